//! A save whose staging does not fit the host memory budget: staged and uploaded in
//! pieces.
//!
//! # Why
//!
//! A save stages the rank's whole data file in host memory before it uploads it, so
//! that the training loop waits for one memcpy only. When that buffer does not fit
//! [`CheckpointConfig::host_memory_budget`](crate::CheckpointConfig::host_memory_budget)
//! even after every droppable copy was let go, the save could fail, or pass the
//! bound and risk the OOM kill the budget is there to prevent. It does neither: it
//! takes the largest buffer that fits (a whole number of blocks) and walks the file
//! through it one window at a time — fill the window from the caller's tensors,
//! checksum its blocks (compress them with zstd), upload it as the next parts of one
//! multipart upload of the data file, wait until the store has let go of the window,
//! fill the next. The part then describes the file exactly as a whole-file save's
//! would, and the commit is the normal one: readers cannot tell the difference.
//!
//! # The cost
//!
//! The caller's tensors are read until the last window is uploaded, so the save
//! blocks for the whole upload, not for one copy: [`Checkpointer::save`] returns
//! once the data file is stored, and so does
//! [`Checkpointer::save_overlapped`](crate::Checkpointer::save_overlapped) (its
//! tensors are free when it returns, as for a blocking save). One warning per such
//! save names the step, the file's size, the budget and the number of pieces.
//! The windows go one after the other (fill, checksum, upload, wait): the stall is
//! about the copy plus the upload of the whole file.
//!
//! The health scan (non-finite counts, slice CRCs of replicated boxes) reads the
//! caller's tensors once more, box by box, rather than the windows: a box's slices
//! are counted from its own start, which a window boundary does not respect.
//! Replicas another rank writes are hashed from the caller's memory, as always.
//!
//! # Memory
//!
//! Held from the budget: the window (and with zstd the room for its frames, at most
//! `compress_bound` of each block, so the window is about half as large). Outside it:
//! the store's partial part, at most one part (`part_size`) of bytes copied from the
//! window's tail (none when the window is a whole number of parts, the usual case)
//! or of frames waiting for the next part, and the compressor's per-thread state.
//! Measured on a 96 MiB file over a 32 MiB budget (16 MiB parts, local disk): the
//! resident set grew by 36 MiB uncompressed, by 60 MiB with zstd (a 16 MiB window,
//! its frames, a part waiting, the compressors). A piecewise save keeps no in-memory copy
//! ([`CheckpointConfig::keep_copy`](crate::CheckpointConfig::keep_copy)): no whole
//! file ever exists in memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use bytes::Bytes;
use ckpt_storage::{Store, Upload};
use tokio::sync::{Notify, OwnedSemaphorePermit, watch};
use tracing::{Instrument, info_span, warn};

use super::job::after_write;
use super::plan::{StagePlan, hash_replicas};
use super::write::{Scanned, describe_file, encode_threads, replica_crcs};
use super::{Checkpointer, Job, Role, SaveHandle, ShadowBox, Staging, Status};
use crate::attempt::{Attempt, data_file_name, nonce};
use crate::budget::{HeldKind, Reservation};
use crate::codec::compress_block;
use crate::direct::ALIGN;
use crate::error::{Error, Result};
use crate::format::{Chunk, ChunkNonFinite, Codec, PartHealth, rank_part_name};
use crate::health::{ScanChunk, join_scans, scan_blocks};
use crate::staging::{Pooled, Source, StagingBuffer};
use crate::upload::put_part;

/// What `start` laid out before it found that the file's staging does not fit.
pub(super) struct Unstaged {
    pub(super) step: u64,
    pub(super) attempt: Attempt,
    /// The header and the sources (its chunks, scan and shadow taken out below).
    pub(super) plan: StagePlan,
    pub(super) chunks: Vec<Chunk>,
    pub(super) scan_chunks: Arc<Vec<ScanChunk>>,
    pub(super) shadow: Vec<ShadowBox>,
    pub(super) health: PartHealth,
    pub(super) permit: OwnedSemaphorePermit,
    pub(super) started: Instant,
}

/// How many times the data file is uploaded while the server stores other bytes
/// than those sent (as `crate::upload::upload` does for a staged file: the tensors
/// are still there to stage it again).
const UPLOAD_ATTEMPTS: usize = 3;

impl Checkpointer {
    /// Saves `state` in pieces (see the [module docs](self)); `over` is why its
    /// staging did not fit, returned when not even one block does.
    pub(super) async fn save_in_pieces(
        &self,
        state: &crate::State<'_>,
        unstaged: Unstaged,
        over: Error,
    ) -> Result<SaveHandle> {
        let Unstaged {
            step,
            attempt,
            plan,
            chunks,
            scan_chunks,
            mut shadow,
            health,
            permit,
            started,
        } = unstaged;
        let config = self.config.clone();
        let rank = config.rank as u32;
        let block = config.block_size as usize;
        let file_len = plan.file_len;
        let part_size = self.store.config().part_size;
        let room = self.budget.available();
        let Some(size) = window_size(room, block, part_size, file_len, config.codec) else {
            return Err(Error::OverBudget(format!(
                "{over}; not even one block of {block} bytes fits, so step {step} cannot be \
                 staged in pieces either"
            )));
        };
        let mut window = StagingBuffer::counted_in(Some(self.budget.clone()));
        window.reset(size.window)?;
        let frames_room = match size.frames {
            0 => None,
            bytes => Some(
                Reservation::new(&self.budget, HeldKind::Staging, bytes as u64).ok_or_else(
                    || {
                        Error::OverBudget(format!(
                            "room for the compressed frames of one window ({bytes} bytes) does \
                             not fit the host memory budget: {}",
                            self.budget.held()
                        ))
                    },
                )?,
            ),
        };
        let pieces = file_len.div_ceil(size.window);
        let budget = self.budget.limit().unwrap_or(u64::MAX);
        warn!(
            step,
            rank,
            file_bytes = file_len,
            budget,
            pieces,
            window = size.window,
            "staging in pieces: step {step}'s data file of {file_len} bytes does not fit the \
             host memory budget of {budget} bytes; it is staged and uploaded {} bytes at a \
             time, in {pieces} pieces, and the stall covers the upload",
            size.window
        );

        let compressed = matches!(config.codec, Codec::Zstd { .. });
        let file_name = data_file_name(rank, compressed, &nonce());
        let dir = attempt.dir();
        let key = format!("{dir}/{file_name}");
        let threads = encode_threads();
        crate::failpoint::hit("before-data-upload");
        // SAFETY: the caller's borrows of `state` are live during this call, which
        // reads the sources only before it returns.
        let (nonfinite, written_replicas) =
            unsafe { scan_sources(&plan.sources, &scan_chunks, block, threads) };
        // SAFETY: as above.
        let shadow_crcs = unsafe { hash_replicas(&plan.replica_sources, block, threads) };
        for (shadow, crcs) in shadow.iter_mut().zip(shadow_crcs) {
            shadow.crcs = Some(crcs);
        }
        let mut window = Arc::new(window);
        let layout = Layout {
            header: &plan.header,
            sources: &plan.sources,
            file_len,
            block,
            codec: config.codec,
            copy_threads: config.copy_threads,
            encode_threads: threads,
        };
        let in_flight = Arc::new(InFlight::default());
        let mut attempt_no = 1;
        let uploaded = loop {
            // SAFETY: as above.
            let result =
                unsafe { upload_file(&self.store, &key, &layout, &mut window, &in_flight).await };
            match result {
                Err(Error::Storage(e))
                    if e.is_damaged_in_flight() && attempt_no < UPLOAD_ATTEMPTS =>
                {
                    warn!(key, attempt = attempt_no, error = %e, "a part was damaged on its way to the store; uploading the file again");
                    attempt_no += 1;
                }
                result => break result,
            }
        };
        // Finished or aborted, the upload has let go of every share of the window
        // and frame (an aborted part's task drops its bytes when cancelled).
        in_flight.settle(0).await;
        drop(frames_room);
        // The window is idle staging now: pooled for the next save (the budget trims
        // it when room is wanted).
        if let Ok(buffer) = Arc::try_unwrap(window) {
            self.pool
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(buffer);
        }
        if uploaded.is_ok() {
            crate::failpoint::hit("after-data-upload");
        }
        let stall = started.elapsed();
        let (_, staging) = watch::channel(Staging::Done(stall));

        let role = match config.committers().iter().position(|&r| r == config.rank) {
            Some(index) => Role::Committer {
                index: index as u32,
            },
            None => Role::Waiter,
        };
        let (status_tx, status) = watch::channel(Status::Writing);
        let job = Job {
            store: self.store.clone(),
            config: config.clone(),
            attempt: attempt.clone(),
            role,
            buffer: Arc::new(Pooled::unpooled(StagingBuffer::new())),
            copy: None,
            chunks,
            scan_chunks,
            shadow,
            health,
            file_len,
            global: (config.rank == 0 && (!state.global.is_empty() || !state.metadata.is_empty()))
                .then(|| state.global.clone()),
            rank_state: state.rank.clone(),
            metadata: state.metadata.clone(),
            pending_copies: None,
            snapshot: None,
        };
        let task = async move {
            let written = match uploaded {
                Ok(file) => {
                    // Host memory only: every shadow box was hashed while staging.
                    let replicas = replica_crcs(&job, written_replicas, |_| Vec::new());
                    let stored = file.stored_bytes;
                    let part = describe_file(
                        &job,
                        file_name,
                        file_len as u64,
                        stored,
                        Scanned::new(file.crcs, nonfinite, replicas),
                        job.config.codec,
                        file.frame_bytes,
                    );
                    let key = format!("{dir}/{}", rank_part_name(rank));
                    put_part(&job.store, &key, part.to_bytes()).await
                }
                Err(e) => Err(e),
            };
            drop(permit);
            after_write(
                written,
                &job.store,
                &job.config,
                &job.attempt,
                role,
                &status_tx,
            )
            .await;
        };
        let task = tokio::spawn(task.instrument(info_span!("ckpt_save", step, rank)));
        {
            let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
            tasks.retain(|t| !t.is_finished());
            tasks.push(task);
        }
        // With keep_copy, the handle waits for a copy that never comes: its
        // `staged_copy` says the save ended without one.
        let copy = config.keep_copy.then(|| watch::channel(None).1);
        Ok(SaveHandle {
            attempt,
            store: self.store.clone(),
            status,
            staging,
            copy,
            role,
            world_size: config.world_size,
            commit_timeout: config.commit_timeout,
            stall,
            budget: self.budget.clone(),
            #[cfg(feature = "cuda")]
            device: None,
        })
    }
}

/// The sizes a piecewise save holds from the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WindowSize {
    /// Raw bytes staged at once: a whole number of blocks.
    window: usize,
    /// Room for the window's compressed frames (zstd), else 0.
    frames: usize,
}

/// The largest window that fits in `room` bytes (with zstd, with room for its
/// frames), never longer than the file: a whole number of `block`s, and when
/// uncompressed and at least one part long, of `part_size`s (if parts are whole
/// blocks), so that the store holds no byte of it once its parts are sent. `None`
/// when not even one block fits.
fn window_size(
    room: u64,
    block: usize,
    part_size: usize,
    file_len: usize,
    codec: Codec,
) -> Option<WindowSize> {
    let room = usize::try_from(room).unwrap_or(usize::MAX);
    let frame_bound = match codec {
        Codec::None => 0,
        Codec::Zstd { .. } => zstd::zstd_safe::compress_bound(block),
    };
    // A mapping is a whole number of pages: round the room down to pages first.
    let fits = |blocks: usize| {
        let window = blocks * block;
        window.div_ceil(ALIGN) * ALIGN + blocks * frame_bound <= room
    };
    let needed = file_len.div_ceil(block).max(1);
    let mut blocks = ((room / ALIGN * ALIGN) / (block + frame_bound)).min(needed);
    while blocks > 0 && !fits(blocks) {
        blocks -= 1;
    }
    if blocks == 0 {
        return None;
    }
    if frame_bound == 0 && part_size.is_multiple_of(block) {
        let per_part = part_size / block;
        if blocks >= per_part && blocks < needed {
            blocks = blocks / per_part * per_part;
        }
    }
    Some(WindowSize {
        window: blocks * block,
        frames: blocks * frame_bound,
    })
}

/// The data file as the windows see it.
struct Layout<'a> {
    header: &'a [u8],
    sources: &'a [Source],
    file_len: usize,
    block: usize,
    codec: Codec,
    copy_threads: usize,
    encode_threads: usize,
}

/// What the upload of the data file found and stored.
#[derive(Debug)]
struct Uploaded {
    crcs: Vec<u32>,
    frame_bytes: Vec<u64>,
    stored_bytes: u64,
}

/// Bytes handed to the store that it holds until their part is sent: a share of the
/// window, or a frame. Counted in `in_flight` while held.
struct Lent {
    window: Option<Arc<StagingBuffer>>,
    frame: Vec<u8>,
    len: usize,
    in_flight: Arc<InFlight>,
}

/// Bytes the store holds of ours, and the event of their release.
#[derive(Debug, Default)]
struct InFlight {
    bytes: AtomicUsize,
    released: Notify,
}

impl Lent {
    fn bytes(self) -> Bytes {
        self.in_flight.bytes.fetch_add(self.len, Ordering::AcqRel);
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        match &self.window {
            Some(window) => &window[..self.len],
            None => &self.frame,
        }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        // The window's reference goes before the event, so a waiter that wakes
        // finds it gone.
        self.window = None;
        self.frame = Vec::new();
        self.in_flight.bytes.fetch_sub(self.len, Ordering::AcqRel);
        self.in_flight.released.notify_one();
    }
}

impl InFlight {
    /// Waits until at most `bytes` are held by the store.
    async fn settle(&self, bytes: usize) {
        while self.bytes.load(Ordering::Acquire) > bytes {
            self.released.notified().await;
        }
    }
}

/// Uploads the data file `layout` describes to `key` through `window`, one window at
/// a time (see the [module docs](self)).
///
/// # Safety
/// Every source must stay allocated and unwritten until this returns.
async unsafe fn upload_file(
    store: &Store,
    key: &str,
    layout: &Layout<'_>,
    window: &mut Arc<StagingBuffer>,
    in_flight: &Arc<InFlight>,
) -> Result<Uploaded> {
    let mut upload = store.upload(key)?;
    // SAFETY: forwarded from the caller.
    let fed = unsafe { feed(&mut upload, store, layout, window, in_flight).await };
    match fed {
        Ok(uploaded) => {
            upload.finish().await?;
            Ok(uploaded)
        }
        Err(e) => {
            if let Err(abort) = upload.abort().await {
                warn!(key, error = %abort, "could not abort the data file's upload");
            }
            Err(e)
        }
    }
}

/// Writes the file's windows into `upload`.
///
/// # Safety
/// As [`upload_file`].
async unsafe fn feed(
    upload: &mut Upload,
    store: &Store,
    layout: &Layout<'_>,
    window: &mut Arc<StagingBuffer>,
    in_flight: &Arc<InFlight>,
) -> Result<Uploaded> {
    let part_size = store.config().part_size.max(1);
    let block = layout.block;
    let size = window.capacity() / block * block;
    let mut out = Uploaded {
        crcs: Vec::with_capacity(layout.file_len.div_ceil(block)),
        frame_bytes: Vec::new(),
        stored_bytes: 0,
    };
    let mut largest_frame = 0;
    let mut offset = 0;
    while offset < layout.file_len {
        let len = size.min(layout.file_len - offset);
        // The store lets go of the previous window's bytes (and of frames, but the
        // partial part it keeps until the next one fills) before the window is
        // filled again.
        match layout.codec {
            Codec::None => in_flight.settle(0).await,
            Codec::Zstd { .. } => in_flight.settle(part_size + largest_frame).await,
        }
        let buffer = Arc::get_mut(window).expect("the store let go of the window");
        let dst = buffer.fill(len);
        // SAFETY: forwarded from the caller.
        unsafe {
            fill_window(
                dst,
                offset,
                layout.header,
                layout.sources,
                layout.copy_threads,
            )
        };
        let (crcs, frames) =
            encode_window(&buffer[..len], block, layout.codec, layout.encode_threads)?;
        out.crcs.extend(crcs);
        let before = out.stored_bytes as usize;
        match layout.codec {
            Codec::None => {
                // Whole parts go as shares of the window; a tail that ends inside a
                // part is copied, since the store keeps it until the next window.
                let end = before + len;
                let shared = (end / part_size * part_size)
                    .saturating_sub(before)
                    .min(len);
                if shared > 0 {
                    let lent = Lent {
                        window: Some(window.clone()),
                        frame: Vec::new(),
                        len: shared,
                        in_flight: in_flight.clone(),
                    };
                    upload.write(lent.bytes()).await?;
                }
                if shared < len {
                    upload
                        .write(Bytes::copy_from_slice(&window[shared..len]))
                        .await?;
                }
                out.stored_bytes += len as u64;
            }
            Codec::Zstd { .. } => {
                for frame in frames {
                    let n = frame.len();
                    largest_frame = largest_frame.max(n);
                    out.frame_bytes.push(n as u64);
                    out.stored_bytes += n as u64;
                    let lent = Lent {
                        window: None,
                        frame,
                        len: n,
                        in_flight: in_flight.clone(),
                    };
                    upload.write(lent.bytes()).await?;
                }
            }
        }
        if before < part_size && out.stored_bytes as usize >= part_size {
            crate::failpoint::hit("during-data-upload");
        }
        offset += len;
    }
    Ok(out)
}

/// Writes bytes `[offset, offset + dst.len())` of the data file (`header`, then
/// `sources` back to back) into `dst`, copying only what overlaps the window, on
/// `threads` threads.
///
/// # Safety
/// Every source must stay allocated and unwritten until this returns.
unsafe fn fill_window(
    dst: &mut [u8],
    offset: usize,
    header: &[u8],
    sources: &[Source],
    threads: usize,
) {
    let end = offset + dst.len();
    let mut data_at = 0;
    if offset < header.len() {
        let head = &header[offset..end.min(header.len())];
        dst[..head.len()].copy_from_slice(head);
        data_at = head.len();
    }
    let mut within = Vec::new();
    let mut lo = header.len();
    for source in sources {
        let hi = lo + source.len();
        let (from, to) = (lo.max(offset), hi.min(end));
        if from < to {
            // SAFETY: forwarded from the caller.
            let bytes = unsafe { source.bytes() };
            within.push(Source::new(&bytes[from - lo..to - lo]));
        }
        lo = hi;
        if lo >= end {
            break;
        }
    }
    // SAFETY: the slices of live sources, as above.
    unsafe { crate::staging::copy_sources(&mut dst[data_at..], &within, threads) };
}

/// Each block's CRC32 and (zstd) frame.
type Encoded = Vec<(u32, Vec<u8>)>;

/// The block CRC32s of one window (a whole number of blocks, but the file's last),
/// and with zstd its frames, on `threads` threads.
fn encode_window(
    window: &[u8],
    block: usize,
    codec: Codec,
    threads: usize,
) -> Result<(Vec<u32>, Vec<Vec<u8>>)> {
    let blocks: Vec<&[u8]> = window.chunks(block).collect();
    let per = blocks.len().div_ceil(threads.max(1)).max(1);
    let encode = |group: &[&[u8]]| -> std::io::Result<Encoded> {
        group
            .iter()
            .map(|raw| {
                let frame = match codec {
                    Codec::None => Vec::new(),
                    Codec::Zstd { level, shuffle } => compress_block(raw, level, shuffle)?,
                };
                Ok((crc32fast::hash(raw), frame))
            })
            .collect()
    };
    let groups: Vec<std::io::Result<Encoded>> = std::thread::scope(|scope| {
        let handles: Vec<_> = blocks
            .chunks(per)
            .map(|group| scope.spawn(move || encode(group)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("an encode thread panicked"))
            .collect()
    });
    let mut crcs = Vec::with_capacity(blocks.len());
    let mut frames = Vec::new();
    for group in groups {
        let group = group.map_err(|e| Error::Failed(format!("compression failed: {e}")))?;
        for (crc, frame) in group {
            crcs.push(crc);
            if matches!(codec, Codec::Zstd { .. }) {
                frames.push(frame);
            }
        }
    }
    Ok((crcs, frames))
}

/// The health scan of the written boxes, from the caller's memory box by box (each
/// box's slices counted from its start, as the whole-file scan counts them): the
/// non-finite counts and the slice CRCs of replicated boxes, by chunk index.
///
/// # Safety
/// Every source must stay allocated and unwritten until this returns.
unsafe fn scan_sources(
    sources: &[Source],
    chunks: &[ScanChunk],
    block: usize,
    threads: usize,
) -> (Vec<ChunkNonFinite>, Vec<(usize, Vec<u32>)>) {
    // (box, its blocks) units, spread over the threads.
    let units: Vec<(usize, std::ops::Range<usize>)> = chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| c.float || c.replicated)
        .flat_map(|(i, c)| {
            let blocks = (c.end - c.begin).div_ceil(block);
            let per = blocks.div_ceil(threads.max(1)).max(1);
            (0..blocks)
                .step_by(per)
                .map(move |b| (i, b..(b + per).min(blocks)))
        })
        .collect();
    let alone = |i: usize| ScanChunk {
        begin: 0,
        end: chunks[i].end - chunks[i].begin,
        ..chunks[i]
    };
    let scan = |(i, blocks): &(usize, std::ops::Range<usize>)| {
        // SAFETY: forwarded from the caller.
        let bytes = unsafe { sources[*i].bytes() };
        scan_blocks(bytes, blocks.clone(), block, &[alone(*i)])
    };
    let per = units.len().div_ceil(threads.max(1)).max(1);
    let scans: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = units
            .chunks(per)
            .map(|group| scope.spawn(move || group.iter().map(scan).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a health scan thread panicked"))
            .collect()
    });
    let mut nonfinite = Vec::new();
    let mut replicas = Vec::new();
    let mut scans = units.iter().map(|(i, _)| *i).zip(scans).peekable();
    while let Some((i, first)) = scans.next() {
        let mut of_box = vec![first];
        while let Some((_, next)) = scans.next_if(|(j, _)| *j == i) {
            of_box.push(next);
        }
        let found = join_scans(of_box, &[alone(i)], block);
        nonfinite.extend(found.nonfinite.into_iter().map(|n| ChunkNonFinite {
            chunk: i as u32,
            elements: n.elements,
        }));
        replicas.extend(found.replicas.into_iter().map(|(_, crcs)| (i, crcs)));
    }
    (nonfinite, replicas)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole file as `fill` lays it out.
    fn whole(header: &[u8], sources: &[Source]) -> Vec<u8> {
        let total = header.len() + sources.iter().map(Source::len).sum::<usize>();
        let mut buffer = StagingBuffer::new();
        buffer.reset(total).unwrap();
        // SAFETY: the sources borrow the test's vectors, live and unwritten.
        unsafe { super::super::plan::fill(&mut buffer, header, sources, total, 1) };
        buffer.to_vec()
    }

    #[test]
    fn windows_put_together_are_the_whole_file_wherever_they_cut() {
        let header: Vec<u8> = (0..37u8).collect();
        let boxes: Vec<Vec<u8>> = [0usize, 5, 1, 64, 0, 19, 100]
            .iter()
            .enumerate()
            .map(|(b, &n)| (0..n).map(|i| (i * 7 + b * 31) as u8 ^ 0x5a).collect())
            .collect();
        let sources: Vec<Source> = boxes.iter().map(|b| Source::new(b)).collect();
        let file = whole(&header, &sources);
        assert_eq!(file.len(), 37 + 5 + 1 + 64 + 19 + 100);
        // Windows that cut the header, a box, fall between boxes, or hold it all.
        for size in [
            1,
            3,
            16,
            36,
            37,
            38,
            42,
            43,
            100,
            file.len() - 1,
            file.len(),
            4096,
        ] {
            for threads in [1, 3] {
                let mut pieced = Vec::new();
                let mut offset = 0;
                while offset < file.len() {
                    let mut dst = vec![0xEE; size.min(file.len() - offset)];
                    // SAFETY: as above.
                    unsafe { fill_window(&mut dst, offset, &header, &sources, threads) };
                    pieced.extend_from_slice(&dst);
                    offset += dst.len();
                }
                assert!(
                    pieced == file,
                    "windows of {size} bytes on {threads} threads"
                );
            }
        }
    }

    #[test]
    fn the_window_is_the_largest_whole_number_of_blocks_and_parts_that_fits() {
        let mib = 1usize << 20;
        let plain = Codec::None;
        let size = |room: usize, file: usize| {
            window_size(room as u64, 256 << 10, 16 * mib, file, plain).map(|s| s.window)
        };
        // Whole parts when at least one fits.
        assert_eq!(size(32 * mib, 96 * mib), Some(32 * mib));
        assert_eq!(size(40 * mib, 96 * mib), Some(32 * mib));
        // Below a part: whole blocks.
        assert_eq!(size(mib + 1000, 96 * mib), Some(mib));
        // Never longer than the file.
        assert_eq!(size(64 * mib, 3 * mib + 5), Some(3 * mib + (256 << 10)));
        // Not one block.
        assert_eq!(size((256 << 10) - 1, 96 * mib), None);
        // zstd keeps room for the frames.
        let zstd = Codec::Zstd {
            level: 1,
            shuffle: 0,
        };
        let z = window_size(32 * mib as u64, 256 << 10, 16 * mib, 96 * mib, zstd).unwrap();
        let bound = zstd::zstd_safe::compress_bound(256 << 10);
        assert!(z.window + z.frames <= 32 * mib, "{z:?}");
        assert!(
            z.window + z.frames + (256 << 10) + bound > 32 * mib,
            "{z:?}"
        );
    }
}
