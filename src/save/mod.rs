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
//!
//! The files follow a save in order: `config.rs` (the settings), `checkpointer.rs`
//! (what a trainer calls), `stage.rs` and `plan.rs` (the copy the training loop
//! waits for, on `stage_thread.rs`'s thread when overlapped), `job.rs` (the
//! background task: durable, then committed) and `write.rs` (the bytes of the rank's
//! files); `handle.rs` is what the caller holds meanwhile. The types they share are
//! defined here.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ckpt_storage::Store;
use tokio::sync::{Semaphore, watch};

use crate::attempt::Attempt;
use crate::budget::{Dropper, HostBudget};
use crate::copies::RankCopy;
use crate::error::{Error, Result};
use crate::format::Chunk;
use crate::staging::{Pool, Pooled};
use stage_thread::StageThread;

mod checkpointer;
mod config;
mod handle;
mod job;
mod pieces;
mod plan;
mod snapshot;
mod stage;
mod stage_thread;
mod write;

pub use config::{CheckpointConfig, HealthCheck};
pub use snapshot::SnapshotHandle;

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
    /// The rank's host-memory budget, for [`SaveHandle::host_bytes_held`].
    budget: Arc<HostBudget>,
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
    /// The rank's host-memory budget, shared with its copies holder.
    budget: Arc<HostBudget>,
    /// Lets the budget unmap idle staging buffers (registered with it).
    _trimmer: Arc<dyn Dropper>,
    /// Snapshots being made at once (one).
    snapshot_slots: Arc<Semaphore>,
    /// Side streams for the device-to-host copies of device tensors.
    #[cfg(feature = "cuda")]
    side: Mutex<crate::cuda::device::SideStreams>,
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
    /// The written chunks as the health scan needs them.
    scan_chunks: Arc<Vec<crate::health::ScanChunk>>,
    /// The replicas staged after the file, only to be checksummed.
    shadow: Vec<ShadowBox>,
    /// Bytes of the staged buffer that are the file.
    file_len: usize,
    /// The part's health before the scan: the replica policy, the caller's metrics
    /// and findings.
    health: crate::format::PartHealth,
    global: Option<BTreeMap<String, crate::format::StateValue>>,
    rank_state: BTreeMap<String, crate::format::StateValue>,
    metadata: BTreeMap<String, serde_json::Value>,
    /// Waits for copies into the staging buffer that the host does not make (the
    /// device-to-host copies of device tensors); `None` when there are none.
    pending_copies: Option<PendingCopies>,
    /// Where a snapshot is handed over once checksummed (`None` for a save to the
    /// store).
    snapshot: Option<snapshot::SnapshotSender>,
}

/// A replica this rank holds but another writes: hashed during staging (host
/// memory, `crcs`), or staged after the file at `staged` of
/// [`Pooled::beyond`](crate::staging::Pooled::beyond) and hashed with it (device
/// memory).
#[derive(Debug, Clone)]
struct ShadowBox {
    tensor: String,
    dtype: crate::DType,
    offsets: Vec<u64>,
    lengths: Vec<u64>,
    staged: std::ops::Range<usize>,
    crcs: Option<Vec<u32>>,
}

impl ShadowBox {
    fn new(
        tensor: &str,
        dtype: crate::DType,
        region: &crate::Region,
        staged: std::ops::Range<usize>,
    ) -> Self {
        Self {
            tensor: tensor.to_string(),
            dtype,
            offsets: region.offsets.clone(),
            lengths: region.lengths.clone(),
            staged,
            crcs: None,
        }
    }
}

/// A blocking wait for copies into the staging buffer made by a device.
type PendingCopies = Box<dyn FnOnce() -> Result<()> + Send + Sync>;

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
