//! The pools policy: a binding imports the pools it lies in, exactly, or where that would pass
//! the wait target its own part of them (sized from which pages are resident) and leaves the
//! pools whole to the background threads; a binding that an import in flight covers waits for
//! it where that should land sooner. The cost it sizes parts by is learned from the bindings'
//! own imports ([`super::super::cost::Learned`]).

use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use super::super::ImportError;
use super::super::backend::Backend;
use super::super::cost::ImportCost;
use super::super::plan::{Planned, piece, pool_range};
use super::super::pools::{Pool, PoolId};
use super::ahead::AheadJob;
use super::bind::{AtWork, FlightWait};
use super::config::PoolsConfig;
use super::state::{Bound, State};
use super::{Core, Importer, regions};
use crate::space::page_size;

/// A binding's own part of its pools (pools policy), sized by [`Core::size_part`].
pub(super) struct Part {
    pub(super) r: Planned,
    /// What its import is estimated to take.
    pub(super) est: Duration,
    /// The range whose pages' residency was read, and one entry per page (none: not read).
    pub(super) seen: Planned,
    pub(super) pages: Vec<bool>,
}

impl Part {
    /// `r`, with every page taken as untouched.
    pub(super) fn untouched(cost: &ImportCost, r: Planned) -> Part {
        Part { r, est: cost.estimate(r.len()), seen: r, pages: Vec::new() }
    }

    /// The resident bytes of `r`, where it lies inside the range read.
    pub(super) fn resident_in(&self, r: Planned) -> Option<u64> {
        if self.pages.is_empty() || r.lo < self.seen.lo || r.hi > self.seen.hi {
            return None;
        }
        let page = page_size();
        let (a, b) = ((r.lo - self.seen.lo) / page, (r.hi - self.seen.lo).div_ceil(page));
        let pages = self.pages.get(a as usize..b as usize)?;
        Some((pages.iter().filter(|&&p| p).count() as u64 * page).min(r.len()))
    }
}

impl<B: Backend + 'static> Importer<B> {
    /// The pools policy's binding with nothing ready: waits for an import in flight that should
    /// land sooner than the binding's own part would take, or imports its pools whole where that
    /// fits the wait target, or else its part of them and leaves the rest to the background
    /// thread; then marks the binding's regions as ones where bindings come (their pools are
    /// imported ahead). The lock is given back.
    #[allow(clippy::type_complexity)]
    pub(super) fn bind_pools<'a>(
        &'a self,
        cfg: &PoolsConfig,
        mut st: MutexGuard<'a, State<B::Import>>,
        addr: u64,
        size: u64,
        now: Instant,
        flight: &mut FlightWait,
    ) -> Result<(MutexGuard<'a, State<B::Import>>, Result<Bound, ImportError>), ImportError> {
        let core = &*self.core;
        let end = addr.checked_add(size).ok_or(ImportError::BindingWraps { addr, size })?;
        let whole = core.in_window(pool_range(&st.pools, addr, size, core.align)?, addr, size);
        // The part at the granule: every page taken as untouched.
        let fallback = piece(whole, addr, size, st.granule);
        let overlaps_ok = core.backend.overlapping_imports();
        let t = Instant::now();
        // The background threads start nothing that takes the memory-map lock while the part's
        // pages are read (a populate or a commit queued there would hold the read), nor enter
        // the driver from the sizing to the import, unless the binding waits for one of theirs
        // in flight: one let into the driver between them would hold up the import sized
        // without it.
        let mut at_work = overlaps_ok.then(|| AtWork::new(&core.binding_imports));
        let mut part = if overlaps_ok {
            core.size_part(&st, whole, addr, size, core.wait_beside_driver(cfg, &st))
        } else {
            Part::untouched(&st.cost, fallback)
        };
        flight.sized = t.elapsed();
        // A part over pages a binding's import holds takes that import in (a re-import all the
        // same, but the next binding across their border finds one import).
        let taken = if overlaps_ok { take_in(&st, cfg.wait, whole, &mut part) } else { 0 };
        let own = if overlaps_ok { part.r } else { whole };
        flight.part = Some((part.r, part.est, part.resident_in(part.r)));
        let (g, served) = core.wait_in_flight(st, (addr, size), part.est, own, flight, &mut at_work);
        st = g;
        if let Some(bound) = served {
            return Ok((st, Ok(bound)));
        }
        let split = overlaps_ok && part.r != whole;
        let tries: &[(Planned, bool)] = if split || fallback == whole {
            &[(if split { part.r } else { whole }, false)]
        } else {
            &[(whole, true), (fallback, false)]
        };
        let debug = tracing::enabled!(tracing::Level::DEBUG);
        let before = (st.stats.reimports, if debug { describe_over(&st, whole) } else { String::new() });
        let bound = core.bind_importing(&mut st, addr, tries, now);
        drop(at_work);
        if let Ok(b) = &bound {
            // A part grown over imports it took in is not learned from (their pages' cost is
            // neither untouched nor a populate's), nor one that met a background import in the
            // driver: drivers serialize imports, so its time holds the wait for that one, a
            // fixed cost no smaller part avoids, which per MiB of a small part would shrink the
            // granule tenfold (more parts, more borders for bindings to cross, more imports).
            if taken == 0 && !st.met_in_driver {
                core.learn(cfg, &mut st, b.range.len(), part.resident_in(b.range));
            }
            if st.stats.reimports > before.0 {
                log_reimport((addr, size), b.range, whole, part.r, &before.1);
            }
        }
        let epoch = st.epoch;
        if split && bound.is_ok() {
            st.stats.pieces += 1;
            self.send(AheadJob::Widen(whole, epoch));
        }
        let chunk = core.cfg.chunk;
        let mut new_pools = Vec::new();
        for c in regions(addr, end, chunk) {
            if st.hot.insert(c) {
                let (lo, hi) = (c * chunk, (c * chunk).saturating_add(chunk));
                new_pools.extend(st.pools.overlapping(lo, hi).into_iter().map(|p| p.id));
            }
        }
        if cfg.ahead > 0 {
            for id in new_pools {
                self.send(AheadJob::Pool(id, epoch));
            }
        }
        Ok((st, bound))
    }
}

impl<B: Backend> Core<B> {
    /// Learns from a binding's import of `len` bytes just made (its time is the last of
    /// [`super::Stats::times`]), `resident` of them populated before it (`None`: not read, all
    /// taken as untouched), where the cost was measured ([`super::super::cost::Learned::learn`]),
    /// and sizes the granule again by what it learned.
    pub(super) fn learn(&self, cfg: &PoolsConfig, st: &mut State<B::Import>, len: u64, resident: Option<u64>) {
        let Some(&took) = st.stats.times.last() else { return };
        // A cost given is used as it is.
        if cfg.cost.is_some() {
            return;
        }
        if st.learned.learn(&self.cost, &mut st.cost, took, len, resident) {
            st.granule = st.cost.granule(cfg.wait, self.align);
        }
    }

    /// What is left of the wait target for a binding's own import: the target less what is
    /// left of the background import in the driver now, if any (its pin at the populated cost,
    /// less its time there so far). Drivers serialize imports, so the binding's import waits for
    /// that one first, whatever its own size.
    pub(super) fn wait_beside_driver(&self, cfg: &PoolsConfig, st: &State<B::Import>) -> Duration {
        let in_driver = *self.in_driver.lock().unwrap_or_else(|p| p.into_inner());
        let left = in_driver.map_or(Duration::ZERO, |(since, r)| st.cost.pin(r.len()).saturating_sub(since.elapsed()));
        cfg.wait.saturating_sub(left)
    }

    /// The pools policy's part of `whole` that a binding at `addr, size` imports itself
    /// (within `wait`, the wait target less the background import in the driver, if any):
    /// `whole` where its import is estimated to fit the wait target, given which of its pages
    /// are resident, else the piece around the binding at the largest power-of-two granule that
    /// fits, else the piece at the backend's alignment; a range larger than that only where it
    /// overlaps no import in flight, and no import a binding made or used unless the least
    /// part does too. One residency read (`mincore`; `QueryWorkingSetEx` on Windows) reads the
    /// pages of the largest of these that could fit were all its pages resident (a few MiB at
    /// most); where none could, or the read fails, every page is taken as untouched.
    pub(super) fn size_part(
        &self,
        st: &State<B::Import>,
        whole: Planned,
        addr: u64,
        size: u64,
        wait: Duration,
    ) -> Part {
        let cost = st.cost;
        let least = piece(whole, addr, size, self.align);
        if cost.pin(least.len()) > wait {
            return Part::untouched(&cost, least);
        }
        let reach = cost.pin_granule(wait, self.align);
        let seen = if cost.pin(whole.len()) <= wait { whole } else { piece(whole, addr, size, reach) };
        let mut part = Part { r: least, est: Duration::MAX, seen, pages: Vec::new() };
        let read = self.space.range(seen.lo, seen.len()).map_err(ImportError::from);
        if read.and_then(|r| Ok(self.space.resident_pages(r, &mut part.pages)?)).is_err() {
            return Part::untouched(&cost, least);
        }
        let granules = (0..).map(|i| reach >> i).take_while(|&g| g > self.align);
        let candidates = std::iter::once(seen).chain(granules.map(|g| piece(whole, addr, size, g)));
        let estimate = |r: Planned| cost.estimate_with(r.len(), part.resident_in(r).unwrap_or(0));
        // More than the least part only over pages no binding imported and none in flight: a
        // larger part there would import them again. Where the least part imports pages again
        // already (a binding across the border of two parts), the larger one imports no more
        // again than it does, and holds the next binding across that border.
        let again = st.overlaps_used(least.lo, least.hi, None);
        let free = |r: &Planned| !((!again && st.overlaps_used(r.lo, r.hi, None)) || st.in_flight_over(*r));
        let fits = candidates.filter(free).map(|r| (r, estimate(r))).find(|&(_, est)| est <= wait);
        (part.r, part.est) = fits.unwrap_or((least, estimate(least)));
        part
    }

    /// A binding's wait for an import in flight that covers it (`addr, size`), where that
    /// should land sooner than its own part would take (`part_cost`), or where the device
    /// refuses overlaps and an import in flight overlaps `own`: the binding served by it, or
    /// `None` to import.
    pub(super) fn wait_in_flight<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<B::Import>>,
        (addr, size): (u64, u64),
        part_cost: Duration,
        own: Planned,
        flight: &mut FlightWait,
        at_work: &mut Option<AtWork<'_>>,
    ) -> (MutexGuard<'a, State<B::Import>>, Option<Bound>) {
        // The caller checked that the binding does not wrap.
        let end = addr.saturating_add(size);
        let overlaps_ok = self.backend.overlapping_imports();
        // The wait for an import in flight is bounded once, when it begins: by what is left of
        // that import and the binding's own part's time. Each landing wakes the binding to look
        // again, and must not push the bound further.
        let mut deadline: Option<(Instant, Instant)> = None;
        loop {
            let in_driver = *self.in_driver.lock().unwrap_or_else(|p| p.into_inner());
            let left = st.in_flight_left(addr, end, in_driver);
            // A device that refuses overlaps cannot import beside an import in flight: it waits.
            let must = !overlaps_ok && st.in_flight_over(own);
            let worth = left.is_some_and(|l| l <= part_cost);
            if !must && !worth {
                break;
            }
            let (began, until) = *deadline.get_or_insert_with(|| {
                st.stats.in_flight_waits += 1;
                flight.phase = match in_driver {
                    Some((since, r)) if r.covers(addr, end) => {
                        format!(", in the driver {:.2} ms", since.elapsed().as_secs_f64() * 1e3)
                    }
                    _ => String::new(),
                };
                let now = Instant::now();
                // At most an hour: a cost given may be anything, and an `Instant` past it
                // would not be.
                let bound = left.unwrap_or_default().saturating_add(part_cost).min(Duration::from_secs(3600));
                (now, now + bound)
            });
            // The import waited for must get into the driver.
            *at_work = None;
            let mut timed_out = false;
            st = if must {
                self.landed.wait(st).unwrap_or_else(|p| p.into_inner())
            } else {
                let rest = until.saturating_duration_since(Instant::now());
                let (g, t) = self.landed.wait_timeout(st, rest).unwrap_or_else(|p| p.into_inner());
                timed_out = t.timed_out();
                g
            };
            flight.waited = Some(began.elapsed());
            flight.timed_out = timed_out;
            if let Some(bound) = self.reuse(&mut st, addr, size) {
                return (st, Some(bound));
            }
            if timed_out {
                break;
            }
        }
        (st, None)
    }
}

/// Grows `part` (inside `whole`, the binding's pools) over every live import a binding
/// made or used that it overlaps and that lies inside `whole`, again until nothing more
/// joins: a binding across the border of earlier parts imports pages again in any case, and
/// the union is one import that serves the next binding across that border (which would
/// import them again once more). Taken where the union's estimate (the pages taken in at
/// the populated cost: an import pinned them) fits the wait target, or costs no more than
/// the part and one import's fixed part (what the next binding across the border would pay
/// at least). The imports taken in stay live (bindings hold
/// their handles) until their pools are released, and serve no later binding
/// ([`State::covering`] takes the largest). The bytes taken in (0: none).
pub(super) fn take_in<I>(st: &State<I>, wait: Duration, whole: Planned, part: &mut Part) -> u64 {
    let inside = |k: &(u64, u64), hi: u64| whole.lo <= k.0 && hi <= whole.hi;
    let mut r = part.r;
    loop {
        let grown = st
            .overlapping(r.lo, r.hi)
            .filter(|(k, v)| v.ahead.is_none() && inside(k, v.hi))
            .fold(r, |u, (k, v)| Planned { lo: u.lo.min(k.0), hi: u.hi.max(v.hi) });
        if grown == r {
            break;
        }
        r = grown;
    }
    let extra = r.len() - part.r.len();
    if extra == 0 {
        return 0;
    }
    let cost = &st.cost;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let est = part.est.saturating_add(cost.populated_per_mib.mul_f64(mib(extra)));
    if est > wait.max(part.est.saturating_add(cost.fixed)) {
        return 0;
    }
    tracing::debug!("part {} grown to {r}, taking in the imports of {} KiB it overlaps", part.r, extra >> 10);
    (part.r, part.est) = (r, est);
    extra
}

/// The debug line of a binding `addr, size` whose import of `range` (its part `part` of its
/// pools `whole`) was a re-import: what was over its pools before it (`over`).
fn log_reimport((addr, size): (u64, u64), range: Planned, whole: Planned, part: Planned, over: &str) {
    tracing::debug!(
        "re-import by binding {addr:#x}+{size:#x}: {range} of pools {whole} (part {part}); live over the pools: {over}"
    );
}

/// The live imports and imports in flight over `r`, in words (the debug log of a re-import).
fn describe_over<I>(st: &State<I>, r: Planned) -> String {
    let mut out: Vec<String> = st
        .overlapping(r.lo, r.hi)
        .map(|(k, v)| {
            let used = if v.ahead.is_some() { "unused" } else { "used" };
            format!("{:#x}..{:#x} {:?} {used}", k.0, v.hi, v.made)
        })
        .collect();
    out.extend(st.in_flight.iter().filter(|f| f.r.lo < r.hi && r.lo < f.r.hi).map(|f| format!("{} in flight", f.r)));
    out.join(", ")
}

/// The live imports released with `pool` (its id `id`) under the pools policy: every one it
/// overlaps that overlaps no other live pool, and every one made ahead for it.
pub(super) fn released_with<I>(st: &State<I>, id: PoolId, pool: Pool) -> Vec<(u64, u64)> {
    st.overlapping(pool.lo, pool.hi)
        .filter(|(k, v)| v.ahead == Some(id) || st.pools.overlapping(k.0, v.hi).is_empty())
        .map(|(k, _)| *k)
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::super::state::{Flight, Live, Made};
    use super::super::{ImportConfig, ImportPolicy};
    use super::*;
    use crate::space::{Prot, Space};

    fn planned(lo: u64, hi: u64) -> Planned {
        Planned { lo, hi }
    }

    /// A live import `lo..hi` in `st`: used by a binding, or made ahead for a pool and unused.
    fn live(st: &mut State<()>, lo: u64, hi: u64, unused: bool) {
        st.seq += 1;
        let ahead = unused.then_some(PoolId(9));
        let made = if unused { Made::Ahead(PoolId(9)) } else { Made::Binding { reimport: false } };
        st.imports.insert(
            (lo, st.seq),
            Live { hi, import: (), ahead, made_for: ahead, made, handed: !unused, replaced: false },
        );
        st.longest = st.longest.max(hi - lo);
    }

    /// A binding's part across the border of two parts bindings imported takes both in: one
    /// import of their union (the next binding across either border finds it), within the
    /// binding's pools, and not over an unused import ahead (that one is released instead).
    #[test]
    fn a_part_across_two_live_parts_takes_them_in() {
        let us = Duration::from_micros;
        let cost = ImportCost { fixed: us(100), untouched_per_mib: us(10_000), populated_per_mib: us(100) };
        let mut st: State<()> = State::new(cost, 4096);
        let whole = planned(0x10_0000, 0x20_0000);
        live(&mut st, 0x10_0000, 0x11_0000, false);
        live(&mut st, 0x11_8000, 0x12_8000, false);
        // Unused ahead, and a binding's import reaching past the pools: neither is taken in.
        live(&mut st, 0x12_8000, 0x13_0000, true);
        live(&mut st, 0xf_0000, 0x10_1000, false);
        let mut part = Part::untouched(&cost, planned(0x10_f000, 0x11_9000));
        let est = part.est;
        assert_eq!(take_in(&st, us(400), whole, &mut part), 0x2_8000 - 0xa000);
        assert_eq!(part.r, planned(0x10_0000, 0x12_8000));
        assert!(part.est > est && part.est <= est + cost.fixed);
        // Where taking them in would cost more than the wait target and one import's fixed
        // part, the part stays as it was.
        let mut part = Part::untouched(&cost, planned(0x10_f000, 0x11_9000));
        let mut dear = st;
        dear.cost.populated_per_mib = us(10_000);
        assert_eq!(take_in(&dear, us(400), whole, &mut part), 0);
        assert_eq!(part.r, planned(0x10_f000, 0x11_9000));
    }

    /// A binding inside several live imports is served by the largest: the import that took
    /// the others in.
    #[test]
    fn a_binding_is_served_by_the_largest_import_that_covers_it() {
        let mut st: State<()> = State::new(ImportCost::default(), 4096);
        live(&mut st, 0x10_0000, 0x11_0000, false);
        live(&mut st, 0x10_0000, 0x12_8000, false);
        live(&mut st, 0x10_8000, 0x11_0000, false);
        assert_eq!(st.covering(0x10_8000, 0x10_9000), Some((0x10_0000, 2)));
    }

    /// A binding's part is sized within what is left of the wait target once the background
    /// import in the driver now has landed (drivers serialize imports): here one with a second
    /// of its pin left, so the binding imports its own pages, not its pool whole (which alone
    /// would fit the target).
    #[test]
    fn a_part_beside_a_background_import_in_the_driver_is_the_least_one() {
        let space = Arc::new(Space::with_window(64 << 20).unwrap());
        space.commit(space.range(0, 64 << 20).unwrap(), Prot::READ_WRITE).unwrap();
        let us = Duration::from_micros;
        let cost = ImportCost { fixed: us(50), untouched_per_mib: us(1000), populated_per_mib: us(1000) };
        let pools = PoolsConfig::default().ahead(0).cost(Some(cost)).ahead_threads(1);
        let cfg = ImportConfig::default().chunk(1 << 20).policy(ImportPolicy::Pools(pools));
        let imp = Importer::new(space, crate::import::Pin::new(), cfg).unwrap();
        imp.add_pool(4 << 20, 64 << 10).unwrap();
        imp.add_pool(8 << 20, 64 << 10).unwrap();
        // Alone, the pool whole (64 KiB: 0.11 ms) fits the 400 us target.
        assert_eq!(imp.bind((4 << 20) + 0x10, 0x10).unwrap().range, planned(4 << 20, (4 << 20) + (64 << 10)));
        *imp.core.in_driver.lock().unwrap() = Some((Instant::now(), planned(32 << 20, (32 << 20) + (1 << 30))));
        let bound = imp.bind((8 << 20) + 0x10, 0x10);
        *imp.core.in_driver.lock().unwrap() = None;
        assert_eq!(bound.unwrap().range, planned(8 << 20, (8 << 20) + 4096));
    }

    /// A binding holds the background threads out of the driver from its sizing to its import,
    /// but not while it waits for an import in flight: that one must get in. Here the flight is
    /// put in by hand (expected in 10 s, sooner than the binding's own part), and the test sees
    /// the binding waiting (its count of in-flight waits, taken under the importer's lock that
    /// the wait gives up) with no binding at work, then lands the flight.
    #[test]
    fn a_binding_waiting_for_an_import_in_flight_lets_the_background_threads_in() {
        let space = Arc::new(Space::with_window(64 << 20).unwrap());
        space.commit(space.range(0, 64 << 20).unwrap(), Prot::READ_WRITE).unwrap();
        let slow = ImportCost {
            fixed: Duration::ZERO,
            untouched_per_mib: Duration::from_secs(3600),
            populated_per_mib: Duration::ZERO,
        };
        let pools = PoolsConfig::default().ahead(0).cost(Some(slow)).ahead_threads(1);
        let cfg = ImportConfig::default().chunk(1 << 20).policy(ImportPolicy::Pools(pools));
        let imp = Importer::new(space, crate::import::Pin::new(), cfg).unwrap();
        imp.add_pool(4 << 20, 64 << 10).unwrap();
        let r = planned(4 << 20, (4 << 20) + (64 << 10));
        imp.core.state().in_flight.push(Flight { r, since: Instant::now(), est: Duration::from_secs(10) });
        let at_work_while_waiting = std::thread::scope(|sc| {
            let seen = sc.spawn(|| {
                loop {
                    let mut st = imp.core.state();
                    if st.stats.in_flight_waits == 1 {
                        let at_work = imp.core.binding_imports.load(std::sync::atomic::Ordering::Acquire);
                        st.in_flight.clear();
                        imp.core.landed.notify_all();
                        return at_work;
                    }
                    drop(st);
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
            assert!(imp.bind((4 << 20) + 0x10, 0x10).unwrap().made);
            seen.join().unwrap()
        });
        assert_eq!(at_work_while_waiting, 0);
    }

    /// A binding's import that met a background import in the driver is not learned from (its
    /// time holds the wait for that one); one that met none is. Under the fault plan's import
    /// cost every import sleeps 200 ms, far past what the start-up measure saw.
    #[cfg(feature = "faults")]
    #[test]
    fn a_binding_import_that_met_one_in_the_driver_teaches_the_cost_nothing() {
        let space = Arc::new(Space::with_window(64 << 20).unwrap());
        space.commit(space.range(0, 64 << 20).unwrap(), Prot::READ_WRITE).unwrap();
        // A wait target the pools fit whole whatever the start-up measure saw under load.
        let pools = PoolsConfig::default().ahead(0).ahead_threads(1).wait(Duration::from_millis(100));
        let cfg = ImportConfig::default().chunk(1 << 20).policy(ImportPolicy::Pools(pools));
        let imp = Importer::new(space, crate::import::Pin::new(), cfg).unwrap();
        let start = imp.cost();
        let model = crate::faults::ImportCostModel { fixed: Duration::from_millis(200), per_mib: Duration::ZERO };
        let _plan = crate::faults::scoped(crate::faults::Plan { import_cost: Some(model), ..Default::default() });
        imp.add_pool(4 << 20, 64 << 10).unwrap();
        imp.add_pool(8 << 20, 64 << 10).unwrap();
        // A background import of one page, just in the driver: nothing left of it to wait for.
        *imp.core.in_driver.lock().unwrap() = Some((Instant::now(), planned(32 << 20, (32 << 20) + 4096)));
        let met = imp.bind((4 << 20) + 0x10, 0x10);
        *imp.core.in_driver.lock().unwrap() = None;
        assert!(met.unwrap().made);
        assert_eq!(imp.cost(), start, "learned from an import that met one in the driver");
        assert!(imp.bind((8 << 20) + 0x10, 0x10).unwrap().made);
        assert!(imp.cost().untouched_per_mib > start.untouched_per_mib, "{} against {start}", imp.cost());
    }

    /// What bindings' imports teach the cost (measured at start, so learned): the 90th
    /// percentile of their recent times per MiB, not the average (the wait target bounds the
    /// slow imports), untouched and resident pages apart, and nothing from small imports.
    #[test]
    fn the_cost_learned_is_the_slow_imports_per_kind_of_page() {
        let space = Arc::new(Space::with_window(64 << 20).unwrap());
        let pools = PoolsConfig::default().ahead(0).ahead_threads(1);
        let cfg = ImportConfig::default().policy(ImportPolicy::Pools(pools));
        let imp = Importer::new(space, crate::import::Pin::new(), cfg).unwrap();
        let core = &*imp.core;
        let start = imp.cost();
        let ms = Duration::from_millis;
        let mut st = core.state();
        let mut learn = |took: Duration, len: u64, resident: Option<u64>| {
            st.stats.times.push(start.fixed + took);
            core.learn(&pools, &mut st, len, resident);
            (st.cost.untouched_per_mib, st.cost.populated_per_mib, st.granule)
        };
        // Untouched MiBs: eight at 1 ms past the fixed part, two at 20 ms.
        let mut last = (start.untouched_per_mib, start.populated_per_mib, 0);
        for t in [1, 1, 1, 1, 20, 1, 1, 1, 20, 1] {
            last = learn(ms(t), 1 << 20, Some(0));
        }
        assert_eq!((last.0, last.1), (ms(20), start.populated_per_mib), "the average would be 4.8 ms");
        // A 400 us wait fits 16 KiB of them at 20 ms/MiB.
        assert!(last.2 <= 16 << 10, "{:#x}", last.2);
        // Resident pages are learned apart: 2 MiB, half resident, at 20 ms for the untouched half
        // and 6 ms for the resident one.
        let (u, p, _) = learn(ms(20 + 6), 2 << 20, Some(1 << 20));
        assert_eq!((u, p), (ms(20), start.populated_per_mib), "half untouched: a time per untouched MiB");
        let (u, p, _) = learn(ms(12), 2 << 20, Some(2 << 20));
        assert_eq!((u, p), (ms(20), ms(6)));
        // Residency not read: every page taken as untouched (two at 40 ms/MiB make the 90th
        // percentile of 13). Under 32 KiB: nothing learned.
        learn(ms(40 * 4), 4 << 20, None);
        let (u, p, _) = learn(ms(40 * 4), 4 << 20, None);
        assert_eq!((u, p), (ms(40), ms(6)));
        assert_eq!(learn(ms(1000), 16 << 10, Some(0)).0, ms(40));
        // A resident MiB costs no more than an untouched one, whatever its imports took.
        learn(ms(100), 1 << 20, Some(1 << 20));
        assert_eq!(learn(ms(100), 1 << 20, Some(1 << 20)).1, ms(40));
    }

    /// A binding's wait for an import in flight is bounded from when it begins: each landing of
    /// another import wakes it to look again, and must not start the bound over. Here an import
    /// that covers the binding sits in the driver (put there by hand: under the pools policy the
    /// background threads enter the driver one at a time, so no real import could land beside
    /// it), and another thread signals a landing every millisecond for two seconds. The
    /// binding's bound is about 40 ms (20 ms left of the pin, 20 ms its own part): it gives up
    /// and imports itself while the signals still come, not after they stop.
    #[test]
    fn a_landing_does_not_start_a_bindings_wait_for_an_import_in_flight_over() {
        let space = Arc::new(Space::with_window(64 << 20).unwrap());
        // Bindings are over committed pages.
        space.commit(space.range(0, 64 << 20).unwrap(), Prot::READ_WRITE).unwrap();
        let ms20 = Duration::from_millis(20);
        let cost = ImportCost { fixed: ms20, untouched_per_mib: Duration::ZERO, populated_per_mib: Duration::ZERO };
        let pools = PoolsConfig::default().ahead(0).cost(Some(cost)).ahead_threads(1);
        let cfg = ImportConfig::default().chunk(1 << 20).policy(ImportPolicy::Pools(pools));
        let imp = Importer::new(space, crate::import::Pin::new(), cfg).unwrap();
        imp.add_pool(4 << 20, 64 << 10).unwrap();
        let r = Planned { lo: 4 << 20, hi: (4 << 20) + (64 << 10) };
        imp.core.state().in_flight.push(Flight { r, since: Instant::now(), est: ms20 });
        *imp.core.in_driver.lock().unwrap() = Some((Instant::now(), r));
        let (stop, expired) = (AtomicBool::new(false), AtomicBool::new(false));
        let (bound, signalling) = std::thread::scope(|sc| {
            sc.spawn(|| {
                let end = Instant::now() + Duration::from_secs(2);
                while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                    imp.core.landed.notify_all();
                    std::thread::sleep(Duration::from_millis(1));
                }
                expired.store(Instant::now() >= end, Ordering::Relaxed);
            });
            let bound = imp.bind((4 << 20) + 0x10, 0x10);
            let signalling = !expired.load(Ordering::Relaxed);
            stop.store(true, Ordering::Relaxed);
            (bound, signalling)
        });
        // The flight put in by hand leaves before the importer's drop waits for it, and lands as
        // a real one does: the pool whole over the binding's part may be waiting for it.
        imp.core.state().in_flight.clear();
        *imp.core.in_driver.lock().unwrap() = None;
        imp.core.landed.notify_all();
        assert!(signalling, "the binding waited for as long as other imports landed");
        assert!(bound.unwrap().made);
        assert_eq!(imp.stats().in_flight_waits, 1);
    }
}
