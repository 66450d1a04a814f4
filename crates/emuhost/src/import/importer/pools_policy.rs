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
        let part = if overlaps_ok {
            // The background threads start nothing that takes the memory-map lock while the
            // part's pages are read: a populate or a commit queued there would hold the read.
            let _at_work = AtWork::new(&core.binding_imports);
            core.size_part(cfg, &st, whole, addr, size)
        } else {
            Part::untouched(&st.cost, fallback)
        };
        flight.sized = t.elapsed();
        let own = if overlaps_ok { part.r } else { whole };
        flight.part = Some((part.r, part.est, part.resident_in(part.r)));
        let (g, served) = core.wait_in_flight(st, (addr, size), part.est, own, flight);
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
        if let Ok(b) = &bound {
            core.learn(cfg, &mut st, b.range.len(), part.resident_in(b.range));
            if st.stats.reimports > before.0 {
                tracing::debug!(
                    "re-import by binding {addr:#x}+{size:#x}: {} of pools {whole} (part {}); live over the pools: {}",
                    b.range,
                    part.r,
                    before.1
                );
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

    /// The pools policy's part of `whole` that a binding at `addr, size` imports itself:
    /// `whole` where its import is estimated to fit the wait target, given which of its pages
    /// are resident, else the piece around the binding at the largest power-of-two granule that
    /// fits, else the piece at the backend's alignment; a range larger than that only where it
    /// overlaps no import in flight, and no import a binding made or used unless the least
    /// part does too. One residency read (`mincore`; `QueryWorkingSetEx` on Windows) reads the
    /// pages of the largest of these that could fit were all its pages resident (a few MiB at
    /// most); where none could, or the read fails, every page is taken as untouched.
    pub(super) fn size_part(
        &self,
        cfg: &PoolsConfig,
        st: &State<B::Import>,
        whole: Planned,
        addr: u64,
        size: u64,
    ) -> Part {
        let (cost, wait) = (st.cost, cfg.wait);
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

    use super::super::state::Flight;
    use super::super::{ImportConfig, ImportPolicy};
    use super::*;
    use crate::space::{Prot, Space};

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
