/* The box's process_vm_readv ceiling: 64 MiB read from another process by T threads (each its 1/T share
 * in one call of 1 MiB iovecs), median GB/s of N repetitions. This is the bound for a same-host bulk
 * transfer through CMA; benches/side_by_side.py compiles and runs it next to its bulk figures.
 *
 *   cc -O2 -pthread benches/cma_ceiling.c -o /tmp/cma_ceiling && /tmp/cma_ceiling [threads] [reps]
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

int main(int argc, char **argv)
{
    threads = argc > 1 ? atoi(argv[1]) : 2;
    int reps = argc > 2 ? atoi(argv[2]) : 20;
    if (threads < 1 || threads > 64 || reps < 1)
        return 2;
    src = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    dst = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memset(src, 7, BYTES);
    memset(dst, 0, BYTES);
    int ready[2];
    if (pipe(ready))
        return 1;
    child = fork();
    if (child == 0) { /* same address space layout: src is at the same address in the child */
        char c = 1;
        if (write(ready[1], &c, 1) != 1)
            _exit(1);
        pause();
        _exit(0);
    }
    char c;
    if (read(ready[0], &c, 1) != 1)
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
