/* The box's process_vm_readv ceiling: 64 MiB read from another process by T threads (each its 1/T share
 * in one call of 1 MiB iovecs), median GB/s of N repetitions. This is the bound for a same-host bulk
 * transfer through CMA; benches/side_by_side.py compiles and runs it next to its bulk figures.
 *
 *   cc -O2 -pthread benches/cma_ceiling.c -o /tmp/cma_ceiling && /tmp/cma_ceiling [threads] [reps]
 *
 * With `--small BYTES ITERS [PID ADDR]` it measures the other end instead: the median time of one
 * process_vm_readv of BYTES bytes (one iovec) from another process, repeated ITERS times: the floor under any
 * same-host small READ that moves data through CMA. Given PID and ADDR it reads from that process at that
 * address (benches/side_by_side.py points it at the very target buffer its 4 KiB READs use); otherwise from
 * a forked child.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BYTES (64ul << 20)
#define PIECE (1ul << 20)

static pid_t child;
static char *src, *dst;
static int threads;

static void *reader(void *arg)
{
    long t = (long)arg;
    size_t share = BYTES / threads, off = t * share, n = share / PIECE;
    struct iovec *l = calloc(n, sizeof *l), *r = calloc(n, sizeof *r);
    for (size_t i = 0; i < n; i++) {
        l[i] = (struct iovec){dst + off + i * PIECE, PIECE};
        r[i] = (struct iovec){src + off + i * PIECE, PIECE};
    }
    size_t done = 0;
    while (done < n) { /* at most IOV_MAX (1024) per call */
        size_t k = n - done > 1024 ? 1024 : n - done;
        if (process_vm_readv(child, l + done, k, r + done, k, 0) < 0) {
            perror("process_vm_readv");
            exit(1);
        }
        done += k;
    }
    free(l);
    free(r);
    return NULL;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Fork `child`, a copy of this process that only waits (same address space layout: a buffer is at the same
 * address there), and return once it runs; nonzero on failure. */
static int fork_reader_target(void)
{
    int ready[2];
    if (pipe(ready))
        return 1;
    child = fork();
    if (child == 0) {
        char c = 1;
        if (write(ready[1], &c, 1) != 1)
            _exit(1);
        pause();
        _exit(0);
    }
    char c;
    return read(ready[0], &c, 1) != 1;
}

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int small(size_t bytes, int iters, pid_t from, unsigned long addr)
{
    if (bytes < 1 || bytes > BYTES || iters < 1)
        return 2;
    char *s = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *d = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (s == MAP_FAILED || d == MAP_FAILED)
        return 1;
    memset(s, 7, bytes);
    memset(d, 0, bytes);
    if (from > 0) {
        child = from;
        s = (char *)addr;
    } else {
        if (fork_reader_target())
            return 1;
        memset(s, 0, bytes); /* the parent's copy differs; the child keeps the 7s */
    }
    double *us = calloc(iters, sizeof *us);
    struct iovec l = {d, bytes}, r = {s, bytes};
    for (int i = 0; i < iters + 1000; i++) { /* the first 1000 warm up */
        double a = now_us();
        if (process_vm_readv(child, &l, 1, &r, 1, 0) != (ssize_t)bytes) {
            perror("process_vm_readv");
            return 1;
        }
        if (i >= 1000)
            us[i - 1000] = now_us() - a;
    }
    if (from <= 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        if (d[0] != 7 || d[bytes - 1] != 7) {
            fprintf(stderr, "data did not arrive\n");
            return 1;
        }
    }
    qsort(us, iters, sizeof *us, cmp);
    printf("{\"bytes\": %zu, \"iters\": %d, \"median_us\": %.3f, \"p10_us\": %.3f}\n", bytes, iters, us[iters / 2],
           us[iters / 10]);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--small") == 0)
        return small(argc > 2 ? strtoul(argv[2], NULL, 0) : 4096, argc > 3 ? atoi(argv[3]) : 20000,
                     argc > 5 ? atoi(argv[4]) : 0, argc > 5 ? strtoul(argv[5], NULL, 0) : 0);
    threads = argc > 1 ? atoi(argv[1]) : 2;
    int reps = argc > 2 ? atoi(argv[2]) : 20;
    if (threads < 1 || threads > 64 || reps < 1)
        return 2;
    src = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    dst = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memset(src, 7, BYTES);
    memset(dst, 0, BYTES);
    if (fork_reader_target())
        return 1;
    memset(src, 0, BYTES); /* the parent's copy differs; the child keeps the 7s */
    double *gbps = calloc(reps + 2, sizeof *gbps);
    for (int i = 0; i < reps + 2; i++) {
        pthread_t th[64];
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (long t = 0; t < threads; t++)
            pthread_create(&th[t], NULL, reader, (void *)t);
        for (int t = 0; t < threads; t++)
            pthread_join(th[t], NULL);
        clock_gettime(CLOCK_MONOTONIC, &b);
        double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
        gbps[i] = BYTES / s / 1e9;
    }
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    if (dst[0] != 7 || dst[BYTES - 1] != 7) {
        fprintf(stderr, "data did not arrive\n");
        return 1;
    }
    qsort(gbps + 2, reps, sizeof *gbps, cmp); /* two warm-ups dropped */
    printf("{\"threads\": %d, \"reps\": %d, \"median_gbps\": %.3f, \"max_gbps\": %.3f}\n", threads, reps,
           gbps[2 + reps / 2], gbps[2 + reps - 1]);
    return 0;
}
