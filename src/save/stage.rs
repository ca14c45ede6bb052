//! Starting a save: take a slot (`max_in_flight`), lay the file out (`plan.rs`), copy
//! the state into a pooled buffer on the caller's thread or on the kept staging
//! thread, and hand the buffer to the background task (`job.rs`). Everything here
//! runs before `save` returns or before `SaveHandle::staged` says the tensors are
//! free, so it is the part of a save the training loop can feel.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;
use tracing::{Instrument, debug, info_span};

use super::job::run_job;
use super::plan::{Filled, StagePlan, check_staged, fill, hash_replicas};
use super::snapshot::SnapshotSender;
use super::{Checkpointer, Job, PendingCopies, Role, SaveHandle, Staging, Status};
use crate::attempt::Attempt;
use crate::error::{Error, Result};
use crate::rank_file::check_header;
use crate::staging::{Pooled, StagingBuffer};

impl Checkpointer {
    pub(super) async fn start(
        &self,
        step: u64,
        state: &crate::State<'_>,
        overlapped: bool,
        wait: bool,
        snapshot: Option<SnapshotSender>,
    ) -> Result<Option<SaveHandle>> {
        let closed = || {
            Error::Failed(format!(
                "save of step {step}: the checkpointer of rank {} was closed",
                self.config.rank
            ))
        };
        // Snapshots have a slot of their own: they never wait for a store upload.
        let slots = match snapshot {
            Some(_) => &self.snapshot_slots,
            None => &self.slots,
        };
        let permit = if wait {
            slots.clone().acquire_owned().await.map_err(|_| closed())?
        } else {
            match slots.clone().try_acquire_owned() {
                Ok(permit) => permit,
                Err(tokio::sync::TryAcquireError::Closed) => return Err(closed()),
                Err(tokio::sync::TryAcquireError::NoPermits) => {
                    debug!(step, "save skipped: a save is still running");
                    return Ok(None);
                }
            }
        };
        let started = Instant::now();
        // Everything that can fail comes before the copy starts: once an overlapped
        // copy runs, this call must not return an error (the caller would take it
        // that nothing reads its tensors any more).
        let run = match snapshot {
            Some(_) => super::snapshot::run_id_of_snapshots(&self.config.run_id),
            None => self.config.run_id.clone(),
        };
        let attempt = Attempt::new(step, self.config.generation, run)?;
        let mut plan = self.plan(step, state)?;
        check_header(&plan.header, self.config.rank as u32, plan.chunks.len())?;
        let chunks = std::mem::take(&mut plan.chunks);
        let scan_chunks = Arc::new(std::mem::take(&mut plan.scan));
        let shadow = std::mem::take(&mut plan.shadow);
        let file_len = plan.file_len;
        let health = self.part_health(state);
        #[cfg(not(feature = "cuda"))]
        let taken = self.take_buffer(step, plan.total);
        #[cfg(feature = "cuda")]
        let taken = match plan.device.is_empty() {
            true => self.take_buffer(step, plan.total),
            false => Ok(self
                .pool
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop()
                .unwrap_or_else(|| StagingBuffer::counted_in(Some(self.budget.clone())))),
        };
        let mut buffer = match taken {
            // Host tensors only (device ones never take a budgeted buffer here): a
            // save to the store that does not fit stages in pieces (`pieces.rs`).
            Err(over @ Error::OverBudget(_)) if snapshot.is_none() => {
                let unstaged = super::pieces::Unstaged {
                    step,
                    attempt,
                    plan,
                    chunks,
                    scan_chunks,
                    shadow,
                    health,
                    permit,
                    started,
                };
                return self.save_in_pieces(state, unstaged, over).await.map(Some);
            }
            taken => taken?,
        };
        #[cfg(not(feature = "cuda"))]
        let pending_copies: Option<PendingCopies> = None;
        #[cfg(feature = "cuda")]
        let (pending_copies, device_event) = match self.stage_device(&mut buffer, &plan, step) {
            Ok(copies) => copies,
            Err(e) => {
                self.pool
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(buffer);
                return Err(e);
            }
        };
        let (staging_tx, staging_rx) = watch::channel(Staging::Copying);
        let filled = if overlapped {
            let checksums = self.config.check_staging.then(|| {
                plan.sources
                    .iter()
                    // SAFETY: the caller's borrows of `state` are live during this call.
                    .map(|s| crc32fast::hash(unsafe { s.bytes() }))
                    .collect::<Vec<u32>>()
            });
            let (tx, rx) = tokio::sync::oneshot::channel();
            let threads = self.config.copy_threads;
            let block = self.config.block_size as usize;
            let spawned = self.stage_thread.run(Box::new(move || {
                let StagePlan {
                    header,
                    sources,
                    replica_sources,
                    names,
                    total,
                    ..
                } = plan;
                // SAFETY: `save_overlapped`'s contract keeps every source live and
                // unwritten until `staging_tx` reports the copy done, below.
                unsafe { fill(&mut buffer, &header, &sources, total, threads) };
                // SAFETY: as above.
                let replica_crcs = unsafe { hash_replicas(&replica_sources, block, threads) };
                let result = match checksums {
                    Some(expected) => {
                        check_staged(&buffer, header.len(), &sources, &names, &expected, step)
                    }
                    None => Ok(()),
                };
                let _ = staging_tx.send(match &result {
                    Ok(()) => Staging::Done(started.elapsed()),
                    Err(e) => Staging::Failed(Arc::new(e.duplicate())),
                });
                let _ = tx.send((buffer, result, replica_crcs));
            }));
            if let Err(e) = spawned {
                return Err(Error::Failed(format!(
                    "cannot start the staging thread: {e}"
                )));
            }
            Filled::Copying(rx)
        } else {
            // SAFETY: the caller's borrows of `state` are live during this call.
            unsafe { fill(&mut buffer, &plan.header, &plan.sources, plan.total, 1) };
            // SAFETY: as above. One thread, as the copy: a hash reads several times
            // faster than a copy writes, so a rank that holds only replicas still
            // returns before a writer, without taking the writers' cores.
            let replica_crcs =
                unsafe { hash_replicas(&plan.replica_sources, self.config.block_size as usize, 1) };
            let _ = staging_tx.send(Staging::Done(started.elapsed()));
            Filled::Ready(buffer, replica_crcs)
        };
        let stall = started.elapsed();
        debug!(
            step,
            rank = self.config.rank,
            overlapped,
            ?stall,
            "save registered"
        );

        let rank = self.config.rank as u32;
        let role = match self
            .config
            .committers()
            .iter()
            .position(|&r| r == self.config.rank)
        {
            Some(index) => Role::Committer {
                index: index as u32,
            },
            None => Role::Waiter,
        };
        let (tx, rx) = watch::channel(Status::Writing);
        let (copy_tx, copy_rx) = if self.config.keep_copy {
            let (tx, rx) = watch::channel(None);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let job = Job {
            store: self.store.clone(),
            config: self.config.clone(),
            attempt: attempt.clone(),
            role,
            buffer: Arc::new(Pooled::unpooled(StagingBuffer::new())),
            copy: copy_tx,
            chunks,
            scan_chunks,
            shadow,
            health,
            file_len,
            // Global state is identical on every rank: rank 0's copy is stored.
            global: (self.config.rank == 0
                && (!state.global.is_empty() || !state.metadata.is_empty()))
            .then(|| state.global.clone()),
            rank_state: state.rank.clone(),
            metadata: state.metadata.clone(),
            pending_copies,
            snapshot,
        };
        let pool = self.pool.clone();
        let span = match job.snapshot {
            Some(_) => info_span!("ckpt_snapshot", step, rank),
            None => info_span!("ckpt_save", step, rank),
        };
        let task = tokio::spawn(run_job(job, filled, pool, permit, tx).instrument(span));
        {
            let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
            tasks.retain(|t| !t.is_finished());
            tasks.push(task);
        }
        Ok(Some(SaveHandle {
            attempt,
            store: self.store.clone(),
            status: rx,
            staging: staging_rx,
            copy: copy_rx,
            role,
            world_size: self.config.world_size,
            commit_timeout: self.config.commit_timeout,
            stall,
            budget: self.budget.clone(),
            #[cfg(feature = "cuda")]
            device: device_event,
        }))
    }

    /// What the part will say of health before the scan: the replica policy, the
    /// caller's metrics, and its findings (its own marks, a failed
    /// [`health_check`](crate::CheckpointConfig::health_check)).
    fn part_health(&self, state: &crate::State<'_>) -> crate::format::PartHealth {
        let mut unhealthy = state.unhealthy.clone();
        if let Some(check) = &self.config.health_check
            && let Err(reason) = (check.0)(&state.metrics)
        {
            unhealthy.push(reason);
        }
        crate::format::PartHealth {
            replica_mismatch: self.config.replica_mismatch,
            nonfinite: Vec::new(),
            replicas: Vec::new(),
            metrics: state
                .metrics
                .iter()
                .map(|(k, v)| (k.clone(), crate::format::Metric(*v)))
                .collect(),
            unhealthy,
        }
    }

    /// Makes room in `buffer` for the planned file (page-locked when the state has
    /// device tensors) and enqueues the device tensors' copies into it. Returns the
    /// wait the background task makes before reading the buffer, and the release
    /// event for the caller.
    #[cfg(feature = "cuda")]
    #[allow(clippy::type_complexity)]
    pub(super) fn stage_device(
        &self,
        buffer: &mut StagingBuffer,
        plan: &StagePlan,
        step: u64,
    ) -> Result<(
        Option<PendingCopies>,
        Option<Arc<cudarc::driver::CudaEvent>>,
    )> {
        let Some((first, _)) = plan.device.first() else {
            return Ok((None, None));
        };
        // Page-locked memory counts in the budget like a mapping: what does not fit
        // lets idle buffers and older copies go first.
        loop {
            match buffer.reset_pinned(plan.total, first.context()) {
                Ok(()) => break,
                Err(Error::OverBudget(_)) if self.budget.drop_one(step) => {}
                Err(e) => return Err(e),
            }
        }
        let dst = buffer.as_mut_ptr();
        let mut side = self.side.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the buffer is page-locked, holds `plan.total` bytes, and is not
        // read (checksummed, uploaded) nor given back to the pool before the
        // background task's wait on the returned event (`pending_copies`); the host
        // copies write other bytes of it (header and host tensors). The device
        // buffers obey `DeviceBuffer::from_raw`'s contract, which `add_device` relays.
        let copies = unsafe { side.enqueue(dst, plan.total, &plan.device)? };
        let event = copies.released.clone();
        let wait: PendingCopies = Box::new(move || {
            copies
                .released
                .synchronize()
                .map_err(|e| Error::Device(format!("device-to-host staging copy failed: {e}")))
        });
        Ok((Some(wait), Some(event)))
    }
}
