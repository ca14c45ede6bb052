//! The header of a safetensors data file: built when saving, parsed (as untrusted
//! input) when loading, and the names ckpt gives its entries. Kept apart because it
//! is a third-party format with its own rules, fuzzed on its own.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use super::envelope::byte_offset;
use super::limits::{MAX_DIMS, MAX_HEADER_BYTES, tensor_bytes};
use super::{FResult, FormatError};
use crate::dtype::DType;

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

/// The safetensors entry names of one rank's boxes, in the order given as (tensor,
/// offsets, lengths) (section 3 of `docs/FORMAT.md`). A tensor with one box in the
/// file keeps its global name, as every reader of version 2 expects. A safetensors
/// header is a JSON object, so its names must differ: each box of a tensor with
/// several boxes in the file is named by the tensor and the slice it covers,
/// `NAME[b0:e0,b1:e1,…]` (begin and end in every dimension, decimal), which also
/// tells a plain safetensors reader which piece the entry is. Two boxes of one tensor
/// get one name only when they are the same box. Such a name can still equal another
/// tensor's own name: writers check that before writing
/// (`rank_file_header` in `src/rank_file.rs`).
pub fn entry_names(boxes: &[(&str, &[u64], &[u64])]) -> Vec<String> {
    let mut count: HashMap<&str, u32> = HashMap::with_capacity(boxes.len());
    for &(name, _, _) in boxes {
        *count.entry(name).or_default() += 1;
    }
    boxes
        .iter()
        .map(|&(name, offsets, lengths)| {
            if count.get(name).copied().unwrap_or(0) < 2 {
                return name.to_string();
            }
            let mut entry = String::with_capacity(name.len() + 2 + 8 * offsets.len());
            entry.push_str(name);
            entry.push('[');
            for (d, (&begin, &length)) in offsets.iter().zip(lengths).enumerate() {
                if d > 0 {
                    entry.push(',');
                }
                let _ = write!(entry, "{begin}:{}", begin.saturating_add(length));
            }
            entry.push(']');
            entry
        })
        .collect()
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
    fn a_tensor_keeps_its_name_unless_the_file_holds_several_of_its_boxes() {
        let names = entry_names(&[
            ("w", &[0, 0], &[2, 20]),
            ("b", &[3], &[4]),
            ("w", &[9, 0], &[1, 20]),
            ("s", &[], &[]),
        ]);
        assert_eq!(names, ["w[0:2,0:20]", "b", "w[9:10,0:20]", "s"]);
        // An empty box and a non-empty one at the same offsets differ by their ends.
        let names = entry_names(&[("e", &[2], &[0]), ("e", &[2], &[3])]);
        assert_eq!(names, ["e[2:2]", "e[2:5]"]);
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
