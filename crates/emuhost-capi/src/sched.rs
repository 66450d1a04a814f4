//! `emuhost_sleeper_t` (short sleeps for the guest and the host, `emuhost::sched`) and the
//! compile-worker count.

use std::ffi::c_char;
use std::sync::Arc;
use std::time::Duration;

use emuhost::sched::{Allocator, Caller, Machine, OsHost, Sleeper, Wait};

use crate::entry;
use crate::error::{Error, emuhost_error_t};
use crate::ffi::{put, put_str};
use crate::handle::{self, Kind};
use crate::settings::emuhost_settings_t;

/// A sleep of the game's own (`emuhost_sleeper_sleep`).
pub const EMUHOST_CALLER_GUEST: u32 = 0;
/// A sleep of the host's: frame limiter, audio, timer events.
pub const EMUHOST_CALLER_HOST: u32 = 1;

/// One timer wait: the thread sleeps, and wakes tens of microseconds late.
pub const EMUHOST_WAIT_TIMER: u32 = 0;
/// Yields until the deadline: exact, and keeps a CPU busy.
pub const EMUHOST_WAIT_YIELD: u32 = 1;
/// A timer wait until a margin before the deadline, then yields.
pub const EMUHOST_WAIT_HYBRID: u32 = 2;

/// The allocator serialises threads that allocate at once.
pub const EMUHOST_ALLOCATOR_LOCKED: u32 = 0;
/// The allocator scales with threads (per-thread heaps: mimalloc).
pub const EMUHOST_ALLOCATOR_SCALES: u32 = 1;

/// A sleeper (opaque): decides the short-sleep rule once (at its first sleep or rule query) and
/// logs it once.
///
/// Thread safety: every call may be made from any thread, concurrently.
pub struct emuhost_sleeper_t {
    _private: [u8; 0],
}

pub(crate) struct Sleep(Sleeper<OsHost>);

impl Kind for Sleep {
    type C = emuhost_sleeper_t;
    const NAME: &'static str = "sleeper";
}

/// The short-sleep rule (`emuhost_sleeper_rule`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct emuhost_sleep_rule_t {
    /// How the guest's short sleeps wait (`EMUHOST_WAIT_*`).
    pub guest: u32,
    /// How the host's short sleeps wait.
    pub host: u32,
    /// Logical processors in the affinity mask the rule was decided with; 0 where unknown.
    pub cpus: u32,
}

fn wait_code(w: Wait) -> u32 {
    match w {
        Wait::Timer => EMUHOST_WAIT_TIMER,
        Wait::Yield => EMUHOST_WAIT_YIELD,
        Wait::Hybrid => EMUHOST_WAIT_HYBRID,
    }
}

/// A sleeper with the settings' `EMUHOST_SHORT_SLEEP_TIMER` (`settings` may be NULL: unset, the
/// rule by processor count).
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_sleeper_new(
    settings: *const emuhost_settings_t,
    out: *mut *mut emuhost_sleeper_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = crate::settings::read(settings, "emuhost_sleeper_new")?;
        let sleeper = s.sleeper_builder().build(OsHost);
        // SAFETY: as the caller vouches.
        unsafe { handle::give(out, Arc::new(Sleep(sleeper))) }
    })
}

/// [`emuhost_sleeper_new`] with the host's exact wait chosen: how the host's short sleeps wait
/// where the settings leave it to the rule (`EMUHOST_SHORT_SLEEP_TIMER` unset; set, it decides
/// every short sleep). `host_wait` (`EMUHOST_WAIT_*`): `EMUHOST_WAIT_YIELD`, the default of
/// `emuhost_sleeper_new` (exact, keeps a CPU busy); `EMUHOST_WAIT_HYBRID`, a timer wait until a
/// margin before the deadline that the sleeper learns from the timer's lateness, then yields
/// (nearly exact at a fraction of the CPU; the host's sleeps of a millisecond or more wait so too:
/// docs/sched.md has the measurements); or `EMUHOST_WAIT_TIMER`.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_sleeper_new_host_wait(
    settings: *const emuhost_settings_t,
    host_wait: u32,
    out: *mut *mut emuhost_sleeper_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = crate::settings::read(settings, "emuhost_sleeper_new_host_wait")?;
        let wait = match host_wait {
            EMUHOST_WAIT_TIMER => Wait::Timer,
            EMUHOST_WAIT_YIELD => Wait::Yield,
            EMUHOST_WAIT_HYBRID => Wait::Hybrid,
            _ => {
                return Err(Error::invalid(format!(
                    "host wait {host_wait} is not one of EMUHOST_WAIT_TIMER (0), _YIELD (1), _HYBRID (2)"
                )));
            }
        };
        let sleeper = s.sleeper_builder().host_exact(wait).build(OsHost);
        // SAFETY: as the caller vouches.
        unsafe { handle::give(out, Arc::new(Sleep(sleeper))) }
    })
}

/// Deletes a sleeper. NULL does nothing; a handle deleted already is `EMUHOST_ERROR_BAD_HANDLE`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_sleeper_delete(sleeper: *mut emuhost_sleeper_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<Sleep>(sleeper))
}

/// The longest sleep [`emuhost_sleeper_sleep`] takes: 1 s (the replay's cap on one sleep too).
/// It is a short-sleep call, and a sleep cannot be cut short: longer waits belong on the
/// caller's own timer or in several calls. A longer one, most often a negative count cast to
/// unsigned, is `EMUHOST_ERROR_INVALID_ARGUMENT`.
pub const EMUHOST_SLEEP_MAX_NS: u64 = 1_000_000_000;

/// Sleeps `ns` nanoseconds for `caller` (`EMUHOST_CALLER_*`): under a millisecond by the rule,
/// longer on the timer. `ns` over [`EMUHOST_SLEEP_MAX_NS`] (1 s) is
/// `EMUHOST_ERROR_INVALID_ARGUMENT`, at once.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_sleeper_sleep(
    sleeper: *const emuhost_sleeper_t,
    caller: u32,
    ns: u64,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = handle::get::<Sleep>(sleeper, "emuhost_sleeper_sleep")?;
        let caller = match caller {
            EMUHOST_CALLER_GUEST => Caller::Guest,
            EMUHOST_CALLER_HOST => Caller::Host,
            _ => return Err(Error::invalid(format!("caller {caller} is not EMUHOST_CALLER_GUEST or _HOST"))),
        };
        if ns > EMUHOST_SLEEP_MAX_NS {
            return Err(Error::invalid(format!(
                "emuhost_sleeper_sleep: a sleep of {ns} ns is longer than EMUHOST_SLEEP_MAX_NS ({EMUHOST_SLEEP_MAX_NS} ns, \
                 1 s){}",
                if ns > i64::MAX as u64 {
                    format!(" (as signed: {} ns, a negative count cast?)", ns as i64)
                } else {
                    String::new()
                }
            )));
        }
        s.0.sleep(caller, Duration::from_nanos(ns));
        Ok(())
    })
}

/// The short-sleep rule (decided now if no sleep has decided it yet), and why in words in `why`
/// (as `snprintf`; `why_len` receives the full length, may be NULL; `why` may be NULL when `cap`
/// is 0).
///
/// # Safety
/// `rule` is NULL or writable; `why` points to `cap` writable bytes; `why_len` is NULL or
/// writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_sleeper_rule(
    sleeper: *const emuhost_sleeper_t,
    rule: *mut emuhost_sleep_rule_t,
    why: *mut c_char,
    cap: usize,
    why_len: *mut usize,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = handle::get::<Sleep>(sleeper, "emuhost_sleeper_rule")?;
        let r = s.0.rule();
        let out = emuhost_sleep_rule_t {
            guest: wait_code(r.guest),
            host: wait_code(r.host),
            cpus: r.cpus.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
        };
        // SAFETY: as the caller vouches.
        unsafe {
            crate::ffi::put_opt(rule, "rule", out)?;
            put_str(&r.why(), why, cap, why_len, "why")
        }
    })
}

/// The name of an `EMUHOST_WAIT_*` value (`"timer"`, `"yield"`, `"hybrid"`; static storage), or
/// NULL for a value that is none.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_wait_name(wait: u32) -> *const c_char {
    match wait {
        EMUHOST_WAIT_TIMER => c"timer".as_ptr(),
        EMUHOST_WAIT_YIELD => c"yield".as_ptr(),
        EMUHOST_WAIT_HYBRID => c"hybrid".as_ptr(),
        _ => std::ptr::null(),
    }
}

/// The worker count for a compile job on this machine (usable CPUs from the affinity mask and the
/// cgroup quota, available memory, and whether `allocator`, `EMUHOST_ALLOCATOR_*`, scales), and
/// why in words in `why` (as `emuhost_sleeper_rule`). Logged once per call.
///
/// # Safety
/// `count` is NULL or writable; `why` points to `cap` writable bytes; `why_len` is NULL or
/// writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_prepare_workers(
    allocator: u32,
    count: *mut u32,
    why: *mut c_char,
    cap: usize,
    why_len: *mut usize,
) -> *mut emuhost_error_t {
    entry(|| {
        let allocator = match allocator {
            EMUHOST_ALLOCATOR_LOCKED => Allocator::Locked,
            EMUHOST_ALLOCATOR_SCALES => Allocator::Scales,
            _ => {
                return Err(Error::invalid(format!(
                    "allocator {allocator} is not EMUHOST_ALLOCATOR_LOCKED or _SCALES"
                )));
            }
        };
        crate::ffi::check_ptr(count, "count")?;
        let w = Machine::read().prepare_workers(allocator);
        // SAFETY: as the caller vouches.
        unsafe {
            put(count, "count", u32::try_from(w.count).unwrap_or(u32::MAX))?;
            put_str(&w.why, why, cap, why_len, "why")
        }
    })
}
