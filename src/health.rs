//! Health, computed (the format is [`crate::format::health`]).
//!
//! **On the save**, one pass over the staged bytes yields everything: the file's
//! block CRC32s, the count of non-finite elements in each float box, and the CRC32s
//! of each replicated box in slices of `block_size` counted from the box's start.
//! A file block is hashed piece by piece, cut where a replicated box's slice begins
//! or ends, and the pieces' CRCs are combined (`crc32fast::Hasher::combine`, a few
//! dozen operations whatever the length) into the block's CRC and into the box
//! slice's: no byte is hashed twice. The float scan reads each piece right after it
//! is hashed, while it is still in cache (pieces are at most [`WINDOW`] bytes). The
//! replicas a rank holds but does not write are staged after its file and hashed in
//! box slices only.
//!
//! **On the commit**, [`judge`] reads what every part found and gives the verdict the
//! manifest records: which tensors hold non-finite values, which holders of a
//! replicated box disagree with the copy that was written (and in which slices), the
//! caller's metrics and failed checks, and whether a rank's policy refuses the
//! commit because of a disagreement.

use std::collections::{BTreeMap, HashMap};

use crc32fast::Hasher;

use crate::dtype::DType;
use crate::format::RankPart;
use crate::format::health::{
    ChunkNonFinite, Health, MAX_BLOCKS_LISTED, MAX_HEALTH_ENTRIES, MAX_REASONS, Metric, NonFinite,
    ReplicaMismatch, ReplicaPolicy, count_nonfinite, ranks_text,
};

/// The longest piece hashed and scanned at once: small enough to stay in a core's
/// L2 cache between the hash and the float scan.
pub const WINDOW: usize = 256 << 10;

/// A written box as the scan sees it: its byte range in the file.
#[derive(Debug, Clone, Copy)]
pub struct ScanChunk {
    /// First byte in the file.
    pub begin: usize,
    /// One past the last byte.
    pub end: usize,
    /// Element type.
    pub dtype: DType,
    /// Count its non-finite elements.
    pub float: bool,
    /// Other ranks hold it too: its slice CRCs are wanted.
    pub replicated: bool,
}

impl ScanChunk {
    /// A box of `dtype` at `[begin, end)`.
    pub fn new(begin: usize, end: usize, dtype: DType, replicated: bool) -> Self {
        Self {
            begin,
            end,
            dtype,
            float: dtype.is_float(),
            replicated,
        }
    }
}

/// The CRC of one piece of a replicated box's slice.
#[derive(Debug, Clone, Copy)]
struct Piece {
    chunk: usize,
    slice: usize,
    crc: u32,
    len: u64,
}

/// What one worker found in its file blocks.
#[derive(Debug, Default)]
pub struct SliceScan {
    /// CRC32 of each block, in order.
    pub crcs: Vec<u32>,
    /// Non-finite elements per chunk index that has any (elements counted by the
    /// worker whose range holds their first byte).
    nonfinite: Vec<(usize, u64)>,
    pieces: Vec<Piece>,
}

/// Scans file blocks `blocks` of `file` (blocks of `block` bytes; the last may be
/// short). `chunks` lie in file order, disjoint.
pub fn scan_blocks(
    file: &[u8],
    blocks: std::ops::Range<usize>,
    block: usize,
    chunks: &[ScanChunk],
) -> SliceScan {
    let mut out = SliceScan {
        crcs: Vec::with_capacity(blocks.len()),
        ..SliceScan::default()
    };
    let start = (blocks.start * block).min(file.len());
    // The first chunk that ends after `start`.
    let mut ci = chunks.partition_point(|c| c.end <= start);
    let mut counts: BTreeMap<usize, u64> = BTreeMap::new();
    for b in blocks {
        let (bs, be) = (
            (b * block).min(file.len()),
            ((b + 1) * block).min(file.len()),
        );
        let mut whole: Option<Hasher> = None;
        let mut pos = bs;
        while pos < be {
            while ci < chunks.len() && chunks[ci].end <= pos {
                ci += 1;
            }
            let mut next = be.min(pos + WINDOW);
            let inside = ci < chunks.len() && chunks[ci].begin <= pos;
            if inside {
                let c = &chunks[ci];
                next = next.min(c.end);
                if c.replicated {
                    let slice = (pos - c.begin) / block;
                    next = next.min(c.begin + (slice + 1) * block);
                }
            } else if ci < chunks.len() {
                next = next.min(chunks[ci].begin);
            }
            let piece = &file[pos..next];
            let mut hasher = Hasher::new();
            hasher.update(piece);
            if inside {
                let c = &chunks[ci];
                if c.replicated {
                    out.pieces.push(Piece {
                        chunk: ci,
                        slice: (pos - c.begin) / block,
                        crc: hasher.clone().finalize(),
                        len: piece.len() as u64,
                    });
                }
                if c.float {
                    // The elements whose first byte lies in [pos, next).
                    let size = c.dtype.size();
                    let first = c.begin + (pos - c.begin).div_ceil(size) * size;
                    let last = c.begin + (next - c.begin).div_ceil(size) * size;
                    if last > first {
                        let found = count_nonfinite(c.dtype, &file[first..last.min(c.end)]);
                        if found > 0 {
                            *counts.entry(ci).or_default() += found;
                        }
                    }
                }
            }
            match whole.as_mut() {
                None => whole = Some(hasher),
                Some(whole) => whole.combine(&hasher),
            }
            pos = next;
        }
        out.crcs
            .push(whole.map_or_else(|| Hasher::new().finalize(), Hasher::finalize));
    }
    out.nonfinite = counts.into_iter().collect();
    out
}

/// What the workers found, put together.
#[derive(Debug, Default)]
pub struct FileScan {
    /// CRC32 of every block of the file.
    pub crcs: Vec<u32>,
    /// Chunks with non-finite elements.
    pub nonfinite: Vec<ChunkNonFinite>,
    /// Slice CRCs of every replicated chunk, by chunk index.
    pub replicas: Vec<(usize, Vec<u32>)>,
}

/// Joins the workers' scans, given in block order.
pub fn join_scans(scans: Vec<SliceScan>, chunks: &[ScanChunk], block: usize) -> FileScan {
    let mut out = FileScan::default();
    let mut counts: BTreeMap<usize, u64> = BTreeMap::new();
    let mut slices: BTreeMap<usize, Vec<Option<Hasher>>> = chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| c.replicated)
        .map(|(i, c)| (i, vec![None; (c.end - c.begin).div_ceil(block)]))
        .collect();
    for scan in scans {
        out.crcs.extend(scan.crcs);
        for (chunk, n) in scan.nonfinite {
            *counts.entry(chunk).or_default() += n;
        }
        for piece in scan.pieces {
            let at = &mut slices.get_mut(&piece.chunk).expect("replicated chunk")[piece.slice];
            let hasher = Hasher::new_with_initial_len(piece.crc, piece.len);
            match at.as_mut() {
                None => *at = Some(hasher),
                Some(whole) => whole.combine(&hasher),
            }
        }
    }
    out.nonfinite = counts
        .into_iter()
        .map(|(chunk, elements)| ChunkNonFinite {
            chunk: chunk as u32,
            elements,
        })
        .collect();
    out.replicas = slices
        .into_iter()
        .map(|(chunk, hashers)| {
            let crcs = hashers
                .into_iter()
                .map(|h| {
                    h.expect("every slice of a replicated box is hashed")
                        .finalize()
                })
                .collect();
            (chunk, crcs)
        })
        .collect();
    out
}

/// The slice CRCs of a box's bytes held alone (a replica staged only to be
/// checksummed).
pub fn slice_crcs(bytes: &[u8], block: usize) -> Vec<u32> {
    bytes.chunks(block).map(crc32fast::hash).collect()
}

/// The committer's verdict on one save attempt.
#[derive(Debug, Default)]
pub struct Verdict {
    /// What the manifest records; `None` when no part recorded health (written by an
    /// older build, or by the offline writer).
    pub health: Option<Health>,
    /// Why the commit must be refused: replicas disagree and a holder's policy is
    /// `fail`.
    pub refuse: Option<String>,
}

/// Judges the health of the checkpoint `parts` (sorted by rank) describe.
/// `global_rank` is the rank carrying the global state, whose metrics the manifest
/// keeps.
pub fn judge(parts: &[&RankPart], global_rank: Option<u32>) -> Verdict {
    if parts.iter().all(|p| p.health.is_none()) {
        return Verdict::default();
    }
    let mut reasons: Vec<String> = Vec::new();

    // Non-finite values, by tensor.
    let mut nonfinite: BTreeMap<&str, (u64, Vec<u32>)> = BTreeMap::new();
    for part in parts {
        let Some(health) = &part.health else { continue };
        for found in &health.nonfinite {
            if let Some(chunk) = part.chunks.get(found.chunk as usize) {
                let entry = nonfinite.entry(chunk.tensor.as_str()).or_default();
                entry.0 += found.elements;
                if entry.1.last() != Some(&part.rank) {
                    entry.1.push(part.rank);
                }
            }
        }
    }
    for (tensor, (elements, ranks)) in &nonfinite {
        reasons.push(format!(
            "tensor {tensor:?} holds {elements} non-finite element{} (written by {})",
            if *elements == 1 { "" } else { "s" },
            ranks_text(ranks)
        ));
    }

    // Replicas: every holder's slice CRCs against the written copy's.
    type Key<'a> = (&'a str, &'a [u64], &'a [u64]);
    /// A holder's copy: its rank, whether it wrote the box, its slice CRCs, its policy.
    type Copy<'a> = (u32, bool, &'a [u32], ReplicaPolicy);
    let mut holders: HashMap<Key<'_>, Vec<Copy<'_>>> = HashMap::new();
    for part in parts {
        let Some(health) = &part.health else { continue };
        for replica in &health.replicas {
            holders
                .entry((&replica.tensor, &replica.offsets, &replica.lengths))
                .or_default()
                .push((
                    part.rank,
                    replica.written,
                    &replica.block_crc32,
                    health.replica_mismatch,
                ));
        }
    }
    let mut compared = 0u64;
    let mut mismatches: Vec<ReplicaMismatch> = Vec::new();
    let mut refused = false;
    for ((tensor, offsets, lengths), copies) in &holders {
        if copies.len() < 2 {
            continue;
        }
        compared += 1;
        // The reference is the written copy; without one (a writer that did not mark
        // its box replicated), the lowest rank's.
        let reference = copies
            .iter()
            .find(|c| c.1)
            .or_else(|| copies.iter().min_by_key(|c| c.0))
            .expect("two copies or more");
        let mut agree = Vec::new();
        let mut disagree = Vec::new();
        let mut blocks: Vec<u64> = Vec::new();
        for copy in copies {
            if copy.0 == reference.0 {
                continue;
            }
            let differing: Vec<u64> = if copy.2.len() == reference.2.len() {
                (0..copy.2.len() as u64)
                    .filter(|&i| copy.2[i as usize] != reference.2[i as usize])
                    .collect()
            } else {
                (0..copy.2.len().max(reference.2.len()) as u64).collect()
            };
            if differing.is_empty() {
                agree.push(copy.0);
            } else {
                disagree.push(copy.0);
                blocks.extend(differing);
            }
        }
        if disagree.is_empty() {
            continue;
        }
        refused |= copies.iter().any(|c| c.3 == ReplicaPolicy::Fail);
        blocks.sort_unstable();
        blocks.dedup();
        blocks.truncate(MAX_BLOCKS_LISTED);
        agree.sort_unstable();
        disagree.sort_unstable();
        mismatches.push(ReplicaMismatch {
            tensor: tensor.to_string(),
            offsets: offsets.to_vec(),
            lengths: lengths.to_vec(),
            blocks,
            written_by: reference.0,
            agree,
            disagree,
        });
    }
    mismatches.sort_by(|a, b| {
        (&a.tensor, &a.offsets, &a.lengths).cmp(&(&b.tensor, &b.offsets, &b.lengths))
    });
    reasons.extend(mismatches.iter().map(ReplicaMismatch::to_string));
    let refuse = (refused && !mismatches.is_empty()).then(|| {
        format!(
            "replica_mismatch is \"fail\" and {}{}",
            mismatches[0],
            match mismatches.len() {
                1 => String::new(),
                n => format!(" (and {} more replicated boxes disagree)", n - 1),
            }
        )
    });

    // The caller's metrics and checks; the same finding on many ranks is one line.
    let mut findings: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for part in parts {
        let Some(health) = &part.health else { continue };
        for (name, metric) in &health.metrics {
            if !metric.0.is_finite() {
                findings
                    .entry(format!("metric {name:?} is {}", metric.0))
                    .or_default()
                    .push(part.rank);
            }
        }
        for reason in &health.unhealthy {
            findings.entry(reason.clone()).or_default().push(part.rank);
        }
    }
    reasons.extend(
        findings
            .iter()
            .map(|(finding, ranks)| format!("{finding} (reported by {})", ranks_text(ranks))),
    );
    if reasons.len() > MAX_REASONS {
        let more = reasons.len() - MAX_REASONS;
        reasons.truncate(MAX_REASONS);
        reasons.push(format!("and {more} more reasons"));
    }

    let metrics_from = parts
        .iter()
        .filter_map(|p| p.health.as_ref().map(|h| (p.rank, h)))
        .filter(|(_, h)| !h.metrics.is_empty())
        .min_by_key(|(rank, _)| (Some(*rank) != global_rank, *rank));
    let metrics: BTreeMap<String, Metric> = metrics_from
        .map(|(_, h)| {
            h.metrics
                .iter()
                .take(MAX_HEALTH_ENTRIES)
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        })
        .unwrap_or_default();
    let mut nonfinite: Vec<NonFinite> = nonfinite
        .into_iter()
        .map(|(tensor, (elements, ranks))| NonFinite {
            tensor: tensor.to_string(),
            elements,
            ranks,
        })
        .collect();
    nonfinite.truncate(MAX_HEALTH_ENTRIES);
    mismatches.truncate(MAX_HEALTH_ENTRIES);
    Verdict {
        health: Some(Health {
            healthy: reasons.is_empty(),
            reasons,
            nonfinite,
            replica_mismatches: mismatches,
            replicas_compared: compared,
            metrics,
        }),
        refuse,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floats(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn one_pass_gives_the_block_crcs_the_box_slices_and_the_non_finite_counts() {
        // A 10-byte header, a replicated f32 box of 40 floats, a plain f32 box of 9
        // with two NaNs; blocks of 48 bytes cut both boxes at odd places.
        let block = 48;
        let mut file = vec![7u8; 10];
        let replicated: Vec<f32> = (0..40).map(|i| i as f32).collect();
        file.extend(floats(&replicated));
        let mut plain = vec![1.5f32; 9];
        plain[3] = f32::NAN;
        plain[8] = f32::NEG_INFINITY;
        file.extend(floats(&plain));
        let chunks = [
            ScanChunk::new(10, 170, DType::F32, true),
            ScanChunk::new(170, 206, DType::F32, false),
        ];
        let blocks = file.len().div_ceil(block);
        for workers in 1..=blocks {
            let per = blocks.div_ceil(workers);
            let scans = (0..workers)
                .map(|w| {
                    scan_blocks(
                        &file,
                        (w * per).min(blocks)..((w + 1) * per).min(blocks),
                        block,
                        &chunks,
                    )
                })
                .collect();
            let found = join_scans(scans, &chunks, block);
            assert_eq!(
                found.crcs,
                crate::codec::block_crcs(&file, block),
                "{workers} workers"
            );
            assert_eq!(
                found.replicas,
                vec![(0, slice_crcs(&file[10..170], block))],
                "{workers} workers"
            );
            assert_eq!(
                found.nonfinite,
                vec![ChunkNonFinite {
                    chunk: 1,
                    elements: 2
                }],
                "{workers} workers"
            );
        }
    }
}
