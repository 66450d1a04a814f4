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
    let (queries, path) = query_arms(&a)?;
    if a.json {
        let results: Vec<_> = [&commit, &shared].into_iter().chain(&queries).map(Comparison::json).collect();
        outln!("{}", json!({ "bench": "space", "region_queries": path, "results": results }));
    } else {
        commit.print();
        shared.print();
        outln!("region queries here: {path}");
        for q in &queries {
            q.print();
        }
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

/// Region queries answered by `PROCMAP_QUERY` against the `/proc/self/maps` text (the fallback of
/// kernels before 6.11): over the whole fragmented window, and over one page (what a commit asks).
fn query_arms(a: &Args) -> anyhow::Result<(Vec<Comparison>, &'static str)> {
    let window = a.window_gib << 30;
    let stride = (a.stride_mib << 20).min(window / 2);
    let ioctl = SpaceConfig::default().window(window).build().context("reserving the window")?;
    let text = SpaceConfig::default().window(window).maps_text(true).build().context("reserving the window")?;
    let path = ioctl.region_queries()?.name();
    let islands = fragment(&ioctl, stride)?;
    fragment(&text, stride)?;
    let whole = ioctl.range(0, window)?;
    let one = ioctl.range(stride, page_size())?;
    const SMALL: u32 = 100;
    let (mut big, mut small) = ([Arm::default(), Arm::default()], [Arm::default(), Arm::default()]);
    for _ in 0..a.rounds {
        for (i, s) in [&text, &ioctl].into_iter().enumerate() {
            let n = big[i].round(|| Ok(s.kernel_regions(whole)?.len()))?;
            anyhow::ensure!(n as u64 >= 2 * islands - 1, "{n} regions over {islands} islands");
            small[i].round(|| {
                for _ in 0..SMALL {
                    anyhow::ensure!(s.kernel_regions(one)?.len() == 1, "one committed page is one region");
                }
                Ok(())
            })?;
        }
    }
    let compare = |name: String, [old, new]: [_; 2]| Comparison {
        name,
        old_name: "/proc/self/maps text",
        new_name: "PROCMAP_QUERY",
        old,
        new,
        target_time: None,
        target_calls: None,
    };
    let whole = compare(
        format!("query the regions of the fragmented {} GiB window (~{} regions)", a.window_gib, 2 * islands),
        big,
    );
    let page = compare(format!("query the region of one page, {SMALL} times, in that window"), small);
    Ok((vec![whole, page], path))
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
