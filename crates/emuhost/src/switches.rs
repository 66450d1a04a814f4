//! Every `EMUHOST_*` switch the library reads, and a check of a value against the same parser the
//! library uses, so a tool can refuse a bad value before it starts work (the README's table lists
//! the same switches with their defaults).

use crate::import::{BackendChoice, ImportConfig};
use crate::watch::{self, BackendKind};

/// A switch the library reads.
#[derive(Clone, Copy)]
pub struct Switch {
    pub name: &'static str,
    check: fn(&str) -> Result<(), String>,
}

impl std::fmt::Debug for Switch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// What is wrong with a switch.
#[derive(Debug, thiserror::Error)]
pub enum SwitchError {
    #[error("{name:?} is not a switch emuhost reads (one of {})", names().join(", "))]
    Unknown { name: String },
    #[error("{why}")]
    Bad { name: &'static str, why: String },
    #[error("{name} is not valid UTF-8")]
    NotUnicode { name: &'static str },
}

fn import_switch(name: &'static str, value: &str) -> Result<(), String> {
    ImportConfig::from_lookup(|n| (n == name).then(|| value.to_string())).map(drop).map_err(|e| e.to_string())
}

/// The switches, in the README's order.
pub const ALL: &[Switch] = &[
    Switch {
        name: watch::WATCH_SWITCH,
        check: |v| match v.trim() {
            "" => Ok(()),
            _ => BackendKind::parse(v).map(drop).map_err(|e| e.to_string()),
        },
    },
    Switch { name: watch::VERIFY_SWITCH, check: |v| watch::parse_verify(v).map(drop).map_err(|e| e.to_string()) },
    // Any value means something (see `sched`): set and false-like yields, anything else the timer.
    Switch { name: "EMUHOST_SHORT_SLEEP_TIMER", check: |_| Ok(()) },
    Switch {
        name: "EMUHOST_IMPORT_BACKEND",
        check: |v| v.parse::<BackendChoice>().map(drop).map_err(|e| e.to_string()),
    },
    Switch { name: "EMUHOST_IMPORT_CHUNK_MB", check: |v| import_switch("EMUHOST_IMPORT_CHUNK_MB", v) },
    Switch { name: "EMUHOST_IMPORT_SPAN_MB", check: |v| import_switch("EMUHOST_IMPORT_SPAN_MB", v) },
    Switch { name: "EMUHOST_IMPORT_COOLING_MS", check: |v| import_switch("EMUHOST_IMPORT_COOLING_MS", v) },
    Switch { name: "EMUHOST_IMPORT_POPULATE_AHEAD", check: |v| import_switch("EMUHOST_IMPORT_POPULATE_AHEAD", v) },
];

/// The switches' names.
pub fn names() -> Vec<&'static str> {
    ALL.iter().map(|s| s.name).collect()
}

/// Checks `value` for the switch `name`: an unknown name or a value the library would refuse is an
/// error naming both.
pub fn check(name: &str, value: &str) -> Result<(), SwitchError> {
    let s = ALL.iter().find(|s| s.name == name).ok_or_else(|| SwitchError::Unknown { name: name.to_string() })?;
    (s.check)(value).map_err(|why| SwitchError::Bad { name: s.name, why })
}

/// Checks every switch set in this process's environment (unknown `EMUHOST_*` names are left to
/// the caller: test-only switches live there too).
pub fn check_env() -> Result<(), SwitchError> {
    for s in ALL {
        match std::env::var(s.name) {
            Ok(v) => check(s.name, &v)?,
            Err(std::env::VarError::NotPresent) => {}
            Err(std::env::VarError::NotUnicode(_)) => return Err(SwitchError::NotUnicode { name: s.name }),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_switch_accepts_its_default_and_refuses_nonsense() {
        for s in ALL {
            check(s.name, "").unwrap_or_else(|e| panic!("{}: empty: {e}", s.name));
        }
        for (name, good, bad, says) in [
            ("EMUHOST_WATCH", "mprotect", "fast", "EMUHOST_WATCH=\"fast\" is not one of"),
            ("EMUHOST_VERIFY_COLLECT", "1", "maybe", "EMUHOST_VERIFY_COLLECT=\"maybe\" is not one of"),
            ("EMUHOST_IMPORT_BACKEND", "pin", "gpu", "EMUHOST_IMPORT_BACKEND=\"gpu\""),
            ("EMUHOST_IMPORT_CHUNK_MB", "32", "3", "EMUHOST_IMPORT_CHUNK_MB=\"3\": a power of two"),
            ("EMUHOST_IMPORT_SPAN_MB", "0", "-1", "EMUHOST_IMPORT_SPAN_MB=\"-1\": an unsigned integer"),
            ("EMUHOST_IMPORT_COOLING_MS", "10", "1s", "EMUHOST_IMPORT_COOLING_MS=\"1s\": an unsigned integer"),
            ("EMUHOST_IMPORT_POPULATE_AHEAD", "chunks", "all", "EMUHOST_IMPORT_POPULATE_AHEAD=\"all\": expected"),
        ] {
            check(name, good).unwrap();
            let e = check(name, bad).unwrap_err().to_string();
            assert!(e.starts_with(says), "{name}: {e}");
        }
        // The sleep switch takes any value.
        check("EMUHOST_SHORT_SLEEP_TIMER", "whatever").unwrap();
        let e = check("EMUHOST_WACTH", "uffd").unwrap_err().to_string();
        assert!(e.starts_with("\"EMUHOST_WACTH\" is not a switch") && e.contains("EMUHOST_WATCH"), "{e}");
    }
}
