//! The only place with OS calls. Each OS gets a folder with the same names (`linux/` now,
//! `windows/` later); the rest of the library calls `crate::sys::*` and never the OS itself.
//!
//! # Safety
//! This module opts out of the crate's `deny(unsafe_code)`. Every `unsafe` block in it carries a
//! `// SAFETY:` line naming the invariant or check that makes it sound.
#![allow(unsafe_code)]

mod counts;
pub mod hooks;

#[cfg(feature = "counters")]
pub mod counters;
#[cfg(not(feature = "counters"))]
#[path = "counters_disabled.rs"]
pub mod counters;

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
pub(crate) use linux::*;
