//! ckpt itself: one timed save (stall, staged, durable, committed) and one timed load
//! (same world or resharded, allocating or in place) with where its time went.

use super::*;

pub(super) fn make_checkpointers(
    store: &Store,
    config: &BenchConfig,
    codec: Codec,
) -> Result<Vec<Checkpointer>> {
    (0..config.ranks)
        .map(|rank| {
            let mut c = CheckpointConfig::new(rank, config.ranks);
            c.block_size = config.block_size;
            c.codec = codec;
            Checkpointer::new(store.clone(), c)
        })
        .collect()
}

pub(super) struct Saved {
    /// What `save` blocked each rank for, ms.
    pub(super) stalls: Vec<f64>,
    /// When each rank's copy ended, ms after its `save` call.
    pub(super) staged: Vec<f64>,
    pub(super) commit_ms: f64,
    pub(super) file_bytes: u64,
    pub(super) stored_bytes: u64,
}

pub(super) fn save_once(
    rt: &tokio::runtime::Handle,
    checkpointers: &[Checkpointer],
    data: &Workload,
    config: &BenchConfig,
    step: u64,
    overlapped: bool,
) -> Result<Saved> {
    let results = on_ranks(
        checkpointers.len(),
        |rank, barrier| -> Result<(f64, f64, Instant, Instant)> {
            let state = state_of(rank, config, &data[rank])?;
            barrier.wait();
            let started = Instant::now();
            let outcome = if overlapped {
                // SAFETY: the workload is neither written nor freed before this
                // thread has waited for `wait_staged` below.
                rt.block_on(unsafe { checkpointers[rank].save_overlapped(step, &state) })?
            } else {
                rt.block_on(checkpointers[rank].save(step, &state))?
            };
            let handle = outcome;
            let stall = ms(handle.stall());
            let staged = ms(handle.wait_staged()?);
            rt.block_on(handle.committed())?;
            Ok((stall, staged, started, Instant::now()))
        },
    );
    let mut stalls = Vec::new();
    let mut staged = Vec::new();
    let mut first_start: Option<Instant> = None;
    let mut first_commit: Option<Instant> = None;
    for result in results {
        let (stall, staged_after, started, committed) = result?;
        stalls.push(stall);
        staged.push(staged_after);
        first_start = Some(first_start.map_or(started, |s| s.min(started)));
        // The committing rank learns of the commit at once; the others poll for it,
        // so the earliest rank to see it marks the commit.
        first_commit = Some(first_commit.map_or(committed, |c| c.min(committed)));
    }
    let commit_ms = match (first_start, first_commit) {
        (Some(s), Some(c)) => ms(c - s),
        _ => 0.0,
    };
    let store = checkpointers[0].store();
    let manifest = rt.block_on(ckpt::catalog::read_manifest(store, step))?;
    Ok(Saved {
        stalls,
        staged,
        commit_ms,
        file_bytes: manifest.ranks.iter().map(|r| r.raw_bytes).sum(),
        stored_bytes: manifest.ranks.iter().map(|r| r.stored_bytes).sum(),
    })
}

pub(super) struct LoadFigures {
    pub(super) ms: f64,
    pub(super) requested: u64,
    pub(super) read: u64,
    pub(super) breakdown: LoadBreakdown,
}

/// How a bench load gets its output buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LoadMode {
    /// `load_into` buffers allocated and touched before the clock starts.
    InPlace,
    /// `load`, which allocates them.
    Allocating,
}

/// One load of step `step` by `world` rank threads at once, each loading its dim-0
/// shard of every tensor.
#[allow(clippy::too_many_arguments)]
pub(super) fn load_once(
    rt: &tokio::runtime::Handle,
    store: &Store,
    step: u64,
    world: usize,
    data: &Workload,
    config: &BenchConfig,
    verify: bool,
    mode: LoadMode,
) -> Result<LoadFigures> {
    let faults_before = std::sync::Mutex::new(None);
    let results = on_ranks(
        world,
        |rank, barrier| -> Result<(Instant, Instant, LoadStats, f64)> {
            // A trainer's parameters exist before it resumes: the buffers are
            // allocated and every page touched before the clock starts.
            let shape = [config.rows, config.cols];
            let shard = Region::dim0_shard(&shape, rank, world);
            let bytes = shard.volume().unwrap_or(0) as usize * 4;
            let prefault = Instant::now();
            let mut buffers: Vec<Vec<u8>> = match mode {
                LoadMode::InPlace => (0..config.tensors).map(|_| vec![1u8; bytes]).collect(),
                LoadMode::Allocating => Vec::new(),
            };
            let prefault_ms = ms(prefault.elapsed());
            barrier.wait();
            faults_before
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(minor_faults);
            let started = Instant::now();
            // A handle of its own, so that its requests are this rank's alone.
            let store = &store.with_own_counter();
            let (mut stats, request, loaded) = rt.block_on(async {
                let reader = CheckpointReader::open(store, Some(step)).await?;
                let opened = started.elapsed();
                let request = LoadRequest::dim0_shards(reader.manifest(), rank, world);
                let (mut stats, loaded) = match mode {
                    LoadMode::InPlace => {
                        let mut outputs: Vec<&mut [u8]> =
                            buffers.iter_mut().map(Vec::as_mut_slice).collect();
                        (reader.load_into(&request, &mut outputs).await?, None)
                    }
                    LoadMode::Allocating => {
                        let loaded = reader.load(&request).await?;
                        (loaded.stats, Some(loaded))
                    }
                };
                // Opening the checkpoint counts as planning: both come before reads.
                stats.timings.plan += opened;
                Ok::<_, Error>((stats, request, loaded))
            })?;
            let finished = Instant::now();
            // The requests of opening the checkpoint too.
            stats.store_requests = store.request_counts();
            if verify {
                let boxes: Vec<(&str, &Region, &[u8])> = match &loaded {
                    Some(loaded) => loaded
                        .tensors
                        .iter()
                        .map(|t| (t.name.as_str(), &t.region, t.data.as_slice()))
                        .collect(),
                    None => request
                        .wants
                        .iter()
                        .zip(&buffers)
                        .map(|(w, b)| (w.name.as_str(), &w.region, b.as_slice()))
                        .collect(),
                };
                check_loaded(&boxes, data, config)?;
            }
            drop(loaded);
            Ok((started, finished, stats, prefault_ms))
        },
    );
    let faults = minor_faults().saturating_sub(
        faults_before
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .unwrap_or(0),
    );
    let (mut start, mut end): (Option<Instant>, Option<Instant>) = (None, None);
    let (mut requested, mut read) = (0, 0);
    let mut b = LoadBreakdown::default();
    for result in results {
        let (s, e, stats, prefault_ms) = result?;
        start = Some(start.map_or(s, |x| x.min(s)));
        end = Some(end.map_or(e, |x| x.max(e)));
        requested += stats.bytes_requested;
        read += stats.bytes_read;
        let t = &stats.timings;
        b.plan_ms = b.plan_ms.max(ms(t.plan));
        b.read_ms += ms(t.read);
        b.read_cpu_ms += ms(t.read_cpu);
        b.verify_ms += ms(t.verify);
        b.copy_ms += ms(t.copy);
        b.bytes_copied += stats.bytes_copied as f64;
        b.prefault_ms = b.prefault_ms.max(prefault_ms);
        b.bytes_read_from_store += stats.bytes_read_from_store;
        b.bytes_received_from_peers += stats.bytes_received_from_peers;
        b.store_requests += stats.store_requests.into();
        b.unique_bytes += stats.unique_bytes;
    }
    b.io_wait_ms = (b.read_ms - b.read_cpu_ms).max(0.0);
    b.minor_faults = faults as f64;
    let wall = match (start, end) {
        (Some(s), Some(e)) => ms(e - s),
        _ => 0.0,
    };
    b.wall_ms = wall;
    Ok(LoadFigures {
        ms: wall,
        requested,
        read,
        breakdown: b,
    })
}

/// Field by field median of breakdowns.
pub(super) fn median_breakdown(all: &[LoadBreakdown]) -> LoadBreakdown {
    let m = |f: fn(&LoadBreakdown) -> f64| median(&all.iter().map(f).collect::<Vec<_>>());
    LoadBreakdown {
        wall_ms: m(|b| b.wall_ms),
        plan_ms: m(|b| b.plan_ms),
        read_ms: m(|b| b.read_ms),
        read_cpu_ms: m(|b| b.read_cpu_ms),
        io_wait_ms: m(|b| b.io_wait_ms),
        verify_ms: m(|b| b.verify_ms),
        copy_ms: m(|b| b.copy_ms),
        bytes_copied: m(|b| b.bytes_copied),
        minor_faults: m(|b| b.minor_faults),
        prefault_ms: m(|b| b.prefault_ms),
        bytes_read_from_store: m(|b| b.bytes_read_from_store as f64) as u64,
        bytes_received_from_peers: m(|b| b.bytes_received_from_peers as f64) as u64,
        store_requests: super::cooperative::Requests {
            list: m(|b| b.store_requests.list as f64) as u64,
            get: m(|b| b.store_requests.get as f64) as u64,
            head: m(|b| b.store_requests.head as f64) as u64,
        },
        unique_bytes: m(|b| b.unique_bytes as f64) as u64,
    }
}

/// Minor page faults of this process so far.
pub(super) fn minor_faults() -> u64 {
    // SAFETY: `rusage` is plain data for which all-zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid, writable `rusage` for the duration of the call.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0;
    }
    usage.ru_minflt as u64
}

/// Compares loaded row boxes with the generated rows they came from.
pub(super) fn check_loaded(
    boxes: &[(&str, &Region, &[u8])],
    data: &Workload,
    config: &BenchConfig,
) -> Result<()> {
    let row_bytes = (config.cols * 4) as usize;
    let shape = [config.rows, config.cols];
    for (t, &(name, region, bytes)) in boxes.iter().enumerate() {
        let first = region.offsets.first().copied().unwrap_or(0);
        for (i, row) in bytes.chunks(row_bytes).enumerate() {
            let global = first + i as u64;
            let rank = (0..config.ranks)
                .find(|&r| {
                    let b = Region::dim0_shard(&shape, r, config.ranks);
                    global >= b.offsets[0] && global < b.offsets[0] + b.lengths[0]
                })
                .unwrap_or(0);
            let local =
                (global - Region::dim0_shard(&shape, rank, config.ranks).offsets[0]) as usize;
            let src = &as_bytes(&data[rank][t])[local * row_bytes..(local + 1) * row_bytes];
            if src != row {
                return Err(Error::Failed(format!(
                    "bench: row {global} of {name} loaded wrong"
                )));
            }
        }
    }
    Ok(())
}

/// The read strategy of PyTorch DCP's `FileSystemReader` on step `step` of a local
/// store, by `world` rank threads at once: each rank reads every saved rank file
/// its dim-0 box overlaps, one file after another, front to back in one plain
/// buffered stream, one read per stored item (a tensor's chunk, read whole even when
/// only a slice of it is wanted, as DCP reads a resharded item), into memory it
/// touched before the clock started. No checksums and no scatter: a floor for that
/// strategy on this disk, measured in the same repetition as ckpt's loads. Returns
/// ms from the first rank starting to the last finishing; `None` off local disk.
pub(super) fn dcp_read_once(
    rt: &tokio::runtime::Handle,
    store: &Store,
    step: u64,
    world: usize,
    config: &BenchConfig,
) -> Result<Option<f64>> {
    let Some(root) = local_root(store) else {
        return Ok(None);
    };
    let manifest = rt.block_on(ckpt::catalog::read_manifest(store, step))?;
    let shape = [config.rows, config.cols];
    let rows = |rank: usize, of: usize| {
        let b = Region::dim0_shard(&shape, rank, of);
        b.offsets[0]..b.offsets[0] + b.lengths[0]
    };
    let results = on_ranks(world, |rank, barrier| -> Result<(Instant, Instant)> {
        let want = rows(rank, world);
        let files: Vec<(PathBuf, u64)> = (0..config.ranks)
            .filter(|&saved| {
                let have = rows(saved, config.ranks);
                have.start < want.end && want.start < have.end
            })
            .map(|saved| {
                let entry = &manifest.ranks[saved];
                let item = config.bytes_per_rank(saved) / config.tensors.max(1) as u64;
                (root.join(manifest.dir()).join(&entry.file), item.max(1))
            })
            .collect();
        let largest = files.iter().map(|(_, item)| *item).max().unwrap_or(1);
        let sizes: Vec<u64> = files
            .iter()
            .map(|(path, _)| std::fs::metadata(path).map(|m| m.len()))
            .collect::<std::io::Result<_>>()
            .map_err(|e| io_error(&root, e))?;
        let mut memory = vec![1u8; sizes.iter().sum::<u64>().max(largest) as usize];
        barrier.wait();
        let started = Instant::now();
        let mut at = 0usize;
        for ((path, item), size) in files.iter().zip(&sizes) {
            let mut file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
            // The safetensors header first (its length, then the JSON), then the items.
            let mut len = [0u8; 8];
            file.read_exact(&mut len).map_err(|e| io_error(path, e))?;
            let header = u64::from_le_bytes(len).min(*size - 8) as usize;
            file.read_exact(&mut memory[at..at + header])
                .map_err(|e| io_error(path, e))?;
            let (mut left, mut to) = (*size - 8 - header as u64, at + header);
            while left > 0 {
                let n = left.min(*item) as usize;
                file.read_exact(&mut memory[to..to + n])
                    .map_err(|e| io_error(path, e))?;
                (left, to) = (left - n as u64, to + n);
            }
            at = to;
        }
        std::hint::black_box(&memory);
        Ok((started, Instant::now()))
    });
    let (mut start, mut end): (Option<Instant>, Option<Instant>) = (None, None);
    for result in results {
        let (s, e) = result?;
        start = Some(start.map_or(s, |x| x.min(s)));
        end = Some(end.map_or(e, |x| x.max(e)));
    }
    Ok(start.zip(end).map(|(s, e)| ms(e - s)))
}
