//! What the node does with what its ranks say: a rank's hello (one rank per
//! connection, a second connection replacing the first), its ask for a generation,
//! its heartbeats, its reports (a fatal error or a departure passed up as the
//! node's own report naming the rank), its snapshot requests (passed up, fenced
//! by the node's own view of who is seated first), and a rank that goes.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tracing::{debug, warn};

use super::rendezvous::grow;
use super::state::{Local, LocalId, Outbox, Shared, State};
use crate::policy::lost_member;
use crate::protocol::{self, ClientMessage, ServerMessage};
use crate::{Assignment, Directive, ElasticError, Member, Report, snapshot_not_running};

/// Most rank connections a node serves.
const MAX_LOCAL: usize = 4096;

impl Shared {
    /// A new rank connection (`None`: too many).
    pub(super) fn register(&self, outbox: Outbox) -> Option<LocalId> {
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
    pub(super) fn remove(&self, c: LocalId, reason: &str) {
        self.forget(c, reason);
        grow(self);
    }

    pub(super) fn forget(&self, c: LocalId, reason: &str) {
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

    pub(super) fn handle(&self, c: LocalId, message: ClientMessage) -> Result<bool, String> {
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

    pub(super) fn apply(&self, c: LocalId, message: ClientMessage) -> Result<bool, String> {
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
            ClientMessage::CommitSnapshot {
                token,
                generation,
                record,
            } => {
                // The node's part of the fence: a rank it no longer seats in the
                // running generation (lost, told stale) commits nothing, even
                // before the control plane hears of the loss.
                let seated = state.running().is_some_and(|g| {
                    g.assignment.generation == generation
                        && g.seats.contains_key(local_id(&state, c))
                });
                let answer = if seated {
                    drop(state);
                    let committed = self.upstream.commit_snapshot(generation, &record);
                    state = self.lock();
                    snapshot_answer(token, committed.map(|()| None))
                } else {
                    let refused = match state.running() {
                        Some(g) if g.assignment.generation == generation => {
                            ElasticError::Rejected(format!(
                                "member {:?} is not in generation {generation}; its snapshot record is not committed",
                                local_id(&state, c)
                            ))
                        }
                        running => snapshot_not_running(
                            generation,
                            running.map(|g| g.assignment.generation),
                        ),
                    };
                    snapshot_answer(token, Err(refused))
                };
                state.send(c, &answer);
                Ok(false)
            }
            ClientMessage::ReadSnapshot { token } => {
                drop(state);
                let answer = snapshot_answer(token, self.upstream.committed_snapshot());
                self.lock().send(c, &answer);
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

    pub(super) fn hello(
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

    pub(super) fn rendezvous(&self, state: &mut State, c: LocalId, after: u64, now: Instant) {
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

    pub(super) fn rank_report(
        &self,
        state: &mut State,
        c: LocalId,
        generation: u64,
        report: Report,
    ) {
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
}

/// The id of the rank on connection `c` ("?" before its hello).
fn local_id(state: &State, c: LocalId) -> &str {
    state.locals.get(&c).map_or("?", |local| local.id())
}

/// The answer to a rank's snapshot request with `token`: what the control plane
/// answered the node, with the kind of a failure kept (a refusal, or a control
/// plane out of reach that a retry may find again).
fn snapshot_answer(token: u64, answer: Result<Option<String>, ElasticError>) -> ServerMessage {
    let (record, refused, transient) = match answer {
        Ok(record) => (record, None, false),
        Err(ElasticError::Rejected(why)) => (None, Some(why), false),
        Err(ElasticError::Io(why) | ElasticError::Timeout(why)) => (None, Some(why), true),
        Err(e) => (None, Some(e.to_string()), false),
    };
    ServerMessage::SnapshotAnswer {
        token,
        record,
        refused,
        transient,
    }
}

pub(super) fn error(message: &str, fatal: bool) -> ServerMessage {
    ServerMessage::Error {
        message: message.to_owned(),
        fatal,
    }
}
