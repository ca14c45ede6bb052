//! Layouts: which rank holds which box of a tensor, and the check that a layout's
//! boxes tile the tensor exactly once (the corner sum that proves it for any
//! number of boxes lives in the private `tiling` module).

use serde::{Deserialize, Serialize};

use super::manifest::TensorEntry;
use super::tiling::{TilingFault, check_tiling};
use super::{FResult, FormatError};
use crate::region::Region;

/// Which rank holds which box of a tensor. Layouts are shared by tensors with the
/// same chunking, which keeps the manifest small at thousands of ranks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Dim-0 split: rank `r` holds rows `dim0[r]..dim0[r+1]` and every other
    /// dimension whole. `world_size + 1` non-decreasing boundaries from 0 to the
    /// number of rows.
    Dim0(Vec<u64>),
    /// Any boxes, each held by one rank (a rank may hold several since version 3).
    Boxes(Vec<LayoutBox>),
}

/// One box of a [`Layout::Boxes`] layout. Since format version 3 a rank may hold
/// several boxes of one tensor; the boxes of a layout are disjoint whatever ranks
/// hold them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayoutBox {
    /// Rank whose file holds the box.
    pub rank: u32,
    /// Start of the box per dimension.
    pub offsets: Vec<u64>,
    /// Extent of the box per dimension.
    pub lengths: Vec<u64>,
}

impl Layout {
    /// The (rank, box) pairs of a tensor of `shape` under this layout, empty boxes
    /// left out.
    pub fn boxes(&self, shape: &[u64]) -> Vec<(u32, Region)> {
        match self {
            Layout::Dim0(bounds) => bounds
                .windows(2)
                .enumerate()
                .filter(|(_, w)| w[1] > w[0])
                .map(|(rank, w)| (rank as u32, Region::rows(shape, w[0], w[1] - w[0])))
                .collect(),
            Layout::Boxes(boxes) => boxes
                .iter()
                .map(|b| (b.rank, Region::new(b.offsets.clone(), b.lengths.clone())))
                .filter(|(_, r)| !r.is_empty())
                .collect(),
        }
    }

    /// The (rank, box) pairs that meet `want`, with the common part.
    pub fn overlapping(&self, shape: &[u64], want: &Region) -> Vec<(u32, Region, Region)> {
        match self {
            Layout::Dim0(bounds) if !shape.is_empty() => {
                let lo = want.offsets[0];
                let hi = lo + want.lengths[0];
                // First rank whose rows end after `lo`.
                let first = bounds.partition_point(|&b| b <= lo).saturating_sub(1);
                let mut out = Vec::new();
                for rank in first..bounds.len().saturating_sub(1) {
                    if bounds[rank] >= hi {
                        break;
                    }
                    if bounds[rank + 1] <= bounds[rank] {
                        continue;
                    }
                    let chunk = Region::rows(shape, bounds[rank], bounds[rank + 1] - bounds[rank]);
                    if let Some(part) = chunk.intersect(want) {
                        out.push((rank as u32, chunk, part));
                    }
                }
                out
            }
            _ => self
                .boxes(shape)
                .into_iter()
                .filter_map(|(rank, chunk)| chunk.intersect(want).map(|part| (rank, chunk, part)))
                .collect(),
        }
    }
}

/// Refuses a box layout that lists a rank more than once, which documents of a
/// version before [`SEVERAL_BOXES_VERSION`](super::SEVERAL_BOXES_VERSION) cannot
/// mean (their parts hold one chunk per tensor). `O(n log n)` in the boxes.
pub(crate) fn check_one_box_per_rank(
    layout: &Layout,
    tensor: &TensorEntry,
    version: u32,
    object: &str,
) -> FResult<()> {
    let Layout::Boxes(boxes) = layout else {
        return Ok(());
    };
    let mut ranks: Vec<u32> = boxes.iter().map(|b| b.rank).collect();
    ranks.sort_unstable();
    match ranks.windows(2).find(|w| w[0] == w[1]) {
        None => Ok(()),
        Some(w) => Err(FormatError::new(
            object,
            None,
            format!(
                "tensor {:?}: format_version {version} gives rank {} two boxes of one tensor (version {} allows it)",
                tensor.name,
                w[0],
                super::SEVERAL_BOXES_VERSION
            ),
        )),
    }
}

pub(crate) fn check_layout(
    layout: &Layout,
    tensor: &TensorEntry,
    world: u32,
    object: &str,
) -> FResult<()> {
    let err = |message: String| {
        FormatError::new(object, None, format!("tensor {:?}: {message}", tensor.name))
    };
    let volume: u64 = tensor.shape.iter().product();
    match layout {
        Layout::Dim0(bounds) => {
            if tensor.shape.is_empty() {
                return Err(err("a scalar cannot have a dim-0 layout".into()));
            }
            if bounds.len() != world as usize + 1 {
                return Err(err(format!(
                    "dim-0 layout has {} boundaries for world_size {world}",
                    bounds.len()
                )));
            }
            if bounds.first() != Some(&0) || bounds.last() != Some(&tensor.shape[0]) {
                return Err(err(format!(
                    "dim-0 layout must run from 0 to {} rows",
                    tensor.shape[0]
                )));
            }
            if bounds.windows(2).any(|w| w[1] < w[0]) {
                return Err(err("dim-0 boundaries decrease".into()));
            }
        }
        Layout::Boxes(boxes) => {
            let mut covered: u64 = 0;
            for b in boxes {
                if b.offsets.len() != b.lengths.len() {
                    return Err(err(format!(
                        "box has {} offsets and {} lengths",
                        b.offsets.len(),
                        b.lengths.len()
                    )));
                }
                if b.rank >= world {
                    return Err(err(format!("box held by rank {} of {world}", b.rank)));
                }
                let region = Region {
                    offsets: b.offsets.clone(),
                    lengths: b.lengths.clone(),
                };
                if !region.within(&tensor.shape) {
                    return Err(err(format!(
                        "box {region} lies outside shape {:?}",
                        tensor.shape
                    )));
                }
                covered = region
                    .volume()
                    .and_then(|v| covered.checked_add(v))
                    .ok_or_else(|| err("box volumes overflow".into()))?;
            }
            // Equal volumes and no overlap mean an exact tiling; the corner sum
            // proves it for any number of boxes, and names an overlap first.
            match (check_tiling(boxes, &tensor.shape), covered == volume) {
                (Ok(()), true) => {}
                (Err(fault @ (TilingFault::Overlap(_) | TilingFault::TooComplex { .. })), _) => {
                    return Err(err(fault.to_string()));
                }
                (_, false) => {
                    return Err(err(format!(
                        "boxes cover {covered} elements of {volume}: chunks must tile the tensor exactly once"
                    )));
                }
                (Err(fault), true) => {
                    return Err(err(format!(
                        "{fault}, although the boxes' volumes add up to the tensor's: boxes overlap"
                    )));
                }
            }
        }
    }
    Ok(())
}
