//! One rank of an elastic job: an agent of ckpt's control plane drives a loop of
//! generations in this same process.
//!
//! Each turn of the loop: rendezvous (the control plane fixes this rank, the world
//! size and the generation), build a TCP ring for that world from the addresses the
//! ranks publish in the generation's key-value space, run
//! [`run_supervised`](crate::train::run_supervised()) (which resumes from the newest
//! committed checkpoint, resharded for the new world), and see how it ended:
//!
//! - finished, or stopped by a signal after its final save: leave and exit;
//! - a regroup (members wait to join) or a stop that another node asked for: the
//!   checkpoint just committed, go round again;
//! - a failure: the agent's abort hook has already aborted the ring if the control
//!   plane saw the failure first; otherwise this rank saw it first (a peer's socket
//!   closed) and reports it; either way, go round again and resume;
//! - this member is stale (it was dropped while stopped or partitioned) or the job
//!   shuts down: exit without writing anything more.
//!
//! Nothing here knows about the coordinator's transport: the agent speaks to any
//! [`ControlPlane`](ckpt_elastic::ControlPlane).

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ckpt::copies::{Copies, CopyConfig};
use ckpt::storage::Store;
use ckpt_elastic::{Agent, Assignment, Cancel, Directive, ElasticError, Report};

use crate::collective::{Collective, TcpCollective, TcpConfig};
use crate::train::{
    Checkpointing, Outcome, Stats, Supervisor, TrainConfig, TrainError, run_supervised,
};

/// How long a rank that failed waits for the control plane to handle its report
/// before it closes its collectives anyway.
const FATAL_REPORT_WAIT: Duration = Duration::from_secs(2);

/// How an elastic rank ended.
#[derive(Debug)]
pub enum Exit {
    /// Training reached its last step (in some generation).
    Finished {
        /// Steps completed.
        step: u64,
        /// Loss of the last step.
        loss: f64,
    },
    /// A signal stopped this rank after a committed final save.
    Stopped {
        /// The step saved.
        step: u64,
    },
    /// The job trained to its last step without this member (which was still
    /// waiting to join when the others committed it): nothing is left to do.
    Over {
        /// The job's final step, committed.
        step: u64,
        /// What the control plane said.
        reason: String,
    },
    /// The control plane dropped this member (stale) or shut the job down.
    Left(String),
    /// An error that recovery cannot fix (bad settings, a checkpoint error).
    Failed(String),
}

/// Milliseconds since the Unix epoch: recovery timings are compared across processes.
pub fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// The supervisor of one generation, over the agent.
struct AgentSupervisor<'a> {
    agent: &'a Agent,
    cancel: Cancel,
    /// Nesting depth of waits on others (a load runs collectives).
    waiting: std::sync::atomic::AtomicUsize,
    first_progress: Mutex<Option<(u64, Instant)>>,
    first_step: Mutex<Option<Instant>>,
}

impl Supervisor for AgentSupervisor<'_> {
    fn progress(&self, step: u64) {
        self.agent.progress(step);
        let mut first = self
            .first_progress
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match *first {
            None => *first = Some((step, Instant::now())),
            Some((start, _)) if step > start => {
                let mut stepped = self.first_step.lock().unwrap_or_else(|p| p.into_inner());
                stepped.get_or_insert_with(Instant::now);
            }
            Some(_) => {}
        }
    }
    fn waiting(&self, active: bool) {
        if active {
            if self.waiting.fetch_add(1, Ordering::SeqCst) == 0 {
                self.agent.collective_started();
            }
        } else if self.waiting.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.agent.collective_done();
        }
    }
    fn regroup_requested(&self) -> bool {
        self.agent.regroup_requested()
    }
    fn cancelled(&self) -> Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(self.cancel.cancelled())
    }
    fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }
    fn committed(&self, step: u64) {
        if let Err(e) = self.agent.report(Report::Committed { step }) {
            tracing::warn!(step, error = %e, "could not report a commit to the control plane");
        }
    }
    fn checkpoint_generation(&self, generation: u64) {
        self.agent.set_checkpoint_generation(generation);
    }
    fn commit_snapshot(&self, record: &str) -> Result<bool, String> {
        self.agent
            .commit_snapshot(record)
            .map(|()| true)
            .map_err(|e| e.to_string())
    }
    fn committed_snapshot(&self) -> Result<Option<String>, String> {
        self.agent.committed_snapshot().map_err(|e| e.to_string())
    }
}

fn say(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_fmt(line);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

/// Builds this generation's ring: bind a listener where the peers can reach it,
/// publish it, learn the successor's, connect. Cancelled with the generation.
fn bootstrap(
    agent: &Agent,
    assignment: &Assignment,
    ip: IpAddr,
    tcp: &TcpConfig,
    cancel: &Cancel,
) -> Result<TcpCollective, String> {
    let (rank, world) = (assignment.rank, assignment.world_size);
    let listener =
        TcpListener::bind((ip, 0)).map_err(|e| format!("binding a ring listener on {ip}: {e}"))?;
    let me = listener
        .local_addr()
        .map_err(|e| format!("ring listener address: {e}"))?;
    agent
        .kv_set(&format!("ring/{rank}"), &me.to_string())
        .map_err(|e| format!("publishing the ring address: {e}"))?;
    let next_rank = (rank + 1) % world;
    let next = agent
        .kv_get(&format!("ring/{next_rank}"), tcp.connect_timeout)
        .map_err(|e| format!("learning rank {next_rank}'s ring address: {e}"))?;
    let next: SocketAddr = next
        .parse()
        .map_err(|e| format!("rank {next_rank} published a bad address {next:?}: {e}"))?;
    TcpCollective::from_peers(
        rank,
        world,
        assignment.generation,
        listener,
        next,
        tcp.clone(),
        &|| cancel.is_cancelled(),
    )
    .map_err(|e| e.to_string())
}

/// True when the store's newest healthy checkpoint is the job's final step: whatever
/// the control plane said, the job is done (the store is the record of what was
/// trained). A final commit judged unhealthy does not end the job: the next
/// generation resumes from the newest healthy one and trains the steps again.
pub fn final_step_committed(
    runtime: &tokio::runtime::Handle,
    store: Option<&Store>,
    steps: u64,
) -> bool {
    let Some(store) = store else {
        return false;
    };
    matches!(
        runtime.block_on(ckpt::catalog::latest_selecting(store, ckpt::catalog::Select::Healthy)),
        Ok(Some((manifest, _))) if manifest.step == steps
    )
}

/// What happened to the previous generation, for the recovery line.
struct Previous {
    /// When the failure reached this rank (the directive, or its own collective
    /// error), Unix ms.
    noticed_ms: u128,
    /// When the generation's work had stopped (aborted), Unix ms.
    aborted_ms: u128,
}

/// Runs this rank's generations until the job ends for it. `job` names the job's
/// run ids; `ip` is where its ring listener binds; `stop` is the signal flag.
#[allow(clippy::too_many_arguments)]
pub fn run(
    agent: &Agent,
    job: &str,
    runtime: &tokio::runtime::Handle,
    store: Option<&Store>,
    config: &TrainConfig,
    tcp: &TcpConfig,
    ip: IpAddr,
    stop: &AtomicBool,
) -> Exit {
    let mut checkpointing = Checkpointing::default();
    if (config.memory_copies || config.snapshot_every > 0) && store.is_some() {
        // The job's secret guards the copy servers as it does the ring. The holder
        // outlives every generation's checkpointer: it owns the rank's budget, and
        // each checkpointer counts in it (`Checkpointer::with_budget`).
        let copy_config = CopyConfig {
            secret: tcp.secret.clone(),
            budget: Some(ckpt::HostBudget::new(config.host_memory_budget)),
            ..CopyConfig::default()
        };
        match Copies::serve(ip, copy_config) {
            Ok(copies) => checkpointing.copies = Some(Arc::new(copies)),
            Err(e) => {
                tracing::warn!(%ip, error = %e, "no in-memory copies (recoveries read the store)")
            }
        }
    }
    let mut first = true;
    let mut previous: Option<Previous> = None;
    loop {
        let rendezvous_started = Instant::now();
        let assignment = match agent.rendezvous() {
            Ok(a) => a,
            Err(ElasticError::Shutdown(reason))
                if final_step_committed(runtime, store, config.steps) =>
            {
                return Exit::Over {
                    step: config.steps,
                    reason,
                };
            }
            Err(e) => return Exit::Left(format!("rendezvous: {e}")),
        };
        let rendezvous = rendezvous_started.elapsed();
        // The store is the record of what was trained: a generation formed after the
        // final step was committed (by a control plane that restarted and forgot the
        // job had finished) has nothing to train, and must not start over.
        if final_step_committed(runtime, store, config.steps) {
            let step = config.steps;
            let _ = agent.report(Report::Finished { step });
            let _ = agent.report(Report::Leaving {
                reason: format!("the job had already finished at step {step}"),
            });
            return Exit::Over {
                step,
                reason: format!(
                    "generation {} formed after the final commit",
                    assignment.generation
                ),
            };
        }
        let (rank, world, generation) = (
            assignment.rank,
            assignment.world_size,
            assignment.generation,
        );
        tracing::info!(
            generation,
            rank,
            world,
            cause = %assignment.cause,
            rendezvous_ms = rendezvous.as_millis() as u64,
            "generation formed"
        );
        if rank == 0 {
            say(format_args!(
                "generation {generation}: world {world} ({}), rendezvous {} ms",
                assignment.cause,
                rendezvous.as_millis()
            ));
        }
        if let Some(step) = checkpointing.settle(runtime, Duration::from_secs(2)) {
            tracing::info!(step, "the previous generation's save was left to finish");
        }
        let cancel = agent.cancel();
        let noticed = Arc::new(Mutex::new(None::<u128>));
        let bootstrap_started = Instant::now();
        let comm = match bootstrap(agent, &assignment, ip, tcp, &cancel) {
            Ok(c) => Arc::new(c),
            Err(e) => {
                if !cancel.is_cancelled() {
                    tracing::warn!(generation, rank, error = %e, "ring bootstrap failed");
                    let _ = agent.report(Report::CollectiveFailed {
                        peer: None,
                        reason: format!("bootstrap: {e}"),
                    });
                }
                if let Some(exit) = left(agent) {
                    return exit;
                }
                let now = unix_ms();
                previous = Some(Previous {
                    noticed_ms: now,
                    aborted_ms: now,
                });
                continue;
            }
        };
        let bootstrap_time = bootstrap_started.elapsed();
        {
            let comm = Arc::clone(&comm);
            let noticed = Arc::clone(&noticed);
            agent.set_abort_hook(Box::new(move || {
                noticed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert_with(unix_ms);
                comm.abort();
            }));
        }
        let supervisor = AgentSupervisor {
            agent,
            cancel: cancel.clone(),
            waiting: std::sync::atomic::AtomicUsize::new(0),
            first_progress: Mutex::new(None),
            first_step: Mutex::new(None),
        };
        let mut generation_config = config.clone();
        generation_config.generation = config
            .generation
            .max(assignment.checkpoint_generation_floor);
        generation_config.resume = config.resume || !first;
        if generation != 1 {
            // A test's fault happens once, in the job's first generation (not again in
            // a relaunched process, nor after the resume that recovered from it).
            generation_config.hold = None;
            generation_config.device_error = None;
            generation_config.rot_copy = None;
            generation_config.save_stage = None;
            generation_config.sdc = None;
            generation_config.snapshot_vote_against = None;
            generation_config.nan = config.nan.filter(|f| f.persistent);
        }
        generation_config.run_id = Some(run_id(job, generation));
        first = false;
        let started = Instant::now();
        let mut stats = Stats::default();
        let watcher = RecoveryLine {
            previous: previous.take(),
            generation,
            world,
            cause: assignment.cause.clone(),
            rendezvous,
            bootstrap: bootstrap_time,
            started,
        };
        let done = AtomicBool::new(false);
        let outcome = std::thread::scope(|scope| {
            // Rank 0 prints the recovery line once the first step of this
            // generation completes (or the generation ends first).
            if rank == 0 && watcher.previous.is_some() {
                scope.spawn(|| watcher.report_when_stepped(&supervisor, &done));
            }
            let out = run_supervised(
                comm.as_ref(),
                runtime,
                store,
                &generation_config,
                stop,
                &mut stats,
                &supervisor,
                &mut checkpointing,
            );
            done.store(true, Ordering::SeqCst);
            out
        });
        match outcome {
            Ok(Outcome::Finished { step, loss }) => {
                // Members still waiting to join need not wait out the rendezvous
                // timeout: the job is done.
                let _ = agent.report(Report::Finished { step });
                let _ = agent.report(Report::Leaving {
                    reason: format!("finished at step {step}"),
                });
                return Exit::Finished { step, loss };
            }
            Ok(Outcome::Stopped { step }) if stop.load(Ordering::SeqCst) => {
                let _ = agent.report(Report::Leaving {
                    reason: format!("stopped by a signal after committing step {step}"),
                });
                return Exit::Stopped { step };
            }
            Ok(Outcome::Stopped { step }) | Ok(Outcome::Regroup { step }) => {
                tracing::info!(
                    generation,
                    step,
                    "generation ended at a committed checkpoint; regrouping"
                );
                // Not a failure: the others are not to be aborted on our account.
                if let Err(e) = agent.report(Report::Ended { step }) {
                    tracing::warn!(generation, error = %e, "could not report the end of the generation");
                }
            }
            Err(e) => {
                let aborted_ms = unix_ms();
                let seen_first = !cancel.is_cancelled();
                let noticed_ms = noticed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .unwrap_or(aborted_ms);
                if let Some(exit) = left(agent) {
                    comm.abort();
                    return exit;
                }
                if stop.load(Ordering::SeqCst) {
                    // A signal asked this rank to stop: it does not rejoin.
                    comm.abort();
                    let _ = agent.report(Report::Leaving {
                        reason: format!(
                            "stopped by a signal; the final save did not complete: {e}"
                        ),
                    });
                    return Exit::Failed(format!(
                        "stopped by a signal before the final save committed: {e}"
                    ));
                }
                if seen_first {
                    match &e {
                        TrainError::Collective(c) => {
                            let _ = agent.report(Report::CollectiveFailed {
                                peer: c.peer(),
                                reason: e.to_string(),
                            });
                        }
                        TrainError::Checkpoint(c) if c.is_transient() => {
                            let _ = agent.report(Report::CollectiveFailed {
                                peer: None,
                                reason: e.to_string(),
                            });
                        }
                        TrainError::Cancelled(_) => {}
                        _ => {
                            // Report, and wait until the control plane has it, before
                            // aborting: the peers notice the abort at once and would
                            // otherwise report a collective failure first, which names
                            // no culprit.
                            let _ = agent.report_handled(
                                Report::Fatal {
                                    reason: e.to_string(),
                                },
                                FATAL_REPORT_WAIT,
                            );
                            comm.abort();
                            return Exit::Failed(e.to_string());
                        }
                    }
                }
                comm.abort();
                if rank == 0 || seen_first {
                    tracing::warn!(generation, rank, error = %e, "generation failed; rejoining");
                }
                previous = Some(Previous {
                    noticed_ms,
                    aborted_ms,
                });
            }
        }
    }
}

/// The run id of a generation's save attempts (`ckpt_elastic::env::run_id` within
/// the library's length limit).
pub fn run_id(job: &str, generation: u64) -> String {
    ckpt_elastic::env::run_id(job, generation, ckpt::RunId::MAX_LEN)
}

/// When the control plane dropped this member or ended the job, how it leaves.
fn left(agent: &Agent) -> Option<Exit> {
    match agent.directive() {
        Some(Directive::Stale { current }) => Some(Exit::Left(format!(
            "stale: this member's generation is over (the job is at generation {current}); leaving without writing anything more"
        ))),
        Some(Directive::Shutdown { reason }) => Some(Exit::Left(format!("shutdown: {reason}"))),
        _ => None,
    }
}

/// The one-line summary of a recovery that rank 0 prints.
struct RecoveryLine {
    previous: Option<Previous>,
    generation: u64,
    world: usize,
    cause: String,
    rendezvous: Duration,
    bootstrap: Duration,
    started: Instant,
}

impl RecoveryLine {
    fn report_when_stepped(&self, supervisor: &AgentSupervisor<'_>, done: &AtomicBool) {
        let Some(previous) = &self.previous else {
            return;
        };
        let first_step = loop {
            if let Some(at) = *supervisor
                .first_step
                .lock()
                .unwrap_or_else(|p| p.into_inner())
            {
                break at;
            }
            if done.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let load = supervisor
            .first_progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map_or(Duration::ZERO, |(_, at)| at - self.started);
        let now = unix_ms();
        say(format_args!(
            "recovery: generation {} world {} ({}): noticed at {} ms, aborted +{} ms, rendezvous {} ms, ring {} ms, load {} ms, first step {} ms; back to training {} ms after the failure was noticed",
            self.generation,
            self.world,
            self.cause,
            previous.noticed_ms,
            previous.aborted_ms.saturating_sub(previous.noticed_ms),
            self.rendezvous.as_millis(),
            self.bootstrap.as_millis(),
            load.as_millis(),
            (first_step - self.started).saturating_sub(load).as_millis(),
            now.saturating_sub(previous.noticed_ms),
        ));
    }
}
