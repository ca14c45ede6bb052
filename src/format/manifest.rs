//! The root manifest, `manifest.json`: its presence is the commit. Its types, and
//! the structural checks run on every manifest read (each tensor's layout is checked
//! by [`super::layout`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::envelope::{parse_json, seal, unseal};
use super::health::{HEALTH_VERSION, Health, HealthStatus};
use super::layout::{Layout, check_layout, check_one_box_per_rank};
use super::limits::{MAX_MANIFEST_BYTES, MAX_PART_BYTES, check_common, check_shape, tensor_bytes};
use super::names::check_object_name;
use super::{FResult, FormatError};
use crate::dtype::DType;

/// How a rank's data file is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(tag = "codec", rename_all = "lowercase")]
pub enum Codec {
    /// The plain safetensors file.
    #[default]
    None,
    /// Independent zstd frames, one per block of raw bytes. With `shuffle == 0` the
    /// file is a plain zstd stream of the safetensors file; with `shuffle == w > 1`
    /// every block's bytes were transposed in groups of `w` before compression
    /// (bytes of equal significance together), so only ckpt can decode it.
    Zstd {
        /// zstd compression level used.
        level: i32,
        /// Byte-shuffle width (0 or 1: none).
        #[serde(default)]
        shuffle: u32,
    },
}

/// One tensor of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Global name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Index into [`Manifest::layouts`]: where the tensor's chunks are.
    pub layout: u32,
}

/// What the manifest says about one rank's files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankEntry {
    /// The rank.
    pub rank: u32,
    /// Its manifest part (`rank-00003.json`).
    pub part: String,
    /// Size of the part in bytes.
    pub part_bytes: u64,
    /// CRC32 of the whole part object.
    pub part_crc32: u32,
    /// Its data file.
    pub file: String,
    /// Size of the data file as stored.
    pub stored_bytes: u64,
    /// Size of the data file before compression.
    pub raw_bytes: u64,
}

/// The manifest of one save attempt, `step-NNNNNNNN/gGGGGGGGG-RUN/manifest.json`
/// (`step-NNNNNNNN/manifest.json` in version 1): with its commit record, the commit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`](super::FORMAT_VERSION) when written by this build; 1 for
    /// older checkpoints.
    pub format_version: u32,
    /// Training step.
    pub step: u64,
    /// The save attempt's directory name inside the step directory (version 2;
    /// `None` in version 1, whose objects lie directly in the step directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
    /// Ranks that saved.
    pub world_size: u32,
    /// Generation of the elastic world that saved.
    pub generation: u64,
    /// Commit time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// Block size of checksums (and compression frames), bytes.
    pub block_size: u64,
    /// Encoding of the data files.
    pub codec: Codec,
    /// Tensors, sorted by name.
    pub tensors: Vec<TensorEntry>,
    /// Layouts the tensors refer to.
    pub layouts: Vec<Layout>,
    /// One entry per rank, sorted by rank.
    pub ranks: Vec<RankEntry>,
    /// Rank whose part carries the global non-tensor state, if any.
    pub global_state_rank: Option<u32>,
    /// User metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// The committer's verdict on the checkpoint's health (version 4); `None`
    /// (health unknown) in older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<Health>,
}

impl Manifest {
    /// The directory holding the checkpoint's objects, relative to the root:
    /// `step-N/ATTEMPT` (version 2) or `step-N` (version 1).
    pub fn dir(&self) -> String {
        match &self.attempt {
            Some(attempt) => format!("{}/{attempt}", super::step_dir(self.step)),
            None => super::step_dir(self.step),
        }
    }

    /// Parses and validates a sealed manifest.
    pub fn parse(bytes: &[u8], object: &str) -> FResult<Manifest> {
        let (body, offset) = unseal(bytes, object, MAX_MANIFEST_BYTES)?;
        let manifest: Manifest = parse_json(body, offset, object)?;
        manifest.validate(object)?;
        Ok(manifest)
    }

    /// Serializes and seals.
    pub fn to_bytes(&self) -> Vec<u8> {
        seal(&serde_json::to_vec(self).expect("manifest serializes"))
    }

    /// Structural checks: version, sizes, names, layouts and that every tensor's
    /// boxes lie inside it and tile it exactly (before version 3, also that no rank
    /// holds two boxes of one tensor).
    pub fn validate(&self, object: &str) -> FResult<()> {
        check_common(
            object,
            self.format_version,
            self.attempt.as_deref(),
            self.world_size,
            self.block_size,
        )?;
        let err = |message: String| FormatError::new(object, None, message);
        if self.ranks.len() != self.world_size as usize {
            return Err(err(format!(
                "lists {} ranks for world_size {}",
                self.ranks.len(),
                self.world_size
            )));
        }
        for (i, entry) in self.ranks.iter().enumerate() {
            if entry.rank as usize != i {
                return Err(err(format!("rank entry {i} is for rank {}", entry.rank)));
            }
            check_object_name(&entry.part, object, "part")?;
            check_object_name(&entry.file, object, "file")?;
            if entry.part_bytes > MAX_PART_BYTES {
                return Err(err(format!(
                    "part {} claims {} bytes, above the {MAX_PART_BYTES}-byte limit",
                    entry.part, entry.part_bytes
                )));
            }
        }
        if let Some(rank) = self.global_state_rank
            && rank >= self.world_size
        {
            return Err(err(format!("global_state_rank {rank} is not a rank")));
        }
        if let Some(health) = &self.health {
            if self.format_version < HEALTH_VERSION {
                return Err(err(format!(
                    "format_version {} carries health, which version {HEALTH_VERSION} introduced",
                    self.format_version
                )));
            }
            health.validate(object)?;
        }
        for pair in self.tensors.windows(2) {
            if pair[0].name >= pair[1].name {
                return Err(err(format!(
                    "tensors must be sorted by name without repeats: {:?} comes before {:?}",
                    pair[0].name, pair[1].name
                )));
            }
        }
        // Before version 3 a rank holds at most one box of a tensor; each shared
        // layout is checked for it once.
        let mut one_box_checked =
            vec![self.format_version >= super::SEVERAL_BOXES_VERSION; self.layouts.len()];
        for tensor in &self.tensors {
            check_shape(&tensor.shape, tensor.dtype, object, &tensor.name)?;
            let layout = self.layouts.get(tensor.layout as usize).ok_or_else(|| {
                err(format!(
                    "tensor {:?} refers to layout {} of {}",
                    tensor.name,
                    tensor.layout,
                    self.layouts.len()
                ))
            })?;
            check_layout(layout, tensor, self.world_size, object)?;
            if !std::mem::replace(&mut one_box_checked[tensor.layout as usize], true) {
                check_one_box_per_rank(layout, tensor, self.format_version, object)?;
            }
        }
        Ok(())
    }

    /// What is known of the checkpoint's health.
    pub fn health_status(&self) -> HealthStatus<'_> {
        match &self.health {
            Some(health) if health.healthy => HealthStatus::Healthy,
            Some(health) => HealthStatus::Unhealthy(&health.reasons),
            None => HealthStatus::Unknown,
        }
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    /// Total raw bytes of tensor data.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| tensor_bytes(t.dtype, &t.shape).unwrap_or(0))
            .sum()
    }
}
