//! On-storage format (version 2; version 1 is still read): object names, the manifest,
//! the rank parts, and the safetensors header of rank data files. Normative description: `docs/FORMAT.md`.
//!
//! Everything here parses untrusted bytes: sizes are capped before allocating,
//! arithmetic is checked, names are confined to the checkpoint directory, and every
//! failure is a [`FormatError`] naming the object and, where known, the byte offset.
//!
//! The module is split by concern so each parser can be read (and fuzzed) alone:
//! [`names`] for object names, [`envelope`] for the checksummed JSON wrapper,
//! [`limits`] for the caps and the checks every object shares, [`manifest`] for the
//! commit object, [`layout`] for which rank holds which box, [`part`] for a rank's
//! part, [`agreement`] for what the manifest and a part must both say, and
//! [`safetensors`] for the header of the data files. Everything is
//! re-exported here, so callers name `crate::format::X` whatever file `X` lives in.

use std::fmt;

pub mod agreement;
pub mod envelope;
pub mod layout;
pub mod limits;
pub mod manifest;
pub mod names;
pub mod part;
pub mod safetensors;
mod tiling;

pub use agreement::Assignments;
pub use envelope::{seal, unseal};
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
pub use part::{Chunk, FileEntry, RankPart, StateValue};
pub use safetensors::{
    HeaderEntry, SafetensorsHeader, build_safetensors_header, parse_safetensors_header,
};

/// The format version this code writes and reads.
pub const FORMAT_VERSION: u32 = 2;
/// The oldest version this build still reads.
pub const OLDEST_READABLE_VERSION: u32 = 1;

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
