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

mod codec_samples;
pub(crate) mod command;
pub(crate) mod control_plane;
mod cooperative;
#[cfg(feature = "cuda")]
pub(crate) mod device;
mod measure;
mod processes;
mod raw;
mod render;
mod replicas;
mod scale;
mod workload;

use codec_samples::*;
use measure::*;
pub(crate) use processes::{ProcessesReport, rank_main};
use raw::*;
pub(crate) use render::render;
use scale::*;
use workload::*;

use ckpt::{Error, Result};

/// A bad bench configuration or a bad message between bench processes.
fn invalid(message: impl Into<String>) -> Error {
    Error::Invalid(message.into())
}
use ckpt::format::{
    Chunk, Codec, FileEntry, MANIFEST, RankPart, rank_file_name, rank_part_name, step_dir,
    version_for,
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
    /// In the commit-scale part, when not 0, only the committer ranks run a
    /// `Checkpointer`; the others write their data file and part with
    /// `RankFileWriter`, this many at a time, and do not wait.
    pub commit_writers: usize,
    /// Simulated loading ranks of the cooperative-scale part (0 skips it).
    #[serde(default)]
    pub coop_ranks: usize,
    /// Tensors of the cooperative-scale part's synthetic checkpoint.
    #[serde(default)]
    pub coop_tensors: usize,
    /// Replicas of every shard in the cooperative-scale part's HSDP layout.
    #[serde(default)]
    pub coop_replicas: usize,
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
    /// Replicas of every shard: `ranks / replicas` shards, rank `r` holding shard
    /// `r % shards`, replica 0 writing. Above 1, the bench measures replica agreement
    /// alone (`replicas::run`): saves with and without it, one process per rank.
    #[serde(default = "one")]
    pub replicas: usize,
}

fn one() -> usize {
    1
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
            commit_writers: 0,
            coop_ranks: 0,
            coop_tensors: 1000,
            coop_replicas: 8,
            rss_saves: 0,
            codec_sample_bytes: 64 << 20,
            threads: true,
            processes: true,
            store_options: Vec::new(),
            replicas: 1,
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
        if self.coop_ranks > 0 && self.coop_tensors == 0 {
            return Err(invalid("coop tensors must be at least 1, got 0"));
        }
        if self.meta_tensors > 0 && self.meta_ranks == 0 {
            return Err(invalid("meta ranks must be at least 1, got 0"));
        }
        if self.replicas == 0 || !self.ranks.is_multiple_of(self.replicas) {
            return Err(invalid(format!(
                "replicas {} must be at least 1 and divide ranks {}",
                self.replicas, self.ranks
            )));
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
    /// The cooperative-scale part: one report per layout.
    pub cooperative_scale: Vec<cooperative::CoopScaleReport>,
    /// RSS over consecutive saves.
    pub rss: Option<RssReport>,
    /// What each rank's checkpointing held in host memory after the core saves, by
    /// kind, with its peak (`Checkpointer::host_bytes_held`): the staging the saves
    /// kept, against `rss`'s whole-process figure.
    pub host_bytes_held: Vec<ckpt::HostBytesHeld>,
    /// The core figures again with one process per rank (`BenchConfig::processes`).
    pub processes: Option<ProcessesReport>,
    /// Replica agreement's cost (`BenchConfig::replicas` above 1).
    pub replicas: Option<replicas::ReplicasReport>,
    /// The targets.
    pub targets: Vec<Target>,
    /// Every repetition's figures, for the curious.
    pub samples: BTreeMap<String, Vec<f64>>,
    /// Same-size load through the allocating `load` (fresh buffers), ms (median);
    /// `load_ms` is the in-place load.
    pub load_alloc_ms: f64,
    /// PyTorch DCP's read strategy on the same files, same world size: one plain
    /// buffered stream per rank file, front to back (local disk), ms (median).
    pub dcp_load_ms: Option<f64>,
    /// The same onto `reshard_ranks` ranks: each reads whole every file it overlaps.
    pub dcp_reshard_load_ms: Option<f64>,
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
    /// Bytes of data files the ranks read from the store (as stored).
    pub bytes_read_from_store: u64,
    /// Bytes the ranks received from each other (0: these loads are not
    /// cooperative).
    pub bytes_received_from_peers: u64,
    /// Requests the ranks sent to the store, by kind, opening the checkpoint
    /// included (each rank on a store handle of its own). A local store's data
    /// files are read by positioned reads, not requests.
    pub store_requests: cooperative::Requests,
    /// The checkpoint's bytes the loads needed, as the ranks report them (each
    /// rank's own blocks, summed: a byte two ranks need counts twice).
    pub unique_bytes: u64,
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
        report.commit_scale = Some(rt.block_on(commit_scale(
            store,
            config.commit_ranks,
            config.commit_writers,
        ))?);
    }
    if config.coop_ranks > 0 {
        for (layout, replicas) in cooperative::layouts(config.coop_ranks, config.coop_replicas) {
            report
                .cooperative_scale
                .push(rt.block_on(cooperative::coop_scale(
                    config.coop_ranks,
                    layout,
                    replicas,
                    config.coop_tensors,
                    config.block_size,
                    progress,
                ))?);
        }
    }
    if config.metadata_only {
        report.targets = targets(&report);
        return Ok(report);
    }
    if config.replicas > 1 {
        report.replicas = Some(replicas::run(store, rt, config, progress)?);
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
        progress(&format!("rep {}/{}: DCP's read", rep + 1, config.reps));
        evict_step(&root, step, config.warm);
        if let Some(dcp) = dcp_read_once(rt, store, step, config.ranks, config)? {
            push("dcp_load_ms", dcp);
        }
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
        if let Some(dcp) = dcp_read_once(rt, store, step, config.reshard_ranks, config)? {
            push("dcp_reshard_load_ms", dcp);
        }
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
    report.host_bytes_held = checkpointers.iter().map(|c| c.host_bytes_held()).collect();

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
    report.dcp_load_ms = samples.get("dcp_load_ms").map(|v| median(v));
    report.dcp_reshard_load_ms = samples.get("dcp_reshard_load_ms").map(|v| median(v));
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
        cooperative_scale: Vec::new(),
        rss: None,
        host_bytes_held: Vec::new(),
        processes: None,
        replicas: None,
        targets: Vec::new(),
        samples: BTreeMap::new(),
        load_alloc_ms: 0.0,
        dcp_load_ms: None,
        dcp_reshard_load_ms: None,
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
