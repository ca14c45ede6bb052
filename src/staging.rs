//! Page-aligned, reusable staging buffers.
//!
//! A rank's staging buffer holds its whole data file and is reused from save to save,
//! so it is allocated once. It is aligned to 4 KiB so that local disk can be written
//! with direct I/O straight from it (no second copy through the page cache), which
//! a `Vec<u8>` cannot promise.

use std::alloc::Layout;
use std::ops::Deref;
use std::ptr::NonNull;

/// Alignment of staging buffers: the page size and the largest logical block size
/// direct I/O needs.
pub(crate) const ALIGN: usize = 4096;

/// A byte buffer aligned to [`ALIGN`] whose capacity is kept across uses.
pub(crate) struct StagingBuffer {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: the buffer owns its allocation exclusively, like a Vec<u8>, and holds no
// thread-bound state, so moving it to another thread moves sole ownership.
unsafe impl Send for StagingBuffer {}
// SAFETY: every method that writes takes `&mut self`; through `&self` the bytes
// are only read (`Deref` to `[u8]`), so shared references on several threads race
// on nothing.
unsafe impl Sync for StagingBuffer {}

impl StagingBuffer {
    /// An empty buffer that owns no memory yet.
    pub(crate) fn new() -> Self {
        Self {
            ptr: NonNull::dangling(),
            len: 0,
            cap: 0,
        }
    }

    /// Empties the buffer and makes room for `total` bytes, reusing the allocation
    /// when it is large enough (the contents are not kept).
    pub(crate) fn reset(&mut self, total: usize) {
        self.len = 0;
        if total <= self.cap {
            return;
        }
        self.release();
        let cap = total.div_ceil(ALIGN).max(1) * ALIGN;
        let layout = Layout::from_size_align(cap, ALIGN).expect("staging size fits a layout");
        // SAFETY: `alloc` requires a non-zero size, and `cap` is at least `ALIGN`.
        let ptr = unsafe { std::alloc::alloc(layout) };
        self.ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        self.cap = cap;
    }

    /// Appends `bytes`; the room was made by [`StagingBuffer::reset`].
    pub(crate) fn extend_from_slice(&mut self, bytes: &[u8]) {
        assert!(
            bytes.len() <= self.cap - self.len,
            "staging buffer overflow: {} bytes into {} free",
            bytes.len(),
            self.cap - self.len
        );
        // SAFETY: the destination lies inside the allocation (checked above) and
        // cannot overlap `bytes`, which the caller borrows from elsewhere.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.as_ptr().add(self.len),
                bytes.len(),
            );
        }
        self.len += bytes.len();
    }

    fn release(&mut self) {
        if self.cap > 0 {
            let layout =
                Layout::from_size_align(self.cap, ALIGN).expect("layout of an allocation made");
            // SAFETY: `ptr` was allocated with exactly this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
            self.ptr = NonNull::dangling();
            self.cap = 0;
            self.len = 0;
        }
    }
}

impl Deref for StagingBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the first `len` bytes are initialized (written by
        // `extend_from_slice`); a dangling pointer is valid for a zero length.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_reused() {
        let mut buffer = StagingBuffer::new();
        assert!(buffer.is_empty());
        buffer.reset(10_000);
        assert_eq!(buffer.ptr.as_ptr() as usize % ALIGN, 0);
        buffer.extend_from_slice(&[1, 2, 3]);
        buffer.extend_from_slice(&[4]);
        assert_eq!(&buffer[..], &[1, 2, 3, 4]);
        let before = buffer.ptr;
        buffer.reset(5_000);
        assert_eq!(buffer.ptr, before, "a smaller reset keeps the allocation");
        assert!(buffer.is_empty());
        buffer.reset(100_000);
        assert_eq!(buffer.ptr.as_ptr() as usize % ALIGN, 0);
    }

    #[test]
    #[should_panic(expected = "staging buffer overflow")]
    fn writing_past_the_reserved_room_panics_instead_of_corrupting() {
        let mut buffer = StagingBuffer::new();
        buffer.reset(4096);
        buffer.extend_from_slice(&[0u8; 5000]);
    }
}
