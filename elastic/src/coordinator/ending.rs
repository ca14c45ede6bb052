//! How a generation ends, and the job: at a checkpoint boundary (nobody aborted),
//! by a Restart of its remaining members (a failure), by the job finishing (who is
//! outside the running generation is told to shut down) or by its shutdown.

use std::collections::HashSet;
use std::time::{Instant, SystemTime};

use tracing::{info, warn};

use super::Event;
use super::core::{Conn, ConnId, Core, Phase};
use crate::Directive;
use crate::policy::End;

impl Core {
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
}
