//! `ckpt bench` with every rank in a process of its own, as trainers and PyTorch DCP
//! run them.
//!
//! Threads of one process share an allocator, a page table and a runtime; processes
//! do not, and that changes the figures that matter (the cost of faulting pages in,
//! the contention of the copy and of the reads). So the bench runs the core of W1
//! both ways. The parent starts one `ckpt bench-rank` child per rank and drives them
//! in lock step over their stdin and stdout, one JSON line per command and per reply:
//! a command is written to every child before any reply is read, so the ranks start
//! together (within the microseconds of a few pipe writes), like the threads behind a
//! barrier. Children report times on the monotonic clock, which every process of the
//! machine shares, so the parent can take the first start and the last end across
//! them. Each child generates its own rank's values from the seed, as the threads do.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{
    BenchConfig, CoreFigures, MemcpyFigures, RawTarget, evict_step, generate_rank, invalid, max,
    ms, state_of,
};
use ckpt::format::step_dir;
use ckpt::load::{CheckpointReader, LoadRequest};
use ckpt::region::Region;
use ckpt::save::{CheckpointConfig, Checkpointer};
use ckpt::state::State;
use ckpt::storage::Store;
use ckpt::{DType, Error, ReplicaPolicy, Result};

/// The core of W1 with one process per rank.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct ProcessesReport {
    /// Rank processes that save.
    pub ranks: usize,
    /// The figures (their keys at this object's level in JSON).
    #[serde(flatten)]
    pub core: CoreFigures,
    /// The same-size load's store counters, every rank's summed (the last
    /// repetition's; a local store's data files are read without requests).
    pub load: super::cooperative::LoadCounters,
    /// The same for the load onto `reshard_ranks` processes.
    pub reshard_load: super::cooperative::LoadCounters,
    /// Every repetition's figures.
    pub samples: std::collections::BTreeMap<String, Vec<f64>>,
}

/// What the parent asks a rank process to do.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub(super) enum Order {
    /// Allocate and fault in the staging pool.
    WarmUp,
    /// Copy the rank's bytes once into a pre-faulted buffer.
    Memcpy,
    /// Save `step`, blocking or overlapped, and wait for the commit; with
    /// `no_agreement`, through the checkpointer that does not compare replicas.
    Save {
        step: u64,
        overlapped: bool,
        #[serde(default)]
        no_agreement: bool,
    },
    /// Load rank's dim-0 shard of every tensor of `step` for a world of `world`
    /// (ranks at or above it do nothing); with `verify`, compare with the values.
    Load {
        step: u64,
        world: usize,
        verify: bool,
    },
    /// Exit.
    Exit,
}

/// A rank process's answer: the fields its order fills, or `error`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Answer {
    pub(super) error: Option<String>,
    pub(super) ms: f64,
    pub(super) stall_ms: f64,
    pub(super) staged_ms: f64,
    pub(super) start_ns: u64,
    pub(super) durable_ns: u64,
    pub(super) end_ns: u64,
    pub(super) requested: u64,
    pub(super) read: u64,
    pub(super) file_bytes: u64,
    pub(super) skipped: bool,
    #[serde(default)]
    pub(super) load: super::cooperative::LoadCounters,
}

/// Nanoseconds on the monotonic clock that every process of the machine shares
/// (`Instant` cannot be sent to another process).
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The run id of the processes' saves: apart from the threads' saves of the same run.
const RUN_ID: &str = "bench-processes";

/// `ckpt bench-rank`: one rank process, driven by the parent over stdin and stdout.
pub(crate) fn rank_main(store: Store, rank: usize, config: BenchConfig) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Failed(format!("rank {rank}: tokio runtime: {e}")))?;
    let rt = runtime.handle();
    // Ranks past the saving world only take part in the resharded load.
    let saver = rank < config.ranks;
    // With replicas, a rank holds shard `rank % shards`: the values of that rank of
    // a world of `shards`.
    let shards = config.ranks / config.replicas.max(1);
    let data = if saver {
        let mut sharded = config.clone();
        sharded.ranks = shards;
        generate_rank(&sharded, rank % shards)
    } else {
        Vec::new()
    };
    let checkpointer = |policy: ReplicaPolicy| -> Result<Checkpointer> {
        let mut c = CheckpointConfig::new(rank, config.ranks);
        c.block_size = config.block_size;
        c.run_id = RUN_ID.into();
        c.replica_mismatch = policy;
        Checkpointer::new(store.clone(), c)
    };
    let checkpointers = if saver {
        Some(Savers {
            agreeing: checkpointer(ReplicaPolicy::Warn)?,
            unchecked: if config.replicas > 1 {
                Some(checkpointer(ReplicaPolicy::Off)?)
            } else {
                None
            },
        })
    } else {
        None
    };
    let bytes: usize = data.iter().map(|t| t.len() * 4).sum();
    let mut scratch = Scratch::default();
    let stdin = std::io::stdin().lock();
    let mut stdout = std::io::stdout().lock();
    for line in stdin.lines() {
        let line = line.map_err(|e| Error::Failed(format!("rank {rank}: stdin: {e}")))?;
        let order: Order = serde_json::from_str(&line)
            .map_err(|e| invalid(format!("rank {rank}: bad order {line:?}: {e}")))?;
        if matches!(order, Order::Exit) {
            break;
        }
        let answer = obey(
            rt,
            &store,
            checkpointers.as_ref(),
            &config,
            rank,
            &data,
            bytes,
            &mut scratch,
            order,
        )
        .unwrap_or_else(|e| Answer {
            error: Some(e.to_string()),
            ..Answer::default()
        });
        let text = serde_json::to_string(&answer).expect("answers serialize");
        writeln!(stdout, "{text}")
            .and_then(|()| stdout.flush())
            .map_err(|e| Error::Failed(format!("rank {rank}: stdout: {e}")))?;
    }
    Ok(())
}

/// A saving rank's checkpointers: the default one (replicas compared), and with
/// replicas one that does not compare them, for the bench of agreement's cost.
struct Savers {
    agreeing: Checkpointer,
    unchecked: Option<Checkpointer>,
}

/// The state a rank saves: its dim-0 shard of every tensor, or with replicas its
/// copy of its shard, written by replica 0 only.
fn rank_state<'a>(rank: usize, config: &BenchConfig, data: &'a [Vec<f32>]) -> Result<State<'a>> {
    if config.replicas <= 1 {
        return state_of(rank, config, data);
    }
    let shards = config.ranks / config.replicas;
    let shape = [config.rows, config.cols];
    let mut state = State::new();
    for (t, values) in data.iter().enumerate() {
        state.add_replica(
            format!("layers.{t:03}.weight"),
            DType::F32,
            &shape,
            Region::dim0_shard(&shape, rank % shards, shards),
            ckpt::as_bytes(values),
            rank < shards,
        )?;
    }
    Ok(state)
}

/// Memory a rank process keeps between orders, as a trainer keeps its buffers.
#[derive(Default)]
struct Scratch {
    /// The memcpy baseline's destination, pre-faulted.
    memcpy_dst: Vec<u8>,
    /// Load destinations by world size.
    loads: BTreeMap<usize, Vec<Vec<u8>>>,
}

#[allow(clippy::too_many_arguments)]
fn obey(
    rt: &tokio::runtime::Handle,
    store: &Store,
    savers: Option<&Savers>,
    config: &BenchConfig,
    rank: usize,
    data: &[Vec<f32>],
    bytes: usize,
    scratch: &mut Scratch,
    order: Order,
) -> Result<Answer> {
    let Some(savers) = savers else {
        // Not a saving rank: only loads concern it.
        if !matches!(order, Order::Load { .. }) {
            return Ok(Answer {
                skipped: true,
                ..Answer::default()
            });
        }
        return obey_load(rt, store, config, rank, data, &mut scratch.loads, order);
    };
    if let Order::Load { .. } = order {
        return obey_load(rt, store, config, rank, data, &mut scratch.loads, order);
    }
    let memcpy_dst = &mut scratch.memcpy_dst;
    let checkpointer = &savers.agreeing;
    Ok(match order {
        Order::WarmUp => {
            let state = rank_state(rank, config, data)?;
            let mut ms = super::ms(checkpointer.warm_up(&state)?);
            if let Some(unchecked) = &savers.unchecked {
                ms += super::ms(unchecked.warm_up(&state)?);
            }
            Answer {
                ms,
                ..Answer::default()
            }
        }
        Order::Memcpy => {
            if memcpy_dst.len() != bytes {
                // Pre-faulted, as the staging pool is after `warm_up`.
                *memcpy_dst = vec![1u8; bytes];
            }
            let started = Instant::now();
            let mut offset = 0;
            for t in data {
                let src = ckpt::as_bytes(t);
                memcpy_dst[offset..offset + src.len()].copy_from_slice(src);
                offset += src.len();
            }
            std::hint::black_box(&mut *memcpy_dst);
            Answer {
                ms: ms(started.elapsed()),
                ..Answer::default()
            }
        }
        Order::Save {
            step,
            overlapped,
            no_agreement,
        } => {
            let checkpointer = match (&savers.unchecked, no_agreement) {
                (Some(unchecked), true) => unchecked,
                (None, true) => return Err(invalid("no_agreement needs replicas")),
                (_, false) => checkpointer,
            };
            let state = rank_state(rank, config, data)?;
            let start_ns = now_ns();
            let outcome = if overlapped {
                // SAFETY: `data` lives as long as this process and is never written;
                // the copy is waited for below.
                rt.block_on(unsafe { checkpointer.save_overlapped(step, &state) })?
            } else {
                rt.block_on(checkpointer.save(step, &state))?
            };
            let handle = outcome;
            let staged = handle.wait_staged()?;
            rt.block_on(handle.durable())?;
            let durable_ns = now_ns();
            rt.block_on(handle.committed())?;
            let end_ns = now_ns();
            let file_bytes = if rank == 0 {
                let manifest = rt.block_on(ckpt::catalog::read_manifest(store, step))?;
                manifest.ranks.iter().map(|r| r.raw_bytes).sum()
            } else {
                0
            };
            Answer {
                stall_ms: ms(handle.stall()),
                staged_ms: ms(staged),
                start_ns,
                durable_ns,
                end_ns,
                file_bytes,
                ..Answer::default()
            }
        }
        Order::Load { .. } | Order::Exit => Answer::default(),
    })
}

/// A rank's load of its dim-0 shards of every tensor for a world of `world`.
fn obey_load(
    rt: &tokio::runtime::Handle,
    store: &Store,
    config: &BenchConfig,
    rank: usize,
    data: &[Vec<f32>],
    loads: &mut BTreeMap<usize, Vec<Vec<u8>>>,
    order: Order,
) -> Result<Answer> {
    let Order::Load {
        step,
        world,
        verify,
    } = order
    else {
        return Err(invalid("not a load"));
    };
    if rank >= world {
        return Ok(Answer {
            skipped: true,
            ..Answer::default()
        });
    }
    // In place, as the threads load: a trainer's parameters exist before it
    // resumes, so the buffers are allocated and touched before the clock starts.
    // They are kept for the next load of this world size: freeing half a GiB
    // between orders would hand the next one the allocator's trim (tens of ms of
    // returning pages to the kernel, seen inside an overlapped save's stall).
    let buffers = loads.entry(world).or_insert_with(|| {
        let shard = ckpt::Region::dim0_shard(&[config.rows, config.cols], rank, world);
        let bytes = shard.volume().unwrap_or(0) as usize * 4;
        (0..config.tensors).map(|_| vec![1u8; bytes]).collect()
    });
    // A handle of its own, so that its requests are this load's alone.
    let store = &store.with_own_counter();
    let start_ns = now_ns();
    let stats = rt.block_on(async {
        let reader = CheckpointReader::open(store, Some(step)).await?;
        let request = LoadRequest::dim0_shards(reader.manifest(), rank, world);
        let mut outputs: Vec<&mut [u8]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
        reader.load_into(&request, &mut outputs).await
    })?;
    let end_ns = now_ns();
    if verify && world == config.ranks {
        for (t, (loaded, own)) in buffers.iter().zip(data).enumerate() {
            if loaded.as_slice() != ckpt::as_bytes(own) {
                return Err(Error::Failed(format!(
                    "bench: rank {rank} loaded tensor {t} wrong"
                )));
            }
        }
    }
    Ok(Answer {
        start_ns,
        end_ns,
        requested: stats.bytes_requested,
        read: stats.bytes_read,
        load: super::cooperative::LoadCounters {
            bytes_read_from_store: stats.bytes_read_from_store,
            bytes_received_from_peers: stats.bytes_received_from_peers,
            // The requests of opening the checkpoint too.
            store_requests: store.request_counts().into(),
            unique_bytes: stats.unique_bytes,
        },
        ..Answer::default()
    })
}

/// One rank process and its pipes.
struct RankProcess {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// The rank processes of one bench run; they exit when this is dropped.
pub(super) struct Ranks {
    ranks: Vec<RankProcess>,
}

impl Ranks {
    /// Starts `config.ranks` processes of `exe bench-rank` on `store`.
    pub(super) fn spawn(
        exe: &std::path::Path,
        store: &Store,
        config: &BenchConfig,
    ) -> Result<Self> {
        let json = serde_json::to_string(config).expect("the config serializes");
        let processes = config.ranks.max(config.reshard_ranks);
        let mut ranks = Vec::with_capacity(processes);
        for rank in 0..processes {
            let mut command = Command::new(exe);
            command.args(["bench-rank", "--url", store.url()]).args([
                "--rank",
                &rank.to_string(),
                "--config",
                &json,
            ]);
            for option in &config.store_options {
                command.args(["-o", option]);
            }
            let mut child = command
                // As a launcher sets it: the encode threads share the cores.
                .env("LOCAL_WORLD_SIZE", processes.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| {
                    Error::Failed(format!(
                        "cannot start rank process {} bench-rank: {e}",
                        exe.display()
                    ))
                })?;
            let stdin = child.stdin.take().expect("piped");
            let stdout = BufReader::new(child.stdout.take().expect("piped"));
            ranks.push(RankProcess {
                child,
                stdin,
                stdout,
            });
        }
        Ok(Self { ranks })
    }

    /// Sends `order` to every rank, then collects their answers in rank order.
    pub(super) fn all(&mut self, order: &Order) -> Result<Vec<Answer>> {
        let line = serde_json::to_string(order).expect("orders serialize") + "\n";
        for (rank, p) in self.ranks.iter_mut().enumerate() {
            p.stdin
                .write_all(line.as_bytes())
                .and_then(|()| p.stdin.flush())
                .map_err(|e| Error::Failed(format!("rank process {rank} is gone: {e}")))?;
        }
        let mut answers = Vec::with_capacity(self.ranks.len());
        for (rank, p) in self.ranks.iter_mut().enumerate() {
            let mut text = String::new();
            let n = p
                .stdout
                .read_line(&mut text)
                .map_err(|e| Error::Failed(format!("rank process {rank}: {e}")))?;
            if n == 0 {
                return Err(Error::Failed(format!(
                    "rank process {rank} exited during {order:?} (its stderr is above)"
                )));
            }
            let answer: Answer = serde_json::from_str(&text).map_err(|e| {
                Error::Failed(format!("rank process {rank} answered {text:?}: {e}"))
            })?;
            if let Some(error) = answer.error {
                return Err(Error::Failed(format!("rank process {rank}: {error}")));
            }
            answers.push(answer);
        }
        Ok(answers)
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        let line = serde_json::to_string(&Order::Exit).expect("orders serialize") + "\n";
        for p in &mut self.ranks {
            let _ = p.stdin.write_all(line.as_bytes());
            let _ = p.stdin.flush();
        }
        for p in &mut self.ranks {
            let _ = p.child.wait();
        }
    }
}

/// The executable that serves `bench-rank`: `CKPT_BENCH_EXE`, or this program.
pub(super) fn rank_executable() -> Result<std::path::PathBuf> {
    match std::env::var_os("CKPT_BENCH_EXE") {
        Some(exe) => Ok(exe.into()),
        None => std::env::current_exe()
            .map_err(|e| Error::Failed(format!("cannot find this executable: {e}"))),
    }
}

/// Runs the core of the bench with one process per rank, from step `first_step` on.
pub(crate) fn run(
    store: &Store,
    rt: &tokio::runtime::Handle,
    config: &BenchConfig,
    raw: &RawTarget,
    first_step: u64,
    progress: &dyn Fn(&str),
) -> Result<ProcessesReport> {
    progress(&format!(
        "processes: starting {} rank processes (each generates its values)",
        config.ranks
    ));
    let mut ranks = Ranks::spawn(&rank_executable()?, store, config)?;
    let root = store.url().to_string();
    let mut report = ProcessesReport {
        ranks: config.ranks,
        ..ProcessesReport::default()
    };
    let mut samples: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut push = |key: &str, value: f64| samples.entry(key.to_string()).or_default().push(value);

    let worst = |answers: &[Answer], f: fn(&Answer) -> f64| {
        max(&answers
            .iter()
            .filter(|a| !a.skipped)
            .map(f)
            .collect::<Vec<_>>())
    };
    let span_ms = |answers: &[Answer]| {
        let live: Vec<&Answer> = answers.iter().filter(|a| !a.skipped).collect();
        let start = live.iter().map(|a| a.start_ns).min().unwrap_or(0);
        let end = live.iter().map(|a| a.end_ns).max().unwrap_or(0);
        end.saturating_sub(start) as f64 / 1e6
    };
    let first_commit_ms = |answers: &[Answer]| {
        let live = || answers.iter().filter(|a| !a.skipped);
        let start = live().map(|a| a.start_ns).min().unwrap_or(0);
        let end = live().map(|a| a.end_ns).min().unwrap_or(0);
        end.saturating_sub(start) as f64 / 1e6
    };

    progress("processes: memcpy baseline");
    let mut memcpy = MemcpyFigures {
        worst: Vec::new(),
        per_rank: Vec::new(),
    };
    for _ in 0..config.reps {
        memcpy
            .worst
            .push(worst(&ranks.all(&Order::Memcpy)?, |a| a.ms));
    }
    progress("processes: staging warm-up, then the first save");
    let warm_up_ms = worst(&ranks.all(&Order::WarmUp)?, |a| a.ms);
    push("warm_up_ms", warm_up_ms);
    let mut step = first_step;
    let cold = ranks.all(&Order::Save {
        step,
        overlapped: false,
        no_agreement: false,
    })?;
    push("cold_stall_ms", worst(&cold, |a| a.stall_ms));
    let file_bytes = cold[0].file_bytes;
    for rep in 0..config.reps {
        let tag = format!("processes: rep {}/{}", rep + 1, config.reps);
        progress(&format!("{tag}: raw write"));
        push("raw_write_gbps", raw.write(rt, config.raw_bytes, false)?);
        let previous = step;
        step += 1;
        rt.block_on(store.delete_prefix(&step_dir(previous)))?;
        progress(&format!("{tag}: ckpt save"));
        let saved = ranks.all(&Order::Save {
            step,
            overlapped: false,
            no_agreement: false,
        })?;
        push("stall_ms", worst(&saved, |a| a.stall_ms));
        let commit_ms = first_commit_ms(&saved);
        push("commit_ms", commit_ms);
        let previous = step;
        step += 1;
        rt.block_on(store.delete_prefix(&step_dir(previous)))?;
        progress(&format!("{tag}: ckpt save, overlapped"));
        let overlapped = ranks.all(&Order::Save {
            step,
            overlapped: true,
            no_agreement: false,
        })?;
        push("overlap_stall_ms", worst(&overlapped, |a| a.stall_ms));
        push("overlap_staged_ms", worst(&overlapped, |a| a.staged_ms));
        progress(&format!("{tag}: raw read"));
        push(
            "raw_read_gbps",
            raw.read(rt, config.raw_bytes, config.warm)?,
        );
        progress(&format!("{tag}: ckpt load"));
        evict_step(&root, step, config.warm);
        let loaded = ranks.all(&Order::Load {
            step,
            world: config.ranks,
            verify: rep == 0,
        })?;
        push("load_ms", span_ms(&loaded));
        report.load = summed(&loaded);
        progress(&format!(
            "{tag}: ckpt load onto {} processes",
            config.reshard_ranks
        ));
        evict_step(&root, step, config.warm);
        let resharded = ranks.all(&Order::Load {
            step,
            world: config.reshard_ranks,
            verify: false,
        })?;
        push("reshard_load_ms", span_ms(&resharded));
        report.reshard_load = summed(&resharded);
    }
    drop(ranks);
    rt.block_on(store.delete_prefix(&step_dir(step)))?;

    samples.insert("memcpy_ms".into(), memcpy.worst);
    report.core = CoreFigures::from_samples(&samples, file_bytes, config.total_bytes());
    report.samples = samples;
    Ok(report)
}

/// The load counters of every rank that loaded, summed.
fn summed(answers: &[Answer]) -> super::cooperative::LoadCounters {
    let mut sum = super::cooperative::LoadCounters::default();
    for answer in answers.iter().filter(|a| !a.skipped) {
        sum += answer.load;
    }
    sum
}
