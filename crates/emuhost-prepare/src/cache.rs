//! The pipeline cache file and the progress journal beside it.
//!
//! **Cache file.** The driver's cache data (`vkGetPipelineCacheData`) starts with
//! `VkPipelineCacheHeaderVersionOne`: header size (32), header version (1), vendor ID, device ID
//! and the driver's `pipelineCacheUUID` (16 bytes); the rest is the driver's own. A driver is
//! meant to ignore data made for another device or driver, but corrupt data past a valid header
//! is not something to hand it. So the file wraps the data in an envelope: 16 bytes of magic
//! (`EMUHOST-VKPC`, three zero bytes, the envelope's version), the data's length and its CRC32
//! (`crc32fast`, zero-extended; little-endian u64s), then the data. Version 1 held an FNV-1a 64
//! checksum instead: such a file is rejected as of another version ([`CacheRejected::Version`]),
//! as one whose envelope, checksum or header does not match this device is ([`CacheRejected`]),
//! and the run starts cold. The file is replaced atomically (written beside it, synced, renamed);
//! the file beside it, `FILE.tmp`, is created exclusively ([`create_exclusive`]), so a link put there while
//! the run goes on is never written through, and FILE never becomes one.
//!
//! **Journal** (`FILE.journal`): what an interrupted run had finished. Its first line names the
//! device (`emuhost-prepare-journal 1 VENDOR DEVICE UUID`); each line after it is the key of a
//! variant whose pipeline is in the cache file saved before the line was written. A journal of
//! another device, or with a line that is not a key, is discarded whole. A run that finishes with
//! no failure removes it.
//!
//! **Only emuhost's files are replaced.** Before anything is read or written, [`check_ours`]
//! looks at the three files a run with a cache file replaces, truncates or removes (the file,
//! `FILE.journal`, `FILE.tmp`): each must be absent or a regular file that starts with emuhost's
//! mark (the envelope's magic, the journal's first word). The journal and the temporary file may
//! also be empty: a run killed between creating one and its first write leaves it so. Anything
//! else is refused ([`PrepareError::NotOurs`]) and left as it is.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use super::PrepareError;
use super::error::CacheRejected;
use super::vk::DeviceInfo;

/// The envelope's version: the magic's last byte. 1 held an FNV-1a 64 checksum, 2 a CRC32.
const VERSION: u8 = 2;
const MAGIC: &[u8; 16] = b"EMUHOST-VKPC\0\0\0\x02";
/// What every version of emuhost's cache file starts with (the magic less its version).
const CACHE_MARK: &[u8] = b"EMUHOST-VKPC";
/// What every journal starts with.
const JOURNAL_MARK: &[u8] = b"emuhost-prepare-journal ";
const ENVELOPE: usize = 32;
const VK_HEADER: usize = 32;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Wraps the driver's cache data in the envelope.
pub fn wrap(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ENVELOPE + data.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    out.extend_from_slice(&u64::from(crc32fast::hash(data)).to_le_bytes());
    out.extend_from_slice(data);
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks a cache file's bytes against this device; returns the driver's data inside.
///
/// # Errors
///
/// The [`CacheRejected`] that says why the file is not used: not emuhost's envelope, another
/// envelope version, truncated, corrupt, a Vulkan header this build does not read, or another
/// device or driver.
pub fn unwrap<'a>(file: &'a [u8], dev: &DeviceInfo) -> Result<&'a [u8], CacheRejected> {
    if file.len() < ENVELOPE {
        return Err(CacheRejected::Short { len: file.len(), want: ENVELOPE });
    }
    if &file[..16] != MAGIC {
        return Err(if file[..15] == MAGIC[..15] {
            CacheRejected::Version { found: file[15], want: VERSION }
        } else {
            CacheRejected::Magic
        });
    }
    let (said, want_sum) = (u64_at(file, 16), u64_at(file, 24));
    let data = &file[ENVELOPE..];
    if said != data.len() as u64 {
        return Err(CacheRejected::Length { said, held: data.len() as u64 });
    }
    let found = u64::from(crc32fast::hash(data));
    if found != want_sum {
        return Err(CacheRejected::Checksum { found, want: want_sum });
    }
    if data.len() < VK_HEADER {
        return Err(CacheRejected::Header { header_size: 0, version: 0 });
    }
    let (header_size, version) = (u32_at(data, 0), u32_at(data, 4));
    if (header_size as usize) < VK_HEADER || header_size as usize > data.len() || version != 1 {
        return Err(CacheRejected::Header { header_size, version });
    }
    let (vendor, device) = (u32_at(data, 8), u32_at(data, 12));
    if vendor != dev.vendor_id || device != dev.device_id {
        return Err(CacheRejected::Device { vendor, device, want_vendor: dev.vendor_id, want_device: dev.device_id });
    }
    if data[16..32] != dev.pipeline_cache_uuid {
        return Err(CacheRejected::Uuid { found: hex(&data[16..32]), want: hex(&dev.pipeline_cache_uuid) });
    }
    Ok(data)
}

/// Writes `bytes` to `path` atomically: a file beside it (`FILE.tmp`, created exclusively),
/// synced, renamed over it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), PrepareError> {
    let tmp = sibling(path, ".tmp");
    let io = |source| PrepareError::Io { path: tmp.clone(), source };
    let mut f = create_exclusive(&tmp).map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|source| PrepareError::Io { path: path.to_path_buf(), source })
}

/// Creates `path` afresh for writing, never through a link. What is there goes first (the
/// directory entry only: a link is removed, not what it points to; [`check_ours`] found it
/// emuhost's at the start of the run, or a killed run left it); the file is then created with
/// `O_CREAT | O_EXCL`, which never follows a link, so anything put there in between is refused
/// (`AlreadyExists`) rather than written through.
pub fn create_exclusive(path: &Path) -> std::io::Result<std::fs::File> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::OpenOptions::new().write(true).create_new(true).open(path)
}

/// `path` with `suffix` added to its file name.
pub fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Refuses a cache file, `FILE.journal` or `FILE.tmp` that is there and not emuhost's (see the
/// module's docs): a preparation with `path` replaces, truncates or removes them.
pub fn check_ours(path: &Path) -> Result<(), PrepareError> {
    check_one(path, CACHE_MARK, false, "pipeline cache file")?;
    check_one(&sibling(path, ".journal"), JOURNAL_MARK, true, "preparation journal")?;
    check_one(&sibling(path, ".tmp"), CACHE_MARK, true, "pipeline cache being written")
}

fn check_one(path: &Path, mark: &[u8], empty_ok: bool, what: &'static str) -> Result<(), PrepareError> {
    use std::io::Read as _;
    let io = |source| PrepareError::Io { path: path.to_path_buf(), source };
    let not_ours = |why: &str| PrepareError::NotOurs { path: path.to_path_buf(), what, why: why.into() };
    // Not followed: a link would be replaced by the rename, not what it points to.
    let kind = match std::fs::symlink_metadata(path) {
        Ok(m) => m.file_type(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(e)),
    };
    if kind.is_dir() {
        return Err(not_ours("a directory"));
    } else if kind.is_symlink() {
        return Err(not_ours("a symbolic link (give the file it points to)"));
    } else if !kind.is_file() {
        // Opening a FIFO would block; a device is never ours to replace.
        return Err(not_ours("not a regular file"));
    }
    let mut head = Vec::with_capacity(mark.len());
    std::fs::File::open(path).and_then(|f| f.take(mark.len() as u64).read_to_end(&mut head)).map_err(io)?;
    match head.len() {
        0 if empty_ok => Ok(()),
        0 => Err(not_ours("empty")),
        _ if head == mark => Ok(()),
        _ => Err(not_ours("it does not start with emuhost's header")),
    }
}

/// The journal's first line for this device.
pub fn journal_header(dev: &DeviceInfo) -> String {
    format!("emuhost-prepare-journal 1 {:#x} {:#x} {}", dev.vendor_id, dev.device_id, hex(&dev.pipeline_cache_uuid))
}

/// Reads a journal's keys; `Err` says why it is not trusted. A last line without its newline was
/// cut by the interruption: it is left out (its variant is made again).
pub fn parse_journal(text: &str, dev: &DeviceInfo) -> Result<Vec<u64>, String> {
    let text = if text.ends_with('\n') { text } else { text.rfind('\n').map_or("", |i| &text[..=i]) };
    let mut lines = text.lines();
    let want = journal_header(dev);
    match lines.next() {
        Some(h) if h == want => {}
        Some(h) => return Err(format!("its first line {h:?} is not this device's {want:?}")),
        None => return Err("it is empty".into()),
    }
    lines
        .enumerate()
        .map(|(i, l)| {
            (l.len() == 16)
                .then(|| u64::from_str_radix(l, 16).ok())
                .flatten()
                .ok_or_else(|| format!("line {} {l:?} is not a variant key", i + 2))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    // A symbolic link to a file (Windows tells file and folder links apart).
    #[cfg(unix)]
    use std::os::unix::fs::symlink;
    #[cfg(windows)]
    use std::os::windows::fs::symlink_file as symlink;

    fn dev() -> DeviceInfo {
        DeviceInfo {
            name: "test".into(),
            vendor_id: 0x10de,
            device_id: 0x2335,
            driver_version: 1,
            pipeline_cache_uuid: [7; 16],
            api_version: 0,
            max_workgroup_invocations: 1024,
            max_workgroup_size: [1024, 1024, 64],
            creation_feedback: true,
        }
    }

    fn data(vendor: u32, device: u32, uuid: [u8; 16]) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&32u32.to_le_bytes());
        d.extend_from_slice(&1u32.to_le_bytes());
        d.extend_from_slice(&vendor.to_le_bytes());
        d.extend_from_slice(&device.to_le_bytes());
        d.extend_from_slice(&uuid);
        d.extend_from_slice(b"driver's own bytes");
        d
    }

    #[test]
    fn a_good_file_unwraps() {
        let d = data(0x10de, 0x2335, [7; 16]);
        assert_eq!(unwrap(&wrap(&d), &dev()).unwrap(), &d[..]);
    }

    /// A file of envelope version 1: the magic ending in 1 and an FNV-1a 64 checksum.
    fn version_1(data: &[u8]) -> Vec<u8> {
        let mut out = b"EMUHOST-VKPC\0\0\0\x01".to_vec();
        out.extend_from_slice(&(data.len() as u64).to_le_bytes());
        out.extend_from_slice(&crate::fnv1a(data).to_le_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn the_checksum_is_crc32_and_a_version_1_file_is_rejected_as_such() {
        let d = data(0x10de, 0x2335, [7; 16]);
        let w = wrap(&d);
        assert_eq!(&w[24..32], &u64::from(crc32fast::hash(&d)).to_le_bytes(), "CRC32, zero-extended");
        let old = version_1(&d);
        let e = unwrap(&old, &dev()).unwrap_err();
        assert_eq!(e, CacheRejected::Version { found: 1, want: 2 });
        assert!(e.to_string().contains("version 1") && e.to_string().contains("FNV-1a"), "{e}");
        // Ours: a run replaces it.
        assert!(old.starts_with(CACHE_MARK));
    }

    #[test]
    fn every_fault_is_rejected() {
        let good = wrap(&data(0x10de, 0x2335, [7; 16]));
        assert!(matches!(unwrap(&good[..20], &dev()), Err(CacheRejected::Short { .. })));
        let mut f = good.clone();
        f[0] ^= 1;
        assert_eq!(unwrap(&f, &dev()), Err(CacheRejected::Magic));
        let mut f = good.clone();
        f[15] = 9;
        assert_eq!(unwrap(&f, &dev()), Err(CacheRejected::Version { found: 9, want: 2 }));
        assert!(matches!(unwrap(&good[..good.len() - 1], &dev()), Err(CacheRejected::Length { .. })));
        let mut f = good.clone();
        *f.last_mut().unwrap() ^= 0x40;
        assert!(matches!(unwrap(&f, &dev()), Err(CacheRejected::Checksum { .. })));
        let other = wrap(&data(0x1002, 0x2335, [7; 16]));
        assert!(matches!(unwrap(&other, &dev()), Err(CacheRejected::Device { vendor: 0x1002, .. })));
        let other = wrap(&data(0x10de, 0x2336, [7; 16]));
        assert!(matches!(unwrap(&other, &dev()), Err(CacheRejected::Device { device: 0x2336, .. })));
        let other = wrap(&data(0x10de, 0x2335, [8; 16]));
        assert!(matches!(unwrap(&other, &dev()), Err(CacheRejected::Uuid { .. })));
        let mut bad_header = data(0x10de, 0x2335, [7; 16]);
        bad_header[4] = 2;
        assert!(matches!(unwrap(&wrap(&bad_header), &dev()), Err(CacheRejected::Header { version: 2, .. })));
        assert!(matches!(unwrap(&wrap(b"short"), &dev()), Err(CacheRejected::Header { .. })));
    }

    /// A fresh folder for one test.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("emuhost-prepare-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A link planted at the temporary name after the start-of-run check (`check_ours`), to a
    /// user's file or to nowhere: the save neither writes through it nor leaves the cache file a
    /// link.
    #[test]
    fn a_link_planted_at_the_temporary_name_is_not_written_through() {
        let dir = scratch("link");
        let file = dir.join("c.vkpc");
        let precious = dir.join("precious");
        let nowhere = dir.join("nowhere");
        std::fs::write(&precious, b"a user's file").unwrap();
        check_ours(&file).unwrap();
        for (n, target) in [&precious, &nowhere].into_iter().enumerate() {
            symlink(target, sibling(&file, ".tmp")).unwrap();
            let bytes = wrap(format!("cache {n}").as_bytes());
            write_atomic(&file, &bytes).unwrap();
            assert_eq!(std::fs::read(&precious).unwrap(), b"a user's file", "{target:?}: the link's target untouched");
            assert!(!nowhere.exists(), "{target:?}: a dangling link's target not made");
            assert!(std::fs::symlink_metadata(&file).unwrap().file_type().is_file(), "{target:?}: FILE a regular file");
            assert_eq!(std::fs::read(&file).unwrap(), bytes);
        }
        let mut left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, ["c.vkpc", "precious"], "no temporary file or link left");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn journal_round_trip_and_refusals() {
        let text = format!("{}\n{:016x}\n{:016x}\n", journal_header(&dev()), 5u64, u64::MAX);
        assert_eq!(parse_journal(&text, &dev()).unwrap(), [5, u64::MAX]);
        let mut other = dev();
        other.pipeline_cache_uuid[0] = 0;
        assert!(parse_journal(&text, &other).unwrap_err().contains("not this device's"));
        assert!(parse_journal(&format!("{text}xyz\n"), &dev()).unwrap_err().contains("line 4"));
        assert!(parse_journal("", &dev()).is_err());
        // A cut last line is left out, not a reason to distrust the rest.
        assert_eq!(parse_journal(&format!("{text}00000000"), &dev()).unwrap(), [5, u64::MAX]);
    }
}
