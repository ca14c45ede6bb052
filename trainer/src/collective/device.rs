//! Collectives over device memory, enqueued on streams.
//!
//! [`DeviceCollective`] keeps the [`Collective`] contract (same operations in the same
//! order on every rank, a timeout on every operation, abort from any thread, poisoning
//! after the first error, propagation to the peers) for memory the host cannot touch
//! and operations that run asynchronously, as NCCL's do:
//!
//! - an operation is *enqueued* on a stream and returns once it is; its buffers must
//!   stay valid, and `out` unread, until [`DeviceCollective::synchronize`] on that
//!   stream has returned `Ok` (or the stream was otherwise synchronized);
//! - a failure of an enqueued operation (a lost peer, a stall past the timeout, an
//!   abort) surfaces in `synchronize` and in every later call, as the first error;
//! - shards are even (NCCL has no uneven all-gather): `out` holds `world_size()`
//!   times `mine`. A caller with uneven dim-0 shards pads them to the largest, which
//!   [`crate::collective::shard_counts`] gives.
//!
//! # Why a second trait
//!
//! A buffer type parameter on [`Collective`] (or an associated type) would change
//! every signature the trainer and its tests use with `&dyn Collective` today, and
//! would not express the one real difference: device operations complete later, so a
//! result needs a separate wait. A separate trait with associated `Buffer` and
//! `Stream` types keeps the host trait and the TCP backend exactly as they are, lets
//! the NCCL backend use CUDA types without the trait knowing CUDA, and is still
//! object-safe for one backend (`dyn DeviceCollective<Buffer = …, Stream = …>`).
//! [`HostDevice`] implements it over any host [`Collective`] (operations complete at
//! once, the stream is a formality), which is how the contract is tested on CPU and
//! how a GPU trainer could fall back to TCP by staging through host memory.

use super::{Collective, CollectiveError, CollectiveResult};

/// What a reduction sums, element-wise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceType {
    /// Little-endian i64, wrapping: exact, the same for any world size and order.
    I64,
    /// Little-endian f32: rounding depends on the order, hence on the world size.
    F32,
}

impl ReduceType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ReduceType::I64 => 8,
            ReduceType::F32 => 4,
        }
    }
}

/// Memory a device collective reads or writes: it knows its length in bytes.
pub trait DeviceMemory {
    /// Length in bytes.
    fn byte_len(&self) -> usize;
}

impl DeviceMemory for [u8] {
    fn byte_len(&self) -> usize {
        self.len()
    }
}

/// The primitives of a communicator over device memory; see the module docs for
/// how its contract relates to [`Collective`]'s.
pub trait DeviceCollective: Send + Sync {
    /// Device memory (NCCL: CUDA device memory; [`HostDevice`]: bytes).
    type Buffer: DeviceMemory + ?Sized;
    /// An ordered queue of work (NCCL: a CUDA stream).
    type Stream: ?Sized;

    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Enqueues an all-gather: `mine` of every rank lands in `out` at
    /// `rank · mine.len()`. `out` holds `world_size() · mine.len()` bytes.
    fn all_gather(
        &self,
        mine: &Self::Buffer,
        out: &mut Self::Buffer,
        stream: &Self::Stream,
    ) -> CollectiveResult;

    /// Enqueues a reduce-scatter: the element-wise sum of `data` over all ranks, of
    /// which rank `r` keeps segment `r` (`out.len()` bytes at `r · out.len()`).
    fn reduce_scatter(
        &self,
        data: &Self::Buffer,
        out: &mut Self::Buffer,
        ty: ReduceType,
        stream: &Self::Stream,
    ) -> CollectiveResult;

    /// Enqueues an in-place element-wise sum of `data` over all ranks.
    fn all_reduce(
        &self,
        data: &mut Self::Buffer,
        ty: ReduceType,
        stream: &Self::Stream,
    ) -> CollectiveResult;

    /// Enqueues a copy of rank `root`'s `data` into every rank's `data`.
    fn broadcast(
        &self,
        root: usize,
        data: &mut Self::Buffer,
        stream: &Self::Stream,
    ) -> CollectiveResult;

    /// Blocks until every operation enqueued on `stream` so far has completed, and
    /// returns the first error of the communicator if any did not (a timeout, a lost
    /// peer, an abort). Bounded by the communicator's timeout.
    fn synchronize(&self, stream: &Self::Stream) -> CollectiveResult;

    /// Makes every waiting and every later call fail with
    /// [`CollectiveError::Aborted`]; callable from any thread, never blocks.
    fn abort(&self);
}

/// Checks an all-gather's sizes (shared by the backends).
pub fn check_all_gather(
    op: &'static str,
    world: usize,
    mine: usize,
    out: usize,
) -> CollectiveResult {
    if mine.checked_mul(world) != Some(out) {
        return Err(CollectiveError::Invalid {
            op,
            message: format!(
                "the output holds {out} bytes, not world size {world} × {mine} contributed"
            ),
        });
    }
    Ok(())
}

/// Checks a reduce-scatter's sizes (shared by the backends).
pub fn check_reduce_scatter(
    op: &'static str,
    world: usize,
    data: usize,
    out: usize,
    ty: ReduceType,
) -> CollectiveResult {
    check_all_gather(op, world, out, data)?;
    check_elements(op, out, ty)
}

/// Checks that `bytes` is a whole number of `ty` elements.
pub fn check_elements(op: &'static str, bytes: usize, ty: ReduceType) -> CollectiveResult {
    if !bytes.is_multiple_of(ty.size()) {
        return Err(CollectiveError::Invalid {
            op,
            message: format!("{bytes} bytes is not a whole number of {ty:?} elements"),
        });
    }
    Ok(())
}

/// The stream of [`HostDevice`]: operations complete before they return.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostStream;

/// A [`DeviceCollective`] over host bytes, on any host [`Collective`]: each
/// operation runs to completion when called (so `synchronize` has nothing to wait
/// for), with the wrapped communicator's timeouts, abort and poisoning.
#[derive(Debug)]
pub struct HostDevice<C> {
    inner: C,
}

impl<C: Collective> HostDevice<C> {
    /// Wraps `inner`.
    pub fn new(inner: C) -> Self {
        Self { inner }
    }

    /// The wrapped communicator.
    pub fn inner(&self) -> &C {
        &self.inner
    }
}

fn to_i64(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

fn to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

fn store_i64(values: &[i64], out: &mut [u8]) {
    for (v, o) in values.iter().zip(out.chunks_exact_mut(8)) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

fn store_f32(values: &[f32], out: &mut [u8]) {
    for (v, o) in values.iter().zip(out.chunks_exact_mut(4)) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

impl<C: Collective> DeviceCollective for HostDevice<C> {
    type Buffer = [u8];
    type Stream = HostStream;

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_gather(&self, mine: &[u8], out: &mut [u8], _: &HostStream) -> CollectiveResult {
        let world = self.world_size();
        check_all_gather("all_gather", world, mine.len(), out.len())?;
        self.inner.all_gather(mine, &vec![mine.len(); world], out)
    }

    fn reduce_scatter(
        &self,
        data: &[u8],
        out: &mut [u8],
        ty: ReduceType,
        _: &HostStream,
    ) -> CollectiveResult {
        let world = self.world_size();
        check_reduce_scatter("reduce_scatter", world, data.len(), out.len(), ty)?;
        let counts = vec![out.len() / ty.size(); world];
        match ty {
            ReduceType::I64 => {
                let mut values = to_i64(data);
                let mut mine = vec![0i64; counts[0]];
                self.inner
                    .reduce_scatter_i64(&mut values, &counts, &mut mine)?;
                store_i64(&mine, out);
            }
            ReduceType::F32 => {
                let mut values = to_f32(data);
                let mut mine = vec![0f32; counts[0]];
                self.inner
                    .reduce_scatter_f32(&mut values, &counts, &mut mine)?;
                store_f32(&mine, out);
            }
        }
        Ok(())
    }

    fn all_reduce(&self, data: &mut [u8], ty: ReduceType, _: &HostStream) -> CollectiveResult {
        check_elements("all_reduce", data.len(), ty)?;
        match ty {
            ReduceType::I64 => {
                let mut values = to_i64(data);
                self.inner.all_reduce_i64(&mut values)?;
                store_i64(&values, data);
            }
            ReduceType::F32 => {
                let mut values = to_f32(data);
                self.inner.all_reduce_f32(&mut values)?;
                store_f32(&values, data);
            }
        }
        Ok(())
    }

    fn broadcast(&self, root: usize, data: &mut [u8], _: &HostStream) -> CollectiveResult {
        self.inner.broadcast(root, data)
    }

    fn synchronize(&self, _: &HostStream) -> CollectiveResult {
        Ok(())
    }

    fn abort(&self) {
        self.inner.abort()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{TcpCollective, TcpConfig};
    use std::net::TcpListener;
    use std::time::Duration;

    /// Runs `f` on every rank of a TCP world of `world` ranks (threads), each
    /// wrapped as a device collective.
    fn on_world<T: Send>(
        world: usize,
        f: impl Fn(HostDevice<TcpCollective>) -> T + Sync,
    ) -> Vec<T> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let config = TcpConfig {
            timeout: Duration::from_secs(20),
            connect_timeout: Duration::from_secs(20),
            secret: None,
        };
        let mut listener = Some(listener);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let config = config.clone();
                    let f = &f;
                    let root = if rank == 0 { listener.take() } else { None };
                    s.spawn(move || {
                        let comm = match root {
                            Some(l) => TcpCollective::bootstrap_root(l, world, config),
                            None => TcpCollective::bootstrap(rank, world, addr, config),
                        }
                        .unwrap();
                        f(HostDevice::new(comm))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn host_device_operations_match_their_definitions() {
        let world = 3;
        let results = on_world(world, |comm| {
            let rank = comm.rank();
            let stream = HostStream;
            // All-gather of 5 bytes per rank.
            let mine: Vec<u8> = (0..5).map(|i| (rank * 10 + i) as u8).collect();
            let mut gathered = vec![0u8; 5 * world];
            comm.all_gather(&mine, &mut gathered, &stream).unwrap();
            // Reduce-scatter of i64: rank r contributes r+1+i at index i.
            let values: Vec<i64> = (0..6).map(|i| rank as i64 + 1 + i).collect();
            let mut data = vec![0u8; 48];
            store_i64(&values, &mut data);
            let mut mine_sum = vec![0u8; 16];
            comm.reduce_scatter(&data, &mut mine_sum, ReduceType::I64, &stream)
                .unwrap();
            // All-reduce of f32 and a broadcast from rank 2.
            let mut f = vec![0u8; 8];
            store_f32(&[rank as f32, 0.5], &mut f);
            comm.all_reduce(&mut f, ReduceType::F32, &stream).unwrap();
            let mut b = vec![rank as u8; 4];
            comm.broadcast(2, &mut b, &stream).unwrap();
            comm.synchronize(&stream).unwrap();
            (rank, gathered, to_i64(&mine_sum), to_f32(&f), b)
        });
        for (rank, gathered, sums, f, b) in results {
            let expected: Vec<u8> = (0..world)
                .flat_map(|r| (0..5).map(move |i| (r * 10 + i) as u8))
                .collect();
            assert_eq!(gathered, expected);
            // Sum over ranks of (r + 1 + i) = 6 + 3i, rank keeps indices 2r, 2r+1.
            let want: Vec<i64> = (0..2).map(|j| 6 + 3 * (2 * rank as i64 + j)).collect();
            assert_eq!(sums, want, "rank {rank}");
            assert_eq!(f, vec![3.0, 1.5]);
            assert_eq!(b, vec![2u8; 4]);
        }
    }

    #[test]
    fn sizes_that_do_not_match_the_world_are_invalid_before_any_transfer() {
        let results = on_world(2, |comm| {
            let stream = HostStream;
            let bad_gather = comm.all_gather(&[1, 2], &mut [0u8; 5], &stream);
            let bad_type = comm.all_reduce(&mut [0u8; 6], ReduceType::F32, &stream);
            let bad_scatter =
                comm.reduce_scatter(&[0u8; 16], &mut [0u8; 4], ReduceType::I64, &stream);
            // The communicator is still usable: nothing was sent.
            let mut ok = [comm.rank() as u8];
            comm.broadcast(0, &mut ok, &stream).unwrap();
            (bad_gather, bad_type, bad_scatter, ok[0])
        });
        for (gather, ty, scatter, ok) in results {
            assert!(
                matches!(gather, Err(CollectiveError::Invalid { .. })),
                "{gather:?}"
            );
            assert!(matches!(ty, Err(CollectiveError::Invalid { .. })), "{ty:?}");
            assert!(
                matches!(scatter, Err(CollectiveError::Invalid { .. })),
                "{scatter:?}"
            );
            assert_eq!(ok, 0);
        }
    }

    #[test]
    fn abort_through_the_device_trait_fails_this_rank_and_reaches_the_peer() {
        let results = on_world(2, |comm| {
            if comm.rank() == 1 {
                comm.abort();
            }
            comm.all_reduce(&mut [0u8; 8], ReduceType::I64, &HostStream)
        });
        assert!(
            matches!(results[1], Err(CollectiveError::Aborted { .. })),
            "{:?}",
            results[1]
        );
        assert!(
            matches!(results[0], Err(CollectiveError::PeerLost { peer: 1, .. })),
            "{:?}",
            results[0]
        );
    }
}
