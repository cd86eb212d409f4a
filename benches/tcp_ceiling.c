// The raw TCP ceiling for scripts/bench_tcp.py: what plain sockets move on the same link, no library.
//
//   tcp_ceiling server IP PORT            serve until killed
//   tcp_ceiling client IP PORT ITERS      print one JSON line: 64 MiB pulled over 1 and over 4 connections
//                                         (GB/s, median of ITERS) and a 4 KiB ping-pong round trip (µs)
//   tcp_ceiling ping IP PORT SECS         print one JSON line: 4 KiB ping-pong round trips (µs) for SECS, one
//                                         every millisecond (the round trip under whatever else runs then)
//
// Protocol: a connection sends 'B' and little-endian u64s n and off, answered with the n bytes at off of the
// server's 64 MiB buffer; or 'P' followed by 4096-byte pings, each echoed. Large reads go straight into one
// 64 MiB buffer, as a transfer library would, and each connection of a pull moves its own quarter of the
// server's buffer, so 64 MiB of distinct memory is read on one side and written on the other, as in the
// library's READ (sending one 16 MiB quarter four times would leave it in the server's cache).
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BULK (64u << 20)
#define PING 4096
#define TRIPS 2000

static char *blob;

static void die(const char *what) {
    perror(what);
    exit(1);
}

static int full(int fd, void *p, size_t n, int rd) {
    char *c = p;
    while (n) {
        ssize_t k = rd ? recv(fd, c, n, 0) : send(fd, c, n, MSG_NOSIGNAL);
        if (k <= 0) return -1;
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

static void *serve(void *arg) {
    int fd = (int)(intptr_t)arg, one = 1;
    char kind, ping[PING];
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    while (full(fd, &kind, 1, 1) == 0) {
        if (kind == 'B') {
            uint64_t n, off;
            if (full(fd, &n, 8, 1) || full(fd, &off, 8, 1) || n > BULK || off > BULK - n || full(fd, blob + off, n, 0))
                break;
        } else {
            while (full(fd, ping, PING, 1) == 0 && full(fd, ping, PING, 0) == 0) {
            }
            break;
        }
    }
    close(fd);
    return NULL;
}

static int dial(const char *ip, int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, ip, &a.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) die("connect");
    return fd;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

struct pull {
    int fd;
    char *dst;
    uint64_t n;
};

static void *pull(void *arg) {
    struct pull *p = arg;
    char req[17] = {'B'};
    uint64_t off = (uint64_t)(p->dst - blob);
    memcpy(req + 1, &p->n, 8);
    memcpy(req + 9, &off, 8);
    if (full(p->fd, req, 17, 0) || full(p->fd, p->dst, p->n, 1)) die("pull");
    return NULL;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: tcp_ceiling server IP PORT | client IP PORT ITERS | ping IP PORT SECS\n");
        return 2;
    }
    int port = atoi(argv[3]);
    blob = calloc(1, BULK);
    if (!blob) die("calloc");
    // Real pages on both sides, as a library's registered memory is: untouched, the server would send from the
    // kernel's one shared zero page, always in cache.
    memset(blob, 0x5a, BULK);
    if (!strcmp(argv[1], "server")) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        inet_pton(AF_INET, argv[2], &a.sin_addr);
        int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 64)) die("listen");
        printf("@ready\n");
        fflush(stdout);
        for (;;) {
            int fd = accept(ls, NULL, NULL);
            if (fd < 0) continue;
            pthread_t t;
            pthread_create(&t, NULL, serve, (void *)(intptr_t)fd);
            pthread_detach(t);
        }
    }
    if (!strcmp(argv[1], "ping")) {
        double secs = argc > 4 ? atof(argv[4]) : 1, t_end = now() + secs;
        int fd = dial(argv[2], port), one = 1, n = 0, cap = (int)(secs * 1000) + 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        double *rt = calloc((size_t)cap, sizeof *rt);
        char ping[PING] = {0};
        if (!rt || full(fd, "P", 1, 0)) die("ping");
        while (n < cap && now() < t_end) {
            double t0 = now();
            if (full(fd, ping, PING, 0) || full(fd, ping, PING, 1)) die("ping");
            rt[n++] = (now() - t0) * 1e6;
            usleep(1000);
        }
        qsort(rt, (size_t)n, sizeof *rt, cmp);
        printf("{\"trips\": %d, \"rtt_median_us\": %.1f, \"rtt_p99_us\": %.1f}\n", n, rt[n / 2], rt[n * 99 / 100]);
        return 0;
    }
    int iters = argc > 4 ? atoi(argv[4]) : 10;
    if (iters < 1) iters = 1;
    double *r = calloc((size_t)iters, sizeof *r), med[2];
    for (int s = 0; s < 2; s++) {
        int streams = s ? 4 : 1;
        struct pull p[4];
        for (int i = 0; i < streams; i++) p[i] = (struct pull){dial(argv[2], port), blob + i * (BULK / streams), BULK / streams};
        for (int it = 0; it < iters; it++) {
            pthread_t t[4];
            double t0 = now();
            for (int i = 0; i < streams; i++) pthread_create(&t[i], NULL, pull, &p[i]);
            for (int i = 0; i < streams; i++) pthread_join(t[i], NULL);
            r[it] = BULK / (now() - t0) / 1e9;
        }
        qsort(r, (size_t)iters, sizeof *r, cmp);
        med[s] = r[iters / 2];
        for (int i = 0; i < streams; i++) close(p[i].fd);
    }
    int fd = dial(argv[2], port), one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    static double rtt[TRIPS];
    char ping[PING] = {0};
    if (full(fd, "P", 1, 0)) die("ping");
    for (int i = 0; i < TRIPS; i++) {
        double t0 = now();
        if (full(fd, ping, PING, 0) || full(fd, ping, PING, 1)) die("ping");
        rtt[i] = (now() - t0) * 1e6;
    }
    qsort(rtt, TRIPS, sizeof *rtt, cmp);
    printf("{\"bulk_1_gbps\": %.3f, \"bulk_4_gbps\": %.3f, \"rtt_median_us\": %.1f, \"rtt_p99_us\": %.1f}\n", med[0], med[1],
           rtt[TRIPS / 2], rtt[TRIPS * 99 / 100]);
    return 0;
}
