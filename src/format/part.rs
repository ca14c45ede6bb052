//! A rank's part of the manifest, `rank-RRRRR.json`: its data file, the boxes in it,
//! and its non-tensor state, with the structural checks run on every part read.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::envelope::{parse_json, seal, unseal};
use super::health::{HEALTH_VERSION, PartHealth};
use super::limits::{MAX_PART_BYTES, check_common, check_shape, tensor_bytes};
use super::manifest::Codec;
use super::names::check_object_name;
use super::{FResult, FormatError};
use crate::dtype::DType;
use crate::region::Region;

/// A non-tensor value: JSON, or opaque bytes (stored base64).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StateValue {
    /// A JSON value (data-loader position, scheduler state, user metadata).
    Json(serde_json::Value),
    /// Opaque bytes (RNG state), base64 in the manifest.
    Base64(String),
}

impl StateValue {
    /// Wraps bytes.
    pub fn bytes(data: &[u8]) -> Self {
        use base64::Engine;
        StateValue::Base64(base64::engine::general_purpose::STANDARD.encode(data))
    }

    /// The value as bytes: decoded base64, or the JSON text.
    pub fn to_bytes(&self) -> Result<Vec<u8>, String> {
        use base64::Engine;
        match self {
            StateValue::Json(value) => serde_json::to_vec(value).map_err(|e| e.to_string()),
            StateValue::Base64(text) => base64::engine::general_purpose::STANDARD
                .decode(text)
                .map_err(|e| format!("invalid base64: {e}")),
        }
    }

    /// The JSON value, when this is JSON.
    pub fn as_json(&self) -> Option<&serde_json::Value> {
        match self {
            StateValue::Json(value) => Some(value),
            StateValue::Base64(_) => None,
        }
    }
}

/// A rank's data file as described by its part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the step directory.
    pub name: String,
    /// Size of the plain safetensors file.
    pub raw_bytes: u64,
    /// Size as stored (equals `raw_bytes` when uncompressed).
    pub stored_bytes: u64,
    /// CRC32 of every block of raw bytes, in order; the last block may be short.
    pub block_crc32: Vec<u32>,
    /// Compressed size of every frame (one per block); empty when uncompressed.
    #[serde(default)]
    pub frame_bytes: Vec<u64>,
}

/// One box stored in a rank's file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// Global tensor name.
    pub tensor: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Box offsets.
    pub offsets: Vec<u64>,
    /// Box lengths.
    pub lengths: Vec<u64>,
    /// Raw byte range `[begin, end)` of the box's data (row-major) in the file.
    pub bytes: [u64; 2],
}

impl Chunk {
    /// The chunk's box.
    pub fn region(&self) -> Region {
        Region::new(self.offsets.clone(), self.lengths.clone())
    }
}

/// A part's chunks found by tensor and box, in constant time per lookup: since
/// version 3 a rank may hold several boxes of one tensor, so the tensor's name alone
/// no longer finds its chunk.
#[derive(Debug)]
pub struct ChunkIndex<'a> {
    by_box: HashMap<(&'a str, &'a [u64], &'a [u64]), &'a Chunk>,
}

impl<'a> ChunkIndex<'a> {
    /// Indexes the chunks of `part`.
    pub fn new(part: &'a RankPart) -> Self {
        let by_box = part
            .chunks
            .iter()
            .map(|c| ((c.tensor.as_str(), &c.offsets[..], &c.lengths[..]), c))
            .collect();
        Self { by_box }
    }

    /// The chunk of `tensor` whose box is exactly `region`.
    pub fn get(&self, tensor: &str, region: &Region) -> Option<&'a Chunk> {
        self.by_box
            .get(&(tensor, &region.offsets[..], &region.lengths[..]))
            .copied()
    }
}

/// A rank's part of the manifest, `rank-RRRRR.json` in the save attempt's directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankPart {
    /// [`FORMAT_VERSION`](super::FORMAT_VERSION) when written by this build; 1 for
    /// older checkpoints.
    pub format_version: u32,
    /// Training step.
    pub step: u64,
    /// The save attempt's directory name inside the step directory (version 2;
    /// `None` in version 1, whose objects lie directly in the step directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
    /// This rank.
    pub rank: u32,
    /// Ranks that saved.
    pub world_size: u32,
    /// Generation of the world that saved.
    pub generation: u64,
    /// Block size of checksums and frames.
    pub block_size: u64,
    /// Encoding of the data file.
    pub codec: Codec,
    /// The data file.
    pub file: FileEntry,
    /// Boxes in the file.
    pub chunks: Vec<Chunk>,
    /// Global non-tensor state (present in one rank's part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_state: Option<BTreeMap<String, StateValue>>,
    /// This rank's own non-tensor state.
    #[serde(default)]
    pub rank_state: BTreeMap<String, StateValue>,
    /// User metadata (from the rank that carries the global state).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// What the save found of the state's health (version 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<PartHealth>,
}

impl RankPart {
    /// Parses and validates a sealed rank part.
    pub fn parse(bytes: &[u8], object: &str) -> FResult<RankPart> {
        let (body, offset) = unseal(bytes, object, MAX_PART_BYTES)?;
        let part: RankPart = parse_json(body, offset, object)?;
        part.validate(object)?;
        Ok(part)
    }

    /// The `world_size` that the leading fields of a part give, from a prefix of the
    /// part object (the reference writer puts it fifth, within the first few hundred
    /// bytes). Unchecked, since the CRC covers the whole object: for listing a save
    /// that never committed, which must not read a part of any size whole. `None`
    /// when the prefix is not an envelope or does not reach the field.
    pub fn peek_world_size(prefix: &[u8]) -> Option<u32> {
        use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

        struct Fields<'a>(&'a std::cell::Cell<Option<u32>>);
        impl<'de> Visitor<'de> for Fields<'_> {
            type Value = ();
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a rank part")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "world_size" {
                        self.0.set(Some(map.next_value()?));
                        return Ok(());
                    }
                    map.next_value::<IgnoredAny>()?;
                }
                Ok(())
            }
        }
        let found = std::cell::Cell::new(None);
        let body = super::envelope::body_prefix(prefix)?;
        // The prefix ends mid-object: the error at its end is expected; what the
        // visitor saw before it stands.
        let _ = serde_json::Deserializer::from_slice(body).deserialize_map(Fields(&found));
        found.get()
    }

    /// Serializes and seals.
    pub fn to_bytes(&self) -> Vec<u8> {
        seal(&serde_json::to_vec(self).expect("rank part serializes"))
    }

    /// Number of blocks in the file.
    pub fn block_count(&self) -> u64 {
        self.file.raw_bytes.div_ceil(self.block_size)
    }

    /// Structural checks: sizes, names, checksum table, chunk byte ranges.
    pub fn validate(&self, object: &str) -> FResult<()> {
        check_common(
            object,
            self.format_version,
            self.attempt.as_deref(),
            self.world_size,
            self.block_size,
        )?;
        let err = |message: String| FormatError::new(object, None, message);
        if self.rank >= self.world_size {
            return Err(err(format!(
                "rank {} of world_size {}",
                self.rank, self.world_size
            )));
        }
        check_object_name(&self.file.name, object, "file")?;
        let blocks = self.block_count();
        if self.file.block_crc32.len() as u64 != blocks {
            return Err(err(format!(
                "file {} has {} block checksums for {} raw bytes in blocks of {} (expected {blocks})",
                self.file.name,
                self.file.block_crc32.len(),
                self.file.raw_bytes,
                self.block_size
            )));
        }
        match self.codec {
            Codec::None => {
                if self.file.stored_bytes != self.file.raw_bytes
                    || !self.file.frame_bytes.is_empty()
                {
                    return Err(err(format!(
                        "uncompressed file {} stores {} bytes of {} raw, with {} frames",
                        self.file.name,
                        self.file.stored_bytes,
                        self.file.raw_bytes,
                        self.file.frame_bytes.len()
                    )));
                }
            }
            Codec::Zstd { .. } => {
                if self.file.frame_bytes.len() as u64 != blocks {
                    return Err(err(format!(
                        "compressed file {} has {} frames for {blocks} blocks",
                        self.file.name,
                        self.file.frame_bytes.len()
                    )));
                }
                let total = self
                    .file
                    .frame_bytes
                    .iter()
                    .try_fold(0u64, |acc, &f| acc.checked_add(f))
                    .ok_or_else(|| err("frame sizes overflow".into()))?;
                if total != self.file.stored_bytes {
                    return Err(err(format!(
                        "frames add up to {total} bytes, file {} stores {}",
                        self.file.name, self.file.stored_bytes
                    )));
                }
            }
        }
        // Version 3 lets a rank hold several boxes of one tensor, each listed once;
        // before it, a tensor has one chunk per part. That the boxes of one tensor
        // are disjoint follows from the manifest: each chunk must be one of the boxes
        // its layout gives this rank (`Assignments::check_part`), and those tile the
        // tensor. A box listed twice would pass that count with another missing, so
        // it is refused here.
        let several = self.format_version >= super::SEVERAL_BOXES_VERSION;
        let mut tensors: HashSet<&str> = HashSet::new();
        let mut boxes: HashSet<(&str, &[u64], &[u64])> = HashSet::new();
        if several {
            boxes.reserve(self.chunks.len());
        } else {
            tensors.reserve(self.chunks.len());
        }
        for chunk in &self.chunks {
            if !several && !tensors.insert(chunk.tensor.as_str()) {
                return Err(err(format!(
                    "tensor {:?} has two chunks in one rank, which format_version {} does not allow (version {} does)",
                    chunk.tensor,
                    self.format_version,
                    super::SEVERAL_BOXES_VERSION
                )));
            }
            check_shape(&chunk.shape, chunk.dtype, object, &chunk.tensor)?;
            let region = Region {
                offsets: chunk.offsets.clone(),
                lengths: chunk.lengths.clone(),
            };
            if chunk.offsets.len() != chunk.lengths.len() || !region.within(&chunk.shape) {
                return Err(err(format!(
                    "chunk of {:?} with box offsets {:?} lengths {:?} lies outside shape {:?}",
                    chunk.tensor, chunk.offsets, chunk.lengths, chunk.shape
                )));
            }
            if several && !boxes.insert((&chunk.tensor, &chunk.offsets, &chunk.lengths)) {
                return Err(err(format!(
                    "tensor {:?} lists box {region} twice",
                    chunk.tensor
                )));
            }
            let [begin, end] = chunk.bytes;
            let expected = tensor_bytes(chunk.dtype, &chunk.lengths).unwrap_or(u64::MAX);
            if end < begin || end - begin != expected || end > self.file.raw_bytes {
                return Err(err(format!(
                    "chunk of {:?} claims bytes {begin}..{end}; a {} box of {:?} needs {expected} bytes inside a {}-byte file",
                    chunk.tensor, chunk.dtype, chunk.lengths, self.file.raw_bytes
                )));
            }
        }
        if let Some(health) = &self.health {
            if self.format_version < HEALTH_VERSION {
                return Err(err(format!(
                    "format_version {} carries health, which version {HEALTH_VERSION} introduced",
                    self.format_version
                )));
            }
            health.validate(&self.chunks, self.block_size, object)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_world_size_is_read_from_a_prefix_and_nothing_else_passes_for_one() {
        let body = br#"{"format_version":2,"step":9,"attempt":"g00000000-0","rank":0,"world_size":4,"generation":0,"block_size":"#;
        let mut sealed = super::super::seal(body);
        sealed.pop();
        assert_eq!(RankPart::peek_world_size(&sealed), Some(4));
        assert_eq!(
            RankPart::peek_world_size(&sealed[..60]),
            None,
            "cut before the field"
        );
        assert_eq!(RankPart::peek_world_size(body), None, "not an envelope");
        let wrong = super::super::seal(br#"{"world_size":"four"}"#);
        assert_eq!(RankPart::peek_world_size(&wrong), None);
    }
}
