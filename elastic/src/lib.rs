//! The elastic control plane: which processes form the training world, with which
//! ranks, and what each must do when the world changes.
//!
//! # Why a control plane
//!
//! A collective (NCCL, a TCP ring) cannot recover from a lost peer by itself: every
//! survivor blocks or fails, and none knows who else is alive. Something outside the
//! data path has to notice the failure, tell the survivors to abort, and hand out a
//! new, consistent world. That is this module. It moves a few small messages per
//! second, never tensors.
//!
//! # Parts
//!
//! - A [`Coordinator`] (standalone `ckpt coordinator`, or embedded in a launcher)
//!   forms *generations*: a numbered membership with ranks `0..world_size`.
//! - Each rank process links an [`Agent`] over a [`ControlPlane`] backend
//!   ([`TcpControlPlane`] to a coordinator, or `EtcdControlPlane` straight to an
//!   etcd cluster, with no coordinator process, behind the `etcd` feature). The
//!   agent's own thread heartbeats and watches for [`Directive`]s, so the training
//!   thread can be stuck in a collective and still be aborted.
//! - The [`policy`] decides, for both backends, when a generation forms, who is in
//!   it, what a report does and when a job is shut down; [`timeouts`] holds the
//!   windows it decides with, their defaults and their checks.
//!
//! # Protocol
//!
//! One TCP connection per member carries newline-delimited JSON ([`protocol`]), each
//! line at most [`protocol::MAX_LINE`] bytes. The member says `hello` (job, identity,
//! the generation it is running, if any), then asks to `rendezvous` for a generation
//! newer than the one it had, heartbeats with its [`Progress`], sends [`Report`]s,
//! sets keys, and commits or reads the job's snapshot record
//! ([`ControlPlane::commit_snapshot`]). The coordinator answers with assignments,
//! directives, key-value updates, answers to snapshot requests and errors. A generation forms (by the rules of the [`policy`], which the etcd
//! backend follows too) when:
//!
//! - no generation runs: at least `min_ranks` members wait and either `max_ranks`
//!   are there or the `last_call` window since `min_ranks` was reached has passed (so
//!   members starting together land in one generation);
//! - a generation just ended: every survivor asked for the next one, or `join_timeout`
//!   passed (who did not come is dropped and told [`Directive::Stale`]).
//!
//! Ranks follow the members sorted by `(node, id)`, so the ranks of one node are
//! contiguous. Generation numbers only grow, also across coordinator restarts (see
//! below). Members beyond `max_ranks`, and members arriving while a generation runs,
//! wait; after the next [`Report::Committed`] the coordinator sends
//! [`Directive::Regroup`], so the world grows at a checkpoint boundary and loses no
//! work.
//!
//! # Failure model
//!
//! - *Crash* (process killed, node rebooted): the connection closes and the kernel
//!   tells the coordinator at once. The member is dropped; the others get
//!   [`Directive::Restart`].
//! - *Hang or partition* (SIGSTOP, a dead link, a lost node whose sockets linger):
//!   no heartbeat for `heartbeat_timeout`. The member is dropped, the others restart,
//!   and the member is told [`Directive::Stale`] in case it wakes up: a hung member
//!   that resumes must write nothing more for its old generation.
//! - *Stuck training thread* (the process heartbeats, but its training thread is
//!   wedged): idle longer than `progress_timeout` while *not* inside a collective.
//!   A member blocked in a collective is waiting for a peer, not hung itself, so it
//!   is not blamed; the peer that is really stuck is.
//! - *Errors a rank sees itself*: [`Report::CollectiveFailed`] restarts the world
//!   without dropping anyone; [`Report::Fatal`] and [`Report::Leaving`] drop the
//!   reporting member.
//! - *Too few members*: below `min_ranks` for longer than `rendezvous_timeout`, every
//!   member gets [`Directive::Shutdown`].
//! - *Coordinator restart*: the coordinator keeps nothing that matters across a
//!   restart. Each [`TcpControlPlane`] reconnects to the same address and re-announces
//!   the generation it is running. When all members of a claimed generation come
//!   back with the same view within a settle window (`CoordinatorConfig::settle`, by
//!   default the heartbeat timeout: a member that cannot come back by then would be
//!   declared lost anyway), the new coordinator
//!   adopts it and training never stops. Otherwise it restarts the claimants into a
//!   generation numbered above every number any member announced. Until the settle
//!   window ends (or a generation is adopted) no generation forms, so a fresh member
//!   cannot slip in a generation number below a running one.
//! - *Hostile or broken input* (other jobs, garbage, oversize lines, generations from
//!   the past or the future): a clear error to that connection, a warning in the
//!   log, no effect on anyone else. Nothing a peer sends can panic the coordinator or
//!   make it hold more than one line's worth of memory per connection.
//!
//! The coordinator is a single process: if it is down, nothing fails, but nothing can
//! recover either until it is back.

pub mod agent;
mod cancel;
pub mod coordinator;
pub mod env;
pub mod etcd;
pub mod node;
pub mod policy;
// The wire format (docs/ELASTIC.md): public for the tools and tests that speak it raw
// (the control plane's scale bench simulates thousands of members with it) and for
// the peers that reuse its line reader. It changes only with the protocol version.
pub mod protocol;
#[cfg(test)]
mod scenarios;
pub mod tcp;
#[cfg(test)]
mod testing;
pub mod timeouts;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use agent::{Agent, AgentConfig};
pub use cancel::Cancel;
pub use coordinator::{Coordinator, CoordinatorConfig, CoordinatorHandle, Event, JobOver};
pub use env::{RankEnv, Rdzv};
pub use etcd::EtcdUrl;
#[cfg(feature = "etcd")]
pub use etcd::{EtcdControlPlane, EtcdJob, EtcdSettings, EtcdTls, EtcdUser};
pub use node::{NodeAgent, NodeConfig};
pub use tcp::{TcpControlPlane, TcpSettings};
pub use timeouts::Timeouts;

/// Who a member is. `job` must match the coordinator's job id (else a clear error).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Member {
    /// The job this member belongs to; the coordinator rejects other jobs.
    pub job: String,
    /// Unique within the job (e.g. `host:pid` or a launcher-given name).
    pub id: String,
    /// Address peers reach this member on (for collectives' bootstrap).
    pub host: String,
    /// The node (machine) the member runs on: ranks of one node are contiguous.
    pub node: String,
    /// How many ranks this member holds: 1 for a rank process of its own; a node's
    /// launcher joins the control plane as one member holding its node's ranks, so
    /// that the control plane's load grows with nodes, not ranks.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub ranks: usize,
}

/// Most ranks one member may hold (a node's launcher holds its node's ranks), on
/// every backend.
pub(crate) const MAX_RANKS_PER_MEMBER: usize = 1 << 16;

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl Member {
    /// A member holding one rank.
    pub fn new(
        job: impl Into<String>,
        id: impl Into<String>,
        host: impl Into<String>,
        node: impl Into<String>,
    ) -> Member {
        Member {
            job: job.into(),
            id: id.into(),
            host: host.into(),
            node: node.into(),
            ranks: 1,
        }
    }
}

/// The first rank of each of `members` (in rank order), and the world size after
/// them: a member's ranks follow those of the members before it.
pub fn first_ranks(members: &[Member]) -> (Vec<usize>, usize) {
    let mut next = 0usize;
    let firsts = members
        .iter()
        .map(|m| {
            let first = next;
            next = next.saturating_add(m.ranks);
            first
        })
        .collect();
    (firsts, next)
}

/// A fingerprint of a generation's membership: its members' ids and rank counts, in
/// rank order (64-bit FNV-1a, the same in every process and build). Members compare
/// it instead of carrying the list of every member, which at thousands of nodes
/// would make every assignment a large message.
pub fn roster_digest<'a>(members: impl IntoIterator<Item = (&'a str, usize)>) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for (id, ranks) in members {
        eat(&(id.len() as u64).to_le_bytes());
        eat(id.as_bytes());
        eat(&(ranks as u64).to_le_bytes());
    }
    hash
}

/// One generation as this member sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// Strictly increasing, also across coordinator restarts.
    pub generation: u64,
    /// This member's (first) rank: members sorted by `(node, id)` hold contiguous
    /// blocks of `0..world_size`.
    pub rank: usize,
    /// How many ranks this member holds, from `rank` on (its [`Member::ranks`]).
    #[serde(default = "one")]
    pub ranks: usize,
    /// Ranks in this generation: the sum of its members' ranks.
    pub world_size: usize,
    /// Members (rank processes, or nodes) in this generation.
    pub members: usize,
    /// [`roster_digest`] of the generation's members in rank order: two members hold
    /// the same view of a generation when their numbers and digests agree.
    pub roster: u64,
    /// Every checkpoint saved in this generation must use a checkpoint generation >=
    /// this (the max checkpoint generation any member ever reported + 1, see
    /// [`Progress`]).
    pub checkpoint_generation_floor: u64,
    /// Why it formed: "initial", "lost member X: connection closed", "grow: 1 waiting
    /// member", ...
    pub cause: String,
}

/// What the control plane asks of a member (pushed to the [`Agent`]'s thread).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Directive {
    /// The current generation (`generation`, the one that is over) is over (a member
    /// failed): abort at once and rendezvous again.
    Restart {
        /// The generation that ended.
        generation: u64,
        /// Why, naming the member when there is one.
        cause: String,
    },
    /// Members are waiting to join: finish at the next checkpoint boundary (save,
    /// commit), then rendezvous again. No abort.
    Regroup {
        /// The running generation that should regroup.
        generation: u64,
        /// Why ("grow: 1 waiting member").
        cause: String,
    },
    /// This member's generation is over and it was not kept (a hung or partitioned
    /// member that wakes up): abort, write nothing more, and leave (or rendezvous as a
    /// new member). Applies to a member whose generation is `<= current`.
    Stale {
        /// The newest generation the coordinator knows.
        current: u64,
    },
    /// The job cannot go on (fewer than min ranks for longer than the rendezvous
    /// timeout, or the job finished): abort and exit.
    Shutdown {
        /// Why.
        reason: String,
    },
}

/// Heartbeat payload. `idle` = time since the training thread last called
/// `progress()`/`collective_done()`; `in_collective` = it is blocked waiting on peers.
/// A member that is not in a collective and idle longer than the coordinator's
/// progress timeout is hung (its training thread is stuck) even though its process
/// lives.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// Last step the training thread reported.
    pub step: u64,
    /// The training thread is inside a collective (waiting on peers).
    pub in_collective: bool,
    /// Milliseconds since the training thread last showed progress.
    pub idle_ms: u64,
    /// Highest checkpoint generation this member has saved with.
    pub checkpoint_generation: u64,
}

/// What a member tells the control plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Report {
    /// The communicator failed (peer named when known): the world must re-form. The
    /// coordinator restarts the generation; members that do not rendezvous again
    /// within the join timeout are dropped.
    CollectiveFailed {
        /// The failed peer's rank, when known.
        peer: Option<usize>,
        /// What failed.
        reason: String,
    },
    /// This member cannot go on (device lost): drop it and restart the others.
    Fatal {
        /// What happened.
        reason: String,
    },
    /// Step `step` committed in this generation (sent by rank 0); if members are
    /// waiting, the coordinator answers with Regroup.
    Committed {
        /// The committed step.
        step: u64,
    },
    /// This member ended the generation at a checkpoint boundary that every member
    /// agreed on (a stop or a regroup whose save committed at `step`) and is about to
    /// rendezvous again: the generation is over without a failure, so the others
    /// are not aborted; they come to the rendezvous by themselves.
    Ended {
        /// The step committed at the boundary.
        step: u64,
    },
    /// The job trained to its last step and committed it (sent before `Leaving` by
    /// every member that finished): members still waiting to join are told
    /// [`Directive::Shutdown`] at once rather than waiting out the rendezvous timeout,
    /// and later ones too. Members of the running generation are not interrupted.
    Finished {
        /// The final step.
        step: u64,
    },
    /// Leaving on purpose (preempted after its final save, finished): not a failure.
    Leaving {
        /// Why.
        reason: String,
    },
    /// One of the ranks this member holds (a node's launcher) was lost: crashed,
    /// silent or hung, as the launcher saw it. The generation restarts; the member
    /// stays and comes back holding its remaining ranks.
    RankLost {
        /// Why, naming the rank (the words of [`policy::lost_member`]).
        cause: String,
    },
    /// One of the ranks this member holds left on purpose, at a boundary the world
    /// agreed on ([`Report::Leaving`] of a rank): not a failure; the others are not
    /// aborted.
    RankLeft {
        /// Why, naming the rank.
        cause: String,
    },
}

/// A control-plane backend (a TCP coordinator, or etcd). One value per member
/// process. Every blocking call is bounded by a timeout or a [`Cancel`]. Both backends
/// pass the same conformance suite (`elastic/tests/conformance.rs`).
pub trait ControlPlane: Send + Sync {
    /// Blocks until a generation newer than `after` includes this member (joining, or
    /// waiting as a new member while a generation runs). Err on cancel / timeout / bad
    /// job / shutdown.
    fn rendezvous(&self, after: u64, cancel: &Cancel) -> Result<Assignment, ElasticError>;
    /// Sends a heartbeat for `generation` (0: in no generation yet).
    fn heartbeat(&self, generation: u64, progress: &Progress) -> Result<(), ElasticError>;
    /// Blocks up to `timeout` for the next directive for `generation` (or a newer one).
    fn watch(&self, generation: u64, timeout: Duration) -> Result<Option<Directive>, ElasticError>;
    /// Tells the control plane something about `generation` (see [`Report`]).
    fn report(&self, generation: u64, report: &Report) -> Result<(), ElasticError>;
    /// Like [`report`](ControlPlane::report), but returns only once the control plane
    /// has handled the report (waiting up to `timeout`): a member that failed says
    /// so before it closes its collectives, and its peers' errors about the closed
    /// connections cannot reach the control plane first. Backends whose `report`
    /// returns once the report is stored (etcd) keep this default.
    fn report_handled(
        &self,
        generation: u64,
        report: &Report,
        timeout: Duration,
    ) -> Result<(), ElasticError> {
        let _ = timeout;
        self.report(generation, report)
    }
    /// How long the control plane has been out of reach, for a backend that hides
    /// an outage for a while by reconnecting (the TCP client: its calls fail only
    /// after its unreachable timeout); `None` when it is reached, or when the
    /// backend fails calls at once (etcd). A node agent counts its own patience from
    /// the outage's start, not from the first call that failed.
    fn unreachable_for(&self) -> Option<Duration> {
        None
    }
    /// Generation-scoped key-value space for bootstrapping collectives.
    fn kv_set(&self, generation: u64, key: &str, value: &str) -> Result<(), ElasticError>;
    /// From now on this member holds `ranks` ranks (see [`Member::ranks`]): a node's
    /// launcher calls it when its ranks are lost or started again. Backends that do
    /// not serve node agents refuse it.
    fn hold(&self, ranks: usize) -> Result<(), ElasticError> {
        Err(ElasticError::Rejected(format!(
            "this control plane cannot change the ranks a member holds (asked {ranks})"
        )))
    }
    /// Blocks up to `timeout` until `generation`'s key-value space holds more than
    /// `known` keys, and returns them all (empty after the timeout): how a node's
    /// launcher passes keys on to its ranks. Err when the generation is over.
    fn kv_all(
        &self,
        generation: u64,
        known: usize,
        timeout: Duration,
    ) -> Result<Vec<(String, String)>, ElasticError> {
        let _ = (generation, known, timeout);
        Err(ElasticError::Rejected(
            "this control plane cannot list a generation's keys".into(),
        ))
    }
    /// Blocks until the key exists in `generation` (Err on cancel, on timeout, or when
    /// the generation is over).
    fn kv_get(
        &self,
        generation: u64,
        key: &str,
        cancel: &Cancel,
        timeout: Duration,
    ) -> Result<String, ElasticError>;
    /// Records `record` (at most [`MAX_SNAPSHOT_RECORD`] bytes) as the job's newest
    /// committed in-memory snapshot, on behalf of `generation`.
    ///
    /// # Guarantees
    ///
    /// - *Fenced*: accepted only while `generation` is the running generation and
    ///   this member is in it; a member of an older generation gets
    ///   [`ElasticError::Rejected`] naming its generation, and the record stays as
    ///   it was. A record committed by a newer generation is never replaced.
    /// - *Job-scoped*: unlike the key-value space, the record outlives the
    ///   generation that wrote it, so that the next generation reads it back after
    ///   a failure. Each commit replaces the one before; a new job starts with none.
    /// - Returns once the control plane stored it (or refused it): `Ok` means a
    ///   [`committed_snapshot`](ControlPlane::committed_snapshot) made afterwards,
    ///   from any member, returns it or a newer one.
    ///
    /// The built-in coordinator keeps it in its memory: a restarted coordinator
    /// knows no record until the next commit (readers then fall back to the
    /// store). etcd keeps it in one key of the job.
    fn commit_snapshot(&self, generation: u64, record: &str) -> Result<(), ElasticError>;
    /// The newest record [`commit_snapshot`](ControlPlane::commit_snapshot) stored
    /// for this job, whichever generation committed it; `None` when none was.
    fn committed_snapshot(&self) -> Result<Option<String>, ElasticError>;
}

/// The longest record [`ControlPlane::commit_snapshot`] accepts (4 KiB): a
/// snapshot's step and where its copies are, not the snapshot itself.
pub const MAX_SNAPSHOT_RECORD: usize = 4 * 1024;

/// Refuses a snapshot record over [`MAX_SNAPSHOT_RECORD`], the same words on every
/// backend.
pub(crate) fn check_snapshot_record(record: &str) -> Result<(), ElasticError> {
    if record.len() > MAX_SNAPSHOT_RECORD {
        return Err(ElasticError::Rejected(format!(
            "snapshot record of {} bytes is over the {MAX_SNAPSHOT_RECORD}-byte bound; not committed",
            record.len()
        )));
    }
    Ok(())
}

/// Refuses a snapshot commit from `generation` when the running generation is
/// `running` (`None`: none runs), the same words on every backend.
pub(crate) fn snapshot_not_running(generation: u64, running: Option<u64>) -> ElasticError {
    let now = match running {
        Some(g) => format!("generation {g} is running"),
        None => "no generation is running".to_owned(),
    };
    ElasticError::Rejected(format!(
        "generation {generation} is not running ({now}); its snapshot record is not committed"
    ))
}

/// Refuses a snapshot commit from `generation` when generation `newer` already
/// committed one.
pub(crate) fn snapshot_superseded(generation: u64, newer: u64) -> ElasticError {
    ElasticError::Rejected(format!(
        "generation {generation} cannot replace the snapshot record committed by the newer generation {newer}"
    ))
}

/// A control-plane call failed. Each variant says whether trying again can help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElasticError {
    /// The call's [`Cancel`] was cancelled. Retrying with the same token cannot help.
    #[error("cancelled")]
    Cancelled,
    /// Waiting took longer than allowed; retrying may help.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The control plane refused the request: another job's id, a stale or over
    /// generation, a malformed or oversize message. Retrying the same request cannot
    /// help.
    #[error("rejected: {0}")]
    Rejected(String),
    /// The coordinator cannot be reached (the backend keeps reconnecting); retrying
    /// later may help.
    #[error("control plane unreachable: {0}")]
    Io(String),
    /// The peer broke the protocol (an unparsable or unexpected message).
    #[error("control plane protocol error: {0}")]
    Protocol(String),
    /// The job is over ([`Directive::Shutdown`]). Retrying cannot help.
    #[error("job shut down: {0}")]
    Shutdown(String),
}

impl ElasticError {
    /// `key` will never be set in `generation`: that generation is over.
    pub(crate) fn generation_over(generation: u64, key: &str) -> ElasticError {
        ElasticError::Rejected(format!(
            "generation {generation} is over; key {key:?} will not be set in it"
        ))
    }

    /// `key` was not set in `generation` within `timeout`.
    pub(crate) fn key_timeout(generation: u64, key: &str, timeout: Duration) -> ElasticError {
        ElasticError::Timeout(format!(
            "key {key:?} not set in generation {generation} within {} ms",
            timeout.as_millis()
        ))
    }
}
