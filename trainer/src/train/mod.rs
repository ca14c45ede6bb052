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
//! With `replicas` R > 1 (a world of R × S ranks), rank `r` holds shard `r % S` in
//! replica group `r / S`: phase 1 gathers each shard from replica group 0, phase 3 is
//! an all-reduce (every replica needs its shard's sum), and every save has group 0
//! write and the others checksum their copies for the commit to compare.
//!
//! A step whose gathered parameters or agreed loss is not finite (or a spike, see
//! [`TrainConfig::spike_factor`]) is not applied: the world rolls back, in the same
//! processes, to the newest healthy commit (module `rollback`).
//!
//! Checkpoints hold the parameters and both Adam moments as dim-0 shards, and as
//! global state the step, the data position, the generator description and the loss
//! history. Nothing is per rank: the data of a step is a function of (seed, step,
//! chunk), so a resumed run at any world size continues the same sequence.
//!
//! The parts, each in its module:
//! - `supervised`: [`run_supervised`], the generation's start and its loop of steps,
//!   one method per phase;
//! - `supervisor`: the [`Supervisor`] contract (progress, waits, cancellation) and
//!   the adapters that make every wait reported and cancellable;
//! - `checkpointing`: [`Checkpointing`], what a rank keeps from one generation to
//!   the next (the save in flight, buffers, state vectors);
//! - `saving`: the saves of a generation and the two rules for their commits (a
//!   periodic save may fail, the last one of a generation may not);
//! - `shards`: a rank's state and its saved form, written and read in one place;
//! - `resume`: the world's one decision on the checkpoint to resume from;
//! - `cooperative`: a resume that reads every byte from the store once per world,
//!   the ranks passing the rest over the collective;
//! - `rollback`: the judgement of a step (non-finite, a spike) and the count of
//!   rollbacks in a row;
//! - `copies`: the trainer's side of in-memory copies ([`ckpt::copies`]);
//! - `snapshots`: the memory tier ([`ckpt::snapshot`]): snapshots every few steps,
//!   replicated, voted and committed, and a resume from the newest one.

use std::io::Write;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use ckpt::storage::Store;

use crate::collective::{Collective, CollectiveError};
use crate::model::Preset;

mod checkpointing;
mod cooperative;
mod copies;
mod resume;
mod rollback;
mod saving;
mod shards;
mod snapshots;
mod supervised;
mod supervisor;

pub use checkpointing::Checkpointing;
pub use supervised::run_supervised;
pub use supervisor::{Supervisor, Unsupervised};

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
    /// Snapshot into host memory every this many steps (0: never): kept, replicated
    /// to the ring successor and committed by a vote (module `snapshots`), so that a
    /// lost rank costs at most this many steps and one when the survivors hold every
    /// file. Needs a copy server on every rank ([`Checkpointing::copies`]) and a store.
    pub snapshot_every: u64,
    /// Bytes of host memory this rank's checkpointing may hold: staging buffers,
    /// copies, replicas and snapshots (`None`: unbounded, only counted). See
    /// [`ckpt::CheckpointConfig::host_memory_budget`].
    pub host_memory_budget: Option<u64>,
    /// Fault injection for tests: (step, rank) votes against the snapshot of that
    /// step, as a rank that never finished it would: it is not committed.
    pub snapshot_vote_against: Option<(u64, usize)>,
    /// Keep this many newest checkpoints.
    pub keep: usize,
    /// A world of more than one rank resumes cooperatively: rank 0 alone reads the
    /// commit and shares it, each byte is read from the store by one rank and passed
    /// to the others over the collective (module `cooperative`). False: every rank
    /// reads what it needs from the store on its own.
    pub cooperative_load: bool,
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
    /// [`CheckpointConfig::new`](ckpt::CheckpointConfig::new) reads it). An elastic rank sets one per generation,
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
    /// [`ckpt::copies`]), so that a recovery rebuilds from RAM where it can.
    pub memory_copies: bool,
    /// Overlapped saves ([`Checkpointer::save_overlapped`](ckpt::Checkpointer::save_overlapped)): the copy into the staging
    /// buffer runs while the next step gathers and computes, and the rank waits for
    /// it only right before its optimizer step overwrites the saved rows. False:
    /// blocking saves, the copy inside the step that saves.
    pub overlapped_staging: bool,
    /// Check that no saved tensor changes before its staging copy (a CRC32 of every
    /// tensor at save time; see `CheckpointConfig::check_staging`).
    pub check_staging: bool,
    /// Data-parallel replicas of every shard: a world of `replicas × S` ranks holds
    /// `S` dim-0 shards, rank `r` shard `r % S`, each `replicas` times over. Replicas
    /// compute bitwise identical updates; every save has replica group 0 write and
    /// the others checksum their copies, so that the commit compares them. A world
    /// that `replicas` does not divide trains without replicas (1: none).
    pub replicas: usize,
    /// What a commit does when replicas disagree: record it and mark the commit
    /// unhealthy (`Warn`), or refuse it (`Fail`).
    pub replica_mismatch: ckpt::ReplicaPolicy,
    /// Roll back when a step's loss exceeds this factor times the mean of the (up to
    /// 10) losses before it. `None`: only non-finite losses and parameters roll back.
    pub spike_factor: Option<f64>,
    /// Rollbacks in a row to the same checkpoint that a job survives; one more stops
    /// it with [`TrainError::Diverged`].
    pub max_rollbacks: u32,
    /// Fault injection for tests: a NaN written into one parameter element of one
    /// rank after a step (see [`NanFault`]).
    pub nan: Option<NanFault>,
    /// Fault injection for tests: (step, rank) flips one bit of one element of that
    /// rank's copy of a parameter right before the save of that step, and flips it
    /// back once the save has staged it (memory corruption that only the save sees).
    /// With replicas the commit's comparison names that rank; without, nothing can.
    pub sdc: Option<(u64, usize)>,
}

/// Where and how often [`TrainConfig::nan`] poisons a parameter: `rank` writes a NaN
/// into element 0 of its rows of the last tensor it holds rows of, right after step
/// `step` (before that step's save).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NanFault {
    /// The step just completed.
    pub step: u64,
    /// The rank that writes the NaN.
    pub rank: usize,
    /// Every time the rank reaches the step (a poison that rolling back cannot
    /// escape), instead of once per process.
    pub persistent: bool,
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
    /// Training keeps going bad at the same place: more rollbacks in a row to the
    /// same checkpoint than [`TrainConfig::max_rollbacks`] allows.
    #[error("{0}")]
    Diverged(String),
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
    /// Snapshots taken (the memory tier).
    pub snapshots: u64,
    /// Time the loop spent on snapshots: the vote at each boundary (an all-gather),
    /// registering the next snapshot, and waiting for its copy before the optimizer
    /// step.
    pub snapshot_blocked: Duration,
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

/// What every part of a generation reads, and none changes.
#[derive(Clone, Copy)]
struct Context<'a> {
    /// The world's collective, watched by the supervisor.
    comm: &'a dyn Collective,
    runtime: &'a tokio::runtime::Handle,
    /// `None`: nothing is saved or loaded.
    store: Option<&'a Store>,
    config: &'a TrainConfig,
    supervisor: &'a dyn Supervisor,
    rank: usize,
    world: usize,
    /// The shard this rank holds and its replica group.
    place: shards::Place,
}

/// Prints one line on stdout (flushed, so launchers and tests see it at once).
fn say(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_fmt(line);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}
