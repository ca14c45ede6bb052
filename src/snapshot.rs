//! The memory tier: snapshots committed in the control plane, and recoveries from
//! the newest one the survivors hold.
//!
//! # Why
//!
//! The store's bandwidth and cost set how often a job saves to it (every few hundred
//! steps), and a failure loses, in every rank, the work since the last store commit.
//! A snapshot ([`Checkpointer::snapshot`](crate::Checkpointer::snapshot)) costs one
//! staging copy and a replica's transfer to a ring peer, so it can be taken every few
//! steps; a failure that the survivors' copies cover then loses at most that
//! interval. The store stays the durability guarantee: losing the whole job (or two
//! ring neighbours) loses only what the store has not got.
//!
//! # Committing
//!
//! A snapshot is committed when every rank of the generation holds its own file and
//! its replica of its ring predecessor's file is complete. Each rank checks that of
//! itself and casts a [`Vote`] (16 bytes: the step, ready or not, and the CRC32 of
//! its rank part); the trainer's own collective all-gathers the votes, so every rank
//! learns the same outcome ([`tally`]) without a request to any server, and the
//! table of part CRC32s with it. One rank then records the commit in the control
//! plane ([`SnapshotRecord`], through the agent's `commit_snapshot`), where it
//! survives the re-formation that follows a failure; the control plane accepts it
//! only from the generation that is running (the fence: a rank of an old generation
//! can never commit), and every rank keeps the table
//! ([`Copies::commit_snapshot`](crate::copies::Copies::commit_snapshot)).
//!
//! What lives where, and why:
//!
//! - **In the control plane**: the record — step, generation, world size, the
//!   snapshot's directory, and one CRC32 of the table of part CRC32s. It is a fixed
//!   few hundred bytes whatever the world size (the control plane's values are
//!   bounded, and a commit every step must stay cheap for it).
//! - **With the copies**: each rank's part (chunks, non-tensor state and the block
//!   CRC32s of its file) travels with its file to the replica's holder, and the
//!   table of part CRC32s is held by every rank that voted. At a recovery the table
//!   is checked against the record's CRC32, each part against the table, and every
//!   block of every file against its part: memory is trusted no more than the store.
//!
//! # Recovering
//!
//! After a failure the survivors exchange their holdings (as for copies of store
//! saves) and read the record. The snapshot is usable when every rank of the world
//! that took it has a file held by a survivor ([`SnapshotRecord::uncovered`]) and it
//! is newer than the newest store commit. One rank then gathers the parts from the
//! holders ([`share`], checked against the table) and broadcasts them; every rank
//! opens the snapshot ([`open_shared`]) and loads its new boxes with
//! [`copies::load_into`](crate::copies::load_into), resharded onto the new world
//! exactly as a load from the store, each block checked. A file whose every holder
//! fails (a rotted replica and its owner dead) makes the load fail; the caller then
//! resumes from the store commit instead.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::attempt::Attempt;
pub use crate::copies::Snapshot;
use crate::copies::{Copies, CopyKey, Holding};
use crate::error::{Error, Result};
use crate::format::{FormatError, RankPart};
use crate::load::CheckpointReader;
pub use crate::save::SnapshotHandle;
use ckpt_storage::Store;

/// A committed snapshot, as recorded in the control plane ([module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// The step.
    pub step: u64,
    /// The generation of the world that took it.
    pub generation: u64,
    /// That world's size: its files are ranks `0..world`.
    pub world: u32,
    /// The snapshot's attempt directory (`step-N/gG-snap-RUN`): every copy of its
    /// files is named by it.
    pub dir: String,
    /// CRC32 of the table of every rank's part CRC32 (little-endian, rank order).
    pub table_crc32: u32,
}

/// Longest record text accepted ([`SnapshotRecord::parse`]).
const MAX_RECORD: usize = 4096;

impl SnapshotRecord {
    /// The record of the snapshot `attempt` taken by a world of `world` ranks, whose
    /// parts have the CRC32s `table` (rank order).
    pub fn new(attempt: &Attempt, world: u32, table: &[u32]) -> Self {
        Self {
            step: attempt.step,
            generation: attempt.generation,
            world,
            dir: attempt.dir(),
            table_crc32: table_crc32(table),
        }
    }

    /// The record as the control plane stores it (JSON).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a snapshot record serializes")
    }

    /// Reads a record; an error names what is wrong.
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |why: String| Error::Corrupt(FormatError::new("snapshot record", None, why));
        if text.len() > MAX_RECORD {
            return Err(bad(format!("{} bytes, at most {MAX_RECORD}", text.len())));
        }
        let record: Self = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let attempt = record.attempt().ok_or_else(|| {
            bad(format!(
                "{:?} is not the directory of a snapshot of step {}",
                record.dir, record.step
            ))
        })?;
        if attempt.generation != record.generation || record.world == 0 {
            return Err(bad(format!(
                "generation {} or world {} disagrees with {:?}",
                record.generation, record.world, record.dir
            )));
        }
        Ok(record)
    }

    /// The snapshot's attempt, parsed from its directory.
    pub fn attempt(&self) -> Option<Attempt> {
        let (step_dir, name) = self.dir.split_once('/')?;
        (step_dir == crate::format::step_dir(self.step))
            .then(|| Attempt::parse(self.step, name))
            .flatten()
    }

    /// True when `table` is the table of part CRC32s this record committed.
    pub fn matches(&self, table: &[u32]) -> bool {
        table.len() == self.world as usize && table_crc32(table) == self.table_crc32
    }

    /// The key of rank `rank`'s file.
    pub fn key(&self, rank: u32) -> CopyKey {
        CopyKey {
            dir: self.dir.clone(),
            world: self.world,
            rank,
        }
    }

    /// The ranks of the snapshot's world whose file no rank of `holdings` holds
    /// (empty: the survivors cover it).
    pub fn uncovered(&self, holdings: &[Holding]) -> Vec<u32> {
        (0..self.world)
            .filter(|&r| {
                let key = self.key(r);
                !holdings.iter().any(|h| h.held.contains(&key))
            })
            .collect()
    }
}

fn table_crc32(table: &[u32]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    for crc in table {
        hasher.update(&crc.to_le_bytes());
    }
    hasher.finalize()
}

/// One rank's vote on committing a snapshot: cast after it holds its own file and
/// its replica of its predecessor's, all-gathered by the trainer's collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vote {
    /// The step voted on.
    pub step: u64,
    /// The rank holds its own file and its replica is complete.
    pub ready: bool,
    /// CRC32 of the rank's part.
    pub part_crc32: u32,
}

impl Vote {
    /// Size of an encoded vote.
    pub const SIZE: usize = 16;

    /// This rank's vote on `snapshot`: ready when `own` holds it and, when
    /// `replica` names the predecessor's file, holds that too.
    pub fn cast(own: &Copies, snapshot: &Snapshot, replica: Option<&CopyKey>) -> Self {
        let ready = own.snapshot_part(snapshot.key()).is_some()
            && replica.is_none_or(|key| own.snapshot_part(key).is_some());
        Self {
            step: snapshot.step(),
            ready,
            part_crc32: snapshot.part_crc32(),
        }
    }

    /// A vote against (this rank took no snapshot of `step`, or lost it).
    pub fn against(step: u64) -> Self {
        Self {
            step,
            ready: false,
            part_crc32: 0,
        }
    }

    /// The fixed-size record exchanged.
    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut out = [0u8; Self::SIZE];
        out[..8].copy_from_slice(&self.step.to_le_bytes());
        out[8..12].copy_from_slice(&self.part_crc32.to_le_bytes());
        out[12] = u8::from(self.ready);
        out
    }

    /// Reads a record; anything malformed is a vote against.
    pub fn decode(bytes: &[u8]) -> Self {
        if bytes.len() != Self::SIZE || bytes[12] > 1 || bytes[13..].iter().any(|&b| b != 0) {
            return Self::against(u64::MAX);
        }
        Self {
            step: u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
            part_crc32: u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")),
            ready: bytes[12] == 1,
        }
    }
}

/// The outcome of the votes on the snapshot of `step` (every rank's, in rank
/// order): the table of part CRC32s when every rank voted ready on that step, else
/// the ranks that did not.
pub fn tally(votes: &[Vote], step: u64) -> std::result::Result<Vec<u32>, Vec<usize>> {
    let against: Vec<usize> = votes
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.ready || v.step != step)
        .map(|(r, _)| r)
        .collect();
    if against.is_empty() && !votes.is_empty() {
        Ok(votes.iter().map(|v| v.part_crc32).collect())
    } else {
        Err(against)
    }
}

/// Gathers, on one rank of the new world, what every rank needs to open the
/// committed snapshot `record`: the table of part CRC32s (this rank's own, else a
/// peer's that matches the record), every part (from this rank's copies, else a
/// holder's, each checked against the table), and the manifest built from them.
/// `table` is every rank's holding in the new world and `rank` this rank. Returns
/// the bytes [`open_shared`] reads (the format of
/// [`CheckpointReader::share`](crate::CheckpointReader::share)). Blocking (the
/// copy servers are asked over TCP): call it off an async runtime's workers.
///
/// Errors: [`Error::NotFound`] when no holder delivers a part or the table, naming
/// the rank; [`Error::Corrupt`] when the parts do not form a snapshot.
pub fn share(
    record: &SnapshotRecord,
    own: &Copies,
    table: &[Holding],
    rank: usize,
) -> Result<Vec<u8>> {
    let attempt = record
        .attempt()
        .ok_or_else(|| Error::invalid(format!("{:?} is not a snapshot's directory", record.dir)))?;
    let config = own.config();
    let peers = || {
        table
            .iter()
            .enumerate()
            .filter(move |(r, _)| *r != rank)
            .filter_map(|(r, h)| h.addr.map(|a| (r, h, a)))
    };
    let connect = |addr: SocketAddr| {
        crate::copies::connect(addr, config.peer_timeout, config.secret.as_ref())
    };
    let mut tried = Vec::new();
    let crcs = match own
        .snapshot_table(&record.dir)
        .filter(|t| record.matches(t))
    {
        Some(t) => t,
        None => {
            let mut found = None;
            for (r, _, addr) in peers() {
                match connect(addr).and_then(|mut p| p.table(&record.dir, record.world)) {
                    Ok(t) if record.matches(&t) => {
                        found = Some(t);
                        break;
                    }
                    Ok(_) => tried.push(format!("rank {r}: a table that is not the record's")),
                    Err(e) => tried.push(format!("rank {r}: {e}")),
                }
            }
            found.ok_or_else(|| {
                Error::NotFound(format!(
                    "no rank holds the table of part CRC32s of snapshot {} ({})",
                    record.dir,
                    tried.join("; ")
                ))
            })?
        }
    };
    let mut parts: Vec<(Vec<u8>, RankPart)> = Vec::with_capacity(record.world as usize);
    for saved in 0..record.world {
        let key = record.key(saved);
        let expected = crcs[saved as usize];
        let mut why = Vec::new();
        let mut bytes = own
            .snapshot_part(&key)
            .map(|p| p.to_vec())
            .filter(|p| crc32fast::hash(p) == expected);
        if bytes.is_none() {
            for (r, _, addr) in peers().filter(|(_, h, _)| h.held.contains(&key)) {
                match connect(addr).and_then(|mut p| p.part(&key)) {
                    Ok(b) if crc32fast::hash(&b) == expected => {
                        bytes = Some(b);
                        break;
                    }
                    Ok(_) => why.push(format!(
                        "rank {r} holds a part that differs from the commit's"
                    )),
                    Err(e) => why.push(format!("rank {r}: {e}")),
                }
            }
        }
        let bytes = bytes.ok_or_else(|| {
            Error::NotFound(format!(
                "no rank delivers rank {saved}'s part of snapshot {} ({})",
                record.dir,
                if why.is_empty() {
                    "not held".to_string()
                } else {
                    why.join("; ")
                }
            ))
        })?;
        let part = RankPart::parse(&bytes, &key.to_string())?;
        parts.push((bytes, part));
    }
    let refs: Vec<&(Vec<u8>, RankPart)> = parts.iter().collect();
    let manifest = crate::commit::build_manifest(&attempt, record.world, &refs)?;
    let encoded: Vec<(u32, &[u8])> = parts.iter().map(|(b, p)| (p.rank, b.as_slice())).collect();
    Ok(crate::load::encode_shared(
        &manifest.to_bytes(),
        b"[]",
        &encoded,
    ))
}

/// Opens the snapshot that [`share`] describes: a reader whose manifest and parts
/// are in memory, for [`copies::load_into`](crate::copies::load_into) (its files
/// are read from the copies; no store holds them, so a file no copy delivers fails
/// the load).
pub fn open_shared(shared: &[u8]) -> Result<CheckpointReader> {
    static NOWHERE: std::sync::OnceLock<Store> = std::sync::OnceLock::new();
    let store = NOWHERE.get_or_init(|| Store::from_url("memory://").expect("a memory store"));
    CheckpointReader::from_shared(store, shared)
}
