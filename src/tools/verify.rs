//! `ckpt verify`: read every byte of a checkpoint and check everything checkable.
//!
//! A checkpoint is sound when its manifest and every rank part pass their checksums
//! and structural checks, the chunks of every tensor tile it exactly once, every rank
//! part agrees with the manifest's layouts, every data file has its recorded size and
//! a safetensors header that matches its part, and every block passes its CRC32.
//! Faults are collected (not just the first), each naming the object, the tensor
//! when one is concerned, and the byte offset. Memory is bounded by the budget:
//! files are streamed in batches of blocks.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Mutex;

use ckpt_storage::Store;
use futures::StreamExt;
use serde::Serialize;

use crate::blocks::{self, BlockMap};
use crate::catalog::Commit;
use crate::error::{Error, Result};
use crate::format::{
    Chunk, ChunkIndex, FormatError, Layout, MAX_HEADER_BYTES, Manifest, RankEntry, RankPart,
    entry_names, parse_safetensors_header,
};
use crate::load::CheckpointReader;
use crate::region::Region;

/// Boxes layouts up to this size are checked pairwise for overlaps.
const FULL_TILING_CHECK_LIMIT: usize = 20_000;

/// Settings of a verification.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// Bytes of data in flight at once, all files together. Default 1 GiB.
    pub memory_budget: u64,
    /// Data files read at once. Default 4.
    pub concurrency: usize,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        Self {
            memory_budget: 1 << 30,
            concurrency: 4,
        }
    }
}

/// What [`verify`] reports as it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyProgress {
    /// Raw bytes the data files to be read hold, by the manifest (once, first).
    Total(u64),
    /// Raw bytes just verified.
    Verified(u64),
}

/// Missing rank parts named one by one in their fault; the rest are counted.
const MISSING_RANKS_NAMED: usize = 5;

/// One thing wrong with a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fault {
    /// The object at fault, relative to the store root.
    pub object: String,
    /// The tensors concerned: those whose data lies in the faulty block or object.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tensors: Vec<String>,
    /// Byte offset in the object, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.object)?;
        if let Some(offset) = self.offset {
            write!(f, " at byte {offset}")?;
        }
        match self.tensors.as_slice() {
            [] => {}
            [one] => write!(f, " (tensor {one:?})")?,
            many => write!(f, " (tensors {})", many.join(", "))?,
        }
        write!(f, ": {}", self.message)
    }
}

/// Outcome of verifying one checkpoint.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// The step verified.
    pub step: u64,
    /// True when no fault was found.
    pub ok: bool,
    /// Data files read.
    pub files: usize,
    /// Blocks checked.
    pub blocks: u64,
    /// Raw bytes whose checksum was verified.
    pub bytes_verified: u64,
    /// Stored bytes of all data files (what reading everything costs).
    pub stored_bytes: u64,
    /// Everything found wrong.
    pub faults: Vec<Fault>,
}

fn fault(
    object: &str,
    tensor: Option<&str>,
    offset: Option<u64>,
    message: impl Into<String>,
) -> Fault {
    Fault {
        object: object.to_string(),
        tensors: tensor.map(str::to_string).into_iter().collect(),
        offset,
        message: message.into(),
    }
}

/// Stored bytes the checkpoint's data files hold by its manifest, for sizing progress
/// bars (saturating: the figures are the manifest's, not yet compared with anything).
pub fn stored_bytes(manifest: &Manifest) -> u64 {
    manifest
        .ranks
        .iter()
        .fold(0, |sum, r| sum.saturating_add(r.stored_bytes))
}

/// Verifies checkpoint `step`. `progress` hears the raw bytes to read, then the raw
/// bytes verified as they are. Errors are for what prevents verifying at all (no
/// such step, store down); everything wrong with the checkpoint itself is a
/// [`Fault`] in the report.
pub async fn verify(
    store: &Store,
    step: u64,
    options: &VerifyOptions,
    progress: &(dyn Fn(VerifyProgress) + Sync),
) -> Result<VerifyReport> {
    let manifest = crate::catalog::read_manifest(store, step).await;
    verify_opened(store, step, manifest, options, progress).await
}

/// Verifies `commit`, as [`verify`] does its step's, without looking the step up in
/// the commit log (which costs a read of every record).
pub async fn verify_commit(
    store: &Store,
    commit: &Commit,
    options: &VerifyOptions,
    progress: &(dyn Fn(VerifyProgress) + Sync),
) -> Result<VerifyReport> {
    let manifest = crate::catalog::read_commit(store, commit).await;
    verify_opened(store, commit.step, manifest, options, progress).await
}

async fn verify_opened(
    store: &Store,
    step: u64,
    manifest: Result<Manifest>,
    options: &VerifyOptions,
    progress: &(dyn Fn(VerifyProgress) + Sync),
) -> Result<VerifyReport> {
    let mut report = VerifyReport {
        step,
        ok: true,
        files: 0,
        blocks: 0,
        bytes_verified: 0,
        stored_bytes: 0,
        faults: Vec::new(),
    };
    let manifest = match manifest {
        Ok(manifest) => manifest,
        Err(Error::Corrupt(e)) => {
            report
                .faults
                .push(fault(&e.object, None, e.offset, e.message));
            report.ok = false;
            return Ok(report);
        }
        Err(e) => return Err(e),
    };
    report.stored_bytes = stored_bytes(&manifest);
    let manifest_object = format!("{}/manifest.json", manifest.dir());
    report
        .faults
        .extend(check_tiling(&manifest, &manifest_object));

    // What every rank must hold, from the layouts.
    let mut expected: HashMap<u32, Vec<(&str, Region)>> = HashMap::new();
    for tensor in &manifest.tensors {
        let layout = &manifest.layouts[tensor.layout as usize];
        for (rank, region) in layout.boxes(&tensor.shape) {
            expected
                .entry(rank)
                .or_default()
                .push((tensor.name.as_str(), region));
        }
    }

    // One listing says which parts exist, so a part absent from it costs no request
    // of its own and all of them make one fault: a manifest that lists a million
    // ranks of which four were saved is one listing and one line, not a million.
    let dir = manifest.dir();
    let listed: HashSet<String> = store
        .list(&dir)
        .await?
        .into_iter()
        .map(|object| object.key)
        .collect();
    let (present, missing): (Vec<&RankEntry>, Vec<&RankEntry>) = manifest
        .ranks
        .iter()
        .partition(|entry| listed.contains(&format!("{dir}/{}", entry.part)));
    drop(listed);
    if !missing.is_empty() {
        report.faults.push(missing_parts(
            &manifest_object,
            &missing,
            manifest.world_size,
        ));
    }
    progress(VerifyProgress::Total(
        present
            .iter()
            .fold(0u64, |sum, entry| sum.saturating_add(entry.raw_bytes)),
    ));
    let present: Vec<u32> = present.iter().map(|entry| entry.rank).collect();
    drop(missing);

    let reader = CheckpointReader::from_manifest(store, manifest.clone());
    let per_file_budget =
        (options.memory_budget / options.concurrency.max(1) as u64).max(manifest.block_size);
    let faults = Mutex::new(Vec::new());
    let counters = Mutex::new((0usize, 0u64, 0u64));
    let verified = |n: u64| progress(VerifyProgress::Verified(n));
    let verified: &(dyn Fn(u64) + Sync) = &verified;
    futures::stream::iter(present)
        .map(|rank| {
            let reader = &reader;
            let expected = expected.get(&rank).map(Vec::as_slice).unwrap_or(&[]);
            let faults = &faults;
            let counters = &counters;
            async move {
                let found =
                    verify_rank(store, reader, rank, expected, per_file_budget, verified).await;
                match found {
                    Ok((mut file_faults, blocks, bytes)) => {
                        let mut c = counters.lock().unwrap_or_else(|p| p.into_inner());
                        c.0 += 1;
                        c.1 += blocks;
                        c.2 += bytes;
                        faults
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .append(&mut file_faults);
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
        })
        .buffer_unordered(options.concurrency.max(1))
        .collect::<Vec<Result<()>>>()
        .await
        .into_iter()
        .collect::<Result<()>>()?;
    let (files, blocks, bytes) = *counters.lock().unwrap_or_else(|p| p.into_inner());
    report.files = files;
    report.blocks = blocks;
    report.bytes_verified = bytes;
    report
        .faults
        .extend(faults.into_inner().unwrap_or_else(|p| p.into_inner()));
    report
        .faults
        .sort_by(|a, b| (&a.object, a.offset).cmp(&(&b.object, b.offset)));
    report.ok = report.faults.is_empty();
    Ok(report)
}

/// One fault for every rank part the manifest lists and the store lacks: how many,
/// and the first few ranks.
fn missing_parts(manifest_object: &str, missing: &[&RankEntry], world: u32) -> Fault {
    let named: Vec<String> = missing
        .iter()
        .take(MISSING_RANKS_NAMED)
        .map(|entry| entry.rank.to_string())
        .collect();
    let more = missing.len() - named.len();
    let mut ranks = format!(
        "{} {}",
        if missing.len() == 1 { "rank" } else { "ranks" },
        named.join(", ")
    );
    if more > 0 {
        ranks.push_str(&format!(" and {more} more"));
    }
    fault(
        manifest_object,
        None,
        None,
        format!(
            "{} of {world} rank parts are missing from a committed checkpoint: {ranks}",
            missing.len()
        ),
    )
}

/// Exact tiling: boxes inside the shape (checked at parse), volumes summing to the
/// tensor (checked at parse), and pairwise disjoint (checked here for large layouts).
fn check_tiling(manifest: &Manifest, object: &str) -> Vec<Fault> {
    let mut faults = Vec::new();
    for tensor in &manifest.tensors {
        let Layout::Boxes(boxes) = &manifest.layouts[tensor.layout as usize] else {
            continue;
        };
        if boxes.len() > FULL_TILING_CHECK_LIMIT {
            faults.push(fault(
                object,
                Some(&tensor.name),
                None,
                format!(
                    "{} boxes: more than {FULL_TILING_CHECK_LIMIT}, overlaps not checked",
                    boxes.len()
                ),
            ));
            continue;
        }
        let regions: Vec<Region> = boxes
            .iter()
            .map(|b| Region::new(b.offsets.clone(), b.lengths.clone()))
            .collect();
        'outer: for (i, a) in regions.iter().enumerate() {
            for b in &regions[i + 1..] {
                if let Some(common) = a.intersect(b) {
                    faults.push(fault(
                        object,
                        Some(&tensor.name),
                        None,
                        format!("boxes {a} and {b} overlap in {common}"),
                    ));
                    break 'outer;
                }
            }
        }
    }
    faults
}

/// Checks one rank: its part, its agreement with the layouts, its data file.
/// Returns (faults, blocks checked, raw bytes verified).
async fn verify_rank(
    store: &Store,
    reader: &CheckpointReader,
    rank: u32,
    expected: &[(&str, Region)],
    budget: u64,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(Vec<Fault>, u64, u64)> {
    let part = match reader.part(rank).await {
        Ok(part) => part,
        Err(Error::Corrupt(e)) => {
            return Ok((vec![fault(&e.object, None, e.offset, e.message)], 0, 0));
        }
        Err(e) => return Err(e),
    };
    let dir = reader.manifest().dir();
    let part_object = format!("{}/{}", dir, crate::format::rank_part_name(rank));
    let object = format!("{}/{}", dir, part.file.name);
    let mut faults = Vec::new();

    // The part holds exactly the boxes the manifest places on this rank, found by
    // tensor and box: a rank may hold several boxes of one tensor.
    let chunks = ChunkIndex::new(&part);
    for (name, region) in expected {
        if chunks.get(name, region).is_none() {
            faults.push(fault(
                &part_object,
                Some(name),
                None,
                format!("lacks box {region} the manifest places here"),
            ));
        }
    }
    let placed: HashSet<(&str, &[u64], &[u64])> = expected
        .iter()
        .map(|(name, region)| (*name, &region.offsets[..], &region.lengths[..]))
        .collect();
    // A tensor with no element has no box in its layout, yet one part holds its
    // (empty) chunk, so that the commit knew of it.
    let empty_of_manifest = |c: &Chunk| {
        c.lengths.contains(&0)
            && reader
                .manifest()
                .tensor(&c.tensor)
                .is_some_and(|t| t.shape == c.shape && t.dtype == c.dtype)
    };
    for chunk in part.chunks.iter().filter(|c| {
        !placed.contains(&(c.tensor.as_str(), &c.offsets[..], &c.lengths[..]))
            && !empty_of_manifest(c)
    }) {
        faults.push(fault(
            &part_object,
            Some(&chunk.tensor),
            None,
            format!(
                "holds box {} the manifest does not place here",
                chunk.region()
            ),
        ));
    }

    match store.head(&object).await {
        Ok(info) if info.size == part.file.stored_bytes => {}
        Ok(info) => faults.push(fault(
            &object,
            None,
            Some(info.size.min(part.file.stored_bytes)),
            format!(
                "{} bytes stored, the part records {}",
                info.size, part.file.stored_bytes
            ),
        )),
        Err(e) if e.is_not_found() => {
            faults.push(fault(&object, None, None, "data file is missing"));
            return Ok((faults, 0, 0));
        }
        Err(e) => return Err(e.into()),
    }

    let (mut file_faults, blocks, bytes) =
        verify_blocks(store, &object, &part, budget, progress).await?;
    faults.append(&mut file_faults);
    Ok((faults, blocks, bytes))
}

/// Streams every block of a data file, checks each CRC, and checks the safetensors
/// header against the part.
async fn verify_blocks(
    store: &Store,
    object: &str,
    part: &RankPart,
    budget: u64,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(Vec<Fault>, u64, u64)> {
    let map = BlockMap::new(part);
    let total = map.blocks();
    let per_batch = (budget / part.block_size).max(1);
    let mut faults = Vec::new();
    // Raw bytes from the file's start, kept until the header is whole.
    let mut header: Option<Vec<u8>> = Some(Vec::new());
    let (mut checked, mut verified) = (0u64, 0u64);
    // Chunks by start offset, to name the tensor a bad block belongs to.
    let mut by_offset: Vec<&Chunk> = part.chunks.iter().collect();
    by_offset.sort_by_key(|c| c.bytes[0]);
    // Tensors whose data meets raw bytes `range`, to say what a bad block holds.
    let tensors_in = |range: &Range<u64>| -> Vec<String> {
        let first = by_offset.partition_point(|c| c.bytes[1] <= range.start);
        by_offset[first..]
            .iter()
            .take_while(|c| c.bytes[0] < range.end)
            .filter(|c| c.bytes[1] > c.bytes[0])
            .map(|c| c.tensor.clone())
            .collect()
    };

    let mut start = 0;
    while start < total {
        let batch: Range<u64> = start..(start + per_batch).min(total);
        start = batch.end;
        let stored = match blocks::fetch(store, object, &map, &batch).await {
            Ok(stored) => stored,
            Err(Error::Corrupt(e)) => {
                faults.push(fault(&e.object, None, e.offset, e.message));
                break;
            }
            Err(e) => return Err(e),
        };
        let crcs = &part.file.block_crc32[batch.start as usize..batch.end as usize];
        let object_owned = object.to_string();
        let map_owned = map.clone();
        let crcs_owned = crcs.to_vec();
        let batch_owned = batch.clone();
        let results = tokio::task::spawn_blocking(move || {
            let mut out = Vec::with_capacity((batch_owned.end - batch_owned.start) as usize);
            blocks::check(
                &object_owned,
                &map_owned,
                &batch_owned,
                &crcs_owned,
                &stored,
                |b, r| {
                    out.push((b, r));
                    true
                },
            );
            out
        })
        .await
        .map_err(|e| Error::Failed(format!("verification task failed: {e}")))?;
        for (b, result) in results {
            checked += 1;
            let raw = map.raw_range(b);
            match result {
                Ok(data) => {
                    verified += data.len() as u64;
                    progress(data.len() as u64);
                    if let Some(prefix) = header.as_mut() {
                        prefix.extend_from_slice(&data);
                        if header_bytes_wanted(prefix, part.file.raw_bytes).is_none() {
                            faults.extend(check_header(object, part, prefix));
                            header = None;
                        }
                    }
                }
                Err(e) => {
                    let mut f = fault(&e.object, None, e.offset, e.message);
                    f.tensors = tensors_in(&raw);
                    faults.push(f);
                    // A bad block before the header is whole: the CRC fault says it all.
                    header = None;
                }
            }
        }
    }
    if let Some(prefix) = header {
        faults.extend(check_header(object, part, &prefix));
    }
    Ok((faults, checked, verified))
}

/// Bytes from the file's start that judging its safetensors header needs, or `None`
/// once `prefix` holds them all (or enough to know the header cannot be sound: a
/// length beyond the limit or beyond the file).
fn header_bytes_wanted(prefix: &[u8], raw_bytes: u64) -> Option<u64> {
    let Some(len) = prefix.get(..8) else {
        return Some(8);
    };
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    let judged =
        n > MAX_HEADER_BYTES || n.saturating_add(8) > raw_bytes || prefix.len() as u64 >= n + 8;
    (!judged).then(|| n + 8)
}

/// Reads the safetensors header of the data file `object` of `part`, through its
/// checksummed blocks, and checks it as [`verify`] does: it must parse and describe
/// exactly the part's chunks. The first fault is the error, naming the object and
/// the byte offset.
///
/// For the tools that read data by the part's byte ranges: the loader needs nothing
/// from the header (the part, vouched for by the manifest, says where each chunk
/// lies, and the block checksums vouch for the bytes), but what `export` and
/// `reshard` write out must not come from a file that `verify` rejects. Reads at
/// most the header's blocks; a header longer than the format's limit is refused
/// from its first 8 bytes.
pub(crate) async fn check_data_header(store: &Store, object: &str, part: &RankPart) -> Result<()> {
    let map = BlockMap::new(part);
    let mut prefix = Vec::new();
    let mut next = 0;
    while next < map.blocks() {
        let Some(wanted) = header_bytes_wanted(&prefix, part.file.raw_bytes) else {
            break;
        };
        let batch = next..wanted
            .div_ceil(part.block_size)
            .clamp(next + 1, map.blocks());
        let stored = blocks::fetch(store, object, &map, &batch).await?;
        let crcs = &part.file.block_crc32[batch.start as usize..batch.end as usize];
        let mut failure = None;
        blocks::check(
            object,
            &map,
            &batch,
            crcs,
            &stored,
            |_, block| match block {
                Ok(data) => {
                    prefix.extend_from_slice(&data);
                    true
                }
                Err(e) => {
                    failure = Some(e);
                    false
                }
            },
        );
        if let Some(e) = failure {
            return Err(e.into());
        }
        next = batch.end;
    }
    match check_header(object, part, &prefix).into_iter().next() {
        None => Ok(()),
        Some(f) => {
            let message = match f.tensors.first() {
                Some(tensor) => format!("tensor {tensor:?}: {}", f.message),
                None => f.message,
            };
            Err(FormatError::new(&f.object, f.offset, message).into())
        }
    }
}

/// The safetensors header must parse and describe exactly the part's chunks.
fn check_header(object: &str, part: &RankPart, prefix: &[u8]) -> Vec<Fault> {
    let header = match parse_safetensors_header(prefix, part.file.raw_bytes, object) {
        Ok(header) => header,
        Err(e) => return vec![fault(&e.object, None, e.offset, e.message)],
    };
    let mut faults = Vec::new();
    let entries: HashMap<&str, _> = header
        .entries
        .iter()
        .map(|e| (e.name.as_str(), e))
        .collect();
    // Each chunk's entry, named as the writer names it (a tensor with several boxes
    // in the file has one entry per box, named by its slice).
    let boxes: Vec<(&str, &[u64], &[u64])> = part
        .chunks
        .iter()
        .map(|c| (c.tensor.as_str(), &c.offsets[..], &c.lengths[..]))
        .collect();
    for (chunk, name) in part.chunks.iter().zip(entry_names(&boxes)) {
        let wanted = [
            chunk.bytes[0].wrapping_sub(header.data_start),
            chunk.bytes[1].wrapping_sub(header.data_start),
        ];
        match entries.get(name.as_str()) {
            Some(e)
                if e.dtype == chunk.dtype
                    && e.shape == chunk.lengths
                    && e.data_offsets == wanted => {}
            Some(e) => faults.push(fault(
                object,
                Some(&chunk.tensor),
                Some(8),
                format!(
                    "safetensors entry {name:?} {} {:?} at {:?} disagrees with the part's {} {:?} at {:?}",
                    e.dtype, e.shape, e.data_offsets, chunk.dtype, chunk.lengths, wanted
                ),
            )),
            None => faults.push(fault(
                object,
                Some(&chunk.tensor),
                Some(8),
                format!("safetensors header has no entry {name:?} for this chunk"),
            )),
        }
    }
    if header.entries.len() != part.chunks.len() {
        faults.push(fault(
            object,
            None,
            Some(8),
            format!(
                "safetensors header has {} entries, the part {} chunks",
                header.entries.len(),
                part.chunks.len()
            ),
        ));
    }
    faults
}
