//! Agreement between the manifest and a rank part. Each parses and validates on its
//! own, but a CRC is not a MAC: a hostile checkpoint can carry a manifest and parts
//! that are each well formed and vouch for each other's bytes while describing
//! different tensors. The loader sizes buffers from the manifest and copies runs
//! described by the parts, so before a part is used everything both describe must
//! be equal: step, rank, world size, data file, block size, codec, sizes, every
//! chunk's dtype and shape, and the exact set of boxes.
//!
//! The set is compared by membership and count: every non-empty chunk must be a box
//! the manifest's layouts give this rank, and there must be as many as they give it.
//! Since version 3 a rank may hold several boxes of one tensor, so the count alone
//! would let a part list one box twice and omit another; the part's own validation
//! refuses a box listed twice, and membership plus equal counts then make the two
//! sets equal.

use super::layout::{Layout, LayoutBox};
use super::manifest::Manifest;
use super::part::{Chunk, RankPart};
use super::{FResult, FormatError};

/// What the manifest's layouts give each rank, indexed once per manifest so each
/// part is checked in time proportional to its own size (a manifest can list 2^20
/// ranks; scanning every layout for every part would be quadratic).
#[derive(Debug, Clone)]
pub struct Assignments {
    /// Non-empty boxes assigned to each rank, over every tensor.
    per_rank: Vec<u64>,
    /// Per layout: for a box layout, its non-empty boxes sorted by (rank, offsets,
    /// lengths); empty for a dim-0 layout.
    sorted: Vec<Vec<u32>>,
}

fn box_key(b: &LayoutBox) -> (u32, &[u64], &[u64]) {
    (b.rank, &b.offsets, &b.lengths)
}

impl Assignments {
    /// Indexes a validated manifest (layout indices and ranks in range).
    pub fn new(manifest: &Manifest) -> Self {
        // Tensors per layout that hold any element: an empty tensor has only empty
        // boxes, which hold no data and need no chunk.
        let mut uses = vec![0u64; manifest.layouts.len()];
        for tensor in &manifest.tensors {
            if !tensor.shape.contains(&0)
                && let Some(count) = uses.get_mut(tensor.layout as usize)
            {
                *count += 1;
            }
        }
        let mut per_rank = vec![0u64; manifest.world_size as usize];
        let mut sorted = vec![Vec::new(); manifest.layouts.len()];
        for (index, layout) in manifest.layouts.iter().enumerate() {
            let uses = uses[index];
            if uses == 0 {
                continue;
            }
            match layout {
                Layout::Dim0(bounds) => {
                    for (rank, rows) in bounds.windows(2).enumerate() {
                        if rows[1] > rows[0]
                            && let Some(count) = per_rank.get_mut(rank)
                        {
                            *count += uses;
                        }
                    }
                }
                Layout::Boxes(boxes) => {
                    let mut live: Vec<u32> = (0..boxes.len() as u32)
                        .filter(|&i| !boxes[i as usize].lengths.contains(&0))
                        .collect();
                    live.sort_unstable_by(|&a, &b| {
                        box_key(&boxes[a as usize]).cmp(&box_key(&boxes[b as usize]))
                    });
                    for &i in &live {
                        if let Some(count) = per_rank.get_mut(boxes[i as usize].rank as usize) {
                            *count += uses;
                        }
                    }
                    sorted[index] = live;
                }
            }
        }
        Self { per_rank, sorted }
    }

    /// Checks that `part`, read from `object` as rank `rank`'s part, describes what
    /// `manifest` (the one these assignments index) says about that rank.
    pub fn check_part(
        &self,
        manifest: &Manifest,
        rank: u32,
        part: &RankPart,
        object: &str,
    ) -> FResult<()> {
        let bad = |message: String| FormatError::new(object, None, message);
        let entry = manifest
            .ranks
            .get(rank as usize)
            .ok_or_else(|| bad(format!("rank {rank} is not in the manifest")))?;
        let differ = |what: &str, part: &dyn std::fmt::Debug, manifest: &dyn std::fmt::Debug| {
            bad(format!("{what} {part:?}, the manifest says {manifest:?}"))
        };
        if part.step != manifest.step {
            return Err(differ("step", &part.step, &manifest.step));
        }
        if part.attempt != manifest.attempt || part.generation != manifest.generation {
            return Err(differ(
                "attempt/generation",
                &(&part.attempt, part.generation),
                &(&manifest.attempt, manifest.generation),
            ));
        }
        if part.rank != rank {
            return Err(differ("rank", &part.rank, &rank));
        }
        if part.world_size != manifest.world_size {
            return Err(differ("world_size", &part.world_size, &manifest.world_size));
        }
        if part.file.name != entry.file {
            return Err(differ("data file", &part.file.name, &entry.file));
        }
        if part.block_size != manifest.block_size {
            return Err(differ("block_size", &part.block_size, &manifest.block_size));
        }
        if part.codec != manifest.codec {
            return Err(differ("codec", &part.codec, &manifest.codec));
        }
        if part.file.raw_bytes != entry.raw_bytes {
            return Err(differ("raw_bytes", &part.file.raw_bytes, &entry.raw_bytes));
        }
        if part.file.stored_bytes != entry.stored_bytes {
            return Err(differ(
                "stored_bytes",
                &part.file.stored_bytes,
                &entry.stored_bytes,
            ));
        }
        let mut matched = 0u64;
        for chunk in &part.chunks {
            let tensor = manifest.tensor(&chunk.tensor).ok_or_else(|| {
                bad(format!(
                    "holds a chunk of {:?}, a tensor the manifest does not list",
                    chunk.tensor
                ))
            })?;
            if chunk.dtype != tensor.dtype {
                return Err(bad(format!(
                    "chunk of {:?} is {}, the manifest says {}",
                    chunk.tensor, chunk.dtype, tensor.dtype
                )));
            }
            if chunk.shape != tensor.shape {
                return Err(bad(format!(
                    "chunk of {:?} has global shape {:?}, the manifest says {:?}",
                    chunk.tensor, chunk.shape, tensor.shape
                )));
            }
            if chunk.lengths.contains(&0) {
                // An empty box holds no data; nothing is loaded from it.
                continue;
            }
            if !self.assigns(manifest, tensor.layout, rank, chunk) {
                return Err(bad(format!(
                    "holds box {} of {:?}, which the manifest's layout does not give rank {rank}",
                    chunk.region(),
                    chunk.tensor
                )));
            }
            matched += 1;
        }
        let expected = self.per_rank.get(rank as usize).copied().unwrap_or(0);
        if matched != expected {
            return Err(bad(format!(
                "holds {matched} of the {expected} boxes the manifest's layouts give rank {rank}"
            )));
        }
        Ok(())
    }

    /// True when layout `layout` gives `rank` exactly the box of `chunk`.
    fn assigns(&self, manifest: &Manifest, layout: u32, rank: u32, chunk: &Chunk) -> bool {
        match manifest.layouts.get(layout as usize) {
            Some(Layout::Dim0(bounds)) => {
                let (Some(&start), Some(&end)) =
                    (bounds.get(rank as usize), bounds.get(rank as usize + 1))
                else {
                    return false;
                };
                let dims = chunk.shape.len();
                end > start
                    && dims > 0
                    && chunk.offsets.len() == dims
                    && chunk.lengths.len() == dims
                    && chunk.offsets[0] == start
                    && chunk.lengths[0] == end - start
                    && chunk.offsets[1..].iter().all(|&o| o == 0)
                    && chunk.lengths[1..] == chunk.shape[1..]
            }
            Some(Layout::Boxes(boxes)) => {
                let Some(sorted) = self.sorted.get(layout as usize) else {
                    return false;
                };
                let wanted = (rank, chunk.offsets.as_slice(), chunk.lengths.as_slice());
                sorted
                    .binary_search_by(|&i| box_key(&boxes[i as usize]).cmp(&wanted))
                    .is_ok()
            }
            None => false,
        }
    }
}
