//! The save path: stage, checksum, (compress,) upload, describe, commit.
//!
//! [`Checkpointer::save`] is the only part the training loop waits for: it copies
//! the rank's boxes into a staging buffer laid out as the final safetensors file
//! (header first, then each box), and hands the buffer to a background task. The task
//! computes block checksums, optionally compresses, uploads the data file and writes
//! the rank's manifest part, all inside the save attempt's own directory (format v2,
//! see [`crate::attempt`]).
//!
//! The commit is live: a few ranks (rank 0, the last rank and the middle one) are
//! *committers*. Each watches the attempt's directory until every part is there; the
//! first commits at once, the others after a takeover delay if the slot is still
//! empty, so the death of any one rank after its part is durable does not stop the
//! commit. Every other rank learns the outcome by reading the attempt's slot
//! (committed, failed and why, or superseded), with a backoff whose requests do not
//! grow with the world size. A rank that cannot write its data file or its part
//! (after the store's retries; a reset create-if-absent is retried too) records the
//! failure in the slot itself, naming the rank: the others learn it at their next
//! look, not at the commit timeout.
//!
//! Memory is bounded by the staging pool: at most `max_in_flight` buffers, each the
//! size of the rank's file, reused from save to save (capacity is kept, so after the
//! first save no allocation or page fault happens on the hot path). With
//! [`CheckpointConfig::keep_copy`] a save's buffer is also lent out as the rank's
//! in-memory copy of the save ([`SaveHandle::copy`], `crate::copies`), and comes back
//! to the pool when the last holder of that copy lets it go: the pool then holds one
//! more buffer per copy kept.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ckpt_storage::Store;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tracing::{Instrument, debug, info_span, warn};

use crate::attempt::{Attempt, data_file_name};
use crate::codec::{block_crcs, compress_block};
use crate::commit::{Outcome, Retry};
use crate::copies::{CopyKey, RankCopy};
use crate::error::{Error, Result};
use crate::format::{
    Chunk, Codec, FileEntry, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, RankPart, rank_part_name,
    repeats_a_tensor, version_for,
};
use crate::staging::{Pool, Pooled, Source, StagingBuffer, copy_sources};
use crate::writer::{PlannedBox, check_header, rank_file_header};

/// Settings of a rank's checkpointer.
#[derive(Debug, Clone)]
pub struct CheckpointConfig {
    /// This rank.
    pub rank: usize,
    /// Ranks that save each checkpoint; the commit waits for all of them.
    pub world_size: usize,
    /// Generation of the elastic world. Part of every object name of a save
    /// (fencing): once a generation has committed, saves of older generations are
    /// refused. A run that resumes should use a generation above the checkpoint it
    /// resumed from.
    pub generation: u64,
    /// Run id shared by every rank of this world and different for every run and
    /// restart (e.g. a launcher's random job id). Part of every object name of a save.
    /// Default: the `CKPT_RUN_ID` environment variable; otherwise a random id when the
    /// world has one rank, and `0` when it has more (two runs with the same id and
    /// generation cannot both save a step: the second gets [`Error::Fenced`]).
    pub run_id: String,
    /// Raw bytes per checksum block and compression frame. Default 256 KiB: reads
    /// at most one partial block at each end of a range.
    pub block_size: u64,
    /// Encoding of data files. Default [`Codec::None`].
    pub codec: Codec,
    /// Saves whose upload may run at once. Default 1. A further
    /// [`Checkpointer::save`] waits until the oldest has written its part;
    /// [`Checkpointer::try_save`] returns `None` instead.
    pub max_in_flight: usize,
    /// Keep this many newest committed checkpoints (older ones and stale partial
    /// ones are deleted by the committing rank). Default `None`: keep all.
    pub keep_last: Option<usize>,
    /// How long [`SaveHandle::committed`] waits for the other ranks' parts. Default
    /// 10 min. Once every part is durable the outcome arrives within about
    /// `commit_takeover` × 2 (× world size ÷ 1,024 beyond 1,024 ranks), whatever
    /// this is.
    pub commit_timeout: Duration,
    /// How long a backup committer waits, after seeing every part, for the committer
    /// before it commits itself. Default 2 s; the second backup waits twice as long,
    /// and beyond 1,024 ranks both wait world size ÷ 1,024 times as long (the
    /// committer may be reading many parts still, and a backup that takes over from a
    /// live committer doubles the load on the store).
    pub commit_takeover: Duration,
    /// With `keep_last`: how long a superseded checkpoint stays readable (readers
    /// that opened it have this long to finish). Default 10 min, as `ckpt gc --grace`.
    pub retention_grace: Duration,
    /// Local disk, uncompressed: write data files with `O_DIRECT` straight from the
    /// page-aligned staging buffer (file systems that refuse it get buffered writes).
    /// Default true; false writes through the page cache like other objects.
    pub direct_io: bool,
    /// Threads that copy an overlapped save into its staging buffer
    /// ([`Checkpointer::save_overlapped`]). Default: the cores divided among the
    /// node's ranks (`LOCAL_WORLD_SIZE`), 1 to 4.
    pub copy_threads: usize,
    /// Overlapped saves check that no tensor changed between `save_overlapped` and the
    /// end of its copy: a CRC32 of each tensor is taken when the save is registered
    /// (a read of the state, on the caller's thread) and compared with the staged
    /// bytes. A mismatch fails the save with [`Error::Mutated`], naming the tensor.
    /// Default: on in debug builds, off in release builds.
    pub check_staging: bool,
    /// Keep each save's staged data file (header and boxes, raw, as the block CRC32s
    /// cover it) as this rank's in-memory copy of the save: [`SaveHandle::copy`] hands
    /// out a shared reference to the staging buffer itself, no byte copied, and the
    /// buffer returns to the pool only when the save's upload and every holder of the
    /// copy are done with it. So each copy kept costs one staging buffer (the size of
    /// this rank's data file) for as long as it is kept, and a save while copies are
    /// held takes a fresh buffer (page faults in its copy) unless
    /// [`Checkpointer::warm_up`] prepared it. `crate::copies` keeps, replicates and
    /// recovers from these copies. Default false.
    pub keep_copy: bool,
}

impl CheckpointConfig {
    /// Defaults for `rank` of `world_size`.
    pub fn new(rank: usize, world_size: usize) -> Self {
        Self {
            rank,
            world_size,
            generation: 0,
            block_size: 256 << 10,
            codec: Codec::None,
            max_in_flight: 1,
            keep_last: None,
            commit_timeout: Duration::from_secs(600),
            commit_takeover: Duration::from_secs(2),
            retention_grace: crate::retention::DEFAULT_GRACE,
            direct_io: true,
            copy_threads: (encode_threads()).clamp(1, 4),
            check_staging: cfg!(debug_assertions),
            keep_copy: false,
            run_id: std::env::var("CKPT_RUN_ID").unwrap_or_else(|_| {
                if world_size == 1 {
                    crate::attempt::random_run_id()
                } else {
                    "0".to_string()
                }
            }),
        }
    }

    /// The ranks that commit: rank 0, then the last rank, then the middle one (spread
    /// out, so that losing one node rarely loses them all).
    pub fn committers(&self) -> Vec<usize> {
        let world = self.world_size;
        let mut out: Vec<usize> = Vec::with_capacity(3);
        for rank in [0, world.saturating_sub(1), world / 2] {
            if rank < world && !out.contains(&rank) {
                out.push(rank);
            }
        }
        out
    }

    /// Checks the settings; the error names the field and its value.
    pub fn validate(&self) -> Result<()> {
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(Error::invalid(format!(
                "rank {} is not in world_size {}",
                self.rank, self.world_size
            )));
        }
        if !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&self.block_size) {
            return Err(Error::invalid(format!(
                "block_size {} is outside {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}",
                self.block_size
            )));
        }
        crate::attempt::check_run_id(&self.run_id)?;
        if self.max_in_flight == 0 {
            return Err(Error::invalid("max_in_flight must be at least 1, got 0"));
        }
        if self.copy_threads == 0 {
            return Err(Error::invalid("copy_threads must be at least 1, got 0"));
        }
        if self.keep_last == Some(0) {
            return Err(Error::invalid(
                "keep_last must be at least 1 (the newest commit is never deleted), got 0",
            ));
        }
        if let Codec::Zstd { level, shuffle } = self.codec
            && (!(-7..=22).contains(&level) || shuffle > 16)
        {
            return Err(Error::invalid(format!(
                "zstd level {level} must be in -7..=22 and shuffle {shuffle} in 0..=16"
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Status {
    Writing,
    Durable,
    Committed,
    Failed(Arc<Error>),
}

/// How this rank takes part in the commit.
#[derive(Debug, Clone, Copy)]
enum Role {
    /// Commits (index 0) or takes over after `index` × the takeover delay.
    Committer { index: u32 },
    /// Learns the outcome from the slot.
    Waiter,
}

/// Follows one rank's save in the background.
///
/// # Cancel safety
///
/// Dropping the handle does not cancel the save: the background task finishes the
/// upload and, on a committer, the commit. A crash of the process at any point leaves
/// the previous committed checkpoint intact; the attempt's directory then lacks its
/// manifest (or some rank files) and does not exist for readers until retention
/// collects it, unless another committer completes the commit.
#[derive(Debug)]
pub struct SaveHandle {
    attempt: Attempt,
    store: Store,
    status: watch::Receiver<Status>,
    staging: watch::Receiver<Staging>,
    /// The staged file as an in-memory copy, once staged (with `keep_copy`).
    copy: Option<watch::Receiver<Option<RankCopy>>>,
    role: Role,
    world_size: usize,
    commit_timeout: Duration,
    stall: Duration,
    /// Recorded after the device-to-host copies of the save's device tensors.
    #[cfg(feature = "cuda")]
    device: Option<Arc<cudarc::driver::CudaEvent>>,
}

/// Where the copy of the caller's tensors into the staging buffer stands.
#[derive(Debug, Clone)]
enum Staging {
    /// Copying on background threads (an overlapped save).
    Copying,
    /// The copy is complete, this long after `save` was called: the caller's tensors
    /// are free again.
    Done(Duration),
    /// The copy ended, but a tensor changed before it was copied (or the copy
    /// failed): the save is abandoned.
    Failed(Arc<Error>),
}

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

    /// Waits until the caller's tensors have been copied into the staging buffer:
    /// from then on the caller may change or free them. For a blocking
    /// [`Checkpointer::save`] this is ready at once.
    ///
    /// Errors: [`Error::Mutated`] when a tensor was changed before the copy read it
    /// (with [`CheckpointConfig::check_staging`]); the save is then abandoned on this
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

    /// [`SaveHandle::staged`] for synchronous code: blocks the calling thread (the
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
    /// (with [`CheckpointConfig::keep_copy`]; no byte is copied): `None` until the
    /// staging copy (and with device tensors, their device-to-host copies) has ended,
    /// when staging failed, and without `keep_copy`. While this handle or any clone of
    /// the copy lives, its staging buffer does not go back to the pool.
    pub fn copy(&self) -> Option<RankCopy> {
        self.copy.as_ref().and_then(|copy| copy.borrow().clone())
    }

    /// Waits for [`SaveHandle::copy`]. Errors: [`Error::Invalid`] without
    /// [`CheckpointConfig::keep_copy`]; the staging error when staging failed.
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
                    "step {}: the save ended before its staged file could be kept",
                    self.attempt.step
                )));
            }
        }
    }

    /// The channel [`SaveHandle::copy`] reads, for a holder of copies that takes the
    /// copy once it is there (`crate::copies::Copies::keep`).
    pub(crate) fn copy_channel(&self) -> Option<watch::Receiver<Option<RankCopy>>> {
        self.copy.clone()
    }

    /// The event recorded after the device-to-host copies of the save's device
    /// tensors (feature `cuda`; `None` when the state had none). Until it has
    /// completed, the device tensors must not be written: a trainer makes its
    /// optimizer step's stream wait for it (`stream.wait(event)`, no host stall).
    /// [`SaveHandle::staged`] covers the host tensors only.
    #[cfg(feature = "cuda")]
    pub fn device_released(&self) -> Option<&cudarc::driver::CudaEvent> {
        self.device.as_deref()
    }

    /// Blocks the calling thread until [`SaveHandle::device_released`] has
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
fn jitter(delay: Duration) -> Duration {
    let r = crate::attempt::nonce();
    let x = u64::from_str_radix(&r[..4], 16).unwrap_or(0) as f64 / 65535.0;
    delay.mul_f64(0.75 + 0.5 * x)
}

/// An outcome as the result `committed()` reports.
fn outcome_result(attempt: &Attempt, outcome: Outcome) -> Result<()> {
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

/// A rank's checkpoint writer. Cheap to clone? No: one per rank; share it by
/// reference.
#[derive(Debug)]
pub struct Checkpointer {
    store: Store,
    config: Arc<CheckpointConfig>,
    pool: Arc<Pool>,
    slots: Arc<Semaphore>,
    /// The background task of every save not known to have ended, for
    /// [`Checkpointer::close`].
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// The thread that makes overlapped saves' copies (see [`StageThread`]).
    stage_thread: StageThread,
    /// Side streams for the device-to-host copies of device tensors.
    #[cfg(feature = "cuda")]
    side: Mutex<crate::cuda::device::SideStreams>,
}

/// How much less of a contended core the staging thread and its copy workers take
/// than the training threads: Linux's nice value, +5 (about a third of their
/// weight).
#[cfg(target_os = "linux")]
const STAGING_NICE: libc::c_int = 5;

/// Lets the training loop keep the cores the staging copies would take from it: the
/// calling thread (the staging thread, and the copy workers it starts, which
/// inherit this) runs under `SCHED_BATCH` (a thread woken does not preempt the one
/// running) at [`STAGING_NICE`]. The copy of an overlapped save is background work,
/// but it used to take the core from the thread that had just registered a save,
/// or from another rank still registering its own: on W1 in Python (four rank
/// processes on two cores, each rank's copy starting as its save registers) the
/// slowest rank's stall was 8-9 ms, of which the library's own registration took
/// 4-7 ms of preemption, against 0.2 ms alone. With both, 1.4 ms, and its
/// registration 0.2 ms; the copy finishes about as soon where the cores are free
/// (the training thread waits for it before the optimizer step), and later where
/// other work keeps them busy. Device tensors are copied by the device, not these
/// threads. Best effort: elsewhere, or refused, nothing changes.
fn yield_to_training() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } != 0 {
            debug!(
                error = %std::io::Error::last_os_error(),
                "the staging thread keeps the default scheduling policy"
            );
        }
        // SAFETY: who 0 is the calling thread (Linux keeps nice values per thread).
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, STAGING_NICE) } != 0 {
            debug!(
                error = %std::io::Error::last_os_error(),
                "the staging thread keeps the default priority"
            );
        }
    }
}

/// One overlapped save's copy, run on the staging thread.
type StageWork = Box<dyn FnOnce() + Send>;

/// The thread that runs a checkpointer's overlapped copies, one after another,
/// started at its first overlapped save and kept. Starting a thread per save cost
/// the caller up to 25 ms of its stall where the process's other threads were busy
/// (W1 in Python: four rank processes on two cores, each copying its save): the
/// stack's mapping waits for the process's memory map. Handing work to a waiting
/// thread costs a wake-up. Overlapped copies of one checkpointer run one at a time
/// anyway: a caller waits for a save's copy before changing its tensors for the
/// next. The thread ends when the checkpointer is dropped (its queue closes); one
/// whose work panicked is replaced at the next save.
#[derive(Debug, Default)]
struct StageThread(Mutex<Option<std::sync::mpsc::Sender<StageWork>>>);

impl StageThread {
    fn run(&self, work: StageWork) -> std::io::Result<()> {
        let mut queue = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let work = match queue.as_ref() {
            Some(sender) => match sender.send(work) {
                Ok(()) => return Ok(()),
                Err(std::sync::mpsc::SendError(work)) => work,
            },
            None => work,
        };
        let (sender, receiver) = std::sync::mpsc::channel::<StageWork>();
        std::thread::Builder::new()
            .name("ckpt-stage".into())
            .spawn(move || {
                yield_to_training();
                for work in receiver {
                    work();
                }
            })?;
        sender
            .send(work)
            .expect("the staging thread just started holds its queue");
        *queue = Some(sender);
        Ok(())
    }
}

/// The staging buffer, shared with the upload as zero-copy `Bytes`.
struct Staged(Arc<Pooled>);

impl AsRef<[u8]> for Staged {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

struct Job {
    store: Store,
    config: Arc<CheckpointConfig>,
    attempt: Attempt,
    role: Role,
    buffer: Arc<Pooled>,
    /// Where the staged file is published as an in-memory copy (with `keep_copy`).
    copy: Option<watch::Sender<Option<RankCopy>>>,
    chunks: Vec<Chunk>,
    global: Option<BTreeMap<String, crate::format::StateValue>>,
    rank_state: BTreeMap<String, crate::format::StateValue>,
    metadata: BTreeMap<String, serde_json::Value>,
    /// Waits for copies into the staging buffer that the host does not make (the
    /// device-to-host copies of device tensors); `None` when there are none.
    pending_copies: Option<PendingCopies>,
}

/// A blocking wait for copies into the staging buffer made by a device.
type PendingCopies = Box<dyn FnOnce() -> Result<()> + Send + Sync>;

impl Checkpointer {
    /// A checkpointer for one rank, writing under `store`'s root.
    pub fn new(store: Store, config: CheckpointConfig) -> Result<Self> {
        config.validate()?;
        let slots = Arc::new(Semaphore::new(config.max_in_flight));
        Ok(Self {
            store,
            config: Arc::new(config),
            pool: Arc::new(Mutex::new(Vec::new())),
            slots,
            tasks: Mutex::new(Vec::new()),
            stage_thread: StageThread::default(),
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

    /// Saves this rank's `state` as part of checkpoint `step`, copying it before
    /// returning (a *blocking* save).
    ///
    /// Blocks while the state is copied into a staging buffer (and while
    /// `max_in_flight` earlier saves are still writing their parts: see
    /// [`Checkpointer::try_save`] for a save that never waits).
    /// The returned handle tells when this rank's part is durable and when the whole
    /// checkpoint is committed. Must be called within a tokio runtime.
    ///
    /// [`Checkpointer::save_overlapped`] returns before the copy instead, so that it
    /// runs while the caller computes.
    pub async fn save(&self, step: u64, state: &crate::State<'_>) -> Result<SaveHandle> {
        let handle = self.start(step, state, false, true).await?;
        Ok(handle.expect("a save that may wait always starts"))
    }

    /// [`Checkpointer::save`], except that when `max_in_flight` saves are still
    /// writing their parts it returns `Ok(None)` at once and stages nothing: training
    /// never waits for storage, and this step is not checkpointed.
    pub async fn try_save(
        &self,
        step: u64,
        state: &crate::State<'_>,
    ) -> Result<Option<SaveHandle>> {
        self.start(step, state, false, false).await
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
    /// threads ([`CheckpointConfig::copy_threads`]) while the caller goes on (the next
    /// forward and backward passes only read the parameters). The handle's
    /// [`SaveHandle::staged`] (or [`SaveHandle::wait_staged`]) says when the copy is
    /// complete; a trainer waits for it right before its optimizer step overwrites
    /// the saved parameters and moments.
    ///
    /// Changing a saved tensor before `staged()` returns is a bug: the checkpoint
    /// would hold a mix of two steps. With [`CheckpointConfig::check_staging`] (on in
    /// debug builds) such a change is detected and the save fails with
    /// [`Error::Mutated`] naming the tensor; without it, it goes unnoticed.
    ///
    /// # Safety
    /// Every tensor's memory in `state` must stay allocated, and must not be written,
    /// until [`SaveHandle::staged`] (or [`SaveHandle::wait_staged`]) has returned or
    /// the handle has been dropped (dropping it waits for the copy). The borrow
    /// checker cannot see this: `state`'s borrows end when this call returns, while
    /// the copy reads the memory after that.
    pub async unsafe fn save_overlapped(
        &self,
        step: u64,
        state: &crate::State<'_>,
    ) -> Result<SaveHandle> {
        let handle = self.start(step, state, true, true).await?;
        Ok(handle.expect("a save that may wait always starts"))
    }

    /// [`Checkpointer::save_overlapped`], except that when `max_in_flight` saves are
    /// still writing their parts it returns `Ok(None)` at once (and then reads
    /// nothing of `state` after returning).
    ///
    /// # Safety
    /// As for [`Checkpointer::save_overlapped`] when it returns a handle.
    pub async unsafe fn try_save_overlapped(
        &self,
        step: u64,
        state: &crate::State<'_>,
    ) -> Result<Option<SaveHandle>> {
        self.start(step, state, true, false).await
    }

    /// Allocates the staging pool for saves of `state`'s size (its shape, not its
    /// values, matters) and faults every page in now, so that the first save of a
    /// job is not its slowest: `max_in_flight` buffers, each the size of this rank's
    /// data file (one more with [`CheckpointConfig::keep_copy`], for the copy of the
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
            pool.push(StagingBuffer::new());
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
                buffer.reset(total);
                buffer.prefault();
            }
        }
        Ok(started.elapsed())
    }

    async fn start(
        &self,
        step: u64,
        state: &crate::State<'_>,
        overlapped: bool,
        wait: bool,
    ) -> Result<Option<SaveHandle>> {
        let closed = || {
            Error::Failed(format!(
                "save of step {step}: the checkpointer of rank {} was closed",
                self.config.rank
            ))
        };
        let permit = if wait {
            self.slots
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| closed())?
        } else {
            match self.slots.clone().try_acquire_owned() {
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
        let attempt = Attempt::new(step, self.config.generation, self.config.run_id.clone())?;
        let mut plan = self.plan(step, state)?;
        check_header(&plan.header, self.config.rank as u32, plan.chunks.len())?;
        let chunks = std::mem::take(&mut plan.chunks);
        let mut buffer = self
            .pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_else(StagingBuffer::new);
        #[cfg(not(feature = "cuda"))]
        let pending_copies: Option<PendingCopies> = None;
        #[cfg(not(feature = "cuda"))]
        buffer.reset(plan.total);
        #[cfg(feature = "cuda")]
        let (pending_copies, device_event) = match self.stage_device(&mut buffer, &plan) {
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
            let spawned = self.stage_thread.run(Box::new(move || {
                let StagePlan {
                    header,
                    sources,
                    names,
                    total,
                    ..
                } = plan;
                // SAFETY: `save_overlapped`'s contract keeps every source live and
                // unwritten until `staging_tx` reports the copy done, below.
                unsafe { fill(&mut buffer, &header, &sources, total, threads) };
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
                let _ = tx.send((buffer, result));
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
            let _ = staging_tx.send(Staging::Done(started.elapsed()));
            Filled::Ready(buffer)
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
            // Global state is identical on every rank: rank 0's copy is stored.
            global: (self.config.rank == 0
                && (!state.global.is_empty() || !state.metadata.is_empty()))
            .then(|| state.global.clone()),
            rank_state: state.rank.clone(),
            metadata: state.metadata.clone(),
            pending_copies,
        };
        let pool = self.pool.clone();
        let span = info_span!("ckpt_save", step, rank);
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
            #[cfg(feature = "cuda")]
            device: device_event,
        }))
    }

    /// Makes room in `buffer` for the planned file (page-locked when the state has
    /// device tensors) and enqueues the device tensors' copies into it. Returns the
    /// wait the background task makes before reading the buffer, and the release
    /// event for the caller.
    #[cfg(feature = "cuda")]
    #[allow(clippy::type_complexity)]
    fn stage_device(
        &self,
        buffer: &mut StagingBuffer,
        plan: &StagePlan,
    ) -> Result<(
        Option<PendingCopies>,
        Option<Arc<cudarc::driver::CudaEvent>>,
    )> {
        let Some((first, _)) = plan.device.first() else {
            buffer.reset(plan.total);
            return Ok((None, None));
        };
        buffer.reset_pinned(plan.total, first.context())?;
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

    /// Lays the rank's data file out: its header, and the tensors that follow it.
    /// Fails when two of its safetensors entries would get one name.
    fn plan(&self, step: u64, state: &crate::State<'_>) -> Result<StagePlan> {
        let written: Vec<_> = state.tensors.iter().filter(|t| t.write).collect();
        #[allow(unused_mut)]
        let mut planned: Vec<PlannedBox> = written
            .iter()
            .map(|t| PlannedBox {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                region: t.region.clone(),
            })
            .collect();
        // Device tensors follow the host tensors in the file.
        #[cfg(feature = "cuda")]
        let device_written: Vec<_> = state.device.iter().filter(|t| t.write).collect();
        #[cfg(feature = "cuda")]
        planned.extend(device_written.iter().map(|t| PlannedBox {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            region: t.region.clone(),
        }));
        let header = rank_file_header(
            step,
            self.config.rank as u32,
            self.config.world_size as u32,
            &planned,
        )?;
        #[cfg_attr(feature = "cuda", allow(unused_variables))]
        let total = header.len() + written.iter().map(|t| t.data.len()).sum::<usize>();
        let mut at = header.len() as u64;
        #[allow(unused_mut)]
        let mut chunks: Vec<Chunk> = written
            .iter()
            .map(|t| {
                let begin = at;
                at += t.data.len() as u64;
                Chunk {
                    tensor: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    offsets: t.region.offsets.clone(),
                    lengths: t.region.lengths.clone(),
                    bytes: [begin, at],
                }
            })
            .collect();
        #[cfg(feature = "cuda")]
        let (total, device) = {
            let mut device = Vec::new();
            for t in device_written {
                let begin = at;
                at += t.buffer.len() as u64;
                chunks.push(Chunk {
                    tensor: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    offsets: t.region.offsets.clone(),
                    lengths: t.region.lengths.clone(),
                    bytes: [begin, at],
                });
                device.push((t.buffer.clone(), begin as usize));
            }
            (at as usize, device)
        };
        Ok(StagePlan {
            total,
            chunks,
            sources: written.iter().map(|t| Source::new(t.data)).collect(),
            names: written.iter().map(|t| t.name.clone()).collect(),
            header,
            #[cfg(feature = "cuda")]
            device,
        })
    }
}

/// A rank's data file, laid out.
struct StagePlan {
    /// The safetensors header.
    header: Vec<u8>,
    /// The written tensors' bytes, in file order.
    sources: Vec<Source>,
    /// Their names.
    names: Vec<String>,
    /// Header plus data.
    total: usize,
    /// The manifest's records of the written tensors (file offsets).
    chunks: Vec<Chunk>,
    /// The written device tensors and their offsets in the file, after the host ones.
    #[cfg(feature = "cuda")]
    device: Vec<(crate::cuda::DeviceBuffer, usize)>,
}

/// The staging buffer, filled or being filled.
enum Filled {
    /// A blocking save's, filled.
    Ready(StagingBuffer),
    /// An overlapped save's: the staging thread hands it over when the copy ends.
    Copying(tokio::sync::oneshot::Receiver<(StagingBuffer, Result<()>)>),
}

/// Writes `header` then `sources` into `buffer` (`total` bytes in all), copying on
/// `threads` threads. The `during-staging` failpoint sits after the first tensor.
///
/// # Safety
/// Every source must stay allocated and unwritten until this returns.
unsafe fn fill(
    buffer: &mut StagingBuffer,
    header: &[u8],
    sources: &[Source],
    total: usize,
    threads: usize,
) {
    let out = buffer.fill(total);
    let (head, mut data) = out.split_at_mut(header.len());
    head.copy_from_slice(header);
    // The first tensor, then the failpoint (with two tensors or more), then the rest.
    let split = sources.len().min(1);
    for (i, group) in [&sources[..split], &sources[split..]]
        .into_iter()
        .enumerate()
    {
        if i == 1 && !group.is_empty() {
            crate::failpoint::hit("during-staging");
        }
        let n: usize = group.iter().map(Source::len).sum();
        let (now, rest) = data.split_at_mut(n);
        // SAFETY: forwarded from the caller.
        unsafe { copy_sources(now, group, threads) };
        data = rest;
    }
}

/// Compares each staged tensor's CRC32 with the one taken when the save was
/// registered: a difference means the caller changed the tensor before the copy read
/// it, so the staged file mixes two states. The error names the first such tensor.
fn check_staged(
    buffer: &StagingBuffer,
    header_len: usize,
    sources: &[Source],
    names: &[String],
    expected: &[u32],
    step: u64,
) -> Result<()> {
    let mut at = header_len;
    for ((source, name), &before) in sources.iter().zip(names).zip(expected) {
        let staged = crc32fast::hash(&buffer[at..at + source.len()]);
        at += source.len();
        if staged != before {
            let e = Error::Mutated(format!(
                "tensor {name:?} changed while step {step} was being staged (crc32 \
                 {before:08x} when save_overlapped was called, {staged:08x} copied): it \
                 was written before SaveHandle::staged() returned; this save is abandoned"
            ));
            tracing::error!(step, tensor = %name, "{e}");
            return Err(e);
        }
    }
    Ok(())
}

async fn run_job(
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
    let buffer = match filled {
        Filled::Ready(buffer) => buffer,
        Filled::Copying(copy) => {
            let failed = match copy.await {
                Ok((buffer, Ok(()))) => Ok(buffer),
                Ok((buffer, Err(e))) => {
                    pool.lock().unwrap_or_else(|p| p.into_inner()).push(buffer);
                    Err(e)
                }
                Err(_) => Err(Error::Failed(format!(
                    "the staging copy of step {step} ended without reporting (its thread died)"
                ))),
            };
            match failed {
                Ok(buffer) => buffer,
                Err(e) => {
                    drop(permit);
                    warn!(step, error = %e, "checkpoint save failed while staging");
                    give_up(&job.store, &job.config, &job.attempt, e, &status).await;
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
        give_up(&job.store, &job.config, &job.attempt, e, &status).await;
        return;
    }
    job.buffer = Arc::new(Pooled::new(buffer, &pool));
    if let Some(copy) = job.copy.take() {
        let key = CopyKey {
            dir: job.attempt.dir(),
            world: job.config.world_size as u32,
            rank: job.config.rank as u32,
        };
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
    let result = match (written, role) {
        (Ok(()), Role::Committer { index }) => {
            let _ = status.send(Status::Durable);
            crate::failpoint::hit("after-rank-part");
            commit_as(&store, &config, &attempt, index).await
        }
        (Ok(()), Role::Waiter) => {
            let _ = status.send(Status::Durable);
            crate::failpoint::hit("after-rank-part");
            return;
        }
        (Err(e), _) => {
            warn!(step, error = %e, "checkpoint save failed");
            give_up(&store, &config, &attempt, e, &status).await;
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

async fn write_rank(job: &Job) -> Result<()> {
    let config = &job.config;
    let rank = config.rank as u32;
    let dir = job.attempt.dir();
    let block = config.block_size as usize;
    let compressed = matches!(config.codec, Codec::Zstd { .. });
    let file_name = data_file_name(rank, compressed, &crate::attempt::nonce());
    let file_key = format!("{dir}/{file_name}");
    crate::failpoint::hit("before-data-upload");

    // Checksums (and frames) on background threads: CPU work off the async workers.
    // A plain file does not depend on its checksums, so it is written meanwhile.
    let started = Instant::now();
    let (crcs, frames, stored_bytes) = match config.codec {
        Codec::None => {
            let (crcs, stored) = tokio::try_join!(
                async {
                    encode(job.buffer.clone(), block, config.codec)
                        .await
                        .map(|(crcs, _)| crcs)
                },
                write_plain(job, &file_key),
            )?;
            (crcs, None, stored)
        }
        Codec::Zstd { .. } => {
            let (crcs, frames) = encode(job.buffer.clone(), block, config.codec).await?;
            let frames = frames.unwrap_or_default();
            upload(&job.store, &file_key, &frames).await?;
            let stored = frames.iter().map(|f| f.len() as u64).sum();
            (crcs, Some(frames), stored)
        }
    };
    let encoded = started.elapsed();
    debug!(bytes = stored_bytes, elapsed = ?encoded, "data file written");
    crate::failpoint::hit("after-data-upload");

    let part = RankPart {
        // The lowest version that describes the part: 3 only when this rank holds
        // several boxes of one tensor (the data file's header says the same).
        format_version: version_for(repeats_a_tensor(
            job.chunks.iter().map(|c| c.tensor.as_str()),
        )),
        step: job.attempt.step,
        attempt: Some(job.attempt.name()),
        rank,
        world_size: config.world_size as u32,
        generation: config.generation,
        block_size: config.block_size,
        codec: config.codec,
        file: FileEntry {
            name: file_name,
            raw_bytes: job.buffer.len() as u64,
            stored_bytes,
            block_crc32: crcs,
            frame_bytes: frames
                .as_ref()
                .map(|f| f.iter().map(|b| b.len() as u64).collect())
                .unwrap_or_default(),
        },
        chunks: job.chunks.clone(),
        global_state: job.global.clone(),
        rank_state: job.rank_state.clone(),
        metadata: if job.global.is_some() {
            job.metadata.clone()
        } else {
            BTreeMap::new()
        },
    };
    put_part(
        &job.store,
        &format!("{dir}/{}", rank_part_name(rank)),
        part.to_bytes(),
    )
    .await
}

/// Writes a rank's part create-if-absent: a part is never replaced. Finding the same
/// bytes there is success (a retried write whose first try landed); finding other
/// bytes means the attempt's name was used by another save (a reused run id).
/// A transient failure (a connection reset mid-body) is tried again within the
/// store's retry budget: the comparison makes the create safe to repeat.
pub(crate) async fn put_part(store: &Store, key: &str, bytes: Vec<u8>) -> Result<()> {
    let bytes = Bytes::from(bytes);
    crate::commit::retry(store, "writing a rank part", Retry::Transient, || {
        let bytes = bytes.clone();
        async move {
            match store.put_if_absent(key, bytes.clone()).await {
                Ok(()) => Ok(()),
                Err(e) if e.is_already_exists() => {
                    if store.get(key).await? == bytes {
                        Ok(())
                    } else {
                        Err(Error::Fenced(format!(
                            "{} already holds another save's part: this attempt's name is taken \
                             (give every run its own run id, or a new generation)",
                            store.url().trim_end_matches('/').to_string() + "/" + key
                        )))
                    }
                }
                Err(e) => Err(e.into()),
            }
        }
    })
    .await
}

/// Writes the staging buffer as the rank's plain data file: on local disk with
/// direct I/O straight from the aligned buffer, elsewhere as a streaming upload.
/// Returns the bytes stored.
async fn write_plain(job: &Job, file_key: &str) -> Result<u64> {
    let local = if job.config.direct_io {
        job.store.local_path(file_key)?
    } else {
        None
    };
    match local {
        Some(path) => {
            let buffer = job.buffer.clone();
            let fsync = job.store.config().fsync;
            tokio::task::spawn_blocking(move || {
                crate::direct::write_file(&path, &buffer, fsync, || {
                    crate::failpoint::hit("during-data-upload")
                })
                .map_err(|e| Error::Failed(format!("write {}: {e}", path.display())))
            })
            .await
            .map_err(|e| Error::Failed(format!("data file writer failed: {e}")))??;
        }
        _ => {
            let all = Bytes::from_owner(Staged(job.buffer.clone()));
            upload(&job.store, file_key, &[all]).await?;
        }
    }
    Ok(job.buffer.len() as u64)
}

/// Block checksums, and with zstd the frames, computed in parallel slices of blocks on
/// threads of their own at a lower scheduling priority.
///
/// Why not tokio's blocking pool: this is background work that competes for the same
/// cores as the training loop, and in particular as other ranks' staging copies (every
/// `save` stall is one memcpy only if nothing else runs). Threads of their own can be
/// niced without lowering the priority of the shared pool's threads for good (an
/// unprivileged thread cannot raise its priority back), and the pool's I/O stays at
/// normal priority.
async fn encode(
    buffer: Arc<Pooled>,
    block: usize,
    codec: Codec,
) -> Result<(Vec<u32>, Option<Vec<Bytes>>)> {
    let blocks = buffer.len().div_ceil(block).max(1);
    let workers = encode_threads().min(blocks);
    let per = blocks.div_ceil(workers);
    let mut tasks = Vec::with_capacity(workers);
    for w in 0..workers {
        let buffer = buffer.clone();
        // One permit per thread, process-wide: concurrent saves share the budget.
        let permit = ENCODE_PERMITS
            .get_or_init(|| Arc::new(Semaphore::new(encode_threads())))
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Error::Failed("encode permits closed".into()))?;
        tasks.push(spawn_background(
            move || -> std::io::Result<(Vec<u32>, Vec<Bytes>)> {
                let _permit = permit;
                let start = (w * per * block).min(buffer.len());
                let end = ((w + 1) * per * block).min(buffer.len());
                let slice = &buffer[start..end];
                let crcs = block_crcs(slice, block);
                let frames = match codec {
                    Codec::None => Vec::new(),
                    Codec::Zstd { level, shuffle } => slice
                        .chunks(block)
                        .map(|raw| compress_block(raw, level, shuffle).map(Bytes::from))
                        .collect::<std::io::Result<_>>()?,
                };
                Ok((crcs, frames))
            },
        ));
    }
    let mut crcs = Vec::with_capacity(blocks);
    let mut frames = Vec::new();
    for task in tasks {
        let (c, f) = task
            .await
            .map_err(|_| Error::Failed("checksum thread panicked".into()))?
            .map_err(|e| Error::Failed(format!("compression failed: {e}")))?;
        crcs.extend(c);
        frames.extend(f);
    }
    if buffer.is_empty() {
        crcs.clear();
    }
    Ok((crcs, matches!(codec, Codec::Zstd { .. }).then_some(frames)))
}

/// Encode threads a process may run at once, over all its saves: the cores divided
/// among the ranks of the node (`LOCAL_WORLD_SIZE`, as launchers set it), at most 8.
/// Eight ranks on a 96-core node then run 8 threads each, not 96.
fn encode_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let local_ranks = std::env::var("LOCAL_WORLD_SIZE")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(1);
        (cores / local_ranks).clamp(1, 8)
    })
}

static ENCODE_PERMITS: std::sync::OnceLock<Arc<Semaphore>> = std::sync::OnceLock::new();

/// Niceness of the background encode threads (0 is normal, 19 the lowest).
const BACKGROUND_NICE: i32 = 10;

/// Runs `work` on a new thread at [`BACKGROUND_NICE`] and hands back its result.
fn spawn_background<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> tokio::sync::oneshot::Receiver<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("ckpt-encode".into())
        .spawn(move || {
            lower_priority();
            let _ = tx.send(work());
        });
    if let Err(e) = spawned {
        // Out of threads: the receiver reports a failure when `tx` is dropped.
        warn!(error = %e, "cannot start an encode thread");
    }
    rx
}

/// Lowers this thread's scheduling priority (Linux: `setpriority` on a thread id
/// applies to that thread only). Best effort.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain syscalls on the calling thread's own id.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, BACKGROUND_NICE);
    }
}

/// How many times a data file is uploaded while the server stores other bytes
/// than those sent (a part damaged in flight).
const UPLOAD_ATTEMPTS: usize = 3;

/// Uploads `pieces` to `key`, and again, whole, when the server stored a part
/// with other bytes than those sent: a multipart upload cannot resend one part
/// (the store streams them and keeps none), but the save still holds the file.
async fn upload(store: &Store, key: &str, pieces: &[Bytes]) -> Result<()> {
    let mut attempt = 1;
    loop {
        match upload_once(store, key, pieces).await {
            Err(e) if e.is_damaged_in_flight() && attempt < UPLOAD_ATTEMPTS => {
                warn!(key, attempt, error = %e, "a part was damaged on its way to the store; uploading the file again");
                attempt += 1;
            }
            result => return Ok(result?),
        }
    }
}

/// Streams `pieces` to `key` in parts of the store's part size.
async fn upload_once(store: &Store, key: &str, pieces: &[Bytes]) -> ckpt_storage::Result<()> {
    let part = store.config().part_size;
    let mut upload = store.upload(key)?;
    let mut written = 0;
    for piece in pieces {
        let mut offset = 0;
        while offset < piece.len() {
            let end = (offset + part).min(piece.len());
            upload.write(piece.slice(offset..end)).await?;
            written += end - offset;
            if written >= part && written - (end - offset) < part {
                crate::failpoint::hit("during-data-upload");
            }
            offset = end;
        }
    }
    upload.finish().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pooled(checkpointer: &Checkpointer) -> usize {
        checkpointer
            .pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// A kept copy is the staged file, byte for byte what the store holds, and its
    /// staging buffer goes back to the pool only once the copy is let go.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_copy_is_the_staged_file_and_its_buffer_returns_when_let_go() {
        // On local disk: a memory store may keep the uploaded bytes themselves.
        let dir = tempfile::tempdir().unwrap();
        let store = Store::from_url(&format!("file://{}", dir.path().display())).unwrap();
        let mut config = CheckpointConfig::new(0, 1);
        config.keep_copy = true;
        config.block_size = 4096;
        let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        let mut state = crate::State::new();
        state
            .add_dim0_shard("t", crate::DType::U8, &[10_000], 0, 1, &data)
            .unwrap();
        let handle = checkpointer.save(1, &state).await.unwrap();
        let copy = handle.staged_copy().await.unwrap();
        handle.committed().await.unwrap();
        assert!(copy.is_staging_buffer());
        assert_eq!(copy.key().dir, handle.attempt().dir());
        let reader = crate::CheckpointReader::open(&store, None).await.unwrap();
        let part = reader.part(0).await.unwrap();
        let stored = store
            .get(&format!("{}/{}", handle.attempt().dir(), part.file.name))
            .await
            .unwrap();
        assert!(copy.bytes() == &stored[..]);
        // Held by the copy (and the handle): the next save takes a fresh buffer.
        assert_eq!(pooled(&checkpointer), 0);
        drop(handle);
        assert_eq!(pooled(&checkpointer), 0, "the copy still holds the buffer");
        drop(copy);
        assert_eq!(pooled(&checkpointer), 1, "back to the pool");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_keep_copy_a_save_keeps_no_copy_and_pools_its_buffer() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::from_url(&format!("file://{}", dir.path().display())).unwrap();
        let checkpointer = Checkpointer::new(store, CheckpointConfig::new(0, 1)).unwrap();
        let data = [1u8; 100];
        let mut state = crate::State::new();
        state
            .add_dim0_shard("t", crate::DType::U8, &[100], 0, 1, &data)
            .unwrap();
        let handle = checkpointer.save(1, &state).await.unwrap();
        handle.committed().await.unwrap();
        assert!(handle.copy().is_none());
        assert!(matches!(handle.staged_copy().await, Err(Error::Invalid(_))));
        assert_eq!(pooled(&checkpointer), 1);
    }
}
