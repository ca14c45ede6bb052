//! The coordinator: a TCP server that forms generations and tells members what to do.
//!
//! The coordinator owns one thread, which runs a single-threaded tokio runtime: a
//! task accepts connections, a task ticks the clock (the timeouts), and each
//! connection has a reader task (parses lines, applies them to the shared state) and
//! a writer task (drains a bounded outbox, so that a member that stops reading can
//! never block the coordinator: when its outbox is full, or a write to it takes too
//! long, it is disconnected). Connections cost no threads, so one coordinator serves
//! tens of thousands of them, up to [`CoordinatorConfig::max_connections`]. All
//! decisions are made by one `Core` under one mutex, from messages and the clock only,
//! which keeps the rules in one place and testable without sockets.
//!
//! The coordinator keeps nothing that matters across its own restart: generation
//! numbers, the checkpoint-generation floor and the running membership are rebuilt
//! from what the members announce when they reconnect (see the module docs of
//! [`crate`]). The one exception is the job's committed snapshot record
//! ([`ControlPlane::commit_snapshot`](crate::ControlPlane::commit_snapshot)): a
//! restarted coordinator knows none until the next commit, and a generation that
//! re-forms before then reads none and restores from the store instead.
//!
//! # Files
//!
//! - this one: the public face (configuration, events, the bound coordinator and the
//!   handle of a running one) and the state the tasks and the handle share;
//! - `server.rs`: the runtime's tasks and the sockets, which decide nothing;
//! - `core.rs`: the state every decision reads and its three entry points (a
//!   message, a tick of the explicit clock, a connection gone);
//! - the decisions, one `impl Core` per step of a generation's life: `hello.rs` (who
//!   is let in, and what the generation it claims gets it), `formation.rs` (asks to
//!   join and the forming of the next generation), `running.rs` (heartbeats, reports,
//!   keys and snapshot commits while it trains), `ending.rs` (how a generation ends, and the job);
//! - `adopt.rs`: the part of the decisions that only a restarted coordinator takes
//!   (adopting the generation its reconnecting members claim), kept apart because it
//!   reads as one story of its own;
//! - `tests.rs`: the core's rules with an explicit clock and no sockets.

mod adopt;
mod core;
mod ending;
mod formation;
mod hello;
mod running;
mod server;
#[cfg(test)]
mod tests;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::Notify;

use self::core::Core;
use self::server::{raise_file_limit, serve, widen_backlog};
use super::policy::Policy;
use super::timeouts::{Timeouts, validate_ranks};

/// What a coordinator decides with. Durations are wall-clock on the coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// The job id members must announce.
    pub job: String,
    /// Fewest members a generation may have.
    pub min_ranks: usize,
    /// Most members a generation may have; more wait.
    pub max_ranks: usize,
    /// The formation and failure windows ([`Timeouts::DEFAULT`] unless set).
    pub timeouts: Timeouts,
    /// How long a freshly started coordinator waits for the members of a running
    /// generation to reconnect and announce it before forming a new one (by default
    /// the heartbeat timeout: a member that cannot come back by then would be
    /// declared lost anyway). A launcher that starts a new job with its own
    /// coordinator sets zero: there is no running generation to adopt.
    pub settle: Duration,
    /// Connections served at once (members of every node, waiting ones included,
    /// and connections that have not said hello yet); one more is refused with a
    /// fatal error line. A connection costs a socket and a few KiB, no thread.
    /// [`CoordinatorConfig::DEFAULT_MAX_CONNECTIONS`] unless set; at least
    /// `max_ranks`. The coordinator raises the process's soft limit on open files
    /// toward the hard limit when it is below this (and logs a warning when the
    /// hard limit is lower still).
    pub max_connections: usize,
}

impl CoordinatorConfig {
    /// The default [`CoordinatorConfig::max_connections`]: four times 16,384, the
    /// most ranks a job is planned with, each on a connection of its own.
    pub const DEFAULT_MAX_CONNECTIONS: usize = 65_536;

    /// A configuration for `job` with the default timeouts.
    pub fn new(job: impl Into<String>, min_ranks: usize, max_ranks: usize) -> Self {
        CoordinatorConfig {
            job: job.into(),
            min_ranks,
            max_ranks,
            timeouts: Timeouts::DEFAULT,
            settle: Timeouts::DEFAULT.heartbeat_timeout,
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
        }
    }

    /// Checks that the settings make sense together; the error names the values.
    pub fn validate(&self) -> Result<(), String> {
        if self.job.is_empty() {
            return Err("job id is empty".into());
        }
        validate_ranks(self.min_ranks, self.max_ranks)?;
        if self.max_connections < self.max_ranks {
            return Err(format!(
                "max_connections ({}) is below max_ranks ({}): a full generation could not connect",
                self.max_connections, self.max_ranks
            ));
        }
        self.timeouts.validate()
    }

    /// The formation policy these settings give.
    pub fn policy(&self) -> Policy {
        Policy {
            min_ranks: self.min_ranks,
            max_ranks: self.max_ranks,
            timeouts: self.timeouts,
        }
    }
}

/// A change of generation, for a launcher's recovery summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A generation formed (or was adopted after a coordinator restart).
    Formed {
        /// Its number.
        generation: u64,
        /// Member ids in rank order (a node's launcher is one member).
        members: Vec<String>,
        /// Ranks: the sum of the ranks its members hold.
        world_size: usize,
        /// Why it formed.
        cause: String,
        /// True when adopted from reconnecting members rather than formed anew.
        adopted: bool,
        /// When.
        at: SystemTime,
    },
    /// A member of the running generation left it on purpose ([`Report::Leaving`]:
    /// preempted after its final save, or finished): it is no longer a member, and the
    /// others were not aborted.
    ///
    /// [`Report::Leaving`]: crate::Report::Leaving
    Left {
        /// The generation it left.
        generation: u64,
        /// Its id.
        member: String,
        /// Why, as the next generation's cause will say it.
        cause: String,
        /// When.
        at: SystemTime,
    },
    /// A generation ended (Restart sent to its remaining members).
    Ended {
        /// Its number.
        generation: u64,
        /// Why.
        cause: String,
        /// When.
        at: SystemTime,
    },
    /// The job was shut down.
    Shutdown {
        /// Why.
        reason: String,
        /// When.
        at: SystemTime,
    },
}

/// Why a job is over, as its control plane knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobOver {
    /// A member trained to the last step: the job succeeded, whatever it recovered
    /// from on the way.
    Finished(String),
    /// The job was shut down without finishing (too few members for too long).
    ShutDown(String),
}

impl JobOver {
    /// True when the job trained to its last step.
    pub fn finished(&self) -> bool {
        matches!(self, JobOver::Finished(_))
    }
}

impl std::fmt::Display for JobOver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobOver::Finished(reason) => f.write_str(reason),
            JobOver::ShutDown(reason) => write!(f, "job shut down: {reason}"),
        }
    }
}

/// A bound coordinator, not yet serving.
pub struct Coordinator {
    listener: TcpListener,
    config: CoordinatorConfig,
    secret: Option<ckpt_auth::JobSecret>,
}

/// Job-secret handshakes the coordinator runs at once: room for every node of a
/// large job reconnecting together (a handshake is two messages and two HMACs),
/// while a flood of silent connections holds at most this many descriptors.
const MAX_HANDSHAKES: usize = 4096;

impl Coordinator {
    /// Validates `config` and binds `addr` (port 0 picks a free port).
    pub fn bind(addr: SocketAddr, config: CoordinatorConfig) -> io::Result<Coordinator> {
        config
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let listener = TcpListener::bind(addr)?;
        widen_backlog(&listener, config.max_connections);
        Ok(Coordinator {
            listener,
            config,
            secret: None,
        })
    }

    /// Admits only connections that prove `secret` (the job's; see `ckpt_auth`).
    pub fn with_secret(mut self, secret: Option<ckpt_auth::JobSecret>) -> Coordinator {
        self.secret = secret;
        self
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves on a background thread (one, however many connections). Dropping the
    /// handle stops the coordinator.
    pub fn spawn(self) -> CoordinatorHandle {
        let addr = self.local_addr();
        raise_file_limit(self.config.max_connections);
        let shared = Arc::new(Shared {
            core: Mutex::new(Core::new(self.config, Instant::now())),
            events_changed: Condvar::new(),
            stop: Notify::new(),
            stopping: AtomicBool::new(false),
            gate: ckpt_auth::Gatekeeper::with_limit("coordinator", self.secret, MAX_HANDSHAKES),
        });
        let started = start_runtime(&shared, self.listener);
        let (threads, spawn_error) = match started {
            Ok(thread) => (vec![thread], None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let handle = CoordinatorHandle {
            shared,
            addr,
            threads,
            spawn_error,
        };
        if handle.spawn_error.is_some() {
            handle.stop();
        }
        handle
    }

    /// Serves on this thread until stopped (the `ckpt coordinator` command).
    pub fn run(self) -> io::Result<()> {
        self.spawn().join()
    }
}

/// A running coordinator.
pub struct CoordinatorHandle {
    shared: Arc<Shared>,
    addr: SocketAddr,
    threads: Vec<JoinHandle<()>>,
    spawn_error: Option<io::Error>,
}

impl CoordinatorHandle {
    /// Connections refused for lacking the job's secret (or for arriving while too
    /// many handshakes were in progress).
    pub fn refused_connections(&self) -> u64 {
        self.shared.gate.refused()
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving: closes the listener and every connection (members see what
    /// they would see if the coordinator process died). Idempotent; returns at once,
    /// [`CoordinatorHandle::join`] waits for the sockets to be closed.
    pub fn stop(&self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // The accept task ends on this (a permit waits for it if it is busy), and
        // the runtime with it: dropping the runtime drops every connection's tasks,
        // which closes their sockets.
        self.shared.stop.notify_one();
        self.shared.events_changed.notify_all();
    }

    /// Waits for the coordinator's thread to end (after [`CoordinatorHandle::stop`],
    /// or never).
    pub fn join(mut self) -> io::Result<()> {
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        match self.spawn_error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The newest generation number known.
    pub fn generation(&self) -> u64 {
        self.shared.lock().newest
    }

    /// Members waiting for a generation (new members while one runs, members
    /// beyond `max_ranks`, survivors between generations).
    pub fn waiting(&self) -> usize {
        self.shared.lock().waiting()
    }

    /// Why the job is over, once it is: it trained to its last step, or it was shut
    /// down (too few members for too long, a fatal report). `None` while it may
    /// still train.
    pub fn job_over(&self) -> Option<JobOver> {
        let core = self.shared.lock();
        core.finished
            .clone()
            .map(JobOver::Finished)
            .or_else(|| core.shutdown.clone().map(JobOver::ShutDown))
    }

    /// Members connected now (training, waiting or between generations), from every
    /// node.
    pub fn members(&self) -> usize {
        self.shared
            .lock()
            .conns
            .values()
            .filter(|c| c.member.is_some())
            .count()
    }

    /// Every event so far (the newest 4096), oldest first.
    pub fn events(&self) -> Vec<Event> {
        self.shared.lock().events.clone()
    }

    /// Blocks until an event (past or future) satisfies `predicate`, or `timeout`
    /// passes.
    pub fn wait_for_event(
        &self,
        timeout: Duration,
        mut predicate: impl FnMut(&Event) -> bool,
    ) -> Option<Event> {
        let deadline = Instant::now() + timeout;
        let mut core = self.shared.lock();
        loop {
            if let Some(event) = core.events.iter().find(|e| predicate(e)) {
                return Some(event.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.shared.stopping.load(Ordering::SeqCst) {
                return None;
            }
            core = self
                .shared
                .events_changed
                .wait_timeout(core, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for CoordinatorHandle {
    fn drop(&mut self) {
        self.stop();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// What the runtime's tasks and the handle share.
struct Shared {
    core: Mutex<Core>,
    events_changed: Condvar,
    /// Wakes the accept task when the coordinator stops.
    stop: Notify,
    stopping: AtomicBool,
    /// Who is admitted (with a job secret: who proves it).
    gate: Arc<ckpt_auth::Gatekeeper>,
}

/// Starts the coordinator's thread: a single-threaded tokio runtime serving
/// `listener` until [`CoordinatorHandle::stop`].
fn start_runtime(shared: &Arc<Shared>, listener: TcpListener) -> io::Result<JoinHandle<()>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    listener.set_nonblocking(true)?;
    let listener = {
        let _entered = runtime.enter();
        tokio::net::TcpListener::from_std(listener)?
    };
    let shared = shared.clone();
    std::thread::Builder::new()
        .name("ckpt-coordinator".into())
        .spawn(move || {
            runtime.block_on(serve(shared, listener));
            // Dropping the runtime here drops the connections' tasks and sockets.
            drop(runtime);
        })
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Core> {
        // Core's methods leave it consistent between statements that can panic (none
        // should); keep serving rather than poison every connection.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the core and wakes event waiters if it logged events.
    fn with_core<T>(&self, f: impl FnOnce(&mut Core) -> T) -> T {
        let mut core = self.lock();
        let before = core.event_count;
        let result = f(&mut core);
        let changed = core.event_count != before;
        drop(core);
        if changed {
            self.events_changed.notify_all();
        }
        result
    }
}
