//! The space's bench: one-call commit against the region-by-region walk over a fragmented window;
//! a run of shared pages mapped as one view against one view per page; region queries answered by
//! `PROCMAP_QUERY` against the `/proc/self/maps` text.

use emuhost::space::{GuestAddr, Prot, Space, SpaceConfig, page_size};

use super::{Arm, BenchError, Comparison, check};

/// What to measure.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SpaceBench {
    /// Rounds of each arm (alternated).
    pub rounds: u32,
    /// Guest window to fragment, in GiB.
    pub window_gib: u64,
    /// One committed page every this many MiB fragments the window (two kernel regions each);
    /// smaller than the window.
    pub stride_mib: u64,
    /// Shared pages to map.
    pub shared_pages: u64,
}

impl SpaceBench {
    /// The bench with these fields (see each field).
    pub fn new(rounds: u32, window_gib: u64, stride_mib: u64, shared_pages: u64) -> Self {
        SpaceBench { rounds, window_gib, stride_mib, shared_pages }
    }
}

/// What was measured.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SpaceReport {
    /// One-call commit of the fragmented window against the region-by-region walk.
    pub commit: Comparison,
    /// `None` where shared views cannot be mapped (Windows without placeholders).
    pub shared: Option<Comparison>,
    /// The region queries: over the whole window, and over one page many times (none on Windows,
    /// which has one way to ask: `VirtualQuery`).
    pub queries: Vec<Comparison>,
    /// How this kernel answers region queries (`Space::region_queries`).
    pub region_queries: &'static str,
    /// The comparisons not measured here, and why.
    pub left_out: Vec<(&'static str, String)>,
}

/// The region-query comparison's name where it is left out.
pub const QUERIES: &str = "region queries: PROCMAP_QUERY against the /proc/self/maps text";
/// The shared-pages comparison's name where it is left out.
pub const SHARED: &str = "a run of shared pages as one view against one view per page";

/// Runs the space bench (see the module's docs); what cannot be measured on this OS is in
/// [`SpaceReport::left_out`].
///
/// # Errors
///
/// [`BenchError::Check`] for a stride not smaller than the window; the first runtime call that
/// failed (the window reserved, a commit, a view mapped, a region query).
pub fn run(a: &SpaceBench) -> Result<SpaceReport, BenchError> {
    let mut left_out = Vec::new();
    let commit = commit_arms(a)?;
    let shared = match super::views_here() {
        Ok(()) => Some(shared_arms(a)?),
        Err(why) => {
            left_out.push((SHARED, why));
            None
        }
    };
    let (queries, region_queries) = if cfg!(target_os = "linux") {
        query_arms(a)?
    } else {
        let path = Space::with_window(1 << 30)?.region_queries()?.name();
        left_out.push((QUERIES, format!("Linux's two ways; this OS has one ({path})")));
        (Vec::new(), path)
    };
    Ok(SpaceReport { commit, shared, queries, region_queries, left_out })
}

/// Resets the whole window to reserved and commits one page every `stride`: 2 kernel regions per
/// stride (the page and the reserved rest).
fn fragment(s: &Space, stride: u64) -> Result<u64, BenchError> {
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

fn commit_arms(a: &SpaceBench) -> Result<Comparison, BenchError> {
    let window = a.window_gib << 30;
    let stride = a.stride_mib << 20;
    check!(stride < window, "a stride of {} MiB must be smaller than the window ({} GiB)", a.stride_mib, a.window_gib);
    let one = SpaceConfig::default()
        .window(window)
        .build()
        .map_err(|e| BenchError::doing("reserving the one-call window", e))?;
    let walk = SpaceConfig::default()
        .window(window)
        .one_call_commit(false)
        .build()
        .map_err(|e| BenchError::doing("reserving the walk window", e))?;
    let (mut old, mut new) = (Arm::default(), Arm::default());
    let mut islands = 0;
    super::progress::plan(u64::from(a.rounds));
    for _ in 0..a.rounds {
        super::progress::tick();
        islands = fragment(&walk, stride)?;
        let whole = walk.range(0, window)?;
        old.round(|| walk.commit(whole, Prot::READ_WRITE))?;
        fragment(&one, stride)?;
        new.round(|| one.commit(whole, Prot::READ_WRITE))?;
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
fn query_arms(a: &SpaceBench) -> Result<(Vec<Comparison>, &'static str), BenchError> {
    let window = a.window_gib << 30;
    let stride = (a.stride_mib << 20).min(window / 2);
    let reserve = |c: SpaceConfig| c.build().map_err(|e| BenchError::doing("reserving the window", e));
    let ioctl = reserve(SpaceConfig::default().window(window))?;
    let text = reserve(SpaceConfig::default().window(window).maps_text(true))?;
    let path = ioctl.region_queries()?.name();
    let islands = fragment(&ioctl, stride)?;
    fragment(&text, stride)?;
    let whole = ioctl.range(0, window)?;
    let one = ioctl.range(stride, page_size())?;
    const SMALL: u32 = 100;
    let (mut big, mut small) = ([Arm::default(), Arm::default()], [Arm::default(), Arm::default()]);
    super::progress::plan(u64::from(a.rounds));
    for _ in 0..a.rounds {
        super::progress::tick();
        for (i, s) in [&text, &ioctl].into_iter().enumerate() {
            let n = big[i].round(|| Ok::<_, BenchError>(s.kernel_regions(whole)?.len()))?;
            check!(n as u64 >= 2 * islands - 1, "{n} regions over {islands} islands");
            small[i].round(|| {
                for _ in 0..SMALL {
                    check!(s.kernel_regions(one)?.len() == 1, "one committed page is one region");
                }
                Ok::<_, BenchError>(())
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

fn shared_arms(a: &SpaceBench) -> Result<Comparison, BenchError> {
    let page = page_size();
    let n = a.shared_pages;
    let s = Space::with_window((n * page).next_multiple_of(1 << 30) * 2)?;
    let sec = s.create_section(n * page)?;
    let range = s.range(0, n * page)?;
    let indices: Vec<u64> = (0..n).collect();
    let (mut old, mut new) = (Arm::default(), Arm::default());
    super::progress::plan(u64::from(a.rounds));
    for _ in 0..a.rounds {
        super::progress::tick();
        old.round(|| {
            for i in 0..n {
                s.map_section(s.range(i * page, page)?, sec, i * page, Prot::READ_WRITE)?;
            }
            Ok::<_, BenchError>(())
        })?;
        check!(s.views().len() as u64 == n, "per-page arm made {} views", s.views().len());
        s.decommit(range)?;
        let views = new.round(|| s.map_pages(GuestAddr(0), sec, &indices, Prot::READ_WRITE))?;
        check!(views == 1, "the run arm made {views} views");
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
