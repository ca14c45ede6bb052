//! A save after its copy: the background task that writes the rank's data file and
//! part (`write.rs`), then commits (on a committer) or learns the outcome (on every
//! other rank), and reports each step to the handle. Failures are recorded in the
//! attempt's slot so the other ranks learn them at their next look.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_storage::Store;
use tokio::sync::{OwnedSemaphorePermit, watch};
use tracing::warn;

use super::config::CheckpointConfig;
use super::handle::{jitter, outcome_result};
use super::plan::Filled;
use super::write::write_rank;
use super::{Job, Role, Status};
use crate::attempt::Attempt;
use crate::commit::{Outcome, Retry};
use crate::copies::{CopyKey, RankCopy};
use crate::error::{Error, Result};
use crate::staging::{Pool, Pooled};

pub(super) async fn run_job(
    mut job: Job,
    filled: Filled,
    pool: Arc<Pool>,
    permit: OwnedSemaphorePermit,
    status: watch::Sender<Status>,
) {
    let step = job.attempt.step;
    // Copies the device makes into the buffer end before anything reads it or gives
    // it back to the pool.
    let device_copies = match job.pending_copies.take() {
        Some(wait) => tokio::task::spawn_blocking(wait)
            .await
            .unwrap_or_else(|e| Err(Error::Failed(format!("waiting for device copies: {e}")))),
        None => Ok(()),
    };
    let (buffer, replica_crcs) = match filled {
        Filled::Ready(buffer, crcs) => (buffer, crcs),
        Filled::Copying(copy) => {
            let failed = match copy.await {
                Ok((buffer, Ok(()), crcs)) => Ok((buffer, crcs)),
                Ok((buffer, Err(e), _)) => {
                    pool.lock().unwrap_or_else(|p| p.into_inner()).push(buffer);
                    Err(e)
                }
                Err(_) => Err(Error::Failed(format!(
                    "the staging copy of step {step} ended without reporting (its thread died)"
                ))),
            };
            match failed {
                Ok(filled) => filled,
                Err(e) => {
                    drop(permit);
                    warn!(step, error = %e, "checkpoint save failed while staging");
                    abandon(&mut job, e, &status).await;
                    return;
                }
            }
        }
    };
    if let Err(e) = device_copies {
        // The buffer is dropped here, not pooled: its copies failed.
        drop(buffer);
        drop(permit);
        warn!(step, error = %e, "checkpoint save failed while staging device tensors");
        abandon(&mut job, e, &status).await;
        return;
    }
    job.buffer = Arc::new(Pooled::new(buffer, &pool, job.file_len));

    // The host replicas are the first shadow boxes, in order.
    for (shadow, crcs) in job.shadow.iter_mut().zip(replica_crcs) {
        shadow.crcs = Some(crcs);
    }
    if let Some(snapshot) = job.snapshot.take() {
        // The pool is the checkpointer's to keep alive: a snapshot let go after its
        // checkpointer is gone frees its buffer rather than pooling it.
        drop(pool);
        super::snapshot::finish(job, snapshot, permit, status).await;
        return;
    }
    if let Some(copy) = job.copy.take() {
        let key = CopyKey {
            dir: job.attempt.dir(),
            world: job.config.world_size as u32,
            rank: job.config.rank as u32,
        };
        job.buffer.lend_as(crate::budget::HeldKind::Copy);
        copy.send_replace(Some(RankCopy::staged(key, job.buffer.clone())));
    }
    let written = write_rank(&job).await;
    let Job {
        buffer,
        store,
        config,
        attempt,
        role,
        ..
    } = job;
    // Give the buffer back before the slot, so the next save finds it (unless an
    // in-memory copy still holds it: it comes back when that is let go).
    drop(buffer);
    drop(permit);
    after_write(written, &store, &config, &attempt, role, &status).await;
}

/// A save's end once its rank part is written (or could not be): reports it durable,
/// then commits on a committer ([`commit_as`]); records the failure in the slot
/// otherwise ([`give_up`]). The piecewise save (`pieces.rs`) ends here too.
pub(super) async fn after_write(
    written: Result<()>,
    store: &Store,
    config: &CheckpointConfig,
    attempt: &Attempt,
    role: Role,
    status: &watch::Sender<Status>,
) {
    let step = attempt.step;
    let result = match (written, role) {
        (Ok(()), Role::Committer { index }) => {
            let _ = status.send(Status::Durable);
            crate::failpoint::hit("after-rank-part");
            commit_as(store, config, attempt, index).await
        }
        (Ok(()), Role::Waiter) => {
            let _ = status.send(Status::Durable);
            crate::failpoint::hit("after-rank-part");
            return;
        }
        (Err(e), _) => {
            warn!(step, error = %e, "checkpoint save failed");
            give_up(store, config, attempt, e, status).await;
            return;
        }
    };
    match result {
        Ok(()) => {
            let _ = status.send(Status::Committed);
        }
        Err(e) => {
            warn!(step, error = %e, "checkpoint save failed");
            let _ = status.send(Status::Failed(Arc::new(e)));
        }
    }
}

/// The save (or snapshot) `job` failed before its file was written: a snapshot
/// reports it to its handle (nothing of it is in the store); a save records it in
/// its attempt's slot ([`give_up`]).
async fn abandon(job: &mut Job, error: Error, status: &watch::Sender<Status>) {
    if let Some(snapshot) = job.snapshot.take() {
        let error = Arc::new(error);
        let _ = status.send(Status::Failed(error.clone()));
        snapshot.send(Err(error));
        return;
    }
    give_up(&job.store, &job.config, &job.attempt, error, status).await;
}

/// This rank cannot write its part of `attempt`, which therefore can never commit:
/// records that in the attempt's slot (a tombstone naming the rank and the error),
/// so that every other rank learns it at its next look at the slot instead of
/// waiting for this rank's part until `commit_timeout`. Then reports `error` (or the
/// outcome that stands, when a committer filled the slot first: a part whose write
/// failed on a reset connection may have landed after all).
///
/// The tombstone is tried again after any failure, within the store's retry budget
/// (a full disk may have room a moment later). An attempt whose names another save
/// took (`Error::Fenced`) is not this save's to bury. When the tombstone cannot be
/// written at all (the store stays unreachable or full beyond its retry budget), the
/// other ranks learn nothing before `commit_timeout`.
async fn give_up(
    store: &Store,
    config: &CheckpointConfig,
    attempt: &Attempt,
    error: Error,
    status: &watch::Sender<Status>,
) {
    let committed = !matches!(error, Error::Fenced(_))
        && {
            let failed = Outcome::Failed {
                reason: format!("rank {} could not write its part: {error}", config.rank),
            };
            match crate::commit::retry(store, "recording the failed save", Retry::Any, || {
                crate::commit::bury(store, attempt, &failed)
            })
            .await
            {
                Ok(outcome) => matches!(outcome, Outcome::Committed { .. }),
                Err(e) => {
                    warn!(
                        step = attempt.step,
                        error = %e,
                        "could not record the failed save; the other ranks wait for this rank's part until their commit timeout"
                    );
                    false
                }
            }
        };
    let _ = status.send(if committed {
        Status::Committed
    } else {
        Status::Failed(Arc::new(error))
    });
}

/// The committer's part, after its own part is durable: watch the attempt's
/// directory until every part is there, then commit (the first committer at once,
/// backups after `index` × the takeover delay unless the slot is filled meanwhile).
/// Applies retention when this call committed.
///
/// The first committer reads each part as it appears ([`crate::commit::Known`]), so
/// the work left after the last part lands is that part, not the world's; it looks
/// again soon after a look that found new parts, but never lists again before as
/// long as its last listing took has passed (listings of a large world are long).
async fn commit_as(
    store: &Store,
    config: &CheckpointConfig,
    attempt: &Attempt,
    index: u32,
) -> Result<()> {
    let world = config.world_size as u32;
    let deadline = Instant::now() + config.commit_timeout;
    let first_delay = Duration::from_millis(10);
    let mut delay = first_delay;
    let mut complete_since: Option<Instant> = None;
    let takeover = config.commit_takeover * index * world.div_ceil(1024).max(1);
    let mut known = crate::commit::Known::new(world, index == 0);
    // A backup looks no more often than its takeover delay (at least every second):
    // in a large world its listings would compete with the committer it is there to
    // replace.
    let max_delay = takeover.max(Duration::from_secs(1));
    loop {
        let look = known.look(store, attempt).await?;
        if look.slot.is_some()
            && let Some(outcome) = crate::commit::read_outcome(store, attempt).await?
        {
            return outcome_result(attempt, outcome);
        }
        if look.parts == world as usize {
            let since = *complete_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= takeover {
                // A commit is safe to run again (the log append is idempotent per
                // attempt, the slot create-if-absent): a reset request costs a retry,
                // not the outcome.
                let outcome = crate::commit::retry(store, "committing", Retry::Transient, || {
                    crate::commit::commit_gathered(store, attempt, &known)
                })
                .await?;
                if let Outcome::Committed { seq: Some(_) } = outcome {
                    crate::failpoint::hit("after-commit");
                    if let Some(keep) = config.keep_last {
                        let policy = crate::retention::Policy {
                            keep,
                            grace: config.retention_grace,
                        };
                        if let Err(e) = crate::retention::after_commit(store, policy).await {
                            warn!(error = %e, "retention failed; old checkpoints stay");
                        }
                    }
                }
                return outcome_result(attempt, outcome);
            }
            delay = delay.min(
                takeover
                    .saturating_sub(since.elapsed())
                    .max(Duration::from_millis(10)),
            );
        } else if index == 0 && look.new_parts > 0 {
            // Parts are arriving: the last may be next.
            delay = first_delay;
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout(format!(
                "step {} was not committed within {:?}: {} of {world} rank parts are present",
                attempt.step, config.commit_timeout, look.parts
            )));
        }
        tokio::time::sleep(jitter(delay).max(look.listing)).await;
        delay = (delay * 2).min(max_delay);
    }
}
