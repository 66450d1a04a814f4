//! `emuhost bench space`.

use anyhow::Context;
use emuhost::space::{GuestAddr, Prot, Space, SpaceConfig, page_size};
use serde_json::json;

use super::{Arm, Comparison};
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

pub fn run(a: Args) -> anyhow::Result<Outcome> {
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
    let commit = commit_arms(&a)?;
    let shared = shared_arms(&a)?;
    if a.json {
        outln!("{}", json!({ "bench": "space", "results": [commit.json(), shared.json()] }));
    } else {
        commit.print();
        shared.print();
    }
    Ok(Outcome::Ok)
}

/// Resets the whole window to reserved and commits one page every `stride`: 2 kernel regions per
/// stride (the page and the reserved rest).
fn fragment(s: &Space, stride: u64) -> anyhow::Result<u64> {
    s.decommit(s.range(0, s.window())?)?;
    let mut islands = 0;
    let mut at = 0;
    while at + page_size() <= s.window() {
        s.commit(s.range(at, page_size())?, Prot::READ_WRITE)?;
        islands += 1;
        at += stride;
    }
    Ok(islands)
}

fn commit_arms(a: &Args) -> anyhow::Result<Comparison> {
    let window = a.window_gib << 30;
    let stride = a.stride_mib << 20;
    if stride >= window {
        anyhow::bail!("--stride-mib {} must be smaller than the window ({} GiB)", a.stride_mib, a.window_gib);
    }
    let one = SpaceConfig::default().window(window).build().context("reserving the one-call window")?;
    let walk =
        SpaceConfig::default().window(window).one_call_commit(false).build().context("reserving the walk window")?;
    let (mut old, mut new) = (Arm::default(), Arm::default());
    let mut islands = 0;
    for _ in 0..a.rounds {
        islands = fragment(&walk, stride)?;
        let whole = walk.range(0, window)?;
        old.round(|| Ok(walk.commit(whole, Prot::READ_WRITE)?))?;
        fragment(&one, stride)?;
        new.round(|| Ok(one.commit(whole, Prot::READ_WRITE)?))?;
    }
    let name = format!(
        "commit over a fragmented {} GiB window ({} committed islands, ~{} regions)",
        a.window_gib,
        islands,
        2 * islands
    );
    Ok(Comparison {
        name,
        old_name: "region by region",
        new_name: "one call",
        old,
        new,
        target_time: Some(20.0),
        target_calls: None,
    })
}

fn shared_arms(a: &Args) -> anyhow::Result<Comparison> {
    let page = page_size();
    let n = a.shared_pages;
    let s = Space::with_window((n * page).next_multiple_of(1 << 30) * 2)?;
    let sec = s.create_section(n * page)?;
    let range = s.range(0, n * page)?;
    let indices: Vec<u64> = (0..n).collect();
    let (mut old, mut new) = (Arm::default(), Arm::default());
    for _ in 0..a.rounds {
        old.round(|| {
            for i in 0..n {
                s.map_section(s.range(i * page, page)?, sec, i * page, Prot::READ_WRITE)?;
            }
            Ok(())
        })?;
        anyhow::ensure!(s.views().len() as u64 == n, "per-page arm made {} views", s.views().len());
        s.decommit(range)?;
        let views = new.round(|| Ok(s.map_pages(GuestAddr(0), sec, &indices, Prot::READ_WRITE)?))?;
        anyhow::ensure!(views == 1, "the run arm made {views} views");
        s.decommit(range)?;
    }
    let name = format!("map {n} shared pages ({} MiB)", (n * page) >> 20);
    Ok(Comparison {
        name,
        old_name: "one view per page",
        new_name: "runs as one view",
        old,
        new,
        target_time: None,
        target_calls: Some(50.0),
    })
}
