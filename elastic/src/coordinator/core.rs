//! The coordinator's decisions: every rule lives in [`Core`], driven by messages and
//! an explicit clock, so that it can be tested without sockets or threads.
//!
//! The core owns each connection's outbox (its writer task drains it) and the
//! state of the job: the phase (settling, gathering, running, rejoining), the
//! members, the generation numbers and floors, the running generation's key-value
//! space, and the events a launcher reads.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tokio::sync::mpsc::Sender;
use tokio::sync::mpsc::error::TrySendError;
use tracing::{info, warn};

use super::adopt::claim_is_coherent;
use super::server::Hangup;
use super::{CoordinatorConfig, Event};
use crate::policy::{
    Action, Between, Candidate, Effect, End, Standing, Timers, ends_membership, hung_member,
    job_finished, lost_member, withdrawal,
};
use crate::protocol::{self, ClientMessage, ServerMessage};
use crate::{Assignment, Directive, MAX_RANKS_PER_MEMBER, Member, Progress, Report, roster_digest};

/// Keys per generation's key-value space.
const MAX_KEYS: usize = 4096;
/// Largest generation number accepted from a member: far beyond any real job, and
/// small enough that counting up from it cannot overflow.
const MAX_GENERATION: u64 = 1 << 53;
/// Connections up to which a member's ask is answered at once rather than at the
/// next tick (see [`Core::try_form_soon`]).
const FORM_AT_ONCE_UP_TO: usize = 64;
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
    fn standing(&self) -> Standing<'_> {
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
            ClientMessage::Hold { .. } | ClientMessage::Sync { .. } => Vec::new(),
            ClientMessage::Heartbeat { generation, .. }
            | ClientMessage::Report { generation, .. }
            | ClientMessage::KvSet { generation, .. } => vec![*generation],
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
            ClientMessage::Sync { token } => {
                // The connection's messages are handled in order: all before this
                // one are done.
                self.send(c, &ServerMessage::Synced { token });
                Outcome::Continue
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn hello(
        &mut self,
        c: ConnId,
        version: u32,
        member: Member,
        seen: u64,
        checkpoint_generation: u64,
        claim: Option<Assignment>,
        now: Instant,
    ) -> Outcome {
        let refusal = if let Some(refusal) =
            protocol::hello_refusal(version, &member, &self.config.job, "coordinator")
        {
            Some(refusal)
        } else if member.ranks == 0 || member.ranks > MAX_RANKS_PER_MEMBER {
            Some(format!(
                "member {:?} holds {} ranks; a member holds 1 to {MAX_RANKS_PER_MEMBER}",
                member.id, member.ranks
            ))
        } else {
            None
        };
        if let Some(refusal) = refusal {
            self.error(c, &refusal, true);
            return Outcome::Close(refusal);
        }
        let claim = match claim {
            Some(claim) if !claim_is_coherent(&claim, &member) => {
                self.error(
                    c,
                    &format!(
                        "claimed generation {} is not coherent with member {:?} (rank {}, {} of {} ranks, {} members); claim ignored",
                        claim.generation,
                        member.id,
                        claim.rank,
                        claim.ranks,
                        claim.world_size,
                        claim.members
                    ),
                    false,
                );
                None
            }
            claim => claim,
        };
        self.members_seen = true;
        self.newest = self.newest.max(seen);
        self.floor = self.floor.max(checkpoint_generation.saturating_add(1));
        if let Some(claim) = &claim {
            self.newest = self.newest.max(claim.generation);
            self.floor = self.floor.max(claim.checkpoint_generation_floor);
        }
        let id = member.id.clone();
        // A second connection for the same member replaces the first: it keeps the
        // first one's place only if it claims exactly the running generation.
        let reattach = match (&self.phase, &claim) {
            (Phase::Running(running), Some(claim)) => {
                running.members.contains(&id) && running.claimed_by(&id, claim)
            }
            _ => false,
        };
        if let Some(old) = self.conn_of(&id).filter(|&old| old != c) {
            if reattach {
                self.by_member.insert(id.clone(), c);
                self.remove(old, "replaced by a new connection", now);
            } else {
                self.remove(
                    old,
                    "replaced by a new connection without its generation",
                    now,
                );
            }
        }
        self.by_member.insert(id.clone(), c);
        let Some(conn) = self.conns.get_mut(&c) else {
            return Outcome::Close("connection removed".into());
        };
        conn.member = Some(member);
        let welcome = ServerMessage::Welcome {
            job: self.config.job.clone(),
            generation: self.newest,
        };
        self.send(c, &welcome);
        if let Some(reason) = self.shutdown.clone() {
            self.directive(c, Directive::Shutdown { reason });
            return Outcome::Welcomed;
        }
        let Some(claim) = claim else {
            return Outcome::Welcomed;
        };
        let claimed = claim.generation;
        match &self.phase {
            Phase::Settling { .. } => {
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = Some(claimed);
                    conn.claim = Some(claim);
                }
                self.try_adopt(now);
            }
            Phase::Running(_) if reattach => {
                info!(member = %id, generation = claimed, "member reconnected to its generation");
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = Some(claimed);
                }
            }
            Phase::Rejoin {
                previous, expected, ..
            } if *previous == claimed && expected.contains(&id) => {
                // It may have missed the Restart while it was disconnected.
                let cause = self.cause.clone();
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = Some(claimed);
                }
                self.directive(
                    c,
                    Directive::Restart {
                        generation: claimed,
                        cause,
                    },
                );
            }
            _ => self.tell_stale(c, claimed),
        }
        Outcome::Welcomed
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

    pub(super) fn rendezvous(&mut self, c: ConnId, after: u64, now: Instant) {
        if let Some(reason) = self.shutdown.clone().or_else(|| self.finished.clone()) {
            self.directive(c, Directive::Shutdown { reason });
            return;
        }
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        let id = conn.id().to_owned();
        let in_generation = conn.generation;
        conn.claim = None;
        if let Phase::Running(running) = &self.phase
            && in_generation == Some(running.generation)
        {
            if running.generation > after {
                // Asked again (after a reconnect): answer again.
                let running_generation = running.generation;
                self.assign_again(c, running_generation);
                return;
            }
            self.leave_running(&id, now);
        }
        // Numbers stay above whatever the member knew (also from before a restart).
        if after > 0 && !self.formed_any && self.cause == "initial" {
            // A generation this coordinator never saw ended while it was down.
            self.cause = format!(
                "members of generation {after} rejoined a restarted coordinator (what ended generation {after} happened while it was down)"
            );
        }
        self.newest = self.newest.max(after);
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        if let Some(conn) = self.conns.get_mut(&c)
            && conn.wants.is_none()
        {
            conn.wants = Some((after, arrival));
        }
        self.try_form_soon(now);
    }

    pub(super) fn assign_again(&mut self, c: ConnId, generation: u64) {
        let Phase::Running(running) = &self.phase else {
            return;
        };
        if running.generation != generation
            || running
                .members
                .iter()
                .any(|id| !self.by_member.contains_key(id))
        {
            return;
        }
        let Some(conn) = self.conns.get(&c) else {
            return;
        };
        let Some(assignment) = running.assignment_of(conn.id(), self.floor, &self.cause) else {
            return;
        };
        self.send(c, &ServerMessage::Assigned { assignment });
    }

    /// A running member asked for a new generation: the running one is over.
    pub(super) fn leave_running(&mut self, id: &str, now: Instant) {
        let Phase::Running(running) = &self.phase else {
            return;
        };
        match self
            .config
            .policy()
            .on_rendezvous_while_running(id, &running.standing())
        {
            End::AtBoundary { cause } => {
                // Everybody comes at their checkpoint boundary: no abort.
                let previous = running.generation;
                let expected = self.connected(&running.members);
                info!(
                    generation = previous,
                    "generation ended at a checkpoint boundary: {cause}"
                );
                self.event(Event::Ended {
                    generation: previous,
                    cause: cause.clone(),
                    at: SystemTime::now(),
                });
                self.cause = cause;
                self.kv.clear();
                self.phase = Phase::Rejoin { previous, expected };
            }
            End::Abort { cause } => self.restart(cause, &[id.to_owned()], false, now),
        }
    }

    pub(super) fn connected(&self, ids: &[String]) -> BTreeSet<String> {
        ids.iter()
            .filter(|id| self.by_member.contains_key(*id))
            .cloned()
            .collect()
    }

    pub(super) fn heartbeat(&mut self, c: ConnId, generation: u64, progress: Progress) {
        self.floor = self
            .floor
            .max(progress.checkpoint_generation.saturating_add(1));
        if generation == 0 {
            return;
        }
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        match conn.generation {
            Some(g) if g == generation => {
                conn.progress = Some(progress);
            }
            // Sent before it read its newer assignment.
            Some(g) if g > generation => {}
            _ => self.not_in_generation(c, generation, "heartbeat"),
        }
    }

    pub(super) fn report(&mut self, c: ConnId, generation: u64, report: Report, now: Instant) {
        let waiting = self.waiting();
        let policy = self.config.policy();
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        let id = conn.id().to_owned();
        if ends_membership(&report) {
            conn.wants = None;
        }
        let in_it = generation != 0 && conn.generation == Some(generation);
        if let Report::Finished { step } = report {
            // Whatever the phase: the job is over once a member of a generation
            // trained to the last step in it.
            if in_it {
                self.finish(job_finished(&id, step));
            }
            return;
        }
        match &mut self.phase {
            Phase::Running(running) if in_it && running.generation == generation => {
                let rank = running.rank_of(&id).unwrap_or(0);
                match policy.on_report(&id, rank, &report, &running.standing(), waiting) {
                    Effect::None | Effect::Finished { .. } => {}
                    Effect::Restart {
                        cause,
                        drop_reporter,
                    } => {
                        let dropped = if drop_reporter { vec![id] } else { Vec::new() };
                        self.restart(cause, &dropped, false, now);
                    }
                    Effect::Leave { cause } => {
                        // Leaving is not a failure: the member leaves at a point the
                        // whole world agreed on (its final save committed, or the job
                        // finished), so the others are not aborted; they rendezvous
                        // again by themselves and form the next generation without
                        // it. (If they went on training instead, the member's exit
                        // would fail their next collective, which they report.)
                        info!(generation, "{cause}");
                        running.members.retain(|m| *m != id);
                        running.at_boundary = true;
                        running.left = Some(cause.clone());
                        let emptied = running.members.is_empty();
                        if let Some(conn) = self.conns.get_mut(&c) {
                            conn.generation = None;
                        }
                        self.cause = cause.clone();
                        self.event(Event::Left {
                            generation,
                            member: id,
                            cause,
                            at: SystemTime::now(),
                        });
                        if emptied {
                            self.phase = Phase::Gathering { after: generation };
                        }
                    }
                    Effect::Regroup { cause } => {
                        running.regroup = Some(cause.clone());
                        self.regroup(generation, cause);
                    }
                    Effect::RankLeft { cause } => {
                        info!(generation, "{cause}");
                        running.at_boundary = true;
                        running.left = Some(cause.clone());
                        self.cause = cause;
                    }
                    Effect::AtBoundary => {
                        info!(
                            generation,
                            "member {id} (rank {rank}) ended the generation at a checkpoint"
                        );
                        running.at_boundary = true;
                    }
                }
            }
            Phase::Rejoin { previous, expected } if in_it && *previous == generation => {
                if let Some(root_cause) = withdrawal(&id, &report) {
                    if let Some(root_cause) = root_cause {
                        self.cause = root_cause;
                    }
                    expected.remove(&id);
                    if let Some(conn) = self.conns.get_mut(&c) {
                        conn.generation = None;
                    }
                    self.try_form(now);
                }
            }
            _ if generation == 0 || in_it => {}
            _ => self.not_in_generation(c, generation, "report"),
        }
    }

    /// The job is done: every member outside the running generation (waiting to
    /// join, or connected and not asking yet: a node agent whose ranks are still
    /// starting) is told to shut down, and so is any that asks later; the running
    /// generation's members leave by themselves. A member told nothing would learn
    /// of the end only from the coordinator's going, which says nothing of how the
    /// job ended.
    pub(super) fn finish(&mut self, reason: String) {
        if self.finished.is_some() {
            return;
        }
        info!("{reason}");
        self.finished = Some(reason.clone());
        let running: HashSet<&str> = match &self.phase {
            Phase::Running(running) => running.members.iter().map(String::as_str).collect(),
            _ => HashSet::new(),
        };
        let newest = self.newest;
        let in_generation =
            |conn: &Conn| running.contains(conn.id()) || conn.generation == Some(newest);
        let waiting: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, conn)| {
                conn.member.is_some() && (conn.wants.is_some() || !in_generation(conn))
            })
            .map(|(&c, _)| c)
            .collect();
        for c in waiting {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.wants = None;
            }
            self.directive(
                c,
                Directive::Shutdown {
                    reason: reason.clone(),
                },
            );
        }
    }

    /// Asks the members of the running generation to regroup at their next
    /// checkpoint (members wait to join).
    fn regroup(&mut self, generation: u64, cause: String) {
        let Phase::Running(running) = &self.phase else {
            return;
        };
        info!(generation, "regroup: {cause}");
        let members: Vec<ConnId> = running
            .members
            .iter()
            .filter_map(|id| self.by_member.get(id).copied())
            .collect();
        self.cause = cause.clone();
        for c in members {
            self.directive(
                c,
                Directive::Regroup {
                    generation,
                    cause: cause.clone(),
                },
            );
        }
    }

    pub(super) fn kv_set(&mut self, c: ConnId, generation: u64, key: String, value: String) {
        let Some(conn) = self.conns.get(&c) else {
            return;
        };
        let running = match &self.phase {
            Phase::Running(running) if running.generation == generation => running,
            _ => {
                if generation > self.newest {
                    self.not_in_generation(c, generation, "kv_set");
                } else {
                    let message = format!(
                        "generation {generation} is not running (newest {}); key {key:?} not set",
                        self.newest
                    );
                    self.error(c, &message, false);
                }
                return;
            }
        };
        if conn.generation != Some(generation) {
            let message = format!(
                "member {:?} is not in generation {generation}; key {key:?} not set",
                conn.id()
            );
            self.error(c, &message, false);
            return;
        }
        if self.kv.len() >= MAX_KEYS && !self.kv.contains_key(&key) {
            let message =
                format!("generation {generation} already has {MAX_KEYS} keys; key {key:?} not set");
            self.error(c, &message, false);
            return;
        }
        let members: Vec<ConnId> = running
            .members
            .iter()
            .filter_map(|id| self.by_member.get(id).copied())
            .collect();
        let update = ServerMessage::Kv {
            generation,
            key: key.clone(),
            value: value.clone(),
        };
        self.kv.insert(key, value);
        for member in members {
            self.send(member, &update);
        }
    }

    /// Ends the running generation: drops `dropped` (telling them Stale when
    /// `stale`), sends Restart to the rest and waits for them to rejoin.
    pub(super) fn restart(&mut self, cause: String, dropped: &[String], stale: bool, now: Instant) {
        let Phase::Running(running) = &self.phase else {
            return;
        };
        let generation = running.generation;
        let remaining: Vec<String> = running
            .members
            .iter()
            .filter(|id| !dropped.contains(id))
            .cloned()
            .collect();
        info!(generation, "generation ended: {cause}");
        self.event(Event::Ended {
            generation,
            cause: cause.clone(),
            at: SystemTime::now(),
        });
        self.cause = cause.clone();
        self.kv.clear();
        for id in dropped {
            if let Some(c) = self.conn_of(id) {
                if stale {
                    self.tell_stale(c, generation);
                } else if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = None;
                }
            }
        }
        let expected = self.connected(&remaining);
        for id in &expected {
            if let Some(c) = self.conn_of(id) {
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.progress = None;
                }
                self.directive(
                    c,
                    Directive::Restart {
                        generation,
                        cause: cause.clone(),
                    },
                );
            }
        }
        self.phase = if expected.is_empty() {
            Phase::Gathering { after: generation }
        } else {
            Phase::Rejoin {
                previous: generation,
                expected,
            }
        };
        self.try_form(now);
    }

    /// Members waiting to join: those asking for a generation, and members of the
    /// running one that now hold more ranks than they were given (a node whose rank
    /// was started again).
    pub(super) fn waiting(&self) -> usize {
        let running = match &self.phase {
            Phase::Running(running) => Some(running),
            _ => None,
        };
        self.conns
            .values()
            .filter(|c| {
                let Some(member) = &c.member else {
                    return false;
                };
                let grows = running.is_some_and(|r| {
                    c.generation == Some(r.generation)
                        && r.seats
                            .get(&member.id)
                            .is_some_and(|&(_, seat)| member.ranks > seat)
                });
                c.wants.is_some() || grows
            })
            .count()
    }

    /// The member now holds `ranks` ranks: they count from the next formation.
    pub(super) fn hold(&mut self, c: ConnId, ranks: usize, now: Instant) {
        if ranks == 0 || ranks > MAX_RANKS_PER_MEMBER {
            let text = format!("a member holds 1 to {MAX_RANKS_PER_MEMBER} ranks, not {ranks}");
            self.error(c, &text, false);
            return;
        }
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        let Some(member) = conn.member.as_mut() else {
            return;
        };
        if member.ranks != ranks {
            info!(member = %member.id, from = member.ranks, to = ranks, "member holds another number of ranks");
            member.ranks = ranks;
        }
        if conn.wants.is_some() {
            self.try_form_soon(now);
        }
    }

    /// Between generations, after a member asked, changed its ranks or went: in a
    /// small job the policy is asked now; in a large one the next tick asks it
    /// (within 10 ms). Asking walks every connection, so thousands of members
    /// asking together would otherwise cost thousands of walks, and the last call
    /// could end before the coordinator has read every ask.
    pub(super) fn try_form_soon(&mut self, now: Instant) {
        if self.conns.len() <= FORM_AT_ONCE_UP_TO {
            self.try_form(now);
        }
    }

    /// Between generations: asks the policy whether the next one forms (or the job
    /// is shut down), and does what it says.
    pub(super) fn try_form(&mut self, now: Instant) {
        // Before any member said hello there is nobody to form with or to shut down
        // for; once the job finished, nobody is awaited.
        if self.shutdown.is_some() || self.finished.is_some() || !self.members_seen {
            return;
        }
        let (ended, survivors) = match &mut self.phase {
            Phase::Settling { .. } | Phase::Running(_) => return,
            Phase::Gathering { after } => (*after, None),
            Phase::Rejoin { previous, expected } => {
                expected.retain(|id| self.by_member.contains_key(id));
                (
                    *previous,
                    Some(expected.iter().cloned().collect::<Vec<_>>()),
                )
            }
        };
        let waiting: Vec<(ConnId, &Member, u64)> = self
            .conns
            .iter()
            .filter_map(|(&c, conn)| Some((c, conn.member.as_ref()?, conn.wants?.1)))
            .collect();
        let candidates: Vec<Candidate<'_>> = waiting
            .iter()
            .map(|&(_, member, arrival)| Candidate { member, arrival })
            .collect();
        let between = Between {
            ended,
            survivors: survivors.as_deref(),
            waiting: &candidates,
        };
        let decision = self.config.policy().decide(&between, &mut self.timers, now);
        let chosen: Vec<(Member, ConnId)> = match &decision.action {
            Action::Form(members) => {
                let conn_of: HashMap<&str, ConnId> = waiting
                    .iter()
                    .map(|&(c, member, _)| (member.id.as_str(), c))
                    .collect();
                members
                    .iter()
                    .filter_map(|m| Some((m.clone(), *conn_of.get(m.id.as_str())?)))
                    .collect()
            }
            Action::Wait | Action::ShutDown(_) => Vec::new(),
        };
        for id in &decision.late {
            warn!(member = %id, generation = ended, "member did not rejoin in time; dropped");
            if let Phase::Rejoin { expected, .. } = &mut self.phase {
                expected.remove(id);
            }
            if let Some(c) = self.conn_of(id) {
                self.tell_stale(c, ended);
            }
        }
        match decision.action {
            Action::Wait => {}
            Action::Form(_) => self.form(chosen, now),
            Action::ShutDown(reason) => self.shut_down(reason),
        }
    }

    /// Forms the next generation of `chosen`, in rank order.
    pub(super) fn form(&mut self, chosen: Vec<(Member, ConnId)>, now: Instant) {
        let generation = self.newest + 1;
        self.newest = generation;
        self.formed_any = true;
        let cause = std::mem::replace(&mut self.cause, "initial".into());
        let running = Running::new(
            generation,
            chosen
                .iter()
                .map(|(m, _)| (m.id.clone(), m.ranks))
                .collect(),
        );
        for (member, c) in &chosen {
            if let Some(conn) = self.conns.get_mut(c) {
                conn.wants = None;
                conn.generation = Some(generation);
                conn.last_seen = now;
                conn.progress = None;
                conn.claim = None;
                conn.stale_for = None;
            }
            if let Some(assignment) = running.assignment_of(&member.id, self.floor, &cause) {
                self.send(*c, &ServerMessage::Assigned { assignment });
            }
        }
        let ids = running.members.clone();
        if ids.len() <= 64 {
            info!(
                generation,
                world_size = running.world_size,
                members = ?ids,
                "generation formed: {cause}"
            );
        } else {
            info!(
                generation,
                world_size = running.world_size,
                members = ids.len(),
                "generation formed: {cause}"
            );
        }
        self.event(Event::Formed {
            generation,
            members: ids.clone(),
            world_size: running.world_size,
            cause: cause.clone(),
            adopted: false,
            at: SystemTime::now(),
        });
        self.cause = cause;
        self.kv.clear();
        self.timers.running();
        self.phase = Phase::Running(running);
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

    pub(super) fn shut_down(&mut self, reason: String) {
        warn!("job shut down: {reason}");
        self.event(Event::Shutdown {
            reason: reason.clone(),
            at: SystemTime::now(),
        });
        self.shutdown = Some(reason.clone());
        self.kv.clear();
        self.phase = Phase::Gathering { after: self.newest };
        let all: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, conn)| conn.member.is_some())
            .map(|(&c, _)| c)
            .collect();
        for c in all {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.wants = None;
                conn.generation = None;
            }
            self.directive(
                c,
                Directive::Shutdown {
                    reason: reason.clone(),
                },
            );
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
