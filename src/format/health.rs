//! Health (format version 4): what a save knew about the state it wrote, beside the
//! bytes themselves. The block CRCs prove that the bytes read are the bytes written;
//! they say nothing of a state that was already wrong when it was written (a NaN, a
//! bit flipped in one replica's memory). So each rank part records what its save
//! found on the way through the bytes it staged anyway, and the committer, which
//! reads every part, judges the checkpoint once for every reader:
//!
//! - per box of a float tensor, how many elements are not finite;
//! - per replicated box (a box several ranks hold), the CRC32 of each `block_size`
//!   slice of the box's bytes on every holder, the writer's and the others', which
//!   the committer compares;
//! - the caller's metrics (`loss`, `grad_norm`, …) and, when its own check failed,
//!   why.
//!
//! The manifest's [`Health`] is the verdict: healthy, or the reasons it is not. A
//! manifest without it (versions 1 to 3) has health *unknown*; readers that pick
//! "the newest healthy checkpoint" take such a checkpoint, since nothing is known
//! against it.
//!
//! JSON has no NaN or infinity, and those are exactly the metrics worth keeping, so a
//! [`Metric`] that is not finite is written as the string `"NaN"`, `"inf"` or
//! `"-inf"`.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::limits::tensor_bytes;
use super::part::Chunk;
use super::{FResult, FormatError};
use crate::dtype::DType;

/// The first format version whose manifests and parts carry health.
pub const HEALTH_VERSION: u32 = 4;

/// Reasons a manifest lists in full; past that, one line says how many more there
/// were (a world of 16,384 ranks that all disagree must not make a huge manifest).
pub const MAX_REASONS: usize = 32;

/// Replica mismatches, non-finite tensors and metrics a manifest lists at most.
pub const MAX_HEALTH_ENTRIES: usize = 256;

/// Differing block indices listed per replica mismatch.
pub const MAX_BLOCKS_LISTED: usize = 16;

/// A caller's scalar metric. Serialized as a JSON number when finite, else as
/// `"NaN"`, `"inf"` or `"-inf"`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Metric(pub f64);

impl Serialize for Metric {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let x = self.0;
        if x.is_finite() {
            s.serialize_f64(x)
        } else if x.is_nan() {
            s.serialize_str("NaN")
        } else if x > 0.0 {
            s.serialize_str("inf")
        } else {
            s.serialize_str("-inf")
        }
    }
}

impl<'de> Deserialize<'de> for Metric {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(f64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(x) => Ok(Metric(x)),
            Raw::Text(text) => match text.as_str() {
                "NaN" => Ok(Metric(f64::NAN)),
                "inf" => Ok(Metric(f64::INFINITY)),
                "-inf" => Ok(Metric(f64::NEG_INFINITY)),
                other => Err(serde::de::Error::custom(format!(
                    "metric {other:?} is neither a number nor NaN, inf or -inf"
                ))),
            },
        }
    }
}

impl fmt::Display for Metric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What a save does when the holders of a replicated box disagree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplicaPolicy {
    /// Commit, marked unhealthy, with a warning naming the ranks.
    #[default]
    Warn,
    /// Refuse the commit: the previous checkpoint stays the newest.
    Fail,
    /// Do not compare: replicas that another rank writes are not staged at all.
    Off,
}

impl ReplicaPolicy {
    /// Its name, as in a configuration: `warn`, `fail` or `off`.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaPolicy::Warn => "warn",
            ReplicaPolicy::Fail => "fail",
            ReplicaPolicy::Off => "off",
        }
    }
}

impl std::str::FromStr for ReplicaPolicy {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "warn" => Ok(ReplicaPolicy::Warn),
            "fail" => Ok(ReplicaPolicy::Fail),
            "off" => Ok(ReplicaPolicy::Off),
            other => Err(format!(
                "replica_mismatch must be \"warn\", \"fail\" or \"off\", not {other:?}"
            )),
        }
    }
}

impl fmt::Display for ReplicaPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Non-finite elements found in one chunk of a rank's file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkNonFinite {
    /// Index of the chunk in the part's `chunks`.
    pub chunk: u32,
    /// Elements that are NaN or infinite.
    pub elements: u64,
}

/// The CRC32s of one replicated box as one holder has it: one per `block_size`
/// slice of the box's row-major bytes, counted from the box's first byte (not the
/// file's), so every holder's list lines up whatever else its file holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaCrcs {
    /// Global tensor name.
    pub tensor: String,
    /// Element type.
    pub dtype: DType,
    /// Box offsets.
    pub offsets: Vec<u64>,
    /// Box lengths.
    pub lengths: Vec<u64>,
    /// True on the rank whose file holds the box.
    pub written: bool,
    /// CRC32 of each slice of the box's bytes.
    pub block_crc32: Vec<u32>,
}

/// What a rank part says of its save's health (version 4).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PartHealth {
    /// The rank's replica policy: the committer refuses the commit on a mismatch
    /// when any holder of the disagreeing box says `fail`.
    pub replica_mismatch: ReplicaPolicy,
    /// Float chunks of the file with elements that are not finite.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nonfinite: Vec<ChunkNonFinite>,
    /// The rank's replicated boxes (written or not), when the policy compares them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<ReplicaCrcs>,
    /// The caller's metrics at this save.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, Metric>,
    /// Why the caller's own check found the state unhealthy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unhealthy: Vec<String>,
}

impl PartHealth {
    /// Structural checks against the part's `chunks` and block size.
    pub fn validate(&self, chunks: &[Chunk], block: u64, object: &str) -> FResult<()> {
        let err = |message: String| FormatError::new(object, None, message);
        for found in &self.nonfinite {
            let chunk = chunks.get(found.chunk as usize).ok_or_else(|| {
                err(format!(
                    "health names chunk {} of {}",
                    found.chunk,
                    chunks.len()
                ))
            })?;
            let elements: u64 = chunk.lengths.iter().product();
            if found.elements == 0 || found.elements > elements {
                return Err(err(format!(
                    "health counts {} non-finite elements in a chunk of {elements} ({:?})",
                    found.elements, chunk.tensor
                )));
            }
        }
        for replica in &self.replicas {
            if replica.offsets.len() != replica.lengths.len() {
                return Err(err(format!(
                    "replica of {:?} has {} offsets and {} lengths",
                    replica.tensor,
                    replica.offsets.len(),
                    replica.lengths.len()
                )));
            }
            let bytes = tensor_bytes(replica.dtype, &replica.lengths)
                .ok_or_else(|| err(format!("replica box of {:?} is too large", replica.tensor)))?;
            let expected = bytes.div_ceil(block);
            if replica.block_crc32.len() as u64 != expected {
                return Err(err(format!(
                    "replica of {:?} has {} block checksums for {bytes} bytes in blocks of {block} (expected {expected})",
                    replica.tensor,
                    replica.block_crc32.len()
                )));
            }
        }
        Ok(())
    }
}

/// Non-finite elements of one tensor, over every rank that wrote a box of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NonFinite {
    /// The tensor.
    pub tensor: String,
    /// Elements that are NaN or infinite.
    pub elements: u64,
    /// Ranks whose boxes hold them.
    pub ranks: Vec<u32>,
}

/// Holders of one replicated box that disagree with the copy that was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaMismatch {
    /// The tensor.
    pub tensor: String,
    /// Box offsets.
    pub offsets: Vec<u64>,
    /// Box lengths.
    pub lengths: Vec<u64>,
    /// The first differing slices of the box (indices of `block_size` slices of its
    /// bytes), at most [`MAX_BLOCKS_LISTED`].
    pub blocks: Vec<u64>,
    /// The rank whose copy is in the checkpoint.
    pub written_by: u32,
    /// Other holders whose copy equals the written one.
    pub agree: Vec<u32>,
    /// Holders whose copy differs.
    pub disagree: Vec<u32>,
}

impl fmt::Display for ReplicaMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let boxed = crate::region::Region::new(self.offsets.clone(), self.lengths.clone());
        write!(
            f,
            "replicas of tensor {:?} box {boxed} disagree at block {}: {} {} from the copy rank {} wrote",
            self.tensor,
            self.blocks
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            ranks_text(&self.disagree),
            if self.disagree.len() == 1 {
                "differs"
            } else {
                "differ"
            },
            self.written_by
        )?;
        if !self.agree.is_empty() {
            write!(
                f,
                " ({} {} with it)",
                ranks_text(&self.agree),
                if self.agree.len() == 1 {
                    "agrees"
                } else {
                    "agree"
                }
            )?;
        }
        Ok(())
    }
}

/// "rank 3" or "ranks 1, 4, 5": at most 8 listed, then how many more, so that a
/// reason stays one short line in a world of any size.
pub fn ranks_text(ranks: &[u32]) -> String {
    let shown: Vec<String> = ranks.iter().take(8).map(u32::to_string).collect();
    let more = ranks.len().saturating_sub(8);
    format!(
        "rank{} {}{}",
        if ranks.len() == 1 { "" } else { "s" },
        shown.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    )
}

/// A checkpoint's health, judged by the committer from every rank's part (manifest,
/// version 4).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Health {
    /// True when every float tensor is finite, every replica agreed with the copy
    /// written, and no rank's own check failed.
    pub healthy: bool,
    /// Why not, one line each; empty when healthy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
    /// Tensors with non-finite elements.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nonfinite: Vec<NonFinite>,
    /// Replicated boxes whose holders disagree.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replica_mismatches: Vec<ReplicaMismatch>,
    /// Replicated boxes whose copies were compared.
    #[serde(default)]
    pub replicas_compared: u64,
    /// The caller's metrics, from the rank that carries the global state (else the
    /// lowest rank that gave any).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, Metric>,
}

impl Health {
    /// Structural checks.
    pub fn validate(&self, object: &str) -> FResult<()> {
        let err = |message: String| FormatError::new(object, None, message);
        if self.healthy != self.reasons.is_empty() {
            return Err(err(format!(
                "health says healthy: {} with {} reasons",
                self.healthy,
                self.reasons.len()
            )));
        }
        if self.reasons.len() > MAX_REASONS + 1
            || self.nonfinite.len() > MAX_HEALTH_ENTRIES
            || self.replica_mismatches.len() > MAX_HEALTH_ENTRIES
            || self.metrics.len() > MAX_HEALTH_ENTRIES
        {
            return Err(err("health lists more entries than a writer records".into()));
        }
        Ok(())
    }
}

/// What is known of a checkpoint's health.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HealthStatus<'a> {
    /// Judged healthy at its commit.
    Healthy,
    /// Judged unhealthy, for these reasons.
    Unhealthy(&'a [String]),
    /// Written before health was recorded (format version 3 or older).
    Unknown,
}

impl HealthStatus<'_> {
    /// `healthy`, `unhealthy` or `unknown`.
    pub fn as_str(&self) -> &'static str {
        match self {
            HealthStatus::Healthy => "healthy",
            HealthStatus::Unhealthy(_) => "unhealthy",
            HealthStatus::Unknown => "unknown",
        }
    }

    /// True unless judged unhealthy: what "the newest healthy checkpoint" accepts.
    pub fn acceptable(&self) -> bool {
        !matches!(self, HealthStatus::Unhealthy(_))
    }

    /// `Some(true)` healthy, `Some(false)` unhealthy, `None` unknown: the JSON
    /// `"healthy"` field of the tools.
    pub fn healthy(&self) -> Option<bool> {
        match self {
            HealthStatus::Healthy => Some(true),
            HealthStatus::Unhealthy(_) => Some(false),
            HealthStatus::Unknown => None,
        }
    }

    /// The reasons, empty unless unhealthy.
    pub fn reasons(&self) -> &[String] {
        match self {
            HealthStatus::Unhealthy(reasons) => reasons,
            _ => &[],
        }
    }
}

/// Number of elements of `dtype` in `bytes` that are NaN or infinite (0 for a dtype
/// that is not a float). Reads each element once; a trailing partial element is
/// ignored (callers pass whole elements).
///
/// Element-aligned slices of the wide types are read as words, a block at a time
/// into a 32-bit sum, which the compiler vectorizes: the scan runs about as fast as
/// the CRC beside it. Other slices take the plain loop.
pub fn count_nonfinite(dtype: DType, bytes: &[u8]) -> u64 {
    match dtype {
        DType::F32 => count_words::<u32>(bytes, 0x7f80_0000),
        DType::F64 => count_words::<u64>(bytes, 0x7ff0_0000_0000_0000),
        DType::F16 => count_words::<u16>(bytes, 0x7c00),
        DType::BF16 => count_words::<u16>(bytes, 0x7f80),
        // E5M2 keeps IEEE's infinities and NaNs: the exponent all ones.
        DType::F8_E5M2 => count_bytes(bytes, |b| b & 0x7c == 0x7c),
        // E4M3 (the "fn" variant) has no infinity; its one NaN is S.1111.111.
        DType::F8_E4M3 => count_bytes(bytes, |b| b & 0x7f == 0x7f),
        // E8M0 is an exponent alone; 0xff is its NaN.
        DType::F8_E8M0 => count_bytes(bytes, |b| b == 0xff),
        _ => 0,
    }
}

/// A little-endian word type whose exponent bits `mask` covers.
trait Word: Copy + std::ops::BitAnd<Output = Self> + PartialEq {
    fn from_le_slice(bytes: &[u8]) -> Self;
}

macro_rules! word {
    ($t:ty) => {
        impl Word for $t {
            fn from_le_slice(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("one element"))
            }
        }
    };
}
word!(u16);
word!(u32);
word!(u64);

fn count_words<T: Word>(bytes: &[u8], mask: T) -> u64 {
    let size = std::mem::size_of::<T>();
    let whole = &bytes[..bytes.len() / size * size];
    let slow = |b: &[u8]| {
        b.chunks_exact(size)
            .filter(|e| T::from_le_slice(e) & mask == mask)
            .count() as u64
    };
    if cfg!(target_endian = "big")
        || !(whole.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        return slow(whole);
    }
    // SAFETY: every bit pattern is a valid `T`, and `whole` starts aligned for `T`
    // (checked above), so `head` is empty and the words are the elements.
    let (head, words, tail) = unsafe { whole.align_to::<T>() };
    debug_assert!(head.is_empty());
    words
        .chunks(1 << 16)
        .map(|block| {
            block
                .iter()
                .map(|&w| u32::from(w & mask == mask))
                .sum::<u32>() as u64
        })
        .sum::<u64>()
        + slow(tail)
}

fn count_bytes(bytes: &[u8], bad: impl Fn(u8) -> bool) -> u64 {
    bytes
        .chunks(1 << 16)
        .map(|block| block.iter().map(|&b| u32::from(bad(b))).sum::<u32>() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_elements_are_counted_in_every_float_dtype_and_nowhere_else() {
        let f32s: Vec<u8> = [1.0f32, f32::NAN, f32::INFINITY, -f32::INFINITY, f32::MAX]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(count_nonfinite(DType::F32, &f32s), 3);
        assert_eq!(count_nonfinite(DType::I32, &f32s), 0, "integers are finite");
        let f64s: Vec<u8> = [f64::NAN, 0.0, -0.0, f64::MIN_POSITIVE]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(count_nonfinite(DType::F64, &f64s), 1);
        // bf16: 0x7fc0 NaN, 0xff80 -inf, 0x3f80 1.0; f16: 0x7e00 NaN, 0x3c00 1.0.
        let bf16: Vec<u8> = [0x7fc0u16, 0xff80, 0x3f80]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(count_nonfinite(DType::BF16, &bf16), 2);
        let f16: Vec<u8> = [0x7e00u16, 0x3c00, 0x7bff]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(count_nonfinite(DType::F16, &f16), 1);
        assert_eq!(count_nonfinite(DType::F8_E4M3, &[0x7f, 0x7e, 0xff]), 2);
        assert_eq!(count_nonfinite(DType::F8_E5M2, &[0x7c, 0x7b, 0xfe]), 2);
        assert_eq!(count_nonfinite(DType::F8_E8M0, &[0xff, 0xfe]), 1);
        // Unaligned slices take the plain loop and count the same.
        let mut shifted = vec![0u8];
        shifted.extend(&f32s);
        assert_eq!(count_nonfinite(DType::F32, &shifted[1..]), 3);
        let many: Vec<u8> = (0..100_000u32)
            .map(|i| if i % 1000 == 7 { f32::NAN } else { i as f32 })
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(count_nonfinite(DType::F32, &many), 100);
    }

    #[test]
    fn metrics_that_json_cannot_hold_round_trip_as_words() {
        let metrics: BTreeMap<String, Metric> = [
            ("loss".to_string(), Metric(f64::NAN)),
            ("grad_norm".to_string(), Metric(f64::INFINITY)),
            ("lr".to_string(), Metric(3e-4)),
        ]
        .into();
        let text = serde_json::to_string(&metrics).unwrap();
        assert_eq!(text, r#"{"grad_norm":"inf","loss":"NaN","lr":0.0003}"#);
        let back: BTreeMap<String, Metric> = serde_json::from_str(&text).unwrap();
        assert!(back["loss"].0.is_nan());
        assert_eq!(back["grad_norm"].0, f64::INFINITY);
        assert_eq!(back["lr"].0, 3e-4);
        let bad = serde_json::from_str::<Metric>(r#""huge""#).unwrap_err();
        assert!(bad.to_string().contains("\"huge\""), "{bad}");
    }

    #[test]
    fn a_verdict_that_contradicts_its_reasons_is_refused() {
        let health = Health {
            healthy: true,
            reasons: vec!["tensor \"w\" has 1 non-finite element".into()],
            nonfinite: vec![],
            replica_mismatches: vec![],
            replicas_compared: 0,
            metrics: BTreeMap::new(),
        };
        let err = health.validate("m.json").unwrap_err();
        assert!(
            err.to_string().contains("healthy: true with 1 reasons"),
            "{err}"
        );
    }
}
