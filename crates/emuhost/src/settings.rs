//! Every `EMUHOST_*` switch, defined once: [`SETTINGS`] gives each its name, its default (as the
//! README's table states it), a line of documentation and its parser, which sets the typed field
//! of [`Settings`]. The library reads no environment variable of its own accord: a caller that
//! wants the switches of the environment asks for [`Settings::from_env`] (the CLI does; an
//! emulator that embeds emuhost builds its `Settings` in code). [`Settings::set`],
//! [`Settings::from_lookup`] and [`Settings::from_env`] are one code path, and an error names
//! the switch and the value.
//!
//! ```
//! use emuhost::settings::{SettingError, Settings};
//!
//! // An embedder sets switches in code; a CLI would call `Settings::from_env()`.
//! let mut s = Settings::default();
//! s.set("EMUHOST_SHORT_SLEEP_TIMER", "1").unwrap();
//! assert_eq!(s.short_sleep_timer, Some(true));
//! let e = s.set("EMUHOST_IMPORT_BACKEND", "opengl").unwrap_err();
//! assert!(matches!(e, SettingError::Bad { name: "EMUHOST_IMPORT_BACKEND", .. }), "{e}");
//! assert!(matches!(s.set("EMUHOST_NOPE", "1"), Err(SettingError::Unknown { .. })));
//!
//! // The same from any lookup (a config file, a test's map).
//! let s = Settings::from_lookup(|name| (name == "EMUHOST_VERIFY_COLLECT").then(|| "1".into())).unwrap();
//! assert!(s.verify_collect);
//! ```

use crate::faults::FaultSettings;
use std::time::Duration;

use crate::import::{
    BackendChoice, ChunksConfig, ImportConfig, ImportCost, ImportPolicy, PlanConfig, PoolsConfig, PopulateAhead,
};
use crate::watch::{BackendKind, TrackerConfig, VERIFY_SWITCH};

/// The switch that forces a write-tracking backend ([`TrackerConfig::backend`]).
pub const WATCH_SWITCH: &str = "EMUHOST_WATCH";

/// Reads an `EMUHOST_IMPORT_BACKEND` value (trimmed, any case; empty is `auto`).
///
/// # Errors
/// A value other than `auto`, `vulkan`, `cuda` or `pin`: the message names the switch and value.
pub fn parse_import_backend(value: &str) -> Result<BackendChoice, String> {
    use crate::import::BackendKind as Kind;
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(BackendChoice::Auto),
        "vulkan" => Ok(BackendChoice::Only(Kind::Vulkan)),
        "cuda" => Ok(BackendChoice::Only(Kind::Cuda)),
        "pin" => Ok(BackendChoice::Only(Kind::Pin)),
        _ => Err(format!("EMUHOST_IMPORT_BACKEND={value:?}: expected auto, vulkan, cuda or pin")),
    }
}

/// Reads an `EMUHOST_WATCH` value (trimmed, any case; empty is unset): the backend it forces.
///
/// # Errors
/// A name that is no backend, another platform's backend (`uffd` on Windows, `writewatch` on
/// Linux), or the retired `softdirty`: the message names the switch, the value and why.
pub fn parse_watch(value: &str) -> Result<Option<BackendKind>, String> {
    let bad = |why: &str| format!("{WATCH_SWITCH}={value:?} {why}");
    let here = || BackendKind::AUTO.map(BackendKind::name).join(", ");
    let name = value.trim().to_ascii_lowercase();
    if let Some(kind) = BackendKind::ALL.into_iter().find(|k| k.name() == name) {
        return if BackendKind::AUTO.contains(&kind) {
            Ok(Some(kind))
        } else {
            Err(bad(&format!("is another platform's backend; this one has {}", here())))
        };
    }
    match name.as_str() {
        "" => Ok(None),
        "softdirty" => Err(bad(
            "is no longer offered: soft-dirty bits cannot be read and cleared in one step, so it lost writes made \
             during a collect (use mprotect on kernels without uffd WP_ASYNC)",
        )),
        _ => Err(bad(&format!("is not one of {}", here()))),
    }
}

/// The log filter switch (`tracing`'s `EnvFilter` syntax). The library keeps its text; the CLI
/// checks and applies it.
pub const LOG_SWITCH: &str = "EMUHOST_LOG";

/// The switch that sets [`Settings::watch_published_layout`].
pub const PUBLISHED_LAYOUT_SWITCH: &str = "EMUHOST_WATCH_PUBLISHED_LAYOUT";
/// The short-sleep switch (see [`crate::sched`]).
pub const SHORT_SLEEP_TIMER_SWITCH: &str = crate::sched::SHORT_SLEEP_TIMER_VAR;

/// How the host layer is set up: one typed field per switch. [`Default`] is the documented
/// defaults (no environment is read).
///
/// ```
/// use emuhost::sched::{Caller, OsHost, Wait};
/// use emuhost::settings::Settings;
///
/// let mut s = Settings::default();
/// s.set("EMUHOST_SHORT_SLEEP_TIMER", "0").unwrap();
/// // The parts each module is made with.
/// let sleeper = s.sleeper_builder().build(OsHost);
/// assert_eq!(sleeper.rule().wait_for(Caller::Guest), Wait::Yield);
/// let _tracker_config = s.tracker_config();
/// let _import_config = s.import_config();
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settings {
    /// `EMUHOST_LOG`: the log filter, for the program that installs the subscriber.
    pub log: String,
    /// `EMUHOST_WATCH`: the write-tracking backend forced (it must pass its self-test); `None`:
    /// the first of [`BackendKind::AUTO`] that passes.
    pub watch: Option<BackendKind>,
    /// `EMUHOST_VERIFY_COLLECT`: check every collect against a region query.
    pub verify_collect: bool,
    /// `EMUHOST_WATCH_PUBLISHED_LAYOUT`: collects read the layout the space publishes instead of
    /// waiting for its lock ([`TrackerConfig::published_layout`]).
    pub watch_published_layout: bool,
    /// `EMUHOST_SHORT_SLEEP_TIMER`: `None` (unset): the rule by processor count; `Some(true)`:
    /// every short sleep on the timer; `Some(false)`: every short sleep yields.
    pub short_sleep_timer: Option<bool>,
    /// `EMUHOST_IMPORT_BACKEND`.
    pub import_backend: BackendChoice,
    /// `EMUHOST_IMPORT_POLICY`, `_CHUNK_MB`, `_SPAN_MB`, `_COOLING_MS`, `_POPULATE_AHEAD`, and
    /// the pools policy's `_AHEAD_MB`, `_AHEAD_THREADS`, `_AHEAD_PIECE_KB`, `_MERGE_MB`, `_WAIT_US`,
    /// `_COST_US`
    /// ([`Settings::import_config`] is the importer's config).
    pub import: ImportSettings,
    /// `EMUHOST_FAULT_*`: the fault plan for the process (see [`crate::faults::install`]).
    pub faults: FaultSettings,
    /// `EMUHOST_SNAPSHOT_BUDGET_MB`, in bytes: the most bytes of page copies snapshots keep
    /// ([`Settings::snapshot_config`]); `None`: no limit.
    pub snapshot_budget: Option<u64>,
    /// `EMUHOST_SNAPSHOT_MODE`: how snapshots keep the bytes ([`Settings::snapshot_config`]).
    pub snapshot_mode: crate::snapshot::SnapshotMode,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            log: "info".to_string(),
            watch: None,
            verify_collect: false,
            watch_published_layout: true,
            short_sleep_timer: None,
            import_backend: BackendChoice::Auto,
            import: ImportSettings::default(),
            faults: FaultSettings::default(),
            snapshot_budget: None,
            snapshot_mode: crate::snapshot::SnapshotMode::default(),
        }
    }
}

/// A switch: its name, its default as the README states it, what it does, and its parser.
#[derive(Clone, Copy)]
pub struct Switch {
    /// The variable's name (`EMUHOST_...`).
    pub name: &'static str,
    /// Its default, as the README's table writes it.
    pub default: &'static str,
    /// What it does, in one line (the README's table and `emuhost policy`).
    pub doc: &'static str,
    apply: fn(&mut Settings, &str) -> Result<(), String>,
}

impl std::fmt::Debug for Switch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// What is wrong with a switch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingError {
    /// A name that is no switch of [`SETTINGS`] (the nearest one suggested where one is near).
    #[error("{name:?} is not a switch emuhost reads{}", unknown_hint(name))]
    Unknown {
        /// The name given.
        name: String,
    },
    /// A value the switch refuses. `why` names the switch and the value.
    #[error("{why}")]
    Bad {
        /// The switch.
        name: &'static str,
        /// The value given.
        value: String,
        /// Why it is refused, naming both.
        why: String,
    },
    /// A switch set in the environment to bytes that are not UTF-8 ([`Settings::from_env`]).
    #[error("{name} is not valid UTF-8")]
    NotUnicode {
        /// The switch.
        name: &'static str,
    },
}

/// The one on/off parser (trimmed, any case): `1`, `true`, `on`, `yes` are on; `0`, `false`,
/// `off`, `no` and the empty string are off; anything else is `None`, which each switch treats
/// as its doc says (an error for most).
pub fn on_off(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "" | "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

/// Whether a set switch's value means "on" (the short-sleep switch's reading): `0`, `false`,
/// `off`, `no` and the empty string (trimmed, any case) are off; any other value is on.
pub fn switch_on(value: &str) -> bool {
    on_off(value) != Some(false)
}

/// Sets the fault switch `name` to `value` (empty: unset); a bad value is an error naming both.
#[cfg(feature = "faults")]
fn fault(s: &mut Settings, name: &'static str, value: &str) -> Result<(), String> {
    use crate::faults::{
        COMMIT_SWITCH, FOREIGN_SEGV_SWITCH, FaultError, IMPORT_ABOVE_SWITCH, IMPORT_COST_SWITCH, IMPORT_SWITCH,
        NO_POPULATE_WRITE_SWITCH, NO_PROCMAP_QUERY_SWITCH, UFFD_SWITCH, UffdFault,
    };
    let bad = |why: String| FaultError::BadSwitch { name, value: value.to_string(), why }.to_string();
    let v = value.trim();
    let flag = || on_off(v).ok_or_else(|| bad("expected 1 or 0".into()));
    let plan = &mut s.faults.plan;
    match name {
        IMPORT_SWITCH => plan.import = v.parse().map_err(bad)?,
        IMPORT_ABOVE_SWITCH if v.is_empty() => plan.import_above = None,
        IMPORT_ABOVE_SWITCH => {
            let mb: u64 = v.parse().map_err(|_| bad("MiB as an integer".into()))?;
            plan.import_above = Some(mb.checked_mul(1 << 20).ok_or_else(|| bad("too large".into()))?);
        }
        COMMIT_SWITCH => plan.commit_enomem = v.parse().map_err(bad)?,
        IMPORT_COST_SWITCH if v.is_empty() => plan.import_cost = None,
        IMPORT_COST_SWITCH => plan.import_cost = Some(v.parse().map_err(bad)?),
        UFFD_SWITCH => {
            plan.uffd = match v.to_ascii_lowercase().as_str() {
                "" => None,
                "eperm" => Some(UffdFault::Eperm),
                "enosys" => Some(UffdFault::Enosys),
                _ => return Err(bad("expected eperm or enosys".into())),
            }
        }
        FOREIGN_SEGV_SWITCH => s.faults.foreign = flag()?,
        NO_PROCMAP_QUERY_SWITCH => plan.no_procmap_query = flag()?,
        NO_POPULATE_WRITE_SWITCH => plan.no_populate_write = flag()?,
        _ => return Err(bad("not a fault switch".into())),
    }
    Ok(())
}

/// A build without fault injection refuses a set fault switch (naming it), so that a run meant
/// to be under a fault does not pass silently without one; an empty value is unset.
#[cfg(not(feature = "faults"))]
fn fault(_: &mut Settings, name: &'static str, value: &str) -> Result<(), String> {
    match value.is_empty() {
        true => Ok(()),
        false => Err(crate::faults::FaultError::NotBuilt { name }.to_string()),
    }
}

fn import(s: &mut Settings, name: &'static str, v: &str) -> Result<(), String> {
    s.import.set(name, v)
}

/// The switches, in the README's order.
pub const SETTINGS: &[Switch] = &[
    Switch {
        name: LOG_SWITCH,
        default: "`info`",
        doc: "log filter (`tracing`'s `EnvFilter` syntax), to stderr",
        apply: |s, v| {
            s.log = v.to_string();
            Ok(())
        },
    },
    Switch {
        name: WATCH_SWITCH,
        default: "unset (self-test: `uffd`, then `mprotect`; on Windows `writewatch`, then `guard`)",
        doc: "force a write-tracking backend: `uffd` or `mprotect`; empty is as unset",
        apply: |s, v| {
            s.watch = parse_watch(v)?;
            Ok(())
        },
    },
    Switch {
        name: VERIFY_SWITCH,
        default: "unset (off)",
        doc: "on/off: check every collect against a region query",
        apply: |s, v| {
            s.verify_collect = on_off(v)
                .ok_or_else(|| format!("{VERIFY_SWITCH}={v:?} is not one of 1, true, on, yes, 0, false, off, no"))?;
            Ok(())
        },
    },
    Switch {
        name: PUBLISHED_LAYOUT_SWITCH,
        default: "`1` (on)",
        doc: "on/off: collects read the layout the space publishes, never waiting for its lock",
        apply: |s, v| {
            // Empty is as unset (on), not off.
            s.watch_published_layout = v.trim().is_empty()
                || on_off(v).ok_or_else(|| {
                    format!("{PUBLISHED_LAYOUT_SWITCH}={v:?} is not one of 1, true, on, yes, 0, false, off, no")
                })?;
            Ok(())
        },
    },
    Switch {
        name: SHORT_SLEEP_TIMER_SWITCH,
        default: "unset",
        doc: "unset: the rule by processor count; set: off words make every short sleep yield, any other \
              value puts every one on the timer",
        // Any value means something: an off word yields, anything else the timer.
        apply: |s, v| {
            s.short_sleep_timer = Some(switch_on(v));
            Ok(())
        },
    },
    Switch {
        name: "EMUHOST_IMPORT_BACKEND",
        default: "`auto`",
        doc: "`auto` (Vulkan, then CUDA, then pin), `vulkan`, `cuda` or `pin`",
        apply: |s, v| {
            s.import_backend = parse_import_backend(v)?;
            Ok(())
        },
    },
    Switch {
        name: "EMUHOST_IMPORT_POLICY",
        default: "`pools` (`chunks` on Windows)",
        doc: "`pools` (a binding's pools, exactly, imported ahead where bindings come) or `chunks` (the seed's chunks and spans)",
        apply: |s, v| import(s, "EMUHOST_IMPORT_POLICY", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_CHUNK_MB",
        default: "`16`",
        doc: "import chunk in MiB (a power of two); under `pools`, the size of the regions where bindings are watched for",
        apply: |s, v| import(s, "EMUHOST_IMPORT_CHUNK_MB", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_SPAN_MB",
        default: "`64`",
        doc: "`chunks` policy: span cap in MiB; `0` turns spans off",
        apply: |s, v| import(s, "EMUHOST_IMPORT_SPAN_MB", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_COOLING_MS",
        default: "`1000`",
        doc: "how long a range that failed to import is held before it is tried again",
        apply: |s, v| import(s, "EMUHOST_IMPORT_COOLING_MS", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_POPULATE_AHEAD",
        default: "`off`",
        doc: "`off`, `pools` (or `on`) or `chunks`: fault pages in on a background thread",
        apply: |s, v| import(s, "EMUHOST_IMPORT_POPULATE_AHEAD", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_AHEAD_MB",
        default: "`256`",
        doc: "`pools` policy: MiB imported ahead of use on a background thread and not yet bound; `0` is off",
        apply: |s, v| import(s, "EMUHOST_IMPORT_AHEAD_MB", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_AHEAD_THREADS",
        default: "`0`",
        doc: "`pools` policy: background import threads; `0` is a quarter of the processors, one to four",
        apply: |s, v| import(s, "EMUHOST_IMPORT_AHEAD_THREADS", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_AHEAD_PIECE_KB",
        default: "`4096`",
        doc: "`pools` policy: the most KiB a background thread imports at once; a larger pool is imported in overlapping pieces; `0` imports pools whole",
        apply: |s, v| import(s, "EMUHOST_IMPORT_AHEAD_PIECE_KB", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_MERGE_MB",
        default: "`64`",
        doc: "`pools` policy: where the live imports are at half the cap or more, the largest range a background thread imports in one where a pool is whole in several of them (its pieces then go); a larger pool is merged in slices of this size; `0`: no merges",
        apply: |s, v| import(s, "EMUHOST_IMPORT_MERGE_MB", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_WAIT_US",
        default: "`400`",
        doc: "`pools` policy: the longest a binding should wait for an import; past it a binding imports only its part of a pool",
        apply: |s, v| import(s, "EMUHOST_IMPORT_WAIT_US", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_COST_US",
        default: "unset",
        doc: "`pools` policy: the import cost as `FIXED,UNTOUCHED,POPULATED` µs (an import, a MiB untouched, a MiB populated), used as given instead of measured at start",
        apply: |s, v| import(s, "EMUHOST_IMPORT_COST_US", v),
    },
    Switch {
        name: "EMUHOST_IMPORT_MAX_LIVE",
        default: "unset",
        doc: "the most live imports (at least 1; unset: the backend's limit, Vulkan's `maxMemoryAllocationCount`, which also bounds a value given); past it an import releases imports no binding needs, merges with a neighbour's, or its binding goes without",
        apply: |s, v| import(s, "EMUHOST_IMPORT_MAX_LIVE", v),
    },
    Switch {
        name: "EMUHOST_SNAPSHOT_BUDGET_MB",
        default: "unset",
        doc: "snapshots: the most MiB of page copies kept; past it the oldest snapshots are dropped first (never the newest); unset or empty: no limit",
        apply: |s, v| {
            s.snapshot_budget = switch_bytes("EMUHOST_SNAPSHOT_BUDGET_MB", v, 1 << 20)?;
            Ok(())
        },
    },
    Switch {
        name: "EMUHOST_SNAPSHOT_MODE",
        default: "`take`",
        doc: "snapshots: `take` (a take copies the pages written since the previous one) or `cow` (copy before write: a take copies nothing, each page is copied before its first write after it; the `mprotect` and `guard` backends only)",
        apply: |s, v| {
            use crate::snapshot::SnapshotMode;
            s.snapshot_mode = match v.trim().to_ascii_lowercase().as_str() {
                "" | "take" => SnapshotMode::CopyAtTake,
                "cow" => SnapshotMode::CopyBeforeWrite,
                _ => return Err(format!("EMUHOST_SNAPSHOT_MODE={v:?}: expected take or cow")),
            };
            Ok(())
        },
    },
    Switch {
        name: crate::faults::IMPORT_SWITCH,
        default: "unset",
        doc: "faults: which imports fail (a schedule)",
        apply: |s, v| fault(s, crate::faults::IMPORT_SWITCH, v),
    },
    Switch {
        name: crate::faults::IMPORT_ABOVE_SWITCH,
        default: "unset",
        doc: "faults: imports of more than this many MiB fail",
        apply: |s, v| fault(s, crate::faults::IMPORT_ABOVE_SWITCH, v),
    },
    Switch {
        name: crate::faults::COMMIT_SWITCH,
        default: "unset",
        doc: "faults: which commit system calls fail with ENOMEM (a schedule)",
        apply: |s, v| fault(s, crate::faults::COMMIT_SWITCH, v),
    },
    Switch {
        name: crate::faults::UFFD_SWITCH,
        default: "unset",
        doc: "faults: `eperm` or `enosys`: opening a userfaultfd fails so",
        apply: |s, v| fault(s, crate::faults::UFFD_SWITCH, v),
    },
    Switch {
        name: crate::faults::FOREIGN_SEGV_SWITCH,
        default: "unset",
        doc: "faults: on/off: a foreign SIGSEGV handler and fault before every collect",
        apply: |s, v| fault(s, crate::faults::FOREIGN_SEGV_SWITCH, v),
    },
    Switch {
        name: crate::faults::NO_PROCMAP_QUERY_SWITCH,
        default: "unset",
        doc: "faults: on/off: region queries read /proc/self/maps",
        apply: |s, v| fault(s, crate::faults::NO_PROCMAP_QUERY_SWITCH, v),
    },
    Switch {
        name: crate::faults::NO_POPULATE_WRITE_SWITCH,
        default: "unset",
        doc: "faults: on/off: populates touch each page",
        apply: |s, v| fault(s, crate::faults::NO_POPULATE_WRITE_SWITCH, v),
    },
    Switch {
        name: crate::faults::IMPORT_COST_SWITCH,
        default: "unset",
        doc: "faults: `FIXED,PER_MIB` µs: every import holds one process-wide lock and sleeps that long (a driver that serializes imports)",
        apply: |s, v| fault(s, crate::faults::IMPORT_COST_SWITCH, v),
    },
];

/// `EMUHOST_*` names the README's table lists that are not settings of the library: the test
/// suite and CI read them (name, default as the README states it).
pub const TEST_SWITCHES: &[(&str, &str)] = &[
    ("EMUHOST_REQUIRE_VULKAN", "unset"),
    ("EMUHOST_REQUIRE_CUDA", "unset"),
    ("EMUHOST_FUZZ_SECONDS", "`10`"),
    ("EMUHOST_CI_WINDOWS", "`1`"),
];

/// The switches' names, in the README's order.
pub fn names() -> Vec<&'static str> {
    SETTINGS.iter().map(|s| s.name).collect()
}

/// The switch whose name is nearest `name` (a typo's few letters away: at most 3 edits, and fewer
/// than a third of the name), if one is.
pub fn nearest(name: &str) -> Option<&'static str> {
    let limit = (name.chars().count() / 3).min(3);
    SETTINGS.iter().map(|s| (edits(name, s.name), s.name)).filter(|&(d, _)| d <= limit).min().map(|(_, n)| n)
}

/// Levenshtein distance (insertions, deletions and substitutions) of two names, ignoring case.
fn edits(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.to_uppercase().chars().collect(), b.chars().collect());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            (diag, row[j + 1]) = (row[j + 1], next);
        }
    }
    row[b.len()]
}

/// What [`SettingError::Unknown`] adds: the nearest switch, and the switches.
fn unknown_hint(name: &str) -> String {
    let near = nearest(name).map_or(String::new(), |n| format!(": did you mean {n}?"));
    format!("{near} (one of {})", names().join(", "))
}

impl Settings {
    /// The write tracker's config these settings make (`EMUHOST_WATCH`,
    /// `EMUHOST_VERIFY_COLLECT`, `EMUHOST_WATCH_PUBLISHED_LAYOUT`), with emuhost's own `SIGSEGV` handler.
    pub fn tracker_config(&self) -> TrackerConfig {
        TrackerConfig::default()
            .backend(self.watch)
            .verify(self.verify_collect)
            .published_layout(self.watch_published_layout)
    }

    /// The snapshots' config these settings make (`EMUHOST_SNAPSHOT_BUDGET_MB`,
    /// `EMUHOST_SNAPSHOT_MODE`).
    pub fn snapshot_config(&self) -> crate::snapshot::SnapshotConfig {
        crate::snapshot::SnapshotConfig::default().budget_bytes(self.snapshot_budget).mode(self.snapshot_mode)
    }

    /// The short-sleep builder these settings make (`EMUHOST_SHORT_SLEEP_TIMER`).
    pub fn sleeper_builder(&self) -> crate::sched::SleeperBuilder {
        crate::sched::SleeperBuilder::default().short_sleep_timer(self.short_sleep_timer)
    }

    /// Sets the switch `name` to `value` (its parser's reading of it).
    ///
    /// # Errors
    /// [`SettingError::Unknown`] for a name not in [`SETTINGS`], [`SettingError::Bad`] for a
    /// value the switch refuses, naming both.
    pub fn set(&mut self, name: &str, value: &str) -> Result<(), SettingError> {
        let s =
            SETTINGS.iter().find(|s| s.name == name).ok_or_else(|| SettingError::Unknown { name: name.to_string() })?;
        (s.apply)(self, value).map_err(|why| SettingError::Bad { name: s.name, value: value.to_string(), why })
    }

    /// The defaults, with each switch that `get` gives a value (`None`: unset) set to it.
    ///
    /// # Errors
    /// The first switch whose value is refused ([`SettingError::Bad`]).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, SettingError> {
        let mut settings = Settings::default();
        for s in SETTINGS {
            if let Some(v) = get(s.name) {
                settings.set(s.name, &v)?;
            }
        }
        Ok(settings)
    }

    /// The defaults, with each switch set in this process's environment set to its value. The
    /// only place the library reads the environment (the same on Linux and Windows).
    ///
    /// # Errors
    /// [`SettingError::NotUnicode`] for a switch set to bytes that are not UTF-8, else as
    /// [`Settings::from_lookup`].
    pub fn from_env() -> Result<Self, SettingError> {
        for s in SETTINGS {
            if let Err(std::env::VarError::NotUnicode(_)) = std::env::var(s.name) {
                return Err(SettingError::NotUnicode { name: s.name });
            }
        }
        Self::from_lookup(|name| std::env::var(name).ok())
    }
}

/// Which import policy `EMUHOST_IMPORT_POLICY` names ([`ImportPolicy`] without its settings).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ImportPolicyName {
    /// `pools` (the default): [`ImportPolicy::Pools`].
    #[default]
    Pools,
    /// `chunks`: [`ImportPolicy::Chunks`].
    Chunks,
}

/// The `EMUHOST_IMPORT_*` switches but the backend, typed. Both policies' settings are kept,
/// whichever `EMUHOST_IMPORT_POLICY` names, so that the switches may be set in any order;
/// [`Settings::import_config`] builds the importer's config from them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportSettings {
    /// `EMUHOST_IMPORT_POLICY`.
    pub policy: ImportPolicyName,
    /// `EMUHOST_IMPORT_CHUNK_MB` and `EMUHOST_IMPORT_SPAN_MB` (the chunks policy's).
    pub plan: PlanConfig,
    /// `EMUHOST_IMPORT_COOLING_MS`.
    pub cooling: Duration,
    /// `EMUHOST_IMPORT_POPULATE_AHEAD`.
    pub populate_ahead: PopulateAhead,
    /// The pools policy's: `EMUHOST_IMPORT_AHEAD_MB`, `_AHEAD_THREADS`, `_AHEAD_PIECE_KB`,
    /// `_WAIT_US` and `_COST_US`.
    pub pools: PoolsConfig,
    /// `EMUHOST_IMPORT_MAX_LIVE`.
    pub max_live: Option<u64>,
}

impl Default for ImportSettings {
    fn default() -> Self {
        let d = ImportConfig::default();
        ImportSettings {
            policy: match d.policy {
                ImportPolicy::Pools(_) => ImportPolicyName::Pools,
                ImportPolicy::Chunks(_) => ImportPolicyName::Chunks,
            },
            plan: PlanConfig::new(d.chunk, ChunksConfig::default().span_cap),
            cooling: d.cooling,
            populate_ahead: d.populate_ahead,
            pools: d.policy.pools_config().copied().unwrap_or_default(),
            max_live: d.max_live,
        }
    }
}

impl Settings {
    /// The importer's config these settings give: the policy `EMUHOST_IMPORT_POLICY` names, with
    /// its own settings.
    pub fn import_config(&self) -> ImportConfig {
        let i = &self.import;
        let policy = match i.policy {
            ImportPolicyName::Pools => ImportPolicy::Pools(i.pools),
            ImportPolicyName::Chunks => ImportPolicy::Chunks(ChunksConfig::default().span_cap(i.plan.span_cap)),
        };
        let c = ImportConfig::default().chunk(i.plan.chunk).cooling(i.cooling).populate_ahead(i.populate_ahead);
        c.policy(policy).max_live(i.max_live)
    }
}

impl ImportSettings {
    /// Sets the import switch `name` to `value` (empty: its default); a bad value is an error
    /// naming both. (Long: one arm a switch, each that switch's whole parse.)
    fn set(&mut self, name: &'static str, value: &str) -> Result<(), String> {
        let d = ImportSettings::default();
        let bad = |value: &str, why: &str| format!("{name}={value:?}: {why}");
        match name {
            "EMUHOST_IMPORT_CHUNK_MB" => {
                self.plan.chunk = d.plan.chunk;
                if let Some(mb) = switch_u64(name, value)? {
                    let bytes =
                        mb.checked_mul(1 << 20).ok_or_else(|| bad(&mb.to_string(), "too large: past 2^64 bytes"))?;
                    self.plan.chunk = Some(bytes)
                        .filter(|b| b.is_power_of_two())
                        .ok_or_else(|| bad(&mb.to_string(), "a power of two of MiB is needed"))?;
                }
            }
            "EMUHOST_IMPORT_SPAN_MB" => {
                self.plan.span_cap = switch_bytes(name, value, 1 << 20)?.unwrap_or(d.plan.span_cap);
            }
            "EMUHOST_IMPORT_COOLING_MS" => {
                self.cooling = switch_u64(name, value)?.map_or(d.cooling, Duration::from_millis);
            }
            "EMUHOST_IMPORT_AHEAD_THREADS" => {
                self.pools.ahead_threads = match switch_u64(name, value)? {
                    None => d.pools.ahead_threads,
                    Some(n) => {
                        u32::try_from(n).ok().filter(|&n| n <= 64).ok_or_else(|| bad(&n.to_string(), "at most 64"))?
                    }
                };
            }
            "EMUHOST_IMPORT_AHEAD_PIECE_KB" => {
                self.pools.ahead_piece = switch_bytes(name, value, 1 << 10)?.unwrap_or(d.pools.ahead_piece);
            }
            "EMUHOST_IMPORT_MERGE_MB" => {
                self.pools.merge = switch_bytes(name, value, 1 << 20)?.unwrap_or(d.pools.merge);
            }
            "EMUHOST_IMPORT_WAIT_US" => {
                self.pools.wait = switch_u64(name, value)?.map_or(d.pools.wait, Duration::from_micros);
            }
            "EMUHOST_IMPORT_COST_US" => {
                self.pools.cost = if value.trim().is_empty() { d.pools.cost } else { Some(import_cost(name, value)?) };
            }
            "EMUHOST_IMPORT_POLICY" => {
                self.policy = match value.trim().to_ascii_lowercase().as_str() {
                    "" => d.policy,
                    "pools" => ImportPolicyName::Pools,
                    "chunks" | "seed" => ImportPolicyName::Chunks,
                    _ => return Err(bad(value, "expected pools or chunks")),
                };
            }
            "EMUHOST_IMPORT_MAX_LIVE" => {
                self.max_live = match switch_u64(name, value)? {
                    Some(0) => return Err(bad(value, "at least 1 live import is needed")),
                    n => n,
                };
            }
            "EMUHOST_IMPORT_AHEAD_MB" => {
                self.pools.ahead = switch_bytes(name, value, 1 << 20)?.unwrap_or(d.pools.ahead);
            }
            "EMUHOST_IMPORT_POPULATE_AHEAD" => {
                self.populate_ahead = match on_off(value) {
                    Some(false) => PopulateAhead::Off,
                    Some(true) => PopulateAhead::Pools,
                    None => match value.trim().to_ascii_lowercase().as_str() {
                        "pools" => PopulateAhead::Pools,
                        "chunks" => PopulateAhead::Chunks,
                        _ => return Err(bad(value, "expected off, pools (or on) or chunks")),
                    },
                };
            }
            _ => return Err(bad(value, "not an import switch")),
        }
        Ok(())
    }
}

/// An unsigned switch's value: `None` when empty.
fn switch_u64(name: &str, value: &str) -> Result<Option<u64>, String> {
    match value.trim() {
        "" => Ok(None),
        v => v.parse().map(Some).map_err(|_| format!("{name}={value:?}: an unsigned integer is needed")),
    }
}

/// A switch in units of `unit` bytes (KiB, MiB), as bytes; one past 2^64 bytes is an error.
fn switch_bytes(name: &str, value: &str, unit: u64) -> Result<Option<u64>, String> {
    let too_large = |n: u64| format!("{name}={:?}: too large", n.to_string());
    switch_u64(name, value)?.map(|n| n.checked_mul(unit).ok_or_else(|| too_large(n))).transpose()
}

/// The most a part of `EMUHOST_IMPORT_COST_US` may be, in µs (a minute): an estimate for the
/// whole of a 128 TiB window stays within a `Duration` of nanoseconds in 64 bits.
const MOST_COST_US: u64 = 60_000_000;

/// The cost `EMUHOST_IMPORT_COST_US` (`name`) gives: three whole numbers of µs, `FIXED,UNTOUCHED,
/// POPULATED` (an import; a MiB of untouched pages; a MiB of populated ones), as
/// [`import_cost_value`] writes them.
///
/// # Errors
/// Not three comma-separated whole numbers, or one above 60000000 µs: the message names the
/// switch (`name`) and the value.
///
/// ```
/// use emuhost::settings::{import_cost, import_cost_value};
///
/// let c = import_cost("EMUHOST_IMPORT_COST_US", "40, 25,300").unwrap();
/// assert_eq!(c.fixed, std::time::Duration::from_micros(40));
/// assert_eq!(import_cost_value(&c), "40,25,300");
/// assert!(import_cost("EMUHOST_IMPORT_COST_US", "40,25").unwrap_err().contains("EMUHOST_IMPORT_COST_US"));
/// ```
pub fn import_cost(name: &str, value: &str) -> Result<ImportCost, String> {
    let bad = |why: &str| format!("{name}={value:?}: {why}");
    let parts: Vec<&str> = value.split(',').map(str::trim).collect();
    let [fixed, untouched, populated] = parts[..] else {
        return Err(bad("three numbers of µs are needed: FIXED,UNTOUCHED_PER_MIB,POPULATED_PER_MIB"));
    };
    let us = |v: &str| match v.parse::<u64>() {
        Ok(n) if n <= MOST_COST_US => Ok(Duration::from_micros(n)),
        Ok(_) => Err(bad("each part at most 60000000 µs (a minute)")),
        Err(_) => Err(bad("each part an unsigned integer of µs")),
    };
    Ok(ImportCost { fixed: us(fixed)?, untouched_per_mib: us(untouched)?, populated_per_mib: us(populated)? })
}

/// `cost` as `EMUHOST_IMPORT_COST_US` takes it (whole µs, rounded to the nearest).
pub fn import_cost_value(cost: &ImportCost) -> String {
    let us = |d: Duration| (d.as_nanos() + 500) / 1000;
    format!("{},{},{}", us(cost.fixed), us(cost.untouched_per_mib), us(cost.populated_per_mib))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The platform's protection backend (a name every platform's tests can set).
    const PROTECTION: BackendKind = if cfg!(windows) { BackendKind::Guard } else { BackendKind::Mprotect };

    /// The settings' default import config is the import module's default, the platform's
    /// policy included (chunks and spans on Windows, pools elsewhere).
    #[test]
    fn the_default_import_config_is_the_import_modules() {
        assert_eq!(Settings::default().import_config(), crate::import::ImportConfig::default());
    }

    #[test]
    fn backend_names_parse() {
        use crate::import::BackendKind;
        assert_eq!(parse_import_backend("").unwrap(), BackendChoice::Auto);
        assert_eq!(parse_import_backend(" Vulkan ").unwrap(), BackendChoice::Only(BackendKind::Vulkan));
        assert_eq!(parse_import_backend("pin").unwrap(), BackendChoice::Only(BackendKind::Pin));
        let e = parse_import_backend("gl").unwrap_err();
        assert_eq!(e, "EMUHOST_IMPORT_BACKEND=\"gl\": expected auto, vulkan, cuda or pin");
    }

    #[test]
    fn watch_names_parse_and_another_platforms_backend_is_named() {
        assert_eq!(parse_watch(" ").unwrap(), None);
        for kind in BackendKind::AUTO {
            assert_eq!(parse_watch(&kind.name().to_uppercase()).unwrap(), Some(kind));
        }
        let other = BackendKind::ALL.into_iter().find(|k| !BackendKind::AUTO.contains(k)).unwrap();
        let e = parse_watch(other.name()).unwrap_err();
        let here = BackendKind::AUTO.map(BackendKind::name).join(", ");
        assert!(e.contains("another platform's backend") && e.ends_with(&here), "{e}");
        assert!(parse_watch("dirty").unwrap_err().ends_with(&format!("is not one of {here}")));
    }

    #[test]
    fn switch_values() {
        for off in ["", " ", "0", " 0 ", "false", "FALSE", "Off", "no", "NO", "\tno\n"] {
            assert!(!switch_on(off), "{off:?} must be off");
        }
        for on in ["1", "on", "true", "yes", "timer", "2", "00", "nope", "offf"] {
            assert!(switch_on(on), "{on:?} must be on");
        }
    }

    #[cfg(feature = "faults")]
    #[test]
    fn fault_switches_make_a_plan_and_a_bad_value_is_named() {
        use crate::faults::*;
        let set = |pairs: &[(&'static str, &str)]| {
            let mut s = Settings::default();
            pairs.iter().try_for_each(|&(k, v)| s.set(k, v)).map(|()| s.faults)
        };
        assert_eq!(set(&[]).unwrap(), FaultSettings::default());
        let f = set(&[
            (IMPORT_SWITCH, "3"),
            (IMPORT_ABOVE_SWITCH, "16"),
            (COMMIT_SWITCH, "1-2"),
            (UFFD_SWITCH, "ENOSYS"),
            (FOREIGN_SEGV_SWITCH, "1"),
            (IMPORT_COST_SWITCH, "500,170"),
        ])
        .unwrap();
        let plan = f.plan;
        let us = std::time::Duration::from_micros;
        assert_eq!(plan.import_cost, Some(ImportCostModel { fixed: us(500), per_mib: us(170) }));
        let e = set(&[(IMPORT_COST_SWITCH, "500")]).unwrap_err();
        assert!(e.to_string().contains("EMUHOST_FAULT_IMPORT_COST_US=\"500\""), "{e}");
        assert!(f.foreign);
        assert_eq!(plan.import, Schedule::nth(3));
        assert_eq!(plan.import_above, Some(16 << 20));
        assert_eq!(plan.commit_enomem, Schedule::calls(1, 2));
        assert_eq!(plan.uffd, Some(UffdFault::Enosys));
        let e = set(&[(UFFD_SWITCH, "sometimes")]).unwrap_err();
        assert!(e.to_string().contains("EMUHOST_FAULT_UFFD=\"sometimes\""), "{e}");
        let e = set(&[(IMPORT_SWITCH, "0")]).unwrap_err();
        assert!(e.to_string().contains("EMUHOST_FAULT_IMPORT=\"0\""), "{e}");
        // Empty is unset.
        assert_eq!(set(&[(UFFD_SWITCH, "eperm"), (UFFD_SWITCH, " ")]).unwrap(), FaultSettings::default());
    }

    fn check(name: &str, value: &str) -> Result<Settings, SettingError> {
        let mut s = Settings::default();
        s.set(name, value).map(|()| s)
    }

    /// A default the table states as a value (`` `16` ``) is the one [`Settings::default`] has:
    /// setting the switch to it changes nothing.
    #[test]
    fn every_default_the_table_states_is_the_default() {
        let mut stated = 0;
        for s in SETTINGS {
            let Some(v) = s.default.strip_prefix('`').and_then(|d| d.strip_suffix('`')) else { continue };
            let got = check(s.name, v).unwrap_or_else(|e| panic!("{}: its default {v:?}: {e}", s.name));
            assert_eq!(got, Settings::default(), "{}={v:?}, its stated default", s.name);
            stated += 1;
        }
        assert!(stated >= 10, "{stated} switches state a default");
    }

    #[test]
    fn every_switch_accepts_empty_as_its_default_and_refuses_nonsense() {
        for s in SETTINGS {
            let got = check(s.name, "").unwrap_or_else(|e| panic!("{}: empty: {e}", s.name));
            // The sleep switch set empty is set (and off); every other one empty is its default.
            if s.name != SHORT_SLEEP_TIMER_SWITCH && s.name != LOG_SWITCH {
                assert_eq!(got, Settings::default(), "{}: empty", s.name);
            }
        }
        let mut bad = vec![
            ("EMUHOST_WATCH", PROTECTION.name(), "fast", "EMUHOST_WATCH=\"fast\" is not one of"),
            ("EMUHOST_VERIFY_COLLECT", "1", "maybe", "EMUHOST_VERIFY_COLLECT=\"maybe\" is not one of"),
            ("EMUHOST_WATCH_PUBLISHED_LAYOUT", "0", "2", "EMUHOST_WATCH_PUBLISHED_LAYOUT=\"2\" is not one of"),
            ("EMUHOST_IMPORT_BACKEND", "pin", "gpu", "EMUHOST_IMPORT_BACKEND=\"gpu\""),
            ("EMUHOST_IMPORT_CHUNK_MB", "32", "3", "EMUHOST_IMPORT_CHUNK_MB=\"3\": a power of two"),
            ("EMUHOST_IMPORT_SPAN_MB", "0", "-1", "EMUHOST_IMPORT_SPAN_MB=\"-1\": an unsigned integer"),
            ("EMUHOST_IMPORT_COOLING_MS", "10", "1s", "EMUHOST_IMPORT_COOLING_MS=\"1s\": an unsigned integer"),
            ("EMUHOST_IMPORT_POPULATE_AHEAD", "chunks", "all", "EMUHOST_IMPORT_POPULATE_AHEAD=\"all\": expected"),
            ("EMUHOST_IMPORT_AHEAD_MB", "64", "lots", "EMUHOST_IMPORT_AHEAD_MB=\"lots\": an unsigned integer"),
            // The policy that is not the platform's default (Windows': chunks).
            (
                "EMUHOST_IMPORT_POLICY",
                if cfg!(windows) { "pools" } else { "chunks" },
                "spans",
                "EMUHOST_IMPORT_POLICY=\"spans\": expected pools or chunks",
            ),
            ("EMUHOST_IMPORT_MAX_LIVE", "16", "0", "EMUHOST_IMPORT_MAX_LIVE=\"0\": at least 1 live import"),
            ("EMUHOST_SNAPSHOT_BUDGET_MB", "64", "1G", "EMUHOST_SNAPSHOT_BUDGET_MB=\"1G\": an unsigned integer"),
            ("EMUHOST_SNAPSHOT_MODE", "cow", "uffd", "EMUHOST_SNAPSHOT_MODE=\"uffd\": expected take or cow"),
            ("EMUHOST_IMPORT_WAIT_US", "1000", "1ms", "EMUHOST_IMPORT_WAIT_US=\"1ms\": an unsigned integer"),
            ("EMUHOST_IMPORT_AHEAD_THREADS", "2", "65", "EMUHOST_IMPORT_AHEAD_THREADS=\"65\": at most 64"),
            (
                "EMUHOST_IMPORT_AHEAD_PIECE_KB",
                "1024",
                "1M",
                "EMUHOST_IMPORT_AHEAD_PIECE_KB=\"1M\": an unsigned integer",
            ),
            ("EMUHOST_IMPORT_MERGE_MB", "8", "8M", "EMUHOST_IMPORT_MERGE_MB=\"8M\": an unsigned integer"),
            ("EMUHOST_IMPORT_COST_US", "30,370,50", "30,370", "EMUHOST_IMPORT_COST_US=\"30,370\": three numbers"),
            ("EMUHOST_IMPORT_COST_US", "0,0,0", "1,2,x", "EMUHOST_IMPORT_COST_US=\"1,2,x\": each part an unsigned"),
            (
                "EMUHOST_IMPORT_COST_US",
                "60000000,0,0",
                "60000001,0,0",
                "EMUHOST_IMPORT_COST_US=\"60000001,0,0\": each part at most 60000000",
            ),
        ];
        if crate::faults::ENABLED {
            bad.push(("EMUHOST_FAULT_UFFD", "eperm", "often", "EMUHOST_FAULT_UFFD=\"often\": expected eperm"));
            bad.push(("EMUHOST_FAULT_FOREIGN_SEGV", "1", "2", "EMUHOST_FAULT_FOREIGN_SEGV=\"2\": expected"));
        } else {
            bad.push(("EMUHOST_FAULT_UFFD", "", "eperm", "EMUHOST_FAULT_UFFD is set, but this build has no"));
        }
        for (name, good, bad, says) in bad {
            let set = check(name, good).unwrap();
            assert!(good.is_empty() || set != Settings::default(), "{name}={good} changes nothing");
            let e = check(name, bad).unwrap_err();
            assert!(e.to_string().starts_with(says), "{name}: {e}");
            assert!(matches!(e, SettingError::Bad { name: n, ref value, .. } if n == name && value == bad), "{e:?}");
        }
        let e = check("EMUHOST_WACTH", "uffd").unwrap_err().to_string();
        assert!(e.starts_with("\"EMUHOST_WACTH\" is not a switch") && e.contains("EMUHOST_WATCH"), "{e}");
    }

    #[test]
    fn an_unknown_switch_names_the_nearest() {
        for (typo, near) in [
            ("EMUHOST_WACTH", "EMUHOST_WATCH"),
            ("EMUHOST_IMPORT_SPAN_MIB", "EMUHOST_IMPORT_SPAN_MB"),
            ("emuhost_log", "EMUHOST_LOG"),
            ("EMUHOST_IMPORT_BACKEN", "EMUHOST_IMPORT_BACKEND"),
        ] {
            assert_eq!(nearest(typo), Some(near), "{typo}");
            let e = check(typo, "1").unwrap_err().to_string();
            assert!(e.contains(&format!(": did you mean {near}? (one of ")), "{e}");
        }
        assert_eq!(nearest("EMUHOST_FROBNICATE"), None);
        assert_eq!(nearest("FOO"), None);
        let e = check("FOO", "1").unwrap_err().to_string();
        assert!(e.starts_with("\"FOO\" is not a switch emuhost reads (one of EMUHOST_"), "{e}");
        assert_eq!(edits("kitten", "SITTING"), 3);
    }

    #[test]
    fn each_switch_sets_its_field() {
        let s = Settings::from_lookup(|name| {
            Some(
                match name {
                    "EMUHOST_LOG" => "debug",
                    "EMUHOST_WATCH" => return Some(format!(" {} ", PROTECTION.name().to_uppercase())),
                    "EMUHOST_VERIFY_COLLECT" => "yes",
                    "EMUHOST_WATCH_PUBLISHED_LAYOUT" => "off",
                    "EMUHOST_SHORT_SLEEP_TIMER" => "timer",
                    "EMUHOST_IMPORT_BACKEND" => "pin",
                    "EMUHOST_IMPORT_CHUNK_MB" => "32",
                    "EMUHOST_IMPORT_SPAN_MB" => "0",
                    "EMUHOST_IMPORT_COOLING_MS" => "5",
                    "EMUHOST_IMPORT_POPULATE_AHEAD" => "on",
                    "EMUHOST_IMPORT_AHEAD_MB" => "48",
                    "EMUHOST_IMPORT_POLICY" => " Chunks ",
                    "EMUHOST_IMPORT_WAIT_US" => "250",
                    "EMUHOST_IMPORT_COST_US" => " 30, 370 ,50",
                    "EMUHOST_SNAPSHOT_BUDGET_MB" => " 64 ",
                    "EMUHOST_SNAPSHOT_MODE" => " COW ",
                    _ => return None,
                }
                .to_string(),
            )
        })
        .unwrap();
        assert_eq!(s.log, "debug");
        assert_eq!(s.watch, Some(PROTECTION));
        assert!(s.verify_collect);
        assert!(!s.watch_published_layout && !s.tracker_config().published_layout);
        assert_eq!(s.short_sleep_timer, Some(true));
        assert_eq!(s.import_backend, BackendChoice::Only(crate::import::BackendKind::Pin));
        assert_eq!((s.import.plan.chunk, s.import.plan.span_cap), (32 << 20, 0));
        assert_eq!(s.import.cooling, std::time::Duration::from_millis(5));
        assert_eq!(s.import.populate_ahead, crate::import::PopulateAhead::Pools);
        assert_eq!(s.import.pools.ahead, 48 << 20);
        assert_eq!(s.import.policy, ImportPolicyName::Chunks);
        assert_eq!(s.import.pools.wait, std::time::Duration::from_micros(250));
        assert_eq!((s.snapshot_budget, s.snapshot_config().budget_bytes), (Some(64 << 20), Some(64 << 20)));
        assert_eq!(s.snapshot_config().mode, crate::snapshot::SnapshotMode::CopyBeforeWrite);
        let us = std::time::Duration::from_micros;
        let cost = crate::import::ImportCost { fixed: us(30), untouched_per_mib: us(370), populated_per_mib: us(50) };
        assert_eq!((s.import.pools.cost, import_cost_value(&cost)), (Some(cost), "30,370,50".to_string()));
        for (v, want) in [("", false), (" Off ", false), ("no", false), ("0", false), ("1", true), ("x", true)] {
            assert_eq!(check(SHORT_SLEEP_TIMER_SWITCH, v).unwrap().short_sleep_timer, Some(want), "{v:?}");
        }
    }

    #[test]
    fn the_import_cost_switch_form_round_trips_and_refuses_what_it_cannot_hold() {
        let c = import_cost("S", " 30,370 , 50").unwrap();
        assert_eq!(import_cost_value(&c), "30,370,50");
        assert_eq!(import_cost("S", &import_cost_value(&c)).unwrap(), c);
        for bad in ["", "1,2", "1,2,3,4", "1,-2,3", "1,2,60000001", "a,b,c"] {
            assert!(import_cost("S", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn on_off_words() {
        for v in ["1", "true", "ON", " yes "] {
            assert_eq!(on_off(v), Some(true), "{v:?}");
        }
        for v in ["", " ", "0", "FALSE", "off", "\tno\n"] {
            assert_eq!(on_off(v), Some(false), "{v:?}");
        }
        for v in ["2", "00", "maybe", "offf"] {
            assert_eq!(on_off(v), None, "{v:?}");
        }
    }

    /// The README's switch table (rows `| \`EMUHOST_...\` | default | what it does |`) lists the
    /// same switches as [`SETTINGS`] (and the test-only ones), in the same order, with the same
    /// defaults. The README is the workspace's, read at run time: a packaged crate (`cargo
    /// package`) has no workspace around it, and its tests skip this one.
    #[test]
    fn the_readme_table_is_the_settings_table() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        if !root.join("Cargo.toml").exists() {
            eprintln!(
                "no workspace around {}: the README's table is checked in the workspace",
                env!("CARGO_MANIFEST_DIR")
            );
            return;
        }
        let readme = std::fs::read_to_string(root.join("README.md")).expect("the workspace's README.md");
        let rows: Vec<(&str, &str)> = readme
            .lines()
            .filter_map(|l| l.strip_prefix("| `EMUHOST_"))
            .map(|l| {
                let mut cols = l.split(" | ");
                let name = cols.next().unwrap_or("").trim_end_matches('`');
                (name, cols.next().unwrap_or("").trim())
            })
            .collect();
        let want: Vec<(String, &str)> = SETTINGS
            .iter()
            .map(|s| (s.name, s.default))
            .chain(TEST_SWITCHES.iter().copied())
            .map(|(n, d)| (n.trim_start_matches("EMUHOST_").to_string(), d))
            .collect();
        let got: Vec<(String, &str)> = rows.iter().map(|&(n, d)| (n.to_string(), d)).collect();
        assert_eq!(got, want, "the README's switch table and settings.rs differ (name, default)");
    }
}
