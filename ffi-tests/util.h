/*
 * util.h - helpers shared by the C-API tests (agents with UCX, buffers,
 * polling loops).  Everything is static so each test is one translation unit.
 */
#ifndef GIXL_FFI_UTIL_H
#define GIXL_FFI_UTIL_H

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <poll.h>
#include <sys/personality.h>
#include <sys/types.h>
#include <unistd.h>

#include "check.h"

/* How long the polling helpers wait before giving up. */
#define FT_TIMEOUT_MS 20000

static inline uint64_t ft_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static inline void ft_sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* A byte pattern that depends on the position and a seed. */
static inline unsigned char ft_pattern(size_t i, unsigned seed)
{
    return (unsigned char)((i * 131u + seed * 29u + (i >> 8)) & 0xffu);
}

static inline void ft_fill(void *buf, size_t len, unsigned seed)
{
    unsigned char *p = buf;
    for (size_t i = 0; i < len; i++)
        p[i] = ft_pattern(i, seed);
}

/* Returns the index of the first mismatching byte, or -1 when all match. */
static inline long ft_verify(const void *buf, size_t len, unsigned seed)
{
    const unsigned char *p = buf;
    for (size_t i = 0; i < len; i++)
        if (p[i] != ft_pattern(i, seed))
            return (long)i;
    return -1;
}

/* Create an agent (default config) plus a UCX backend with default params. */
static inline int ft_make_agent(const char *name, nixl_capi_agent_t *agent,
                                nixl_capi_backend_t *backend)
{
    nixl_capi_mem_list_t mems = NULL;
    nixl_capi_params_t params = NULL;
    int s = nixl_capi_create_agent(name, agent);
    if (s)
        return s;
    s = nixl_capi_get_plugin_params(*agent, "UCX", &mems, &params);
    if (s)
        return s;
    s = nixl_capi_create_backend(*agent, "UCX", params, backend);
    nixl_capi_destroy_mem_list(mems);
    nixl_capi_destroy_params(params);
    return s;
}

static inline nixl_capi_reg_dlist_t ft_reg_list(void *buf, size_t len)
{
    nixl_capi_reg_dlist_t d = NULL;
    if (nixl_capi_create_reg_dlist(NIXL_CAPI_MEM_DRAM, &d) != 0)
        return NULL;
    if (buf && nixl_capi_reg_dlist_add_desc(d, (uintptr_t)buf, len, 0, NULL, 0) != 0) {
        nixl_capi_destroy_reg_dlist(d);
        return NULL;
    }
    return d;
}

static inline nixl_capi_xfer_dlist_t ft_xfer_list(void *buf, size_t len)
{
    nixl_capi_xfer_dlist_t d = NULL;
    if (nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, &d) != 0)
        return NULL;
    if (buf && nixl_capi_xfer_dlist_add_desc(d, (uintptr_t)buf, len, 0) != 0) {
        nixl_capi_destroy_xfer_dlist(d);
        return NULL;
    }
    return d;
}

/* Register one DRAM buffer; returns the status of register_mem. */
static inline int ft_register(nixl_capi_agent_t agent, void *buf, size_t len)
{
    nixl_capi_reg_dlist_t d = ft_reg_list(buf, len);
    if (!d)
        return -100;
    int s = nixl_capi_register_mem(agent, d, NULL);
    nixl_capi_destroy_reg_dlist(d);
    return s;
}

static inline int ft_deregister(nixl_capi_agent_t agent, void *buf, size_t len)
{
    nixl_capi_reg_dlist_t d = ft_reg_list(buf, len);
    if (!d)
        return -100;
    int s = nixl_capi_deregister_mem(agent, d, NULL);
    nixl_capi_destroy_reg_dlist(d);
    return s;
}

/*
 * Load `from`'s full metadata into `into`.  On success the loaded agent name
 * is copied into name_out (if given).  Returns the load_remote_md status.
 */
static inline int ft_exchange_md(nixl_capi_agent_t from, nixl_capi_agent_t into,
                                 char *name_out, size_t name_cap)
{
    void *md = NULL;
    size_t len = 0;
    char *name = NULL;
    int s = nixl_capi_get_local_md(from, &md, &len);
    if (s)
        return s;
    s = nixl_capi_load_remote_md(into, md, len, &name);
    free(md);
    if (s == 0 && name_out && name_cap) {
        snprintf(name_out, name_cap, "%s", name);
    }
    free(name);
    return s;
}

/* Poll an xfer request until it leaves IN_PROG; returns the last status. */
static inline int ft_wait_xfer(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req, int first)
{
    int s = first;
    uint64_t end = ft_now_ms() + FT_TIMEOUT_MS;
    while (s == NIXL_CAPI_IN_PROG && ft_now_ms() < end) {
        ft_sleep_us(200);
        s = nixl_capi_get_xfer_status(agent, req);
    }
    return s;
}

/*
 * Poll get_notifs on `agent` (appending into `map`) until `from` has at
 * least `want` notifications.  Returns true on success.
 */
static inline bool ft_wait_notifs(nixl_capi_agent_t agent, nixl_capi_notif_map_t map,
                                  const char *from, size_t want)
{
    uint64_t end = ft_now_ms() + FT_TIMEOUT_MS;
    for (;;) {
        size_t n = 0;
        if (nixl_capi_get_notifs(agent, map, NULL) != 0)
            return false;
        if (nixl_capi_notif_map_get_notifs_size(map, from, &n) == 0 && n >= want)
            return true;
        if (ft_now_ms() >= end)
            return false;
        ft_sleep_us(500);
    }
}

/* True when notification #idx from `from` equals (data, len). */
static inline bool ft_notif_equals(nixl_capi_notif_map_t map, const char *from, size_t idx,
                                   const void *data, size_t len)
{
    const void *got = NULL;
    size_t got_len = 0;
    if (nixl_capi_notif_map_get_notif(map, from, idx, &got, &got_len) != 0)
        return false;
    if (got_len != len)
        return false;
    return len == 0 || memcmp(got, data, len) == 0;
}

/* ---------- a peer process driven over a pipe (t_two_process, t_exact) ---------- */

/* The fds a re-executed peer reads commands from and writes replies to. */
#define FT_PEER_R 200
#define FT_PEER_W 201

/* Move all n bytes through fd, retrying on EINTR; a read first waits up to
 * timeout_ms for data.  False on error, end of file or timeout. */
static inline bool ft_pipe_io(int fd, unsigned char *c, size_t n, bool reading, int timeout_ms)
{
    while (n) {
        if (reading) {
            struct pollfd pfd = {fd, POLLIN, 0};
            int pr = poll(&pfd, 1, timeout_ms);
            if (pr < 0 && errno == EINTR)
                continue;
            if (pr <= 0)
                return false;
        }
        ssize_t r = reading ? read(fd, c, n) : write(fd, c, n);
        if (r <= 0) {
            if (r < 0 && errno == EINTR)
                continue;
            return false;
        }
        c += r;
        n -= (size_t)r;
    }
    return true;
}

static inline bool ft_read_full(int fd, void *p, size_t n, int timeout_ms)
{
    return ft_pipe_io(fd, p, n, true, timeout_ms);
}

static inline bool ft_write_full(int fd, const void *p, size_t n)
{
    return ft_pipe_io(fd, (unsigned char *)p, n, false, 0);
}

/*
 * Fork and re-execute this binary as /proc/self/exe with argv, its stdin-side
 * pipe on FT_PEER_R and its reply pipe on FT_PEER_W, every other fd above 2
 * closed; with aslr_off, address randomisation is off in the child (kept
 * across its exec).  Sets *to (commands to the peer) and *from (its replies);
 * returns the pid, or -1.
 */
static inline pid_t ft_spawn_self(char *const argv[], bool aslr_off, int *to, int *from)
{
    int d2p[2], p2d[2];
    if (pipe2(d2p, O_CLOEXEC) || pipe2(p2d, O_CLOEXEC))
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        /* Only async-signal-safe calls until exec: this process has threads. */
        if (dup2(d2p[0], FT_PEER_R) < 0 || dup2(p2d[1], FT_PEER_W) < 0)
            _exit(120);
        close_range(3, FT_PEER_R - 1, 0);
        close_range(FT_PEER_W + 1, ~0u, 0);
        /* setarch -R: ASLR off, kept across this exec and the peer's own. */
        if (aslr_off && personality(ADDR_NO_RANDOMIZE) == -1)
            _exit(122);
        execv("/proc/self/exe", argv);
        _exit(121);
    }
    close(d2p[0]);
    close(p2d[1]);
    *to = d2p[1];
    *from = p2d[0];
    return pid;
}

#endif /* GIXL_FFI_UTIL_H */
