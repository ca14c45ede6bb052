//! `ckpt reshard`: rewrite a checkpoint for another world size or layout, streaming.
//!
//! Each destination rank's file is written with a [`RankFileWriter`]: its boxes are
//! known up front, so the header goes first and the data follows in dim-0 slabs read
//! from the source (resharded on the fly by the loader), never whole tensors. The
//! destination is committed with the same protocol as a training save.
//!
//! Non-tensor state: global state and metadata are copied. Per-rank state is copied
//! rank for rank when the world size is unchanged; otherwise every source rank's
//! state is kept, as JSON, in the global state entry `ckpt.source_rank_states`
//! (`{"world_size": N, "ranks": [{"rank": r, "state": {...}}, ...]}`), so nothing is
//! dropped and the program that resumes decides how to map it.

use std::collections::BTreeMap;

use ckpt_storage::Store;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use super::{dim0_boxes, slab_rows, slabs};
use crate::error::{Error, Result};
use crate::format::{Codec, LayoutBox, Manifest, StateValue};
use crate::load::{CheckpointReader, LoadRequest};
use crate::region::Region;
use crate::writer::{PlannedBox, RankFileWriter, commit, tool_attempt};

/// A layout file (`ckpt reshard --layout FILE`): per tensor, the box each rank holds.
///
/// ```json
/// {"world_size": 2,
///  "default": "dim0",
///  "tensors": {"mlp.w": [{"rank": 0, "offsets": [0, 0], "lengths": [8, 2]},
///                        {"rank": 1, "offsets": [0, 2], "lengths": [8, 2]}]}}
/// ```
/// Tensors not listed follow `default`: `dim0` (even dim-0 split) or `replicate`
/// (whole tensor in rank 0's file, for small tensors every rank reads whole).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutFile {
    /// Ranks of the new layout.
    pub world_size: u32,
    /// Layout of tensors not listed: `dim0` or `replicate`.
    #[serde(default = "default_layout")]
    pub default: String,
    /// Boxes per tensor.
    #[serde(default)]
    pub tensors: BTreeMap<String, Vec<LayoutBox>>,
}

fn default_layout() -> String {
    "dim0".to_string()
}

/// Where to reshard to.
#[derive(Debug, Clone)]
pub enum Target {
    /// Even dim-0 split over this many ranks.
    WorldSize(u32),
    /// Explicit boxes.
    Layout(LayoutFile),
}

impl Target {
    fn world(&self) -> u32 {
        match self {
            Target::WorldSize(w) => *w,
            Target::Layout(l) => l.world_size,
        }
    }

    /// The boxes of every tensor of `manifest` per destination rank, checked to tile
    /// each tensor exactly.
    pub fn plan(&self, manifest: &Manifest) -> Result<Vec<Vec<PlannedBox>>> {
        let world = self.world();
        if world == 0 || world > crate::format::MAX_WORLD_SIZE {
            return Err(Error::invalid(format!(
                "world size {world} is outside 1..={}",
                crate::format::MAX_WORLD_SIZE
            )));
        }
        if let Target::Layout(layout) = self {
            if layout.default != "dim0" && layout.default != "replicate" {
                return Err(Error::invalid(format!(
                    "layout default {:?} must be \"dim0\" or \"replicate\"",
                    layout.default
                )));
            }
            if let Some(unknown) = layout.tensors.keys().find(|n| manifest.tensor(n).is_none()) {
                return Err(Error::invalid(format!(
                    "layout names tensor {unknown:?}, which the checkpoint does not have"
                )));
            }
        }
        let mut per_rank: Vec<Vec<PlannedBox>> = vec![Vec::new(); world as usize];
        for tensor in &manifest.tensors {
            let boxes: Vec<(u32, Region)> = match self {
                Target::Layout(layout) if layout.tensors.contains_key(&tensor.name) => {
                    let boxes = &layout.tensors[&tensor.name];
                    crate::format::check_layout(
                        &crate::format::Layout::Boxes(boxes.clone()),
                        tensor,
                        world,
                        "layout file",
                    )
                    .map_err(|e| Error::invalid(e.message))?;
                    boxes
                        .iter()
                        .map(|b| (b.rank, Region::new(b.offsets.clone(), b.lengths.clone())))
                        .collect()
                }
                Target::Layout(layout) if layout.default == "replicate" => {
                    vec![(0, Region::full(&tensor.shape))]
                }
                _ => dim0_boxes(&tensor.shape, world),
            };
            // A tensor with no element keeps one (empty) box, whatever the layout
            // file says of it: without a chunk the commit would drop it.
            let no_element = Region::full(&tensor.shape).is_empty();
            let boxes = if no_element {
                dim0_boxes(&tensor.shape, world)
            } else {
                boxes
            };
            for (rank, region) in boxes {
                if region.is_empty() && !no_element {
                    continue;
                }
                per_rank[rank as usize].push(PlannedBox {
                    name: tensor.name.clone(),
                    dtype: tensor.dtype,
                    shape: tensor.shape.clone(),
                    region,
                });
            }
        }
        Ok(per_rank)
    }
}

/// Settings of a reshard.
#[derive(Debug, Clone)]
pub struct ReshardOptions {
    /// Bytes of tensor data held at once, all ranks together. Default 1 GiB.
    pub memory_budget: u64,
    /// Destination ranks written at once. Default 2.
    pub rank_concurrency: usize,
    /// Codec of the destination (default: the source's).
    pub codec: Option<Codec>,
}

impl Default for ReshardOptions {
    fn default() -> Self {
        Self {
            memory_budget: 1 << 30,
            rank_concurrency: 2,
            codec: None,
        }
    }
}

/// What a reshard did.
#[derive(Debug, Clone, Serialize)]
pub struct ReshardReport {
    /// The step (same in source and destination).
    pub step: u64,
    /// Source world size.
    pub from_world_size: u32,
    /// Destination world size.
    pub to_world_size: u32,
    /// Tensors rewritten.
    pub tensors: usize,
    /// Bytes of tensor data written.
    pub bytes: u64,
    /// Stored bytes read from the source.
    pub bytes_read: u64,
}

/// Rewrites the checkpoint `source` reads (from `src`) into `dst` for `target`,
/// committing it there. Refuses to overwrite a committed checkpoint of the same step
/// in `dst`, and checks every source data file (its header included) before writing
/// anything, so nothing is committed from a checkpoint `verify` rejects.
pub async fn reshard(
    src: &Store,
    source: &CheckpointReader,
    dst: &Store,
    target: &Target,
    options: &ReshardOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<ReshardReport> {
    let manifest = source.manifest();
    let step = manifest.step;
    let world = target.world();
    if crate::catalog::read_manifest(dst, step).await.is_ok() {
        return Err(Error::invalid(format!(
            "{} already holds a committed checkpoint at step {step}; choose another destination",
            dst.url()
        )));
    }
    let plan = target.plan(manifest)?;
    super::check_data_headers(src, source, &manifest.tensors).await?;
    let global = source.global_state().await?;
    let rank_states = source.rank_states().await?;
    let mut global_out = global.clone();
    let same_world = world == manifest.world_size;
    if !same_world && rank_states.iter().any(|(_, s)| !s.is_empty()) {
        let ranks: Vec<serde_json::Value> = rank_states
            .iter()
            .map(|(rank, state)| serde_json::json!({"rank": rank, "state": state}))
            .collect();
        global_out.insert(
            "ckpt.source_rank_states".to_string(),
            StateValue::Json(
                serde_json::json!({"world_size": manifest.world_size, "ranks": ranks}),
            ),
        );
    }
    let codec = options.codec.unwrap_or(manifest.codec);
    let budget = (options.memory_budget / options.rank_concurrency.max(1) as u64).max(1);
    let has_global = !global_out.is_empty() || !manifest.metadata.is_empty();

    let attempt = &tool_attempt(dst, step).await?;
    let results: Vec<(u64, u64)> = futures::stream::iter(plan.into_iter().enumerate())
        .map(|(rank, boxes)| {
            let global_out = &global_out;
            let rank_states = &rank_states;
            async move {
                let rank = rank as u32;
                let mut writer = RankFileWriter::begin(
                    dst,
                    attempt,
                    rank,
                    world,
                    manifest.block_size,
                    codec,
                    &boxes,
                )
                .await?;
                let (mut written, mut read) = (0u64, 0u64);
                for b in &boxes {
                    let rows = slab_rows(&b.region, b.dtype.size(), budget);
                    for slab in slabs(&b.region, rows) {
                        let loaded = source
                            .load(&LoadRequest::new().tensor(b.name.clone(), slab))
                            .await?;
                        read += loaded.stats.bytes_read;
                        let data = &loaded.tensors[0].data;
                        writer.write(data).await?;
                        written += data.len() as u64;
                        progress(data.len() as u64);
                    }
                }
                let rank_state = if same_world {
                    rank_states
                        .get(rank as usize)
                        .map(|(_, s)| s.clone())
                        .unwrap_or_default()
                } else {
                    BTreeMap::new()
                };
                let (global, metadata) = if rank == 0 && has_global {
                    (Some(global_out.clone()), manifest.metadata.clone())
                } else {
                    (None, BTreeMap::new())
                };
                writer.finish(global, rank_state, metadata).await?;
                Ok::<_, Error>((written, read))
            }
        })
        .buffer_unordered(options.rank_concurrency.max(1))
        .try_collect()
        .await?;
    if !commit(dst, attempt, world).await? {
        return Err(Error::Failed(format!(
            "every rank of step {step} was written to {} but the commit found parts missing",
            dst.url()
        )));
    }
    Ok(ReshardReport {
        step,
        from_world_size: manifest.world_size,
        to_world_size: world,
        tensors: manifest.tensors.len(),
        bytes: results.iter().map(|r| r.0).sum(),
        bytes_read: results.iter().map(|r| r.1).sum(),
    })
}
