//! `ckpt ls` and `ckpt inspect`: what a root holds, and one manifest made readable.

use std::collections::BTreeMap;
use std::time::SystemTime;

use ckpt_storage::Store;
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;

use crate::catalog::{CheckpointInfo, Commit, list_checkpoints, read_commit};
use crate::error::{Error, Result};
use crate::format::{
    Codec, Health, Layout, Manifest, Metric, NonFinite, RankPart, ReplicaMismatch, rank_part_name,
};
use crate::load::CheckpointReader;

/// One step directory as `ckpt ls` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ListedCheckpoint {
    /// The step.
    pub step: u64,
    /// Its directory under the root.
    pub dir: String,
    /// Its position in the commit order (logged commits).
    pub seq: Option<u64>,
    /// Generation of the world that saved it (format v2).
    pub generation: Option<u64>,
    /// `committed`, `abandoned` (committed, but a later run went back to an older
    /// step), `failed` (its save recorded why it cannot commit), `partial` (no
    /// manifest) or `corrupt` (a manifest that fails its checks).
    pub status: &'static str,
    /// True for the newest commit whose manifest is valid, healthy or not: what
    /// `inspect`, `verify` and the other tools open by default.
    pub latest: bool,
    /// True for the checkpoint a resume loads: the newest commit whose manifest is
    /// valid and that is not judged unhealthy (the latest one, unless it is
    /// unhealthy).
    pub resume: bool,
    /// The commit's health: `true` healthy, `false` unhealthy, `null` unknown
    /// (written before health was recorded, or by an offline tool) and for what is
    /// not a valid commit (failed, partial, corrupt).
    pub healthy: Option<bool>,
    /// Why it is unhealthy (only when `healthy` is false).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub health_reasons: Vec<String>,
    /// Ranks that saved (from the manifest, or from a rank part when partial).
    pub world_size: Option<u32>,
    /// Ranks whose part is missing (partial checkpoints).
    pub missing_ranks: Vec<u32>,
    /// Number of tensors.
    pub tensors: Option<usize>,
    /// Bytes of tensor data (uncompressed).
    pub tensor_bytes: Option<u64>,
    /// Bytes stored in the step directory.
    pub stored_bytes: u64,
    /// `none` or `zstd` with its level.
    pub compression: Option<String>,
    /// Seconds since the last object of the step was written.
    pub age_s: Option<f64>,
    /// Why the checkpoint is partial or corrupt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

/// A codec as words.
pub fn codec_name(codec: &Codec) -> String {
    match codec {
        Codec::None => "none".to_string(),
        Codec::Zstd { level, shuffle } if *shuffle > 1 => format!("zstd-{level}+shuffle{shuffle}"),
        Codec::Zstd { level, .. } => format!("zstd-{level}"),
    }
}

/// Manifests (committed checkpoints) and part prefixes (partial ones) that `ckpt ls`
/// reads at once.
pub const LS_CONCURRENCY: usize = 16;

/// Every checkpoint under the root: commits in commit order (oldest first), then
/// failed and partial saves. Costs the survey of the root (a listing and the commit
/// log), then one manifest per commit (its health is in it) and a 4 KiB prefix of a
/// part per partial save, [`LS_CONCURRENCY`] at once.
pub async fn ls(store: &Store) -> Result<Vec<ListedCheckpoint>> {
    let now = SystemTime::now();
    let survey = list_checkpoints(store).await?;
    let mut out: Vec<ListedCheckpoint> =
        futures::stream::iter(survey.into_iter().map(|info| describe(store, info, now)))
            .buffered(LS_CONCURRENCY)
            .try_collect()
            .await?;
    let valid = |c: &ListedCheckpoint| matches!(c.status, "committed" | "abandoned");
    if let Some(latest) = out.iter_mut().rev().find(|c| valid(c)) {
        latest.latest = true;
    }
    if let Some(resume) = out
        .iter_mut()
        .rev()
        .find(|c| valid(c) && c.healthy != Some(false))
    {
        resume.resume = true;
    }
    Ok(out)
}

/// One directory of the survey as `ckpt ls` shows it.
async fn describe(
    store: &Store,
    info: CheckpointInfo,
    now: SystemTime,
) -> Result<ListedCheckpoint> {
    let age_s = info
        .modified
        .and_then(|m| now.duration_since(m).ok())
        .map(|d| d.as_secs_f64());
    let mut listed = ListedCheckpoint {
        step: info.step,
        dir: info.dir.clone(),
        seq: info.seq,
        generation: info.generation,
        status: info.status.as_str(),
        latest: false,
        resume: false,
        healthy: None,
        health_reasons: Vec::new(),
        world_size: None,
        missing_ranks: Vec::new(),
        tensors: None,
        tensor_bytes: None,
        stored_bytes: info.bytes,
        compression: None,
        age_s,
        problem: None,
    };
    if info.committed {
        let commit = Commit {
            seq: info.seq,
            step: info.step,
            dir: info.dir.clone(),
            time: info.committed_at,
        };
        match read_commit(store, &commit).await {
            Ok(manifest) => {
                listed.world_size = Some(manifest.world_size);
                listed.tensors = Some(manifest.tensors.len());
                listed.tensor_bytes = Some(manifest.tensor_bytes());
                listed.compression = Some(codec_name(&manifest.codec));
                let health = manifest.health_status();
                listed.healthy = health.healthy();
                listed.health_reasons = health.reasons().to_vec();
                if let Some(back_to) = info.abandoned_for {
                    listed.problem = Some(format!(
                        "abandoned: a later run went back and committed step {back_to} after it; \
                         still readable by step, removed by retention in commit order"
                    ));
                }
            }
            Err(Error::Corrupt(e)) => {
                listed.status = "corrupt";
                listed.problem = Some(e.to_string());
            }
            Err(e) => return Err(e),
        }
    } else if let Some(failure) = &info.failure {
        listed.problem = Some(failure.clone());
    } else {
        // The world size is in any part that made it, near its start.
        let world = match info.ranks_present.first() {
            Some(&rank) => {
                let key = format!("{}/{}", info.dir, rank_part_name(rank));
                world_of_part(store, &key).await
            }
            None => None,
        };
        listed.world_size = world;
        if let Some(world) = world {
            listed.missing_ranks = (0..world)
                .filter(|r| info.ranks_present.binary_search(r).is_err())
                .collect();
            listed.problem = Some(format!(
                "no manifest; {} of {world} rank parts present, missing ranks {}",
                info.ranks_present.len(),
                ranges_text(&listed.missing_ranks)
            ));
        } else {
            listed.problem = Some("no manifest and no readable rank part".to_string());
        }
    }
    Ok(listed)
}

/// How much of a partial save's part `ckpt ls` reads: its leading fields, whatever
/// the part's size (a part is up to 256 MiB, and a partial save's is not checked
/// against any manifest).
const PART_PREFIX_BYTES: u64 = 4096;

/// The world size a partial save's part names, from a bounded prefix of it.
async fn world_of_part(store: &Store, key: &str) -> Option<u32> {
    let size = store.head(key).await.ok()?.size;
    let prefix = store
        .get_range(key, 0..size.min(PART_PREFIX_BYTES))
        .await
        .ok()?;
    RankPart::peek_world_size(&prefix)
}

/// `0-3,7,9-10` for a sorted list of ranks.
pub fn ranges_text(ranks: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let start = ranks[i];
        let mut end = start;
        while i + 1 < ranks.len() && ranks[i + 1] == end + 1 {
            i += 1;
            end = ranks[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

/// One chunk of a tensor, for `inspect --tensors`.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkView {
    /// Rank whose file holds it.
    pub rank: u32,
    /// Box offsets.
    pub offsets: Vec<u64>,
    /// Box lengths.
    pub lengths: Vec<u64>,
    /// The data file.
    pub file: String,
}

/// One tensor, for `inspect --tensors`.
#[derive(Debug, Clone, Serialize)]
pub struct TensorView {
    /// Global name.
    pub name: String,
    /// Element type.
    pub dtype: String,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Bytes of data.
    pub bytes: u64,
    /// `dim0` or `boxes`.
    pub layout: &'static str,
    /// Where its chunks are.
    pub chunks: Vec<ChunkView>,
}

/// One rank, for `inspect --ranks`.
#[derive(Debug, Clone, Serialize)]
pub struct RankView {
    /// The rank.
    pub rank: u32,
    /// Its data file.
    pub file: String,
    /// Stored bytes of the file.
    pub stored_bytes: u64,
    /// Raw bytes of the file.
    pub raw_bytes: u64,
    /// Bytes of its manifest part.
    pub part_bytes: u64,
    /// Chunks in the file (from its part).
    pub chunks: usize,
    /// Keys of its own non-tensor state.
    pub rank_state: Vec<String>,
}

/// A manifest's health ([`Health`]), every list present even when empty.
#[derive(Debug, Clone, Serialize)]
pub struct HealthView {
    /// True when every float tensor is finite, every replica agreed and no rank's
    /// own check failed.
    pub healthy: bool,
    /// Why not, one line each.
    pub reasons: Vec<String>,
    /// Tensors with non-finite elements.
    pub nonfinite: Vec<NonFinite>,
    /// Replicated boxes whose holders disagree.
    pub replica_mismatches: Vec<ReplicaMismatch>,
    /// Replicated boxes whose copies were compared.
    pub replicas_compared: u64,
    /// The caller's metrics (a value that is not finite is `"NaN"`, `"inf"` or
    /// `"-inf"`).
    pub metrics: BTreeMap<String, Metric>,
}

impl From<&Health> for HealthView {
    fn from(health: &Health) -> Self {
        Self {
            healthy: health.healthy,
            reasons: health.reasons.clone(),
            nonfinite: health.nonfinite.clone(),
            replica_mismatches: health.replica_mismatches.clone(),
            replicas_compared: health.replicas_compared,
            metrics: health.metrics.clone(),
        }
    }
}

/// A manifest made readable.
#[derive(Debug, Clone, Serialize)]
pub struct Inspection {
    /// Step.
    pub step: u64,
    /// The directory of its objects under the root.
    pub dir: String,
    /// Ranks that saved.
    pub world_size: u32,
    /// Elastic generation.
    pub generation: u64,
    /// Format version.
    pub format_version: u32,
    /// Commit time, ms since the epoch.
    pub created_unix_ms: u64,
    /// Checksum block size.
    pub block_size: u64,
    /// Compression.
    pub compression: String,
    /// Number of tensors in the checkpoint (before filtering).
    pub tensor_count: usize,
    /// Bytes of tensor data.
    pub tensor_bytes: u64,
    /// Bytes of data files as stored.
    pub stored_bytes: u64,
    /// Layouts by kind: how many tensors use a dim-0 layout and how many boxes.
    pub layouts: BTreeMap<String, usize>,
    /// Keys of the global non-tensor state.
    pub global_state: Vec<String>,
    /// User metadata.
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// `true` healthy, `false` unhealthy, `None` (JSON `null`) unknown: written
    /// before health was recorded (format version 3 or older), or by an offline tool.
    pub healthy: Option<bool>,
    /// What the commit judged of the checkpoint's health; `None` when unknown.
    pub health: Option<HealthView>,
    /// Tensors (with `--tensors`), filtered by the glob.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensors: Option<Vec<TensorView>>,
    /// Ranks (with `--ranks`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Vec<RankView>>,
}

/// Reads checkpoint `step` (or the newest) and describes it.
pub async fn inspect(
    store: &Store,
    step: Option<u64>,
    tensors: bool,
    ranks: bool,
    filter: &str,
) -> Result<Inspection> {
    let reader = CheckpointReader::open(store, step).await?;
    let manifest: &Manifest = reader.manifest();
    let mut layouts = BTreeMap::new();
    for t in &manifest.tensors {
        let kind = match manifest.layouts[t.layout as usize] {
            Layout::Dim0(_) => "dim0",
            Layout::Boxes(_) => "boxes",
        };
        *layouts.entry(kind.to_string()).or_insert(0) += 1;
    }
    let tensor_views = tensors.then(|| {
        manifest
            .tensors
            .iter()
            .filter(|t| super::glob_match(filter, &t.name))
            .map(|t| {
                let layout = &manifest.layouts[t.layout as usize];
                TensorView {
                    name: t.name.clone(),
                    dtype: t.dtype.to_string(),
                    shape: t.shape.clone(),
                    bytes: t.shape.iter().product::<u64>() * t.dtype.size() as u64,
                    layout: match layout {
                        Layout::Dim0(_) => "dim0",
                        Layout::Boxes(_) => "boxes",
                    },
                    chunks: layout
                        .boxes(&t.shape)
                        .into_iter()
                        .map(|(rank, region)| ChunkView {
                            rank,
                            offsets: region.offsets,
                            lengths: region.lengths,
                            file: manifest.ranks[rank as usize].file.clone(),
                        })
                        .collect(),
                }
            })
            .collect()
    });
    let rank_views = if ranks {
        let mut views = Vec::with_capacity(manifest.ranks.len());
        for entry in &manifest.ranks {
            let part = reader.part(entry.rank).await?;
            views.push(RankView {
                rank: entry.rank,
                file: entry.file.clone(),
                stored_bytes: entry.stored_bytes,
                raw_bytes: entry.raw_bytes,
                part_bytes: entry.part_bytes,
                chunks: part.chunks.len(),
                rank_state: part.rank_state.keys().cloned().collect(),
            });
        }
        Some(views)
    } else {
        None
    };
    let global_state = reader.global_state().await?.keys().cloned().collect();
    Ok(Inspection {
        step: manifest.step,
        dir: manifest.dir(),
        world_size: manifest.world_size,
        generation: manifest.generation,
        format_version: manifest.format_version,
        created_unix_ms: manifest.created_unix_ms,
        block_size: manifest.block_size,
        compression: codec_name(&manifest.codec),
        tensor_count: manifest.tensors.len(),
        tensor_bytes: manifest.tensor_bytes(),
        stored_bytes: super::verify::stored_bytes(manifest),
        layouts,
        global_state,
        metadata: manifest.metadata.clone(),
        healthy: manifest.health_status().healthy(),
        health: manifest.health.as_ref().map(HealthView::from),
        tensors: tensor_views,
        ranks: rank_views,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_ranges_read_naturally() {
        assert_eq!(ranges_text(&[0, 1, 2, 3, 7, 9, 10]), "0-3,7,9-10");
        assert_eq!(ranges_text(&[]), "");
        assert_eq!(ranges_text(&[5]), "5");
    }
}
