//! The protection backend, on every platform: armed pages read-only, a write claimed by the fault
//! handler through the page-state table of [`crate::sys::guard`] (`mprotect` + `SIGSEGV` on Linux,
//! `VirtualProtect` + a vectored exception handler on Windows).

use std::io;
use std::sync::{Arc, Mutex};

use super::{Backend, Runs};
use crate::space::{Prot, Region, Space};
use crate::sys::guard::{self as segv, ARMED, BUSY_MASK, DIRTY, FOREIGN, PROT_MASK, Registration, TableKey, WRITE};
use crate::sys::mm::page_size;
use crate::watch::BackendKind;

/// Runs of pages, host `(start, end, protection bits)`.
type ProtRuns = Vec<(usize, usize, u16)>;

/// The protection backend over `space`'s window, named `kind` (`mprotect` on Linux, `guard` on
/// Windows); the fault handler is installed only if `install_handler`.
pub(super) fn make(kind: BackendKind, space: &Space, install_handler: bool) -> io::Result<Box<dyn Backend>> {
    Ok(Box::new(new(kind, space, install_handler)?))
}

/// [`make`], unboxed (the write-watch backend keeps one for the pages write watch cannot see).
#[cfg_attr(not(windows), allow(dead_code))]
pub(super) fn new(kind: BackendKind, space: &Space, install_handler: bool) -> io::Result<GuardBackend> {
    let pages = space.window() as usize / page_size();
    let reg = Arc::new(Registration::new(space.host_base(), pages, install_handler)?);
    Ok(GuardBackend {
        kind,
        #[cfg(target_os = "linux")]
        drops: listen_for_drops(&reg, space),
        reg,
        scratch: Mutex::default(),
    })
}

/// The listener that marks armed pages dropped behind the space's back written, and pages
/// unmapped or mapped over behind its back foreign (see `drops`), where the kernel has it.
#[cfg(target_os = "linux")]
fn listen_for_drops(reg: &Arc<Registration>, space: &Space) -> Option<super::drops::Drops> {
    let (base, len) = (space.host_base(), space.window() as usize);
    super::drops::Drops::start(base, len, Arc::new(Marks { reg: reg.clone(), base, end: base + len }))
}

/// What the listener's events do to the page-state table over host `base..end`.
#[cfg(target_os = "linux")]
struct Marks {
    reg: Arc<Registration>,
    base: usize,
    end: usize,
}

#[cfg(target_os = "linux")]
impl Marks {
    /// `f(state)` for each page of host `start..end` inside the window.
    fn each(&self, start: usize, end: usize, f: impl Fn(u16) -> Option<u16>) {
        use std::sync::atomic::Ordering::SeqCst;
        let p = page_size();
        let (s, e) = (start.max(self.base) & !(p - 1), end.min(self.end));
        for a in (s..e).step_by(p) {
            if let Some(st) = self.reg.state(a) {
                let _ = st.fetch_update(SeqCst, SeqCst, &f);
            }
        }
    }
}

#[cfg(target_os = "linux")]
impl super::drops::Told for Marks {
    // Armed pages only (a page not armed is not tracked), whatever their protection: their
    // content is about to change, and the mark makes every reader's next collect report them.
    fn removed(&self, start: usize, end: usize) {
        self.each(start, end, |old| (old & ARMED != 0).then_some(old | DIRTY));
    }

    // Every page, armed or not (a later arm must not protect it either); a stale claim is
    // dropped with it.
    fn unmapped(&self, start: usize, end: usize) {
        self.each(start, end, |old| Some((old | FOREIGN) & !segv::STALE));
    }

    fn owned(&self, start: usize, end: usize) {
        self.each(start, end, |old| (old & FOREIGN != 0).then_some(old & !FOREIGN));
    }
}

pub(super) struct GuardBackend {
    kind: BackendKind,
    /// Dropped before `reg`: its reader thread marks pages of `reg`.
    #[cfg(target_os = "linux")]
    drops: Option<super::drops::Drops>,
    reg: Arc<Registration>,
    /// A read's buffers (the runs to protect, the runs seen written), kept between reads so a
    /// collect allocates nothing once they have grown.
    scratch: Mutex<(ProtRuns, ProtRuns)>,
}

impl GuardBackend {
    /// Calls `f(page_addr, state)` for each page of `start..end`.
    fn each(&self, start: usize, end: usize, mut f: impl FnMut(usize, &std::sync::atomic::AtomicU16)) {
        let p = page_size();
        for a in (start..end).step_by(p) {
            if let Some(s) = self.reg.state(a) {
                f(a, s);
            }
        }
    }

    /// Sets the protection bits of armed pages to `bits`; writable ones are marked written (the
    /// space just made them writable, so their writes are no longer caught).
    fn set_prot(&self, start: usize, end: usize, bits: u16) {
        use std::sync::atomic::Ordering::SeqCst;
        self.each(start, end, |_, s| {
            let _ = s.fetch_update(SeqCst, SeqCst, |old| {
                let dirty = if bits & WRITE != 0 { DIRTY } else { old & DIRTY };
                (old & ARMED != 0).then_some((old & !(PROT_MASK | DIRTY)) | bits | dirty)
            });
        });
    }

    /// Marks the pages of the runs `seen` inside `start..end` written again (a collect took their
    /// marks but could not protect them).
    fn remark(&self, seen: &[(usize, usize, u16)], start: usize, end: usize) {
        use std::sync::atomic::Ordering::SeqCst;
        for &(s, e, _) in seen {
            if s < end && e > start {
                self.each(s.max(start), e.min(end), |_, st| {
                    let _ = st.fetch_update(SeqCst, SeqCst, |old| (old & ARMED != 0).then_some(old | DIRTY));
                });
            }
        }
    }

    /// Fails with [`super::not_ours`] where a page of `start..end` is foreign (see `drops`): one
    /// atomic load unless foreign code mapped over the window.
    fn owned_only(&self, _start: usize, _end: usize) -> io::Result<()> {
        #[cfg(target_os = "linux")]
        if let Some(a) = self.drops.as_ref().and_then(|d| d.foreign_in(_start, _end)) {
            return Err(super::not_ours(a));
        }
        Ok(())
    }

    /// Protects runs of equal state (by protection bits) with `f(bits)`.
    fn protect_runs(&self, runs: &[(usize, usize, u16)], f: impl Fn(u16) -> u16) -> io::Result<()> {
        for &(s, e, bits) in runs {
            self.reg.protect(s, e - s, f(bits))?;
        }
        Ok(())
    }
}

fn push_run(runs: &mut Vec<(usize, usize, u16)>, a: usize, p: usize, bits: u16) {
    match runs.last_mut() {
        Some(last) if last.1 == a && last.2 == bits => last.1 = a + p,
        _ => runs.push((a, a + p, bits)),
    }
}

impl Backend for GuardBackend {
    fn kind(&self) -> BackendKind {
        self.kind
    }

    fn arm(&self, start: usize, end: usize, regions: &[Region], base: usize) -> io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        let p = page_size();
        let mut runs = Vec::new();
        for r in regions {
            let region_bits = segv::prot_bits(crate::sys::RawProt { read: r.read, write: r.write, exec: r.exec });
            self.each((base + r.start).max(start), (base + r.end).min(end), |a, s| {
                // A page armed before keeps the guest protection recorded then (the kernel's shows
                // our write protection) and its mark. The busy count of a handler at work is kept,
                // and so is the mark it set: the handler is about to make the page writable, and
                // a write after this arm returns would go unseen without the mark.
                let old = s
                    .fetch_update(SeqCst, SeqCst, |old| {
                        let bits = if old & ARMED != 0 { old & PROT_MASK } else { region_bits };
                        let keep = match (old & BUSY_MASK != 0, old & ARMED != 0) {
                            (true, _) => DIRTY,
                            (false, true) => old & DIRTY,
                            (false, false) => 0,
                        };
                        Some((old & (BUSY_MASK | FOREIGN)) | ARMED | bits | keep)
                    })
                    .expect("always Some");
                let bits = if old & ARMED != 0 { old & PROT_MASK } else { region_bits };
                // A foreign page is not ours to protect.
                if old & FOREIGN == 0 {
                    push_run(&mut runs, a, p, bits);
                }
            });
        }
        self.protect_runs(&runs, |b| b & !WRITE)
    }

    fn disarm(&self, start: usize, end: usize) -> io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        let p = page_size();
        let mut runs = Vec::new();
        // Protection first, state second: a write that faulted on the read-only page and whose
        // handler runs after the state is cleared finds the page writable when it is retried
        // (see `segv::STALE`); the other order would leave an unarmed read-only page to it.
        self.each(start, end, |a, s| {
            let st = s.load(SeqCst);
            if st & (ARMED | FOREIGN) == ARMED {
                push_run(&mut runs, a, p, st & PROT_MASK);
            }
        });
        self.protect_runs(&runs, |b| b)?;
        segv::disarm_states(&self.reg, start, end);
        Ok(())
    }

    fn fault_key(&self) -> Option<TableKey> {
        Some(self.reg.key())
    }

    fn peek(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        self.owned_only(start, end)?;
        let p = page_size();
        self.each(start, end, |a, s| {
            let st = s.load(SeqCst);
            if st & ARMED != 0 && st & DIRTY != 0 {
                out.push(a as u64, (a + p) as u64);
            }
        });
        Ok(())
    }

    fn read(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        // Foreign pages first: a collect neither takes marks nor protects anything in a span
        // that holds one (it is reported untracked).
        self.owned_only(start, end)?;
        // The read of an allocation: probe its first readable page, so memory released behind the
        // space's back fails here (and is not made readable by the re-arm below).
        let mut probe = None;
        self.each(start, end, |a, s| {
            if probe.is_none() && s.load(SeqCst) & segv::READ != 0 {
                probe = Some(a);
            }
        });
        if let Some(a) = probe {
            crate::sys::mm::read_host(a, &mut [0u8])?;
        }
        let p = page_size();
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let (runs, seen) = &mut *scratch;
        runs.clear();
        seen.clear();
        // Take the marks first, protect second (see sys/linux/segv.rs). The pages from the first
        // taken to the last are protected together, in runs of equal protection: clean pages are
        // protected already, and a page a handler is busy with keeps its mark, so protecting it
        // again only costs its writer one more fault. One call per allocation, and the mappings
        // the handlers split are merged again.
        let (mut first, mut last) = (usize::MAX, 0);
        self.each(start, end, |a, s| {
            let (written, taken) = segv::take_written(s);
            if written {
                push_run(seen, a, p, 0);
            }
            if taken {
                first = first.min(a);
                last = a + p;
            }
        });
        if first < last {
            self.each(first, last, |a, s| {
                let st = s.load(SeqCst);
                if st & ARMED != 0 {
                    push_run(runs, a, p, st & PROT_MASK);
                }
            });
        }
        for &(s, e, bits) in runs.iter() {
            if !self.reg.reprotect(s, e - s, bits & !WRITE)? {
                // At the map limit: the kernel refused to split a mapping. The written pages of the
                // run keep their marks (writable, and reported again by the next collect), so
                // nothing is lost and the collect does not fail.
                self.remark(seen, s, e);
            }
        }
        seen.iter().for_each(|&(s, e, _)| out.push(s as u64, e as u64));
        Ok(())
    }

    fn protected(&self, start: usize, end: usize, prot: Prot) -> io::Result<bool> {
        self.set_prot(start, end, segv::prot_bits(prot.raw()));
        Ok(false)
    }

    fn remapped(&self, start: usize, end: usize, prot: Prot) -> io::Result<bool> {
        use std::sync::atomic::Ordering::SeqCst;
        let bits = segv::prot_bits(prot.raw());
        // New content: report it whatever the protection.
        self.each(start, end, |_, s| {
            let _ =
                s.fetch_update(SeqCst, SeqCst, |old| (old & ARMED != 0).then_some((old & !PROT_MASK) | bits | DIRTY));
        });
        Ok(false)
    }

    fn unstale(&self, start: usize, end: usize) {
        use std::sync::atomic::Ordering::SeqCst;
        self.each(start, end, |_, s| {
            s.fetch_and(!segv::STALE, SeqCst);
        });
    }

    fn released(&self, start: usize, end: usize, _in_place: bool) -> io::Result<bool> {
        use std::sync::atomic::Ordering::SeqCst;
        self.each(start, end, |_, s| {
            let _ = s.fetch_update(SeqCst, SeqCst, |old| (old & ARMED != 0).then_some(old & !(PROT_MASK | DIRTY)));
        });
        Ok(false)
    }

    fn prepare_host_write(&self, start: usize, end: usize) -> io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        let mut failed = None;
        self.each(start, end, |a, s| {
            let st = s.load(SeqCst);
            if st & (ARMED | WRITE | FOREIGN) == ARMED | WRITE && !self.reg.unprotect_for_write(a) {
                failed.get_or_insert(a);
            }
        });
        match failed {
            Some(a) => Err(io::Error::other(format!("could not unprotect the page at {a:#x}"))),
            None => Ok(()),
        }
    }

    fn reprotects(&self) -> bool {
        true
    }

    // A collect made after a drop or unmap behind the space's back returned sees it.
    fn begin_read(&self) {
        #[cfg(target_os = "linux")]
        if let Some(d) = &self.drops {
            d.settle();
        }
    }

    fn owned(&self, _start: usize, _end: usize, _remapped: bool) {
        #[cfg(target_os = "linux")]
        if let Some(d) = &self.drops {
            d.owned(_start, _end, _remapped);
        }
    }

    fn needs_host_write_prepare(&self) -> bool {
        true
    }

    fn copy_hook(&self, hook: Option<&std::sync::Arc<crate::sys::cow::CowArena>>) -> io::Result<()> {
        if self.reg.set_copy_hook(hook) {
            Ok(())
        } else {
            Err(io::Error::new(io::ErrorKind::AlreadyExists, "another copy-before-write hook is set on this tracker"))
        }
    }
}
