//! What this machine offers: kernel release, logical processors in the affinity mask,
//! userfaultfd's features, and whether `PAGEMAP_SCAN` and `PROCMAP_QUERY` answer.

use std::io;

use super::uapi::*;

/// The kernel's release string (`uname -r`).
pub fn os_release() -> String {
    rustix::system::uname().release().to_string_lossy().into_owned()
}

pub use super::sched::affinity_cpus;

/// Wine's version where the process runs under Wine: never on Linux.
pub fn wine_version() -> Option<String> {
    None
}

/// Whether the kernel accounts every private writable page against a commit limit
/// (`vm.overcommit_memory` = 2, or unreadable: assumed so). There `mprotect` charges pages it makes
/// writable and does not give the charge back when it takes write access away from touched ones,
/// so only a new mapping returns it. Read once.
pub fn strict_overcommit() -> bool {
    static STRICT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *STRICT.get_or_init(|| std::fs::read_to_string("/proc/sys/vm/overcommit_memory").map_or(true, |m| m.trim() == "2"))
}

pub use super::uffd::features as userfaultfd_features;

/// Whether the `PAGEMAP_SCAN` ioctl answers (an empty scan of one stack page).
pub fn pagemap_scan() -> io::Result<()> {
    let pagemap = super::uffd::Pagemap::open()?;
    let local = 0u64;
    let page = rustix::param::page_size() as u64;
    let start = (&local as *const u64 as u64) & !(page - 1);
    let mut out = [PageRegion::default(); 1];
    let mut arg = pm_scan_arg(0, start, start + page);
    arg.category_anyof_mask = PAGE_IS_PRESENT;
    arg.return_mask = PAGE_IS_PRESENT;
    pagemap.scan(&mut arg, &mut out).map(drop)
}

/// Whether the `PROCMAP_QUERY` ioctl answers.
pub fn procmap_query() -> io::Result<()> {
    let maps = super::query::Maps::open(false)?;
    maps.ioctl(0).map(|_| ())
}

/// The transparent huge page mode (`always`, `madvise` or `never`), if the kernel has THP.
pub fn thp_mode() -> Option<String> {
    thp_setting("enabled")
}

/// The bracketed word of `/sys/kernel/mm/transparent_hugepage/<name>`, if there is one.
fn thp_setting(name: &str) -> Option<String> {
    let s = std::fs::read_to_string(format!("/sys/kernel/mm/transparent_hugepage/{name}")).ok()?;
    let start = s.find('[')?;
    let end = s[start..].find(']')?;
    Some(s[start + 1..start + end].to_string())
}

/// The kernel's transparent huge page settings, as read now (an administrator may change them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ThpModes {
    /// `enabled`: `always`, `madvise` or `never`.
    pub top: String,
    /// Each size's `hugepages-<size>kB/enabled` (Linux 6.8+): `always`, `inherit`, `madvise` or
    /// `never`.
    pub sizes: Vec<String>,
    /// `shmem_enabled`, if there is one: `always`, `within_size`, `advise`, `never`, `deny` or
    /// `force`.
    pub shmem: Option<String>,
}

/// The THP settings, `None` where the kernel has no THP.
pub fn thp_modes() -> Option<ThpModes> {
    let top = thp_mode()?;
    let mut sizes = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/sys/kernel/mm/transparent_hugepage") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("hugepages-")
                && let Some(mode) = thp_setting(&format!("{name}/enabled"))
            {
                sizes.push(mode);
            }
        }
    }
    Some(ThpModes { top, sizes, shmem: thp_setting("shmem_enabled") })
}
