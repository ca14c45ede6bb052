//! The commit of one save attempt (format v2), and how every rank learns its outcome.
//!
//! An attempt's directory (see [`crate::attempt`]) fills with every rank's data file
//! and part. Its **slot**, `manifest.json` in that directory, is written exactly once,
//! create-if-absent, and decides the attempt's outcome for everybody:
//!
//! - a manifest: committed. Before writing it, the committer appended the attempt to
//!   the commit log ([`crate::commits`]), which orders it among all commits and fences
//!   it: an attempt whose generation is older than the log's newest is refused;
//! - a tombstone (`{"failed": …}`): the attempt failed (its parts disagree, a data
//!   file is missing) or was superseded by a newer generation. The reason is there
//!   for every rank to read, not only for the rank that tried.
//!
//! Only the parts of this attempt are read: parts of other attempts of the same step
//! (another world, an earlier run) live in other directories and cannot interfere.
//! Several committers may race; the log append is idempotent per attempt and the slot
//! is create-if-absent, so they agree on one outcome.

use std::collections::{BTreeMap, HashMap};

use ckpt_storage::{ObjectInfo, Store};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use crate::attempt::Attempt;
use crate::commits::{Appended, CommitRecord};
use crate::error::{Error, Result};
use crate::format::{
    FORMAT_VERSION, FormatError, LATEST, Layout, LayoutBox, MANIFEST, Manifest, RankEntry,
    RankPart, TensorEntry, parse_rank_part_name, rank_part_name, seal, unseal,
};
use crate::region::Region;

/// Tombstones are small; a slot larger than this is a manifest.
pub(crate) const MAX_TOMBSTONE_BYTES: u64 = 4096;

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Its manifest is written; `seq` is its position in the commit log when known
    /// to the caller (the rank that committed it).
    Committed {
        /// Position in the commit log.
        seq: Option<u64>,
    },
    /// It can never commit; the reason is recorded in its slot.
    Failed {
        /// Why.
        reason: String,
    },
    /// A newer generation committed first: this attempt is fenced off.
    Superseded {
        /// The newer generation.
        generation: u64,
    },
}

/// The body of a tombstone.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Tombstone {
    failed: TombstoneBody,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct TombstoneBody {
    reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    superseded_by_generation: Option<u64>,
}

/// The slot of `attempt`: `DIR/manifest.json`.
pub(crate) fn slot_key(attempt: &Attempt) -> String {
    format!("{}/{MANIFEST}", attempt.dir())
}

/// What one listing of an attempt's directory shows.
#[derive(Debug, Clone)]
pub(crate) struct Presence {
    /// Ranks (below the world size) whose part is there.
    pub parts: usize,
    /// The slot, when written.
    pub slot: Option<ObjectInfo>,
}

/// Lists the attempt's directory: how many parts are there, and whether the slot is.
pub(crate) async fn presence(store: &Store, attempt: &Attempt, world: u32) -> Result<Presence> {
    let listing = store.list_dir(&attempt.dir()).await?;
    let mut present = vec![false; world as usize];
    let mut slot = None;
    for object in listing.objects {
        let name = object.key.rsplit('/').next().unwrap_or("");
        if name == MANIFEST {
            slot = Some(object);
        } else if let Some(rank) = parse_rank_part_name(name)
            && let Some(p) = present.get_mut(rank as usize)
        {
            *p = true;
        }
    }
    Ok(Presence {
        parts: present.iter().filter(|&&p| p).count(),
        slot,
    })
}

/// Reads the outcome recorded in the slot; `None` while it is not written.
pub(crate) async fn read_outcome(store: &Store, attempt: &Attempt) -> Result<Option<Outcome>> {
    let key = slot_key(attempt);
    let info = match store.head(&key).await {
        Ok(info) => info,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    outcome_of_slot(store, &key, &info).await.map(Some)
}

async fn outcome_of_slot(store: &Store, key: &str, info: &ObjectInfo) -> Result<Outcome> {
    if info.size > MAX_TOMBSTONE_BYTES {
        return Ok(Outcome::Committed { seq: None });
    }
    let bytes = store.get(key).await?;
    Ok(match parse_tombstone(&bytes, key)? {
        Some(outcome) => outcome,
        None => Outcome::Committed { seq: None },
    })
}

/// The tombstone's outcome, or `None` when `bytes` is not a tombstone (a manifest).
pub(crate) fn parse_tombstone(bytes: &[u8], object: &str) -> Result<Option<Outcome>> {
    let (body, offset) = unseal(bytes, object, crate::format::MAX_MANIFEST_BYTES)?;
    if !body.starts_with(b"{\"failed\"") {
        return Ok(None);
    }
    let tombstone: Tombstone = serde_json::from_slice(body).map_err(|e| {
        FormatError::new(
            object,
            Some(offset as u64),
            format!("invalid tombstone: {e}"),
        )
    })?;
    Ok(Some(match tombstone.failed.superseded_by_generation {
        Some(generation) => Outcome::Superseded { generation },
        None => Outcome::Failed {
            reason: tombstone.failed.reason,
        },
    }))
}

/// Which failures [`retry`] tries again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Transient ones ([`Error::is_transient`]), on remote stores only: local disk
    /// and memory do not retry, as the store itself does not.
    Transient,
    /// Any, on every store: for a write whose absence leaves other ranks waiting (a
    /// failed save's tombstone), where a full disk may have room again a moment later.
    Any,
}

/// Runs `request`, and runs it again after a failure `when` allows, within the
/// store's retry budget (its `max_retries`, `retry_timeout` and backoff).
///
/// For the requests object_store does not retry because they are not idempotent as
/// such (a create-if-absent put whose connection was reset may have landed), which
/// their callers make safe to repeat: an `AlreadyExists` on a later try is read as
/// "maybe my own first try" (a part compares the bytes, a slot reads the outcome,
/// the commit log finds the attempt's record).
pub(crate) async fn retry<T, F, Fut>(
    store: &Store,
    what: &str,
    when: Retry,
    mut request: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let settings = &store.config().retry;
    let local = matches!(
        store.backend(),
        ckpt_storage::Backend::Local | ckpt_storage::Backend::Memory
    );
    let retries = match when {
        Retry::Transient if local => 0,
        _ => settings.max_retries,
    };
    let started = std::time::Instant::now();
    let mut backoff = settings.init_backoff;
    let mut tried = 0;
    loop {
        match request().await {
            Err(e)
                if (when == Retry::Any || e.is_transient())
                    && tried < retries
                    && started.elapsed() + backoff < settings.retry_timeout =>
            {
                tried += 1;
                warn!(error = %e, retry = tried, "{what} failed; trying again");
                tokio::time::sleep(backoff).await;
                backoff = backoff
                    .mul_f64(settings.backoff_base)
                    .min(settings.max_backoff);
            }
            result => return result,
        }
    }
}

/// Records that `attempt` can never commit. Another committer may have decided the
/// slot first: the outcome returned is the one that stands.
pub(crate) async fn bury(store: &Store, attempt: &Attempt, outcome: &Outcome) -> Result<Outcome> {
    let body = match outcome {
        Outcome::Committed { .. } => unreachable!("a commit is not buried"),
        Outcome::Failed { reason } => TombstoneBody {
            reason: truncate(reason, 1024),
            superseded_by_generation: None,
        },
        Outcome::Superseded { generation } => TombstoneBody {
            reason: format!("generation {generation} committed first"),
            superseded_by_generation: Some(*generation),
        },
    };
    let bytes = seal(&serde_json::to_vec(&Tombstone { failed: body }).expect("serializes"));
    match store.put_if_absent(&slot_key(attempt), bytes).await {
        Ok(()) => Ok(outcome.clone()),
        Err(e) if e.is_already_exists() => Ok(read_outcome(store, attempt)
            .await?
            .unwrap_or_else(|| outcome.clone())),
        Err(e) => Err(e.into()),
    }
}

fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

/// Commits `attempt` of a world of `world` ranks, whose parts must all be present.
///
/// Reads every part, checks that they agree, checks that every data file is there
/// whole, appends the attempt to the commit log (refused when a newer generation has
/// committed) and writes the manifest into the slot. A disagreement is recorded as a
/// tombstone; a storage error is returned (nothing recorded: another committer, or a
/// retry, may still succeed).
pub(crate) async fn commit(store: &Store, attempt: &Attempt, world: u32) -> Result<Outcome> {
    let dir = attempt.dir();
    let parts: Result<Vec<(Vec<u8>, RankPart)>> = futures::stream::iter(0..world)
        .map(|rank| {
            let key = format!("{dir}/{}", rank_part_name(rank));
            async move {
                let bytes = store.get(&key).await?;
                let part = RankPart::parse(&bytes, &key)?;
                Ok::<_, Error>((bytes.to_vec(), part))
            }
        })
        .buffered(32)
        .try_collect()
        .await;
    let slot = slot_key(attempt);
    let manifest = match parts.and_then(|parts| {
        let manifest = build_manifest(attempt, world, &parts)?;
        // The boxes must tile every tensor exactly: an overlap or a hole is refused
        // here, once, for every rank to read.
        manifest.validate(&slot)?;
        Ok(manifest)
    }) {
        Ok(manifest) => manifest,
        Err(e @ (Error::Corrupt(_) | Error::Mismatch(_) | Error::Invalid(_))) => {
            return bury(
                store,
                attempt,
                &Outcome::Failed {
                    reason: e.to_string(),
                },
            )
            .await;
        }
        Err(e) => return Err(e),
    };
    // Every data file must be there, whole, before the commit vouches for it.
    let files: Vec<(String, u64)> = manifest
        .ranks
        .iter()
        .map(|entry| (format!("{dir}/{}", entry.file), entry.stored_bytes))
        .collect();
    let missing: Vec<String> = futures::stream::iter(files)
        .map(|(key, expected)| async move {
            match store.head(&key).await {
                Ok(info) if info.size == expected => Ok(None),
                Ok(info) => Ok(Some(format!(
                    "{key} has {} bytes, its part records {expected}",
                    info.size
                ))),
                Err(e) if e.is_not_found() => Ok(Some(format!("{key} is missing"))),
                Err(e) => Err(Error::from(e)),
            }
        })
        .buffer_unordered(32)
        .try_filter_map(|m| async move { Ok(m) })
        .try_collect()
        .await?;
    if let Some(first) = missing.first() {
        let reason = format!(
            "cannot commit step {}: {first}{}",
            attempt.step,
            match missing.len() {
                1 => String::new(),
                n => format!(" (and {} more data files)", n - 1),
            }
        );
        return bury(store, attempt, &Outcome::Failed { reason }).await;
    }
    crate::failpoint::hit("before-commit");
    let seq = match crate::commits::append(store, &CommitRecord::new(attempt, world)).await? {
        Appended::At(seq) => seq,
        Appended::Fenced { generation, .. } => {
            return bury(store, attempt, &Outcome::Superseded { generation }).await;
        }
    };
    let key = slot_key(attempt);
    match store.put_if_absent(&key, manifest.to_bytes()).await {
        Ok(()) => {}
        Err(e) if e.is_already_exists() => {
            return Ok(read_outcome(store, attempt)
                .await?
                .map(|o| match o {
                    Outcome::Committed { .. } => Outcome::Committed { seq: Some(seq) },
                    other => other,
                })
                .unwrap_or(Outcome::Committed { seq: Some(seq) }));
        }
        Err(e) => return Err(e.into()),
    }
    debug!(step = attempt.step, seq, "committed");
    // The hint is for humans and old tools; readers use the commit log.
    if let Err(e) = store.put(LATEST, attempt.step.to_string()).await {
        warn!(step = attempt.step, error = %e, "could not update the latest hint");
    }
    Ok(Outcome::Committed { seq: Some(seq) })
}

/// A tensor's dtype, shape and (rank, box) chunks, gathered from the parts.
type Gathered<'a> = (crate::DType, &'a [u64], Vec<(u32, Region)>);

/// Builds the root manifest from every rank's part (sorted by rank).
#[doc(hidden)]
pub fn build_manifest(
    attempt: &Attempt,
    world: u32,
    parts: &[(Vec<u8>, RankPart)],
) -> Result<Manifest> {
    let step = attempt.step;
    let first = &parts
        .first()
        .ok_or_else(|| Error::invalid("a checkpoint needs at least one rank"))?
        .1;
    let dir = attempt.dir();
    let name = attempt.name();
    let mut tensors: BTreeMap<&str, Gathered<'_>> = BTreeMap::new();
    let mut ranks = Vec::with_capacity(parts.len());
    for (bytes, part) in parts {
        let object = format!("{dir}/{}", rank_part_name(part.rank));
        let disagree = |what: &str, theirs: String, ours: String| {
            Error::Corrupt(crate::format::FormatError::new(
                &object,
                None,
                format!(
                    "{what} {theirs} disagrees with rank {}'s {ours}",
                    first.rank
                ),
            ))
        };
        if part.step != step || part.world_size != world || part.rank as usize != ranks.len() {
            return Err(disagree(
                "step/world/rank",
                format!("{}/{}/{}", part.step, part.world_size, part.rank),
                format!("{step}/{world}/{}", ranks.len()),
            ));
        }
        if part.attempt.as_deref() != Some(name.as_str()) || part.generation != attempt.generation {
            return Err(disagree(
                "attempt/generation",
                format!("{:?}/{}", part.attempt, part.generation),
                format!("{name:?}/{}", attempt.generation),
            ));
        }
        if part.block_size != first.block_size || part.codec != first.codec {
            return Err(disagree(
                "block size/codec",
                format!("{}/{:?}", part.block_size, part.codec),
                format!("{}/{:?}", first.block_size, first.codec),
            ));
        }
        for chunk in &part.chunks {
            let entry = tensors.entry(chunk.tensor.as_str()).or_insert((
                chunk.dtype,
                chunk.shape.as_slice(),
                Vec::new(),
            ));
            if entry.0 != chunk.dtype || entry.1 != chunk.shape.as_slice() {
                return Err(Error::Mismatch(format!(
                    "tensor {:?}: rank {} saved {} {:?}, another rank saved {} {:?}",
                    chunk.tensor, part.rank, chunk.dtype, chunk.shape, entry.0, entry.1
                )));
            }
            entry.2.push((part.rank, chunk.region()));
        }
        ranks.push(RankEntry {
            rank: part.rank,
            part: rank_part_name(part.rank),
            part_bytes: bytes.len() as u64,
            part_crc32: crc32fast::hash(bytes),
            file: part.file.name.clone(),
            stored_bytes: part.file.stored_bytes,
            raw_bytes: part.file.raw_bytes,
        });
    }

    let mut layouts: Vec<Layout> = Vec::new();
    let mut layout_ids: HashMap<Layout, u32> = HashMap::new();
    let mut entries = Vec::with_capacity(tensors.len());
    for (name, (dtype, shape, boxes)) in tensors {
        let layout = encode_layout(shape, world, boxes);
        let id = *layout_ids.entry(layout.clone()).or_insert_with(|| {
            layouts.push(layout);
            (layouts.len() - 1) as u32
        });
        entries.push(TensorEntry {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            layout: id,
        });
    }
    let global = parts.iter().find(|(_, p)| p.global_state.is_some());
    Ok(Manifest {
        format_version: FORMAT_VERSION,
        step,
        attempt: Some(name),
        world_size: world,
        generation: attempt.generation,
        created_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        block_size: first.block_size,
        codec: first.codec,
        tensors: entries,
        layouts,
        ranks,
        global_state_rank: global.map(|(_, p)| p.rank),
        metadata: global.map(|(_, p)| p.metadata.clone()).unwrap_or_default(),
    })
}

/// The compact dim-0 form when rank `r`'s rows follow rank `r-1`'s and every other
/// dimension is whole; the list of boxes otherwise.
fn encode_layout(shape: &[u64], world: u32, mut boxes: Vec<(u32, Region)>) -> Layout {
    boxes.sort_by_key(|(rank, _)| *rank);
    if !shape.is_empty() {
        let mut bounds = vec![0u64; world as usize + 1];
        let mut next_rank = 0u32;
        let mut rows = 0u64;
        let mut dim0 = true;
        for (rank, region) in &boxes {
            let whole_rest =
                region.offsets[1..].iter().all(|&o| o == 0) && region.lengths[1..] == shape[1..];
            if !whole_rest || region.offsets[0] != rows || *rank < next_rank {
                dim0 = false;
                break;
            }
            for r in next_rank..=*rank {
                bounds[r as usize] = rows;
            }
            rows += region.lengths[0];
            next_rank = rank + 1;
        }
        if dim0 && rows == shape[0] {
            for bound in bounds.iter_mut().skip(next_rank as usize) {
                *bound = rows;
            }
            return Layout::Dim0(bounds);
        }
    }
    Layout::Boxes(
        boxes
            .into_iter()
            .map(|(rank, region)| LayoutBox {
                rank,
                offsets: region.offsets,
                lengths: region.lengths,
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dim0_shards_encode_compactly() {
        let shape = [10u64, 4];
        let boxes = (0..3)
            .map(|r| (r, Region::dim0_shard(&shape, r as usize, 3)))
            .collect();
        assert_eq!(
            encode_layout(&shape, 3, boxes),
            Layout::Dim0(vec![0, 3, 6, 10])
        );
        // A rank without rows keeps its (empty) slot.
        let boxes = vec![
            (0, Region::rows(&shape, 0, 4)),
            (2, Region::rows(&shape, 4, 6)),
        ];
        assert_eq!(
            encode_layout(&shape, 3, boxes),
            Layout::Dim0(vec![0, 4, 4, 10])
        );
    }

    #[test]
    fn column_splits_stay_boxes() {
        let shape = [4u64, 4];
        let boxes = vec![
            (0, Region::new(vec![0, 0], vec![4, 2])),
            (1, Region::new(vec![0, 2], vec![4, 2])),
        ];
        assert!(matches!(encode_layout(&shape, 2, boxes), Layout::Boxes(b) if b.len() == 2));
    }
}
