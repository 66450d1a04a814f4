//! Region queries: the kernel's own record of what is mapped where. The Linux counterpart of
//! Windows' `VirtualQuery`.
//!
//! Two ways, chosen by what the kernel answers, never by its version: the `PROCMAP_QUERY` ioctl on
//! `/proc/self/maps` (Linux 6.11+: one call returns the mapping covering an address, or the next
//! one above it), and, where that ioctl answers `ENOTTY` or `EINVAL` (older kernels, a seccomp
//! filter), the text of `/proc/self/maps`, read once per query and parsed only up to the end of
//! the queried range. The first query of the process decides, and the answer is kept.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

use super::uapi::*;
use crate::sys::counters::{Call, count};

pub use crate::sys::Region;

/// How region queries are answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryPath {
    /// The `PROCMAP_QUERY` ioctl.
    Ioctl,
    /// The text of `/proc/self/maps`: the kernel has no `PROCMAP_QUERY`.
    Text,
    /// The text of `/proc/self/maps` because the layer above asked for it (fault injection).
    TextForced,
}

impl QueryPath {
    /// The path in words, as `emuhost probe` prints it.
    pub fn name(self) -> &'static str {
        match self {
            QueryPath::Ioctl => "PROCMAP_QUERY",
            QueryPath::Text => "/proc/self/maps (no PROCMAP_QUERY)",
            QueryPath::TextForced => "/proc/self/maps (forced)",
        }
    }
}

/// The process's answer: 0 not asked yet, 1 the ioctl works, 2 it does not.
static IOCTL: AtomicU8 = AtomicU8::new(0);

/// An open `/proc/self/maps`, to query regions.
#[derive(Debug)]
pub struct Maps {
    file: File,
    /// Parse the text even where the ioctl works (set by the layer above, for tests).
    force_text: bool,
}

impl Maps {
    /// Opens `/proc/self/maps`; `force_text` makes every query read its text.
    pub fn open(force_text: bool) -> io::Result<Self> {
        Ok(Self { file: File::open("/proc/self/maps")?, force_text })
    }

    /// How this handle's queries are answered (the first call of the process asks the kernel).
    pub fn path(&self) -> io::Result<QueryPath> {
        if self.force_text {
            return Ok(QueryPath::TextForced);
        }
        match IOCTL.load(Relaxed) {
            1 => return Ok(QueryPath::Ioctl),
            2 => return Ok(QueryPath::Text),
            _ => {}
        }
        let works = match self.ioctl(0) {
            Ok(_) => true,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => false,
            Err(e) => return Err(e),
        };
        IOCTL.store(if works { 1 } else { 2 }, Relaxed);
        Ok(if works { QueryPath::Ioctl } else { QueryPath::Text })
    }

    /// The `PROCMAP_QUERY` ioctl: the region covering `addr`, or else the first one above it;
    /// `None` past the last one.
    pub fn ioctl(&self, addr: usize) -> io::Result<Option<Region>> {
        let mut q = procmap_query {
            size: size_of::<procmap_query>() as u64,
            query_flags: PROCMAP_QUERY_COVERING_OR_NEXT_VMA,
            query_addr: addr as u64,
            vma_start: 0,
            vma_end: 0,
            vma_flags: 0,
            vma_page_size: 0,
            vma_offset: 0,
            inode: 0,
            dev_major: 0,
            dev_minor: 0,
            vma_name_size: 0,
            build_id_size: 0,
            vma_name_addr: 0,
            build_id_addr: 0,
        };
        count(Call::Query);
        // SAFETY: `self.file` is /proc/self/maps and `procmap_query` is PROCMAP_QUERY's struct,
        // with its `size` set; the name and build-id buffers are null with zero sizes, so the
        // kernel writes only into `q`.
        if let Err(e) = unsafe { ioctl_rw::<PROCMAP_QUERY, _>(self.file.as_fd(), &mut q) } {
            return if e.raw_os_error() == Some(libc::ENOENT) { Ok(None) } else { Err(e) };
        }
        Ok(Some(Region {
            start: q.vma_start as usize,
            end: q.vma_end as usize,
            read: q.vma_flags & PROCMAP_QUERY_VMA_READABLE != 0,
            write: q.vma_flags & PROCMAP_QUERY_VMA_WRITABLE != 0,
            exec: q.vma_flags & PROCMAP_QUERY_VMA_EXECUTABLE != 0,
            shared: q.vma_flags & PROCMAP_QUERY_VMA_SHARED != 0,
            file: q.inode != 0,
        }))
    }

    /// Every region that overlaps `start..end`, clipped to it, in address order (nothing is
    /// mapped in the gaps between them).
    pub fn regions(&self, start: usize, end: usize) -> io::Result<Vec<Region>> {
        if self.path()? != QueryPath::Ioctl {
            return regions_from_text(start, end);
        }
        let mut out = Vec::new();
        let mut at = start;
        while at < end {
            match self.ioctl(at)? {
                Some(r) if r.start < end => {
                    out.push(Region { start: r.start.max(start), end: r.end.min(end), ..r });
                    at = r.end;
                }
                _ => break,
            }
        }
        Ok(out)
    }
}

/// The regions over `start..end` from one read of `/proc/self/maps` (a fresh open, so concurrent
/// queries share no file position). Reading stops at the first line past `end`; lines below
/// `start` are only split at their first field.
fn regions_from_text(start: usize, end: usize) -> io::Result<Vec<Region>> {
    count(Call::Query);
    let mut f = File::open("/proc/self/maps")?;
    let mut buf = vec![0u8; 64 << 10];
    let (mut have, mut out) = (0, Vec::new());
    loop {
        let n = f.read(&mut buf[have..])?;
        have += n;
        let mut used = 0;
        while let Some(nl) = buf[used..have].iter().position(|&b| b == b'\n') {
            let line = &buf[used..used + nl];
            used += nl + 1;
            if line_end(line).is_some_and(|e| e <= start) {
                continue;
            }
            let r = parse_line(line).ok_or_else(|| {
                io::Error::other(format!("unreadable /proc/self/maps line {:?}", String::from_utf8_lossy(line)))
            })?;
            if r.start >= end {
                return Ok(out);
            }
            out.push(Region { start: r.start.max(start), end: r.end.min(end), ..r });
        }
        if n == 0 {
            return Ok(out);
        }
        buf.copy_within(used..have, 0);
        have -= used;
        if have == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
    }
}

/// A line's end address (its first field is `start-end`).
fn line_end(line: &[u8]) -> Option<usize> {
    let dash = line.iter().position(|&b| b == b'-')?;
    let sp = line.iter().position(|&b| b == b' ')?;
    usize::from_str_radix(std::str::from_utf8(line.get(dash + 1..sp)?).ok()?, 16).ok()
}

/// One line: `start-end perms offset dev inode [path]`, addresses in hex.
fn parse_line(line: &[u8]) -> Option<Region> {
    let line = std::str::from_utf8(line).ok()?;
    let mut f = line.split_ascii_whitespace();
    let (a, b) = f.next()?.split_once('-')?;
    let perms = f.next()?.as_bytes();
    let (_offset, _dev, inode) = (f.next()?, f.next()?, f.next()?);
    if perms.len() != 4 {
        return None;
    }
    Some(Region {
        start: usize::from_str_radix(a, 16).ok()?,
        end: usize::from_str_radix(b, 16).ok()?,
        read: perms[0] == b'r',
        write: perms[1] == b'w',
        exec: perms[2] == b'x',
        shared: perms[3] == b's',
        file: inode.parse::<u64>().ok()? != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::super::mm::{RawProt, Reservation, page_size};
    use super::*;

    #[test]
    fn a_maps_line_parses() {
        let r = parse_line(b"7f00a000-7f00c000 rw-s 00002000 00:01 4242   /memfd:emuhost-section-0 (deleted)").unwrap();
        assert_eq!((r.start, r.end), (0x7f00a000, 0x7f00c000));
        assert!(r.read && r.write && !r.exec && r.shared && r.file);
        let r = parse_line(b"10000-11000 --xp 00000000 00:00 0").unwrap();
        assert!(!r.read && !r.write && r.exec && !r.shared && !r.file);
        assert_eq!(line_end(b"10000-11000 --xp 00000000 00:00 0"), Some(0x11000));
        assert!(parse_line(b"zz-11000 ---p 0 00:00 0").is_none());
        assert!(parse_line(b"10000-11000").is_none());
    }

    #[test]
    fn both_paths_see_the_same_regions() {
        let maps = Maps::open(false).unwrap();
        if maps.path().unwrap() != QueryPath::Ioctl {
            println!("skipped: no PROCMAP_QUERY on this kernel, nothing to compare the text with");
            return;
        }
        // A reservation of our own with three regions in it, and the code of this test binary.
        let page = page_size();
        let res = Reservation::new(16 * page, 0).unwrap();
        res.protect(4 * page, 4 * page, RawProt { read: true, write: true, exec: false }).unwrap();
        let code = parse_line as *const () as usize;
        for (a, b) in [(res.base(), res.base() + 16 * page), (code, code + 1)] {
            let by_ioctl = maps.regions(a, b).unwrap();
            let by_text = Maps::open(true).unwrap().regions(a, b).unwrap();
            assert_eq!(by_ioctl, by_text, "{a:#x}..{b:#x}");
        }
        assert_eq!(maps.regions(res.base(), res.base() + 16 * page).unwrap().len(), 3);
    }
}
