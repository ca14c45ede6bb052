//! Writing one rank's files: block CRC32s (and zstd frames) computed on background
//! threads at lowered priority, the data file uploaded (or written with direct I/O
//! on local disk), then the rank's manifest part. The encode threads are bounded per
//! process, so eight ranks on one node do not each start a thread per core.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use super::{Job, Staged};
use crate::attempt::data_file_name;
use crate::codec::compress_block;
use crate::error::{Error, Result};
use crate::format::{
    Codec, FileEntry, RankPart, ReplicaCrcs, rank_part_name, repeats_a_tensor, version_with_health,
};
use crate::health::{SliceScan, join_scans, scan_blocks};
use crate::upload::{put_part, upload};

pub(super) async fn write_rank(job: &Job) -> Result<()> {
    let config = &job.config;
    let rank = config.rank as u32;
    let dir = job.attempt.dir();
    let block = config.block_size as usize;
    let compressed = matches!(config.codec, Codec::Zstd { .. });
    let file_name = data_file_name(rank, compressed, &crate::attempt::nonce());
    let file_key = format!("{dir}/{file_name}");
    crate::failpoint::hit("before-data-upload");

    // Checksums (and frames), and the health scan, on background threads: CPU work
    // off the async workers. A plain file does not depend on its checksums, so it is
    // written meanwhile.
    let started = Instant::now();
    let (scan, frames, stored_bytes) = match config.codec {
        Codec::None => {
            let (scan, stored) = tokio::try_join!(
                async { encode(job, block, config.codec).await.map(|(scan, _)| scan) },
                write_plain(job, &file_key),
            )?;
            (scan, None, stored)
        }
        Codec::Zstd { .. } => {
            let (scan, frames) = encode(job, block, config.codec).await?;
            let frames = frames.unwrap_or_default();
            upload(&job.store, &file_key, &frames).await?;
            let stored = frames.iter().map(|f| f.len() as u64).sum();
            (scan, Some(frames), stored)
        }
    };
    let encoded = started.elapsed();
    debug!(bytes = stored_bytes, elapsed = ?encoded, "data file written");
    crate::failpoint::hit("after-data-upload");

    let part = describe(
        job,
        file_name,
        stored_bytes,
        scan,
        config.codec,
        frames.as_deref(),
    );
    put_part(
        &job.store,
        &format!("{dir}/{}", rank_part_name(rank)),
        part.to_bytes(),
    )
    .await
}

/// The rank's manifest part of the save `job` staged: its data file `file_name`
/// (`stored_bytes` as stored, encoded with `codec`, `frames` with zstd) with the block CRC32s and health
/// that `scan` found. Warns when the scan found non-finite values.
pub(super) fn describe(
    job: &Job,
    file_name: String,
    stored_bytes: u64,
    scan: Scanned,
    codec: Codec,
    frames: Option<&[Bytes]>,
) -> RankPart {
    let frame_bytes = frames
        .map(|f| f.iter().map(|b| b.len() as u64).collect())
        .unwrap_or_default();
    let raw_bytes = job.buffer.len() as u64;
    describe_file(
        job,
        file_name,
        raw_bytes,
        stored_bytes,
        scan,
        codec,
        frame_bytes,
    )
}

/// [`describe`] for a data file that was never staged whole (`pieces.rs`): its raw
/// length and its frames' lengths are given rather than read from the buffer.
pub(super) fn describe_file(
    job: &Job,
    file_name: String,
    raw_bytes: u64,
    stored_bytes: u64,
    scan: Scanned,
    codec: Codec,
    frame_bytes: Vec<u64>,
) -> RankPart {
    let config = &job.config;
    let rank = config.rank as u32;
    let Scanned {
        crcs,
        nonfinite,
        replicas,
    } = scan;
    let mut health = job.health.clone();
    health.nonfinite = nonfinite;
    health.replicas = replicas;
    if !health.nonfinite.is_empty() {
        let tensors: Vec<&str> = health
            .nonfinite
            .iter()
            .filter_map(|n| job.chunks.get(n.chunk as usize).map(|c| c.tensor.as_str()))
            .collect();
        warn!(
            step = job.attempt.step,
            rank,
            ?tensors,
            "saving non-finite values"
        );
    }
    RankPart {
        // The lowest version that describes the part: at least 4, which carries
        // health; 3 in the data file's header when this rank holds several boxes of
        // one tensor.
        format_version: version_with_health(repeats_a_tensor(
            job.chunks.iter().map(|c| c.tensor.as_str()),
        )),
        step: job.attempt.step,
        attempt: Some(job.attempt.name()),
        rank,
        world_size: config.world_size as u32,
        generation: config.generation,
        block_size: config.block_size,
        codec,
        file: FileEntry {
            name: file_name,
            raw_bytes,
            stored_bytes,
            block_crc32: crcs,
            frame_bytes,
        },
        chunks: job.chunks.clone(),
        global_state: job.global.clone(),
        rank_state: job.rank_state.clone(),
        metadata: if job.global.is_some() {
            job.metadata.clone()
        } else {
            BTreeMap::new()
        },
        health: Some(health),
    }
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

/// What the encode threads found: the file's block CRCs and the part's health scan.
pub(super) struct Scanned {
    crcs: Vec<u32>,
    nonfinite: Vec<crate::format::ChunkNonFinite>,
    replicas: Vec<ReplicaCrcs>,
}

impl Scanned {
    /// What a scan found, put together by a caller that scanned on its own
    /// (`pieces.rs`).
    pub(super) fn new(
        crcs: Vec<u32>,
        nonfinite: Vec<crate::format::ChunkNonFinite>,
        replicas: Vec<ReplicaCrcs>,
    ) -> Self {
        Self {
            crcs,
            nonfinite,
            replicas,
        }
    }
}

/// Block checksums, the health scan (`crate::health`: non-finite counts, the slice
/// CRCs of replicated boxes, those of the replicas staged after the file), and with
/// zstd the frames, computed in parallel slices on threads of their own at a lower
/// scheduling priority.
///
/// Why not tokio's blocking pool: this is background work that competes for the same
/// cores as the training loop, and in particular as other ranks' staging copies (every
/// `save` stall is one memcpy only if nothing else runs). Threads of their own can be
/// niced without lowering the priority of the shared pool's threads for good (an
/// unprivileged thread cannot raise its priority back), and the pool's I/O stays at
/// normal priority.
pub(super) async fn encode(
    job: &Job,
    block: usize,
    codec: Codec,
) -> Result<(Scanned, Option<Vec<Bytes>>)> {
    let buffer = &job.buffer;
    let blocks = buffer.len().div_ceil(block);
    // The replicas staged after the file (device memory), in slices: (replica,
    // slice range); host replicas were hashed while staging.
    let units: Vec<(usize, std::ops::Range<usize>)> = job
        .shadow
        .iter()
        .enumerate()
        .filter(|(_, r)| r.crcs.is_none())
        .flat_map(|(i, r)| {
            let end = r.staged.end;
            r.staged
                .clone()
                .step_by(block)
                .map(move |at| (i, at..(at + block).min(end)))
        })
        .collect();
    let units = Arc::new(units);
    let workers = encode_threads().min(blocks.max(units.len()).max(1));
    let per = blocks.div_ceil(workers);
    let per_unit = units.len().div_ceil(workers);
    let chunks = job.scan_chunks.clone();
    let mut tasks = Vec::with_capacity(workers);
    for w in 0..workers {
        let buffer = buffer.clone();
        let chunks = chunks.clone();
        let units = units.clone();
        // One permit per thread, process-wide: concurrent saves share the budget.
        let permit = ENCODE_PERMITS
            .get_or_init(|| Arc::new(Semaphore::new(encode_threads())))
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Error::Failed("encode permits closed".into()))?;
        tasks.push(spawn_background(
            move || -> std::io::Result<(SliceScan, Vec<Bytes>, Vec<u32>)> {
                let _permit = permit;
                let mine = (w * per).min(blocks)..((w + 1) * per).min(blocks);
                let start = (mine.start * block).min(buffer.len());
                let end = (mine.end * block).min(buffer.len());
                let scan = scan_blocks(&buffer, mine, block, &chunks);
                let frames = match codec {
                    Codec::None => Vec::new(),
                    Codec::Zstd { level, shuffle } => buffer[start..end]
                        .chunks(block)
                        .map(|raw| compress_block(raw, level, shuffle).map(Bytes::from))
                        .collect::<std::io::Result<_>>()?,
                };
                let beyond = buffer.beyond();
                let shadow = units
                    [(w * per_unit).min(units.len())..((w + 1) * per_unit).min(units.len())]
                    .iter()
                    .map(|(_, range)| crc32fast::hash(&beyond[range.clone()]))
                    .collect();
                Ok((scan, frames, shadow))
            },
        ));
    }
    let mut scans = Vec::with_capacity(workers);
    let mut frames = Vec::new();
    let mut shadow_crcs = Vec::with_capacity(units.len());
    for task in tasks {
        let (scan, f, shadow) = task
            .await
            .map_err(|_| Error::Failed("checksum thread panicked".into()))?
            .map_err(|e| Error::Failed(format!("compression failed: {e}")))?;
        scans.push(scan);
        frames.extend(f);
        shadow_crcs.extend(shadow);
    }
    let found = join_scans(scans, &chunks, block);
    let mut shadow_crcs = shadow_crcs.into_iter();
    let replicas = replica_crcs(job, found.replicas, |r| {
        shadow_crcs
            .by_ref()
            .take(r.staged.len().div_ceil(block))
            .collect()
    });
    Ok((
        Scanned {
            crcs: found.crcs,
            nonfinite: found.nonfinite,
            replicas,
        },
        matches!(codec, Codec::Zstd { .. }).then_some(frames),
    ))
}

/// The part's replica CRCs: the written replicated boxes' (`written`, by chunk
/// index), then those of the replicas this rank holds but another writes, hashed
/// while staging or, for those staged after the file, taken from `staged_after`.
pub(super) fn replica_crcs(
    job: &Job,
    written: Vec<(usize, Vec<u32>)>,
    mut staged_after: impl FnMut(&super::ShadowBox) -> Vec<u32>,
) -> Vec<ReplicaCrcs> {
    let mut out: Vec<ReplicaCrcs> = written
        .into_iter()
        .map(|(i, block_crc32)| {
            let chunk = &job.chunks[i];
            ReplicaCrcs {
                tensor: chunk.tensor.clone(),
                dtype: chunk.dtype,
                offsets: chunk.offsets.clone(),
                lengths: chunk.lengths.clone(),
                written: true,
                block_crc32,
            }
        })
        .collect();
    for r in &job.shadow {
        let block_crc32 = match &r.crcs {
            Some(crcs) => crcs.clone(),
            None => staged_after(r),
        };
        out.push(ReplicaCrcs {
            tensor: r.tensor.clone(),
            dtype: r.dtype,
            offsets: r.offsets.clone(),
            lengths: r.lengths.clone(),
            written: false,
            block_crc32,
        });
    }
    out
}

/// Encode threads a process may run at once, over all its saves: the cores divided
/// among the ranks of the node (`LOCAL_WORLD_SIZE`, as launchers set it), at most 8.
/// Eight ranks on a 96-core node then run 8 threads each, not 96.
pub(super) fn encode_threads() -> usize {
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
