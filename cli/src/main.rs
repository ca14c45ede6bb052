//! The `ckpt` command line.

mod bench;
mod commands;
mod output;

use std::process::ExitCode;

use bench::BenchConfig;
use ckpt::probe::probe;
use ckpt::storage::{Store, StoreConfig};
use ckpt_elastic::timeouts::{Timeouts, millis, parse_seconds};
use clap::{Parser, Subcommand};
use output::{errln, out, outln};

/// Exit code: everything checked out.
const EXIT_OK: u8 = 0;
/// Exit code: a check failed (the store misbehaved, a checkpoint is unsound).
const EXIT_CHECK_FAILED: u8 = 1;
/// Exit code: bad usage or configuration (bad URL, unknown option).
const EXIT_USAGE: u8 = 2;

#[derive(Parser)]
#[command(
    name = "ckpt",
    version,
    about = "Fault-tolerant sharded checkpoints for distributed training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check that a store URL supports everything ckpt needs (put, ranged reads,
    /// multipart upload, create-if-absent, list, delete), cleaning up after itself.
    #[command(
        after_help = "Example:\n  ckpt probe file://./runs/demo\n  AWS_ENDPOINT=http://127.0.0.1:9000 AWS_ALLOW_HTTP=true ckpt probe s3://bucket/run1 --json"
    )]
    Probe {
        /// Store URL: file:///dir, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix
        url: String,
        /// Backend option KEY=VALUE as object_store names it (e.g. aws_endpoint=http://127.0.0.1:9000); repeatable.
        #[arg(long = "option", short = 'o', value_name = "KEY=VALUE")]
        options: Vec<String>,
        /// Print a JSON report instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Measure ckpt against its baselines (memcpy, raw sequential write and read) on a
    /// store: stall, time until committed, same-size and resharded loads, zstd,
    /// metadata at scale. Defaults to workload W1 (4 ranks x 64 fp32 tensors of
    /// 8192x1024, 2 GiB); progress goes to stderr.
    #[command(
        after_help = "Examples:\n  ckpt bench file:///tmp/ckpt-bench\n  ckpt bench --url file:///tmp/ckpt-bench --rss-saves 20 --json > bench.json\n  ckpt bench file:///tmp/b --ranks 2 --tensors 4 --rows 256 --cols 256 --reps 1 --raw-mib 1"
    )]
    Bench(Box<BenchArgs>),
    /// One rank process of `ckpt bench`, driven over stdin and stdout.
    #[command(hide = true)]
    BenchRank(BenchRankArgs),
    /// Run the elastic control plane's coordinator for one job: it forms generations
    /// of ranks, detects lost and hung ranks and tells survivors to restart. Prints
    /// `coordinator: listening on ADDR`, then serves until killed; generation changes
    /// are logged on stderr.
    #[command(
        after_help = "Example:\n  ckpt coordinator --listen 0.0.0.0:29400 --job run1 --min-ranks 2 --max-ranks 8"
    )]
    Coordinator(CoordinatorArgs),
    /// Start N rank processes of any command on this node, like torchrun: each gets
    /// torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    /// MASTER_ADDR, MASTER_PORT, GROUP_RANK, TORCHELASTIC_RUN_ID). With an elastic flag
    /// (--min-ranks, --max-ranks, --max-restarts, --nnodes, --rdzv) the job survives
    /// lost ranks: a script that calls `ckpt.elastic.run` (or the reference trainer)
    /// keeps training on the survivors, in the same processes.
    #[command(
        after_help = "Examples:\n  ckpt launch --nproc 4 -- python train.py --ckpt file:///data/run1\n  ckpt launch --nproc 4 --min-ranks 2 -- python python/examples/train_gpt.py --ckpt file:///tmp/gpt\n  ckpt launch --nproc 8 --nnodes 1:2 --node-id 0 --job-id run1 --rdzv tcp://head:29400 --host-rdzv -- python train.py"
    )]
    Launch {
        #[command(flatten)]
        launch: ckpt_launch::LaunchArgs,
        /// The command every rank runs, after `--`.
        #[arg(required = true, last = true, value_name = "COMMAND")]
        command: Vec<std::ffi::OsString>,
    },
    #[command(flatten)]
    Tool(commands::Tool),
}

/// Flags of `ckpt bench`.
#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
struct BenchArgs {
    /// A bench of something other than a store.
    #[command(subcommand)]
    what: Option<BenchWhat>,
    /// Store URL to benchmark (a scratch location: the bench writes and deletes
    /// step directories and a `.ckpt-bench/` baseline file there).
    #[arg(long = "url", value_name = "URL")]
    url_flag: Option<String>,
    /// Store URL (same as --url).
    url: Option<String>,
    /// Backend option KEY=VALUE as object_store names it; repeatable.
    #[arg(long = "option", short = 'o', value_name = "KEY=VALUE")]
    options: Vec<String>,
    /// Print a JSON report instead of a table.
    #[arg(long)]
    json: bool,
    /// Saving ranks (threads of this process or processes, see --ranks-as).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Ranks of the resharded load.
    #[arg(long, default_value_t = 3)]
    reshard_ranks: usize,
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
enum RanksAs {
    /// Threads of one process, then one process per rank.
    Both,
    /// Threads of one process only.
    Threads,
    /// One process per rank only.
    Processes,
}

/// The benches of `ckpt bench` that are not about a store.
#[derive(clap::Subcommand)]
enum BenchWhat {
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
struct ControlPlaneArgs {
    /// Simulated nodes (each a real node agent with one connection or lease).
    #[arg(long, value_name = "N")]
    nodes: usize,
    /// Simulated ranks per node.
    #[arg(long, value_name = "R", default_value_t = 8)]
    ranks_per_node: usize,
    /// The control plane: the built-in coordinator (started as a process of its
    /// own) or etcd.
    #[arg(long, value_enum, default_value_t = bench::control_plane::Backend::Tcp)]
    backend: bench::control_plane::Backend,
    /// The etcd cluster for --backend etcd: etcd://HOST:PORT[,HOST:PORT...]/PREFIX.
    #[arg(long, value_name = "URL")]
    etcd: Option<String>,
    /// Length of the steady-state window, seconds.
    #[arg(long, value_name = "S", default_value_t = 10.0, value_parser = parse_seconds)]
    steady_secs: f64,
    /// How the lost node goes: silent (found by the heartbeat timeout) or with its
    /// connections closed.
    #[arg(long, value_enum, default_value_t = bench::control_plane::Kill::Silence)]
    kill: bench::control_plane::Kill,
    /// The job's heartbeat timeout, seconds.
    #[arg(long, value_name = "S", default_value_t = Timeouts::DEFAULT.heartbeat_timeout.as_secs_f64(), value_parser = parse_seconds)]
    heartbeat_timeout_secs: f64,
    /// Print the figures as JSON.
    #[arg(long)]
    json: bool,
}

/// Flags of the hidden `ckpt bench-rank` (one rank process of `ckpt bench`).
#[derive(clap::Args)]
struct BenchRankArgs {
    /// Store URL.
    #[arg(long)]
    url: String,
    /// Backend option KEY=VALUE; repeatable.
    #[arg(long = "option", short = 'o', value_name = "KEY=VALUE")]
    options: Vec<String>,
    /// This rank.
    #[arg(long)]
    rank: usize,
    /// The bench configuration, as JSON.
    #[arg(long)]
    config: String,
}

/// Flags of `ckpt coordinator`.
#[derive(clap::Args)]
struct CoordinatorArgs {
    /// Address to listen on (port 0 picks a free port; the line printed at start
    /// names the real one).
    #[arg(long, value_name = "ADDR")]
    listen: std::net::SocketAddr,
    /// Job id; members of other jobs are refused.
    #[arg(long, value_name = "ID")]
    job: String,
    /// Fewest ranks a generation may have.
    #[arg(long, value_name = "M")]
    min_ranks: usize,
    /// Most ranks a generation may have; more wait to join.
    #[arg(long, value_name = "N")]
    max_ranks: usize,
    /// No heartbeat for this long: the rank is lost. Also how long a restarted
    /// coordinator waits for ranks to come back before forming a new generation.
    #[arg(long, value_name = "S", default_value_t = Timeouts::DEFAULT.heartbeat_timeout.as_secs_f64(), value_parser = parse_seconds)]
    heartbeat_timeout_secs: f64,
    /// Idle this long outside a collective: the rank is hung.
    #[arg(long, value_name = "S", default_value_t = Timeouts::DEFAULT.progress_timeout.as_secs_f64(), value_parser = parse_seconds)]
    progress_timeout_secs: f64,
    /// After a restart, ranks that do not rejoin within this are dropped.
    #[arg(long, value_name = "S", default_value_t = Timeouts::DEFAULT.join_timeout.as_secs_f64(), value_parser = parse_seconds)]
    join_timeout_secs: f64,
    /// Once enough ranks wait, how long to wait for more arriving together.
    #[arg(long, value_name = "MS", default_value_t = millis(Timeouts::DEFAULT.last_call))]
    last_call_ms: u64,
    /// Fewer than --min-ranks for this long: the job is shut down.
    #[arg(long, value_name = "S", default_value_t = Timeouts::DEFAULT.rendezvous_timeout.as_secs_f64(), value_parser = parse_seconds)]
    rendezvous_timeout_secs: f64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The coordinator's log of generation changes is its output: info by default.
    let default_level = match cli.command {
        Command::Coordinator(_) => tracing::Level::INFO,
        _ => tracing::Level::ERROR,
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::builder()
                .with_default_directive(default_level.into())
                .from_env_lossy(),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Command::Coordinator(args) = cli.command {
        return run_coordinator(args);
    }
    if let Command::Launch { launch, command } = cli.command {
        return run_launch(&launch, command);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            errln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match cli.command {
        Command::Probe { url, options, json } => runtime.block_on(run_probe(&url, &options, json)),
        Command::Bench(args) => run_bench(&runtime, *args),
        Command::BenchRank(args) => run_bench_rank(runtime, args),
        Command::Tool(tool) => runtime.block_on(commands::run(tool)),
        Command::Coordinator(args) => run_coordinator(args),
        Command::Launch { launch, command } => run_launch(&launch, command),
    }
}

/// `ckpt launch … -- COMMAND…`: the launcher's exit status is the job's.
fn run_launch(launch: &ckpt_launch::LaunchArgs, mut command: Vec<std::ffi::OsString>) -> ExitCode {
    let program = ckpt_launch::Program {
        program: command.remove(0),
        args: command,
        hand_over_listener: false,
        // A Python rank imports torch (seconds) before it reaches the rendezvous.
        last_call: std::time::Duration::from_secs(30),
    };
    let config = match launch.config(program) {
        Ok(config) => config,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match ckpt_launch::launch(&config) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            errln!("launch: {e}");
            ExitCode::from(EXIT_CHECK_FAILED)
        }
    }
}

fn run_coordinator(args: CoordinatorArgs) -> ExitCode {
    use std::io::Write;
    use std::time::Duration;

    let timeouts = Timeouts {
        last_call: Duration::from_millis(args.last_call_ms),
        heartbeat_timeout: Duration::from_secs_f64(args.heartbeat_timeout_secs),
        progress_timeout: Duration::from_secs_f64(args.progress_timeout_secs),
        join_timeout: Duration::from_secs_f64(args.join_timeout_secs),
        rendezvous_timeout: Duration::from_secs_f64(args.rendezvous_timeout_secs),
    };
    let config = ckpt_elastic::CoordinatorConfig {
        job: args.job,
        min_ranks: args.min_ranks,
        max_ranks: args.max_ranks,
        timeouts,
        // A restarted coordinator waits as long as a member may stay silent.
        settle: timeouts.heartbeat_timeout,
        max_connections: ckpt_elastic::CoordinatorConfig::DEFAULT_MAX_CONNECTIONS,
    };
    // The job's secret, which every member must prove: CKPT_JOB_SECRET or
    // CKPT_JOB_SECRET_FILE, as its launchers and ranks have it.
    let secret = match ckpt_auth::JobSecret::from_env() {
        Ok(secret) => secret,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if secret.is_none() {
        errln!(
            "coordinator: no job secret ({} or {}): any process that reaches this port may join the job",
            ckpt_auth::SECRET_ENV,
            ckpt_auth::SECRET_FILE_ENV
        );
    }
    let coordinator = match ckpt_elastic::Coordinator::bind(args.listen, config) {
        Ok(coordinator) => coordinator.with_secret(secret),
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
            errln!("error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
        Err(e) => {
            errln!("error: cannot listen on {}: {e}", args.listen);
            return ExitCode::from(EXIT_CHECK_FAILED);
        }
    };
    let mut stdout = std::io::stdout();
    let _ = writeln!(
        stdout,
        "coordinator: listening on {}",
        coordinator.local_addr()
    );
    let _ = stdout.flush();
    match coordinator.run() {
        Ok(()) => ExitCode::from(EXIT_OK),
        Err(e) => {
            errln!("error: coordinator failed: {e}");
            ExitCode::from(EXIT_CHECK_FAILED)
        }
    }
}

/// `ckpt bench --device-gib …`: the device staging figures only.
#[cfg(feature = "cuda")]
fn run_device_bench(
    runtime: &tokio::runtime::Runtime,
    store: &Store,
    args: &BenchArgs,
) -> ExitCode {
    let config = bench::device::DeviceBenchConfig {
        gib: args.device_gib.clone(),
        reps: args.reps,
        device: args.device,
    };
    print_bench(
        args.json,
        |progress| bench::device::run(store, runtime.handle(), &config, progress),
        bench::device::render,
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
            return ExitCode::from(EXIT_CHECK_FAILED);
        }
    };
    if json {
        return print_json(&report);
    }
    out!("{}", render(&report));
    ExitCode::from(EXIT_OK)
}

/// Prints `report` as pretty JSON on stdout.
fn print_json<R: serde::Serialize>(report: &R) -> ExitCode {
    match serde_json::to_string_pretty(report) {
        Ok(text) => {
            outln!("{text}");
            ExitCode::from(EXIT_OK)
        }
        Err(e) => {
            errln!("error: cannot encode the report: {e}");
            ExitCode::from(EXIT_CHECK_FAILED)
        }
    }
}

/// `ckpt bench control-plane`.
fn run_control_plane_bench(args: &ControlPlaneArgs) -> ExitCode {
    let ckpt = match std::env::current_exe() {
        Ok(path) => path,
        Err(e) => {
            errln!("error: cannot find this program to start the coordinator: {e}");
            return ExitCode::from(EXIT_CHECK_FAILED);
        }
    };
    let config = bench::control_plane::Config {
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
        |progress| bench::control_plane::run(&config, progress).map_err(ckpt::Error::Failed),
        bench::control_plane::render,
    )
}

fn run_bench(runtime: &tokio::runtime::Runtime, args: BenchArgs) -> ExitCode {
    if let Some(BenchWhat::ControlPlane(what)) = &args.what {
        return run_control_plane_bench(what);
    }
    let Some(url) = args.url_flag.clone().or(args.url.clone()) else {
        errln!("error: ckpt bench needs a store URL (--url URL)");
        return ExitCode::from(EXIT_USAGE);
    };
    let store = match store_config(&args.options)
        .and_then(|c| Store::open(&url, c).map_err(|e| e.to_string()))
    {
        Ok(store) => store,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(EXIT_USAGE);
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
        rss_saves: args.rss_saves,
        codec_sample_bytes: args.codec_sample_mib << 20,
        threads: args.ranks_as != RanksAs::Processes,
        processes: args.ranks_as != RanksAs::Threads,
        store_options: args.options.clone(),
    };
    print_bench(
        args.json,
        |progress| bench::run(&store, runtime.handle(), &config, progress),
        bench::render,
    )
}

fn run_bench_rank(runtime: tokio::runtime::Runtime, args: BenchRankArgs) -> ExitCode {
    // The rank makes its own runtime, as a trainer's rank does.
    drop(runtime);
    let config: BenchConfig = match serde_json::from_str(&args.config) {
        Ok(config) => config,
        Err(e) => {
            errln!("error: bench-rank: bad --config: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let store = match store_config(&args.options)
        .and_then(|c| Store::open(&args.url, c).map_err(|e| e.to_string()))
    {
        Ok(store) => store,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match bench::rank_main(store, args.rank, config) {
        Ok(()) => ExitCode::from(EXIT_OK),
        Err(e) => {
            errln!("error: bench rank {}: {e}", args.rank);
            ExitCode::from(EXIT_CHECK_FAILED)
        }
    }
}

fn store_config(options: &[String]) -> Result<StoreConfig, String> {
    let mut config = StoreConfig::default();
    for option in options {
        let (key, value) = option
            .split_once('=')
            .ok_or_else(|| format!("option {option:?} is not KEY=VALUE"))?;
        config = config.with_option(key.trim(), value.trim());
    }
    Ok(config)
}

async fn run_probe(url: &str, options: &[String], json: bool) -> ExitCode {
    let store =
        match store_config(options).and_then(|c| Store::open(url, c).map_err(|e| e.to_string())) {
            Ok(store) => store,
            Err(e) => {
                errln!("error: {e}");
                return ExitCode::from(EXIT_USAGE);
            }
        };
    let report = probe(&store).await;
    if json {
        let printed = print_json(&report);
        if printed != ExitCode::from(EXIT_OK) {
            return printed;
        }
    } else {
        outln!("probe of {}", report.url);
        for step in &report.steps {
            let status = if step.ok { "ok" } else { "FAILED" };
            outln!("  {:<18} {:>6}  {:>9.1} ms", step.step, status, step.ms);
            if let Some(error) = &step.error {
                outln!("    {error}");
            }
        }
    }
    if report.ok() {
        ExitCode::from(EXIT_OK)
    } else {
        ExitCode::from(EXIT_CHECK_FAILED)
    }
}
