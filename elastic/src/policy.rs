//! The formation policy: when a generation forms and who is in it, in which order;
//! what a member's report does to the running generation; when the world grows;
//! when a job with too few members is shut down; and the words of every cause.
//!
//! # Why one policy
//!
//! Two backends decide the same things from different state: the built-in
//! coordinator from its connections, under one mutex ([`crate::coordinator`]), and
//! every etcd agent from its mirror of the job's keys, proposing the result in a
//! compare-and-swap ([`crate::etcd::rules`]). When each wrote the rules out itself they
//! drifted (one waited a last call where the other formed at once, one started the
//! join deadline at the end of a generation and the other once enough members
//! waited, one named a member who left in the next generation's cause and the other
//! did not). Here the rules are written once. Each backend only translates its state
//! into the policy's terms ([`Between`], [`Standing`], [`Candidate`]) and applies
//! the answer in its own way: the coordinator sends messages, an etcd agent writes a
//! record.
//!
//! Pure: no I/O and no clock of its own. Time is passed in, and the windows that
//! span calls are measured by a [`Timers`] that the caller keeps (the coordinator
//! one, each etcd agent one of its own; any agent's proposal is valid, and the
//! transaction picks one).

use std::collections::HashSet;
use std::fmt::Display;
use std::time::{Duration, Instant};

use crate::timeouts::Timeouts;
use crate::{Member, Progress, Report};

/// What the policy decides with: the size bounds of a generation and the windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Fewest ranks of a generation (the sum of its members' [`Member::ranks`]).
    pub min_ranks: usize,
    /// Most ranks of a generation; members that would exceed it wait.
    pub max_ranks: usize,
    /// The formation and failure windows.
    pub timeouts: Timeouts,
}

/// The windows that run between calls, measured from when their condition was first
/// seen. Keyed by the generation that ended, so that a new one starts afresh.
#[derive(Debug, Default, Clone)]
pub struct Timers {
    /// (ended generation, when `min_ranks` members were first seen waiting): the
    /// last call's start.
    min_since: Option<(u64, Instant)>,
    /// (ended generation, when its end was first seen): the join deadline's start.
    ended_seen: Option<(u64, Instant)>,
    /// When fewer than `min_ranks` members were first seen waiting.
    below_min_since: Option<Instant>,
}

impl Timers {
    /// A generation runs (or a restarted coordinator settles): the windows of the
    /// wait between generations start again from the next end.
    pub fn running(&mut self) {
        self.min_since = None;
        self.below_min_since = None;
    }

    fn since(slot: &mut Option<(u64, Instant)>, ended: u64, now: Instant) -> Instant {
        match *slot {
            Some((key, at)) if key == ended => at,
            _ => {
                *slot = Some((ended, now));
                now
            }
        }
    }
}

/// A member asking for a generation.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    /// Who.
    pub member: &'a Member,
    /// When it asked, in the backend's order (a counter, an etcd revision): among
    /// members of equal standing, the earlier ones get the places.
    pub arrival: u64,
}

/// The world between two generations, as the policy needs it.
#[derive(Debug, Clone, Copy)]
pub struct Between<'a> {
    /// The generation that ended (0: none formed yet). The windows are measured per
    /// ended generation.
    pub ended: u64,
    /// The survivors the next generation waits for, up to the join timeout (only
    /// those still present). `None` when it waits for nobody in particular: no
    /// generation formed yet, or the last one ended with no survivor; then the last
    /// call groups the members that arrive together.
    pub survivors: Option<&'a [String]>,
    /// The members asking for a generation.
    pub waiting: &'a [Candidate<'a>],
}

/// What the world between generations asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Survivors that did not ask by the join timeout: the next generation no longer
    /// waits for them. The coordinator tells them they are stale at once; etcd does
    /// when the next generation forms without them.
    pub late: Vec<String>,
    /// What to do now.
    pub action: Action,
}

/// The step a [`Decision`] asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Nothing yet.
    Wait,
    /// Form a generation of these members, index = rank.
    Form(Vec<Member>),
    /// Fewer than `min_ranks` members waited for the rendezvous timeout: the job
    /// cannot go on.
    ShutDown(String),
}

/// The running generation, as the policy needs it.
#[derive(Debug, Clone, Copy)]
pub struct Standing<'a> {
    /// Its number.
    pub generation: u64,
    /// Its ranks now (members that left on purpose are no longer counted).
    pub world_size: usize,
    /// Why a regroup was asked, once it was.
    pub regroup: Option<&'a str>,
    /// Why the last member that left on purpose left, if one did.
    pub left: Option<&'a str>,
    /// A member ended it at a checkpoint boundary every member agreed on.
    pub at_boundary: bool,
}

/// What a report from a member of the running generation does to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Nothing.
    None,
    /// The generation ends with an abort: the others restart. `drop_reporter`: the
    /// next generation does not wait for the reporter (it cannot go on).
    Restart {
        /// Why.
        cause: String,
        /// The reporter is out.
        drop_reporter: bool,
    },
    /// The reporter leaves at a boundary the whole world agreed on: it is no longer a
    /// member, and the others are not aborted (they come to the rendezvous by
    /// themselves, and the next generation forms without it).
    Leave {
        /// Why.
        cause: String,
    },
    /// Members wait to join: the members finish at their next checkpoint and
    /// rendezvous again, so the world grows without losing work.
    Regroup {
        /// Why.
        cause: String,
    },
    /// A member ended the generation at an agreed checkpoint: not a failure.
    AtBoundary,
    /// One rank of a member that holds several left at an agreed boundary: as
    /// [`Effect::AtBoundary`], and its words are the next generation's cause.
    RankLeft {
        /// Why.
        cause: String,
    },
    /// The job trained to its last step: members waiting to join are sent away, no
    /// generation forms any more, the running one is not interrupted.
    Finished {
        /// Why the job is over.
        reason: String,
    },
}

/// How a running generation ends when one of its members asks for a newer one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// At a boundary everybody agreed on (a regroup, a stop, a member that left after
    /// the final save): nobody is aborted; the next generation waits for the members.
    AtBoundary {
        /// Why (also the next generation's cause).
        cause: String,
    },
    /// Out of turn: the others are aborted, and the asker (already waiting) is not
    /// counted among the survivors.
    Abort {
        /// Why.
        cause: String,
    },
}

impl Policy {
    /// What the world between generations asks for: form the next generation (the
    /// survivors first, then by arrival, at most `max_ranks`, ranks by node and id),
    /// wait, or shut the job down.
    ///
    /// - With survivors to wait for, it forms once every survivor asks, or once the
    ///   join timeout after the end passes (who did not ask is `late`).
    /// - With none, it forms once `max_ranks` members wait, or the last call after
    ///   `min_ranks` were first seen waiting passes.
    /// - Either way it needs `min_ranks` members; below that for the rendezvous
    ///   timeout, the job is shut down.
    pub fn decide(&self, between: &Between<'_>, timers: &mut Timers, now: Instant) -> Decision {
        // Sizes count ranks: a member may hold several (a node's launcher).
        let waiting: usize = between.waiting.iter().map(|c| c.member.ranks).sum();
        let asked: HashSet<&str> = between
            .waiting
            .iter()
            .map(|c| c.member.id.as_str())
            .collect();
        let asked = |id: &str| asked.contains(id);
        let (ready, late) = match between.survivors {
            None if waiting < self.min_ranks => {
                timers.min_since = None;
                (false, Vec::new())
            }
            None => {
                let since = Timers::since(&mut timers.min_since, between.ended, now);
                let ready = waiting >= self.max_ranks
                    || now.saturating_duration_since(since) >= self.timeouts.last_call;
                (ready, Vec::new())
            }
            Some(survivors) => {
                let seen = Timers::since(&mut timers.ended_seen, between.ended, now);
                let missing = survivors.iter().filter(|id| !asked(id));
                if now.saturating_duration_since(seen) >= self.timeouts.join_timeout {
                    (true, missing.cloned().collect())
                } else {
                    (missing.count() == 0, Vec::new())
                }
            }
        };
        let action = if waiting < self.min_ranks {
            let since = *timers.below_min_since.get_or_insert(now);
            let limit = self.timeouts.rendezvous_timeout;
            if now.saturating_duration_since(since) >= limit {
                Action::ShutDown(format!(
                    "only {waiting} of at least {} ranks for {} s",
                    self.min_ranks,
                    limit.as_secs_f64()
                ))
            } else {
                Action::Wait
            }
        } else {
            timers.below_min_since = None;
            if ready {
                Action::Form(self.choose(between))
            } else {
                Action::Wait
            }
        };
        Decision { late, action }
    }

    /// Who gets the places: the survivors first, then by arrival, while the ranks
    /// they hold fit in `max_ranks` (a member that does not fit waits, and a smaller
    /// one after it may still take the places left); ranks follow `(node, id)`, so a
    /// node's ranks are neighbours.
    fn choose(&self, between: &Between<'_>) -> Vec<Member> {
        let survivors: HashSet<&str> = between
            .survivors
            .unwrap_or_default()
            .iter()
            .map(String::as_str)
            .collect();
        let mut order: Vec<&Candidate<'_>> = between.waiting.iter().collect();
        order.sort_by_key(|c| (!survivors.contains(c.member.id.as_str()), c.arrival));
        let mut places = self.max_ranks;
        let mut members: Vec<Member> = Vec::new();
        for candidate in order {
            if candidate.member.ranks <= places {
                places -= candidate.member.ranks;
                members.push(candidate.member.clone());
            }
        }
        rank_order(&mut members);
        members
    }

    /// What `report` from `id` (rank `rank` of the running generation) does to it;
    /// `waiting`: members waiting to join it.
    pub fn on_report(
        &self,
        id: &str,
        rank: usize,
        report: &Report,
        running: &Standing<'_>,
        waiting: usize,
    ) -> Effect {
        match report {
            Report::CollectiveFailed { peer, reason } => {
                let peer = peer.map(|p| format!(" with rank {p}")).unwrap_or_default();
                Effect::Restart {
                    cause: format!("member {id} (rank {rank}): collective failed{peer}: {reason}"),
                    drop_reporter: false,
                }
            }
            Report::Fatal { reason } => Effect::Restart {
                cause: format!("member {id} (rank {rank}) failed: {reason}"),
                drop_reporter: true,
            },
            Report::Leaving { reason } => Effect::Leave {
                cause: format!("member {id} (rank {rank}) left: {reason}"),
            },
            Report::Committed { step } => {
                if waiting == 0 || running.regroup.is_some() || running.world_size >= self.max_ranks
                {
                    return Effect::None;
                }
                let plural = if waiting == 1 { "" } else { "s" };
                Effect::Regroup {
                    cause: format!(
                        "grow: {waiting} waiting member{plural} (after step {step} committed)"
                    ),
                }
            }
            Report::RankLost { cause } => Effect::Restart {
                cause: cause.clone(),
                drop_reporter: false,
            },
            Report::RankLeft { cause } => Effect::RankLeft {
                cause: cause.clone(),
            },
            Report::Ended { .. } if !running.at_boundary => Effect::AtBoundary,
            Report::Ended { .. } => Effect::None,
            Report::Finished { step } => Effect::Finished {
                reason: job_finished(id, *step),
            },
        }
    }

    /// The running generation is over because `id`, one of its members, asked for a
    /// newer one.
    pub fn on_rendezvous_while_running(&self, id: &str, running: &Standing<'_>) -> End {
        let generation = running.generation;
        if running.regroup.is_some() || running.at_boundary {
            let cause = running.regroup.or(running.left).map_or_else(
                || format!("generation {generation} ended at a checkpoint"),
                str::to_owned,
            );
            End::AtBoundary { cause }
        } else {
            End::Abort {
                cause: format!("member {id} left generation {generation} to rendezvous again"),
            }
        }
    }

    /// Whether a member's training thread is hung: idle longer than the progress
    /// timeout while not waiting on its peers in a collective.
    pub fn hung(&self, progress: &Progress) -> bool {
        !progress.in_collective
            && Duration::from_millis(progress.idle_ms) > self.timeouts.progress_timeout
    }
}

/// Whether `report` ends its sender's membership: it will not ask for another
/// generation, so it is not waited for (and stops waiting, if it was).
pub fn ends_membership(report: &Report) -> bool {
    matches!(report, Report::Fatal { .. } | Report::Leaving { .. })
}

/// What `report` from `id`, a survivor the next generation waits for, changes:
/// `None` when nothing; otherwise it is no longer waited for, and a fatal report is
/// the root cause the next generation names (the peers' collective errors often
/// reach the control plane before the failed member's own report).
pub fn withdrawal(id: &str, report: &Report) -> Option<Option<String>> {
    match report {
        Report::Fatal { reason } => Some(Some(format!("member {id} failed: {reason}"))),
        Report::Leaving { .. } => Some(None),
        _ => None,
    }
}

/// Why the job is over when member `id` trained to its last step, `step`.
pub fn job_finished(id: &str, step: u64) -> String {
    format!("the job finished: member {id} trained to step {step}")
}

/// Why member `id` is lost (`how`: a closed connection, silence, a hung thread).
pub fn lost_member(id: &str, how: impl Display) -> String {
    format!("lost member {id}: {how}")
}

/// Why member `id`, whose training thread was idle `idle_ms` outside a collective,
/// is lost.
pub fn hung_member(id: &str, idle_ms: u64) -> String {
    lost_member(
        id,
        format_args!("hung (training thread idle {idle_ms} ms outside a collective)"),
    )
}

/// Sorts `members` into rank order: by node, then id.
pub fn rank_order(members: &mut [Member]) {
    members.sort_by(|a, b| (&a.node, &a.id).cmp(&(&b.node, &b.id)));
}

#[cfg(test)]
mod tests {
    //! The policy's own corners; the scenarios in `crate::scenarios` run it through
    //! both backends.

    use super::*;

    /// Member `i` on node `n{9 - i}`: ranks run against the ids.
    fn member(i: usize) -> Member {
        crate::testing::member("j", i, format!("n{}", 9 - i))
    }

    fn policy(min: usize, max: usize) -> Policy {
        Policy {
            min_ranks: min,
            max_ranks: max,
            timeouts: Timeouts::DEFAULT,
        }
    }

    /// `members` asking for a generation, in this order.
    fn in_arrival_order(members: &[Member]) -> Vec<Candidate<'_>> {
        members
            .iter()
            .enumerate()
            .map(|(i, m)| Candidate {
                member: m,
                arrival: i as u64,
            })
            .collect()
    }

    #[test]
    fn survivors_take_the_places_before_earlier_newcomers_and_ranks_follow_node_then_id() {
        let members: Vec<Member> = (0..4).map(member).collect();
        let waiting = in_arrival_order(&members);
        let survivors = ["m3".to_owned(), "m2".to_owned()];
        let between = Between {
            ended: 4,
            survivors: Some(&survivors),
            waiting: &waiting,
        };
        let t0 = Instant::now();
        let decision = policy(1, 3).decide(&between, &mut Timers::default(), t0);
        let Action::Form(formed) = decision.action else {
            panic!("{decision:?}");
        };
        let ids: Vec<&str> = formed.iter().map(|m| m.id.as_str()).collect();
        // m2 and m3 survived; m0 arrived first of the newcomers; nodes n6 < n7 < n9.
        assert_eq!(ids, ["m3", "m2", "m0"]);
    }

    #[test]
    fn sizes_count_ranks_and_a_member_that_does_not_fit_leaves_room_to_a_smaller_one() {
        let sized = |i: usize, ranks: usize| Member { ranks, ..member(i) };
        let members = [sized(0, 8), sized(1, 8), sized(2, 2)];
        let waiting = in_arrival_order(&members);
        let between = Between {
            ended: 0,
            survivors: None,
            waiting: &waiting,
        };
        let t0 = Instant::now();
        // 18 ranks wait, more than the 12 that fit, so it forms at once: m0 (8) takes
        // its places, m1 (8) does not fit, m2 (2) does. Nodes n7 (m2) < n9 (m0).
        let Action::Form(formed) = policy(10, 12)
            .decide(&between, &mut Timers::default(), t0)
            .action
        else {
            panic!("not formed");
        };
        let ids: Vec<&str> = formed.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["m2", "m0"]);
        // Three members holding 18 ranks are too few for a minimum of 19.
        let below = policy(19, 32).decide(&between, &mut Timers::default(), t0);
        assert_eq!(below.action, Action::Wait);
        let limit = t0 + Timeouts::DEFAULT.rendezvous_timeout;
        let mut timers = Timers::default();
        policy(19, 32).decide(&between, &mut timers, t0);
        let Action::ShutDown(reason) = policy(19, 32).decide(&between, &mut timers, limit).action
        else {
            panic!("not shut down");
        };
        assert!(reason.contains("only 18 of at least 19 ranks"), "{reason}");
    }

    #[test]
    fn the_join_deadline_runs_from_the_end_and_names_who_did_not_ask() {
        let members: Vec<Member> = (0..2).map(member).collect();
        let one = [Candidate {
            member: &members[0],
            arrival: 0,
        }];
        let survivors = ["m0".to_owned(), "m1".to_owned()];
        let between = Between {
            ended: 2,
            survivors: Some(&survivors),
            waiting: &one,
        };
        let p = policy(1, 2);
        let mut timers = Timers::default();
        let t0 = Instant::now();
        let first = p.decide(&between, &mut timers, t0);
        assert_eq!(first.action, Action::Wait);
        let late = t0 + p.timeouts.join_timeout;
        let decision = p.decide(&between, &mut timers, late);
        assert_eq!(decision.late, ["m1"]);
        assert_eq!(decision.action, Action::Form(vec![members[0].clone()]));
    }

    #[test]
    fn a_report_of_the_last_step_or_a_boundary_is_not_a_failure() {
        let p = policy(1, 4);
        let running = Standing {
            generation: 3,
            world_size: 2,
            regroup: None,
            left: Some("member m1 (rank 1) left: preempted"),
            at_boundary: true,
        };
        assert_eq!(
            p.on_report("m0", 0, &Report::Ended { step: 9 }, &running, 0),
            Effect::None
        );
        assert!(matches!(
            p.on_report("m0", 0, &Report::Finished { step: 9 }, &running, 0),
            Effect::Finished { reason } if reason.contains("step 9")
        ));
        assert_eq!(
            p.on_rendezvous_while_running("m0", &running),
            End::AtBoundary {
                cause: "member m1 (rank 1) left: preempted".into()
            }
        );
        let hung = Progress {
            idle_ms: 60_001,
            ..Progress::default()
        };
        assert!(p.hung(&hung));
        assert!(!p.hung(&Progress {
            in_collective: true,
            ..hung
        }));
    }
}
