//! Shared memory: sections (a memfd on Linux, a pagefile-backed mapping on Windows) and the views
//! that map them into the window.

use std::sync::Arc;

use super::layout::view;
use super::{Change, GuestAddr, GuestRange, Prot, Space, SpaceError, View, page_size};

/// A shared section's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SectionId(pub u64);

#[derive(Clone, Copy, Debug)]
pub(super) struct ViewEntry {
    pub(super) section: SectionId,
    pub(super) offset: u64,
}

#[derive(Debug)]
pub(super) struct Section {
    mem: Arc<crate::sys::mm::Section>,
    size: u64,
}

impl Space {
    /// Creates a shared section of `len` bytes, zero-filled.
    pub fn create_section(&self, len: u64) -> Result<SectionId, SpaceError> {
        GuestRange::new(GuestAddr(0), len)?;
        let mut st = self.state();
        let id = SectionId(st.next_section);
        let mem = crate::sys::mm::Section::new(&format!("emuhost-section-{}", id.0), len)
            .map_err(|e| SpaceError::os("create section", 0, len, e))?;
        st.next_section += 1;
        st.sections.insert(id, Section { mem: Arc::new(mem), size: len });
        Ok(id)
    }

    /// Drops the space's handle on a section. Views of it stay mapped (the kernel keeps the
    /// memory until the last view goes).
    pub fn destroy_section(&self, id: SectionId) -> Result<(), SpaceError> {
        self.state().sections.remove(&id).map(|_| ()).ok_or(SpaceError::NoSection(id.0))
    }

    /// Maps the section's bytes from `offset` (page-aligned) at `range` as ONE view, replacing
    /// whatever was there. Mapping a single page at several addresses makes aliases: each sees
    /// the others' writes.
    pub fn map_section(
        &self,
        range: GuestRange,
        section: SectionId,
        offset: u64,
        prot: Prot,
    ) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        let _changing = self.changing();
        let mut st = self.state();
        st.refuse_held("map section", range)?;
        let sec = st.sections.get(&section).ok_or(SpaceError::NoSection(section.0))?;
        GuestRange::new(GuestAddr(offset), range.len())?;
        if offset.checked_add(range.len()).is_none_or(|end| end > sec.size) {
            return Err(SpaceError::PastSection { section: section.0, offset, len: range.len(), size: sec.size });
        }
        let mem = sec.mem.clone();
        let _in_flight = self.begin(&mut st, range, Some(true));
        let mut rec = self.record_mut();
        let regions = self.own_regions(&rec, "map section", range)?;
        let kept = st.cut_views(range.start().0, range.end().0);
        self.reserve_holes(range, &regions)
            .and_then(|()| self.res.map_shared(off, len, &mem, offset, prot.raw()))
            .map_err(|e| SpaceError::os("map section", range.start().0, range.len(), e))?;
        st.forget(range.start().0, range.end().0);
        st.views.insert(range.start().0, range.end().0, ViewEntry { section, offset });
        rec.forget(range.start().0, range.end().0);
        rec.set_prot(range.start().0, range.end().0, prot);
        rec.shared.insert(range.start().0, range.end().0, ());
        st.tell(self, Change::Mapped { range, prot });
        st.tell_remapped(self, &rec.prots, &kept);
        Ok(())
    }

    /// Maps section pages at consecutive guest pages from `start`: guest page `i` shows section
    /// page `pages[i]`. Each run of consecutive section pages becomes one view (one `mmap`).
    /// Returns the number of views made.
    pub fn map_pages(
        &self,
        start: GuestAddr,
        section: SectionId,
        pages: &[u64],
        prot: Prot,
    ) -> Result<usize, SpaceError> {
        let page = page_size();
        let mut views = 0;
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1].wrapping_add(1) {
                j += 1;
            }
            let at = start.0.checked_add(i as u64 * page).ok_or(SpaceError::OutOfWindow {
                addr: start.0,
                len: pages.len() as u64 * page,
                window: self.window(),
            })?;
            let range = GuestRange::new(GuestAddr(at), (j - i) as u64 * page)?;
            let offset = pages[i].checked_mul(page).ok_or(SpaceError::PastSection {
                section: section.0,
                offset: u64::MAX,
                len: range.len(),
                size: 0,
            })?;
            self.map_section(range, section, offset, prot)?;
            views += 1;
            i = j;
        }
        Ok(views)
    }

    /// The shared views, in address order.
    pub fn views(&self) -> Vec<View> {
        let st = self.state();
        st.views.iter().map(|(s, e, v)| view(s, e, v)).collect()
    }

    /// The shared views that overlap `range`, unclipped.
    pub fn views_in(&self, range: GuestRange) -> Vec<View> {
        let st = self.state();
        st.views.overlapping(range.start().0, range.end().0).map(|(s, e, v)| view(s, e, v)).collect()
    }
}
