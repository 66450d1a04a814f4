//! The uffd backend (Linux): userfaultfd write-protection, read by `PAGEMAP_SCAN`.

use std::io;
use std::sync::Mutex;

use super::{Backend, Runs};
use crate::space::{Prot, Region, Space};
use crate::sys::probe::ThpModes;
use crate::sys::uapi::PageRegion;
use crate::sys::uffd::{Uffd, no_huge_pages};
use crate::watch::BackendKind;

/// Entries of the uffd backend's `PAGEMAP_SCAN` output vector (a full one resumes the scan).
pub(in crate::watch) const SCAN_VEC: usize = 512;

/// The uffd backend over `space`'s window.
pub(super) fn make(space: &Space) -> io::Result<Box<dyn Backend>> {
    let uffd = Uffd::new()?;
    // The whole window at once, so that an arm finds its pages registered (see
    // `UffdBackend::arm_pages`). Where that fails (a mapping in the window registered with
    // another userfaultfd, or one that may never be written) each arm registers its own.
    if let Err(e) = uffd.register(space.host_base(), space.window() as usize) {
        tracing::debug!("write tracking: registering the window failed ({e}); arms register their pages");
    }
    Ok(Box::new(UffdBackend {
        uffd,
        vec: Mutex::new(vec![PageRegion::default(); SCAN_VEC]),
        no_huge: huge_pages_may_back(crate::sys::probe::thp_modes().as_ref(), space.adopted()),
    }))
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

/// A scan's error: `EPERM` is memory its userfaultfd never registered (`PM_SCAN_CHECK_WPASYNC`),
/// mapped behind the tracker's back: not ours ([`super::not_ours`]), reported untracked even
/// where it looks like the space's own (anonymous, private, the same protection).
fn not_registered(e: io::Error, start: usize) -> io::Error {
    if e.raw_os_error() == Some(libc::EPERM) { super::not_ours(start) } else { e }
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
        self.uffd.scan_written(start, end, &mut vec, |s, e| out.push(s, e)).map_err(|e| not_registered(e, start))
    }

    fn peek(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()> {
        let mut vec = self.vec.lock().unwrap_or_else(|p| p.into_inner());
        self.uffd.peek_written(start, end, &mut vec, |s, e| out.push(s, e)).map_err(|e| not_registered(e, start))
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
