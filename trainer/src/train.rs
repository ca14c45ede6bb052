//! The training loop of one *generation*: a fixed world that runs until the target
//! step, a stop request, or the first failure, which it returns to its caller.
//!
//! [`run_generation`] takes its communicator as an argument and owns nothing global,
//! so an elastic agent can call it again in the same process with a new world and
//! `resume = true` after a failure: it then loads the newest committed checkpoint
//! resharded onto the new world size and carries on.
//!
//! One step, FSDP2 style, on rank `r` of `W`:
//! 1. all-gather every parameter from its dim-0 shards (`r·n/W .. (r+1)·n/W` rows);
//! 2. forward and backward of chunks `r, r+W, …` of the step's global batch (a fixed
//!    number of chunks, independent of `W`), adding each chunk's gradient in exact
//!    fixed point (deterministic mode) or in f32 (fast mode);
//! 3. reduce-scatter the gradients: each rank receives the sum over all chunks of the
//!    rows it owns;
//! 4. one small all-reduce carries every chunk's loss (summed afterwards in chunk
//!    order, so the logged loss is identical for every `W`) and the ranks' stop flags
//!    (so that all ranks agree on the step at which a SIGTERM stops them);
//! 5. Adam on the owned rows of parameters and moments.
//!
//! Checkpoints hold the parameters and both Adam moments as dim-0 shards, and as
//! global state the step, the data position, the generator description and the loss
//! history. Nothing is per rank: the data of a step is a function of (seed, step,
//! chunk), so a resumed run at any world size continues the same sequence.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ckpt::storage::Store;
use ckpt::{CheckpointConfig, Checkpointer, DType, LoadRequest, SaveHandle, State, as_bytes};
use serde_json::json;

use crate::collective::{Collective, CollectiveError, CollectiveExt, shard_counts, shard_range};
use crate::fixed;
use crate::memory::{self, Holding, Memory};
use crate::model::{self, GradSink, Preset, Teacher, TensorSpec};

/// What one generation is asked to do.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Model, task and batch sizes.
    pub preset: Preset,
    /// Seed of the initial parameters, the teacher and the data.
    pub seed: u64,
    /// The step to reach (a resumed run continues up to it).
    pub steps: u64,
    /// Exact fixed-point gradient sums (bitwise identical for every world size) or
    /// f32 sums (less traffic and arithmetic, but the last bits depend on the world).
    pub deterministic: bool,
    /// Save every this many steps (0: only the final save).
    pub ckpt_every: u64,
    /// Keep this many newest checkpoints.
    pub keep: usize,
    /// Saves in a row that may fail (a storage outage, a full disk) while training
    /// goes on; one more stops the rank with the error. The final save must commit.
    pub max_failed_saves: u32,
    /// How long a superseded checkpoint stays for readers before retention removes
    /// it.
    pub retention_grace: Duration,
    /// Resume from the newest committed checkpoint, if there is one.
    pub resume: bool,
    /// Print the loss every this many steps (rank 0).
    pub log_every: u64,
    /// Generation number recorded in the checkpoints (a floor: a resumed run saves in
    /// a newer generation than the checkpoint it resumed from).
    pub generation: u64,
    /// Run id of the save attempts (`None`: `CKPT_RUN_ID`, as
    /// [`CheckpointConfig::new`] reads it). An elastic rank sets one per generation,
    /// so that two generations never name the same attempt directory.
    pub run_id: Option<String>,
    /// Fault injection for tests: one rank stops forever at a step, so that a test
    /// can kill the world at a known point instead of racing a fast loop.
    pub hold: Option<Hold>,
    /// Test knob: sleep this long after every step, so that a tiny model trains long
    /// enough for a test to act (relaunch a node) while it runs.
    pub step_pause: Duration,
    /// Fault injection for tests: (step, rank) at which that rank reports a device
    /// error, as a CUDA error would surface on a GPU.
    pub device_error: Option<(u64, usize)>,
    /// Fault injection for tests: (step, rank) whose in-memory copies of its saves
    /// from that step on get one bit flipped once kept.
    pub rot_copy: Option<(u64, usize)>,
    /// Fault injection for tests: (failpoint, step, rank): that rank arms the
    /// failpoint of the save protocol before its first save at or after that step.
    pub save_stage: Option<(String, u64, usize)>,
    /// Elastic ranks: keep in-memory copies of the newest checkpoints (see
    /// [`crate::memory`]), so that a recovery rebuilds from RAM where it can.
    pub memory_copies: bool,
    /// Overlapped saves ([`Checkpointer::save_overlapped`]): the copy into the staging
    /// buffer runs while the next step gathers and computes, and the rank waits for
    /// it only right before its optimizer step overwrites the saved rows. False:
    /// blocking saves, the copy inside the step that saves.
    pub overlapped_staging: bool,
    /// Check that no saved tensor changes before its staging copy (a CRC32 of every
    /// tensor at save time; see `CheckpointConfig::check_staging`).
    pub check_staging: bool,
}

/// Where a rank holds (parks its training thread forever); see
/// [`TrainConfig::hold`]. The other ranks go on until their next collective, which
/// waits for the held rank: the world is stuck mid-step, as if that rank hung.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    /// The step just completed.
    pub step: u64,
    /// The rank that holds.
    pub rank: usize,
    /// Before calling `save` for that step (its checkpoint can never commit) or
    /// after (the save runs on in the background and may commit).
    pub before_save: bool,
}

/// Parks the training thread when `hold` says so: forever in a fixed world; until the
/// supervisor cancels the generation in an elastic one (then the generation ends with
/// [`TrainError::Cancelled`], as any wait does).
fn hold_here(
    hold: Option<Hold>,
    step: u64,
    rank: usize,
    before_save: bool,
    supervisor: &dyn Supervisor,
) -> Result<(), TrainError> {
    if let Some(h) = hold
        && h.step == step
        && h.rank == rank
        && h.before_save == before_save
    {
        say(format_args!(
            "fault: rank {rank} holds {} saving step {step}",
            if before_save { "before" } else { "after" }
        ));
        while !supervisor.is_cancelled() {
            std::thread::park_timeout(Duration::from_millis(50));
        }
        return Err(TrainError::Cancelled(format!("holding at step {step}")));
    }
    Ok(())
}

/// What a control plane sees of a generation and asks of it. The elastic agent
/// implements it; a fixed world uses [`Unsupervised`].
///
/// Every method is cheap and called from the training thread: progress marks feed
/// the heartbeats that tell a stuck training loop from a slow one, `cancelled`
/// ends every wait that is not a collective (a commit, a load), which
/// [`Collective::abort`] cannot reach.
pub trait Supervisor: Sync {
    /// A step completed (or the load finished: `step` is where training stands).
    fn progress(&self, step: u64);
    /// The training thread starts (`true`) or stops (`false`) waiting on others: a
    /// collective (its peers), a load or a commit (the store, the committer). A
    /// loop that makes no progress while waiting is not the one that is stuck. Calls
    /// nest (a load runs collectives).
    fn waiting(&self, active: bool);
    /// Members wait to join: the world should end this generation at its next
    /// checkpoint.
    fn regroup_requested(&self) -> bool;
    /// Completes once this generation is cancelled (a member failed, or this one is
    /// stale).
    fn cancelled(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
    /// Whether it is cancelled already.
    fn is_cancelled(&self) -> bool;
    /// Rank 0 learned that `step` committed.
    fn committed(&self, step: u64);
    /// The checkpoint generation this generation's saves use (fencing floor of later
    /// ones).
    fn checkpoint_generation(&self, generation: u64);
}

/// The supervisor of a fixed world: nothing watches it and nothing cancels it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Unsupervised;

impl Supervisor for Unsupervised {
    fn progress(&self, _: u64) {}
    fn waiting(&self, _: bool) {}
    fn regroup_requested(&self) -> bool {
        false
    }
    fn cancelled(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(std::future::pending())
    }
    fn is_cancelled(&self) -> bool {
        false
    }
    fn committed(&self, _: u64) {}
    fn checkpoint_generation(&self, _: u64) {}
}

/// Checkpoint state that outlives a generation: the save still in flight when a
/// generation ended. An elastic rank keeps one across its generations, so that the
/// next generation waits for the previous save to reach a known outcome (or
/// abandons it explicitly) instead of dropping it unseen while its upload runs on.
#[derive(Debug, Default)]
pub struct Checkpointing {
    pending: Option<SaveHandle>,
    /// Saves in a row that failed (storage errors past retries, a full disk); reset
    /// by a commit.
    failed_in_a_row: u32,
    /// In-memory copies of the newest checkpoints (elastic ranks): a recovery
    /// rebuilds from them instead of the store where it can. Used only when every
    /// rank of the world has them.
    pub memory: Option<Arc<Memory>>,
    /// The step's full-size buffers, kept from one generation to the next: their
    /// size does not depend on the world, and releasing and faulting in several
    /// hundred megabytes again would add tens of milliseconds to every recovery.
    workspace: Workspace,
    /// The last generation's state vectors (its rows at the step it stopped at),
    /// recycled as the next load's destination: memory this process has already
    /// touched fills several times faster than fresh pages.
    spare: Vec<Vec<f32>>,
}

/// A generation's state, whose vectors go back to [`Checkpointing::spare`] however
/// the generation ends.
struct Recycled<'a> {
    shards: Shards,
    spare: &'a mut Vec<Vec<f32>>,
}

impl std::ops::Deref for Recycled<'_> {
    type Target = Shards;
    fn deref(&self) -> &Shards {
        &self.shards
    }
}

impl std::ops::DerefMut for Recycled<'_> {
    fn deref_mut(&mut self) -> &mut Shards {
        &mut self.shards
    }
}

impl Drop for Recycled<'_> {
    fn drop(&mut self) {
        let s = &mut self.shards;
        self.spare.clear();
        for ((p, m), v) in s.params.iter_mut().zip(&mut s.m).zip(&mut s.v) {
            self.spare
                .extend([std::mem::take(p), std::mem::take(m), std::mem::take(v)]);
        }
    }
}

/// Buffers of one step that span all parameters (see [`Checkpointing`]).
#[derive(Debug, Default)]
struct Workspace {
    /// The all-gathered parameters.
    full: Vec<f32>,
    /// Fixed-point gradient accumulators (deterministic mode).
    acc_i64: Vec<i64>,
    /// f32 gradients (scratch of one chunk in deterministic mode).
    acc_f32: Vec<f32>,
}

impl Workspace {
    /// Sizes the buffers for `total` parameters (contents unspecified).
    fn prepare(&mut self, total: usize, deterministic: bool) {
        fn sized<T: Clone + Default>(v: &mut Vec<T>, n: usize) {
            if v.len() != n {
                *v = memory::huge_zeros(n);
            }
        }
        sized(&mut self.full, total);
        sized(&mut self.acc_i64, if deterministic { total } else { 0 });
        sized(&mut self.acc_f32, total);
    }
}

impl Checkpointing {
    /// Waits, at most `limit`, for the save left by an earlier generation to become
    /// durable on this rank, then lets it go: if every part is durable a surviving
    /// committer commits it (the commit is live), and a newer generation's commit
    /// fences it otherwise. Returns the step it was saving.
    pub fn settle(&mut self, runtime: &tokio::runtime::Handle, limit: Duration) -> Option<u64> {
        let handle = self.pending.take()?;
        let step = handle.step();
        // The timer must be created inside the runtime.
        match runtime.block_on(async { tokio::time::timeout(limit, handle.durable()).await }) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(step, error = %e, "the save left by the previous generation failed on this rank")
            }
            Err(_) => {
                tracing::warn!(
                    step,
                    "the save left by the previous generation is not durable yet; leaving it"
                )
            }
        }
        Some(step)
    }
}

/// A collective that tells the supervisor when the training thread waits on peers.
struct Watched<'a> {
    comm: &'a dyn Collective,
    supervisor: &'a dyn Supervisor,
}

impl Watched<'_> {
    fn run<T>(&self, f: impl FnOnce(&dyn Collective) -> T) -> T {
        self.supervisor.waiting(true);
        let out = f(self.comm);
        self.supervisor.waiting(false);
        out
    }
}

impl Collective for Watched<'_> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    fn all_gather(
        &self,
        mine: &[u8],
        counts: &[usize],
        out: &mut [u8],
    ) -> crate::collective::CollectiveResult {
        self.run(|c| c.all_gather(mine, counts, out))
    }
    fn reduce_scatter_i64(
        &self,
        data: &mut [i64],
        counts: &[usize],
        out: &mut [i64],
    ) -> crate::collective::CollectiveResult {
        self.run(|c| c.reduce_scatter_i64(data, counts, out))
    }
    fn reduce_scatter_f32(
        &self,
        data: &mut [f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> crate::collective::CollectiveResult {
        self.run(|c| c.reduce_scatter_f32(data, counts, out))
    }
    fn all_reduce_i64(&self, data: &mut [i64]) -> crate::collective::CollectiveResult {
        self.run(|c| c.all_reduce_i64(data))
    }
    fn all_reduce_f32(&self, data: &mut [f32]) -> crate::collective::CollectiveResult {
        self.run(|c| c.all_reduce_f32(data))
    }
    fn broadcast(&self, root: usize, data: &mut [u8]) -> crate::collective::CollectiveResult {
        self.run(|c| c.broadcast(root, data))
    }
    fn barrier(&self) -> crate::collective::CollectiveResult {
        self.run(|c| c.barrier())
    }
    fn abort(&self) {
        self.comm.abort()
    }
}

/// Runs `future` unless the supervisor cancels the generation first; the future's
/// own result is left for the caller to judge.
fn or_cancelled<T>(
    runtime: &tokio::runtime::Handle,
    supervisor: &dyn Supervisor,
    what: &str,
    future: impl Future<Output = T>,
) -> Result<T, TrainError> {
    supervisor.waiting(true);
    let out = runtime.block_on(async {
        tokio::select! {
            out = future => Ok(out),
            () = supervisor.cancelled() => Err(TrainError::Cancelled(what.to_string())),
        }
    });
    supervisor.waiting(false);
    out
}

/// Runs `future` unless the supervisor cancels the generation first.
fn unless_cancelled<T>(
    runtime: &tokio::runtime::Handle,
    supervisor: &dyn Supervisor,
    what: &str,
    future: impl Future<Output = Result<T, ckpt::Error>>,
) -> Result<T, TrainError> {
    or_cancelled(runtime, supervisor, what, future)?.map_err(TrainError::from)
}

/// How a generation ended without failure.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The target step was reached (and saved, when checkpointing).
    Finished {
        /// Steps completed.
        step: u64,
        /// Loss of the last step.
        loss: f64,
    },
    /// A stop was requested (SIGTERM); the ranks agreed on a step, saved it and
    /// waited for the commit.
    Stopped {
        /// Steps completed (and saved).
        step: u64,
    },
    /// The supervisor asked for a regroup (members wait to join): the ranks agreed on
    /// a checkpoint step, saved it, waited for the commit and ended the generation, so
    /// that the next one (with the new members) loads it.
    Regroup {
        /// Steps completed (and saved).
        step: u64,
    },
}

/// Why a generation failed. A collective error means the world is broken (a new
/// world may resume); a checkpoint error means the store or a checkpoint failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A collective failed (lost peer, timeout, abort).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Saving or loading a checkpoint failed.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] ckpt::Error),
    /// The settings or the checkpoint found do not fit this run.
    #[error("{0}")]
    Invalid(String),
    /// The supervisor cancelled the generation during a wait (for a commit, a load).
    #[error("cancelled while {0}")]
    Cancelled(String),
    /// This rank's device failed (lost GPU, uncorrectable ECC error): the rank cannot
    /// go on, the others can without it.
    #[error("device error: {0}")]
    Device(String),
}

/// Counters of one generation, for benchmarks.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Steps run in this generation.
    pub steps: u64,
    /// Wall time of those steps (checkpoint stalls included).
    pub elapsed: Duration,
    /// Time blocked in `save` (staging, or registering an overlapped save), waiting
    /// for the previous commit, and waiting for an overlapped save's copy before the
    /// optimizer step.
    pub ckpt_blocked: Duration,
    /// Time in parameter all-gathers.
    pub gather: Duration,
    /// Time in forward and backward (fixed-point conversion included).
    pub compute: Duration,
    /// Time in gradient reduce-scatters and the loss/stop all-reduce.
    pub reduce: Duration,
    /// Time in Adam.
    pub update: Duration,
    /// Checkpoints saved.
    pub saves: u64,
    /// Optimizer steps that had to wait for an overlapped save's copy (its time is
    /// in `ckpt_blocked`).
    pub staging_waits: u64,
    /// Time since the generation's first step at the end of each step (its save
    /// call included).
    pub marks: Vec<Duration>,
}

impl Stats {
    /// Steps per second after the first two steps (warm-up, first allocation).
    pub fn steady_steps_per_s(&self) -> f64 {
        let n = self.marks.len();
        if n < 4 {
            return f64::NAN;
        }
        (n - 3) as f64 / (self.marks[n - 1] - self.marks[2]).as_secs_f64().max(1e-9)
    }
}

/// One rank's training state: its dim-0 shards of parameters and moments.
struct Shards {
    params: Vec<Vec<f32>>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    step: u64,
    losses: Vec<f64>,
}

fn owned_rows(spec: &TensorSpec, rank: usize, world: usize) -> std::ops::Range<usize> {
    shard_range(spec.rows, rank, world)
}

fn trainer_state(config: &TrainConfig) -> serde_json::Value {
    let p = &config.preset;
    json!({
        "preset": p.name,
        "seed": config.seed,
        "global_batch": p.batch,
        "chunks": p.chunks,
        "parameters": p.parameters(),
    })
}

/// Prints one line on stdout (flushed, so launchers and tests see it at once).
fn say(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_fmt(line);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

/// Runs one generation on `comm`'s world. See the module docs.
///
/// `stop` is polled once per step (a signal handler sets it); the ranks agree on the
/// first step at which any of them saw it. `stats` receives counters.
pub fn run_generation(
    comm: &dyn Collective,
    runtime: &tokio::runtime::Handle,
    store: Option<&Store>,
    config: &TrainConfig,
    stop: &AtomicBool,
    stats: &mut Stats,
) -> Result<Outcome, TrainError> {
    run_supervised(
        comm,
        runtime,
        store,
        config,
        stop,
        stats,
        &Unsupervised,
        &mut Checkpointing::default(),
    )
}

/// [`run_generation`] under a supervisor (an elastic agent), with checkpoint state
/// that outlives the generation. The generation ends early with
/// [`TrainError::Cancelled`] or a collective error when the supervisor cancels it
/// (its abort hook aborts `comm`), and with [`Outcome::Regroup`] when it asks for a
/// regroup. `config.generation` is the floor of the checkpoint generation.
#[allow(clippy::too_many_arguments)]
pub fn run_supervised(
    comm: &dyn Collective,
    runtime: &tokio::runtime::Handle,
    store: Option<&Store>,
    config: &TrainConfig,
    stop: &AtomicBool,
    stats: &mut Stats,
    supervisor: &dyn Supervisor,
    checkpointing: &mut Checkpointing,
) -> Result<Outcome, TrainError> {
    let watched = Watched { comm, supervisor };
    let comm: &dyn Collective = &watched;
    let (rank, world) = (comm.rank(), comm.world_size());
    let preset = &config.preset;
    if preset.chunks > fixed::MAX_CHUNKS || !preset.batch.is_multiple_of(preset.chunks) {
        return Err(TrainError::Invalid(format!(
            "preset {}: {} chunks of a batch of {} (need a divisor, at most {})",
            preset.name,
            preset.chunks,
            preset.batch,
            fixed::MAX_CHUNKS
        )));
    }
    let specs = preset.tensors();
    let mut offsets = Vec::with_capacity(specs.len() + 1);
    let mut total = 0;
    for s in &specs {
        offsets.push(total);
        total += s.numel();
    }
    offsets.push(total);

    // Whether to resume is decided together: in an elastic world a member that
    // just joined (a relaunched rank) has never trained while the survivors resume,
    // and all of them must run the same collectives.
    // So is whether to keep in-memory copies: only when every rank has them (their
    // table of holdings is one more collective).
    let (resume, memory) = match store {
        Some(_) => {
            let mut wanted = [
                i64::from(config.resume),
                i64::from(checkpointing.memory.is_some()),
            ];
            comm.all_reduce_i64(&mut wanted)?;
            let memory = match &checkpointing.memory {
                Some(memory) if wanted[1] == world as i64 => {
                    Some((Arc::clone(memory), holdings(comm, memory)?))
                }
                _ => None,
            };
            (wanted[0] > 0, memory)
        }
        None => (false, None),
    };
    let memory = memory
        .as_ref()
        .map(|(m, table)| (m.as_ref(), table.as_slice()));
    // An overlapped save of the previous generation may still read the vectors
    // about to be recycled as this load's destination.
    if let Some(handle) = &checkpointing.pending {
        let _ = handle.wait_staged();
    }
    let resumed = match (store, resume) {
        (Some(store), true) => {
            let spare = std::mem::take(&mut checkpointing.spare);
            load(
                comm, runtime, store, config, &specs, supervisor, memory, spare,
            )?
        }
        _ => None,
    };
    // A resumed run saves in a newer generation than the checkpoint it resumed from:
    // a late writer of the timeline it left is then fenced off.
    let generation = resumed
        .as_ref()
        .map_or(config.generation, |(_, g)| config.generation.max(g + 1));
    let mut st = Recycled {
        shards: resumed
            .map(|(shards, _)| shards)
            .unwrap_or_else(|| init(config, &specs, rank, world)),
        spare: &mut checkpointing.spare,
    };
    supervisor.checkpoint_generation(generation);
    supervisor.progress(st.step);
    let checkpointer = match store {
        Some(store) => {
            let mut c = CheckpointConfig::new(rank, world);
            c.keep_last = Some(config.keep.max(1));
            c.retention_grace = config.retention_grace;
            c.generation = generation;
            if let Some(run_id) = &config.run_id {
                c.run_id = run_id.clone();
            }
            c.check_staging = config.check_staging;
            let checkpointer = Checkpointer::new(store.clone(), c)?;
            // The staging pool, allocated and faulted in now: the first checkpoint
            // of the generation is not its slowest save.
            checkpointer.warm_up(&state_of(config, &specs, &st, rank, world)?)?;
            Some(checkpointer)
        }
        None => None,
    };
    if rank == 0 {
        say(format_args!(
            "start: preset {} ({} parameters), world {world}, step {} of {}, {} mode",
            preset.name,
            preset.parameters(),
            st.step,
            config.steps,
            if config.deterministic {
                "deterministic"
            } else {
                "fast"
            }
        ));
    }

    let teacher = Teacher::new(config.seed, preset);
    checkpointing.workspace.prepare(total, config.deterministic);
    let Workspace {
        full,
        acc_i64,
        acc_f32,
    } = &mut checkpointing.workspace;
    let mut grad_shard: Vec<f32> = Vec::new();
    let mut grad_shard_i64: Vec<i64> = Vec::new();
    let pending = &mut checkpointing.pending;
    let failed_in_a_row = &mut checkpointing.failed_in_a_row;
    let started = Instant::now();
    let first_step = st.step;
    let mut loss = f64::NAN;

    while st.step < config.steps {
        if supervisor.is_cancelled() {
            return Err(TrainError::Cancelled(format!("at step {}", st.step)));
        }
        let step = st.step;
        // 1. All-gather the parameters.
        let mut clock = Instant::now();
        for (i, spec) in specs.iter().enumerate() {
            let counts: Vec<usize> = shard_counts(spec.rows, world)
                .into_iter()
                .map(|r| r * spec.cols)
                .collect();
            comm.all_gather_f32(
                &st.params[i],
                &counts,
                &mut full[offsets[i]..offsets[i + 1]],
            )?;
        }
        stats.gather += lap(&mut clock);
        // 2. This rank's chunks.
        let mut flags = vec![0i64; preset.chunks + 2];
        if config.deterministic {
            acc_i64.fill(0);
        } else {
            acc_f32.fill(0.0);
        }
        for chunk in (rank..preset.chunks).step_by(world) {
            // A cancelled generation stops between chunks, not at the next
            // collective: recovery does not wait for a whole step's compute.
            if supervisor.is_cancelled() {
                return Err(TrainError::Cancelled(format!(
                    "computing step {}",
                    step + 1
                )));
            }
            let (x, y) = model::chunk_data(config.seed, step, chunk, preset, &teacher);
            let mut sink = if config.deterministic {
                GradSink::Fixed {
                    acc: &mut acc_i64[..],
                    scratch: &mut acc_f32[..],
                }
            } else {
                GradSink::Float {
                    acc: &mut acc_f32[..],
                }
            };
            let chunk_loss =
                model::chunk_step_unless(preset, full, &offsets, &x, &y, &mut sink, &|| {
                    supervisor.is_cancelled()
                })
                .ok_or_else(|| TrainError::Cancelled(format!("computing step {}", step + 1)))?;
            flags[chunk] = chunk_loss.to_bits() as i64;
        }
        stats.compute += lap(&mut clock);
        // 3. Reduce-scatter the gradients and 5. update the owned rows.
        // 4. Losses and stop flags first, so a stop is agreed before any update.
        flags[preset.chunks] = i64::from(stop.load(Ordering::SeqCst));
        flags[preset.chunks + 1] = i64::from(supervisor.regroup_requested());
        comm.all_reduce_i64(&mut flags)?;
        loss = flags[..preset.chunks]
            .iter()
            .map(|b| f64::from_bits(*b as u64))
            .sum();
        let stopping = flags[preset.chunks] != 0;
        // A regroup ends the generation like a stop, at the same agreed step, but the
        // ranks go on in the next generation instead of exiting.
        let regrouping = !stopping && flags[preset.chunks + 1] != 0;
        stats.reduce += lap(&mut clock);
        for (i, spec) in specs.iter().enumerate() {
            let counts: Vec<usize> = shard_counts(spec.rows, world)
                .into_iter()
                .map(|r| r * spec.cols)
                .collect();
            let mine = counts[rank];
            grad_shard.resize(mine, 0.0);
            let range = offsets[i]..offsets[i + 1];
            if config.deterministic {
                grad_shard_i64.resize(mine, 0);
                comm.reduce_scatter_i64(&mut acc_i64[range], &counts, &mut grad_shard_i64)?;
                for (g, s) in grad_shard.iter_mut().zip(&grad_shard_i64) {
                    *g = fixed::from_fixed(*s);
                }
            } else {
                comm.reduce_scatter_f32(&mut acc_f32[range], &counts, &mut grad_shard)?;
            }
            stats.reduce += lap(&mut clock);
            // The optimizer step overwrites the rows an overlapped save may still be
            // copying: the only point where the copy must be over.
            if i == 0
                && let Some(handle) = pending.as_ref()
                && !handle.is_staged()
            {
                let waited = Instant::now();
                handle.wait_staged()?;
                stats.ckpt_blocked += waited.elapsed();
                stats.staging_waits += 1;
                clock = Instant::now();
            }
            let st = &mut *st;
            model::adam(
                preset.lr,
                step + 1,
                &mut st.params[i],
                &mut st.m[i],
                &mut st.v[i],
                &grad_shard,
            );
            stats.update += lap(&mut clock);
        }
        st.step = step + 1;
        st.losses.push(loss);
        stats.steps += 1;
        supervisor.progress(st.step);
        if rank == 0 && (st.step.is_multiple_of(config.log_every.max(1)) || st.step == config.steps)
        {
            say(format_args!("step {} loss {loss:.6}", st.step));
        }

        if config.device_error == Some((st.step, rank)) {
            say(format_args!(
                "fault: rank {rank} device error at step {}",
                st.step
            ));
            return Err(TrainError::Device(format!(
                "injected at step {} (as a lost GPU would surface)",
                st.step
            )));
        }
        hold_here(config.hold, st.step, rank, true, supervisor)?;
        let due = (config.ckpt_every > 0 && st.step.is_multiple_of(config.ckpt_every))
            || st.step == config.steps
            || stopping
            || regrouping;
        if let Some(checkpointer) = &checkpointer
            && due
        {
            let blocked = Instant::now();
            if let Some(previous) = pending.take() {
                let step = previous.step();
                // A save that failed (its commit is buried as failed, on every rank
                // alike) costs a checkpoint, not the job: training goes on and the
                // next save tries again, up to `max_failed_saves` in a row.
                match or_cancelled(
                    runtime,
                    supervisor,
                    "waiting for the previous commit",
                    previous.committed(),
                )? {
                    Ok(_) => {
                        *failed_in_a_row = 0;
                        if let Some((memory, _)) = memory {
                            memory.confirm(&previous.attempt().dir());
                        }
                        if rank == 0 {
                            supervisor.committed(step);
                        }
                    }
                    Err(e) if *failed_in_a_row < config.max_failed_saves => {
                        *failed_in_a_row += 1;
                        if rank == 0 {
                            say(format_args!(
                                "checkpoint of step {step} failed ({e}); training goes on ({} of {} failed saves in a row allowed)",
                                failed_in_a_row, config.max_failed_saves
                            ));
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if let Some((name, step, at_rank)) = &config.save_stage
                && st.step >= *step
                && rank == *at_rank
            {
                ckpt::failpoint::arm(name).map_err(TrainError::Invalid)?;
            }
            let handle = save(runtime, checkpointer, config, &specs, &st, rank, world)?;
            let copied = Instant::now();
            let copy = memory.map(|(memory, table)| {
                let rot = config
                    .rot_copy
                    .is_some_and(|(from, at)| st.step >= from && rank == at);
                keep_copy(memory, table, &handle, &specs, &st, rank, world, rot);
                copied.elapsed()
            });
            stats.ckpt_blocked += blocked.elapsed();
            stats.saves += 1;
            if rank == 0 {
                say(format_args!(
                    "saving step {} (stall {:.1} ms{})",
                    st.step,
                    handle.stall().as_secs_f64() * 1e3,
                    copy.map_or(String::new(), |d| format!(
                        ", in-memory copy {:.1} ms",
                        d.as_secs_f64() * 1e3
                    ))
                ));
            }
            *pending = Some(handle);
        }
        hold_here(config.hold, st.step, rank, false, supervisor)?;
        stats.marks.push(started.elapsed());
        if !config.step_pause.is_zero() {
            std::thread::sleep(config.step_pause);
        }
        if stopping || regrouping {
            if let Some(handle) = pending.take() {
                unless_cancelled(
                    runtime,
                    supervisor,
                    "waiting for the final commit",
                    handle.committed(),
                )?;
                if let Some((memory, _)) = memory {
                    memory.confirm(&handle.attempt().dir());
                }
                if rank == 0 {
                    supervisor.committed(handle.step());
                }
                if stopping {
                    final_retention(runtime, store, config, rank);
                }
            }
            stats.elapsed += started.elapsed();
            if regrouping {
                if rank == 0 {
                    say(format_args!(
                        "regroup at step {} (checkpoint committed)",
                        st.step
                    ));
                }
                return Ok(Outcome::Regroup { step: st.step });
            }
            if rank == 0 {
                say(format_args!(
                    "stopped at step {} (checkpoint committed)",
                    st.step
                ));
            }
            return Ok(Outcome::Stopped { step: st.step });
        }
    }
    if let Some(handle) = pending.take() {
        unless_cancelled(
            runtime,
            supervisor,
            "waiting for the final commit",
            handle.committed(),
        )?;
        if let Some((memory, _)) = memory {
            memory.confirm(&handle.attempt().dir());
        }
        if rank == 0 {
            supervisor.committed(handle.step());
            say(format_args!("committed step {}", handle.step()));
        }
        final_retention(runtime, store, config, rank);
    }
    stats.elapsed += started.elapsed();
    if fixed::clamped() > 0 {
        tracing::warn!(
            clamped = fixed::clamped(),
            "gradient elements were clamped to ±65536 (diverging?)"
        );
    }
    if st.step == first_step && !st.losses.is_empty() {
        loss = *st.losses.last().expect("non-empty");
    }
    Ok(Outcome::Finished {
        step: st.step,
        loss,
    })
}

/// Retention after the last commit of a run, by rank 0. The committing rank applies
/// retention in its background save task after the commit, but `committed()` may
/// return before that task is done, and the process is about to exit: without this,
/// the final commit's retention can be cut off (leaving `keep + 1` checkpoints).
fn final_retention(
    runtime: &tokio::runtime::Handle,
    store: Option<&Store>,
    config: &TrainConfig,
    rank: usize,
) {
    if rank != 0 {
        return;
    }
    if let Some(store) = store
        && let Err(e) = runtime.block_on(ckpt::retention::after_commit(
            store,
            ckpt::retention::Policy {
                keep: config.keep.max(1),
                grace: config.retention_grace,
            },
        ))
    {
        tracing::warn!(error = %e, "retention after the final commit failed; old checkpoints stay");
    }
}

/// Time since `clock`, which moves to now.
fn lap(clock: &mut Instant) -> Duration {
    let now = Instant::now();
    let d = now - *clock;
    *clock = now;
    d
}

fn init(config: &TrainConfig, specs: &[TensorSpec], rank: usize, world: usize) -> Shards {
    let mut params = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let rows = owned_rows(spec, rank, world);
        let mut p = vec![0f32; rows.len() * spec.cols];
        model::init_rows(config.seed, i, spec, rows, &mut p);
        params.push(p);
    }
    let zeros: Vec<Vec<f32>> = params.iter().map(|p| vec![0f32; p.len()]).collect();
    Shards {
        params,
        m: zeros.clone(),
        v: zeros,
        step: 0,
        losses: Vec::new(),
    }
}

/// Every rank's holding of in-memory copies (see [`memory`]), by rank.
fn holdings(comm: &dyn Collective, memory: &Memory) -> Result<Vec<Holding>, TrainError> {
    let world = comm.world_size();
    let mut table = vec![0u8; Holding::SIZE * world];
    comm.all_gather(
        &memory.holding().encode(),
        &vec![Holding::SIZE; world],
        &mut table,
    )?;
    Ok(table
        .chunks_exact(Holding::SIZE)
        .map(Holding::decode)
        .collect())
}

/// Keeps this rank's rows of the save `handle` started as an in-memory copy, and
/// pulls a replica of its ring predecessor's copy in the background. `rot` (a test's
/// fault) flips one bit of the copy.
#[allow(clippy::too_many_arguments)]
fn keep_copy(
    memory: &Memory,
    table: &[Holding],
    handle: &SaveHandle,
    specs: &[TensorSpec],
    st: &Shards,
    rank: usize,
    world: usize,
    rot: bool,
) {
    let dir = handle.attempt().dir();
    let mut tensors = Vec::with_capacity(specs.len() * memory::KINDS);
    for i in 0..specs.len() {
        tensors.extend([
            memory.copy_of(&st.params[i]),
            memory.copy_of(&st.m[i]),
            memory.copy_of(&st.v[i]),
        ]);
    }
    if let Some(x) = tensors
        .iter_mut()
        .find_map(|t| t.first_mut())
        .filter(|_| rot)
    {
        *x = f32::from_bits(x.to_bits() ^ 1);
        say(format_args!(
            "fault: rank {rank} flipped a bit of its in-memory copy of step {}",
            st.step
        ));
    }
    let key = memory::Key {
        dir: dir.clone(),
        world,
        rank,
    };
    memory.keep_own(memory::RankCopy::new(key, tensors));
    if world < 2 {
        return;
    }
    let predecessor = (rank + world - 1) % world;
    if let Some(from) = table.get(predecessor).and_then(|h| h.addr) {
        let lens = specs
            .iter()
            .flat_map(|s| {
                let n = owned_rows(s, predecessor, world).len() * s.cols;
                [n; memory::KINDS]
            })
            .collect();
        let key = memory::Key {
            dir,
            world,
            rank: predecessor,
        };
        memory.replicate(from, key, lens);
    }
}

fn save(
    runtime: &tokio::runtime::Handle,
    checkpointer: &Checkpointer,
    config: &TrainConfig,
    specs: &[TensorSpec],
    st: &Shards,
    rank: usize,
    world: usize,
) -> Result<SaveHandle, TrainError> {
    let state = state_of(config, specs, st, rank, world)?;
    let outcome = if config.overlapped_staging {
        // SAFETY: the saved rows (`st.params`, `st.m`, `st.v`) are written only by
        // the optimizer step, which waits for `wait_staged()` on the pending handle
        // first (in `run_generation`); a new generation waits for it before it loads
        // into recycled vectors, and `Checkpointing` drops the pending handle (which
        // waits) before the spare vectors.
        runtime.block_on(unsafe { checkpointer.save_overlapped(st.step, &state) })?
    } else {
        runtime.block_on(checkpointer.save(st.step, &state))?
    };
    Ok(outcome)
}

/// What a rank saves: its rows of every parameter and both Adam moments, and the
/// trainer's global state.
/// What a model tensor's parameters and Adam moments are saved as: `PREFIX/NAME`, in
/// the order of a copy's tensors (see [`memory::KINDS`]).
const SAVED_AS: [&str; memory::KINDS] = ["param", "adam_m", "adam_v"];

fn state_of<'a>(
    config: &TrainConfig,
    specs: &[TensorSpec],
    st: &'a Shards,
    rank: usize,
    world: usize,
) -> Result<State<'a>, TrainError> {
    let mut state = State::new();
    for (i, spec) in specs.iter().enumerate() {
        let shape = spec.shape();
        for (prefix, data) in SAVED_AS
            .into_iter()
            .zip([&st.params[i], &st.m[i], &st.v[i]])
        {
            state.add_dim0_shard(
                format!("{prefix}/{}", spec.name),
                DType::F32,
                &shape,
                rank,
                world,
                as_bytes(data),
            )?;
        }
    }
    let batch = config.preset.batch as u64;
    state.set_global_json("step", json!(st.step));
    state.set_global_json("trainer", trainer_state(config));
    state.set_global_json(
        "data_position",
        json!({ "next_step": st.step, "samples_consumed": st.step * batch }),
    );
    state.set_global_json(
        "rng",
        json!({
            "algorithm": "counter-based splitmix64 of (seed, stream, step, sample)",
            "seed": config.seed,
            "note": "no generator state: step N's data is a function of (seed, N)",
        }),
    );
    state.set_global_json("loss_history", json!(st.losses));
    state.set_global_json(
        "optimizer",
        json!({ "kind": "adam", "lr": config.preset.lr, "beta1": model::BETA1, "beta2": model::BETA2, "eps": model::EPS, "t": st.step }),
    );
    Ok(state)
}

/// What a rank reports after trying to load the proposed checkpoint.
const LOADED: i64 = 1;
/// The checkpoint is damaged where this rank reads it (or has no manifest).
const DAMAGED: i64 = 0;

/// Loads the newest committed checkpoint that **every** rank can load, resharded onto
/// this world, or `None` when the store holds none.
///
/// One decision for the whole world: rank 0 proposes the commits newest first (in
/// commit order); every rank loads its boxes of the proposal; an all-reduce says
/// whether all succeeded. A checkpoint damaged only where some ranks read it is
/// skipped by all of them, so no rank resumes from a step the others refused.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn load(
    comm: &dyn Collective,
    runtime: &tokio::runtime::Handle,
    store: &Store,
    config: &TrainConfig,
    specs: &[TensorSpec],
    supervisor: &dyn Supervisor,
    memory: Option<(&Memory, &[Holding])>,
    mut spare: Vec<Vec<f32>>,
) -> Result<Option<(Shards, u64)>, TrainError> {
    const NONE: u64 = u64::MAX;
    let (rank, world) = (comm.rank(), comm.world_size());
    // Rank 0 walks the commits newest first, reading older history only if needed.
    let mut walk = if rank == 0 {
        Some(unless_cancelled(
            runtime,
            supervisor,
            "finding the newest commit",
            ckpt::catalog::NewestFirst::new(store),
        )?)
    } else {
        None
    };
    let mut known: Vec<ckpt::Commit> = Vec::new();
    let (found, generation, committed_dir) = loop {
        let proposal = match walk.as_mut() {
            Some(walk) => unless_cancelled(
                runtime,
                supervisor,
                "finding the newest commit",
                walk.next(),
            )?,
            None => None,
        };
        let proposal = proposal.as_ref();
        let seq = comm.broadcast_u64(0, proposal.map_or(NONE, |c| c.seq.unwrap_or(NONE - 1)))?;
        let step = comm.broadcast_u64(0, proposal.map_or(NONE, |c| c.step))?;
        if seq == NONE {
            return Ok(None);
        }
        let matches = |c: &ckpt::Commit| match c.seq {
            Some(s) => s == seq,
            None => seq == NONE - 1 && c.step == step,
        };
        let commit = match proposal {
            Some(c) => Some(c.clone()),
            None => {
                if !known.iter().any(matches) {
                    known = unless_cancelled(
                        runtime,
                        supervisor,
                        "listing the commits",
                        ckpt::catalog::commits(store),
                    )?;
                }
                known.iter().find(|c| matches(c)).cloned()
            }
        };
        let dir = commit.as_ref().map(|c| c.dir.clone());
        let in_memory = match (&commit, memory) {
            (Some(commit), Some((memory, table))) => from_memory(
                memory,
                table,
                runtime,
                store,
                commit,
                rank,
                world,
                specs,
                supervisor,
                std::mem::take(&mut spare),
            ),
            _ => None,
        };
        let attempt = match (in_memory, commit) {
            (Some(found), _) => Ok(found),
            (None, Some(commit)) => or_cancelled(runtime, supervisor, "loading", async {
                let manifest = ckpt::catalog::read_commit(store, &commit).await?;
                let generation = manifest.generation;
                let reader = ckpt::CheckpointReader::from_manifest(store, manifest);
                // In place: into the vectors the last generation left (pages this
                // process has touched fill faster), or new ones.
                let (request, mut tensors) = store_request(specs, rank, world, &mut spare);
                let mut outputs: Vec<&mut [u8]> =
                    tensors.iter_mut().map(|t| ckpt::as_bytes_mut(t)).collect();
                reader.load_into(&request, &mut outputs).await?;
                let global = reader.global_state().await?;
                Ok::<_, ckpt::Error>((
                    Found::Store {
                        step: reader.step(),
                        saved_world: reader.manifest().world_size,
                        tensors,
                        global,
                    },
                    generation,
                ))
            })?,
            (None, None) => Err(ckpt::Error::NotFound(format!(
                "rank {rank} cannot find commit {seq} (step {step}) that rank 0 proposed"
            ))),
        };
        let (vote, fatal) = match &attempt {
            Ok(_) => (LOADED, None),
            Err(e) if e.is_corruption() || matches!(e, ckpt::Error::NotFound(_)) => {
                tracing::warn!(step, rank, error = %e, "checkpoint does not load here; the world falls back");
                (DAMAGED, None)
            }
            // Anything else (the store is down) ends the resume for every rank.
            Err(e) => (-(world as i64) - 1, Some(e.to_string())),
        };
        let mut votes = [vote];
        comm.all_reduce_i64(&mut votes)?;
        if votes[0] < 0 {
            return Err(TrainError::Invalid(fatal.unwrap_or_else(|| {
                format!("another rank could not read checkpoint step {step}; resume abandoned")
            })));
        }
        if votes[0] == world as i64 {
            let (found, generation) = attempt.expect("this rank loaded");
            break (found, generation, dir);
        }
        if rank == 0 {
            say(format_args!(
                "checkpoint step {step} does not load on {} of {world} ranks; falling back to the commit before it",
                world as i64 - votes[0]
            ));
        }
    };
    let (step, saved_world, shards, rebuilt) = match found {
        Found::Store {
            step,
            saved_world,
            tensors,
            global,
        } => (
            step,
            saved_world,
            shards_from_store(step, tensors, global, config, specs)?,
            [0, 0, 0],
        ),
        Found::Memory {
            step,
            assembled,
            global,
        } => {
            let rebuilt = [1, assembled.local_bytes as i64, assembled.peer_bytes as i64];
            let saved_world = assembled.saved_world as u32;
            let shards = shards_from_store(step, assembled.tensors, global, config, specs)?;
            (step, saved_world, shards, rebuilt)
        }
    };
    if shards.losses.len() as u64 != step {
        return Err(TrainError::Invalid(format!(
            "checkpoint step {step} records {} losses",
            shards.losses.len()
        )));
    }
    // Where the rows came from, summed over the world, for the resume line.
    let mut source = String::new();
    if let Some((memory, _)) = memory {
        let mut rebuilt = rebuilt;
        comm.all_reduce_i64(&mut rebuilt)?;
        source = format!(
            "; rows rebuilt from memory on {} of {world} ranks ({:.1} MB own, {:.1} MB from peers)",
            rebuilt[0],
            rebuilt[1] as f64 / 1e6,
            rebuilt[2] as f64 / 1e6
        );
        if rebuilt[0] < world as i64 {
            source.push_str(", read from the store on the others");
        }
        if let Some(dir) = &committed_dir {
            memory.confirm(dir);
        }
    }
    if rank == 0 {
        say(format_args!(
            "resumed from step {step} of {} (saved by {saved_world} ranks, resharded onto {world}{source})",
            store.url()
        ));
    }
    Ok(Some((shards, generation)))
}

/// What a rank loaded: from the store, or rebuilt from in-memory copies.
enum Found {
    Store {
        step: u64,
        saved_world: u32,
        /// Parameters, first and second moments of each spec in turn.
        tensors: Vec<Vec<f32>>,
        global: BTreeMap<String, ckpt::format::StateValue>,
    },
    Memory {
        step: u64,
        assembled: memory::Assembled,
        /// The non-tensor state, from the store (copies hold only rows).
        global: BTreeMap<String, ckpt::format::StateValue>,
    },
}

/// This rank's rows of `commit` rebuilt from the in-memory copies `table` lists (into
/// the `spare` vectors where there are some), every row checked against the block
/// CRC32s of the commit's rank parts, with the non-tensor state read from the store;
/// or `None` (the store is read instead) when the copies do not cover the rows, a
/// peer fails, or a copy does not match what was saved (logged as a warning).
#[allow(clippy::too_many_arguments)]
fn from_memory(
    memory: &Memory,
    table: &[Holding],
    runtime: &tokio::runtime::Handle,
    store: &Store,
    commit: &ckpt::Commit,
    rank: usize,
    world: usize,
    specs: &[TensorSpec],
    supervisor: &dyn Supervisor,
    spare: Vec<Vec<f32>>,
) -> Option<(Found, u64)> {
    // Only a generation-stamped attempt names one commit exactly.
    let attempt = commit.attempt()?;
    let shapes: Vec<memory::Shape> = specs
        .iter()
        .map(|s| memory::Shape {
            rows: s.rows,
            cols: s.cols,
        })
        .collect();
    let names: Vec<String> = specs
        .iter()
        .flat_map(|s| SAVED_AS.map(|prefix| format!("{prefix}/{}", s.name)))
        .collect();
    supervisor.waiting(true);
    let rebuilt = (|| {
        let manifest = runtime
            .block_on(ckpt::catalog::read_commit(store, commit))
            .map_err(|e| memory::AssembleError::Unavailable(e.to_string()))?;
        let reader = ckpt::CheckpointReader::from_manifest(store, manifest);
        let part = |r: usize| {
            runtime
                .block_on(reader.part(r as u32))
                .map_err(|e| e.to_string())
        };
        let saved = memory::Saved {
            names: &names,
            part: &part,
        };
        let assembled = memory::assemble(
            memory,
            table,
            rank,
            world,
            &commit.dir,
            &shapes,
            &saved,
            spare,
            &|| supervisor.is_cancelled(),
        )?;
        let global = runtime
            .block_on(reader.global_state())
            .map_err(|e| memory::AssembleError::Unavailable(e.to_string()))?;
        Ok::<_, memory::AssembleError>((assembled, global))
    })();
    supervisor.waiting(false);
    match rebuilt {
        Ok((assembled, global)) => Some((
            Found::Memory {
                step: commit.step,
                assembled,
                global,
            },
            attempt.generation,
        )),
        Err(memory::AssembleError::Mismatch(e)) => {
            tracing::warn!(step = commit.step, rank, error = %e, "an in-memory copy differs from what was saved; reading the store");
            None
        }
        Err(memory::AssembleError::Unavailable(e)) => {
            tracing::info!(step = commit.step, rank, error = %e, "not rebuilt from memory; reading the store");
            None
        }
    }
}

/// Checks a checkpoint loaded from the store against this run and turns it into
/// this rank's shards.
fn shards_from_store(
    step: u64,
    tensors: Vec<Vec<f32>>,
    global: BTreeMap<String, ckpt::format::StateValue>,
    config: &TrainConfig,
    specs: &[TensorSpec],
) -> Result<Shards, TrainError> {
    let expect = trainer_state(config);
    let saved = global.get("trainer").and_then(|v| v.as_json()).cloned();
    for key in ["preset", "seed", "global_batch", "chunks"] {
        let saved = saved.as_ref().and_then(|s| s.get(key));
        if saved != expect.get(key) {
            return Err(TrainError::Invalid(format!(
                "checkpoint step {step} was written with {key} = {}, this run has {key} = {}",
                saved.map_or("nothing".to_string(), |v| v.to_string()),
                expect[key]
            )));
        }
    }
    let saved_step = global
        .get("step")
        .and_then(|v| v.as_json())
        .and_then(|v| v.as_u64());
    if saved_step != Some(step) {
        return Err(TrainError::Invalid(format!(
            "checkpoint step {step} records step {saved_step:?} in its global state"
        )));
    }
    let losses: Vec<f64> = global
        .get("loss_history")
        .and_then(|v| v.as_json())
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .ok_or_else(|| {
            TrainError::Invalid(format!("checkpoint step {step} has no loss_history"))
        })?;
    let mut tensors = tensors.into_iter();
    let mut shards = Shards {
        params: Vec::new(),
        m: Vec::new(),
        v: Vec::new(),
        step,
        losses,
    };
    for _ in specs {
        let mut next = || tensors.next().expect("three tensors per spec");
        shards.params.push(next());
        shards.m.push(next());
        shards.v.push(next());
    }
    Ok(shards)
}

/// The load of this rank's rows of every parameter and both moments (dtype and shape
/// checked), and its destinations: the `spare` vectors where they have the right
/// sizes, new ones otherwise.
fn store_request(
    specs: &[TensorSpec],
    rank: usize,
    world: usize,
    spare: &mut Vec<Vec<f32>>,
) -> (LoadRequest, Vec<Vec<f32>>) {
    let mut request = LoadRequest::new();
    let mut tensors = Vec::with_capacity(specs.len() * 3);
    let mut spare = std::mem::take(spare).into_iter();
    for spec in specs {
        let shape = spec.shape();
        let n = owned_rows(spec, rank, world).len() * spec.cols;
        for prefix in SAVED_AS {
            request = request.expect(
                format!("{prefix}/{}", spec.name),
                DType::F32,
                &shape,
                ckpt::Region::dim0_shard(&shape, rank, world),
            );
            tensors.push(match spare.next() {
                Some(v) if v.len() == n => v,
                _ => vec![0f32; n],
            });
        }
    }
    (request, tensors)
}
