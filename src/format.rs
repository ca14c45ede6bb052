//! On-storage format, version 1: object names, the manifest, the rank parts, and the
//! safetensors header of rank data files. Normative description: `docs/FORMAT.md`.
//!
//! Everything here parses untrusted bytes: sizes are capped before allocating,
//! arithmetic is checked, names are confined to the checkpoint directory, and every
//! failure is a [`FormatError`] naming the object and, where known, the byte offset.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::region::Region;

/// The format version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Name of the commit object inside a step directory.
pub const MANIFEST: &str = "manifest.json";
/// Name of the hint object at the root (the newest committed step, as text).
pub const LATEST: &str = "latest";
/// Largest `manifest.json` accepted.
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;
/// Largest rank part accepted.
pub const MAX_PART_BYTES: u64 = 256 << 20;
/// Largest safetensors header accepted (safetensors' own limit).
pub const MAX_HEADER_BYTES: u64 = 100 << 20;
/// Most dimensions of a tensor.
pub const MAX_DIMS: usize = 32;
/// Largest world size.
pub const MAX_WORLD_SIZE: u32 = 1 << 20;
/// Smallest and largest block size.
pub const MIN_BLOCK_SIZE: u64 = 4 << 10;
/// Largest block size.
pub const MAX_BLOCK_SIZE: u64 = 256 << 20;
/// Layouts with at most this many boxes are checked pairwise for overlaps.
pub const OVERLAP_CHECK_LIMIT: usize = 512;
/// Largest tensor, in bytes (2^60).
pub const MAX_TENSOR_BYTES: u64 = 1 << 60;

/// The directory of one checkpoint: `step-00000120`.
pub fn step_dir(step: u64) -> String {
    format!("step-{step:08}")
}

/// Parses a step directory name back into its step.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A rank's data file: `rank-00003.safetensors`, or `.safetensors.zst` compressed.
pub fn rank_file_name(rank: u32, compressed: bool) -> String {
    if compressed {
        format!("rank-{rank:05}.safetensors.zst")
    } else {
        format!("rank-{rank:05}.safetensors")
    }
}

/// A rank's part of the manifest: `rank-00003.json`.
pub fn rank_part_name(rank: u32) -> String {
    format!("rank-{rank:05}.json")
}

/// Parses `rank-00003.json` back into its rank.
pub fn parse_rank_part_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("rank-")?.strip_suffix(".json")?;
    if digits.len() < 5 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
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

type FResult<T> = Result<T, FormatError>;

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

/// Which rank holds which box of a tensor. Layouts are shared by tensors with the
/// same chunking, which keeps the manifest small at thousands of ranks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Dim-0 split: rank `r` holds rows `dim0[r]..dim0[r+1]` and every other
    /// dimension whole. `world_size + 1` non-decreasing boundaries from 0 to the
    /// number of rows.
    Dim0(Vec<u64>),
    /// Any boxes, each held by one rank.
    Boxes(Vec<LayoutBox>),
}

/// One box of a [`Layout::Boxes`] layout.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayoutBox {
    /// Rank whose file holds the box.
    pub rank: u32,
    /// Start of the box per dimension.
    pub offsets: Vec<u64>,
    /// Extent of the box per dimension.
    pub lengths: Vec<u64>,
}

impl Layout {
    /// The (rank, box) pairs of a tensor of `shape` under this layout, empty boxes
    /// left out.
    pub fn boxes(&self, shape: &[u64]) -> Vec<(u32, Region)> {
        match self {
            Layout::Dim0(bounds) => bounds
                .windows(2)
                .enumerate()
                .filter(|(_, w)| w[1] > w[0])
                .map(|(rank, w)| (rank as u32, Region::rows(shape, w[0], w[1] - w[0])))
                .collect(),
            Layout::Boxes(boxes) => boxes
                .iter()
                .map(|b| (b.rank, Region::new(b.offsets.clone(), b.lengths.clone())))
                .filter(|(_, r)| !r.is_empty())
                .collect(),
        }
    }

    /// The (rank, box) pairs that meet `want`, with the common part.
    pub fn overlapping(&self, shape: &[u64], want: &Region) -> Vec<(u32, Region, Region)> {
        match self {
            Layout::Dim0(bounds) if !shape.is_empty() => {
                let lo = want.offsets[0];
                let hi = lo + want.lengths[0];
                // First rank whose rows end after `lo`.
                let first = bounds.partition_point(|&b| b <= lo).saturating_sub(1);
                let mut out = Vec::new();
                for rank in first..bounds.len().saturating_sub(1) {
                    if bounds[rank] >= hi {
                        break;
                    }
                    if bounds[rank + 1] <= bounds[rank] {
                        continue;
                    }
                    let chunk = Region::rows(shape, bounds[rank], bounds[rank + 1] - bounds[rank]);
                    if let Some(part) = chunk.intersect(want) {
                        out.push((rank as u32, chunk, part));
                    }
                }
                out
            }
            _ => self
                .boxes(shape)
                .into_iter()
                .filter_map(|(rank, chunk)| chunk.intersect(want).map(|part| (rank, chunk, part)))
                .collect(),
        }
    }
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

/// The root manifest, `step-NNNNNNNN/manifest.json`: its presence is the commit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Training step.
    pub step: u64,
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

/// A rank's part of the manifest, `step-NNNNNNNN/rank-RRRRR.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankPart {
    /// Always [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Training step.
    pub step: u64,
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
}

// ------------------------------------------------------------------ envelope

const ENVELOPE_PREFIX: &str = "{\"crc32\":\"";
const ENVELOPE_MIDDLE: &str = "\",\"body\":";

/// Wraps a JSON body as `{"crc32":"xxxxxxxx","body":BODY}`, the CRC32 taken over
/// the exact bytes of BODY.
pub fn seal(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 40);
    out.extend_from_slice(ENVELOPE_PREFIX.as_bytes());
    out.extend_from_slice(format!("{:08x}", crc32fast::hash(body)).as_bytes());
    out.extend_from_slice(ENVELOPE_MIDDLE.as_bytes());
    out.extend_from_slice(body);
    out.push(b'}');
    out
}

/// Checks the envelope and its CRC and returns BODY and its offset in `bytes`.
pub fn unseal<'a>(bytes: &'a [u8], object: &str, cap: u64) -> FResult<(&'a [u8], usize)> {
    if bytes.len() as u64 > cap {
        return Err(FormatError::new(
            object,
            None,
            format!("{} bytes exceeds the {cap}-byte limit", bytes.len()),
        ));
    }
    let header_len = ENVELOPE_PREFIX.len() + 8 + ENVELOPE_MIDDLE.len();
    let bad =
        |offset: usize, what: &str| FormatError::new(object, Some(offset as u64), what.to_string());
    if bytes.len() < header_len + 1 {
        return Err(bad(
            bytes.len(),
            "truncated: too short for a checksummed JSON object",
        ));
    }
    if !bytes.starts_with(ENVELOPE_PREFIX.as_bytes()) {
        return Err(bad(
            0,
            "not a checksummed JSON object (expected {\"crc32\":\"...\",\"body\":...})",
        ));
    }
    let hex = &bytes[ENVELOPE_PREFIX.len()..ENVELOPE_PREFIX.len() + 8];
    let expected = std::str::from_utf8(hex)
        .ok()
        .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| bad(ENVELOPE_PREFIX.len(), "crc32 is not 8 hex digits"))?;
    if &bytes[ENVELOPE_PREFIX.len() + 8..header_len] != ENVELOPE_MIDDLE.as_bytes() {
        return Err(bad(
            ENVELOPE_PREFIX.len() + 8,
            "expected \",\"body\": after the crc32",
        ));
    }
    if bytes.last() != Some(&b'}') {
        return Err(bad(bytes.len() - 1, "truncated: missing the closing brace"));
    }
    let body = &bytes[header_len..bytes.len() - 1];
    let actual = crc32fast::hash(body);
    if actual != expected {
        return Err(bad(
            header_len,
            &format!("checksum mismatch: body has crc32 {actual:08x}, header says {expected:08x}"),
        ));
    }
    Ok((body, header_len))
}

fn parse_json<T: for<'de> Deserialize<'de>>(
    body: &[u8],
    body_offset: usize,
    object: &str,
) -> FResult<T> {
    serde_json::from_slice(body).map_err(|e| {
        let offset = byte_offset(body, e.line(), e.column()) + body_offset;
        FormatError::new(object, Some(offset as u64), format!("invalid JSON: {e}"))
    })
}

/// Converts serde_json's 1-based line and column into a byte offset.
fn byte_offset(text: &[u8], line: usize, column: usize) -> usize {
    let mut offset = 0;
    for _ in 1..line.max(1) {
        match text[offset..].iter().position(|&b| b == b'\n') {
            Some(i) => offset += i + 1,
            None => return text.len(),
        }
    }
    (offset + column.saturating_sub(1)).min(text.len())
}

// ------------------------------------------------------------------ validation

/// A name inside the checkpoint directory: one path segment, no `..`, no `/`.
pub fn check_object_name(name: &str, object: &str, what: &str) -> FResult<()> {
    let bad = |why: &str| FormatError::new(object, None, format!("{what} {name:?} {why}"));
    if name.is_empty() || name.len() > 255 {
        return Err(bad("must be 1 to 255 bytes long"));
    }
    if name == "." || name == ".." || name.contains("..") {
        return Err(bad("must not contain '..'"));
    }
    if name.contains('/') || name.contains('\\') || name.contains('\0') {
        return Err(bad(
            "must be a plain name inside the checkpoint (no '/', '\\' or NUL)",
        ));
    }
    Ok(())
}

fn tensor_bytes(dtype: DType, lengths: &[u64]) -> Option<u64> {
    lengths
        .iter()
        .try_fold(dtype.size() as u64, |acc, &l| acc.checked_mul(l))
        .filter(|&b| b <= MAX_TENSOR_BYTES)
}

fn check_shape(shape: &[u64], dtype: DType, object: &str, tensor: &str) -> FResult<()> {
    if shape.len() > MAX_DIMS {
        return Err(FormatError::new(
            object,
            None,
            format!(
                "tensor {tensor:?} has {} dimensions, more than {MAX_DIMS}",
                shape.len()
            ),
        ));
    }
    if tensor_bytes(dtype, shape).is_none() {
        return Err(FormatError::new(
            object,
            None,
            format!("tensor {tensor:?} of shape {shape:?} exceeds {MAX_TENSOR_BYTES} bytes"),
        ));
    }
    Ok(())
}

fn check_common(object: &str, version: u32, world: u32, block: u64) -> FResult<()> {
    if version != FORMAT_VERSION {
        return Err(FormatError::new(
            object,
            None,
            format!("unsupported format_version {version} (this build reads {FORMAT_VERSION})"),
        ));
    }
    if world == 0 || world > MAX_WORLD_SIZE {
        return Err(FormatError::new(
            object,
            None,
            format!("world_size {world} is outside 1..={MAX_WORLD_SIZE}"),
        ));
    }
    if !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block) {
        return Err(FormatError::new(
            object,
            None,
            format!("block_size {block} is outside {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}"),
        ));
    }
    Ok(())
}

impl Manifest {
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
    /// boxes lie inside it and add up to its volume.
    pub fn validate(&self, object: &str) -> FResult<()> {
        check_common(
            object,
            self.format_version,
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
        for pair in self.tensors.windows(2) {
            if pair[0].name >= pair[1].name {
                return Err(err(format!(
                    "tensors must be sorted by name without repeats: {:?} comes before {:?}",
                    pair[0].name, pair[1].name
                )));
            }
        }
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
        }
        Ok(())
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

pub(crate) fn check_layout(
    layout: &Layout,
    tensor: &TensorEntry,
    world: u32,
    object: &str,
) -> FResult<()> {
    let err = |message: String| {
        FormatError::new(object, None, format!("tensor {:?}: {message}", tensor.name))
    };
    let volume: u64 = tensor.shape.iter().product();
    match layout {
        Layout::Dim0(bounds) => {
            if tensor.shape.is_empty() {
                return Err(err("a scalar cannot have a dim-0 layout".into()));
            }
            if bounds.len() != world as usize + 1 {
                return Err(err(format!(
                    "dim-0 layout has {} boundaries for world_size {world}",
                    bounds.len()
                )));
            }
            if bounds.first() != Some(&0) || bounds.last() != Some(&tensor.shape[0]) {
                return Err(err(format!(
                    "dim-0 layout must run from 0 to {} rows",
                    tensor.shape[0]
                )));
            }
            if bounds.windows(2).any(|w| w[1] < w[0]) {
                return Err(err("dim-0 boundaries decrease".into()));
            }
        }
        Layout::Boxes(boxes) => {
            let mut covered: u64 = 0;
            for b in boxes {
                if b.offsets.len() != b.lengths.len() {
                    return Err(err(format!(
                        "box has {} offsets and {} lengths",
                        b.offsets.len(),
                        b.lengths.len()
                    )));
                }
                if b.rank >= world {
                    return Err(err(format!("box held by rank {} of {world}", b.rank)));
                }
                let region = Region {
                    offsets: b.offsets.clone(),
                    lengths: b.lengths.clone(),
                };
                if !region.within(&tensor.shape) {
                    return Err(err(format!(
                        "box {region} lies outside shape {:?}",
                        tensor.shape
                    )));
                }
                covered = region
                    .volume()
                    .and_then(|v| covered.checked_add(v))
                    .ok_or_else(|| err("box volumes overflow".into()))?;
            }
            // Equal volumes and no overlap mean an exact tiling. The pairwise check
            // is quadratic, so it runs for layouts of up to OVERLAP_CHECK_LIMIT boxes;
            // larger ones rely on the volume check and on the loader's coverage check.
            if boxes.len() <= OVERLAP_CHECK_LIMIT {
                let regions: Vec<Region> = boxes
                    .iter()
                    .map(|b| Region::new(b.offsets.clone(), b.lengths.clone()))
                    .collect();
                for (i, a) in regions.iter().enumerate() {
                    for b in &regions[i + 1..] {
                        if let Some(common) = a.intersect(b) {
                            return Err(err(format!("boxes {a} and {b} overlap in {common}")));
                        }
                    }
                }
            }
            if covered != volume {
                return Err(err(format!(
                    "boxes cover {covered} elements of {volume}: chunks must tile the tensor exactly once"
                )));
            }
        }
    }
    Ok(())
}

impl RankPart {
    /// Parses and validates a sealed rank part.
    pub fn parse(bytes: &[u8], object: &str) -> FResult<RankPart> {
        let (body, offset) = unseal(bytes, object, MAX_PART_BYTES)?;
        let part: RankPart = parse_json(body, offset, object)?;
        part.validate(object)?;
        Ok(part)
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
        let mut seen: HashMap<&str, ()> = HashMap::with_capacity(self.chunks.len());
        for chunk in &self.chunks {
            if seen.insert(chunk.tensor.as_str(), ()).is_some() {
                return Err(err(format!(
                    "tensor {:?} has two chunks in one rank",
                    chunk.tensor
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
            let [begin, end] = chunk.bytes;
            let expected = tensor_bytes(chunk.dtype, &chunk.lengths).unwrap_or(u64::MAX);
            if end < begin || end - begin != expected || end > self.file.raw_bytes {
                return Err(err(format!(
                    "chunk of {:?} claims bytes {begin}..{end}; a {} box of {:?} needs {expected} bytes inside a {}-byte file",
                    chunk.tensor, chunk.dtype, chunk.lengths, self.file.raw_bytes
                )));
            }
        }
        Ok(())
    }
}

// ------------------------------------------------------------------ safetensors

/// One entry of a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Entry name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape of the stored array.
    pub shape: Vec<u64>,
    /// Byte range relative to the start of the data section.
    pub data_offsets: [u64; 2],
}

/// A parsed safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsHeader {
    /// Size of the header (8-byte length prefix included): the data section's start.
    pub data_start: u64,
    /// Entries sorted by data offset.
    pub entries: Vec<HeaderEntry>,
    /// The `__metadata__` map.
    pub metadata: BTreeMap<String, String>,
}

/// Builds a safetensors header (length prefix and JSON padded with spaces to a
/// multiple of 8) for entries packed back to back in the given order.
pub fn build_safetensors_header(
    entries: &[(String, DType, Vec<u64>)],
    metadata: &BTreeMap<String, String>,
) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert(
            "__metadata__".into(),
            serde_json::to_value(metadata).expect("metadata serializes"),
        );
    }
    let mut offset = 0u64;
    for (name, dtype, shape) in entries {
        let bytes = tensor_bytes(*dtype, shape).expect("checked by the caller");
        map.insert(
            name.clone(),
            serde_json::json!({
                "dtype": dtype.name(),
                "shape": shape,
                "data_offsets": [offset, offset + bytes],
            }),
        );
        offset += bytes;
    }
    let mut json = serde_json::to_vec(&map).expect("header serializes");
    while !(json.len() + 8).is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

/// Parses the header of a safetensors file from its first bytes. `file_size` is the
/// size of the whole file (to check that every entry lies inside it). `prefix` needs
/// only hold the header: 8 bytes, then the length those bytes announce.
pub fn parse_safetensors_header(
    prefix: &[u8],
    file_size: u64,
    object: &str,
) -> FResult<SafetensorsHeader> {
    let err = |offset: u64, message: String| FormatError::new(object, Some(offset), message);
    let len_bytes: [u8; 8] = prefix
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| {
            err(
                0,
                format!(
                    "truncated: {} bytes, a safetensors file starts with an 8-byte header length",
                    prefix.len()
                ),
            )
        })?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(err(
            0,
            format!("header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit"),
        ));
    }
    let data_start = 8 + header_len;
    if data_start > file_size {
        return Err(err(
            0,
            format!("header length {header_len} runs past the end of the {file_size}-byte file"),
        ));
    }
    let json = prefix.get(8..data_start as usize).ok_or_else(|| {
        err(
            prefix.len() as u64,
            format!(
                "truncated: header needs {data_start} bytes, have {}",
                prefix.len()
            ),
        )
    })?;
    let value: serde_json::Value = serde_json::from_slice(json).map_err(|e| {
        err(
            8 + byte_offset(json, e.line(), e.column()) as u64,
            format!("invalid header JSON: {e}"),
        )
    })?;
    let map = value
        .as_object()
        .ok_or_else(|| err(8, "header is not a JSON object".into()))?;
    let mut entries = Vec::with_capacity(map.len());
    let mut metadata = BTreeMap::new();
    for (name, entry) in map {
        if name == "__metadata__" {
            let meta = entry
                .as_object()
                .ok_or_else(|| err(8, "__metadata__ is not an object".into()))?;
            for (k, v) in meta {
                let v = v.as_str().ok_or_else(|| {
                    err(8, format!("__metadata__ value of {k:?} is not a string"))
                })?;
                metadata.insert(k.clone(), v.to_string());
            }
            continue;
        }
        let bad = |why: &str| err(8, format!("entry {name:?}: {why}"));
        let dtype: DType = entry
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("missing dtype"))?
            .parse()
            .map_err(|e: String| bad(&e))?;
        let shape: Vec<u64> = entry
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("missing shape"))?
            .iter()
            .map(|d| d.as_u64().ok_or_else(|| bad("shape holds a non-integer")))
            .collect::<FResult<_>>()?;
        if shape.len() > MAX_DIMS {
            return Err(bad("too many dimensions"));
        }
        let offsets = entry
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad("data_offsets must be [begin, end]"))?;
        let begin = offsets[0]
            .as_u64()
            .ok_or_else(|| bad("data_offsets holds a non-integer"))?;
        let end = offsets[1]
            .as_u64()
            .ok_or_else(|| bad("data_offsets holds a non-integer"))?;
        let expected = tensor_bytes(dtype, &shape).ok_or_else(|| bad("absurd size"))?;
        if end < begin || end - begin != expected {
            return Err(bad(&format!(
                "data_offsets {begin}..{end} do not hold {expected} bytes of {dtype} {shape:?}"
            )));
        }
        if end.checked_add(data_start).is_none_or(|e| e > file_size) {
            return Err(bad(&format!(
                "data ends past the end of the {file_size}-byte file"
            )));
        }
        entries.push(HeaderEntry {
            name: name.clone(),
            dtype,
            shape,
            data_offsets: [begin, end],
        });
    }
    entries.sort_by_key(|e| e.data_offsets);
    let mut cursor = 0;
    for entry in &entries {
        if entry.data_offsets[0] != cursor {
            return Err(err(
                data_start + cursor,
                format!(
                    "entry {:?} starts at data offset {} where {cursor} was expected (gap or overlap)",
                    entry.name, entry.data_offsets[0]
                ),
            ));
        }
        cursor = entry.data_offsets[1];
    }
    Ok(SafetensorsHeader {
        data_start,
        entries,
        metadata,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips_and_detects_flips() {
        let sealed = seal(br#"{"a":1}"#);
        let (body, offset) = unseal(&sealed, "m", 1 << 20).unwrap();
        assert_eq!(body, br#"{"a":1}"#);
        assert_eq!(&sealed[offset..offset + body.len()], body);
        let mut flipped = sealed.clone();
        flipped[offset + 5] ^= 0x01;
        let e = unseal(&flipped, "m", 1 << 20).unwrap_err();
        assert!(e.message.contains("checksum mismatch"), "{e}");
        assert!(unseal(&sealed[..sealed.len() - 1], "m", 1 << 20).is_err());
        assert!(
            unseal(&sealed, "m", 4)
                .unwrap_err()
                .message
                .contains("limit")
        );
    }

    #[test]
    fn json_errors_carry_byte_offsets() {
        let body = b"{\n  \"a\": tru\n}";
        let e = parse_json::<serde_json::Value>(body, 100, "obj").unwrap_err();
        let offset = e.offset.unwrap();
        assert!((100 + 9..=100 + 13).contains(&offset), "{e}");
    }

    #[test]
    fn names_are_confined() {
        for bad in ["", "..", "../x", "a/b", "a\\b", "x\0", "a..b"] {
            assert!(check_object_name(bad, "m", "file").is_err(), "{bad:?}");
        }
        check_object_name("rank-00001.safetensors", "m", "file").unwrap();
    }

    #[test]
    fn step_and_rank_names_round_trip() {
        assert_eq!(parse_step_dir(&step_dir(120)), Some(120));
        assert_eq!(parse_step_dir("step-12"), None);
        assert_eq!(parse_step_dir("step-0000001x"), None);
        assert_eq!(parse_rank_part_name(&rank_part_name(3)), Some(3));
        assert_eq!(parse_rank_part_name("rank-3.json"), None);
    }

    #[test]
    fn safetensors_header_round_trips_through_the_reference_reader() {
        let entries = vec![
            ("a".to_string(), DType::F32, vec![2, 3]),
            ("b".to_string(), DType::BF16, vec![4]),
        ];
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "ckpt".to_string());
        let mut file = build_safetensors_header(&entries, &meta);
        let header_len = file.len() as u64;
        file.extend(std::iter::repeat_n(7u8, 24 + 8));
        let parsed = parse_safetensors_header(&file, file.len() as u64, "f").unwrap();
        assert_eq!(parsed.data_start, header_len);
        assert_eq!(parsed.entries[1].data_offsets, [24, 32]);
        assert_eq!(parsed.metadata["format"], "ckpt");
        let reference = safetensors::SafeTensors::deserialize(&file).unwrap();
        assert_eq!(reference.tensor("a").unwrap().shape(), &[2, 3]);
    }

    #[test]
    fn hostile_headers_are_refused_without_allocating() {
        let mut huge = u64::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        let e = parse_safetensors_header(&huge, 10, "f").unwrap_err();
        assert!(e.message.contains("limit"), "{e}");
        assert!(parse_safetensors_header(&[1, 2], 2, "f").is_err());
        let mut past = 100u64.to_le_bytes().to_vec();
        past.extend_from_slice(b"{}");
        assert!(
            parse_safetensors_header(&past, 10, "f")
                .unwrap_err()
                .message
                .contains("past the end")
        );
    }
}
