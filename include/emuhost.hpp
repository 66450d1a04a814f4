// emuhost for C++17: a header-only wrapper of emuhost.h. Handles are move-only RAII objects that
// delete their C handle; buffers are spans; a failed call throws emuhost::Error.
//
// Errors are exceptions, not std::error_code returns: the wrapper's point is RAII, and a
// constructor (Space, Tracker, Importer) has no other way to fail; an error_code style would need
// two-phase construction or a result type on every call. Code bases built with -fno-exceptions
// use emuhost.h directly (every call returns its error there). Error::code() is the C code
// (EMUHOST_ERROR_*), so a caller can still branch on it.
//
// Thread safety is the C handles' (see emuhost.h): every object may be used from several threads
// at once; moving from or destroying one while another thread uses it is the caller's to avoid,
// as with any C++ object.
//
// Arguments come in the C call's order (emuhost_tracker_new(space, settings, backend, flags) is
// Tracker(space, settings, backend, flags)), the out-pointer becoming the result.
#ifndef EMUHOST_HPP
#define EMUHOST_HPP

// C++17 and exceptions, said plainly rather than by a page of errors further down.
#if defined(_MSVC_LANG)
#if _MSVC_LANG < 201703L
#error "emuhost.hpp needs C++17 (/std:c++17); C++14 and older, and C, use emuhost.h"
#endif
#elif !defined(__cplusplus) || __cplusplus < 201703L
#error "emuhost.hpp needs C++17 (-std=c++17); C++14 and older, and C, use emuhost.h"
#endif
#if !defined(__cpp_exceptions) && !defined(_CPPUNWIND)
#error "emuhost.hpp reports errors as exceptions: built with -fno-exceptions, use emuhost.h (every call returns its error)"
#endif

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if __has_include(<span>) && __cplusplus >= 202002L
#include <span>
#endif

#include "emuhost.h"

namespace emuhost {

#if defined(__cpp_lib_span)
template <class T>
using span = std::span<T>;
#else
// std::span arrived in C++20; in C++17 this minimal one (pointer and count) stands in.
template <class T>
class span {
public:
    constexpr span() noexcept = default;
    constexpr span(T *data, std::size_t size) noexcept : data_(data), size_(size) {}
    template <class C, class = decltype(std::declval<C &>().data())>
    constexpr span(C &c) noexcept : data_(c.data()), size_(c.size()) {}
    constexpr T *data() const noexcept { return data_; }
    constexpr std::size_t size() const noexcept { return size_; }
    constexpr T *begin() const noexcept { return data_; }
    constexpr T *end() const noexcept { return data_ + size_; }
    constexpr T &operator[](std::size_t i) const noexcept { return data_[i]; }

private:
    T *data_ = nullptr;
    std::size_t size_ = 0;
};
#endif

// A failed emuhost call: what() is the message, code() the EMUHOST_ERROR_* code.
class Error : public std::runtime_error {
public:
    Error(std::uint32_t code, const std::string &message) : std::runtime_error(message), code_(code) {}
    std::uint32_t code() const noexcept { return code_; }

private:
    std::uint32_t code_;
};

namespace detail {

// Throws the error `e` (deleted first) as an emuhost::Error; nothing for NULL.
inline void check(emuhost_error_t *e) {
    if (!e) return;
    std::string message(emuhost_error_message(e, nullptr, 0), '\0');
    emuhost_error_message(e, message.data(), message.size() + 1);
    std::uint32_t code = emuhost_error_code(e);
    emuhost_error_delete(e);
    throw Error(code, message);
}

// A string from a snprintf-style call `f(buf, cap, &len)`: called again only where the text is
// longer than a first buffer.
template <class F>
std::string text(F f) {
    char first[512];
    std::size_t len = 0;
    check(f(first, sizeof first, &len));
    if (len < sizeof first) return std::string(first, len);
    std::string s(len, '\0');
    check(f(s.data(), len + 1, &len));
    s.resize(len);
    return s;
}

// Whether C is contiguous memory of plain values: std::data(c) and std::size(c) (a std::vector,
// std::array, std::string, std::span, a C array) of a trivially copyable type; Writable: not const.
template <class C, class = void>
struct Contiguous : std::false_type {};
template <class C>
struct Contiguous<C, std::void_t<decltype(std::data(std::declval<C &>())), decltype(std::size(std::declval<C &>()))>>
    : std::is_trivially_copyable<std::remove_pointer_t<decltype(std::data(std::declval<C &>()))>> {};
template <class C, class = void>
struct Writable : std::false_type {};
template <class C>
struct Writable<C, std::enable_if_t<Contiguous<C>::value>>
    : std::negation<std::is_const<std::remove_pointer_t<decltype(std::data(std::declval<C &>()))>>> {};

// A move-only owner of a C handle, deleted with `Delete` (whose error, impossible for a handle
// the owner holds, is dropped: destructors do not throw).
template <class T, emuhost_error_t *(*Delete)(T *)>
class Handle {
public:
    Handle() noexcept = default;
    explicit Handle(T *raw) noexcept : raw_(raw) {}
    Handle(Handle &&o) noexcept : raw_(std::exchange(o.raw_, nullptr)) {}
    Handle &operator=(Handle &&o) noexcept {
        if (this != &o) {
            reset();
            raw_ = std::exchange(o.raw_, nullptr);
        }
        return *this;
    }
    Handle(const Handle &) = delete;
    Handle &operator=(const Handle &) = delete;
    ~Handle() { reset(); }

    T *get() const noexcept { return raw_; }
    T *release() noexcept { return std::exchange(raw_, nullptr); }
    void reset() noexcept {
        if (raw_) emuhost_error_delete(Delete(std::exchange(raw_, nullptr)));
    }
    explicit operator bool() const noexcept { return raw_ != nullptr; }

private:
    T *raw_ = nullptr;
};

}  // namespace detail

// Throws emuhost::Error (EMUHOST_ERROR_UNAVAILABLE) where the library in use does not serve this
// header's version (EMUHOST_VERSION_CHECK(); see emuhost_version_compatible). Call it once at start.
inline void check_version() {
    if (!EMUHOST_VERSION_CHECK()) {
        throw Error(EMUHOST_ERROR_UNAVAILABLE, std::string("emuhost ") + emuhost_version() +
                                                   " does not serve the header's version " + EMUHOST_VERSION_STRING);
    }
}

// Settings: every EMUHOST_* switch, set by name; the defaults, or the environment on request.
class Settings : public detail::Handle<emuhost_settings_t, emuhost_settings_delete> {
public:
    // Every switch at its default (no environment is read).
    Settings() : Handle(make()) {}
    static Settings from_env() {
        emuhost_settings_t *raw = nullptr;
        detail::check(emuhost_settings_from_env(&raw));
        return Settings(raw);
    }
    Settings &set(const std::string &name, const std::string &value) {
        detail::check(emuhost_settings_set(get(), name.c_str(), value.c_str()));
        return *this;
    }
    void install_faults() const { detail::check(emuhost_settings_install_faults(get())); }

private:
    explicit Settings(emuhost_settings_t *raw) : Handle(raw) {}
    static emuhost_settings_t *make() {
        emuhost_settings_t *raw = nullptr;
        detail::check(emuhost_settings_new(&raw));
        return raw;
    }
};

inline const emuhost_settings_t *raw(const Settings *s) { return s ? s->get() : nullptr; }

// A change of the window's mappings that the caller makes itself, marked in flight while this
// lives (see emuhost_space_change_begin): Space::change().
class Change : public detail::Handle<emuhost_change_t, emuhost_change_end> {
public:
    explicit Change(emuhost_change_t *raw) : Handle(raw) {}
};

// A long read of the memory map that the caller makes itself (its own driver's pin of guest
// memory), marked in flight while this lives (see emuhost_space_long_read_begin): Space::long_read().
// Empty (false) when a change of the mappings was in flight: step aside and try again.
class LongRead : public detail::Handle<emuhost_long_read_t, emuhost_long_read_end> {
public:
    LongRead() noexcept = default;
    explicit LongRead(emuhost_long_read_t *raw) : Handle(raw) {}
};

// The program's own kernel write into armed memory (a read(2) into guest memory) in flight
// while this lives (see emuhost_tracker_host_write_begin): Tracker::host_write().
class HostWrite : public detail::Handle<emuhost_host_write_t, emuhost_host_write_end> {
public:
    explicit HostWrite(emuhost_host_write_t *raw) : Handle(raw) {}
};

// The guest address space.
class Space : public detail::Handle<emuhost_space_t, emuhost_space_delete> {
public:
    static Space reserve(std::uint64_t window, std::uint64_t guard = 0) {
        emuhost_space_t *raw = nullptr;
        detail::check(emuhost_space_reserve(window, guard, &raw));
        return Space(raw);
    }
    static Space reserve_at(void *base, std::uint64_t window, std::uint64_t guard = 0) {
        emuhost_space_t *raw = nullptr;
        detail::check(emuhost_space_reserve_at(base, window, guard, &raw));
        return Space(raw);
    }
    // The caller's reservation (see emuhost_space_adopt's safety paragraph).
    static Space adopt(void *base, std::uint64_t len) {
        emuhost_space_t *raw = nullptr;
        detail::check(emuhost_space_adopt(base, len, &raw));
        return Space(raw);
    }

    emuhost_space_info_t info() const {
        emuhost_space_info_t i{};
        detail::check(emuhost_space_info(get(), &i));
        return i;
    }
    // The host address of guest address `addr`.
    std::uint8_t *host(std::uint64_t addr) const { return static_cast<std::uint8_t *>(info().host_base) + addr; }

    void commit(std::uint64_t addr, std::uint64_t len, std::uint32_t prot) const {
        detail::check(emuhost_space_commit(get(), addr, len, prot));
    }
    std::uint64_t commit_reserved(std::uint64_t addr, std::uint64_t len, std::uint32_t prot) const {
        std::uint64_t n = 0;
        detail::check(emuhost_space_commit_reserved(get(), addr, len, prot, &n));
        return n;
    }
    void decommit(std::uint64_t addr, std::uint64_t len) const { detail::check(emuhost_space_decommit(get(), addr, len)); }
    void protect(std::uint64_t addr, std::uint64_t len, std::uint32_t prot) const {
        detail::check(emuhost_space_protect(get(), addr, len, prot));
    }
    void zero(std::uint64_t addr, std::uint64_t len) const { detail::check(emuhost_space_zero(get(), addr, len)); }
    void populate(std::uint64_t addr, std::uint64_t len) const { detail::check(emuhost_space_populate(get(), addr, len)); }
    // Marks the caller's own mprotect/mmap/munmap in the window as in flight while the guard
    // lives (see emuhost_space_change_begin).
    Change change() const {
        emuhost_change_t *raw = nullptr;
        detail::check(emuhost_space_change_begin(get(), &raw));
        return Change(raw);
    }
    // Marks the caller's own long read of the memory map (a pin on its own device) while the
    // guard lives; empty when a change is in flight (see emuhost_space_long_read_begin).
    LongRead long_read() const {
        emuhost_long_read_t *raw = nullptr;
        detail::check(emuhost_space_long_read_begin(get(), &raw));
        return LongRead(raw);
    }
    // Copies `len` bytes at `data` to guest address `addr` (see emuhost_space_write).
    void write(std::uint64_t addr, const void *data, std::size_t len) const {
        detail::check(emuhost_space_write(get(), addr, data, len));
    }
    // Copies the bytes of any contiguous memory of plain values (a std::vector<std::uint8_t>, a
    // std::array<std::uint32_t, N>, a std::string, a std::span, a C array) to `addr`.
    template <class C, std::enable_if_t<detail::Contiguous<const C>::value, int> = 0>
    void write(std::uint64_t addr, const C &bytes) const {
        write(addr, std::data(bytes), std::size(bytes) * sizeof(*std::data(bytes)));
    }
    // Copies `len` bytes at guest address `addr` into `buf` (see emuhost_space_read).
    void read(std::uint64_t addr, void *buf, std::size_t len) const {
        detail::check(emuhost_space_read(get(), addr, buf, len));
    }
    // Fills any contiguous, writable memory of plain values with the bytes at `addr`.
    template <class C, std::enable_if_t<detail::Writable<std::remove_reference_t<C>>::value, int> = 0>
    void read(std::uint64_t addr, C &&buf) const {
        read(addr, std::data(buf), std::size(buf) * sizeof(*std::data(buf)));
    }

    std::uint64_t create_section(std::uint64_t len) const {
        std::uint64_t id = 0;
        detail::check(emuhost_space_create_section(get(), len, &id));
        return id;
    }
    void destroy_section(std::uint64_t id) const { detail::check(emuhost_space_destroy_section(get(), id)); }
    void map_section(std::uint64_t addr, std::uint64_t len, std::uint64_t id, std::uint64_t offset, std::uint32_t prot) const {
        detail::check(emuhost_space_map_section(get(), addr, len, id, offset, prot));
    }
    std::size_t map_pages(std::uint64_t addr, std::uint64_t id, span<const std::uint64_t> pages, std::uint32_t prot) const {
        std::size_t views = 0;
        detail::check(emuhost_space_map_pages(get(), addr, id, pages.data(), pages.size(), prot, &views));
        return views;
    }
    std::vector<emuhost_allocation_t> allocations(std::uint64_t addr, std::uint64_t len) const {
        return list<emuhost_allocation_t>(emuhost_space_allocations, addr, len);
    }
    std::vector<emuhost_view_t> views(std::uint64_t addr, std::uint64_t len) const {
        return list<emuhost_view_t>(emuhost_space_views, addr, len);
    }

private:
    explicit Space(emuhost_space_t *raw) : Handle(raw) {}

    template <class T, class F>
    std::vector<T> list(F f, std::uint64_t addr, std::uint64_t len) const {
        std::vector<T> out;
        std::size_t n = 0;
        do {  // again where the list grew between the calls
            out.resize(n);
            detail::check(f(get(), addr, len, out.data(), out.size(), &n));
        } while (n > out.size());
        out.resize(n);
        return out;
    }
};

// One tracker's fault handle, for the embedder's own SIGSEGV (Windows: vectored exception)
// handler: Tracker::fault_handle(). handle() is async-signal-safe (atomics only, no lock, no
// allocation, no exception); the handle is deleted when this goes (see emuhost_fault_handle_t).
class FaultHandle {
public:
    FaultHandle() noexcept = default;
    explicit FaultHandle(emuhost_fault_handle_t *raw) noexcept : raw_(raw) {}
    FaultHandle(FaultHandle &&o) noexcept : raw_(std::exchange(o.raw_, nullptr)) {}
    FaultHandle &operator=(FaultHandle &&o) noexcept {
        if (this != &o) {
            reset();
            raw_ = std::exchange(o.raw_, nullptr);
        }
        return *this;
    }
    FaultHandle(const FaultHandle &) = delete;
    FaultHandle &operator=(const FaultHandle &) = delete;
    ~FaultHandle() { reset(); }

    // Whether the fault at host address `addr` was this tracker's and is handled: return from
    // the handler then (emuhost_fault_handle_handle). False for an empty handle.
    bool handle(std::uintptr_t addr, bool is_write) const noexcept {
        return emuhost_fault_handle_handle(raw_, addr, is_write ? 1 : 0) == 1;
    }
    emuhost_fault_handle_t *get() const noexcept { return raw_; }
    emuhost_fault_handle_t *release() noexcept { return std::exchange(raw_, nullptr); }
    void reset() noexcept {
        if (raw_) emuhost_fault_handle_delete(std::exchange(raw_, nullptr));
    }
    explicit operator bool() const noexcept { return raw_ != nullptr; }

private:
    emuhost_fault_handle_t *raw_ = nullptr;
};

// Whether any tracker's armed pages hold the fault at `addr` and it is handled (async-signal-safe;
// see emuhost_handle_fault).
inline bool handle_fault(std::uintptr_t addr, bool is_write) noexcept { return emuhost_handle_fault(addr, is_write ? 1 : 0) == 1; }

// A write tracker on a space (one per space); keeps the space alive.
class Tracker : public detail::Handle<emuhost_tracker_t, emuhost_tracker_delete> {
public:
    // As emuhost_tracker_new(space, settings, backend, flags): settings may be nullptr (the
    // defaults); flags 0, or EMUHOST_TRACKER_EMBEDDER_HANDLES_FAULTS (the embedder's SIGSEGV
    // handler calls emuhost_handle_fault or FaultHandle::handle first).
    explicit Tracker(const Space &space, const Settings *settings = nullptr, std::uint32_t backend = EMUHOST_WATCH_AUTO,
                     std::uint32_t flags = 0)
        : Handle(make(space, settings, backend, flags)) {}
    std::uint32_t backend() const {
        std::uint32_t b = 0;
        detail::check(emuhost_tracker_backend(get(), &b));
        return b;
    }
    std::string backend_name() const { return emuhost_watch_backend_name(backend()); }
    // A fault handle of this tracker for the embedder's own fault handler (at most
    // EMUHOST_FAULT_HANDLES_MAX live at once).
    FaultHandle fault_handle() const {
        emuhost_fault_handle_t *raw = nullptr;
        detail::check(emuhost_tracker_fault_handle(get(), &raw));
        return FaultHandle(raw);
    }
    void arm(std::uint64_t addr, std::uint64_t len) const { detail::check(emuhost_tracker_arm(get(), addr, len)); }
    void disarm(std::uint64_t addr, std::uint64_t len) const { detail::check(emuhost_tracker_disarm(get(), addr, len)); }
    // Marks the program's own kernel write into addr..addr + len (a read(2) there) while the
    // guard lives; with mprotect such a write fails with EFAULT otherwise.
    HostWrite host_write(std::uint64_t addr, std::uint64_t len) const {
        emuhost_host_write_t *raw = nullptr;
        detail::check(emuhost_tracker_host_write_begin(get(), addr, len, &raw));
        return HostWrite(raw);
    }
    // The written pages' guest addresses go to the front of `pages` (room for len / page size).
    emuhost_collect_t collect(std::uint64_t addr, std::uint64_t len, span<std::uint64_t> pages) const {
        emuhost_collect_t r{};
        detail::check(emuhost_tracker_collect(get(), addr, len, pages.data(), pages.size(), &r));
        return r;
    }
    // ORs one bit per `granularity` bytes written into `words` (bit i: addr + i * granularity),
    // taking them (collect) or not (query).
    emuhost_written_t collect_into(std::uint64_t addr, std::uint64_t len, std::uint64_t granularity,
                                   span<std::uint64_t> words, bool query = false) const {
        emuhost_written_t r{};
        detail::check(emuhost_tracker_collect_into(get(), addr, len, granularity, words.data(), words.size(), query, &r));
        return r;
    }

private:
    static emuhost_tracker_t *make(const Space &space, const Settings *settings, std::uint32_t backend,
                                   std::uint32_t flags) {
        emuhost_tracker_t *raw = nullptr;
        detail::check(emuhost_tracker_new(space.get(), emuhost::raw(settings), backend, flags, &raw));
        return raw;
    }
};

// One consumer of a tracker's writes, with its own dirty pages; keeps the tracker alive.
class Consumer : public detail::Handle<emuhost_consumer_t, emuhost_consumer_delete> {
public:
    explicit Consumer(const Tracker &tracker) : Handle(make(tracker)) {}
    emuhost_written_t collect_into(std::uint64_t addr, std::uint64_t len, std::uint64_t granularity,
                                   span<std::uint64_t> words, bool query = false) const {
        emuhost_written_t r{};
        detail::check(emuhost_consumer_collect_into(get(), addr, len, granularity, words.data(), words.size(), query, &r));
        return r;
    }

private:
    static emuhost_consumer_t *make(const Tracker &tracker) {
        emuhost_consumer_t *raw = nullptr;
        detail::check(emuhost_consumer_new(tracker.get(), &raw));
        return raw;
    }
};

// Snapshots of a guest range of a tracker's space: save states, rewind, run-ahead; keeps the
// tracker (and the space) alive. A snapshot is its id (a number, not an owner): release() frees
// it, and the snapshots object frees every one it keeps when it goes. An id that is not live
// (released, never taken, or dropped for EMUHOST_SNAPSHOT_BUDGET_MB) throws
// EMUHOST_ERROR_INVALID_ARGUMENT; a restore refused (held pages, a shared view, guest writes
// beside it) EMUHOST_ERROR_REFUSED (see emuhost_snapshots_restore).
class Snapshots : public detail::Handle<emuhost_snapshots_t, emuhost_snapshots_delete> {
public:
    // As emuhost_snapshots_new(tracker, addr, len, settings): settings may be nullptr (the
    // defaults; EMUHOST_SNAPSHOT_BUDGET_MB is the budget).
    Snapshots(const Tracker &tracker, std::uint64_t addr, std::uint64_t len, const Settings *settings = nullptr)
        : Handle(make(tracker, addr, len, settings)) {}
    // Takes a snapshot of the range; its id.
    std::uint64_t take() const {
        std::uint64_t id = 0;
        detail::check(emuhost_snapshots_take(get(), &id));
        return id;
    }
    // Puts snapshot `id` back (it stays live): the pages whose bytes were put back, and those
    // decommitted.
    emuhost_restored_t restore(std::uint64_t id) const {
        emuhost_restored_t r{};
        detail::check(emuhost_snapshots_restore(get(), id, &r));
        return r;
    }
    void release(std::uint64_t id) const { detail::check(emuhost_snapshots_release(get(), id)); }
    // Snapshot `id`'s bytes at guest `addr`, without restoring it (a save state).
    std::vector<std::uint8_t> read(std::uint64_t id, std::uint64_t addr, std::size_t len) const {
        std::vector<std::uint8_t> buf(len);
        detail::check(emuhost_snapshots_read(get(), id, addr, buf.data(), len));
        return buf;
    }
    // The live snapshots' ids, oldest first.
    std::vector<std::uint64_t> live() const {
        std::size_t n = 0;
        detail::check(emuhost_snapshots_live(get(), nullptr, 0, &n));
        std::vector<std::uint64_t> ids(n);
        detail::check(emuhost_snapshots_live(get(), ids.data(), ids.size(), &n));
        ids.resize(std::min(n, ids.size()));
        return ids;
    }
    emuhost_snapshot_stats_t stats() const {
        emuhost_snapshot_stats_t s{};
        detail::check(emuhost_snapshots_stats(get(), &s));
        return s;
    }

private:
    static emuhost_snapshots_t *make(const Tracker &tracker, std::uint64_t addr, std::uint64_t len,
                                     const Settings *settings) {
        emuhost_snapshots_t *raw = nullptr;
        detail::check(emuhost_snapshots_new(tracker.get(), addr, len, emuhost::raw(settings), &raw));
        return raw;
    }
};

// An importer of a space's memory into the GPU; keeps the space alive.
class Importer : public detail::Handle<emuhost_importer_t, emuhost_importer_delete> {
public:
    // On a device emuhost opens (EMUHOST_IMPORT_BACKEND).
    static Importer open(const Space &space, const Settings *settings = nullptr) {
        emuhost_importer_t *raw = nullptr;
        detail::check(emuhost_importer_new(space.get(), emuhost::raw(settings), &raw));
        return Importer(raw);
    }
    // On the caller's VkDevice (see emuhost_importer_new_vulkan's safety paragraph); settings may
    // be nullptr.
    static Importer vulkan(const Space &space, const Settings *settings, const emuhost_vulkan_device_t &device) {
        emuhost_importer_t *raw = nullptr;
        detail::check(emuhost_importer_new_vulkan(space.get(), emuhost::raw(settings), &device, &raw));
        return Importer(raw);
    }
    // In the caller's CUcontext; settings may be nullptr.
    static Importer cuda(const Space &space, const Settings *settings, void *context) {
        emuhost_importer_t *raw = nullptr;
        detail::check(emuhost_importer_new_cuda(space.get(), emuhost::raw(settings), context, &raw));
        return Importer(raw);
    }

    std::uint32_t gpu() const {
        std::uint32_t g = 0;
        detail::check(emuhost_importer_backend(get(), &g, nullptr, 0, nullptr));
        return g;
    }
    std::string describe() const {
        return detail::text([&](char *b, std::size_t c, std::size_t *l) { return emuhost_importer_backend(get(), nullptr, b, c, l); });
    }
    std::uint64_t add_pool(std::uint64_t lo, std::uint64_t size) const {
        std::uint64_t id = 0;
        detail::check(emuhost_importer_add_pool(get(), lo, size, &id));
        return id;
    }
    void remove_pool(std::uint64_t id) const { detail::check(emuhost_importer_remove_pool(get(), id)); }
    emuhost_binding_t bind(std::uint64_t addr, std::uint64_t size) const {
        emuhost_binding_t b{};
        detail::check(emuhost_importer_bind(get(), addr, size, &b));
        return b;
    }
    emuhost_import_stats_t stats() const {
        emuhost_import_stats_t s{};
        detail::check(emuhost_importer_stats(get(), &s));
        return s;
    }
    void handles_done() const { detail::check(emuhost_importer_handles_done(get())); }
    void release_all() const { detail::check(emuhost_importer_release_all(get())); }

private:
    explicit Importer(emuhost_importer_t *raw) : Handle(raw) {}
};

// Short sleeps for the guest and the host, by the rule.
// A sleep over EMUHOST_SLEEP_MAX_NS (1 s) throws (EMUHOST_ERROR_INVALID_ARGUMENT).
class Sleeper : public detail::Handle<emuhost_sleeper_t, emuhost_sleeper_delete> {
public:
    explicit Sleeper(const Settings *settings = nullptr) : Handle(make(settings)) {}
    // With the host's exact wait chosen (EMUHOST_WAIT_HYBRID, _YIELD or _TIMER; see
    // emuhost_sleeper_new_host_wait).
    static Sleeper with_host_wait(const Settings *settings, std::uint32_t host_wait) {
        emuhost_sleeper_t *raw = nullptr;
        detail::check(emuhost_sleeper_new_host_wait(emuhost::raw(settings), host_wait, &raw));
        return Sleeper(raw);
    }
    void sleep_guest(std::chrono::nanoseconds d) const { sleep(EMUHOST_CALLER_GUEST, d); }
    void sleep_host(std::chrono::nanoseconds d) const { sleep(EMUHOST_CALLER_HOST, d); }
    emuhost_sleep_rule_t rule() const {
        emuhost_sleep_rule_t r{};
        detail::check(emuhost_sleeper_rule(get(), &r, nullptr, 0, nullptr));
        return r;
    }
    // Why the rule is what it is, in words.
    std::string why() const {
        return detail::text([&](char *b, std::size_t c, std::size_t *l) { return emuhost_sleeper_rule(get(), nullptr, b, c, l); });
    }

private:
    explicit Sleeper(emuhost_sleeper_t *raw) : Handle(raw) {}
    static emuhost_sleeper_t *make(const Settings *settings) {
        emuhost_sleeper_t *raw = nullptr;
        detail::check(emuhost_sleeper_new(emuhost::raw(settings), &raw));
        return raw;
    }
    void sleep(std::uint32_t caller, std::chrono::nanoseconds d) const {
        detail::check(emuhost_sleeper_sleep(get(), caller, d.count() < 0 ? 0 : static_cast<std::uint64_t>(d.count())));
    }
};

struct Workers {
    std::uint32_t count;
    std::string why;
};

// The worker count for a compile job on this machine (EMUHOST_ALLOCATOR_*).
inline Workers prepare_workers(std::uint32_t allocator) {
    Workers w{0, {}};
    w.why = detail::text([&](char *b, std::size_t c, std::size_t *l) { return emuhost_prepare_workers(allocator, &w.count, b, c, l); });
    return w;
}

// emuhost's log lines to `callback` (see emuhost_set_log_callback); nullptr stops them.
inline void set_log_callback(emuhost_log_callback_t callback, void *user) { detail::check(emuhost_set_log_callback(callback, user)); }
inline void set_log_level(std::uint32_t level) { detail::check(emuhost_set_log_level(level)); }
// The log filter in EMUHOST_LOG's syntax; nullptr or "" change nothing; the later of this and
// set_log_level wins (see emuhost_set_log_filter).
inline void set_log_filter(const char *filter) { detail::check(emuhost_set_log_filter(filter)); }
// Waits until the lines logged so far reached the callback (see emuhost_log_flush).
inline void log_flush() noexcept { emuhost_log_flush(); }

}  // namespace emuhost

#endif
