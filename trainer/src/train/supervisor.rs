//! What a control plane sees of a generation and how it ends one.
//!
//! A generation can be ended from outside while it waits: a collective by
//! [`Collective::abort`], every other wait (a commit, a load) by the supervisor's
//! cancellation. This module holds that contract ([`Supervisor`]), the supervisor of
//! a fixed world that never cancels ([`Unsupervised`]), and the two adapters through
//! which the training loop waits, so that every wait is both reported (a loop that
//! waits on others is not the one that is stuck) and cancellable.

use std::future::Future;
use std::pin::Pin;

use crate::collective::{Collective, CollectiveResult};

use super::TrainError;

/// What a control plane sees of a generation and asks of it. The elastic agent
/// implements it; a fixed world uses [`Unsupervised`].
///
/// Every method is cheap and called from the training thread: progress marks feed
/// the heartbeats that tell a stuck training loop from a slow one, `cancelled`
/// ends every wait that is not a collective (a commit, a load), which
/// [`Collective::abort`] cannot reach.
pub trait Supervisor: Sync {
    /// A step completed (or the load finished: `step` is where training stands).
    fn progress(&self, step: u64);
    /// The training thread starts (`true`) or stops (`false`) waiting on others: a
    /// collective (its peers), a load or a commit (the store, the committer). A
    /// loop that makes no progress while waiting is not the one that is stuck. Calls
    /// nest (a load runs collectives).
    fn waiting(&self, active: bool);
    /// Members wait to join: the world should end this generation at its next
    /// checkpoint.
    fn regroup_requested(&self) -> bool;
    /// Completes once this generation is cancelled (a member failed, or this one is
    /// stale).
    fn cancelled(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
    /// Whether it is cancelled already.
    fn is_cancelled(&self) -> bool;
    /// Rank 0 learned that `step` committed.
    fn committed(&self, step: u64);
    /// The checkpoint generation this generation's saves use (fencing floor of later
    /// ones).
    fn checkpoint_generation(&self, generation: u64);
    /// Rank 0 records a committed snapshot (a
    /// [`SnapshotRecord`](ckpt::snapshot::SnapshotRecord)'s JSON) where it survives
    /// the re-formation after a failure. `Ok(false)`: there is nowhere to record it
    /// (a fixed world, whose commit lives in the ranks' memory only).
    fn commit_snapshot(&self, record: &str) -> Result<bool, String> {
        let _ = record;
        Ok(false)
    }
    /// The newest committed snapshot's record, whichever generation committed it.
    fn committed_snapshot(&self) -> Result<Option<String>, String> {
        Ok(None)
    }
}

/// The supervisor of a fixed world: nothing watches it and nothing cancels it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Unsupervised;

impl Supervisor for Unsupervised {
    fn progress(&self, _: u64) {}
    fn waiting(&self, _: bool) {}
    fn regroup_requested(&self) -> bool {
        false
    }
    fn cancelled(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(std::future::pending())
    }
    fn is_cancelled(&self) -> bool {
        false
    }
    fn committed(&self, _: u64) {}
    fn checkpoint_generation(&self, _: u64) {}
}

/// A collective that tells the supervisor when the training thread waits on peers.
pub(super) struct Watched<'a> {
    pub(super) comm: &'a dyn Collective,
    pub(super) supervisor: &'a dyn Supervisor,
}

impl Watched<'_> {
    fn run<T>(&self, f: impl FnOnce(&dyn Collective) -> T) -> T {
        self.supervisor.waiting(true);
        let out = f(self.comm);
        self.supervisor.waiting(false);
        out
    }
}

impl Collective for Watched<'_> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    fn all_gather(&self, mine: &[u8], counts: &[usize], out: &mut [u8]) -> CollectiveResult {
        self.run(|c| c.all_gather(mine, counts, out))
    }
    fn reduce_scatter_i64(
        &self,
        data: &mut [i64],
        counts: &[usize],
        out: &mut [i64],
    ) -> CollectiveResult {
        self.run(|c| c.reduce_scatter_i64(data, counts, out))
    }
    fn reduce_scatter_f32(
        &self,
        data: &mut [f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> CollectiveResult {
        self.run(|c| c.reduce_scatter_f32(data, counts, out))
    }
    fn all_reduce_i64(&self, data: &mut [i64]) -> CollectiveResult {
        self.run(|c| c.all_reduce_i64(data))
    }
    fn all_reduce_f32(&self, data: &mut [f32]) -> CollectiveResult {
        self.run(|c| c.all_reduce_f32(data))
    }
    fn broadcast(&self, root: usize, data: &mut [u8]) -> CollectiveResult {
        self.run(|c| c.broadcast(root, data))
    }
    fn barrier(&self) -> CollectiveResult {
        self.run(|c| c.barrier())
    }
    fn abort(&self) {
        self.comm.abort()
    }
}

/// Runs `future` unless the supervisor cancels the generation first; the future's
/// own result is left for the caller to judge.
pub(super) fn or_cancelled<T>(
    runtime: &tokio::runtime::Handle,
    supervisor: &dyn Supervisor,
    what: &str,
    future: impl Future<Output = T>,
) -> Result<T, TrainError> {
    supervisor.waiting(true);
    let out = runtime.block_on(async {
        tokio::select! {
            out = future => Ok(out),
            () = supervisor.cancelled() => Err(TrainError::Cancelled(what.to_string())),
        }
    });
    supervisor.waiting(false);
    out
}

/// Runs `future` unless the supervisor cancels the generation first.
pub(super) fn unless_cancelled<T>(
    runtime: &tokio::runtime::Handle,
    supervisor: &dyn Supervisor,
    what: &str,
    future: impl Future<Output = Result<T, ckpt::Error>>,
) -> Result<T, TrainError> {
    or_cancelled(runtime, supervisor, what, future)?.map_err(TrainError::from)
}
