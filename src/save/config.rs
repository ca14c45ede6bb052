//! The settings of a rank's checkpointer ([`CheckpointConfig`](crate::CheckpointConfig)): plain data with
//! documented defaults, checked once when the checkpointer is made so that a bad
//! setting fails before the first save, not in the middle of one.

use std::time::Duration;

use super::write::encode_threads;
use crate::error::{Error, Result};
use crate::format::{Codec, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, ReplicaPolicy};

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
    /// [`Checkpointer::save`](crate::Checkpointer::save) waits until the oldest has written its part;
    /// [`Checkpointer::try_save`](crate::Checkpointer::try_save) returns `None` instead.
    pub max_in_flight: usize,
    /// Keep this many newest committed checkpoints (older ones and stale partial
    /// ones are deleted by the committing rank). Default `None`: keep all.
    pub keep_last: Option<usize>,
    /// How long [`SaveHandle::committed`](crate::SaveHandle::committed) waits for the other ranks' parts. Default
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
    /// ([`Checkpointer::save_overlapped`](crate::Checkpointer::save_overlapped)). Default: the cores divided among the
    /// node's ranks (`LOCAL_WORLD_SIZE`), 1 to 4.
    pub copy_threads: usize,
    /// Overlapped saves check that no tensor changed between `save_overlapped` and the
    /// end of its copy: a CRC32 of each tensor is taken when the save is registered
    /// (a read of the state, on the caller's thread) and compared with the staged
    /// bytes. A mismatch fails the save with [`Error::Mutated`], naming the tensor.
    /// Default: on in debug builds, off in release builds.
    pub check_staging: bool,
    /// Keep each save's staged data file (header and boxes, raw, as the block CRC32s
    /// cover it) as this rank's in-memory copy of the save: [`SaveHandle::copy`](crate::SaveHandle::copy) hands
    /// out a shared reference to the staging buffer itself, no byte copied, and the
    /// buffer returns to the pool only when the save's upload and every holder of the
    /// copy are done with it. So each copy kept costs one staging buffer (the size of
    /// this rank's data file) for as long as it is kept, and a save while copies are
    /// held takes a fresh buffer (page faults in its copy) unless
    /// [`Checkpointer::warm_up`](crate::Checkpointer::warm_up) prepared it. `crate::copies` keeps, replicates and
    /// recovers from these copies. Default false.
    pub keep_copy: bool,
    /// Most bytes of host memory this rank's checkpointing may hold at once:
    /// staging buffers (pinned or not, idle in the pool or in use), own copies,
    /// replicas of peers' copies and snapshots, together ([`crate::budget`]). Never
    /// exceeded: when a buffer, a replica or a snapshot would pass it, the oldest
    /// copy that may be dropped is let go (never the newest committed snapshot or
    /// checkpoint before its successor commits); a snapshot that still does not fit
    /// is not taken, and a save whose staging buffer does not fit stages and uploads
    /// its file in pieces (a longer stall, said in a warning). Default `None`: no
    /// bound (memory is still counted, [`Checkpointer::host_bytes_held`](crate::Checkpointer::host_bytes_held)).
    ///
    /// A save in pieces (host tensors only) takes the largest buffer that fits,
    /// a whole number of [`block_size`](Self::block_size) blocks (with zstd, about
    /// half the room: the rest is kept for its frames), and fills, checksums and uploads
    /// the file through it one window after the other, as parts of one multipart
    /// upload: the caller's tensors are read until the file is stored, so `save`
    /// (and [`save_overlapped`](crate::Checkpointer::save_overlapped), which then
    /// returns with its tensors free) blocks for the whole upload, not one copy. Its
    /// part and its commit are those of a whole-file save; it keeps no
    /// [`keep_copy`](Self::keep_copy) copy. A budget that does not hold one block
    /// fails the save with [`Error::OverBudget`](crate::Error::OverBudget).
    pub host_memory_budget: Option<u64>,
    /// What a save does when the ranks that hold one replicated box (a
    /// [`State::add_replica`](crate::State::add_replica) box, a scalar of
    /// [`State::add_dim0_shard`](crate::State::add_dim0_shard)) hold different bytes:
    /// every holder checksums its own copy off the training thread and the commit
    /// compares them. `Warn` (default) commits the checkpoint marked unhealthy, with
    /// a warning naming the ranks; `Fail` refuses the commit (the previous checkpoint
    /// stays the newest, and `wait_committed` fails); `Off` does not compare (ranks
    /// that do not write a replica then do not stage it either).
    pub replica_mismatch: ReplicaPolicy,
    /// The caller's own test of a save's health, on the metrics it recorded with
    /// [`State::health_metric`](crate::State::health_metric): an `Err(reason)`
    /// marks the checkpoint unhealthy. Runs on the caller's thread when `save` is
    /// called. Default none.
    pub health_check: Option<HealthCheck>,
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
            host_memory_budget: None,
            replica_mismatch: ReplicaPolicy::default(),
            health_check: None,
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

/// A caller's test of a save's health: metrics in, `Err(reason)` when unhealthy.
#[derive(Clone)]
pub struct HealthCheck(
    #[allow(clippy::type_complexity)]
    pub  std::sync::Arc<
        dyn Fn(&std::collections::BTreeMap<String, f64>) -> std::result::Result<(), String>
            + Send
            + Sync,
    >,
);

impl HealthCheck {
    /// Wraps `check`.
    pub fn new(
        check: impl Fn(&std::collections::BTreeMap<String, f64>) -> std::result::Result<(), String>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self(std::sync::Arc::new(check))
    }
}

impl std::fmt::Debug for HealthCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HealthCheck(..)")
    }
}
