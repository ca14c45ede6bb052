//! The public face of the save path ([`Checkpointer`](crate::Checkpointer)): making one, the blocking,
//! overlapped and non-waiting saves, warming the staging pool up, and `close`. Each
//! save starts in `stage.rs`; this file holds what a trainer calls.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckpt_storage::Store;
use tokio::sync::Semaphore;

use super::config::CheckpointConfig;
use super::stage_thread::StageThread;
use super::{Checkpointer, SaveHandle};
use crate::budget::{Dropper, HostBudget, HostBytesHeld};
use crate::error::{Error, Result};
use crate::staging::{Pool, StagingBuffer};

impl Checkpointer {
    /// A checkpointer for one rank, writing under `store`'s root, with a host
    /// memory budget of its own ([`CheckpointConfig::host_memory_budget`]).
    pub fn new(store: Store, config: CheckpointConfig) -> Result<Self> {
        let budget = HostBudget::new(config.host_memory_budget);
        Self::with_budget(store, config, budget)
    }

    /// A checkpointer that counts its staging in `budget`, a budget shared with
    /// the rank's other holders: a copies holder that outlives this checkpointer
    /// (an elastic rank makes a checkpointer per generation and keeps its copies
    /// across them), or the checkpointer of an earlier generation. With
    /// [`CheckpointConfig::host_memory_budget`] set, the shared budget's bound
    /// becomes that value ([`HostBudget::set_limit`]); with `None` it is left as it
    /// is.
    pub fn with_budget(
        store: Store,
        config: CheckpointConfig,
        budget: Arc<HostBudget>,
    ) -> Result<Self> {
        config.validate()?;
        if let Some(limit) = config.host_memory_budget {
            budget.set_limit(Some(limit));
        }
        let slots = Arc::new(Semaphore::new(config.max_in_flight));
        let pool: Arc<Pool> = Arc::new(Mutex::new(Vec::new()));
        let trimmer: Arc<dyn Dropper> = Arc::new(PoolTrimmer(Arc::downgrade(&pool)));
        budget.register(Arc::downgrade(&trimmer));
        Ok(Self {
            store,
            config: Arc::new(config),
            pool,
            slots,
            tasks: Mutex::new(Vec::new()),
            stage_thread: StageThread::default(),
            budget,
            _trimmer: trimmer,
            snapshot_slots: Arc::new(Semaphore::new(1)),
            #[cfg(feature = "cuda")]
            side: Mutex::new(Default::default()),
        })
    }

    /// The store written to.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The settings.
    pub fn config(&self) -> &CheckpointConfig {
        &self.config
    }

    /// The rank's host-memory budget ([`CheckpointConfig::host_memory_budget`]):
    /// give it to the rank's [`Copies`](crate::copies::Copies) holder
    /// ([`CopyConfig::budget`](crate::copies::CopyConfig::budget)) so that staging,
    /// copies, replicas and snapshots share one bound.
    pub fn host_budget(&self) -> &Arc<HostBudget> {
        &self.budget
    }

    /// Host memory held now by this rank's checkpointing, by kind, with the peak.
    pub fn host_bytes_held(&self) -> HostBytesHeld {
        self.budget.held()
    }

    /// A staging buffer of at least `total` bytes for a save or snapshot of `step`,
    /// inside the budget: an idle one of the pool that is large enough, else a new
    /// mapping; when that does not fit, the holders let go of their oldest
    /// droppable copies of earlier steps (whose buffers come back to the pool) and
    /// idle buffers too small are unmapped, until one fits. [`Error::OverBudget`]
    /// when nothing is left to let go.
    pub(super) fn take_buffer(&self, step: u64, total: usize) -> Result<StagingBuffer> {
        loop {
            let popped = {
                let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
                // Over a budget that shrank: idle buffers go first.
                while self.budget.available() == 0 && pool.len() > 1 {
                    pool.pop();
                }
                match pool.iter().position(|b| b.capacity() >= total) {
                    Some(at) => Some(pool.swap_remove(at)),
                    None => pool.pop(),
                }
            };
            let from_pool = popped.is_some();
            let mut buffer =
                popped.unwrap_or_else(|| StagingBuffer::counted_in(Some(self.budget.clone())));
            match buffer.reset(total) {
                Ok(()) => return Ok(buffer),
                // A pooled buffer too small was unmapped: try the next, or a new one.
                Err(_) if from_pool => continue,
                Err(e) => {
                    if !self.budget.drop_one(step) {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Saves this rank's `state` as part of checkpoint `step`, copying it before
    /// returning (a *blocking* save).
    ///
    /// Blocks while the state is copied into a staging buffer (and while
    /// `max_in_flight` earlier saves are still writing their parts: see
    /// [`Checkpointer::try_save`](crate::Checkpointer::try_save) for a save that never waits).
    /// The returned handle tells when this rank's part is durable and when the whole
    /// checkpoint is committed. Must be called within a tokio runtime.
    ///
    /// [`Checkpointer::save_overlapped`](crate::Checkpointer::save_overlapped) returns before the copy instead, so that it
    /// runs while the caller computes.
    pub async fn save(&self, step: u64, state: &crate::State<'_>) -> Result<SaveHandle> {
        let handle = self.start(step, state, false, true, None).await?;
        Ok(handle.expect("a save that may wait always starts"))
    }

    /// [`Checkpointer::save`](crate::Checkpointer::save), except that when `max_in_flight` saves are still
    /// writing their parts it returns `Ok(None)` at once and stages nothing: training
    /// never waits for storage, and this step is not checkpointed.
    pub async fn try_save(
        &self,
        step: u64,
        state: &crate::State<'_>,
    ) -> Result<Option<SaveHandle>> {
        self.start(step, state, false, false, None).await
    }

    /// Waits for every save this checkpointer started to end — its part written,
    /// and, on a committing rank, the commit and the retention after it — and refuses
    /// saves from then on. A trainer calls it before it exits, so that no background
    /// work of the last save (its retention in particular) is cut off. The outcome
    /// of each save is its handle's; this returns an error only when a save's task
    /// died (a panic), naming how many.
    pub async fn close(&self) -> Result<()> {
        // Every slot taken means no save is between its start and its task's
        // registration; closing the slots then refuses (and wakes) any later save.
        // A second close finds them closed already.
        let all = u32::try_from(self.config.max_in_flight).unwrap_or(u32::MAX);
        if let Ok(slots) = self.slots.acquire_many(all).await {
            self.slots.close();
            drop(slots);
        }
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        let mut died = 0;
        for task in tasks {
            if task.await.is_err() {
                died += 1;
            }
        }
        if died > 0 {
            return Err(Error::Failed(format!(
                "{died} save task(s) of rank {} ended abnormally",
                self.config.rank
            )));
        }
        Ok(())
    }

    /// Saves this rank's `state` as part of checkpoint `step`, returning as soon as
    /// the save is registered: the copy into the staging buffer runs on background
    /// threads ([`CheckpointConfig::copy_threads`](crate::CheckpointConfig::copy_threads)) while the caller goes on (the next
    /// forward and backward passes only read the parameters). The handle's
    /// [`SaveHandle::staged`](crate::SaveHandle::staged) (or [`SaveHandle::wait_staged`](crate::SaveHandle::wait_staged)) says when the copy is
    /// complete; a trainer waits for it right before its optimizer step overwrites
    /// the saved parameters and moments.
    ///
    /// Changing a saved tensor before `staged()` returns is a bug: the checkpoint
    /// would hold a mix of two steps. With [`CheckpointConfig::check_staging`](crate::CheckpointConfig::check_staging) (on in
    /// debug builds) such a change is detected and the save fails with
    /// [`Error::Mutated`] naming the tensor; without it, it goes unnoticed.
    ///
    /// # Safety
    /// Every tensor's memory in `state` must stay allocated, and must not be written,
    /// until [`SaveHandle::staged`](crate::SaveHandle::staged) (or [`SaveHandle::wait_staged`](crate::SaveHandle::wait_staged)) has returned or
    /// the handle has been dropped (dropping it waits for the copy). The borrow
    /// checker cannot see this: `state`'s borrows end when this call returns, while
    /// the copy reads the memory after that.
    ///
    /// A save that does not fit [`CheckpointConfig::host_memory_budget`](crate::CheckpointConfig::host_memory_budget) is staged
    /// and uploaded in pieces before this returns, as a blocking save: its handle is
    /// staged at once.
    pub async unsafe fn save_overlapped(
        &self,
        step: u64,
        state: &crate::State<'_>,
    ) -> Result<SaveHandle> {
        let handle = self.start(step, state, true, true, None).await?;
        Ok(handle.expect("a save that may wait always starts"))
    }

    /// [`Checkpointer::save_overlapped`](crate::Checkpointer::save_overlapped), except that when `max_in_flight` saves are
    /// still writing their parts it returns `Ok(None)` at once (and then reads
    /// nothing of `state` after returning).
    ///
    /// # Safety
    /// As for [`Checkpointer::save_overlapped`](crate::Checkpointer::save_overlapped) when it returns a handle.
    pub async unsafe fn try_save_overlapped(
        &self,
        step: u64,
        state: &crate::State<'_>,
    ) -> Result<Option<SaveHandle>> {
        self.start(step, state, true, false, None).await
    }

    /// Allocates the staging pool for saves of `state`'s size (its shape, not its
    /// values, matters) and faults every page in now, so that the first save of a
    /// job is not its slowest: `max_in_flight` buffers, each the size of this rank's
    /// data file (one more with [`CheckpointConfig::keep_copy`](crate::CheckpointConfig::keep_copy), for the copy of the
    /// committed checkpoint held while the next save stages). Returns how long that
    /// took. Later saves of a larger state grow the buffers
    /// again.
    pub fn warm_up(&self, state: &crate::State<'_>) -> Result<Duration> {
        let started = Instant::now();
        let total = self.plan(0, state)?.total;
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        // A kept copy holds its buffer: while a save stages, the copy of the newest
        // committed checkpoint is held (one more buffer). A third, for a save that
        // starts before the previous one is known to be committed, is mapped when
        // needed rather than faulted in here for every job.
        let wanted = self.config.max_in_flight + usize::from(self.config.keep_copy);
        while pool.len() < wanted {
            pool.push(StagingBuffer::counted_in(Some(self.budget.clone())));
        }
        #[cfg(feature = "cuda")]
        if let Some(first) = state.device.first() {
            // Device tensors stage into page-locked memory (zeroed, so faulted in).
            for buffer in pool.iter_mut() {
                buffer.reset_pinned(total, first.buffer.context())?;
            }
            return Ok(started.elapsed());
        }
        for buffer in pool.iter_mut() {
            if buffer.capacity() < total {
                // Within the budget: buffers that do not fit are left for the
                // saves to map (or stage in pieces).
                if buffer.reset(total).is_err() {
                    break;
                }
                buffer.prefault();
            }
        }
        pool.retain(|b| b.capacity() > 0);
        Ok(started.elapsed())
    }
}

/// Lets the budget unmap one idle staging buffer of the pool (the smallest).
#[derive(Debug)]
struct PoolTrimmer(std::sync::Weak<Pool>);

impl Dropper for PoolTrimmer {
    fn drop_oldest(&self, _before: u64) -> bool {
        let Some(pool) = self.0.upgrade() else {
            return false;
        };
        let mut pool = pool.lock().unwrap_or_else(|p| p.into_inner());
        let smallest = pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() > 0)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match smallest {
            Some(at) => {
                drop(pool.swap_remove(at));
                true
            }
            None => false,
        }
    }
}
