//! Streaming writer of one rank's data file, for offline tools.
//!
//! [`Checkpointer::save`](crate::Checkpointer::save) stages a rank's whole state in
//! memory, which is right for a training loop (the stall is one memcpy). Offline
//! tools that rewrite checkpoints (`ckpt reshard`, `ckpt import`) must not hold whole
//! tensors: they know every box and its size up front, so the header can be written
//! first and the data streamed in order, checksummed (and compressed) block by block
//! as it goes. The result is byte-for-byte the format of section 3 of
//! `docs/FORMAT.md`, committed by the same protocol.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use ckpt_storage::{Store, Upload};

use crate::attempt::{Attempt, data_file_name};
use crate::codec::compress_block;
use crate::commit::Outcome;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::{
    Chunk, Codec, FileEntry, MAX_HEADER_BYTES, RankPart, StateValue, build_safetensors_header,
    entry_names, rank_part_name, repeats_a_tensor, version_for,
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

/// Writes one rank's data file and part as a stream. Create with
/// [`RankFileWriter::begin`], feed every box's bytes in order with
/// [`RankFileWriter::write`], then [`RankFileWriter::finish`].
///
/// Memory: one block (plus the store's multipart buffers), whatever the file size.
pub struct RankFileWriter {
    store: Store,
    attempt: Attempt,
    step: u64,
    rank: u32,
    world: u32,
    block_size: u64,
    codec: Codec,
    file_name: String,
    upload: Option<Upload>,
    /// Format version of the file and its part.
    version: u32,
    chunks: Vec<Chunk>,
    total: u64,
    written: u64,
    block: Vec<u8>,
    crcs: Vec<u32>,
    frames: Vec<u64>,
    stored: u64,
}

impl std::fmt::Debug for RankFileWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankFileWriter")
            .field("step", &self.step)
            .field("rank", &self.rank)
            .field("written", &self.written)
            .field("total", &self.total)
            .finish()
    }
}

impl RankFileWriter {
    /// Starts rank `rank`'s file of save attempt `attempt` holding `boxes` (in this
    /// order).
    pub async fn begin(
        store: &Store,
        attempt: &Attempt,
        rank: u32,
        world: u32,
        block_size: u64,
        codec: Codec,
        boxes: &[PlannedBox],
    ) -> Result<Self> {
        if rank >= world {
            return Err(Error::invalid(format!(
                "rank {rank} is not in world_size {world}"
            )));
        }
        let step = attempt.step;
        let header = rank_file_header(step, rank, world, boxes)?;
        check_header(&header, rank, boxes.len())?;
        let mut offset = header.len() as u64;
        let mut chunks = Vec::with_capacity(boxes.len());
        for b in boxes {
            if !b.region.within(&b.shape) {
                return Err(Error::invalid(format!(
                    "box {} of {:?} lies outside shape {:?}",
                    b.region, b.name, b.shape
                )));
            }
            let bytes = b.region.volume().unwrap_or(0) * b.dtype.size() as u64;
            chunks.push(Chunk {
                tensor: b.name.clone(),
                dtype: b.dtype,
                shape: b.shape.clone(),
                offsets: b.region.offsets.clone(),
                lengths: b.region.lengths.clone(),
                bytes: [offset, offset + bytes],
            });
            offset += bytes;
        }
        let compressed = matches!(codec, Codec::Zstd { .. });
        let file_name = data_file_name(rank, compressed, &crate::attempt::nonce());
        let upload = store.upload(&format!("{}/{file_name}", attempt.dir()))?;
        let mut writer = Self {
            store: store.clone(),
            attempt: attempt.clone(),
            step,
            rank,
            world,
            block_size,
            codec,
            file_name,
            upload: Some(upload),
            version: rank_file_version(boxes),
            chunks,
            total: offset,
            written: 0,
            block: Vec::with_capacity(block_size as usize),
            crcs: Vec::new(),
            frames: Vec::new(),
            stored: 0,
        };
        writer.push(&header).await?;
        Ok(writer)
    }

    /// Raw bytes of tensor data still expected.
    pub fn remaining(&self) -> u64 {
        self.total - self.written
    }

    /// Appends tensor bytes (the boxes' data, row-major, in the order given to
    /// `begin`).
    pub async fn write(&mut self, data: &[u8]) -> Result<()> {
        if data.len() as u64 > self.remaining() {
            return Err(Error::invalid(format!(
                "rank {} file of step {}: {} bytes written past the planned {} bytes",
                self.rank,
                self.step,
                data.len() as u64 - self.remaining(),
                self.total
            )));
        }
        self.push(data).await
    }

    async fn push(&mut self, mut data: &[u8]) -> Result<()> {
        self.written += data.len() as u64;
        let block = self.block_size as usize;
        while !data.is_empty() {
            let take = (block - self.block.len()).min(data.len());
            self.block.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.block.len() == block {
                self.flush_block().await?;
            }
        }
        Ok(())
    }

    async fn flush_block(&mut self) -> Result<()> {
        if self.block.is_empty() {
            return Ok(());
        }
        self.crcs.push(crc32fast::hash(&self.block));
        let bytes = match self.codec {
            Codec::None => Bytes::copy_from_slice(&self.block),
            Codec::Zstd { level, shuffle } => {
                let frame = compress_block(&self.block, level, shuffle)
                    .map_err(|e| Error::Failed(format!("compression failed: {e}")))?;
                self.frames.push(frame.len() as u64);
                Bytes::from(frame)
            }
        };
        self.stored += bytes.len() as u64;
        self.block.clear();
        self.upload
            .as_mut()
            .expect("upload open until finish")
            .write(bytes)
            .await?;
        Ok(())
    }

    /// Completes the data file and writes the rank's part. Fails when fewer bytes
    /// than planned were written.
    pub async fn finish(
        mut self,
        global_state: Option<BTreeMap<String, StateValue>>,
        rank_state: BTreeMap<String, StateValue>,
        metadata: BTreeMap<String, serde_json::Value>,
    ) -> Result<()> {
        if self.remaining() != 0 {
            let missing = self.remaining();
            if let Some(upload) = self.upload.take() {
                let _ = upload.abort().await;
            }
            return Err(Error::invalid(format!(
                "rank {} file of step {}: {missing} planned bytes were never written",
                self.rank, self.step
            )));
        }
        self.flush_block().await?;
        self.upload.take().expect("upload open").finish().await?;
        let part = RankPart {
            format_version: self.version,
            step: self.step,
            attempt: Some(self.attempt.name()),
            rank: self.rank,
            world_size: self.world,
            generation: self.attempt.generation,
            block_size: self.block_size,
            codec: self.codec,
            file: FileEntry {
                name: self.file_name.clone(),
                raw_bytes: self.written,
                stored_bytes: self.stored,
                block_crc32: std::mem::take(&mut self.crcs),
                frame_bytes: std::mem::take(&mut self.frames),
            },
            chunks: std::mem::take(&mut self.chunks),
            global_state,
            rank_state,
            metadata,
        };
        crate::upload::put_part(
            &self.store,
            &format!("{}/{}", self.attempt.dir(), rank_part_name(self.rank)),
            part.to_bytes(),
        )
        .await
    }
}

/// A save attempt for an offline tool writing step `step` into `store`: a fresh run
/// id, and the generation of the newest commit there (so that the tool is not fenced
/// off by the run that wrote the root, and does not fence it off either).
pub async fn tool_attempt(store: &Store, step: u64) -> Result<Attempt> {
    let generation = crate::commits::newest(store)
        .await?
        .map_or(0, |c| c.record.generation);
    Attempt::new(step, generation, crate::attempt::random_run_id())
}

/// Commits save attempt `attempt` of a world of `world` ranks, whose parts must all
/// be written. Returns true when it is committed (by this call or earlier); a
/// failed or fenced commit is an error that says why.
pub async fn commit(store: &Store, attempt: &Attempt, world: u32) -> Result<bool> {
    let present = crate::commit::parts_present(store, attempt, world).await?;
    let outcome = match crate::commit::read_outcome(store, attempt).await? {
        Some(outcome) => outcome,
        None if present < world as usize => return Ok(false),
        None => crate::commit::commit(store, attempt, world).await?,
    };
    match outcome {
        Outcome::Committed { .. } => Ok(true),
        Outcome::Failed { reason } => Err(Error::Failed(format!(
            "step {} did not commit: {reason}",
            attempt.step
        ))),
        Outcome::Superseded { generation } => Err(Error::Fenced(format!(
            "step {} was fenced off: generation {generation} committed first",
            attempt.step
        ))),
    }
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
