//! The flags of `ckpt bench` and of its hidden rank processes (`ckpt bench-rank`),
//! and how they start a bench and print its report.

use std::process::ExitCode;

#[cfg(feature = "cuda")]
use ckpt::storage::Store;
use ckpt_elastic::timeouts::{Timeouts, parse_seconds};

#[cfg(feature = "cuda")]
use super::device;
use super::{BenchConfig, control_plane};
use crate::exit;
use crate::output::{errln, out, print_json};
use crate::store::{LibraryDefaults, StoreArgs};

/// Flags of `ckpt bench`.
#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct BenchArgs {
    /// A bench of something other than a store.
    #[command(subcommand)]
    what: Option<BenchWhat>,
    /// Store URL to benchmark (a scratch location: the bench writes and deletes
    /// step directories and a `.ckpt-bench/` baseline file there).
    #[arg(long = "url", value_name = "URL")]
    url_flag: Option<String>,
    /// Store URL (same as --url).
    url: Option<String>,
    #[command(flatten)]
    store: StoreArgs<LibraryDefaults>,
    /// Print a JSON report instead of a table.
    #[arg(long)]
    json: bool,
    /// Saving ranks (threads of this process or processes, see --ranks-as).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Ranks of the resharded load.
    #[arg(long, default_value_t = 3)]
    reshard_ranks: usize,
    /// Replicas of every shard (HSDP-style: ranks / R shards, replica 0 writes).
    /// Above 1, measure only what replica agreement costs a save: saves with and
    /// without it, one process per rank, and the CRC throughput per core.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Tensors.
    #[arg(long, default_value_t = 64)]
    tensors: usize,
    /// Rows per tensor (dim 0, sharded).
    #[arg(long, default_value_t = 8192)]
    rows: u64,
    /// Columns per tensor.
    #[arg(long, default_value_t = 1024)]
    cols: u64,
    /// Measured repetitions (medians are reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Block size in bytes (checksum block and zstd frame).
    #[arg(long, default_value_t = 256 << 10)]
    block_size: u64,
    /// zstd level of the compressed runs.
    #[arg(long, default_value_t = 3)]
    zstd_level: i32,
    /// Skip the compressed runs.
    #[arg(long)]
    no_zstd: bool,
    /// Size of the raw sequential write/read baseline, MiB.
    #[arg(long, default_value_t = 1024)]
    raw_mib: u64,
    /// Skip the O_DIRECT raw write.
    #[arg(long)]
    no_direct: bool,
    /// Keep the page cache before reads (default: empty it for a local store).
    #[arg(long)]
    warm: bool,
    /// Seed of the workload's values.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Tensors of the synthetic metadata-scale checkpoint (0 skips it).
    #[arg(long, default_value_t = 1000)]
    meta_tensors: usize,
    /// Ranks of the synthetic metadata-scale checkpoint.
    #[arg(long, default_value_t = 1024)]
    meta_ranks: usize,
    /// Run only the metadata-scale part.
    #[arg(long)]
    metadata_only: bool,
    /// Simulate this many ranks committing one small checkpoint on the URL, counting
    /// requests per rank and the time to commit (0 skips it; runs after the metadata
    /// part, also with --metadata-only).
    #[arg(long, default_value_t = 0)]
    commit_ranks: usize,
    /// With --commit-ranks and N > 0: only the committer ranks run a checkpointer;
    /// every other rank writes its data file and part with the library's offline
    /// writer (the same objects), N ranks at a time, and does not wait for the outcome.
    #[arg(long, default_value_t = 0)]
    commit_writers: usize,
    /// Simulate this many ranks resuming from a synthetic checkpoint (parts and
    /// manifest in a memory store, no data files), each on its own and
    /// cooperatively, counting the store requests of the job by kind; as FSDP (one
    /// shard per rank), HSDP (--coop-replicas) and DDP (the whole model per rank).
    /// 0 skips it; runs after the metadata part, also with --metadata-only.
    #[arg(long, default_value_t = 0)]
    coop_ranks: usize,
    /// Tensors of the --coop-ranks checkpoint.
    #[arg(long, default_value_t = 1000)]
    coop_tensors: usize,
    /// Replicas of every shard in the --coop-ranks HSDP layout (must divide the
    /// ranks; 1 skips that layout).
    #[arg(long, default_value_t = 8)]
    coop_replicas: usize,
    /// Record host RSS over this many consecutive saves (0 skips it).
    #[arg(long, default_value_t = 0)]
    rss_saves: usize,
    /// Data (MiB) of the per-block codec comparison.
    #[arg(long, default_value_t = 64)]
    codec_sample_mib: u64,
    /// Run the ranks as threads of this process (the top-level figures, with the
    /// compressed runs and RSS), as one process each (the `processes` figures), or
    /// both.
    #[arg(long, value_enum, default_value_t = RanksAs::Both)]
    ranks_as: RanksAs,
    /// Measure only the staging of device state instead (feature `cuda`): for each
    /// size, in GiB, a save of that much device memory against a plain copy into
    /// pinned memory. Uses --reps; e.g. --device-gib 1,8,40.
    #[cfg(feature = "cuda")]
    #[arg(long, value_delimiter = ',', value_name = "GIB,...")]
    device_gib: Vec<f64>,
    /// CUDA device ordinal of --device-gib.
    #[cfg(feature = "cuda")]
    #[arg(long, default_value_t = 0)]
    device: usize,
}

/// How `ckpt bench` runs its ranks (`--ranks-as`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum RanksAs {
    /// Threads of one process, then one process per rank.
    Both,
    /// Threads of one process only.
    Threads,
    /// One process per rank only.
    Processes,
}

/// The benches of `ckpt bench` that are not about a store.
#[derive(clap::Subcommand)]
pub(crate) enum BenchWhat {
    /// The elastic control plane at scale: N simulated nodes of R ranks (the real
    /// node agent of `ckpt launch`, ranks simulated in this process) against a real
    /// coordinator process, or an etcd cluster. Measures the formation of a
    /// generation, the steady state (messages, coordinator CPU and memory, etcd
    /// writes) and the loss of a node.
    #[command(
        after_help = "Examples:\n  ckpt bench control-plane --nodes 128 --ranks-per-node 8 --backend tcp\n  ckpt bench control-plane --nodes 2048 --ranks-per-node 8 --backend etcd --etcd etcd://127.0.0.1:2379/bench --json"
    )]
    ControlPlane(ControlPlaneArgs),
}

/// Flags of `ckpt bench control-plane`.
#[derive(clap::Args)]
pub(crate) struct ControlPlaneArgs {
    /// Simulated nodes (each a real node agent with one connection or lease).
    #[arg(long, value_name = "N")]
    nodes: usize,
    /// Simulated ranks per node.
    #[arg(long, value_name = "R", default_value_t = 8)]
    ranks_per_node: usize,
    /// The control plane: the built-in coordinator (started as a process of its
    /// own) or etcd.
    #[arg(long, value_enum, default_value_t = control_plane::Backend::Tcp)]
    backend: control_plane::Backend,
    /// The etcd cluster for --backend etcd: etcd://HOST:PORT[,HOST:PORT...]/PREFIX.
    #[arg(long, value_name = "URL")]
    etcd: Option<String>,
    /// Length of the steady-state window, seconds.
    #[arg(long, value_name = "S", default_value_t = 10.0, value_parser = parse_seconds)]
    steady_secs: f64,
    /// How the lost node goes: silent (found by the heartbeat timeout) or with its
    /// connections closed.
    #[arg(long, value_enum, default_value_t = control_plane::Kill::Silence)]
    kill: control_plane::Kill,
    /// The job's heartbeat timeout, seconds.
    #[arg(long, value_name = "S", default_value_t = Timeouts::DEFAULT.heartbeat_timeout.as_secs_f64(), value_parser = parse_seconds)]
    heartbeat_timeout_secs: f64,
    /// Print the figures as JSON.
    #[arg(long)]
    json: bool,
}

/// Flags of the hidden `ckpt bench-rank` (one rank process of `ckpt bench`).
#[derive(clap::Args)]
pub(crate) struct BenchRankArgs {
    /// Store URL.
    #[arg(long)]
    url: String,
    #[command(flatten)]
    store: StoreArgs<LibraryDefaults>,
    /// This rank.
    #[arg(long)]
    rank: usize,
    /// The bench configuration, as JSON.
    #[arg(long)]
    config: String,
}

/// `ckpt bench --device-gib …`: the device staging figures only.
#[cfg(feature = "cuda")]
fn run_device_bench(
    runtime: &tokio::runtime::Runtime,
    store: &Store,
    args: &BenchArgs,
) -> ExitCode {
    let config = device::DeviceBenchConfig {
        gib: args.device_gib.clone(),
        reps: args.reps,
        device: args.device,
    };
    print_bench(
        args.json,
        |progress| device::run(store, runtime.handle(), &config, progress),
        device::render,
    )
}

/// Runs a bench with progress lines on stderr (seconds since the start), then prints
/// its report as JSON or as the table `render` makes.
fn print_bench<R: serde::Serialize>(
    json: bool,
    run: impl FnOnce(&dyn Fn(&str)) -> ckpt::Result<R>,
    render: impl FnOnce(&R) -> String,
) -> ExitCode {
    let started = std::time::Instant::now();
    let progress = |line: &str| {
        errln!("[{:>7.1} s] {line}", started.elapsed().as_secs_f64());
    };
    let report = match run(&progress) {
        Ok(report) => report,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(exit::CHECK_FAILED);
        }
    };
    if json {
        return ExitCode::from(if print_json(&report) {
            exit::OK
        } else {
            exit::CHECK_FAILED
        });
    }
    out!("{}", render(&report));
    ExitCode::from(exit::OK)
}

/// `ckpt bench control-plane`.
fn run_control_plane_bench(args: &ControlPlaneArgs) -> ExitCode {
    let ckpt = match std::env::current_exe() {
        Ok(path) => path,
        Err(e) => {
            errln!("error: cannot find this program to start the coordinator: {e}");
            return ExitCode::from(exit::CHECK_FAILED);
        }
    };
    let config = control_plane::Config {
        nodes: args.nodes,
        ranks_per_node: args.ranks_per_node,
        backend: args.backend,
        etcd: args.etcd.clone(),
        steady: std::time::Duration::from_secs_f64(args.steady_secs),
        kill: args.kill,
        timeouts: Timeouts {
            heartbeat_timeout: std::time::Duration::from_secs_f64(args.heartbeat_timeout_secs),
            ..Timeouts::DEFAULT
        },
        ckpt,
    };
    print_bench(
        args.json,
        |progress| control_plane::run(&config, progress).map_err(ckpt::Error::Failed),
        control_plane::render,
    )
}

pub(crate) fn run_bench(runtime: &tokio::runtime::Runtime, args: BenchArgs) -> ExitCode {
    if let Some(BenchWhat::ControlPlane(what)) = &args.what {
        return run_control_plane_bench(what);
    }
    let Some(url) = args.url_flag.clone().or(args.url.clone()) else {
        errln!("error: ckpt bench needs a store URL (--url URL)");
        return ExitCode::from(exit::USAGE);
    };
    let store = match args.store.open(&url) {
        Ok(store) => store,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(exit::USAGE);
        }
    };
    #[cfg(feature = "cuda")]
    if !args.device_gib.is_empty() {
        return run_device_bench(runtime, &store, &args);
    }
    let config = BenchConfig {
        ranks: args.ranks,
        reshard_ranks: args.reshard_ranks,
        tensors: args.tensors,
        rows: args.rows,
        cols: args.cols,
        reps: args.reps,
        block_size: args.block_size,
        zstd_level: (!args.no_zstd).then_some(args.zstd_level),
        raw_bytes: args.raw_mib << 20,
        direct: !args.no_direct,
        warm: args.warm,
        seed: args.seed,
        meta_tensors: args.meta_tensors,
        meta_ranks: args.meta_ranks,
        metadata_only: args.metadata_only,
        commit_ranks: args.commit_ranks,
        commit_writers: args.commit_writers,
        coop_ranks: args.coop_ranks,
        coop_tensors: args.coop_tensors,
        coop_replicas: args.coop_replicas,
        rss_saves: args.rss_saves,
        codec_sample_bytes: args.codec_sample_mib << 20,
        threads: args.ranks_as != RanksAs::Processes,
        processes: args.ranks_as != RanksAs::Threads,
        store_options: args.store.pairs(),
        replicas: args.replicas,
    };
    print_bench(
        args.json,
        |progress| super::run(&store, runtime.handle(), &config, progress),
        super::render,
    )
}

pub(crate) fn run_bench_rank(runtime: tokio::runtime::Runtime, args: BenchRankArgs) -> ExitCode {
    // The rank makes its own runtime, as a trainer's rank does.
    drop(runtime);
    let config: BenchConfig = match serde_json::from_str(&args.config) {
        Ok(config) => config,
        Err(e) => {
            errln!("error: bench-rank: bad --config: {e}");
            return ExitCode::from(exit::USAGE);
        }
    };
    let store = match args.store.open(&args.url) {
        Ok(store) => store,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(exit::USAGE);
        }
    };
    match super::rank_main(store, args.rank, config) {
        Ok(()) => ExitCode::from(exit::OK),
        Err(e) => {
            errln!("error: bench rank {}: {e}", args.rank);
            ExitCode::from(exit::CHECK_FAILED)
        }
    }
}
