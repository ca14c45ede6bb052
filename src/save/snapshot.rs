//! Snapshots: a save that stops at host memory.
//!
//! A store save costs the store's bandwidth and money, so jobs make them every few
//! hundred steps and lose half that interval of every rank's work at each failure.
//! A snapshot ([`Checkpointer::snapshot`]) is staged exactly as a save is — the same
//! plan, the same overlapped copy into a pooled staging buffer, so the same stall —
//! and checksummed by the same encode threads (block CRC32s of the raw file and the
//! health scan), but nothing is uploaded: the staged file and its rank part (the
//! JSON a store save would write, block CRC32s included) are handed to the caller as
//! a [`Snapshot`], to keep in its [`Copies`](crate::copies::Copies) holder, replicate
//! to a ring peer and commit in the control plane ([`crate::snapshot`] says how).
//!
//! A snapshot's attempt has a run id of its own (`snap-` and the run's), so its
//! directory, and with it every [`CopyKey`] of its files, never equals a store
//! save's of the same step and generation. Its part records no codec: a snapshot is
//! raw in memory whatever the checkpointer's codec. Snapshots have a slot of their
//! own (one at a time): a snapshot never waits for a store upload, nor a save for a
//! snapshot's checksums. Their staging buffers come from the same pool, within the
//! same [host memory budget](crate::budget); the buffer is lent to the snapshot and
//! comes back to the pool when the last holder lets it go.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, watch};
use tracing::warn;

use super::write::{describe, encode};
use super::{Checkpointer, Job, SaveHandle, Status};
use crate::attempt::Attempt;
use crate::attempt::MAX_RUN_ID_LEN;
use crate::budget::{HeldKind, HostBytesHeld};
use crate::copies::{CopyKey, RankCopy, Snapshot};
use crate::error::{Error, Result};
use crate::format::Codec;

/// A snapshot's outcome, once known.
type Outcome = std::result::Result<Snapshot, Arc<Error>>;

/// Where a snapshot's background task hands the snapshot over: a slot the handle
/// takes the snapshot out of, and a signal that it is there. The task keeps no
/// reference to the snapshot once the handle has taken it, so its buffer's memory
/// is held only by what the caller keeps (a channel that carried the snapshot
/// itself would hold it until the task's end of the channel is dropped, a moment
/// after the waiter wakes, and a budget asked meanwhile would find it still held).
pub(super) struct SnapshotSender {
    slot: Arc<Mutex<Option<Outcome>>>,
    done: watch::Sender<bool>,
}

impl SnapshotSender {
    /// Hands the outcome over.
    pub(super) fn send(self, outcome: Outcome) {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(outcome);
        self.done.send_replace(true);
    }
}

/// The run id of a run's snapshots: `snap-` and the run's id, shortened to fit.
pub(super) fn run_id_of_snapshots(run: &str) -> String {
    let mut id = format!("snap-{run}");
    id.truncate(MAX_RUN_ID_LEN);
    id
}

/// Follows one rank's snapshot while it is staged and checksummed.
#[derive(Debug)]
pub struct SnapshotHandle {
    save: SaveHandle,
    slot: Arc<Mutex<Option<Outcome>>>,
    done: watch::Receiver<bool>,
    /// The outcome, once taken out of the slot.
    outcome: OnceLock<Outcome>,
}

impl SnapshotHandle {
    /// The step.
    pub fn step(&self) -> u64 {
        self.save.step()
    }

    /// The snapshot's attempt (its directory names the snapshot's files).
    pub fn attempt(&self) -> &Attempt {
        self.save.attempt()
    }

    /// How long `snapshot` blocked the caller.
    pub fn stall(&self) -> Duration {
        self.save.stall()
    }

    /// Waits until the caller's tensors are copied (as [`SaveHandle::staged`]).
    pub async fn staged(&self) -> Result<Duration> {
        self.save.staged().await
    }

    /// [`SnapshotHandle::staged`] for synchronous code.
    pub fn wait_staged(&self) -> Result<Duration> {
        self.save.wait_staged()
    }

    /// The event after the device-to-host copies of the snapshot's device tensors
    /// (as [`SaveHandle::device_released`]).
    #[cfg(feature = "cuda")]
    pub fn device_released(&self) -> Option<&cudarc::driver::CudaEvent> {
        self.save.device_released()
    }

    /// Blocks until [`SnapshotHandle::device_released`] has completed (as
    /// [`SaveHandle::wait_device_released`]).
    #[cfg(feature = "cuda")]
    pub fn wait_device_released(&self) -> Result<()> {
        self.save.wait_device_released()
    }

    /// Host memory held by the rank's checkpointing now, by kind.
    pub fn host_bytes_held(&self) -> HostBytesHeld {
        self.save.host_bytes_held()
    }

    /// Waits for the snapshot: staged and checksummed. Errors: the staging error
    /// ([`Error::Mutated`] and the like).
    pub async fn ready(&self) -> Result<Snapshot> {
        if self.outcome.get().is_none() {
            let mut done = self.done.clone();
            // Until handed over, or the task ended without a word.
            while !*done.borrow_and_update() && done.changed().await.is_ok() {}
            let taken = self.slot.lock().unwrap_or_else(|p| p.into_inner()).take();
            match taken {
                Some(outcome) => {
                    let _ = self.outcome.set(outcome);
                }
                None if self.outcome.get().is_none() => {
                    self.save.staged().await?;
                    return Err(Error::Failed(format!(
                        "snapshot of step {} ended without a result",
                        self.step()
                    )));
                }
                None => {}
            }
        }
        match self.outcome.get().expect("taken above") {
            Ok(snapshot) => Ok(snapshot.clone()),
            Err(e) => Err(e.duplicate()),
        }
    }

    /// [`SnapshotHandle::ready`] for synchronous code (not on a runtime's worker).
    pub fn wait_ready(&self) -> Result<Snapshot> {
        futures::executor::block_on(self.ready())
    }
}

impl Checkpointer {
    /// Snapshots this rank's `state` at `step` into host memory: staged as
    /// [`Checkpointer::save`] stages (blocking while it copies), checksummed in the
    /// background, uploaded nowhere ([the memory tier](crate::snapshot)). Waits while the previous
    /// snapshot is still being checksummed. [`Error::OverBudget`] when its staging
    /// buffer does not fit the host memory budget even after the oldest droppable
    /// copies are let go: the snapshot is not taken.
    pub async fn snapshot(&self, step: u64, state: &crate::State<'_>) -> Result<SnapshotHandle> {
        self.start_snapshot(step, state, false).await
    }

    /// [`Checkpointer::snapshot`] that returns before the copy, as
    /// [`Checkpointer::save_overlapped`] does.
    ///
    /// # Safety
    /// As for [`Checkpointer::save_overlapped`].
    pub async unsafe fn snapshot_overlapped(
        &self,
        step: u64,
        state: &crate::State<'_>,
    ) -> Result<SnapshotHandle> {
        self.start_snapshot(step, state, true).await
    }

    async fn start_snapshot(
        &self,
        step: u64,
        state: &crate::State<'_>,
        overlapped: bool,
    ) -> Result<SnapshotHandle> {
        let slot = Arc::new(Mutex::new(None));
        let (done_tx, done) = watch::channel(false);
        let sender = SnapshotSender {
            slot: slot.clone(),
            done: done_tx,
        };
        let save = self
            .start(step, state, overlapped, true, Some(sender))
            .await?
            .expect("a snapshot that may wait always starts");
        Ok(SnapshotHandle {
            save,
            slot,
            done,
            outcome: OnceLock::new(),
        })
    }
}

/// The background end of a snapshot: checksum and scan the staged file as a save
/// does, describe it in a rank part, lend the buffer to the snapshot and hand both
/// over. The permit (the snapshot slot) is held until then.
pub(super) async fn finish(
    job: Job,
    snapshot: SnapshotSender,
    permit: OwnedSemaphorePermit,
    status: watch::Sender<Status>,
) {
    let step = job.attempt.step;
    let block = job.config.block_size as usize;
    let result = match encode(&job, block, Codec::None).await {
        Ok((scan, _)) => {
            let rank = job.config.rank as u32;
            let name = crate::attempt::data_file_name(rank, false, &crate::attempt::nonce());
            let raw = job.buffer.len() as u64;
            let part = describe(&job, name, raw, scan, Codec::None, None).to_bytes();
            job.buffer.lend_as(HeldKind::Snapshot);
            let key = CopyKey {
                dir: job.attempt.dir(),
                world: job.config.world_size as u32,
                rank,
            };
            Ok(Snapshot::staged(
                RankCopy::staged(key, job.buffer.clone()),
                part,
                step,
            ))
        }
        Err(e) => {
            warn!(step, error = %e, "snapshot failed while checksumming");
            Err(Arc::new(e))
        }
    };
    drop(job);
    drop(permit);
    let _ = status.send(match &result {
        Ok(_) => Status::Durable,
        Err(e) => Status::Failed(e.clone()),
    });
    snapshot.send(result);
}
