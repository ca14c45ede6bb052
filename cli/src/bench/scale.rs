//! Metadata at scale: a synthetic checkpoint description of many tensors and ranks
//! built, parsed and planned without tensor data; and one commit by many simulated
//! ranks, counting requests.

use futures::{StreamExt, TryStreamExt};

use super::*;

/// A synthetic checkpoint written to a store: parts and manifest, no data files.
pub(super) struct Synthetic {
    /// Its step.
    pub step: u64,
    /// Its directory.
    pub dir: String,
    /// Building the manifest from every part, ms.
    pub build_ms: f64,
    /// Bytes of `manifest.json`.
    pub manifest_bytes: u64,
    /// Bytes of rank 0's part.
    pub part_bytes: u64,
}

/// A fresh private memory store.
pub(super) fn private_memory_store(what: &str) -> Result<Store> {
    let name = format!(
        "memory://ckpt-bench-{what}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    Ok(Store::from_url(&name)?)
}

/// Writes to `store` (committed, step 1) the parts and manifest of a checkpoint of
/// `tensors` fp32 tensors, each sharded on dim 0 over `world` saving ranks, without
/// data files. Each tensor is 4096 x 1024 (16 MiB) when the world allows, else a row
/// per rank.
pub(super) async fn write_synthetic(
    store: &Store,
    tensors: usize,
    world: usize,
    block: u64,
) -> Result<Synthetic> {
    let step = 1u64;
    let attempt = ckpt::Attempt::new(step, 0, "bench")?;
    let dir = attempt.dir();
    let rows = (world as u64).max(4096);
    let cols = 1024u64;
    let shape = [rows, cols];
    let mut parts = Vec::with_capacity(world);
    for rank in 0..world {
        let region = Region::dim0_shard(&shape, rank, world);
        let bytes_each = region.volume().unwrap_or(0) * 4;
        let header = 4096u64;
        let chunks: Vec<Chunk> = (0..tensors)
            .map(|t| {
                let begin = header + t as u64 * bytes_each;
                Chunk {
                    tensor: format!("model.layers.{t:04}.weight"),
                    dtype: DType::F32,
                    shape: shape.to_vec(),
                    offsets: region.offsets.clone(),
                    lengths: region.lengths.clone(),
                    bytes: [begin, begin + bytes_each],
                }
            })
            .collect();
        let raw_bytes = header + tensors as u64 * bytes_each;
        let blocks = raw_bytes.div_ceil(block) as usize;
        let part = RankPart {
            // One box per tensor and rank: the version a writer gives it is 2.
            format_version: version_for(false),
            step,
            attempt: Some(attempt.name()),
            rank: rank as u32,
            world_size: world as u32,
            generation: 0,
            block_size: block,
            codec: Codec::None,
            file: FileEntry {
                name: rank_file_name(rank as u32, false),
                raw_bytes,
                stored_bytes: raw_bytes,
                block_crc32: (0..blocks as u32)
                    .map(|b| b.wrapping_mul(0x9e37_79b9))
                    .collect(),
                frame_bytes: Vec::new(),
            },
            chunks,
            global_state: None,
            rank_state: BTreeMap::new(),
            metadata: BTreeMap::new(),
            health: None,
        };
        let bytes = part.to_bytes();
        parts.push((bytes, part));
    }
    let started = Instant::now();
    let refs: Vec<&(Vec<u8>, RankPart)> = parts.iter().collect();
    let manifest = ckpt::testing::build_manifest(&attempt, world as u32, &refs)?;
    drop(refs);
    manifest.validate(&format!("{dir}/{MANIFEST}"))?;
    let manifest_bytes = manifest.to_bytes();
    let build_ms = ms(started.elapsed());
    let part_bytes = parts[0].0.len() as u64;
    let manifest_len = manifest_bytes.len() as u64;
    for (bytes, part) in parts {
        store
            .put(&format!("{dir}/{}", rank_part_name(part.rank)), bytes)
            .await?;
    }
    ckpt::testing::append(
        store,
        &ckpt::testing::CommitRecord::new(&attempt, world as u32),
    )
    .await?;
    store
        .put(&format!("{dir}/{MANIFEST}"), manifest_bytes)
        .await?;
    Ok(Synthetic {
        step,
        dir,
        build_ms,
        manifest_bytes: manifest_len,
        part_bytes,
    })
}

/// Builds a synthetic checkpoint description in a private memory store (parts and
/// manifest, no data files) and times what a committing rank and a loading rank do.
pub(super) async fn metadata_scale(
    config: &BenchConfig,
    progress: &dyn Fn(&str),
) -> Result<MetadataReport> {
    let (tensors, world) = (config.meta_tensors, config.meta_ranks);
    let store = private_memory_store("metadata")?;
    progress("metadata scale: building the manifest");
    let Synthetic {
        step,
        dir,
        build_ms,
        manifest_bytes: manifest_len,
        part_bytes,
    } = write_synthetic(&store, tensors, world, config.block_size).await?;

    progress("metadata scale: open and plan");
    let plan_for = |load_world: usize| {
        let store = store.clone();
        async move {
            let mut opens = Vec::new();
            let mut plans = Vec::new();
            let mut read = 0u64;
            for _ in 0..config.reps.clamp(1, 5) {
                let started = Instant::now();
                let reader = CheckpointReader::open(&store, Some(step)).await?;
                opens.push(ms(started.elapsed()));
                // The middle rank: it straddles saved ranks when resharding.
                let rank = load_world / 2;
                let started = Instant::now();
                let request = LoadRequest::dim0_shards(reader.manifest(), rank, load_world);
                let plan = reader.plan(&request).await?;
                plans.push(ms(started.elapsed()));
                read = manifest_len + plan.parts_read() as u64 * part_bytes;
            }
            Ok::<_, Error>((median(&opens), median(&plans), read))
        }
    };
    let (open_ms, plan_ms, plan_bytes_read) = plan_for(world).await?;
    let reshard_ranks = (world * 3 / 4).max(1);
    let (_, reshard_plan_ms, reshard_plan_bytes_read) = plan_for(reshard_ranks).await?;
    store.delete_prefix(&dir).await?;
    Ok(MetadataReport {
        tensors,
        ranks: world,
        chunks: tensors as u64 * world as u64,
        manifest_bytes: manifest_len,
        part_bytes,
        build_ms,
        open_ms,
        plan_ms,
        plan_bytes_read,
        reshard_ranks,
        reshard_plan_ms,
        reshard_plan_bytes_read,
    })
}

/// Requests and time of one commit by many simulated ranks.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CommitScaleReport {
    /// Simulated ranks.
    pub ranks: usize,
    /// How they were simulated: `checkpointers` (one `Checkpointer` per rank) or
    /// `writers` (`Checkpointer`s for the committer ranks only; every other rank's
    /// data file and part written by `RankFileWriter`, `writers_in_flight` at a time).
    pub simulation: String,
    /// With `writers`: ranks writing at once.
    pub writers_in_flight: usize,
    /// From the first `save` to the last rank's `committed()`.
    pub commit_ms: f64,
    /// From the first `save` until the last rank's part was written.
    pub last_part_ms: f64,
    /// From the last rank's part being written to the first committer's
    /// `committed()` returning (the manifest written).
    pub commit_after_last_part_ms: f64,
    /// Requests of every rank, summed.
    pub requests_total: u64,
    /// Mean requests per rank (data file, part, commit, learning the outcome).
    pub requests_per_rank: f64,
    /// Most requests by a rank that only waits for the outcome (0 with writers).
    pub waiter_requests_max: u64,
    /// Most requests by a committer (its own save, watching the attempt, reading
    /// every part, checking every data file, the log and the manifest).
    pub committer_requests_max: u64,
    /// Requests of the first committer after the last part was written.
    pub committer_requests_after_last_part: u64,
    /// Bytes of the committed `manifest.json`.
    pub manifest_bytes: u64,
}

/// The bench's one-tensor state of `rank`: a dim-0 shard of a `rows` × `cols` f32.
fn commit_shard(rank: usize, ranks: usize, rows: u64, cols: u64) -> (Region, Vec<f32>) {
    let region = Region::dim0_shard(&[rows, cols], rank, ranks);
    let begin = region.offsets[0] * cols;
    let values = (begin..begin + region.lengths[0] * cols)
        .map(|i| i as f32)
        .collect();
    (region, values)
}

/// `ranks` ranks, each with its own request counter on a shared connection pool,
/// save one small dim-0 shard of step 1 under a fresh prefix of `store` and wait for
/// the commit. Counts every request each rank's store handle sends.
///
/// With `writers_in_flight` > 0, only the committer ranks run a `Checkpointer` (the
/// real save and commit path); every other rank writes its data file and part with
/// the library's `RankFileWriter` (the same objects), that many ranks at a time, and
/// does not wait for the outcome, so that a large world is not bounded by the
/// waiters' polling of one test server.
pub(super) async fn commit_scale(
    store: &Store,
    ranks: usize,
    writers_in_flight: usize,
) -> Result<CommitScaleReport> {
    let writers = writers_in_flight > 0;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let run = ckpt::RunId::generate().to_string();
    // The generation of the root's newest commit: not fenced, and fencing nobody.
    let generation = ckpt::testing::newest(store)
        .await?
        .map_or(0, |c| c.record.generation);
    let (rows, cols) = (ranks as u64 * 4, 16u64);
    let committers = CheckpointConfig::new(0, ranks).committers();
    let mut checkpointers = Vec::new();
    let mut stores = Vec::with_capacity(ranks);
    for rank in 0..ranks {
        let own = store.with_own_counter();
        stores.push(own.clone());
        if writers && !committers.contains(&rank) {
            continue;
        }
        let mut config = CheckpointConfig::new(rank, ranks);
        config.run_id = run.clone();
        config.block_size = 4096;
        config.generation = generation;
        checkpointers.push((rank, Checkpointer::new(own, config)?));
    }
    let attempt = ckpt::Attempt::new(1, generation, run.clone())?;
    // When each rank's part was written; the committer's requests at the last one.
    let written = AtomicUsize::new(0);
    let last_part: Mutex<Option<(Instant, u64)>> = Mutex::new(None);
    let part_written = || {
        let at = Instant::now();
        if written.fetch_add(1, Ordering::SeqCst) + 1 == ranks {
            *last_part.lock().expect("not poisoned") = Some((at, stores[0].requests()));
        }
    };

    let started = Instant::now();
    let mut handles = Vec::with_capacity(checkpointers.len());
    for (rank, checkpointer) in &checkpointers {
        let (region, values) = commit_shard(*rank, ranks, rows, cols);
        let mut state = State::new();
        state.add("w", DType::F32, &[rows, cols], region, as_bytes(&values))?;
        handles.push((*rank, checkpointer.save(1, &state).await?));
    }
    let light = (0..ranks).filter(|r| writers && !committers.contains(r));
    let write_light = futures::stream::iter(light)
        .map(|rank| {
            let (store, attempt) = (&stores[rank], &attempt);
            let part_written = &part_written;
            async move {
                let (region, values) = commit_shard(rank, ranks, rows, cols);
                let planned = ckpt::testing::PlannedBox {
                    name: "w".into(),
                    dtype: DType::F32,
                    shape: vec![rows, cols],
                    region,
                };
                let mut writer = ckpt::testing::RankFileWriter::begin(
                    store,
                    attempt,
                    rank as u32,
                    ranks as u32,
                    4096,
                    Codec::None,
                    &[planned],
                )
                .await?;
                writer.write(as_bytes(&values)).await?;
                writer
                    .finish(None, BTreeMap::new(), BTreeMap::new())
                    .await?;
                part_written();
                Ok::<_, Error>(())
            }
        })
        .buffer_unordered(writers_in_flight.max(1))
        .try_collect::<()>();
    let first_committer = std::sync::OnceLock::new();
    let wait_all = futures::future::join_all(handles.iter().map(|(rank, handle)| {
        let (part_written, first_committer) = (&part_written, &first_committer);
        let first = *rank == committers[0];
        async move {
            handle.durable().await?;
            part_written();
            handle.committed().await?;
            if first {
                let _ = first_committer.set(Instant::now());
            }
            Ok::<_, Error>(())
        }
    }));
    let (written_light, results) = futures::join!(write_light, wait_all);
    written_light?;
    let commit_ms = ms(started.elapsed());
    for result in results {
        result?;
    }
    let (last_at, committer_before) = last_part
        .lock()
        .expect("not poisoned")
        .ok_or_else(|| Error::Failed("not every rank wrote its part".into()))?;
    let committed_at = *first_committer
        .get()
        .ok_or_else(|| Error::Failed("the first committer did not report".into()))?;
    let manifest_bytes = store
        .head(&format!("{}/{MANIFEST}", attempt.dir()))
        .await?
        .size;
    let counts: Vec<u64> = stores.iter().map(Store::requests).collect();
    let total: u64 = counts.iter().sum();
    let max_of = |committer: bool| {
        counts
            .iter()
            .enumerate()
            .filter(|(rank, _)| committers.contains(rank) == committer)
            .filter(|_| committer || !writers)
            .map(|(_, &n)| n)
            .max()
            .unwrap_or(0)
    };
    Ok(CommitScaleReport {
        ranks,
        simulation: if writers { "writers" } else { "checkpointers" }.into(),
        writers_in_flight,
        commit_ms,
        last_part_ms: ms(last_at - started),
        commit_after_last_part_ms: ms(committed_at.saturating_duration_since(last_at)),
        requests_total: total,
        requests_per_rank: total as f64 / ranks as f64,
        waiter_requests_max: max_of(false),
        committer_requests_max: max_of(true),
        committer_requests_after_last_part: counts[committers[0]] - committer_before,
        manifest_bytes,
    })
}
