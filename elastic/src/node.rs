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
//! - A rank that starts again while its node trains waits like a new member: the node
//!   holds one more rank, the control plane counts it as waiting, and the world grows
//!   at the next checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::policy::{Policy, hung_member, lost_member};
use crate::protocol::{self, ClientMessage, LineError, LineReader, ServerMessage};
use crate::timeouts::{DEFAULT_HEARTBEAT_INTERVAL, Timeouts};
use crate::{Assignment, Cancel, ControlPlane, Directive, ElasticError, Member, Progress, Report};

/// Lines queued for one rank before it counts as not reading.
const OUTBOX: usize = 256;
/// Time a rank's new connection has to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on one write to a rank.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause after an error talking to the control plane.
const TICK: Duration = Duration::from_millis(50);
/// Longest wait of the node's threads when nothing happens (they are woken by
/// every change): a node of a large job must not cost wake-ups while idle.
const IDLE: Duration = Duration::from_secs(1);
/// Most rank connections a node serves.
const MAX_LOCAL: usize = 4096;
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
    /// stay out of reach before it gives up (at most [`UNREACHABLE_GIVE_UP`]): the
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

struct Shared {
    /// Who is served (with a job secret: who proves it).
    gate: Arc<ckpt_auth::Gatekeeper>,
    config: NodeConfig,
    upstream: Arc<dyn ControlPlane>,
    state: Mutex<State>,
    changed: Condvar,
    stopping: AtomicBool,
    /// Neither heartbeats nor directives: a simulated stopped node.
    silent: AtomicBool,
}

type LocalId = u64;

/// Where the lines for one rank go.
enum Outbox {
    /// A rank process's connection: its writer thread drains the queue.
    Socket {
        queue: SyncSender<Arc<str>>,
        socket: TcpStream,
    },
    /// A rank simulated in this process ([`NodeAgent::attach`]): the lines go to a
    /// queue shared by many, tagged with the rank's number.
    Attached {
        tag: usize,
        queue: SyncSender<(usize, Arc<str>)>,
    },
}

/// One rank's connection.
struct Local {
    outbox: Outbox,
    member: Option<Member>,
    last_seen: Instant,
    progress: Option<(u64, Progress)>,
    /// Asking for a generation newer than this one, since then.
    wants: Option<(u64, Instant)>,
    /// Told it is stale or that the job is over: it no longer counts.
    out: bool,
}

impl Local {
    fn id(&self) -> &str {
        self.member.as_ref().map_or("?", |m| m.id.as_str())
    }

    fn close(&self) {
        if let Outbox::Socket { socket, .. } = &self.outbox {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

/// The node's generation: its upstream assignment and its ranks' places in it.
struct Generation {
    assignment: Assignment,
    /// Member id -> rank, for the node's ranks given a place.
    seats: BTreeMap<String, usize>,
    /// When it formed (the join timeout of ranks that have not asked yet).
    formed: Instant,
    /// Over (a Restart, a Stale, or the node asked for a newer one).
    over: bool,
    /// Its ranks were told that it is over (the control plane's Restart or Stale,
    /// relayed). Not so when it is over because the node asked for a newer one: a
    /// rank of it that has not asked yet hears it when the newer one is installed.
    told: bool,
    /// One of its ranks ended it at a checkpoint boundary that every rank agreed on
    /// ([`Report::Ended`]): the others come to the rendezvous by themselves once
    /// their save has committed, and are not aborted.
    at_boundary: bool,
    /// Keys of its key-value space, as passed on.
    kv: Vec<(String, String)>,
}

#[derive(Default)]
struct State {
    locals: HashMap<LocalId, Local>,
    next_local: LocalId,
    /// Ranks the launcher runs now.
    expected: usize,
    generation: Option<Generation>,
    /// Newest generation number heard of.
    newest: u64,
    /// The rendezvous in flight upstream: (after, ranks asked for, its cancel).
    asking: Option<(u64, usize, Cancel)>,
    /// Ranks told to the control plane by the last `hold`.
    held: usize,
    /// When a rank first asked for the first generation.
    first_ask: Option<Instant>,
    shutdown: Option<String>,
    /// Since when every call upstream has failed for want of the control plane
    /// (cleared by any call that reaches it).
    unreachable_since: Option<Instant>,
    /// A generation was ever installed: the node joined the job.
    joined: bool,
    /// A rank of the node finished the job (reported once upstream).
    finished: bool,
    /// The highest checkpoint generation any of its ranks ever saved with: what the
    /// control plane keeps later floors above, whatever became of the rank.
    checkpoint_generation: u64,
}

impl State {
    /// Ranks that count: said hello, not out.
    fn live(&self) -> impl Iterator<Item = (LocalId, &Local)> {
        self.locals
            .iter()
            .filter(|(_, l)| l.member.is_some() && !l.out)
            .map(|(&c, l)| (c, l))
    }

    fn local_of(&self, id: &str) -> Option<LocalId> {
        self.live().find(|(_, l)| l.id() == id).map(|(c, _)| c)
    }

    fn running(&self) -> Option<&Generation> {
        self.generation.as_ref().filter(|g| !g.over)
    }

    fn send(&mut self, c: LocalId, message: &ServerMessage) {
        let Some(local) = self.locals.get(&c) else {
            return;
        };
        let line = match protocol::encode(message) {
            Ok(line) => Arc::<str>::from(line),
            Err(e) => {
                warn!(rank = local.id(), error = %e, "cannot encode a message");
                return;
            }
        };
        let sent = match &local.outbox {
            Outbox::Socket { queue, .. } => queue.try_send(line).map_err(|e| match e {
                TrySendError::Full(_) => TrySendError::Full(()),
                TrySendError::Disconnected(_) => TrySendError::Disconnected(()),
            }),
            Outbox::Attached { tag, queue } => queue.try_send((*tag, line)).map_err(|e| match e {
                TrySendError::Full(_) => TrySendError::Full(()),
                TrySendError::Disconnected(_) => TrySendError::Disconnected(()),
            }),
        };
        match sent {
            Ok(()) | Err(TrySendError::Disconnected(())) => {}
            Err(TrySendError::Full(())) => {
                warn!(rank = local.id(), "rank does not read; disconnecting it");
                local.close();
            }
        }
    }

    fn directive(&mut self, c: LocalId, directive: Directive) {
        if let Some(local) = self.locals.get(&c) {
            debug!(rank = local.id(), ?directive, "directive to a rank");
        }
        self.send(c, &ServerMessage::Directive { directive });
    }

    /// The rank's place in the node's generation, as an assignment of one rank.
    fn assignment_of(&self, id: &str) -> Option<Assignment> {
        let generation = self.generation.as_ref()?;
        let &rank = generation.seats.get(id)?;
        Some(Assignment {
            rank,
            ranks: 1,
            ..generation.assignment.clone()
        })
    }

    /// Gives rank `c` its place, and the generation's keys set so far (keys that
    /// reach a rank before its place are dropped by it).
    fn assign(&mut self, c: LocalId, assignment: Assignment) {
        let generation = assignment.generation;
        self.send(c, &ServerMessage::Assigned { assignment });
        let keys = match &self.generation {
            Some(g) if g.assignment.generation == generation => g.kv.clone(),
            _ => Vec::new(),
        };
        for (key, value) in keys {
            self.send(
                c,
                &ServerMessage::Kv {
                    generation,
                    key,
                    value,
                },
            );
        }
    }

    /// Tells `c` it is out: its generation is over and it was not kept.
    fn tell_stale(&mut self, c: LocalId) {
        let current = self.newest;
        if let Some(local) = self.locals.get_mut(&c) {
            local.out = true;
            local.wants = None;
        }
        self.directive(c, Directive::Stale { current });
    }
}

impl Shared {
    /// A node for `config` over `upstream`: no rank connected, in no generation.
    fn new(config: NodeConfig, upstream: Arc<dyn ControlPlane>) -> Shared {
        Shared {
            gate: ckpt_auth::Gatekeeper::new("node agent", config.secret.clone()),
            config,
            upstream,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            silent: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn policy(&self) -> Policy {
        Policy {
            min_ranks: 1,
            max_ranks: usize::MAX,
            timeouts: self.config.timeouts,
        }
    }

    /// Reports upstream, logging what cannot be sent (the control plane sees the
    /// generation end some other way, or the node is cut off).
    fn report(&self, generation: u64, report: Report) {
        if let Err(e) = self.upstream.report(generation, &report) {
            warn!(generation, error = %e, ?report, "cannot report to the control plane");
        }
    }

    /// Rank `c` of the running generation is lost: `cause` names it. It loses its
    /// place (a reconnect cannot claim it back) and is told it is stale, so that it
    /// writes nothing more if it wakes up; its connection stays open for it to read
    /// that. The generation restarts.
    fn lose(&self, state: &mut State, c: LocalId, cause: String) {
        let generation = state.running().map(|g| g.assignment.generation);
        warn!(generation, "{cause}");
        if let Some(id) = state.locals.get(&c).map(|l| l.id().to_owned())
            && let Some(g) = state.generation.as_mut()
        {
            g.seats.remove(&id);
        }
        state.tell_stale(c);
        if let Some(generation) = generation {
            self.report_loss(state, generation, cause);
        }
        self.changed.notify_all();
    }

    /// Reports a rank of `generation` lost; when it was the node's last live rank,
    /// the node leaves too, so that the next generation does not wait for a node
    /// with nothing to bring (it asks again as a newcomer when a rank starts again).
    fn report_loss(&self, state: &State, generation: u64, cause: String) {
        self.report(generation, Report::RankLost { cause });
        if state.live().next().is_none() {
            let reason = "every rank of this node is gone".to_owned();
            self.report(generation, Report::Leaving { reason });
        }
    }

    /// A new rank connection (`None`: too many).
    fn register(&self, outbox: Outbox) -> Option<LocalId> {
        let mut state = self.lock();
        if state.locals.len() >= MAX_LOCAL {
            return None;
        }
        let c = state.next_local;
        state.next_local += 1;
        state.locals.insert(
            c,
            Local {
                outbox,
                member: None,
                last_seen: Instant::now(),
                progress: None,
                wants: None,
                out: false,
            },
        );
        Some(c)
    }

    /// A rank's connection ended.
    fn remove(&self, c: LocalId, reason: &str) {
        self.forget(c, reason);
        grow(self);
    }

    fn forget(&self, c: LocalId, reason: &str) {
        let mut state = self.lock();
        let Some(local) = state.locals.remove(&c) else {
            return;
        };
        let Some(member) = local.member else {
            return;
        };
        debug!(rank = %member.id, reason, "rank disconnected");
        if local.out || self.stopping.load(Ordering::SeqCst) {
            self.changed.notify_all();
            return;
        }
        let seated = state
            .running()
            .and_then(|g| Some((g.assignment.generation, *g.seats.get(&member.id)?)));
        if let Some((generation, _)) = seated {
            if let Some(g) = state.generation.as_mut() {
                g.seats.remove(&member.id);
            }
            let cause = lost_member(&member.id, reason);
            warn!(generation, "{cause}");
            self.report_loss(&state, generation, cause);
        } else if state.live().next().is_none()
            && state.shutdown.is_none()
            && !state.finished
            && let Some(generation) = state.generation.as_ref().map(|g| g.assignment.generation)
        {
            // The node's last rank went after its generation ended (its ranks died
            // nearly together, and the first loss restarted the generation): with
            // nothing to bring, the node leaves rather than have the next generation
            // wait out its rejoin window for it, and drops the ask it made for the
            // rank that is gone. It asks again as a newcomer when a rank starts.
            self.report(
                generation,
                Report::Leaving {
                    reason: "every rank of this node is gone".to_owned(),
                },
            );
            if let Some((_, _, ask)) = &state.asking {
                ask.cancel();
            }
        }
        self.changed.notify_all();
    }

    fn handle(&self, c: LocalId, message: ClientMessage) -> Result<bool, String> {
        let counted = matches!(
            message,
            ClientMessage::Hello { .. } | ClientMessage::Rendezvous { .. }
        );
        let outcome = self.apply(c, message);
        if counted {
            grow(self);
        }
        outcome
    }

    fn apply(&self, c: LocalId, message: ClientMessage) -> Result<bool, String> {
        let now = Instant::now();
        let mut state = self.lock();
        let Some(local) = state.locals.get_mut(&c) else {
            return Err("connection removed".into());
        };
        local.last_seen = now;
        let hello_done = local.member.is_some();
        match message {
            ClientMessage::Hello { .. } if hello_done => {
                state.send(c, &error("hello sent twice on one connection", false));
                Ok(false)
            }
            ClientMessage::Hello {
                version,
                member,
                claim,
                checkpoint_generation,
                ..
            } => {
                state.checkpoint_generation =
                    state.checkpoint_generation.max(checkpoint_generation);
                self.hello(&mut state, c, version, member, claim)
                    .map(|()| true)
            }
            _ if !hello_done => {
                let text = "the first message must be hello";
                state.send(c, &error(text, true));
                Err(text.into())
            }
            ClientMessage::Rendezvous { after } => {
                self.rendezvous(&mut state, c, after, now);
                Ok(false)
            }
            ClientMessage::Heartbeat {
                generation,
                progress,
            } => {
                let newer = progress.checkpoint_generation > state.checkpoint_generation;
                state.checkpoint_generation = state
                    .checkpoint_generation
                    .max(progress.checkpoint_generation);
                if let Some(local) = state.locals.get_mut(&c) {
                    local.progress = Some((generation, progress));
                }
                if newer {
                    // A rank saves in a newer checkpoint generation: the control
                    // plane hears it now, not at the next beat, so that a generation
                    // formed after this rank's loss fences its saves' successors.
                    drop(state);
                    self.beat();
                }
                Ok(false)
            }
            ClientMessage::Report { generation, report } => {
                self.rank_report(&mut state, c, generation, report);
                Ok(false)
            }
            ClientMessage::KvSet {
                generation,
                key,
                value,
            } => {
                drop(state);
                if let Err(e) = self.upstream.kv_set(generation, &key, &value) {
                    self.lock().send(c, &error(&e.to_string(), false));
                }
                Ok(false)
            }
            ClientMessage::Hold { .. } => {
                let text = "a rank of a node holds one rank";
                state.send(c, &error(text, false));
                Ok(false)
            }
            ClientMessage::Sync { token } => {
                // A rank's messages are handled in order, and what a report sends
                // upstream is on its way before this answer.
                state.send(c, &ServerMessage::Synced { token });
                Ok(false)
            }
        }
    }

    fn hello(
        &self,
        state: &mut State,
        c: LocalId,
        version: u32,
        member: Member,
        claim: Option<Assignment>,
    ) -> Result<(), String> {
        let refusal = if let Some(refusal) =
            protocol::hello_refusal(version, &member, &self.config.job, "node")
        {
            Some(refusal)
        } else if member.ranks != 1 {
            Some(format!(
                "member {:?} holds {} ranks; a rank of a node holds one",
                member.id, member.ranks
            ))
        } else {
            None
        };
        if let Some(refusal) = refusal {
            state.send(c, &error(&refusal, true));
            return Err(refusal);
        }
        // A second connection of the same rank replaces the first.
        if let Some(old) = state.local_of(&member.id).filter(|&old| old != c)
            && let Some(old) = state.locals.get_mut(&old)
        {
            old.out = true;
            old.close();
        }
        let id = member.id.clone();
        if let Some(local) = state.locals.get_mut(&c) {
            local.member = Some(member);
        }
        let welcome = ServerMessage::Welcome {
            job: self.config.job.clone(),
            generation: state.newest,
        };
        state.send(c, &welcome);
        if let Some(reason) = state.shutdown.clone() {
            state.directive(c, Directive::Shutdown { reason });
            return Ok(());
        }
        if let Some(claim) = claim {
            let kept = state.running().is_some() && state.assignment_of(&id) == Some(claim);
            if !kept {
                state.tell_stale(c);
            }
        }
        self.changed.notify_all();
        Ok(())
    }

    fn rendezvous(&self, state: &mut State, c: LocalId, after: u64, now: Instant) {
        if let Some(reason) = state.shutdown.clone() {
            state.directive(c, Directive::Shutdown { reason });
            return;
        }
        let Some(local) = state.locals.get_mut(&c) else {
            return;
        };
        if local.out {
            // A stale rank that asks again is a new rank.
            local.out = false;
        }
        let id = local.id().to_owned();
        if local.wants.is_none() {
            local.wants = Some((after, now));
        }
        state.first_ask.get_or_insert(now);
        // Its place in a newer generation is already known: answer at once.
        if let Some(assignment) = state.assignment_of(&id).filter(|a| a.generation > after)
            && state.running().is_some()
        {
            if let Some(local) = state.locals.get_mut(&c) {
                local.wants = None;
            }
            state.assign(c, assignment);
        }
        self.changed.notify_all();
    }

    fn rank_report(&self, state: &mut State, c: LocalId, generation: u64, report: Report) {
        let Some(local) = state.locals.get(&c) else {
            return;
        };
        let id = local.id().to_owned();
        let running = state
            .running()
            .filter(|g| g.assignment.generation == generation)
            .and_then(|g| Some((*g.seats.get(&id)?, g.seats.len())));
        let Some((rank, seated)) = running else {
            // About an older generation, or before it had a place: the control plane
            // judges the node, not the rank; nothing to pass on.
            if matches!(report, Report::Leaving { .. } | Report::Fatal { .. })
                && let Some(local) = state.locals.get_mut(&c)
            {
                local.out = true;
                local.wants = None;
                self.changed.notify_all();
            }
            return;
        };
        let upstream = match report {
            Report::Fatal { reason } => {
                if let Some(local) = state.locals.get_mut(&c) {
                    local.out = true;
                }
                if let Some(g) = state.generation.as_mut() {
                    g.seats.remove(&id);
                }
                Report::RankLost {
                    cause: format!("member {id} (rank {rank}) failed: {reason}"),
                }
            }
            Report::Leaving { reason } => {
                if let Some(local) = state.locals.get_mut(&c) {
                    local.out = true;
                    local.wants = None;
                }
                let left = state
                    .running()
                    .map(|g| {
                        g.seats
                            .keys()
                            .filter(|seat| state.local_of(seat).is_some())
                            .count()
                    })
                    .unwrap_or(0);
                if left == 0 || seated == 1 {
                    Report::Leaving { reason }
                } else {
                    Report::RankLeft {
                        cause: format!("member {id} (rank {rank}) left: {reason}"),
                    }
                }
            }
            Report::Ended { step } => {
                if let Some(g) = state.generation.as_mut() {
                    g.at_boundary = true;
                }
                Report::Ended { step }
            }
            Report::Finished { .. } if state.finished => return,
            Report::Finished { step } => {
                state.finished = true;
                Report::Finished { step }
            }
            other => other,
        };
        self.changed.notify_all();
        match upstream {
            Report::RankLost { cause } => self.report_loss(state, generation, cause),
            upstream => self.report(generation, upstream),
        }
    }

    /// Whether the node should ask the control plane for a generation now, and for
    /// how many ranks.
    fn should_ask(&self, state: &State, now: Instant) -> Option<(u64, usize)> {
        if state.shutdown.is_some() || state.asking.is_some() {
            return None;
        }
        let live = state.live().count();
        let waiting: Vec<u64> = state
            .live()
            .filter_map(|(_, l)| l.wants.map(|(after, _)| after))
            .collect();
        if waiting.is_empty() {
            return None;
        }
        let after = state.newest;
        match state.running() {
            Some(g) => {
                // A rank of the running generation asks for a newer one: it is over
                // for the node too (at a boundary, or out of turn).
                let generation = g.assignment.generation;
                let member_asks = state.live().any(|(_, l)| {
                    l.wants.is_some_and(|(a, _)| a >= generation) && g.seats.contains_key(l.id())
                });
                member_asks.then_some((generation, live))
            }
            None if state.generation.is_some() => Some((after, live)),
            None => {
                let all = waiting.len() == live && live >= state.expected;
                let called = state
                    .first_ask
                    .is_some_and(|t| now.saturating_duration_since(t) >= self.config.last_call);
                (all || called).then_some((after, live))
            }
        }
    }

    /// When [`Shared::should_ask`] says so, records the ask about to go upstream
    /// (the generation it replaces is over for the node from now on) and returns
    /// it: after which generation, for how many ranks, and its cancel.
    fn start_asking(&self, state: &mut State, now: Instant) -> Option<(u64, usize, Cancel)> {
        let (after, ranks) = self.should_ask(state, now)?;
        let cancel = Cancel::new();
        state.asking = Some((after, ranks, cancel.clone()));
        if let Some(g) = state.generation.as_mut()
            && g.assignment.generation <= after
        {
            g.over = true;
        }
        Some((after, ranks, cancel))
    }

    /// The node got its place in generation `a`: its ranks get theirs.
    fn install(&self, a: Assignment, now: Instant) {
        let mut state = self.lock();
        state.joined = true;
        state.newest = state.newest.max(a.generation);
        let mut ids: Vec<String> = state.live().map(|(_, l)| l.id().to_owned()).collect();
        ids.sort();
        let places = a.ranks;
        let seats: BTreeMap<String, usize> = ids
            .iter()
            .take(places)
            .enumerate()
            .map(|(i, id)| (id.clone(), a.rank + i))
            .collect();
        info!(
            generation = a.generation,
            first = a.rank,
            ranks = a.ranks,
            world_size = a.world_size,
            "node has its place in a generation"
        );
        let generation = a.generation;
        // The control plane's Restart of the generation this one replaces travels
        // apart from this answer (another thread relays it) and, once this is
        // installed, would find no generation of its own to end; nor does the
        // control plane send one to a node that asked first (a survivor whose
        // collective failed asks at once, and the node asks for it). The ranks still
        // in the old one hear of its end here, unless the relay told them already, or
        // one of them blocked where only its generation's end reaches it (the ring's
        // bootstrap, a commit) would wait out the join timeout and be dropped. The
        // node's own ask marks the old generation over, so `over` cannot tell. A
        // generation that ended at a checkpoint boundary is not aborted: its ranks
        // finish the same commit and come by themselves.
        if let Some(old) = state
            .generation
            .as_ref()
            .filter(|g| !g.told && !g.at_boundary)
            && old.assignment.generation < generation
        {
            let restart = Directive::Restart {
                generation: old.assignment.generation,
                cause: a.cause.clone(),
            };
            let still_in: Vec<LocalId> = old
                .seats
                .keys()
                .filter_map(|id| state.local_of(id))
                .filter(|c| state.locals.get(c).is_some_and(|l| l.wants.is_none()))
                .collect();
            for c in still_in {
                state.directive(c, restart.clone());
            }
        }
        state.generation = Some(Generation {
            assignment: a,
            seats: seats.clone(),
            formed: now,
            over: false,
            told: false,
            at_boundary: false,
            kv: Vec::new(),
        });
        for id in ids.iter().skip(places) {
            // More live ranks than places (one started while the node asked): it
            // waits for the next generation, and the node holds it from now on.
            debug!(rank = %id, generation, "no place for this rank in this generation");
        }
        let asking: Vec<(LocalId, String)> = state
            .live()
            .filter(|(_, l)| l.wants.is_some_and(|(after, _)| after < generation))
            .map(|(c, l)| (c, l.id().to_owned()))
            .collect();
        for (c, id) in asking {
            if let Some(assignment) = state.assignment_of(&id) {
                if let Some(local) = state.locals.get_mut(&c) {
                    local.wants = None;
                    local.progress = None;
                    local.last_seen = now;
                }
                state.assign(c, assignment);
            }
        }
        if seats.len() < places {
            // A rank counted in the ask died before the answer: the world has a
            // hole, and the node says so at once.
            let cause = format!(
                "node holds {places} ranks in generation {generation} but only {} are alive",
                seats.len()
            );
            drop(state);
            warn!(generation, "{cause}");
            self.report(generation, Report::RankLost { cause });
            return;
        }
        self.changed.notify_all();
    }

    /// A call upstream reached the control plane.
    fn reached(&self) {
        self.lock().unreachable_since = None;
    }

    /// A call upstream failed for want of the control plane (`error`, at `now`).
    /// Once every call has failed so for [`UNREACHABLE_GIVE_UP`], the node shuts its
    /// ranks down with the cause, and says true: the job cannot go on from here,
    /// and a rank connected to the control plane itself would have given up too.
    ///
    /// The outage counts from its start: a backend that reconnects quietly (the TCP
    /// client) fails a call only after its own timeout, which is part of it
    /// ([`ControlPlane::unreachable_for`]); before it stacked with this one, and a
    /// node gave up after twice [`UNREACHABLE_GIVE_UP`]. A node that has not joined a
    /// generation gives up after [`NodeConfig::give_up_before_joining`].
    fn unreachable(&self, error: &ElasticError, now: Instant) -> bool {
        let hidden = self.upstream.unreachable_for().unwrap_or_default();
        let (since, patience) = {
            let mut state = self.lock();
            if state.shutdown.is_some() {
                return true;
            }
            let patience = if state.joined {
                UNREACHABLE_GIVE_UP
            } else {
                self.config.give_up_before_joining.min(UNREACHABLE_GIVE_UP)
            };
            (*state.unreachable_since.get_or_insert(now), patience)
        };
        let down = now.saturating_duration_since(since).max(hidden);
        if down < patience {
            return false;
        }
        self.relay(Directive::Shutdown {
            reason: format!(
                "the control plane has been out of reach of this node for {} s: {error}",
                down.as_secs()
            ),
        });
        true
    }

    /// Passes `directive` from the control plane on to the ranks it concerns.
    fn relay(&self, directive: Directive) {
        let mut state = self.lock();
        let seated = |state: &State| -> Vec<LocalId> {
            let Some(g) = &state.generation else {
                return Vec::new();
            };
            g.seats.keys().filter_map(|id| state.local_of(id)).collect()
        };
        match &directive {
            Directive::Restart { generation, .. } | Directive::Regroup { generation, .. } => {
                let ours = state
                    .generation
                    .as_ref()
                    .is_some_and(|g| g.assignment.generation == *generation);
                if !ours {
                    return;
                }
                if matches!(directive, Directive::Restart { .. })
                    && let Some(g) = state.generation.as_mut()
                {
                    g.over = true;
                    g.told = true;
                }
                for c in seated(&state) {
                    state.directive(c, directive.clone());
                }
            }
            Directive::Stale { current } => {
                state.newest = state.newest.max(*current);
                let over = state.generation.as_mut().map(|g| {
                    g.over = true;
                    g.told = true;
                    g.assignment.generation
                });
                info!(
                    current,
                    "the control plane dropped this node; its ranks are stale"
                );
                for c in seated(&state) {
                    // A rank that already left the generation and asks for a newer
                    // one knows it is over: its ask stands, for the node to pass on.
                    let moved_on = state
                        .locals
                        .get(&c)
                        .and_then(|l| l.wants)
                        .is_some_and(|(after, _)| over.is_some_and(|g| after >= g));
                    if !moved_on {
                        state.tell_stale(c);
                    }
                }
            }
            Directive::Shutdown { reason } => {
                state.shutdown = Some(reason.clone());
                // Every rank still connected, stale ones included: one waiting for a
                // generation must hear that none will come.
                let all: Vec<LocalId> = state
                    .locals
                    .iter()
                    .filter(|(_, l)| l.member.is_some())
                    .map(|(&c, _)| c)
                    .collect();
                for c in all {
                    state.directive(c, directive.clone());
                }
            }
        }
        self.changed.notify_all();
    }

    /// The node's own checks of its ranks in the running generation.
    fn check_ranks(&self, now: Instant) {
        let policy = self.policy();
        let timeouts = self.config.timeouts;
        let mut state = self.lock();
        let Some(g) = state.running() else {
            return;
        };
        let generation = g.assignment.generation;
        let formed = g.formed;
        let seats: Vec<String> = g.seats.keys().cloned().collect();
        for id in seats {
            let Some(c) = state.local_of(&id) else {
                // Given a place, then gone before taking it (its fatal report or
                // its exit raced the node's ask): the world has a hole.
                if let Some(g) = state.generation.as_mut() {
                    g.seats.remove(&id);
                }
                let cause = lost_member(
                    &id,
                    format_args!("gone before it joined generation {generation}"),
                );
                warn!(generation, "{cause}");
                self.report_loss(&state, generation, cause);
                return;
            };
            let local = &state.locals[&c];
            let silent = now.saturating_duration_since(local.last_seen);
            let joined = local
                .progress
                .as_ref()
                .is_some_and(|(g, _)| *g == generation);
            let verdict = if silent > timeouts.heartbeat_timeout {
                Some(lost_member(
                    &id,
                    format_args!("no heartbeat for {} ms", silent.as_millis()),
                ))
            } else if let Some((g, p)) = &local.progress
                && *g == generation
                && policy.hung(p)
            {
                Some(hung_member(&id, p.idle_ms))
            } else if !joined
                && local.wants.is_none()
                && now.saturating_duration_since(formed) > timeouts.join_timeout
            {
                Some(lost_member(
                    &id,
                    format_args!(
                        "did not join generation {generation} within {} ms",
                        timeouts.join_timeout.as_millis()
                    ),
                ))
            } else {
                None
            };
            if let Some(cause) = verdict {
                self.lose(&mut state, c, cause);
                return;
            }
        }
    }

    /// What the node says in its heartbeat: its ranks' slowest step and highest
    /// checkpoint generation. Hangs are the node's to judge, so it is never idle.
    /// One heartbeat upstream now.
    fn beat(&self) {
        let (generation, progress) = self.progress();
        if let Err(e) = self.upstream.heartbeat(generation, &progress) {
            debug!(error = %e, "node heartbeat not sent");
        }
    }

    fn progress(&self) -> (u64, Progress) {
        let state = self.lock();
        let Some(g) = state.running() else {
            let progress = Progress {
                checkpoint_generation: state.checkpoint_generation,
                ..Progress::default()
            };
            return (0, progress);
        };
        let generation = g.assignment.generation;
        let mut progress = Progress {
            step: u64::MAX,
            ..Progress::default()
        };
        for (_, local) in state.live() {
            if let Some((g, p)) = &local.progress
                && *g == generation
            {
                progress.step = progress.step.min(p.step);
                progress.checkpoint_generation =
                    progress.checkpoint_generation.max(p.checkpoint_generation);
            }
        }
        if progress.step == u64::MAX {
            progress.step = 0;
        }
        progress.checkpoint_generation = progress
            .checkpoint_generation
            .max(state.checkpoint_generation);
        (generation, progress)
    }
}

fn error(message: &str, fatal: bool) -> ServerMessage {
    ServerMessage::Error {
        message: message.to_owned(),
        fatal,
    }
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
    /// closing its connections). Not undone.
    #[doc(hidden)]
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

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("ckpt-node-rank".into())
            .spawn(move || serve_rank(&shared, stream, peer));
        if let Err(e) = spawned {
            warn!(%peer, error = %e, "cannot start a thread for a rank");
        }
    }
}

fn write_lines(mut socket: TcpStream, outbox: Receiver<Arc<str>>) {
    let _ = socket.set_write_timeout(Some(WRITE_TIMEOUT));
    for line in outbox {
        if socket.write_all(line.as_bytes()).is_err() {
            break;
        }
    }
    let _ = socket.shutdown(Shutdown::Both);
}

fn serve_rank(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    match shared.gate.screen(&stream, peer) {
        Ok(()) => {}
        Err(ckpt_auth::AuthError::NoHandshake) => {
            // One of the node's ranks started without the secret, most likely: say
            // so in its own protocol.
            if let Ok(line) = protocol::encode(&error(&protocol::without_secret(), true)) {
                let _ = (&stream).write_all(line.as_bytes());
            }
            return;
        }
        Err(_) => return,
    }
    let (Ok(for_writer), Ok(for_state)) = (stream.try_clone(), stream.try_clone()) else {
        warn!(%peer, "cannot clone a rank's socket");
        return;
    };
    let (queue, lines) = sync_channel(OUTBOX);
    let outbox = Outbox::Socket {
        queue,
        socket: for_state,
    };
    let Some(c) = shared.register(outbox) else {
        warn!(%peer, "too many rank connections; refused");
        return;
    };
    let writer = std::thread::Builder::new()
        .name("ckpt-node-write".into())
        .spawn(move || write_lines(for_writer, lines));
    if writer.is_err() {
        shared.remove(c, "no thread to write");
        return;
    }
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let mut reader = LineReader::new(stream);
    let reason = loop {
        match reader.next_line() {
            Ok(None) => break "connection closed".to_owned(),
            Ok(Some(line)) => match protocol::decode::<ClientMessage>(line) {
                Ok(message) => match shared.handle(c, message) {
                    Ok(true) => {
                        let _ = reader.get_ref().set_read_timeout(None);
                    }
                    Ok(false) => {}
                    Err(reason) => break reason,
                },
                Err(e) => shared.lock().send(c, &error(&e.to_string(), false)),
            },
            Err(LineError::TooLong { max }) => {
                let message = format!("line longer than {max} bytes; closing the connection");
                shared.lock().send(c, &error(&message, true));
                break message;
            }
            Err(LineError::Io(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                break format!("no hello within {HELLO_TIMEOUT:?}");
            }
            Err(e) => break e.to_string(),
        }
    };
    shared.remove(c, &reason);
}

/// Asks the control plane for generations when the node's ranks want one.
fn rendezvous_loop(shared: &Arc<Shared>) {
    loop {
        let (after, ranks, cancel) = {
            let mut state = shared.lock();
            loop {
                if shared.stopping.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(ask) = shared.start_asking(&mut state, Instant::now()) {
                    break ask;
                }
                // Woken by every change; the timeout only ends the last call.
                let wait = match (state.first_ask, &state.generation) {
                    (Some(first), None) => (first + shared.config.last_call)
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                    _ => IDLE,
                };
                state = shared
                    .changed
                    .wait_timeout(state, wait.min(IDLE))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        };
        let outcome = shared
            .upstream
            .hold(ranks)
            .and_then(|()| shared.upstream.rendezvous(after, &cancel));
        let now = Instant::now();
        {
            let mut state = shared.lock();
            state.asking = None;
            if outcome.is_ok() || !matches!(outcome, Err(ElasticError::Cancelled)) {
                state.held = ranks;
            }
        }
        match outcome {
            Ok(assignment) => {
                shared.reached();
                shared.install(assignment, now);
            }
            Err(ElasticError::Cancelled) => {}
            Err(ElasticError::Shutdown(reason)) => {
                shared.relay(Directive::Shutdown { reason });
            }
            Err(e) => {
                warn!(error = %e, "the node's rendezvous failed");
                if !matches!(e, ElasticError::Timeout(_) | ElasticError::Io(_)) {
                    shared.relay(Directive::Shutdown {
                        reason: format!("the control plane refused this node: {e}"),
                    });
                } else if matches!(e, ElasticError::Io(_)) {
                    shared.unreachable(&e, now);
                }
                std::thread::sleep(TICK);
            }
        }
    }
}

/// Heartbeats upstream, passes directives on, checks the node's ranks, and keeps
/// the rank count the control plane has in step with the live ranks.
fn upkeep_loop(shared: &Arc<Shared>) {
    let interval = shared.config.heartbeat_interval;
    let mut next_beat = Instant::now();
    while !shared.stopping.load(Ordering::SeqCst) {
        if shared.silent.load(Ordering::SeqCst) {
            std::thread::sleep(interval);
            continue;
        }
        let now = Instant::now();
        if now >= next_beat {
            shared.beat();
            next_beat = now + interval;
            shared.check_ranks(now);
            grow(shared);
        }
        let (generation, asking) = {
            let state = shared.lock();
            let generation = state
                .generation
                .as_ref()
                .map_or(0, |g| g.assignment.generation);
            (generation, state.asking.clone())
        };
        let wait = next_beat.saturating_duration_since(Instant::now());
        match shared.upstream.watch(generation, wait) {
            Ok(Some(directive)) => {
                shared.reached();
                if let (Directive::Shutdown { .. }, Some((_, _, cancel))) = (&directive, asking) {
                    cancel.cancel();
                }
                shared.relay(directive);
            }
            Ok(None) => shared.reached(),
            Err(e) => {
                warn!(error = %e, "the node cannot watch the control plane");
                if matches!(e, ElasticError::Rejected(_) | ElasticError::Shutdown(_)) {
                    shared.relay(Directive::Shutdown {
                        reason: format!("the control plane refused this node: {e}"),
                    });
                    return;
                }
                if matches!(e, ElasticError::Io(_)) {
                    let asking = shared.lock().asking.as_ref().map(|(_, _, c)| c.clone());
                    if shared.unreachable(&e, Instant::now())
                        && let Some(cancel) = asking
                    {
                        cancel.cancel();
                    }
                }
                std::thread::sleep(TICK);
            }
        }
    }
}

/// Keeps the ranks the control plane counts for this node in step with its live
/// ranks: while the node asks for a generation (a rank that connects late is
/// counted before the generation forms), and while it trains (a rank started again
/// waits to join, so that the world grows at the next checkpoint).
fn grow(shared: &Shared) {
    let ranks = {
        let state = shared.lock();
        let live = state.live().count();
        let asked = match (&state.asking, state.running()) {
            (Some((_, asked, _)), _) => *asked,
            (None, Some(g)) if live > g.seats.len() => state.held,
            _ => return,
        };
        if live == asked || live == 0 {
            return;
        }
        live
    };
    match shared.upstream.hold(ranks) {
        Ok(()) => {
            let mut state = shared.lock();
            state.held = ranks;
            if let Some((_, asked, _)) = state.asking.as_mut() {
                *asked = ranks;
            }
        }
        Err(e) => debug!(error = %e, "cannot tell the control plane the node's ranks"),
    }
}

/// Passes the running generation's keys on to its ranks.
fn kv_loop(shared: &Arc<Shared>) {
    while !shared.stopping.load(Ordering::SeqCst) {
        let (generation, known) = {
            let state = shared.lock();
            match state.running() {
                Some(g) => (g.assignment.generation, g.kv.len()),
                None => (0, 0),
            }
        };
        if generation == 0 {
            let state = shared.lock();
            let _ = shared.changed.wait_timeout(state, IDLE);
            continue;
        }
        // Bounded by the heartbeat interval, so that a node that is dropped lets go
        // of its control plane (closing its connection) that soon.
        match shared
            .upstream
            .kv_all(generation, known, shared.config.heartbeat_interval)
        {
            Ok(all) if all.len() > known => {
                let mut state = shared.lock();
                let Some(g) = state.generation.as_mut() else {
                    continue;
                };
                if g.assignment.generation != generation {
                    continue;
                }
                let new: Vec<(String, String)> = all
                    .into_iter()
                    .filter(|(k, v)| !g.kv.iter().any(|(k2, v2)| k2 == k && v2 == v))
                    .collect();
                g.kv.extend(new.iter().cloned());
                let ids: Vec<String> = g.seats.keys().cloned().collect();
                let seated: Vec<LocalId> = ids.iter().filter_map(|id| state.local_of(id)).collect();
                for (key, value) in new {
                    let update = ServerMessage::Kv {
                        generation,
                        key,
                        value,
                    };
                    for &c in &seated {
                        state.send(c, &update);
                    }
                }
            }
            Ok(_) => {}
            Err(_) => {
                let state = shared.lock();
                let _ = shared.changed.wait_timeout(state, TICK);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream that accepts everything, keeps what it is reported, and never
    /// answers; [`Quiet::out_of_reach_for`] `Some(d)` says it has been reconnecting
    /// to a coordinator out of reach for `d` (as the TCP client does before its
    /// calls fail).
    #[derive(Default)]
    struct Quiet {
        unreachable: Option<Duration>,
        reports: Mutex<Vec<(u64, Report)>>,
    }

    impl Quiet {
        fn out_of_reach_for(d: Option<Duration>) -> Quiet {
            Quiet {
                unreachable: d,
                ..Quiet::default()
            }
        }

        fn reports(&self) -> Vec<(u64, Report)> {
            self.reports.lock().unwrap().clone()
        }
    }

    impl ControlPlane for Quiet {
        fn unreachable_for(&self) -> Option<Duration> {
            self.unreachable
        }
        fn rendezvous(&self, _: u64, _: &Cancel) -> Result<Assignment, ElasticError> {
            Err(ElasticError::Timeout("quiet".into()))
        }
        fn heartbeat(&self, _: u64, _: &Progress) -> Result<(), ElasticError> {
            Ok(())
        }
        fn watch(&self, _: u64, _: Duration) -> Result<Option<Directive>, ElasticError> {
            Ok(None)
        }
        fn report(&self, generation: u64, report: &Report) -> Result<(), ElasticError> {
            self.reports
                .lock()
                .unwrap()
                .push((generation, report.clone()));
            Ok(())
        }
        fn kv_set(&self, _: u64, _: &str, _: &str) -> Result<(), ElasticError> {
            Ok(())
        }
        fn kv_get(&self, _: u64, _: &str, _: &Cancel, _: Duration) -> Result<String, ElasticError> {
            Err(ElasticError::Timeout("quiet".into()))
        }
    }

    fn assignment(generation: u64, ranks: usize, cause: &str) -> Assignment {
        Assignment {
            generation,
            rank: 0,
            ranks,
            world_size: ranks,
            members: 1,
            roster: 0,
            checkpoint_generation_floor: 0,
            cause: cause.into(),
        }
    }

    /// A node with an upstream that never answers, whose ranks `ids` (tags 0, 1, …)
    /// are seated in generation 1; those named in `asking` already ask for a newer
    /// one. Returns it and what its ranks are sent.
    fn node_in_generation_1(
        ids: &[&str],
        asking: &[&str],
    ) -> (Shared, std::sync::mpsc::Receiver<(usize, Arc<str>)>) {
        node_over(Arc::new(Quiet::default()), ids, asking)
    }

    /// [`node_in_generation_1`] over `upstream`.
    fn node_over(
        upstream: Arc<dyn ControlPlane>,
        ids: &[&str],
        asking: &[&str],
    ) -> (Shared, std::sync::mpsc::Receiver<(usize, Arc<str>)>) {
        let shared = Shared::new(NodeConfig::new("job"), upstream);
        let (queue, lines) = std::sync::mpsc::sync_channel(16);
        let now = Instant::now();
        {
            let mut state = shared.lock();
            for (tag, id) in ids.iter().enumerate() {
                let c = state.next_local;
                state.next_local += 1;
                state.locals.insert(
                    c,
                    Local {
                        outbox: Outbox::Attached {
                            tag,
                            queue: queue.clone(),
                        },
                        member: Some(Member::new("job", *id, "127.0.0.1", "n0")),
                        last_seen: now,
                        progress: None,
                        wants: asking.contains(id).then_some((1, now)),
                        out: false,
                    },
                );
            }
            state.joined = true;
            state.generation = Some(Generation {
                assignment: assignment(1, ids.len() + 1, "initial"),
                seats: ids
                    .iter()
                    .enumerate()
                    .map(|(i, id)| (id.to_string(), i))
                    .collect(),
                formed: now,
                over: false,
                told: false,
                at_boundary: false,
                kv: Vec::new(),
            });
        }
        (shared, lines)
    }

    /// Whether the rank tagged `tag` was given its place in `generation`.
    fn assigned(got: &[(usize, ServerMessage)], tag: usize, generation: u64) -> bool {
        got.iter().any(|(t, m)| {
            *t == tag
                && matches!(m, ServerMessage::Assigned { assignment } if assignment.generation == generation)
        })
    }

    fn sent(lines: &std::sync::mpsc::Receiver<(usize, Arc<str>)>) -> Vec<(usize, ServerMessage)> {
        lines
            .try_iter()
            .map(|(tag, line)| (tag, protocol::decode(line.as_bytes()).unwrap()))
            .collect()
    }

    /// Found by the PyTorch elastic tests: a node alone in its job lost a rank, a
    /// survivor whose collective failed asked again at once, and the coordinator
    /// formed the next generation at once. The node installed it before its other
    /// thread relayed the restart of the old one, which then found no generation
    /// of the node's to end: the survivor blocked in a collective was never aborted
    /// and was dropped by the join timeout. A rank still in the replaced generation
    /// is now told at the install; one already asking gets its place instead.
    ///
    /// Found again by the trainer's elastic tests (node 1 killed whole, node 0's
    /// rank 1 dropped by the join timeout): the install told nobody when the node
    /// had asked because one of its ranks did, which is how a survivor's ask goes,
    /// since the ask marks the old generation over. The test goes through that ask.
    #[test]
    fn installing_a_newer_generation_ends_the_running_one_for_its_ranks() {
        let (shared, lines) = node_in_generation_1(&["blocked", "asking"], &["asking"]);
        let ask = shared.start_asking(&mut shared.lock(), Instant::now());
        assert_eq!(
            ask.map(|(after, ranks, _)| (after, ranks)),
            Some((1, 2)),
            "the node asks for both its ranks"
        );
        shared.lock().asking = None;
        shared.install(
            assignment(2, 2, "lost member gone: connection closed"),
            Instant::now(),
        );
        let got = sent(&lines);
        let restart = ServerMessage::Directive {
            directive: Directive::Restart {
                generation: 1,
                cause: "lost member gone: connection closed".into(),
            },
        };
        assert!(got.contains(&(0, restart.clone())), "{got:?}");
        assert!(!got.contains(&(1, restart)), "{got:?}");
        assert!(assigned(&got, 1, 2), "{got:?}");
    }

    /// Found by the trainer's elastic tests (a node killed whole): its two ranks
    /// died nearly together. The first loss ended the generation; the second
    /// disconnect came after the control plane's restart was relayed, so the rank
    /// was no longer seated in a running generation and the node reported nothing.
    /// The node neither asked again (no live rank) nor left, and the coordinator
    /// waited out its rejoin window for it. A node left with no live rank leaves,
    /// whenever its last rank goes, and drops an ask it has in flight.
    #[test]
    fn a_node_whose_last_rank_goes_after_its_generation_ended_leaves() {
        let upstream = Arc::new(Quiet::default());
        let (shared, _lines) = node_over(upstream.clone(), &["first", "second"], &["second"]);
        shared.forget(0, "connection closed");
        assert!(
            matches!(
                upstream.reports().as_slice(),
                [(1, Report::RankLost { .. })]
            ),
            "{:?}",
            upstream.reports()
        );
        shared.relay(Directive::Restart {
            generation: 1,
            cause: "lost member first: connection closed".into(),
        });
        let (_, _, ask) = shared
            .start_asking(&mut shared.lock(), Instant::now())
            .expect("the survivor's ask goes upstream");
        shared.forget(1, "connection closed");
        let reports = upstream.reports();
        assert!(
            matches!(reports.as_slice(), [_, (1, Report::Leaving { .. })]),
            "{reports:?}"
        );
        assert!(ask.is_cancelled(), "the ask for a rank that is gone stands");
        shared.lock().asking = None;
        assert!(
            shared
                .start_asking(&mut shared.lock(), Instant::now())
                .is_none(),
            "a node with no live rank asks for nothing"
        );
    }

    /// At a checkpoint boundary (a regroup, or a stop elsewhere) the first rank to
    /// ask reported the generation ended there; a rank still finishing the same
    /// commit is not aborted by the install, and gets its place when it asks.
    #[test]
    fn a_generation_ended_at_a_boundary_is_not_aborted_for_the_ranks_still_in_it() {
        let (shared, lines) = node_in_generation_1(&["finishing", "asking"], &[]);
        let asking = 1;
        shared
            .apply(
                asking,
                ClientMessage::Report {
                    generation: 1,
                    report: Report::Ended { step: 10 },
                },
            )
            .unwrap();
        shared
            .apply(asking, ClientMessage::Rendezvous { after: 1 })
            .unwrap();
        assert!(
            shared
                .start_asking(&mut shared.lock(), Instant::now())
                .is_some()
        );
        shared.lock().asking = None;
        shared.install(assignment(2, 2, "grow: 1 waiting member"), Instant::now());
        let got = sent(&lines);
        assert!(
            !got.iter().any(|(tag, m)| *tag == 0
                && matches!(
                    m,
                    ServerMessage::Directive {
                        directive: Directive::Restart { .. }
                    }
                )),
            "{got:?}"
        );
        shared
            .apply(0, ClientMessage::Rendezvous { after: 1 })
            .unwrap();
        let got = sent(&lines);
        assert!(assigned(&got, 0, 2), "{got:?}");
    }

    /// The control plane's Restart, relayed before the install, is what the ranks
    /// still in the old generation hear: the install does not say it again.
    #[test]
    fn a_restart_relayed_before_the_install_is_not_sent_again() {
        let (shared, lines) = node_in_generation_1(&["blocked", "asking"], &["asking"]);
        let _ = shared.start_asking(&mut shared.lock(), Instant::now());
        let restart = Directive::Restart {
            generation: 1,
            cause: "lost member gone: connection closed".into(),
        };
        shared.relay(restart.clone());
        shared.lock().asking = None;
        shared.install(
            assignment(2, 2, "lost member gone: connection closed"),
            Instant::now(),
        );
        let restarts = sent(&lines)
            .into_iter()
            .filter(|(tag, m)| {
                *tag == 0
                    && *m
                        == ServerMessage::Directive {
                            directive: restart.clone(),
                        }
            })
            .count();
        assert_eq!(restarts, 1);
    }

    /// Found by the chaos soak (seed 2027 run 45 of the Python example): the
    /// coordinator was gone for good (its launcher exited with the job), and the node
    /// asked it again every 50 ms for ever while its ranks waited. It now gives up
    /// after failing for [`UNREACHABLE_GIVE_UP`] without a call that got through, and
    /// tells its ranks why.
    #[test]
    fn a_node_whose_control_plane_stays_unreachable_shuts_its_ranks_down() {
        let (shared, lines) = node_in_generation_1(&["asking", "blocked"], &["asking"]);
        let gone =
            ElasticError::Io("the coordinator at 127.0.0.1:1 has been unreachable for 60 s".into());
        let t0 = Instant::now();
        assert!(!shared.unreachable(&gone, t0));
        assert!(!shared.unreachable(&gone, t0 + UNREACHABLE_GIVE_UP / 2));
        // A call that gets through starts the count again.
        shared.reached();
        let t1 = t0 + UNREACHABLE_GIVE_UP;
        assert!(!shared.unreachable(&gone, t1));
        assert!(sent(&lines).is_empty(), "nothing told yet");
        assert!(shared.unreachable(&gone, t1 + UNREACHABLE_GIVE_UP));
        let got = sent(&lines);
        for tag in [0, 1] {
            assert!(
                got.iter().any(|(t, m)| *t == tag
                    && matches!(m, ServerMessage::Directive { directive: Directive::Shutdown { reason } }
                        if reason.contains("has been out of reach of this node for 60 s")
                            && reason.contains("unreachable"))),
                "rank {tag} hears why: {got:?}"
            );
        }
        assert_eq!(
            shared.should_ask(&shared.lock(), Instant::now()),
            None,
            "the node asks no more"
        );
    }

    /// Found by the Python chaos scenario of a node back while its job finished: the
    /// TCP client hid the first 60 s of the coordinator's absence (reconnecting)
    /// before a call failed, and the node then failed calls for its own 60 s: its
    /// ranks waited two minutes for a job that was over. The outage the backend hid
    /// counts.
    #[test]
    fn the_outage_the_backend_hid_counts_toward_the_nodes_patience() {
        let joined = Shared::new(
            NodeConfig::new("job"),
            Arc::new(Quiet::out_of_reach_for(Some(UNREACHABLE_GIVE_UP))),
        );
        joined.lock().joined = true;
        let gone = ElasticError::Io("the coordinator at 127.0.0.1:1 is gone".into());
        assert!(
            joined.unreachable(&gone, Instant::now()),
            "the first failed call comes after the backend's 60 s: the node gives up"
        );
        assert!(
            joined
                .lock()
                .shutdown
                .as_deref()
                .is_some_and(|r| r.contains("out of reach of this node for 60 s")),
            "{:?}",
            joined.lock().shutdown
        );
        // A shorter hidden outage leaves the rest of the patience.
        let brief = Shared::new(
            NodeConfig::new("job"),
            Arc::new(Quiet::out_of_reach_for(Some(Duration::from_secs(5)))),
        );
        brief.lock().joined = true;
        let t0 = Instant::now();
        assert!(!brief.unreachable(&gone, t0));
        assert!(brief.unreachable(&gone, t0 + UNREACHABLE_GIVE_UP));
    }

    /// The same scenario's other half: the node had come back (its ranks still
    /// importing torch) and never joined a generation when the coordinator left
    /// with the finished job. It gives up as a first connection would, after
    /// `give_up_before_joining` (the launcher's connect timeout), not 60 s.
    #[test]
    fn a_node_that_never_joined_gives_up_after_its_connect_timeout() {
        let config = NodeConfig {
            give_up_before_joining: Duration::from_secs(3),
            ..NodeConfig::new("job")
        };
        let fresh = Shared::new(config.clone(), Arc::new(Quiet::default()));
        let gone = ElasticError::Io("the coordinator at 127.0.0.1:1 is gone".into());
        let t0 = Instant::now();
        assert!(!fresh.unreachable(&gone, t0));
        assert!(!fresh.unreachable(&gone, t0 + Duration::from_secs(2)));
        assert!(fresh.unreachable(&gone, t0 + Duration::from_secs(3)));
        // Once it joined, the full patience again.
        let joined = Shared::new(config, Arc::new(Quiet::default()));
        joined.lock().joined = true;
        assert!(!joined.unreachable(&gone, t0));
        assert!(!joined.unreachable(&gone, t0 + Duration::from_secs(3)));
        assert!(joined.unreachable(&gone, t0 + UNREACHABLE_GIVE_UP));
    }

    /// Found by the chaos soak (seed 2027 run 58): a node cut off from the
    /// coordinator for longer than the heartbeat timeout. The other node finished
    /// the job meanwhile. Once the network healed, this node's ranks found their
    /// peers gone and asked for a new generation; then the coordinator's old word
    /// that the node was dropped arrived. The node took its asking ranks for stale:
    /// it forgot their asks and left them out of everything after, the end of the
    /// job included. They waited in their rendezvous for ever. A rank that already
    /// asks for a newer generation knows the old one is over: its ask stands, and
    /// the end of the job reaches every rank still connected.
    #[test]
    fn ranks_already_asking_keep_their_ask_when_the_node_is_dropped_and_hear_the_job_end() {
        let (shared, lines) = node_in_generation_1(&["asking", "blocked"], &["asking"]);
        shared.relay(Directive::Stale { current: 1 });
        let got = sent(&lines);
        assert!(
            !got.iter().any(|(tag, _)| *tag == 0),
            "the asking rank is not told it is stale: {got:?}"
        );
        assert!(
            got.iter().any(|(tag, m)| *tag == 1
                && matches!(
                    m,
                    ServerMessage::Directive {
                        directive: Directive::Stale { .. }
                    }
                )),
            "the rank still in the old generation is: {got:?}"
        );
        assert_eq!(
            shared.should_ask(&shared.lock(), Instant::now()),
            Some((1, 1)),
            "the node asks for its one asking rank"
        );
        let shutdown = Directive::Shutdown {
            reason: "the job finished".into(),
        };
        shared.relay(shutdown.clone());
        let got = sent(&lines);
        for tag in [0, 1] {
            assert!(
                got.contains(&(
                    tag,
                    ServerMessage::Directive {
                        directive: shutdown.clone()
                    }
                )),
                "rank {tag} hears the job ended: {got:?}"
            );
        }
    }
}
