//! What the caller holds while a save runs ([`SaveHandle`](crate::SaveHandle)): when its tensors are
//! free again (staged), when this rank's part is durable, when the whole checkpoint
//! is committed. The background task publishes each milestone on a watch channel;
//! the handle only reads them, so dropping it never cancels the save.

use std::time::{Duration, Instant};

use super::{Role, SaveHandle, Staging, Status};
use crate::attempt::Attempt;
use crate::commit::Outcome;
use crate::copies::{PendingCopy, RankCopy};
use crate::error::{Error, Result};

impl Drop for SaveHandle {
    /// An overlapped save may still be reading the caller's tensors: dropping its
    /// handle waits for the copy to end, so that memory the handle was keeping
    /// borrowed (by contract) is not freed under the copy.
    fn drop(&mut self) {
        if matches!(*self.staging.borrow(), Staging::Copying) {
            let _ = self.wait_staged();
        }
    }
}

impl SaveHandle {
    /// The step being saved.
    pub fn step(&self) -> u64 {
        self.attempt.step
    }

    /// The save attempt: its directory holds every object this save writes.
    pub fn attempt(&self) -> &Attempt {
        &self.attempt
    }

    /// How long `save` blocked the caller (for a blocking save, the staging copy
    /// included; for an overlapped one, only the registration).
    pub fn stall(&self) -> Duration {
        self.stall
    }

    /// Host memory held by the rank's checkpointing now (staging, copies,
    /// replicas, snapshots), by kind, with the peak and the budget.
    pub fn host_bytes_held(&self) -> crate::HostBytesHeld {
        self.budget.held()
    }

    /// Waits until the caller's tensors have been copied into the staging buffer:
    /// from then on the caller may change or free them. For a blocking
    /// [`Checkpointer::save`](crate::Checkpointer::save) this is ready at once.
    ///
    /// Errors: [`Error::Mutated`] when a tensor was changed before the copy read it
    /// (with [`CheckpointConfig::check_staging`](crate::CheckpointConfig::check_staging)); the save is then abandoned on this
    /// rank and its checkpoint does not commit.
    pub async fn staged(&self) -> Result<Duration> {
        let mut staging = self.staging.clone();
        loop {
            match &*staging.borrow_and_update() {
                Staging::Done(after) => return Ok(*after),
                Staging::Failed(e) => return Err(e.duplicate()),
                Staging::Copying => {}
            }
            if staging.changed().await.is_err() {
                return match &*staging.borrow() {
                    Staging::Done(after) => Ok(*after),
                    Staging::Failed(e) => Err(e.duplicate()),
                    Staging::Copying => Err(Error::Failed(format!(
                        "the staging copy of step {} ended without reporting",
                        self.attempt.step
                    ))),
                };
            }
        }
    }

    /// [`SaveHandle::staged`](crate::SaveHandle::staged) for synchronous code: blocks the calling thread (the
    /// copy runs on threads of its own, so this may be called anywhere, a runtime's
    /// worker included). Returns how long after `save` was called the copy ended.
    pub fn wait_staged(&self) -> Result<Duration> {
        if let Staging::Done(after) = &*self.staging.borrow() {
            return Ok(*after);
        }
        futures::executor::block_on(self.staged())
    }

    /// True once the staging copy has ended (successfully or not).
    pub fn is_staged(&self) -> bool {
        !matches!(*self.staging.borrow(), Staging::Copying)
    }

    /// This rank's data file of the save as it was staged, shared with the save
    /// (with [`CheckpointConfig::keep_copy`](crate::CheckpointConfig::keep_copy); no byte is copied): `None` until the
    /// staging copy (and with device tensors, their device-to-host copies) has ended,
    /// when staging failed, and without `keep_copy`. While this handle or any clone of
    /// the copy lives, its staging buffer does not go back to the pool.
    pub fn copy(&self) -> Option<RankCopy> {
        self.copy.as_ref().and_then(|copy| copy.borrow().clone())
    }

    /// Waits for [`SaveHandle::copy`](crate::SaveHandle::copy). Errors: [`Error::Invalid`] without
    /// [`CheckpointConfig::keep_copy`](crate::CheckpointConfig::keep_copy); the staging error when staging failed.
    pub async fn staged_copy(&self) -> Result<RankCopy> {
        let Some(copy) = &self.copy else {
            return Err(Error::invalid(format!(
                "step {}: no in-memory copy without CheckpointConfig::keep_copy",
                self.attempt.step
            )));
        };
        let mut copy = copy.clone();
        loop {
            if let Some(held) = copy.borrow_and_update().clone() {
                return Ok(held);
            }
            if copy.changed().await.is_err() {
                if let Some(held) = copy.borrow().clone() {
                    return Ok(held);
                }
                self.staged().await?;
                return Err(Error::Failed(format!(
                    "step {}: the save ended before its staged file could be kept (it failed, \
                     or it was staged in pieces to fit the host memory budget, and no whole \
                     file was ever held)",
                    self.attempt.step
                )));
            }
        }
    }

    /// The event recorded after the device-to-host copies of the save's device
    /// tensors (feature `cuda`; `None` when the state had none). Until it has
    /// completed, the device tensors must not be written: a trainer makes its
    /// optimizer step's stream wait for it (`stream.wait(event)`, no host stall).
    /// [`SaveHandle::staged`](crate::SaveHandle::staged) covers the host tensors only.
    #[cfg(feature = "cuda")]
    pub fn device_released(&self) -> Option<&cudarc::driver::CudaEvent> {
        self.device.as_deref()
    }

    /// Blocks the calling thread until [`SaveHandle::device_released`](crate::SaveHandle::device_released) has
    /// completed (at once without device tensors). Errors: [`Error::Device`] when a
    /// copy failed.
    #[cfg(feature = "cuda")]
    pub fn wait_device_released(&self) -> Result<()> {
        match &self.device {
            Some(event) => event
                .synchronize()
                .map_err(|e| Error::Device(format!("device-to-host staging copy failed: {e}"))),
            None => Ok(()),
        }
    }

    /// Waits until this rank's part is durable: its data file and manifest part are
    /// written (fsynced on local disk).
    ///
    /// Errors are typed: [`Error::is_transient`] (the store failed), [`Error::Fenced`]
    /// (the attempt's names were taken), and the others.
    pub async fn durable(&self) -> Result<()> {
        let mut status = self.status.clone();
        loop {
            match &*status.borrow_and_update() {
                Status::Durable | Status::Committed => return Ok(()),
                Status::Failed(e) => return Err(e.duplicate()),
                Status::Writing => {}
            }
            if status.changed().await.is_err() {
                return Err(Error::Failed(format!(
                    "save of step {} ended without reporting (the runtime shut down?)",
                    self.attempt.step
                )));
            }
        }
    }

    /// Waits until the whole checkpoint is committed, and returns how it ended.
    ///
    /// Once every rank's part is durable, the outcome arrives within a bounded time
    /// even when the committing rank dies (another committer takes over). Errors:
    /// [`Error::Fenced`] when a newer generation committed first, [`Error::Corrupt`]
    /// or [`Error::Failed`] when the parts could not be committed (the reason that the
    /// committer recorded, or that the rank which could not write its part recorded),
    /// [`Error::Timeout`] when some rank's part did not arrive within
    /// `commit_timeout` (a rank that died, or one that could not record its own
    /// failure either), storage errors as they are.
    ///
    /// On a committer, returns only once its background work for the save (the
    /// commit, and retention when it committed) has ended too, so a process may exit
    /// right after.
    pub async fn committed(&self) -> Result<()> {
        self.durable().await?;
        match self.role {
            Role::Committer { .. } => {
                let mut status = self.status.clone();
                loop {
                    match &*status.borrow_and_update() {
                        Status::Failed(e) => return Err(e.duplicate()),
                        Status::Committed => {}
                        Status::Writing | Status::Durable => {}
                    }
                    // The sender goes away when the background task ends.
                    if status.changed().await.is_err() {
                        return match &*status.borrow() {
                            Status::Committed => Ok(()),
                            Status::Failed(e) => Err(e.duplicate()),
                            _ => Err(Error::Failed(format!(
                                "save of step {} ended without an outcome",
                                self.attempt.step
                            ))),
                        };
                    }
                }
            }
            Role::Waiter => self.wait_for_slot().await,
        }
    }

    /// Polls the attempt's slot with a backoff: a few requests per rank for a commit
    /// that takes seconds, and at most one request per `max_delay` after that, where
    /// `max_delay` grows with the world size (8 ms per rank, 0.25 to 10 s) so that the
    /// whole world's polling stays near 125 requests per second however large it is:
    /// waiting ranks must not slow down the committers they wait for.
    async fn wait_for_slot(&self) -> Result<()> {
        let deadline = Instant::now() + self.commit_timeout;
        let world = self.world_size as u64;
        let max_delay = Duration::from_millis((8 * world).clamp(250, 10_000));
        // The first poll waits longer in a larger world: every rank arrives at once.
        let mut delay = Duration::from_millis((world / 4).clamp(20, 1000));
        loop {
            if let Some(outcome) = crate::commit::read_outcome(&self.store, &self.attempt).await? {
                return outcome_result(&self.attempt, outcome);
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout(format!(
                    "step {} was not committed within {:?}: some rank has not finished its part",
                    self.attempt.step, self.commit_timeout
                )));
            }
            // This rank's own part is durable and its background task is over (a
            // waiting rank does not commit): nothing but the store can report now.
            let pause = jitter(delay).min(deadline.saturating_duration_since(Instant::now()));
            tokio::time::sleep(pause).await;
            delay = (delay * 2).min(max_delay);
        }
    }
}

/// `delay` scaled by a factor in 0.75..1.25, so that ranks that started together do
/// not poll together.
pub(super) fn jitter(delay: Duration) -> Duration {
    let r = crate::attempt::nonce();
    let x = u64::from_str_radix(&r[..4], 16).unwrap_or(0) as f64 / 65535.0;
    delay.mul_f64(0.75 + 0.5 * x)
}

/// An outcome as the result `committed()` reports.
pub(super) fn outcome_result(attempt: &Attempt, outcome: Outcome) -> Result<()> {
    match outcome {
        Outcome::Committed { .. } => Ok(()),
        Outcome::Failed { reason } => Err(Error::Failed(format!(
            "step {} ({}) did not commit: {reason}",
            attempt.step,
            attempt.dir()
        ))),
        Outcome::Superseded { generation } => Err(Error::Fenced(format!(
            "step {} ({}) was fenced off: generation {generation} committed first",
            attempt.step,
            attempt.dir()
        ))),
    }
}

impl From<&SaveHandle> for PendingCopy {
    /// The save's copy as a holder of copies takes it ([`crate::copies::Copies::keep`]).
    fn from(handle: &SaveHandle) -> Self {
        PendingCopy {
            step: handle.attempt.step,
            dir: handle.attempt.dir(),
            copy: handle.copy.clone(),
        }
    }
}
