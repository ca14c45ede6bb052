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

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ckpt_storage::{ErrorKind, Store};
use futures::{StreamExt, TryStreamExt};
use tracing::warn;

use crate::blocks::BlockMap;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::{
    Assignments, ChunkIndex, Codec, FormatError, MAX_PART_BYTES, Manifest, RankPart, StateValue,
    TensorEntry,
};
use crate::region::{Region, for_each_run};

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
    /// [`CheckpointReader::load`] and [`CheckpointReader::load_into`]).
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
    fn add(&mut self, other: &LoadTimings) {
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
/// Made by [`CheckpointReader::plan`], consumed by [`CheckpointReader::execute`].
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

impl CheckpointReader {
    /// Opens checkpoint `step`, or the newest committed one when `None` (skipping
    /// corrupt manifests with a warning).
    pub async fn open(store: &Store, step: Option<u64>) -> Result<Self> {
        let manifest = match step {
            Some(step) => crate::catalog::read_manifest(store, step).await?,
            None => crate::catalog::latest(store).await?.ok_or_else(|| {
                Error::NotFound(format!("no committed checkpoint in {}", store.url()))
            })?,
        };
        Ok(Self::from_manifest(store, manifest))
    }

    /// A reader over an already validated manifest.
    pub fn from_manifest(store: &Store, manifest: Manifest) -> Self {
        Self {
            store: store.clone(),
            manifest: Arc::new(manifest),
            parts: tokio::sync::Mutex::new(HashMap::new()),
            assignments: OnceLock::new(),
            sized: Mutex::new(Default::default()),
            config: ReadConfig::default(),
        }
    }

    /// Replaces the read tuning.
    pub fn with_read_config(mut self, config: ReadConfig) -> Self {
        self.config = config;
        self
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The read tuning.
    pub fn read_config(&self) -> &ReadConfig {
        &self.config
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// The part of `rank`, fetched once, verified against the manifest's size and
    /// checksum, and checked to describe what the manifest says about the rank
    /// (step, file, sizes, every chunk's dtype, shape and box) before any of it is
    /// used. Its size is compared before it is read, and no more than that size is
    /// read, so a part swollen to gigabytes costs one metadata request.
    pub async fn part(&self, rank: u32) -> Result<Arc<RankPart>> {
        if let Some(part) = self.parts.lock().await.get(&rank) {
            return Ok(part.clone());
        }
        let entry = self.manifest.ranks.get(rank as usize).ok_or_else(|| {
            Error::NotFound(format!(
                "rank {rank} is not part of step {} (world size {})",
                self.manifest.step, self.manifest.world_size
            ))
        })?;
        let key = format!("{}/{}", self.manifest.dir(), entry.part);
        let missing = |e: ckpt_storage::Error| {
            if e.is_not_found() {
                Error::from(FormatError::new(
                    &key,
                    None,
                    "rank part is missing from a committed checkpoint",
                ))
            } else {
                Error::from(e)
            }
        };
        let size = self.store.head(&key).await.map_err(missing)?.size;
        if size > MAX_PART_BYTES || size != entry.part_bytes {
            return Err(FormatError::new(
                &key,
                Some(size.min(entry.part_bytes)),
                format!("{size} bytes, the manifest says {}", entry.part_bytes),
            )
            .into());
        }
        let mut reads = 0;
        let bytes = loop {
            let bytes = self
                .store
                .get_range(&key, 0..entry.part_bytes)
                .await
                .map_err(missing)?;
            reads += 1;
            let crc = crc32fast::hash(&bytes);
            if crc == entry.part_crc32 {
                break bytes;
            }
            let e = Error::from(FormatError::new(
                &key,
                Some(0),
                format!(
                    "crc32 {crc:08x}, the manifest says {:08x}",
                    entry.part_crc32
                ),
            ));
            if reads >= reads_on_mismatch(&self.store) {
                return Err(read_again(e, reads));
            }
            warn!(object = %key, error = %e, "a rank part failed its checksum as read from a remote store; reading it again (damaged in flight?)");
        };
        let part = RankPart::parse(&bytes, &key)?;
        self.assignments
            .get_or_init(|| Assignments::new(&self.manifest))
            .check_part(&self.manifest, rank, &part, &key)?;
        let part = Arc::new(part);
        self.parts.lock().await.insert(rank, part.clone());
        Ok(part)
    }

    /// The global non-tensor state (empty when none was saved).
    pub async fn global_state(&self) -> Result<BTreeMap<String, StateValue>> {
        match self.manifest.global_state_rank {
            Some(rank) => Ok(self
                .part(rank)
                .await?
                .global_state
                .clone()
                .unwrap_or_default()),
            None => Ok(BTreeMap::new()),
        }
    }

    /// Every saved rank's own non-tensor state, by saved rank. After a world-size
    /// change the loader decides how to map them onto its ranks.
    pub async fn rank_states(&self) -> Result<Vec<(u32, BTreeMap<String, StateValue>)>> {
        futures::stream::iter(0..self.manifest.world_size)
            .map(|rank| async move { Ok::<_, Error>((rank, self.part(rank).await?.rank_state.clone())) })
            .buffered(32)
            .try_collect()
            .await
    }

    /// Loads the boxes of `request`, verified, into buffers it allocates.
    ///
    /// The same read path as [`CheckpointReader::load_into`]: the data files' sizes
    /// are checked first, then one zero-filled buffer per want is allocated and
    /// loaded in place. A trainer whose parameters already exist should call
    /// `load_into` instead: a fresh buffer costs a page fault per 4 KiB page on
    /// first write, about a fifth of a cold load's time on the machines measured
    /// (`docs/BENCHMARKS.md`).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops the load between batches (reads of local files
    /// run to their end within one poll), and nothing is returned.
    pub async fn load(&self, request: &LoadRequest) -> Result<Loaded> {
        let started = Instant::now();
        let plan = self.plan(request).await?;
        let planned = started.elapsed();
        let mut loaded = self.execute(request, plan).await?;
        loaded.stats.timings.plan = planned;
        Ok(loaded)
    }

    /// Loads the boxes of `request`, verified, into `outputs`: one buffer per want,
    /// in request order, each exactly the want's size in bytes (row-major data of
    /// its box). This is how a trainer resumes into parameters and optimizer moments
    /// it already holds, as PyTorch's distributed checkpoint loads in place.
    ///
    /// The count and sizes of `outputs` are checked against the manifest before any
    /// I/O: a mismatch is [`Error::Invalid`] naming the tensor and both sizes.
    ///
    /// Every byte written into an output belongs to a block whose CRC32 was checked,
    /// and when the load succeeds every byte of every output has been written.
    ///
    /// # On failure
    ///
    /// When the load fails midway (a corrupt block, a storage error) or its future
    /// is dropped, the outputs are partially written: some runs hold new bytes,
    /// possibly the bytes of a block that then failed its check, and others still
    /// hold what was there before. The caller must not use them; load again (an
    /// older checkpoint, say) before training on them.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops the load; whatever it is dropped (or leaked) after,
    /// nothing writes into `outputs` any more: every write happens inside a poll of
    /// the future. On a multi-threaded runtime the reads block the polling worker
    /// through `block_in_place` (the runtime moves its other tasks away); on a
    /// current-thread runtime they block it outright.
    pub async fn load_into(
        &self,
        request: &LoadRequest,
        outputs: &mut [&mut [u8]],
    ) -> Result<LoadStats> {
        self.check_outputs_of(request, outputs)?;
        let started = Instant::now();
        let plan = self.plan(request).await?;
        let planned = started.elapsed();
        let mut stats = self.execute_into(request, plan, outputs).await?;
        stats.timings.plan = planned;
        Ok(stats)
    }

    /// Checks the count and sizes of `outputs` against `request`'s wants, as the
    /// manifest describes them (no I/O): the first check of a load in place.
    pub(crate) fn check_outputs_of(
        &self,
        request: &LoadRequest,
        outputs: &[&mut [u8]],
    ) -> Result<()> {
        let sizes = request
            .wants
            .iter()
            .map(|want| self.check_want(want).map(|(_, bytes)| bytes))
            .collect::<Result<Vec<u64>>>()?;
        check_outputs(request, &sizes, outputs)
    }

    /// Checks one want against the manifest; returns its tensor and its size in
    /// bytes. No I/O.
    fn check_want(&self, want: &Want) -> Result<(&TensorEntry, u64)> {
        let manifest = &self.manifest;
        let step = manifest.step;
        let tensor = manifest.tensor(&want.name).ok_or_else(|| {
            Error::NotFound(format!(
                "tensor {:?} is not in checkpoint step {step} ({} tensors)",
                want.name,
                manifest.tensors.len()
            ))
        })?;
        if let Some(dtype) = want.dtype
            && dtype != tensor.dtype
        {
            return Err(Error::Mismatch(format!(
                "tensor {:?}: requested {dtype}, checkpoint step {step} has {}",
                want.name, tensor.dtype
            )));
        }
        if let Some(shape) = &want.shape
            && shape != &tensor.shape
        {
            return Err(Error::Mismatch(format!(
                "tensor {:?}: requested shape {shape:?}, checkpoint step {step} has {:?}",
                want.name, tensor.shape
            )));
        }
        if !want.region.within(&tensor.shape) {
            return Err(Error::Mismatch(format!(
                "tensor {:?}: requested box {} lies outside its shape {:?}",
                want.name, want.region, tensor.shape
            )));
        }
        let bytes = want
            .region
            .volume()
            .unwrap_or(0)
            .saturating_mul(tensor.dtype.size() as u64);
        Ok((tensor, bytes))
    }

    /// Plans a load without reading data: checks the request against the manifest,
    /// fetches the rank parts its boxes touch and turns every intersection into byte
    /// runs per data file. [`CheckpointReader::execute`] then reads them; the split
    /// lets the planning cost be measured on its own (`ckpt bench`).
    ///
    /// A plan's runs are checked to tile every want's output exactly (inside it, no
    /// two overlapping, together covering it) and to lie inside their data file:
    /// the reads write into the outputs from several threads at once without locks,
    /// which is sound only because no two runs share a destination byte.
    pub async fn plan(&self, request: &LoadRequest) -> Result<LoadPlan> {
        let mut stats = LoadStats::default();
        let mut sizes = Vec::with_capacity(request.wants.len());
        // (want index, chunk box, part box) per saved rank.
        let mut pieces: BTreeMap<u32, Vec<(usize, Region, Region)>> = BTreeMap::new();
        for (i, want) in request.wants.iter().enumerate() {
            let (tensor, bytes) = self.check_want(want)?;
            stats.bytes_requested += bytes;
            sizes.push(bytes);
            let layout = &self.manifest.layouts[tensor.layout as usize];
            let mut covered = 0u64;
            for (rank, chunk, part) in layout.overlapping(&tensor.shape, &want.region) {
                covered += part.volume().unwrap_or(0);
                pieces.entry(rank).or_default().push((i, chunk, part));
            }
            if covered != want.region.volume().unwrap_or(0) {
                return Err(FormatError::new(
                    &format!("{}/manifest.json", self.manifest.dir()),
                    None,
                    format!(
                        "chunks of {:?} cover {covered} of the {} elements of box {}",
                        want.name,
                        want.region.volume().unwrap_or(0),
                        want.region
                    ),
                )
                .into());
            }
        }

        let ranks: Vec<u32> = pieces.keys().copied().collect();
        stats.parts_read = ranks.len();
        let parts: Vec<Arc<RankPart>> = futures::stream::iter(ranks.iter().copied())
            .map(|rank| self.part(rank))
            .buffered(32)
            .try_collect()
            .await?;

        let mut files = Vec::with_capacity(parts.len());
        for (part, (rank, rank_pieces)) in parts.iter().zip(pieces) {
            let object = format!("{}/{}", self.manifest.dir(), part.file.name);
            let part_key = format!(
                "{}/{}",
                self.manifest.dir(),
                crate::format::rank_part_name(rank)
            );
            // By tensor and box: a rank may hold several boxes of one tensor.
            let index = ChunkIndex::new(part);
            let mut runs = Vec::new();
            for (want_index, chunk_region, part_region) in rank_pieces {
                let want = &request.wants[want_index];
                let chunk = index
                    .get(want.name.as_str(), &chunk_region)
                    .ok_or_else(|| {
                        FormatError::new(
                            &part_key,
                            None,
                            format!(
                                "has no chunk {chunk_region} of {:?} that the manifest places there",
                                want.name
                            ),
                        )
                    })?;
                let elem = chunk.dtype.size();
                for_each_run(
                    &part_region,
                    &chunk_region,
                    &want.region,
                    elem,
                    |s, d, len| {
                        runs.push(Run {
                            src: chunk.bytes[0] + s,
                            len,
                            want: want_index,
                            dst: d,
                        });
                    },
                );
            }
            runs.sort_by_key(|r| r.src);
            if let Some(run) = runs.iter().find(|r| {
                r.src
                    .checked_add(r.len)
                    .is_none_or(|end| end > part.file.raw_bytes)
            }) {
                return Err(FormatError::new(
                    &part_key,
                    None,
                    format!(
                        "a chunk of {:?} reaches past the {} raw bytes of its data file (bytes {}..+{})",
                        request.wants[run.want].name, part.file.raw_bytes, run.src, run.len
                    ),
                )
                .into());
            }
            files.push((object, part.clone(), runs));
        }
        self.check_tiling(request, &sizes, &files)?;
        Ok(LoadPlan {
            files,
            sizes,
            stats,
        })
    }

    /// Checks that the runs of every want tile its output exactly: each inside it,
    /// none overlapping another, all together as many bytes as the output. The
    /// manifest's checks make this hold for any checkpoint that parses; it is checked
    /// again here because the lock-free scatter's soundness rests on it.
    fn check_tiling(
        &self,
        request: &LoadRequest,
        sizes: &[u64],
        files: &[(String, Arc<RankPart>, Vec<Run>)],
    ) -> Result<()> {
        let mut spans: Vec<(usize, u64, u64)> = files
            .iter()
            .flat_map(|(_, _, runs)| runs.iter().map(|r| (r.want, r.dst, r.len)))
            .collect();
        spans.sort_unstable();
        let mut filled = vec![0u64; sizes.len()];
        let bad = |want: usize, why: String| -> Error {
            FormatError::new(
                &format!("{}/manifest.json", self.manifest.dir()),
                None,
                format!(
                    "the chunks of {:?} do not tile box {}: {why}",
                    request.wants[want].name, request.wants[want].region
                ),
            )
            .into()
        };
        for (want, dst, len) in spans {
            if dst < filled[want] {
                return Err(bad(want, format!("two chunks overlap at byte {dst}")));
            }
            let end = dst
                .checked_add(len)
                .filter(|&end| end <= sizes[want])
                .ok_or_else(|| {
                    bad(
                        want,
                        format!("bytes {dst}..+{len} lie outside its {} bytes", sizes[want]),
                    )
                })?;
            filled[want] = end;
            // Runs are disjoint and sorted, so `filled` only grows; the sum of the
            // lengths is compared below through the last end and the gaps.
        }
        let mut covered = vec![0u64; sizes.len()];
        for (_, _, runs) in files {
            for r in runs {
                covered[r.want] += r.len;
            }
        }
        for (want, (&c, &size)) in covered.iter().zip(sizes).enumerate() {
            if c != size {
                return Err(bad(want, format!("they cover {c} of its {size} bytes")));
            }
        }
        Ok(())
    }

    /// Reads, verifies and scatters what `plan` (made by [`CheckpointReader::plan`]
    /// for the same `request`) names, into buffers it allocates. See
    /// [`CheckpointReader::load`].
    pub async fn execute(&self, request: &LoadRequest, plan: LoadPlan) -> Result<Loaded> {
        check_plan(request, &plan)?;
        // Sizes claimed by the manifest and parts are checked against the objects
        // before anything is allocated, and allocation failure is an error: a hostile
        // checkpoint whose documents vouch for each other cannot abort the process.
        self.check_stored_sizes(&plan).await?;
        let mut buffers: Vec<Vec<u8>> = request
            .wants
            .iter()
            .zip(&plan.sizes)
            .map(|(want, &n)| zeroed(n, &want.name))
            .collect::<Result<_>>()?;
        let mut outputs: Vec<&mut [u8]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
        let stats = self.read_plan(plan, &mut outputs).await?;
        let tensors = request
            .wants
            .iter()
            .zip(buffers)
            .map(|(want, data)| {
                let tensor = self.manifest.tensor(&want.name).ok_or_else(|| {
                    Error::invalid(format!(
                        "tensor {:?} is not in the checkpoint the plan was made for",
                        want.name
                    ))
                })?;
                Ok(LoadedTensor {
                    name: want.name.clone(),
                    dtype: tensor.dtype,
                    shape: tensor.shape.clone(),
                    region: want.region.clone(),
                    data,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Loaded { tensors, stats })
    }

    /// Reads, verifies and scatters what `plan` (made by [`CheckpointReader::plan`]
    /// for the same `request`) names, into `outputs`. See
    /// [`CheckpointReader::load_into`] for what `outputs` must be and hold after an
    /// error.
    pub async fn execute_into(
        &self,
        request: &LoadRequest,
        plan: LoadPlan,
        outputs: &mut [&mut [u8]],
    ) -> Result<LoadStats> {
        check_plan(request, &plan)?;
        check_outputs(request, &plan.sizes, outputs)?;
        self.check_stored_sizes(&plan).await?;
        self.read_plan(plan, outputs).await
    }

    /// Compares each data file's stored size with what its part records (once per
    /// file and reader: tools load a checkpoint in many slabs).
    pub(crate) async fn check_stored_sizes(&self, plan: &LoadPlan) -> Result<()> {
        let claimed: Vec<(String, u64)> = {
            let sized = self.sized.lock().unwrap_or_else(|p| p.into_inner());
            plan.files
                .iter()
                .filter(|(object, _, _)| !sized.contains(object))
                .map(|(object, part, _)| (object.clone(), part.file.stored_bytes))
                .collect()
        };
        futures::stream::iter(claimed)
            .map(|(object, stored)| async move {
                let info = self.store.head(&object).await.map_err(|e| match e.kind() {
                    ErrorKind::NotFound => Error::from(FormatError::new(
                        &object,
                        None,
                        "data file is missing from a committed checkpoint",
                    )),
                    _ => Error::from(e),
                })?;
                if info.size != stored {
                    return Err(Error::from(FormatError::new(
                        &object,
                        Some(info.size.min(stored)),
                        format!(
                            "{}{} bytes stored, its part records {stored}",
                            if info.size < stored {
                                "truncated: "
                            } else {
                                ""
                            },
                            info.size
                        ),
                    )));
                }
                Ok::<String, Error>(object)
            })
            .buffer_unordered(32)
            .try_collect::<Vec<String>>()
            .await?
            .into_iter()
            .for_each(|object| {
                self.sized
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(object);
            });
        Ok(())
    }

    /// Reads every file of `plan` into `outputs` (checked to match the plan).
    ///
    /// Every write into `outputs` happens inside a poll of this future (see
    /// [`in_this_poll`]): plain local files are read by scoped threads that are all
    /// joined before the poll returns, and fetched batches are verified and copied in
    /// the poll that received them. So no thread can write into the outputs once
    /// the future is dropped, or even leaked with `mem::forget`, and the borrow of
    /// `outputs` ends.
    pub(crate) async fn read_plan(
        &self,
        plan: LoadPlan,
        outputs: &mut [&mut [u8]],
    ) -> Result<LoadStats> {
        let LoadPlan {
            files, mut stats, ..
        } = plan;
        let dest = Arc::new(Outputs::new(outputs));
        let (mut local, mut remote) = (Vec::new(), Vec::new());
        for (object, part, runs) in files {
            let path = match part.codec {
                Codec::None => self.store.local_path(&object)?,
                _ => None,
            };
            let file = FileRead {
                object: Arc::from(object.as_str()),
                map: Arc::new(BlockMap::new(&part)),
                part,
                runs,
                dest: dest.clone(),
            };
            match path {
                Some(path) => local.push((file, path)),
                None => remote.push(file),
            }
        }
        let mut tallies = Vec::new();
        if !local.is_empty() {
            let config = &self.config;
            tallies.extend(in_this_poll(|| {
                on_threads(local, config.file_concurrency, |(file, path)| {
                    file.read_local(&path, config)
                })
            })?);
        }
        let dest = &dest;
        let remote: Vec<Tally> = futures::stream::iter(remote)
            .map(|file| async move {
                let _ = dest;
                file.read_store(&self.store, &self.config).await
            })
            .buffer_unordered(self.config.file_concurrency.max(1))
            .try_collect()
            .await?;
        tallies.extend(remote);
        for tally in tallies {
            stats.bytes_read += tally.read;
            stats.bytes_verified += tally.verified;
            stats.bytes_copied += tally.copied;
            stats.timings.add(&tally.timings);
        }
        Ok(stats)
    }
}

/// Runs `work`, which writes into a load's outputs, to its end within the current
/// poll: through `block_in_place` on a multi-threaded runtime (the runtime moves its
/// other tasks off this worker meanwhile), inline elsewhere.
pub(crate) fn in_this_poll<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// Runs `work` on every item, on at most `threads` scoped threads taking items in
/// order, and returns the results in item order; after a failure no new item starts.
/// Every thread is joined before this returns.
pub(crate) fn on_threads<I: Send, T: Send>(
    items: Vec<I>,
    threads: usize,
    work: impl Fn(I) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let count = items.len();
    let queue = Mutex::new(items.into_iter().enumerate());
    let failed = AtomicBool::new(false);
    let results: Mutex<Vec<(usize, Result<T>)>> = Mutex::new(Vec::with_capacity(count));
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, count.max(1)) {
            scope.spawn(|| {
                loop {
                    if failed.load(Ordering::Acquire) {
                        return;
                    }
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                    let Some((i, item)) = next else { return };
                    let result = work(item);
                    if result.is_err() {
                        failed.store(true, Ordering::Release);
                    }
                    results
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((i, result));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// Checks that `plan` was made for a request with as many wants as `request`.
fn check_plan(request: &LoadRequest, plan: &LoadPlan) -> Result<()> {
    if plan.sizes.len() != request.wants.len() {
        return Err(Error::invalid(format!(
            "the plan has {} boxes, the request {}",
            plan.sizes.len(),
            request.wants.len()
        )));
    }
    Ok(())
}

/// Checks the caller's buffers against the wants' sizes.
pub(crate) fn check_outputs(
    request: &LoadRequest,
    sizes: &[u64],
    outputs: &[&mut [u8]],
) -> Result<()> {
    if outputs.len() != sizes.len() {
        return Err(Error::invalid(format!(
            "{} output buffers for {} requested boxes: load_into takes one per want, in request order",
            outputs.len(),
            sizes.len()
        )));
    }
    for ((want, &size), out) in request.wants.iter().zip(sizes).zip(outputs) {
        if out.len() as u64 != size {
            return Err(Error::invalid(format!(
                "tensor {:?}: the output buffer holds {} bytes, box {} needs {size}",
                want.name,
                out.len(),
                want.region
            )));
        }
    }
    Ok(())
}

/// A zero-filled buffer of `n` bytes, or an error when it cannot be had (rather than
/// the abort of `vec![0; n]`). Zeroed pages come from the allocator lazily, so a load
/// touches only what it writes.
fn zeroed(n: u64, tensor: &str) -> Result<Vec<u8>> {
    let too_big = || {
        Error::Failed(format!(
            "cannot allocate {n} bytes to load tensor {tensor:?}: request a smaller box"
        ))
    };
    let len = usize::try_from(n).map_err(|_| too_big())?;
    zeroed_vec(len, false).ok_or_else(too_big)
}

/// `n` zero elements in fresh memory that the kernel is asked to back with
/// transparent huge pages (Linux; elsewhere plain memory): a destination for
/// [`CheckpointReader::load_into`], or any large buffer written once in full, whose
/// first writes fault in a page per 2 MiB rather than per 4 KiB — several times less
/// time on the machines measured (`docs/BENCHMARKS.md`). Nothing is written up front:
/// the zeros are the kernel's fresh pages. (Staging buffers do not use this: they are
/// faulted in ahead, where asking for huge pages was measured slower; see
/// `src/staging.rs`.)
///
/// Errors: [`Error::Failed`] when the memory cannot be had (rather than the abort of
/// `vec![0; n]`).
pub fn zeroed_huge<T: crate::Element>(n: usize) -> Result<Vec<T>> {
    zeroed_vec(n, true).ok_or_else(|| {
        Error::Failed(format!(
            "cannot allocate {n} elements of {} bytes",
            std::mem::size_of::<T>()
        ))
    })
}

/// `len` zero elements from the allocator (huge pages asked for with `huge`), or
/// `None` when they cannot be had.
fn zeroed_vec<T: crate::Element>(len: usize, huge: bool) -> Option<Vec<T>> {
    let layout = std::alloc::Layout::array::<T>(len).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: `layout` has a non-zero size; a null result is handled; on success the
    // allocation holds `len` initialized elements (all-zero bytes are a valid `T`,
    // which is `Pod`) with the global allocator's layout for a `Vec<T>` of capacity
    // `len`, which is what `from_raw_parts` needs.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    if huge {
        advise_huge_pages(ptr as usize, layout.size());
    }
    // SAFETY: as above.
    Some(unsafe { Vec::from_raw_parts(ptr.cast::<T>(), len, len) })
}

/// Asks the kernel to back the whole huge pages inside the `bytes` bytes at `addr`
/// with transparent huge pages. Best effort; below 4 MiB nothing is asked.
fn advise_huge_pages(addr: usize, bytes: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    if bytes >= 2 * HUGE_PAGE {
        let start = addr.next_multiple_of(HUGE_PAGE);
        let end = (addr + bytes) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: the caller's range is one live allocation, and MADV_HUGEPAGE
            // only changes how the kernel backs its pages, never their contents; a
            // failure leaves ordinary pages.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (addr, bytes, HUGE_PAGE);
}

/// The caller's output buffers as raw pointers, so that reads on several threads can
/// write disjoint runs into them without a lock per copy.
///
/// Sound because (1) the runs of a plan never overlap and lie inside their output
/// (checked by [`CheckpointReader::check_tiling`] before any read, and each run is
/// handed to exactly one task), so no two slices made here alias; (2) the outputs
/// are mutably borrowed by the load for its whole duration, so nothing else reads or
/// writes them meanwhile; (3) every write happens within a poll of the load's future
/// (`in_this_poll`: scoped threads joined before the poll returns), so none can
/// outlive the borrow, even when the future is dropped or leaked.
pub(crate) struct Outputs {
    buffers: Vec<(*mut u8, usize)>,
}

// SAFETY: the pointers are only dereferenced through `Outputs::slice`, whose callers
// uphold the disjointness and lifetime argument above; sending or sharing the
// pointers themselves between threads is harmless.
unsafe impl Send for Outputs {}
// SAFETY: as for `Send`: `&Outputs` only hands out slices under that argument.
unsafe impl Sync for Outputs {}

impl Outputs {
    pub(crate) fn new(outputs: &mut [&mut [u8]]) -> Self {
        Self {
            buffers: outputs
                .iter_mut()
                .map(|o| (o.as_mut_ptr(), o.len()))
                .collect(),
        }
    }

    /// Bytes `dst..dst + len` of output `want`.
    ///
    /// # Safety
    ///
    /// The range must be (part of) one run of the plan these outputs were checked
    /// against, given to this caller alone, and the returned slice must be dropped
    /// before the poll of the load's future that made it returns. Bounds are checked
    /// here.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, want: usize, dst: u64, len: u64) -> &mut [u8] {
        let (ptr, size) = self.buffers[want];
        let (dst, len) = (dst as usize, len as usize);
        assert!(
            dst.checked_add(len).is_some_and(|end| end <= size),
            "run {dst}..+{len} outside output {want} of {size} bytes"
        );
        // SAFETY: in bounds (asserted); not aliased and alive by the caller's
        // contract (see the type's docs).
        unsafe { std::slice::from_raw_parts_mut(ptr.add(dst), len) }
    }
}

/// What reading one file (or one batch) did.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) read: u64,
    pub(crate) verified: u64,
    pub(crate) copied: u64,
    pub(crate) timings: LoadTimings,
}

impl Tally {
    pub(crate) fn add(&mut self, other: &Tally) {
        self.read += other.read;
        self.verified += other.verified;
        self.copied += other.copied;
        self.timings.add(&other.timings);
    }
}

/// CPU time of the calling thread (user and system).
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Where the bytes of one batch go when it is read.
#[derive(Debug, Clone, Copy)]
enum Piece {
    /// Into bytes `dst..dst + len` of output `want`.
    Out { want: usize, dst: u64, len: u64 },
    /// Into scratch (bytes no want asked for, or a batch read whole and copied).
    Scratch { len: u64 },
}

/// A copy out of a batch's verified bytes: `len` bytes at offset `at` of the batch
/// into bytes `dst..` of output `want`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scatter {
    at: u64,
    want: usize,
    dst: u64,
    len: u64,
}

/// Above this many pieces per batch, a batch is read into scratch and copied out:
/// many short runs (a narrow column slice) cost more as buffers of one vectored read
/// than as copies.
const MAX_PIECES: usize = 256;

/// One data file of a load.
pub(crate) struct FileRead {
    pub(crate) object: Arc<str>,
    pub(crate) part: Arc<RankPart>,
    pub(crate) map: Arc<BlockMap>,
    /// Sorted by source offset.
    pub(crate) runs: Vec<Run>,
    pub(crate) dest: Arc<Outputs>,
}

impl FileRead {
    /// The batches of whole blocks to read: the blocks the runs touch, merged, cut
    /// into pieces of at most `batch_bytes` raw bytes.
    pub(crate) fn batches(&self, batch_bytes: u64) -> Vec<Range<u64>> {
        let block = self.part.block_size;
        let mut needed: Vec<Range<u64>> = Vec::new();
        for run in &self.runs {
            let first = run.src / block;
            let last = (run.src + run.len).div_ceil(block);
            match needed.last_mut() {
                Some(r) if first <= r.end => r.end = r.end.max(last),
                _ => needed.push(first..last),
            }
        }
        let per_batch = (batch_bytes / block).max(1);
        needed
            .iter()
            .flat_map(|r| {
                (r.start..r.end)
                    .step_by(per_batch as usize)
                    .map(move |s| s..(s + per_batch).min(r.end))
            })
            .collect()
    }

    /// Raw byte range of `blocks`.
    pub(crate) fn raw_range(&self, blocks: &Range<u64>) -> Range<u64> {
        let block = self.part.block_size;
        blocks.start * block..(blocks.end * block).min(self.part.file.raw_bytes)
    }

    /// The runs' pieces inside raw bytes `raw`, as copies out of a buffer holding
    /// exactly those bytes. `cursor` is the first run that may still matter; it only
    /// moves forward as batches do.
    pub(crate) fn copies(&self, raw: &Range<u64>, cursor: &mut usize) -> Vec<Scatter> {
        while *cursor < self.runs.len()
            && self.runs[*cursor].src + self.runs[*cursor].len <= raw.start
        {
            *cursor += 1;
        }
        let mut copies = Vec::new();
        for run in &self.runs[*cursor..] {
            if run.src >= raw.end {
                break;
            }
            let lo = run.src.max(raw.start);
            let hi = (run.src + run.len).min(raw.end);
            if lo < hi {
                copies.push(Scatter {
                    at: lo - raw.start,
                    want: run.want,
                    dst: run.dst + (lo - run.src),
                    len: hi - lo,
                });
            }
        }
        copies
    }

    /// How to read raw bytes `raw` in place: the pieces of one vectored read, in
    /// file order, or `None` when the copies overlap in the file (two wants of the
    /// same bytes) or are too many, so the batch goes through scratch.
    fn pieces(raw: &Range<u64>, copies: &[Scatter]) -> Option<Vec<Piece>> {
        let mut pieces = Vec::with_capacity(copies.len() * 2 + 1);
        let mut at = 0u64;
        for c in copies {
            if c.at < at {
                return None;
            }
            if c.at > at {
                pieces.push(Piece::Scratch { len: c.at - at });
            }
            pieces.push(Piece::Out {
                want: c.want,
                dst: c.dst,
                len: c.len,
            });
            at = c.at + c.len;
        }
        let len = raw.end - raw.start;
        if at < len {
            pieces.push(Piece::Scratch { len: len - at });
        }
        (pieces.len() <= MAX_PIECES).then_some(pieces)
    }

    /// Reads a plain data file of a local store with positioned reads, straight
    /// into the outputs where the batch's runs allow it, `batches_in_flight` batches
    /// at a time on scoped threads (joined before this returns).
    fn read_local(&self, path: &std::path::Path, config: &ReadConfig) -> Result<Tally> {
        let file = std::fs::File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::from(FormatError::new(
                &self.object,
                None,
                "data file is missing from a committed checkpoint",
            )),
            _ => Error::from(ckpt_storage::Error::new(
                ckpt_storage::io_error_kind(&e),
                format!("open {}: {e}", self.object),
            )),
        })?;
        let scratch: Mutex<Vec<Vec<u8>>> = Mutex::default();
        let mut cursor = 0usize;
        let jobs: Vec<_> = self
            .batches(config.batch_bytes)
            .into_iter()
            .map(|blocks| {
                let raw = self.raw_range(&blocks);
                let copies = self.copies(&raw, &mut cursor);
                (blocks, raw, copies)
            })
            .collect();
        let batches = on_threads(jobs, config.batches_in_flight, |(blocks, raw, copies)| {
            read_batch(
                &mut |at, buffers| crate::blocks::read_into(&file, &self.object, at, buffers),
                &self.object,
                &self.part,
                &self.map,
                &self.dest,
                &scratch,
                blocks,
                raw,
                &copies,
            )
        })?;
        let mut tally = Tally::default();
        for batch in &batches {
            tally.add(batch);
        }
        Ok(tally)
    }

    /// Reads a data file through the store (any backend, any codec): a ranged get
    /// per batch, then checksums, decompression and the copies into the outputs in
    /// the poll that received the batch.
    async fn read_store(self, store: &Store, config: &ReadConfig) -> Result<Tally> {
        let batches = self.batches(config.batch_bytes);
        let mut cursor = 0usize;
        let jobs: Vec<_> = batches
            .into_iter()
            .map(|blocks| {
                let raw = self.raw_range(&blocks);
                let copies = self.copies(&raw, &mut cursor);
                (blocks, copies)
            })
            .collect();
        // About two full batches of bytes in flight: more requests when the runs are
        // short (a rank of a resharded load reads a slice of every chunk of a file),
        // so small reads do not leave the store idle between them.
        let block = self.part.block_size;
        let count = jobs.len().max(1) as u64;
        let mean = jobs
            .iter()
            .map(|(b, _)| (b.end - b.start) * block)
            .sum::<u64>()
            / count;
        let in_flight_batches = (config.batches_in_flight.max(1) as u64 * config.batch_bytes
            / mean.max(1))
        .clamp(2, 16) as usize;
        let this = &self;
        let mut tally = Tally::default();
        let mut done = futures::stream::iter(jobs)
            .map(|(blocks, copies)| async move {
                let mut waited = Duration::ZERO;
                let mut reads = 0;
                loop {
                    let started = Instant::now();
                    let stored =
                        crate::blocks::fetch(store, &this.object, &this.map, &blocks).await?;
                    waited += started.elapsed();
                    reads += 1;
                    // Verified and copied within this poll (see `read_plan`); a batch
                    // that fails its checks copies nothing.
                    match in_this_poll(|| {
                        verify_and_copy(
                            &this.object,
                            &this.part,
                            &this.map,
                            &this.dest,
                            blocks.clone(),
                            stored,
                            &copies,
                        )
                    }) {
                        Ok(mut tally) => {
                            tally.timings.read += waited;
                            return Ok::<_, Error>(tally);
                        }
                        Err(e) if e.is_corruption() && reads < reads_on_mismatch(store) => {
                            warn!(object = %this.object, blocks = ?blocks, error = %e, "blocks failed their checks as read from a remote store; reading them again (damaged in flight?)");
                        }
                        Err(e) => return Err(read_again(e, reads)),
                    }
                }
            })
            .buffered(in_flight_batches);
        while let Some(batch) = done.try_next().await? {
            tally.add(&batch);
        }
        Ok(tally)
    }
}

/// How many times blocks (or a rank part) that fail their checksums are read before
/// the failure counts as corruption at rest: three from a remote store, where bytes
/// cross a network and its middleboxes and a damaged response is transient (the
/// block CRC32 finds it; a second read gets the stored bytes); once from local disk
/// or memory, where reading again returns the same bytes.
fn reads_on_mismatch(store: &Store) -> u32 {
    match store.backend() {
        ckpt_storage::Backend::Local | ckpt_storage::Backend::Memory => 1,
        _ => 3,
    }
}

/// A corruption error found on every one of `reads` reads, saying so.
fn read_again(mut e: Error, reads: u32) -> Error {
    if reads > 1
        && let Error::Corrupt(f) = &mut e
    {
        f.message
            .push_str(&format!(" (the same in {reads} reads: damaged at rest)"));
    }
    e
}

/// A reader of raw bytes of a plain file into memory: `read(at, buffers)` fills
/// `buffers`, back to back, with the bytes from raw offset `at` on.
pub(crate) type ReadRaw<'a> = dyn FnMut(u64, &mut [&mut [u8]]) -> Result<()> + 'a;

/// Reads one batch of a plain file (a local file, a peer's in-memory copy) through
/// `read`: in place when its runs allow (one vectored read into the outputs and
/// scratch for the bytes between them, then the CRC32 of each block over that
/// memory), else into scratch, verified, then copied.
#[allow(clippy::too_many_arguments)]
pub(crate) fn read_batch(
    read: &mut ReadRaw<'_>,
    object: &str,
    part: &RankPart,
    map: &BlockMap,
    dest: &Outputs,
    scratch_pool: &Mutex<Vec<Vec<u8>>>,
    blocks: Range<u64>,
    raw: Range<u64>,
    copies: &[Scatter],
) -> Result<Tally> {
    let len = raw.end - raw.start;
    let pieces = FileRead::pieces(&raw, copies);
    let direct = pieces.is_some();
    let pieces = pieces.unwrap_or_else(|| vec![Piece::Scratch { len }]);
    let scratch_len: u64 = pieces
        .iter()
        .map(|p| match p {
            Piece::Scratch { len } => *len,
            Piece::Out { .. } => 0,
        })
        .sum();
    let mut scratch = scratch_pool
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .pop()
        .unwrap_or_default();
    if (scratch.len() as u64) < scratch_len {
        scratch.resize(scratch_len as usize, 0);
    }
    let mut tally = Tally {
        read: len,
        verified: len,
        ..Tally::default()
    };
    let crcs = &part.file.block_crc32[blocks.start as usize..blocks.end as usize];
    {
        let mut rest: &mut [u8] = &mut scratch[..scratch_len as usize];
        let mut buffers: Vec<&mut [u8]> = pieces
            .iter()
            .map(|p| match *p {
                // SAFETY: an in-place piece is exactly one copy of this batch, i.e.
                // part of one run of the checked plan, read by this thread alone;
                // the slice is dropped at the end of this block, before the scoped
                // thread is joined (see `Outputs`).
                Piece::Out { want, dst, len } => unsafe { dest.slice(want, dst, len) },
                Piece::Scratch { len } => {
                    let (head, tail) = std::mem::take(&mut rest).split_at_mut(len as usize);
                    rest = tail;
                    head
                }
            })
            .collect();
        let (started, cpu) = (Instant::now(), thread_cpu());
        read(raw.start, &mut buffers)?;
        tally.timings.read += started.elapsed();
        tally.timings.read_cpu += thread_cpu().saturating_sub(cpu);
        let started = Instant::now();
        let views: Vec<&[u8]> = buffers.iter().map(|b| &**b).collect();
        crate::blocks::verify_pieces(object, map, &blocks, crcs, &views)?;
        tally.timings.verify += started.elapsed();
    }
    if !direct {
        let started = Instant::now();
        for c in copies {
            // SAFETY: as above: `c` is part of one run of the checked plan, written
            // by this task alone, and the slice does not outlive this statement.
            let out = unsafe { dest.slice(c.want, c.dst, c.len) };
            out.copy_from_slice(&scratch[c.at as usize..(c.at + c.len) as usize]);
            tally.copied += c.len;
        }
        tally.timings.copy += started.elapsed();
    }
    scratch_pool
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(scratch);
    Ok(tally)
}

/// Checks (and decompresses, when `map` says the blocks are stored compressed) the
/// stored bytes of `blocks`, then copies the runs out of the verified raw bytes into
/// the outputs.
pub(crate) fn verify_and_copy(
    object: &str,
    part: &RankPart,
    map: &BlockMap,
    dest: &Outputs,
    blocks: Range<u64>,
    stored: Bytes,
    copies: &[Scatter],
) -> Result<Tally> {
    let compressed = map.is_compressed();
    let crcs = &part.file.block_crc32[blocks.start as usize..blocks.end as usize];
    let mut tally = Tally {
        read: stored.len() as u64,
        ..Tally::default()
    };
    let started = Instant::now();
    let mut plain = Vec::new();
    let mut failure = None;
    crate::blocks::check(
        object,
        map,
        &blocks,
        crcs,
        &stored,
        |_, block| match block {
            Ok(data) => {
                if compressed {
                    plain.extend_from_slice(&data);
                }
                true
            }
            Err(e) => {
                failure = Some(e);
                false
            }
        },
    );
    if let Some(e) = failure {
        return Err(e.into());
    }
    // Uncompressed and sound: the stored bytes are the raw bytes.
    let raw: &[u8] = if compressed { &plain } else { &stored };
    tally.verified = raw.len() as u64;
    tally.timings.verify += started.elapsed();
    let started = Instant::now();
    for c in copies {
        let from = raw
            .get(c.at as usize..(c.at + c.len) as usize)
            .ok_or_else(|| {
                FormatError::new(
                    object,
                    None,
                    format!(
                        "blocks {}..{} decode to {} bytes, fewer than their runs need",
                        blocks.start,
                        blocks.end,
                        raw.len()
                    ),
                )
            })?;
        // SAFETY: `c` is part of one run of the checked plan, written by this task
        // alone, and the slice does not outlive this statement (see `Outputs`).
        let out = unsafe { dest.slice(c.want, c.dst, c.len) };
        out.copy_from_slice(from);
        tally.copied += c.len;
    }
    tally.timings.copy += started.elapsed();
    Ok(tally)
}

/// Loads from the newest committed checkpoint; when it turns out to be corrupt
/// (a checksum mismatch, a missing or truncated file), warns and tries the one before,
/// down to the oldest. Commit records that name no commit are skipped, as every
/// command skips them (see [`crate::catalog::names_a_commit`]). `request` builds the
/// request from the manifest found.
pub async fn load_latest(
    store: &Store,
    request: impl Fn(&Manifest) -> LoadRequest,
) -> Result<(CheckpointReader, Loaded)> {
    let mut walk = crate::catalog::NewestFirst::new(store).await?;
    let mut last_error = None;
    while let Some(commit) = walk.next().await? {
        let attempt = async {
            let manifest = crate::catalog::read_commit(store, &commit).await?;
            let reader = CheckpointReader::from_manifest(store, manifest);
            let loaded = reader.load(&request(reader.manifest())).await?;
            Ok::<_, Error>((reader, loaded))
        };
        match attempt.await {
            Ok(result) => return Ok(result),
            Err(e) if e.is_corruption() => {
                warn!(step = commit.step, dir = %commit.dir, error = %e, "checkpoint is corrupt; falling back to the previous commit");
                last_error = Some(e);
            }
            Err(e @ Error::NotFound(_))
                if !crate::catalog::names_a_commit(store, &commit).await? =>
            {
                warn!(step = commit.step, dir = %commit.dir, error = %e, "skipping a commit record that names no commit");
            }
            Err(e) => return Err(e),
        }
    }
    Err(last_error
        .unwrap_or_else(|| Error::NotFound(format!("no committed checkpoint in {}", store.url()))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_zeroed_buffers_are_zero_and_absurd_sizes_are_errors_not_aborts() {
        let floats: Vec<f32> = zeroed_huge(3 << 20).unwrap();
        assert_eq!(floats.len(), 3 << 20);
        assert!(floats.iter().all(|&x| x == 0.0));
        assert!(zeroed_huge::<u8>(0).unwrap().is_empty());
        let err = zeroed_huge::<u64>(usize::MAX / 4).unwrap_err();
        assert!(matches!(err, Error::Failed(_)), "{err}");
    }
}
