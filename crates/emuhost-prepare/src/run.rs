//! One preparation: the cache file and journal read and checked, every pending program translated
//! (workers pulling programs), then every variant's pipeline created (workers pulling variants),
//! the cache saved and the journal appended every `checkpoint_every` pipelines and at the end.

use std::collections::HashSet;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::cache::{check_ours, create_exclusive, journal_header, parse_journal, sibling, unwrap, wrap, write_atomic};
use super::corpus::{Corpus, Program, Variant};
use super::error::CacheRejected;
use super::translate::{self, Spirv};
use super::vk::{DeviceInfo, Driver};
use super::{PrepareError, fnv1a};

/// What a preparation is asked to do ([`prepare`] has an example).
#[derive(Clone, Debug)]
pub struct Options {
    /// Threads for each phase (at least 1).
    pub workers: usize,
    /// The pipeline cache file (its journal is `FILE.journal`). `None`: a cache in memory only,
    /// nothing saved, nothing resumed.
    pub cache: Option<PathBuf>,
    /// The Vulkan device's index in the loader's list; `None`: the best one.
    pub device: Option<usize>,
    /// Pipelines created between two saves of the cache and the journal.
    pub checkpoint_every: usize,
    /// Stop once this many pipelines were created, as an interruption would (then save).
    pub stop_after: Option<usize>,
    /// Set from outside (another thread, a signal) to stop as an interruption would.
    pub cancel: Arc<AtomicBool>,
}

impl Default for Options {
    /// One worker, no cache file, the best device, a save every 64 pipelines, no stop.
    fn default() -> Options {
        Options {
            workers: 1,
            cache: None,
            device: None,
            checkpoint_every: 64,
            stop_after: None,
            cancel: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// The two phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// naga: parse, validate, constants, SPIR-V.
    Translate,
    /// The driver: shader module and compute pipeline through the cache.
    Compile,
}

impl Phase {
    /// The phase's name as the logs and reports write it: `translate` or `compile`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Translate => "translate",
            Phase::Compile => "compile",
        }
    }
}

/// What the cache file gave the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheStart {
    /// No cache file was asked for.
    None,
    /// No file yet: an empty cache.
    Cold,
    /// The file was checked and handed to the driver: this many bytes of its data.
    Warm {
        /// The driver's data handed to it from the file (the envelope not counted).
        bytes: usize,
    },
    /// The file was not used (and will be replaced): why.
    Rejected(CacheRejected),
}

/// What the journal gave the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JournalStart {
    /// No journal: every variant is made.
    None,
    /// An interrupted run's journal: this many of the corpus's variants were done and are skipped.
    Resumed {
        /// Variants skipped because the journal lists them.
        skipped: usize,
    },
    /// A journal was there and is not trusted: why. Every variant is made.
    Discarded(String),
}

/// A shader that failed, by name, with the error.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The program's name.
    pub program: String,
    /// The variant's index and constants; `None` where the whole program failed to translate.
    pub variant: Option<(usize, String)>,
    /// The phase that failed.
    pub phase: Phase,
    /// The translator's or the driver's error, as text.
    pub error: String,
}

/// A phase's time: wall-clock, and the sum of its jobs' times over all workers.
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseTime {
    /// From the phase's start until all its workers are done.
    pub wall: Duration,
    /// The jobs' times added up over all workers (more than `wall` where workers overlap).
    pub busy: Duration,
}

/// What a preparation did ([`prepare`] has an example).
#[derive(Clone, Debug)]
pub struct Report {
    /// The device prepared on.
    pub device: DeviceInfo,
    /// Threads of each phase ([`Options::workers`]).
    pub workers: usize,
    /// Programs in the corpus.
    pub programs: usize,
    /// Variants in the corpus (over all programs).
    pub variants: usize,
    /// What the cache file gave the run.
    pub cache: CacheStart,
    /// What the journal gave the run.
    pub journal: JournalStart,
    /// Programs given to the translator (those with a variant left to make).
    pub translated_programs: usize,
    /// Variants written as SPIR-V.
    pub translated_variants: usize,
    /// Pipelines created.
    pub created: usize,
    /// Of them, those the driver said came from the cache; `None` where the driver does not say.
    pub cache_hits: Option<usize>,
    /// The shaders that failed, sorted by program and variant.
    pub failures: Vec<Failure>,
    /// The translate phase's time.
    pub translate: PhaseTime,
    /// The compile phase's time.
    pub compile: PhaseTime,
    /// Saves of the cache file (and journal).
    pub saves: usize,
    /// The driver's cache data at the last save, in bytes (0 without a save).
    pub cache_bytes: usize,
    /// Stopped before the end (`stop_after` or `cancel`); the journal says where.
    pub interrupted: bool,
    /// The journal is kept (interrupted, or failures to retry) rather than removed.
    pub journal_kept: bool,
}

impl Report {
    /// Variants left to make after this run (failed, or not reached).
    pub fn remaining(&self) -> usize {
        let skipped = match self.journal {
            JournalStart::Resumed { skipped } => skipped,
            _ => 0,
        };
        self.variants - skipped - self.created
    }
}

/// The key of a variant: the program's name, language and source and the constants, hashed.
pub fn variant_key(p: &Program, v: &Variant) -> u64 {
    let mut s = format!("{}\0{}\0{}\0", p.name, p.language.name(), p.source);
    s.push_str(&v.describe());
    fnv1a(s.as_bytes())
}

/// Work shared by the workers of the compile phase.
struct Shared<'a> {
    driver: &'a Driver,
    cache_path: Option<&'a Path>,
    journal: Mutex<Option<File>>,
    journal_path: PathBuf,
    /// Keys of pipelines created since the last save.
    unsaved: Mutex<Vec<u64>>,
    checkpoint: Mutex<(usize, usize)>, // saves, bytes
    error: Mutex<Option<PrepareError>>,
    stop: AtomicBool,
}

impl Shared<'_> {
    /// Saves the cache, then journals the pipelines created before the save. Only pipelines in a
    /// saved cache file are ever journaled.
    fn save(&self) -> Result<(), PrepareError> {
        let Some(path) = self.cache_path else { return Ok(()) };
        let mut ck = self.checkpoint.lock().unwrap_or_else(|e| e.into_inner());
        let keys = std::mem::take(&mut *self.unsaved.lock().unwrap_or_else(|e| e.into_inner()));
        let data = self.driver.cache_data()?;
        write_atomic(path, &wrap(&data))?;
        let mut j = self.journal.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = j.as_mut() {
            let io = |source| PrepareError::Io { path: self.journal_path.clone(), source };
            let text: String = keys.iter().map(|k| format!("{k:016x}\n")).collect();
            f.write_all(text.as_bytes()).map_err(io)?;
            f.sync_data().map_err(io)?;
        }
        ck.0 += 1;
        ck.1 = data.len();
        Ok(())
    }

    fn fail(&self, e: PrepareError) {
        let mut slot = self.error.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert(e);
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Runs `n` jobs on `workers` threads pulling indices; `job` returns false to stop them all.
/// Returns the phase's time.
fn pool(workers: usize, n: usize, stop: &AtomicBool, job: impl Fn(usize) -> bool + Sync) -> PhaseTime {
    let next = AtomicUsize::new(0);
    let busy_ns = std::sync::atomic::AtomicU64::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..workers.min(n) {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let t = Instant::now();
                    let go_on = job(i);
                    busy_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    if !go_on {
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    PhaseTime { wall: t.elapsed(), busy: Duration::from_nanos(busy_ns.into_inner()) }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Reads the cache file: its checked data, or why it is not used. A missing file is cold.
fn read_cache(path: &Path, dev: &DeviceInfo) -> Result<(CacheStart, Vec<u8>), PrepareError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((CacheStart::Cold, Vec::new())),
        Err(source) => return Err(PrepareError::Io { path: path.to_path_buf(), source }),
    };
    match unwrap(&bytes, dev) {
        Ok(data) => Ok((CacheStart::Warm { bytes: data.len() }, data.to_vec())),
        Err(why) => {
            tracing::warn!("prepare: pipeline cache {} discarded: {why}; starting with an empty cache", path.display());
            Ok((CacheStart::Rejected(why), Vec::new()))
        }
    }
}

/// Prepares `corpus` (see the crate's docs): translates every program not yet done, creates every
/// variant's pipeline on the device, saves the cache and journal as it goes.
/// `progress(phase, done, total)` is called after each job, from the worker that did it.
///
/// A shader that fails is a [`Failure`] in the [`Report`], not an error; so is a cache file or
/// journal that is rejected ([`CacheStart::Rejected`], [`JournalStart::Discarded`]).
///
/// # Errors
///
/// [`PrepareError::NoWorkers`] for `workers == 0`; [`PrepareError::NotOurs`] for a cache file
/// (or its `.journal`/`.tmp`) that is not emuhost's, checked before the device is opened; the
/// device's errors ([`PrepareError::Loader`], [`PrepareError::Instance`],
/// [`PrepareError::NoComputeDevice`], [`PrepareError::NoSuchDevice`], [`PrepareError::Vulkan`]);
/// [`PrepareError::Io`] for a cache file or journal that cannot be read or written.
///
/// # Examples
///
/// A small generated corpus prepared with no cache file. It needs a Vulkan device (lavapipe will
/// do); without one the example stops early, unless `EMUHOST_REQUIRE_VULKAN=1`.
///
/// ```
/// use emuhost_prepare::{GenConfig, Options, generate, prepare};
///
/// # fn main() -> Result<(), emuhost_prepare::PrepareError> {
/// let mut cfg = GenConfig::default();
/// cfg.programs = 2;
/// cfg.variants = 2;
/// let corpus = generate(&cfg);
/// # if emuhost_prepare::probe_device(None).is_err()
/// #     && std::env::var_os("EMUHOST_REQUIRE_VULKAN").is_none_or(|v| v != "1")
/// # {
/// #     return Ok(()); // No Vulkan device on this machine.
/// # }
/// let report = prepare(&corpus, &Options::default(), &|_phase, _done, _total| {})?;
/// assert_eq!(report.created, 4);
/// assert!(report.failures.is_empty());
/// assert_eq!(report.remaining(), 0);
/// # Ok(())
/// # }
/// ```
pub fn prepare(
    corpus: &Corpus,
    opts: &Options,
    progress: &(dyn Fn(Phase, usize, usize) + Sync),
) -> Result<Report, PrepareError> {
    if opts.workers == 0 {
        return Err(PrepareError::NoWorkers);
    }
    // Before the device is opened: files that are not emuhost's are refused on any machine.
    if let Some(path) = &opts.cache {
        check_ours(path)?;
    }
    let mut driver = Driver::open(opts.device)?;
    let dev = driver.info.clone();
    tracing::info!(
        "prepare: device {} (vendor {:#x}, device {:#x}, Vulkan {}.{}), {} workers",
        dev.name,
        dev.vendor_id,
        dev.device_id,
        ash::vk::api_version_major(dev.api_version),
        ash::vk::api_version_minor(dev.api_version),
        opts.workers
    );
    let cache_start = start_cache(&mut driver, opts.cache.as_deref(), &dev)?;

    // The journal is trusted only beside a cache file that was used.
    let journal_path = opts.cache.as_deref().map_or_else(PathBuf::new, |p| sibling(p, ".journal"));
    let mut done: HashSet<u64> = HashSet::new();
    let journal_start = read_journal(opts.cache.is_some(), &cache_start, &journal_path, &dev, &mut done)?;
    let (pending, skipped) = pending(corpus, &done);
    let journal_start = match journal_start {
        JournalStart::Resumed { .. } => {
            tracing::info!(
                "prepare: resuming: {skipped} of {} variants were prepared by an interrupted run",
                corpus.variant_count()
            );
            JournalStart::Resumed { skipped }
        }
        other => other,
    };
    let journal = open_journal(opts.cache.is_some(), &journal_start, &journal_path, &dev)?;

    let failures: Mutex<Vec<Failure>> = Mutex::new(Vec::new());
    let translated = translate_phase(corpus, opts, &pending, &failures, progress);
    let compiled = compile_phase(corpus, opts, &driver, journal, &journal_path, &translated, &failures, progress)?;
    let interrupted = translated.interrupted || compiled.interrupted;

    let mut failures = failures.into_inner().unwrap_or_else(|e| e.into_inner());
    failures.sort_by(|a, b| {
        (&a.program, a.variant.as_ref().map(|v| v.0)).cmp(&(&b.program, b.variant.as_ref().map(|v| v.0)))
    });
    let journal_kept = opts.cache.is_some() && (interrupted || !failures.is_empty());
    if opts.cache.is_some() && !journal_kept {
        // Everything is in the saved cache: nothing to resume. The next run makes every
        // pipeline again, from the warm cache.
        std::fs::remove_file(&journal_path)
            .map_err(|source| PrepareError::Io { path: journal_path.clone(), source })?;
    }
    Ok(Report {
        cache_hits: dev.creation_feedback.then_some(compiled.hits),
        device: dev,
        workers: opts.workers,
        programs: corpus.programs.len(),
        variants: corpus.variant_count(),
        cache: cache_start,
        journal: journal_start,
        translated_programs: translated.programs,
        translated_variants: translated.spirv.len(),
        created: compiled.created,
        failures,
        translate: translated.time,
        compile: compiled.time,
        saves: compiled.saves,
        cache_bytes: compiled.cache_bytes,
        interrupted,
        journal_kept,
    })
}

/// The driver's pipeline cache, made from the cache file's data where there is one and it is
/// good (`Warm` then says how many bytes the driver was handed).
fn start_cache(driver: &mut Driver, cache: Option<&Path>, dev: &DeviceInfo) -> Result<CacheStart, PrepareError> {
    let (cache_start, initial) = match cache {
        Some(path) => read_cache(path, dev)?,
        None => (CacheStart::None, Vec::new()),
    };
    let handed = driver.make_cache(&initial)?;
    Ok(match cache_start {
        CacheStart::Warm { .. } => CacheStart::Warm { bytes: handed },
        other => other,
    })
}

/// Reads the journal beside a cache file that was used into `done` (the keys of the variants
/// it lists); a journal that does not go with the cache is discarded with a warning.
fn read_journal(
    has_cache: bool,
    cache_start: &CacheStart,
    journal_path: &Path,
    dev: &DeviceInfo,
    done: &mut HashSet<u64>,
) -> Result<JournalStart, PrepareError> {
    Ok(match (has_cache, cache_start) {
        (false, _) => JournalStart::None,
        (true, CacheStart::Warm { .. }) => match std::fs::read_to_string(journal_path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => JournalStart::None,
            Err(source) => return Err(PrepareError::Io { path: journal_path.to_path_buf(), source }),
            Ok(text) => match parse_journal(&text, dev) {
                Ok(keys) => {
                    done.extend(keys);
                    JournalStart::Resumed { skipped: 0 }
                }
                Err(why) => {
                    tracing::warn!("prepare: journal {} discarded: {why}", journal_path.display());
                    JournalStart::Discarded(why)
                }
            },
        },
        (true, _) => {
            if journal_path.exists() {
                let why = "the cache file it goes with was not used".to_string();
                tracing::warn!("prepare: journal {} discarded: {why}", journal_path.display());
                JournalStart::Discarded(why)
            } else {
                JournalStart::None
            }
        }
    })
}

/// What is left: per program (its index), the variants not in `done`; and how many were.
fn pending(corpus: &Corpus, done: &HashSet<u64>) -> (Vec<(usize, Vec<usize>)>, usize) {
    let mut skipped = 0;
    let pending = corpus
        .programs
        .iter()
        .enumerate()
        .filter_map(|(pi, p)| {
            let left: Vec<usize> =
                (0..p.variants.len()).filter(|&vi| !done.contains(&variant_key(p, &p.variants[vi]))).collect();
            skipped += p.variants.len() - left.len();
            (!left.is_empty()).then_some((pi, left))
        })
        .collect();
    (pending, skipped)
}

/// The journal this run appends to: the old one when resuming, else a new one with its header.
fn open_journal(
    has_cache: bool,
    journal_start: &JournalStart,
    journal_path: &Path,
    dev: &DeviceInfo,
) -> Result<Option<File>, PrepareError> {
    let io = |source| PrepareError::Io { path: journal_path.to_path_buf(), source };
    Ok(match (has_cache, journal_start) {
        (false, _) => None,
        (true, JournalStart::Resumed { .. }) => Some(open_append(journal_path).map_err(io)?),
        (true, _) => {
            let mut f = create_exclusive(journal_path).map_err(io)?;
            // One write: the header is whole or the file is empty (both known to be ours).
            f.write_all(format!("{}\n", journal_header(dev)).as_bytes()).map_err(io)?;
            Some(f)
        }
    })
}

/// Opens the journal a run resumes, to append to it, and makes sure it opened the file at `path`
/// itself: a link put there since the run began (it checked that the journal was a regular file)
/// is refused before anything is written, and what it points to is left as it is.
fn open_append(path: &Path) -> std::io::Result<File> {
    let f = std::fs::OpenOptions::new().append(true).open(path)?;
    let (opened, named) = (f.metadata()?, std::fs::symlink_metadata(path)?);
    if !named.file_type().is_file() || !same_file(&opened, &named) {
        return Err(std::io::Error::other("not the regular file the run began with (a link put there since?)"));
    }
    Ok(f)
}

/// Whether `opened` (an open file's metadata) and `named` (the path's, the link itself where it is
/// one) are the same file: the same device and inode.
#[cfg(unix)]
fn same_file(opened: &std::fs::Metadata, named: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    (opened.dev(), opened.ino()) == (named.dev(), named.ino())
}

/// Whether `opened` and `named` are the same file, weaker than on unix: Windows' file index
/// (`std::os::windows::fs::MetadataExt::file_index`) is not stable Rust, so the same length and
/// modification time stand in for it. A link at the path is still refused (by the file type);
/// what this misses is a regular file of the same length and time put there between the open and
/// the check.
#[cfg(not(unix))]
fn same_file(opened: &std::fs::Metadata, named: &std::fs::Metadata) -> bool {
    opened.len() == named.len() && opened.modified().ok() == named.modified().ok()
}

/// What phase 1 made: each variant's SPIR-V (program, variant, key), in corpus order.
struct Translated {
    spirv: Vec<(usize, usize, u64, Spirv)>,
    programs: usize,
    time: PhaseTime,
    interrupted: bool,
}

/// Phase 1: translates the programs with something left, workers pulling programs.
fn translate_phase(
    corpus: &Corpus,
    opts: &Options,
    pending: &[(usize, Vec<usize>)],
    failures: &Mutex<Vec<Failure>>,
    progress: &(dyn Fn(Phase, usize, usize) + Sync),
) -> Translated {
    let cancel = &opts.cancel;
    let spirv: Mutex<Vec<(usize, usize, u64, Spirv)>> = Mutex::new(Vec::new());
    let translated = AtomicUsize::new(0);
    let stop = AtomicBool::new(cancel.load(Ordering::Relaxed));
    let time = pool(opts.workers, pending.len(), &stop, |j| {
        let (pi, left) = &pending[j];
        let p = &corpus.programs[*pi];
        match translate::parse(p) {
            Err(error) => {
                lock(failures).push(Failure { program: p.name.clone(), variant: None, phase: Phase::Translate, error })
            }
            Ok(parsed) => {
                for &vi in left {
                    let v = &p.variants[vi];
                    match parsed.variant(v) {
                        Ok(s) => lock(&spirv).push((*pi, vi, variant_key(p, v), s)),
                        Err(error) => lock(failures).push(Failure {
                            program: p.name.clone(),
                            variant: Some((vi, v.describe())),
                            phase: Phase::Translate,
                            error,
                        }),
                    }
                }
            }
        }
        progress(Phase::Translate, translated.fetch_add(1, Ordering::Relaxed) + 1, pending.len());
        !cancel.load(Ordering::Relaxed)
    });
    let mut spirv = spirv.into_inner().unwrap_or_else(|e| e.into_inner());
    // Corpus order, so that a run's pipelines (and the journal) come in the same order each time.
    spirv.sort_by_key(|(pi, vi, ..)| (*pi, *vi));
    Translated { spirv, programs: translated.into_inner(), time, interrupted: stop.load(Ordering::Relaxed) }
}

/// What phase 2 made.
struct Compiled {
    created: usize,
    hits: usize,
    time: PhaseTime,
    saves: usize,
    cache_bytes: usize,
    interrupted: bool,
}

/// Phase 2: creates every translated variant's pipeline through the cache, workers pulling
/// variants; saves the cache and appends the journal every `checkpoint_every` pipelines and at
/// the end.
#[allow(clippy::too_many_arguments)] // The run's parts, each borrowed from `prepare`'s frame.
fn compile_phase(
    corpus: &Corpus,
    opts: &Options,
    driver: &Driver,
    journal: Option<File>,
    journal_path: &Path,
    translated: &Translated,
    failures: &Mutex<Vec<Failure>>,
    progress: &(dyn Fn(Phase, usize, usize) + Sync),
) -> Result<Compiled, PrepareError> {
    let cancel = &opts.cancel;
    let spirv = &translated.spirv;
    let shared = Shared {
        driver,
        cache_path: opts.cache.as_deref(),
        journal: Mutex::new(journal),
        journal_path: journal_path.to_path_buf(),
        unsaved: Mutex::new(Vec::new()),
        checkpoint: Mutex::new((0, 0)),
        error: Mutex::new(None),
        stop: AtomicBool::new(translated.interrupted),
    };
    let created = AtomicUsize::new(0);
    let hits = AtomicUsize::new(0);
    let finished = AtomicUsize::new(0);
    let time = pool(opts.workers, spirv.len(), &shared.stop, |j| {
        let (pi, vi, key, s) = &spirv[j];
        match driver.create_compute(s) {
            Ok(out) => {
                if out.cache_hit == Some(true) {
                    hits.fetch_add(1, Ordering::Relaxed);
                }
                let unsaved = {
                    let mut u = lock(&shared.unsaved);
                    u.push(*key);
                    u.len()
                };
                let n = created.fetch_add(1, Ordering::Relaxed) + 1;
                if opts.stop_after.is_some_and(|limit| n >= limit) {
                    return false;
                }
                if unsaved >= opts.checkpoint_every.max(1)
                    && let Err(e) = shared.save()
                {
                    shared.fail(e);
                    return false;
                }
            }
            Err(error) => {
                let p = &corpus.programs[*pi];
                lock(failures).push(Failure {
                    program: p.name.clone(),
                    variant: Some((*vi, p.variants[*vi].describe())),
                    phase: Phase::Compile,
                    error,
                });
            }
        }
        progress(Phase::Compile, finished.fetch_add(1, Ordering::Relaxed) + 1, spirv.len());
        !cancel.load(Ordering::Relaxed)
    });
    if let Some(e) = lock(&shared.error).take() {
        return Err(e);
    }
    let interrupted = shared.stop.load(Ordering::Relaxed);
    shared.save()?;
    let (saves, cache_bytes) = *lock(&shared.checkpoint);
    Ok(Compiled { created: created.into_inner(), hits: hits.into_inner(), time, saves, cache_bytes, interrupted })
}

/// The process's peak resident memory, in bytes: Linux's `VmHWM` (`/proc/self/status`), Windows'
/// peak working set (`GetProcessMemoryInfo`).
pub fn peak_memory_bytes() -> Option<u64> {
    emuhost::probe::process_memory().ok().map(|m| m.resident_peak)
}

/// `VmHWM:   N kB` in bytes.
pub fn parse_vm_hwm(status: &str) -> Option<u64> {
    emuhost::probe::status_bytes(status, "VmHWM")
}

#[cfg(test)]
mod tests {
    use super::*;
    // A symbolic link to a file (Windows tells file and folder links apart).
    #[cfg(unix)]
    use std::os::unix::fs::symlink;
    #[cfg(windows)]
    use std::os::windows::fs::symlink_file as symlink;

    fn dev() -> DeviceInfo {
        DeviceInfo {
            name: "test".into(),
            vendor_id: 0x10de,
            device_id: 0x2335,
            driver_version: 1,
            pipeline_cache_uuid: [7; 16],
            api_version: 0,
            max_workgroup_invocations: 1024,
            max_workgroup_size: [1024, 1024, 64],
            creation_feedback: true,
        }
    }

    /// A link planted at `FILE.journal` after the start-of-run check, to a user's file: a new
    /// journal is made in its place, a resumed one is refused; the user's file is never written.
    #[test]
    fn a_link_planted_at_the_journal_is_not_written_through() {
        let dir = std::env::temp_dir().join(format!("emuhost-prepare-run-journal-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let journal = dir.join("c.vkpc.journal");
        let precious = dir.join("precious");
        std::fs::write(&precious, b"a user's file\n").unwrap();
        for start in [JournalStart::None, JournalStart::Discarded("test".into())] {
            symlink(&precious, &journal).unwrap();
            let f = open_journal(true, &start, &journal, &dev()).unwrap();
            drop(f);
            assert_eq!(std::fs::read(&precious).unwrap(), b"a user's file\n", "{start:?}");
            assert!(std::fs::symlink_metadata(&journal).unwrap().file_type().is_file(), "{start:?}");
            assert_eq!(std::fs::read_to_string(&journal).unwrap(), format!("{}\n", journal_header(&dev())));
            std::fs::remove_file(&journal).unwrap();
        }
        symlink(&precious, &journal).unwrap();
        let e = open_journal(true, &JournalStart::Resumed { skipped: 0 }, &journal, &dev()).unwrap_err();
        assert!(e.to_string().contains(journal.to_str().unwrap()), "{e}");
        assert_eq!(std::fs::read(&precious).unwrap(), b"a user's file\n");
        // A journal that is a file is appended to, as before.
        std::fs::remove_file(&journal).unwrap();
        std::fs::write(&journal, format!("{}\n", journal_header(&dev()))).unwrap();
        let f = open_journal(true, &JournalStart::Resumed { skipped: 0 }, &journal, &dev()).unwrap();
        writeln!(f.unwrap(), "{:016x}", 5).unwrap();
        assert!(std::fs::read_to_string(&journal).unwrap().ends_with("\n0000000000000005\n"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
