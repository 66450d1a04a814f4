//! The `EMUHOST_*` switches as the CLI takes them: from the environment and from flags, into one
//! [`Settings`] (the library's table, `EMUHOST_LOG` included) that every command is given. Each
//! value is checked before any work starts; the log filter is checked here too, since the CLI is
//! what applies it.

use anyhow::bail;
use emuhost::settings::{self, LOG_SWITCH, Settings};

/// Other `EMUHOST_*` names that are not switches of a run: read by the test suite and CI.
const NOT_SWITCHES: &[&str] = &["EMUHOST_TEST_FAULT_CHILD", "EMUHOST_TEST_WATCH_CHILD", "EMUHOST_TEST_SETTINGS_CHILD"];

/// Sets the switch `name` to `value` in `s`: an unknown name or a value emuhost would refuse is
/// an error naming it.
pub fn set(s: &mut Settings, name: &str, value: &str) -> anyhow::Result<()> {
    // An unknown name's error names the nearest switch and the switches.
    s.set(name, value)?;
    if name == LOG_SWITCH
        && let Err(e) = tracing_subscriber::EnvFilter::try_new(value)
    {
        bail!("{LOG_SWITCH}={value:?} is not a log filter: {e}");
    }
    Ok(())
}

/// Checks one switch's value against the library's parser.
pub fn check(name: &str, value: &str) -> anyhow::Result<()> {
    set(&mut Settings::default(), name, value)
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

/// The settings the environment's switches make (the CLI is where the environment is read). An
/// `EMUHOST_*` name that is not a switch is only warned of (the environment is shared with other
/// programs).
pub fn from_env() -> anyhow::Result<Settings> {
    let mut s = Settings::default();
    for (k, v) in std::env::vars_os() {
        let Some(k) = k.to_str().filter(|k| k.starts_with("EMUHOST_")) else { continue };
        let Some(v) = v.to_str() else { bail!("{k} is not valid UTF-8") };
        if settings::names().contains(&k) {
            set(&mut s, k, v)?;
        } else if !NOT_SWITCHES.contains(&k) && !settings::TEST_SWITCHES.iter().any(|(n, _)| *n == k) {
            let near = settings::nearest(k).map_or(String::new(), |n| format!("; did you mean {n}?"));
            eprintln!("emuhost: warning: {k} is not a switch emuhost reads{near} (see the README's table)");
        }
    }
    Ok(s)
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
        // This platform's best backend: another platform's is an error (its own test).
        let native = if cfg!(windows) { "writewatch" } else { "uffd" };
        assert_eq!(parse(&format!("EMUHOST_WATCH={native}")).unwrap(), ("EMUHOST_WATCH".into(), native.into()));
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
        let mut s = Settings::default();
        set(&mut s, "EMUHOST_LOG", "debug").unwrap();
        set(&mut s, "EMUHOST_IMPORT_SPAN_MB", "0").unwrap();
        assert_eq!((s.log.as_str(), s.import.plan.span_cap), ("debug", 0));
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
