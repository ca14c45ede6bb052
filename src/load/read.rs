//! Reading one data file's blocks: batched and coalesced, each block's CRC32
//! checked (and zstd frame decoded) before any byte is delivered, positioned
//! vectored reads on local disk, ranged gets elsewhere, and a second and third read
//! of a remote block that fails its checksum before it counts as corruption.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ckpt_storage::Store;
use futures::{StreamExt, TryStreamExt};
use tracing::warn;

use super::Run;
use super::execute::{in_this_poll, on_threads};
use super::request::ReadConfig;
use super::scatter::{MAX_PIECES, Outputs, Piece, Scatter, Tally, thread_cpu};
use crate::blocks::BlockMap;
use crate::error::{Error, Result};
use crate::format::{FormatError, RankPart};

/// One data file of a load.
pub(crate) struct FileRead {
    pub(crate) object: Arc<str>,
    pub(crate) part: Arc<RankPart>,
    pub(crate) map: Arc<BlockMap>,
    /// Sorted by source offset.
    pub(crate) runs: Vec<Run>,
    pub(crate) dest: Arc<Outputs>,
}

impl FileRead {
    /// The batches of whole blocks to read: the blocks the runs touch, merged, cut
    /// into pieces of at most `batch_bytes` raw bytes.
    pub(crate) fn batches(&self, batch_bytes: u64) -> Vec<Range<u64>> {
        let block = self.part.block_size;
        let mut needed: Vec<Range<u64>> = Vec::new();
        for run in &self.runs {
            let first = run.src / block;
            let last = (run.src + run.len).div_ceil(block);
            match needed.last_mut() {
                Some(r) if first <= r.end => r.end = r.end.max(last),
                _ => needed.push(first..last),
            }
        }
        let per_batch = (batch_bytes / block).max(1);
        needed
            .iter()
            .flat_map(|r| {
                (r.start..r.end)
                    .step_by(per_batch as usize)
                    .map(move |s| s..(s + per_batch).min(r.end))
            })
            .collect()
    }

    /// Raw byte range of `blocks`.
    pub(crate) fn raw_range(&self, blocks: &Range<u64>) -> Range<u64> {
        let block = self.part.block_size;
        blocks.start * block..(blocks.end * block).min(self.part.file.raw_bytes)
    }

    /// The runs' pieces inside raw bytes `raw`, as copies out of a buffer holding
    /// exactly those bytes. `cursor` is the first run that may still matter; it only
    /// moves forward as batches do.
    pub(crate) fn copies(&self, raw: &Range<u64>, cursor: &mut usize) -> Vec<Scatter> {
        while *cursor < self.runs.len()
            && self.runs[*cursor].src + self.runs[*cursor].len <= raw.start
        {
            *cursor += 1;
        }
        let mut copies = Vec::new();
        for run in &self.runs[*cursor..] {
            if run.src >= raw.end {
                break;
            }
            let lo = run.src.max(raw.start);
            let hi = (run.src + run.len).min(raw.end);
            if lo < hi {
                copies.push(Scatter {
                    at: lo - raw.start,
                    want: run.want,
                    dst: run.dst + (lo - run.src),
                    len: hi - lo,
                });
            }
        }
        copies
    }

    /// How to read raw bytes `raw` in place: the pieces of one vectored read, in
    /// file order, or `None` when the copies overlap in the file (two wants of the
    /// same bytes) or are too many, so the batch goes through scratch.
    fn pieces(raw: &Range<u64>, copies: &[Scatter]) -> Option<Vec<Piece>> {
        let mut pieces = Vec::with_capacity(copies.len() * 2 + 1);
        let mut at = 0u64;
        for c in copies {
            if c.at < at {
                return None;
            }
            if c.at > at {
                pieces.push(Piece::Scratch { len: c.at - at });
            }
            pieces.push(Piece::Out {
                want: c.want,
                dst: c.dst,
                len: c.len,
            });
            at = c.at + c.len;
        }
        let len = raw.end - raw.start;
        if at < len {
            pieces.push(Piece::Scratch { len: len - at });
        }
        (pieces.len() <= MAX_PIECES).then_some(pieces)
    }

    /// Reads a plain data file of a local store with positioned reads, straight
    /// into the outputs where the batch's runs allow it, `batches_in_flight` batches
    /// at a time on scoped threads (joined before this returns).
    pub(super) fn read_local(&self, path: &std::path::Path, config: &ReadConfig) -> Result<Tally> {
        let file = std::fs::File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::from(FormatError::new(
                &self.object,
                None,
                "data file is missing from a committed checkpoint",
            )),
            _ => Error::from(ckpt_storage::Error::new(
                ckpt_storage::io_error_kind(&e),
                format!("open {}: {e}", self.object),
            )),
        })?;
        let scratch: Mutex<Vec<Vec<u8>>> = Mutex::default();
        let mut cursor = 0usize;
        let jobs: Vec<_> = self
            .batches(config.batch_bytes)
            .into_iter()
            .map(|blocks| {
                let raw = self.raw_range(&blocks);
                let copies = self.copies(&raw, &mut cursor);
                (blocks, raw, copies)
            })
            .collect();
        let batches = on_threads(jobs, config.batches_in_flight, |(blocks, raw, copies)| {
            read_batch(
                &mut |at, buffers| crate::blocks::read_into(&file, &self.object, at, buffers),
                &self.object,
                &self.part,
                &self.map,
                &self.dest,
                &scratch,
                blocks,
                raw,
                &copies,
            )
        })?;
        let mut tally = Tally::default();
        for batch in &batches {
            tally.add(batch);
        }
        Ok(tally)
    }

    /// Reads a data file through the store (any backend, any codec): a ranged get
    /// per batch, then checksums, decompression and the copies into the outputs in
    /// the poll that received the batch.
    pub(super) async fn read_store(self, store: &Store, config: &ReadConfig) -> Result<Tally> {
        let batches = self.batches(config.batch_bytes);
        let mut cursor = 0usize;
        let jobs: Vec<_> = batches
            .into_iter()
            .map(|blocks| {
                let raw = self.raw_range(&blocks);
                let copies = self.copies(&raw, &mut cursor);
                (blocks, copies)
            })
            .collect();
        // About two full batches of bytes in flight: more requests when the runs are
        // short (a rank of a resharded load reads a slice of every chunk of a file),
        // so small reads do not leave the store idle between them.
        let block = self.part.block_size;
        let count = jobs.len().max(1) as u64;
        let mean = jobs
            .iter()
            .map(|(b, _)| (b.end - b.start) * block)
            .sum::<u64>()
            / count;
        let in_flight_batches = (config.batches_in_flight.max(1) as u64 * config.batch_bytes
            / mean.max(1))
        .clamp(2, 16) as usize;
        let this = &self;
        let mut tally = Tally::default();
        let mut done = futures::stream::iter(jobs)
            .map(|(blocks, copies)| async move {
                let mut waited = Duration::ZERO;
                let mut reads = 0;
                loop {
                    let started = Instant::now();
                    let stored =
                        crate::blocks::fetch(store, &this.object, &this.map, &blocks).await?;
                    waited += started.elapsed();
                    reads += 1;
                    // Verified and copied within this poll (see `read_plan`); a batch
                    // that fails its checks copies nothing.
                    match in_this_poll(|| {
                        verify_and_copy(
                            &this.object,
                            &this.part,
                            &this.map,
                            &this.dest,
                            blocks.clone(),
                            stored,
                            &copies,
                        )
                    }) {
                        Ok(mut tally) => {
                            tally.timings.read += waited;
                            return Ok::<_, Error>(tally);
                        }
                        Err(e) if e.is_corruption() && reads < reads_on_mismatch(store) => {
                            warn!(object = %this.object, blocks = ?blocks, error = %e, "blocks failed their checks as read from a remote store; reading them again (damaged in flight?)");
                        }
                        Err(e) => return Err(read_again(e, reads)),
                    }
                }
            })
            .buffered(in_flight_batches);
        while let Some(batch) = done.try_next().await? {
            tally.add(&batch);
        }
        Ok(tally)
    }
}

/// How many times blocks (or a rank part) that fail their checksums are read before
/// the failure counts as corruption at rest: three from a remote store, where bytes
/// cross a network and its middleboxes and a damaged response is transient (the
/// block CRC32 finds it; a second read gets the stored bytes); once from local disk
/// or memory, where reading again returns the same bytes.
pub(super) fn reads_on_mismatch(store: &Store) -> u32 {
    match store.backend() {
        ckpt_storage::Backend::Local | ckpt_storage::Backend::Memory => 1,
        _ => 3,
    }
}

/// A corruption error found on every one of `reads` reads, saying so.
pub(super) fn read_again(mut e: Error, reads: u32) -> Error {
    if reads > 1
        && let Error::Corrupt(f) = &mut e
    {
        f.message
            .push_str(&format!(" (the same in {reads} reads: damaged at rest)"));
    }
    e
}

/// A reader of raw bytes of a plain file into memory: `read(at, buffers)` fills
/// `buffers`, back to back, with the bytes from raw offset `at` on.
pub(crate) type ReadRaw<'a> = dyn FnMut(u64, &mut [&mut [u8]]) -> Result<()> + 'a;

/// Reads one batch of a plain file (a local file, a peer's in-memory copy) through
/// `read`: in place when its runs allow (one vectored read into the outputs and
/// scratch for the bytes between them, then the CRC32 of each block over that
/// memory), else into scratch, verified, then copied.
#[allow(clippy::too_many_arguments)]
pub(crate) fn read_batch(
    read: &mut ReadRaw<'_>,
    object: &str,
    part: &RankPart,
    map: &BlockMap,
    dest: &Outputs,
    scratch_pool: &Mutex<Vec<Vec<u8>>>,
    blocks: Range<u64>,
    raw: Range<u64>,
    copies: &[Scatter],
) -> Result<Tally> {
    let len = raw.end - raw.start;
    let pieces = FileRead::pieces(&raw, copies);
    let direct = pieces.is_some();
    let pieces = pieces.unwrap_or_else(|| vec![Piece::Scratch { len }]);
    let scratch_len: u64 = pieces
        .iter()
        .map(|p| match p {
            Piece::Scratch { len } => *len,
            Piece::Out { .. } => 0,
        })
        .sum();
    let mut scratch = scratch_pool
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .pop()
        .unwrap_or_default();
    if (scratch.len() as u64) < scratch_len {
        scratch.resize(scratch_len as usize, 0);
    }
    let mut tally = Tally {
        read: len,
        verified: len,
        ..Tally::default()
    };
    let crcs = &part.file.block_crc32[blocks.start as usize..blocks.end as usize];
    {
        let mut rest: &mut [u8] = &mut scratch[..scratch_len as usize];
        let mut buffers: Vec<&mut [u8]> = pieces
            .iter()
            .map(|p| match *p {
                // SAFETY: an in-place piece is exactly one copy of this batch, i.e.
                // part of one run of the checked plan, read by this thread alone;
                // the slice is dropped at the end of this block, before the scoped
                // thread is joined (see `Outputs`).
                Piece::Out { want, dst, len } => unsafe { dest.slice(want, dst, len) },
                Piece::Scratch { len } => {
                    let (head, tail) = std::mem::take(&mut rest).split_at_mut(len as usize);
                    rest = tail;
                    head
                }
            })
            .collect();
        let (started, cpu) = (Instant::now(), thread_cpu());
        read(raw.start, &mut buffers)?;
        tally.timings.read += started.elapsed();
        tally.timings.read_cpu += thread_cpu().saturating_sub(cpu);
        let started = Instant::now();
        let views: Vec<&[u8]> = buffers.iter().map(|b| &**b).collect();
        crate::blocks::verify_pieces(object, map, &blocks, crcs, &views)?;
        tally.timings.verify += started.elapsed();
    }
    if !direct {
        let started = Instant::now();
        for c in copies {
            // SAFETY: as above: `c` is part of one run of the checked plan, written
            // by this task alone, and the slice does not outlive this statement.
            let out = unsafe { dest.slice(c.want, c.dst, c.len) };
            out.copy_from_slice(&scratch[c.at as usize..(c.at + c.len) as usize]);
            tally.copied += c.len;
        }
        tally.timings.copy += started.elapsed();
    }
    scratch_pool
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(scratch);
    Ok(tally)
}

/// Checks (and decompresses, when `map` says the blocks are stored compressed) the
/// stored bytes of `blocks`, then copies the runs out of the verified raw bytes into
/// the outputs.
pub(crate) fn verify_and_copy(
    object: &str,
    part: &RankPart,
    map: &BlockMap,
    dest: &Outputs,
    blocks: Range<u64>,
    stored: Bytes,
    copies: &[Scatter],
) -> Result<Tally> {
    let compressed = map.is_compressed();
    let crcs = &part.file.block_crc32[blocks.start as usize..blocks.end as usize];
    let mut tally = Tally {
        read: stored.len() as u64,
        ..Tally::default()
    };
    let started = Instant::now();
    let mut plain = Vec::new();
    let mut failure = None;
    crate::blocks::check(
        object,
        map,
        &blocks,
        crcs,
        &stored,
        |_, block| match block {
            Ok(data) => {
                if compressed {
                    plain.extend_from_slice(&data);
                }
                true
            }
            Err(e) => {
                failure = Some(e);
                false
            }
        },
    );
    if let Some(e) = failure {
        return Err(e.into());
    }
    // Uncompressed and sound: the stored bytes are the raw bytes.
    let raw: &[u8] = if compressed { &plain } else { &stored };
    tally.verified = raw.len() as u64;
    tally.timings.verify += started.elapsed();
    let started = Instant::now();
    for c in copies {
        let from = raw
            .get(c.at as usize..(c.at + c.len) as usize)
            .ok_or_else(|| {
                FormatError::new(
                    object,
                    None,
                    format!(
                        "blocks {}..{} decode to {} bytes, fewer than their runs need",
                        blocks.start,
                        blocks.end,
                        raw.len()
                    ),
                )
            })?;
        // SAFETY: `c` is part of one run of the checked plan, written by this task
        // alone, and the slice does not outlive this statement (see `Outputs`).
        let out = unsafe { dest.slice(c.want, c.dst, c.len) };
        out.copy_from_slice(from);
        tally.copied += c.len;
    }
    tally.timings.copy += started.elapsed();
    Ok(tally)
}
