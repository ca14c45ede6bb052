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

use std::collections::HashMap;

use ckpt_storage::{ObjectInfo, Store};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use crate::attempt::Attempt;
use crate::commits::{Appended, CommitRecord};
use crate::error::{Error, Result};
use crate::format::{
    FormatError, LATEST, Layout, LayoutBox, MANIFEST, Manifest, RankEntry, RankPart, TensorEntry,
    parse_rank_part_name, rank_part_name, seal, unseal,
};

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

/// Lists the attempt's directory once: how many of its parts (ranks below the world
/// size) are there.
pub(crate) async fn parts_present(store: &Store, attempt: &Attempt, world: u32) -> Result<usize> {
    let listing = store.list_dir(&attempt.dir()).await?;
    let mut present = vec![false; world as usize];
    for object in listing.objects {
        let name = object.key.rsplit('/').next().unwrap_or("");
        if let Some(rank) = parse_rank_part_name(name)
            && let Some(p) = present.get_mut(rank as usize)
        {
            *p = true;
        }
    }
    Ok(present.iter().filter(|&&p| p).count())
}

/// Parts read directly (without a listing) when at most this many are missing.
const PROBE_MAX: usize = 64;
/// Ranks whose keys one listing range covers (two keys each: 1,000, one S3 page).
const LIST_GROUP: u32 = 500;
/// Listing ranges requested at once.
const LISTS_IN_FLIGHT: usize = 16;
/// Parts, or data files, read at once by a committer: it reads a part for every two
/// objects the world writes, and must keep up with all of them.
const READS_IN_FLIGHT: usize = 128;

/// What a committer has learned about an attempt while its ranks write their parts.
///
/// Every object of an attempt is written once and never replaced (format v2), so what
/// a committer read while the parts arrived stands at the commit: a part parsed when
/// it appeared is the part the commit would read, and a data file seen with the size
/// its part records is whole. A committer that keeps one `Known` across its watch
/// reads each part once, as it lands; after the last rank's part lands only that
/// part is left to read, not the whole world's.
///
/// A look checks the slot, then, while many parts are missing, lists the ranges of
/// keys of the groups of [`LIST_GROUP`] ranks that still miss a part (a listing
/// shows every part and every data file with its size); complete groups are not
/// listed again. When at most [`PROBE_MAX`] parts are missing it reads (or, without
/// `read`, checks) those parts directly: a few requests instead of listings.
///
/// What is kept is a cache only: [`commit_gathered`] reads every part not in it and
/// checks every data file not seen whole, then checks that all of them agree, as
/// [`commit`] does from nothing.
#[derive(Debug)]
pub(crate) struct Known {
    world: u32,
    read: bool,
    /// Parts read and parsed, by rank.
    parts: Vec<Option<ReadPart>>,
    /// Ranks whose part is known to be written (read, listed, or found by a probe).
    present: Vec<bool>,
    /// Ranks whose read part's data file was seen with the size the part records.
    whole: Vec<bool>,
}

/// A part as read: its bytes, and what they parse to.
type ReadPart = (Vec<u8>, RankPart);

/// What one look at an attempt showed.
#[derive(Debug, Clone)]
pub(crate) struct Look {
    /// Ranks (below the world size) whose part is known to be written.
    pub parts: usize,
    /// Parts first seen in this look.
    pub new_parts: usize,
    /// The slot, when written.
    pub slot: Option<ObjectInfo>,
    /// Time spent listing (zero when the look only read parts directly).
    pub listing: std::time::Duration,
}

impl Known {
    /// Nothing known yet about the attempt of a world of `world` ranks. With `read`,
    /// each look reads and parses the parts it finds (the committer that commits
    /// first); without, it only tracks which are present (a backup committer, which
    /// reads them all if it ever takes over).
    pub(crate) fn new(world: u32, read: bool) -> Self {
        let n = world as usize;
        Self {
            world,
            read,
            parts: vec![None; n],
            present: vec![false; n],
            whole: vec![false; n],
        }
    }

    fn missing(&self) -> Vec<u32> {
        (0..self.world)
            .filter(|&r| !self.present[r as usize])
            .collect()
    }

    /// Looks at the attempt's directory once (see the type's docs) and reads what
    /// appeared.
    pub(crate) async fn look(&mut self, store: &Store, attempt: &Attempt) -> Result<Look> {
        let dir = attempt.dir();
        let missing = self.missing();
        let before = self.world as usize - missing.len();
        let listed = missing.len() > PROBE_MAX;
        let mut sizes: HashMap<String, u64> = HashMap::new();
        let mut found: Vec<u32> = Vec::new();
        let slot = match store.head(&slot_key(attempt)).await {
            Ok(info) => Some(info),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e.into()),
        };
        let started = std::time::Instant::now();
        let mut listing = std::time::Duration::ZERO;
        if listed {
            // Only the groups of ranks with a part missing are listed, each as one
            // range of keys (a rank's data file and part sort together:
            // `rank-00007-…` before `rank-00007.json`), several at once: a group
            // whose parts are all in is not listed again.
            let mut groups: Vec<u32> = missing.iter().map(|&r| r / LIST_GROUP).collect();
            groups.dedup();
            let ranges: Vec<(String, String)> = if self.world <= 100_000 {
                groups
                    .into_iter()
                    .map(|g| {
                        let first = g * LIST_GROUP;
                        let last = (first + LIST_GROUP).min(self.world) - 1;
                        let after = match first {
                            0 => format!("{dir}/rank-"),
                            _ => format!("{dir}/{}", rank_part_name(first - 1)),
                        };
                        (after, format!("{dir}/{}", rank_part_name(last)))
                    })
                    .collect()
            } else {
                // Six-digit ranks do not sort with five-digit ones: list them all.
                vec![(format!("{dir}/rank-"), format!("{dir}/rank.~"))]
            };
            let listed: Vec<Vec<ObjectInfo>> = futures::stream::iter(ranges)
                .map(|(after, until)| {
                    let dir = &dir;
                    async move { store.list_between(dir, &after, &until).await }
                })
                .buffer_unordered(LISTS_IN_FLIGHT)
                .try_collect()
                .await?;
            let objects = listed.into_iter().flatten();
            for object in objects {
                let name = object.key.rsplit('/').next().unwrap_or("").to_string();
                if let Some(rank) = parse_rank_part_name(&name)
                    && rank < self.world
                {
                    if !self.present[rank as usize] {
                        found.push(rank);
                    }
                } else if name != MANIFEST {
                    sizes.insert(name, object.size);
                }
            }
            listing = started.elapsed();
            for &rank in &found {
                self.present[rank as usize] = true;
            }
            if self.read {
                self.read_parts(store, &dir, &found).await?;
            }
        } else {
            if self.read {
                found = self.read_parts(store, &dir, &missing).await?;
            } else {
                let parts = missing
                    .into_iter()
                    .map(|rank| (rank, format!("{dir}/{}", rank_part_name(rank)), None));
                found = existing(store, parts.collect()).await?;
            }
            for &rank in &found {
                self.present[rank as usize] = true;
            }
        }
        // Data files of the parts just read: whole when the listing showed the size
        // their part records; otherwise (a probe, or a file the listing missed) one
        // request each now rather than after the last part.
        let mut unseen = Vec::new();
        for &rank in &found {
            let Some((_, part)) = &self.parts[rank as usize] else {
                continue;
            };
            match sizes.get(&part.file.name) {
                Some(&size) if size == part.file.stored_bytes => self.whole[rank as usize] = true,
                _ => unseen.push((
                    rank,
                    format!("{dir}/{}", part.file.name),
                    Some(part.file.stored_bytes),
                )),
            }
        }
        for rank in existing(store, unseen).await? {
            self.whole[rank as usize] = true;
        }
        let parts = self.present.iter().filter(|&&p| p).count();
        debug!(
            step = attempt.step,
            listed,
            missing = self.world as usize - before,
            found = found.len(),
            parts,
            listing_ms = listing.as_millis(),
            ms = started.elapsed().as_millis(),
            "looked at the attempt"
        );
        Ok(Look {
            parts,
            new_parts: parts - before,
            slot,
            listing,
        })
    }

    /// Reads and parses the parts of `ranks` not yet read; returns the ranks whose
    /// part exists. A part that does not parse is present but not kept: the commit
    /// reads it again and records why it cannot commit.
    async fn read_parts(&mut self, store: &Store, dir: &str, ranks: &[u32]) -> Result<Vec<u32>> {
        let wanted = ranks
            .iter()
            .copied()
            .filter(|&r| self.parts[r as usize].is_none());
        let read: Vec<(u32, Option<ReadPart>)> = futures::stream::iter(wanted)
            .map(|rank| {
                let key = format!("{dir}/{}", rank_part_name(rank));
                async move {
                    match store.get(&key).await {
                        Ok(bytes) => Ok(Some((
                            rank,
                            RankPart::parse(&bytes, &key)
                                .ok()
                                .map(|part| (bytes.to_vec(), part)),
                        ))),
                        Err(e) if e.is_not_found() => Ok(None),
                        Err(e) => Err(Error::from(e)),
                    }
                }
            })
            .buffer_unordered(READS_IN_FLIGHT)
            .try_filter_map(|r| async move { Ok(r) })
            .try_collect()
            .await?;
        let mut found = Vec::with_capacity(read.len());
        for (rank, part) in read {
            found.push(rank);
            self.parts[rank as usize] = part;
        }
        Ok(found)
    }
}

/// The ranks of `objects` (rank, key, expected size) that exist, with that size when
/// one is expected: HEAD requests, [`READS_IN_FLIGHT`] at once.
async fn existing(store: &Store, objects: Vec<(u32, String, Option<u64>)>) -> Result<Vec<u32>> {
    futures::stream::iter(objects)
        .map(|(rank, key, expected)| async move {
            match store.head(&key).await {
                Ok(info) => Ok(expected.is_none_or(|e| e == info.size).then_some(rank)),
                Err(e) if e.is_not_found() => Ok(None),
                Err(e) => Err(Error::from(e)),
            }
        })
        .buffer_unordered(READS_IN_FLIGHT)
        .try_filter_map(|r| async move { Ok(r) })
        .try_collect()
        .await
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
    commit_gathered(store, attempt, &Known::new(world, false)).await
}

/// [`commit`], with what a watching committer already read: only the parts not in
/// `known` are read, and only the data files it has not seen whole are checked.
pub(crate) async fn commit_gathered(
    store: &Store,
    attempt: &Attempt,
    known: &Known,
) -> Result<Outcome> {
    let world = known.world;
    let dir = attempt.dir();
    let unread = (0..world).filter(|&r| known.parts[r as usize].is_none());
    let fresh_read: Result<Vec<(Vec<u8>, RankPart)>> = futures::stream::iter(unread)
        .map(|rank| {
            let key = format!("{dir}/{}", rank_part_name(rank));
            async move {
                let bytes = store.get(&key).await?;
                let part = RankPart::parse(&bytes, &key)?;
                Ok::<_, Error>((bytes.to_vec(), part))
            }
        })
        .buffered(READS_IN_FLIGHT)
        .try_collect()
        .await;
    let fresh: Vec<(Vec<u8>, RankPart)>;
    let parts = match fresh_read {
        Ok(read) => {
            fresh = read;
            let mut fresh = fresh.iter();
            Ok(known
                .parts
                .iter()
                .filter_map(|cached| cached.as_ref().or_else(|| fresh.next()))
                .collect::<Vec<_>>())
        }
        Err(e) => Err(e),
    };
    let slot = slot_key(attempt);
    let manifest = match parts.and_then(|parts| {
        let (manifest, refuse) = build_judged_manifest(attempt, world, &parts)?;
        // The boxes must tile every tensor exactly: an overlap or a hole is refused
        // here, once, for every rank to read.
        manifest.validate(&slot)?;
        Ok((manifest, refuse))
    }) {
        Ok((_, Some(refusal))) => {
            warn!(step = attempt.step, "commit refused: {refusal}");
            return bury(
                store,
                attempt,
                &Outcome::Failed {
                    reason: format!("cannot commit step {}: {refusal}", attempt.step),
                },
            )
            .await;
        }
        Ok((manifest, None)) => manifest,
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
    // Every data file must be there, whole, before the commit vouches for it (the
    // ones seen whole while the parts arrived were: objects are never replaced).
    let files: Vec<(String, u64)> = manifest
        .ranks
        .iter()
        .filter(|entry| !known.whole[entry.rank as usize])
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
        .buffer_unordered(READS_IN_FLIGHT)
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

/// A box of a rank: (rank, offsets, lengths), borrowed from its part.
type RankBox<'a> = (u32, &'a [u64], &'a [u64]);
/// A tensor's name, dtype, shape and boxes, gathered from the parts.
type Gathered<'a> = (&'a str, crate::DType, &'a [u64], Vec<RankBox<'a>>);

/// Builds the root manifest from every rank's part (sorted by rank), with the
/// verdict on its health ([`crate::health::judge`]).
pub fn build_manifest(
    attempt: &Attempt,
    world: u32,
    parts: &[&(Vec<u8>, RankPart)],
) -> Result<Manifest> {
    Ok(build_judged_manifest(attempt, world, parts)?.0)
}

/// [`build_manifest`], and why the commit must be refused when a rank's replica
/// policy refuses the disagreement found.
fn build_judged_manifest(
    attempt: &Attempt,
    world: u32,
    parts: &[&(Vec<u8>, RankPart)],
) -> Result<(Manifest, Option<String>)> {
    let step = attempt.step;
    let first = &parts
        .first()
        .ok_or_else(|| Error::invalid("a checkpoint needs at least one rank"))?
        .1;
    let dir = attempt.dir();
    let name = attempt.name();
    // Tensors in the order first seen, found by name (a hash lookup per chunk: a
    // world of 16,384 ranks saving 1,000 tensors each has 16 M chunks).
    let mut tensors: Vec<Gathered<'_>> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    let mut ranks = Vec::with_capacity(parts.len());
    for &(bytes, part) in parts {
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
            let at = *index.entry(chunk.tensor.as_str()).or_insert_with(|| {
                tensors.push((
                    chunk.tensor.as_str(),
                    chunk.dtype,
                    chunk.shape.as_slice(),
                    Vec::with_capacity(parts.len()),
                ));
                tensors.len() - 1
            });
            let entry = &mut tensors[at];
            if entry.1 != chunk.dtype || entry.2 != chunk.shape.as_slice() {
                return Err(Error::Mismatch(format!(
                    "tensor {:?}: rank {} saved {} {:?}, another rank saved {} {:?}",
                    chunk.tensor, part.rank, chunk.dtype, chunk.shape, entry.1, entry.2
                )));
            }
            entry.3.push((
                part.rank,
                chunk.offsets.as_slice(),
                chunk.lengths.as_slice(),
            ));
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
    // Whether some rank holds several boxes of one tensor: the manifest is then of
    // version 3, else of version 2, which older readers still read.
    let mut several = false;
    tensors.sort_unstable_by_key(|t| t.0);
    for (name, dtype, shape, mut boxes) in tensors {
        boxes.sort_unstable();
        several |= boxes.windows(2).any(|w| w[0].0 == w[1].0);
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
    let global = parts
        .iter()
        .map(|e| &e.1)
        .find(|p| p.global_state.is_some());
    let verdict = crate::health::judge(
        &parts.iter().map(|e| &e.1).collect::<Vec<_>>(),
        global.map(|p| p.rank),
    );
    if let Some(health) = &verdict.health
        && !health.healthy
    {
        warn!(
            step,
            reasons = ?health.reasons,
            "step {step} is unhealthy; resumes pass over it unless asked for it"
        );
    }
    let manifest = Manifest {
        format_version: if verdict.health.is_some() {
            crate::format::version_with_health(several)
        } else {
            crate::format::version_for(several)
        },
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
        global_state_rank: global.map(|p| p.rank),
        metadata: global.map(|p| p.metadata.clone()).unwrap_or_default(),
        health: verdict.health,
    };
    Ok((manifest, verdict.refuse))
}

/// The compact dim-0 form when rank `r`'s rows follow rank `r-1`'s and every other
/// dimension is whole (one box per rank at most); the list of boxes otherwise,
/// sorted by rank and box, so that tensors chunked alike share it.
fn encode_layout(shape: &[u64], world: u32, mut boxes: Vec<RankBox<'_>>) -> Layout {
    boxes.sort_unstable();
    if !shape.is_empty() {
        let mut bounds = vec![0u64; world as usize + 1];
        let mut next_rank = 0u32;
        let mut rows = 0u64;
        let mut dim0 = true;
        for &(rank, offsets, lengths) in &boxes {
            let whole_rest = offsets[1..].iter().all(|&o| o == 0) && lengths[1..] == shape[1..];
            if !whole_rest || offsets[0] != rows || rank < next_rank {
                dim0 = false;
                break;
            }
            for r in next_rank..=rank {
                bounds[r as usize] = rows;
            }
            rows += lengths[0];
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
            .map(|(rank, offsets, lengths)| LayoutBox {
                rank,
                offsets: offsets.to_vec(),
                lengths: lengths.to_vec(),
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use crate::writer::{PlannedBox, RankFileWriter};
    use std::collections::BTreeMap;

    const SHAPE: [u64; 2] = [1024, 4];

    /// Writes rank `rank`'s data file and part of `attempt` (one dim-0 shard).
    async fn write_rank(store: &Store, attempt: &Attempt, rank: u32, world: u32) {
        let region = Region::dim0_shard(&SHAPE, rank as usize, world as usize);
        let bytes = vec![rank as u8; (region.volume().unwrap() * 4) as usize];
        let planned = PlannedBox {
            name: "w".into(),
            dtype: crate::DType::F32,
            shape: SHAPE.to_vec(),
            region,
        };
        let mut writer = RankFileWriter::begin(
            store,
            attempt,
            rank,
            world,
            4096,
            crate::Codec::None,
            &[planned],
        )
        .await
        .unwrap();
        writer.write(&bytes).await.unwrap();
        writer
            .finish(None, BTreeMap::new(), BTreeMap::new())
            .await
            .unwrap();
    }

    async fn write_ranks(
        store: &Store,
        attempt: &Attempt,
        ranks: std::ops::Range<u32>,
        world: u32,
    ) {
        for rank in ranks {
            write_rank(store, attempt, rank, world).await;
        }
    }

    fn fresh(name: &str) -> (Store, Attempt) {
        let store = Store::from_url(&format!("memory://commit-{name}")).unwrap();
        (store, Attempt::new(1, 0, "run").unwrap())
    }

    #[tokio::test]
    async fn a_watching_committer_reads_each_part_once_and_commits_with_a_few_requests() {
        let world = 200;
        let (store, attempt) = fresh("watching");
        let mut known = Known::new(world, true);
        write_ranks(&store, &attempt, 0..80, world).await;
        // Many missing: a listing from the start.
        let look = known.look(&store, &attempt).await.unwrap();
        assert_eq!((look.parts, look.new_parts), (80, 80));
        assert!(look.slot.is_none());
        // Still many: a listing from the lowest missing rank on.
        write_ranks(&store, &attempt, 80..150, world).await;
        let look = known.look(&store, &attempt).await.unwrap();
        assert_eq!((look.parts, look.new_parts), (150, 70));
        // Few missing: they are read directly.
        write_ranks(&store, &attempt, 150..199, world).await;
        let look = known.look(&store, &attempt).await.unwrap();
        assert_eq!((look.parts, look.new_parts), (199, 49));
        write_rank(&store, &attempt, 199, world).await;
        let counted = store.with_own_counter();
        let look = known.look(&counted, &attempt).await.unwrap();
        assert_eq!(look.parts, 200);
        // The slot, the last part and its data file.
        assert_eq!(counted.requests(), 3);
        let counted = store.with_own_counter();
        let outcome = commit_gathered(&counted, &attempt, &known).await.unwrap();
        assert!(matches!(outcome, Outcome::Committed { seq: Some(1) }));
        // No part read again, no data file checked again: the log, the slot, the hint.
        assert!(counted.requests() <= 8, "{} requests", counted.requests());
        let manifest = crate::read_manifest(&store, 1).await.unwrap();
        assert_eq!(manifest.ranks.len(), 200);
        assert_eq!(manifest.world_size, 200);
    }

    #[tokio::test]
    async fn a_committer_that_read_nothing_commits_the_same_manifest() {
        let world = 3;
        let (store, attempt) = fresh("cold");
        write_ranks(&store, &attempt, 0..world, world).await;
        let counted = store.with_own_counter();
        let outcome = commit(&counted, &attempt, world).await.unwrap();
        assert!(matches!(outcome, Outcome::Committed { seq: Some(1) }));
        // Every part read, every data file checked.
        assert!(counted.requests() >= 2 * world as u64);
    }

    #[tokio::test]
    async fn a_part_that_does_not_parse_when_first_read_still_buries_the_attempt() {
        let world = 4;
        let (store, attempt) = fresh("corrupt-part");
        write_ranks(&store, &attempt, 0..3, world).await;
        let key = format!("{}/{}", attempt.dir(), rank_part_name(3));
        store.put(&key, b"{not a part".to_vec()).await.unwrap();
        assert_fails_when_watched(&store, &attempt, world, "rank-00003.json").await;
    }

    #[tokio::test]
    async fn a_data_file_not_seen_whole_is_checked_at_the_commit() {
        let world = 4;
        let (store, attempt) = fresh("missing-file");
        write_ranks(&store, &attempt, 0..world, world).await;
        // Rank 2's data file disappears before the committer looks.
        let listing = store.list(&attempt.dir()).await.unwrap();
        let file = listing
            .iter()
            .find(|o| o.key.contains("rank-00002-"))
            .unwrap();
        store.delete(&file.key).await.unwrap();
        assert_fails_when_watched(&store, &attempt, world, "is missing").await;
    }

    /// A committer that watched every part in (present, though maybe not kept)
    /// records a failure whose reason names `why`.
    async fn assert_fails_when_watched(store: &Store, attempt: &Attempt, world: u32, why: &str) {
        let mut known = Known::new(world, true);
        assert_eq!(
            known.look(store, attempt).await.unwrap().parts,
            world as usize
        );
        let outcome = commit_gathered(store, attempt, &known).await.unwrap();
        assert!(
            matches!(&outcome, Outcome::Failed { reason } if reason.contains(why)),
            "{outcome:?}"
        );
    }

    #[tokio::test]
    async fn a_backup_tracks_presence_without_reading_parts() {
        let world = 100;
        let (store, attempt) = fresh("backup");
        write_ranks(&store, &attempt, 0..world, world).await;
        let counted = store.with_own_counter();
        let mut known = Known::new(world, false);
        let look = known.look(&counted, &attempt).await.unwrap();
        assert_eq!(look.parts, 100);
        // The slot and one listing.
        assert_eq!(counted.requests(), 2);
        assert!(known.parts.iter().all(Option::is_none));
    }

    fn borrowed(regions: &[(u32, Region)]) -> Vec<RankBox<'_>> {
        regions
            .iter()
            .map(|(rank, r)| (*rank, r.offsets.as_slice(), r.lengths.as_slice()))
            .collect()
    }

    #[test]
    fn dim0_shards_encode_compactly() {
        let shape = [10u64, 4];
        let regions: Vec<_> = (0..3)
            .map(|r| (r, Region::dim0_shard(&shape, r as usize, 3)))
            .collect();
        assert_eq!(
            encode_layout(&shape, 3, borrowed(&regions)),
            Layout::Dim0(vec![0, 3, 6, 10])
        );
        // A rank without rows keeps its (empty) slot.
        let regions = vec![
            (0, Region::rows(&shape, 0, 4)),
            (2, Region::rows(&shape, 4, 6)),
        ];
        assert_eq!(
            encode_layout(&shape, 3, borrowed(&regions)),
            Layout::Dim0(vec![0, 4, 4, 10])
        );
    }

    #[test]
    fn column_splits_stay_boxes() {
        let shape = [4u64, 4];
        let regions = vec![
            (0, Region::new(vec![0, 0], vec![4, 2])),
            (1, Region::new(vec![0, 2], vec![4, 2])),
        ];
        assert!(
            matches!(encode_layout(&shape, 2, borrowed(&regions)), Layout::Boxes(b) if b.len() == 2)
        );
    }
}
