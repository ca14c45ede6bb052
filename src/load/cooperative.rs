//! Cooperative loads: a job reads every byte it needs from the store once, and the
//! ranks pass the rest to each other over their own network.
//!
//! With data-parallel replicas, R ranks want the same boxes; a resharded load has
//! neighbours wanting rows of the same blocks. Read independently, the store serves
//! those bytes R times, and lists and reads the metadata once per rank: at a
//! thousand ranks the store's request rate and egress, not any disk, bound the
//! resume. The training network is one to two orders of magnitude faster than the
//! store, so the library splits a load in steps that the caller's collective
//! carries between ranks (PyTorch's process group, the reference trainer's ring):
//!
//! 1. **One look at the store.** One rank opens the checkpoint (the listing, the
//!    manifest) and fetches every rank part ([`CheckpointReader::share`]); the
//!    others open the same checkpoint from those bytes
//!    ([`CheckpointReader::from_shared`]), checked as if read from the store (the
//!    sealed manifest validated, each part against the manifest's size and CRC32),
//!    without a request.
//! 2. **One reader per byte.** Every saved data file is laid end to end on one
//!    line of raw bytes, and the line is cut into `world` pieces of equal bytes at
//!    block boundaries: the rank owning a piece reads, from the store, the blocks
//!    of it that anyone asks for, and nobody else does. The cut is a function of
//!    the manifest and the world size alone, so every rank computes it without a
//!    collective, and it splits bytes evenly whatever the layout (one writer under
//!    DDP, every rank under FSDP). Each rank plans its own load as usual
//!    ([`CheckpointReader::plan`]) and asks each owner for the whole CRC blocks its
//!    runs touch ([`Cooperative::asks`]); the requests travel in one all-to-all.
//! 3. **Serve, exchange, verify.** Each owner reads the union of what it was asked,
//!    verified and decompressed ([`Cooperative::serve`]), and fills one buffer per
//!    asking rank ([`Cooperative::write_sent`]); the caller sends them (one
//!    message per pair of ranks, however many tensors). The receiver checks every block a peer sent against the save's
//!    CRC32s before a byte of it reaches an output ([`Cooperative::finish`]):
//!    nothing is trusted because a peer sent it. A block that fails is read from
//!    the store instead, and the peer is named in a warning and counted.
//!
//! The requests and the buffers are plain bytes so that any transport can carry
//! them; a rank that dies between the steps is the transport's to detect (the
//! Python layer names it).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use ckpt_storage::Store;
use futures::{StreamExt, TryStreamExt};
use tracing::warn;

use super::CheckpointReader;
use super::execute::{in_this_poll, on_threads};
use super::plan::{check_outputs, check_plan};
use super::read::{FileRead, read_again, reads_on_mismatch};
use super::request::{LoadPlan, LoadRequest, LoadStats};
use super::scatter::Outputs;
use crate::blocks::BlockMap;
use crate::error::{Error, Result};
use crate::format::{FormatError, Manifest, RankPart};

/// The first bytes of [`CheckpointReader::share`]'s encoding.
const SHARED_MAGIC: &[u8; 8] = b"CKPTSHR1";
/// Bytes of one entry of an encoded request: saved rank (u32), first and end
/// block (u64 each), little-endian.
const ASK_BYTES: usize = 20;

/// The bytes [`CheckpointReader::from_shared`] reads: the magic, the sealed
/// manifest, the commits passed over (JSON) and every part as stored, each with its
/// rank and length.
pub(crate) fn encode_shared(manifest: &[u8], skipped: &[u8], parts: &[(u32, &[u8])]) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        8 + 16
            + manifest.len()
            + skipped.len()
            + parts.iter().map(|(_, b)| b.len() + 12).sum::<usize>(),
    );
    out.extend_from_slice(SHARED_MAGIC);
    for blob in [manifest, skipped] {
        out.extend_from_slice(&(blob.len() as u64).to_le_bytes());
        out.extend_from_slice(blob);
    }
    out.extend_from_slice(&(parts.len() as u32).to_le_bytes());
    for (rank, bytes) in parts {
        out.extend_from_slice(&rank.to_le_bytes());
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    }
    out
}

impl CheckpointReader {
    /// Fetches every rank part and returns what the other ranks of a job need to
    /// open this checkpoint without a request to the store: the sealed manifest,
    /// the unhealthy commits passed over to find it, and every part as stored.
    /// The other ranks open it with [`CheckpointReader::from_shared`].
    pub async fn share(&self) -> Result<Vec<u8>> {
        let fetched: Vec<(u32, String, bytes::Bytes)> =
            futures::stream::iter(0..self.manifest.world_size)
                .map(|rank| async move {
                    let (key, bytes) = self.fetch_part_bytes(rank).await?;
                    Ok::<_, Error>((rank, key, bytes))
                })
                .buffered(32)
                .try_collect()
                .await?;
        {
            let mut parts = self.parts.lock().await;
            for (rank, key, bytes) in &fetched {
                if !parts.contains_key(rank) {
                    parts.insert(*rank, Arc::new(self.accept_part(*rank, key, bytes)?));
                }
            }
        }
        let manifest = self.manifest.to_bytes();
        let skipped = serde_json::to_vec(
            &self
                .skipped
                .iter()
                .map(|s| (s.step, &s.dir, &s.reasons))
                .collect::<Vec<_>>(),
        )
        .map_err(|e| Error::invalid(format!("encoding the commits passed over: {e}")))?;
        let parts: Vec<(u32, &[u8])> = fetched.iter().map(|(r, _, b)| (*r, &b[..])).collect();
        let out = encode_shared(&manifest, &skipped, &parts);
        Ok(out)
    }

    /// Opens the checkpoint that another rank's [`CheckpointReader::share`]
    /// describes, without a request to `store`: the manifest is validated and each
    /// part checked against the manifest's size and CRC32 and parsed, as a read
    /// from the store would be. Bytes that fail any check are an error naming the
    /// offset or the object.
    pub fn from_shared(store: &Store, shared: &[u8]) -> Result<Self> {
        const WHAT: &str = "a checkpoint shared by another rank";
        let mut cursor = Cursor {
            bytes: shared,
            at: 0,
        };
        if cursor.take(8)? != SHARED_MAGIC {
            return Err(FormatError::new(WHAT, Some(0), "does not start with CKPTSHR1").into());
        }
        let manifest_len = cursor.u64()?;
        let manifest = Manifest::parse(cursor.take(manifest_len)?, "manifest.json (shared)")?;
        let skipped_len = cursor.u64()?;
        let skipped: Vec<(u64, String, Vec<String>)> =
            serde_json::from_slice(cursor.take(skipped_len)?).map_err(|e| {
                FormatError::new(
                    WHAT,
                    Some(cursor.at as u64),
                    format!("commits passed over: {e}"),
                )
            })?;
        let mut reader = Self::from_manifest(store, manifest);
        reader.skipped = skipped
            .into_iter()
            .map(|(step, dir, reasons)| crate::catalog::Skipped { step, dir, reasons })
            .collect();
        let count = cursor.u32()?;
        if count != reader.manifest.world_size {
            return Err(FormatError::new(
                WHAT,
                Some(cursor.at as u64),
                format!(
                    "holds {count} parts, the manifest has {} ranks",
                    reader.manifest.world_size
                ),
            )
            .into());
        }
        let mut parts = std::collections::HashMap::with_capacity(count as usize);
        for _ in 0..count {
            let rank = cursor.u32()?;
            let len = cursor.u64()?;
            let bytes = cursor.take(len)?;
            let key = reader.part_key(rank)?;
            reader.check_part_bytes(rank, &key, bytes)?;
            parts.insert(rank, Arc::new(reader.accept_part(rank, &key, bytes)?));
        }
        reader.parts = tokio::sync::Mutex::new(parts);
        if cursor.at != shared.len() {
            return Err(FormatError::new(WHAT, Some(cursor.at as u64), "trailing bytes").into());
        }
        Ok(reader)
    }

    /// Starts this rank's part of a cooperative load of `plan` (made by
    /// [`CheckpointReader::plan`] for this rank's request) by `world` ranks, this
    /// one `rank`. Every rank part must be held (a reader from
    /// [`CheckpointReader::from_shared`], or after [`CheckpointReader::share`]): the
    /// cut of the line of bytes is computed from all of them. No I/O.
    pub fn cooperate(&self, plan: LoadPlan, rank: usize, world: usize) -> Result<Cooperative> {
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!(
                "cooperative load: rank {rank} of a world of {world}"
            )));
        }
        let parts = self.held_parts()?;
        let line = Line::new(&parts, world);
        let mut asks: Vec<Vec<(u32, Range<u64>)>> = vec![Vec::new(); world];
        for (object, part, runs) in &plan.files {
            let saved = saved_rank_of(&parts, object, part)?;
            for blocks in needed_blocks(part.block_size, runs) {
                for (owner, piece) in line.split(saved, &blocks) {
                    asks[owner].push((saved, piece));
                }
            }
        }
        Ok(Cooperative {
            rank,
            world,
            plan,
            parts,
            asks,
            held: BTreeMap::new(),
            served: Vec::new(),
            stats: LoadStats::default(),
            unique_bytes_served: 0,
            dir: self.manifest.dir(),
            store: self.store.clone(),
            config: self.config.clone(),
        })
    }

    /// Every rank part, by saved rank; an error when one was not fetched.
    fn held_parts(&self) -> Result<Vec<Arc<RankPart>>> {
        let parts = self
            .parts
            .try_lock()
            .map_err(|_| Error::invalid("cooperative load: the rank parts are being fetched"))?;
        (0..self.manifest.world_size)
            .map(|rank| {
                parts.get(&rank).cloned().ok_or_else(|| {
                    Error::invalid(format!(
                        "cooperative load: rank {rank}'s part is not held (open the reader with share or from_shared)"
                    ))
                })
            })
            .collect()
    }
}

/// The batches of one saved rank's file an owner read, verified and raw, keyed by
/// their first block.
type HeldBatches = BTreeMap<u64, (Range<u64>, Vec<u8>)>;

/// One rank's side of a cooperative load, between the collectives that carry its
/// bytes: [`Cooperative::asks`] go to every rank (all-to-all), each rank
/// [`serve`](Cooperative::serve)s what it was asked and the buffers go back
/// (all-to-all), then [`finish`](Cooperative::finish) verifies and scatters them.
pub struct Cooperative {
    rank: usize,
    world: usize,
    plan: LoadPlan,
    /// Every rank part, by saved rank.
    parts: Vec<Arc<RankPart>>,
    /// What this rank asks each owner (by owner): (saved rank, blocks), in order.
    asks: Vec<Vec<(u32, Range<u64>)>>,
    /// What this rank read as owner, verified, raw: by saved rank, batches keyed by
    /// their first block.
    held: BTreeMap<u32, HeldBatches>,
    /// What each rank asked of this one, by rank (this one's own entry is its own
    /// needs), once served.
    served: Vec<Vec<(u32, Range<u64>)>>,
    stats: LoadStats,
    unique_bytes_served: u64,
    /// The checkpoint's directory.
    dir: String,
    store: Store,
    config: super::ReadConfig,
}

impl std::fmt::Debug for Cooperative {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cooperative")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl Cooperative {
    /// What this rank asks each rank for, by rank (an empty request for a rank it
    /// needs nothing from, its own included: it serves itself without a message).
    pub fn asks(&self) -> Vec<Vec<u8>> {
        self.asks
            .iter()
            .enumerate()
            .map(|(owner, asks)| {
                if owner == self.rank {
                    return Vec::new();
                }
                encode_asks(asks)
            })
            .collect()
    }

    /// Raw bytes this rank will receive from each rank, by rank: the sizes of the
    /// buffers to receive into.
    pub fn expected(&self) -> Vec<u64> {
        self.asks
            .iter()
            .enumerate()
            .map(|(owner, asks)| {
                if owner == self.rank {
                    return 0;
                }
                asks.iter()
                    .map(|(saved, blocks)| raw_bytes(&self.parts[*saved as usize], blocks))
                    .sum()
            })
            .collect()
    }

    /// The stored bytes of everything asked of this rank (its own needs included),
    /// counted once: summed over the ranks, the checkpoint's bytes the whole job
    /// needs. Known after [`Cooperative::serve`].
    pub fn unique_bytes_served(&self) -> u64 {
        self.unique_bytes_served
    }

    /// Reads from the store what the ranks asked of this one (`asked[r]`: rank
    /// `r`'s request, as its [`Cooperative::asks`] made it; this rank's own entry
    /// is ignored, its own needs are known) — the union once, each block verified
    /// (and decompressed) — and returns how many bytes go to each rank, by rank
    /// (none to a rank that asked nothing, nor to this one). The bytes themselves
    /// are written by [`Cooperative::write_sent`] (or returned by
    /// [`Cooperative::sent`]).
    pub async fn serve(&mut self, asked: &[&[u8]]) -> Result<Vec<u64>> {
        if asked.len() != self.world {
            return Err(Error::invalid(format!(
                "cooperative load: {} requests for a world of {}",
                asked.len(),
                self.world
            )));
        }
        let (requests, batches, unique) = self.union_of(asked)?;
        self.unique_bytes_served = unique;
        let store = &self.store;
        let parts = &self.parts;
        let dir = self.dir.as_str();
        let in_flight = (self.config.file_concurrency * self.config.batches_in_flight).max(2);
        let read: Vec<(u32, Range<u64>, Vec<u8>, u64)> = futures::stream::iter(batches)
            .map(move |(saved, blocks)| async move {
                let part = &parts[saved as usize];
                let object = part_object(dir, part);
                let (raw, stored) = fetch_raw(store, &object, part, &blocks).await?;
                Ok::<_, Error>((saved, blocks, raw, stored))
            })
            .buffer_unordered(in_flight)
            .try_collect()
            .await?;
        for (saved, blocks, raw, stored) in read {
            self.stats.bytes_read += stored;
            self.stats.bytes_read_from_store += stored;
            self.stats.bytes_verified += raw.len() as u64;
            self.held
                .entry(saved)
                .or_default()
                .insert(blocks.start, (blocks, raw));
        }
        let sizes = requests
            .iter()
            .enumerate()
            .map(|(to, request)| {
                if to == self.rank {
                    return 0;
                }
                request
                    .iter()
                    .map(|(saved, blocks)| raw_bytes(&self.parts[*saved as usize], blocks))
                    .sum()
            })
            .collect();
        self.served = requests;
        Ok(sizes)
    }

    /// The requests of `asked` decoded (this rank's own entry replaced by its own
    /// needs), the batches of blocks that read their union from the store, and the
    /// union's stored bytes.
    #[allow(clippy::type_complexity)]
    fn union_of(
        &self,
        asked: &[&[u8]],
    ) -> Result<(Vec<Vec<(u32, Range<u64>)>>, Vec<(u32, Range<u64>)>, u64)> {
        let mut requests: Vec<Vec<(u32, Range<u64>)>> = Vec::with_capacity(self.world);
        for (from, bytes) in asked.iter().enumerate() {
            requests.push(if from == self.rank {
                self.asks[self.rank].clone()
            } else {
                decode_asks(bytes, &self.parts, from)?
            });
        }
        // The union of the requests, per saved rank, merged.
        let mut union: BTreeMap<u32, Vec<Range<u64>>> = BTreeMap::new();
        for request in &requests {
            for (saved, blocks) in request {
                union.entry(*saved).or_default().push(blocks.clone());
            }
        }
        let mut batches = Vec::new();
        let mut unique = 0u64;
        for (saved, mut ranges) in union {
            let part = &self.parts[saved as usize];
            let map = BlockMap::new(part);
            ranges.sort_by_key(|r| r.start);
            let mut merged: Vec<Range<u64>> = Vec::new();
            for r in ranges {
                match merged.last_mut() {
                    Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                    _ => merged.push(r),
                }
            }
            let per_batch = (self.config.batch_bytes / part.block_size).max(1);
            for r in merged {
                let stored = map.stored_range(&r);
                unique += stored.end - stored.start;
                let mut start = r.start;
                while start < r.end {
                    let end = (start + per_batch).min(r.end);
                    batches.push((saved, start..end));
                    start = end;
                }
            }
        }
        Ok((requests, batches, unique))
    }

    /// What [`Cooperative::serve`] would read for `asked`, without reading: the
    /// ranged GETs it sends and the stored bytes they fetch (for planning figures at
    /// scale; the simulated ranks' data files need not exist).
    pub fn planned_reads(&self, asked: &[&[u8]]) -> Result<(u64, u64)> {
        if asked.len() != self.world {
            return Err(Error::invalid(format!(
                "cooperative load: {} requests for a world of {}",
                asked.len(),
                self.world
            )));
        }
        let (_, batches, unique) = self.union_of(asked)?;
        Ok((batches.len() as u64, unique))
    }

    /// Writes the bytes for rank `to` (after [`Cooperative::serve`]) into `out`,
    /// which must be exactly the size `serve` gave: the raw bytes of the blocks it
    /// asked for, back to back, in the order it asked.
    pub fn write_sent(&self, to: usize, out: &mut [u8]) -> Result<()> {
        let request = self.served.get(to).ok_or_else(|| {
            Error::invalid(format!(
                "cooperative load: rank {to} asked nothing of this one (or serve has not run)"
            ))
        })?;
        let mut at = 0usize;
        let capacity = out.len();
        for (saved, blocks) in request {
            for (_, bytes) in self.held_pieces(*saved, blocks)? {
                let end = at + bytes.len();
                out.get_mut(at..end)
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "cooperative load: a buffer of {capacity} bytes for rank {to}, too short"
                        ))
                    })?
                    .copy_from_slice(bytes);
                at = end;
            }
        }
        if at != out.len() {
            return Err(Error::invalid(format!(
                "cooperative load: a buffer of {} bytes for rank {to}, which gets {at}",
                out.len()
            )));
        }
        Ok(())
    }

    /// The bytes for rank `to`, as [`Cooperative::write_sent`] writes them.
    pub fn sent(&self, to: usize) -> Result<Vec<u8>> {
        if to == self.rank {
            return Ok(Vec::new());
        }
        let len: u64 = self
            .served
            .get(to)
            .map(|request| {
                request
                    .iter()
                    .map(|(saved, blocks)| raw_bytes(&self.parts[*saved as usize], blocks))
                    .sum()
            })
            .unwrap_or(0);
        let mut out = vec![0u8; len as usize];
        self.write_sent(to, &mut out)?;
        Ok(out)
    }

    /// The held raw bytes of `blocks` of `saved`'s file, as slices of the batches
    /// read, in order.
    fn held_pieces(&self, saved: u32, blocks: &Range<u64>) -> Result<Vec<(Range<u64>, &[u8])>> {
        let part = &self.parts[saved as usize];
        let block = part.block_size;
        let missing = || {
            Error::invalid(format!(
                "cooperative load: blocks {}..{} of rank {saved}'s file were not read",
                blocks.start, blocks.end
            ))
        };
        let batches = self.held.get(&saved).ok_or_else(missing)?;
        let mut out = Vec::new();
        let mut at = blocks.start;
        while at < blocks.end {
            let (range, raw) = batches
                .range(..=at)
                .next_back()
                .map(|(_, v)| v)
                .filter(|(range, _)| range.end > at)
                .ok_or_else(missing)?;
            let end = range.end.min(blocks.end);
            let from = ((at - range.start) * block) as usize;
            let to = (raw_bytes(part, &(range.start..end))) as usize;
            out.push((at..end, &raw[from..to]));
            at = end;
        }
        Ok(out)
    }

    /// Verifies what the other ranks sent (`received[r]`: rank `r`'s buffer, of
    /// [`Cooperative::expected`]'s size; this rank's own entry is ignored), reads
    /// from the store any block that fails its CRC32, and scatters the plan's runs
    /// into `outputs` (as [`CheckpointReader::load_into`] takes them).
    ///
    /// On failure the outputs are partly written, as after a failed
    /// [`CheckpointReader::load_into`].
    pub async fn finish(
        mut self,
        request: &LoadRequest,
        received: &[&[u8]],
        outputs: &mut [&mut [u8]],
    ) -> Result<LoadStats> {
        check_plan(request, &self.plan)?;
        check_outputs(request, &self.plan.sizes, outputs)?;
        if received.len() != self.world {
            return Err(Error::invalid(format!(
                "cooperative load: {} buffers received for a world of {}",
                received.len(),
                self.world
            )));
        }
        let expected = self.expected();
        for (from, (buffer, want)) in received.iter().zip(&expected).enumerate() {
            if from != self.rank && buffer.len() as u64 != *want {
                return Err(Error::invalid(format!(
                    "cooperative load: rank {from} sent {} bytes, {want} were asked",
                    buffer.len()
                )));
            }
        }
        // Where each needed block range comes from: (saved rank) -> [(blocks, source)].
        let mut sources: BTreeMap<u32, Vec<(Range<u64>, Source<'_>)>> = BTreeMap::new();
        for (owner, asks) in self.asks.iter().enumerate() {
            let mut at = 0usize;
            for (saved, blocks) in asks {
                let source = if owner == self.rank {
                    Source::Held
                } else {
                    let len = raw_bytes(&self.parts[*saved as usize], blocks) as usize;
                    let bytes = &received[owner][at..at + len];
                    at += len;
                    self.stats.bytes_received_from_peers += len as u64;
                    Source::Peer { rank: owner, bytes }
                };
                sources
                    .entry(*saved)
                    .or_default()
                    .push((blocks.clone(), source));
            }
        }
        // Blocks peers sent that fail their checks, read from the store instead.
        let mut refetched: BTreeMap<(u32, u64), Vec<u8>> = BTreeMap::new();
        for (saved, list) in &sources {
            let part = &self.parts[*saved as usize];
            for (blocks, source) in list {
                let Source::Peer { rank, bytes } = source else {
                    continue;
                };
                if let Some(bad) = failing_blocks(part, blocks, bytes) {
                    let object = part_object(&self.dir, part);
                    warn!(peer = rank, object = %object, block = bad, blocks = ?blocks, "blocks a peer sent failed their CRC32; reading them from the store");
                    self.stats.peer_blocks_rejected += blocks.end - blocks.start;
                    let (raw, stored) = fetch_raw(&self.store, &object, part, blocks).await?;
                    self.stats.bytes_read += stored;
                    self.stats.bytes_read_from_store += stored;
                    refetched.insert((*saved, blocks.start), raw);
                }
            }
        }
        let dest = Outputs::new(outputs);
        let mut jobs = Vec::with_capacity(self.plan.files.len());
        for (object, part, runs) in &self.plan.files {
            let saved = saved_rank_of(&self.parts, object, part)?;
            let mut pieces: Vec<(Range<u64>, &[u8])> = Vec::new();
            let mut list: Vec<&(Range<u64>, Source<'_>)> = sources
                .get(&saved)
                .map(|l| l.iter().collect())
                .unwrap_or_default();
            list.sort_by_key(|(blocks, _)| blocks.start);
            for (blocks, source) in list {
                match source {
                    Source::Held => pieces.extend(self.held_pieces(saved, blocks)?),
                    Source::Peer { bytes, .. } => match refetched.get(&(saved, blocks.start)) {
                        Some(raw) => pieces.push((blocks.clone(), raw.as_slice())),
                        None => pieces.push((blocks.clone(), bytes)),
                    },
                }
            }
            jobs.push((object.clone(), part.clone(), runs.clone(), pieces));
        }
        let dest = Arc::new(dest);
        let copied: Vec<u64> = in_this_poll(|| {
            on_threads(
                jobs,
                self.config.file_concurrency.max(1),
                |(object, part, runs, pieces)| {
                    let file = FileRead {
                        object: Arc::from(object.as_str()),
                        map: Arc::new(BlockMap::raw(&part)),
                        part,
                        runs,
                        dest: dest.clone(),
                    };
                    let mut cursor = 0usize;
                    let mut copied = 0u64;
                    for (blocks, bytes) in pieces {
                        let raw = file.raw_range(&blocks);
                        for c in file.copies(&raw, &mut cursor) {
                            // SAFETY: `c` is part of one run of the checked plan (the
                            // runs tile the outputs without overlap), written by this
                            // thread alone, and the slice does not outlive this
                            // statement; every thread is joined before `finish`
                            // returns (see `Outputs`).
                            let out = unsafe { dest.slice(c.want, c.dst, c.len) };
                            out.copy_from_slice(&bytes[c.at as usize..(c.at + c.len) as usize]);
                            copied += c.len;
                        }
                    }
                    Ok(copied)
                },
            )
        })?;
        let mut stats = self.stats;
        stats.bytes_requested = self.plan.stats.bytes_requested;
        stats.parts_read = self.plan.stats.parts_read;
        stats.bytes_copied += copied.iter().sum::<u64>();
        stats.unique_bytes = self.unique_bytes_served;
        Ok(stats)
    }
}

/// Where a needed block range's raw bytes are.
enum Source<'a> {
    /// Read by this rank as their owner (in `Cooperative::held`).
    Held,
    /// Sent by rank `rank`, not yet verified.
    Peer { rank: usize, bytes: &'a [u8] },
}

/// The cut of the job's line of bytes: every saved rank's data file end to end
/// (raw bytes, in rank order), cut into `world` pieces of equal bytes at block
/// boundaries; piece `o` is read by rank `o`.
struct Line {
    /// Where each saved rank's file starts on the line.
    starts: Vec<u64>,
    /// Block size of each saved rank's file.
    blocks: Vec<u64>,
    total: u64,
    world: usize,
}

impl Line {
    fn new(parts: &[Arc<RankPart>], world: usize) -> Self {
        let mut starts = Vec::with_capacity(parts.len());
        let mut total = 0u64;
        for part in parts {
            starts.push(total);
            total += part.file.raw_bytes;
        }
        Self {
            starts,
            blocks: parts.iter().map(|p| p.block_size.max(1)).collect(),
            total,
            world,
        }
    }

    /// The owner of the byte at `at` on the line.
    fn owner_at(&self, at: u64) -> usize {
        if self.total == 0 {
            return 0;
        }
        ((at as u128 * self.world as u128 / self.total as u128) as usize).min(self.world - 1)
    }

    /// Where owner `owner`'s piece ends on the line.
    fn piece_end(&self, owner: usize) -> u64 {
        ((owner as u128 + 1) * self.total as u128).div_ceil(self.world as u128) as u64
    }

    /// `blocks` of `saved`'s file split by owner (a block belongs to the owner of
    /// its first byte).
    fn split(&self, saved: u32, blocks: &Range<u64>) -> Vec<(usize, Range<u64>)> {
        let start = self.starts[saved as usize];
        let size = self.blocks[saved as usize];
        let mut out: Vec<(usize, Range<u64>)> = Vec::new();
        let mut b = blocks.start;
        while b < blocks.end {
            let owner = self.owner_at(start + b * size);
            // The first block starting at or after the end of the owner's piece.
            let end_on_line = self.piece_end(owner);
            let next = end_on_line.saturating_sub(start).div_ceil(size).max(b + 1);
            let end = next.min(blocks.end);
            match out.last_mut() {
                Some((o, r)) if *o == owner && r.end == b => r.end = end,
                _ => out.push((owner, b..end)),
            }
            b = end;
        }
        out
    }
}

/// The blocks `runs` (sorted by source offset) touch, merged.
fn needed_blocks(block: u64, runs: &[super::Run]) -> Vec<Range<u64>> {
    let mut needed: Vec<Range<u64>> = Vec::new();
    for run in runs {
        let first = run.src / block;
        let last = (run.src + run.len).div_ceil(block);
        match needed.last_mut() {
            Some(r) if first <= r.end => r.end = r.end.max(last),
            _ => needed.push(first..last),
        }
    }
    needed
}

/// Raw bytes of `blocks` of `part`'s file.
fn raw_bytes(part: &RankPart, blocks: &Range<u64>) -> u64 {
    let block = part.block_size;
    (blocks.end * block).min(part.file.raw_bytes) - (blocks.start * block).min(part.file.raw_bytes)
}

/// The object key of `part`'s data file in checkpoint directory `dir`.
fn part_object(dir: &str, part: &RankPart) -> String {
    format!("{dir}/{}", part.file.name)
}

/// The saved rank whose data file a plan's file is.
fn saved_rank_of(parts: &[Arc<RankPart>], object: &str, part: &RankPart) -> Result<u32> {
    match parts.get(part.rank as usize) {
        Some(held) if std::ptr::eq(&**held, part) || **held == *part => Ok(part.rank),
        _ => Err(Error::invalid(format!(
            "cooperative load: the plan's file {object} is not rank {}'s of this checkpoint",
            part.rank
        ))),
    }
}

/// The first block of `blocks` whose raw bytes in `bytes` fail their CRC32, if any.
fn failing_blocks(part: &RankPart, blocks: &Range<u64>, bytes: &[u8]) -> Option<u64> {
    let block = part.block_size;
    let base = blocks.start * block;
    for b in blocks.clone() {
        let lo = (b * block - base) as usize;
        let hi = (((b + 1) * block).min(part.file.raw_bytes) - base) as usize;
        let ok = bytes
            .get(lo..hi)
            .is_some_and(|raw| crc32fast::hash(raw) == part.file.block_crc32[b as usize]);
        if !ok {
            return Some(b);
        }
    }
    None
}

/// Reads `blocks` of a data file from the store, verified and decompressed, with a
/// second and third read of a remote store's bytes that fail their checks. Returns
/// the raw bytes and the stored bytes read.
async fn fetch_raw(
    store: &Store,
    object: &str,
    part: &RankPart,
    blocks: &Range<u64>,
) -> Result<(Vec<u8>, u64)> {
    let map = BlockMap::new(part);
    let crcs = &part.file.block_crc32[blocks.start as usize..blocks.end as usize];
    let mut reads = 0;
    let mut fetched = 0u64;
    loop {
        let stored = crate::blocks::fetch(store, object, &map, blocks).await?;
        reads += 1;
        fetched += stored.len() as u64;
        let mut raw = Vec::with_capacity(raw_bytes(part, blocks) as usize);
        let mut failure = None;
        crate::blocks::check(
            object,
            &map,
            blocks,
            crcs,
            &stored,
            |_, block| match block {
                Ok(data) => {
                    raw.extend_from_slice(&data);
                    true
                }
                Err(e) => {
                    failure = Some(e);
                    false
                }
            },
        );
        match failure {
            None => return Ok((raw, fetched)),
            Some(e) if reads < reads_on_mismatch(store) => {
                warn!(object, blocks = ?blocks, error = %e, "blocks failed their checks as read from a remote store; reading them again (damaged in flight?)");
            }
            Some(e) => return Err(read_again(e.into(), reads)),
        }
    }
}

/// Encodes a request: (saved rank, first block, end block) per entry.
fn encode_asks(asks: &[(u32, Range<u64>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(asks.len() * ASK_BYTES);
    for (saved, blocks) in asks {
        out.extend_from_slice(&saved.to_le_bytes());
        out.extend_from_slice(&blocks.start.to_le_bytes());
        out.extend_from_slice(&blocks.end.to_le_bytes());
    }
    out
}

/// Decodes rank `from`'s request, checking every entry against the parts.
fn decode_asks(
    bytes: &[u8],
    parts: &[Arc<RankPart>],
    from: usize,
) -> Result<Vec<(u32, Range<u64>)>> {
    let bad = |message: String| {
        Error::invalid(format!("cooperative load: rank {from}'s request {message}"))
    };
    if !bytes.len().is_multiple_of(ASK_BYTES) {
        return Err(bad(format!("is {} bytes, not whole entries", bytes.len())));
    }
    bytes
        .chunks_exact(ASK_BYTES)
        .map(|entry| {
            let saved = u32::from_le_bytes(entry[0..4].try_into().expect("4 bytes"));
            let start = u64::from_le_bytes(entry[4..12].try_into().expect("8 bytes"));
            let end = u64::from_le_bytes(entry[12..20].try_into().expect("8 bytes"));
            let part = parts
                .get(saved as usize)
                .ok_or_else(|| bad(format!("names saved rank {saved} of {}", parts.len())))?;
            let blocks = part.file.block_crc32.len() as u64;
            if start >= end || end > blocks {
                return Err(bad(format!(
                    "asks blocks {start}..{end} of rank {saved}'s file, which has {blocks}"
                )));
            }
            Ok((saved, start..end))
        })
        .collect()
}

/// Reads the encoding of [`CheckpointReader::share`], every length bounded by
/// what is left.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8]> {
        let left = (self.bytes.len() - self.at) as u64;
        if n > left {
            return Err(FormatError::new(
                "a checkpoint shared by another rank",
                Some(self.at as u64),
                format!("truncated: {n} bytes claimed, {left} left"),
            )
            .into());
        }
        let out = &self.bytes[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(out)
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
}
