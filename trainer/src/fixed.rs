//! Exact fixed-point accumulation of gradients.
//!
//! Float addition is not associative, so a sum whose grouping depends on the world
//! size (which chunks a rank adds locally, which ranks a ring adds in which order)
//! changes in its last bits when the world size changes. Integer addition is
//! associative and commutative, so each chunk's gradient is converted once to a
//! fixed-point integer, `trunc(g · 2^40)`, and every later sum (within a rank, across
//! ranks by the reduce-scatter) is exact: any grouping gives the same bits.
//!
//! - Resolution: `2^-40 ≈ 9.1e-13`. A gradient element is truncated toward zero to
//!   that absolute precision once per chunk (`g · 2^40` is exact in f32, a power-of-two
//!   scaling; the f32-to-integer conversion truncates: one instruction, where
//!   rounding would cost a libm call per element); a value below it contributes 0.
//! - Range: each chunk's element is clamped to `±2^16 = ±65536` (`2^56` in fixed
//!   point), so the sum of up to [`MAX_CHUNKS`] chunks stays below `2^63`: no
//!   overflow is possible. Gradients of a mean loss are far below that bound; a
//!   clamped value is counted and reported (it means the run is diverging).
//! - The conversion back is `sum as f64 · 2^-40`, rounded to f32: exact up to the f32
//!   rounding, identical on every rank.
//! - A non-finite gradient cannot be represented; it is clamped like a huge one
//!   (NaN becomes 0) and counted.

use std::sync::atomic::{AtomicU64, Ordering};

/// Fixed-point scale: 2^40.
pub const SCALE: f64 = (1u64 << 40) as f64;
/// Largest magnitude of one chunk's element, in fixed point (2^56).
pub const LIMIT: i64 = 1 << 56;
/// Most chunks whose clamped sum cannot overflow i64.
pub const MAX_CHUNKS: usize = 127;

static CLAMPED: AtomicU64 = AtomicU64::new(0);

/// Elements clamped so far in this process (non-finite or beyond ±65536).
pub fn clamped() -> u64 {
    CLAMPED.load(Ordering::Relaxed)
}

/// `g` in fixed point, truncated toward zero and clamped to ±[`LIMIT`] (NaN: 0).
#[inline]
pub fn to_fixed(g: f32) -> i64 {
    // `as` saturates at the i64 bounds and maps NaN to 0; the clamp then bounds it.
    ((g * SCALE as f32) as i64).clamp(-LIMIT, LIMIT)
}

/// A fixed-point sum back in f32.
#[inline]
pub fn from_fixed(v: i64) -> f32 {
    (v as f64 / SCALE) as f32
}

/// `acc += to_fixed(g)` element-wise.
pub fn accumulate(g: &[f32], acc: &mut [i64]) {
    let mut clamped = 0u64;
    for (a, g) in acc.iter_mut().zip(g) {
        let v = to_fixed(*g);
        clamped += u64::from(v.unsigned_abs() == LIMIT as u64 || g.is_nan());
        *a = a.wrapping_add(v);
    }
    if clamped > 0 {
        CLAMPED.fetch_add(clamped, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_independent_of_grouping() {
        let values: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1013) as f32 * 1e-3 - 0.5)
            .collect();
        let forward: i64 = values.iter().map(|v| to_fixed(*v)).sum();
        let backward: i64 = values.iter().rev().map(|v| to_fixed(*v)).sum();
        let halves: i64 = values[..333].iter().map(|v| to_fixed(*v)).sum::<i64>()
            + values[333..].iter().map(|v| to_fixed(*v)).sum::<i64>();
        assert_eq!(forward, backward);
        assert_eq!(forward, halves);
    }

    #[test]
    fn round_trip_keeps_f32_values_above_the_resolution() {
        for g in [1.0f32, -3.25, 1e-3, 12345.678, -0.1] {
            assert_eq!(from_fixed(to_fixed(g)), g);
        }
        assert_eq!(to_fixed(1e9), LIMIT);
        assert_eq!(to_fixed(f32::NEG_INFINITY), -LIMIT);
        assert_eq!(to_fixed(f32::NAN), 0);
    }
}
