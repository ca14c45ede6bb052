//! Checking bytes of a committed data file that come from somewhere other than the
//! store against the block CRC32s its save computed, for copies of a rank's *boxes*
//! kept outside the library.
//!
//! The copies this module's parent keeps are whole staged files, checked block by
//! block as they are read ([`super::load_into`]). A trainer may instead keep copies of
//! its tensors' data only (the boxes, not the file), in memory of its own. The file's
//! raw bytes are the safetensors header followed by the boxes back to back, so every
//! block is rebuilt from the header — a function of the rank part, rebuilt here with
//! the writer's own code ([`file_header`]) — and the boxes' bytes, which the caller
//! reads from wherever it keeps them ([`read_verified`]). Blocks straddle boxes, so
//! checking one box's bytes costs reading the neighbouring bytes its first and last
//! blocks share (at most two blocks more). A mismatch is an error the caller answers
//! by reading the store instead.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::format::{Chunk, FormatError, RankPart};
use crate::rank_file::{PlannedBox, rank_file_header};

/// Where a copy's bytes come from: `read(chunk, bytes, out)` fills `out` with bytes
/// `bytes` (offsets inside the box's data, row-major) of `chunk`'s box, or says why it
/// cannot.
pub type ReadBox<'a> =
    dyn FnMut(&Chunk, Range<u64>, &mut [u8]) -> std::result::Result<(), String> + 'a;

/// Raw bytes of a data file, whole blocks, checked against their CRC32s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedBytes {
    /// Raw byte range of the file these bytes are (starts and ends on block
    /// boundaries, or at the end of the file).
    pub raw: Range<u64>,
    /// The bytes.
    pub bytes: Vec<u8>,
}

impl VerifiedBytes {
    /// The bytes of raw range `range`, which must lie inside [`VerifiedBytes::raw`].
    pub fn slice(&self, range: Range<u64>) -> Option<&[u8]> {
        if range.start < self.raw.start || range.end > self.raw.end || range.start > range.end {
            return None;
        }
        let start = (range.start - self.raw.start) as usize;
        let end = (range.end - self.raw.start) as usize;
        self.bytes.get(start..end)
    }
}

/// The safetensors header that the save of `part` wrote at the start of its data
/// file, rebuilt from the part (the header is a function of the step, the rank, the
/// world size and the boxes in file order). Fails, naming `object`, when the part's
/// boxes are not laid out back to back right after a header of that length, as this
/// library writes them.
pub fn file_header(part: &RankPart, object: &str) -> Result<Vec<u8>> {
    let boxes: Vec<PlannedBox> = part
        .chunks
        .iter()
        .map(|c| PlannedBox {
            name: c.tensor.clone(),
            dtype: c.dtype,
            shape: c.shape.clone(),
            region: c.region(),
        })
        .collect();
    // A part whose entry names would collide was not written by this library.
    let header = rank_file_header(part.step, part.rank, part.world_size, &boxes)
        .map_err(|e| Error::Corrupt(FormatError::new(object, None, e.to_string())))?;
    let mut at = header.len() as u64;
    for chunk in &part.chunks {
        if chunk.bytes[0] != at {
            return Err(Error::Corrupt(FormatError::new(
                object,
                Some(chunk.bytes[0]),
                format!(
                    "box of {:?} begins at byte {}, not at {at} where a rebuilt header and the boxes before it end",
                    chunk.tensor, chunk.bytes[0]
                ),
            )));
        }
        at = chunk.bytes[1];
    }
    if at != part.file.raw_bytes {
        return Err(Error::Corrupt(FormatError::new(
            object,
            Some(at),
            format!(
                "the boxes end at byte {at}, the file at {}",
                part.file.raw_bytes
            ),
        )));
    }
    Ok(header)
}

/// Reads raw bytes `want` of `part`'s data file, extended to whole blocks, from a copy
/// of its boxes outside the store, and checks every block against the part's CRC32s.
///
/// `header` is [`file_header`] of the part. `read` ([`ReadBox`]) reads the boxes'
/// bytes; its error is the copy's failure (a peer that does not answer). `object`
/// names the copy in errors (a peer and the checkpoint, say).
///
/// Errors: [`Error::Corrupt`] naming `object`, the block and its raw offset when a
/// block's CRC32 differs from the save's; [`Error::NotFound`] with the reader's
/// message when `read` fails; [`Error::Invalid`] when `want` is not inside the file.
pub fn read_verified(
    part: &RankPart,
    header: &[u8],
    want: Range<u64>,
    object: &str,
    read: &mut ReadBox<'_>,
) -> Result<VerifiedBytes> {
    let raw_len = part.file.raw_bytes;
    if want.start > want.end || want.end > raw_len {
        return Err(Error::invalid(format!(
            "bytes {}..{} of {object} lie outside its {raw_len} bytes",
            want.start, want.end
        )));
    }
    let block = part.block_size;
    let first = want.start / block;
    let last = want.end.div_ceil(block).max(first + 1);
    let raw = first * block..(last * block).min(raw_len);
    let mut bytes = vec![0u8; (raw.end - raw.start) as usize];
    // The header's share.
    let header_end = header.len() as u64;
    if raw.start < header_end {
        let end = raw.end.min(header_end);
        bytes[..(end - raw.start) as usize]
            .copy_from_slice(&header[raw.start as usize..end as usize]);
    }
    // Each box's share.
    for chunk in &part.chunks {
        let [begin, end] = chunk.bytes;
        let (from, to) = (begin.max(raw.start), end.min(raw.end));
        if from >= to {
            continue;
        }
        let out = &mut bytes[(from - raw.start) as usize..(to - raw.start) as usize];
        read(chunk, from - begin..to - begin, out).map_err(Error::NotFound)?;
    }
    for (i, b) in (first..last).enumerate() {
        let start = i * block as usize;
        let end = ((i + 1) * block as usize).min(bytes.len());
        let expected = part.file.block_crc32.get(b as usize).copied();
        let actual = crc32fast::hash(&bytes[start..end]);
        if expected != Some(actual) {
            return Err(Error::Corrupt(FormatError::new(
                object,
                Some(b * block),
                format!(
                    "block {b} has CRC32 {actual:08x}, the save computed {}",
                    expected.map_or("none".to_string(), |e| format!("{e:08x}"))
                ),
            )));
        }
    }
    Ok(VerifiedBytes { raw, bytes })
}
