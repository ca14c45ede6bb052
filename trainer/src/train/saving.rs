//! The saves of one generation and the rules for their commits.
//!
//! A periodic save that fails costs a checkpoint, not the job: the next one waits for
//! it, counts the failure and tries again, up to `max_failed_saves` in a row. The
//! last save of a generation (the final step, a stop, a regroup) must commit, and
//! when the process is about to exit, every save's background work (the retention
//! after the commit) must end before it does: `Checkpointer::close`. Both
//! waits, and what a commit confirms (the in-memory copy, the supervisor's record),
//! are written here once, for every way a generation ends.

use std::time::Instant;

use ckpt::{Checkpointer, SaveHandle};

use ckpt::copies::{Copies, Holding};

use crate::model::TensorSpec;

use super::copies::keep_copy;
use super::shards::{Place, Shards, state_of};
use super::snapshots::{self, held_json};
use super::supervisor::or_cancelled;
use super::{Context, Stats, TrainConfig, TrainError, say};

/// The saves of one generation: its checkpointer, the save in flight (kept in
/// [`Checkpointing`](super::Checkpointing), so that it outlives the generation) and
/// the count of failed saves in a row.
pub(super) struct Saves<'a> {
    pub(super) ctx: Context<'a>,
    /// `None` without a store: nothing is saved.
    pub(super) checkpointer: Option<Checkpointer>,
    /// The in-memory copies and every rank's holding, when the world keeps them.
    pub(super) copies: Option<(&'a Copies, &'a [Holding])>,
    /// The rank's copy holder (whether or not it keeps copies of saves), whose
    /// replicas count in what the rank holds.
    pub(super) holder: Option<&'a Copies>,
    pub(super) pending: &'a mut Option<SaveHandle>,
    pub(super) failed_in_a_row: &'a mut u32,
}

impl Saves<'_> {
    /// Saves `st`: first waits for the previous save's commit (a failed one is
    /// tolerated, see the module docs), then starts this one, keeps its in-memory
    /// copy and leaves it in flight. Nothing without a store.
    pub(super) fn save(
        &mut self,
        st: &Shards,
        specs: &[TensorSpec],
        stats: &mut Stats,
    ) -> Result<(), TrainError> {
        if self.checkpointer.is_none() {
            return Ok(());
        }
        let blocked = Instant::now();
        if let Some(previous) = self.pending.take() {
            self.settle_previous(previous)?;
        }
        let Context {
            runtime,
            config,
            rank,
            world,
            ..
        } = self.ctx;
        if let Some((name, step, at_rank)) = &config.save_stage
            && st.step >= *step
            && rank == *at_rank
        {
            ckpt::failpoint::arm(name).map_err(TrainError::Invalid)?;
        }
        let checkpointer = self.checkpointer.as_ref().expect("checked above");
        let handle = start_save(runtime, checkpointer, config, specs, st, self.ctx.place)?;
        if let Some((copies, table)) = self.copies {
            let rot = config
                .rot_copy
                .is_some_and(|(from, at)| st.step >= from && rank == at);
            keep_copy(runtime, copies, table, &handle, rank, world, rot)?;
        }
        stats.ckpt_blocked += blocked.elapsed();
        stats.saves += 1;
        if rank == 0 {
            say(format_args!(
                "saving step {} (stall {:.1} ms); host_bytes_held {}",
                st.step,
                handle.stall().as_secs_f64() * 1e3,
                held_json(&self.host_bytes_held()),
            ));
        }
        *self.pending = Some(handle);
        Ok(())
    }

    /// The previous periodic save's commit: a failure (its commit is buried as
    /// failed, on every rank alike) lets training go on, up to `max_failed_saves` in a
    /// row.
    fn settle_previous(&mut self, previous: SaveHandle) -> Result<(), TrainError> {
        let step = previous.step();
        match self.commit_of(&previous, "waiting for the previous commit")? {
            Ok(()) => *self.failed_in_a_row = 0,
            Err(e) if *self.failed_in_a_row < self.ctx.config.max_failed_saves => {
                *self.failed_in_a_row += 1;
                if self.ctx.rank == 0 {
                    say(format_args!(
                        "checkpoint of step {step} failed ({e}); training goes on ({} of {} failed saves in a row allowed)",
                        self.failed_in_a_row, self.ctx.config.max_failed_saves
                    ));
                }
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// Waits for the save in flight to reach its outcome before a rollback, which
    /// then sees it among the commits (or knows it failed); a failed save is only
    /// logged: the rollback goes to the newest healthy commit there is.
    pub(super) fn settle(&mut self) -> Result<(), TrainError> {
        let Some(handle) = self.pending.take() else {
            return Ok(());
        };
        if let Err(e) = self.commit_of(&handle, "waiting for the commit before a rollback")? {
            tracing::warn!(step = handle.step(), error = %e, "the save before a rollback failed");
        }
        Ok(())
    }

    /// Waits for the save in flight to commit; it must. `exiting`: the process ends
    /// next, so the checkpointer is closed first (see [`Saves::close`]).
    /// Returns the step committed, `None` when no save was in flight.
    pub(super) fn final_commit(&mut self, exiting: bool) -> Result<Option<u64>, TrainError> {
        let Some(handle) = self.pending.take() else {
            return Ok(None);
        };
        self.commit_of(&handle, "waiting for the final commit")??;
        if exiting {
            self.close()?;
        }
        Ok(Some(handle.step()))
    }

    /// Waits for `handle`'s commit unless the generation is cancelled first; once it
    /// committed, confirms its in-memory copy and (rank 0) tells the supervisor. The
    /// save's own error is left for the caller to judge.
    fn commit_of(
        &self,
        handle: &SaveHandle,
        what: &str,
    ) -> Result<Result<(), ckpt::Error>, TrainError> {
        let Context {
            runtime,
            supervisor,
            rank,
            ..
        } = self.ctx;
        let committed = or_cancelled(runtime, supervisor, what, handle.committed())?;
        if committed.is_ok() {
            if let Some((copies, _)) = self.copies {
                copies.confirm(&handle.attempt().dir());
            }
            if rank == 0 {
                supervisor.committed(handle.step());
            }
        }
        Ok(committed)
    }

    /// Waits, if it has not finished, for the copy of an overlapped save in flight:
    /// the optimizer step is about to overwrite the rows it reads. Returns whether it
    /// waited.
    pub(super) fn wait_staged(&self, stats: &mut Stats) -> Result<bool, TrainError> {
        let Some(handle) = self.pending.as_ref().filter(|h| !h.is_staged()) else {
            return Ok(false);
        };
        let waited = Instant::now();
        handle.wait_staged()?;
        stats.ckpt_blocked += waited.elapsed();
        stats.staging_waits += 1;
        Ok(true)
    }

    /// What the rank's checkpointing holds in host memory now, by kind, with the
    /// peak (module `snapshots` says how the holder's count joins in).
    pub(super) fn host_bytes_held(&self) -> ckpt::HostBytesHeld {
        snapshots::host_bytes_held(self.checkpointer.as_ref(), self.holder)
    }

    /// Closes the checkpointer: waits for the background work of every save this
    /// rank started (on the rank that committed, the retention after the commit), so
    /// that the exit that follows cuts nothing off.
    fn close(&self) -> Result<(), TrainError> {
        if let Some(checkpointer) = &self.checkpointer {
            self.ctx.runtime.block_on(checkpointer.close())?;
        }
        Ok(())
    }
}

/// Starts the save of `st` at its step: the staging copy now, or overlapped with the
/// next step (`config.overlapped_staging`).
fn start_save(
    runtime: &tokio::runtime::Handle,
    checkpointer: &Checkpointer,
    config: &TrainConfig,
    specs: &[TensorSpec],
    st: &Shards,
    place: Place,
) -> Result<SaveHandle, TrainError> {
    let state = state_of(config, specs, st, place)?;
    let handle = if config.overlapped_staging {
        // SAFETY: the saved rows (`st.params`, `st.m`, `st.v`) are written only by
        // the optimizer step, which waits for `wait_staged()` on the pending handle
        // first (`Saves::wait_staged`, in the generation's update); a new generation
        // waits for it before it loads into recycled vectors, and `Checkpointing`
        // drops the pending handle (which waits) before the spare vectors.
        runtime.block_on(unsafe { checkpointer.save_overlapped(st.step, &state) })?
    } else {
        runtime.block_on(checkpointer.save(st.step, &state))?
    };
    Ok(handle)
}
