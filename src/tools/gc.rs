//! `ckpt gc`: retention for a checkpoint root, safe for readers.
//!
//! The rule:
//! - the newest committed checkpoint is never removed, and neither are the `keep`
//!   newest ones;
//! - an older committed checkpoint is removed only once the commit that superseded it
//!   (the next newer one) is at least `grace` old: a reader that chose it while it
//!   was the newest has had that long to load it;
//! - a partial checkpoint (no manifest) is removed only when it is older than the
//!   newest commit (every rank has moved past it) and its last write is at least
//!   `grace` old; partial checkpoints newer than the newest commit may be saves in
//!   progress and are kept.
//!
//! Removal deletes the manifest first, so a removal cut short leaves a partial
//! checkpoint, never a committed one with missing files.

use std::time::{Duration, SystemTime};

use ckpt_storage::Store;
use serde::Serialize;

use crate::catalog::list_checkpoints;
use crate::error::Result;
use crate::format::{MANIFEST, step_dir};

/// One checkpoint `gc` removes.
#[derive(Debug, Clone, Serialize)]
pub struct Removal {
    /// The step.
    pub step: u64,
    /// Whether it was committed.
    pub committed: bool,
    /// Bytes it occupies.
    pub bytes: u64,
    /// Why it goes.
    pub reason: String,
}

/// What `gc` removes and keeps.
#[derive(Debug, Clone, Serialize)]
pub struct GcPlan {
    /// Committed checkpoints kept at least.
    pub keep: usize,
    /// Checkpoints to remove, oldest first.
    pub remove: Vec<Removal>,
    /// Steps kept.
    pub kept: Vec<u64>,
    /// Bytes freed by the removals.
    pub bytes_freed: u64,
}

/// Decides what to remove (nothing is deleted).
pub async fn plan(store: &Store, keep: usize, grace: Duration) -> Result<GcPlan> {
    let keep = keep.max(1);
    let all = list_checkpoints(store).await?;
    let now = SystemTime::now();
    let old_enough = |t: Option<SystemTime>| {
        t.and_then(|t| now.duration_since(t).ok())
            .is_some_and(|age| age >= grace)
    };
    let committed: Vec<usize> = (0..all.len()).filter(|&i| all[i].committed).collect();
    let newest_commit = committed.last().map(|&i| all[i].step);
    let mut remove = Vec::new();
    let mut kept = Vec::new();
    for (i, info) in all.iter().enumerate() {
        let verdict = if info.committed {
            let position = committed
                .iter()
                .position(|&c| c == i)
                .expect("committed index");
            let newer = committed.len() - 1 - position;
            if newer < keep {
                None
            } else {
                // The commit right after this one: how long has it superseded it?
                let successor = &all[committed[position + 1]];
                old_enough(successor.modified).then(|| {
                    format!(
                        "older than the {keep} newest commits, superseded by step {} more than {grace:?} ago",
                        successor.step
                    )
                })
            }
        } else {
            match newest_commit {
                Some(newest) if info.step < newest && old_enough(info.modified) => Some(format!(
                    "partial and older than the newest commit (step {newest})"
                )),
                _ => None,
            }
        };
        match verdict {
            Some(reason) => remove.push(Removal {
                step: info.step,
                committed: info.committed,
                bytes: info.bytes,
                reason,
            }),
            None => kept.push(info.step),
        }
    }
    let bytes_freed = remove.iter().map(|r| r.bytes).sum();
    Ok(GcPlan {
        keep,
        remove,
        kept,
        bytes_freed,
    })
}

/// Removes what `plan` decided, manifest first. Calls `progress` after each step.
pub async fn apply(
    store: &Store,
    plan: &GcPlan,
    progress: &(dyn Fn(&Removal) + Sync),
) -> Result<()> {
    for removal in &plan.remove {
        let dir = step_dir(removal.step);
        store.delete(&format!("{dir}/{MANIFEST}")).await?;
        store.delete_prefix(&dir).await?;
        progress(removal);
    }
    Ok(())
}
