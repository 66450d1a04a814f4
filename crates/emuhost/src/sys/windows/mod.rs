//! Windows 10 1803 and later (and Wine): placeholders carved into private `MEM_WRITE_WATCH`
//! allocations and section views, `VirtualQuery` region queries, write tracking by
//! `GetWriteWatch` and by `VirtualProtect` with a vectored exception handler, high-resolution
//! waitable timers, and what the machine offers.

pub mod fault;
pub mod heap;
pub mod mm;
pub mod pin;
pub mod probe;
pub mod procstat;
pub mod query;
pub mod sched;
pub mod writewatch;
