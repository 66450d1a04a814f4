//! The binding path both policies take: the checks, a live import reused, the binding's own
//! import (tried smaller and cooled where it fails), and the import itself (commit, populate
//! on a background thread, the driver).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::super::ImportError;
use super::super::backend::{Backend, GpuHandle, HostSpan};
use super::super::plan::{Planned, binding_cover};
use super::ahead::POPULATE_SLICE;
use super::state::{Bound, Made, State};
use super::{Core, ImportPolicy, Importer, chain};
use crate::space::{Prot, page_size};

/// A binding at work on its import (sizing its part, holding its span, in the backend): while
/// one lives, the background threads begin no populate slice, commit or driver import
/// ([`Core::step_aside`]). Counted in and out by its life, so a panic in a backend call does not
/// leave the background threads waiting for good.
pub(super) struct AtWork<'a>(&'a AtomicU64);

impl<'a> AtWork<'a> {
    pub(super) fn new(count: &'a AtomicU64) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        AtWork(count)
    }
}

impl Drop for AtWork<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long a binding waited for an import in flight, and whether it gave up (debug log).
#[derive(Default)]
pub(super) struct FlightWait {
    /// The binding's own part, its estimate and resident bytes (pools policy).
    pub(super) part: Option<(Planned, Duration, Option<u64>)>,
    /// The time to size the part (its residency read, `mincore` or `QueryWorkingSetEx`, under the
    /// importer's lock).
    pub(super) sized: Duration,
    pub(super) phase: String,
    pub(super) waited: Option<Duration>,
    pub(super) timed_out: bool,
}

impl<B: Backend + 'static> Importer<B> {
    /// Binds guest bytes `addr..addr + size`: reuses an import that covers them, or imports.
    /// The bytes must lie in the window ([`ImportError::OutOfWindow`]) and their pages be
    /// committed ([`ImportError::NotCommitted`]): either is refused before anything is tried,
    /// and holds nothing cooling. (The reserved pages of the rest of an import's range are
    /// committed for it: [`ImportConfig::commit`](super::ImportConfig::commit).)
    ///
    /// # Errors
    /// [`ImportError::OutOfWindow`], [`ImportError::NotCommitted`], [`ImportError::EmptyBinding`]
    /// or [`ImportError::BindingWraps`] for a bad binding; [`ImportError::Import`] where the
    /// backend failed every range tried, [`ImportError::Cooling`] where they are all cooling
    /// after a failure (both [`ImportError::is_refused`]: go on without the import).
    pub fn bind(&self, addr: u64, size: u64) -> Result<Bound, ImportError> {
        self.bind_at(addr, size, Instant::now())
    }

    /// [`Importer::bind`] with the time given (cooling is measured against it): for a replay
    /// with a clock of its own, and for tests.
    ///
    /// A binding that finds its import ready returns at once. Otherwise the time from the call
    /// to the return is the binding thread's wait ([`Stats::waits`](super::Stats::waits), [`Stats::wait_time`](super::Stats::wait_time),
    /// [`Stats::wait_worst`](super::Stats::wait_worst)): under the chunks policy, its own import; under the pools policy,
    /// the import in flight it waited for, or its own import of its pools, or of its part of them.
    pub fn bind_at(&self, addr: u64, size: u64, now: Instant) -> Result<Bound, ImportError> {
        self.check_binding(addr, size)?;
        let t0 = Instant::now();
        let core = &*self.core;
        let mut st = self.state();
        let locked = t0.elapsed();
        let mut flight = FlightWait::default();
        st.largest_binding = st.largest_binding.max(size);
        if let Some(bound) = core.reuse(&mut st, addr, size) {
            return Ok(bound);
        }
        let bound = match core.cfg.policy {
            ImportPolicy::Chunks(c) => {
                let tries = core.chunk_tries(&c, &st, addr, size)?;
                core.bind_importing(&mut st, addr, &tries, now)
            }
            ImportPolicy::Pools(p) => {
                let (g, bound) = self.bind_pools(&p, st, addr, size, now, &mut flight)?;
                st = g;
                bound
            }
        };
        let waited = t0.elapsed();
        st.stats.waited(waited);
        let made = bound.as_ref().is_ok_and(|b| b.made);
        let met_in_driver = st.met_in_driver;
        add_cause(&mut st.stats, waited, locked, &flight, made.then_some(met_in_driver));
        // The log lines once the lock is released.
        drop(st);
        super::state::log_made();
        if waited > Duration::from_micros(500) {
            log_slow_binding((addr, size), &bound, waited, locked, &flight);
        }
        bound
    }

    /// Refuses a binding that is the caller's mistake, before any lock of the importer's: one
    /// that is empty or wraps (its own errors), runs past the window's end, or lies over pages
    /// the space has not committed (the first run of them named; one record read).
    pub(super) fn check_binding(&self, addr: u64, size: u64) -> Result<(), ImportError> {
        binding_cover(addr, size, self.core.cfg.chunk)?;
        let space = &self.core.space;
        let window = space.window();
        let end = addr + size; // no wrap: checked just above
        if end > window {
            return Err(ImportError::OutOfWindow { addr, size, window });
        }
        let page = page_size();
        let lo = addr / page * page;
        let pages = space.range(lo, end.next_multiple_of(page) - lo)?;
        match space.uncommitted(pages) {
            Some(r) => Err(ImportError::NotCommitted { addr, size, lo: r.start().0, hi: r.end().0 }),
            None => Ok(()),
        }
    }
}

impl<B: Backend> Core<B> {
    /// A binding served by a live import that covers it, if there is one.
    pub(super) fn reuse(&self, st: &mut State<B::Import>, addr: u64, size: u64) -> Option<Bound> {
        let k = st.covering(addr, addr.checked_add(size)?)?;
        let live = st.imports.get_mut(&k).expect("the key was just found");
        let range = Planned { lo: k.0, hi: live.hi };
        let first_use = live.ahead.take().is_some();
        live.handed = true;
        let handle = self.backend.handle(&live.import);
        let s = &mut st.stats;
        s.reuses += 1;
        if first_use {
            s.ahead_hits += 1;
            s.ahead_bytes -= range.len();
        }
        Some(Bound { range, made: false, spanned: false, handle, offset: addr - range.lo })
    }

    /// A binding's own import: each range of `tries` (`true`: one a smaller one follows if it
    /// fails) until one is made; one cooling is skipped.
    pub(super) fn bind_importing(
        &self,
        st: &mut State<B::Import>,
        addr: u64,
        tries: &[(Planned, bool)],
        now: Instant,
    ) -> Result<Bound, ImportError> {
        let mut last = None;
        for &(range, is_span) in tries {
            if let Some(&until) = st.cooling.get(&range) {
                if now < until {
                    st.stats.cooled += 1;
                    let left_ms = (until - now).as_millis() as u64;
                    last = Some(ImportError::Cooling { lo: range.lo, hi: range.hi, left_ms });
                    continue;
                }
                st.cooling.remove(&range);
            }
            let made = {
                let _at_work = AtWork::new(&self.binding_imports);
                self.import(st, range)
            };
            match made {
                Ok((lo, handle)) => {
                    return Ok(Bound { range, made: true, spanned: is_span, handle, offset: addr - lo });
                }
                Err(e) if e.is_capped() => {
                    // At the cap: counted apart and held nothing cooling (a release may make room
                    // for the next binding); a smaller range would not fit either.
                    st.stats.capped += 1;
                    if st.stats.capped == 1 {
                        tracing::warn!("binding at {addr:#x} went without: {}", chain(&e));
                    }
                    return Err(e);
                }
                Err(e) => {
                    st.stats.failures += 1;
                    if !self.cfg.cooling.is_zero() {
                        st.cooling.insert(range, now + self.cfg.cooling);
                    }
                    if is_span {
                        st.stats.unspanned_retries += 1;
                        let again = match self.cfg.policy {
                            ImportPolicy::Chunks(_) => "made again without the span",
                            ImportPolicy::Pools(_) => "made again as the binding's part of it",
                        };
                        tracing::warn!("import of {range} failed ({}); {again}", chain(&e));
                    } else {
                        tracing::warn!("import of {range} failed: {}", chain(&e));
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least one range was tried or cooling"))
    }

    /// Imports `r` (or, where overlaps are refused, the union of `r` and the imports it overlaps;
    /// or, at the cap on live imports, `r` merged with a neighbour's: module `cap`): the import's
    /// start and device objects.
    pub(super) fn import(&self, st: &mut State<B::Import>, r: Planned) -> Result<(u64, GpuHandle), ImportError> {
        self.import_with(st, r, true)
    }

    /// [`Core::import`]; at the cap, two neighbours merged to make room only where `compact`
    /// (not for the merge of two neighbours itself).
    pub(super) fn import_with(
        &self,
        st: &mut State<B::Import>,
        r: Planned,
        compact: bool,
    ) -> Result<(u64, GpuHandle), ImportError> {
        // Where the device refuses a page in two imports (CUDA), the re-import takes in the
        // imports it overlaps: they are released first, and the new import covers them all.
        let mut r = r;
        let mut superseded = Vec::new();
        if !self.backend.overlapping_imports() && st.overlaps(r.lo, r.hi) {
            let (lo, hi, keys) = st.union(r.lo, r.hi);
            r = Planned { lo, hi };
            superseded = keys;
        }
        if superseded.is_empty() && !self.make_room(st) {
            let merged = self.merge(st, r);
            if merged.is_none() && compact && self.compact(st) {
                return self.import_with(st, r, false);
            }
            // Where nothing makes room the binding imports over the cap (module `cap`).
            if let Some((grown, keys)) = merged {
                st.stats.cap_merges += 1;
                tracing::debug!(
                    "at the cap of {} live imports: {r} merged into {grown}, taking in {}",
                    self.cap,
                    keys.len()
                );
                (r, superseded) = (grown, keys);
            } else {
                self.over_cap(st, r);
            }
        }
        let t = Instant::now();
        let span = HostSpan::of(&self.space, r.lo, r.len()).map_err(|e| self.wrap(r, e))?;
        let held = t.elapsed();
        if held > Duration::from_micros(200) {
            // The hold takes the space's lock, which a change keeps across its system call.
            tracing::debug!("binding's hold of {r} waited {:.2} ms for the space's lock", held.as_secs_f64() * 1e3);
        }
        // Pages an unused import ahead holds were never imported for a binding: not a re-import.
        let reimport = st.overlaps_used(r.lo, r.hi, None);
        for k in superseded {
            if let Some(old) = st.imports.remove(&k) {
                st.stats.live -= 1;
                st.stats.live_bytes -= old.hi - k.0;
                if old.ahead.is_some() {
                    st.stats.ahead_bytes -= old.hi - k.0;
                }
                self.release(old.import);
            }
        }
        // The slot is taken under the state's lock, where the room was checked.
        self.slots.fetch_add(1, Ordering::AcqRel);
        // Background threads enter the driver only while no binding is at its import: one
        // there now is the one this import meets.
        st.met_in_driver = self.in_driver.lock().unwrap_or_else(|p| p.into_inner()).is_some();
        let (import, took) = self.make(span, r, false).inspect_err(|_| {
            self.slots.fetch_sub(1, Ordering::AcqRel);
        })?;
        let handle = self.backend.handle(&import);
        // Unused imports ahead that the new one covers are taken in (released), once it is made.
        for k in st.unused_inside(r.lo, r.hi) {
            self.release_unused(st, k);
        }
        self.record(st, r, import, took, Made::Binding { reimport });
        Ok((r.lo, handle))
    }

    /// Commits the reserved pages of `span` (its range `r`) and imports it: the import and its
    /// time. On a background thread (`background`) it populates the pages first and stays out
    /// of the way of bindings' imports.
    pub(super) fn make(
        &self,
        span: HostSpan,
        r: Planned,
        background: bool,
    ) -> Result<(B::Import, Duration), ImportError> {
        let t = Instant::now();
        if self.cfg.commit {
            // Only the reserved pages, under the space's lock: the guest's keep their protection.
            // The span holds the range already, so nothing is decommitted between this and the
            // import. A background commit waits for the bindings at their import: it takes the
            // space's lock (which a binding's hold needs) across an mprotect that queues for the
            // memory-map lock (which a binding's `mincore` and pin need).
            if background {
                self.aside(|| Some(()));
            }
            self.space.commit_reserved(span.guest(), Prot::READ_WRITE).map_err(|e| self.wrap(r, e.into()))?;
        }
        if background {
            // In slices, each after every binding's import under way: a long populate holds the
            // process's memory-map lock, and a binding's pin (or a commit queued for the lock in
            // write mode, which the pin then queues behind) would wait for all of it.
            let g = span.guest();
            let mut at = g.start().0;
            while at < g.end().0 {
                let n = POPULATE_SLICE.min(g.end().0 - at);
                let _read = self.step_aside();
                let slice = self.space.range(at, n).and_then(|s| self.space.populate(s));
                if let Err(e) = slice {
                    // The pin faults in what this left (pages the guest made read-only, for one).
                    tracing::debug!("populate ahead of the import of {r}: {e}");
                }
                at += n;
            }
        }
        // The background threads enter the driver one at a time, and only while no binding
        // imports: a driver serializes imports (on an H200 a 4 KiB import took 1.4 ms beside
        // another thread's), and a binding should wait for one of theirs at most.
        let _turn = background.then(|| {
            let turn = self.driver_turn.lock().unwrap_or_else(|p| p.into_inner());
            (turn, self.step_aside())
        });
        let before = t.elapsed();
        let releasing = self.releasing.load(Ordering::Relaxed);
        let met = if background {
            *self.in_driver.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), r));
            None
        } else {
            self.in_driver.lock().unwrap_or_else(|p| p.into_inner()).map(|(since, r)| (since.elapsed(), r.len()))
        };
        let import = self.backend.import(span);
        if background {
            *self.in_driver.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        let import = import.map_err(|e| self.wrap(r, e))?;
        let took = t.elapsed();
        if took > Duration::from_micros(500) {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            let who = if background { "ahead" } else { "binding's" };
            let beside = met.map_or(String::new(), |(been, len)| {
                format!("; a background import of {} KiB had been in the driver {:.2} ms", len >> 10, ms(been))
            });
            tracing::debug!(
                "{who} import of {r}: {:.2} ms to commit and populate, {:.2} ms in the backend{beside}; \
                 {releasing} releases under way at its start",
                ms(before),
                ms(took - before)
            );
        }
        Ok((import, took))
    }
}

/// Adds a binding's wait (`waited`, of it `locked` for the importer's lock) to the waits by
/// cause ([`super::Stats::wait_own`] and beside it): its wait for an import in flight, if any,
/// and the rest to its own import (`made`: whether it met a background import in the driver),
/// or to the flight where it made none.
pub(super) fn add_cause(
    s: &mut super::Stats,
    waited: Duration,
    locked: Duration,
    flight: &FlightWait,
    made: Option<bool>,
) {
    let add = |c: &mut (u64, Duration), d: Duration| {
        c.0 += 1;
        c.1 += d;
    };
    s.wait_lock += locked;
    let rest = waited.saturating_sub(locked);
    let flew = flight.waited.map(|d| d.min(rest));
    if let Some(d) = flew {
        add(&mut s.wait_flight, if made.is_some() { d } else { rest });
    }
    let own = rest.saturating_sub(flew.unwrap_or_default());
    match made {
        Some(true) => add(&mut s.wait_beside_driver, own),
        Some(false) => add(&mut s.wait_own, own),
        None => {}
    }
}

/// The debug log of a binding that waited `waited` (of it `locked` for the importer's lock):
/// how it was served and what it waited for.
pub(super) fn log_slow_binding(
    (addr, size): (u64, u64),
    bound: &Result<Bound, ImportError>,
    waited: Duration,
    locked: Duration,
    flight: &FlightWait,
) {
    let how = match bound {
        Ok(b) if b.made => format!("imported {} ({} KiB) itself", b.range, b.range.len() >> 10),
        Ok(b) => format!("was served by {}, in flight when it came", b.range),
        Err(_) => "failed".to_owned(),
    };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let flew = match flight.waited {
        Some(d) => format!(
            ", {:.2} ms for an import in flight{}{}",
            ms(d),
            flight.phase,
            if flight.timed_out { " (gave up)" } else { "" }
        ),
        None => String::new(),
    };
    let part = match flight.part {
        Some((r, est, resident)) => {
            let resident = resident.map_or(String::new(), |b| format!(", {} KiB resident", b >> 10));
            format!("; its part {r} estimated {:.2} ms{resident}, sized in {:.2} ms", ms(est), ms(flight.sized))
        }
        None => String::new(),
    };
    tracing::debug!(
        "binding {addr:#x}+{size:#x} waited {:.2} ms: {how} ({:.2} ms for the lock{flew}{part})",
        ms(waited),
        ms(locked)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A binding's wait goes to its causes: the lock, an import in flight (all of the rest where
    /// it made no import), its own import beside a background one in the driver or alone.
    #[test]
    fn a_bindings_wait_is_split_by_cause() {
        let ms = Duration::from_millis;
        let mut s = super::super::Stats::default();
        let flew = FlightWait { waited: Some(ms(3)), ..Default::default() };
        add_cause(&mut s, ms(10), ms(1), &flew, Some(true));
        add_cause(&mut s, ms(5), ms(0), &flew, None);
        add_cause(&mut s, ms(2), ms(0), &FlightWait::default(), Some(false));
        assert_eq!(s.wait_lock, ms(1));
        assert_eq!(s.wait_flight, (2, ms(8)));
        assert_eq!(s.wait_beside_driver, (1, ms(6)));
        assert_eq!(s.wait_own, (1, ms(2)));
    }
}
