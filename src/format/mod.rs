//! On-storage format (version 4; versions 3, 2 and 1 are still read): object names, the
//! manifest, the rank parts, and the safetensors header of rank data files. Normative
//! description: `docs/FORMAT.md`.
//!
//! Version 3 lets a rank hold several disjoint boxes of one tensor (a `ShardedTensor`
//! whose spec gives a rank two shards, pieces a resharding leaves on one rank). A
//! writer gives each document the lowest version that describes it ([`version_for`]),
//! so a checkpoint whose ranks hold one box per tensor stays readable by builds that
//! read only version 2.
//!
//! Version 4 adds health to the parts and the manifest ([`health`]): what the save
//! found of non-finite values, of replicas that disagree and of the caller's
//! metrics. A manifest without it has health unknown.
//!
//! Everything here parses untrusted bytes: sizes are capped before allocating,
//! arithmetic is checked, names are confined to the checkpoint directory, and every
//! failure is a [`FormatError`] naming the object and, where known, the byte offset.
//!
//! The module is split by concern so each parser can be read (and fuzzed) alone:
//! [`names`] for object names, [`envelope`] for the checksummed JSON wrapper,
//! [`limits`] for the caps and the checks every object shares, [`health`] for what
//! a save knew of the state it wrote, [`manifest`] for the
//! commit object, [`layout`] for which rank holds which box, [`part`] for a rank's
//! part, [`agreement`] for what the manifest and a part must both say, and
//! [`safetensors`] for the header of the data files. Everything is
//! re-exported here, so callers name `crate::format::X` whatever file `X` lives in.

use std::fmt;

pub mod agreement;
pub mod envelope;
pub mod health;
pub mod layout;
pub mod limits;
pub mod manifest;
pub mod names;
pub mod part;
pub mod safetensors;
mod tiling;

pub use agreement::Assignments;
pub use envelope::{seal, unseal};
pub use health::{
    ChunkNonFinite, HEALTH_VERSION, Health, HealthStatus, Metric, NonFinite, PartHealth,
    ReplicaCrcs, ReplicaMismatch, ReplicaPolicy, count_nonfinite,
};
pub(crate) use layout::check_layout;
pub use layout::{Layout, LayoutBox};
pub use limits::{
    MAX_BLOCK_SIZE, MAX_DIMS, MAX_HEADER_BYTES, MAX_MANIFEST_BYTES, MAX_PART_BYTES,
    MAX_TENSOR_BYTES, MAX_WORLD_SIZE, MIN_BLOCK_SIZE,
};
pub use manifest::{Codec, Manifest, RankEntry, TensorEntry};
pub use names::{
    LATEST, MANIFEST, check_object_name, parse_rank_part_name, parse_step_dir, rank_file_name,
    rank_part_name, step_dir,
};
pub use part::{Chunk, ChunkIndex, FileEntry, RankPart, StateValue};
pub use safetensors::{
    HeaderEntry, SafetensorsHeader, build_safetensors_header, entry_names, parse_safetensors_header,
};

/// The newest format version this code reads and writes.
pub const FORMAT_VERSION: u32 = 4;
/// The oldest version this build still reads.
pub const OLDEST_READABLE_VERSION: u32 = 1;
/// The first version in which a rank may hold several boxes of one tensor.
pub const SEVERAL_BOXES_VERSION: u32 = 3;

/// The version a writer gives a data file, a rank part or a manifest: the lowest
/// that describes it. Version 2 when every rank holds at most one box of each
/// tensor (readers of version 2 then read it), [`SEVERAL_BOXES_VERSION`] when some
/// rank holds several.
pub fn version_for(several_boxes_per_rank: bool) -> u32 {
    if several_boxes_per_rank {
        SEVERAL_BOXES_VERSION
    } else {
        2
    }
}

/// The version of a rank part or manifest that carries health: at least
/// [`HEALTH_VERSION`]. Data files carry none and keep [`version_for`].
pub fn version_with_health(several_boxes_per_rank: bool) -> u32 {
    version_for(several_boxes_per_rank).max(HEALTH_VERSION)
}

/// True when some name occurs more than once in `tensors` (one name per box of a
/// rank): the rank holds several boxes of that tensor.
pub fn repeats_a_tensor<'a>(tensors: impl IntoIterator<Item = &'a str>) -> bool {
    let mut seen = std::collections::HashSet::new();
    tensors.into_iter().any(|name| !seen.insert(name))
}

/// A malformed, hostile or inconsistent checkpoint object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct FormatError {
    /// The object (key relative to the store root) at fault.
    pub object: String,
    /// Byte offset in the object where the fault was found, when known.
    pub offset: Option<u64>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.offset {
            Some(offset) => write!(f, "{} at byte {offset}: {}", self.object, self.message),
            None => write!(f, "{}: {}", self.object, self.message),
        }
    }
}

impl FormatError {
    pub(crate) fn new(object: &str, offset: Option<u64>, message: impl Into<String>) -> Self {
        Self {
            object: object.to_string(),
            offset,
            message: message.into(),
        }
    }
}

pub(crate) type FResult<T> = Result<T, FormatError>;
