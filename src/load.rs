//! The load path: plan which bytes a rank needs, read them, verify, scatter.
//!
//! A [`LoadRequest`] names, per tensor, the box the rank wants. The planner
//! intersects each wanted box with the saved chunks (through the manifest's layouts,
//! so only the rank parts that matter are fetched), turns every intersection into
//! contiguous runs of bytes, and reads, per data file, just the blocks those runs
//! touch: in batches, coalesced, checksummed block by block, decompressed when the
//! file is compressed. A different world size or layout is the same path.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use ckpt_storage::{ErrorKind, Store};
use futures::{StreamExt, TryStreamExt};
use tracing::warn;

use crate::blocks::BlockMap;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::{
    Assignments, Codec, FormatError, MAX_PART_BYTES, Manifest, RankPart, StateValue,
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
    files: Vec<(String, Arc<RankPart>, Vec<Run>)>,
    /// Bytes of each want's output, in request order.
    sizes: Vec<u64>,
    /// Counters so far (requested bytes, parts read).
    stats: LoadStats,
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
    /// Raw bytes per read batch of one file (memory in flight per file ≈ 2 batches).
    /// Default 16 MiB.
    pub batch_bytes: u64,
    /// Data files read at once. Default 4.
    pub file_concurrency: usize,
}

impl Default for ReadConfig {
    fn default() -> Self {
        Self {
            batch_bytes: 16 << 20,
            file_concurrency: 4,
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
struct Run {
    src: u64,
    len: u64,
    want: usize,
    dst: u64,
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
        let bytes = self
            .store
            .get_range(&key, 0..entry.part_bytes)
            .await
            .map_err(missing)?;
        let crc = crc32fast::hash(&bytes);
        if crc != entry.part_crc32 {
            return Err(FormatError::new(
                &key,
                None,
                format!(
                    "crc32 {crc:08x}, the manifest says {:08x}",
                    entry.part_crc32
                ),
            )
            .into());
        }
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

    /// Loads the boxes of `request`, verified.
    pub async fn load(&self, request: &LoadRequest) -> Result<Loaded> {
        let plan = self.plan(request).await?;
        self.execute(request, plan).await
    }

    /// Plans a load without reading data: checks the request against the manifest,
    /// fetches the rank parts its boxes touch and turns every intersection into byte
    /// runs per data file. [`CheckpointReader::execute`] then reads them; the split
    /// lets the planning cost be measured on its own (`ckpt bench`).
    pub async fn plan(&self, request: &LoadRequest) -> Result<LoadPlan> {
        let manifest = &self.manifest;
        let step = manifest.step;
        let mut stats = LoadStats::default();
        let mut sizes = Vec::with_capacity(request.wants.len());
        // (want index, chunk box, part box) per saved rank.
        let mut pieces: BTreeMap<u32, Vec<(usize, Region, Region)>> = BTreeMap::new();
        for (i, want) in request.wants.iter().enumerate() {
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
            let bytes = want.region.volume().unwrap_or(0) * tensor.dtype.size() as u64;
            stats.bytes_requested += bytes;
            sizes.push(bytes);
            let layout = &manifest.layouts[tensor.layout as usize];
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
            let index: HashMap<&str, usize> = part
                .chunks
                .iter()
                .enumerate()
                .map(|(i, c)| (c.tensor.as_str(), i))
                .collect();
            let mut runs = Vec::new();
            for (want_index, chunk_region, part_region) in rank_pieces {
                let want = &request.wants[want_index];
                let chunk = index
                    .get(want.name.as_str())
                    .map(|&i| &part.chunks[i])
                    .filter(|c| c.region() == chunk_region)
                    .ok_or_else(|| {
                        FormatError::new(
                            &format!("{}/{}", self.manifest.dir(), crate::format::rank_part_name(rank)),
                            None,
                            format!("has no chunk {chunk_region} of {:?} that the manifest places there", want.name),
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
            files.push((object, part.clone(), runs));
        }
        Ok(LoadPlan {
            files,
            sizes,
            stats,
        })
    }

    /// Reads, verifies and scatters what `plan` (made by [`CheckpointReader::plan`]
    /// for the same `request`) names.
    pub async fn execute(&self, request: &LoadRequest, plan: LoadPlan) -> Result<Loaded> {
        let manifest = &self.manifest;
        let LoadPlan {
            files,
            sizes,
            mut stats,
        } = plan;
        if sizes.len() != request.wants.len() {
            return Err(Error::invalid(format!(
                "the plan has {} boxes, the request {}",
                sizes.len(),
                request.wants.len()
            )));
        }
        // Sizes claimed by the manifest and parts are checked against the objects
        // before anything is allocated, and allocation failure is an error: a hostile
        // checkpoint whose documents vouch for each other cannot abort the process.
        let claimed: Vec<(String, u64)> = {
            let sized = self.sized.lock().unwrap_or_else(|p| p.into_inner());
            files
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
        let outputs: Vec<Mutex<Vec<u8>>> = request
            .wants
            .iter()
            .zip(&sizes)
            .map(|(want, &n)| zeroed(n, &want.name).map(Mutex::new))
            .collect::<Result<_>>()?;
        let outputs_ref = &outputs;
        let counters: Vec<(u64, u64)> = futures::stream::iter(files)
            .map(|(object, part, runs)| async move {
                read_file(
                    &self.store,
                    &object,
                    &part,
                    &runs,
                    outputs_ref,
                    self.config.batch_bytes,
                )
                .await
            })
            .buffer_unordered(self.config.file_concurrency.max(1))
            .try_collect()
            .await?;
        for (read, verified) in counters {
            stats.bytes_read += read;
            stats.bytes_verified += verified;
        }

        let tensors = request
            .wants
            .iter()
            .zip(outputs)
            .map(|(want, data)| {
                let tensor = manifest.tensor(&want.name).ok_or_else(|| {
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
                    data: data.into_inner().unwrap_or_else(|p| p.into_inner()),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Loaded { tensors, stats })
    }
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
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| too_big())?;
    // SAFETY: `layout` has a non-zero size; a null result is handled; on success the
    // allocation holds `len` initialized (zero) bytes with the global allocator's
    // layout for a `Vec<u8>` of capacity `len`, which is what `from_raw_parts` needs.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout);
        if ptr.is_null() {
            return Err(too_big());
        }
        Ok(Vec::from_raw_parts(ptr, len, len))
    }
}

/// Reads the blocks `runs` touch in one data file, verifies them and copies the runs
/// into `outputs`. Returns (stored bytes read, raw bytes verified).
async fn read_file(
    store: &Store,
    object: &str,
    part: &RankPart,
    runs: &[Run],
    outputs: &[Mutex<Vec<u8>>],
    batch_bytes: u64,
) -> Result<(u64, u64)> {
    let block = part.block_size;
    let raw_len = part.file.raw_bytes;
    // Needed blocks as sorted, merged ranges of block indices.
    let mut needed: Vec<Range<u64>> = Vec::new();
    for run in runs {
        let first = run.src / block;
        let last = (run.src + run.len).div_ceil(block);
        match needed.last_mut() {
            Some(r) if first <= r.end => r.end = r.end.max(last),
            _ => needed.push(first..last),
        }
    }
    // Batches of whole blocks, at most `batch_bytes` raw each.
    let per_batch = (batch_bytes / block).max(1);
    let batches: Vec<Range<u64>> = needed
        .iter()
        .flat_map(|r| {
            (r.start..r.end)
                .step_by(per_batch as usize)
                .map(move |s| s..(s + per_batch).min(r.end))
        })
        .collect();
    let map = BlockMap::new(part);
    // About two full batches of bytes in flight: more requests when the runs are
    // short (a rank of a resharded load reads a slice of every chunk of a file), so
    // small reads do not leave the device idle between them.
    let batch_count = batches.len().max(1) as u64;
    let mean_batch = batches
        .iter()
        .map(|b| (b.end - b.start) * block)
        .sum::<u64>()
        / batch_count;
    let in_flight = (2 * batch_bytes / mean_batch.max(1)).clamp(2, 16) as usize;
    let mut fetched = futures::stream::iter(batches)
        .map(|blocks| fetch_batch(store, object, part, &map, blocks))
        .buffered(in_flight);
    let mut cursor = 0usize;
    let (mut read, mut verified) = (0u64, 0u64);
    while let Some((blocks, raw, stored)) = fetched.try_next().await? {
        read += stored;
        verified += raw.len() as u64;
        let start = blocks.start * block;
        let end = (blocks.end * block).min(raw_len);
        while cursor < runs.len() && runs[cursor].src + runs[cursor].len <= start {
            cursor += 1;
        }
        for run in &runs[cursor..] {
            if run.src >= end {
                break;
            }
            let lo = run.src.max(start);
            let hi = (run.src + run.len).min(end);
            if lo >= hi {
                continue;
            }
            let mut out = outputs[run.want].lock().unwrap_or_else(|p| p.into_inner());
            let dst = (run.dst + (lo - run.src)) as usize;
            out[dst..dst + (hi - lo) as usize]
                .copy_from_slice(&raw[(lo - start) as usize..(hi - start) as usize]);
        }
    }
    Ok((read, verified))
}

/// Fetches blocks `blocks` of a file, verifies each block's CRC32 (after
/// decompression) and returns their raw bytes and the stored bytes read.
async fn fetch_batch(
    store: &Store,
    object: &str,
    part: &RankPart,
    map: &BlockMap,
    blocks: Range<u64>,
) -> Result<(Range<u64>, Bytes, u64)> {
    let stored = crate::blocks::fetch(store, object, map, &blocks).await?;
    let stored_len = stored.len() as u64;
    let crcs = part.file.block_crc32[blocks.start as usize..blocks.end as usize].to_vec();
    let (object, map, range) = (object.to_string(), map.clone(), blocks.clone());
    let compressed = matches!(part.codec, Codec::Zstd { .. });
    // Checksums and decompression on a blocking thread.
    let raw = tokio::task::spawn_blocking(move || -> Result<Bytes> {
        let mut plain = Vec::new();
        let mut failure = None;
        crate::blocks::check(
            &object,
            &map,
            &range,
            &crcs,
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
        match failure {
            Some(e) => Err(e.into()),
            // Uncompressed and sound: the stored bytes are the raw bytes, no copy.
            None if !compressed => Ok(stored),
            None => Ok(Bytes::from(plain)),
        }
    })
    .await
    .map_err(|e| Error::Failed(format!("verification task failed: {e}")))??;
    Ok((blocks, raw, stored_len))
}

/// Loads from the newest committed checkpoint; when it turns out to be corrupt
/// (a checksum mismatch, a missing or truncated file), warns and tries the one before,
/// down to the oldest. `request` builds the request from the manifest found.
pub async fn load_latest(
    store: &Store,
    request: impl Fn(&Manifest) -> LoadRequest,
) -> Result<(CheckpointReader, Loaded)> {
    let steps = crate::catalog::committed_steps(store).await?;
    let mut last_error = None;
    for step in steps {
        let attempt = async {
            let reader = CheckpointReader::open(store, Some(step)).await?;
            let loaded = reader.load(&request(reader.manifest())).await?;
            Ok::<_, Error>((reader, loaded))
        };
        match attempt.await {
            Ok(result) => return Ok(result),
            Err(e) if e.is_corruption() => {
                warn!(step, error = %e, "checkpoint is corrupt; falling back to the previous commit");
                last_error = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last_error
        .unwrap_or_else(|| Error::NotFound(format!("no committed checkpoint in {}", store.url()))))
}
