//! The two backends behind one trait. They work on host addresses inside the space's window;
//! the tracker turns guest ranges into host ones and back.

use std::io;
use std::sync::Mutex;

use super::BackendKind;
use super::bitmap::Bits;
use crate::space::{Prot, Region, Space};
use crate::sys::mm::page_size;
use crate::sys::probe::ThpModes;
use crate::sys::segv::{self, ARMED, BUSY_MASK, DIRTY, PROT_MASK, Registration, TableKey, WRITE};
use crate::sys::uapi::PageRegion;
use crate::sys::uffd::{Uffd, no_huge_pages};

pub(super) trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// Arms host `start..end`; `regions` are the kernel's regions there (guest addresses, `base`
    /// added gives host ones).
    fn arm(&self, start: usize, end: usize, regions: &[Region], base: usize) -> io::Result<()>;
    fn disarm(&self, start: usize, end: usize) -> io::Result<()>;
    /// Gives `out` the written runs of host `start..end`, in address order, and arms them again.
    fn read(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()>;
    /// Gives `out` the written runs of `start..end` as [`Backend::read`] does, leaving them
    /// written (the next read reports them again).
    fn peek(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()>;
    /// The key of the page-state table a fault handler hands faults to (`None`: this backend's
    /// writes never fault).
    fn fault_key(&self) -> Option<TableKey> {
        None
    }
    /// The space set `prot` on armed pages. `Ok(true)`: report them written at the next collect.
    fn protected(&self, start: usize, end: usize, prot: Prot) -> io::Result<bool>;
    /// The space mapped armed pages anew (a view, a refilled hole) with `prot`.
    fn remapped(&self, start: usize, end: usize, prot: Prot) -> io::Result<bool>;
    /// The space released armed pages (`in_place`: their mappings stay, see
    /// [`crate::space::Observer::keeps_mappings`]).
    fn released(&self, start: usize, end: usize, in_place: bool) -> io::Result<bool>;
    /// The space changed host `start..end` (armed or not): pages a disarm gave back there are no
    /// longer the tracker's to claim a fault of.
    fn unstale(&self, _start: usize, _end: usize) {}
    /// The host is about to write to armed pages through the kernel.
    fn prepare_host_write(&self, start: usize, end: usize) -> io::Result<()>;
    /// Whether [`Backend::prepare_host_write`] does anything (the kernel's writes would fail
    /// without it).
    fn needs_host_write_prepare(&self) -> bool {
        false
    }
}

/// Where a backend's read puts the written runs it finds, as host addresses less `base` (guest
/// addresses): into `bits` if given, else into `out`, a run joined to the one before it when
/// they touch and that one is at index `join` or later (what `out` held before may need a sort,
/// and is not joined). Made as the kernel's output is read, this is the whole conversion: at
/// 50 % written a second pass over the runs cost as much as a fifth of the kernel's scan.
pub(super) struct Runs<'a, 'b> {
    out: &'a mut Vec<(u64, u64)>,
    base: u64,
    join: usize,
    bits: Option<&'a mut Bits<'b>>,
}

impl<'a, 'b> Runs<'a, 'b> {
    pub(super) fn new(out: &'a mut Vec<(u64, u64)>, base: u64, join: usize, bits: Option<&'a mut Bits<'b>>) -> Self {
        Self { out, base, join, bits }
    }

    /// Adds host `s..e`.
    #[inline]
    pub(super) fn push(&mut self, s: u64, e: u64) {
        let (s, e) = (s - self.base, e - self.base);
        if let Some(bits) = &mut self.bits {
            bits.set(s, e);
            return;
        }
        debug_assert!(self.out.len() <= self.join || self.out[self.out.len() - 1].1 <= s, "runs out of order");
        if self.out.len() > self.join
            && let Some(last) = self.out.last_mut()
            && last.1 == s
        {
            last.1 = e;
            return;
        }
        self.out.push((s, e));
    }
}

/// Entries of the uffd backend's `PAGEMAP_SCAN` output vector (a full one resumes the scan).
pub(super) const SCAN_VEC: usize = 512;

/// The backend `kind` over `space`'s window; with mprotect, emuhost's `SIGSEGV` handler is
/// installed only if `install_handler` (else the embedder's own handler forwards faults).
pub(super) fn make(kind: BackendKind, space: &Space, install_handler: bool) -> io::Result<Box<dyn Backend>> {
    Ok(match kind {
        BackendKind::Uffd => {
            let uffd = Uffd::new()?;
            // The whole window at once, so that an arm finds its pages registered (see
            // `UffdBackend::arm_pages`). Where that fails (a mapping in the window registered with
            // another userfaultfd, or one that may never be written) each arm registers its own.
            if let Err(e) = uffd.register(space.host_base(), space.window() as usize) {
                tracing::debug!("write tracking: registering the window failed ({e}); arms register their pages");
            }
            Box::new(UffdBackend {
                uffd,
                vec: Mutex::new(vec![PageRegion::default(); SCAN_VEC]),
                no_huge: huge_pages_may_back(crate::sys::probe::thp_modes().as_ref(), space.adopted()),
            })
        }
        BackendKind::Mprotect => {
            let pages = space.window() as usize / page_size();
            Box::new(MprotectBackend {
                reg: Registration::new(space.host_base(), pages, install_handler)?,
                scratch: Mutex::default(),
            })
        }
    })
}

/// Whether the pages of a tracked range could come to be backed by transparent huge pages
/// (a written one would be reported whole) unless the range is advised against them: where the
/// top mode or some size's is `always`; where shmem's (the views' memfds) is `always`,
/// `within_size` or `force`; and, in a reservation the caller made (which it may have advised
/// `MADV_HUGEPAGE`), where some mode is `madvise`. Elsewhere (`madvise` on the space's own
/// reservation, the default of most distributions, or `never`) the arm makes no
/// `MADV_NOHUGEPAGE`: it takes the process's memory-map lock for writing, and every such call of
/// an arm waits for every reader of that lock (a driver's pin, a populate, another thread's
/// collect) while its commit holds the space's lock. Read when the tracker is made.
pub(super) fn huge_pages_may_back(modes: Option<&ThpModes>, adopted: bool) -> bool {
    let Some(m) = modes else { return false };
    let sizes = m.sizes.iter().map(|s| if s == "inherit" { m.top.as_str() } else { s.as_str() });
    let anon = std::iter::once(m.top.as_str()).chain(sizes).any(|s| s == "always" || (adopted && s == "madvise"));
    let shmem = matches!(m.shmem.as_deref(), Some("always" | "within_size" | "force"));
    anon || shmem
}

struct UffdBackend {
    uffd: Uffd,
    vec: Mutex<Vec<PageRegion>>,
    /// Advise `MADV_NOHUGEPAGE` on arming ([`huge_pages_may_back`]).
    no_huge: bool,
}

impl UffdBackend {
    /// Arms pages: advised against huge pages where they could get them, registered unless they
    /// are (`fresh`: mapped anew, so not), write-protected. A registration takes the process's
    /// memory-map lock for writing, and waits there for every reader (a driver's pin, a populate,
    /// another thread's collect); the question whether the pages are registered takes it for
    /// reading. The window is registered when the backend is made, pages stay registered when
    /// they are disarmed or released in place, so most arms, and the commits and protection
    /// changes over armed pages, register nothing: what is left is pages mapped anew (a view, a
    /// release mapped anew, a refilled hole).
    fn arm_pages(&self, start: usize, end: usize, fresh: bool) -> io::Result<()> {
        if self.no_huge {
            no_huge_pages(start, end - start)?;
        }
        self.register_unless_registered(start, end, fresh)?;
        self.uffd.protect(start, end - start)
    }

    /// Registers `start..end` if it is `fresh` or some of it is not registered.
    fn register_unless_registered(&self, start: usize, end: usize, fresh: bool) -> io::Result<()> {
        if fresh || !self.uffd.registered(start, end - start)? {
            self.uffd.register(start, end - start)?;
        }
        Ok(())
    }
}

impl Backend for UffdBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Uffd
    }

    fn arm(&self, start: usize, end: usize, _regions: &[Region], _base: usize) -> io::Result<()> {
        self.arm_pages(start, end, false)
    }

    // The pages stay registered (see `arm_pages`); dropping the tracker closes the userfaultfd,
    // which unregisters them all.
    fn disarm(&self, start: usize, end: usize) -> io::Result<()> {
        self.uffd.unprotect(start, end - start)
    }

    fn read(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()> {
        let mut vec = self.vec.lock().unwrap_or_else(|p| p.into_inner());
        self.uffd.scan_written(start, end, &mut vec, |s, e| out.push(s, e))
    }

    fn peek(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()> {
        let mut vec = self.vec.lock().unwrap_or_else(|p| p.into_inner());
        self.uffd.peek_written(start, end, &mut vec, |s, e| out.push(s, e))
    }

    // mprotect keeps the registration and the write-protect bits of the pages it changes. Pages
    // mapped behind the tracker's back are not registered: they become registered without write
    // protection, which the next scan reports as written and arms.
    fn protected(&self, start: usize, end: usize, _prot: Prot) -> io::Result<bool> {
        self.register_unless_registered(start, end, false)?;
        Ok(false)
    }

    fn remapped(&self, start: usize, end: usize, _prot: Prot) -> io::Result<bool> {
        self.arm_pages(start, end, true)?;
        Ok(true)
    }

    // Released pages mapped anew are reserved mappings, new to userfaultfd: arm them so a later
    // commit is tracked from its first write. Released in place, they stay registered, and their
    // dropped pages lose their write protection (an anonymous page keeps no marker): a write
    // after the next commit makes a page the next scan reports, and that collect reports every
    // released page anyway (its content is new) and write-protects them all (the scan's
    // `PAGE_IS_WRITTEN` path takes an empty entry for written). So nothing is done here.
    fn released(&self, start: usize, end: usize, in_place: bool) -> io::Result<bool> {
        if !in_place {
            self.arm_pages(start, end, true)?;
        }
        Ok(false)
    }

    // The kernel resolves its own writes to write-protected pages in asynchronous mode.
    fn prepare_host_write(&self, _start: usize, _end: usize) -> io::Result<()> {
        Ok(())
    }
}

/// Runs of pages, host `(start, end, protection bits)`.
type ProtRuns = Vec<(usize, usize, u16)>;

struct MprotectBackend {
    reg: Registration,
    /// A read's buffers (the runs to protect, the runs seen written), kept between reads so a
    /// collect allocates nothing once they have grown.
    scratch: Mutex<(ProtRuns, ProtRuns)>,
}

impl MprotectBackend {
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

impl Backend for MprotectBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Mprotect
    }

    fn arm(&self, start: usize, end: usize, regions: &[Region], base: usize) -> io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        let p = page_size();
        let mut runs = Vec::new();
        for r in regions {
            let region_bits = segv::prot_bits(crate::sys::mm::RawProt { read: r.read, write: r.write, exec: r.exec });
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
                        Some((old & BUSY_MASK) | ARMED | bits | keep)
                    })
                    .expect("always Some");
                let bits = if old & ARMED != 0 { old & PROT_MASK } else { region_bits };
                push_run(&mut runs, a, p, bits);
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
            if st & ARMED != 0 {
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
            if st & ARMED != 0 && st & WRITE != 0 && !self.reg.unprotect_for_write(a) {
                failed.get_or_insert(a);
            }
        });
        match failed {
            Some(a) => Err(io::Error::other(format!("could not unprotect the page at {a:#x}"))),
            None => Ok(()),
        }
    }

    fn needs_host_write_prepare(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn modes(top: &str, sizes: &[&str], shmem: Option<&str>) -> ThpModes {
        ThpModes { top: top.into(), sizes: sizes.iter().map(|s| s.to_string()).collect(), shmem: shmem.map(Into::into) }
    }

    #[test]
    fn huge_pages_may_back_tracked_pages_only_where_a_mode_lets_them_unasked() {
        // Debian's and Ubuntu's default, this VM's: 2 MiB pages inherit `madvise`, others `never`.
        let usual = modes("madvise", &["inherit", "never", "never"], Some("never"));
        assert!(!huge_pages_may_back(Some(&usual), false));
        // A caller's reservation may have asked for them.
        assert!(huge_pages_may_back(Some(&usual), true));
        assert!(huge_pages_may_back(Some(&modes("always", &["inherit"], Some("never"))), false));
        // One size `always` is enough, and so is `always` at the top whatever the sizes say.
        assert!(huge_pages_may_back(Some(&modes("madvise", &["never", "always"], None)), false));
        assert!(huge_pages_may_back(Some(&modes("always", &["never"], None)), false));
        // `inherit` follows the top.
        assert!(!huge_pages_may_back(Some(&modes("never", &["inherit"], None)), true));
        // Views are memfd pages: shmem's own modes.
        for (shmem, may) in
            [("always", true), ("within_size", true), ("force", true), ("advise", false), ("deny", false)]
        {
            assert_eq!(huge_pages_may_back(Some(&modes("never", &[], Some(shmem))), false), may, "{shmem}");
        }
        // No THP in the kernel.
        assert!(!huge_pages_may_back(None, true));
    }
}
