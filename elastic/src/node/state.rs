//! What the node knows, under one lock: its rank connections, the generation it
//! holds a block of ranks in, and what it asked the control plane. Every thread of
//! the node (a rank's reader, the rendezvous, the upkeep, the key relay) reads and
//! changes it through [`Shared`], and waits on its condition variable for the
//! others' changes.

use std::collections::{BTreeMap, HashMap};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use tracing::{debug, warn};

use super::NodeConfig;
use crate::policy::Policy;
use crate::protocol::{self, ServerMessage};
use crate::{Assignment, Cancel, ControlPlane, Directive, Member, Progress, Report};

pub(super) struct Shared {
    /// Who is served (with a job secret: who proves it).
    pub(super) gate: Arc<ckpt_auth::Gatekeeper>,
    pub(super) config: NodeConfig,
    pub(super) upstream: Arc<dyn ControlPlane>,
    pub(super) state: Mutex<State>,
    pub(super) changed: Condvar,
    pub(super) stopping: AtomicBool,
    /// Neither heartbeats nor directives: a simulated stopped node.
    pub(super) silent: AtomicBool,
}

pub(super) type LocalId = u64;

/// Where the lines for one rank go.
pub(super) enum Outbox {
    /// A rank process's connection: its writer thread drains the queue.
    Socket {
        queue: SyncSender<Arc<str>>,
        socket: TcpStream,
    },
    /// A rank simulated in this process ([`NodeAgent::attach`]): the lines go to a
    /// queue shared by many, tagged with the rank's number.
    ///
    /// [`NodeAgent::attach`]: super::NodeAgent::attach
    Attached {
        tag: usize,
        queue: SyncSender<(usize, Arc<str>)>,
    },
}

/// One rank's connection.
pub(super) struct Local {
    pub(super) outbox: Outbox,
    pub(super) member: Option<Member>,
    pub(super) last_seen: Instant,
    pub(super) progress: Option<(u64, Progress)>,
    /// Asking for a generation newer than this one, since then.
    pub(super) wants: Option<(u64, Instant)>,
    /// Told it is stale or that the job is over: it no longer counts.
    pub(super) out: bool,
}

impl Local {
    pub(super) fn id(&self) -> &str {
        self.member.as_ref().map_or("?", |m| m.id.as_str())
    }

    pub(super) fn close(&self) {
        if let Outbox::Socket { socket, .. } = &self.outbox {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

/// The node's generation: its upstream assignment and its ranks' places in it.
pub(super) struct Generation {
    pub(super) assignment: Assignment,
    /// Member id -> rank, for the node's ranks given a place.
    pub(super) seats: BTreeMap<String, usize>,
    /// When it formed (the join timeout of ranks that have not asked yet).
    pub(super) formed: Instant,
    /// Over (a Restart, a Stale, or the node asked for a newer one).
    pub(super) over: bool,
    /// Its ranks were told that it is over (the control plane's Restart or Stale,
    /// relayed). Not so when it is over because the node asked for a newer one: a
    /// rank of it that has not asked yet hears it when the newer one is installed.
    pub(super) told: bool,
    /// One of its ranks ended it at a checkpoint boundary that every rank agreed on
    /// ([`Report::Ended`]): the others come to the rendezvous by themselves once
    /// their save has committed, and are not aborted.
    pub(super) at_boundary: bool,
    /// Keys of its key-value space, as passed on.
    pub(super) kv: Vec<(String, String)>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) locals: HashMap<LocalId, Local>,
    pub(super) next_local: LocalId,
    /// Ranks the launcher runs now.
    pub(super) expected: usize,
    pub(super) generation: Option<Generation>,
    /// Newest generation number heard of.
    pub(super) newest: u64,
    /// The rendezvous in flight upstream: (after, ranks asked for, its cancel).
    pub(super) asking: Option<(u64, usize, Cancel)>,
    /// Ranks told to the control plane by the last `hold`.
    pub(super) held: usize,
    /// When a rank first asked for the first generation.
    pub(super) first_ask: Option<Instant>,
    pub(super) shutdown: Option<String>,
    /// Since when every call upstream has failed for want of the control plane
    /// (cleared by any call that reaches it).
    pub(super) unreachable_since: Option<Instant>,
    /// A generation was ever installed: the node joined the job.
    pub(super) joined: bool,
    /// A rank of the node finished the job (reported once upstream).
    pub(super) finished: bool,
    /// The highest checkpoint generation any of its ranks ever saved with: what the
    /// control plane keeps later floors above, whatever became of the rank.
    pub(super) checkpoint_generation: u64,
}

impl State {
    /// Ranks that count: said hello, not out.
    pub(super) fn live(&self) -> impl Iterator<Item = (LocalId, &Local)> {
        self.locals
            .iter()
            .filter(|(_, l)| l.member.is_some() && !l.out)
            .map(|(&c, l)| (c, l))
    }

    pub(super) fn local_of(&self, id: &str) -> Option<LocalId> {
        self.live().find(|(_, l)| l.id() == id).map(|(c, _)| c)
    }

    pub(super) fn running(&self) -> Option<&Generation> {
        self.generation.as_ref().filter(|g| !g.over)
    }

    pub(super) fn send(&mut self, c: LocalId, message: &ServerMessage) {
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

    pub(super) fn directive(&mut self, c: LocalId, directive: Directive) {
        if let Some(local) = self.locals.get(&c) {
            debug!(rank = local.id(), ?directive, "directive to a rank");
        }
        self.send(c, &ServerMessage::Directive { directive });
    }

    /// The rank's place in the node's generation, as an assignment of one rank.
    pub(super) fn assignment_of(&self, id: &str) -> Option<Assignment> {
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
    pub(super) fn assign(&mut self, c: LocalId, assignment: Assignment) {
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
    pub(super) fn tell_stale(&mut self, c: LocalId) {
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
    pub(super) fn new(config: NodeConfig, upstream: Arc<dyn ControlPlane>) -> Shared {
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

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn policy(&self) -> Policy {
        Policy {
            min_ranks: 1,
            max_ranks: usize::MAX,
            timeouts: self.config.timeouts,
        }
    }

    /// Reports upstream, logging what cannot be sent (the control plane sees the
    /// generation end some other way, or the node is cut off).
    pub(super) fn report(&self, generation: u64, report: Report) {
        if let Err(e) = self.upstream.report(generation, &report) {
            warn!(generation, error = %e, ?report, "cannot report to the control plane");
        }
    }

    /// Reports a rank of `generation` lost; when it was the node's last live rank,
    /// the node leaves too, so that the next generation does not wait for a node
    /// with nothing to bring (it asks again as a newcomer when a rank starts again).
    pub(super) fn report_loss(&self, state: &State, generation: u64, cause: String) {
        self.report(generation, Report::RankLost { cause });
        if state.live().next().is_none() {
            let reason = "every rank of this node is gone".to_owned();
            self.report(generation, Report::Leaving { reason });
        }
    }
}
