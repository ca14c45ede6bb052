//! Planning a load without reading data: each want checked against the manifest,
//! intersected with the saved chunks (fetching only the rank parts that matter), and
//! turned into runs of bytes per data file; then the check that the runs tile every
//! output exactly once, on which the lock-free scatter's soundness rests.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};

use super::request::{LoadPlan, LoadRequest, LoadStats, Want};
use super::{CheckpointReader, Run};
use crate::error::{Error, Result};
use crate::format::{ChunkIndex, FormatError, RankPart, TensorEntry};
use crate::region::{Region, for_each_run};

impl CheckpointReader {
    /// Checks one want against the manifest; returns its tensor and its size in
    /// bytes. No I/O.
    pub(super) fn check_want(&self, want: &Want) -> Result<(&TensorEntry, u64)> {
        let manifest = &self.manifest;
        let step = manifest.step;
        let tensor = manifest.tensor(&want.name).ok_or_else(|| {
            Error::NotFound(format!(
                "tensor {:?} is not in checkpoint step {step} ({} tensors)",
                want.name,
                manifest.tensors.len()
            ))
        })?;
        if let Some(dtype) = want.dtype
            && dtype != tensor.dtype
        {
            return Err(Error::Mismatch(format!(
                "tensor {:?}: requested {dtype}, checkpoint step {step} has {}",
                want.name, tensor.dtype
            )));
        }
        if let Some(shape) = &want.shape
            && shape != &tensor.shape
        {
            return Err(Error::Mismatch(format!(
                "tensor {:?}: requested shape {shape:?}, checkpoint step {step} has {:?}",
                want.name, tensor.shape
            )));
        }
        if !want.region.within(&tensor.shape) {
            return Err(Error::Mismatch(format!(
                "tensor {:?}: requested box {} lies outside its shape {:?}",
                want.name, want.region, tensor.shape
            )));
        }
        let bytes = want
            .region
            .volume()
            .unwrap_or(0)
            .saturating_mul(tensor.dtype.size() as u64);
        Ok((tensor, bytes))
    }

    /// Plans a load without reading data: checks the request against the manifest,
    /// fetches the rank parts its boxes touch and turns every intersection into byte
    /// runs per data file. [`CheckpointReader::execute`](crate::CheckpointReader::execute) then reads them; the split
    /// lets the planning cost be measured on its own (`ckpt bench`).
    ///
    /// A plan's runs are checked to tile every want's output exactly (inside it, no
    /// two overlapping, together covering it) and to lie inside their data file:
    /// the reads write into the outputs from several threads at once without locks,
    /// which is sound only because no two runs share a destination byte.
    pub async fn plan(&self, request: &LoadRequest) -> Result<LoadPlan> {
        let mut stats = LoadStats::default();
        let mut sizes = Vec::with_capacity(request.wants.len());
        // (want index, chunk box, part box) per saved rank.
        let mut pieces: BTreeMap<u32, Vec<(usize, Region, Region)>> = BTreeMap::new();
        for (i, want) in request.wants.iter().enumerate() {
            let (tensor, bytes) = self.check_want(want)?;
            stats.bytes_requested += bytes;
            sizes.push(bytes);
            let layout = &self.manifest.layouts[tensor.layout as usize];
            let mut covered = 0u64;
            for (rank, chunk, part) in layout.overlapping(&tensor.shape, &want.region) {
                covered += part.volume().unwrap_or(0);
                pieces.entry(rank).or_default().push((i, chunk, part));
            }
            if covered != want.region.volume().unwrap_or(0) {
                return Err(FormatError::new(
                    &format!("{}/manifest.json", self.manifest.dir()),
                    None,
                    format!(
                        "chunks of {:?} cover {covered} of the {} elements of box {}",
                        want.name,
                        want.region.volume().unwrap_or(0),
                        want.region
                    ),
                )
                .into());
            }
        }

        let ranks: Vec<u32> = pieces.keys().copied().collect();
        stats.parts_read = ranks.len();
        let parts: Vec<Arc<RankPart>> = futures::stream::iter(ranks.iter().copied())
            .map(|rank| self.part(rank))
            .buffered(32)
            .try_collect()
            .await?;

        let mut files = Vec::with_capacity(parts.len());
        for (part, (rank, rank_pieces)) in parts.iter().zip(pieces) {
            let object = format!("{}/{}", self.manifest.dir(), part.file.name);
            let part_key = format!(
                "{}/{}",
                self.manifest.dir(),
                crate::format::rank_part_name(rank)
            );
            // By tensor and box: a rank may hold several boxes of one tensor.
            let index = ChunkIndex::new(part);
            let mut runs = Vec::new();
            for (want_index, chunk_region, part_region) in rank_pieces {
                let want = &request.wants[want_index];
                let chunk = index
                    .get(want.name.as_str(), &chunk_region)
                    .ok_or_else(|| {
                        FormatError::new(
                            &part_key,
                            None,
                            format!(
                                "has no chunk {chunk_region} of {:?} that the manifest places there",
                                want.name
                            ),
                        )
                    })?;
                let elem = chunk.dtype.size();
                for_each_run(
                    &part_region,
                    &chunk_region,
                    &want.region,
                    elem,
                    |s, d, len| {
                        runs.push(Run {
                            src: chunk.bytes[0] + s,
                            len,
                            want: want_index,
                            dst: d,
                        });
                    },
                );
            }
            runs.sort_by_key(|r| r.src);
            if let Some(run) = runs.iter().find(|r| {
                r.src
                    .checked_add(r.len)
                    .is_none_or(|end| end > part.file.raw_bytes)
            }) {
                return Err(FormatError::new(
                    &part_key,
                    None,
                    format!(
                        "a chunk of {:?} reaches past the {} raw bytes of its data file (bytes {}..+{})",
                        request.wants[run.want].name, part.file.raw_bytes, run.src, run.len
                    ),
                )
                .into());
            }
            files.push((object, part.clone(), runs));
        }
        self.check_tiling(request, &sizes, &files)?;
        Ok(LoadPlan {
            files,
            sizes,
            stats,
        })
    }

    /// Checks that the runs of every want tile its output exactly: each inside it,
    /// none overlapping another, all together as many bytes as the output. The
    /// manifest's checks make this hold for any checkpoint that parses; it is checked
    /// again here because the lock-free scatter's soundness rests on it.
    fn check_tiling(
        &self,
        request: &LoadRequest,
        sizes: &[u64],
        files: &[(String, Arc<RankPart>, Vec<Run>)],
    ) -> Result<()> {
        let mut spans: Vec<(usize, u64, u64)> = files
            .iter()
            .flat_map(|(_, _, runs)| runs.iter().map(|r| (r.want, r.dst, r.len)))
            .collect();
        spans.sort_unstable();
        let mut filled = vec![0u64; sizes.len()];
        let bad = |want: usize, why: String| -> Error {
            FormatError::new(
                &format!("{}/manifest.json", self.manifest.dir()),
                None,
                format!(
                    "the chunks of {:?} do not tile box {}: {why}",
                    request.wants[want].name, request.wants[want].region
                ),
            )
            .into()
        };
        for (want, dst, len) in spans {
            if dst < filled[want] {
                return Err(bad(want, format!("two chunks overlap at byte {dst}")));
            }
            let end = dst
                .checked_add(len)
                .filter(|&end| end <= sizes[want])
                .ok_or_else(|| {
                    bad(
                        want,
                        format!("bytes {dst}..+{len} lie outside its {} bytes", sizes[want]),
                    )
                })?;
            filled[want] = end;
            // Runs are disjoint and sorted, so `filled` only grows; the sum of the
            // lengths is compared below through the last end and the gaps.
        }
        let mut covered = vec![0u64; sizes.len()];
        for (_, _, runs) in files {
            for r in runs {
                covered[r.want] += r.len;
            }
        }
        for (want, (&c, &size)) in covered.iter().zip(sizes).enumerate() {
            if c != size {
                return Err(bad(want, format!("they cover {c} of its {size} bytes")));
            }
        }
        Ok(())
    }
}

/// Checks that `plan` was made for a request with as many wants as `request`.
pub(super) fn check_plan(request: &LoadRequest, plan: &LoadPlan) -> Result<()> {
    if plan.sizes.len() != request.wants.len() {
        return Err(Error::invalid(format!(
            "the plan has {} boxes, the request {}",
            plan.sizes.len(),
            request.wants.len()
        )));
    }
    Ok(())
}

/// Checks the caller's buffers against the wants' sizes.
pub(crate) fn check_outputs(
    request: &LoadRequest,
    sizes: &[u64],
    outputs: &[&mut [u8]],
) -> Result<()> {
    if outputs.len() != sizes.len() {
        return Err(Error::invalid(format!(
            "{} output buffers for {} requested boxes: load_into takes one per want, in request order",
            outputs.len(),
            sizes.len()
        )));
    }
    for ((want, &size), out) in request.wants.iter().zip(sizes).zip(outputs) {
        if out.len() as u64 != size {
            return Err(Error::invalid(format!(
                "tensor {:?}: the output buffer holds {} bytes, box {} needs {size}",
                want.name,
                out.len(),
                want.region
            )));
        }
    }
    Ok(())
}
