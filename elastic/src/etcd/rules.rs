//! The rules of the etcd backend, as pure functions of what etcd holds.
//!
//! Every agent evaluates the same rules on its own mirror of the job's keys and
//! proposes the resulting generation record in a transaction that compares the
//! record's revision: the first proposal wins, the others fail their comparison,
//! re-read, and find nothing left to do. Keeping the rules free of I/O is what lets
//! them be tested without etcd.
//!
//! What a generation is and when it forms is not decided here: that is the
//! [formation policy](crate::policy), which the built-in coordinator follows too.
//! This module translates the job's keys into the policy's terms and its answers
//! into the next generation record, and decides what only etcd has: which records
//! mean a member is gone, and what each member is told from the records it sees.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::policy::{
    Action, Between, Candidate, Effect, End, Policy, Standing, Timers, hung_member, lost_member,
    withdrawal,
};
use crate::timeouts::{Timeouts, millis, validate_ranks};
use crate::{Assignment, CoordinatorConfig, Directive, Member, Report, roster_digest};

/// The job's settings, published once under `config` (the first launcher's win).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobConfig {
    /// Fewest members of a generation.
    pub min_ranks: usize,
    /// Most members of a generation.
    pub max_ranks: usize,
    /// Once `min_ranks` wait, how long to wait for more (ms).
    pub last_call_ms: u64,
    /// Lease time to live: a member silent this long is lost (ms, whole seconds).
    pub heartbeat_timeout_ms: u64,
    /// A training thread idle this long outside a collective is hung (ms).
    pub progress_timeout_ms: u64,
    /// After an abort, survivors that do not ask to rejoin by then are dropped (ms).
    pub join_timeout_ms: u64,
    /// Below `min_ranks` this long with no generation running: shutdown (ms).
    pub rendezvous_timeout_ms: u64,
}

impl JobConfig {
    /// The same settings as a built-in coordinator's.
    pub fn from_coordinator(c: &CoordinatorConfig) -> JobConfig {
        let t = &c.timeouts;
        JobConfig {
            min_ranks: c.min_ranks,
            max_ranks: c.max_ranks,
            last_call_ms: millis(t.last_call),
            heartbeat_timeout_ms: millis(t.heartbeat_timeout),
            progress_timeout_ms: millis(t.progress_timeout),
            join_timeout_ms: millis(t.join_timeout),
            rendezvous_timeout_ms: millis(t.rendezvous_timeout),
        }
    }

    /// The time windows, as the rules apply them.
    pub fn timeouts(&self) -> Timeouts {
        Timeouts {
            last_call: Duration::from_millis(self.last_call_ms),
            heartbeat_timeout: Duration::from_millis(self.heartbeat_timeout_ms),
            progress_timeout: Duration::from_millis(self.progress_timeout_ms),
            join_timeout: Duration::from_millis(self.join_timeout_ms),
            rendezvous_timeout: Duration::from_millis(self.rendezvous_timeout_ms),
        }
    }

    /// The lease time to live in whole seconds (etcd's unit), at least 2 (etcd's
    /// floor with its default election timeout).
    pub fn lease_ttl_secs(&self) -> i64 {
        i64::try_from(self.heartbeat_timeout_ms.div_ceil(1000))
            .unwrap_or(i64::MAX)
            .max(2)
    }

    /// The formation policy these settings give.
    pub fn policy(&self) -> Policy {
        Policy {
            min_ranks: self.min_ranks,
            max_ranks: self.max_ranks,
            timeouts: self.timeouts(),
        }
    }

    /// Checks the values, naming the bad one (the coordinator's checks: a job's
    /// settings are valid on one backend exactly when they are on the other).
    pub fn validate(&self) -> Result<(), String> {
        validate_ranks(self.min_ranks, self.max_ranks)?;
        self.timeouts().validate()
    }
}

/// What a member publishes about itself, under its lease (gone when it dies).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// Who it is.
    pub member: Member,
    /// Waiting for a generation newer than this one (it called `rendezvous`).
    pub wants: Option<u64>,
    /// The generation it runs (0: none).
    pub generation: u64,
    /// Highest checkpoint generation it saved with.
    pub checkpoint_generation: u64,
}

/// A member's place in a generation: who, and how many ranks it holds there. Written
/// as `["ID", RANKS]`, so that the record of 2,048 nodes stays near 30 KiB (see
/// [`GenRecord`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "(String, usize)", into = "(String, usize)")]
pub struct Seat {
    /// The member's id.
    pub id: String,
    /// Its ranks in the generation.
    pub ranks: usize,
}

impl From<(String, usize)> for Seat {
    fn from((id, ranks): (String, usize)) -> Seat {
        Seat { id, ranks }
    }
}

impl From<Seat> for (String, usize) {
    fn from(seat: Seat) -> (String, usize) {
        (seat.id, seat.ranks)
    }
}

impl From<&Member> for Seat {
    fn from(member: &Member) -> Seat {
        Seat {
            id: member.id.clone(),
            ranks: member.ranks,
        }
    }
}

/// The job's one generation record, advanced only by compare-and-swap.
///
/// Every member watches it, so it is kept small: a member's place is its id and its
/// rank count, nothing else; its size is about 10 bytes plus the id per member (plus
/// the ids of the members a generation that ended waits for), so 2,048 nodes named
/// `nNNNN` make about 50 KiB, and members with ids of 64 bytes reach etcd's default
/// request limit (1.5 MiB) only beyond 10,000 members.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenRecord {
    /// Strictly increasing.
    pub generation: u64,
    /// Members in rank order.
    pub members: Vec<Seat>,
    /// Checkpoint generations of this generation's saves are >= this.
    pub floor: u64,
    /// Why it formed.
    pub cause: String,
    /// Where it stands.
    pub state: GenState,
    /// The job finished (a member trained to the last step): no generation forms any
    /// more, and members waiting to join are told to shut down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<String>,
    /// While it runs: members waiting to join it, as the agent that evaluates the
    /// rules last counted them ([`waiting`]); a commit regroups when there are any.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub waiting: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The life of a generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GenState {
    /// Training. `regroup`: members wait, finish at the next checkpoint.
    /// `at_boundary`: a member ended it at a committed checkpoint; the others come to
    /// the rendezvous by themselves.
    Running {
        /// Why a regroup was asked, if it was.
        regroup: Option<String>,
        /// A member ended the generation at an agreed checkpoint boundary.
        at_boundary: bool,
        /// Why the last member that left on purpose left (the next generation's
        /// cause). Absent in records of older versions.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        left: Option<String>,
    },
    /// Over. `abort`: the members were told to restart (a failure); `expected`: who
    /// the next generation waits for; `dropped`: who was declared lost (told stale).
    Ended {
        /// The survivors must abort (Restart).
        abort: bool,
        /// Why.
        cause: String,
        /// Survivors the next generation waits for (up to the join timeout).
        expected: Vec<String>,
        /// Members declared lost (hung, silent): stale if they come back.
        dropped: Vec<String>,
    },
    /// The job cannot go on.
    Shutdown {
        /// Why.
        reason: String,
    },
}

impl GenRecord {
    /// The record before any generation formed.
    pub fn none() -> GenRecord {
        GenRecord {
            generation: 0,
            members: Vec::new(),
            floor: 0,
            cause: "initial".into(),
            state: GenState::Ended {
                abort: false,
                cause: "initial".into(),
                expected: Vec::new(),
                dropped: Vec::new(),
            },
            finished: None,
            waiting: 0,
        }
    }

    /// Running with nothing pending.
    pub fn is_running(&self) -> bool {
        matches!(self.state, GenState::Running { .. })
    }

    /// `id`'s (first) rank in this generation.
    pub fn rank_of(&self, id: &str) -> Option<usize> {
        let at = self.members.iter().position(|m| m.id == id)?;
        Some(self.members[..at].iter().map(|m| m.ranks).sum())
    }

    /// Ranks in this generation: the sum of its members' ranks.
    pub fn world_size(&self) -> usize {
        self.members.iter().map(|m| m.ranks).sum()
    }

    /// The assignment of `id`, when it is a member and the generation runs.
    pub fn assignment(&self, id: &str) -> Option<Assignment> {
        if !self.is_running() {
            return None;
        }
        let ranks = self.members.iter().find(|m| m.id == id)?.ranks;
        Some(Assignment {
            generation: self.generation,
            rank: self.rank_of(id)?,
            ranks,
            world_size: self.world_size(),
            members: self.members.len(),
            roster: roster_digest(self.members.iter().map(|m| (m.id.as_str(), m.ranks))),
            checkpoint_generation_floor: self.floor,
            cause: self.cause.clone(),
        })
    }

    fn ended(&self, abort: bool, cause: String, leaving: &[&str], dropped: &[&str]) -> GenRecord {
        let expected = self
            .members
            .iter()
            .map(|m| m.id.clone())
            .filter(|id| !leaving.contains(&id.as_str()) && !dropped.contains(&id.as_str()))
            .collect();
        GenRecord {
            state: GenState::Ended {
                abort,
                cause,
                expected,
                dropped: dropped.iter().map(|s| s.to_string()).collect(),
            },
            waiting: 0,
            ..self.clone()
        }
    }
}

/// A live member record and the etcd revision of its last write (arrival order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Live {
    /// The record.
    pub record: MemberRecord,
    /// Its `mod_revision`.
    pub revision: i64,
}

/// Where the running generation `current` stands, for the policy.
fn standing(current: &GenRecord) -> Option<Standing<'_>> {
    let GenState::Running {
        regroup,
        at_boundary,
        left,
    } = &current.state
    else {
        return None;
    };
    Some(Standing {
        generation: current.generation,
        world_size: current.world_size(),
        regroup: regroup.as_deref(),
        left: left.as_deref(),
        at_boundary: *at_boundary,
    })
}

/// Members waiting to join `current`, as the policy counts them for a regroup:
/// those asking for a generation that are not in it, and, while it runs, its members
/// whose records now hold more ranks than their places in it (a node whose rank was
/// started again; as the coordinator counts them).
pub fn waiting(current: &GenRecord, live: &BTreeMap<String, Live>) -> usize {
    let running = current.is_running();
    live.values()
        .filter(|l| {
            let member = &l.record.member;
            match current.members.iter().find(|m| m.id == member.id) {
                None => l.record.wants.is_some(),
                Some(seat) => running && member.ranks > seat.ranks,
            }
        })
        .count()
}

/// What the world's state asks for, if anything: the next generation record.
/// `live` holds every member record present in etcd; `timers` are this agent's
/// observations of the policy's windows.
pub fn next(
    current: &GenRecord,
    live: &BTreeMap<String, Live>,
    config: &JobConfig,
    timers: &mut Timers,
    now: Instant,
) -> Option<GenRecord> {
    if current.finished.is_some() {
        return None;
    }
    match &current.state {
        GenState::Shutdown { .. } => None,
        GenState::Running { .. } => {
            timers.running();
            let lost: Vec<&str> = current
                .members
                .iter()
                .map(|m| m.id.as_str())
                .filter(|id| !live.contains_key(*id))
                .collect();
            if lost.is_empty() {
                let waiting = waiting(current, live);
                return (waiting != current.waiting).then(|| GenRecord {
                    waiting,
                    ..current.clone()
                });
            }
            let cause = lost
                .iter()
                .map(|id| {
                    lost_member(
                        id,
                        "its lease ended (process gone, or silent for the heartbeat timeout)",
                    )
                })
                .collect::<Vec<_>>()
                .join("; ");
            Some(current.ended(true, cause, &[], &lost))
        }
        GenState::Ended {
            expected, cause, ..
        } => {
            let waiting: Vec<&Live> = live.values().filter(|l| l.record.wants.is_some()).collect();
            let candidates: Vec<Candidate<'_>> = waiting
                .iter()
                .map(|l| Candidate {
                    member: &l.record.member,
                    arrival: u64::try_from(l.revision).unwrap_or(0),
                })
                .collect();
            // Survivors to wait for: those the record names that are still there.
            // None named (the first generation, or one that ended with nobody
            // left): the last call.
            let survivors: Option<Vec<String>> = (current.generation != 0 && !expected.is_empty())
                .then(|| {
                    expected
                        .iter()
                        .filter(|id| live.contains_key(*id))
                        .cloned()
                        .collect()
                });
            let between = Between {
                ended: current.generation,
                survivors: survivors.as_deref(),
                waiting: &candidates,
            };
            // Who did not come by the join timeout is simply not in the next
            // record: `directive` tells them they are stale once it forms.
            let members = match config.policy().decide(&between, timers, now).action {
                Action::Wait => return None,
                Action::ShutDown(reason) => {
                    return Some(GenRecord {
                        state: GenState::Shutdown { reason },
                        ..current.clone()
                    });
                }
                Action::Form(members) => members,
            };
            let newest_known = waiting
                .iter()
                .filter_map(|l| l.record.wants)
                .max()
                .unwrap_or(0)
                .max(current.generation);
            let floor = live
                .values()
                .map(|l| l.record.checkpoint_generation.saturating_add(1))
                .fold(current.floor, u64::max);
            Some(GenRecord {
                generation: newest_known + 1,
                members: members.iter().map(Seat::from).collect(),
                floor,
                cause: if current.generation == 0 {
                    "initial".into()
                } else {
                    cause.clone()
                },
                state: GenState::Running {
                    regroup: None,
                    at_boundary: false,
                    left: None,
                },
                finished: None,
                waiting: 0,
            })
        }
    }
}

/// The record after `id`, a member of `generation`, reports `report`; `None`: no
/// change. `waiting`: live members waiting to join.
pub fn on_report(
    current: &GenRecord,
    id: &str,
    generation: u64,
    report: &Report,
    waiting: usize,
    config: &JobConfig,
) -> Option<GenRecord> {
    if generation == 0 || current.generation != generation {
        return None;
    }
    let rank = current.rank_of(id)?;
    match &current.state {
        GenState::Running {
            regroup,
            at_boundary,
            left,
        } => {
            let standing = standing(current)?;
            let running =
                |regroup: Option<String>, at_boundary: bool, left: Option<String>| GenRecord {
                    state: GenState::Running {
                        regroup,
                        at_boundary,
                        left,
                    },
                    ..current.clone()
                };
            match config
                .policy()
                .on_report(id, rank, report, &standing, waiting)
            {
                Effect::None => None,
                Effect::Restart {
                    cause,
                    drop_reporter,
                } => {
                    let leaving: &[&str] = if drop_reporter { &[id] } else { &[] };
                    Some(current.ended(true, cause, leaving, &[]))
                }
                Effect::Leave { cause } => {
                    // Not a failure: the others rendezvous by themselves at the
                    // boundary every member agreed on.
                    let mut next = running(regroup.clone(), true, Some(cause.clone()));
                    next.members.retain(|m| m.id != id);
                    if next.members.is_empty() {
                        next.state = GenState::Ended {
                            abort: false,
                            cause,
                            expected: Vec::new(),
                            dropped: Vec::new(),
                        };
                    }
                    Some(next)
                }
                Effect::Regroup { cause } => Some(running(Some(cause), *at_boundary, left.clone())),
                Effect::AtBoundary => Some(running(regroup.clone(), true, left.clone())),
                Effect::RankLeft { cause } => Some(running(regroup.clone(), true, Some(cause))),
                Effect::Finished { reason } => current.finished.is_none().then(|| GenRecord {
                    finished: Some(reason),
                    ..current.clone()
                }),
            }
        }
        GenState::Ended {
            abort,
            cause,
            expected,
            dropped,
        } if expected.iter().any(|e| e == id) => {
            let root_cause = withdrawal(id, report)?;
            Some(GenRecord {
                state: GenState::Ended {
                    abort: *abort,
                    cause: root_cause.unwrap_or_else(|| cause.clone()),
                    expected: expected.iter().filter(|e| *e != id).cloned().collect(),
                    dropped: dropped.clone(),
                },
                ..current.clone()
            })
        }
        _ => None,
    }
}

/// The record after `id`, running `current`, asks for a newer generation: the running
/// one is over (without an abort at an agreed boundary, else with one).
pub fn on_leave_running(current: &GenRecord, id: &str, config: &JobConfig) -> Option<GenRecord> {
    let standing = standing(current)?;
    current.rank_of(id)?;
    Some(
        match config.policy().on_rendezvous_while_running(id, &standing) {
            End::AtBoundary { cause } => current.ended(false, cause, &[], &[]),
            End::Abort { cause } => current.ended(true, cause, &[id], &[]),
        },
    )
}

/// The record after `id` found its own training thread hung.
pub fn on_hung(current: &GenRecord, id: &str, idle_ms: u64) -> Option<GenRecord> {
    if !current.is_running() {
        return None;
    }
    current.rank_of(id)?;
    Some(current.ended(true, hung_member(id, idle_ms), &[], &[id]))
}

/// What `id`, running `generation`, is told: from the newest record seen for that
/// generation (`of_generation`) and the job's newest record (`newest`).
/// `waiting`: it asked to rendezvous; `lost`: its lease or record is gone.
pub fn directive(
    id: &str,
    generation: u64,
    of_generation: Option<&GenRecord>,
    newest: &GenRecord,
    waiting: bool,
    lost: bool,
) -> Option<Directive> {
    if let GenState::Shutdown { reason } = &newest.state {
        return Some(Directive::Shutdown {
            reason: reason.clone(),
        });
    }
    if let Some(reason) = &newest.finished
        && newest.rank_of(id).is_none()
        && (waiting || generation == 0)
    {
        return Some(Directive::Shutdown {
            reason: reason.clone(),
        });
    }
    if generation == 0 {
        return None;
    }
    if lost {
        return Some(Directive::Stale {
            current: newest.generation.max(generation),
        });
    }
    // A newer generation formed without it while it was not asking for one: it was
    // dropped (hung, or late past the join timeout), also if its own generation
    // asked it to restart before.
    if newest.generation > generation && newest.rank_of(id).is_none() && !waiting {
        return Some(Directive::Stale {
            current: newest.generation,
        });
    }
    if let Some(record) = of_generation.filter(|r| r.generation == generation) {
        match &record.state {
            GenState::Running {
                regroup: Some(cause),
                ..
            } if record.rank_of(id).is_some() => {
                return Some(Directive::Regroup {
                    generation,
                    cause: cause.clone(),
                });
            }
            GenState::Ended { dropped, .. } if dropped.iter().any(|d| d == id) => {
                return Some(Directive::Stale {
                    current: newest.generation,
                });
            }
            GenState::Ended {
                abort: true,
                cause,
                expected,
                ..
            } if expected.iter().any(|e| e == id) => {
                return Some(Directive::Restart {
                    generation,
                    cause: cause.clone(),
                });
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests;
