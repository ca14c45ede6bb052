//! The loop of one generation, [`run_supervised`], as named steps.
//!
//! A generation starts once (the world agrees on resuming and on in-memory copies,
//! loads or initialises its state, builds its checkpointer), then runs steps until
//! the target step, an agreed stop or regroup, or the first failure. Each phase of a
//! step (see the parent module's docs) is a method of [`Generation`], which owns the
//! buffers that phase uses, so the loop itself reads as the algorithm does.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ckpt::storage::Store;
use ckpt::{CheckpointConfig, Checkpointer};

use crate::collective::{Collective, CollectiveExt, shard_counts};
use crate::fixed;
use ckpt::copies::{Copies, Holding};

use crate::model::{self, GradSink, Preset, Teacher, TensorSpec};

use super::checkpointing::{Checkpointing, Recycled, Workspace};
use super::copies::holdings;
use super::resume::load;
use super::rollback::{self, Rollbacks};
use super::saving::Saves;
use super::shards::{Place, Shards, init, owned_rows, state_of};
use super::snapshots::{self, Snapshots, held_json};
use super::supervisor::Watched;
use super::{Context, Outcome, Stats, Supervisor, TrainConfig, TrainError, say};

/// [`run_generation`](super::run_generation) under a supervisor (an elastic agent),
/// with checkpoint state that outlives the generation. The generation ends early with
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
    let mut rollbacks = Rollbacks::default();
    let mut again: Option<TrainConfig> = None;
    // One clock for every round: the step marks of a rollback's round go on from
    // the ones before it.
    let started = Instant::now();
    loop {
        let round = again.as_ref().unwrap_or(config);
        let ended = run_round(
            comm,
            runtime,
            store,
            round,
            stop,
            stats,
            supervisor,
            checkpointing,
            &mut rollbacks,
            started,
        )?;
        match ended {
            Ended::Done(outcome) => return Ok(outcome),
            Ended::Rollback { from, reason } => {
                // The same processes, the same world: resume from the newest
                // healthy commit, in a newer checkpoint generation.
                let mut next = round.clone();
                next.resume = true;
                next.generation = rollbacks.generation + 1;
                rollbacks.pending = Some((from, reason));
                // The snapshot committed before the rollback belongs to the timeline
                // it left: never resumed from, by whichever rank is rank 0 later.
                checkpointing.abandoned_snapshot = checkpointing
                    .copies
                    .as_ref()
                    .and_then(|c| c.committed_snapshot())
                    .map(|(dir, _)| dir);
                again = Some(next);
            }
        }
    }
}

/// How one round of a generation (its start, or a rollback's restart) ended.
enum Ended {
    /// The generation is over.
    Done(Outcome),
    /// A bad step: start again from the newest healthy commit.
    Rollback {
        /// The last step trained.
        from: u64,
        /// What was wrong with the step after it.
        reason: String,
    },
}

/// One round of [`run_supervised`]: the start (resume or initial state), then steps
/// until the generation ends or a step goes bad.
#[allow(clippy::too_many_arguments)]
fn run_round(
    comm: &dyn Collective,
    runtime: &tokio::runtime::Handle,
    store: Option<&Store>,
    config: &TrainConfig,
    stop: &AtomicBool,
    stats: &mut Stats,
    supervisor: &dyn Supervisor,
    checkpointing: &mut Checkpointing,
    rollbacks: &mut Rollbacks,
    started: Instant,
) -> Result<Ended, TrainError> {
    let watched = Watched { comm, supervisor };
    let (rank, world) = (comm.rank(), comm.world_size());
    let ctx = Context {
        comm: &watched,
        runtime,
        store,
        config,
        supervisor,
        rank,
        world,
        place: Place::of(rank, world, config.replicas),
    };
    let layout = Layout::new(&config.preset, ctx.place)?;
    let start = agree_on_start(ctx, checkpointing.copies.as_ref())?;
    let holder = start
        .copies
        .as_ref()
        .map(|(copies, table)| (copies, table.as_slice()));
    // The copies of store saves, when the job keeps them; the holder serves
    // snapshots either way.
    let copies = holder
        .filter(|_| config.memory_copies)
        .map(|(copies, table)| (copies.as_ref(), table));
    // A rollback goes back to the newest healthy store commit: a snapshot may hold
    // the very state that went bad.
    let snapshot_source = holder
        .filter(|_| rollbacks.pending.is_none())
        .map(|(copies, table)| (copies.as_ref(), table));
    let (shards, generation) = starting_state(
        ctx,
        &layout.specs,
        copies,
        snapshot_source,
        start.resume,
        checkpointing,
    )?;
    rollbacks.generation = generation;
    rollbacks.arrived(ctx, shards.step)?;
    let Checkpointing {
        pending,
        failed_in_a_row,
        workspace,
        spare,
        ..
    } = checkpointing;
    let st = Recycled { shards, spare };
    supervisor.checkpoint_generation(generation);
    supervisor.progress(st.step);
    let checkpointer = store
        .map(|store| {
            // One budget for the rank: the copy holder's, which outlives this
            // generation's checkpointer.
            let budget = holder.and_then(|(copies, _)| copies.config().budget.clone());
            checkpointer(
                ctx,
                store,
                generation,
                copies.is_some(),
                budget,
                &layout.specs,
                &st,
            )
        })
        .transpose()?;
    let held = snapshots::host_bytes_held(
        checkpointer.as_ref(),
        holder.map(|(copies, _)| copies.as_ref()),
    );
    announce(ctx, st.step, &held_json(&held));
    let teacher = Teacher::new(config.seed, &config.preset);
    workspace.prepare(layout.total(), config.deterministic);
    Generation {
        ctx,
        stop,
        stats,
        layout,
        teacher,
        st,
        workspace,
        grad_shard: Vec::new(),
        grad_shard_i64: Vec::new(),
        saves: Saves {
            ctx,
            checkpointer,
            copies,
            holder: holder.map(|(copies, _)| copies.as_ref()),
            pending,
            failed_in_a_row,
        },
        snapshots: Snapshots::new(ctx, holder),
        started,
        grad_sq: 0.0,
    }
    .run()
}

/// Where each tensor lies in the all-gathered parameters, and which part of it each
/// rank owns.
struct Layout {
    /// The model's tensors, in order.
    specs: Vec<TensorSpec>,
    /// Where each tensor starts in the full vector, then the total (`specs.len() + 1`
    /// entries).
    offsets: Vec<usize>,
    /// Elements of each tensor that each rank contributes to its all-gather (its
    /// rows times the columns; with replicas, replica group 0 alone contributes).
    counts: Vec<Vec<usize>>,
    /// Where this rank's rows of each tensor start in it, and how many elements.
    own: Vec<(usize, usize)>,
    /// Replicas of each shard (1: none).
    replicas: usize,
}

impl Layout {
    /// The layout of `preset` for a rank at `place`; an error when its chunks cannot
    /// split its batch (fixed-point sums allow at most `fixed::MAX_CHUNKS`).
    fn new(preset: &Preset, place: Place) -> Result<Self, TrainError> {
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
        let world = place.shards * place.replicas;
        let counts = specs
            .iter()
            .map(|s| {
                let mut counts: Vec<usize> = shard_counts(s.rows, place.shards)
                    .into_iter()
                    .map(|rows| rows * s.cols)
                    .collect();
                counts.resize(world, 0);
                counts
            })
            .collect();
        let own = specs
            .iter()
            .map(|s| {
                let rows = owned_rows(s, place);
                (rows.start * s.cols, rows.len() * s.cols)
            })
            .collect();
        Ok(Layout {
            specs,
            offsets,
            counts,
            own,
            replicas: place.replicas,
        })
    }

    /// Parameters in all.
    fn total(&self) -> usize {
        self.offsets[self.specs.len()]
    }

    /// Where tensor `i` lies in the full vector.
    fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }
}

/// How the world starts a generation, decided together.
struct Start {
    /// Load the newest committed checkpoint.
    resume: bool,
    /// The in-memory copies and every rank's holding, when every rank keeps them.
    copies: Option<(Arc<Copies>, Vec<Holding>)>,
}

/// Whether to resume is decided together: in an elastic world a member that just
/// joined (a relaunched rank) has never trained while the survivors resume, and all
/// of them must run the same collectives. So is whether to keep in-memory copies:
/// only when every rank has them (their table of holdings is one more collective).
/// Without a store there is neither.
fn agree_on_start(ctx: Context<'_>, copies: Option<&Arc<Copies>>) -> Result<Start, TrainError> {
    if ctx.store.is_none() {
        return Ok(Start {
            resume: false,
            copies: None,
        });
    }
    let mut wanted = [i64::from(ctx.config.resume), i64::from(copies.is_some())];
    ctx.comm.all_reduce_i64(&mut wanted)?;
    let copies = match copies {
        Some(copies) if wanted[1] == ctx.world as i64 => {
            Some((Arc::clone(copies), holdings(ctx.comm, copies)?))
        }
        _ => None,
    };
    Ok(Start {
        resume: wanted[0] > 0,
        copies,
    })
}

/// This rank's state at the start, and the checkpoint generation of its saves: the
/// newest checkpoint every rank can load (when resuming and there is one), loaded
/// into the last generation's vectors, or the initial state.
fn starting_state(
    ctx: Context<'_>,
    specs: &[TensorSpec],
    copies: Option<(&Copies, &[Holding])>,
    snapshot_source: Option<(&Copies, &[Holding])>,
    resume: bool,
    checkpointing: &mut Checkpointing,
) -> Result<(Shards, u64), TrainError> {
    // An overlapped save of the previous generation may still read the vectors
    // about to be recycled as this load's destination.
    if let Some(handle) = &checkpointing.pending {
        let _ = handle.wait_staged();
    }
    let config = ctx.config;
    let resumed = match (ctx.store, resume) {
        (Some(store), true) => match snapshot_source
            .map(|source| {
                snapshots::resume(
                    ctx.comm,
                    ctx.runtime,
                    store,
                    config,
                    specs,
                    ctx.supervisor,
                    source,
                    checkpointing.abandoned_snapshot.as_deref(),
                    ctx.place,
                    &mut checkpointing.spare,
                )
            })
            .transpose()?
            .flatten()
        {
            Some(resumed) => Some(resumed),
            None => load(
                ctx.comm,
                ctx.runtime,
                store,
                config,
                specs,
                ctx.supervisor,
                copies,
                ctx.place,
                std::mem::take(&mut checkpointing.spare),
            )?,
        },
        _ => None,
    };
    // A resumed run saves in a newer generation than the checkpoint it resumed from:
    // a late writer of the timeline it left is then fenced off.
    let generation = resumed
        .as_ref()
        .map_or(config.generation, |(_, g)| config.generation.max(g + 1));
    let shards = resumed
        .map(|(shards, _)| shards)
        .unwrap_or_else(|| init(config, specs, ctx.place));
    Ok((shards, generation))
}

/// The checkpointer of the generation's saves, its staging pool allocated and faulted
/// in now: the first checkpoint of the generation is not its slowest save. With
/// `keep_copies` each save's staged file stays as this rank's in-memory copy.
fn checkpointer(
    ctx: Context<'_>,
    store: &Store,
    generation: u64,
    keep_copies: bool,
    budget: Option<Arc<ckpt::HostBudget>>,
    specs: &[TensorSpec],
    st: &Shards,
) -> Result<Checkpointer, TrainError> {
    let config = ctx.config;
    let mut c = CheckpointConfig::new(ctx.rank, ctx.world);
    c.keep_last = Some(config.keep.max(1));
    c.retention_grace = config.retention_grace;
    c.generation = generation;
    if let Some(run_id) = &config.run_id {
        c.run_id = run_id.clone();
    }
    c.check_staging = config.check_staging;
    c.keep_copy = keep_copies;
    c.replica_mismatch = config.replica_mismatch;
    let checkpointer = match budget {
        // The holder's budget already has the rank's bound.
        Some(budget) => Checkpointer::with_budget(store.clone(), c, budget)?,
        None => {
            c.host_memory_budget = config.host_memory_budget;
            Checkpointer::new(store.clone(), c)?
        }
    };
    checkpointer.warm_up(&state_of(config, specs, st, ctx.place)?)?;
    Ok(checkpointer)
}

/// Rank 0's line at the start of a generation, with what the rank's checkpointing
/// holds in host memory (`held`, JSON) right after its resume.
fn announce(ctx: Context<'_>, step: u64, held: &str) {
    if ctx.rank != 0 {
        return;
    }
    let config = ctx.config;
    say(format_args!(
        "start: preset {} ({} parameters), world {}{}, step {step} of {}, {} mode; host_bytes_held {held}",
        config.preset.name,
        config.preset.parameters(),
        ctx.world,
        match (config.replicas, ctx.place.replicas) {
            (_, r) if r > 1 => format!(" ({r} replicas of {} shards)", ctx.place.shards),
            (wanted, _) if wanted > 1 => {
                format!(" (no replicas: {wanted} does not divide the world)")
            }
            _ => String::new(),
        },
        config.steps,
        if config.deterministic {
            "deterministic"
        } else {
            "fast"
        }
    ));
}

/// How a generation ends before its last step, at a step the ranks agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// A stop was requested (a signal): save, commit, exit.
    Stop,
    /// Members wait to join: save, commit, and go on in the next generation.
    Regroup,
}

/// What the ranks agreed on in a step's all-reduce.
#[derive(Debug, Clone)]
struct Agreed {
    /// The step's loss: every chunk's, summed in chunk order, so that it is the same
    /// for every world size.
    loss: f64,
    /// Whether the generation ends after this step.
    ending: Option<Ending>,
    /// Why the step is bad (then it was not applied, and the world rolls back).
    bad: Option<String>,
}

/// A generation under way.
struct Generation<'a> {
    ctx: Context<'a>,
    /// Polled once per step; set by a signal handler.
    stop: &'a AtomicBool,
    stats: &'a mut Stats,
    layout: Layout,
    teacher: Teacher,
    /// This rank's parameters and moments.
    st: Recycled<'a>,
    workspace: &'a mut Workspace,
    /// This rank's rows of one tensor's summed gradient.
    grad_shard: Vec<f32>,
    /// The same in fixed point (deterministic mode), as the reduce-scatter returns it.
    grad_shard_i64: Vec<i64>,
    saves: Saves<'a>,
    snapshots: Snapshots<'a>,
    started: Instant,
    /// This rank's share of the squared norm of the step's summed gradient (its
    /// rows; nothing on replicas past group 0, whose rows group 0 counts).
    grad_sq: f64,
}

impl Generation<'_> {
    /// Runs steps until the last one, an agreed stop or regroup, a bad step, or a
    /// failure.
    fn run(mut self) -> Result<Ended, TrainError> {
        let first_step = self.st.step;
        let mut loss = f64::NAN;
        let names: Vec<String> = self.layout.specs.iter().map(|s| s.name.clone()).collect();
        while self.st.step < self.ctx.config.steps {
            if self.ctx.supervisor.is_cancelled() {
                return Err(TrainError::Cancelled(format!("at step {}", self.st.step)));
            }
            let agreed = self.train_step()?;
            if let Some(reason) = agreed.bad {
                // Every rank judged the same agreed values: all of them end here.
                self.saves.settle()?;
                return Ok(Ended::Rollback {
                    from: self.st.step,
                    reason,
                });
            }
            loss = agreed.loss;
            let saving = self.save_due(agreed.ending);
            if saving {
                // Every rank, before any test fault can hold one: a collective.
                self.st.grad_norm = Some(self.grad_norm()?);
            }
            self.inject_device_error()?;
            let step = self.st.step;
            rollback::inject_nan(self.ctx, &names, &mut self.st.params, step);
            self.hold(true)?;
            if saving {
                let flipped = rollback::inject_sdc(self.ctx, &names, &mut self.st.params, step);
                self.saves.save(&self.st, &self.layout.specs, self.stats)?;
                if let Some(i) = flipped {
                    // The save has its copy (or gets it now): memory is mended.
                    self.saves.wait_staged(self.stats)?;
                    rollback::flip(&mut self.st.params[i]);
                }
            }
            let snapshotting = Instant::now();
            self.snapshot(agreed.ending.is_some())?;
            self.stats.snapshot_blocked += snapshotting.elapsed();
            self.hold(false)?;
            self.stats.marks.push(self.started.elapsed());
            if !self.ctx.config.step_pause.is_zero() {
                std::thread::sleep(self.ctx.config.step_pause);
            }
            if let Some(ending) = agreed.ending {
                return self.end_early(ending).map(Ended::Done);
            }
        }
        self.finish(first_step, loss).map(Ended::Done)
    }

    /// One step, phases 1 to 5 of the parent module's docs, then its record: the
    /// step count, the loss history, the supervisor's progress mark and rank 0's log
    /// line.
    fn train_step(&mut self) -> Result<Agreed, TrainError> {
        let step = self.st.step;
        let mut clock = Instant::now();
        self.gather()?;
        // Every rank gathered the same parameters: every rank reaches the same
        // verdict on them.
        let finite = self.workspace.full.iter().all(|x| x.is_finite());
        self.stats.gather += lap(&mut clock);
        // Poisoned parameters are not worth a forward pass (nor the count of
        // clamped gradients it would leave): the step is judged bad below.
        let losses = if finite {
            self.compute(step)?
        } else {
            vec![0; self.ctx.config.preset.chunks]
        };
        self.stats.compute += lap(&mut clock);
        // Losses and stop flags before the update, so a stop is agreed before any
        // rank changes its rows.
        let mut agreed = self.agree(losses)?;
        self.stats.reduce += lap(&mut clock);
        agreed.bad = rollback::judge(self.ctx.config, &self.st.losses, agreed.loss, finite);
        if agreed.bad.is_some() {
            return Ok(agreed);
        }
        self.reduce_and_update(step, &mut clock)?;
        self.record(agreed.loss);
        Ok(agreed)
    }

    /// Phase 1: all-gathers every parameter from its dim-0 shards into the workspace.
    fn gather(&mut self) -> Result<(), TrainError> {
        let writes = self.ctx.place.writes();
        for (i, counts) in self.layout.counts.iter().enumerate() {
            let full = &mut self.workspace.full[self.layout.range(i)];
            // With replicas, replica group 0 alone contributes: the others hold the
            // same rows.
            let mine = if writes { &self.st.params[i][..] } else { &[] };
            self.ctx.comm.all_gather_f32(mine, counts, full)?;
        }
        Ok(())
    }

    /// Phase 2: forward and backward of this rank's chunks (`rank, rank + W, …`), each
    /// chunk's gradient added into the workspace's accumulators. Returns every
    /// chunk's loss as the bits of an f64 (0 for the other ranks' chunks), for the
    /// all-reduce to combine.
    fn compute(&mut self, step: u64) -> Result<Vec<i64>, TrainError> {
        let Context {
            config,
            supervisor,
            rank,
            world,
            ..
        } = self.ctx;
        let preset = &config.preset;
        let Workspace {
            full,
            acc_i64,
            acc_f32,
        } = &mut *self.workspace;
        if config.deterministic {
            acc_i64.fill(0);
        } else {
            acc_f32.fill(0.0);
        }
        let cancelled = || TrainError::Cancelled(format!("computing step {}", step + 1));
        let mut losses = vec![0i64; preset.chunks];
        for chunk in (rank..preset.chunks).step_by(world) {
            // A cancelled generation stops between chunks, not at the next
            // collective: recovery does not wait for a whole step's compute.
            if supervisor.is_cancelled() {
                return Err(cancelled());
            }
            let (x, y) = model::chunk_data(config.seed, step, chunk, preset, &self.teacher);
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
            let offsets = &self.layout.offsets;
            let chunk_loss =
                model::chunk_step_unless(preset, full, offsets, &x, &y, &mut sink, &|| {
                    supervisor.is_cancelled()
                })
                .ok_or_else(cancelled)?;
            losses[chunk] = chunk_loss.to_bits() as i64;
        }
        Ok(losses)
    }

    /// Phase 4: one small all-reduce of every chunk's loss and of the ranks' stop and
    /// regroup flags: all ranks log the same loss and end at the same step.
    fn agree(&self, mut flags: Vec<i64>) -> Result<Agreed, TrainError> {
        let chunks = flags.len();
        flags.push(i64::from(self.stop.load(Ordering::SeqCst)));
        flags.push(i64::from(self.ctx.supervisor.regroup_requested()));
        self.ctx.comm.all_reduce_i64(&mut flags)?;
        let loss = flags[..chunks]
            .iter()
            .map(|b| f64::from_bits(*b as u64))
            .sum();
        // A regroup ends the generation like a stop, at the same agreed step, but the
        // ranks go on in the next generation instead of exiting.
        let ending = if flags[chunks] != 0 {
            Some(Ending::Stop)
        } else if flags[chunks + 1] != 0 {
            Some(Ending::Regroup)
        } else {
            None
        };
        Ok(Agreed {
            loss,
            ending,
            bad: None,
        })
    }

    /// Phases 3 and 5: reduce-scatters each tensor's gradients (this rank receives
    /// the sum over all chunks of the rows it owns), and applies Adam to those rows.
    fn reduce_and_update(&mut self, step: u64, clock: &mut Instant) -> Result<(), TrainError> {
        let Context { comm, config, .. } = self.ctx;
        let Workspace {
            acc_i64, acc_f32, ..
        } = &mut *self.workspace;
        let writes = self.ctx.place.writes();
        self.grad_sq = 0.0;
        for (i, counts) in self.layout.counts.iter().enumerate() {
            let (start, mine) = self.layout.own[i];
            self.grad_shard.resize(mine, 0.0);
            let range = self.layout.range(i);
            if self.layout.replicas > 1 {
                // Every replica needs its shard's sum: an all-reduce gives every rank
                // the same bits of every row (exact in fixed point; one ring order
                // in f32), so replicas update identically.
                let own = range.start + start..range.start + start + mine;
                if config.deterministic {
                    comm.all_reduce_i64(&mut acc_i64[range])?;
                    for (g, s) in self.grad_shard.iter_mut().zip(&acc_i64[own]) {
                        *g = fixed::from_fixed(*s);
                    }
                } else {
                    comm.all_reduce_f32(&mut acc_f32[range])?;
                    self.grad_shard.copy_from_slice(&acc_f32[own]);
                }
            } else if config.deterministic {
                self.grad_shard_i64.resize(mine, 0);
                comm.reduce_scatter_i64(&mut acc_i64[range], counts, &mut self.grad_shard_i64)?;
                for (g, s) in self.grad_shard.iter_mut().zip(&self.grad_shard_i64) {
                    *g = fixed::from_fixed(*s);
                }
            } else {
                comm.reduce_scatter_f32(&mut acc_f32[range], counts, &mut self.grad_shard)?;
            }
            self.stats.reduce += lap(clock);
            if writes {
                self.grad_sq += self
                    .grad_shard
                    .iter()
                    .map(|g| f64::from(*g) * f64::from(*g))
                    .sum::<f64>();
            }
            // The optimizer step overwrites the rows an overlapped save may still be
            // copying: the only point where the copy must be over.
            if i == 0 {
                let save_waited = self.saves.wait_staged(self.stats)?;
                let waiting = Instant::now();
                let snapshot_waited = self.snapshots.wait_staged()?;
                self.stats.snapshot_blocked += waiting.elapsed();
                if save_waited || snapshot_waited {
                    *clock = Instant::now();
                }
            }
            let st = &mut *self.st;
            model::adam(
                config.preset.lr,
                step + 1,
                &mut st.params[i],
                &mut st.m[i],
                &mut st.v[i],
                &self.grad_shard,
            );
            self.stats.update += lap(clock);
        }
        Ok(())
    }

    /// The global norm of the step's summed gradient: every rank's share of its
    /// square, summed in fixed point (one small all-reduce, at the steps that save),
    /// so that every rank records the same value.
    fn grad_norm(&self) -> Result<f64, TrainError> {
        const SCALE: f64 = (1u64 << 24) as f64;
        let cap = i64::MAX as f64 / (self.ctx.world as f64 + 1.0);
        let mut sum = [(self.grad_sq * SCALE).min(cap) as i64];
        self.ctx.comm.all_reduce_i64(&mut sum)?;
        Ok((sum[0] as f64 / SCALE).sqrt())
    }

    /// Counts the step done and logs its loss (rank 0, every `log_every` steps and
    /// the last).
    fn record(&mut self, loss: f64) {
        let config = self.ctx.config;
        self.st.step += 1;
        self.st.losses.push(loss);
        self.stats.steps += 1;
        self.ctx.supervisor.progress(self.st.step);
        let step = self.st.step;
        if self.ctx.rank == 0
            && (step.is_multiple_of(config.log_every.max(1)) || step == config.steps)
        {
            say(format_args!("step {step} loss {loss:.6}"));
        }
    }

    /// Whether this step is saved: every `ckpt_every` steps, the last step, and the
    /// step at which the generation ends early.
    fn save_due(&self, ending: Option<Ending>) -> bool {
        let (config, step) = (self.ctx.config, self.st.step);
        (config.ckpt_every > 0 && step.is_multiple_of(config.ckpt_every))
            || step == config.steps
            || ending.is_some()
    }

    /// The memory tier at this step's boundary: the world votes on the snapshot taken
    /// at the previous one, then takes this step's when one is due (not at the
    /// generation's last step). A step that also saves to the store is snapshotted
    /// all the same: its store commit may come later than a failure, and without the
    /// snapshot a loss before it would cost two intervals.
    fn snapshot(&mut self, ending: bool) -> Result<(), TrainError> {
        self.snapshots.vote()?;
        let step = self.st.step;
        if ending || step >= self.ctx.config.steps || !self.snapshots.due(step) {
            return Ok(());
        }
        if let Some(checkpointer) = &self.saves.checkpointer {
            self.snapshots
                .take(checkpointer, &self.layout.specs, &self.st)?;
            self.stats.snapshots += 1;
        }
        Ok(())
    }

    /// A test's fault ([`TrainConfig::device_error`]): this rank reports a device
    /// error at this step, as a lost GPU would surface.
    fn inject_device_error(&self) -> Result<(), TrainError> {
        let (step, rank) = (self.st.step, self.ctx.rank);
        if self.ctx.config.device_error != Some((step, rank)) {
            return Ok(());
        }
        say(format_args!(
            "fault: rank {rank} device error at step {step}"
        ));
        Err(TrainError::Device(format!(
            "injected at step {step} (as a lost GPU would surface)"
        )))
    }

    /// A test's fault ([`TrainConfig::hold`]): parks the training thread before or
    /// after this step's save, forever in a fixed world, until the supervisor
    /// cancels the generation in an elastic one (which then ends with
    /// [`TrainError::Cancelled`], as any wait does).
    fn hold(&self, before_save: bool) -> Result<(), TrainError> {
        let (step, rank) = (self.st.step, self.ctx.rank);
        let Some(hold) = self.ctx.config.hold else {
            return Ok(());
        };
        if (hold.step, hold.rank, hold.before_save) != (step, rank, before_save) {
            return Ok(());
        }
        say(format_args!(
            "fault: rank {rank} holds {} saving step {step}",
            if before_save { "before" } else { "after" }
        ));
        while !self.ctx.supervisor.is_cancelled() {
            std::thread::park_timeout(Duration::from_millis(50));
        }
        Err(TrainError::Cancelled(format!("holding at step {step}")))
    }

    /// Ends the generation at an agreed stop or regroup, once this step's save has
    /// committed.
    fn end_early(mut self, ending: Ending) -> Result<Outcome, TrainError> {
        // A stopped rank exits next; a regrouped one goes on in the next generation.
        self.saves.final_commit(ending == Ending::Stop)?;
        self.stats.elapsed += self.started.elapsed();
        let step = self.st.step;
        let (what, outcome) = match ending {
            Ending::Stop => ("stopped", Outcome::Stopped { step }),
            Ending::Regroup => ("regroup", Outcome::Regroup { step }),
        };
        if self.ctx.rank == 0 {
            say(format_args!("{what} at step {step} (checkpoint committed)"));
        }
        Ok(outcome)
    }

    /// Ends the generation at its last step, once its save has committed.
    fn finish(mut self, first_step: u64, loss: f64) -> Result<Outcome, TrainError> {
        if let Some(step) = self.saves.final_commit(true)?
            && self.ctx.rank == 0
        {
            say(format_args!("committed step {step}"));
        }
        self.stats.elapsed += self.started.elapsed();
        // Every rank: what its checkpointing held at most (a harness checks it
        // against the budget).
        let held = self.saves.host_bytes_held();
        say(format_args!(
            "final host_bytes_held {} (rank {})",
            held_json(&held),
            self.ctx.rank
        ));
        if fixed::clamped() > 0 {
            tracing::warn!(
                clamped = fixed::clamped(),
                "gradient elements were clamped to ±65536 (diverging?)"
            );
        }
        // A generation that started at its last step trained nothing: its loss is
        // the last one recorded.
        let loss = match self.st.losses.last() {
            Some(last) if self.st.step == first_step => *last,
            _ => loss,
        };
        Ok(Outcome::Finished {
            step: self.st.step,
            loss,
        })
    }
}

/// Time since `clock`, which moves to now.
fn lap(clock: &mut Instant) -> Duration {
    let now = Instant::now();
    let d = now - *clock;
    *clock = now;
    d
}
