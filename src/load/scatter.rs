//! Where verified bytes go: the caller's outputs as raw pointers that several
//! threads write disjoint runs into without a lock (the safety argument is on
//! [`Outputs`]), and the copies out of one batch of blocks.

use std::time::Duration;

use super::request::LoadTimings;

/// The caller's output buffers as raw pointers, so that reads on several threads can
/// write disjoint runs into them without a lock per copy.
///
/// Sound because (1) the runs of a plan never overlap and lie inside their output
/// (checked by [`CheckpointReader::check_tiling`](crate::CheckpointReader::check_tiling) before any read, and each run is
/// handed to exactly one task), so no two slices made here alias; (2) the outputs
/// are mutably borrowed by the load for its whole duration, so nothing else reads or
/// writes them meanwhile; (3) every write happens within a poll of the load's future
/// (`in_this_poll`: scoped threads joined before the poll returns), so none can
/// outlive the borrow, even when the future is dropped or leaked.
pub(crate) struct Outputs {
    pub(super) buffers: Vec<(*mut u8, usize)>,
}

// SAFETY: the pointers are only dereferenced through `Outputs::slice`, whose callers
// uphold the disjointness and lifetime argument above; sending or sharing the
// pointers themselves between threads is harmless.
unsafe impl Send for Outputs {}
// SAFETY: as for `Send`: `&Outputs` only hands out slices under that argument.
unsafe impl Sync for Outputs {}

impl Outputs {
    pub(crate) fn new(outputs: &mut [&mut [u8]]) -> Self {
        Self {
            buffers: outputs
                .iter_mut()
                .map(|o| (o.as_mut_ptr(), o.len()))
                .collect(),
        }
    }

    /// Bytes `dst..dst + len` of output `want`.
    ///
    /// # Safety
    ///
    /// The range must be (part of) one run of the plan these outputs were checked
    /// against, given to this caller alone, and the returned slice must be dropped
    /// before the poll of the load's future that made it returns. Bounds are checked
    /// here.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, want: usize, dst: u64, len: u64) -> &mut [u8] {
        let (ptr, size) = self.buffers[want];
        let (dst, len) = (dst as usize, len as usize);
        assert!(
            dst.checked_add(len).is_some_and(|end| end <= size),
            "run {dst}..+{len} outside output {want} of {size} bytes"
        );
        // SAFETY: in bounds (asserted); not aliased and alive by the caller's
        // contract (see the type's docs).
        unsafe { std::slice::from_raw_parts_mut(ptr.add(dst), len) }
    }
}

/// What reading one file (or one batch) did.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) read: u64,
    pub(crate) verified: u64,
    pub(crate) copied: u64,
    pub(crate) timings: LoadTimings,
}

impl Tally {
    pub(crate) fn add(&mut self, other: &Tally) {
        self.read += other.read;
        self.verified += other.verified;
        self.copied += other.copied;
        self.timings.add(&other.timings);
    }
}

/// CPU time of the calling thread (user and system).
pub(super) fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Where the bytes of one batch go when it is read.
#[derive(Debug, Clone, Copy)]
pub(super) enum Piece {
    /// Into bytes `dst..dst + len` of output `want`.
    Out { want: usize, dst: u64, len: u64 },
    /// Into scratch (bytes no want asked for, or a batch read whole and copied).
    Scratch { len: u64 },
}

/// A copy out of a batch's verified bytes: `len` bytes at offset `at` of the batch
/// into bytes `dst..` of output `want`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scatter {
    pub(super) at: u64,
    pub(super) want: usize,
    pub(super) dst: u64,
    pub(super) len: u64,
}

/// Above this many pieces per batch, a batch is read into scratch and copied out:
/// many short runs (a narrow column slice) cost more as buffers of one vectored read
/// than as copies.
pub(super) const MAX_PIECES: usize = 256;
