//! Boxes of a global tensor: the unit of sharding and of resharding.
//!
//! Every layout in use (FSDP/ZeRO dim-0 shards, tensor-parallel column or row splits,
//! uneven splits, replicated tensors) says the same thing: this rank holds an
//! N-dimensional box of the global tensor. Saving records each rank's box; loading
//! names the box wanted; resharding is the intersection of the two. Data of a box is
//! stored row-major over the box's own lengths.

use serde::{Deserialize, Serialize};

/// An N-dimensional box: for each dimension an offset into the global tensor and a
/// length. A zero-dimensional box (a scalar) has one element.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Region {
    /// Start of the box in each dimension of the global tensor.
    pub offsets: Vec<u64>,
    /// Extent of the box in each dimension.
    pub lengths: Vec<u64>,
}

impl Region {
    /// A box from its offsets and lengths (same number of dimensions).
    pub fn new(offsets: Vec<u64>, lengths: Vec<u64>) -> Self {
        assert_eq!(
            offsets.len(),
            lengths.len(),
            "offsets and lengths must have the same number of dimensions"
        );
        Self { offsets, lengths }
    }

    /// The whole tensor of `shape`.
    pub fn full(shape: &[u64]) -> Self {
        Self {
            offsets: vec![0; shape.len()],
            lengths: shape.to_vec(),
        }
    }

    /// Rows `start..start + rows` of dimension 0, every other dimension whole.
    pub fn rows(shape: &[u64], start: u64, rows: u64) -> Self {
        let mut region = Self::full(shape);
        if let (Some(offset), Some(length)) =
            (region.offsets.first_mut(), region.lengths.first_mut())
        {
            *offset = start;
            *length = rows;
        }
        region
    }

    /// Rank `rank`'s share of an even dim-0 split of `shape` over `world` ranks:
    /// rows `rank·n/world .. (rank+1)·n/world` (so shares differ by at most one row;
    /// a rank may get none when there are fewer rows than ranks). Scalars are held
    /// whole by every rank.
    pub fn dim0_shard(shape: &[u64], rank: usize, world: usize) -> Self {
        assert!(
            world > 0 && rank < world,
            "rank {rank} out of world size {world}"
        );
        let Some(&n) = shape.first() else {
            return Self::full(shape);
        };
        let (r, w) = (rank as u128, world as u128);
        let start = (r * n as u128 / w) as u64;
        let end = ((r + 1) * n as u128 / w) as u64;
        Self::rows(shape, start, end - start)
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.lengths.len()
    }

    /// Number of elements, or `None` on overflow.
    pub fn volume(&self) -> Option<u64> {
        self.lengths
            .iter()
            .try_fold(1u64, |acc, &l| acc.checked_mul(l))
    }

    /// True when the box holds no element.
    pub fn is_empty(&self) -> bool {
        self.lengths.contains(&0)
    }

    /// True when the box lies inside a tensor of `shape`.
    pub fn within(&self, shape: &[u64]) -> bool {
        self.ndim() == shape.len()
            && self.offsets.len() == self.lengths.len()
            && self
                .offsets
                .iter()
                .zip(&self.lengths)
                .zip(shape)
                .all(|((&o, &l), &s)| o.checked_add(l).is_some_and(|end| end <= s))
    }

    /// The common part of two boxes of one tensor, or `None` when they do not meet
    /// (or when either is empty).
    pub fn intersect(&self, other: &Region) -> Option<Region> {
        if self.ndim() != other.ndim() {
            return None;
        }
        let mut offsets = Vec::with_capacity(self.ndim());
        let mut lengths = Vec::with_capacity(self.ndim());
        for d in 0..self.ndim() {
            let start = self.offsets[d].max(other.offsets[d]);
            let end = (self.offsets[d] + self.lengths[d]).min(other.offsets[d] + other.lengths[d]);
            if end <= start {
                return None;
            }
            offsets.push(start);
            lengths.push(end - start);
        }
        Some(Region { offsets, lengths })
    }

    /// True when `other` lies inside this box.
    pub fn contains(&self, other: &Region) -> bool {
        self.ndim() == other.ndim()
            && (0..self.ndim()).all(|d| {
                other.offsets[d] >= self.offsets[d]
                    && other.offsets[d] + other.lengths[d] <= self.offsets[d] + self.lengths[d]
            })
    }
}

impl std::fmt::Display for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[")?;
        for d in 0..self.ndim() {
            if d > 0 {
                f.write_str(", ")?;
            }
            write!(
                f,
                "{}..{}",
                self.offsets[d],
                self.offsets[d] + self.lengths[d]
            )?;
        }
        f.write_str("]")
    }
}

/// Calls `copy(src_byte, dst_byte, len_bytes)` for every contiguous run of `part`,
/// where the source holds box `src` row-major and the destination box `dst`
/// row-major. `part` must lie inside both. Runs come in increasing source order, and
/// dimensions that `part` spans whole in both boxes are merged into one run, so a
/// dim-0 shard is a single copy.
pub fn for_each_run(
    part: &Region,
    src: &Region,
    dst: &Region,
    elem: usize,
    mut copy: impl FnMut(u64, u64, u64),
) {
    let ndim = part.ndim();
    debug_assert!(src.contains(part) && dst.contains(part));
    if part.is_empty() {
        return;
    }
    if ndim == 0 {
        copy(0, 0, elem as u64);
        return;
    }
    let strides = |lengths: &[u64]| {
        let mut strides = vec![1u64; ndim];
        for d in (0..ndim - 1).rev() {
            strides[d] = strides[d + 1] * lengths[d + 1];
        }
        strides
    };
    let src_strides = strides(&src.lengths);
    let dst_strides = strides(&dst.lengths);

    // Innermost dimensions the part covers whole in both boxes form one run, and the
    // first dimension outside them contributes its partial length.
    let mut split = ndim - 1;
    while split > 0
        && part.lengths[split] == src.lengths[split]
        && part.lengths[split] == dst.lengths[split]
    {
        split -= 1;
    }
    let run_elems: u64 = part.lengths[split..].iter().product();
    let run_bytes = run_elems * elem as u64;

    let mut index = vec![0u64; split];
    loop {
        let mut src_elem = 0u64;
        let mut dst_elem = 0u64;
        for d in 0..ndim {
            let i = if d < split { index[d] } else { 0 };
            src_elem += (part.offsets[d] - src.offsets[d] + i) * src_strides[d];
            dst_elem += (part.offsets[d] - dst.offsets[d] + i) * dst_strides[d];
        }
        copy(src_elem * elem as u64, dst_elem * elem as u64, run_bytes);

        // Odometer over the outer dimensions.
        let mut d = split;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < part.lengths[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dim0_shards_tile_the_rows() {
        let shape = [10u64, 3];
        let shards: Vec<_> = (0..4).map(|r| Region::dim0_shard(&shape, r, 4)).collect();
        assert_eq!(shards.iter().map(|s| s.lengths[0]).sum::<u64>(), 10);
        for pair in shards.windows(2) {
            assert_eq!(pair[0].offsets[0] + pair[0].lengths[0], pair[1].offsets[0]);
        }
        assert!(shards.iter().all(|s| s.lengths[1] == 3));
        // Fewer rows than ranks: some ranks hold nothing.
        let tiny: Vec<_> = (0..4).map(|r| Region::dim0_shard(&[2], r, 4)).collect();
        assert_eq!(tiny.iter().filter(|s| s.is_empty()).count(), 2);
    }

    #[test]
    fn intersection_and_containment() {
        let a = Region::new(vec![0, 0], vec![4, 4]);
        let b = Region::new(vec![2, 3], vec![4, 4]);
        let i = a.intersect(&b).unwrap();
        assert_eq!(i, Region::new(vec![2, 3], vec![2, 1]));
        assert!(a.contains(&i) && b.contains(&i));
        assert!(a.intersect(&Region::new(vec![4, 0], vec![1, 1])).is_none());
        assert!(Region::new(vec![1], vec![2]).within(&[3]));
        assert!(!Region::new(vec![2], vec![2]).within(&[3]));
        assert!(!Region::new(vec![u64::MAX], vec![2]).within(&[3]));
    }

    /// Reference: copy element by element through global coordinates.
    fn naive(part: &Region, src: &Region, dst: &Region, src_data: &[u32], dst_data: &mut [u32]) {
        let n = part.volume().unwrap();
        for flat in 0..n {
            let mut rem = flat;
            let mut coord = vec![0u64; part.ndim()];
            for d in (0..part.ndim()).rev() {
                coord[d] = part.offsets[d] + rem % part.lengths[d];
                rem /= part.lengths[d];
            }
            let index = |r: &Region| {
                (0..r.ndim()).fold(0u64, |acc, d| acc * r.lengths[d] + coord[d] - r.offsets[d])
            };
            dst_data[index(dst) as usize] = src_data[index(src) as usize];
        }
    }

    #[test]
    fn runs_match_elementwise_copy() {
        let src = Region::new(vec![0, 2, 1], vec![4, 5, 6]);
        let dst = Region::new(vec![1, 0, 0], vec![3, 7, 7]);
        let part = src.intersect(&dst).unwrap();
        let src_data: Vec<u32> = (0..src.volume().unwrap() as u32).collect();
        let mut expected = vec![0u32; dst.volume().unwrap() as usize];
        naive(&part, &src, &dst, &src_data, &mut expected);

        let mut got = vec![0u32; expected.len()];
        let mut runs = 0;
        for_each_run(&part, &src, &dst, 4, |s, d, len| {
            runs += 1;
            let (s, d, len) = (s as usize / 4, d as usize / 4, len as usize / 4);
            got[d..d + len].copy_from_slice(&src_data[s..s + len]);
        });
        assert_eq!(got, expected);
        assert_eq!(runs, 3 * 5, "one run per (dim0, dim1) index");
    }

    #[test]
    fn dim0_parts_are_one_run() {
        let shape = [8u64, 4, 2];
        let src = Region::dim0_shard(&shape, 1, 2);
        let dst = Region::dim0_shard(&shape, 1, 3); // rows 2..5
        let part = src.intersect(&dst).unwrap(); // row 4
        let mut runs = Vec::new();
        for_each_run(&part, &src, &dst, 2, |s, d, l| runs.push((s, d, l)));
        let row_bytes = 4 * 2 * 2;
        assert_eq!(runs, vec![(0, 2 * row_bytes, row_bytes)]);
    }

    #[test]
    fn scalars_copy_one_element() {
        let scalar = Region::full(&[]);
        let mut runs = Vec::new();
        for_each_run(&scalar, &scalar, &scalar, 8, |s, d, l| runs.push((s, d, l)));
        assert_eq!(runs, vec![(0, 0, 8)]);
    }
}
