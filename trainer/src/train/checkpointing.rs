//! What a rank keeps from one generation to the next.
//!
//! An elastic rank runs many generations in one process. Between them it must not
//! lose the save still in flight (the next generation waits for it to reach a known
//! outcome), nor the memory the last one touched: the step's full-size buffers and
//! the state vectors are reused, because faulting in hundreds of megabytes again
//! would add tens of milliseconds to every recovery. [`Checkpointing`] holds all of
//! it; [`Recycled`] hands a generation's state vectors back to it however the
//! generation ends.

use std::sync::Arc;
use std::time::Duration;

use ckpt::SaveHandle;
use ckpt::copies::Copies;

use super::shards::Shards;

/// Checkpoint state that outlives a generation: the save still in flight when a
/// generation ended. An elastic rank keeps one across its generations, so that the
/// next generation waits for the previous save to reach a known outcome (or
/// abandons it explicitly) instead of dropping it unseen while its upload runs on.
#[derive(Debug, Default)]
pub struct Checkpointing {
    pub(super) pending: Option<SaveHandle>,
    /// Saves in a row that failed (storage errors past retries, a full disk); reset
    /// by a commit.
    pub(super) failed_in_a_row: u32,
    /// In-memory copies of the newest checkpoints (elastic ranks): a recovery
    /// rebuilds from them instead of the store where it can. Used only when every
    /// rank of the world has them.
    pub copies: Option<Arc<Copies>>,
    /// The step's full-size buffers, kept from one generation to the next: their
    /// size does not depend on the world, and releasing and faulting in several
    /// hundred megabytes again would add tens of milliseconds to every recovery.
    pub(super) workspace: Workspace,
    /// The last generation's state vectors (its rows at the step it stopped at),
    /// recycled as the next load's destination: memory this process has already
    /// touched fills several times faster than fresh pages.
    pub(super) spare: Vec<Vec<f32>>,
    /// The directory of the snapshot that was committed when the world last rolled
    /// back: it belongs to the timeline the rollback left, and is never resumed
    /// from (module `snapshots`).
    pub(super) abandoned_snapshot: Option<String>,
}

impl Checkpointing {
    /// Waits, at most `limit`, for the save left by an earlier generation to become
    /// durable on this rank, then lets it go: if every part is durable a surviving
    /// committer commits it (the commit is live), and a newer generation's commit
    /// fences it otherwise. Returns the step it was saving.
    pub fn settle(&mut self, runtime: &tokio::runtime::Handle, limit: Duration) -> Option<u64> {
        let handle = self.pending.take()?;
        let step = handle.step();
        // The timer must be created inside the runtime.
        match runtime.block_on(async { tokio::time::timeout(limit, handle.durable()).await }) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(step, error = %e, "the save left by the previous generation failed on this rank")
            }
            Err(_) => {
                tracing::warn!(
                    step,
                    "the save left by the previous generation is not durable yet; leaving it"
                )
            }
        }
        Some(step)
    }
}

/// A generation's state, whose vectors go back to [`Checkpointing::spare`] however
/// the generation ends.
pub(super) struct Recycled<'a> {
    pub(super) shards: Shards,
    pub(super) spare: &'a mut Vec<Vec<f32>>,
}

impl std::ops::Deref for Recycled<'_> {
    type Target = Shards;
    fn deref(&self) -> &Shards {
        &self.shards
    }
}

impl std::ops::DerefMut for Recycled<'_> {
    fn deref_mut(&mut self) -> &mut Shards {
        &mut self.shards
    }
}

impl Drop for Recycled<'_> {
    fn drop(&mut self) {
        let s = &mut self.shards;
        self.spare.clear();
        for ((p, m), v) in s.params.iter_mut().zip(&mut s.m).zip(&mut s.v) {
            self.spare
                .extend([std::mem::take(p), std::mem::take(m), std::mem::take(v)]);
        }
    }
}

/// Buffers of one step that span all parameters (see [`Checkpointing`]).
#[derive(Debug, Default)]
pub(super) struct Workspace {
    /// The all-gathered parameters.
    pub(super) full: Vec<f32>,
    /// Fixed-point gradient accumulators (deterministic mode).
    pub(super) acc_i64: Vec<i64>,
    /// f32 gradients (scratch of one chunk in deterministic mode).
    pub(super) acc_f32: Vec<f32>,
}

impl Workspace {
    /// Sizes the buffers for `total` parameters (contents unspecified).
    pub(super) fn prepare(&mut self, total: usize, deterministic: bool) {
        fn sized<T: ckpt::Element>(v: &mut Vec<T>, n: usize) {
            if v.len() != n {
                *v = huge_zeros(n);
            }
        }
        sized(&mut self.full, total);
        sized(&mut self.acc_i64, if deterministic { total } else { 0 });
        sized(&mut self.acc_f32, total);
    }
}

/// `n` zeros in memory backed by huge pages (`ckpt::load::zeroed_huge`): these
/// buffers are written in full at once, and with 4 KiB pages the page faults cost
/// several times the writes themselves (on a small machine, 60 ms against 10 ms for
/// 100 MB).
pub(super) fn huge_zeros<T: ckpt::Element>(n: usize) -> Vec<T> {
    ckpt::load::zeroed_huge(n).unwrap_or_else(|e| panic!("{e}"))
}
