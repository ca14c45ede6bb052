//! The load path: plan which bytes a rank needs, read them, verify, scatter.
//!
//! A [`LoadRequest`] names, per tensor, the box the rank wants. The planner
//! intersects each wanted box with the saved chunks (through the manifest's layouts,
//! so only the rank parts that matter are fetched), turns every intersection into
//! contiguous runs of bytes, and reads, per data file, just the blocks those runs
//! touch: in batches, coalesced, checksummed block by block, decompressed when the
//! file is compressed. A different world size or layout is the same path.
//!
//! The runs land in the caller's buffers ([`CheckpointReader::load_into`], as a
//! trainer resumes into parameters it already has) or in buffers the reader
//! allocates ([`CheckpointReader::load`], the same path after one allocation per
//! want). Files are read concurrently and each task writes its runs straight into
//! the outputs, without a lock: the planner checks that runs never overlap.
//!
//! Plain data files on local disk are read with positioned vectored reads straight
//! into the outputs (the bytes between runs into scratch), and each block's CRC32
//! is then checked over the memory it landed in; a block that fails leaves the load
//! failed, never delivered. Other stores and compressed files go through ranged gets:
//! verify (and decompress) the fetched bytes, then copy the runs out.
//!
//! A remote store's bytes cross a network, where a byte can change after TCP checked
//! it (a middlebox, a NIC): blocks, or a rank part, that fail their checksums as read
//! from S3, GCS or Azure are read again, up to three reads in all, before the
//! failure counts as corruption at rest (and [`load_latest`] falls back to the commit
//! before). A damaged response thus costs one more request, not the checkpoint;
//! bytes damaged in storage fail every read, and the error names the object, the
//! offset and the number of reads. Local disk and memory are read once.
//!
//! The files follow a load in order: `request.rs` (what is asked and returned),
//! `reader.rs` (opening a checkpoint, the public calls), `plan.rs` (which bytes),
//! `execute.rs` (files read concurrently), `read.rs` (one file's blocks, verified),
//! `scatter.rs` (into the outputs) and `memory.rs` (buffers the load allocates).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use ckpt_storage::Store;

use crate::format::{Assignments, Manifest, RankPart};

mod cooperative;
mod execute;
mod memory;
mod plan;
mod read;
mod reader;
mod request;
mod scatter;

pub use cooperative::Cooperative;
pub(crate) use cooperative::encode_shared;
pub(crate) use execute::{in_this_poll, on_threads};
pub use memory::zeroed_huge;
pub(crate) use read::{FileRead, read_batch, verify_and_copy};
pub use reader::{load_latest, load_latest_selecting};
pub use request::{
    LoadPlan, LoadRequest, LoadStats, LoadTimings, Loaded, LoadedTensor, ReadConfig, Want,
};
pub(crate) use scatter::{Outputs, Scatter, Tally};

/// A committed checkpoint opened for reading.
#[derive(Debug)]
pub struct CheckpointReader {
    store: Store,
    manifest: Arc<Manifest>,
    parts: tokio::sync::Mutex<HashMap<u32, Arc<RankPart>>>,
    /// What the manifest gives each rank, indexed on the first part fetched.
    assignments: OnceLock<Assignments>,
    /// Data files whose stored size was checked against their part (once per reader:
    /// tools load a checkpoint in many slabs).
    sized: Mutex<std::collections::HashSet<String>>,
    config: ReadConfig,
    /// Unhealthy commits passed over to find this one.
    skipped: Vec<crate::catalog::Skipped>,
}

/// A contiguous run of bytes: `len` bytes at raw file offset `src` go to byte `dst`
/// of want `want`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    pub(crate) src: u64,
    pub(crate) len: u64,
    pub(crate) want: usize,
    pub(crate) dst: u64,
}
