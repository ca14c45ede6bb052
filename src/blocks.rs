//! Reading blocks of a rank data file: fetch, decompress, check CRC32.
//!
//! Shared by everything that reads data files block by block and needs to know
//! exactly which block failed and where it is stored.

use std::ops::Range;

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
