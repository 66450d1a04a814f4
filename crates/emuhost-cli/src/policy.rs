//! `emuhost policy`: the short-sleep rule and the compile-worker count, as one JSON object:
//! `{"schema":1,"short_sleep":{"guest":"timer"|"yield","host":"timer"|"yield"|"hybrid"},"prepare_workers":N,"why":"..."}`.
//! Other tools depend on that shape ([`Report`]; the keys in that order). Without flags it reports this machine; each flag stands in for
//! what the machine would say. Bad values are refused by the argument parser: exit 2, naming them.

use emuhost::sched::{
    Allocator, HOST_EXACT_WAIT, Machine, OsHost, SchedHost, ShortSleepRule, TIMER_MAX_CPUS, prepare_workers,
};

use crate::Outcome;

#[derive(clap::Args)]
pub struct Args {
    /// Logical processors in the affinity mask, instead of this machine's. Also the usable CPUs
    /// for the workers: this machine's cgroup CPU quota is not applied then.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    cpus: Option<u64>,
    /// Available memory in MiB, instead of this machine's `MemAvailable`.
    #[arg(long, value_name = "M", allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(0..=u64::MAX >> 20))]
    available_mib: Option<u64>,
    /// Whether the allocator scales with threads allocating at once. Default: `scales` in a build
    /// with the `mimalloc` feature or on Windows where the process heap is the segment heap,
    /// `locked` otherwise.
    #[arg(long, value_enum)]
    allocator: Option<AllocatorArg>,
    /// The value of EMUHOST_SHORT_SLEEP_TIMER: given (even empty) means the switch is set to it;
    /// absent means unset (the environment is not read).
    #[arg(long, value_name = "VALUE", allow_hyphen_values = true)]
    short_sleep_timer: Option<String>,
}

/// The version of `policy`'s keys (raised when one changes name or meaning or goes away).
pub const SCHEMA: u32 = 1;

/// `policy`'s object; the fields in the contract's order.
#[derive(Debug, serde::Serialize)]
struct Report {
    schema: u32,
    short_sleep: ShortSleep,
    prepare_workers: usize,
    why: String,
}

/// The wait of each caller's short sleeps (`timer`, `yield`, `hybrid`).
#[derive(Debug, serde::Serialize)]
struct ShortSleep {
    guest: &'static str,
    host: &'static str,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum AllocatorArg {
    Scales,
    Locked,
}

pub fn run(a: Args) -> anyhow::Result<Outcome> {
    let cpus = match a.cpus {
        Some(n) => Some(n as usize),
        None => OsHost.affinity_cpus(),
    };
    let rule = ShortSleepRule::decide(
        a.short_sleep_timer.as_deref().map(emuhost::settings::switch_on),
        cpus,
        TIMER_MAX_CPUS,
        HOST_EXACT_WAIT,
    )
    // The machine's own: where it has no timer (Windows before 10 1803), short sleeps yield.
    .without_timer(OsHost.timer_missing());
    let allocator = match a.allocator {
        Some(AllocatorArg::Scales) => Allocator::Scales,
        Some(AllocatorArg::Locked) => Allocator::Locked,
        None => crate::prepare::own_allocator().0,
    };
    let workers = if a.cpus.is_none() && a.available_mib.is_none() {
        Machine::read().prepare_workers(allocator)
    } else {
        let machine = Machine::read();
        let usable = a.cpus.map_or_else(|| machine.usable_cpus(), |n| n as usize);
        let available = a.available_mib.map_or(machine.available_bytes.unwrap_or(0), |m| m << 20);
        let mut w = prepare_workers(usable, available, allocator);
        let from = |flag: bool| if flag { "given" } else { "this machine's" };
        w.why = format!("{} [CPUs {}, memory {}]", w.why, from(a.cpus.is_some()), from(a.available_mib.is_some()));
        w
    };
    let why = format!("short sleeps: {}. workers: {}", rule.why(), workers.why);
    let report = Report {
        schema: SCHEMA,
        short_sleep: ShortSleep { guest: rule.guest.name(), host: rule.host.name() },
        prepare_workers: workers.count,
        why,
    };
    outln!("{}", serde_json::to_string(&report)?);
    Ok(Outcome::Ok)
}
