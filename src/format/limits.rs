//! The caps every parser applies before allocating, and the checks the manifest and
//! the rank parts share (version, world size, block size, tensor shapes). Kept in
//! one place so a limit is changed once and holds for every object.

use super::{FORMAT_VERSION, FResult, FormatError, OLDEST_READABLE_VERSION};
use crate::dtype::DType;

/// Largest `manifest.json` accepted.
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;
/// Largest rank part accepted.
pub const MAX_PART_BYTES: u64 = 256 << 20;
/// Largest safetensors header (its JSON, after the 8-byte length): the safetensors
/// crate's own limit, 100,000,000 bytes, so that every data file opens in any
/// safetensors reader. Readers refuse a larger one; writers fail before writing it.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Most dimensions of a tensor.
pub const MAX_DIMS: usize = 32;
/// Largest world size.
pub const MAX_WORLD_SIZE: u32 = 1 << 20;
/// Smallest and largest block size.
pub const MIN_BLOCK_SIZE: u64 = 4 << 10;
/// Largest block size.
pub const MAX_BLOCK_SIZE: u64 = 256 << 20;
/// Largest tensor, in bytes (2^60).
pub const MAX_TENSOR_BYTES: u64 = 1 << 60;

pub(crate) fn tensor_bytes(dtype: DType, lengths: &[u64]) -> Option<u64> {
    lengths
        .iter()
        .try_fold(dtype.size() as u64, |acc, &l| acc.checked_mul(l))
        .filter(|&b| b <= MAX_TENSOR_BYTES)
}

pub(crate) fn check_shape(shape: &[u64], dtype: DType, object: &str, tensor: &str) -> FResult<()> {
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

pub(crate) fn check_common(
    object: &str,
    version: u32,
    attempt: Option<&str>,
    world: u32,
    block: u64,
) -> FResult<()> {
    if !(OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(FormatError::new(
            object,
            None,
            format!(
                "unsupported format_version {version} (this build reads {OLDEST_READABLE_VERSION} to {FORMAT_VERSION})"
            ),
        ));
    }
    // Version 2 names the save attempt (its directory); version 1 has none.
    match (version, attempt) {
        (1, None) => {}
        (1, Some(_)) => {
            return Err(FormatError::new(
                object,
                None,
                "format_version 1 has no attempt",
            ));
        }
        (_, None) => {
            return Err(FormatError::new(
                object,
                None,
                format!("format_version {version} needs an attempt"),
            ));
        }
        (_, Some(name)) => {
            super::check_object_name(name, object, "attempt")?;
            let valid = name
                .strip_prefix('g')
                .and_then(|rest| rest.split_once('-'))
                .is_some_and(|(g, run)| {
                    g.len() >= 8
                        && g.bytes().all(|b| b.is_ascii_digit())
                        && super::names::is_run_id(run)
                });
            if !valid {
                return Err(FormatError::new(
                    object,
                    None,
                    format!("attempt {name:?} is not gGGGGGGGG-RUN"),
                ));
            }
        }
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
