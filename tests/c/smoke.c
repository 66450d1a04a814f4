/* emuhost from C: a window at a fixed base, commit, arm, writes from two threads, the program's
 * own fault handler handing faults to emuhost_handle_fault (emuhost installs none), a collect
 * into the program's own words (0 lost), a snapshot taken and restored by bytes, a pool imported
 * on a VkDevice the program made itself and read back through the GPU, a 20 us sleep through the
 * short-sleep call, the backend and the rule's reason; and misuse caught as errors. Built and run against the shared and the static library by
 * crates/emuhost-capi/tests/it/programs.rs (Linux), and cross-built with mingw against
 * emuhost_capi.dll and run under Wine by `.ci/windows capi`. Compiled with -DSMOKE_NO_VULKAN where
 * there are no Vulkan headers; without a device the Vulkan part is skipped unless
 * EMUHOST_REQUIRE_VULKAN=1.
 *
 * Windows (_WIN32) has the same steps with its own calls: the fault handler is a vectored
 * exception handler (a write is ExceptionInformation[0] == 1 at ExceptionInformation[1]), the
 * threads are CreateThread's, the kernel's write into armed memory is a ReadFile from an anonymous
 * pipe (ERROR_NOACCESS where the guard backend has the pages read-only), the program's own
 * protection change is VirtualProtect, the clock QueryPerformanceCounter. */
#include "emuhost.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _WIN32
#include <windows.h>
#else
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#endif

#ifndef SMOKE_NO_VULKAN
#include "vkdev.h"
#endif

#define BASE ((void *)(uintptr_t)0x200000000000ull) /* 32 TiB: free in a 47-bit address space */
#define MIB (1ull << 20)
#define WINDOW (64 * MIB)
#define ARMED (4 * MIB)
#define WRITTEN 256 /* pages, half from each thread */

static void die(const char *what, emuhost_error_t *e) {
    char msg[1024];
    emuhost_error_message(e, msg, sizeof msg);
    fprintf(stderr, "smoke: %s: error %u: %s\n", what, emuhost_error_code(e), msg);
    emuhost_error_delete(e);
    exit(1);
}

#define CHECK(call)                            \
    do {                                       \
        emuhost_error_t *e_ = (call);          \
        if (e_) die(#call, e_);                \
    } while (0)

/* A call that must fail with `code`. */
static void expect(const char *what, emuhost_error_t *e, uint32_t code) {
    if (!e) {
        fprintf(stderr, "smoke: %s succeeded; expected error %u\n", what, code);
        exit(1);
    }
    if (emuhost_error_code(e) != code) die(what, e);
    char msg[256];
    emuhost_error_message(e, msg, sizeof msg);
    printf("misuse caught: %s: %s\n", what, msg);
    emuhost_error_delete(e);
}

static int log_lines;
static int faults_handed; /* faults emuhost_handle_fault said were emuhost's */

#ifdef _WIN32
/* The program's own vectored exception handler, as an emulator has one: emuhost first (a write
 * to an armed page: retry it), then its own work (here: none, so the search goes on to the next
 * handler, and an unclaimed fault ends the process). */
static LONG CALLBACK on_fault(EXCEPTION_POINTERS *x) {
    const EXCEPTION_RECORD *r = x->ExceptionRecord;
    if (r->ExceptionCode == EXCEPTION_ACCESS_VIOLATION && r->NumberParameters >= 2 &&
        emuhost_handle_fault((uintptr_t)r->ExceptionInformation[1], r->ExceptionInformation[0] == 1)) {
        __atomic_add_fetch(&faults_handed, 1, __ATOMIC_RELAXED);
        return EXCEPTION_CONTINUE_EXECUTION;
    }
    return EXCEPTION_CONTINUE_SEARCH;
}
#else
/* The program's own SIGSEGV handler, as an emulator has one: emuhost first, then its own work
 * (here: none, so the default action, and the fault repeats fatally). */
static void on_segv(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    if (emuhost_handle_fault((uintptr_t)info->si_addr, 1)) {
        __atomic_add_fetch(&faults_handed, 1, __ATOMIC_RELAXED);
        return;
    }
    signal(sig, SIG_DFL);
}
#endif

static void on_log(void *user, uint32_t level, const char *target, const char *message) {
    (void)user;
    __atomic_add_fetch(&log_lines, 1, __ATOMIC_RELAXED);
    fprintf(stderr, "log %u %s: %s\n", level, target, message);
}

struct writer {
    volatile uint8_t *base;
    uint64_t page;
    int parity;
};

static void write_pages(struct writer *w) {
    for (uint64_t i = (uint64_t)w->parity; i < WRITTEN; i += 2) w->base[i * w->page + 8] = (uint8_t)(i + 1);
}

#ifdef _WIN32
typedef HANDLE thread_t;
static DWORD WINAPI thread_main(LPVOID arg) {
    write_pages(arg);
    return 0;
}
static int thread_start(thread_t *t, struct writer *w) {
    *t = CreateThread(NULL, 0, thread_main, w, 0, NULL);
    return *t ? 0 : -1;
}
static void thread_join(thread_t t) {
    WaitForSingleObject(t, INFINITE);
    CloseHandle(t);
}

static double now_us(void) {
    LARGE_INTEGER t, f;
    QueryPerformanceCounter(&t);
    QueryPerformanceFrequency(&f);
    return (double)t.QuadPart * 1e6 / (double)f.QuadPart;
}
#else
typedef pthread_t thread_t;
static void *thread_main(void *arg) {
    write_pages(arg);
    return NULL;
}
static int thread_start(thread_t *t, struct writer *w) { return pthread_create(t, NULL, thread_main, w); }
static void thread_join(thread_t t) { pthread_join(t, NULL); }

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}
#endif

/* `n` bytes of `fill` into a new pipe, then a read by the kernel from it into `at` (read(2); on
 * Windows ReadFile): the bytes read, or -1 with the OS error in `*err` (errno; GetLastError()). */
static long long read_pipe_into(uint8_t *at, size_t n, uint8_t fill, unsigned long *err) {
    static uint8_t data[2 * 65536];
    if (n > sizeof data) exit(1);
    memset(data, fill, n);
    long long got;
#ifdef _WIN32
    HANDLE r, w;
    DWORD wrote, read;
    if (!CreatePipe(&r, &w, NULL, sizeof data)) exit(1);
    if (!WriteFile(w, data, (DWORD)n, &wrote, NULL) || wrote != n) exit(1);
    got = ReadFile(r, at, (DWORD)n, &read, NULL) ? (long long)read : -1;
    *err = got < 0 ? GetLastError() : 0;
    CloseHandle(r);
    CloseHandle(w);
#else
    int fds[2];
    if (pipe(fds) != 0) exit(1);
    if (write(fds[1], data, n) != (ssize_t)n) exit(1);
    got = read(fds[0], at, n);
    *err = got < 0 ? (unsigned long)errno : 0;
    close(fds[0]);
    close(fds[1]);
#endif
    return got;
}

/* The program's own protection change of `len` bytes at `at`: read-only, then read-write. */
static int protect_own(uint8_t *at, size_t len) {
#ifdef _WIN32
    DWORD old;
    return VirtualProtect(at, len, PAGE_READONLY, &old) && VirtualProtect(at, len, PAGE_READWRITE, &old);
#else
    return mprotect(at, len, PROT_READ) == 0 && mprotect(at, len, PROT_READ | PROT_WRITE) == 0;
#endif
}

/* The program's own kernel writes into armed memory (a read(2) from a pipe; on Windows a
 * ReadFile) between emuhost_tracker_host_write_begin and emuhost_host_write_end (with mprotect,
 * EFAULT without them; with guard, ERROR_NOACCESS), collected after; and its own mprotect (on
 * Windows VirtualProtect) in the window marked as a change in flight. */
static void host_write_part(emuhost_space_t *space, emuhost_tracker_t *tracker, uint32_t backend,
                            const emuhost_space_info_t *info) {
    const uint64_t page = info->page_size, at = 300 * page, n = 2 * page;
    uint8_t *host = (uint8_t *)info->host_base + at;
    unsigned long err;
#ifdef _WIN32
    const uint32_t protects = EMUHOST_WATCH_GUARD;
    const unsigned long refused = ERROR_NOACCESS;
#else
    const uint32_t protects = EMUHOST_WATCH_MPROTECT;
    const unsigned long refused = EFAULT;
#endif
    if (backend == protects) {
        long long got = read_pipe_into(host, n, 1, &err);
        if (got != -1 || err != refused) {
            fprintf(stderr, "smoke: a read by the kernel into armed memory returned %lld (OS error %lu), not error %lu\n",
                    got, err, refused);
            exit(1);
        }
        printf("host write: without begin and end, the kernel's write into armed memory fails (OS error %lu)\n", err);
    }
    emuhost_host_write_t *w;
    CHECK(emuhost_tracker_host_write_begin(tracker, at, n, &w));
    long long got = read_pipe_into(host, n, 0x5a, &err);
    CHECK(emuhost_host_write_end(w));
    expect("host write ended twice", emuhost_host_write_end(w), EMUHOST_ERROR_BAD_HANDLE);
    uint64_t words[ARMED / 4096 / 64] = {0};
    emuhost_written_t r;
    CHECK(emuhost_tracker_collect_into(tracker, 0, ARMED, page, words, (size_t)(ARMED / page + 63) / 64, 0, &r));
    int both = ((words[300 / 64] >> (300 % 64)) & 1) && ((words[301 / 64] >> (301 % 64)) & 1);
    printf("host write: read(2) of %lld bytes into armed memory; %llu pages collected%s\n", got,
           (unsigned long long)r.pages, both ? ", its 2 among them" : "");
    if (got != (long long)n || host[0] != 0x5a || host[n - 1] != 0x5a || !both || r.pages != 2) exit(1);

    CHECK(emuhost_space_commit(space, ARMED, page, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE)); /* not armed */
    emuhost_change_t *change;
    CHECK(emuhost_space_change_begin(space, &change));
    uint8_t *own = (uint8_t *)info->host_base + ARMED;
    int changed = protect_own(own, page);
    CHECK(emuhost_change_end(change));
    expect("change ended twice", emuhost_change_end(change), EMUHOST_ERROR_BAD_HANDLE);
    own[0] = 1;
    printf("change: the program's own mprotect marked in flight: %s\n", changed ? "ok" : "failed");
    if (!changed) exit(1);
}

/* A snapshot of 16 pages at `at`: written as the guest writes, taken, written over, restored,
 * and read back equal by bytes; released, after which its id is refused. */
static void snapshot_part(emuhost_space_t *space, emuhost_tracker_t *tracker, emuhost_settings_t *settings,
                          const emuhost_space_info_t *info, uint64_t at) {
    enum { PAGES = 16 };
    const uint64_t len = PAGES * info->page_size;
    static uint8_t taken[PAGES * 65536], over[PAGES * 65536], back[PAGES * 65536];
    if (len > sizeof taken) exit(1);
    CHECK(emuhost_space_commit(space, at, len, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
    emuhost_snapshots_t *snaps;
    CHECK(emuhost_snapshots_new(tracker, at, len, settings, &snaps));
    volatile uint8_t *guest = (volatile uint8_t *)info->host_base + at;
    for (uint64_t i = 0; i < len; i++) guest[i] = (uint8_t)(i * 13 + 7);
    CHECK(emuhost_space_read(space, at, taken, len));
    uint64_t id;
    CHECK(emuhost_snapshots_take(snaps, &id));
    for (uint64_t i = 0; i < len; i += 64) guest[i] = (uint8_t)~guest[i];
    CHECK(emuhost_space_read(space, at, over, len));
    emuhost_restored_t restored;
    CHECK(emuhost_snapshots_restore(snaps, id, &restored));
    CHECK(emuhost_space_read(space, at, back, len));
    if (memcmp(over, taken, len) == 0 || memcmp(back, taken, len) != 0) {
        fprintf(stderr, "smoke: the snapshot's bytes did not come back\n");
        exit(1);
    }
    CHECK(emuhost_snapshots_release(snaps, id));
    expect("restore of a released snapshot", emuhost_snapshots_restore(snaps, id, NULL), EMUHOST_ERROR_INVALID_ARGUMENT);
    emuhost_snapshot_stats_t st;
    CHECK(emuhost_snapshots_stats(snaps, &st));
    printf("snapshot: %llu pages taken, written over and restored (%llu put back): bytes equal\n",
           (unsigned long long)st.pages_copied, (unsigned long long)restored.pages);
    if (st.taken != 1 || st.live != 0) exit(1);
    CHECK(emuhost_snapshots_delete(snaps));
    expect("snapshots deleted twice", emuhost_snapshots_delete(snaps), EMUHOST_ERROR_BAD_HANDLE);
}

#ifndef SMOKE_NO_VULKAN
/* Imports a pool on the program's own device and reads the bound bytes back through the GPU. */
static void vulkan_part(emuhost_space_t *space, emuhost_settings_t *settings, uint8_t *host) {
    struct smoke_vk vk;
    char why[512];
    const char *required = getenv("EMUHOST_REQUIRE_VULKAN");
    if (smoke_vk_open(&vk, why, sizeof why) != 0) {
        if (required && strcmp(required, "1") == 0) {
            fprintf(stderr, "smoke: EMUHOST_REQUIRE_VULKAN=1 and no Vulkan device: %s\n", why);
            exit(1);
        }
        printf("vulkan: skipped: no Vulkan device: %s\n", why);
        return;
    }
    emuhost_vulkan_device_t dev = {
        .get_instance_proc_addr = (emuhost_fn_t)vkGetInstanceProcAddr,
        .instance = vk.instance,
        .physical_device = vk.physical_device,
        .device = vk.device,
        .enabled_extensions = vk.extensions,
        .enabled_extension_count = vk.extension_count,
        .buffer_usage = 0,
    };
    emuhost_importer_t *imp;
    CHECK(emuhost_importer_new_vulkan(space, settings, &dev, &imp));
    const uint64_t pool = 32 * MIB, at = pool + 4096, len = 4096;
    CHECK(emuhost_space_commit(space, pool, MIB, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
    for (uint64_t i = 0; i < len; i++) host[at + i] = (uint8_t)(i * 7 + 3);
    uint64_t id;
    CHECK(emuhost_importer_add_pool(imp, pool, MIB, &id));
    emuhost_binding_t b;
    CHECK(emuhost_importer_bind(imp, at, len, &b));
    if (b.gpu != EMUHOST_GPU_VULKAN || !b.vk_memory || !b.vk_buffer) {
        fprintf(stderr, "smoke: the binding has no Vulkan memory (gpu %u)\n", b.gpu);
        exit(1);
    }
    static uint8_t back[4096];
    if (smoke_vk_read(&vk, b.vk_buffer, b.offset, back, len, why, sizeof why) != 0) {
        fprintf(stderr, "smoke: reading back through the GPU: %s\n", why);
        exit(1);
    }
    if (memcmp(back, host + at, len) != 0) {
        fprintf(stderr, "smoke: the bytes read back through the GPU differ\n");
        exit(1);
    }
    emuhost_import_stats_t st;
    CHECK(emuhost_importer_stats(imp, &st));
    printf("vulkan: %llu bytes read back through the GPU on %s (import %#llx..%#llx, offset %#llx, %llu import)\n",
           (unsigned long long)len, vk.name, (unsigned long long)b.import_lo, (unsigned long long)b.import_hi,
           (unsigned long long)b.offset, (unsigned long long)st.imports);
    CHECK(emuhost_importer_delete(imp)); /* before vkDestroyDevice: the imports go with it */
    smoke_vk_close(&vk);
}
#endif

int main(void) {
    /* The library in use serves this header's version (the loader's SONAME check aside: a static
     * library, or one loaded under another name). */
    if (!EMUHOST_VERSION_CHECK()) {
        fprintf(stderr, "smoke: emuhost %s does not serve the header's %s\n", emuhost_version(), EMUHOST_VERSION_STRING);
        return 1;
    }
    printf("version: header %s, library %u.%u.%u: compatible\n", EMUHOST_VERSION_STRING, emuhost_version_major(),
           emuhost_version_minor(), emuhost_version_patch());
    CHECK(emuhost_set_log_callback(on_log, NULL));
    CHECK(emuhost_set_log_filter(getenv("EMUHOST_LOG"))); /* the environment's, where set */
    emuhost_settings_t *settings; /* the environment's EMUHOST_* switches (EMUHOST_WATCH=mprotect, ...) */
    CHECK(emuhost_settings_from_env(&settings));

    emuhost_space_t *space;
    CHECK(emuhost_space_reserve_at(BASE, WINDOW, 2 * MIB, &space));
    emuhost_space_info_t info;
    CHECK(emuhost_space_info(space, &info));
    if (info.host_base != BASE) {
        fprintf(stderr, "smoke: the window is at %p, not %p\n", info.host_base, BASE);
        return 1;
    }
    const uint64_t page = info.page_size;
    CHECK(emuhost_space_commit(space, 0, ARMED, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));

#ifdef _WIN32
    /* First in the chain. Windows cannot list vectored handlers: that emuhost added none of its
     * own (which it would add first) shows in the count of faults this one was handed below. */
    if (!AddVectoredExceptionHandler(1, on_fault)) return 1;
#else
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, NULL) != 0) return 1;
#endif
    emuhost_tracker_t *tracker;
    CHECK(emuhost_tracker_new(space, settings, EMUHOST_WATCH_AUTO, EMUHOST_TRACKER_EMBEDDER_HANDLES_FAULTS, &tracker));
#ifndef _WIN32
    struct sigaction now;
    sigaction(SIGSEGV, NULL, &now);
    if (now.sa_sigaction != on_segv) {
        fprintf(stderr, "smoke: emuhost replaced the program's SIGSEGV handler\n");
        return 1;
    }
#endif
    uint32_t backend;
    CHECK(emuhost_tracker_backend(tracker, &backend));
    printf("backend: %s\n", emuhost_watch_backend_name(backend));
    CHECK(emuhost_tracker_arm(tracker, 0, ARMED));

    struct writer w[2] = {{info.host_base, page, 0}, {info.host_base, page, 1}};
    thread_t th[2];
    for (int i = 0; i < 2; i++)
        if (thread_start(&th[i], &w[i]) != 0) return 1;
    for (int i = 0; i < 2; i++) thread_join(th[i]);

    /* One bit per page, in the program's own words; a query first (it takes nothing). */
    uint64_t words[ARMED / 4096 / 64] = {0};
    const size_t nwords = (size_t)(ARMED / page + 63) / 64;
    emuhost_written_t got;
    CHECK(emuhost_tracker_collect_into(tracker, 0, ARMED, page, words, nwords, 1, &got));
    uint64_t queried = got.pages;
    memset(words, 0, sizeof words);
    CHECK(emuhost_tracker_collect_into(tracker, 0, ARMED, page, words, nwords, 0, &got));
    unsigned lost = 0, extra = 0;
    for (uint64_t i = 0; i < ARMED / page; i++) {
        int set = (words[i / 64] >> (i % 64)) & 1;
        lost += i < WRITTEN && !set;
        extra += i >= WRITTEN && set;
    }
    printf("collect: %u pages written from 2 threads, %llu queried, %llu collected, %u lost; %d faults handed to emuhost\n",
           WRITTEN, (unsigned long long)queried, (unsigned long long)got.pages, lost,
           __atomic_load_n(&faults_handed, __ATOMIC_RELAXED));
    if (lost || extra || got.pages != WRITTEN || queried != WRITTEN) return 1;
    /* A backend that protects armed pages (mprotect; on Windows guard): every write faulted into
     * the program's own handler, and emuhost's answer let it go on. */
    if ((backend == EMUHOST_WATCH_MPROTECT || backend == EMUHOST_WATCH_GUARD) &&
        __atomic_load_n(&faults_handed, __ATOMIC_RELAXED) < WRITTEN) {
        fprintf(stderr, "smoke: the program's own fault handler was handed fewer faults than pages written\n");
        return 1;
    }

    /* Fault handles are checked like every handle: one deleted twice, or a tracker passed as
     * one, takes no fault and is refused (0, false), never read through. */
    emuhost_fault_handle_t *fh;
    CHECK(emuhost_tracker_fault_handle(tracker, &fh));
    const uintptr_t first = (uintptr_t)info.host_base;
    if (emuhost_fault_handle_handle((const emuhost_fault_handle_t *)tracker, first, 1) != 0) return 1;
    if (emuhost_fault_handle_delete((emuhost_fault_handle_t *)tracker)) return 1;
    if (!emuhost_fault_handle_delete(fh) || emuhost_fault_handle_delete(fh)) return 1;
    if (emuhost_fault_handle_handle(fh, first, 1) != 0) return 1;
    printf("fault handle: deleted twice and a tracker passed as one: refused\n");

    host_write_part(space, tracker, backend, &info);
    snapshot_part(space, tracker, settings, &info, 16 * MIB);

#ifndef SMOKE_NO_VULKAN
    vulkan_part(space, settings, info.host_base);
#else
    printf("vulkan: skipped: built without Vulkan headers\n");
#endif

    emuhost_sleeper_t *sleeper;
    CHECK(emuhost_sleeper_new(settings, &sleeper));
    double t0 = now_us();
    CHECK(emuhost_sleeper_sleep(sleeper, EMUHOST_CALLER_GUEST, 20000));
    double slept = now_us() - t0;
    emuhost_sleep_rule_t rule;
    char why[512];
    CHECK(emuhost_sleeper_rule(sleeper, &rule, why, sizeof why, NULL));
    printf("sleep: 20 us guest sleep took %.1f us; rule: guest %s, host %s: %s\n", slept, emuhost_wait_name(rule.guest),
           emuhost_wait_name(rule.host), why);
    if (slept < 20.0) return 1;
    emuhost_sleeper_t *hybrid; /* the hybrid as the host's exact wait */
    CHECK(emuhost_sleeper_new_host_wait(NULL, EMUHOST_WAIT_HYBRID, &hybrid));
    t0 = now_us();
    CHECK(emuhost_sleeper_sleep(hybrid, EMUHOST_CALLER_HOST, 1500000));
    slept = now_us() - t0;
    CHECK(emuhost_sleeper_rule(hybrid, &rule, NULL, 0, NULL));
    printf("hybrid: 1.5 ms host sleep took %.1f us; host wait %s\n", slept, emuhost_wait_name(rule.host));
    if (slept < 1500.0 || rule.host != EMUHOST_WAIT_HYBRID) return 1;
    CHECK(emuhost_sleeper_delete(hybrid));

    /* Misuse: a NULL handle, a range outside the window, a double delete. */
    expect("arm on a NULL tracker", emuhost_tracker_arm(NULL, 0, page), EMUHOST_ERROR_NULL);
    expect("a sleep of -1 ns cast to unsigned", emuhost_sleeper_sleep(sleeper, EMUHOST_CALLER_GUEST, (uint64_t)-1),
           EMUHOST_ERROR_INVALID_ARGUMENT);
    expect("commit past the window", emuhost_space_commit(space, WINDOW, page, EMUHOST_PROT_READ), EMUHOST_ERROR_OUT_OF_RANGE);
    CHECK(emuhost_tracker_delete(tracker));
    expect("tracker deleted twice", emuhost_tracker_delete(tracker), EMUHOST_ERROR_BAD_HANDLE);

    CHECK(emuhost_sleeper_delete(sleeper));
    CHECK(emuhost_space_delete(space));
    CHECK(emuhost_settings_delete(settings));
    emuhost_log_flush(); /* the lines reach the callback on emuhost's delivery thread */
    if (__atomic_load_n(&log_lines, __ATOMIC_RELAXED) == 0) {
        fprintf(stderr, "smoke: the log callback received no line\n");
        return 1;
    }
    CHECK(emuhost_set_log_callback(NULL, NULL));
    printf("smoke: ok (emuhost %s, C)\n", emuhost_version());
    return 0;
}
