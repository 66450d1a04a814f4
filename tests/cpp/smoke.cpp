// emuhost from C++17 through include/emuhost.hpp: the same steps as tests/c/smoke.c (a window
// at a fixed base, commit, arm, writes from two threads, a collect into the program's own words,
// an import on its own VkDevice read back through the GPU, a snapshot taken and restored by
// bytes, a 20 us sleep, the backend and the rule's reason, misuse caught), with RAII handles and
// exceptions. Built and run by
// crates/emuhost-capi/tests/it/programs.rs (Linux), and cross-built with mingw against
// emuhost_capi.dll and run under Wine by `.ci/windows capi`. On Windows (_WIN32) the kernel's write
// into armed memory is a ReadFile from an anonymous pipe instead of a read(2).
#include "emuhost.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#ifdef _WIN32
#ifndef NOMINMAX
#define NOMINMAX
#endif
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
#else
#include <unistd.h>
#endif

#ifndef SMOKE_NO_VULKAN
#include "vkdev.h"
#endif

namespace {

constexpr std::uint64_t MIB = 1ull << 20;
constexpr std::uint64_t WINDOW = 64 * MIB;
constexpr std::uint64_t ARMED = 4 * MIB;
constexpr std::uint64_t WRITTEN = 256;
void *const BASE = reinterpret_cast<void *>(std::uintptr_t{0x208000000000ull});  // beside the C program's

std::atomic<int> log_lines{0};

// `data` into a new pipe, then a read by the kernel from it into `at` (read(2); on Windows
// ReadFile): the bytes read, or -1.
long long read_pipe_into(std::uint8_t *at, const std::vector<std::uint8_t> &data, const emuhost::Tracker &tracker,
                         std::uint64_t addr) {
    long long got = -1;
#ifdef _WIN32
    HANDLE r, w;
    DWORD wrote = 0, read = 0;
    if (!CreatePipe(&r, &w, nullptr, static_cast<DWORD>(data.size()))) return -1;
    if (WriteFile(w, data.data(), static_cast<DWORD>(data.size()), &wrote, nullptr) && wrote == data.size()) {
        auto hw = tracker.host_write(addr, data.size());
        if (ReadFile(r, at, static_cast<DWORD>(data.size()), &read, nullptr)) got = read;
    }
    CloseHandle(r);
    CloseHandle(w);
#else
    int fds[2];
    if (pipe(fds) != 0) return -1;
    if (write(fds[1], data.data(), data.size()) == static_cast<ssize_t>(data.size())) {
        auto hw = tracker.host_write(addr, data.size());
        got = read(fds[0], at, data.size());
    }
    close(fds[0]);
    close(fds[1]);
#endif
    return got;
}

void on_log(void *, std::uint32_t level, const char *target, const char *message) {
    log_lines.fetch_add(1, std::memory_order_relaxed);
    std::fprintf(stderr, "log %u %s: %s\n", level, target, message);
}

// Runs `f`, which must throw emuhost::Error with `code`.
template <class F>
void expect(const char *what, std::uint32_t code, F f) {
    try {
        f();
    } catch (const emuhost::Error &e) {
        if (e.code() != code) {
            std::fprintf(stderr, "smoke: %s: error %u (%s), expected %u\n", what, e.code(), e.what(), code);
            std::exit(1);
        }
        std::printf("misuse caught: %s: %s\n", what, e.what());
        return;
    }
    std::fprintf(stderr, "smoke: %s succeeded; expected error %u\n", what, code);
    std::exit(1);
}

#ifndef SMOKE_NO_VULKAN
void vulkan_part(const emuhost::Space &space, const emuhost::Settings &settings) {
    smoke_vk vk;
    char why[512];
    const char *required = std::getenv("EMUHOST_REQUIRE_VULKAN");
    if (smoke_vk_open(&vk, why, sizeof why) != 0) {
        if (required && std::strcmp(required, "1") == 0) {
            std::fprintf(stderr, "smoke: EMUHOST_REQUIRE_VULKAN=1 and no Vulkan device: %s\n", why);
            std::exit(1);
        }
        std::printf("vulkan: skipped: no Vulkan device: %s\n", why);
        return;
    }
    emuhost_vulkan_device_t dev{};
    dev.get_instance_proc_addr = reinterpret_cast<emuhost_fn_t>(vkGetInstanceProcAddr);
    dev.instance = vk.instance;
    dev.physical_device = vk.physical_device;
    dev.device = vk.device;
    dev.enabled_extensions = vk.extensions;
    dev.enabled_extension_count = vk.extension_count;
    {
        auto imp = emuhost::Importer::vulkan(space, &settings, dev);
        const std::uint64_t pool = 32 * MIB, at = pool + 4096, len = 4096;
        space.commit(pool, MIB, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE);
        std::vector<std::byte> bytes(len);
        for (std::uint64_t i = 0; i < len; i++) bytes[i] = std::byte(i * 5 + 1);
        space.write(at, bytes);
        imp.add_pool(pool, MIB);
        auto b = imp.bind(at, len);
        std::vector<std::byte> back(len);
        if (b.gpu != EMUHOST_GPU_VULKAN || smoke_vk_read(&vk, b.vk_buffer, b.offset, back.data(), len, why, sizeof why) != 0) {
            std::fprintf(stderr, "smoke: reading back through the GPU: %s\n", why);
            std::exit(1);
        }
        if (back != bytes) {
            std::fprintf(stderr, "smoke: the bytes read back through the GPU differ\n");
            std::exit(1);
        }
        imp.handles_done();  // the read above has completed: replaced imports may go
        if (imp.stats().live != 1) {
            std::fprintf(stderr, "smoke: one live import expected after handles_done\n");
            std::exit(1);
        }
        std::printf("vulkan: %llu bytes read back through the GPU on %s (%s)\n", static_cast<unsigned long long>(len),
                    vk.name, imp.describe().c_str());
    }  // the importer goes before the device
    smoke_vk_close(&vk);
}
#endif

// The wrapper's arguments come in the C call's order: emuhost_tracker_new(space, settings,
// backend, flags), emuhost_importer_new_vulkan(space, settings, device), _new_cuda(space,
// settings, context), emuhost_sleeper_new_host_wait(settings, host_wait); the old orders do not
// compile.
using Settings = const emuhost::Settings *;
static_assert(std::is_constructible_v<emuhost::Tracker, const emuhost::Space &, Settings, std::uint32_t, std::uint32_t>);
static_assert(!std::is_constructible_v<emuhost::Tracker, const emuhost::Space &, std::uint32_t, Settings>);
static_assert(std::is_invocable_v<decltype(&emuhost::Importer::vulkan), const emuhost::Space &, Settings,
                                  const emuhost_vulkan_device_t &>);
static_assert(!std::is_invocable_v<decltype(&emuhost::Importer::vulkan), const emuhost::Space &,
                                   const emuhost_vulkan_device_t &, Settings>);
static_assert(std::is_invocable_v<decltype(&emuhost::Importer::cuda), const emuhost::Space &, Settings, void *>);
static_assert(!std::is_invocable_v<decltype(&emuhost::Importer::cuda), const emuhost::Space &, void *, Settings>);
static_assert(std::is_invocable_v<decltype(&emuhost::Sleeper::with_host_wait), Settings, std::uint32_t>);
static_assert(!std::is_invocable_v<decltype(&emuhost::Sleeper::with_host_wait), std::uint32_t, Settings>);
static_assert(std::is_constructible_v<emuhost::Snapshots, const emuhost::Tracker &, std::uint64_t, std::uint64_t, Settings>);
static_assert(!std::is_constructible_v<emuhost::Snapshots, const emuhost::Tracker &, Settings, std::uint64_t, std::uint64_t>);

// Space::write and read take any contiguous memory of plain values, and a pointer and a length.
int bytes_in_and_out(const emuhost::Space &space, std::uint64_t at) {
    space.commit(at, 64 * 1024, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE);
    const std::vector<std::uint8_t> octets{1, 2, 3, 4};
    const std::array<std::uint32_t, 2> words{0x05060708u, 0x090a0b0cu};
    const std::string text = "emuhost";
    const char c_array[3] = {'x', 'y', 'z'};
    space.write(at, octets);
    space.write(at + 4, words);
    space.write(at + 12, text);
    space.write(at + 19, c_array);
    space.write(at + 22, "!", 1);
    std::array<std::uint8_t, 23> back{};
    space.read(at, back);
    std::vector<std::byte> tail(3);
    space.read(at + 19, tail);
    std::uint32_t first_word = 0;
    space.read(at + 4, &first_word, sizeof first_word);
    std::uint8_t want[23] = {1, 2, 3, 4};
    std::memcpy(want + 4, words.data(), 8);
    std::memcpy(want + 12, "emuhostxyz!", 11);
    if (std::memcmp(back.data(), want, sizeof want) != 0 || tail[0] != std::byte('x') || first_word != 0x05060708u) {
        std::fprintf(stderr, "smoke: the bytes written through Space::write came back different\n");
        return 1;
    }
    std::printf("bytes: a vector, an array of words, a string, a C array and a pointer written and read back\n");
    return 0;
}

// A fault handle is an owner: handle() is false for a fault that is no tracker's and for an
// empty (moved-from) handle, and the C handle is deleted when its owner goes.
int fault_handles(const emuhost::Tracker &tracker) {
    auto fh = tracker.fault_handle();
    int outside = 0;
    if (!fh || fh.handle(reinterpret_cast<std::uintptr_t>(&outside), true) ||
        emuhost::handle_fault(reinterpret_cast<std::uintptr_t>(&outside), true))
        return 1;
    emuhost_fault_handle_t *raw = fh.get();
    {
        emuhost::FaultHandle owner = std::move(fh);
        if (fh || fh.handle(0x1000, true) || owner.get() != raw) return 1;
    }
    // The owner deleted it: a second delete says false.
    if (emuhost_fault_handle_delete(raw)) return 1;
    std::printf("fault handle: owned, deleted with its owner\n");
    return 0;
}

// A snapshot of 16 pages: written, taken, written over, restored, and read back equal by bytes;
// released, after which its id is refused.
int snapshot_round_trip(const emuhost::Space &space, const emuhost::Tracker &tracker, const emuhost::Settings &settings,
                        std::uint64_t at, std::uint64_t page) {
    const std::uint64_t len = 16 * page;
    space.commit(at, len, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE);
    emuhost::Snapshots snapshots(tracker, at, len, &settings);
    // Written as the guest writes: stores into armed memory.
    auto *guest = static_cast<volatile std::uint8_t *>(space.info().host_base) + at;
    for (std::uint64_t i = 0; i < len; i++) guest[i] = static_cast<std::uint8_t>(i * 13 + 7);
    std::vector<std::uint8_t> taken(len), over(len), back(len);
    space.read(at, taken);
    auto id = snapshots.take();
    for (std::uint64_t i = 0; i < len; i += 64) guest[i] = static_cast<std::uint8_t>(~guest[i]);
    space.read(at, over);
    // A save state: the snapshot's bytes without a restore; the live ids.
    if (snapshots.read(id, at, len) != taken || snapshots.live() != std::vector<std::uint64_t>{id}) {
        std::fprintf(stderr, "smoke: the snapshot's bytes or ids read back other than taken\n");
        return 1;
    }
    auto restored = snapshots.restore(id);
    space.read(at, back);
    if (over == taken || back != taken) {
        std::fprintf(stderr, "smoke: the snapshot's bytes did not come back\n");
        return 1;
    }
    snapshots.release(id);
    expect("restore of a released snapshot", EMUHOST_ERROR_INVALID_ARGUMENT, [&] { snapshots.restore(id); });
    expect("read of a released snapshot", EMUHOST_ERROR_INVALID_ARGUMENT, [&] { snapshots.read(id, at, 1); });
    auto st = snapshots.stats();
    std::printf("snapshot: %llu pages taken, written over and restored (%llu put back): bytes equal\n",
                static_cast<unsigned long long>(st.pages_copied), static_cast<unsigned long long>(restored.pages));
    return st.taken == 1 && st.live == 0 ? 0 : 1;
}

int run() {
    emuhost::check_version();
    std::printf("version: header %s, library %s: compatible\n", EMUHOST_VERSION_STRING, emuhost_version());
    emuhost::set_log_callback(on_log, nullptr);
    emuhost::set_log_filter(std::getenv("EMUHOST_LOG"));
    emuhost::Settings settings;
    settings.set("EMUHOST_IMPORT_SPAN_MB", "64");

    auto space = emuhost::Space::reserve_at(BASE, WINDOW, 2 * MIB);
    auto info = space.info();
    if (info.host_base != BASE) {
        std::fprintf(stderr, "smoke: the window is at %p, not %p\n", info.host_base, BASE);
        return 1;
    }
    const std::uint64_t page = info.page_size;
    space.commit(0, ARMED, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE);
    {
        // Where the program would make its own mprotect in the window: marked while it runs.
        auto change = space.change();
        if (!change) return 1;
        // No long read while the change is marked ...
        if (space.long_read()) return 1;
    }
    {
        // ... and one once it ended: where the program would pin guest memory on its own device.
        auto read = space.long_read();
        if (!read) return 1;
    }

    emuhost::Tracker tracker(space, &settings, EMUHOST_WATCH_AUTO);
    std::printf("backend: %s\n", tracker.backend_name().c_str());
    tracker.arm(0, ARMED);
    // Two caches on one tracker, each with its own dirty pages.
    emuhost::Consumer buffers(tracker), textures(tracker);

    auto *base = static_cast<volatile std::uint8_t *>(info.host_base);
    std::vector<std::thread> writers;
    for (std::uint64_t parity = 0; parity < 2; parity++)
        writers.emplace_back([=] {
            for (std::uint64_t i = parity; i < WRITTEN; i += 2) base[i * page + 16] = static_cast<std::uint8_t>(i);
        });
    for (auto &t : writers) t.join();

    // One bit per page in each cache's own words; the first cache's collect must not eat the
    // second's bits.
    unsigned lost = 0;
    for (auto *cache : {&buffers, &textures}) {
        std::vector<std::uint64_t> words((ARMED / page + 63) / 64);
        auto got = cache->collect_into(0, ARMED, page, words);
        for (std::uint64_t i = 0; i < WRITTEN; i++) lost += !((words[i / 64] >> (i % 64)) & 1);
        std::printf("collect: %llu pages written from 2 threads, %llu reported to a consumer\n",
                    static_cast<unsigned long long>(WRITTEN), static_cast<unsigned long long>(got.pages));
        if (got.pages != WRITTEN) return 1;
    }
    std::printf("collect: %u lost\n", lost);
    if (lost) return 1;

    // The program's own read(2) from a pipe into armed memory, marked as a host write.
    std::vector<std::uint8_t> data(page, 0x5a);
    long long got = read_pipe_into(static_cast<std::uint8_t *>(info.host_base) + 300 * page, data, tracker, 300 * page);
    std::vector<std::uint64_t> words((ARMED / page + 63) / 64);
    buffers.collect_into(0, ARMED, page, words);
    std::printf("host write: read(2) of %lld bytes into armed memory, page 300 %s\n", got,
                (words[300 / 64] >> (300 % 64)) & 1 ? "collected" : "lost");
    if (got != static_cast<long long>(page) || !((words[300 / 64] >> (300 % 64)) & 1)) return 1;

    if (bytes_in_and_out(space, 8 * MIB) != 0 || fault_handles(tracker) != 0) return 1;
    if (snapshot_round_trip(space, tracker, settings, 12 * MIB, page) != 0) return 1;

#ifndef SMOKE_NO_VULKAN
    vulkan_part(space, settings);
#else
    std::printf("vulkan: skipped: built without Vulkan headers\n");
#endif

    emuhost::Sleeper sleeper(&settings);
    auto t0 = std::chrono::steady_clock::now();
    sleeper.sleep_guest(std::chrono::microseconds(20));
    auto slept = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    auto rule = sleeper.rule();
    std::printf("sleep: 20 us guest sleep took %.1f us; rule: guest %s, host %s: %s\n", slept,
                emuhost_wait_name(rule.guest), emuhost_wait_name(rule.host), sleeper.why().c_str());
    if (slept < 20.0) return 1;
    auto hybrid = emuhost::Sleeper::with_host_wait(nullptr, EMUHOST_WAIT_HYBRID);
    hybrid.sleep_host(std::chrono::milliseconds(1));
    std::printf("hybrid: host wait %s\n", emuhost_wait_name(hybrid.rule().host));
    if (hybrid.rule().host != EMUHOST_WAIT_HYBRID) return 1;
    auto workers = emuhost::prepare_workers(EMUHOST_ALLOCATOR_LOCKED);
    std::printf("workers: %s\n", workers.why.c_str());

    // Misuse: a NULL (moved-from) handle, a range outside the window, a bad setting, a double delete.
    emuhost::Tracker moved = std::move(tracker);
    expect("arm on a moved-from tracker", EMUHOST_ERROR_NULL, [&] { tracker.arm(0, page); });
    expect("commit past the window", EMUHOST_ERROR_OUT_OF_RANGE, [&] { space.commit(WINDOW, page, EMUHOST_PROT_READ); });
    expect("a misspelt setting", EMUHOST_ERROR_SETTING, [&] { settings.set("EMUHOST_WACTH", "uffd"); });
    emuhost_tracker_t *raw = moved.release();
    emuhost::detail::check(emuhost_tracker_delete(raw));
    expect("tracker deleted twice", EMUHOST_ERROR_BAD_HANDLE, [&] { emuhost::detail::check(emuhost_tracker_delete(raw)); });

    emuhost::log_flush();  // the lines reach the callback on emuhost's delivery thread
    if (log_lines.load() == 0) {
        std::fprintf(stderr, "smoke: the log callback received no line\n");
        return 1;
    }
    emuhost::set_log_callback(nullptr, nullptr);
    std::printf("smoke: ok (emuhost %s, C++17)\n", emuhost_version());
    return 0;
}

}  // namespace

int main() {
    try {
        return run();
    } catch (const emuhost::Error &e) {
        std::fprintf(stderr, "smoke: error %u: %s\n", e.code(), e.what());
        return 1;
    }
}
