//! Shader preparation on a real Vulkan device (Mesa's lavapipe in CI): every pipeline created,
//! the cache file handed back to the driver on the next run, broken shaders reported by name while
//! the run goes on, corrupt or foreign cache files rejected, and resumption after an interruption.
//! Without a device these skip (`crate::vulkan_gate`), except the refusal of files that are not
//! emuhost's, which comes before the device is opened.

use std::path::PathBuf;

use emuhost_prepare::{
    CacheRejected, CacheStart, Corpus, DeviceInfo, GenConfig, JournalStart, Options, Phase, PrepareError, Report,
    check_cache_file, generate, prepare, probe_device, variant_key, wrap_cache_data,
};

use crate::vulkan_gate::vulkan_or_skip;

/// The device the tests prepare on, or `None` (the test skips; see `vulkan_gate`).
#[track_caller]
fn device() -> Option<DeviceInfo> {
    vulkan_or_skip(probe_device(None))
}

/// A fresh folder for one test's cache file.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("emuhost-it-prepare-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(c: &Corpus, opts: &Options) -> Report {
    prepare(c, opts, &|_, _, _| {}).expect("a Vulkan device with a compute queue (lavapipe: mesa-vulkan-drivers)")
}

fn with_cache(cache: PathBuf) -> Options {
    Options { workers: 2, cache: Some(cache), checkpoint_every: 4, ..Options::default() }
}

#[test]
fn every_pipeline_is_created() {
    let Some(_) = device() else { return };
    let c = generate(&GenConfig::default());
    let progress = std::sync::Mutex::new((0, 0));
    let r = prepare(&c, &Options { workers: 3, ..Options::default() }, &|phase, done, total| {
        let mut p = progress.lock().unwrap();
        match phase {
            Phase::Translate => p.0 = p.0.max(done * 1000 / total),
            Phase::Compile => p.1 = p.1.max(done * 1000 / total),
        }
    })
    .unwrap();
    assert!(r.failures.is_empty(), "{:#?}", r.failures);
    assert_eq!((r.programs, r.variants), (12, 36));
    assert_eq!(r.translated_programs, 12);
    assert_eq!(r.translated_variants, 36);
    assert_eq!(r.created, 36);
    assert_eq!(r.remaining(), 0);
    assert_eq!(r.cache, CacheStart::None);
    assert_eq!(r.saves, 0, "no cache file asked for, none written");
    assert!(!r.interrupted);
    assert_eq!(*progress.lock().unwrap(), (1000, 1000), "progress reached the end of both phases");
    assert!(r.translate.busy > std::time::Duration::ZERO && r.compile.busy > std::time::Duration::ZERO);
}

#[test]
fn the_saved_cache_is_handed_to_the_driver_on_the_next_run() {
    let Some(_) = device() else { return };
    let dir = scratch("warm");
    let cache = dir.join("pipelines.vkpc");
    let c = generate(&GenConfig::default());
    let opts = with_cache(cache.clone());
    let cold = run(&c, &opts);
    assert_eq!(cold.cache, CacheStart::Cold);
    assert_eq!(cold.created, 36);
    assert!(cold.saves >= 36 / 4, "saved every 4 pipelines and at the end: {}", cold.saves);
    assert!(cold.cache_bytes >= 32, "at least the driver's header");
    assert!(!cold.journal_kept && !dir.join("pipelines.vkpc.journal").exists(), "a finished run leaves no journal");
    let file = std::fs::read(&cache).unwrap();
    assert_eq!(check_cache_file(&file, &cold.device).unwrap().len(), cold.cache_bytes);

    let warm = run(&c, &opts);
    // The whole of the saved data went to vkCreatePipelineCache.
    assert_eq!(warm.cache, CacheStart::Warm { bytes: cold.cache_bytes });
    assert_eq!(warm.journal, JournalStart::None);
    assert_eq!(warm.created, 36);
    // Where the driver keeps pipelines in its cache (more than the 32-byte header) and reports
    // creation feedback, every pipeline of the warm run is a hit. lavapipe before Mesa 23 keeps
    // nothing (its data is the header alone), so there the hand-over above is what is checked.
    if cold.cache_bytes > 32
        && let Some(hits) = warm.cache_hits
    {
        assert_eq!(hits, 36, "every pipeline from the warm cache");
        assert_eq!(cold.cache_hits, Some(0));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn broken_shaders_are_reported_and_the_run_goes_on() {
    let Some(_) = device() else { return };
    let dir = scratch("broken");
    let mut cfg = GenConfig::default();
    (cfg.broken_translate, cfg.broken_compile) = (2, 2);
    let c = generate(&cfg);
    assert_eq!(c.variant_count(), 38);
    let r = run(&c, &with_cache(dir.join("c.vkpc")));
    let translate: Vec<_> = r.failures.iter().filter(|f| f.phase == Phase::Translate).collect();
    let compile: Vec<_> = r.failures.iter().filter(|f| f.phase == Phase::Compile).collect();
    assert_eq!(translate.len(), 2, "{:#?}", r.failures);
    assert_eq!(compile.len(), 2, "{:#?}", r.failures);
    for f in &translate {
        assert!(f.variant.is_none(), "a program that does not translate fails whole");
        assert!(c.programs.iter().any(|p| p.name == f.program && p.source.contains("wrong")), "{}", f.program);
        assert!(f.error.contains("wrong") || f.error.to_lowercase().contains("type"), "{}", f.error);
    }
    for f in &compile {
        let (_, constants) = f.variant.as_ref().expect("a variant");
        assert!(constants.contains("WG=4096"), "{constants}");
        assert!(f.error.contains("maxComputeWorkGroupInvocations"), "{}", f.error);
    }
    // Every other variant got its pipeline: 38 less 2 programs of 3 less 2 oversized variants.
    assert_eq!(r.created, 38 - 6 - 2);
    assert!(r.journal_kept, "failures leave the journal, so a run after the fix makes only those");
    // A second run makes only what failed (and fails again the same way).
    let again = run(&c, &with_cache(dir.join("c.vkpc")));
    assert_eq!(again.journal, JournalStart::Resumed { skipped: 30 });
    assert_eq!(again.created, 0);
    assert_eq!(again.failures.len(), 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_or_foreign_cache_files_are_rejected() {
    let Some(_) = device() else { return };
    let dir = scratch("corrupt");
    let cache = dir.join("c.vkpc");
    let c = generate(&sized(3, 2));
    let opts = with_cache(cache.clone());
    let first = run(&c, &opts);
    let good = std::fs::read(&cache).unwrap();
    let data = check_cache_file(&good, &first.device).unwrap().to_vec();

    // Ours, of another envelope version: rejected, and replaced with a good one.
    let mut version = good.clone();
    version[15] = 9;
    std::fs::write(&cache, &version).unwrap();
    let r = run(&c, &opts);
    assert_eq!(r.cache, CacheStart::Rejected(CacheRejected::Version { found: 9, want: 2 }));
    assert_eq!(r.created, 6, "the run goes on with an empty cache");
    assert_eq!(std::fs::read(&cache).unwrap(), good, "and replaces the file with a good one");
    // What a run killed while saving leaves: an empty temporary file, and a journal of another
    // device. Both are emuhost's: replaced, the run goes on.
    std::fs::write(dir.join("c.vkpc.tmp"), b"").unwrap();
    std::fs::write(dir.join("c.vkpc.journal"), "emuhost-prepare-journal 1 0x1 0x2 00\n").unwrap();
    let r = run(&c, &opts);
    assert!(matches!(r.journal, JournalStart::Discarded(_)), "{:?}", r.journal);
    assert!(!dir.join("c.vkpc.tmp").exists() && !dir.join("c.vkpc.journal").exists());

    // One bit flipped in the driver's data: the checksum catches it.
    let mut flipped = good.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x10;
    std::fs::write(&cache, &flipped).unwrap();
    assert!(matches!(run(&c, &opts).cache, CacheStart::Rejected(CacheRejected::Checksum { .. })));

    // A well-formed file of another vendor's device, and of another driver build (UUID).
    let mut foreign = data.clone();
    foreign[8..12].copy_from_slice(&(first.device.vendor_id ^ 0x1000).to_le_bytes());
    std::fs::write(&cache, wrap_cache_data(&foreign)).unwrap();
    assert!(matches!(run(&c, &opts).cache, CacheStart::Rejected(CacheRejected::Device { .. })));
    let mut other_build = data.clone();
    other_build[16] ^= 0xff;
    std::fs::write(&cache, wrap_cache_data(&other_build)).unwrap();
    assert!(matches!(run(&c, &opts).cache, CacheStart::Rejected(CacheRejected::Uuid { .. })));

    // A truncated file.
    std::fs::write(&cache, &good[..good.len() / 2]).unwrap();
    assert!(matches!(run(&c, &opts).cache, CacheStart::Rejected(_)));
    // After each rejection the file was replaced: trusted again.
    assert!(matches!(run(&c, &opts).cache, CacheStart::Warm { .. }));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_interrupted_run_resumes_where_it_stopped() {
    let Some(_) = device() else { return };
    let dir = scratch("resume");
    let cache = dir.join("c.vkpc");
    let journal = dir.join("c.vkpc.journal");
    let c = generate(&sized(8, 4));
    let total = c.variant_count();
    let first = run(&c, &Options { stop_after: Some(10), ..with_cache(cache.clone()) });
    assert!(first.interrupted);
    assert!(first.journal_kept && journal.exists());
    assert!((10..total).contains(&first.created), "{}", first.created);
    // The journal holds exactly the variants created, each once.
    let text = std::fs::read_to_string(&journal).unwrap();
    assert_eq!(text.lines().count(), 1 + first.created, "{text}");

    let second = run(&c, &with_cache(cache.clone()));
    assert_eq!(second.journal, JournalStart::Resumed { skipped: first.created });
    assert_eq!(second.created, total - first.created, "only what was left is made");
    assert_eq!(second.remaining(), 0);
    assert!(!second.interrupted && !journal.exists(), "finished: the journal is gone");

    // A journal cut in the middle of a line (killed while writing) keeps its whole lines.
    let first = run(&c, &Options { stop_after: Some(5), ..with_cache(cache.clone()) });
    let mut text = std::fs::read_to_string(&journal).unwrap();
    text.push_str("0123abc");
    std::fs::write(&journal, &text).unwrap();
    let second = run(&c, &with_cache(cache.clone()));
    assert_eq!(second.journal, JournalStart::Resumed { skipped: first.created });

    // A journal without the cache file it goes with is not trusted.
    run(&c, &Options { stop_after: Some(5), ..with_cache(cache.clone()) });
    std::fs::remove_file(&cache).unwrap();
    let r = run(&c, &with_cache(cache.clone()));
    assert!(matches!(r.journal, JournalStart::Discarded(_)), "{:?}", r.journal);
    assert_eq!(r.created, total);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_changed_program_is_made_again() {
    // Keys follow the source and the constants: a journal entry does not cover an edited shader.
    let c = generate(&sized(2, 2));
    let mut edited = c.clone();
    edited.programs[0].source.push_str("\n// edited\n");
    assert_ne!(
        variant_key(&c.programs[0], &c.programs[0].variants[0]),
        variant_key(&edited.programs[0], &edited.programs[0].variants[0])
    );
    assert_eq!(
        variant_key(&c.programs[1], &c.programs[1].variants[1]),
        variant_key(&edited.programs[1], &edited.programs[1].variants[1])
    );
    assert_ne!(
        variant_key(&c.programs[1], &c.programs[1].variants[0]),
        variant_key(&c.programs[1], &c.programs[1].variants[1])
    );
}

/// Files at the cache's paths that emuhost did not write are refused and left as they were: the
/// cache file itself, its journal and its temporary file. The refusal comes before the device
/// is opened, so this runs on any machine.
#[test]
fn files_that_are_not_emuhosts_are_refused_and_left_alone() {
    let dir = scratch("not-ours");
    let cache = dir.join("c.vkpc");
    let c = generate(&sized(1, 1));
    let opts = with_cache(cache.clone());
    let mine = b"a user's file, not a pipeline cache".to_vec();
    for (name, bytes) in [
        ("c.vkpc", &mine[..]),
        ("c.vkpc", b""),
        ("c.vkpc.journal", &mine[..]),
        ("c.vkpc.journal", b"emuhost-prepare"),
        ("c.vkpc.tmp", &mine[..]),
        ("c.vkpc.tmp", b"EMUHOST"),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let e = prepare(&c, &opts, &|_, _, _| {}).expect_err(name);
        assert!(matches!(&e, PrepareError::NotOurs { path: p, .. } if *p == path), "{name} {bytes:?}: {e}");
        assert!(e.to_string().contains(path.to_str().unwrap()), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "{name} left as it was");
        let mut left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, [name], "nothing else made");
        std::fs::remove_file(&path).unwrap();
    }
    // Not a regular file: a folder, and a link (the rename would replace the link).
    std::fs::create_dir(dir.join("c.vkpc.journal")).unwrap();
    let e = prepare(&c, &opts, &|_, _, _| {}).unwrap_err();
    assert!(e.to_string().contains("c.vkpc.journal: a directory"), "{e}");
    std::fs::remove_dir(dir.join("c.vkpc.journal")).unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink("/dev/null", &cache).unwrap();
    #[cfg(windows)]
    std::os::windows::fs::symlink_file("NUL", &cache).unwrap();
    let e = prepare(&c, &opts, &|_, _, _| {}).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A generated corpus's config with `programs` programs of `variants` variants (the config is
/// `#[non_exhaustive]`: set field by field).
fn sized(programs: usize, variants: usize) -> GenConfig {
    let mut c = GenConfig::default();
    (c.programs, c.variants) = (programs, variants);
    c
}
