//! Between generations: members ask to join (or change the ranks they hold), the
//! policy decides when the next generation forms and of whom, and the core forms
//! it: numbers it above every number known, places its members in rank order and
//! sends each its assignment.

use std::collections::HashMap;
use std::time::{Instant, SystemTime};

use tracing::{info, warn};

use super::Event;
use super::core::{ConnId, Core, Phase, Running};
use crate::policy::{Action, Between, Candidate};
use crate::protocol::ServerMessage;
use crate::{Directive, MAX_RANKS_PER_MEMBER, Member};

/// Connections up to which a member's ask is answered at once rather than at the
/// next tick (see [`Core::try_form_soon`]).
const FORM_AT_ONCE_UP_TO: usize = 64;

impl Core {
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
}
