//! `emuhost bench space`: the flags, then the lab's bench ([`emuhost_lab::bench::space`]), printed.

use emuhost_lab::bench::Comparison;
use emuhost_lab::bench::space::SpaceBench;

use super::Report;
use crate::Outcome;

#[derive(clap::Args)]
pub struct Args {
    /// Rounds of each arm (alternated).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Guest window to fragment, in GiB.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=65536))]
    window_gib: u64,
    /// One committed page every this many MiB fragments the window (two kernel regions each).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    stride_mib: u64,
    /// Shared pages to map.
    #[arg(long, default_value_t = 65536, value_parser = clap::value_parser!(u64).range(1..=1 << 22))]
    shared_pages: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// `bench space --json`.
#[derive(serde::Serialize)]
struct SpaceJson<'a> {
    schema: u32,
    bench: &'static str,
    region_queries: &'static str,
    /// Each comparison's figures (see `Report for Comparison`).
    results: Vec<serde_json::Value>,
    left_out: Vec<LeftOut<'a>>,
}

/// A comparison left out, and why.
#[derive(serde::Serialize)]
struct LeftOut<'a> {
    name: &'a str,
    why: &'a str,
}

pub fn run(a: Args) -> anyhow::Result<Outcome> {
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
    if a.stride_mib << 20 >= a.window_gib << 30 {
        anyhow::bail!("--stride-mib {} must be smaller than the window ({} GiB)", a.stride_mib, a.window_gib);
    }
    let r = emuhost_lab::bench::space::run(&SpaceBench::new(a.rounds, a.window_gib, a.stride_mib, a.shared_pages))?;
    if a.json {
        let results: Vec<_> =
            [&r.commit].into_iter().chain(&r.shared).chain(&r.queries).map(Comparison::json).collect();
        let left_out = r.left_out.iter().map(|(name, why)| LeftOut { name, why }).collect();
        let json =
            SpaceJson { schema: super::SCHEMA, bench: "space", region_queries: r.region_queries, results, left_out };
        outln!("{}", serde_json::to_string(&json)?);
    } else {
        r.commit.print();
        if let Some(s) = &r.shared {
            s.print();
        }
        outln!("region queries here: {}", r.region_queries);
        for q in &r.queries {
            q.print();
        }
        for (what, why) in &r.left_out {
            outln!("left out: {what}: {why}");
        }
    }
    Ok(Outcome::Ok)
}
