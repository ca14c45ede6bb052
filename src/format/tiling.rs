//! The exact check that a layout's boxes tile a tensor exactly once, for layouts of
//! any number of boxes.
//!
//! A hostile manifest can balance an overlap with a hole of equal volume: the sum
//! of the boxes' volumes still equals the tensor's, and the hole would load as
//! zeros. Comparing every pair of boxes is quadratic, which a manifest with 2^20
//! ranks turns into a denial of service, so the check works on corners instead.
//!
//! # Why corners suffice
//!
//! Let `g` be the number of boxes covering each element minus one inside the
//! tensor (zero outside): the boxes tile the tensor exactly when `g` is zero
//! everywhere. Take the mixed difference `Δg(c) = Σ (-1)^|e| g(c - e)` over the
//! `2^d` offsets `e` in `{0,1}^d`. `Δ` loses nothing on functions of finite
//! support (`g` is recovered from `Δg` by prefix sums), so `g ≡ 0` exactly when
//! `Δg ≡ 0`. For one box, `Δ` of its indicator is `+1` or `-1` at each of its
//! `2^d` corners (the sign is `-1` to the power of the number of upper bounds in
//! the corner) and zero elsewhere; `Δ` is linear, so `Δg` is the signed count of
//! corners at each point: the boxes' corners with their signs, and the tensor's
//! with the opposite signs. The check adds up the signs at every point and
//! requires them all to be zero. Nothing is approximate and nothing is sampled.
//!
//! # Cost
//!
//! Dimensions that every box spans whole cannot hold a fault and are dropped. The
//! signed corners are summed one dimension at a time: sort the boxes' bounds in
//! the first dimension, add up the signs of boxes whose bound and whose extent in
//! every later dimension are equal (they contribute identical corners below), and
//! recurse on each bound with what is left. On the grids that sharding produces,
//! a box ending at a bound is cancelled by the box starting there, so the work is
//! one sort: `O(n log n)`. In the worst case a box reaches `2^d` corners for `d`
//! split dimensions, `O(2^d n log n)`; `d <= 4` always fits the work budget, and a
//! layout that does not fit is refused as too complex to verify rather than
//! checked slowly.
//!
//! When the corners do not cancel, the elements next to the first few unbalanced
//! corners are counted box by box to name two overlapping boxes (or an element no
//! box holds).

use super::layout::LayoutBox;
use crate::region::Region;

/// Corner events the sum may visit per box, beyond a fixed allowance: room for
/// four split dimensions with no cancellation at all (`2 + 4 + 8 + 16`).
const WORK_PER_BOX: u64 = 32;
/// Corner events any layout may visit.
const WORK_ALLOWANCE: u64 = 1 << 20;
/// Unbalanced corners collected before looking for the fault.
const MAX_UNBALANCED: usize = 16;
/// Elements counted box by box while looking for the fault.
const MAX_PROBES: usize = 256;

/// Why boxes do not tile a tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TilingFault {
    /// Two boxes share elements: says which, with their ranks and the common box.
    Overlap(String),
    /// An element no box holds (its coordinates).
    Gap(Vec<u64>),
    /// Unbalanced corners were found but the elements probed next to them were
    /// each held once (only possible when the probe limit cut the search short).
    Elsewhere(Vec<u64>),
    /// The corner sum would exceed its work budget.
    TooComplex {
        /// Non-empty boxes.
        boxes: usize,
        /// Dimensions split by some box.
        split: usize,
    },
}

impl std::fmt::Display for TilingFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TilingFault::Overlap(what) => f.write_str(what),
            TilingFault::Gap(element) => write!(f, "element {element:?} is in no box"),
            TilingFault::Elsewhere(corner) => write!(
                f,
                "boxes do not cover the tensor exactly once near the corner {corner:?} of its split dimensions"
            ),
            TilingFault::TooComplex { boxes, split } => write!(
                f,
                "{boxes} boxes split the tensor in {split} dimensions, too many to verify the tiling"
            ),
        }
    }
}

/// Checks that the boxes cover every element of `shape` exactly once. The boxes
/// must lie inside `shape` (the caller checks that first). The error says what is
/// wrong: two overlapping boxes with their ranks, preferably, or an element no box
/// holds.
pub(crate) fn check_tiling(boxes: &[LayoutBox], shape: &[u64]) -> Result<(), TilingFault> {
    let budget = WORK_ALLOWANCE.saturating_add(WORK_PER_BOX.saturating_mul(boxes.len() as u64 + 1));
    check_tiling_within(boxes, shape, budget)
}

/// [`check_tiling`] visiting at most `budget` corner events.
fn check_tiling_within(boxes: &[LayoutBox], shape: &[u64], budget: u64) -> Result<(), TilingFault> {
    if shape.contains(&0) {
        // An empty tensor: every box inside it is empty too.
        return Ok(());
    }
    let live: Vec<&LayoutBox> = boxes.iter().filter(|b| !b.lengths.contains(&0)).collect();
    let split: Vec<usize> = (0..shape.len())
        .filter(|&k| {
            live.iter()
                .any(|b| b.offsets[k] != 0 || b.lengths[k] != shape[k])
        })
        .collect();
    let mut corners = Corners::new(&live, shape, &split, budget);
    let mut entries: Vec<(i64, u32)> = (0..live.len() as u32).map(|b| (1, b)).collect();
    entries.push((-1, live.len() as u32));
    let mut point = Vec::with_capacity(split.len());
    if corners.sum(0, entries, &mut point).is_err() {
        return Err(TilingFault::TooComplex {
            boxes: live.len(),
            split: split.len(),
        });
    }
    if corners.unbalanced.is_empty() {
        return Ok(());
    }
    Err(corners.describe_fault(&live, shape, &split))
}

/// The work budget ran out.
struct TooComplex;

/// The signed corners of the boxes (and, with the opposite sign, of the tensor),
/// restricted to the split dimensions.
struct Corners {
    /// Split dimensions kept.
    dims: usize,
    /// Per box, then the tensor last: `[lo0, hi0, lo1, hi1, ...]` over the split
    /// dimensions.
    bounds: Vec<u64>,
    work: u64,
    budget: u64,
    /// Points (split dimensions) whose signed corner count is not zero.
    unbalanced: Vec<Vec<u64>>,
}

impl Corners {
    fn new(live: &[&LayoutBox], shape: &[u64], split: &[usize], budget: u64) -> Self {
        let dims = split.len();
        let mut bounds = Vec::with_capacity((live.len() + 1) * 2 * dims);
        for b in live {
            for &k in split {
                bounds.push(b.offsets[k]);
                bounds.push(b.offsets[k] + b.lengths[k]);
            }
        }
        for &k in split {
            bounds.push(0);
            bounds.push(shape[k]);
        }
        Self {
            dims,
            bounds,
            work: 0,
            budget,
            unbalanced: Vec::new(),
        }
    }

    /// Box `b`'s bounds in split dimensions `from..`.
    fn rest(&self, b: u32, from: usize) -> &[u64] {
        let start = b as usize * 2 * self.dims;
        &self.bounds[start + 2 * from..start + 2 * self.dims]
    }

    /// Adds up the signed corners of `entries` (sign, box), which share the
    /// coordinates `point` in the split dimensions before `level`.
    fn sum(
        &mut self,
        level: usize,
        entries: Vec<(i64, u32)>,
        point: &mut Vec<u64>,
    ) -> Result<(), TooComplex> {
        if self.unbalanced.len() >= MAX_UNBALANCED {
            return Ok(());
        }
        if level == self.dims {
            if entries.iter().map(|&(sign, _)| sign).sum::<i64>() != 0 {
                self.unbalanced.push(point.clone());
            }
            return Ok(());
        }
        self.work = self.work.saturating_add(2 * entries.len() as u64);
        if self.work > self.budget {
            return Err(TooComplex);
        }
        let mut events: Vec<(u64, i64, u32)> = Vec::with_capacity(2 * entries.len());
        for (sign, b) in entries {
            let bound = self.rest(b, level);
            events.push((bound[0], sign, b));
            events.push((bound[1], -sign, b));
        }
        events.sort_unstable_by(|x, y| {
            x.0.cmp(&y.0)
                .then_with(|| self.rest(x.2, level + 1).cmp(self.rest(y.2, level + 1)))
        });
        let mut i = 0;
        while i < events.len() {
            let coordinate = events[i].0;
            let mut group = Vec::new();
            while i < events.len() && events[i].0 == coordinate {
                // Boxes with the same extent in every later dimension have the same
                // corners below this bound: their signs add up here.
                let (_, _, first) = events[i];
                let mut sign = 0;
                while i < events.len()
                    && events[i].0 == coordinate
                    && self.rest(events[i].2, level + 1) == self.rest(first, level + 1)
                {
                    sign += events[i].1;
                    i += 1;
                }
                if sign != 0 {
                    group.push((sign, first));
                }
            }
            if !group.is_empty() {
                point.push(coordinate);
                let result = self.sum(level + 1, group, point);
                point.pop();
                result?;
            }
        }
        Ok(())
    }

    /// Names the fault near the unbalanced corners: a nonzero `Δg(c)` means `g` is
    /// not zero at one of the `2^d` elements `c - e`, so counting the boxes over
    /// those elements finds an element held twice or by no box.
    fn describe_fault(&self, live: &[&LayoutBox], shape: &[u64], split: &[usize]) -> TilingFault {
        let mut probes = 0;
        let mut hole = None;
        for corner in &self.unbalanced {
            // The elements next to a corner inside the tensor: a coordinate at 0
            // has only the element after it, one at the end only the one before.
            let free: Vec<usize> = (0..self.dims)
                .filter(|&j| corner[j] > 0 && corner[j] < shape[split[j]])
                .collect();
            for near in 0u64..1 << free.len().min(16) {
                if probes == MAX_PROBES {
                    break;
                }
                probes += 1;
                let mut element = vec![0u64; shape.len()];
                for (j, &k) in split.iter().enumerate() {
                    element[k] = if corner[j] == shape[k] {
                        corner[j] - 1
                    } else {
                        corner[j]
                    };
                }
                for (bit, &j) in free.iter().enumerate() {
                    element[split[j]] -= (near >> bit) & 1;
                }
                let mut holders = live.iter().filter(|b| {
                    (0..shape.len())
                        .all(|k| (b.offsets[k]..b.offsets[k] + b.lengths[k]).contains(&element[k]))
                });
                match (holders.next(), holders.next()) {
                    (Some(a), Some(b)) => {
                        let (ra, rb) = (region(a), region(b));
                        let common = ra
                            .intersect(&rb)
                            .map_or_else(|| "?".to_string(), |r| r.to_string());
                        return TilingFault::Overlap(format!(
                            "boxes {ra} (rank {}) and {rb} (rank {}) overlap in {common}",
                            a.rank, b.rank
                        ));
                    }
                    (None, _) => {
                        hole.get_or_insert(element);
                    }
                    _ => {}
                }
            }
        }
        match hole {
            Some(element) => TilingFault::Gap(element),
            None => TilingFault::Elsewhere(self.unbalanced[0].clone()),
        }
    }
}

fn region(b: &LayoutBox) -> Region {
    Region {
        offsets: b.offsets.clone(),
        lengths: b.lengths.clone(),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn boxed(rank: u32, offsets: &[u64], lengths: &[u64]) -> LayoutBox {
        LayoutBox {
            rank,
            offsets: offsets.to_vec(),
            lengths: lengths.to_vec(),
        }
    }

    /// The quadratic definition: volumes add up and no two boxes meet.
    fn tiles_naively(boxes: &[LayoutBox], shape: &[u64]) -> bool {
        let volume: u64 = shape.iter().product();
        let regions: Vec<Region> = boxes.iter().map(region).collect();
        let covered: u64 = regions.iter().map(|r| r.volume().unwrap()).sum();
        covered == volume
            && regions.iter().enumerate().all(|(i, a)| {
                regions[i + 1..]
                    .iter()
                    .all(|b| a.is_empty() || b.is_empty() || a.intersect(b).is_none())
            })
    }

    fn checked(boxes: &[LayoutBox], shape: &[u64]) -> Result<(), String> {
        check_tiling(boxes, shape).map_err(|fault| fault.to_string())
    }

    #[test]
    fn a_pinwheel_that_no_straight_cut_splits_is_a_tiling() {
        let pinwheel = [
            boxed(0, &[0, 0], &[2, 1]),
            boxed(1, &[2, 0], &[1, 2]),
            boxed(2, &[1, 2], &[2, 1]),
            boxed(3, &[0, 1], &[1, 2]),
            boxed(4, &[1, 1], &[1, 1]),
        ];
        check_tiling(&pinwheel, &[3, 3]).unwrap();
        let mut moved = pinwheel.clone();
        moved[4].offsets = vec![0, 0];
        let e = checked(&moved, &[3, 3]).unwrap_err();
        assert!(
            e.contains("overlap") && e.contains("rank 0") && e.contains("rank 4"),
            "{e}"
        );
    }

    #[test]
    fn scalars_empty_tensors_and_empty_boxes() {
        check_tiling(&[boxed(0, &[], &[])], &[]).unwrap();
        check_tiling(&[], &[0, 5]).unwrap();
        check_tiling(&[boxed(0, &[0, 0], &[0, 5])], &[0, 5]).unwrap();
        let with_empty = [boxed(0, &[0], &[4]), boxed(1, &[4], &[0])];
        check_tiling(&with_empty, &[4]).unwrap();
        let twice = [boxed(0, &[], &[]), boxed(1, &[], &[])];
        assert!(check_tiling(&twice, &[]).is_err());
    }

    #[test]
    fn a_hole_balanced_by_an_overlap_is_found_in_every_dimension_count() {
        // 3-D grid of 4x4x4 boxes of 2x2x2; one box moved into its neighbour.
        let mut boxes = Vec::new();
        for i in 0..64u32 {
            let at = [
                u64::from(i / 16) * 2,
                u64::from(i / 4 % 4) * 2,
                u64::from(i % 4) * 2,
            ];
            boxes.push(boxed(i, &at, &[2, 2, 2]));
        }
        check_tiling(&boxes, &[8, 8, 8]).unwrap();
        boxes[21].offsets[2] += 1;
        let e = checked(&boxes, &[8, 8, 8]).unwrap_err();
        assert!(e.contains("rank 21") && e.contains("rank 22"), "{e}");
    }

    #[test]
    fn a_hundred_thousand_boxes_are_checked() {
        // Bricks: every other row of boxes is offset by half a box, so no bound
        // cancels across rows and the check really sums corners.
        let (rows, per_row, width) = (400u64, 250u64, 4u64);
        let mut boxes = Vec::new();
        for r in 0..rows {
            let shift = if r % 2 == 1 { width / 2 } else { 0 };
            let mut start = 0;
            for c in 0..per_row {
                let end = (c + 1) * width + shift;
                let end = if c + 1 == per_row {
                    per_row * width + width / 2
                } else {
                    end
                };
                boxes.push(boxed(boxes.len() as u32, &[r, start], &[1, end - start]));
                start = end;
            }
        }
        assert_eq!(boxes.len(), 100_000);
        let shape = [rows, per_row * width + width / 2];
        checked(&boxes, &shape).unwrap();
        // Move a brick's start one column left into its neighbour, and end it one
        // column short: volumes still add up.
        boxes[50_001].offsets[1] -= 1;
        let e = checked(&boxes, &shape).unwrap_err();
        assert!(e.contains("rank 50000") && e.contains("rank 50001"), "{e}");
    }

    #[test]
    fn many_split_dimensions_end_in_an_error_within_the_budget() {
        // Boxes split in 32 dimensions with no corner cancelling: up to 2^32
        // corners each. The sum stops at its budget or at the first unbalanced
        // corners, never visits them all.
        let dims = 32;
        let shape = vec![3u64; dims];
        let boxes: Vec<LayoutBox> = (0..64u32)
            .map(|i| {
                let offsets: Vec<u64> = (0..dims).map(|k| u64::from((i >> (k % 6)) & 1)).collect();
                boxed(i, &offsets, &vec![1; dims])
            })
            .collect();
        assert!(check_tiling(&boxes, &shape).is_err());
        // A valid tiling whose sum needs more than the budget is refused as too
        // complex, not accepted unchecked.
        let halves: Vec<LayoutBox> = (0..16u32)
            .map(|i| {
                let offsets: Vec<u64> = (0..4).map(|k| u64::from((i >> k) & 1) * 2).collect();
                boxed(i, &offsets, &[2, 2, 2, 2])
            })
            .collect();
        check_tiling(&halves, &[4, 4, 4, 4]).unwrap();
        let e = check_tiling_within(&halves, &[4, 4, 4, 4], 8).unwrap_err();
        assert_eq!(
            e,
            TilingFault::TooComplex {
                boxes: 16,
                split: 4
            }
        );
    }

    /// A random tiling of `shape` by straight cuts.
    fn cut(shape: &[u64], at: Vec<u64>, cuts: &mut Vec<(usize, u64)>, out: &mut Vec<LayoutBox>) {
        let mut lengths = shape.to_vec();
        match cuts.pop() {
            Some((k, fraction)) if lengths[k % lengths.len()] > 1 => {
                let k = k % lengths.len();
                let first = 1 + fraction % (lengths[k] - 1);
                let mut second_at = at.clone();
                second_at[k] += first;
                let mut second = lengths.clone();
                second[k] -= first;
                lengths[k] = first;
                cut(&lengths, at, cuts, out);
                cut(&second, second_at, cuts, out);
            }
            _ => out.push(boxed(out.len() as u32, &at, &lengths)),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn agrees_with_the_pairwise_check(
            shape in prop::collection::vec(1u64..6, 1..4),
            mut cuts in prop::collection::vec((0usize..4, 0u64..8), 0..12),
            damage in 0u8..5,
            which in 0usize..64,
            k in 0usize..4,
        ) {
            let mut boxes = Vec::new();
            cut(&shape, vec![0; shape.len()], &mut cuts, &mut boxes);
            let n = boxes.len();
            let b = which % n;
            let k = k % shape.len();
            match damage {
                // Shift one box by one element (staying inside), keeping volumes.
                0 | 1 => {
                    let pos = &mut boxes[b].offsets[k];
                    if damage == 0 && *pos > 0 {
                        *pos -= 1;
                    } else if boxes[b].offsets[k] + boxes[b].lengths[k] < shape[k] {
                        boxes[b].offsets[k] += 1;
                    }
                }
                // Swap the extent of one box in two dimensions (same volume).
                2 => {
                    let j = (k + 1) % shape.len();
                    let (lk, lj) = (boxes[b].lengths[k], boxes[b].lengths[j]);
                    boxes[b].lengths[k] = lj;
                    boxes[b].lengths[j] = lk;
                    let inside = (0..shape.len())
                        .all(|d| boxes[b].offsets[d] + boxes[b].lengths[d] <= shape[d]);
                    if !inside {
                        boxes[b].lengths[k] = lk;
                        boxes[b].lengths[j] = lj;
                    }
                }
                // Move one box onto another of the same size: an overlap balanced
                // by a hole.
                3 => {
                    let lengths = boxes[b].lengths.clone();
                    if let Some(c) = (0..n).find(|&c| c != b && boxes[c].lengths == lengths) {
                        boxes[b].offsets = boxes[c].offsets.clone();
                    }
                }
                _ => {}
            }
            let naive = tiles_naively(&boxes, &shape);
            let fast = checked(&boxes, &shape);
            prop_assert_eq!(naive, fast.is_ok(), "{:?}: {:?}", boxes, fast);
        }
    }
}
