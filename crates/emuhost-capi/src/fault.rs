//! The fault handles' table: `emuhost_fault_handle_handle` runs in a `SIGSEGV` handler, where the
//! handle registry's lock and reference counts (`handle`) may not be used, so fault handles live
//! in a fixed static table of slots instead, read with atomics only (no lock, no allocation, no
//! panic: async-signal-safe).
//!
//! A C fault handle is an encoded `(slot, generation)` value, never a pointer: its low four bits
//! are [`TAG`] (the registry's handles and aligned pointers end in 0), then the slot, then the
//! slot's generation when the handle was made. A lookup decodes it and takes the slot's value only
//! where the slot is live with that very generation, so a deleted handle, a handle deleted twice,
//! another kind of handle or a made-up value finds nothing, and nothing is read through it.
//!
//! A slot's value is written only while the slot is claimed (not live) and no lookup is reading
//! it: a lookup counts itself in the slot's `readers` before it loads the state, and a claim
//! checks `readers` after it changed the state, so a lookup that saw the old value live is either
//! seen (the claim leaves the slot for later) or done reading. A generation is reused only after
//! 2^50 claims of one slot (64-bit).

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};

use emuhost::watch::FaultHandle;

/// How many fault handles may be live at once (a power of two).
const SLOTS: usize = crate::watch::EMUHOST_FAULT_HANDLES_MAX as usize;
const _: () = assert!(SLOTS.is_power_of_two());
const SLOT_BITS: u32 = SLOTS.trailing_zeros();
/// The low bits of every fault handle.
const TAG: usize = 0x9;
const TAG_BITS: u32 = 4;
const GEN_MASK: u64 = (1u64 << (usize::BITS - SLOT_BITS - TAG_BITS)) - 1;

/// A slot's state: its generation (shifted by 2), and one of these.
const FREE: u64 = 0;
const CLAIMED: u64 = 1;
const LIVE: u64 = 2;

struct Slot {
    state: AtomicU64,
    /// Lookups between their count and their copy of the value.
    readers: AtomicU32,
    /// Initialised while the state is `LIVE` (and kept after: `FaultHandle` is `Copy`).
    value: UnsafeCell<MaybeUninit<FaultHandle>>,
}

// SAFETY: `value` is written only by the thread that claimed the slot while no lookup reads it,
// and read only while the slot is live (see the module's comment); everything else is atomic.
unsafe impl Sync for Slot {}

static TABLE: [Slot; SLOTS] = [const {
    Slot { state: AtomicU64::new(FREE), readers: AtomicU32::new(0), value: UnsafeCell::new(MaybeUninit::uninit()) }
}; SLOTS];

fn encode(slot: usize, generation: u64) -> usize {
    ((generation as usize) << (SLOT_BITS + TAG_BITS)) | (slot << TAG_BITS) | TAG
}

/// The slot and generation a handle names, where it has the tag.
fn decode(handle: usize) -> Option<(&'static Slot, u64)> {
    if handle & ((1 << TAG_BITS) - 1) != TAG {
        return None;
    }
    let slot = TABLE.get((handle >> TAG_BITS) & (SLOTS - 1))?;
    Some((slot, (handle >> (SLOT_BITS + TAG_BITS)) as u64))
}

/// Puts `value` in a free slot: its handle, or `None` where every slot is live.
pub(crate) fn insert(value: FaultHandle) -> Option<usize> {
    for (i, slot) in TABLE.iter().enumerate() {
        let state = slot.state.load(SeqCst);
        if state & 3 != FREE {
            continue;
        }
        let generation = ((state >> 2) + 1) & GEN_MASK;
        if slot.state.compare_exchange(state, generation << 2 | CLAIMED, SeqCst, SeqCst).is_err() {
            continue;
        }
        if slot.readers.load(SeqCst) != 0 {
            // A lookup may still be copying the value it found live: leave this slot for later.
            slot.state.store(generation << 2 | FREE, SeqCst);
            continue;
        }
        // SAFETY: claimed by this thread, and no lookup reads the value (see the module's comment).
        unsafe { (*slot.value.get()).write(value) };
        slot.state.store(generation << 2 | LIVE, SeqCst);
        return Some(encode(i, generation));
    }
    None
}

/// The value behind a live handle; `None` for anything else. Async-signal-safe.
pub(crate) fn get(handle: usize) -> Option<FaultHandle> {
    let (slot, generation) = decode(handle)?;
    slot.readers.fetch_add(1, SeqCst);
    let value = (slot.state.load(SeqCst) == generation << 2 | LIVE).then(|| {
        // SAFETY: live with this generation, so initialised, and no claim writes it until this
        // lookup leaves `readers` (the module's comment).
        unsafe { (*slot.value.get()).assume_init_read() }
    });
    slot.readers.fetch_sub(1, SeqCst);
    value
}

/// Frees a live handle's slot: false (and nothing done) where the handle is not live.
/// Async-signal-safe.
pub(crate) fn remove(handle: usize) -> bool {
    let Some((slot, generation)) = decode(handle) else { return false };
    slot.state.compare_exchange(generation << 2 | LIVE, generation << 2 | FREE, SeqCst, SeqCst).is_ok()
}
