//! `ckpt import`: start a sharded run from a published safetensors file.
//!
//! The file's header is parsed with the same bounded parser ckpt uses for its own
//! files; every tensor is split evenly on dim 0 over the destination world and
//! streamed, slab by slab, into each rank's file, which is then committed.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;

use ckpt_storage::Store;
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;

use super::{dim0_boxes, slab_rows, slabs};
use crate::error::{Error, Result};
use crate::format::{Codec, MAX_HEADER_BYTES, parse_safetensors_header};
use crate::region::{Region, for_each_run};
use crate::writer::{PlannedBox, RankFileWriter, commit, tool_attempt};

/// Settings of an import.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// Step the new checkpoint gets. Default 0.
    pub step: u64,
    /// Ranks to split over.
    pub world_size: u32,
    /// Codec of the checkpoint. Default none.
    pub codec: Codec,
    /// Block size. Default 256 KiB.
    pub block_size: u64,
    /// Bytes of tensor data held at once. Default 512 MiB.
    pub memory_budget: u64,
}

impl ImportOptions {
    /// Defaults for `world_size` ranks.
    pub fn new(world_size: u32) -> Self {
        Self {
            step: 0,
            world_size,
            codec: Codec::None,
            block_size: 256 << 10,
            memory_budget: 512 << 20,
        }
    }
}

/// What an import wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ImportReport {
    /// Step of the new checkpoint.
    pub step: u64,
    /// Ranks.
    pub world_size: u32,
    /// Tensors imported.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub bytes: u64,
}

/// Imports the safetensors file `input` into `dst` as a committed checkpoint.
pub async fn import(
    input: &Path,
    dst: &Store,
    options: &ImportOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<ImportReport> {
    let object = input.display().to_string();
    let io_err = |e: std::io::Error| Error::Failed(format!("cannot read {object}: {e}"));
    let file = std::fs::File::open(input).map_err(io_err)?;
    let size = file.metadata().map_err(io_err)?.len();
    let mut len = [0u8; 8];
    file.read_exact_at(&mut len, 0).map_err(|_| {
        crate::format::FormatError::new(
            &object,
            Some(0),
            format!("truncated: {size} bytes, no header length"),
        )
    })?;
    let header_len = u64::from_le_bytes(len)
        .min(MAX_HEADER_BYTES + 1)
        .min(size.saturating_sub(8));
    let mut prefix = vec![0u8; 8 + header_len as usize];
    file.read_exact_at(&mut prefix, 0).map_err(io_err)?;
    let header = parse_safetensors_header(&prefix, size, &object)?;
    if crate::catalog::read_manifest(dst, options.step)
        .await
        .is_ok()
    {
        return Err(Error::invalid(format!(
            "{} already holds a committed checkpoint at step {}; choose another destination or --step",
            dst.url(),
            options.step
        )));
    }
    let world = options.world_size;
    if world == 0 {
        return Err(Error::invalid("world size must be at least 1"));
    }
    let mut plan: Vec<Vec<(PlannedBox, u64)>> = vec![Vec::new(); world as usize];
    for entry in &header.entries {
        for (rank, region) in dim0_boxes(&entry.shape, world) {
            plan[rank as usize].push((
                PlannedBox {
                    name: entry.name.clone(),
                    dtype: entry.dtype,
                    shape: entry.shape.clone(),
                    region,
                },
                header.data_start + entry.data_offsets[0],
            ));
        }
    }
    let budget = options.memory_budget.max(1);
    let file = &file;
    let object = &object;
    let attempt = &tool_attempt(dst, options.step).await?;
    let bytes: Vec<u64> = futures::stream::iter(plan.into_iter().enumerate())
        .map(|(rank, boxes)| async move {
            let planned: Vec<PlannedBox> = boxes.iter().map(|(b, _)| b.clone()).collect();
            let mut writer = RankFileWriter::begin(
                dst,
                attempt,
                rank as u32,
                world,
                options.block_size,
                options.codec,
                &planned,
            )
            .await?;
            let mut written = 0;
            for (b, tensor_start) in &boxes {
                let whole = Region::full(&b.shape);
                let rows = slab_rows(&b.region, b.dtype.size(), budget);
                for slab in slabs(&b.region, rows) {
                    // A dim-0 slab of a whole-row box is one contiguous run of the file.
                    let mut data =
                        vec![0u8; (slab.volume().unwrap_or(0) * b.dtype.size() as u64) as usize];
                    let mut result = Ok(());
                    for_each_run(&slab, &whole, &slab, b.dtype.size(), |src, dst_off, len| {
                        if result.is_ok() {
                            result = file.read_exact_at(
                                &mut data[dst_off as usize..(dst_off + len) as usize],
                                tensor_start + src,
                            );
                        }
                    });
                    result.map_err(|e| Error::Failed(format!("cannot read {object}: {e}")))?;
                    writer.write(&data).await?;
                    written += data.len() as u64;
                    progress(data.len() as u64);
                }
            }
            let (global, metadata) = if rank == 0 {
                let mut meta = BTreeMap::new();
                meta.insert("ckpt.imported_from".to_string(), serde_json::json!(object));
                (Some(BTreeMap::new()), meta)
            } else {
                (None, BTreeMap::new())
            };
            writer.finish(global, BTreeMap::new(), metadata).await?;
            Ok::<u64, Error>(written)
        })
        .buffer_unordered(2)
        .try_collect()
        .await?;
    if !commit(dst, attempt, world).await? {
        return Err(Error::Failed(format!(
            "import into {} could not commit",
            dst.url()
        )));
    }
    Ok(ImportReport {
        step: options.step,
        world_size: world,
        tensors: header.entries.len(),
        bytes: bytes.iter().sum(),
    })
}
