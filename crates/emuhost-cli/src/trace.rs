//! `emuhost trace synth` and `emuhost trace stats`.

use std::io::{self, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Subcommand;
use emuhost::trace::{self, FileReader, Stats, Synth, SynthConfig, TraceError, TraceWriter};
use serde_json::json;

use crate::Outcome;

#[derive(Subcommand)]
pub enum Which {
    /// Write a synthetic session shaped on the measured one (the default session with the default seed).
    Synth {
        /// The generator's seed.
        #[arg(long, default_value_t = trace::DEFAULT_SEED)]
        seed: u64,
        /// Write here instead of to stdout; a name ending in `.zst` is compressed.
        #[arg(long)]
        out: Option<PathBuf>,
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
        Which::Synth { seed, out } => synth(seed, out),
        Which::Stats { file, json, chunk_mib } => stats(file, json, chunk_mib),
    }
}

fn synth(seed: u64, out: Option<PathBuf>) -> anyhow::Result<Outcome> {
    let synth = Synth::new(SynthConfig::default().seed(seed))?;
    let header = synth.header();
    let events = match &out {
        Some(path) => {
            let mut w = TraceWriter::create(path, header)?;
            write_all(synth, &mut w)?;
            let n = w.events();
            w.finish().with_context(|| format!("writing {}", path.display()))?;
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
            ("the default session".to_owned(), Stats::of(trace::default_session().map(Ok::<_, anyhow::Error>), chunk)?)
        }
    };
    if as_json {
        let v = json!({
            "chunk_mib": chunk_mib,
            "events": s.events,
            "frames": s.frames,
            "duration_s": s.duration_us as f64 / 1e6,
            "fps": s.fps(),
            "pools": s.pools,
            "pools_released": s.pools_released,
            "pools_crossing_chunk_end": s.pools_crossing_chunk_end,
            "chunks_touched": s.chunks_touched,
            "chunks_bound": s.chunks_bound,
            "binds": s.binds,
            "binds_crossing_chunk_end": s.binds_crossing_chunk_end,
            "chunk_ends_bound_across": s.chunk_ends_bound_across,
            "commits": s.commits,
            "committed_bytes": s.committed_bytes,
            "decommits": s.decommits,
            "writes": s.writes,
            "write_bytes": s.write_bytes,
            "collects": s.collects,
            "collect_bytes": s.collect_bytes,
            "sleeps_guest": s.sleeps_guest,
            "sleeps_host": s.sleeps_host,
            "sleep_guest_ms": s.sleep_guest_ns as f64 / 1e6,
            "sleep_host_ms": s.sleep_host_ns as f64 / 1e6,
            "game_threads": s.game_threads,
            "host_threads": s.host_threads,
        });
        println!("{v}");
    } else {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let secs = s.duration_us as f64 / 1e6;
        let per_s = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        println!("trace                     {name}");
        println!("frames                    {} in {secs:.1} s ({:.1} frames/s)", s.frames, s.fps());
        println!("events                    {}", s.events);
        println!("pools                     {} made, {} released", s.pools, s.pools_released);
        println!("pools across a chunk end  {} ({chunk_mib} MiB chunks)", s.pools_crossing_chunk_end);
        println!("chunks touched by pools   {}", s.chunks_touched);
        println!("chunks bound              {}", s.chunks_bound);
        println!(
            "bindings                  {} ({} across a chunk end, {} distinct ends)",
            s.binds, s.binds_crossing_chunk_end, s.chunk_ends_bound_across
        );
        println!(
            "commits                   {} ({:.1} MiB), {} decommits",
            s.commits,
            mib(s.committed_bytes),
            s.decommits
        );
        println!("guest writes              {} ({:.1} MiB)", s.writes, mib(s.write_bytes));
        println!("collects                  {} ({:.1} MiB of ranges)", s.collects, mib(s.collect_bytes));
        println!(
            "guest sleeps              {} ({:.0}/s, {:.1} ms asked in all)",
            s.sleeps_guest,
            per_s(s.sleeps_guest),
            s.sleep_guest_ns as f64 / 1e6
        );
        println!(
            "host sleeps               {} ({:.0}/s, {:.1} ms asked in all)",
            s.sleeps_host,
            per_s(s.sleeps_host),
            s.sleep_host_ns as f64 / 1e6
        );
        println!("threads                   render, {} game, {} host", s.game_threads, s.host_threads);
    }
    Ok(Outcome::Ok)
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
    fn synth_writes_a_trace_that_stats_reads() {
        let path = std::env::temp_dir().join(format!("emuhost-cli-{}-synth.trace.zst", std::process::id()));
        synth(3, Some(path.clone())).unwrap();
        let s = Stats::of(FileReader::open(&path).unwrap(), 16 << 20);
        std::fs::remove_file(&path).unwrap();
        let s = s.unwrap();
        assert_eq!((s.pools, s.pools_crossing_chunk_end, s.chunks_touched), (4547, 88, 419));
        assert!(matches!(stats(None, true, 16), Ok(Outcome::Ok)));
    }
}
