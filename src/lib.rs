//! ckpt: fault-tolerant sharded checkpointing for distributed training.
//!
//! # A tour
//!
//! **Saving.** Every rank describes what it holds as boxes of global tensors (plus
//! non-tensor state) in a [`State`] and hands it to its [`Checkpointer`]:
//! [`Checkpointer::save`] blocks only for one copy into a reusable staging buffer
//! ([`Checkpointer::save_overlapped`] not even for that: the copy runs while the
//! caller computes, and [`SaveHandle::staged`] says when the tensors may change
//! again); a background task checksums, uploads and commits, and the returned
//! [`SaveHandle`] says when this rank's part is durable and when the whole checkpoint
//! is committed. [`Checkpointer::try_save`] skips the step instead of waiting when
//! earlier saves are still writing; [`Checkpointer::close`] waits for every save's
//! background work (commit and retention included) before a process exits.
//!
//! **Committing.** Every save attempt (one world's save of one step) writes into a
//! directory of its own, named by the step, the world's generation and its run id,
//! and never writes a name twice. Once every rank's part is there, one of a few
//! committer ranks (others take over if it dies) appends the attempt to the commit
//! log, which orders all commits and fences off older generations, and writes the
//! manifest into the attempt's slot; a failure is written there as a tombstone, so
//! every rank learns the outcome. The newest checkpoint is the last commit in log
//! order, not the highest step ([`catalog`]); retention follows the same order and
//! leaves superseded checkpoints readable for a grace period ([`retention`]).
//! Version-1 checkpoints stay readable. The format and its guarantees:
//! `docs/FORMAT.md`; where each invariant lives in the code: `docs/ARCHITECTURE.md`.
//!
//! **Health.** The pass that checksums a save also counts the non-finite values of
//! every float box and checksums every replicated box on each of its holders (the
//! writer's copy and the others', [`State::add_replica`]); the commit compares the
//! holders and records a verdict in the manifest ([`format::Health`], [`health`]):
//! healthy, or why not, with the caller's metrics ([`State::health_metric`]) and
//! checks ([`CheckpointConfig::health_check`]). Disagreeing replicas commit marked
//! unhealthy, or are refused with [`CheckpointConfig::replica_mismatch`] `Fail`.
//! Resumes ([`load_latest`], [`catalog::latest_selecting`]) take the newest
//! checkpoint not judged unhealthy, naming those they pass over.
//!
//! **Loading.** Any rank of any later world size loads exactly the boxes it wants
//! with a [`CheckpointReader`] ([`LoadRequest`] names tensors and [`Region`]s),
//! verified block by block, or in place into its own buffers.
//!
//! **Recovering from memory.** With [`CheckpointConfig::keep_copy`] each rank keeps
//! the file its save staged as an in-memory copy (no extra copy made), a
//! [`copies::Copies`] holder pulls a replica of its ring predecessor's, and after a
//! failure [`copies::load_into`] loads the survivors' new boxes from those copies,
//! held to the same block checksums as the store, falling back to the store for
//! whatever they cannot deliver ([`copies`]).
//!
//! **The memory tier.** [`Checkpointer::snapshot`] stages like a save and stops
//! there: the file and its rank part stay in host memory, a ring peer pulls a
//! replica, and every rank's vote commits the snapshot in the control plane
//! ([`snapshot`]); after a failure the survivors resume from the newest committed
//! snapshot they cover, resharded and checked block by block, losing at most the
//! snapshot interval, while the store's saves stay the durability guarantee. One
//! [`HostBudget`] per rank ([`CheckpointConfig::host_memory_budget`]) bounds the
//! staging buffers, copies, replicas and snapshots together ([`budget`]).
//!
//! **Offline.** [`tools`] has what the `ckpt` command runs: inspect, verify, diff,
//! export, import, convert, reshard, gc. [`probe`] checks that a store supports what
//! ckpt needs.
//!
//! **Elsewhere.** The elastic control plane (coordinator, agent, etcd backend) is
//! the crate `ckpt-elastic`; the command line and `ckpt bench` are the crate
//! `ckpt-cli`; the object-store layer is [`storage`] (the crate `ckpt-storage`).
//!
//! # Feature flags
//!
//! None is on by default: the library alone builds local-disk and memory stores.
//!
//! - `aws`, `gcp`, `azure`: the S3, GCS and Azure Blob backends of [`storage`];
//!   `cloud` is all three.
//! - `cuda`: device tensors in [`State`], pinned staging, device loads and the
//!   library probe (`ckpt::cuda`), through cudarc's driver API loaded at run time
//!   (no CUDA needed to build; `docs/GPU.md`).
//! - `failpoints`: crash points at the seams of the save protocol, for crash tests
//!   (they do nothing unless armed).
//!
//! # Threads
//!
//! [`Checkpointer`], [`SaveHandle`], [`CheckpointReader`] and [`storage::Store`] are
//! `Send + Sync` (share them by reference or `Arc`); so are [`State`] and [`Error`].
//! Saves and loads are `async` and need a multi-threaded tokio runtime.
//!
//! Modules hidden from these docs (`attempt`, `commit`, `commits`, `writer`) are the
//! protocol's internals, public for the crate's own tools and tests; they may change
//! in any release, and other crates do not use them. What a benchmark or a test
//! outside the crate needs of them (building commit logs and manifests at scale,
//! hostile commit records) is in `ckpt::testing`, behind the `testing` feature. The
//! on-storage format ([`format`](mod@format), normative in `docs/FORMAT.md`) and the failpoints
//! of the chaos harness ([`failpoint`], active with the `failpoints` feature) are
//! public.
//!
//! ```
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), ckpt::Error> {
//! use ckpt::{CheckpointConfig, CheckpointReader, Checkpointer, DType, LoadRequest, State, as_bytes};
//! use ckpt::storage::Store;
//!
//! let store = Store::from_url("memory://tour")?;
//! let weights: Vec<f32> = (0..8 * 4).map(|i| i as f32).collect();
//!
//! // Two ranks, each holding half of an 8x4 matrix (dim-0 sharding, FSDP style).
//! let mut handles = Vec::new();
//! for rank in 0..2 {
//!     let checkpointer = Checkpointer::new(store.clone(), CheckpointConfig::new(rank, 2))?;
//!     let shard = &weights[rank * 16..(rank + 1) * 16];
//!     let mut state = State::new();
//!     state.add_dim0_shard("w", DType::F32, &[8, 4], rank, 2, as_bytes(shard))?;
//!     state.set_rank_json("data_cursor", serde_json::json!({ "sample": 100 + rank }));
//!     handles.push(checkpointer.save(10, &state).await?);
//! }
//! for handle in &handles {
//!     handle.committed().await?;
//! }
//!
//! // A single rank loads rows 2..6: parts of both saved shards.
//! let reader = CheckpointReader::open(&store, None).await?;
//! let request = LoadRequest::new().tensor("w", ckpt::Region::rows(&[8, 4], 2, 4));
//! let loaded = reader.load(&request).await?;
//! assert_eq!(loaded.tensors[0].data, as_bytes(&weights[8..24]));
//! assert_eq!(reader.rank_states().await?.len(), 2);
//! # Ok(())
//! # }
//! ```

pub use ckpt_storage as storage;

#[doc(hidden)]
pub mod attempt;
mod blocks;
pub mod budget;
pub mod catalog;
pub mod codec;
#[doc(hidden)]
pub mod commit;
#[doc(hidden)]
pub mod commits;
pub mod copies;
#[cfg(feature = "cuda")]
pub mod cuda;
mod direct;
pub mod dtype;
mod error;
pub mod failpoint;
pub mod format;
pub mod health;
pub mod load;
pub mod probe;
mod rank_file;
pub mod region;
pub mod retention;
pub mod save;
pub mod snapshot;
mod staging;
pub mod state;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tools;
mod upload;
#[doc(hidden)]
pub mod writer;

pub use attempt::{Attempt, RunId};
pub use budget::{HostBudget, HostBytesHeld};
pub use catalog::{
    CheckpointInfo, Commit, Select, latest, latest_selecting, list_checkpoints, read_manifest,
};
pub use commit::Outcome;
pub use copies::Snapshot;
pub use dtype::DType;
pub use error::{Error, Result};
pub use format::{Codec, Health, HealthStatus, Manifest, ReplicaPolicy, StateValue};
pub use load::{CheckpointReader, LoadRequest, Loaded, LoadedTensor, load_latest};
pub use region::Region;
pub use save::SnapshotHandle;
pub use save::{CheckpointConfig, Checkpointer, HealthCheck, SaveHandle};
pub use state::{Element, State, as_bytes, as_bytes_mut};

/// The README's examples, compiled as doctests so they cannot go stale.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
