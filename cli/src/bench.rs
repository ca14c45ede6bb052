//! `ckpt bench`: ckpt and its baselines, side by side, on the user's own storage.
//!
//! A checkpointing library is only as good as its distance from the hardware, so every
//! figure here comes with the baseline it should be judged against, measured in the
//! same run on the same machine and the same store:
//!
//! - **stall** (what `save` blocks a rank for) against **memcpy**: the same rank
//!   threads each copying the same bytes once into a pre-faulted buffer, at the same
//!   time. The stall's floor is that copy.
//! - **time until committed** against a **raw sequential write** of a file in the same
//!   directory, fsynced (and, for comparison, one written with `O_DIRECT`); for a
//!   remote URL, one object of the same size uploaded through [`Store::upload`].
//! - **load** (same world size, and resharded onto another world size) against a
//!   **raw sequential read** of that file. On local disk the page cache is emptied of
//!   both (`posix_fadvise(DONTNEED)` on clean, fsynced files) before each read, so both
//!   sides read from the device; `--warm` keeps the cache. The tracked loads are in
//!   place ([`CheckpointReader::load_into`]) into buffers each rank allocated and
//!   touched before the clock starts, as a trainer's parameters exist before it
//!   resumes; the allocating `load` is reported beside them, and a breakdown of where
//!   each load's time went.
//! - zstd with and without the byte-shuffle filter: bytes stored, ratio, throughput.
//! - metadata at scale: a synthetic checkpoint description (default 1,000 tensors ×
//!   1,024 ranks) built, parsed and planned without any tensor data.
//! - host RSS over consecutive saves, to show that staging does not grow.
//!
//! Ranks are OS threads of this process; each calls `block_on(checkpointer.save(..))`,
//! so the staging copy runs on the rank's own thread, as in a trainer. Baselines and
//! ckpt runs are interleaved repetition by repetition so that a noisy neighbour
//! disturbs both alike; figures are medians over the repetitions, and ratios are the
//! point (absolute numbers depend on the machine).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use ckpt::storage::{Backend, Store};
use serde::{Deserialize, Serialize};

#[cfg(feature = "cuda")]
pub(crate) mod device;
mod processes;
pub(crate) use processes::{ProcessesReport, rank_main};

use ckpt::{Error, Result};

/// A bad bench configuration or a bad message between bench processes.
fn invalid(message: impl Into<String>) -> Error {
    Error::Invalid(message.into())
}
use ckpt::format::{
    Chunk, Codec, FORMAT_VERSION, FileEntry, MANIFEST, RankPart, rank_file_name, rank_part_name,
    step_dir,
};
use ckpt::load::{CheckpointReader, LoadRequest, LoadStats};
use ckpt::region::Region;
use ckpt::save::{CheckpointConfig, Checkpointer};
use ckpt::state::{State, as_bytes};
use ckpt::{DType, codec};

/// What to run. [`BenchConfig::default`] is workload W1: 4 ranks, 64 fp32 tensors of
/// 8192×1024 sharded on dim 0 (512 MiB per rank, 2 GiB in all), 5 repetitions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct BenchConfig {
    /// Ranks (threads) that save.
    pub ranks: usize,
    /// Ranks that load the resharded checkpoint.
    pub reshard_ranks: usize,
    /// Tensors per checkpoint.
    pub tensors: usize,
    /// Rows of each tensor (dim 0, the sharded one).
    pub rows: u64,
    /// Columns of each tensor.
    pub cols: u64,
    /// Measured repetitions (a warm-up save comes on top).
    pub reps: usize,
    /// Raw bytes per checksum block and zstd frame.
    pub block_size: u64,
    /// zstd level of the compressed runs; `None` skips them.
    pub zstd_level: Option<i32>,
    /// Size of the raw sequential write/read baseline.
    pub raw_bytes: u64,
    /// Also write the raw baseline with `O_DIRECT` (local disk).
    pub direct: bool,
    /// Keep the page cache before reads (local disk) instead of emptying it.
    pub warm: bool,
    /// Seed of the normal(0, 0.02) values.
    pub seed: u64,
    /// Tensors of the synthetic metadata-scale checkpoint; 0 skips it.
    pub meta_tensors: usize,
    /// Ranks of the synthetic metadata-scale checkpoint.
    pub meta_ranks: usize,
    /// Run only the metadata-scale part.
    pub metadata_only: bool,
    /// Simulated ranks of the commit-scale part (0 skips it).
    pub commit_ranks: usize,
    /// Consecutive saves whose RSS is recorded; 0 skips it.
    pub rss_saves: usize,
    /// Bytes of rank 0's data compressed block by block in the codec comparison.
    pub codec_sample_bytes: u64,
    /// Run the core (memcpy, saves, loads), the compressed runs and RSS with every
    /// rank a thread of this process (the top-level figures of [`BenchReport`]).
    pub threads: bool,
    /// Run the core with every rank in a process of its own ([`ProcessesReport`]).
    pub processes: bool,
    /// Store options (`KEY=VALUE`) the rank processes open the store with. Not
    /// reported (they may hold credentials).
    #[serde(skip)]
    pub store_options: Vec<String>,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            ranks: 4,
            reshard_ranks: 3,
            tensors: 64,
            rows: 8192,
            cols: 1024,
            reps: 5,
            block_size: 256 << 10,
            zstd_level: Some(3),
            raw_bytes: 1 << 30,
            direct: true,
            warm: false,
            seed: 42,
            meta_tensors: 1000,
            meta_ranks: 1024,
            metadata_only: false,
            commit_ranks: 0,
            rss_saves: 0,
            codec_sample_bytes: 64 << 20,
            threads: true,
            processes: true,
            store_options: Vec::new(),
        }
    }
}

impl BenchConfig {
    /// Checks the sizes; the error names the value.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.ranks == 0 || self.reshard_ranks == 0 {
            return Err(invalid(format!(
                "ranks {} and reshard ranks {} must be at least 1",
                self.ranks, self.reshard_ranks
            )));
        }
        if self.rows < self.ranks.max(self.reshard_ranks) as u64 || self.cols == 0 {
            return Err(invalid(format!(
                "rows {} must be at least the number of ranks and cols {} at least 1",
                self.rows, self.cols
            )));
        }
        if self.reps == 0 || self.tensors == 0 {
            return Err(invalid(format!(
                "reps {} and tensors {} must be at least 1",
                self.reps, self.tensors
            )));
        }
        if self.raw_bytes < (1 << 20) {
            return Err(invalid(format!(
                "raw baseline of {} bytes is below 1 MiB",
                self.raw_bytes
            )));
        }
        if self.meta_tensors > 0 && self.meta_ranks == 0 {
            return Err(invalid("meta ranks must be at least 1, got 0"));
        }
        Ok(())
    }

    fn bytes_per_rank(&self, rank: usize) -> u64 {
        Region::dim0_shard(&[self.rows, self.cols], rank, self.ranks)
            .volume()
            .unwrap_or(0)
            * 4
            * self.tensors as u64
    }

    fn total_bytes(&self) -> u64 {
        self.rows * self.cols * 4 * self.tensors as u64
    }
}

/// A target of the issue and whether this run met it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Target {
    /// What is compared.
    pub name: String,
    /// The measured value.
    pub value: f64,
    /// The bound.
    pub bound: f64,
    /// `"<="` or `">="`.
    pub relation: &'static str,
    /// Whether the value is within the bound.
    pub met: bool,
}

/// One compressed configuration, saved and loaded end to end.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CodecRun {
    /// `zstd` or `zstd+shuffle4`.
    pub codec: String,
    /// zstd level.
    pub level: i32,
    /// Byte-shuffle width (0: none).
    pub shuffle: u32,
    /// Raw bytes of all data files.
    pub raw_bytes: u64,
    /// Bytes stored.
    pub stored_bytes: u64,
    /// raw ÷ stored.
    pub ratio: f64,
    /// Median time from `save` until committed.
    pub commit_ms: f64,
    /// Raw bytes ÷ commit time.
    pub save_gbps: f64,
    /// Median same-size load time.
    pub load_ms: f64,
    /// Raw bytes ÷ load time.
    pub load_gbps: f64,
}

/// zstd on a sample of the data, block by block on one thread.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CodecSample {
    /// `fp32` or `bf16`.
    pub data: &'static str,
    /// Byte-shuffle width (0: none).
    pub shuffle: u32,
    /// zstd level.
    pub level: i32,
    /// raw ÷ compressed.
    pub ratio: f64,
    /// Raw GB/s compressed, one thread (median of reps).
    pub compress_gbps: f64,
    /// Raw GB/s decompressed, one thread (median of reps).
    pub decompress_gbps: f64,
}

/// The synthetic metadata-scale checkpoint.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MetadataReport {
    /// Tensors.
    pub tensors: usize,
    /// Saving ranks.
    pub ranks: usize,
    /// Chunks in all (tensors × ranks).
    pub chunks: u64,
    /// Bytes of `manifest.json`.
    pub manifest_bytes: u64,
    /// Bytes of one rank part.
    pub part_bytes: u64,
    /// Building the manifest from every part (what the committing rank does), ms.
    pub build_ms: f64,
    /// Reading and parsing (validating) the manifest, ms (median).
    pub open_ms: f64,
    /// Planning one rank's same-size load (parts fetched and parsed included), ms.
    pub plan_ms: f64,
    /// Bytes of metadata that rank reads (manifest + parts).
    pub plan_bytes_read: u64,
    /// World size of the resharded plan.
    pub reshard_ranks: usize,
    /// Planning one rank's resharded load, ms.
    pub reshard_plan_ms: f64,
    /// Bytes of metadata that rank reads (manifest + parts).
    pub reshard_plan_bytes_read: u64,
}

/// Host memory over consecutive saves.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RssReport {
    /// Resident set size after each save committed, MiB.
    pub rss_mib: Vec<f64>,
    /// Last minus second (the first save allocates the staging buffers), MiB.
    pub growth_after_first_mib: f64,
}

/// The core figures of one way of running the ranks (threads of one process, or a
/// process each): the stall against memcpy, overlapped and first saves, the time
/// until committed against a raw write, and loads against a raw read. Medians over
/// the repetitions.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct CoreFigures {
    /// Worst rank's stall of a blocking `save`, ms.
    pub stall_ms: f64,
    /// Worst rank's memcpy of the same bytes, by the same ranks at the same time, into
    /// a pre-faulted buffer, ms.
    pub memcpy_ms: f64,
    /// `stall_ms / memcpy_ms`.
    pub stall_ratio: f64,
    /// Worst rank's stall of `save_overlapped` (registration only), ms.
    pub overlap_stall_ms: f64,
    /// Worst rank's time from `save_overlapped` until its copy ended
    /// (`SaveHandle::staged`), ms.
    pub overlap_staged_ms: f64,
    /// `overlap_stall_ms / memcpy_ms`.
    pub overlap_ratio: f64,
    /// The first save's worst stall (blocking, right after `Checkpointer::warm_up`), ms.
    pub cold_stall_ms: f64,
    /// `cold_stall_ms / stall_ms`: how much slower the first save of a job is.
    pub cold_ratio: f64,
    /// `Checkpointer::warm_up` (staging pool allocated and faulted in), worst rank, ms.
    pub warm_up_ms: f64,
    /// From the first `save` call until the first rank sees the commit, ms.
    pub commit_ms: f64,
    /// Data-file bytes ÷ `commit_ms`, GB/s.
    pub write_gbps: f64,
    /// Raw sequential write (+ fsync) in the same repetitions, GB/s.
    pub raw_write_gbps: f64,
    /// `write_gbps / raw_write_gbps`.
    pub write_ratio: f64,
    /// Same-size load, ms.
    pub load_ms: f64,
    /// Tensor bytes ÷ `load_ms`, GB/s.
    pub read_gbps: f64,
    /// Raw sequential read in the same repetitions, GB/s.
    pub raw_read_gbps: f64,
    /// `read_gbps / raw_read_gbps`.
    pub read_ratio: f64,
    /// Load onto `reshard_ranks` ranks, ms.
    pub reshard_load_ms: f64,
    /// `reshard_load_ms / load_ms`.
    pub reshard_ratio: f64,
}

impl CoreFigures {
    /// Medians and ratios of the samples, by key (a missing key counts as 0).
    fn from_samples(
        samples: &BTreeMap<String, Vec<f64>>,
        file_bytes: u64,
        total_bytes: u64,
    ) -> Self {
        let med = |key: &str| samples.get(key).map_or(0.0, |v| median(v));
        let ratio = |a: f64, b: f64| a / b.max(1e-9);
        let (stall_ms, memcpy_ms) = (med("stall_ms"), med("memcpy_ms"));
        let (overlap_stall_ms, cold_stall_ms) = (med("overlap_stall_ms"), med("cold_stall_ms"));
        let commit_ms = med("commit_ms");
        let write_gbps = gbps(file_bytes, commit_ms / 1e3);
        let raw_write_gbps = med("raw_write_gbps");
        let load_ms = med("load_ms");
        let read_gbps = gbps(total_bytes, load_ms / 1e3);
        let raw_read_gbps = med("raw_read_gbps");
        let reshard_load_ms = med("reshard_load_ms");
        Self {
            stall_ms,
            memcpy_ms,
            stall_ratio: ratio(stall_ms, memcpy_ms),
            overlap_stall_ms,
            overlap_staged_ms: med("overlap_staged_ms"),
            overlap_ratio: ratio(overlap_stall_ms, memcpy_ms),
            cold_stall_ms,
            cold_ratio: ratio(cold_stall_ms, stall_ms),
            warm_up_ms: med("warm_up_ms"),
            commit_ms,
            write_gbps,
            raw_write_gbps,
            write_ratio: ratio(write_gbps, raw_write_gbps),
            load_ms,
            read_gbps,
            raw_read_gbps,
            read_ratio: ratio(read_gbps, raw_read_gbps),
            reshard_load_ms,
            reshard_ratio: ratio(reshard_load_ms, load_ms),
        }
    }
}

/// Everything `ckpt bench` measured. The top-level ratios are the ones scripts track.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BenchReport {
    /// The store benchmarked.
    pub url: String,
    /// The configuration.
    pub config: BenchConfig,
    /// Raw bytes per rank (header included).
    pub bytes_per_rank: u64,
    /// Tensor bytes in all.
    pub total_bytes: u64,
    /// Bytes of all data files (safetensors headers included).
    pub file_bytes: u64,
    /// The core figures with ranks as threads of this process (their keys are at the
    /// top level of the JSON report).
    #[serde(flatten)]
    pub core: CoreFigures,
    /// Each rank's stall, ms (median over reps).
    pub stall_ms_per_rank: Vec<f64>,
    /// Each rank's memcpy, ms (median).
    pub memcpy_ms_per_rank: Vec<f64>,
    /// Raw sequential write with `O_DIRECT`, GB/s (median), when measured.
    pub raw_write_direct_gbps: Option<f64>,
    /// Committed-save GB/s ÷ raw `O_DIRECT` write GB/s, when measured.
    pub write_ratio_direct: Option<f64>,
    /// Bytes read ÷ bytes requested in the resharded load.
    pub reshard_read_amplification: f64,
    /// Whether reads found the page cache emptied first.
    pub cold_reads: bool,
    /// Compressed runs, end to end.
    pub zstd: Vec<CodecRun>,
    /// zstd with and without byte shuffle on fp32 and bf16 samples.
    pub codec_samples: Vec<CodecSample>,
    /// The metadata-scale part.
    pub metadata: Option<MetadataReport>,
    /// The commit-scale part.
    pub commit_scale: Option<CommitScaleReport>,
    /// RSS over consecutive saves.
    pub rss: Option<RssReport>,
    /// The core figures again with one process per rank (`BenchConfig::processes`).
    pub processes: Option<ProcessesReport>,
    /// The targets.
    pub targets: Vec<Target>,
    /// Every repetition's figures, for the curious.
    pub samples: BTreeMap<String, Vec<f64>>,
    /// Same-size load through the allocating `load` (fresh buffers), ms (median);
    /// `load_ms` is the in-place load.
    pub load_alloc_ms: f64,
    /// Where the load time goes, per kind of load (medians over reps).
    pub load_breakdown: LoadBreakdowns,
}

/// Where the time of each kind of load went.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct LoadBreakdowns {
    /// Same world size, in place (`load_ms`).
    pub same_size: LoadBreakdown,
    /// Onto `reshard_ranks` ranks, in place (`reshard_load_ms`).
    pub resharded: LoadBreakdown,
    /// Same world size, allocating `load` (`load_alloc_ms`).
    pub allocating: LoadBreakdown,
}

/// One load's time, split. Apart from `wall_ms` and `plan_ms`, figures are summed
/// over every rank and reading thread (several run at once), each a median over reps.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct LoadBreakdown {
    /// From the first rank starting to the last finishing, ms.
    pub wall_ms: f64,
    /// Opening the checkpoint and planning, slowest rank, ms.
    pub plan_ms: f64,
    /// Inside reads (positioned reads of local files, or ranged gets), ms.
    pub read_ms: f64,
    /// CPU time inside local reads: the kernel's copy into the outputs and page
    /// faults on output pages touched for the first time, ms.
    pub read_cpu_ms: f64,
    /// `read_ms` − `read_cpu_ms`: waiting for the device, ms.
    pub io_wait_ms: f64,
    /// CRC32 checks (and decompression), ms.
    pub verify_ms: f64,
    /// Copies from intermediate buffers into the outputs, ms.
    pub copy_ms: f64,
    /// Tensor bytes that went through such a copy (the rest were read in place).
    pub bytes_copied: f64,
    /// Minor page faults of the process during the load.
    pub minor_faults: f64,
    /// Allocating and touching the output buffers before the load (in place only;
    /// not part of `wall_ms`), slowest rank, ms.
    pub prefault_ms: f64,
}

/// Runs the benchmark against `store` on runtime `rt`; `progress` receives one line
/// per stage.
pub(crate) fn run(
    store: &Store,
    rt: &tokio::runtime::Handle,
    config: &BenchConfig,
    progress: &dyn Fn(&str),
) -> Result<BenchReport> {
    config.validate()?;
    let mut report = empty_report(store, config);
    if config.meta_tensors > 0 {
        progress(&format!(
            "metadata scale: {} tensors x {} ranks",
            config.meta_tensors, config.meta_ranks
        ));
        report.metadata = Some(rt.block_on(metadata_scale(config, progress))?);
    }
    if config.commit_ranks > 0 {
        progress(&format!("commit scale: {} ranks", config.commit_ranks));
        report.commit_scale = Some(rt.block_on(commit_scale(store, config.commit_ranks))?);
    }
    if config.metadata_only {
        report.targets = targets(&report);
        return Ok(report);
    }

    if config.threads {
        progress(&format!(
            "generating {:.2} GiB of normal(0, 0.02) fp32 on {} ranks",
            config.total_bytes() as f64 / (1u64 << 30) as f64,
            config.ranks
        ));
    }
    let raw = RawTarget::new(store, config)?;
    let mut step = 0u64;
    if config.threads {
        let data = generate(config);
        step = threads_core(store, rt, config, &data, &raw, &mut report, progress)?;
    }
    if config.processes {
        // The rank processes generate their own values.
        report.processes = Some(processes::run(store, rt, config, &raw, step + 1, progress)?);
    }
    raw.cleanup();
    report.cold_reads = raw.is_local() && !config.warm;
    report.targets = targets(&report);
    Ok(report)
}

/// The core figures and the compressed runs with every rank a thread of this process;
/// fills `report` and returns the last step used.
fn threads_core(
    store: &Store,
    rt: &tokio::runtime::Handle,
    config: &BenchConfig,
    data: &Workload,
    raw: &RawTarget,
    report: &mut BenchReport,
    progress: &dyn Fn(&str),
) -> Result<u64> {
    let mut samples: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut push = |key: &str, value: f64| samples.entry(key.to_string()).or_default().push(value);

    // memcpy baseline: same threads, same bytes, same time.
    progress("memcpy baseline");
    let per_rank_memcpy = memcpy_baseline(data, config.reps);
    let mut stall_per_rank: Vec<Vec<f64>> = vec![Vec::new(); config.ranks];
    // Same-size in place, resharded in place, same-size allocating.
    let mut breakdowns: [Vec<LoadBreakdown>; 3] = Default::default();

    let checkpointers = make_checkpointers(store, config, Codec::None)?;
    let root = store.url().to_string();
    progress("staging pool warm-up, then the first save");
    let warm_ups = on_ranks(config.ranks, |rank, _| -> Result<f64> {
        let state = state_of(rank, config, &data[rank])?;
        Ok(ms(checkpointers[rank].warm_up(&state)?))
    });
    let warm_up_ms = warm_ups
        .into_iter()
        .collect::<Result<Vec<f64>>>()
        .map(|w| max(&w))?;
    let cold = save_once(rt, &checkpointers, data, config, 1, false)?;
    push("warm_up_ms", warm_up_ms);
    push("cold_stall_ms", max(&cold.stalls));
    let mut step = 1u64;
    // RSS first, before any load: freed load buffers that the allocator keeps
    // would otherwise hide what staging does.
    if config.rss_saves > 0 {
        progress(&format!("rss over {} saves", config.rss_saves));
        let mut rss = Vec::with_capacity(config.rss_saves);
        for _ in 0..config.rss_saves {
            let previous = step;
            step += 1;
            rt.block_on(store.delete_prefix(&step_dir(previous)))?;
            save_once(rt, &checkpointers, data, config, step, false)?;
            rss.push(rss_mib());
        }
        let second = rss.get(1).copied().unwrap_or(rss[0]);
        report.rss = Some(RssReport {
            growth_after_first_mib: rss[rss.len() - 1] - second,
            rss_mib: rss,
        });
    }
    for rep in 0..config.reps {
        progress(&format!("rep {}/{}: raw write", rep + 1, config.reps));
        push("raw_write_gbps", raw.write(rt, config.raw_bytes, false)?);
        if config.direct && raw.is_local() {
            push(
                "raw_write_direct_gbps",
                raw.write(rt, config.raw_bytes, true)?,
            );
        }
        let previous = step;
        step += 1;
        rt.block_on(store.delete_prefix(&step_dir(previous)))?;
        progress(&format!("rep {}/{}: ckpt save", rep + 1, config.reps));
        let saved = save_once(rt, &checkpointers, data, config, step, false)?;
        for (r, s) in saved.stalls.iter().enumerate() {
            stall_per_rank[r].push(*s);
        }
        push("stall_ms", max(&saved.stalls));
        push("commit_ms", saved.commit_ms);
        push("write_gbps", gbps(saved.file_bytes, saved.commit_ms / 1e3));
        // The same save overlapped: it returns once registered, the copy runs on.
        let previous = step;
        step += 1;
        rt.block_on(store.delete_prefix(&step_dir(previous)))?;
        progress(&format!(
            "rep {}/{}: ckpt save, overlapped",
            rep + 1,
            config.reps
        ));
        let overlapped = save_once(rt, &checkpointers, data, config, step, true)?;
        push("overlap_stall_ms", max(&overlapped.stalls));
        push("overlap_staged_ms", max(&overlapped.staged));
        push("overlap_commit_ms", overlapped.commit_ms);

        progress(&format!("rep {}/{}: raw read", rep + 1, config.reps));
        push(
            "raw_read_gbps",
            raw.read(rt, config.raw_bytes, config.warm)?,
        );
        progress(&format!("rep {}/{}: ckpt load", rep + 1, config.reps));
        evict_step(&root, step, config.warm);
        let loaded = load_once(
            rt,
            store,
            step,
            config.ranks,
            data,
            config,
            rep == 0,
            LoadMode::InPlace,
        )?;
        push("load_ms", loaded.ms);
        push("read_gbps", gbps(loaded.requested, loaded.ms / 1e3));
        breakdowns[0].push(loaded.breakdown);
        progress(&format!(
            "rep {}/{}: ckpt load onto {} ranks",
            rep + 1,
            config.reps,
            config.reshard_ranks
        ));
        evict_step(&root, step, config.warm);
        let resharded = load_once(
            rt,
            store,
            step,
            config.reshard_ranks,
            data,
            config,
            rep == 0,
            LoadMode::InPlace,
        )?;
        push("reshard_load_ms", resharded.ms);
        push(
            "reshard_read_amplification",
            resharded.read as f64 / resharded.requested.max(1) as f64,
        );
        breakdowns[1].push(resharded.breakdown);
        progress(&format!(
            "rep {}/{}: ckpt load, allocating",
            rep + 1,
            config.reps
        ));
        evict_step(&root, step, config.warm);
        let allocating = load_once(
            rt,
            store,
            step,
            config.ranks,
            data,
            config,
            rep == 0,
            LoadMode::Allocating,
        )?;
        push("load_alloc_ms", allocating.ms);
        breakdowns[2].push(allocating.breakdown);
    }
    let file_bytes = cold.file_bytes;

    drop(checkpointers);
    rt.block_on(store.delete_prefix(&step_dir(step)))?;

    if let Some(level) = config.zstd_level {
        for shuffle in [0u32, 4] {
            let codec = Codec::Zstd { level, shuffle };
            let label = codec_label(codec);
            progress(&format!("{label} level {level}: warm-up save"));
            let checkpointers = make_checkpointers(store, config, codec)?;
            step += 1;
            let first = save_once(rt, &checkpointers, data, config, step, false)?;
            let (mut commit, mut load) = (Vec::new(), Vec::new());
            for rep in 0..config.reps {
                progress(&format!("{label}: rep {}/{}", rep + 1, config.reps));
                let previous = step;
                step += 1;
                rt.block_on(store.delete_prefix(&step_dir(previous)))?;
                let saved = save_once(rt, &checkpointers, data, config, step, false)?;
                commit.push(saved.commit_ms);
                evict_step(&root, step, config.warm);
                let loaded = load_once(
                    rt,
                    store,
                    step,
                    config.ranks,
                    data,
                    config,
                    rep == 0,
                    LoadMode::InPlace,
                )?;
                load.push(loaded.ms);
            }
            rt.block_on(store.delete_prefix(&step_dir(step)))?;
            let (commit_ms, load_ms) = (median(&commit), median(&load));
            report.zstd.push(CodecRun {
                codec: label.clone(),
                level,
                shuffle,
                raw_bytes: first.file_bytes,
                stored_bytes: first.stored_bytes,
                ratio: first.file_bytes as f64 / first.stored_bytes.max(1) as f64,
                commit_ms,
                save_gbps: gbps(first.file_bytes, commit_ms / 1e3),
                load_ms,
                load_gbps: gbps(config.total_bytes(), load_ms / 1e3),
            });
            samples.insert(format!("{label}_commit_ms"), commit);
            samples.insert(format!("{label}_load_ms"), load);
        }
        progress("codec samples (fp32, bf16; with and without shuffle)");
        report.codec_samples = codec_samples(data, config, level)?;
    }
    samples.insert("memcpy_ms".into(), per_rank_memcpy.worst);
    report.core = CoreFigures::from_samples(&samples, file_bytes, config.total_bytes());
    report.stall_ms_per_rank = stall_per_rank.iter().map(|v| median(v)).collect();
    report.memcpy_ms_per_rank = per_rank_memcpy.per_rank;
    report.raw_write_direct_gbps = samples.get("raw_write_direct_gbps").map(|v| median(v));
    report.write_ratio_direct = report
        .raw_write_direct_gbps
        .map(|direct| report.core.write_gbps / direct.max(1e-9));
    report.reshard_read_amplification = samples
        .get("reshard_read_amplification")
        .map_or(0.0, |v| median(v));
    report.load_alloc_ms = samples.get("load_alloc_ms").map_or(0.0, |v| median(v));
    let [same_size, resharded, allocating] = breakdowns.map(|b| median_breakdown(&b));
    report.load_breakdown = LoadBreakdowns {
        same_size,
        resharded,
        allocating,
    };
    report.file_bytes = file_bytes;
    report.samples = samples;
    Ok(step)
}

fn empty_report(store: &Store, config: &BenchConfig) -> BenchReport {
    BenchReport {
        url: store.url().to_string(),
        config: config.clone(),
        bytes_per_rank: config.bytes_per_rank(0),
        total_bytes: config.total_bytes(),
        file_bytes: 0,
        core: CoreFigures::default(),
        stall_ms_per_rank: Vec::new(),
        memcpy_ms_per_rank: Vec::new(),
        raw_write_direct_gbps: None,
        write_ratio_direct: None,
        reshard_read_amplification: 0.0,
        cold_reads: false,
        zstd: Vec::new(),
        codec_samples: Vec::new(),
        metadata: None,
        commit_scale: None,
        rss: None,
        processes: None,
        targets: Vec::new(),
        samples: BTreeMap::new(),
        load_alloc_ms: 0.0,
        load_breakdown: LoadBreakdowns::default(),
    }
}

fn targets(r: &BenchReport) -> Vec<Target> {
    let le = |name: &str, value: f64, bound: f64| Target {
        name: name.to_string(),
        value,
        bound,
        relation: "<=",
        met: value <= bound,
    };
    let ge = |name: &str, value: f64, bound: f64| Target {
        name: name.to_string(),
        value,
        bound,
        relation: ">=",
        met: value >= bound,
    };
    let mut out = Vec::new();
    if !r.config.metadata_only && r.config.threads {
        out.push(le("stall / memcpy", r.core.stall_ratio, 1.5));
        out.push(le("overlapped stall / memcpy", r.core.overlap_ratio, 0.1));
        out.push(le("first save's stall / stall", r.core.cold_ratio, 2.0));
        out.push(ge("committed save / raw write", r.core.write_ratio, 0.7));
        if let Some(direct) = r.write_ratio_direct {
            out.push(ge("committed save / raw O_DIRECT write", direct, 0.7));
        }
        out.push(ge("same-size load / raw read", r.core.read_ratio, 0.9));
        out.push(le("resharded / same-size load", r.core.reshard_ratio, 1.1));
        out.push(le(
            "reshard bytes read / requested",
            r.reshard_read_amplification,
            1.05,
        ));
    }
    if let Some(p) = &r.processes {
        out.push(le("processes: stall / memcpy", p.core.stall_ratio, 1.5));
        out.push(le(
            "processes: overlapped stall / memcpy",
            p.core.overlap_ratio,
            0.1,
        ));
        out.push(le(
            "processes: first save's stall / stall",
            p.core.cold_ratio,
            2.0,
        ));
        out.push(ge(
            "processes: same-size load / raw read",
            p.core.read_ratio,
            0.9,
        ));
        out.push(le(
            "processes: resharded / same-size load",
            p.core.reshard_ratio,
            1.1,
        ));
    }
    if let Some(m) = &r.metadata {
        out.push(le("metadata: plan one rank (ms)", m.plan_ms, 1000.0));
        out.push(le(
            "metadata: read by one rank (MiB)",
            m.plan_bytes_read as f64 / (1 << 20) as f64,
            16.0,
        ));
    }
    out
}

fn codec_label(codec: Codec) -> String {
    match codec {
        Codec::Zstd { shuffle, .. } if shuffle > 1 => format!("zstd+shuffle{shuffle}"),
        Codec::Zstd { .. } => "zstd".into(),
        Codec::None => "none".into(),
    }
}

/// Median of a non-empty slice (0 when empty).
fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn max(values: &[f64]) -> f64 {
    values.iter().copied().fold(0.0, f64::max)
}

fn gbps(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds.max(1e-9) / 1e9
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---------------------------------------------------------------------------------
// Workload

/// Each rank's tensors: `tensors` row-major fp32 shards.
type Workload = Vec<Vec<Vec<f32>>>;

/// splitmix64: a tiny seeded generator, so the workload is the same on every run.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

/// Values from normal(0, 0.02), Box-Muller, seeded per (rank, tensor).
fn generate(config: &BenchConfig) -> Workload {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..config.ranks)
            .map(|rank| scope.spawn(move || generate_rank(config, rank)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("generator thread panicked"))
            .collect()
    })
}

/// Rank `rank`'s tensors: its dim-0 shard of each, seeded per (rank, tensor).
fn generate_rank(config: &BenchConfig, rank: usize) -> Vec<Vec<f32>> {
    let region = Region::dim0_shard(&[config.rows, config.cols], rank, config.ranks);
    let n = region.volume().unwrap_or(0) as usize;
    (0..config.tensors)
        .map(|t| {
            let mut rng = SplitMix(
                config.seed ^ ((rank as u64) << 32) ^ (t as u64).wrapping_mul(0x1000_0001),
            );
            let mut v = Vec::with_capacity(n);
            while v.len() < n {
                let (u1, u2) = (rng.unit(), rng.unit());
                let r = (-2.0 * u1.ln()).sqrt() * 0.02;
                let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
                v.push((r * c) as f32);
                if v.len() < n {
                    v.push((r * s) as f32);
                }
            }
            v
        })
        .collect()
}

fn state_of<'a>(rank: usize, config: &BenchConfig, data: &'a [Vec<f32>]) -> Result<State<'a>> {
    let mut state = State::new();
    for (t, values) in data.iter().enumerate() {
        state.add_dim0_shard(
            format!("layers.{t:03}.weight"),
            DType::F32,
            &[config.rows, config.cols],
            rank,
            config.ranks,
            as_bytes(values),
        )?;
    }
    state.set_rank_json("data_cursor", serde_json::json!({ "rank": rank }));
    Ok(state)
}

/// Runs `f(rank, barrier)` on `n` OS threads at once and collects the results.
fn on_ranks<T: Send>(n: usize, f: impl Fn(usize, &Barrier) -> T + Sync) -> Vec<T> {
    let barrier = Barrier::new(n);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, barrier) = (&f, &barrier);
                scope.spawn(move || f(rank, barrier))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

// ---------------------------------------------------------------------------------
// memcpy

struct MemcpyFigures {
    /// Worst rank per rep, ms.
    worst: Vec<f64>,
    /// Median per rank, ms.
    per_rank: Vec<f64>,
}

fn memcpy_baseline(data: &Workload, reps: usize) -> MemcpyFigures {
    let times: Vec<Vec<f64>> = on_ranks(data.len(), |rank, barrier| {
        let bytes: usize = data[rank].iter().map(|t| t.len() * 4).sum();
        // Pre-faulted destination, as the staging pool is after the first save.
        let mut dst = vec![1u8; bytes];
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            barrier.wait();
            let started = Instant::now();
            let mut offset = 0;
            for t in &data[rank] {
                let src = as_bytes(t);
                dst[offset..offset + src.len()].copy_from_slice(src);
                offset += src.len();
            }
            std::hint::black_box(&mut dst);
            times.push(ms(started.elapsed()));
        }
        times
    });
    let reps_n = times.first().map_or(0, Vec::len);
    MemcpyFigures {
        worst: (0..reps_n)
            .map(|i| times.iter().map(|t| t[i]).fold(0.0, f64::max))
            .collect(),
        per_rank: times.iter().map(|t| median(t)).collect(),
    }
}

// ---------------------------------------------------------------------------------
// ckpt save and load

fn make_checkpointers(
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

struct Saved {
    /// What `save` blocked each rank for, ms.
    stalls: Vec<f64>,
    /// When each rank's copy ended, ms after its `save` call.
    staged: Vec<f64>,
    commit_ms: f64,
    file_bytes: u64,
    stored_bytes: u64,
}

fn save_once(
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

struct LoadFigures {
    ms: f64,
    requested: u64,
    read: u64,
    breakdown: LoadBreakdown,
}

/// How a bench load gets its output buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LoadMode {
    /// `load_into` buffers allocated and touched before the clock starts.
    InPlace,
    /// `load`, which allocates them.
    Allocating,
}

/// One load of step `step` by `world` rank threads at once, each loading its dim-0
/// shard of every tensor.
#[allow(clippy::too_many_arguments)]
fn load_once(
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
            let (stats, request, loaded) = rt.block_on(async {
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
fn median_breakdown(all: &[LoadBreakdown]) -> LoadBreakdown {
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
    }
}

/// Minor page faults of this process so far.
fn minor_faults() -> u64 {
    // SAFETY: `rusage` is plain data for which all-zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid, writable `rusage` for the duration of the call.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0;
    }
    usage.ru_minflt as u64
}

/// Compares loaded row boxes with the generated rows they came from.
fn check_loaded(
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

// ---------------------------------------------------------------------------------
// Raw baselines

/// Where the raw sequential write/read baseline goes.
enum RawTarget {
    /// A file in the store's directory.
    Local(PathBuf),
    /// One object uploaded through the store.
    Remote(Store),
}

const RAW_KEY: &str = ".ckpt-bench/raw-sequential";
const RAW_CHUNK: usize = 8 << 20;

impl RawTarget {
    fn new(store: &Store, _config: &BenchConfig) -> Result<Self> {
        Ok(match (store.backend(), local_root(store)) {
            (Backend::Local, Some(root)) => {
                let dir = root.join(".ckpt-bench");
                std::fs::create_dir_all(&dir).map_err(|e| io_error(&dir, e))?;
                RawTarget::Local(dir.join("raw-sequential"))
            }
            _ => RawTarget::Remote(store.clone()),
        })
    }

    fn is_local(&self) -> bool {
        matches!(self, RawTarget::Local(_))
    }

    /// Writes `bytes` sequentially (+ fsync), returns GB/s.
    fn write(&self, rt: &tokio::runtime::Handle, bytes: u64, direct: bool) -> Result<f64> {
        let chunk = AlignedBuf::filled(RAW_CHUNK);
        match self {
            RawTarget::Local(path) => {
                let _ = std::fs::remove_file(path);
                let mut options = std::fs::OpenOptions::new();
                options.write(true).create(true).truncate(true);
                if direct {
                    use std::os::unix::fs::OpenOptionsExt;
                    options.custom_flags(libc::O_DIRECT);
                }
                let started = Instant::now();
                let mut file = options.open(path).map_err(|e| io_error(path, e))?;
                let mut left = bytes;
                while left > 0 {
                    let n = left.min(RAW_CHUNK as u64) as usize;
                    file.write_all(&chunk.as_slice()[..n])
                        .map_err(|e| io_error(path, e))?;
                    left -= n as u64;
                }
                file.sync_all().map_err(|e| io_error(path, e))?;
                Ok(gbps(bytes, started.elapsed().as_secs_f64()))
            }
            RawTarget::Remote(store) => {
                let shared = bytes::Bytes::copy_from_slice(chunk.as_slice());
                let started = Instant::now();
                rt.block_on(async {
                    let mut upload = store.upload(RAW_KEY)?;
                    let mut left = bytes;
                    while left > 0 {
                        let n = left.min(RAW_CHUNK as u64) as usize;
                        upload.write(shared.slice(..n)).await?;
                        left -= n as u64;
                    }
                    upload.finish().await
                })?;
                Ok(gbps(bytes, started.elapsed().as_secs_f64()))
            }
        }
    }

    /// Reads the whole baseline file sequentially, returns GB/s.
    fn read(&self, rt: &tokio::runtime::Handle, bytes: u64, warm: bool) -> Result<f64> {
        match self {
            RawTarget::Local(path) => {
                if !warm {
                    evict(path);
                }
                let mut buf = vec![0u8; RAW_CHUNK];
                let started = Instant::now();
                let mut file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
                let mut total = 0u64;
                loop {
                    let n = file.read(&mut buf).map_err(|e| io_error(path, e))?;
                    if n == 0 {
                        break;
                    }
                    total += n as u64;
                }
                std::hint::black_box(&buf);
                Ok(gbps(total.max(1), started.elapsed().as_secs_f64()))
            }
            RawTarget::Remote(store) => {
                let started = Instant::now();
                let data = rt.block_on(store.get(RAW_KEY))?;
                let total = data.len() as u64;
                debug_assert_eq!(total, bytes);
                Ok(gbps(total.max(1), started.elapsed().as_secs_f64()))
            }
        }
    }

    fn cleanup(&self) {
        if let RawTarget::Local(path) = self {
            let _ = std::fs::remove_file(path);
            if let Some(dir) = path.parent() {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

/// A page-aligned buffer of non-zero bytes (`O_DIRECT` needs alignment).
struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len, 4096).expect("valid layout")
    }

    fn filled(len: usize) -> Self {
        assert!(len > 0, "an aligned buffer holds at least one byte");
        // Zeroed, so that the slice below never covers uninitialized memory.
        // SAFETY: the layout's size is non-zero (asserted above), which is all that
        // `alloc_zeroed` requires; a null result is handled next.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout(len)) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(Self::layout(len));
        }
        // SAFETY: `ptr` is non-null, aligned, valid for `len` bytes and initialized
        // (zeroed); this is the only reference to the fresh allocation.
        let slice = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        let mut rng = SplitMix(7);
        for chunk in slice.chunks_mut(8) {
            let v = rng.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
        Self { ptr, len }
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialized bytes (zeroed, then filled, in
        // `filled`) that are freed only in `drop`, and nothing mutates them after
        // construction, so a shared borrow of `self` can lend them out.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from the global allocator in `filled` with exactly this
        // layout (`len` never changes) and is freed only here, once.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.len)) }
    }
}

/// The directory of a local store.
fn local_root(store: &Store) -> Option<PathBuf> {
    match store.backend() {
        Backend::Local => store.url().strip_prefix("file://").map(PathBuf::from),
        _ => None,
    }
}

fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::Failed(format!("bench: {}: {e}", path.display()))
}

/// Drops a clean (fsynced) file's pages from the page cache, so the next read comes
/// from the device. Best effort.
fn evict(path: &Path) {
    use std::os::fd::AsRawFd;
    if let Ok(file) = std::fs::File::open(path) {
        // SAFETY: `posix_fadvise` takes no pointers; the descriptor stays open for
        // the call because `file` is alive, and the advice only drops clean cached
        // pages, never data.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
}

/// Evicts every file of step `step` of a local store (no-op elsewhere or when warm).
fn evict_step(url: &str, step: u64, warm: bool) {
    if warm {
        return;
    }
    let Some(root) = url.strip_prefix("file://") else {
        return;
    };
    // Format v2 keeps a save's files in an attempt directory inside the step's.
    let mut dirs = vec![Path::new(root).join(step_dir(step))];
    while let Some(dir) = dirs.pop() {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(entry.path());
                } else {
                    evict(&entry.path());
                }
            }
        }
    }
}

/// Resident set size of this process, MiB.
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

// ---------------------------------------------------------------------------------
// Codec samples

fn codec_samples(data: &Workload, config: &BenchConfig, level: i32) -> Result<Vec<CodecSample>> {
    let block = config.block_size as usize;
    let mut fp32 = Vec::new();
    for t in &data[0] {
        if fp32.len() as u64 >= config.codec_sample_bytes {
            break;
        }
        fp32.extend_from_slice(as_bytes(t));
    }
    fp32.truncate(config.codec_sample_bytes as usize);
    // bf16: each fp32 rounded to nearest even.
    let bf16: Vec<u8> = fp32
        .chunks_exact(4)
        .flat_map(|b| {
            half::bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes()
        })
        .collect();
    let mut out = Vec::new();
    for (name, bytes, width) in [("fp32", &fp32, 4u32), ("bf16", &bf16, 2u32)] {
        for shuffle in [0, width] {
            let codec = Codec::Zstd { level, shuffle };
            let (mut c_times, mut d_times) = (Vec::new(), Vec::new());
            let mut stored = 0usize;
            for _ in 0..config.reps.min(3) {
                let started = Instant::now();
                let frames: Vec<Vec<u8>> = bytes
                    .chunks(block)
                    .map(|raw| codec::compress_block(raw, level, shuffle))
                    .collect::<std::io::Result<_>>()
                    .map_err(|e| Error::Failed(format!("bench: zstd: {e}")))?;
                c_times.push(started.elapsed().as_secs_f64());
                stored = frames.iter().map(Vec::len).sum();
                let started = Instant::now();
                for (frame, raw) in frames.iter().zip(bytes.chunks(block)) {
                    let back = codec::decompress_block(frame, raw.len(), codec)
                        .map_err(|e| Error::Failed(format!("bench: zstd: {e}")))?;
                    std::hint::black_box(back);
                }
                d_times.push(started.elapsed().as_secs_f64());
            }
            out.push(CodecSample {
                data: name,
                shuffle,
                level,
                ratio: bytes.len() as f64 / stored.max(1) as f64,
                compress_gbps: gbps(bytes.len() as u64, median(&c_times)),
                decompress_gbps: gbps(bytes.len() as u64, median(&d_times)),
            });
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------
// Metadata scale

/// Builds a synthetic checkpoint description in a private memory store (parts and
/// manifest, no data files) and times what a committing rank and a loading rank do.
async fn metadata_scale(config: &BenchConfig, progress: &dyn Fn(&str)) -> Result<MetadataReport> {
    let (tensors, world) = (config.meta_tensors, config.meta_ranks);
    let name = format!(
        "memory://ckpt-bench-metadata-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let store = Store::from_url(&name)?;
    let step = 1u64;
    let attempt = ckpt::attempt::Attempt::new(step, 0, "bench")?;
    let dir = attempt.dir();
    // Each tensor 4096 x 1024 fp32 (16 MiB) when the world allows, else a row per rank.
    let rows = (world as u64).max(4096);
    let cols = 1024u64;
    let shape = [rows, cols];
    let block = config.block_size;
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
            format_version: FORMAT_VERSION,
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
        };
        let bytes = part.to_bytes();
        parts.push((bytes, part));
    }
    progress("metadata scale: building the manifest");
    let started = Instant::now();
    let manifest = ckpt::commit::build_manifest(&attempt, world as u32, &parts)?;
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
    ckpt::commits::append(
        &store,
        &ckpt::commits::CommitRecord::new(&attempt, world as u32),
    )
    .await?;
    store
        .put(&format!("{dir}/{MANIFEST}"), manifest_bytes)
        .await?;

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

// ---------------------------------------------------------------------------------
// Human output

/// The table rows of the core figures; `direct` is the raw `O_DIRECT` write and the
/// committed save's ratio to it, when measured.
fn core_rows(s: &mut String, f: &CoreFigures, reshard_ranks: usize, direct: Option<(f64, f64)>) {
    use std::fmt::Write as _;
    let mut row = |name: &str, a: String, b: String, ratio: Option<f64>| {
        let ratio = ratio.map_or(String::new(), |r| format!("{r:.2}"));
        let _ = writeln!(s, "{name:<34} {a:>12} {b:>12} {ratio:>9}");
    };
    let ms = |v: f64| format!("{v:.1} ms");
    row(
        "stall per rank (worst) vs memcpy",
        ms(f.stall_ms),
        ms(f.memcpy_ms),
        Some(f.stall_ratio),
    );
    row(
        "overlapped stall vs memcpy",
        format!("{:.2} ms", f.overlap_stall_ms),
        ms(f.memcpy_ms),
        Some(f.overlap_ratio),
    );
    row(
        "  overlapped copy done after",
        ms(f.overlap_staged_ms),
        String::new(),
        None,
    );
    row(
        "first save's stall vs stall",
        ms(f.cold_stall_ms),
        ms(f.stall_ms),
        Some(f.cold_ratio),
    );
    row(
        "  staging warm-up (before it)",
        ms(f.warm_up_ms),
        String::new(),
        None,
    );
    let gbs = |v: f64| format!("{v:.2} GB/s");
    row(
        "save until committed vs raw write",
        gbs(f.write_gbps),
        gbs(f.raw_write_gbps),
        Some(f.write_ratio),
    );
    if let Some((raw, ratio)) = direct {
        row(
            "  vs raw O_DIRECT write",
            String::new(),
            gbs(raw),
            Some(ratio),
        );
    }
    row(
        "  time until committed",
        format!("{:.0} ms", f.commit_ms),
        String::new(),
        None,
    );
    row(
        "load, same world vs raw read",
        gbs(f.read_gbps),
        gbs(f.raw_read_gbps),
        Some(f.read_ratio),
    );
    row(
        &format!("load onto {reshard_ranks} ranks vs same world"),
        format!("{:.0} ms", f.reshard_load_ms),
        format!("{:.0} ms", f.load_ms),
        Some(f.reshard_ratio),
    );
}

/// The report as an aligned table.
pub(crate) fn render(r: &BenchReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let c = &r.config;
    let _ = writeln!(s, "ckpt bench on {}", r.url);
    if !c.metadata_only {
        let _ = writeln!(
            s,
            "workload: {} ranks, {} fp32 tensors of {}x{} sharded on dim 0 ({:.1} MiB per rank, {:.2} GiB total), {} reps, median; reads {}",
            c.ranks,
            c.tensors,
            c.rows,
            c.cols,
            r.bytes_per_rank as f64 / (1 << 20) as f64,
            r.total_bytes as f64 / (1u64 << 30) as f64,
            c.reps,
            if r.cold_reads {
                "cold (page cache emptied)"
            } else {
                "warm"
            }
        );
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<34} {:>12} {:>12} {:>9}",
            "measure", "ckpt", "baseline", "ratio"
        );
        if c.threads {
            let _ = writeln!(s, "ranks as threads of one process:");
            let direct = r.raw_write_direct_gbps.zip(r.write_ratio_direct);
            core_rows(&mut s, &r.core, c.reshard_ranks, direct);
            let _ = writeln!(
                s,
                "{:<34} {:>12}",
                "  reshard bytes read / requested",
                format!("{:.4}", r.reshard_read_amplification)
            );
            let _ = writeln!(
                s,
                "{:<34} {:>12} {:>12} {:>9.2}",
                "  allocating load vs in place",
                format!("{:.0} ms", r.load_alloc_ms),
                format!("{:.0} ms", r.core.load_ms),
                r.load_alloc_ms / r.core.load_ms.max(1e-9),
            );
            let _ = writeln!(s);
            let _ = writeln!(
                s,
                "{:<11} {:>8} {:>7} {:>8} {:>8} {:>8} {:>8} {:>7} {:>9} {:>9}",
                "load (ms)",
                "wall",
                "plan",
                "read",
                "read cpu",
                "io wait",
                "verify",
                "copy",
                "copied MiB",
                "faults"
            );
            let b = &r.load_breakdown;
            for (name, b) in [
                ("in place", &b.same_size),
                ("resharded", &b.resharded),
                ("allocating", &b.allocating),
            ] {
                let _ = writeln!(
                    s,
                    "{:<11} {:>8.0} {:>7.1} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>7.0} {:>10.1} {:>9.0}",
                    name,
                    b.wall_ms,
                    b.plan_ms,
                    b.read_ms,
                    b.read_cpu_ms,
                    b.io_wait_ms,
                    b.verify_ms,
                    b.copy_ms,
                    b.bytes_copied / (1 << 20) as f64,
                    b.minor_faults
                );
            }
            let _ = writeln!(
                s,
                "  read, read cpu, verify and copy are summed over ranks and reading threads; in-place buffers took {:.0} ms to allocate and touch beforehand",
                b.same_size.prefault_ms
            );
        }
        if !r.zstd.is_empty() {
            let _ = writeln!(s);
            let _ = writeln!(
                s,
                "{:<16} {:>14} {:>7} {:>11} {:>11}",
                "codec", "stored", "ratio", "save GB/s", "load GB/s"
            );
            let _ = writeln!(
                s,
                "{:<16} {:>14} {:>7.3} {:>11.2} {:>11.2}",
                "none", r.file_bytes, 1.0, r.core.write_gbps, r.core.read_gbps
            );
            for z in &r.zstd {
                let _ = writeln!(
                    s,
                    "{:<16} {:>14} {:>7.3} {:>11.2} {:>11.2}",
                    format!("{}-{}", z.codec, z.level),
                    z.stored_bytes,
                    z.ratio,
                    z.save_gbps,
                    z.load_gbps
                );
            }
        }
        if !r.codec_samples.is_empty() {
            let _ = writeln!(s);
            let _ = writeln!(
                s,
                "{:<6} {:>8} {:>7} {:>16} {:>18}",
                "data", "shuffle", "ratio", "compress GB/s/c", "decompress GB/s/c"
            );
            for z in &r.codec_samples {
                let _ = writeln!(
                    s,
                    "{:<6} {:>8} {:>7.3} {:>16.3} {:>18.3}",
                    z.data, z.shuffle, z.ratio, z.compress_gbps, z.decompress_gbps
                );
            }
        }
        if let Some(p) = &r.processes {
            if c.threads {
                let _ = writeln!(s);
            }
            let _ = writeln!(s, "one process per rank ({} processes):", p.ranks);
            core_rows(&mut s, &p.core, c.reshard_ranks, None);
        }
        if let Some(rss) = &r.rss {
            let _ = writeln!(s);
            let _ = writeln!(
                s,
                "rss over {} saves: first {:.0} MiB, last {:.0} MiB, growth after the first {:+.1} MiB",
                rss.rss_mib.len(),
                rss.rss_mib.first().copied().unwrap_or(0.0),
                rss.rss_mib.last().copied().unwrap_or(0.0),
                rss.growth_after_first_mib
            );
        }
    }
    if let Some(c) = &r.commit_scale {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "commit scale: {} ranks committed in {:.0} ms; requests per rank: mean {:.2}, waiting rank max {}, committer max {}, total {}",
            c.ranks,
            c.commit_ms,
            c.requests_per_rank,
            c.waiter_requests_max,
            c.committer_requests_max,
            c.requests_total
        );
    }
    if let Some(m) = &r.metadata {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "metadata: {} tensors x {} ranks ({} chunks): manifest {:.1} KiB, one part {:.1} KiB, build {:.0} ms",
            m.tensors,
            m.ranks,
            m.chunks,
            m.manifest_bytes as f64 / 1024.0,
            m.part_bytes as f64 / 1024.0,
            m.build_ms
        );
        let _ = writeln!(
            s,
            "  open (read + parse) {:.1} ms; plan one rank {:.1} ms reading {:.2} MiB; onto {} ranks {:.1} ms reading {:.2} MiB",
            m.open_ms,
            m.plan_ms,
            m.plan_bytes_read as f64 / (1 << 20) as f64,
            m.reshard_ranks,
            m.reshard_plan_ms,
            m.reshard_plan_bytes_read as f64 / (1 << 20) as f64
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "{:<36} {:>10} {:>10}  met", "target", "value", "bound");
    for t in &r.targets {
        let _ = writeln!(
            s,
            "{:<36} {:>10.3} {:>2} {:>7.2}  {}",
            t.name,
            t.value,
            t.relation,
            t.bound,
            if t.met { "yes" } else { "NO" }
        );
    }
    s
}

// ---------------------------------------------------------------------------
// Commit scale

/// Requests and time of one commit by many simulated ranks.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CommitScaleReport {
    /// Simulated ranks (one `Checkpointer` each, in this process).
    pub ranks: usize,
    /// From the first `save` to the last rank's `committed()`.
    pub commit_ms: f64,
    /// Requests of every rank, summed.
    pub requests_total: u64,
    /// Mean requests per rank (data file, part, commit, learning the outcome).
    pub requests_per_rank: f64,
    /// Most requests by a rank that only waits for the outcome.
    pub waiter_requests_max: u64,
    /// Most requests by a committer (listing the attempt, reading every part,
    /// checking every data file, the log and the manifest).
    pub committer_requests_max: u64,
}

/// `ranks` ranks, each with its own request counter on a shared connection pool,
/// save one small dim-0 shard of step 1 under a fresh prefix of `store` and wait for
/// the commit. Counts every request each rank's store handle sends.
async fn commit_scale(store: &Store, ranks: usize) -> Result<CommitScaleReport> {
    let run = ckpt::attempt::random_run_id();
    // The generation of the root's newest commit: not fenced, and fencing nobody.
    let generation = ckpt::commits::newest(store)
        .await?
        .map_or(0, |c| c.record.generation);
    let (rows, cols) = (ranks as u64 * 4, 16u64);
    let data: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
    let mut checkpointers = Vec::with_capacity(ranks);
    let mut stores = Vec::with_capacity(ranks);
    for rank in 0..ranks {
        let own = store.with_own_counter();
        let mut config = CheckpointConfig::new(rank, ranks);
        config.run_id = run.clone();
        config.block_size = 4096;
        config.generation = generation;
        stores.push(own.clone());
        checkpointers.push(Checkpointer::new(own, config)?);
    }
    let started = Instant::now();
    let mut handles = Vec::with_capacity(ranks);
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        let region = Region::dim0_shard(&[rows, cols], rank, ranks);
        let begin = (region.offsets[0] * cols) as usize;
        let end = begin + (region.lengths[0] * cols) as usize;
        let mut state = State::new();
        state.add(
            "w",
            DType::F32,
            &[rows, cols],
            region,
            as_bytes(&data[begin..end]),
        )?;
        let outcome = checkpointer.save(1, &state).await?;
        handles.push(outcome);
    }
    let results = futures::future::join_all(handles.iter().map(|h| h.committed())).await;
    let commit_ms = ms(started.elapsed());
    for result in results {
        result?;
    }
    let committers = checkpointers[0].config().committers();
    let counts: Vec<u64> = stores.iter().map(Store::requests).collect();
    let total: u64 = counts.iter().sum();
    let max_of = |committer: bool| {
        counts
            .iter()
            .enumerate()
            .filter(|(rank, _)| committers.contains(rank) == committer)
            .map(|(_, &n)| n)
            .max()
            .unwrap_or(0)
    };
    Ok(CommitScaleReport {
        ranks,
        commit_ms,
        requests_total: total,
        requests_per_rank: total as f64 / ranks as f64,
        waiter_requests_max: max_of(false),
        committer_requests_max: max_of(true),
    })
}
