//! `ckpt diff`: are two checkpoints the same training state?
//!
//! Tensors are compared by their global values, whatever the layouts and world sizes
//! of the two sides: both are read as the same dim-0 slabs of the global tensor
//! (resharding on the fly), first bitwise, then, where bytes differ, numerically.
//! This is the oracle of the recovery tests: a resumed run is right when its
//! checkpoint is bitwise identical to the failure-free run's.
//!
//! Unlike `export` and `reshard`, diff does not read the data files' safetensors
//! headers: it writes nothing out, and the values it compares come by the parts'
//! byte ranges (which the manifest vouches for) through checksummed blocks, so a
//! broken header cannot change them; `verify` is the command that judges headers.

use std::collections::BTreeMap;

use serde::Serialize;

use super::convert::to_f64;
use super::{slab_rows, slabs};
use crate::error::Result;
use crate::load::{CheckpointReader, LoadRequest};
use crate::region::Region;

/// Settings of a comparison.
#[derive(Debug, Clone)]
pub struct DiffOptions {
    /// Absolute tolerance: `|a - b| <= atol + rtol * |b|` counts as equal enough.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
    /// Bytes of data held at once (both sides together). Default 512 MiB.
    pub memory_budget: u64,
}

impl Default for DiffOptions {
    fn default() -> Self {
        Self {
            atol: 0.0,
            rtol: 0.0,
            memory_budget: 512 << 20,
        }
    }
}

/// How one tensor compares.
#[derive(Debug, Clone, Serialize)]
pub struct TensorDiff {
    /// Global name.
    pub name: String,
    /// `identical`, `different`, `dtype-mismatch` or `shape-mismatch`.
    pub status: &'static str,
    /// Elements whose bits differ.
    pub differing: u64,
    /// Elements compared.
    pub elements: u64,
    /// Largest |a - b| (numeric dtypes).
    pub max_abs: f64,
    /// Largest |a - b| / |b| (numeric dtypes; b = 0 counts as infinite).
    pub max_rel: f64,
    /// True when every element is within the tolerances.
    pub within_tolerance: bool,
    /// Explanation for mismatches.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// The comparison of two checkpoints.
#[derive(Debug, Clone, Serialize)]
pub struct DiffReport {
    /// Step of side A.
    pub step_a: u64,
    /// Step of side B.
    pub step_b: u64,
    /// World sizes of A and B.
    pub world_sizes: [u32; 2],
    /// Every tensor present on both sides, sorted by name.
    pub tensors: Vec<TensorDiff>,
    /// Tensors only A has.
    pub only_in_a: Vec<String>,
    /// Tensors only B has.
    pub only_in_b: Vec<String>,
    /// Differences of non-tensor state and metadata, in words.
    pub state_differences: Vec<String>,
    /// True when everything is bitwise identical.
    pub identical: bool,
    /// True when every tensor is within tolerance and nothing else differs.
    pub within_tolerance: bool,
}

/// Compares checkpoint A with checkpoint B. `progress` gets bytes compared (per side).
pub async fn diff(
    a: &CheckpointReader,
    b: &CheckpointReader,
    options: &DiffOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<DiffReport> {
    let (ma, mb) = (a.manifest(), b.manifest());
    let names_a: BTreeMap<&str, _> = ma.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let names_b: BTreeMap<&str, _> = mb.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let only_in_a: Vec<String> = names_a
        .keys()
        .filter(|n| !names_b.contains_key(*n))
        .map(|n| n.to_string())
        .collect();
    let only_in_b: Vec<String> = names_b
        .keys()
        .filter(|n| !names_a.contains_key(*n))
        .map(|n| n.to_string())
        .collect();

    let mut tensors = Vec::new();
    for (name, ta) in &names_a {
        let Some(tb) = names_b.get(name) else {
            continue;
        };
        let mut result = TensorDiff {
            name: name.to_string(),
            status: "identical",
            differing: 0,
            elements: ta.shape.iter().product(),
            max_abs: 0.0,
            max_rel: 0.0,
            within_tolerance: true,
            detail: None,
        };
        if ta.dtype != tb.dtype {
            result.status = "dtype-mismatch";
            result.within_tolerance = false;
            result.detail = Some(format!("{} vs {}", ta.dtype, tb.dtype));
            tensors.push(result);
            continue;
        }
        if ta.shape != tb.shape {
            result.status = "shape-mismatch";
            result.within_tolerance = false;
            result.detail = Some(format!("{:?} vs {:?}", ta.shape, tb.shape));
            tensors.push(result);
            continue;
        }
        let whole = Region::full(&ta.shape);
        let rows = slab_rows(&whole, ta.dtype.size(), (options.memory_budget / 2).max(1));
        for slab in slabs(&whole, rows) {
            let request = LoadRequest::new().tensor(name.to_string(), slab);
            let (la, lb) = futures::try_join!(a.load(&request), b.load(&request))?;
            let (da, db) = (&la.tensors[0].data, &lb.tensors[0].data);
            progress(da.len() as u64);
            if da == db {
                continue;
            }
            compare(ta.dtype, da, db, options, &mut result);
        }
        if result.differing > 0 {
            result.status = "different";
        }
        tensors.push(result);
    }

    let mut state_differences = Vec::new();
    // `ckpt.*` entries are ckpt's own bookkeeping (e.g. the per-rank state a reshard
    // to another world size keeps), not training state.
    let user = |state: BTreeMap<String, crate::format::StateValue>| {
        state
            .into_iter()
            .filter(|(k, _)| !k.starts_with("ckpt."))
            .collect::<BTreeMap<_, _>>()
    };
    let (ga, gb) = (user(a.global_state().await?), user(b.global_state().await?));
    for key in ga
        .keys()
        .chain(gb.keys())
        .collect::<std::collections::BTreeSet<_>>()
    {
        match (ga.get(key), gb.get(key)) {
            (Some(x), Some(y)) if x == y => {}
            (Some(_), Some(_)) => state_differences.push(format!("global state {key:?} differs")),
            (Some(_), None) => state_differences.push(format!("global state {key:?} only in A")),
            _ => state_differences.push(format!("global state {key:?} only in B")),
        }
    }
    if ma.metadata != mb.metadata {
        state_differences.push("user metadata differs".to_string());
    }
    if ma.world_size == mb.world_size {
        let (ra, rb) = (a.rank_states().await?, b.rank_states().await?);
        for ((rank, sa), (_, sb)) in ra.iter().zip(&rb) {
            if sa != sb {
                state_differences.push(format!("rank {rank}'s non-tensor state differs"));
            }
        }
    }

    let identical = only_in_a.is_empty()
        && only_in_b.is_empty()
        && state_differences.is_empty()
        && tensors.iter().all(|t| t.status == "identical");
    let within_tolerance = only_in_a.is_empty()
        && only_in_b.is_empty()
        && state_differences.is_empty()
        && tensors.iter().all(|t| t.within_tolerance);
    Ok(DiffReport {
        step_a: ma.step,
        step_b: mb.step,
        world_sizes: [ma.world_size, mb.world_size],
        tensors,
        only_in_a,
        only_in_b,
        state_differences,
        identical,
        within_tolerance,
    })
}

/// Element-wise comparison of one slab whose bytes differ.
fn compare(
    dtype: crate::DType,
    a: &[u8],
    b: &[u8],
    options: &DiffOptions,
    result: &mut TensorDiff,
) {
    let size = dtype.size();
    let (va, vb) = (to_f64(dtype, a), to_f64(dtype, b));
    for (i, (x, y)) in va.iter().zip(&vb).enumerate() {
        if a[i * size..(i + 1) * size] == b[i * size..(i + 1) * size] {
            continue;
        }
        result.differing += 1;
        let abs = (x - y).abs();
        let rel = if *y == 0.0 {
            f64::INFINITY
        } else {
            abs / y.abs()
        };
        // NaN against a number is as different as it gets.
        let abs = if abs.is_nan() { f64::INFINITY } else { abs };
        result.max_abs = result.max_abs.max(abs);
        result.max_rel = result
            .max_rel
            .max(if rel.is_nan() { f64::INFINITY } else { rel });
        let close = if dtype.is_float() || options.atol > 0.0 || options.rtol > 0.0 {
            abs <= options.atol + options.rtol * y.abs()
        } else {
            false
        };
        if !close {
            result.within_tolerance = false;
        }
    }
}
