// What userfaultfd write-protection costs per page, in the ways a snapshot could use it: the
// instrument behind docs/measurements/2026-12-06-snapshot.md's section "What a write log would
// cost". Not part of the build.
//
//   cc -O2 -pthread -o uffd-costs docs/measurements/uffd-costs.c && ./uffd-costs [MiB] [pages]
//
// Over MiB of populated anonymous memory (default 1024) with `pages` random pages written
// (default 10000), five rounds each, medians printed:
//   scan    PAGEMAP_SCAN with PM_SCAN_WP_MATCHING over the whole range (the tracker's collect)
//   async   a first write to a write-protected page, UFFD_FEATURE_WP_ASYNC (the kernel resolves it)
//   wp1     UFFDIO_WRITEPROTECT of one page (re-arming a page a write log reported)
//   unwp1   UFFDIO_WRITEPROTECT mode 0 of one page (what a handler does to let a write go on)
//   sync    a first write to a write-protected page without WP_ASYNC: the writer stops until a
//           handler thread reads the fault, logs the page and lifts the protection (a write log)
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

// The 6.7 uapi, for older headers (values in ../shared/notes/measured.md).
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)
#endif
#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC (1 << 15)
#endif
struct scan_region { uint64_t start, end, categories; };
struct scan_arg {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages, category_inverted, category_mask,
        category_anyof_mask, return_mask;
};
#define SCAN _IOWR('f', 16, struct scan_arg)
#define WP_MATCHING (1 << 0)
#define CHECK_WPASYNC (1 << 1)
#define IS_WRITTEN (1 << 1)

static size_t page;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, n, sizeof *v, cmp);
    return v[n / 2];
}

static int uffd_open(uint64_t features, char *base, size_t len) {
    int fd = syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
    if (fd < 0) die("userfaultfd");
    struct uffdio_api api = {.api = UFFD_API, .features = features};
    if (ioctl(fd, UFFDIO_API, &api)) die("UFFDIO_API");
    struct uffdio_register reg = {.range = {(uintptr_t)base, len}, .mode = UFFDIO_REGISTER_MODE_WP};
    if (ioctl(fd, UFFDIO_REGISTER, &reg)) die("UFFDIO_REGISTER");
    return fd;
}

static void protect(int fd, char *at, size_t len, int on) {
    struct uffdio_writeprotect wp = {.range = {(uintptr_t)at, len}, .mode = on ? UFFDIO_WRITEPROTECT_MODE_WP : 0};
    if (ioctl(fd, UFFDIO_WRITEPROTECT, &wp)) die("UFFDIO_WRITEPROTECT");
}

// The sync handler: reads faults, counts them (the log), lifts the page's protection.
struct handler { int fd; volatile int stop; long handled; };

static void *handle(void *arg) {
    struct handler *h = arg;
    struct pollfd p = {.fd = h->fd, .events = POLLIN};
    while (!h->stop) {
        if (poll(&p, 1, 10) <= 0) continue;
        struct uffd_msg m;
        while (read(h->fd, &m, sizeof m) == sizeof m) {
            if (m.event != UFFD_EVENT_PAGEFAULT) continue;
            char *at = (char *)(uintptr_t)(m.arg.pagefault.address & ~(uint64_t)(page - 1));
            protect(h->fd, at, page, 0);
            h->handled++;
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    page = sysconf(_SC_PAGESIZE);
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 1024, n = argc > 2 ? strtoul(argv[2], 0, 10) : 10000;
    size_t len = mib << 20, pages = len / page;
    if (n == 0 || n > pages) n = pages / 100;
    enum { ROUNDS = 5 };
    double scan[ROUNDS], async[ROUNDS], wp1[ROUNDS], unwp1[ROUNDS], sync_[ROUNDS];
    size_t *pick = malloc(n * sizeof *pick);
    srand(1);

    char *a = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    char *b = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (a == MAP_FAILED || b == MAP_FAILED) die("mmap");
    madvise(a, len, MADV_NOHUGEPAGE);
    madvise(b, len, MADV_NOHUGEPAGE);
    memset(a, 1, len);
    memset(b, 1, len);
    int fa = uffd_open(UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED, a, len);
    int fb = uffd_open(0, b, len);
    struct handler h = {.fd = fb};
    pthread_t t;
    pthread_create(&t, 0, handle, &h);
    struct scan_region *vec = malloc(pages * sizeof *vec);
    int pagemap = open("/proc/self/pagemap", O_RDONLY);
    if (pagemap < 0) die("/proc/self/pagemap");

    for (int r = 0; r < ROUNDS; r++) {
        for (size_t i = 0; i < n; i++) pick[i] = (size_t)rand() % pages;
        // async: protect all, write the picked pages, then the scan that reports and re-arms them.
        protect(fa, a, len, 1);
        double t0 = now_us();
        for (size_t i = 0; i < n; i++) a[pick[i] * page] += 1;
        async[r] = (now_us() - t0) * 1e3 / n;
        struct scan_arg s = {.size = sizeof s, .flags = WP_MATCHING | CHECK_WPASYNC, .start = (uintptr_t)a,
                             .end = (uintptr_t)a + len, .vec = (uintptr_t)vec, .vec_len = pages,
                             .category_mask = IS_WRITTEN, .return_mask = IS_WRITTEN};
        t0 = now_us();
        if (ioctl(pagemap, SCAN, &s) < 0) die("PAGEMAP_SCAN");
        scan[r] = (now_us() - t0) * 1e3 / pages;
        // wp1 / unwp1: one ioctl a picked page.
        t0 = now_us();
        for (size_t i = 0; i < n; i++) protect(fa, a + pick[i] * page, page, 0);
        unwp1[r] = (now_us() - t0) * 1e3 / n;
        t0 = now_us();
        for (size_t i = 0; i < n; i++) protect(fa, a + pick[i] * page, page, 1);
        wp1[r] = (now_us() - t0) * 1e3 / n;
        // sync: protect all, write the picked pages (each write waits for the handler).
        protect(fb, b, len, 1);
        long before = h.handled;
        t0 = now_us();
        for (size_t i = 0; i < n; i++) b[pick[i] * page] += 1;
        sync_[r] = (now_us() - t0) * 1e3 / n;
        if (h.handled - before < (long)(n * 9 / 10)) fprintf(stderr, "sync: only %ld faults handled\n", h.handled - before);
    }
    h.stop = 1;
    pthread_join(t, 0);
    printf("%zu MiB populated (%zu pages), %zu random pages written a round, %d rounds, medians:\n", mib, pages, n,
           ROUNDS);
    printf("  scan   PAGEMAP_SCAN (WP_MATCHING) of the range   %8.2f ns a present page\n", median(scan, ROUNDS));
    printf("  async  first write, WP_ASYNC                     %8.0f ns a page\n", median(async, ROUNDS));
    printf("  wp1    UFFDIO_WRITEPROTECT of one page           %8.0f ns a page\n", median(wp1, ROUNDS));
    printf("  unwp1  UFFDIO_WRITEPROTECT mode 0 of one page    %8.0f ns a page\n", median(unwp1, ROUNDS));
    printf("  sync   first write, handler thread (a write log) %8.0f ns a page\n", median(sync_, ROUNDS));
    return 0;
}
