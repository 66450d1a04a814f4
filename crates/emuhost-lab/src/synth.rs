//! A synthetic game session, deterministic from a seed, shaped on the Kokiri Forest session that
//! `reference/000_*` measured: 4,547 pools in two minutes at ~40 frames/s, 88 of them across a
//! 16 MiB chunk's end, 419 chunks touched, ~45 spanned imports against ~90 chunk imports.
//!
//! The layout, chunk by chunk (16 MiB chunks from guest 0x10_0000_0000, 512 of them):
//! - *groups*: runs of 1–4 chunks joined by long-lived pools across each inner chunk end. A span
//!   of up to 64 MiB takes a whole group in one import; without spans each bound chunk of it is an
//!   import of its own. The Kokiri pair is one: the 16 MiB pool at 0x1021745000 across
//!   0x1022000000. Each group's chunks are bound (first during the load), except one end chunk of a
//!   few groups, which a span imports anyway (the reference's +7 % of imported memory).
//! - a few group ends are bound across after both of their chunks were bound on their own: without
//!   spans each of those is a re-import of both chunks as one. Kokiri's (0x1021ffff00+0x160) comes
//!   during play, as do two others; the rest come during the load.
//! - the lone chunk: one 4 KiB pool at 0x1034ef6000, made during the load, first bound during play.
//! - pairs of chunks joined by a pool across their end that is never bound (the rest of the 88).
//! - chunks with pools that are never bound, and chunks no pool touches.
//!
//! Every pool is committed (on game thread 0) right before it is made; short-lived pools are made
//! and released all session long (released, then decommitted) inside one chunk of the touched
//! ones. Cross-thread order is kept by frames: a pool is bound, written or collected by another
//! thread only in a frame after the one it was made in and before the one it is released in.
//! Half the writes go to the watched pools (collected in turn), the others to pools that live
//! through the next frame, in which the render thread collects each of them: every write but the
//! last frames' is followed by a collect of its pages, so a replay can judge it.
//!
//! ```
//! use emuhost_lab::synth::{Synth, SynthConfig};
//!
//! // A seed names one session: the same records on every platform.
//! let a: Vec<_> = Synth::new(SynthConfig::default().seed(7)).unwrap().take(2000).collect();
//! let b: Vec<_> = Synth::new(SynthConfig::default().seed(7)).unwrap().take(2000).collect();
//! assert_eq!(a, b);
//! // Every record passes a reader's checks.
//! let synth = Synth::new(SynthConfig::default().seed(7)).unwrap();
//! let mut w = emuhost_lab::trace::TraceWriter::new(std::io::sink(), synth.header()).unwrap();
//! for r in synth.take(2000) {
//!     w.write(&r).unwrap();
//! }
//! ```

use std::collections::{BTreeMap, VecDeque};

use crate::rng::{Rng, splitmix};
use emuhost::space::{GuestAddr, Prot};

use crate::trace::{Event, GUEST_PAGE, Header, Record, SleepKind, Thread, TraceError};

/// The chunk the session is laid out in (the importer's default).
pub const CHUNK: u64 = 16 << 20;
/// Where the game's pools live (guest address): 64 GiB into the window.
pub const REGION: u64 = 0x10_0000_0000;
/// Chunks in the region (8 GiB).
pub const REGION_CHUNKS: u64 = 512;
/// The Kokiri Forest pool: 16 MiB across the chunk end 0x1022000000.
pub const KOKIRI_POOL: (u64, u64) = (0x10_2174_5000, 0x100_0000);
/// The chunk end the Kokiri pool runs across.
pub const KOKIRI_END: u64 = 0x10_2200_0000;
/// The binding across that end that, without spans, re-imports both chunks on the render thread.
pub const KOKIRI_BIND: (u64, u64) = (0x10_21ff_ff00, 0x160);
/// The lone 4 KiB pool, made during the load, first bound during play.
pub const LONE_POOL: (u64, u64) = (0x10_34ef_6000, 0x1000);
/// The seed of the built-in default session.
pub const DEFAULT_SEED: u64 = 6;

/// What to generate. [`SynthConfig::default`] is the reference session; change a field of a value
/// you hold (`#[non_exhaustive]`: fields can be added).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SynthConfig {
    /// The seed: every draw comes from one [`Rng`] seeded with it.
    pub seed: u64,
    /// The session's length in seconds (at least twice `load_seconds`).
    pub seconds: u32,
    /// Frames per second (not 0).
    pub fps: u32,
    /// The first seconds are the load: long-lived pools are made and first bound then.
    pub load_seconds: u32,
    /// Pools made in the session (long-lived and short-lived).
    pub pools: u32,
    /// Pools across a chunk's end.
    pub pools_crossing: u32,
    /// Chunks that pools touch.
    pub chunks_touched: u32,
    /// Groups of 1, 2, 3 and 4 chunks (see the module's doc). The lone chunk is one of the
    /// singles, the Kokiri pair one of the pairs.
    pub groups: [u32; 4],
    /// Groups with an end chunk that is never bound.
    pub unbound_in_groups: u32,
    /// Group ends bound across after both sides were bound (Kokiri's is one).
    pub reimport_ends: u32,
    /// Game threads (at least 2: thread 0 makes the pools, the others sleep).
    pub game_threads: u16,
    /// Host threads (audio, timers).
    pub host_threads: u16,
    /// Bindings the render thread makes each frame.
    pub binds_per_frame: u32,
    /// Writes each game thread makes each frame.
    pub writes_per_thread_frame: u32,
    /// Collects over the watched pools (in turn) the render thread makes each frame; the pools
    /// written the frame before are collected besides.
    pub collects_per_frame: u32,
    /// Guest short sleeps: game threads 1.. sleep this long, this many times a second in all.
    pub guest_sleep_ns: u64,
    /// Guest short sleeps per second, over all game threads but 0.
    pub guest_sleeps_per_s: u32,
    /// Host short sleeps (audio, timers): each host thread, this long, this many times a frame.
    pub host_sleep_ns: u64,
    /// Host short sleeps per host thread and frame.
    pub host_sleeps_per_frame: u32,
}

impl Default for SynthConfig {
    fn default() -> Self {
        Self {
            seed: DEFAULT_SEED,
            seconds: 120,
            fps: 40,
            load_seconds: 10,
            pools: 4547,
            pools_crossing: 88,
            chunks_touched: 419,
            groups: [6, 34, 5, 1],
            unbound_in_groups: 6,
            reimport_ends: 7,
            game_threads: 4,
            host_threads: 1,
            binds_per_frame: 10,
            writes_per_thread_frame: 3,
            collects_per_frame: 2,
            guest_sleep_ns: 20_000,
            guest_sleeps_per_s: 7600,
            host_sleep_ns: 250_000,
            host_sleeps_per_frame: 4,
        }
    }
}

impl SynthConfig {
    /// The same session shape with another seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Links (pools across a group's inner ends).
    fn links(&self) -> u32 {
        let [_, p, t, q] = self.groups;
        p + 2 * t + 3 * q
    }

    fn group_chunks(&self) -> u32 {
        let [s, p, t, q] = self.groups;
        s + 2 * p + 3 * t + 4 * q
    }

    fn frames(&self) -> u64 {
        u64::from(self.seconds) * u64::from(self.fps)
    }

    fn check(&self) -> Result<(), String> {
        let [s, p, t, q] = self.groups;
        let links = self.links();
        let unbound_pairs = self.pools_crossing.checked_sub(links).ok_or("more group links than crossing pools")?;
        let used = self.group_chunks() + 2 * unbound_pairs;
        if used > self.chunks_touched || u64::from(self.chunks_touched) > REGION_CHUNKS - 8 {
            return Err(format!(
                "{used} chunks in groups and crossing pairs do not fit {} touched",
                self.chunks_touched
            ));
        }
        if s < 1 || p < 1 {
            return Err("the lone chunk needs a single and the Kokiri pair a pair".into());
        }
        if self.unbound_in_groups > p + t + q - 1 {
            return Err("more unbound group chunks than groups of two or more".into());
        }
        if self.reimport_ends < 1 || self.reimport_ends > links {
            return Err("re-imported ends must be between 1 and the group links".into());
        }
        if self.fps == 0 || self.load_seconds == 0 || self.seconds < 2 * self.load_seconds {
            return Err("needs fps > 0 and a session at least twice the load".into());
        }
        if self.game_threads < 2 {
            return Err("needs at least two game threads (0 makes pools, the others sleep)".into());
        }
        if u64::from(self.pools) < self.long_lived() {
            return Err(format!("{} pools are fewer than the {} long-lived ones", self.pools, self.long_lived()));
        }
        Ok(())
    }

    /// Long-lived pools: links, unbound crossing pools, one in each other touched chunk, and one
    /// more in each bound chunk but the lone one.
    fn long_lived(&self) -> u64 {
        let links = self.links();
        let unbound_pairs = self.pools_crossing - links;
        let others = self.chunks_touched - self.group_chunks() - 2 * unbound_pairs;
        let bound = self.group_chunks() - self.unbound_in_groups;
        u64::from(links + unbound_pairs + self.groups[0] + others + bound - 1)
    }
}

/// Pages (4 KiB) between `lo` and `hi` bytes, as bytes.
fn pages(rng: &mut Rng, lo: u64, hi: u64) -> u64 {
    rng.range(lo / GUEST_PAGE, hi / GUEST_PAGE + 1) * GUEST_PAGE
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Empty,
    Group,
    /// A chunk of a pair joined by a pool that is never bound.
    Unbound,
    Other,
}

#[derive(Clone, Debug)]
struct Pool {
    lo: u64,
    size: u64,
    made: u64,
    released: Option<u64>,
}

impl Pool {
    fn end(&self) -> u64 {
        self.lo + self.size
    }
}

/// A short-lived pool not placed yet: placed when it is made.
#[derive(Clone, Copy, Debug)]
struct Planned {
    size: u64,
    life: u64,
}

/// The generator: an iterator of records, made one frame at a time.
pub struct Synth {
    cfg: SynthConfig,
    rng: Rng,
    frames: u64,
    frame: u64,
    frame_us: u64,
    pools: Vec<Pool>,
    /// Live pools intersecting each chunk (by index into `pools`).
    chunk_pools: Vec<Vec<usize>>,
    /// Used ranges of each chunk (pools' extents), for placing short-lived pools.
    occupied: Vec<Vec<(u64, u64)>>,
    touched: Vec<usize>,
    /// First-binding frame of each bound chunk.
    first_bind: BTreeMap<u64, Vec<usize>>,
    bound_since: Vec<Option<u64>>,
    active: Vec<usize>,
    /// Group ends bound across: (end address, first frame).
    crossings: Vec<(u64, u64)>,
    /// Long-lived pools made each frame; short-lived ones planned each frame.
    long_makes: BTreeMap<u64, Vec<usize>>,
    short_makes: BTreeMap<u64, Vec<Planned>>,
    releases: BTreeMap<u64, Vec<usize>>,
    /// Pools others may use this frame: made in an earlier frame, not released in this one.
    live: Vec<usize>,
    /// Pools made in the frame before.
    just_made: Vec<usize>,
    watched: Vec<usize>,
    collect_next: usize,
    /// Pools (not watched) written in the frame before: the render thread collects each in this one.
    written: Vec<usize>,
    queue: VecDeque<Record>,
}

fn chunk_lo(i: usize) -> u64 {
    REGION + i as u64 * CHUNK
}

fn chunk_of(addr: u64) -> usize {
    ((addr - REGION) / CHUNK) as usize
}

/// Where the chunks went: each chunk's role, the groups (first chunk, length; Kokiri's pair and
/// the lone chunk first) and the end chunk of each unbound pair.
struct Layout {
    role: Vec<Role>,
    groups: Vec<(usize, usize)>,
    unbound_ends: Vec<usize>,
}

impl Synth {
    /// The session `cfg` describes. Every random draw comes from one generator, in the order of
    /// the steps below: a step moved changes every seed's session.
    ///
    /// # Errors
    /// [`TraceError::BadConfig`], saying what does not fit, for a configuration that cannot be
    /// laid out (more crossing pools than chunks, fewer than two game threads, a session shorter
    /// than twice its load, ...).
    pub fn new(cfg: SynthConfig) -> Result<Self, TraceError> {
        cfg.check().map_err(|what| TraceError::BadConfig { what })?;
        let mut rng = Rng::new(cfg.seed);
        let load = u64::from(cfg.load_seconds) * u64::from(cfg.fps);
        let mut s = Synth::empty(cfg.clone());
        let layout = Self::lay_out(&cfg, &mut rng)?;
        let lone = chunk_of(LONE_POOL.0);
        s.touched = (0..layout.role.len()).filter(|&i| layout.role[i] != Role::Empty && i != lone).collect();
        let bound = Self::choose_bound(&cfg, &layout.groups, &mut rng);
        let links = s.make_long_lived(&layout, &bound, load, &mut rng)?;
        debug_assert_eq!(s.pools.len() as u64, cfg.long_lived());
        s.choose_watched(&bound, &mut rng);
        s.plan_bindings(&bound, &links, load, &mut rng);
        s.plan_short_lived(&mut rng);
        s.rng = rng;
        Ok(s)
    }

    /// A generator with nothing planned yet.
    fn empty(cfg: SynthConfig) -> Synth {
        let n = REGION_CHUNKS as usize;
        Synth {
            frame_us: 1_000_000 / u64::from(cfg.fps),
            frames: cfg.frames(),
            frame: 0,
            pools: Vec::new(),
            chunk_pools: vec![Vec::new(); n],
            occupied: vec![Vec::new(); n],
            touched: Vec::new(),
            first_bind: BTreeMap::new(),
            bound_since: vec![None; n],
            active: Vec::new(),
            crossings: Vec::new(),
            long_makes: BTreeMap::new(),
            short_makes: BTreeMap::new(),
            releases: BTreeMap::new(),
            live: Vec::new(),
            just_made: Vec::new(),
            watched: Vec::new(),
            collect_next: 0,
            written: Vec::new(),
            queue: VecDeque::new(),
            rng: Rng::new(0),
            cfg,
        }
    }

    /// Lays the chunks out: the fixed Kokiri pair and lone chunk, the rest shuffled around them.
    fn lay_out(cfg: &SynthConfig, rng: &mut Rng) -> Result<Layout, TraceError> {
        let n = REGION_CHUNKS as usize;
        let kokiri = chunk_of(KOKIRI_POOL.0);
        let lone = chunk_of(LONE_POOL.0);
        let [singles, pairs, triples, quads] = cfg.groups;
        let unbound_pairs = (cfg.pools_crossing - cfg.links()) as usize;
        let others = (cfg.chunks_touched - cfg.group_chunks()) as usize - 2 * unbound_pairs;
        let empties = n - cfg.chunks_touched as usize;
        // (length, role) of each item to place.
        let mut items: Vec<(usize, Role)> = Vec::new();
        for (len, count) in [(1, singles - 1), (2, pairs - 1), (3, triples), (4, quads)] {
            items.extend((0..count).map(|_| (len, Role::Group)));
        }
        items.extend((0..unbound_pairs).map(|_| (2, Role::Unbound)));
        items.extend((0..others).map(|_| (1, Role::Other)));
        items.extend((0..empties).map(|_| (1, Role::Empty)));
        rng.shuffle(&mut items);
        let mut role = vec![None; n];
        let mut groups: Vec<(usize, usize)> = vec![(kokiri, 2), (lone, 1)];
        let mut unbound_ends: Vec<usize> = Vec::new();
        role[kokiri] = Some(Role::Group);
        role[kokiri + 1] = Some(Role::Group);
        role[lone] = Some(Role::Group);
        let mut p = 0;
        while let Some((len, r)) = items.pop() {
            while p < n && role[p].is_some() {
                p += 1;
            }
            let (len, r) = if (p..p + len).any(|i| i >= n || role[i].is_some()) {
                // Does not fit before a fixed chunk: put an empty chunk here instead.
                let e = items.iter().position(|&(_, r)| r == Role::Empty).ok_or_else(|| TraceError::BadConfig {
                    what: "the layout ran out of empty chunks to fill gaps with".into(),
                })?;
                items.remove(e);
                items.push((len, r));
                (1, Role::Empty)
            } else {
                (len, r)
            };
            role[p..p + len].fill(Some(r));
            match r {
                Role::Group => groups.push((p, len)),
                Role::Unbound => unbound_ends.push(p + 1),
                _ => {}
            }
            p += len;
        }
        let role = role.into_iter().map(|r| r.unwrap_or(Role::Empty)).collect();
        Ok(Layout { role, groups, unbound_ends })
    }

    /// The chunks that get bound: every group chunk but one end chunk of a few groups.
    fn choose_bound(cfg: &SynthConfig, groups: &[(usize, usize)], rng: &mut Rng) -> Vec<bool> {
        let kokiri = chunk_of(KOKIRI_POOL.0);
        let mut bound = vec![false; REGION_CHUNKS as usize];
        for &(first, len) in groups {
            bound[first..first + len].fill(true);
        }
        let mut multi: Vec<(usize, usize)> =
            groups.iter().copied().filter(|&(f, len)| len > 1 && f != kokiri).collect();
        rng.shuffle(&mut multi);
        for &(first, len) in multi.iter().take(cfg.unbound_in_groups as usize) {
            let end = if rng.next_u64() & 1 == 0 { first } else { first + len - 1 };
            bound[end] = false;
        }
        bound
    }

    /// The long-lived pools, made in the first half of the load: one across each inner end of a
    /// group (returned: those ends), one across each unbound pair's end, the lone pool, and pools
    /// inside the other touched chunks and the bound ones.
    fn make_long_lived(
        &mut self,
        layout: &Layout,
        bound: &[bool],
        load: u64,
        rng: &mut Rng,
    ) -> Result<Vec<u64>, TraceError> {
        let lone = chunk_of(LONE_POOL.0);
        let make_frame = |rng: &mut Rng| rng.range(0, load / 2);
        let mut links: Vec<u64> = Vec::new();
        for &(first, len) in &layout.groups {
            for c in first + 1..first + len {
                let end = chunk_lo(c);
                let (lo, size) = if end == KOKIRI_END {
                    KOKIRI_POOL
                } else {
                    let tail = pages(rng, 16 << 10, 6 << 20);
                    (end - tail, tail + pages(rng, 16 << 10, 6 << 20))
                };
                let f = make_frame(rng);
                self.add_long(lo, size, f);
                links.push(end);
            }
        }
        for &end_chunk in &layout.unbound_ends {
            let end = chunk_lo(end_chunk);
            let tail = pages(rng, 16 << 10, 6 << 20);
            let size = tail + pages(rng, 16 << 10, 6 << 20);
            let f = make_frame(rng);
            self.add_long(end - tail, size, f);
        }
        let f = make_frame(rng);
        self.add_long(LONE_POOL.0, LONE_POOL.1, f);
        for (i, &is_bound) in bound.iter().enumerate() {
            let single = layout.groups.iter().any(|&(g, len)| g == i && len == 1);
            let base = layout.role[i] == Role::Other || (single && i != lone);
            let extra = is_bound && i != lone;
            for _ in 0..(usize::from(base) + usize::from(extra)) {
                let size = pages(rng, 64 << 10, 4 << 20);
                let f = make_frame(rng);
                let lo = self.place(i, size, rng).ok_or_else(|| TraceError::BadConfig {
                    what: format!("no room for a long-lived pool in chunk {:#x}", chunk_lo(i)),
                })?;
                self.add_long(lo, size, f);
            }
        }
        Ok(links)
    }

    /// Watched pools (written often, collected by the renderer): Kokiri's and a few more.
    fn choose_watched(&mut self, bound: &[bool], rng: &mut Rng) {
        self.watched.extend(self.pools.iter().position(|p| (p.lo, p.size) == KOKIRI_POOL));
        let in_bound: Vec<usize> = (0..self.pools.len())
            .filter(|&p| bound[chunk_of(self.pools[p].lo)] && self.pools[p].lo != LONE_POOL.0)
            .collect();
        for _ in 0..7 {
            let p = rng.pick(&in_bound);
            if !self.watched.contains(&p) {
                self.watched.push(p);
            }
        }
    }

    /// First bindings: during the load, after the long-lived pools; the lone chunk's in play.
    /// Then the group ends bound across (of `links`): Kokiri's and two more in play, the rest late
    /// in the load.
    fn plan_bindings(&mut self, bound: &[bool], links: &[u64], load: u64, rng: &mut Rng) {
        let lone = chunk_of(LONE_POOL.0);
        let play = self.frames - load;
        for i in (0..bound.len()).filter(|&i| bound[i]) {
            let f = if i == lone { load + play * 45 / 100 } else { rng.range(load / 2, load * 3 / 4) };
            self.first_bind.entry(f).or_default().push(i);
        }
        let mut ends: Vec<u64> = links
            .iter()
            .copied()
            .filter(|&e| e != KOKIRI_END && bound[chunk_of(e) - 1] && bound[chunk_of(e)])
            .collect();
        rng.shuffle(&mut ends);
        ends.truncate(self.cfg.reimport_ends as usize - 1);
        self.crossings.push((KOKIRI_END, load + play * 18 / 100));
        for (k, e) in ends.into_iter().enumerate() {
            let f = match k {
                0 => load + play * 8 / 100,
                1 => load + play * 75 / 100,
                _ => rng.range(load * 3 / 4, load),
            };
            self.crossings.push((e, f));
        }
    }

    /// Short-lived pools: made all session long, each living 10 frames to a minute.
    fn plan_short_lived(&mut self, rng: &mut Rng) {
        let short = u64::from(self.cfg.pools) - self.pools.len() as u64;
        for _ in 0..short {
            let f = rng.range(0, self.frames - 1);
            let most = 1 << rng.range(0, 9);
            let size = rng.range(1, most + 1) * GUEST_PAGE;
            let life = rng.range(10, 60 * u64::from(self.cfg.fps));
            self.short_makes.entry(f).or_default().push(Planned { size, life });
        }
    }

    /// The header of the trace this generates.
    pub fn header(&self) -> Header {
        Header::default().option("source", "synth").option("seed", self.cfg.seed)
    }

    /// The configuration it generates.
    pub fn config(&self) -> &SynthConfig {
        &self.cfg
    }

    fn add_long(&mut self, lo: u64, size: u64, made: u64) {
        self.add_pool(Pool { lo, size, made, released: None });
        let id = self.pools.len() - 1;
        self.long_makes.entry(made).or_default().push(id);
    }

    fn add_pool(&mut self, p: Pool) {
        for c in chunk_of(p.lo)..=chunk_of(p.end() - 1) {
            self.occupied[c].push((p.lo, p.end()));
        }
        self.pools.push(p);
    }

    /// A free, page-aligned spot for `size` bytes inside chunk `c`.
    fn place(&self, c: usize, size: u64, rng: &mut Rng) -> Option<u64> {
        let (lo, hi) = (chunk_lo(c), chunk_lo(c) + CHUNK);
        (0..16).find_map(|_| {
            let at = lo + rng.range(0, (hi - lo - size) / GUEST_PAGE + 1) * GUEST_PAGE;
            self.occupied[c].iter().all(|&(a, b)| at + size <= a || at >= b).then_some(at)
        })
    }

    /// Frame `f`'s start: 25 ms steps at 40 fps, each up to 1 ms late (the same for a seed).
    fn frame_start(&self, f: u64) -> u64 {
        let mut x = self.cfg.seed ^ f.wrapping_mul(0xa076_1d64_78bd_642f);
        f * self.frame_us + splitmix(&mut x) % (self.frame_us / 25).max(1)
    }

    /// One frame's events on every thread, in steps that draw from the one generator in a fixed
    /// order (pools, bindings, writes, sleeps, times): any change of that order changes every
    /// seed's session (and the published figures of the built-in one).
    fn generate_frame(&mut self) {
        let f = self.frame;
        let (t0, t1) = (self.frame_start(f), self.frame_start(f + 1));
        // Per thread, its events in order; times are given after.
        let mut render: Vec<Event> = Vec::new();
        let mut game: Vec<Vec<Event>> = vec![Vec::new(); usize::from(self.cfg.game_threads)];
        self.frame_pools(f, &mut game[0]);
        self.frame_binds(f, &mut render);
        let watched = self.frame_collects(f, &mut render);
        // Pools written in the frame before and not watched: collected in this one, so that every
        // write has a collect after it to be judged by (the pools live on: see below).
        let side = std::mem::take(&mut self.written)
            .into_iter()
            .map(|p| Event::Collect { lo: GuestAddr(self.pools[p].lo), size: self.pools[p].size })
            .collect::<Vec<_>>();
        self.frame_writes(f, &watched, &mut game);
        let host = self.frame_sleeps(f, &mut game);
        self.frame_times(f, (t0, t1), render, side, game, host);
        self.frame += 1;
    }

    /// The frame's pool releases and makes, on the first game thread.
    fn frame_pools(&mut self, f: u64, game0: &mut Vec<Event>) {
        // Pools made in the last frame may be used from this one; pools released in this one may not.
        self.live.append(&mut self.just_made);
        let releasing = self.releases.remove(&f).unwrap_or_default();
        self.live.retain(|p| !releasing.contains(p));
        for &p in &releasing {
            let (lo, size) = (GuestAddr(self.pools[p].lo), self.pools[p].size);
            game0.push(Event::Unpool { lo, size });
            game0.push(Event::Decommit { lo, size });
            let c = chunk_of(lo.0);
            self.chunk_pools[c].retain(|&q| q != p);
            self.occupied[c].retain(|&(a, _)| a != lo.0);
        }
        let mut made = self.long_makes.remove(&f).unwrap_or_default();
        for planned in self.short_makes.remove(&f).unwrap_or_default() {
            // Into a touched chunk with room (the lone chunk stays alone).
            let spot = (0..16).find_map(|_| {
                let c = self.rng.pick(&self.touched);
                let mut rng = self.rng.clone();
                let at = self.place(c, planned.size, &mut rng);
                self.rng = rng;
                at
            });
            let Some(lo) = spot else { continue };
            let released = (f + planned.life < self.frames).then_some(f + planned.life);
            self.add_pool(Pool { lo, size: planned.size, made: f, released });
            let id = self.pools.len() - 1;
            if let Some(r) = released {
                self.releases.entry(r).or_default().push(id);
            }
            made.push(id);
        }
        self.just_made.clone_from(&made);
        for &p in &made {
            let (lo, size) = (GuestAddr(self.pools[p].lo), self.pools[p].size);
            game0.push(Event::Commit { lo, size, prot: Prot::READ_WRITE });
            game0.push(Event::Pool { lo, size });
            for c in chunk_of(lo.0)..=chunk_of(lo.0 + size - 1) {
                self.chunk_pools[c].push(p);
            }
        }
    }

    /// The frame's bindings, on the render thread.
    fn frame_binds(&mut self, f: u64, render: &mut Vec<Event>) {
        // Bindings: first ones, ends bound across, then random ones in chunks bound before.
        for c in self.first_bind.remove(&f).unwrap_or_default() {
            render.push(self.bind_in(c));
            self.bound_since[c] = Some(f);
        }
        for k in 0..self.crossings.len() {
            let (end, from) = self.crossings[k];
            if f >= from && (f - from).is_multiple_of(u64::from(self.cfg.fps)) {
                render.push(if end == KOKIRI_END {
                    Event::Bind { addr: GuestAddr(KOKIRI_BIND.0), size: KOKIRI_BIND.1 }
                } else {
                    let back = 0x100 * self.rng.range(1, 17);
                    Event::Bind { addr: GuestAddr(end - back), size: back + 0x20 * self.rng.range(1, 65) }
                });
            }
        }
        if !self.active.is_empty() {
            for _ in 0..self.cfg.binds_per_frame {
                let c = self.rng.pick(&self.active);
                render.push(self.bind_in(c));
            }
        }
        for c in 0..self.bound_since.len() {
            if self.bound_since[c] == Some(f) {
                self.active.push(c);
            }
        }
    }

    /// The frame's collects over watched pools, on the render thread; the pools watched.
    fn frame_collects(&mut self, f: u64, render: &mut Vec<Event>) -> Vec<usize> {
        // Collects over watched pools, in turn.
        let watched: Vec<usize> = self.watched.iter().copied().filter(|&p| self.pools[p].made < f).collect();
        if !watched.is_empty() {
            for _ in 0..self.cfg.collects_per_frame {
                let p = &self.pools[watched[self.collect_next % watched.len()]];
                self.collect_next += 1;
                render.push(Event::Collect { lo: GuestAddr(p.lo), size: p.size });
            }
        }
        watched
    }

    /// The frame's guest writes, on every game thread.
    fn frame_writes(&mut self, f: u64, watched: &[usize], game: &mut [Vec<Event>]) {
        // Writes on every game thread; half into watched pools, half into pools that live on
        // through the next frame (its collect above).
        let lasting: Vec<usize> =
            self.live.iter().copied().filter(|&p| self.pools[p].released != Some(f + 1)).collect();
        let mut written = Vec::new();
        if !self.live.is_empty() {
            for events in game.iter_mut() {
                for _ in 0..self.cfg.writes_per_thread_frame {
                    let p = if !watched.is_empty() && self.rng.next_u64() & 1 == 0 {
                        self.rng.pick(watched)
                    } else if lasting.is_empty() {
                        // Every live pool is released next frame: no write (one draw, as a pick).
                        self.rng.next_u64();
                        continue;
                    } else {
                        let p = self.rng.pick(&lasting);
                        if !written.contains(&p) {
                            written.push(p);
                        }
                        p
                    };
                    let (lo, end) = (self.pools[p].lo, self.pools[p].end());
                    let addr = self.rng.range(lo, end);
                    let want = 8u64 << self.rng.range(0, 14);
                    events.push(Event::Write { addr: GuestAddr(addr), size: want.min(end - addr) });
                }
            }
        }

        self.written = written;
    }

    /// The frame's guest sleeps on game threads 1.., and a host thread's sleeps (the same on each).
    fn frame_sleeps(&mut self, f: u64, game: &mut [Vec<Event>]) -> Vec<Event> {
        // Guest sleeps on game threads 1..: idle loops of 20 us sleeps, the frame's share of the
        // rate, in one or two loops a thread.
        let fps = u64::from(self.cfg.fps);
        let rate = u64::from(self.cfg.guest_sleeps_per_s);
        let mut left = (f + 1) * rate / fps - f * rate / fps;
        let workers = game.len() as u64 - 1;
        for (i, events) in game.iter_mut().enumerate().skip(1) {
            let share = if i as u64 == workers { left } else { left / (workers - i as u64 + 1) };
            left -= share;
            let first = if share > 1 && self.rng.next_u64() & 1 == 0 { share / 2 } else { share };
            for count in [first, share - first] {
                if count > 0 {
                    let count = u32::try_from(count).unwrap_or(u32::MAX);
                    events.push(Event::Sleep { kind: SleepKind::Guest, ns: self.cfg.guest_sleep_ns, count });
                }
            }
        }
        let host: Vec<Event> = (0..self.cfg.host_sleeps_per_frame)
            .map(|_| Event::Sleep { kind: SleepKind::Host, ns: self.cfg.host_sleep_ns, count: 1 })
            .collect();
        host
    }

    /// Gives the frame's events their times and queues them.
    fn frame_times(
        &mut self,
        f: u64,
        (t0, t1): (u64, u64),
        render: Vec<Event>,
        side: Vec<Event>,
        game: Vec<Vec<Event>>,
        host: Vec<Event>,
    ) {
        // Times: the frame line at the frame's start, each thread's events in order after it.
        let mut out: Vec<Record> = vec![Record { t_us: t0, thread: Thread::Render, event: Event::Frame { index: f } }];
        let mut timed = |thread: Thread, events: Vec<Event>, rng: &mut Rng| {
            let mut ts: Vec<u64> = events.iter().map(|_| rng.range(t0 + 1, t1)).collect();
            ts.sort_unstable();
            out.extend(ts.into_iter().zip(events).map(|(t_us, event)| Record { t_us, thread, event }));
        };
        timed(Thread::Render, render, &mut self.rng);
        // Timed by a generator of their own: the main one's draws (and so every binding, pool
        // and write) are those of a session without these collects.
        timed(Thread::Render, side, &mut Rng::new(self.cfg.seed ^ f.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x51de));
        for (i, events) in game.into_iter().enumerate() {
            timed(Thread::Game(i as u16), events, &mut self.rng);
        }
        for h in 0..self.cfg.host_threads {
            timed(Thread::Host(h), host.clone(), &mut self.rng);
        }
        out.sort_by_key(|r| r.t_us);
        self.queue.extend(out);
    }

    /// A binding inside a live pool's part of chunk `c`.
    fn bind_in(&mut self, c: usize) -> Event {
        let f = self.frame;
        let usable: Vec<usize> = self.chunk_pools[c]
            .iter()
            .copied()
            .filter(|&p| self.pools[p].made < f && self.pools[p].released.is_none_or(|r| r > f))
            .collect();
        let p = &self.pools[self.rng.pick(&usable)];
        let lo = p.lo.max(chunk_lo(c));
        let hi = p.end().min(chunk_lo(c) + CHUNK);
        let addr = self.rng.range(lo, hi) & !0xff;
        let size = (0x20 * self.rng.range(2, 0x800)).min(hi - addr);
        Event::Bind { addr: GuestAddr(addr), size }
    }
}

impl Iterator for Synth {
    type Item = Record;

    fn next(&mut self) -> Option<Record> {
        while self.queue.is_empty() && self.frame < self.frames {
            self.generate_frame();
        }
        self.queue.pop_front()
    }
}

/// The built-in default session (seed [`DEFAULT_SEED`]), generated as it is read.
pub fn default_session() -> Synth {
    Synth::new(SynthConfig::default()).expect("the default configuration is consistent")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inconsistent_configurations_are_refused() {
        let bad = [
            SynthConfig { pools_crossing: 10, ..SynthConfig::default() },
            SynthConfig { pools: 100, ..SynthConfig::default() },
            SynthConfig { chunks_touched: 100, ..SynthConfig::default() },
            SynthConfig { game_threads: 1, ..SynthConfig::default() },
            SynthConfig { reimport_ends: 0, ..SynthConfig::default() },
        ];
        for cfg in bad {
            assert!(matches!(Synth::new(cfg.clone()), Err(TraceError::BadConfig { .. })), "{cfg:?}");
        }
    }
}
