//! Buffers a load allocates: zero-filled lazily (pages come when written), on huge
//! pages where the kernel allows, and an error instead of an abort when a box is
//! larger than memory can hold.

use crate::error::{Error, Result};

/// A zero-filled buffer of `n` bytes, or an error when it cannot be had (rather than
/// the abort of `vec![0; n]`). Zeroed pages come from the allocator lazily, so a load
/// touches only what it writes.
pub(super) fn zeroed(n: u64, tensor: &str) -> Result<Vec<u8>> {
    let too_big = || {
        Error::Failed(format!(
            "cannot allocate {n} bytes to load tensor {tensor:?}: request a smaller box"
        ))
    };
    let len = usize::try_from(n).map_err(|_| too_big())?;
    zeroed_vec(len, false).ok_or_else(too_big)
}

/// `n` zero elements in fresh memory that the kernel is asked to back with
/// transparent huge pages (Linux; elsewhere plain memory): a destination for
/// [`CheckpointReader::load_into`](crate::CheckpointReader::load_into), or any large buffer written once in full, whose
/// first writes fault in a page per 2 MiB rather than per 4 KiB — several times less
/// time on the machines measured (`docs/BENCHMARKS.md`). Nothing is written up front:
/// the zeros are the kernel's fresh pages. (Staging buffers do not use this: they are
/// faulted in ahead, where asking for huge pages was measured slower; see
/// `src/staging.rs`.)
///
/// Errors: [`Error::Failed`] when the memory cannot be had (rather than the abort of
/// `vec![0; n]`).
pub fn zeroed_huge<T: crate::dtype::Element>(n: usize) -> Result<Vec<T>> {
    zeroed_vec(n, true).ok_or_else(|| {
        Error::Failed(format!(
            "cannot allocate {n} elements of {} bytes",
            std::mem::size_of::<T>()
        ))
    })
}

/// `len` zero elements from the allocator (huge pages asked for with `huge`), or
/// `None` when they cannot be had.
fn zeroed_vec<T: crate::dtype::Element>(len: usize, huge: bool) -> Option<Vec<T>> {
    let layout = std::alloc::Layout::array::<T>(len).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: `layout` has a non-zero size; a null result is handled; on success the
    // allocation holds `len` initialized elements (all-zero bytes are a valid `T`,
    // which is `Pod`) with the global allocator's layout for a `Vec<T>` of capacity
    // `len`, which is what `from_raw_parts` needs.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    if huge {
        advise_huge_pages(ptr as usize, layout.size());
    }
    // SAFETY: as above.
    Some(unsafe { Vec::from_raw_parts(ptr.cast::<T>(), len, len) })
}

/// Asks the kernel to back the whole huge pages inside the `bytes` bytes at `addr`
/// with transparent huge pages. Best effort; below 4 MiB nothing is asked.
fn advise_huge_pages(addr: usize, bytes: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    if bytes >= 2 * HUGE_PAGE {
        let start = addr.next_multiple_of(HUGE_PAGE);
        let end = (addr + bytes) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: the caller's range is one live allocation, and MADV_HUGEPAGE
            // only changes how the kernel backs its pages, never their contents; a
            // failure leaves ordinary pages.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (addr, bytes, HUGE_PAGE);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_zeroed_buffers_are_zero_and_absurd_sizes_are_errors_not_aborts() {
        let floats: Vec<f32> = zeroed_huge(3 << 20).unwrap();
        assert_eq!(floats.len(), 3 << 20);
        assert!(floats.iter().all(|&x| x == 0.0));
        assert!(zeroed_huge::<u8>(0).unwrap().is_empty());
        let err = zeroed_huge::<u64>(usize::MAX / 4).unwrap_err();
        assert!(matches!(err, Error::Failed(_)), "{err}");
    }
}
