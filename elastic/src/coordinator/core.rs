//! The coordinator's state and its entry points: [`Core`] holds each connection
//! (and its outbox, which its writer task drains) and the state of the job: the
//! phase (settling, gathering, running, rejoining), the members, the generation
//! numbers and floors, the running generation's key-value space, the job's
//! committed snapshot record, and the events a launcher reads. Everything reaches it through three doors, a message
//! ([`Core::handle`]), a tick of the clock ([`Core::tick`]) and a connection gone
//! ([`Core::remove`]), all with an explicit clock, so that its rules can be tested
//! without sockets or threads.
//!
//! The rules are `impl Core` blocks beside this file, one per step of a
//! generation's life: `hello.rs` (who is let in), `formation.rs` (how the next
//! generation forms), `running.rs` (what its members say while it trains),
//! `ending.rs` (how it ends, and the job) and `adopt.rs` (what only a restarted
//! coordinator does).

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::Sender;
use tokio::sync::mpsc::error::TrySendError;
use tracing::{info, warn};

use super::server::Hangup;
use super::{CoordinatorConfig, Event};
use crate::policy::{Standing, Timers, hung_member, lost_member};
use crate::protocol::{self, ClientMessage, ServerMessage};
use crate::{Assignment, Directive, Member, Progress, roster_digest};

/// Largest generation number accepted from a member: far beyond any real job, and
/// small enough that counting up from it cannot overflow.
const MAX_GENERATION: u64 = 1 << 53;
/// Events kept for [`CoordinatorHandle::events`](super::CoordinatorHandle::events).
const MAX_EVENTS: usize = 4096;

pub(super) type ConnId = u64;

/// What the connection's reader does after a message.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    Continue,
    /// Hello accepted: the connection may now be quiet for long.
    Welcomed,
    /// Close the connection, for this reason.
    Close(String),
}

pub(super) struct Conn {
    pub(super) outbox: Sender<Arc<str>>,
    /// Ends the connection's tasks; `None` only in unit tests of [`Core`].
    pub(super) hangup: Option<Hangup>,
    pub(super) peer: SocketAddr,
    pub(super) member: Option<Member>,
    pub(super) last_seen: Instant,
    pub(super) progress: Option<Progress>,
    /// The generation it announced in hello (only kept while settling).
    pub(super) claim: Option<Assignment>,
    /// Waiting for a generation: (after, arrival order).
    pub(super) wants: Option<(u64, u64)>,
    /// The generation it is in (running, or ended and rejoining from).
    pub(super) generation: Option<u64>,
    /// The newest generation it was told Stale for.
    pub(super) stale_for: Option<u64>,
}

impl Conn {
    pub(super) fn close(&self) {
        if let Some(hangup) = &self.hangup {
            hangup.hang_up();
        }
    }

    pub(super) fn id(&self) -> &str {
        self.member.as_ref().map_or("?", |m| m.id.as_str())
    }
}

pub(super) struct Running {
    pub(super) generation: u64,
    /// Member ids in rank order (members that left on purpose are removed).
    pub(super) members: Vec<String>,
    /// Each member's first rank and rank count, as formed.
    pub(super) seats: HashMap<String, (usize, usize)>,
    /// Ranks, members and [`roster_digest`] as formed: what every assignment says.
    pub(super) world_size: usize,
    pub(super) member_count: usize,
    pub(super) roster: u64,
    /// Why a regroup was asked, once it was.
    pub(super) regroup: Option<String>,
    /// Why the last member that left on purpose left.
    pub(super) left: Option<String>,
    /// A member ended the generation at an agreed checkpoint boundary (a regroup,
    /// a stop, a member leaving after its final save): those who come to the
    /// rendezvous are not a failure, and the others are not aborted.
    pub(super) at_boundary: bool,
}

impl Running {
    /// A generation that just formed (or was adopted): `seats` are its members' ids
    /// and rank counts, in rank order.
    pub(super) fn new(generation: u64, seats: Vec<(String, usize)>) -> Running {
        let roster = roster_digest(seats.iter().map(|(id, ranks)| (id.as_str(), *ranks)));
        let mut first = 0usize;
        let mut placed = HashMap::with_capacity(seats.len());
        for (id, ranks) in &seats {
            placed.insert(id.clone(), (first, *ranks));
            first = first.saturating_add(*ranks);
        }
        Running {
            generation,
            members: seats.into_iter().map(|(id, _)| id).collect(),
            member_count: placed.len(),
            seats: placed,
            world_size: first,
            roster,
            regroup: None,
            left: None,
            at_boundary: false,
        }
    }

    /// `id`'s first rank, when it is a member.
    pub(super) fn rank_of(&self, id: &str) -> Option<usize> {
        self.seats.get(id).map(|&(first, _)| first)
    }

    /// `id`'s assignment, as formed.
    pub(super) fn assignment_of(&self, id: &str, floor: u64, cause: &str) -> Option<Assignment> {
        let &(rank, ranks) = self.seats.get(id)?;
        Some(Assignment {
            generation: self.generation,
            rank,
            ranks,
            world_size: self.world_size,
            members: self.member_count,
            roster: self.roster,
            checkpoint_generation_floor: floor,
            cause: cause.to_owned(),
        })
    }

    /// Whether `claim`, made by `id`, is this generation as formed.
    pub(super) fn claimed_by(&self, id: &str, claim: &Assignment) -> bool {
        claim.generation == self.generation
            && self.seats.get(id) == Some(&(claim.rank, claim.ranks))
            && claim.world_size == self.world_size
            && claim.members == self.member_count
            && claim.roster == self.roster
    }

    /// Where it stands, for the policy.
    pub(super) fn standing(&self) -> Standing<'_> {
        Standing {
            generation: self.generation,
            world_size: self
                .members
                .iter()
                .filter_map(|id| self.seats.get(id))
                .map(|&(_, ranks)| ranks)
                .sum(),
            regroup: self.regroup.as_deref(),
            left: self.left.as_deref(),
            at_boundary: self.at_boundary,
        }
    }
}

pub(super) enum Phase {
    /// Freshly started: collecting claims of running generations until `until`.
    Settling {
        until: Instant,
    },
    /// No generation, nobody in particular to wait for: waiting for `min_ranks`
    /// members (and the last call). `after`: the generation that ended last (the
    /// policy's windows are measured per ended generation).
    Gathering {
        after: u64,
    },
    Running(Running),
    /// A generation ended: waiting for its survivors to ask for the next one (until
    /// the join timeout).
    Rejoin {
        previous: u64,
        expected: BTreeSet<String>,
    },
}

/// The coordinator's decisions: every rule lives here, driven by messages and an
/// explicit clock.
pub(super) struct Core {
    pub(super) config: CoordinatorConfig,
    pub(super) phase: Phase,
    pub(super) conns: HashMap<ConnId, Conn>,
    pub(super) by_member: HashMap<String, ConnId>,
    pub(super) next_conn: ConnId,
    pub(super) next_arrival: u64,
    /// Newest generation number issued, adopted or announced by any member.
    pub(super) newest: u64,
    /// This coordinator formed or adopted a generation (else, after a restart, it
    /// knows nothing of how the members' last one ended).
    pub(super) formed_any: bool,
    /// Max checkpoint generation reported + 1.
    pub(super) floor: u64,
    /// The running generation's key-value space.
    pub(super) kv: HashMap<String, String>,
    /// The job's newest committed snapshot record and the generation that
    /// committed it: kept across generations, unlike `kv`.
    pub(super) snapshot: Option<(u64, String)>,
    /// Why the next generation forms.
    pub(super) cause: String,
    /// The policy's windows between generations.
    pub(super) timers: Timers,
    pub(super) members_seen: bool,
    pub(super) shutdown: Option<String>,
    /// The job finished (a member reported its final step): who asks to join now is
    /// told to shut down.
    pub(super) finished: Option<String>,
    pub(super) events: Vec<Event>,
    pub(super) event_count: u64,
}

impl Core {
    pub(super) fn new(config: CoordinatorConfig, now: Instant) -> Core {
        let until = now + config.settle;
        Core {
            config,
            phase: Phase::Settling { until },
            conns: HashMap::new(),
            by_member: HashMap::new(),
            next_conn: 0,
            next_arrival: 0,
            newest: 0,
            formed_any: false,
            finished: None,
            floor: 0,
            kv: HashMap::new(),
            snapshot: None,
            cause: "initial".into(),
            timers: Timers::default(),
            members_seen: false,
            shutdown: None,
            events: Vec::new(),
            event_count: 0,
        }
    }

    pub(super) fn register(
        &mut self,
        hangup: Option<Hangup>,
        outbox: Sender<Arc<str>>,
        peer: SocketAddr,
    ) -> Option<ConnId> {
        if self.conns.len() >= self.config.max_connections {
            return None;
        }
        let id = self.next_conn;
        self.next_conn += 1;
        self.conns.insert(
            id,
            Conn {
                outbox,
                hangup,
                peer,
                member: None,
                last_seen: Instant::now(),
                progress: None,
                claim: None,
                wants: None,
                generation: None,
                stale_for: None,
            },
        );
        Some(id)
    }

    pub(super) fn event(&mut self, event: Event) {
        if self.events.len() >= MAX_EVENTS {
            self.events.remove(0);
        }
        self.events.push(event);
        self.event_count += 1;
    }

    pub(super) fn send(&mut self, c: ConnId, message: &ServerMessage) {
        let Some(conn) = self.conns.get(&c) else {
            return;
        };
        let line = match protocol::encode(message) {
            Ok(line) => Arc::<str>::from(line),
            Err(e) => {
                warn!(member = conn.id(), error = %e, "cannot encode a message");
                return;
            }
        };
        match conn.outbox.try_send(line) {
            Ok(()) | Err(TrySendError::Closed(_)) => {}
            Err(TrySendError::Full(_)) => {
                warn!(member = conn.id(), peer = %conn.peer, "member does not read; disconnecting it");
                conn.close();
            }
        }
    }

    pub(super) fn directive(&mut self, c: ConnId, directive: Directive) {
        self.send(c, &ServerMessage::Directive { directive });
    }

    pub(super) fn error(&mut self, c: ConnId, message: &str, fatal: bool) {
        if let Some(conn) = self.conns.get(&c) {
            warn!(member = conn.id(), peer = %conn.peer, fatal, "refused: {message}");
        }
        self.send(
            c,
            &ServerMessage::Error {
                message: message.to_owned(),
                fatal,
            },
        );
    }

    pub(super) fn conn_of(&self, id: &str) -> Option<ConnId> {
        self.by_member.get(id).copied()
    }

    pub(super) fn handle(&mut self, c: ConnId, message: ClientMessage, now: Instant) -> Outcome {
        let Some(conn) = self.conns.get_mut(&c) else {
            return Outcome::Close("unknown connection".into());
        };
        conn.last_seen = now;
        let hello_done = conn.member.is_some();
        let numbers = match &message {
            ClientMessage::Hello { seen, claim, .. } => {
                vec![*seen, claim.as_ref().map_or(0, |a| a.generation)]
            }
            ClientMessage::Rendezvous { after } => vec![*after],
            ClientMessage::Hold { .. }
            | ClientMessage::Sync { .. }
            | ClientMessage::ReadSnapshot { .. } => Vec::new(),
            ClientMessage::Heartbeat { generation, .. }
            | ClientMessage::Report { generation, .. }
            | ClientMessage::KvSet { generation, .. }
            | ClientMessage::CommitSnapshot { generation, .. } => vec![*generation],
        };
        if let Some(bad) = numbers.into_iter().find(|&g| g > MAX_GENERATION) {
            let text = format!("generation {bad} is out of range (at most {MAX_GENERATION})");
            self.error(c, &text, false);
            return Outcome::Continue;
        }
        match message {
            ClientMessage::Hello {
                version,
                member,
                seen,
                checkpoint_generation,
                claim,
            } => {
                if hello_done {
                    self.error(c, "hello sent twice on one connection", false);
                    return Outcome::Continue;
                }
                self.hello(c, version, member, seen, checkpoint_generation, claim, now)
            }
            _ if !hello_done => {
                let text = "the first message must be hello";
                self.error(c, text, true);
                Outcome::Close(text.into())
            }
            ClientMessage::Rendezvous { after } => {
                self.rendezvous(c, after, now);
                Outcome::Continue
            }
            ClientMessage::Hold { ranks } => {
                self.hold(c, ranks, now);
                Outcome::Continue
            }
            ClientMessage::Heartbeat {
                generation,
                progress,
            } => {
                self.heartbeat(c, generation, progress);
                Outcome::Continue
            }
            ClientMessage::Report { generation, report } => {
                self.report(c, generation, report, now);
                Outcome::Continue
            }
            ClientMessage::KvSet {
                generation,
                key,
                value,
            } => {
                self.kv_set(c, generation, key, value);
                Outcome::Continue
            }
            ClientMessage::CommitSnapshot {
                token,
                generation,
                record,
            } => {
                let refused = self.commit_snapshot(c, generation, record).err();
                let answer = ServerMessage::SnapshotAnswer {
                    token,
                    record: None,
                    refused,
                    transient: false,
                };
                self.send(c, &answer);
                Outcome::Continue
            }
            ClientMessage::ReadSnapshot { token } => {
                let answer = ServerMessage::SnapshotAnswer {
                    token,
                    record: self.snapshot.as_ref().map(|(_, record)| record.clone()),
                    refused: None,
                    transient: false,
                };
                self.send(c, &answer);
                Outcome::Continue
            }
            ClientMessage::Sync { token } => {
                // The connection's messages are handled in order: all before this
                // one are done.
                self.send(c, &ServerMessage::Synced { token });
                Outcome::Continue
            }
        }
    }

    pub(super) fn tell_stale(&mut self, c: ConnId, generation: u64) {
        let current = self.newest;
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        if conn.stale_for.is_some_and(|told| told >= generation) {
            return;
        }
        conn.stale_for = Some(generation);
        if conn.generation == Some(generation) {
            conn.generation = None;
        }
        info!(
            member = conn.id(),
            generation, current, "member told its generation is stale"
        );
        self.directive(c, Directive::Stale { current });
    }

    /// A message about a generation this connection is not in.
    pub(super) fn not_in_generation(&mut self, c: ConnId, generation: u64, what: &str) {
        if matches!(self.phase, Phase::Settling { .. }) {
            // Members announce numbers from before the restart; they are not errors.
            self.newest = self.newest.max(generation);
            return;
        }
        if generation > self.newest {
            let message = format!(
                "{what} for generation {generation}, which is from the future: the newest is {}",
                self.newest
            );
            self.error(c, &message, false);
        } else {
            self.tell_stale(c, generation);
        }
    }

    pub(super) fn connected(&self, ids: &[String]) -> BTreeSet<String> {
        ids.iter()
            .filter(|id| self.by_member.contains_key(*id))
            .cloned()
            .collect()
    }

    pub(super) fn tick(&mut self, now: Instant) {
        if self.shutdown.is_some() {
            return;
        }
        match &self.phase {
            Phase::Settling { until } => {
                if now >= *until {
                    self.end_settling(now);
                }
            }
            Phase::Running(running) => {
                let policy = self.config.policy();
                let mut lost = Vec::new();
                let mut causes = Vec::new();
                for id in &running.members {
                    let Some(conn) = self.by_member.get(id).and_then(|c| self.conns.get(c)) else {
                        continue;
                    };
                    let silent = now.saturating_duration_since(conn.last_seen);
                    if silent > policy.timeouts.heartbeat_timeout {
                        lost.push(id.clone());
                        causes.push(lost_member(
                            id,
                            format_args!("no heartbeat for {} ms", silent.as_millis()),
                        ));
                    } else if let Some(p) = &conn.progress
                        && policy.hung(p)
                    {
                        lost.push(id.clone());
                        causes.push(hung_member(id, p.idle_ms));
                    }
                }
                if !lost.is_empty() {
                    self.restart(causes.join("; "), &lost, true, now);
                }
            }
            Phase::Gathering { .. } | Phase::Rejoin { .. } => self.try_form(now),
        }
        if matches!(self.phase, Phase::Running(_) | Phase::Settling { .. }) {
            self.timers.running();
        }
    }

    /// The connection is gone (closed, broken, replaced).
    pub(super) fn remove(&mut self, c: ConnId, reason: &str, now: Instant) {
        let Some(conn) = self.conns.remove(&c) else {
            return;
        };
        // Dropping the outbox lets the writer send what is queued (a final error),
        // then close the socket.
        let Some(member) = conn.member else {
            return;
        };
        if self.by_member.get(&member.id) != Some(&c) {
            return;
        }
        self.by_member.remove(&member.id);
        let id = member.id;
        match &self.phase {
            Phase::Running(running) if running.members.contains(&id) => {
                let cause = lost_member(&id, reason);
                self.restart(cause, std::slice::from_ref(&id), false, now);
            }
            Phase::Settling { .. } | Phase::Running(_) => {}
            Phase::Gathering { .. } | Phase::Rejoin { .. } => self.try_form_soon(now),
        }
    }
}
