//! Page-aligned, reusable staging buffers, and the copy that fills them.
//!
//! A rank's staging buffer holds its whole data file and is reused from save to save,
//! so it is allocated once. It is mapped straight from the kernel rather than taken
//! from the allocator, for two reasons:
//!
//! - it is aligned to a page, so local disk can be written with direct I/O straight
//!   from it (no second copy through the page cache), which a `Vec<u8>` cannot promise;
//! - it can be faulted in up front ([`StagingBuffer::prefault`], one
//!   `MADV_POPULATE_WRITE`), so that the first save of a job does not pay for the page
//!   faults (`Checkpointer::warm_up`).
//!
//! It does not ask for transparent huge pages: measured on W1 (4 rank processes of
//! 512 MiB), `MADV_HUGEPAGE` made the warm-up 4× slower (the kernel compacts memory to
//! find huge pages) and the copy no faster.
//!
//! Fresh mappings are zero-filled, so every byte up to the capacity is initialized at
//! all times; the buffer can therefore be handed out as `&mut [u8]` before it is filled.
//!
//! With feature `cuda`, a buffer can instead be page-locked memory from
//! `cuMemHostAlloc` ([`StagingBuffer::reset_pinned`]), the destination of
//! asynchronous device-to-host copies; it is zeroed when allocated, aligned the same
//! way, and kept across saves like a mapping.

use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use crate::budget::{HeldKind, HostBudget, Reservation};
use crate::direct::ALIGN;
use crate::error::{Error, Result};

/// A byte buffer aligned to [`ALIGN`] whose capacity is kept across uses.
pub(crate) struct StagingBuffer {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    /// The budget the mapping is counted in, and the reservation of its capacity.
    budget: Option<Arc<HostBudget>>,
    reserved: Option<Reservation>,
    /// The page-locked allocation `ptr` points into, instead of a mapping.
    #[cfg(feature = "cuda")]
    pinned: Option<crate::cuda::device::PinnedAlloc>,
}

// SAFETY: the buffer owns its mapping exclusively, like a Vec<u8>, and holds no
// thread-bound state, so moving it to another thread moves sole ownership.
unsafe impl Send for StagingBuffer {}
// SAFETY: every method that writes takes `&mut self`; through `&self` the bytes
// are only read (`Deref` to `[u8]`), so shared references on several threads race
// on nothing.
unsafe impl Sync for StagingBuffer {}

impl StagingBuffer {
    /// An empty buffer that owns no memory yet.
    pub(crate) fn new() -> Self {
        Self::counted_in(None)
    }

    /// An empty buffer whose memory, once mapped, is counted in `budget`.
    pub(crate) fn counted_in(budget: Option<Arc<HostBudget>>) -> Self {
        Self {
            ptr: NonNull::dangling(),
            len: 0,
            cap: 0,
            budget,
            reserved: None,
            #[cfg(feature = "cuda")]
            pinned: None,
        }
    }

    /// As [`StagingBuffer::reset`], but page-locked memory of `ctx`: a mapping, or
    /// pinned memory of another context or too small, is replaced.
    #[cfg(feature = "cuda")]
    pub(crate) fn reset_pinned(
        &mut self,
        total: usize,
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    ) -> crate::Result<()> {
        self.len = 0;
        if total <= self.cap && self.pinned.as_ref().is_some_and(|p| p.context() == ctx) {
            return Ok(());
        }
        let cap = total.div_ceil(ALIGN).max(1) * ALIGN;
        self.release();
        let reserved = self.reserve(cap)?;
        let alloc = crate::cuda::device::PinnedAlloc::new(ctx, cap, ALIGN)?;
        self.reserved = reserved;
        self.ptr = NonNull::new(alloc.ptr()).expect("cuMemHostAlloc returned null");
        self.cap = alloc.capacity();
        self.pinned = Some(alloc);
        Ok(())
    }

    /// The start of the buffer, for copies the host does not make (device to host).
    #[cfg(feature = "cuda")]
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes the buffer can hold without mapping anew.
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    /// Empties the buffer and makes room for `total` bytes, reusing the mapping
    /// when it is large enough (the contents are not kept). A larger mapping is
    /// reserved from the budget first (the old one given back); when it does not
    /// fit even after the holders let go of what they may, the buffer is left
    /// empty and the error says by how much.
    pub(crate) fn reset(&mut self, total: usize) -> Result<()> {
        self.len = 0;
        if total <= self.cap {
            return Ok(());
        }
        self.release();
        let cap = total.div_ceil(ALIGN).max(1) * ALIGN;
        self.reserved = self.reserve(cap)?;
        self.ptr = map(cap);
        self.cap = cap;
        Ok(())
    }

    /// Reserves `cap` bytes of staging from the budget, if the buffer has one.
    fn reserve(&self, cap: usize) -> Result<Option<Reservation>> {
        let Some(budget) = &self.budget else {
            return Ok(None);
        };
        Reservation::try_new(budget, HeldKind::Staging, cap as u64)
            .map(Some)
            .ok_or_else(|| {
                let held = budget.held();
                Error::OverBudget(format!(
                    "a staging buffer of {cap} bytes does not fit the host memory budget: {held}"
                ))
            })
    }

    /// The budget the buffer is counted in.
    pub(crate) fn budget(&self) -> Option<&Arc<HostBudget>> {
        self.budget.as_ref()
    }

    /// Faults every page of the buffer in now, so that the copy into it does not.
    /// Best effort: where `MADV_POPULATE_WRITE` is missing (Linux before 5.14), one
    /// byte of every page is written instead.
    pub(crate) fn prefault(&mut self) {
        if self.cap == 0 {
            return;
        }
        #[cfg(target_os = "linux")]
        {
            const MADV_POPULATE_WRITE: libc::c_int = 23;
            // SAFETY: the range is exactly this buffer's own mapping.
            let done = unsafe {
                libc::madvise(self.ptr.as_ptr().cast(), self.cap, MADV_POPULATE_WRITE) == 0
            };
            if done {
                return;
            }
        }
        for page in (0..self.cap).step_by(ALIGN) {
            // SAFETY: `page` lies inside the mapping, which is readable and writable;
            // the byte is written back unchanged, so the contents stay as they were.
            unsafe {
                let p = self.ptr.as_ptr().add(page);
                p.write_volatile(p.read_volatile());
            }
        }
    }

    /// Makes the buffer `total` bytes long (within the room [`StagingBuffer::reset`]
    /// made) and returns all of it for writing. Bytes not yet written hold zeros or an
    /// earlier save's data, never uninitialized memory.
    pub(crate) fn fill(&mut self, total: usize) -> &mut [u8] {
        assert!(
            total <= self.cap,
            "staging buffer overflow: {total} bytes into {} reserved",
            self.cap
        );
        self.len = total;
        // SAFETY: the first `cap` bytes of the mapping are initialized (zero-filled
        // by the kernel, or written since) and exclusively borrowed through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), total) }
    }

    fn release(&mut self) {
        self.reserved = None;
        #[cfg(feature = "cuda")]
        if let Some(pinned) = self.pinned.take() {
            drop(pinned);
            self.ptr = NonNull::dangling();
            self.cap = 0;
            self.len = 0;
            return;
        }
        if self.cap > 0 {
            // SAFETY: `ptr` and `cap` are exactly a mapping made by `map`.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
            self.ptr = NonNull::dangling();
            self.cap = 0;
            self.len = 0;
        }
    }
}

/// Maps `cap` bytes (a multiple of [`ALIGN`]) of zero-filled anonymous memory.
/// Aborts like the allocator when memory is exhausted.
fn map(cap: usize) -> NonNull<u8> {
    // SAFETY: an anonymous private mapping with no address hint has no preconditions.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            cap,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        let layout = std::alloc::Layout::from_size_align(cap, ALIGN).expect("staging layout");
        std::alloc::handle_alloc_error(layout);
    }
    NonNull::new(raw.cast::<u8>()).expect("mmap returned a null mapping")
}

impl Deref for StagingBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the first `len` bytes are initialized (see `fill`); a dangling
        // pointer is valid for a zero length.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for StagingBuffer {
    fn drop(&mut self) {
        self.release();
    }
}

impl std::fmt::Debug for StagingBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingBuffer")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish()
    }
}

/// A checkpointer's free staging buffers.
pub(crate) type Pool = Mutex<Vec<StagingBuffer>>;

/// A staging buffer on loan from a checkpointer's [`Pool`]: it goes back to the pool
/// when the last reference to it is dropped, whoever holds that reference (the save's
/// upload, or an in-memory copy of the save kept after it, `crate::copies`). A
/// buffer whose checkpointer is gone is freed instead.
///
/// A save may stage more than its file: the replicas it holds but another rank
/// writes, copied after the file only to be checksummed (`crate::health`). The
/// buffer then reads as the file alone ([`Deref`]), and [`Pooled::beyond`] gives
/// the rest.
pub(crate) struct Pooled {
    buffer: StagingBuffer,
    pool: Weak<Pool>,
    /// Bytes that are the file: the buffer derefs to these.
    file_len: usize,
    /// What the buffer is counted as while on loan ([`HeldKind`], as its index).
    kind: std::sync::atomic::AtomicU8,
}

impl Pooled {
    /// `buffer`, to be given back to `pool`; its first `file_len` bytes are the file.
    pub(crate) fn new(buffer: StagingBuffer, pool: &Arc<Pool>, file_len: usize) -> Self {
        let file_len = file_len.min(buffer.len());
        Self {
            buffer,
            pool: Arc::downgrade(pool),
            file_len,
            kind: HeldKind::Staging.as_index().into(),
        }
    }

    /// `buffer`, freed when dropped (a buffer that must not be reused).
    pub(crate) fn unpooled(buffer: StagingBuffer) -> Self {
        let file_len = buffer.len();
        Self {
            buffer,
            pool: Weak::new(),
            file_len,
            kind: HeldKind::Staging.as_index().into(),
        }
    }

    /// Counts the buffer as held for `kind` (an own copy, a snapshot) until it goes
    /// back to the pool.
    pub(crate) fn lend_as(&self, kind: HeldKind) {
        let was = HeldKind::from_index(
            self.kind
                .swap(kind.as_index(), std::sync::atomic::Ordering::Relaxed),
        );
        if let Some(budget) = self.buffer.budget() {
            budget.transfer(was, kind, self.buffer.capacity() as u64);
        }
    }

    /// The staged bytes after the file (replicas staged only to be checksummed).
    pub(crate) fn beyond(&self) -> &[u8] {
        &self.buffer[self.file_len..]
    }
}

impl Deref for Pooled {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buffer[..self.file_len]
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.lend_as(HeldKind::Staging);
        if let Some(pool) = self.pool.upgrade() {
            let buffer = std::mem::replace(&mut self.buffer, StagingBuffer::new());
            if buffer.capacity() > 0 {
                pool.lock().unwrap_or_else(|p| p.into_inner()).push(buffer);
            }
        }
    }
}

impl std::fmt::Debug for Pooled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pooled")
            .field("buffer", &self.buffer)
            .field("pooled", &(self.pool.strong_count() > 0))
            .finish()
    }
}

/// Memory a save copies from: the caller's tensor bytes, by address, so that an
/// overlapped save can read them after `save_overlapped` has returned.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Source {
    ptr: *const u8,
    len: usize,
}

// SAFETY: a `Source` is an address and a length; it is only dereferenced (by
// `Source::bytes`) under the contract of `Checkpointer::save_overlapped`, which makes
// the caller keep the memory valid and unchanged until staging completes, from any
// thread.
unsafe impl Send for Source {}
// SAFETY: as above; shared access only ever reads.
unsafe impl Sync for Source {}

impl Source {
    pub(crate) fn new(bytes: &[u8]) -> Self {
        Self {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes again.
    ///
    /// # Safety
    /// The memory given to [`Source::new`] must still be allocated and not written
    /// concurrently.
    pub(crate) unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: the caller guarantees the slice `new` was made from is still live.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Copies `sources`, back to back, into `dst` (exactly their total length) on
/// `threads` threads, each taking an equal contiguous share of the bytes. With one
/// thread the copy runs on the calling thread.
///
/// # Safety
/// Every source must stay allocated and unwritten until this returns.
pub(crate) unsafe fn copy_sources(dst: &mut [u8], sources: &[Source], threads: usize) {
    let total: usize = sources.iter().map(Source::len).sum();
    assert_eq!(dst.len(), total, "staging copy: destination size");
    // Below a few MiB a thread costs more than it saves.
    let threads = threads.clamp(1, total.div_ceil(4 << 20).max(1));
    if threads == 1 {
        let mut offset = 0;
        for source in sources {
            // SAFETY: the caller keeps the source live and unwritten.
            let bytes = unsafe { source.bytes() };
            dst[offset..offset + bytes.len()].copy_from_slice(bytes);
            offset += bytes.len();
        }
        return;
    }
    let share = total.div_ceil(threads);
    std::thread::scope(|scope| {
        let mut rest = dst;
        let mut begin = 0;
        while !rest.is_empty() {
            let n = share.min(rest.len());
            let (mine, tail) = rest.split_at_mut(n);
            rest = tail;
            let range = begin..begin + n;
            begin += n;
            scope.spawn(move || {
                // Walk the sources, copying the parts inside `range`.
                let mut at = 0;
                for source in sources {
                    let (lo, hi) = (at, at + source.len());
                    at = hi;
                    let (from, to) = (lo.max(range.start), hi.min(range.end));
                    if from >= to {
                        continue;
                    }
                    // SAFETY: the caller keeps the source live and unwritten.
                    let bytes = unsafe { source.bytes() };
                    mine[from - range.start..to - range.start]
                        .copy_from_slice(&bytes[from - lo..to - lo]);
                }
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_reused() {
        let mut buffer = StagingBuffer::new();
        assert!(buffer.is_empty());
        buffer.reset(10_000).unwrap();
        assert_eq!(buffer.ptr.as_ptr() as usize % ALIGN, 0);
        buffer.fill(4).copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(&buffer[..], &[1, 2, 3, 4]);
        let before = buffer.ptr;
        buffer.reset(5_000).unwrap();
        assert_eq!(buffer.ptr, before, "a smaller reset keeps the mapping");
        assert!(buffer.is_empty());
        buffer.reset(5 << 20).unwrap();
        assert_eq!(buffer.ptr.as_ptr() as usize % ALIGN, 0);
        assert!(buffer.capacity() >= 5 << 20);
        buffer.prefault();
        assert!(buffer.fill(5 << 20).iter().all(|&b| b == 0));
    }

    #[test]
    #[should_panic(expected = "staging buffer overflow")]
    fn writing_past_the_reserved_room_panics_instead_of_corrupting() {
        let mut buffer = StagingBuffer::new();
        buffer.reset(4096).unwrap();
        buffer.fill(4097);
    }

    #[test]
    fn parallel_copies_equal_a_sequential_one() {
        let a: Vec<u8> = (0..9_000_000u32).map(|i| (i % 251) as u8).collect();
        let b: Vec<u8> = (0..3u32).map(|i| i as u8 + 7).collect();
        let c: Vec<u8> = (0..5_000_001u32).map(|i| (i % 13) as u8).collect();
        let sources = [Source::new(&a), Source::new(&b), Source::new(&c)];
        let expected: Vec<u8> = [&a[..], &b[..], &c[..]].concat();
        for threads in [1, 2, 3, 8] {
            let mut dst = vec![0u8; expected.len()];
            // SAFETY: the sources are live locals, not written during the copy.
            unsafe { copy_sources(&mut dst, &sources, threads) };
            assert!(dst == expected, "{threads} threads");
        }
    }
}
