//! The operations behind the `ckpt` command line, as library functions.
//!
//! Each works on any store URL and keeps memory bounded by a budget, whatever the
//! checkpoint's size: data is read and written in slabs, never whole tensors.

pub mod convert;
pub mod diff;
pub mod export;
pub mod gc;
pub mod import;
pub mod inspect;
pub mod reshard;
pub mod verify;

use std::collections::BTreeSet;

use ckpt_storage::Store;
use futures::{StreamExt, TryStreamExt};

use crate::error::Result;
use crate::format::TensorEntry;
use crate::load::CheckpointReader;
use crate::region::Region;

/// Checks the safetensors header of every data file that holds a chunk of `tensors`
/// (see [`verify::check_data_header`]), before a tool reads their data to write
/// something out. `store` is the store `reader` reads.
pub(crate) async fn check_data_headers<'a>(
    store: &Store,
    reader: &CheckpointReader,
    tensors: impl IntoIterator<Item = &'a TensorEntry>,
) -> Result<()> {
    let manifest = reader.manifest();
    let ranks: BTreeSet<u32> = tensors
        .into_iter()
        .flat_map(|t| manifest.layouts[t.layout as usize].boxes(&t.shape))
        .map(|(rank, _)| rank)
        .collect();
    futures::stream::iter(ranks)
        .map(|rank| async move {
            let part = reader.part(rank).await?;
            let object = format!("{}/{}", reader.manifest().dir(), part.file.name);
            verify::check_data_header(store, &object, &part).await
        })
        .buffer_unordered(HEADER_CHECKS_AT_ONCE)
        .try_collect()
        .await
}

/// Data file headers [`check_data_headers`] reads at once.
const HEADER_CHECKS_AT_ONCE: usize = 8;

/// Matches `name` against a shell-style glob (`*` any run, `?` one character).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    // Iterative matcher with backtracking to the last star.
    let (mut pi, mut ni) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// The boxes of an even dim-0 split of a tensor of `shape` over `world` ranks, with
/// their ranks; ranks without rows get none. A scalar, and a tensor with no element
/// (a dimension of 0), is one box held by rank 0: every tensor must have a chunk
/// somewhere, since a commit learns the checkpoint's tensors from the chunks.
pub(crate) fn dim0_boxes(shape: &[u64], world: u32) -> Vec<(u32, Region)> {
    let whole = Region::full(shape);
    if shape.is_empty() || whole.is_empty() {
        return vec![(0, whole)];
    }
    (0..world)
        .map(|rank| {
            let region = Region::dim0_shard(shape, rank as usize, world as usize);
            (rank, region)
        })
        .filter(|(_, region)| !region.is_empty())
        .collect()
}

/// Rows of a box read per slab so that one slab stays within `budget` bytes (at
/// least one row).
pub(crate) fn slab_rows(region: &Region, elem: usize, budget: u64) -> u64 {
    let row_bytes: u64 = region.lengths.iter().skip(1).product::<u64>() * elem as u64;
    (budget / row_bytes.max(1)).max(1)
}

/// Splits a box into consecutive dim-0 slabs of at most `rows` rows; a scalar or an
/// empty box is one slab.
pub(crate) fn slabs(region: &crate::Region, rows: u64) -> Vec<crate::Region> {
    if region.ndim() == 0 || region.lengths[0] == 0 {
        return vec![region.clone()];
    }
    let mut out = Vec::new();
    let mut start = 0;
    while start < region.lengths[0] {
        let take = rows.min(region.lengths[0] - start);
        let mut slab = region.clone();
        slab.offsets[0] += start;
        slab.lengths[0] = take;
        out.push(slab);
        start += take;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("*", "anything"));
        assert!(glob_match("layer.*.weight", "layer.3.weight"));
        assert!(!glob_match("layer.*.weight", "layer.3.bias"));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("a?c", "ac"));
        assert!(glob_match("*bias", "x.bias"));
        assert!(glob_match("", ""));
        assert!(!glob_match("", "x"));
    }

    #[test]
    fn slabs_cover_the_box_in_order() {
        let region = crate::Region::new(vec![3, 0], vec![10, 4]);
        let rows = slab_rows(&region, 4, 3 * 16);
        assert_eq!(rows, 3);
        let parts = slabs(&region, rows);
        assert_eq!(parts.len(), 4);
        assert_eq!(parts[0].offsets, vec![3, 0]);
        assert_eq!(parts[3].lengths, vec![1, 4]);
        assert_eq!(slabs(&crate::Region::full(&[]), 5).len(), 1);
    }
}
