//! The process's memory figures as every platform's `procstat` gives them: a status text in
//! `/proc/<pid>/status`'s format (Linux's own; Windows writes its figures in it), read by one
//! parser, and what the C allocator holds.

/// The field `key` of a status text (`VmRSS:   1234 kB`), in bytes; `None` where the field is
/// missing or not in kB.
pub fn status_bytes(status: &str, key: &str) -> Option<u64> {
    let rest = status.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?;
    let mut f = rest.split_whitespace();
    match (f.next(), f.next()) {
        (Some(n), Some("kB")) => n.parse::<u64>().ok()?.checked_mul(1024),
        _ => None,
    }
}

/// What the C allocator holds, in bytes (glibc's `mallinfo2` on Linux).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Heap {
    /// Handed out and not yet freed: small chunks in the arenas plus the chunks mapped on their own.
    pub in_use: u64,
    /// Freed but kept by the allocator in its arenas (resident where it was touched).
    pub free_held: u64,
}

#[cfg(test)]
mod tests {
    use super::status_bytes;

    /// A line with the key and nothing after it is no field (and no panic).
    #[test]
    fn a_bare_key_is_no_field() {
        assert_eq!(status_bytes("VmHWM", "VmHWM"), None);
        assert_eq!(status_bytes("VmHWM:", "VmHWM"), None);
        assert_eq!(status_bytes("VmHWM:\t 8 kB", "VmHWM"), Some(8192));
    }
}
