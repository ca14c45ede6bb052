//! Collective communication between the ranks of one world.
//!
//! [`Collective`] holds only the primitives a sharded data-parallel trainer needs, named
//! after NCCL's (`ncclAllGather`, `ncclReduceScatter`, `ncclAllReduce`,
//! `ncclBroadcast`), so that the NCCL backend (`nccl`, feature `cuda`) implements the
//! same trait; conveniences for typed buffers live in [`CollectiveExt`], implemented for
//! every collective.
//!
//! # Contract
//!
//! - Every rank of the world calls the same operations in the same order with
//!   matching sizes (`counts` are identical on every rank). A mismatch is detected
//!   (each transfer carries its operation and length) and reported as
//!   [`CollectiveError::Invalid`].
//! - Shards may be uneven: `counts[r]` is rank `r`'s share, possibly zero (dim-0
//!   splits of `n` rows over `w` ranks give `r·n/w .. (r+1)·n/w`).
//! - Every operation has a timeout: it fails with [`CollectiveError::Timeout`] when a
//!   peer makes no progress for that long.
//! - [`Collective::abort`] may be called from any thread at any time: every operation
//!   blocked in this communicator returns [`CollectiveError::Aborted`] promptly, and
//!   every later one fails at once. A communicator is never used again after an
//!   error: it is *poisoned* (later calls return the first error), and its failure is
//!   propagated to the peers (the TCP backend shuts its sockets, as NCCL's abort
//!   does), so that every survivor of a lost rank learns of it within moments, not
//!   only the lost rank's neighbours. Recovery builds a new communicator for the new
//!   world.
//! - Integer reductions (`*_i64`) sum with wrapping two's-complement addition, which
//!   is associative and commutative: the result is bitwise the same for any world size
//!   and any order of arrival. Float reductions (`*_f32`) are not: their rounding
//!   depends on the order, which depends on the world size.
//!
//! Buffers are host memory. Device memory has its own trait, [`DeviceCollective`]
//! (module [`device`]): same contract, but operations are *enqueued* on a stream and
//! their failures surface when the caller waits for them. Why a second trait rather
//! than a buffer type parameter on this one is explained there. The NCCL backend
//! (module `nccl`, feature `cuda`) implements it; its fault-tolerance machinery
//! (watchdog, poisoning, abort from any thread) is in [`guard`], generic over the
//! raw communicator so that it is tested without a GPU.

pub mod device;
pub mod guard;
#[cfg(feature = "cuda")]
pub mod nccl;
mod tcp;

use std::time::Duration;

pub use device::{DeviceCollective, HostDevice, HostStream, ReduceType};
pub use tcp::{TcpCollective, TcpConfig};

/// A collective operation failed. Every variant names the operation; the peer is the
/// rank whose connection failed or stalled, as seen from this rank.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CollectiveError {
    /// A peer made no progress within the timeout (hung, stopped, partitioned, or
    /// simply slower than the timeout allows). Retrying on the same communicator does
    /// not help: it is poisoned; a new world may.
    #[error("{op}: rank {peer} made no progress for {timeout:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The rank waited for.
        peer: usize,
        /// The timeout that elapsed.
        timeout: Duration,
    },
    /// A peer's connection closed or reset: the process died, or it gave up on this
    /// world after its own failure. Not retryable on this communicator.
    #[error("{op}: lost rank {peer}: {detail}")]
    PeerLost {
        /// The operation.
        op: &'static str,
        /// The rank lost.
        peer: usize,
        /// What the socket said.
        detail: String,
    },
    /// [`Collective::abort`] was called. Not retryable on this communicator.
    #[error("{op}: aborted")]
    Aborted {
        /// The operation.
        op: &'static str,
    },
    /// Another I/O failure (bootstrap included). `peer` is `None` when no peer is
    /// involved (binding a listener).
    #[error("{op}: i/o error{}: {message}", peer.map(|p| format!(" with rank {p}")).unwrap_or_default())]
    Io {
        /// The operation.
        op: &'static str,
        /// The peer, when one is involved.
        peer: Option<usize>,
        /// The error.
        message: String,
    },
    /// The arguments are inconsistent (counts that do not match the buffers or the
    /// world), or the ranks called different operations. A bug in the caller;
    /// retrying does not help.
    #[error("{op}: {message}")]
    Invalid {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A device communicator's operation did not complete within the timeout. Unlike
    /// [`CollectiveError::Timeout`] no peer is named: NCCL does not say which rank
    /// stalled. Not retryable on this communicator (the watchdog aborted it).
    #[error("{op}: did not complete within {timeout:?} (the communicator was aborted)")]
    Stalled {
        /// The operation.
        op: &'static str,
        /// The timeout that elapsed.
        timeout: Duration,
    },
    /// The device library reported an error (an NCCL result code, asynchronous or
    /// returned, or a CUDA error): a peer failed, the network broke, a device was
    /// lost. Not retryable on this communicator.
    #[error("{op}: {message}")]
    Device {
        /// The operation.
        op: &'static str,
        /// The library's error, named (e.g. `ncclRemoteError (6): …`).
        message: String,
    },
}

impl CollectiveError {
    /// The peer rank this error names, if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            CollectiveError::Timeout { peer, .. } | CollectiveError::PeerLost { peer, .. } => {
                Some(*peer)
            }
            CollectiveError::Io { peer, .. } => *peer,
            CollectiveError::Aborted { .. }
            | CollectiveError::Invalid { .. }
            | CollectiveError::Stalled { .. }
            | CollectiveError::Device { .. } => None,
        }
    }

    /// The operation this error names.
    pub fn op(&self) -> &'static str {
        match self {
            CollectiveError::Timeout { op, .. }
            | CollectiveError::PeerLost { op, .. }
            | CollectiveError::Aborted { op }
            | CollectiveError::Io { op, .. }
            | CollectiveError::Invalid { op, .. }
            | CollectiveError::Stalled { op, .. }
            | CollectiveError::Device { op, .. } => op,
        }
    }
}

/// Result of a collective operation.
pub type CollectiveResult<T = ()> = Result<T, CollectiveError>;

/// The primitives of a communicator over a fixed world of ranks. See the module docs
/// for the contract every implementation keeps.
pub trait Collective: Send + Sync {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Gathers every rank's bytes: `mine` (`counts[rank]` bytes) from each rank lands
    /// in `out` at the offset `counts[..r].sum()`, on every rank.
    fn all_gather(&self, mine: &[u8], counts: &[usize], out: &mut [u8]) -> CollectiveResult;

    /// Sums `data` element-wise over all ranks (wrapping) and leaves rank `r` the
    /// sum of its segment: `counts[r]` elements at offset `counts[..r].sum()`, in `out`.
    /// `data` is scratch: its contents afterwards are unspecified.
    fn reduce_scatter_i64(
        &self,
        data: &mut [i64],
        counts: &[usize],
        out: &mut [i64],
    ) -> CollectiveResult;

    /// As [`reduce_scatter_i64`](Self::reduce_scatter_i64) for f32; the rounding
    /// depends on the world size.
    fn reduce_scatter_f32(
        &self,
        data: &mut [f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> CollectiveResult;

    /// Sums `data` element-wise over all ranks (wrapping), in place; exact and
    /// independent of the world size.
    fn all_reduce_i64(&self, data: &mut [i64]) -> CollectiveResult;

    /// Sums `data` element-wise over all ranks in place; the rounding depends on the
    /// world size.
    fn all_reduce_f32(&self, data: &mut [f32]) -> CollectiveResult;

    /// Copies `data` of rank `root` into `data` of every rank.
    fn broadcast(&self, root: usize, data: &mut [u8]) -> CollectiveResult;

    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> CollectiveResult;

    /// Makes every blocked and every later operation fail with
    /// [`CollectiveError::Aborted`]; callable from any thread, never blocks.
    fn abort(&self);
}

/// Conveniences over any [`Collective`].
pub trait CollectiveExt: Collective {
    /// [`Collective::all_gather`] of f32 elements (`counts` in elements).
    fn all_gather_f32(&self, mine: &[f32], counts: &[usize], out: &mut [f32]) -> CollectiveResult {
        let bytes: Vec<usize> = counts.iter().map(|c| c * 4).collect();
        self.all_gather(pod_bytes(mine), &bytes, pod_bytes_mut(out))
    }

    /// Broadcasts a little-endian u64 from `root`.
    fn broadcast_u64(&self, root: usize, value: u64) -> CollectiveResult<u64> {
        let mut bytes = value.to_le_bytes();
        self.broadcast(root, &mut bytes)?;
        Ok(u64::from_le_bytes(bytes))
    }
}

impl<C: Collective + ?Sized> CollectiveExt for C {}

/// Rank `rank`'s share of `n` items split over `world` ranks: `rank·n/world ..
/// (rank+1)·n/world` — the same rule as [`ckpt::Region::dim0_shard`].
pub fn shard_range(n: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let (n, r, w) = (n as u128, rank as u128, world as u128);
    (r * n / w) as usize..((r + 1) * n / w) as usize
}

/// The counts of [`shard_range`] for every rank.
pub fn shard_counts(n: usize, world: usize) -> Vec<usize> {
    (0..world).map(|r| shard_range(n, r, world).len()).collect()
}

/// The element types the host collectives reduce: plain numbers (bytemuck's `Pod`, so
/// they travel as their bytes and any bytes received from a peer read back as values)
/// with the sum that reduces them.
pub(crate) trait Summable: bytemuck::Pod + Send + Sync {
    /// The reduction (sum) of two elements.
    fn add(a: Self, b: Self) -> Self;
}
impl Summable for i64 {
    fn add(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
}
impl Summable for f32 {
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
}
impl Summable for u8 {
    fn add(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
}

/// The bytes of `data`, as sent to a peer.
pub(crate) fn pod_bytes<T: bytemuck::Pod>(data: &[T]) -> &[u8] {
    bytemuck::must_cast_slice(data)
}

/// The bytes of `data`, to receive into.
pub(crate) fn pod_bytes_mut<T: bytemuck::Pod>(data: &mut [T]) -> &mut [u8] {
    bytemuck::must_cast_slice_mut(data)
}
