//! The header of a rank's data file, for every writer of one: the training save lays
//! its staged file out with it, the offline writer streams after it, and the copies
//! check a peer's file against it. Kept below all three so none of them reaches into
//! another for it.

use std::collections::{BTreeMap, HashMap};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::{
    MAX_HEADER_BYTES, build_safetensors_header, entry_names, repeats_a_tensor, version_for,
};
use crate::region::Region;

/// Fails, before anything is written, when `header` (from [`rank_file_header`]) is
/// larger than safetensors readers accept ([`MAX_HEADER_BYTES`] after its length
/// prefix): the file would not be the safetensors file the format promises.
pub(crate) fn check_header(header: &[u8], rank: u32, boxes: usize) -> Result<()> {
    let json = header.len().saturating_sub(8) as u64;
    if json > MAX_HEADER_BYTES {
        return Err(Error::invalid(format!(
            "rank {rank}'s data file would have a safetensors header of {json} bytes for {boxes} boxes, over safetensors' limit of {MAX_HEADER_BYTES}: save fewer boxes per rank, or shorter names"
        )));
    }
    Ok(())
}

/// One box the file will hold, in write order.
#[derive(Debug, Clone)]
pub struct PlannedBox {
    /// Global tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The box.
    pub region: Region,
}

/// The format version of a rank file holding `boxes`, and of its part: the lowest
/// that describes it ([`version_for`]).
pub fn rank_file_version(boxes: &[PlannedBox]) -> u32 {
    version_for(repeats_a_tensor(boxes.iter().map(|b| b.name.as_str())))
}

/// The safetensors header of a rank file holding `boxes` in order (packed), with
/// ckpt's `__metadata__`. Entries are named by [`entry_names`]: a tensor with one box
/// keeps its name, the boxes of a tensor split on this rank are named by their
/// slices. Fails, naming both boxes, when two entries would get one name (the same
/// box twice, or a tensor whose own name is another tensor's slice name).
pub fn rank_file_header(step: u64, rank: u32, world: u32, boxes: &[PlannedBox]) -> Result<Vec<u8>> {
    let refs: Vec<(&str, &[u64], &[u64])> = boxes
        .iter()
        .map(|b| {
            (
                b.name.as_str(),
                b.region.offsets.as_slice(),
                b.region.lengths.as_slice(),
            )
        })
        .collect();
    let names = entry_names(&refs);
    let mut taken: HashMap<&str, usize> = HashMap::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        if let Some(first) = taken.insert(name, i) {
            let (a, b) = (&boxes[first], &boxes[i]);
            return Err(Error::invalid(if a.name == b.name {
                format!(
                    "rank {rank}'s data file of step {step} would hold box {} of tensor {:?} twice",
                    b.region, b.name
                )
            } else {
                format!(
                    "rank {rank}'s data file of step {step} cannot name two safetensors entries {name:?}: tensor {:?} (box {}) and tensor {:?} (box {}) would both take it; rename the tensor whose own name looks like a piece of the other",
                    a.name, a.region, b.name, b.region
                )
            }));
        }
    }
    let entries: Vec<_> = names
        .iter()
        .zip(boxes)
        .map(|(name, b)| (name.clone(), b.dtype, b.region.lengths.clone()))
        .collect();
    let described: BTreeMap<&str, serde_json::Value> = names
        .iter()
        .zip(boxes)
        .map(|(name, b)| {
            let mut described = serde_json::json!({"shape": b.shape, "offsets": b.region.offsets});
            if *name != b.name {
                described["tensor"] = serde_json::Value::from(b.name.as_str());
            }
            (name.as_str(), described)
        })
        .collect();
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), "ckpt".to_string());
    metadata.insert(
        "ckpt.format_version".to_string(),
        rank_file_version(boxes).to_string(),
    );
    metadata.insert("ckpt.step".to_string(), step.to_string());
    metadata.insert("ckpt.rank".to_string(), rank.to_string());
    metadata.insert("ckpt.world_size".to_string(), world.to_string());
    metadata.insert(
        "ckpt.boxes".to_string(),
        serde_json::to_string(&described).expect("boxes serialize"),
    );
    Ok(build_safetensors_header(&entries, &metadata))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_over_the_safetensors_limit_is_refused_and_one_at_it_passes() {
        let limit = MAX_HEADER_BYTES as usize;
        let at_limit = vec![b' '; 8 + limit];
        assert!(check_header(&at_limit, 3, 7).is_ok());
        let over = vec![b' '; 8 + limit + 1];
        let err = check_header(&over, 3, 7).unwrap_err();
        assert!(matches!(err, Error::Invalid(_)), "{err}");
        let message = err.to_string();
        assert!(
            message.contains("rank 3")
                && message.contains("100000001 bytes for 7 boxes")
                && message.contains("limit of 100000000"),
            "{message}"
        );
    }
}
