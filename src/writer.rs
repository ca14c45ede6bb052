//! Streaming writer of one rank's data file, for offline tools.
//!
//! [`Checkpointer::save`](crate::Checkpointer::save) stages a rank's whole state in
//! memory, which is right for a training loop (the stall is one memcpy). Offline
//! tools that rewrite checkpoints (`ckpt reshard`, `ckpt import`) must not hold whole
//! tensors: they know every box and its size up front, so the header can be written
//! first and the data streamed in order, checksummed (and compressed) block by block
//! as it goes. The result is byte-for-byte the format of section 3 of
//! `docs/FORMAT.md`, committed by the same protocol.

use std::collections::BTreeMap;

use bytes::Bytes;
use ckpt_storage::{Store, Upload};

use crate::attempt::{Attempt, data_file_name};
use crate::codec::compress_block;
use crate::commit::Outcome;
use crate::error::{Error, Result};
use crate::format::{Chunk, Codec, FileEntry, RankPart, StateValue, rank_part_name};
use crate::rank_file::check_header;
pub use crate::rank_file::{PlannedBox, rank_file_header, rank_file_version};

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
            // The offline tools write what they read: health unknown.
            health: None,
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
