//! Finding checkpoints under a root: the newest commit, a step's commit, the survey
//! that `ckpt ls` and retention read.
//!
//! Commit order, not step order, says which checkpoint is newest (see
//! [`crate::commits`]). Version-1 checkpoints (`step-N/manifest.json`, no log) stay
//! readable: they come first in commit order, by step, before every logged commit.
//!
//! This module is the one place that says what a commit is, and every command and
//! every rank asks it (docs/FORMAT.md, sections 1 and 6.4): a record names a commit
//! only when its attempt's slot holds a manifest ([`names_a_commit`]); a record whose
//! slot is empty, tombstoned or gone is skipped by loading, opening by step, `ls`,
//! `verify` and retention alike, so no two commands can disagree on the newest.
//!
//! Finding the newest commit reads the tail of the commit log (two requests, and the
//! record before the tail) and the newest manifest; only when the tail cannot be
//! trusted alone, or every logged commit of it fails to open, does it read the whole
//! history. The survey ([`list_checkpoints`]) lists everything, for tools.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::SystemTime;

use ckpt_storage::{ObjectInfo, Store};
use tracing::{debug, warn};

use crate::attempt::Attempt;
use crate::commit::{MAX_TOMBSTONE_BYTES, Outcome, parse_tombstone};
use crate::commits::{LoggedCommit, parse_record_key};
use crate::error::{Error, Result};
use crate::format::{MANIFEST, Manifest, parse_rank_part_name, parse_step_dir, step_dir};

/// One committed checkpoint, as the commit order knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// Position in the commit log; `None` for a version-1 checkpoint.
    pub seq: Option<u64>,
    /// The step.
    pub step: u64,
    /// The directory holding its objects (`step-N/gG-RUN`, or `step-N` for v1).
    pub dir: String,
    /// When it was committed (the log record's time), when known.
    pub time: Option<SystemTime>,
}

impl Commit {
    fn logged(entry: &LoggedCommit) -> Self {
        Self {
            seq: Some(entry.seq),
            step: entry.record.step,
            dir: entry.record.attempt().dir(),
            time: Some(entry.written),
        }
    }

    fn v1(step: u64, time: Option<SystemTime>) -> Self {
        Self {
            seq: None,
            step,
            dir: step_dir(step),
            time,
        }
    }

    /// The key of its manifest.
    pub fn manifest_key(&self) -> String {
        format!("{}/{MANIFEST}", self.dir)
    }

    /// The save attempt it committed (step, generation, run), read off its
    /// directory; `None` for a version-1 checkpoint, which has no attempt.
    pub fn attempt(&self) -> Option<Attempt> {
        let (step, name) = self.dir.split_once('/')?;
        (parse_step_dir(step) == Some(self.step))
            .then(|| Attempt::parse(self.step, name))
            .flatten()
    }
}

/// Removes repeated records of one attempt (a racing committer may append twice);
/// the first one is its place in the commit order.
fn dedup(entries: &[LoggedCommit]) -> Vec<Commit> {
    let mut seen = HashSet::new();
    entries
        .iter()
        .filter(|e| seen.insert((e.record.step, e.record.attempt.clone())))
        .map(Commit::logged)
        .collect()
}

/// Version-1 commits (a `manifest.json` directly in a step directory), by step.
async fn v1_commits(store: &Store) -> Result<Vec<Commit>> {
    let listing = store.list_dir("").await?;
    let mut out = Vec::new();
    for prefix in listing.prefixes {
        let Some(step) = parse_step_dir(prefix.trim_end_matches('/')) else {
            continue;
        };
        match store.head(&format!("{}/{MANIFEST}", step_dir(step))).await {
            Ok(info) => out.push(Commit::v1(step, Some(info.last_modified))),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e.into()),
        }
    }
    out.sort_by_key(|c| c.step);
    Ok(out)
}

/// Every commit under the root, oldest first in commit order (version-1 checkpoints
/// first, then the commit log). Commits whose manifest is missing or corrupt are
/// included: [`read_commit`] says which open.
pub async fn commits(store: &Store) -> Result<Vec<Commit>> {
    let mut all = v1_commits(store).await?;
    all.extend(dedup(&crate::commits::read_all(store).await?));
    Ok(all)
}

/// Reads and validates the manifest of `commit`.
pub async fn read_commit(store: &Store, commit: &Commit) -> Result<Manifest> {
    let key = commit.manifest_key();
    let info = match store.head(&key).await {
        Ok(info) => info,
        Err(e) if e.is_not_found() => {
            return Err(Error::NotFound(format!(
                "checkpoint of step {} in {} has no manifest ({key} is missing)",
                commit.step,
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
    if commit.seq.is_some()
        && let Some(outcome) = parse_tombstone(&bytes, &key)?
    {
        return Err(Error::NotFound(format!(
            "the save of step {} in {} did not commit: {}",
            commit.step,
            commit.dir,
            outcome_text(&outcome)
        )));
    }
    let manifest = Manifest::parse(&bytes, &key)?;
    if manifest.step != commit.step || manifest.dir() != commit.dir {
        return Err(crate::format::FormatError::new(
            &key,
            None,
            format!(
                "manifest says step {} in {}, it was found as step {} in {}",
                manifest.step,
                manifest.dir(),
                commit.step,
                commit.dir
            ),
        )
        .into());
    }
    Ok(manifest)
}

fn outcome_text(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Committed { .. } => "committed".to_string(),
        Outcome::Failed { reason } => format!("failed: {reason}"),
        Outcome::Superseded { generation } => {
            format!("superseded: generation {generation} committed first")
        }
    }
}

/// Whether a commit record names a commit: its slot holds a manifest (a corrupt one
/// included: that is a commit that fails its checks, reported where it is read).
/// A slot that is empty (a crash between commit steps 3 and 4), holds a tombstone,
/// or lies in a directory that is gone names no commit, and every command skips
/// the record. A version-1 commit is found by its manifest, so it names one.
pub async fn names_a_commit(store: &Store, commit: &Commit) -> Result<bool> {
    let Some(attempt) = commit.attempt() else {
        return Ok(commit.seq.is_none());
    };
    match crate::commit::read_outcome(store, &attempt).await {
        Ok(Some(Outcome::Committed { .. })) => Ok(true),
        Ok(None | Some(Outcome::Failed { .. } | Outcome::Superseded { .. })) => Ok(false),
        Err(e) if e.is_corruption() => Ok(true),
        Err(e) => Err(e),
    }
}

/// Reads and validates the manifest of the newest commit of `step` (in commit
/// order: a step saved again by a later run is that run's checkpoint). Records of
/// the step that name no commit ([`names_a_commit`]) are skipped.
pub async fn read_manifest(store: &Store, step: u64) -> Result<Manifest> {
    let logged = crate::commits::read_all(store).await?;
    let mut skipped = None;
    for commit in dedup(&logged).into_iter().rev().filter(|c| c.step == step) {
        match read_commit(store, &commit).await {
            Err(e @ Error::NotFound(_)) => {
                debug!(step, dir = %commit.dir, error = %e, "a commit record that names no commit");
                skipped.get_or_insert(e);
            }
            opened => return opened,
        }
    }
    read_commit(store, &Commit::v1(step, None))
        .await
        .map_err(|e| match e {
            Error::NotFound(_) => Error::NotFound(format!(
                "no committed checkpoint at step {step} in {}{}",
                store.url(),
                skipped.map_or(String::new(), |e| format!(
                    " (its newest commit record names none: {e})"
                ))
            )),
            e => e,
        })
}

/// The newest commit of every committed step, newest first (a step committed twice
/// appears once, at its newest commit). Costs the whole log and a slot read for every
/// distinct step of it.
pub async fn newest_commit_per_step(store: &Store) -> Result<Vec<Commit>> {
    let mut seen = HashSet::new();
    let mut newest = Vec::new();
    for commit in commits(store).await?.into_iter().rev() {
        if !seen.contains(&commit.step) && names_a_commit(store, &commit).await? {
            seen.insert(commit.step);
            newest.push(commit);
        }
    }
    Ok(newest)
}

/// Committed steps, newest commit first: the steps of [`newest_commit_per_step`].
pub async fn committed_steps(store: &Store) -> Result<Vec<u64>> {
    Ok(newest_commit_per_step(store)
        .await?
        .into_iter()
        .map(|c| c.step)
        .collect())
}

/// The newest commit in commit order, whether its manifest opens or not (a corrupt
/// one is what `ckpt verify` reports); records that name no commit are skipped.
/// `None` when there is none. Costs the log's tail and a slot read per record
/// skipped.
pub async fn newest_commit(store: &Store) -> Result<Option<Commit>> {
    let mut walk = NewestFirst::new(store).await?;
    while let Some(commit) = walk.next().await? {
        if names_a_commit(store, &commit).await? {
            return Ok(Some(commit));
        }
    }
    Ok(None)
}

/// Commits newest first, fetched as they are needed: the tail of the commit log
/// first (two requests), the rest of the history (the whole log and version-1 step
/// directories) only when the caller walks past the tail. For choosing where to
/// resume, where the newest commit is nearly always the answer.
#[derive(Debug)]
pub struct NewestFirst {
    store: Store,
    pending: Vec<Commit>,
    seen: HashSet<String>,
    history_read: bool,
}

impl NewestFirst {
    /// Starts at the newest commit of `store`.
    ///
    /// An attempt recorded twice takes its place at its first record, and the tail
    /// alone cannot show that a record repeats an older one. So the tail is trusted
    /// only when every record of it has a step above the record before it (read too:
    /// one request more), as a run that goes on saving writes them; a record that
    /// goes back in steps (a resume from an older checkpoint, or a repeat) makes it
    /// read the whole history, whose order every command shares.
    pub async fn new(store: &Store) -> Result<Self> {
        let tail = crate::commits::read_tail(store).await?;
        let before = match tail.first() {
            Some(first) if first.seq > 1 => crate::commits::read_one(store, first.seq - 1).await?,
            _ => None,
        };
        let steps: Vec<u64> = before.iter().chain(&tail).map(|r| r.record.step).collect();
        let climbing = steps.windows(2).all(|w| w[0] < w[1]);
        let mut pending = if climbing { dedup(&tail) } else { Vec::new() };
        let history_read = pending.is_empty();
        if history_read {
            pending = commits(store).await?;
        }
        Ok(Self {
            store: store.clone(),
            pending,
            seen: HashSet::new(),
            history_read,
        })
    }

    /// The next older commit, or `None` after the oldest.
    pub async fn next(&mut self) -> Result<Option<Commit>> {
        loop {
            if let Some(commit) = self.pending.pop() {
                if self.seen.insert(commit.dir.clone()) {
                    return Ok(Some(commit));
                }
                continue;
            }
            if self.history_read {
                return Ok(None);
            }
            self.history_read = true;
            self.pending = commits(&self.store).await?;
        }
    }
}

/// The newest committed checkpoint whose manifest is valid, healthy or not (see
/// [`latest_selecting`] for the newest healthy one). A corrupt newer one is
/// reported (tracing warning) and skipped. `None` when there is none.
///
/// Costs the log's tail and one manifest when the newest commit is sound.
pub async fn latest(store: &Store) -> Result<Option<Manifest>> {
    let mut walk = NewestFirst::new(store).await?;
    while let Some(commit) = walk.next().await? {
        if let Some(manifest) = open_or_skip(store, &commit).await? {
            return Ok(Some(manifest));
        }
    }
    Ok(None)
}

/// Which checkpoints a search for "the newest" accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Select {
    /// Any that is not judged unhealthy: healthy, or of unknown health (written
    /// before health was recorded). What resumes use.
    #[default]
    Healthy,
    /// Any committed checkpoint, healthy or not. What the tools show.
    Any,
}

/// A commit that a search for the newest healthy checkpoint passed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Its step.
    pub step: u64,
    /// Its directory.
    pub dir: String,
    /// Why it is unhealthy.
    pub reasons: Vec<String>,
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "step {} ({}) is unhealthy: {}",
            self.step,
            self.dir,
            self.reasons.join("; ")
        )
    }
}

/// Whether `manifest` is one `select` accepts; `None` when it does, the skipped
/// commit (warned about) when it does not.
pub fn passes(manifest: &Manifest, select: Select) -> Option<Skipped> {
    let status = manifest.health_status();
    if select == Select::Any || status.acceptable() {
        return None;
    }
    let skipped = Skipped {
        step: manifest.step,
        dir: manifest.dir(),
        reasons: status.reasons().to_vec(),
    };
    warn!("passing over checkpoint {skipped}");
    Some(skipped)
}

/// The newest committed checkpoint whose manifest is valid and that `select`
/// accepts, and the unhealthy commits passed over on the way (newest first, each
/// also a tracing warning). Costs [`latest`]'s requests plus one manifest per
/// commit passed over.
pub async fn latest_selecting(
    store: &Store,
    select: Select,
) -> Result<Option<(Manifest, Vec<Skipped>)>> {
    let mut walk = NewestFirst::new(store).await?;
    let mut skipped = Vec::new();
    while let Some(commit) = walk.next().await? {
        if let Some(manifest) = open_or_skip(store, &commit).await? {
            match passes(&manifest, select) {
                None => return Ok(Some((manifest, skipped))),
                Some(passed) => skipped.push(passed),
            }
        }
    }
    Ok(None)
}

async fn open_or_skip(store: &Store, commit: &Commit) -> Result<Option<Manifest>> {
    match read_commit(store, commit).await {
        Ok(manifest) => Ok(Some(manifest)),
        Err(e) if e.is_corruption() => {
            warn!(step = commit.step, dir = %commit.dir, error = %e, "skipping corrupt checkpoint");
            Ok(None)
        }
        Err(e @ Error::NotFound(_)) => {
            warn!(step = commit.step, dir = %commit.dir, error = %e, "skipping a commit without a manifest");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// What a directory under the root holds, as far as a listing can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Committed, and the newest commit of its timeline.
    Committed,
    /// Committed, but a later commit went back to its step or before (a run resumed
    /// from an older checkpoint): no longer on the timeline that resumes. It stays
    /// readable by step until retention removes it in commit order.
    Abandoned,
    /// Its save recorded that it can never commit (a tombstone: failed or fenced).
    Failed,
    /// Objects without a commit: a save in progress or one that died.
    Partial,
}

impl Status {
    /// Lowercase word.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Committed => "committed",
            Status::Abandoned => "abandoned",
            Status::Failed => "failed",
            Status::Partial => "partial",
        }
    }
}

/// One checkpoint directory under the root: a save attempt (v2) or a step
/// directory (v1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The step.
    pub step: u64,
    /// Its directory.
    pub dir: String,
    /// Position in the commit log, for logged commits.
    pub seq: Option<u64>,
    /// Generation of the world that saved it (v2).
    pub generation: Option<u64>,
    /// True when committed (a manifest, and for v2 a log record naming it).
    pub committed: bool,
    /// What it is.
    pub status: Status,
    /// When committed and abandoned: the step the later commit went back to.
    pub abandoned_for: Option<u64>,
    /// Why it failed (tombstones).
    pub failure: Option<String>,
    /// Ranks whose manifest part is present.
    pub ranks_present: Vec<u32>,
    /// Objects in the directory (staging leftovers of crashed writes included).
    pub objects: usize,
    /// Bytes of those objects.
    pub bytes: u64,
    /// Newest modification time of its objects.
    pub modified: Option<SystemTime>,
    /// When it was committed.
    pub committed_at: Option<SystemTime>,
    /// Keys of its objects (for deletion).
    pub(crate) keys: Vec<String>,
    /// Keys of staging leftovers of crashed local writes (invisible to listings).
    pub(crate) leftovers: Vec<String>,
}

/// Every checkpoint directory under the root: commits in commit order first, then
/// failed and partial saves by step. Lists the whole root: for tools and retention,
/// not for the hot path.
pub async fn list_checkpoints(store: &Store) -> Result<Vec<CheckpointInfo>> {
    Ok(survey(store).await?.0)
}

/// [`list_checkpoints`], and the commit log's records it read to find the commits:
/// retention needs both, and the log is the longest thing a survey reads.
pub(crate) async fn survey(store: &Store) -> Result<(Vec<CheckpointInfo>, Vec<LoggedCommit>)> {
    let objects = store.list("").await?;
    let leftovers = store.staging_leftovers("").await?;
    let mut dirs: BTreeMap<String, CheckpointInfo> = BTreeMap::new();
    let mut slots: Vec<(String, ObjectInfo)> = Vec::new();
    let add = |object: &ObjectInfo, leftover: bool, dirs: &mut BTreeMap<String, CheckpointInfo>| {
        let mut segments = object.key.splitn(3, '/');
        let (Some(top), Some(second)) = (segments.next(), segments.next()) else {
            return None;
        };
        let step = parse_step_dir(top)?;
        let third = segments.next();
        let (dir, name, generation) = match third {
            Some(name) => {
                let attempt = Attempt::parse(step, second)?;
                (attempt.dir(), name, Some(attempt.generation))
            }
            None => (top.to_string(), second, None),
        };
        let info = dirs.entry(dir.clone()).or_insert_with(|| CheckpointInfo {
            step,
            dir: dir.clone(),
            seq: None,
            generation,
            committed: false,
            status: Status::Partial,
            abandoned_for: None,
            failure: None,
            ranks_present: Vec::new(),
            objects: 0,
            bytes: 0,
            modified: None,
            committed_at: None,
            keys: Vec::new(),
            leftovers: Vec::new(),
        });
        info.objects += 1;
        info.bytes += object.size;
        info.modified = info.modified.max(Some(object.last_modified));
        if leftover {
            info.leftovers.push(object.key.clone());
            return None;
        }
        info.keys.push(object.key.clone());
        if name == MANIFEST {
            return Some(dir);
        }
        if let Some(rank) = parse_rank_part_name(name) {
            info.ranks_present.push(rank);
        }
        None
    };
    let local = store.local_root().is_some();
    for object in &objects {
        // Local staging files (`KEY#…`) that a listing shows are counted once, as
        // leftovers, below.
        if parse_record_key(&object.key).is_some() || (local && object.key.contains('#')) {
            continue;
        }
        if let Some(dir) = add(object, false, &mut dirs) {
            slots.push((dir, object.clone()));
        }
    }
    for object in &leftovers {
        add(object, true, &mut dirs);
    }
    let records = crate::commits::read_all(store).await?;
    let logged: HashMap<String, Commit> = dedup(&records)
        .into_iter()
        .map(|c| (c.dir.clone(), c))
        .collect();

    for (dir, slot) in slots {
        let info = dirs.get_mut(&dir).expect("slot's directory");
        if info.generation.is_none() {
            // Version 1: the manifest is the commit.
            info.committed = true;
            info.committed_at = Some(slot.last_modified);
            continue;
        }
        let key = format!("{dir}/{MANIFEST}");
        let tombstone = if slot.size <= MAX_TOMBSTONE_BYTES {
            match store.get(&key).await {
                Ok(bytes) => parse_tombstone(&bytes, &key).unwrap_or(None),
                Err(e) if e.is_not_found() => continue,
                Err(e) => return Err(e.into()),
            }
        } else {
            None
        };
        match (tombstone, logged.get(&dir)) {
            (Some(outcome), _) => {
                info.status = Status::Failed;
                info.failure = Some(outcome_text(&outcome));
            }
            (None, Some(commit)) => {
                info.committed = true;
                info.seq = commit.seq;
                info.committed_at = commit.time;
            }
            (None, None) => {}
        }
    }
    let mut all: Vec<CheckpointInfo> = dirs.into_values().collect();
    for info in &mut all {
        info.ranks_present.sort_unstable();
        if info.committed {
            info.status = Status::Committed;
        }
    }
    // Commit order: v1 by step, then the log; the rest by step.
    all.sort_by_key(|c| match (c.committed, c.seq) {
        (true, None) => (0, c.step, 0, String::new()),
        (true, Some(seq)) => (1, seq, 0, String::new()),
        (false, _) => (2, c.step, 0, c.dir.clone()),
    });
    // A commit is abandoned when a later commit is at its step or before.
    let mut lowest_later: Option<u64> = None;
    for info in all.iter_mut().rev().filter(|c| c.committed) {
        if let Some(later) = lowest_later
            && later <= info.step
        {
            info.status = Status::Abandoned;
            info.abandoned_for = Some(later);
        }
        lowest_later = Some(lowest_later.map_or(info.step, |l| l.min(info.step)));
    }
    Ok((all, records))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_names_its_attempt_and_a_v1_commit_none() {
        let attempt = Attempt::new(10, 2, "job-e3").unwrap();
        let logged = Commit {
            seq: Some(4),
            step: 10,
            dir: attempt.dir(),
            time: None,
        };
        assert_eq!(logged.attempt(), Some(attempt));
        assert_eq!(Commit::v1(10, None).attempt(), None);
        let elsewhere = Commit {
            step: 11,
            ..logged.clone()
        };
        assert_eq!(elsewhere.attempt(), None, "a directory of another step");
    }
}
