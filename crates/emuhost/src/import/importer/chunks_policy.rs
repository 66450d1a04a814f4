//! The chunks policy (the seed's): a binding imports its chunk-aligned cover, grown over the
//! pools that run across its ends (the span, [`super::super::plan`]), and the cover alone where
//! the spanned import fails. Everything happens on the binding thread.

use super::super::ImportError;
use super::super::backend::Backend;
use super::super::plan::{Planned, binding_cover, plan};
use super::super::pools::PoolId;
use super::state::State;
use super::{ChunksConfig, Core};

impl<B: Backend> Core<B> {
    /// The ranges a binding with nothing ready tries, in order (`true`: a smaller one follows
    /// if it fails): its cover spanned, then its cover alone (only the cover where the span
    /// grows nothing). Both cut at the window's end.
    pub(super) fn chunk_tries(
        &self,
        cfg: &ChunksConfig,
        st: &State<B::Import>,
        addr: u64,
        size: u64,
    ) -> Result<Vec<(Planned, bool)>, ImportError> {
        let plain = self.in_window(binding_cover(addr, size, self.cfg.chunk)?, addr, size);
        let spanned = self.in_window(self.chunk_plan(cfg, st, addr, size)?, addr, size);
        Ok(if spanned == plain { vec![(plain, false)] } else { vec![(spanned, true), (plain, false)] })
    }

    /// The range a binding plans under the chunks policy: its cover, spanned.
    pub(super) fn chunk_plan(
        &self,
        cfg: &ChunksConfig,
        st: &State<B::Import>,
        addr: u64,
        size: u64,
    ) -> Result<Planned, ImportError> {
        plan(&st.pools, cfg.plan(self.cfg.chunk), addr, size, true)
    }
}

/// The live imports released with pool `id` under the chunks policy: only those made ahead for
/// it that no binding has used (other pools and bindings may use its chunks).
pub(super) fn released_with<I>(st: &State<I>, id: PoolId) -> Vec<(u64, u64)> {
    st.imports.iter().filter(|(_, v)| v.ahead == Some(id)).map(|(k, _)| *k).collect()
}
