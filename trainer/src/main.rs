//! `ckpt-train`: the reference trainer's command line.
//!
//! `ckpt-train [train] [OPTIONS]` runs one rank (rank, world size and rendezvous from
//! `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; a single rank without them);
//! `ckpt-train launch --nproc N -- [OPTIONS]` starts N ranks; `bench-collectives`
//! measures the TCP backend; `collective-probe` is a fault-injection helper for tests.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use ckpt::HostBudget;
use ckpt::copies::{Copies, CopyConfig};
use ckpt::storage::Store;
use ckpt_elastic::{Agent, AgentConfig, RankEnv, Rdzv};
use ckpt_launch::{EXIT_STOPPED, LaunchArgs, signals};
use ckpt_trainer::bench;
use ckpt_trainer::collective::{Collective, TcpCollective, TcpConfig};
use ckpt_trainer::elastic::{self as elastic_rank, Exit};
use ckpt_trainer::model::Preset;
use ckpt_trainer::train::{
    self, Checkpointing, Hold, NanFault, Outcome, Stats, TrainConfig, Unsupervised,
};
use clap::{ArgAction, Parser};
use std::sync::Arc;

const EXIT_FAILED: u8 = 1;
const EXIT_USAGE: u8 = 2;

const TRAIN_HELP: &str = "\
Examples:
  # 4 ranks, checkpoints on local disk every 50 steps
  ckpt-train launch --nproc 4 -- --preset tiny --steps 200 --ckpt file://./runs/demo
  # resume the newest commit on 3 ranks and continue to step 400
  ckpt-train launch --nproc 3 -- --preset tiny --steps 400 --ckpt file://./runs/demo --resume
  ckpt ls file://./runs/demo && ckpt inspect file://./runs/demo

Other commands:
  ckpt-train launch --nproc N [--master-port P] -- [TRAIN OPTIONS]   start N ranks
  ckpt-train bench-collectives [--size BYTES] [--iters N]             (under launch)
  ckpt-train bench-nccl [--iters N] [--device D]   NCCL build/abort/rebuild times (feature cuda)

Exit codes: 0 finished; 1 failed (a collective, a checkpoint, a rank); 2 usage;
75 stopped by SIGTERM/SIGINT after committing a final checkpoint (resume later).";

/// How saves stage the rank's state (`--staging`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Staging {
    /// Copy in the background; wait before the optimizer step.
    Overlapped,
    /// Copy inside `save`.
    Blocking,
}

/// Train one rank of a sharded data-parallel MLP on a seeded synthetic task,
/// checkpointing through ckpt.
#[derive(Parser, Debug)]
#[command(name = "ckpt-train", version, after_help = TRAIN_HELP)]
struct TrainArgs {
    /// Model and batch sizes: tiny (tests, ~2k parameters), small (~25M), medium (~100M).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Seed of the initial weights, the teacher network and the data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The step to reach; a resumed run continues up to it.
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// Store URL for checkpoints (file://./dir, s3://bucket/prefix, gs://…, az://…);
    /// none: no checkpoints.
    #[arg(long)]
    ckpt: Option<String>,
    /// Save every K steps (plus the final step); 0: only the final step.
    #[arg(long, default_value_t = 50)]
    ckpt_every: u64,
    /// Snapshot into host memory every N steps (0: never), beside the store saves:
    /// each rank keeps its snapshot and a replica of its ring predecessor's, and the
    /// world commits it by a vote at the next step. In an elastic job the commit is
    /// recorded in the control plane, and survivors of a lost rank resume from the
    /// newest committed snapshot when they hold all of it and it is newer than the
    /// store's newest commit (at most N + 1 steps lost). A fixed world keeps the
    /// commit in memory only: a restarted job resumes from the store.
    #[arg(long, default_value_t = 0)]
    snapshot_every: u64,
    /// Bytes of host memory each rank's checkpointing may hold (staging buffers,
    /// in-memory copies, replicas, snapshots); a snapshot that does not fit is
    /// skipped, a save that does not fit is staged in pieces. Default: unbounded.
    #[arg(long)]
    host_memory_budget: Option<u64>,
    /// Resume from the newest committed checkpoint under --ckpt (any world size);
    /// starts fresh when there is none.
    #[arg(long)]
    resume: bool,
    /// Exact fixed-point gradient sums: weights bitwise identical for any world size
    /// and any stop/resume history. --deterministic=false: f32 sums (faster).
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    deterministic: bool,
    /// Keep the K newest checkpoints.
    #[arg(long, default_value_t = 3)]
    keep: usize,
    /// Saves in a row that may fail (storage errors past retries, a full disk) while
    /// training goes on; one more stops the job with the error. The final save must
    /// commit.
    #[arg(long, default_value_t = 3)]
    max_failed_saves: u32,
    /// Seconds a superseded checkpoint stays for readers before retention removes it.
    #[arg(long, default_value_t = 600)]
    keep_grace_secs: u64,
    /// Print the loss every N steps (rank 0).
    #[arg(long, default_value_t = 10)]
    log_every: u64,
    /// Elastic jobs: keep in RAM a copy of the rows each rank saves and a replica of
    /// its ring predecessor's, so that survivors recover from memory instead of the
    /// store (up to about 4× the rank's share of a checkpoint in RAM).
    /// --memory-copies=false: recoveries read the store.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    memory_copies: bool,
    /// A world of more than one rank resumes cooperatively: rank 0 alone reads the
    /// commit and shares it, and each byte of the checkpoint is read from the store by
    /// one rank and passed to the others over the collective, verified by its CRC32
    /// where it lands. --cooperative-load=false: every rank reads what it needs from
    /// the store on its own.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    cooperative_load: bool,
    /// How a save copies the rank's state into its staging buffer: `overlapped`
    /// returns at once and copies while the next step gathers and computes (the rank
    /// waits for the copy only before its optimizer step); `blocking` copies inside
    /// the step that saves.
    #[arg(long, value_enum, default_value_t = Staging::Overlapped)]
    staging: Staging,
    /// Check that no saved tensor changes before its staging copy ends (a CRC32 of
    /// every tensor when the save starts; costs one read of the state per save).
    /// Default: on in debug builds.
    #[arg(long, default_value_t = cfg!(debug_assertions), num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    check_staging: bool,
    /// Data-parallel replicas of every shard: the world is R x S ranks, rank r holding
    /// shard r % S; replica group 0 writes each save, the others checksum their
    /// copies and the commit compares them. A world that R does not divide trains
    /// without replicas.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    replicas: u32,
    /// When replicas disagree at a save: `warn` commits it marked unhealthy (resumes
    /// pass over it), `fail` refuses the commit.
    #[arg(long, default_value = "warn")]
    replica_mismatch: ckpt::ReplicaPolicy,
    /// Roll back when a step's loss exceeds F times the mean of the 10 losses before
    /// it (off by default; a non-finite loss or parameter always rolls back).
    #[arg(long)]
    spike_factor: Option<f64>,
    /// Rollbacks in a row to the same checkpoint that the job survives; one more
    /// stops it with an error naming the step.
    #[arg(long, default_value_t = 3)]
    max_rollbacks: u32,
    /// A collective fails when a peer makes no progress for this many seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout_secs: f64,
    /// Fault injection for tests: STEP:RANK:before-save|after-save parks that rank
    /// forever at that step (the world then hangs mid-step until killed; in an
    /// elastic job, until the generation is cancelled). Elastic faults happen only in
    /// the job's first generation.
    #[arg(long, hide = true)]
    fault_hold: Option<String>,
    /// Test knob: sleep this many milliseconds after every step.
    #[arg(long, hide = true, default_value_t = 0)]
    fault_step_pause_ms: u64,
    /// Fault injection for tests: STEP:RANK reports a device error on that rank at
    /// that step (what a lost GPU does), which it cannot recover from.
    #[arg(long, hide = true)]
    fault_device_error: Option<String>,
    /// Fault injection for tests: STEP:RANK flips one bit of every in-memory copy
    /// that rank keeps of its saves from that step on (memory that rots after the
    /// save), which a recovery must catch by the save's checksums.
    #[arg(long, hide = true)]
    fault_rot_copy: Option<String>,
    /// Fault injection for tests: FAILPOINT@STEP:RANK arms that failpoint of the
    /// save protocol (`ckpt::failpoint::NAMES`) on that rank before its first save at
    /// or after that step; the rank announces it and stops there, for a test to kill
    /// it. Needs a build with the `ckpt/failpoints` feature.
    #[arg(long, hide = true)]
    fault_save_stage: Option<String>,
    /// Fault injection for tests: `STEP:RANK[:persistent]` writes a NaN into one
    /// parameter element of that rank right after that step (before its save): once
    /// per process (in an elastic job, in its first generation only), or every time
    /// the rank reaches the step with `:persistent`.
    #[arg(long, hide = true)]
    fault_nan: Option<String>,
    /// Fault injection for tests: STEP:RANK flips one bit of one parameter element of
    /// that rank right before the save of that step, and flips it back once the save
    /// has its copy (with --replicas 2 or more, the commit names that rank).
    #[arg(long, hide = true)]
    fault_sdc: Option<String>,
    /// Fault injection for tests: STEP:RANK makes that rank vote against the snapshot
    /// of that step, as a rank that never finished it would (it is not committed).
    #[arg(long, hide = true)]
    fault_snapshot_vote: Option<String>,
}

/// Measure the TCP backend: all-reduce and all-gather bus bandwidth against one raw
/// loopback TCP stream (run it under `launch`).
#[derive(Parser, Debug)]
#[command(
    name = "ckpt-train bench-collectives",
    after_help = "Example:\n  ckpt-train launch --nproc 4 -- bench-collectives --size 67108864 --iters 5"
)]
struct BenchArgs {
    /// Bytes per operation (the all-reduced buffer, the gathered buffer).
    #[arg(long, default_value_t = 64 << 20)]
    size: usize,
    /// Timed iterations of each operation.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Measure the NCCL communicator's recovery costs on one GPU: build, abort, rebuild
/// (feature `cuda`; a world of one rank, no launcher needed).
#[cfg(feature = "cuda")]
#[derive(Parser, Debug)]
#[command(
    name = "ckpt-train bench-nccl",
    after_help = "Example:\n  ckpt-train bench-nccl --iters 10 --json"
)]
struct NcclBenchArgs {
    /// Build–use–abort cycles (the first is reported apart).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Test helper: loop all-gathers; one rank kills itself during one of them.
#[derive(Parser, Debug)]
#[command(name = "ckpt-train collective-probe")]
struct ProbeArgs {
    /// Bytes per rank per all-gather.
    #[arg(long, default_value_t = 16 << 20)]
    size: usize,
    /// Iterations.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// RANK:ITER — that rank SIGKILLs itself while entering that iteration.
    #[arg(long)]
    kill: Option<String>,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_secs: f64,
}

/// Start N rank processes of this program on this machine (like torchrun).
#[derive(Parser, Debug)]
#[command(
    name = "ckpt-train launch",
    after_help = "Example:\n  ckpt-train launch --nproc 4 -- --preset tiny --steps 200 --ckpt file://./runs/demo\n\nThe same launcher as `ckpt launch`, running this program."
)]
struct LaunchCommand {
    #[command(flatten)]
    launch: LaunchArgs,
    /// The ranks' arguments: training options, or `bench-collectives …`.
    #[arg(last = true)]
    args: Vec<OsString>,
}

struct World {
    rank: usize,
    world: usize,
    rendezvous: SocketAddr,
}

fn world_from_env() -> Result<World, String> {
    let get = |key: &str| std::env::var(key).ok();
    let parse = |key: &str, default: usize| -> Result<usize, String> {
        match get(key) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|e| format!("{key}={v:?} is not a number: {e}")),
        }
    };
    let rank = parse("RANK", 0)?;
    let world = parse("WORLD_SIZE", 1)?;
    let addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
    let port = parse("MASTER_PORT", 29500)?;
    let ip: IpAddr = addr
        .parse()
        .map_err(|e| format!("MASTER_ADDR={addr:?} is not an IP address: {e}"))?;
    if world == 0 || rank >= world {
        return Err(format!("RANK={rank} is not in WORLD_SIZE={world}"));
    }
    Ok(World {
        rank,
        world,
        rendezvous: SocketAddr::new(ip, port as u16),
    })
}

/// Rank 0's rendezvous listener when the launcher bound it and passed it down.
fn inherited_rendezvous(world: &World) -> Result<Option<std::net::TcpListener>, String> {
    use std::os::fd::FromRawFd;
    let Some(text) = std::env::var(ckpt_launch::RENDEZVOUS_FD).ok() else {
        return Ok(None);
    };
    if world.rank != 0 {
        return Ok(None);
    }
    let fd: i32 = text
        .parse()
        .map_err(|e| format!("{}={text:?}: {e}", ckpt_launch::RENDEZVOUS_FD))?;
    // SAFETY: `struct stat` is plain old data: all zeroes is a valid value.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat(2) writes only into `stat`, a valid and writable `struct stat`;
    // a descriptor that is not open makes it fail, which is checked.
    let fstat = unsafe { libc::fstat(fd, &mut stat) };
    if fd < 3 || fstat != 0 || stat.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(format!(
            "{}={fd} is not an inherited socket",
            ckpt_launch::RENDEZVOUS_FD
        ));
    }
    // SAFETY: the launcher opened this listening socket for rank 0 and passed it down;
    // nothing else in this process owns the descriptor: `connect`, the only reader
    // of the variable, runs once per process.
    let listener = unsafe { std::net::TcpListener::from_raw_fd(fd) };
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    if bound.port() != world.rendezvous.port() {
        return Err(format!(
            "the inherited rendezvous listener is bound to {bound}, MASTER_PORT says {}",
            world.rendezvous.port()
        ));
    }
    Ok(Some(listener))
}

fn connect(world: &World, timeout_secs: f64) -> Result<TcpCollective, String> {
    // The job's secret, which the launcher passes to its ranks: the ring admits
    // only ranks that prove it.
    let secret =
        ckpt_auth::JobSecret::from_env().map_err(|e| format!("rank {}: {e}", world.rank))?;
    let config = TcpConfig {
        timeout: Duration::from_secs_f64(timeout_secs),
        secret,
        ..TcpConfig::default()
    };
    match inherited_rendezvous(world).map_err(|e| format!("rank {}: {e}", world.rank))? {
        Some(listener) => TcpCollective::bootstrap_root(listener, world.world, config),
        None => TcpCollective::bootstrap(world.rank, world.world, world.rendezvous, config),
    }
    .map_err(|e| format!("rank {}: {e}", world.rank))
}

/// A fixed world's copy server for snapshots, bound on the address this host uses
/// toward the rendezvous (a UDP socket's connect sends nothing), with the job's
/// secret; `None` (logged) when it cannot serve.
fn fixed_world_copies(world: &World, config: &TrainConfig) -> Option<Arc<Copies>> {
    let ip = std::net::UdpSocket::bind((IpAddr::from([0, 0, 0, 0]), 0))
        .and_then(|s| s.connect(world.rendezvous).and_then(|()| s.local_addr()))
        .map_or(world.rendezvous.ip(), |a| a.ip());
    let copy_config = CopyConfig {
        secret: ckpt_auth::JobSecret::from_env().ok().flatten(),
        budget: Some(HostBudget::new(config.host_memory_budget)),
        ..CopyConfig::default()
    };
    match Copies::serve(ip, copy_config) {
        Ok(copies) => Some(Arc::new(copies)),
        Err(e) => {
            tracing::warn!(%ip, error = %e, "no copy server: no snapshots");
            None
        }
    }
}

fn fail(code: u8, message: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(code)
}

fn parse_pair(text: &str, what: &str) -> Result<(u64, usize), String> {
    let (a, b) = text
        .split_once(':')
        .ok_or_else(|| format!("{what} {text:?} is not A:B"))?;
    Ok((
        a.parse().map_err(|e| format!("{what} {text:?}: {e}"))?,
        b.parse().map_err(|e| format!("{what} {text:?}: {e}"))?,
    ))
}

/// `FAILPOINT@STEP:RANK` of `--fault-save-stage`.
fn parse_save_stage(text: &str) -> Result<(String, u64, usize), String> {
    let (name, at) = text
        .split_once('@')
        .ok_or_else(|| format!("--fault-save-stage {text:?} is not FAILPOINT@STEP:RANK"))?;
    if !ckpt::failpoint::available() {
        return Err(format!(
            "--fault-save-stage {text:?}: this ckpt-train has no failpoints (build it with --features ckpt/failpoints)"
        ));
    }
    if !ckpt::failpoint::NAMES.contains(&name) {
        return Err(format!(
            "--fault-save-stage {text:?}: unknown failpoint {name:?}; known: {}",
            ckpt::failpoint::NAMES.join(", ")
        ));
    }
    let (step, rank) = parse_pair(at, "--fault-save-stage")?;
    Ok((name.to_string(), step, rank))
}

/// `STEP:RANK[:persistent]` of `--fault-nan`.
fn parse_nan(text: &str) -> Result<NanFault, String> {
    let (pair, persistent) = match text.strip_suffix(":persistent") {
        Some(pair) => (pair, true),
        None => (text, false),
    };
    let (step, rank) = parse_pair(pair, "--fault-nan")?;
    Ok(NanFault {
        step,
        rank,
        persistent,
    })
}

fn ms(total: Duration, steps: u64) -> f64 {
    total.as_secs_f64() * 1e3 / steps.max(1) as f64
}

fn parse_hold(text: &str) -> Result<Hold, String> {
    let bad = || format!("--fault-hold {text:?} is not STEP:RANK:before-save|after-save");
    let mut parts = text.split(':');
    let step = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
    let rank = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
    let before_save = match parts.next() {
        Some("before-save") => true,
        Some("after-save") => false,
        _ => return Err(bad()),
    };
    Ok(Hold {
        step,
        rank,
        before_save,
    })
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let mut args: Vec<OsString> = std::env::args_os().collect();
    let command = args.get(1).and_then(|a| a.to_str()).map(str::to_owned);
    match command.as_deref() {
        Some("launch") => {
            args.remove(1);
            run_launch(LaunchCommand::parse_from(args))
        }
        Some("bench-collectives") => {
            args.remove(1);
            run_bench(BenchArgs::parse_from(args))
        }
        #[cfg(feature = "cuda")]
        Some("bench-nccl") => {
            args.remove(1);
            run_nccl_bench(NcclBenchArgs::parse_from(args))
        }
        Some("collective-probe") => {
            args.remove(1);
            run_probe(ProbeArgs::parse_from(args))
        }
        Some("train") => {
            args.remove(1);
            run_train(TrainArgs::parse_from(args))
        }
        _ => run_train(TrainArgs::parse_from(args)),
    }
}

fn run_launch(command: LaunchCommand) -> ExitCode {
    let program = match std::env::current_exe() {
        Ok(exe) => exe.into_os_string(),
        Err(e) => return fail(EXIT_FAILED, format!("launch: this program's path: {e}")),
    };
    let program = ckpt_launch::Program {
        program,
        args: command.args,
        hand_over_listener: true,
        last_call: ckpt_elastic::Timeouts::DEFAULT.last_call,
    };
    let config = match command.launch.config(program) {
        Ok(c) => c,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    match ckpt_launch::launch(&config) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => fail(EXIT_FAILED, format!("launch: {e}")),
    }
}

#[cfg(feature = "cuda")]
fn run_nccl_bench(args: NcclBenchArgs) -> ExitCode {
    match ckpt_trainer::nccl_bench::run(args.device, args.iters) {
        Ok(report) if args.json => {
            println!("{}", serde_json::to_string(&report).expect("serializable"));
            ExitCode::SUCCESS
        }
        Ok(r) => {
            println!(
                "NCCL {} on device {}, medians of {} cycles after the first: \
                 build until ready {:.1} ms (first {:.1} ms), abort {:.1} ms, \
                 abort + rebuild {:.1} ms, 1 MiB all-reduce {:.2} ms",
                r.nccl_version,
                args.device,
                r.iters - 1,
                r.init_ms,
                r.first_init_ms,
                r.abort_ms,
                r.recreate_ms,
                r.all_reduce_ms
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(EXIT_FAILED, e),
    }
}

fn run_bench(args: BenchArgs) -> ExitCode {
    let world = match world_from_env() {
        Ok(w) => w,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let comm = match connect(&world, 120.0) {
        Ok(c) => c,
        Err(e) => return fail(EXIT_FAILED, e),
    };
    match bench::run(&comm, args.size, args.iters) {
        Ok(report) => {
            if world.rank == 0 {
                if args.json {
                    println!("{}", serde_json::to_string(&report).expect("serializable"));
                } else {
                    println!(
                        "world {} size {} MiB x{}: raw loopback TCP {:.2} GB/s | all-reduce algbw {:.2} GB/s busbw {:.2} GB/s | all-gather algbw {:.2} GB/s busbw {:.2} GB/s",
                        report.world_size,
                        report.bytes >> 20,
                        report.iters,
                        report.raw_tcp_gbps,
                        report.all_reduce_algbw_gbps,
                        report.all_reduce_busbw_gbps,
                        report.all_gather_algbw_gbps,
                        report.all_gather_busbw_gbps
                    );
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(EXIT_FAILED, format!("rank {}: {e}", world.rank)),
    }
}

fn run_probe(args: ProbeArgs) -> ExitCode {
    let world = match world_from_env() {
        Ok(w) => w,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let kill = match args
        .kill
        .as_deref()
        .map(|k| parse_pair(k, "--kill"))
        .transpose()
    {
        Ok(k) => k.map(|(rank, at)| (rank as usize, at)),
        Err(e) => return fail(EXIT_USAGE, e),
    };
    // The launcher sends SIGTERM to the survivors as soon as the killed rank is
    // reaped; the probe must outlive it long enough to report how its collective
    // failed, which is what it is for (the flag is never read: the launcher's
    // SIGKILL after its grace period ends a probe that hangs).
    signals::install();
    let comm = match connect(&world, args.timeout_secs) {
        Ok(c) => c,
        Err(e) => return fail(EXIT_FAILED, e),
    };
    match bench::probe(&comm, args.size, args.iters, kill) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(EXIT_FAILED, format!("rank {}: {e}", world.rank)),
    }
}

fn run_train(args: TrainArgs) -> ExitCode {
    let Some(preset) = Preset::named(&args.preset) else {
        return fail(
            EXIT_USAGE,
            format!(
                "unknown preset {:?}: expected tiny, small or medium",
                args.preset
            ),
        );
    };
    if args.resume && args.ckpt.is_none() {
        return fail(EXIT_USAGE, "--resume needs --ckpt URL");
    }
    if !args.timeout_secs.is_finite() || args.timeout_secs <= 0.0 {
        return fail(
            EXIT_USAGE,
            format!("--timeout-secs must be positive, got {}", args.timeout_secs),
        );
    }
    let hold = match args.fault_hold.as_deref().map(parse_hold).transpose() {
        Ok(h) => h,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let device_error = match args
        .fault_device_error
        .as_deref()
        .map(|f| parse_pair(f, "--fault-device-error"))
        .transpose()
    {
        Ok(d) => d,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let rot_copy = match args
        .fault_rot_copy
        .as_deref()
        .map(|f| parse_pair(f, "--fault-rot-copy"))
        .transpose()
    {
        Ok(d) => d,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let save_stage = match args
        .fault_save_stage
        .as_deref()
        .map(parse_save_stage)
        .transpose()
    {
        Ok(f) => f,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let nan = match args.fault_nan.as_deref().map(parse_nan).transpose() {
        Ok(f) => f,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let sdc = match args
        .fault_sdc
        .as_deref()
        .map(|f| parse_pair(f, "--fault-sdc"))
        .transpose()
    {
        Ok(d) => d,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let snapshot_vote_against = match args
        .fault_snapshot_vote
        .as_deref()
        .map(|f| parse_pair(f, "--fault-snapshot-vote"))
        .transpose()
    {
        Ok(d) => d,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    if let Some(f) = args.spike_factor
        && !(f.is_finite() && f > 0.0)
    {
        return fail(
            EXIT_USAGE,
            format!("--spike-factor must be positive, got {f}"),
        );
    }
    let store = match args.ckpt.as_deref().map(Store::from_url).transpose() {
        Ok(s) => s,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let rank_env = match RankEnv::from_env() {
        Ok(r) => r,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let world = match rank_env {
        Some(_) => None,
        None => match world_from_env() {
            Ok(w) => Some(w),
            Err(e) => return fail(EXIT_USAGE, e),
        },
    };
    signals::install();
    signals::exit_on_second_signal();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(EXIT_FAILED, format!("tokio runtime: {e}")),
    };
    let config = TrainConfig {
        preset,
        seed: args.seed,
        steps: args.steps,
        deterministic: args.deterministic,
        ckpt_every: args.ckpt_every,
        snapshot_every: args.snapshot_every,
        host_memory_budget: args.host_memory_budget,
        snapshot_vote_against,
        keep: args.keep,
        cooperative_load: args.cooperative_load,
        max_failed_saves: args.max_failed_saves,
        retention_grace: std::time::Duration::from_secs(args.keep_grace_secs),
        resume: args.resume,
        log_every: args.log_every,
        generation: 0,
        run_id: None,
        hold,
        step_pause: Duration::from_millis(args.fault_step_pause_ms),
        device_error,
        rot_copy,
        save_stage,
        memory_copies: args.memory_copies,
        overlapped_staging: args.staging == Staging::Overlapped,
        check_staging: args.check_staging,
        replicas: args.replicas as usize,
        replica_mismatch: args.replica_mismatch,
        spike_factor: args.spike_factor,
        max_rollbacks: args.max_rollbacks,
        nan,
        sdc,
    };
    let world = match (world, rank_env) {
        (Some(world), _) => world,
        (None, Some(rank_env)) => {
            return run_elastic_rank(rank_env, &runtime, store.as_ref(), &config, &args);
        }
        (None, None) => unreachable!("either a fixed world or a coordinator"),
    };
    let comm = match connect(&world, args.timeout_secs) {
        Ok(c) => c,
        Err(e) => return fail(EXIT_FAILED, e),
    };
    let mut stats = Stats::default();
    // A fixed world never recovers in its processes: copies of store saves would
    // serve no one (snapshots are committed, in memory, all the same).
    let config = TrainConfig {
        memory_copies: false,
        ..config
    };
    let mut checkpointing = Checkpointing::default();
    if config.snapshot_every > 0 && store.is_some() {
        checkpointing.copies = fixed_world_copies(&world, &config);
    }
    let outcome = train::run_supervised(
        &comm,
        runtime.handle(),
        store.as_ref(),
        &config,
        &signals::STOP,
        &mut stats,
        &Unsupervised,
        &mut checkpointing,
    );
    let rank = comm.rank();
    match outcome {
        Ok(Outcome::Finished { step, loss }) => {
            if rank == 0 {
                let secs = stats.elapsed.as_secs_f64();
                println!(
                    "done: step {step}, loss {loss:.6}; {} steps in {secs:.3} s ({:.3} steps/s, steady {:.3} steps/s), {} saves, {:.3} s blocked on checkpoints, {} snapshots, {:.3} s blocked on snapshots",
                    stats.steps,
                    stats.steps as f64 / secs.max(1e-9),
                    stats.steady_steps_per_s(),
                    stats.saves,
                    stats.ckpt_blocked.as_secs_f64(),
                    stats.snapshots,
                    stats.snapshot_blocked.as_secs_f64()
                );
                println!(
                    "time per step (rank 0): all-gather {:.1} ms, forward/backward {:.1} ms, reduce-scatter {:.1} ms, adam {:.1} ms, checkpoint {:.1} ms",
                    ms(stats.gather, stats.steps),
                    ms(stats.compute, stats.steps),
                    ms(stats.reduce, stats.steps),
                    ms(stats.update, stats.steps),
                    ms(stats.ckpt_blocked, stats.steps)
                );
            }
            ExitCode::SUCCESS
        }
        Ok(Outcome::Stopped { step }) => {
            eprintln!("rank {rank}: stopped at step {step} after a committed checkpoint");
            ExitCode::from(EXIT_STOPPED as u8)
        }
        Ok(Outcome::Regroup { step }) => fail(
            EXIT_FAILED,
            format!("rank {rank}: a fixed world was asked to regroup at step {step}"),
        ),
        Err(e) => fail(EXIT_FAILED, format!("rank {rank}: {e}")),
    }
}

/// One rank of an elastic job (the launcher set `CKPT_RDZV`): join the coordinator
/// and train through as many generations as it takes.
fn run_elastic_rank(
    rank_env: RankEnv,
    runtime: &tokio::runtime::Runtime,
    store: Option<&Store>,
    config: &TrainConfig,
    args: &TrainArgs,
) -> ExitCode {
    let member = rank_env.member.clone();
    let ip = rank_env.ip();
    let plane = match rank_env.connect() {
        Ok(p) => p,
        // A node started after the job ended finds its coordinator gone with it; the
        // store says whether there is anything left to do.
        Err(e)
            if matches!(rank_env.rdzv, Rdzv::Tcp(_))
                && elastic_rank::final_step_committed(runtime.handle(), store, config.steps) =>
        {
            println!(
                "done: the job finished at step {} before this member joined ({e})",
                config.steps
            );
            return ExitCode::SUCCESS;
        }
        Err(e) => return fail(EXIT_FAILED, e),
    };
    let agent = Agent::new(plane, AgentConfig::default());
    let tcp = TcpConfig {
        timeout: Duration::from_secs_f64(args.timeout_secs),
        secret: rank_env.secret.clone(),
        ..TcpConfig::default()
    };
    match elastic_rank::run(
        &agent,
        &member.job,
        runtime.handle(),
        store,
        config,
        &tcp,
        ip,
        &signals::STOP,
    ) {
        Exit::Finished { step, loss } => {
            println!("done: step {step}, loss {loss:.6} (member {})", member.id);
            ExitCode::SUCCESS
        }
        Exit::Stopped { step } => {
            eprintln!(
                "member {}: stopped at step {step} after a committed checkpoint",
                member.id
            );
            ExitCode::from(EXIT_STOPPED as u8)
        }
        Exit::Over { step, reason } => {
            println!(
                "done: the job finished at step {step} without this member ({reason}; member {})",
                member.id
            );
            ExitCode::SUCCESS
        }
        Exit::Left(why) => fail(EXIT_FAILED, format!("member {}: {why}", member.id)),
        Exit::Failed(why) => fail(EXIT_FAILED, format!("member {}: {why}", member.id)),
    }
}
