//! The `EMUHOST_*` switches as the CLI sees them: the library's, plus `EMUHOST_LOG` (the log
//! filter, which only the CLI reads). Each value is checked before any work starts.

use anyhow::bail;

/// The log filter switch.
pub const LOG: &str = "EMUHOST_LOG";

/// Other `EMUHOST_*` names that are not switches of a run: set by emuhost itself for a child
/// process, or read by the test suite.
const NOT_SWITCHES: &[&str] = &[
    "EMUHOST_REPLAY_CHILD",
    "EMUHOST_REQUIRE_VULKAN",
    "EMUHOST_REQUIRE_CUDA",
    "EMUHOST_FUZZ_SECONDS",
    "EMUHOST_TEST_FAULT_CHILD",
];

/// Every switch a replay honours, in the README's order.
pub fn names() -> Vec<&'static str> {
    let mut v = vec![LOG];
    v.extend(emuhost::switches::names());
    v
}

/// Checks one switch's value: an unknown name or a value emuhost would refuse is an error naming it.
pub fn check(name: &str, value: &str) -> anyhow::Result<()> {
    if name == LOG {
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(value) {
            bail!("{LOG}={value:?} is not a log filter: {e}");
        }
        return Ok(());
    }
    if emuhost::faults::SWITCHES.contains(&name) {
        // Checked by `emuhost::faults::from_env` where the process starts (exit 2 naming it).
        return Ok(());
    }
    match emuhost::switches::check(name, value) {
        Err(emuhost::switches::SwitchError::Unknown { .. }) => {
            bail!("{name:?} is not a switch emuhost reads (one of {})", names().join(", "))
        }
        r => Ok(r?),
    }
}

/// Parses `KEY=VALUE` and checks it.
pub fn parse(kv: &str) -> anyhow::Result<(String, String)> {
    let Some((k, v)) = kv.split_once('=') else {
        bail!("{kv:?} is not KEY=VALUE");
    };
    let k = k.trim();
    check(k, v)?;
    Ok((k.to_string(), v.to_string()))
}

/// Checks every switch set in the environment. An `EMUHOST_*` name that is not a switch is only
/// warned of (the environment is shared with other programs), with the closest switch's name.
pub fn check_env() -> anyhow::Result<()> {
    for (k, v) in std::env::vars_os() {
        let Some(k) = k.to_str().filter(|k| k.starts_with("EMUHOST_")) else { continue };
        let Some(v) = v.to_str() else { bail!("{k} is not valid UTF-8") };
        if names().contains(&k) {
            check(k, v)?;
        } else if !NOT_SWITCHES.contains(&k) && !emuhost::faults::SWITCHES.contains(&k) {
            eprintln!("emuhost: warning: {k} is not a switch emuhost reads; see the README's table");
        }
    }
    Ok(())
}

/// Checks that a file can be written at `p` before the work that fills it starts: its folder exists
/// and it is not a folder itself.
pub fn check_output(flag: &str, p: &std::path::Path) -> anyhow::Result<()> {
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    if !dir.is_dir() {
        bail!("{flag} {}: the folder {} does not exist", p.display(), dir.display());
    }
    if p.is_dir() {
        bail!("{flag} {}: is a folder", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_are_parsed_and_checked() {
        assert_eq!(parse("EMUHOST_WATCH=uffd").unwrap(), ("EMUHOST_WATCH".into(), "uffd".into()));
        assert_eq!(parse("EMUHOST_SHORT_SLEEP_TIMER=").unwrap().1, "");
        for (kv, says) in [
            ("EMUHOST_WATCH", "\"EMUHOST_WATCH\" is not KEY=VALUE"),
            ("FOO=1", "\"FOO\" is not a switch emuhost reads"),
            ("EMUHOST_WATCH=fast", "EMUHOST_WATCH=\"fast\" is not one of"),
            ("EMUHOST_LOG=[[[", "EMUHOST_LOG=\"[[[\" is not a log filter"),
            ("EMUHOST_IMPORT_SPAN_MB=x", "EMUHOST_IMPORT_SPAN_MB=\"x\": an unsigned integer is needed"),
        ] {
            let e = format!("{:#}", parse(kv).unwrap_err());
            assert!(e.starts_with(says), "{kv}: {e}");
        }
        assert!(names().contains(&"EMUHOST_LOG") && names().contains(&"EMUHOST_IMPORT_POPULATE_AHEAD"));
    }

    #[test]
    fn the_readme_table_lists_every_switch() {
        let readme = include_str!("../../../README.md");
        for name in names() {
            assert!(readme.contains(&format!("| `{name}` |")), "{name} is missing from the README's switch table");
        }
    }

    #[test]
    fn outputs_need_an_existing_folder() {
        let dir = std::env::temp_dir();
        check_output("--csv", &dir.join("x.csv")).unwrap();
        check_output("--csv", std::path::Path::new("x.csv")).unwrap();
        let e = check_output("--csv", &dir.join("no-such-folder-here/x.csv")).unwrap_err().to_string();
        assert!(e.contains("no-such-folder-here") && e.contains("does not exist"), "{e}");
        assert!(check_output("--plot", &dir).unwrap_err().to_string().ends_with("is a folder"));
    }
}
