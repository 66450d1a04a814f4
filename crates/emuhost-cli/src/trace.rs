//! `emuhost trace synth` and `emuhost trace stats`.

use std::io::{self, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Subcommand;
use emuhost_lab::synth::{self, Synth, SynthConfig};
use emuhost_lab::trace::{FileReader, Stats, TraceError, TraceWriter};

use crate::Outcome;

#[derive(Subcommand)]
pub enum Which {
    /// Write a synthetic session shaped on the measured one (the default session with the default seed).
    Synth {
        /// The generator's seed.
        #[arg(long, default_value_t = synth::DEFAULT_SEED)]
        seed: u64,
        /// Write here instead of to stdout; a name ending in `.zst` is compressed.
        #[arg(short = 'o', long, value_name = "FILE")]
        out: Option<PathBuf>,
        /// The session's length in seconds (default 120); the loading phase is the first tenth of
        /// it, at most 10 s, at least 1 s.
        #[arg(long, value_parser = clap::value_parser!(u32).range(2..=86_400))]
        seconds: Option<u32>,
        /// Game threads (default 4; at least 2: thread 0 makes pools, the others sleep).
        #[arg(long, value_parser = clap::value_parser!(u16).range(2..=256))]
        game_threads: Option<u16>,
        /// Host threads (default 1).
        #[arg(long, value_parser = clap::value_parser!(u16).range(0..=256))]
        host_threads: Option<u16>,
    },
    /// Print a trace's figures: pools, pools across a chunk's end, chunks touched and bound, frames, ...
    Stats {
        /// The trace (`.zst`: compressed). Without it, the built-in default session.
        file: Option<PathBuf>,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// The chunk size the chunk figures count in, in MiB (a power of two).
        #[arg(long, default_value_t = 16)]
        chunk_mib: u64,
    },
}

pub fn run(which: Which) -> anyhow::Result<Outcome> {
    match which {
        Which::Synth { seed, out, seconds, game_threads, host_threads } => {
            let mut cfg = SynthConfig::default().seed(seed);
            if let Some(s) = seconds {
                cfg.seconds = s;
                cfg.load_seconds = (s / 10).clamp(1, cfg.load_seconds);
            }
            cfg.game_threads = game_threads.unwrap_or(cfg.game_threads);
            cfg.host_threads = host_threads.unwrap_or(cfg.host_threads);
            synth(cfg, out)
        }
        Which::Stats { file, json, chunk_mib } => stats(file, json, chunk_mib),
    }
}

fn synth(cfg: SynthConfig, out: Option<PathBuf>) -> anyhow::Result<Outcome> {
    let seed = cfg.seed;
    let synth = Synth::new(cfg)?;
    let header = synth.header();
    let events = match &out {
        Some(path) => {
            let at = || format!("writing {}", path.display());
            let mut w = TraceWriter::create(path, header).with_context(at)?;
            write_all(synth, &mut w).with_context(at)?;
            let n = w.events();
            w.finish().with_context(at)?;
            n
        }
        None => {
            let mut w = TraceWriter::new(io::stdout().lock(), header)?;
            // A reader that stops early (`| head`) is not an error.
            let done = write_all(synth, &mut w).and_then(|()| {
                let n = w.events();
                w.finish()?.flush().map_err(|source| TraceError::Write { source })?;
                Ok(n)
            });
            match done {
                Err(TraceError::Write { source }) if source.kind() == io::ErrorKind::BrokenPipe => {
                    return Ok(Outcome::Ok);
                }
                other => other.context("writing the trace to stdout")?,
            }
        }
    };
    tracing::info!("wrote {events} events (seed {seed})");
    Ok(Outcome::Ok)
}

fn write_all<W: Write>(synth: Synth, w: &mut TraceWriter<W>) -> Result<(), TraceError> {
    for r in synth {
        w.write(&r)?;
    }
    Ok(())
}

/// A byte sum for JSON: exact where it fits a u64 (what JSON readers take as an integer), else
/// as a float.
#[derive(Debug, PartialEq, serde::Serialize)]
#[serde(untagged)]
enum Big {
    Exact(u64),
    Approx(f64),
}

fn big(n: u128) -> Big {
    u64::try_from(n).map_or(Big::Approx(n as f64), Big::Exact)
}

/// The version of `trace stats --json`'s keys (raised when one changes name or meaning or goes
/// away).
pub const SCHEMA: u32 = 1;

/// `trace stats --json`: the trace's figures (see `emuhost_lab::trace::Stats`).
#[derive(Debug, serde::Serialize)]
struct StatsReport {
    schema: u32,
    chunk_mib: u64,
    events: u64,
    frames: u64,
    duration_s: f64,
    fps: f64,
    pools: u64,
    pools_released: u64,
    pools_crossing_chunk_end: u64,
    chunks_touched: u64,
    chunks_bound: u64,
    binds: u64,
    binds_crossing_chunk_end: u64,
    chunk_ends_bound_across: u64,
    commits: u64,
    committed_bytes: Big,
    decommits: u64,
    writes: u64,
    write_bytes: Big,
    collects: u64,
    collect_bytes: Big,
    sleeps_guest: u64,
    sleeps_host: u64,
    sleep_guest_ms: f64,
    sleep_host_ms: f64,
    game_threads: u64,
    host_threads: u64,
}

fn stats(file: Option<PathBuf>, as_json: bool, chunk_mib: u64) -> anyhow::Result<Outcome> {
    if chunk_mib == 0 || !chunk_mib.is_power_of_two() || chunk_mib > 1 << 20 {
        bail!("--chunk-mib {chunk_mib}: not a power of two from 1 to 1048576");
    }
    let chunk = chunk_mib << 20;
    let (name, s) = match &file {
        Some(path) => {
            let at = || format!("reading {}", path.display());
            let reader = FileReader::open(path).with_context(at)?;
            let s = Stats::of(reader, chunk).with_context(at)?;
            (path.display().to_string(), s)
        }
        None => {
            ("the default session".to_owned(), Stats::of(synth::default_session().map(Ok::<_, anyhow::Error>), chunk)?)
        }
    };
    if as_json {
        outln!("{}", serde_json::to_string(&stats_json(&s, chunk_mib)).context("writing the figures as JSON")?);
    } else {
        print_stats(&name, &s, chunk_mib);
    }
    Ok(Outcome::Ok)
}

/// The trace's figures as one JSON object.
fn stats_json(s: &Stats, chunk_mib: u64) -> StatsReport {
    StatsReport {
        schema: SCHEMA,
        chunk_mib,
        events: s.events,
        frames: s.frames,
        duration_s: s.duration_us as f64 / 1e6,
        fps: s.fps(),
        pools: s.pools,
        pools_released: s.pools_released,
        pools_crossing_chunk_end: s.pools_crossing_chunk_end,
        chunks_touched: s.chunks_touched,
        chunks_bound: s.chunks_bound,
        binds: s.binds,
        binds_crossing_chunk_end: s.binds_crossing_chunk_end,
        chunk_ends_bound_across: s.chunk_ends_bound_across,
        commits: s.commits,
        committed_bytes: big(s.committed_bytes),
        decommits: s.decommits,
        writes: s.writes,
        write_bytes: big(s.write_bytes),
        collects: s.collects,
        collect_bytes: big(s.collect_bytes),
        sleeps_guest: s.sleeps_guest,
        sleeps_host: s.sleeps_host,
        sleep_guest_ms: s.sleep_guest_ns as f64 / 1e6,
        sleep_host_ms: s.sleep_host_ns as f64 / 1e6,
        game_threads: s.game_threads,
        host_threads: s.host_threads,
    }
}

/// The trace's figures as text, one line each.
fn print_stats(name: &str, s: &Stats, chunk_mib: u64) {
    let mib = |b: u128| b as f64 / (1 << 20) as f64;
    let secs = s.duration_us as f64 / 1e6;
    let per_s = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    outln!("trace                     {name}");
    outln!("frames                    {} in {secs:.1} s ({:.1} frames/s)", s.frames, s.fps());
    outln!("events                    {}", s.events);
    outln!("pools                     {} made, {} released", s.pools, s.pools_released);
    outln!("pools across a chunk end  {} ({chunk_mib} MiB chunks)", s.pools_crossing_chunk_end);
    outln!("chunks touched by pools   {}", s.chunks_touched);
    outln!("chunks bound              {}", s.chunks_bound);
    outln!(
        "bindings                  {} ({} across a chunk end, {} distinct ends)",
        s.binds,
        s.binds_crossing_chunk_end,
        s.chunk_ends_bound_across
    );
    outln!("commits                   {} ({:.1} MiB), {} decommits", s.commits, mib(s.committed_bytes), s.decommits);
    outln!("guest writes              {} ({:.1} MiB)", s.writes, mib(s.write_bytes));
    outln!("collects                  {} ({:.1} MiB of ranges)", s.collects, mib(s.collect_bytes));
    outln!(
        "guest sleeps              {} ({:.0}/s, {:.1} ms asked in all)",
        s.sleeps_guest,
        per_s(s.sleeps_guest),
        s.sleep_guest_ns as f64 / 1e6
    );
    outln!(
        "host sleeps               {} ({:.0}/s, {:.1} ms asked in all)",
        s.sleeps_host,
        per_s(s.sleeps_host),
        s.sleep_host_ns as f64 / 1e6
    );
    outln!("threads                   render, {} game, {} host", s.game_threads, s.host_threads);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, text: &[u8]) -> PathBuf {
        let path = std::env::temp_dir().join(format!("emuhost-cli-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn stats_of_bad_input_is_an_error_naming_the_line() {
        let path = temp("bad.trace", b"emuhost-trace 1\n0 r frame 0\n5 r bind 0xzz 0x10\nend 2\n");
        let e = stats(Some(path.clone()), true, 16).err().expect("a bad trace is an error");
        std::fs::remove_file(&path).unwrap();
        let msg = format!("{e:#}");
        assert!(msg.contains("line 3: address \"0xzz\" is not a hex number"), "{msg}");
        assert!(stats(None, false, 3).is_err(), "a chunk that is not a power of two");
    }

    #[test]
    fn stats_json_has_the_schema_first_and_exact_sums_where_they_fit() {
        let mut s = Stats::of(std::iter::empty::<Result<_, std::convert::Infallible>>(), 16 << 20).unwrap();
        (s.committed_bytes, s.write_bytes) = (5, u128::from(u64::MAX) + 1);
        let text = serde_json::to_string(&stats_json(&s, 16)).unwrap();
        assert!(text.starts_with(&format!("{{\"schema\":{SCHEMA},\"chunk_mib\":16,")), "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["committed_bytes"].as_u64(), Some(5), "{text}");
        assert_eq!(v["write_bytes"].as_f64(), Some(18446744073709551616.0), "{text}");
        assert!(v["write_bytes"].as_u64().is_none(), "past u64: a float");
    }

    #[test]
    fn synth_writes_a_trace_that_stats_reads() {
        let path = std::env::temp_dir().join(format!("emuhost-cli-{}-synth.trace.zst", std::process::id()));
        synth(SynthConfig::default().seed(3), Some(path.clone())).unwrap();
        let s = Stats::of(FileReader::open(&path).unwrap(), 16 << 20);
        std::fs::remove_file(&path).unwrap();
        let s = s.unwrap();
        assert_eq!((s.pools, s.pools_crossing_chunk_end, s.chunks_touched), (4547, 88, 419));
        assert!(matches!(stats(None, true, 16), Ok(Outcome::Ok)));
    }
}
