//! The `ckpt` command line: the subcommands and their dispatch. Each subcommand's
//! flags and work are in a module of its own; exit codes in [`exit`], the flags of
//! every command that opens a store in [`store`].

mod bench;
mod commands;
mod coordinator;
mod exit;
mod output;
mod probe;
mod store;

use std::process::ExitCode;

use bench::command::{BenchArgs, BenchRankArgs};
use clap::{Parser, Subcommand};
use coordinator::CoordinatorArgs;
use output::errln;
use store::{LibraryDefaults, StoreArgs};

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
        #[command(flatten)]
        store: StoreArgs<LibraryDefaults>,
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
        return coordinator::run_coordinator(args);
    }
    if let Command::Launch { launch, command } = cli.command {
        return run_launch(&launch, command);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            errln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(exit::USAGE);
        }
    };
    match cli.command {
        Command::Probe { url, store, json } => {
            runtime.block_on(probe::run_probe(&url, &store, json))
        }
        Command::Bench(args) => bench::command::run_bench(&runtime, *args),
        Command::BenchRank(args) => bench::command::run_bench_rank(runtime, args),
        Command::Tool(tool) => runtime.block_on(commands::run(tool)),
        Command::Coordinator(args) => coordinator::run_coordinator(args),
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
            return ExitCode::from(exit::USAGE);
        }
    };
    match ckpt_launch::launch(&config) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            errln!("launch: {e}");
            ExitCode::from(exit::CHECK_FAILED)
        }
    }
}
