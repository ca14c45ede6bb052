//! What a load asks for and what it gives back: the boxes a rank wants
//! ([`LoadRequest`](crate::LoadRequest)), the tensors and figures it returns ([`Loaded`](crate::Loaded), [`LoadStats`](crate::LoadStats)),
//! a plan made ahead ([`LoadPlan`](crate::LoadPlan)) and the read settings ([`ReadConfig`](crate::ReadConfig)). Plain
//! data, no I/O.

use std::sync::Arc;
use std::time::Duration;

use super::Run;
use crate::dtype::DType;
use crate::format::{Manifest, RankPart};
use crate::region::Region;

/// One tensor box a rank wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want {
    /// Global tensor name.
    pub name: String,
    /// The box wanted.
    pub region: Region,
    /// Expected dtype; a different one in the checkpoint is an error.
    pub dtype: Option<DType>,
    /// Expected global shape; a different one is an error.
    pub shape: Option<Vec<u64>>,
}

/// What a rank wants to load: a box per tensor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadRequest {
    /// The boxes wanted, in the order results are returned.
    pub wants: Vec<Want>,
}

impl LoadRequest {
    /// An empty request.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks for box `region` of tensor `name`.
    pub fn tensor(mut self, name: impl Into<String>, region: Region) -> Self {
        self.wants.push(Want {
            name: name.into(),
            region,
            dtype: None,
            shape: None,
        });
        self
    }

    /// Asks for box `region` of tensor `name`, which must have `dtype` and `shape`.
    pub fn expect(
        mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[u64],
        region: Region,
    ) -> Self {
        self.wants.push(Want {
            name: name.into(),
            region,
            dtype: Some(dtype),
            shape: Some(shape.to_vec()),
        });
        self
    }

    /// Every tensor of the checkpoint, split evenly on dim 0 for `rank` of `world`
    /// (FSDP2/ZeRO resume at any world size).
    pub fn dim0_shards(manifest: &Manifest, rank: usize, world: usize) -> Self {
        let mut request = Self::new();
        for t in &manifest.tensors {
            request = request.tensor(t.name.clone(), Region::dim0_shard(&t.shape, rank, world));
        }
        request
    }

    /// Every tensor of the checkpoint, whole.
    pub fn everything(manifest: &Manifest) -> Self {
        let mut request = Self::new();
        for t in &manifest.tensors {
            request = request.tensor(t.name.clone(), Region::full(&t.shape));
        }
        request
    }
}

/// One loaded box.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedTensor {
    /// Global tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The box loaded.
    pub region: Region,
    /// Row-major data of the box.
    pub data: Vec<u8>,
}

/// Counters of one load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Bytes of tensor data requested.
    pub bytes_requested: u64,
    /// Bytes fetched from data files (as stored: compressed when compressed).
    pub bytes_read: u64,
    /// Raw bytes verified (whole blocks).
    pub bytes_verified: u64,
    /// Rank parts fetched.
    pub parts_read: usize,
    /// Tensor bytes copied into the outputs from an intermediate buffer (a ranged
    /// get's body, a decompressed frame, scratch); the rest of the requested bytes
    /// were read straight into the outputs (plain files on local disk).
    pub bytes_copied: u64,
    /// Bytes this rank fetched from the store's data files (as stored), re-reads
    /// included: equal to `bytes_read` (a cooperative load reads for its peers too).
    pub bytes_read_from_store: u64,
    /// Raw bytes other ranks sent this rank in a cooperative load.
    pub bytes_received_from_peers: u64,
    /// Blocks peers sent that failed their CRC32 and were read from the store.
    pub peer_blocks_rejected: u64,
    /// Stored bytes of the blocks the whole job needed, each counted once: in a
    /// cooperative load the sum over the ranks of what each read as owner, so the
    /// same on every rank once the caller adds it up (the Python layer does); in a
    /// load on its own, this rank's blocks.
    pub unique_bytes: u64,
    /// Requests this load sent to the store, by kind.
    pub store_requests: ckpt_storage::RequestCounts,
    /// Where the time went.
    pub timings: LoadTimings,
}

/// Time spent in each stage of one load. Apart from `plan`, each figure is summed
/// over the tasks that did the work, several at once, so together they exceed the
/// load's wall time: they say where the threads spent it, and compared with the wall
/// time, how busy the reads kept them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadTimings {
    /// Planning, wall time: rank parts fetched and parsed, runs computed (set by
    /// [`CheckpointReader::load`](crate::CheckpointReader::load) and [`CheckpointReader::load_into`](crate::CheckpointReader::load_into)).
    pub plan: Duration,
    /// In reads: positioned reads of local files, or ranged gets from the store
    /// (request to last body byte).
    pub read: Duration,
    /// CPU time of the reading threads inside local reads: the kernel copying from
    /// the page cache into the outputs, and faulting in output pages touched for
    /// the first time. `read` minus this is waiting for the device.
    pub read_cpu: Duration,
    /// Checking block CRC32s, and decompressing compressed frames.
    pub verify: Duration,
    /// Copying from intermediate buffers into the outputs.
    pub copy: Duration,
}

impl LoadTimings {
    pub(super) fn add(&mut self, other: &LoadTimings) {
        self.plan += other.plan;
        self.read += other.read;
        self.read_cpu += other.read_cpu;
        self.verify += other.verify;
        self.copy += other.copy;
    }
}

/// Result of a load.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// One per want, in request order.
    pub tensors: Vec<LoadedTensor>,
    /// Counters.
    pub stats: LoadStats,
}

/// What a load will read: per data file, the byte runs to fetch and where they go.
/// Made by [`CheckpointReader::plan`](crate::CheckpointReader::plan), consumed by [`CheckpointReader::execute`](crate::CheckpointReader::execute).
#[derive(Debug, Clone)]
pub struct LoadPlan {
    /// (object key, its rank part, runs sorted by source offset) per data file.
    pub(crate) files: Vec<(String, Arc<RankPart>, Vec<Run>)>,
    /// Bytes of each want's output, in request order.
    pub(crate) sizes: Vec<u64>,
    /// Counters so far (requested bytes, parts read).
    pub(crate) stats: LoadStats,
}

impl LoadPlan {
    /// Data files the load reads.
    pub fn files(&self) -> usize {
        self.files.len()
    }

    /// Contiguous byte runs copied out of those files.
    pub fn runs(&self) -> usize {
        self.files.iter().map(|(_, _, runs)| runs.len()).sum()
    }

    /// Bytes of tensor data requested.
    pub fn bytes_requested(&self) -> u64 {
        self.stats.bytes_requested
    }

    /// Rank parts fetched to make the plan.
    pub fn parts_read(&self) -> usize {
        self.stats.parts_read
    }
}

/// Tuning of reads.
#[derive(Debug, Clone)]
pub struct ReadConfig {
    /// Raw bytes per read batch of one file: one positioned read on local disk,
    /// one ranged get elsewhere. Default 16 MiB.
    pub batch_bytes: u64,
    /// Data files read at once. Default 4.
    pub file_concurrency: usize,
    /// Batches of one file in flight. Through the store each holds a buffer of up to
    /// `batch_bytes` (more, shorter requests are sent when the runs are short, up to
    /// the same bytes in flight); plain local files are read in place and hold
    /// none. Default 2.
    pub batches_in_flight: usize,
}

impl Default for ReadConfig {
    fn default() -> Self {
        Self {
            batch_bytes: 16 << 20,
            file_concurrency: 4,
            batches_in_flight: 2,
        }
    }
}
