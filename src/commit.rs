//! The commit: turning every rank's part into one `manifest.json`.
//!
//! A rank that has written its part lists the step directory; when every rank's part
//! is there it reads them all, checks that they agree (step, world, dtypes, shapes,
//! chunks tiling each tensor exactly once), builds the root manifest and writes it
//! create-if-absent. Several ranks may race to do this; one wins, the others see
//! `AlreadyExists`, and all of them succeed. The manifest is deterministic in the
//! parts, so whichever wins, readers see the same checkpoint.

use std::collections::{BTreeMap, HashMap};

use ckpt_storage::Store;
use futures::{StreamExt, TryStreamExt};
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::format::{
    FORMAT_VERSION, LATEST, Layout, LayoutBox, MANIFEST, Manifest, RankEntry, RankPart,
    TensorEntry, parse_rank_part_name, rank_part_name, step_dir,
};
use crate::region::Region;

/// What a commit attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CommitOutcome {
    /// This call wrote `manifest.json`.
    Committed,
    /// Another rank had written it.
    AlreadyCommitted,
    /// Some ranks' parts are not there yet.
    Incomplete {
        /// How many parts are present.
        present: usize,
    },
}

/// Commits step `step` if all `world` parts are present.
pub(crate) async fn try_commit(store: &Store, step: u64, world: u32) -> Result<CommitOutcome> {
    let dir = step_dir(step);
    let listing = store.list_dir(&dir).await?;
    let mut present = vec![false; world as usize];
    let mut manifest_present = false;
    for object in &listing.objects {
        let name = object.key.rsplit('/').next().unwrap_or("");
        if name == MANIFEST {
            manifest_present = true;
        } else if let Some(rank) = parse_rank_part_name(name)
            && let Some(slot) = present.get_mut(rank as usize)
        {
            *slot = true;
        }
    }
    if manifest_present {
        return Ok(CommitOutcome::AlreadyCommitted);
    }
    let count = present.iter().filter(|&&p| p).count();
    if count < world as usize {
        debug!(step, present = count, world, "not all parts present yet");
        return Ok(CommitOutcome::Incomplete { present: count });
    }

    let parts: Vec<(Vec<u8>, RankPart)> = futures::stream::iter(0..world)
        .map(|rank| {
            let key = format!("{dir}/{}", rank_part_name(rank));
            async move {
                let bytes = store.get(&key).await?;
                let part = RankPart::parse(&bytes, &key)?;
                Ok::<_, Error>((bytes.to_vec(), part))
            }
        })
        .buffered(32)
        .try_collect()
        .await?;
    let manifest = build_manifest(step, world, &parts)?;
    manifest.validate(&format!("{dir}/{MANIFEST}"))?;
    // Every data file must be there, whole, before the commit vouches for it (a
    // rank's part is written after its file, but files can vanish: retention
    // racing a slow save, an operator's cleanup).
    let files: Vec<(String, u64)> = manifest
        .ranks
        .iter()
        .map(|entry| (format!("{dir}/{}", entry.file), entry.stored_bytes))
        .collect();
    futures::stream::iter(files)
        .map(|(key, expected)| async move {
            let info = store.head(&key).await.map_err(|e| {
                if e.is_not_found() {
                    Error::Failed(format!("cannot commit step {step}: {key} is missing"))
                } else {
                    Error::from(e)
                }
            })?;
            if info.size != expected {
                return Err(Error::Failed(format!(
                    "cannot commit step {step}: {key} has {} bytes, its part records {expected}",
                    info.size
                )));
            }
            Ok(())
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;
    crate::failpoint::hit("before-commit");
    match store
        .put_if_absent(&format!("{dir}/{MANIFEST}"), manifest.to_bytes())
        .await
    {
        Ok(()) => {}
        Err(e) if e.is_already_exists() => return Ok(CommitOutcome::AlreadyCommitted),
        Err(e) => return Err(e.into()),
    }
    // The hint is best effort: readers trust the listing, not this.
    if let Err(e) = store.put(LATEST, step.to_string()).await {
        warn!(step, error = %e, "could not update the latest hint");
    }
    Ok(CommitOutcome::Committed)
}

/// A tensor's dtype, shape and (rank, box) chunks, gathered from the parts.
type Gathered<'a> = (crate::DType, &'a [u64], Vec<(u32, Region)>);

/// Builds the root manifest from every rank's part (sorted by rank).
pub(crate) fn build_manifest(
    step: u64,
    world: u32,
    parts: &[(Vec<u8>, RankPart)],
) -> Result<Manifest> {
    let first = &parts
        .first()
        .ok_or_else(|| Error::invalid("a checkpoint needs at least one rank"))?
        .1;
    let dir = step_dir(step);
    let mut tensors: BTreeMap<&str, Gathered<'_>> = BTreeMap::new();
    let mut ranks = Vec::with_capacity(parts.len());
    for (bytes, part) in parts {
        let object = format!("{dir}/{}", rank_part_name(part.rank));
        let disagree = |what: &str, theirs: String, ours: String| {
            Error::Corrupt(crate::format::FormatError::new(
                &object,
                None,
                format!(
                    "{what} {theirs} disagrees with rank {}'s {ours}",
                    first.rank
                ),
            ))
        };
        if part.step != step || part.world_size != world || part.rank as usize != ranks.len() {
            return Err(disagree(
                "step/world/rank",
                format!("{}/{}/{}", part.step, part.world_size, part.rank),
                format!("{step}/{world}/{}", ranks.len()),
            ));
        }
        if part.block_size != first.block_size || part.codec != first.codec {
            return Err(disagree(
                "block size/codec",
                format!("{}/{:?}", part.block_size, part.codec),
                format!("{}/{:?}", first.block_size, first.codec),
            ));
        }
        for chunk in &part.chunks {
            let entry = tensors.entry(chunk.tensor.as_str()).or_insert((
                chunk.dtype,
                chunk.shape.as_slice(),
                Vec::new(),
            ));
            if entry.0 != chunk.dtype || entry.1 != chunk.shape.as_slice() {
                return Err(Error::Mismatch(format!(
                    "tensor {:?}: rank {} saved {} {:?}, another rank saved {} {:?}",
                    chunk.tensor, part.rank, chunk.dtype, chunk.shape, entry.0, entry.1
                )));
            }
            entry.2.push((part.rank, chunk.region()));
        }
        ranks.push(RankEntry {
            rank: part.rank,
            part: rank_part_name(part.rank),
            part_bytes: bytes.len() as u64,
            part_crc32: crc32fast::hash(bytes),
            file: part.file.name.clone(),
            stored_bytes: part.file.stored_bytes,
            raw_bytes: part.file.raw_bytes,
        });
    }

    let mut layouts: Vec<Layout> = Vec::new();
    let mut layout_ids: HashMap<Layout, u32> = HashMap::new();
    let mut entries = Vec::with_capacity(tensors.len());
    for (name, (dtype, shape, boxes)) in tensors {
        let layout = encode_layout(shape, world, boxes);
        let id = *layout_ids.entry(layout.clone()).or_insert_with(|| {
            layouts.push(layout);
            (layouts.len() - 1) as u32
        });
        entries.push(TensorEntry {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            layout: id,
        });
    }
    let global = parts.iter().find(|(_, p)| p.global_state.is_some());
    Ok(Manifest {
        format_version: FORMAT_VERSION,
        step,
        world_size: world,
        generation: first.generation,
        created_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        block_size: first.block_size,
        codec: first.codec,
        tensors: entries,
        layouts,
        ranks,
        global_state_rank: global.map(|(_, p)| p.rank),
        metadata: global.map(|(_, p)| p.metadata.clone()).unwrap_or_default(),
    })
}

/// The compact dim-0 form when rank `r`'s rows follow rank `r-1`'s and every other
/// dimension is whole; the list of boxes otherwise.
fn encode_layout(shape: &[u64], world: u32, mut boxes: Vec<(u32, Region)>) -> Layout {
    boxes.sort_by_key(|(rank, _)| *rank);
    if !shape.is_empty() {
        let mut bounds = vec![0u64; world as usize + 1];
        let mut next_rank = 0u32;
        let mut rows = 0u64;
        let mut dim0 = true;
        for (rank, region) in &boxes {
            let whole_rest =
                region.offsets[1..].iter().all(|&o| o == 0) && region.lengths[1..] == shape[1..];
            if !whole_rest || region.offsets[0] != rows || *rank < next_rank {
                dim0 = false;
                break;
            }
            for r in next_rank..=*rank {
                bounds[r as usize] = rows;
            }
            rows += region.lengths[0];
            next_rank = rank + 1;
        }
        if dim0 && rows == shape[0] {
            for bound in bounds.iter_mut().skip(next_rank as usize) {
                *bound = rows;
            }
            return Layout::Dim0(bounds);
        }
    }
    Layout::Boxes(
        boxes
            .into_iter()
            .map(|(rank, region)| LayoutBox {
                rank,
                offsets: region.offsets,
                lengths: region.lengths,
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dim0_shards_encode_compactly() {
        let shape = [10u64, 4];
        let boxes = (0..3)
            .map(|r| (r, Region::dim0_shard(&shape, r as usize, 3)))
            .collect();
        assert_eq!(
            encode_layout(&shape, 3, boxes),
            Layout::Dim0(vec![0, 3, 6, 10])
        );
        // A rank without rows keeps its (empty) slot.
        let boxes = vec![
            (0, Region::rows(&shape, 0, 4)),
            (2, Region::rows(&shape, 4, 6)),
        ];
        assert_eq!(
            encode_layout(&shape, 3, boxes),
            Layout::Dim0(vec![0, 4, 4, 10])
        );
    }

    #[test]
    fn column_splits_stay_boxes() {
        let shape = [4u64, 4];
        let boxes = vec![
            (0, Region::new(vec![0, 0], vec![4, 2])),
            (1, Region::new(vec![0, 2], vec![4, 2])),
        ];
        assert!(matches!(encode_layout(&shape, 2, boxes), Layout::Boxes(b) if b.len() == 2));
    }
}
