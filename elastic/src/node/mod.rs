//! A node's agent towards the control plane: the launcher of a node joins the
//! control plane as one member holding its node's ranks, and serves those ranks
//! itself.
//!
//! # Why
//!
//! When every rank is a member of the control plane in its own right, the control
//! plane's load grows with ranks: a connection, a heartbeat every half second and a
//! place in every generation record per rank. At 16,384 ranks that is 32,000
//! heartbeats a second. Eight ranks of a node fail together when the node fails, and
//! their own launcher sees a rank crash or hang first: so the node is the unit the
//! control plane tracks (its one heartbeat, its one connection or lease), and the
//! launcher watches its ranks locally. This is what torchelastic's per-node agent
//! does too.
//!
//! # How
//!
//! The node agent listens on the node's address and speaks the coordinator's own
//! protocol ([`crate::protocol`]) to its ranks, so a rank cannot tell whether it
//! talks to a coordinator or to its node: the same [`crate::TcpControlPlane`] and
//! [`crate::Agent`] run in both cases, and a rank started without a launcher is a
//! single-rank node of its own. Upstream it is one member holding as many ranks as
//! the node has live ranks ([`crate::ControlPlane::hold`]):
//!
//! - Rendezvous: when its ranks ask for a generation, the node asks once for all of
//!   them (when every live rank asks, when the last call passes, or at once after a
//!   generation ended: the others follow their Restart), and hands its block of
//!   ranks to its ranks in order of their ids.
//! - Failures of a rank are the node's to see: a closed connection, no heartbeat for
//!   the heartbeat timeout, a training thread idle past the progress timeout outside
//!   a collective, a rank that does not come back to the rendezvous within the join
//!   timeout. The node reports [`Report::RankLost`] naming the rank (so the cause
//!   reads as it did when the rank was a member itself), tells the rank it is stale,
//!   and comes back holding the ranks it has left. A node's own loss (its launcher
//!   killed, its machine gone) is the control plane's to see.
//! - Directives (Restart, Regroup, Stale, Shutdown) and the generation's keys are
//!   passed on to the ranks of the generation; reports are passed up (a rank's fatal
//!   error or departure as the node's [`Report::RankLost`] or [`Report::RankLeft`]).
//! - A rank's commit or read of the job's snapshot record
//!   ([`crate::ControlPlane::commit_snapshot`]) is passed up and its answer back. A
//!   commit passes only from a rank the node seats in the running generation it
//!   names: a rank the node already counts as lost commits nothing, even before
//!   the control plane hears of the loss.
//! - A rank that starts again while its node trains waits like a new member: the node
//!   holds one more rank, the control plane counts it as waiting, and the world grows
//!   at the next checkpoint.
//!
//! # Files
//!
//! - this one: the public face (the configuration, the agent, a rank attached in
//!   process) and the threads it starts and stops;
//! - `state.rs`: what the node knows of its ranks and of its generation, under one
//!   lock shared by its threads;
//! - `sockets.rs`: the listener and each rank's connection, which carry lines and
//!   decide nothing;
//! - `ranks.rs`: what the node does with what a rank says (hello, its ask for a
//!   generation, its reports, its snapshot requests) and with a rank that goes;
//! - `rendezvous.rs`: when the node asks the control plane for a generation, for how
//!   many ranks, and how it hands its block of ranks to its ranks;
//! - `upkeep.rs`: the node's heartbeat, its own checks of its ranks, and its
//!   patience with a control plane out of reach;
//! - `relay.rs`: the control plane's directives and keys, passed on to the ranks
//!   they concern;
//! - `tests.rs`: the node's rules driven directly, with an upstream that never
//!   answers.
//!
//! [`Report::RankLost`]: crate::Report::RankLost
//! [`Report::RankLeft`]: crate::Report::RankLeft

mod ranks;
mod relay;
mod rendezvous;
mod sockets;
mod state;
#[cfg(test)]
mod tests;
mod upkeep;

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::SyncSender;
use std::thread::JoinHandle;
use std::time::Duration;

use self::relay::kv_loop;
use self::rendezvous::rendezvous_loop;
use self::sockets::accept_loop;
use self::state::{LocalId, Outbox, Shared};
use self::upkeep::upkeep_loop;
use crate::protocol::ClientMessage;
use crate::timeouts::{DEFAULT_HEARTBEAT_INTERVAL, Timeouts};
use crate::{Assignment, ControlPlane};

/// Pause after an error talking to the control plane.
const TICK: Duration = Duration::from_millis(50);
/// Longest wait of the node's threads when nothing happens (they are woken by
/// every change): a node of a large job must not cost wake-ups while idle.
const IDLE: Duration = Duration::from_secs(1);
/// How long the control plane may fail every call (it cannot be reached) before
/// the node gives up and shuts its ranks down, as a rank connected to the control
/// plane itself would: a node that retried for ever would leave its ranks waiting
/// for a job whose coordinator is gone.
const UNREACHABLE_GIVE_UP: Duration = Duration::from_secs(60);

/// How a node agent serves its ranks.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The job its ranks must announce.
    pub job: String,
    /// The windows it judges its ranks with: heartbeat, progress and join timeouts
    /// (those of the job).
    pub timeouts: Timeouts,
    /// Once one of its ranks asks for the first generation, how long the node waits
    /// for the ranks it expects ([`NodeAgent::expect`]) before it asks for fewer.
    pub last_call: Duration,
    /// Time between the node's heartbeats upstream.
    pub heartbeat_interval: Duration,
    /// The job's secret, which every rank connection must prove (`None`: any
    /// process that reaches the listener is served).
    pub secret: Option<ckpt_auth::JobSecret>,
    /// How long a node that has not joined a generation yet lets the control plane
    /// stay out of reach before it gives up (at most `UNREACHABLE_GIVE_UP`, 60 s): the
    /// launcher's connect timeout. With no training to protect, a coordinator that
    /// went away before the node joined (its job finished meanwhile) is one the
    /// node could not connect to.
    pub give_up_before_joining: Duration,
}

impl NodeConfig {
    /// Defaults for `job`: the default windows, a last call of 30 s (a Python rank
    /// takes seconds to import torch).
    pub fn new(job: impl Into<String>) -> NodeConfig {
        NodeConfig {
            job: job.into(),
            timeouts: Timeouts::DEFAULT,
            last_call: Duration::from_secs(30),
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            secret: None,
            give_up_before_joining: UNREACHABLE_GIVE_UP,
        }
    }
}

/// A node's agent: serves the node's ranks on a local listener and stands for them
/// as one member of the control plane. Dropping it closes every connection (the
/// control plane sees the node lost, unless its ranks left first).
pub struct NodeAgent {
    shared: Arc<Shared>,
    addr: SocketAddr,
    threads: Vec<JoinHandle<()>>,
}

impl NodeAgent {
    /// Connections refused for lacking the job's secret.
    pub fn refused_connections(&self) -> u64 {
        self.shared.gate.refused()
    }

    /// Serves the node's ranks on `listen` (port 0: any), standing for them through
    /// `upstream`, a control plane connected as this node's member.
    pub fn start(
        upstream: Arc<dyn ControlPlane>,
        listen: SocketAddr,
        config: NodeConfig,
    ) -> io::Result<NodeAgent> {
        config
            .timeouts
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(config, upstream));
        let mut threads = Vec::new();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name.into()).spawn(f)
        };
        {
            let shared = shared.clone();
            threads.push(spawn(
                "ckpt-node-accept",
                Box::new(move || accept_loop(&shared, &listener)),
            )?);
        }
        {
            let shared = shared.clone();
            threads.push(spawn(
                "ckpt-node-rendezvous",
                Box::new(move || rendezvous_loop(&shared)),
            )?);
        }
        {
            let shared = shared.clone();
            threads.push(spawn(
                "ckpt-node-upkeep",
                Box::new(move || upkeep_loop(&shared)),
            )?);
        }
        {
            let shared = shared.clone();
            threads.push(spawn("ckpt-node-kv", Box::new(move || kv_loop(&shared)))?);
        }
        Ok(NodeAgent {
            shared,
            addr,
            threads,
        })
    }

    /// Where the node's ranks connect (their `CKPT_RDZV`).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The launcher runs `ranks` ranks now: the first rendezvous waits for them (up
    /// to the last call).
    pub fn expect(&self, ranks: usize) {
        self.shared.lock().expected = ranks;
        self.shared.changed.notify_all();
    }

    /// The node's current generation and its block of ranks, if it has one.
    pub fn assignment(&self) -> Option<Assignment> {
        let state = self.shared.lock();
        state.running().map(|g| g.assignment.clone())
    }

    /// Why the job was shut down, once it was.
    pub fn shutdown_reason(&self) -> Option<String> {
        self.shared.lock().shutdown.clone()
    }

    /// Serves a rank that lives in this process instead of behind a socket: how a
    /// scale test simulates thousands of ranks with the node's real code. The
    /// lines for it go to `queue`, tagged `tag`. `None` when the node serves too
    /// many ranks already.
    pub fn attach(&self, tag: usize, queue: SyncSender<(usize, Arc<str>)>) -> Option<AttachedRank> {
        let c = self.shared.register(Outbox::Attached { tag, queue })?;
        Some(AttachedRank {
            shared: self.shared.clone(),
            c,
        })
    }

    /// Stops the node's heartbeats and its handling of directives, as if its
    /// process were stopped (a scale test's node that goes silent rather than
    /// closing its connections). Not undone. For fault and scale tests: a real node
    /// goes silent only when its process or its network does.
    pub fn go_silent(&self) {
        self.shared.silent.store(true, Ordering::SeqCst);
    }
}

/// A rank served in the node agent's process ([`NodeAgent::attach`]). Dropping it
/// is its connection closing.
pub struct AttachedRank {
    shared: Arc<Shared>,
    c: LocalId,
}

impl AttachedRank {
    /// Handles `message` as if the rank had sent it over its connection; Err when
    /// the node closes the connection (with why).
    pub fn send(&self, message: ClientMessage) -> Result<(), String> {
        self.shared.handle(self.c, message).map(|_| ())
    }
}

impl Drop for AttachedRank {
    fn drop(&mut self) {
        self.shared.remove(self.c, "connection closed");
    }
}

impl NodeAgent {
    /// Starts stopping: the node's threads end within a heartbeat interval, and
    /// dropping it waits for them. Stopping many nodes first and dropping them after
    /// lets them wind down together.
    pub fn stop(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.stop();
        {
            let state = self.shared.lock();
            for local in state.locals.values() {
                local.close();
            }
            if let Some((_, _, cancel)) = &state.asking {
                cancel.cancel();
            }
        }
        self.shared.changed.notify_all();
        // The accept loop wakes on a connection.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
