//! The process's own memory figures, from `/proc/self/status`: the kernel keeps the peak resident
//! set (`VmHWM`, the high-water mark of `VmRSS`) for the process's whole life.

use std::io;

/// `/proc/self/status` as text.
pub fn self_status() -> io::Result<String> {
    std::fs::read_to_string("/proc/self/status")
}
