//! Finding checkpoints under a root: listing, the newest commit, retention.
//!
//! The truth is the listing: a step directory with a valid `manifest.json` is a
//! committed checkpoint, anything else is garbage or a save in progress. The `latest`
//! object is only a hint for humans and other tools.

use std::collections::BTreeMap;
use std::time::SystemTime;

use ckpt_storage::Store;
use tracing::warn;

use crate::error::{Error, Result};
use crate::format::{MANIFEST, Manifest, parse_rank_part_name, parse_step_dir, step_dir};

/// One step directory under the root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The step.
    pub step: u64,
    /// True when `manifest.json` is present (whether it is valid is for
    /// [`read_manifest`] to say).
    pub committed: bool,
    /// Ranks whose manifest part is present.
    pub ranks_present: Vec<u32>,
    /// Objects in the directory.
    pub objects: usize,
    /// Bytes of all objects in the directory.
    pub bytes: u64,
    /// Newest modification time of its objects.
    pub modified: Option<SystemTime>,
}

/// Every step directory under the root, oldest first.
pub async fn list_checkpoints(store: &Store) -> Result<Vec<CheckpointInfo>> {
    let objects = store.list("").await?;
    let mut steps: BTreeMap<u64, CheckpointInfo> = BTreeMap::new();
    for object in objects {
        let mut segments = object.key.splitn(2, '/');
        let (Some(dir), Some(name)) = (segments.next(), segments.next()) else {
            continue;
        };
        let Some(step) = parse_step_dir(dir) else {
            continue;
        };
        let info = steps.entry(step).or_insert_with(|| CheckpointInfo {
            step,
            committed: false,
            ranks_present: Vec::new(),
            objects: 0,
            bytes: 0,
            modified: None,
        });
        info.objects += 1;
        info.bytes += object.size;
        info.modified = info.modified.max(Some(object.last_modified));
        if name == MANIFEST {
            info.committed = true;
        } else if let Some(rank) = parse_rank_part_name(name) {
            info.ranks_present.push(rank);
        }
    }
    let mut out: Vec<CheckpointInfo> = steps.into_values().collect();
    for info in &mut out {
        info.ranks_present.sort_unstable();
    }
    Ok(out)
}

/// Reads and validates the manifest of `step`.
pub async fn read_manifest(store: &Store, step: u64) -> Result<Manifest> {
    let key = format!("{}/{MANIFEST}", step_dir(step));
    let info = match store.head(&key).await {
        Ok(info) => info,
        Err(e) if e.is_not_found() => {
            return Err(Error::NotFound(format!(
                "no committed checkpoint at step {step} in {} ({key} is missing)",
                store.url()
            )));
        }
        Err(e) => return Err(e.into()),
    };
    if info.size > crate::format::MAX_MANIFEST_BYTES {
        return Err(crate::format::FormatError::new(
            &key,
            None,
            format!(
                "{} bytes exceeds the {}-byte manifest limit",
                info.size,
                crate::format::MAX_MANIFEST_BYTES
            ),
        )
        .into());
    }
    let bytes = store.get(&key).await?;
    let manifest = Manifest::parse(&bytes, &key)?;
    if manifest.step != step {
        return Err(crate::format::FormatError::new(
            &key,
            None,
            format!(
                "manifest says step {}, its directory says {step}",
                manifest.step
            ),
        )
        .into());
    }
    Ok(manifest)
}

/// Committed steps, newest first (manifests not yet validated).
pub async fn committed_steps(store: &Store) -> Result<Vec<u64>> {
    let mut steps: Vec<u64> = list_checkpoints(store)
        .await?
        .into_iter()
        .filter(|c| c.committed)
        .map(|c| c.step)
        .collect();
    steps.reverse();
    Ok(steps)
}

/// The newest committed checkpoint whose manifest is valid. A corrupt newer one is
/// reported (tracing warning) and skipped. `None` when there is none.
pub async fn latest(store: &Store) -> Result<Option<Manifest>> {
    for step in committed_steps(store).await? {
        match read_manifest(store, step).await {
            Ok(manifest) => return Ok(Some(manifest)),
            Err(e) if e.is_corruption() => {
                warn!(step, error = %e, "skipping corrupt checkpoint");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// Keeps the `keep` newest committed checkpoints: deletes older committed ones, and
/// partial ones older than the newest commit (they can never commit: every rank has
/// moved on). Partial checkpoints newer than the newest commit may still be in
/// progress and are kept. Returns the steps deleted.
pub async fn apply_retention(store: &Store, keep: usize) -> Result<Vec<u64>> {
    let keep = keep.max(1);
    let all = list_checkpoints(store).await?;
    let committed: Vec<u64> = all.iter().filter(|c| c.committed).map(|c| c.step).collect();
    let Some(&newest) = committed.last() else {
        return Ok(Vec::new());
    };
    let oldest_kept = committed[committed.len().saturating_sub(keep)];
    let doomed: Vec<u64> = all
        .iter()
        .filter(|c| {
            if c.committed {
                c.step < oldest_kept
            } else {
                c.step < newest
            }
        })
        .map(|c| c.step)
        .collect();
    for &step in &doomed {
        // The manifest goes first: a half-deleted checkpoint is then merely partial.
        store
            .delete(&format!("{}/{MANIFEST}", step_dir(step)))
            .await?;
        store.delete_prefix(&step_dir(step)).await?;
    }
    Ok(doomed)
}
