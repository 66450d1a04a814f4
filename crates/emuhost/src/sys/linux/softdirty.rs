//! Soft-dirty bits: writing `4` to `/proc/self/clear_refs` clears them for the whole process (and
//! write-protects every page so the next write sets the bit again); bit 55 of a page's
//! `/proc/self/pagemap` entry reads it. Kernels without `CONFIG_MEM_SOFT_DIRTY` accept the write
//! and never set the bit, which only a self-test can tell.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;

use crate::sys::counters::{Call, count};

const SOFT_DIRTY: u64 = 1 << 55;

#[derive(Debug)]
pub struct SoftDirty {
    pagemap: File,
    clear_refs: File,
}

impl SoftDirty {
    pub fn new() -> io::Result<Self> {
        Ok(Self {
            pagemap: File::open("/proc/self/pagemap")?,
            clear_refs: OpenOptions::new().write(true).open("/proc/self/clear_refs")?,
        })
    }

    /// Clears every soft-dirty bit of the process.
    pub fn clear(&self) -> io::Result<()> {
        count(Call::Copy);
        (&self.clear_refs).write_all(b"4")
    }

    /// Appends the runs of soft-dirty pages in `start..end` (host addresses) as `(start, end)`.
    pub fn read(&self, start: usize, end: usize, out: &mut Vec<(usize, usize)>) -> io::Result<()> {
        let page = super::mm::page_size();
        let mut buf = vec![0u8; ((end - start) / page) * 8];
        count(Call::Copy);
        self.pagemap.read_exact_at(&mut buf, (start / page * 8) as u64)?;
        for (i, e) in buf.chunks_exact(8).enumerate() {
            if u64::from_le_bytes(e.try_into().expect("8 bytes")) & SOFT_DIRTY != 0 {
                let a = start + i * page;
                match out.last_mut() {
                    Some(last) if last.1 == a => last.1 = a + page,
                    _ => out.push((a, a + page)),
                }
            }
        }
        Ok(())
    }
}
