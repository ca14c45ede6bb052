//! What the members of the running generation say while it trains: heartbeats
//! (their progress and checkpoint generation, which raise the floor), reports
//! (each weighed by the policy: a failure, a departure, a regroup, a boundary, the
//! end of the job), the keys of its key-value space, and the commits of the job's
//! snapshot record, which only a member of the running generation may make.

use std::time::{Instant, SystemTime};

use tracing::{debug, info};

use super::Event;
use super::core::{ConnId, Core, Phase};
use crate::policy::{Effect, ends_membership, job_finished, withdrawal};
use crate::protocol::ServerMessage;
use crate::{
    Directive, ElasticError, Progress, Report, check_snapshot_record, snapshot_not_running,
    snapshot_superseded,
};

/// Keys per generation's key-value space.
const MAX_KEYS: usize = 4096;

impl Core {
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

    /// Records `record` as the job's committed snapshot for `generation`, when that
    /// is the running generation and the member on `c` is in it; else why not (in
    /// words, for the answer). Kept across generations: re-formations clear `kv`,
    /// never this.
    pub(super) fn commit_snapshot(
        &mut self,
        c: ConnId,
        generation: u64,
        record: String,
    ) -> Result<(), String> {
        let refusal = |e: ElasticError| match e {
            ElasticError::Rejected(why) => why,
            other => other.to_string(),
        };
        check_snapshot_record(&record).map_err(refusal)?;
        let running = match &self.phase {
            Phase::Running(running) => Some(running.generation),
            _ => None,
        };
        if running != Some(generation) {
            return Err(refusal(snapshot_not_running(generation, running)));
        }
        let Some(conn) = self.conns.get(&c) else {
            return Err("connection removed".into());
        };
        if conn.generation != Some(generation) {
            return Err(format!(
                "member {:?} is not in generation {generation}; its snapshot record is not committed",
                conn.id()
            ));
        }
        if let Some((newer, _)) = self.snapshot.as_ref().filter(|(g, _)| *g > generation) {
            return Err(refusal(snapshot_superseded(generation, *newer)));
        }
        debug!(
            generation,
            member = conn.id(),
            bytes = record.len(),
            "snapshot record committed"
        );
        self.snapshot = Some((generation, record));
        Ok(())
    }
}
