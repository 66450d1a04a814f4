//! What dropping a space gives back: an adopted window reserved again, or its own mapping unmapped.

use super::{GuestRange, Space};

impl Drop for Space {
    /// An adopted window goes back to the caller reserved: each run of pages the space committed,
    /// protected or mapped a view over is decommitted, as [`Space::decommit`] does (a run that
    /// holds a foreign mapping is left as it is, with a warning). A window the space reserved is
    /// unmapped with its guards, but for what it finds is not its own: a mapping foreign code put
    /// in a hole, or another space's reservation there.
    fn drop(&mut self) {
        if !self.res.adopted() {
            // Dead write-tracking tables over the window go first: a fault there from now on is on
            // memory mapped anew, never a tracker's.
            crate::sys::guard::unmapped(self.res.base(), self.res.base() + self.window() as usize);
            return self.unmap_own();
        }
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (a, b, _) in self.record().prots.iter() {
            match runs.last_mut() {
                Some(last) if last.1 == a => last.1 = b,
                _ => runs.push((a, b)),
            }
        }
        for (a, b) in runs {
            let run = GuestRange::from_bounds(a, b).expect("the record is page-aligned");
            if let Err(e) = self.decommit(run) {
                tracing::warn!("dropping an adopted window: {run} is left as it is: {e}");
            }
        }
    }
}

impl Space {
    /// Unmaps what of its mapping (window and guards) the space made: one region query over the
    /// whole mapping; a region it cannot have made stays mapped (with a debug line), and so does
    /// another space's reservation. Where the query fails the reservation's drop unmaps all but
    /// other spaces' reservations.
    fn unmap_own(&self) {
        // A fork's child: its region queries would read the parent's map (the reservation's drop
        // unmaps the child's copy).
        if self.same_process().is_err() {
            return;
        }
        let (lo, hi) = self.res.mapping();
        let Ok(regions) = self.maps.regions(lo, hi) else { return };
        let (base, end) = (self.res.base(), self.res.base() + self.window() as usize);
        let rec = self.record();
        let mut own: Vec<(usize, usize)> = Vec::new();
        for r in &regions {
            // The guards' parts must be reserved pages; the window's what the record says.
            let (ws, we) = (r.start.max(base), r.end.min(end));
            let reserved = !r.read && !r.write && !r.exec && !r.shared && !r.file;
            let guard_ok = reserved || (r.start >= ws && r.end <= we);
            let window_ok = ws >= we || rec.foreign((ws - base) as u64, (we - base) as u64, r).is_none();
            if guard_ok && window_ok {
                match own.last_mut() {
                    Some(last) if last.1 == r.start => last.1 = r.end,
                    _ => own.push((r.start, r.end)),
                }
            } else {
                tracing::debug!("dropping the space: {:#x}..{:#x} is not its own; left mapped", r.start, r.end);
            }
        }
        let mut parts = Vec::new();
        for (mut at, e) in own {
            for (x, y) in self.res.later_within(at, e) {
                parts.push((at, x));
                at = y;
            }
            parts.push((at, e));
        }
        parts.retain(|(s, e)| s < e);
        self.res.unmap_parts(&parts);
    }
}
