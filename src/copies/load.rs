//! Loading a rank's boxes of a committed checkpoint from the copies its world holds,
//! verified, with the store for whatever they cannot deliver.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::net::{Asked, Peer};
use super::{Copies, CopyKey, Holding};
use crate::blocks::BlockMap;
use crate::error::{Error, Result};
use crate::format::RankPart;
use crate::load::{
    CheckpointReader, FileRead, LoadPlan, LoadRequest, LoadStats, Outputs, Run, Scatter, Tally,
    in_this_poll, on_threads, read_batch, verify_and_copy,
};

/// Where the copies of a recovery come from.
pub struct Sources<'a> {
    /// This rank's holder (its own copies, and the replicas it pulled).
    pub own: &'a Copies,
    /// Every rank's holding in this world, by rank, as exchanged at the start of the
    /// recovery; `table[rank]` is this rank's own.
    pub table: &'a [Holding],
    /// This rank.
    pub rank: usize,
    /// Asked between batches: true abandons the load with [`Error::Failed`] (the
    /// outputs are then partially written, as after any failed load).
    pub cancelled: Option<&'a (dyn Fn() -> bool + Sync)>,
}

/// Why a saved rank's file was not (or not all) read from a given copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FallbackReason {
    /// No rank of this world holds a copy of the file.
    NotHeld,
    /// The copy's bytes differ from what the save checksummed (memory that rotted, a
    /// peer serving other bytes) or its length from the committed file's: the
    /// message names the copy, its holder and the block. The next holder, or the
    /// store, is read instead; the copy is best not trusted again.
    Mismatch(String),
    /// The holder could not deliver: its own copy is gone, or the peer does not hold
    /// it, does not answer, answers garbage or went away.
    Unavailable(String),
}

/// A saved rank's file that a copy did not deliver, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    /// The saved rank whose file it is.
    pub saved_rank: u32,
    /// The rank (of this world) whose copy failed; `None` with
    /// [`FallbackReason::NotHeld`].
    pub holder: Option<usize>,
    /// Why.
    pub reason: FallbackReason,
}

impl std::fmt::Display for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.reason {
            FallbackReason::NotHeld => {
                write!(f, "no rank holds a copy of rank {}'s file", self.saved_rank)
            }
            FallbackReason::Mismatch(why) | FallbackReason::Unavailable(why) => f.write_str(why),
        }
    }
}

/// What [`load_into`] read from where.
#[derive(Debug, Clone, Default)]
pub struct FromCopies {
    /// Saved ranks' data files the request touched.
    pub files: usize,
    /// Of those, the files read from the store.
    pub files_from_store: usize,
    /// Raw bytes read from this rank's own copies (whole blocks around what was
    /// requested: what the check needs).
    pub own_bytes: u64,
    /// Raw bytes received from peers' copies.
    pub peer_bytes: u64,
    /// Every copy that did not deliver, in the order tried; a file read from the
    /// store has at least one.
    pub fallbacks: Vec<Fallback>,
    /// The store's share of the load (zero when every file came from copies).
    pub store: LoadStats,
}

impl FromCopies {
    /// True when no byte came from the store.
    pub fn all_from_memory(&self) -> bool {
        self.files_from_store == 0
    }
}

/// One saved rank's file of the plan.
type PlannedFile = (String, Arc<RankPart>, Vec<Run>);

/// What reading one file from the copies came to.
struct FileOutcome {
    /// The file, when no copy delivered it (the store is read).
    unread: Option<PlannedFile>,
    own_bytes: u64,
    peer_bytes: u64,
    fallbacks: Vec<Fallback>,
}

/// Loads the boxes of `request` from the checkpoint `reader` opened, verified, into
/// `outputs` (one buffer per want, in request order, as
/// [`CheckpointReader::load_into`]), taking each saved rank's data file from the
/// copies `sources` lists — this rank's own first, then its peers' in rank order —
/// and from the store when none delivers it.
///
/// `reader` is the commit to resume from, found through the store's commit log; its
/// manifest and the rank parts the request touches are read from the store (they
/// hold the block CRC32s every copy is checked against), so memory never decides
/// what is loaded. Only copies named by the commit's attempt directory, world size
/// and rank ([`CopyKey`]) are used.
///
/// On success every byte of every output comes from a block that matched its save's
/// CRC32: from a copy or from the store, bitwise the same. A copy that fails (see
/// [`FallbackReason`]) costs a [`Fallback`] in the result and a read of its file from
/// the next holder or the store; errors are those of the store's part of the load
/// ([`CheckpointReader::load_into`]), and [`Error::Failed`] when
/// [`Sources::cancelled`] said so. After an error the outputs are partially written.
///
/// Files are read from copies `reader`'s
/// [`ReadConfig::file_concurrency`](crate::load::ReadConfig::file_concurrency) at a
/// time, on threads of their own that block the polling worker (as reads of local
/// files do: a multi-threaded runtime moves its other tasks away).
pub async fn load_into(
    reader: &CheckpointReader,
    request: &LoadRequest,
    outputs: &mut [&mut [u8]],
    sources: &Sources<'_>,
) -> Result<FromCopies> {
    reader.check_outputs_of(request, outputs)?;
    let started = Instant::now();
    let LoadPlan {
        files,
        sizes,
        mut stats,
    } = reader.plan(request).await?;
    stats.timings.plan = started.elapsed();
    let dir = reader.manifest().dir();
    let dest = Arc::new(Outputs::new(outputs));
    let mut result = FromCopies {
        files: files.len(),
        ..FromCopies::default()
    };
    let config = reader.read_config();
    let outcomes = in_this_poll(|| {
        on_threads(files, config.file_concurrency, |file| {
            Ok(from_copies(file, &dir, &dest, sources, config.batch_bytes))
        })
    })?;
    let mut unread = Vec::new();
    for outcome in outcomes {
        let outcome = outcome?;
        result.own_bytes += outcome.own_bytes;
        result.peer_bytes += outcome.peer_bytes;
        result.fallbacks.extend(outcome.fallbacks);
        unread.extend(outcome.unread);
    }
    drop(dest);
    result.files_from_store = unread.len();
    if !unread.is_empty() {
        let plan = LoadPlan {
            files: unread,
            sizes,
            stats,
        };
        reader.check_stored_sizes(&plan).await?;
        result.store = reader.read_plan(plan, outputs).await?;
    }
    Ok(result)
}

/// Reads one saved rank's file from the first copy that delivers it; `Err` only when
/// the load was cancelled.
fn from_copies(
    (object, part, runs): PlannedFile,
    dir: &str,
    dest: &Arc<Outputs>,
    sources: &Sources<'_>,
    batch_bytes: u64,
) -> Result<FileOutcome> {
    let key = CopyKey {
        dir: dir.to_string(),
        world: part.world_size,
        rank: part.rank,
    };
    // This rank first, then the peers in rank order.
    let mut holders: Vec<usize> = sources
        .table
        .iter()
        .enumerate()
        .filter(|(holder, holding)| {
            holding.held.contains(&key) && (*holder == sources.rank || holding.addr.is_some())
        })
        .map(|(holder, _)| holder)
        .collect();
    holders.sort_by_key(|&holder| (holder != sources.rank, holder));
    let mut outcome = FileOutcome {
        unread: None,
        own_bytes: 0,
        peer_bytes: 0,
        fallbacks: Vec::new(),
    };
    if holders.is_empty() {
        outcome.fallbacks.push(Fallback {
            saved_rank: part.rank,
            holder: None,
            reason: FallbackReason::NotHeld,
        });
    }
    for holder in holders {
        let file = FileRead {
            object: Arc::from(format!("copy of {key} held by rank {holder}").as_str()),
            map: Arc::new(BlockMap::raw(&part)),
            part: part.clone(),
            runs: runs.clone(),
            dest: dest.clone(),
        };
        let read = if holder == sources.rank {
            own(&file, &key, sources, batch_bytes).map(|tally| (tally.read, 0))
        } else {
            peer(&file, &key, holder, sources, batch_bytes).map(|tally| (0, tally.read))
        };
        match read {
            Ok((own_bytes, peer_bytes)) => {
                outcome.own_bytes += own_bytes;
                outcome.peer_bytes += peer_bytes;
                return Ok(outcome);
            }
            Err(Failure::Cancelled) => {
                return Err(Error::Failed(format!(
                    "loading {dir} from in-memory copies was cancelled"
                )));
            }
            Err(Failure::Copy(reason)) => outcome.fallbacks.push(Fallback {
                saved_rank: part.rank,
                holder: Some(holder),
                reason,
            }),
        }
    }
    outcome.unread = Some((object, part, runs));
    Ok(outcome)
}

/// Why one copy did not deliver a file.
enum Failure {
    Copy(FallbackReason),
    Cancelled,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Copy(match e {
            Error::Corrupt(e) => FallbackReason::Mismatch(e.to_string()),
            other => FallbackReason::Unavailable(other.to_string()),
        })
    }
}

fn check_cancelled(sources: &Sources<'_>) -> std::result::Result<(), Failure> {
    match sources.cancelled {
        Some(cancelled) if cancelled() => Err(Failure::Cancelled),
        _ => Ok(()),
    }
}

/// Checks that a copy of `len` bytes can be the file `file` names.
fn check_len(file: &FileRead, len: u64) -> std::result::Result<(), Failure> {
    if len != file.part.file.raw_bytes {
        return Err(Failure::Copy(FallbackReason::Mismatch(format!(
            "{}: {len} bytes, the committed file has {}",
            file.object, file.part.file.raw_bytes
        ))));
    }
    Ok(())
}

/// Reads `file` from this rank's own copy: each batch's blocks checked in the copy's
/// memory, then the runs copied out.
fn own(
    file: &FileRead,
    key: &CopyKey,
    sources: &Sources<'_>,
    batch_bytes: u64,
) -> std::result::Result<Tally, Failure> {
    let copy = sources.own.get(key).ok_or_else(|| {
        Failure::Copy(FallbackReason::Unavailable(format!(
            "{}: no longer held",
            file.object
        )))
    })?;
    check_len(file, copy.len())?;
    let all = bytes::Bytes::from_owner(copy);
    each_batch(file, sources, batch_bytes, |blocks, raw, copies| {
        let stored = all.slice(raw.start as usize..raw.end as usize);
        verify_and_copy(
            &file.object,
            &file.part,
            &file.map,
            &file.dest,
            blocks,
            stored,
            copies,
        )
    })
}

/// Reads `file` from `holder`'s copy over one connection: each batch's blocks from
/// the socket straight into the outputs (and scratch), then checked there.
fn peer(
    file: &FileRead,
    key: &CopyKey,
    holder: usize,
    sources: &Sources<'_>,
    batch_bytes: u64,
) -> std::result::Result<Tally, Failure> {
    let unavailable =
        |e: Asked| Failure::Copy(FallbackReason::Unavailable(format!("{}: {e}", file.object)));
    let addr = sources.table[holder].addr.ok_or_else(|| {
        Failure::Copy(FallbackReason::Unavailable(format!(
            "{}: it has no copy server",
            file.object
        )))
    })?;
    let config = sources.own.config();
    let mut peer =
        Peer::connect(addr, config.peer_timeout, config.secret.as_ref()).map_err(unavailable)?;
    check_len(file, peer.len(key).map_err(unavailable)?)?;
    let scratch = std::sync::Mutex::default();
    each_batch(file, sources, batch_bytes, |blocks, raw, copies| {
        let mut read = |at: u64, buffers: &mut [&mut [u8]]| -> Result<()> {
            peer.raw(key, at, buffers)
                .map_err(|e| Error::NotFound(format!("{}: {e}", file.object)))
        };
        read_batch(
            &mut read,
            &file.object,
            &file.part,
            &file.map,
            &file.dest,
            &scratch,
            blocks,
            raw,
            copies,
        )
    })
}

/// Reads `file` batch by batch with `read(blocks, raw, copies)` (the blocks of one
/// batch, their raw bytes, and the copies out of them into the outputs), asking
/// whether the load is cancelled before each.
fn each_batch(
    file: &FileRead,
    sources: &Sources<'_>,
    batch_bytes: u64,
    mut read: impl FnMut(Range<u64>, Range<u64>, &[Scatter]) -> Result<Tally>,
) -> std::result::Result<Tally, Failure> {
    let mut tally = Tally::default();
    let mut cursor = 0;
    for blocks in file.batches(batch_bytes) {
        check_cancelled(sources)?;
        let raw = file.raw_range(&blocks);
        let copies = file.copies(&raw, &mut cursor);
        tally.add(&read(blocks, raw, &copies)?);
    }
    Ok(tally)
}
