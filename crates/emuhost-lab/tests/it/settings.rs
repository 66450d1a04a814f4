//! The runtime reads no environment variable unless the caller asks for `Settings::from_env`:
//! in a child process whose environment sets every kind of switch to a value the library would
//! refuse or act on, a tracker, an importer's config and a replay built from `Settings` run by
//! those settings alone.

use std::sync::Arc;

use emuhost::import::{BackendChoice, BackendKind as ImportKind, ImportConfig};
use emuhost::settings::Settings;
use emuhost::space::Space;
use emuhost::watch::{BackendKind, Tracker};
use emuhost_lab::replay::{ReplayConfig, replay};
use emuhost_lab::trace::read_str;

/// Marks the child process.
const CHILD: &str = "EMUHOST_TEST_SETTINGS_CHILD";

/// What the child's environment says: each a value that would fail or change the run if read.
const ENV: &[(&str, &str)] = &[
    ("EMUHOST_WATCH", "bogus"),
    ("EMUHOST_VERIFY_COLLECT", "maybe"),
    ("EMUHOST_IMPORT_CHUNK_MB", "3"),
    ("EMUHOST_IMPORT_POLICY", "bogus"),
    ("EMUHOST_IMPORT_BACKEND", "gpu"),
    ("EMUHOST_SHORT_SLEEP_TIMER", "1"),
];

const TRACE: &str = "emuhost-trace 1 window=0x100000000
0 g0 commit 0x1000000 0x200000 rw-
1 g0 pool 0x1000000 0x200000
2 r frame 0
3 r bind 0x1000000 0x1000
4 g0 write 0x1000000 0x10
5 g0 sleep guest 20000 x2
6 r frame 1
7 r collect 0x1000000 0x200000
8 r frame 2
end 9
";

#[test]
fn given_settings_the_environment_is_not_read() {
    if std::env::var_os(CHILD).is_none() {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args(["settings::given_settings_the_environment_is_not_read", "--exact", "--nocapture"]).env(CHILD, "1");
        cmd.envs(ENV.iter().copied());
        let out = cmd.output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("test result: ok. 1 passed"), "child: {:?}\n{text}", out.status);
        return;
    }
    // The switches are in this process's environment: asked for, they are read (and refused).
    let e = Settings::from_env().unwrap_err().to_string();
    assert!(e.starts_with("EMUHOST_WATCH=\"bogus\""), "{e}");

    let settings = Settings::default();
    let space = Arc::new(Space::with_window(1 << 24).unwrap());
    // One after the other: a space has one tracker at a time.
    for with_settings in [false, true] {
        let t = if with_settings {
            Tracker::new(&space, &settings.tracker_config())
        } else {
            Tracker::new(&space, &emuhost::watch::TrackerConfig::default())
        }
        .unwrap();
        assert!(BackendKind::AUTO.contains(&t.kind()) && !t.verifying(), "{t:?}");
    }
    assert_eq!(settings.import_config(), ImportConfig::default());

    let mut cfg = ReplayConfig::default();
    cfg.settings.import_backend = BackendChoice::Only(ImportKind::Pin);
    let (header, records) = read_str(TRACE).unwrap();
    let r = replay(&header, records.into_iter().enumerate().map(|(i, r)| Ok((i as u64 + 2, r))), &cfg).unwrap();
    assert!(r.sleep_rule.contains("EMUHOST_SHORT_SLEEP_TIMER unset"), "{}", r.sleep_rule);
    // The backend the self-tests choose here (mprotect on a kernel without uffd's, e.g. 6.1).
    let auto = emuhost::watch::choose(&settings.tracker_config()).unwrap().kind;
    assert!(!r.verify_collect && r.watch_backend == auto.name(), "{r:?}");
    // One import or two (the pool's part, then the pool whole, as the cost measured here says).
    assert!((1..=2).contains(&r.imports) && r.bind_failures == 0 && r.lost_writes == 0, "{r:?}");

    // And the settings given are the ones in force.
    let mut cfg = cfg.clone();
    cfg.settings.set("EMUHOST_SHORT_SLEEP_TIMER", "off").unwrap();
    // The platform's protection backend.
    let protection = crate::watch_gate::PROTECTION.name();
    cfg.settings.set("EMUHOST_WATCH", protection).unwrap();
    cfg.settings.set("EMUHOST_VERIFY_COLLECT", "on").unwrap();
    let (header, records) = read_str(TRACE).unwrap();
    let r = replay(&header, records.into_iter().enumerate().map(|(i, r)| Ok((i as u64 + 2, r))), &cfg).unwrap();
    assert!(r.sleep_rule.contains("EMUHOST_SHORT_SLEEP_TIMER is set and off"), "{}", r.sleep_rule);
    assert!(r.verify_collect && r.watch_backend == protection, "{r:?}");
}
