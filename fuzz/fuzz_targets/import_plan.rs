//! Random pools (added and released) and bindings planned under random configurations, each plan
//! checked against the reference model (`import::plan::reference`) over the live pools: the same
//! range, or the same error. A range covers its binding, is chunk-aligned, and passes the binding's
//! own cover only by a span within the cap.
#![no_main]

use arbitrary::Arbitrary;
use emuhost::import::{PlanConfig, PoolId, Pools, binding_cover, plan, reference};
use libfuzzer_sys::fuzz_target;

/// Where addresses fall: most in the lowest 256 MiB (a few small chunks, where pools meet and
/// spans chain), some in 16 GiB, anywhere, or at the very top (where covers wrap).
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Addr {
    /// `page * 4 KiB + byte`, within 256 MiB of the bottom.
    Near { page: u16, byte: u16 },
    /// The same within 16 GiB.
    Far { page: u32, byte: u16 },
    /// So many bytes below `u64::MAX`.
    Top(u32),
    Raw(u64),
}

impl Addr {
    fn get(self) -> u64 {
        match self {
            Addr::Near { page, byte } => u64::from(page) * 4096 + u64::from(byte % 4096),
            Addr::Far { page, byte } => u64::from(page % (1 << 22)) * 4096 + u64::from(byte % 4096),
            Addr::Top(back) => u64::MAX - u64::from(back),
            Addr::Raw(a) => a,
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Size {
    Bytes(u16),
    Pages(u16),
    Mib(u8),
    Raw(u64),
}

impl Size {
    fn get(self) -> u64 {
        match self {
            Size::Bytes(b) => u64::from(b),
            Size::Pages(p) => u64::from(p) * 4096,
            Size::Mib(m) => u64::from(m) << 20,
            Size::Raw(s) => s,
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Chunk {
    /// 4 KiB << (n % 16): 4 KiB to 128 MiB.
    Small(u8),
    /// 4 KiB << (n % 52): up to 2^63.
    Shift(u8),
    /// Any value: the planner must refuse one that is not a power of two.
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Cap {
    Off,
    /// A few chunks: the cap a chain of pools reaches exactly.
    Chunks(u8),
    Mib(u16),
    Raw(u64),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add { lo: Addr, size: Size },
    Remove { index: u16 },
    Plan { addr: Addr, size: Size, chunk: Chunk, cap: Cap, span: bool },
}

fuzz_target!(|ops: Vec<Op>| {
    let mut pools = Pools::new();
    // The live pools in registration order (what the model takes), with their ids.
    let mut live: Vec<(PoolId, u64, u64)> = Vec::new();
    for op in ops {
        match op {
            Op::Add { lo, size } => {
                let (lo, size) = (lo.get(), size.get());
                let valid = size > 0 && lo.checked_add(size).is_some();
                match pools.add(lo, size) {
                    Some(id) => {
                        assert!(valid, "a registry took {lo:#x}+{size:#x}");
                        live.push((id, lo, size));
                    }
                    None => assert!(!valid, "a registry refused {lo:#x}+{size:#x}"),
                }
            }
            Op::Remove { index } => {
                if live.is_empty() {
                    continue;
                }
                let (id, lo, size) = live.remove(usize::from(index) % live.len());
                let p = pools.remove(id).expect("a live pool");
                assert_eq!((p.id, p.lo, p.hi), (id, lo, lo + size));
                assert!(pools.remove(id).is_none());
            }
            Op::Plan { addr, size, chunk, cap, span } => {
                let chunk = match chunk {
                    Chunk::Small(n) => 4096u64 << (n % 16),
                    Chunk::Shift(n) => 4096u64 << (n % 52),
                    Chunk::Raw(c) => c,
                };
                let span_cap = match cap {
                    Cap::Off => 0,
                    Cap::Chunks(n) => chunk.saturating_mul(u64::from(n % 16)),
                    Cap::Mib(m) => u64::from(m) << 20,
                    Cap::Raw(c) => c,
                };
                let cfg = PlanConfig::new(chunk, span_cap);
                let (addr, size) = (addr.get(), size.get());
                check(&pools, &live, cfg, addr, size, span);
            }
        }
    }
    assert_eq!(pools.len(), live.len());
});

fn check(pools: &Pools, live: &[(PoolId, u64, u64)], cfg: PlanConfig, addr: u64, size: u64, span: bool) {
    let list: Vec<(u64, u64)> = live.iter().map(|&(_, lo, size)| (lo, size)).collect();
    let got = plan(pools, cfg, addr, size, span);
    let want = reference(&list, cfg, addr, size, span);
    let what = || format!("{addr:#x}+{size:#x} {cfg:?} span {span} over {list:x?}");
    match (&got, &want) {
        (Ok(g), Ok(w)) => assert_eq!(g, w, "{}", what()),
        (Err(g), Err(w)) => assert_eq!(g.to_string(), w.to_string(), "{}", what()),
        _ => panic!("planner {got:?}, model {want:?}: {}", what()),
    }
    let Ok(r) = got else { return };
    let end = addr + size;
    assert!(r.covers(addr, end) && r.lo % cfg.chunk == 0 && r.hi % cfg.chunk == 0, "{r} {}", what());
    let plain = binding_cover(addr, size, cfg.chunk).expect("the plan took it");
    if r != plain {
        assert!(span && r.covers(plain.lo, plain.hi) && r.len() <= cfg.span_cap, "{r} {}", what());
    }
}
