/* A fake libcufile for tests/gds_cufile.rs: the cuFile entry points gixl calls, over pread/pwrite, with the
 * "device pointer" taken as host memory (gixl's fake device keeps device memory in host memory). Every call
 * is counted; gixl_fake_cufile_counts() hands the counters to the test, which opens this library by the same
 * path. Declarations written from cufile.h's documented ABI (CUfileError_t, CUfileDescr_t, the signatures).
 *
 * GIXL_FAKE_CUFILE chooses a misbehaviour (read at cuFileDriverOpen):
 *   open-fails    cuFileDriverOpen returns CU_FILE_DRIVER_NOT_INITIALIZED
 *   bufreg-fails  cuFileBufRegister returns CU_FILE_INTERNAL_BUF_REGISTER_ERROR
 *   corrupt       cuFileRead flips the first byte it read
 * gixl_fake_cufile_delay(fd, us): each cuFileRead/cuFileWrite on fd sleeps us microseconds first (the
 * deregistration race). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

typedef struct {
    int err;
    int cu_err;
} CUfileError_t;

typedef struct {
    int type;
    union {
        int fd;
        void *handle;
    } handle;
    const void *fs_ops;
} CUfileDescr_t;

enum { C_OPEN, C_CLOSE, C_HREG, C_HDEREG, C_BREG, C_BDEREG, C_READ, C_WRITE, C_RBYTES, C_WBYTES,
       C_UNREG_IO, C_BAD, C_N };
static uint64_t counts[C_N];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int mode_open_fails, mode_bufreg_fails, mode_corrupt, opened;
static int delay_fd = -1;
static long delay_us;

void gixl_fake_cufile_delay(int fd, long us) {
    __atomic_store_n(&delay_us, us, __ATOMIC_RELAXED);
    __atomic_store_n(&delay_fd, fd, __ATOMIC_RELAXED);
}

#define MAXBUF 4096
static struct { uintptr_t base; size_t len; } bufs[MAXBUF];

struct handle { int fd; };

static void count(int c, uint64_t n) { __atomic_fetch_add(&counts[c], n, __ATOMIC_RELAXED); }

void gixl_fake_cufile_counts(uint64_t *out, size_t n) {
    for (size_t i = 0; i < n && i < C_N; i++) out[i] = __atomic_load_n(&counts[i], __ATOMIC_RELAXED);
}

/* Registered buffers now (the test checks that deregistration released them all). */
size_t gixl_fake_cufile_live_bufs(void) {
    size_t n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAXBUF; i++) n += bufs[i].base != 0;
    pthread_mutex_unlock(&lock);
    return n;
}

CUfileError_t cuFileDriverOpen(void) {
    const char *m = getenv("GIXL_FAKE_CUFILE");
    mode_open_fails = m && !strcmp(m, "open-fails");
    mode_bufreg_fails = m && !strcmp(m, "bufreg-fails");
    mode_corrupt = m && !strcmp(m, "corrupt");
    count(C_OPEN, 1);
    if (mode_open_fails) return (CUfileError_t){5001, 0};
    opened = 1;
    return (CUfileError_t){0, 0};
}

CUfileError_t cuFileDriverClose_v2(void) {
    count(C_CLOSE, 1);
    opened = 0;
    return (CUfileError_t){0, 0};
}

CUfileError_t cuFileHandleRegister(void **fh, CUfileDescr_t *d) {
    count(C_HREG, 1);
    if (!opened) return (CUfileError_t){5001, 0};
    if (!fh || !d || d->type != 1 || d->fs_ops != NULL || fcntl(d->handle.fd, F_GETFD) < 0) {
        count(C_BAD, 1);
        return (CUfileError_t){5022, 0};
    }
    struct handle *h = malloc(sizeof *h);
    h->fd = d->handle.fd;
    *fh = h;
    return (CUfileError_t){0, 0};
}

void cuFileHandleDeregister(void *fh) {
    count(C_HDEREG, 1);
    free(fh);
}

CUfileError_t cuFileBufRegister(const void *base, size_t len, int flags) {
    (void)flags;
    count(C_BREG, 1);
    if (mode_bufreg_fails) return (CUfileError_t){5045, 0};
    CUfileError_t r = {5037, 0};
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAXBUF; i++)
        if (bufs[i].base == (uintptr_t)base) {
            pthread_mutex_unlock(&lock);
            return (CUfileError_t){5023, 0};
        }
    for (int i = 0; i < MAXBUF; i++)
        if (!bufs[i].base) {
            bufs[i].base = (uintptr_t)base;
            bufs[i].len = len;
            r.err = 0;
            break;
        }
    pthread_mutex_unlock(&lock);
    return r;
}

CUfileError_t cuFileBufDeregister(const void *base) {
    count(C_BDEREG, 1);
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAXBUF; i++)
        if (bufs[i].base == (uintptr_t)base) {
            bufs[i].base = 0;
            pthread_mutex_unlock(&lock);
            return (CUfileError_t){0, 0};
        }
    pthread_mutex_unlock(&lock);
    count(C_BAD, 1);
    return (CUfileError_t){5024, 0};
}

/* Whether [base + off, + len) lies in a registered buffer whose base is `base`. */
static int registered(const void *base, off_t off, size_t len) {
    int ok = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAXBUF; i++)
        if (bufs[i].base == (uintptr_t)base && (size_t)off + len <= bufs[i].len) ok = 1;
    pthread_mutex_unlock(&lock);
    return ok;
}

static ssize_t io(int rd, void *fh, char *base, size_t size, off_t foff, off_t boff) {
    if (!fh || boff < 0 || foff < 0) {
        count(C_BAD, 1);
        return -5022;
    }
    if (!registered(base, boff, size)) count(C_UNREG_IO, 1);
    int fd = ((struct handle *)fh)->fd;
    if (fd == __atomic_load_n(&delay_fd, __ATOMIC_RELAXED)) usleep(__atomic_load_n(&delay_us, __ATOMIC_RELAXED));
    size_t done = 0;
    while (done < size) {
        ssize_t n = rd ? pread(fd, base + boff + done, size - done, foff + done)
                       : pwrite(fd, base + boff + done, size - done, foff + done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1; /* errno set, as cuFile does for file system errors */
        if (n == 0) break;
        done += n;
    }
    if (rd && mode_corrupt && done > 0) base[boff] ^= 0x5a;
    count(rd ? C_READ : C_WRITE, 1);
    count(rd ? C_RBYTES : C_WBYTES, done);
    return done;
}

ssize_t cuFileRead(void *fh, void *base, size_t size, off_t foff, off_t boff) {
    return io(1, fh, base, size, foff, boff);
}

ssize_t cuFileWrite(void *fh, const void *base, size_t size, off_t foff, off_t boff) {
    return io(0, fh, (char *)base, size, foff, boff);
}
