//! Reading blocks of a rank data file: fetch, decompress, check CRC32.
//!
//! Shared by everything that reads data files block by block and needs to know
//! exactly which block failed and where it is stored.
//!
//! Two ways in. [`fetch`] asks the store for the stored bytes of some blocks and
//! [`check`] decodes and verifies them: every backend, every codec. [`read_into`] is
//! the local-disk shortcut for plain files: one positioned, vectored read puts the
//! blocks' bytes straight where the caller wants them (a tensor's memory, scratch for
//! the bytes nobody asked for) and [`verify_pieces`] then checks the blocks' CRC32
//! over that memory. Through object_store the same bytes cost a fresh buffer per
//! request (page faults, then unmapping it), and a copy out of it.

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;

use bytes::Bytes;
use ckpt_storage::{ErrorKind, Store};

use crate::codec::decompress_block;
use crate::error::{Error, Result};
use crate::format::{Codec, FormatError, RankPart};

/// Where the blocks of one data file are stored.
#[derive(Debug, Clone)]
pub(crate) struct BlockMap {
    block: u64,
    raw_len: u64,
    codec: Codec,
    /// Stored offset of every frame, plus the end (compressed files only).
    frame_offsets: Vec<u64>,
}

impl BlockMap {
    pub(crate) fn new(part: &RankPart) -> Self {
        let frame_offsets = match part.codec {
            Codec::None => Vec::new(),
            Codec::Zstd { .. } => std::iter::once(0)
                .chain(part.file.frame_bytes.iter().scan(0u64, |acc, &f| {
                    *acc += f;
                    Some(*acc)
                }))
                .collect(),
        };
        Self {
            block: part.block_size,
            raw_len: part.file.raw_bytes,
            codec: part.codec,
            frame_offsets,
        }
    }

    /// The blocks of `part`'s data file as raw bytes, whatever its codec: how a copy
    /// of the staged file (raw, `crate::copies`) is laid out.
    pub(crate) fn raw(part: &RankPart) -> Self {
        Self {
            block: part.block_size,
            raw_len: part.file.raw_bytes,
            codec: Codec::None,
            frame_offsets: Vec::new(),
        }
    }

    /// True when the blocks are stored as compressed frames.
    pub(crate) fn is_compressed(&self) -> bool {
        matches!(self.codec, Codec::Zstd { .. })
    }

    /// Number of blocks.
    pub(crate) fn blocks(&self) -> u64 {
        self.raw_len.div_ceil(self.block)
    }

    /// Raw byte range of block `b`.
    pub(crate) fn raw_range(&self, b: u64) -> Range<u64> {
        b * self.block..((b + 1) * self.block).min(self.raw_len)
    }

    /// Stored byte range of blocks `blocks`.
    pub(crate) fn stored_range(&self, blocks: &Range<u64>) -> Range<u64> {
        match self.codec {
            Codec::None => {
                self.raw_range(blocks.start).start..self.raw_range(blocks.end.max(1) - 1).end
            }
            Codec::Zstd { .. } => {
                self.frame_offsets[blocks.start as usize]..self.frame_offsets[blocks.end as usize]
            }
        }
    }
}

/// Fetches the stored bytes of `blocks`. A missing or short file is a corruption
/// error naming the object and the offset.
pub(crate) async fn fetch(
    store: &Store,
    object: &str,
    map: &BlockMap,
    blocks: &Range<u64>,
) -> Result<Bytes> {
    let range = map.stored_range(blocks);
    store
        .get_range(object, range.clone())
        .await
        .map_err(|e| match e.kind() {
            ErrorKind::NotFound => FormatError::new(
                object,
                None,
                "data file is missing from a committed checkpoint",
            )
            .into(),
            ErrorKind::Permanent => FormatError::new(
                object,
                Some(range.start),
                format!(
                    "cannot read bytes {}..{} (truncated?): {e}",
                    range.start, range.end
                ),
            )
            .into(),
            _ => Error::from(e),
        })
}

/// Decodes and checks each block of `blocks` from their stored bytes `stored`,
/// calling `each(block, result)` in order. `crcs` are the recorded checksums of
/// exactly these blocks. CPU-bound: call on a blocking thread for large batches.
pub(crate) fn check(
    object: &str,
    map: &BlockMap,
    blocks: &Range<u64>,
    crcs: &[u32],
    stored: &Bytes,
    mut each: impl FnMut(u64, std::result::Result<Bytes, FormatError>) -> bool,
) {
    let base = map.stored_range(blocks).start;
    for (k, b) in (blocks.start..blocks.end).enumerate() {
        let raw = map.raw_range(b);
        let (stored_at, block): (u64, std::result::Result<Bytes, FormatError>) = match map.codec {
            Codec::None => (
                raw.start,
                Ok(stored.slice((raw.start - base) as usize..(raw.end - base) as usize)),
            ),
            Codec::Zstd { .. } => {
                let f0 = map.frame_offsets[b as usize];
                let f1 = map.frame_offsets[b as usize + 1];
                let frame = &stored[(f0 - base) as usize..(f1 - base) as usize];
                (
                    f0,
                    decompress_block(frame, (raw.end - raw.start) as usize, map.codec)
                        .map(Bytes::from)
                        .map_err(|e| {
                            FormatError::new(
                                object,
                                Some(f0),
                                format!(
                                    "frame of block {b} (raw bytes {}..{}): {e}",
                                    raw.start, raw.end
                                ),
                            )
                        }),
                )
            }
        };
        let block = block.and_then(|data| {
            let actual = crc32fast::hash(&data);
            if actual == crcs[k] {
                Ok(data)
            } else {
                Err(FormatError::new(
                    object,
                    Some(stored_at),
                    format!(
                        "block {b} (raw bytes {}..{}) fails its CRC32: computed {actual:08x}, recorded {:08x}",
                        raw.start, raw.end, crcs[k]
                    ),
                ))
            }
        });
        if !each(b, block) {
            return;
        }
    }
}

/// Reads raw bytes `at..at + Σ len(pieces)` of a plain (uncompressed) local data file
/// into `pieces`, in order, with positioned vectored reads (`preadv`): the kernel
/// copies from the page cache (or the device) into the caller's memory, nothing in
/// between. A file shorter than the range is a corruption error naming the object
/// and where it ends.
pub(crate) fn read_into(
    file: &File,
    object: &str,
    at: u64,
    pieces: &mut [&mut [u8]],
) -> Result<()> {
    let total: u64 = pieces.iter().map(|p| p.len() as u64).sum();
    let (mut index, mut skip, mut done) = (0usize, 0usize, 0u64);
    // Paced as the store's own reads of local storage.
    let mut pauses = ckpt_storage::LOCAL_READ_PAUSES.iter();
    loop {
        while index < pieces.len() && pieces[index].len() == skip {
            index += 1;
            skip = 0;
        }
        if index == pieces.len() {
            break;
        }
        // At most IOV_MAX (1024 on Linux) buffers per call.
        let iov: Vec<libc::iovec> = pieces[index..]
            .iter_mut()
            .take(1024)
            .enumerate()
            .map(|(k, p)| {
                let from = if k == 0 { skip } else { 0 };
                libc::iovec {
                    iov_base: p[from..].as_mut_ptr().cast(),
                    iov_len: p.len() - from,
                }
            })
            .collect();
        let offset = at + done;
        let offset_t = libc::off_t::try_from(offset).map_err(|_| {
            Error::from(FormatError::new(
                object,
                Some(offset),
                "offset out of range",
            ))
        })?;
        // SAFETY: every iovec points into a distinct `&mut [u8]` of `pieces` (past
        // the bytes already read of the first one) with its exact remaining length,
        // and those borrows outlive the call; `iov.len()` is at most 1024 (IOV_MAX)
        // and the descriptor is open for as long as `file` is borrowed.
        let n = unsafe {
            libc::preadv(
                file.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
                offset_t,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            let kind = ckpt_storage::io_error_kind(&e);
            // A failing device or network file system (EIO, a stale handle) may let
            // the same read through a moment later, as the store's own reads do.
            if kind == ErrorKind::Transient
                && let Some(pause) = pauses.next()
            {
                tracing::warn!(object, offset, error = %e, "a read of a local data file failed; reading again in {} ms", pause.as_millis());
                std::thread::sleep(*pause);
                continue;
            }
            return Err(Error::from(ckpt_storage::Error::new(
                kind,
                format!("read {object}: bytes {offset}..{}: {e}", at + total),
            )));
        }
        if n == 0 {
            return Err(FormatError::new(
                object,
                Some(offset),
                format!(
                    "cannot read bytes {at}..{} (truncated?): the file ends at byte {offset}",
                    at + total
                ),
            )
            .into());
        }
        let mut n = n as usize;
        done += n as u64;
        // Advance past the buffers filled.
        while n > 0 && index < pieces.len() {
            let left = pieces[index].len() - skip;
            if n >= left {
                n -= left;
                index += 1;
                skip = 0;
            } else {
                skip += n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// Checks the CRC32 of each block of `blocks` (of a plain file) over `pieces`, the
/// blocks' raw bytes in order, however they are split (the pieces need not align
/// with blocks). `crcs` are the recorded checksums of exactly these blocks. The error
/// names the object and the first failing block's offset, as [`check`] does.
pub(crate) fn verify_pieces(
    object: &str,
    map: &BlockMap,
    blocks: &Range<u64>,
    crcs: &[u32],
    pieces: &[&[u8]],
) -> std::result::Result<(), FormatError> {
    let mut pieces = pieces.iter().map(|p| &p[..]).filter(|p| !p.is_empty());
    let mut current: &[u8] = &[];
    for (k, b) in (blocks.start..blocks.end).enumerate() {
        let raw = map.raw_range(b);
        let mut want = (raw.end - raw.start) as usize;
        let mut hasher = crc32fast::Hasher::new();
        while want > 0 {
            if current.is_empty() {
                current = pieces.next().ok_or_else(|| {
                    FormatError::new(
                        object,
                        Some(raw.end - want as u64),
                        format!("block {b} is short of {want} bytes in memory"),
                    )
                })?;
            }
            let take = want.min(current.len());
            hasher.update(&current[..take]);
            current = &current[take..];
            want -= take;
        }
        let actual = hasher.finalize();
        if actual != crcs[k] {
            return Err(FormatError::new(
                object,
                Some(raw.start),
                format!(
                    "block {b} (raw bytes {}..{}) fails its CRC32: computed {actual:08x}, recorded {:08x}",
                    raw.start, raw.end, crcs[k]
                ),
            ));
        }
    }
    Ok(())
}
