//! Retention: the one rule that decides which checkpoints go, for saves (`keep_last`)
//! and for `ckpt gc` alike.
//!
//! The rule, over the survey of the root ([`crate::catalog::list_checkpoints`]):
//!
//! - Commits are ranked by **commit order**, never by step: a run that resumed from
//!   an older checkpoint commits "smaller" steps that are nonetheless the newest.
//! - The `keep` newest commits whose manifest opens are kept, and so is every commit
//!   newer than the oldest of them (a newer commit that does not open is evidence,
//!   and never counts towards `keep`). The newest valid commit is never removed.
//! - The newest commit that a resume would load is never removed either, whatever
//!   `keep` says: the newest valid one not judged unhealthy (healthy, or of unknown
//!   health; [`crate::catalog::Select::Healthy`]). When the `keep` newest are all
//!   unhealthy, finding it costs one manifest per older commit until one is
//!   acceptable; it is kept alone, and the unhealthy commits between it and the
//!   kept ones go as usual.
//! - An older commit is removed only once the commit right after it in commit order
//!   is at least `grace` old: a reader that picked it while it was the newest has had
//!   that long to finish (the grace period is the readers' lease).
//! - A save that never committed (partial or failed) is removed when its newest
//!   object is older than the newest commit and at least `grace` old; one newer than
//!   the newest commit may still be in progress and stays.
//! - Staging leftovers of crashed local writes inside a kept directory go after
//!   `grace`.
//! - A log record that names no committed directory (its removal was cut short
//!   after the directory went, or its commit never wrote the manifest) goes once it
//!   is `grace` old, except the newest record, which the fence reads; the directory
//!   that record names stays with it, so the log never ends in a record naming
//!   nothing (an older commit recorded twice, or a save whose slot is not written).
//!
//! Removal deletes the manifest first, then the other objects, then the log record:
//! a removal cut short leaves an uncommitted directory, never a commit with holes.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use ckpt_storage::Store;
use serde::Serialize;
use tracing::{info, warn};

use crate::catalog::{CheckpointInfo, Commit, Status, read_commit};
use crate::commits::{LoggedCommit, record_key};
use crate::error::{Error, Result};
use crate::format::MANIFEST;

/// Default grace period: how long a superseded checkpoint stays readable.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(600);

/// What to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Newest valid commits kept (at least 1).
    pub keep: usize,
    /// How long a superseded commit, or a dead save, stays.
    pub grace: Duration,
}

impl Policy {
    /// Keep `keep` commits with the default grace period.
    pub fn keep(keep: usize) -> Self {
        Self {
            keep: keep.max(1),
            grace: DEFAULT_GRACE,
        }
    }
}

/// One directory (or loose objects of one) that retention removes.
#[derive(Debug, Clone, Serialize)]
pub struct Removal {
    /// The step.
    pub step: u64,
    /// The directory.
    pub dir: String,
    /// Whether it was committed.
    pub committed: bool,
    /// Bytes it frees.
    pub bytes: u64,
    /// Why it goes.
    pub reason: String,
    /// Only these objects go (stray objects of a kept commit); empty: the whole
    /// directory.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub only: Vec<String>,
    #[serde(skip)]
    keys: Vec<String>,
    #[serde(skip)]
    leftovers: Vec<String>,
    #[serde(skip)]
    seq: Option<u64>,
}

/// What retention removes and keeps.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Commits kept at least.
    pub keep: usize,
    /// What goes, oldest first.
    pub remove: Vec<Removal>,
    /// Directories kept.
    pub kept: Vec<String>,
    /// Bytes freed by the removals.
    pub bytes_freed: u64,
    /// Commits kept although `keep` alone would let them go (the newest healthy
    /// one, when the newest `keep` are unhealthy).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<Held>,
}

/// A commit kept beyond `keep`, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Held {
    /// The step.
    pub step: u64,
    /// The directory.
    pub dir: String,
    /// Why it stays.
    pub reason: String,
}

/// The newest commit a resume would load, as retention found it.
#[derive(Debug, Clone)]
pub(crate) struct Resumable {
    dir: String,
    /// `healthy` or `unknown`.
    health: &'static str,
}

fn age_at_least(now: SystemTime, t: Option<SystemTime>, grace: Duration) -> bool {
    t.is_some_and(|t| now.duration_since(t).is_ok_and(|age| age >= grace))
}

/// Decides what to remove (nothing is deleted). Lists the whole root and opens
/// the manifests of the newest commits until `keep` of them open.
pub async fn plan(store: &Store, policy: Policy) -> Result<Plan> {
    // One read of the commit log serves the survey, the kept newest record and the
    // dangling records alike.
    let (survey, records) = crate::catalog::survey(store).await?;
    let keep = policy.keep.max(1);
    let mut valid = HashSet::new();
    let mut resumable = None;
    // The newest `keep` commits that open, and on past them (one manifest each)
    // until one that a resume would load: the newest healthy one stays too.
    for info in survey.iter().rev().filter(|c| c.committed) {
        if valid.len() >= keep && resumable.is_some() {
            break;
        }
        let commit = Commit {
            seq: info.seq,
            step: info.step,
            dir: info.dir.clone(),
            time: info.committed_at,
        };
        match read_commit(store, &commit).await {
            Ok(manifest) => {
                if valid.len() < keep {
                    valid.insert(info.dir.clone());
                }
                let health = manifest.health_status();
                if resumable.is_none() && health.acceptable() {
                    resumable = Some(Resumable {
                        dir: info.dir.clone(),
                        health: health.as_str(),
                    });
                }
            }
            Err(e) if e.is_corruption() || matches!(e, Error::NotFound(_)) => {
                warn!(dir = %info.dir, error = %e, "a commit that does not open is kept, and not counted");
            }
            Err(e) => return Err(e),
        }
    }
    let mut plan = decide(
        &survey,
        &valid,
        resumable.as_ref(),
        policy,
        SystemTime::now(),
    );
    keep_what_the_newest_record_names(&mut plan, &records);
    plan.remove.extend(dangling_records(
        &records,
        &survey,
        policy,
        SystemTime::now(),
    ));
    // Staging leftovers and stray objects inside kept version-1 commits.
    let now = SystemTime::now();
    for info in survey
        .iter()
        .filter(|c| c.committed && plan.kept.contains(&c.dir))
    {
        let old: Vec<String> = info
            .leftovers
            .iter()
            .filter(|_| age_at_least(now, info.modified, policy.grace))
            .cloned()
            .collect();
        if !old.is_empty() {
            plan.remove.push(Removal {
                step: info.step,
                dir: info.dir.clone(),
                committed: true,
                bytes: 0,
                reason: format!("{} staging leftover(s) of crashed writes", old.len()),
                only: old.clone(),
                keys: Vec::new(),
                leftovers: old,
                seq: None,
            });
        }
    }
    Ok(plan)
}

/// The newest record of the log stays (the fence reads it), so the directory it
/// names stays too: otherwise the log would end in a record that names nothing. It
/// is usually the newest commit; it is an older one when a committer appended a
/// duplicate record for it (two committers whose tails missed each other), and a
/// save that did not commit (yet) when its committer stopped between the record and
/// the slot (a later committer may still write the slot). It goes once a newer
/// record follows.
fn keep_what_the_newest_record_names(plan: &mut Plan, records: &[LoggedCommit]) {
    let Some(newest) = records.iter().max_by_key(|r| r.seq) else {
        return;
    };
    let dir = newest.record.attempt().dir();
    if let Some(at) = plan
        .remove
        .iter()
        .position(|r| r.only.is_empty() && r.dir == dir)
    {
        let kept = plan.remove.remove(at);
        info!(dir = %kept.dir, "kept: the log's newest record names it");
        plan.bytes_freed -= kept.bytes;
        plan.kept.push(kept.dir);
    }
}

/// Log records that name no committed directory of the survey, once `grace` old; the
/// newest record always stays (the fence reads the log's tail).
fn dangling_records(
    records: &[LoggedCommit],
    survey: &[CheckpointInfo],
    policy: Policy,
    now: SystemTime,
) -> Vec<Removal> {
    let newest = records.iter().map(|r| r.seq).max();
    let committed: HashSet<(&str, Option<u64>)> = survey
        .iter()
        .filter(|c| c.committed)
        .map(|c| (c.dir.as_str(), c.seq))
        .collect();
    records
        .iter()
        .filter(|r| Some(r.seq) != newest)
        .filter(|r| {
            let dir = r.record.attempt().dir();
            !committed.contains(&(dir.as_str(), Some(r.seq)))
        })
        .filter(|r| age_at_least(now, Some(r.written), policy.grace))
        .map(|r| Removal {
            step: r.record.step,
            dir: r.record.attempt().dir(),
            committed: false,
            bytes: 0,
            reason: format!(
                "log record {} names no committed checkpoint (a removal cut short, or a commit that never wrote its manifest)",
                r.seq
            ),
            only: vec![record_key(r.seq)],
            keys: Vec::new(),
            leftovers: Vec::new(),
            seq: Some(r.seq),
        })
        .collect()
}

/// The rule itself, on a survey in commit order; `valid` holds the directories of
/// the newest commits that opened, `resumable` the newest commit a resume would load.
pub(crate) fn decide(
    survey: &[CheckpointInfo],
    valid: &HashSet<String>,
    resumable: Option<&Resumable>,
    policy: Policy,
    now: SystemTime,
) -> Plan {
    let keep = policy.keep.max(1);
    let commits: Vec<&CheckpointInfo> = survey.iter().filter(|c| c.committed).collect();
    // The oldest commit kept: the `keep`-th newest valid one (all are kept when
    // fewer than `keep` are valid, or none is).
    let mut seen_valid = 0;
    let mut oldest_kept = 0;
    for (i, info) in commits.iter().enumerate().rev() {
        if valid.contains(&info.dir) {
            seen_valid += 1;
            oldest_kept = i;
            if seen_valid == keep {
                break;
            }
        }
    }
    if seen_valid < keep {
        oldest_kept = 0;
    }
    let newest_commit_time = commits.iter().filter_map(|c| c.committed_at).max();
    let mut remove = Vec::new();
    let mut kept = Vec::new();
    let mut held = Vec::new();
    for (i, info) in commits.iter().enumerate() {
        if i < oldest_kept
            && let Some(resumable) = resumable.filter(|r| r.dir == info.dir)
        {
            held.push(Held {
                step: info.step,
                dir: info.dir.clone(),
                reason: format!(
                    "the newest {}, which a resume loads (the {keep} newest commit(s) are unhealthy)",
                    if resumable.health == "healthy" {
                        "healthy checkpoint"
                    } else {
                        "checkpoint not judged unhealthy (its health is unknown)"
                    }
                ),
            });
            kept.push(info.dir.clone());
            continue;
        }
        let verdict = (i < oldest_kept)
            .then(|| commits[i + 1])
            .filter(|successor| age_at_least(now, successor.committed_at, policy.grace))
            .map(|successor| {
                let what = if info.status == Status::Abandoned {
                    "abandoned (a later run resumed from an older step), "
                } else {
                    ""
                };
                format!(
                    "{what}older than the {keep} newest commit(s); superseded by step {} more than {:?} ago",
                    successor.step, policy.grace
                )
            });
        match verdict {
            Some(reason) => remove.push(removal(info, reason)),
            None => kept.push(info.dir.clone()),
        }
    }
    for info in survey.iter().filter(|c| !c.committed) {
        let dead = newest_commit_time
            .is_some_and(|newest| info.modified.is_some_and(|m| m < newest))
            && age_at_least(now, info.modified, policy.grace);
        if dead {
            let what = match info.status {
                Status::Failed => format!(
                    "failed save ({})",
                    info.failure.as_deref().unwrap_or("tombstone")
                ),
                _ => "partial save older than the newest commit".to_string(),
            };
            remove.push(removal(info, what));
        } else {
            kept.push(info.dir.clone());
        }
    }
    let bytes_freed = remove.iter().map(|r| r.bytes).sum();
    Plan {
        keep,
        remove,
        kept,
        bytes_freed,
        held,
    }
}

fn removal(info: &CheckpointInfo, reason: String) -> Removal {
    Removal {
        step: info.step,
        dir: info.dir.clone(),
        committed: info.committed,
        bytes: info.bytes,
        reason,
        only: Vec::new(),
        keys: info.keys.clone(),
        leftovers: info.leftovers.clone(),
        seq: info.seq,
    }
}

/// Removes what `plan` decided: manifest first, then the other objects, then the
/// log record. Calls `progress` after each removal.
pub async fn apply(store: &Store, plan: &Plan, progress: &(dyn Fn(&Removal) + Sync)) -> Result<()> {
    for removal in &plan.remove {
        if removal.only.is_empty() {
            let manifest = format!("{}/{MANIFEST}", removal.dir);
            store.delete(&manifest).await?;
            for key in removal.keys.iter().filter(|k| **k != manifest) {
                store.delete(key).await?;
            }
        }
        for key in &removal.leftovers {
            store.delete_leftover(key).await?;
        }
        if let Some(seq) = removal.seq {
            store.delete(&record_key(seq)).await?;
        }
        progress(removal);
    }
    Ok(())
}

/// Retention after a save committed: plan and apply with `policy`, logging what
/// goes and what stays beyond `keep`.
pub async fn after_commit(store: &Store, policy: Policy) -> Result<Vec<Removal>> {
    let plan = plan(store, policy).await?;
    for held in &plan.held {
        info!(step = held.step, dir = %held.dir, reason = %held.reason, "retention keeps a checkpoint beyond keep_last");
    }
    apply(store, &plan, &|r| {
        info!(step = r.step, dir = %r.dir, reason = %r.reason, "retention removed a checkpoint")
    })
    .await?;
    Ok(plan.remove)
}
