//! One set of behavioural checks over the collectives' contract
//! (`ckpt_trainer::collective`'s module docs), run on every backend: TCP always
//! (`collectives.rs`), NCCL with the `cuda` feature (`gpu_nccl.rs`, which skips
//! loudly without a GPU and NCCL).
//!
//! The trainer does not know which backend it talks through, so whatever one backend
//! guarantees, the other must too. Each check is written once, generically over
//! [`Backend`] (how to form a world of ranks on threads of this process, and how the
//! backend words a stalled or a lost peer), and drives every rank through [`Rank`]:
//! host bytes in and out, each operation run to completion. That is the common ground
//! of the two traits: the TCP backend is a host [`Collective`], seen here through
//! [`HostDevice`], and NCCL a [`DeviceCollective`] whose rank copies in, enqueues,
//! synchronizes and copies out. [`every_check!`] makes one test per check and backend.
//! What only one backend has stays in its own file: uneven shards, mismatched
//! operations and a SIGKILLed process for TCP; pending work, re-initialisation and
//! the unique id for NCCL.

use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ckpt_trainer::collective::{
    Collective, CollectiveError, CollectiveResult, DeviceCollective, HostDevice, HostStream,
    ReduceType,
};

/// A collective backend as the checks see it.
pub(crate) trait Backend {
    /// One rank's communicator.
    type Rank: Rank;

    /// Whether a world of `world` ranks can run here; when not, says `SKIPPED` (or
    /// fails, where `CKPT_REQUIRE` asks for what is missing) and the check returns.
    fn available(world: usize) -> bool;

    /// The most ranks a world here may have (asked once [`Backend::available`] said
    /// yes for one rank).
    fn capacity() -> usize;

    /// Forms a world of `world` ranks on threads of this process, every operation
    /// bounded by `timeout`, runs `body` on each rank, and returns what each returned,
    /// by rank.
    fn with_world<T: Send>(
        world: usize,
        timeout: Duration,
        body: impl Fn(Self::Rank) -> T + Sync,
    ) -> Vec<T>;

    /// Whether `err` is how this backend says that `peer` made no progress within the
    /// timeout.
    fn timed_out(err: &CollectiveError, peer: usize) -> bool;

    /// Whether `err` is how this backend says that `peer` went away (its process
    /// died, or it gave up on this world after its own failure).
    fn lost(err: &CollectiveError, peer: usize) -> bool;

    /// Whether `err` is how this backend reports an abort of this rank during `op`.
    fn aborted(err: &CollectiveError, op: &str) -> bool;
}

/// One rank of a world under test, driven with host bytes; every call returns once
/// its operation has completed (or failed), on every backend.
pub(crate) trait Rank: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// [`DeviceCollective::all_gather`].
    fn all_gather(&self, mine: &[u8], out: &mut [u8]) -> CollectiveResult;
    /// [`DeviceCollective::reduce_scatter`].
    fn reduce_scatter(&self, data: &[u8], out: &mut [u8], ty: ReduceType) -> CollectiveResult;
    /// [`DeviceCollective::all_reduce`].
    fn all_reduce(&self, data: &mut [u8], ty: ReduceType) -> CollectiveResult;
    /// [`DeviceCollective::broadcast`].
    fn broadcast(&self, root: usize, data: &mut [u8]) -> CollectiveResult;
    /// Returns once every rank has entered (a device backend has no barrier of its
    /// own: it all-reduces one element, the barrier NCCL's users build).
    fn barrier(&self) -> CollectiveResult;
    /// [`DeviceCollective::abort`].
    fn abort(&self);
}

/// A host collective (the TCP backend), through the device trait its operations are
/// also offered under.
impl<C: Collective> Rank for HostDevice<C> {
    fn rank(&self) -> usize {
        DeviceCollective::rank(self)
    }

    fn world_size(&self) -> usize {
        DeviceCollective::world_size(self)
    }

    fn all_gather(&self, mine: &[u8], out: &mut [u8]) -> CollectiveResult {
        DeviceCollective::all_gather(self, mine, out, &HostStream)?;
        self.synchronize(&HostStream)
    }

    fn reduce_scatter(&self, data: &[u8], out: &mut [u8], ty: ReduceType) -> CollectiveResult {
        DeviceCollective::reduce_scatter(self, data, out, ty, &HostStream)?;
        self.synchronize(&HostStream)
    }

    fn all_reduce(&self, data: &mut [u8], ty: ReduceType) -> CollectiveResult {
        DeviceCollective::all_reduce(self, data, ty, &HostStream)?;
        self.synchronize(&HostStream)
    }

    fn broadcast(&self, root: usize, data: &mut [u8]) -> CollectiveResult {
        DeviceCollective::broadcast(self, root, data, &HostStream)?;
        self.synchronize(&HostStream)
    }

    fn barrier(&self) -> CollectiveResult {
        self.inner().barrier()
    }

    fn abort(&self) {
        DeviceCollective::abort(self)
    }
}

/// Rank `rank`'s `i`-th contribution to an integer sum: large, of both signs.
pub(crate) fn value(rank: usize, i: usize) -> i64 {
    ((rank as i64 + 1) * 1_000_003 + i as i64 * 7) * if i.is_multiple_of(2) { 1 } else { -1 }
}

fn bytes<T: bytemuck::Pod>(values: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(values).to_vec()
}

fn values<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

/// Every operation, on worlds of one rank up to five (or the backend's capacity),
/// gives what a serial computation gives.
pub(crate) fn every_operation_matches_a_serial_reference_for_every_world_size<B: Backend>() {
    if !B::available(1) {
        return;
    }
    for world in 1..=B::capacity().min(5) {
        let results = B::with_world(world, Duration::from_secs(60), |comm| {
            let (rank, w) = (comm.rank(), comm.world_size());
            // All-gather, small and large (> 32 KiB a rank, the threaded path).
            for per_rank in [1usize, 3, 10_000] {
                let start = rank * per_rank;
                let mine: Vec<f32> = (start..start + per_rank).map(|i| i as f32).collect();
                let mut out = vec![0xffu8; w * per_rank * 4];
                comm.all_gather(&bytes(&mine), &mut out).unwrap();
                let want: Vec<f32> = (0..w * per_rank).map(|i| i as f32).collect();
                assert_eq!(values::<f32>(&out), want, "world {w} rank {rank}");
            }
            // Reduce-scatter of i64, exact.
            for per_rank in [1usize, 5_000] {
                let n = per_rank * w;
                let data: Vec<i64> = (0..n).map(|i| value(rank, i)).collect();
                let mut out = vec![0u8; per_rank * 8];
                comm.reduce_scatter(&bytes(&data), &mut out, ReduceType::I64)
                    .unwrap();
                let start = rank * per_rank;
                for (k, got) in values::<i64>(&out).into_iter().enumerate() {
                    let want: i64 = (0..w).map(|r| value(r, start + k)).sum();
                    assert_eq!(got, want, "world {w} rank {rank} element {}", start + k);
                }
            }
            // All-reduce of i64 and of f32 (integer-valued, so exact too).
            let mut ints = bytes(&(0..10_001).map(|i| value(rank, i)).collect::<Vec<_>>());
            comm.all_reduce(&mut ints, ReduceType::I64).unwrap();
            for (i, got) in values::<i64>(&ints).into_iter().enumerate() {
                assert_eq!(got, (0..w).map(|r| value(r, i)).sum::<i64>());
            }
            let floats: Vec<f32> = (0..9_999).map(|i| (i % 13 + rank) as f32).collect();
            let mut floats = bytes(&floats);
            comm.all_reduce(&mut floats, ReduceType::F32).unwrap();
            for (i, got) in values::<f32>(&floats).into_iter().enumerate() {
                let want: usize = (0..w).map(|r| i % 13 + r).sum();
                assert_eq!(got, want as f32);
            }
            // Broadcast from the last rank, more than one 1 MiB piece, and a small
            // one from rank 0.
            let root = w - 1;
            let mut data = if rank == root {
                (0..3_000_000u32).map(|i| (i % 251) as u8).collect()
            } else {
                vec![0u8; 3_000_000]
            };
            comm.broadcast(root, &mut data).unwrap();
            assert!(data.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
            let mut small = (42 + rank as u64).to_le_bytes();
            comm.broadcast(0, &mut small).unwrap();
            assert_eq!(u64::from_le_bytes(small), 42);
            comm.barrier().unwrap();
            rank
        });
        assert_eq!(results, (0..world).collect::<Vec<_>>());
    }
}

/// No rank leaves a barrier before the last one has entered it.
pub(crate) fn a_barrier_returns_only_once_every_rank_has_entered<B: Backend>() {
    let world = 3;
    if !B::available(world) {
        return;
    }
    let times = B::with_world(world, Duration::from_secs(60), |comm| {
        // Ranks arrive 100 ms apart.
        std::thread::sleep(Duration::from_millis(100 * comm.rank() as u64));
        let entered = Instant::now();
        comm.barrier().unwrap();
        (entered, Instant::now())
    });
    let last_in = times.iter().map(|t| t.0).max().unwrap();
    for (rank, (_, left)) in times.iter().enumerate() {
        assert!(*left >= last_in, "rank {rank} left before the last entered");
    }
}

/// Sizes that do not fit the world are refused before anything is sent, and the
/// communicator stays usable.
pub(crate) fn sizes_that_do_not_match_the_world_are_invalid_and_do_not_poison<B: Backend>() {
    if !B::available(1) {
        return;
    }
    let world = B::capacity().min(2);
    let results = B::with_world(world, Duration::from_secs(60), |comm| {
        let w = comm.world_size();
        let bad_gather = comm.all_gather(&[1, 2], &mut vec![0u8; 2 * w + 1]);
        let bad_type = comm.all_reduce(&mut [0u8; 6], ReduceType::F32);
        let bad_scatter = comm.reduce_scatter(&vec![0u8; 16 * w], &mut [0u8; 4], ReduceType::I64);
        let mut ok = [comm.rank() as u8 + 1];
        comm.broadcast(0, &mut ok).unwrap();
        (bad_gather, bad_type, bad_scatter, ok[0])
    });
    for (gather, ty, scatter, ok) in results {
        for bad in [gather, ty, scatter] {
            assert!(
                matches!(bad, Err(CollectiveError::Invalid { .. })),
                "{bad:?}"
            );
        }
        assert_eq!(ok, 1, "the broadcast after the refusals");
    }
}

/// A world of two with `timeout` on every operation: rank 0 runs `first` while rank 1
/// is silent, then rank 1 runs `then`; returns what each returned.
fn rank_1_after_rank_0<B: Backend, T: Send, U: Send>(
    timeout: Duration,
    first: impl Fn(&B::Rank) -> T + Sync,
    then: impl Fn(&B::Rank) -> U + Sync,
) -> (T, U) {
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = Mutex::new(done_rx);
    let mut results = B::with_world(2, timeout, |comm| {
        if comm.rank() == 1 {
            done_rx.lock().unwrap().recv().unwrap();
            return (None, Some(then(&comm)));
        }
        // Sent when `first` returns or panics, so that a failed check ends the test
        // instead of leaving rank 1 waiting.
        struct Done<'a>(&'a mpsc::Sender<()>);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                let _ = self.0.send(());
            }
        }
        let _done = Done(&done_tx);
        (Some(first(&comm)), None)
    });
    let (second, first) = (results.pop().unwrap(), results.pop().unwrap());
    (first.0.unwrap(), second.1.unwrap())
}

/// A peer that does not call the operation fails it on the others after the
/// timeout, not sooner and not much later.
pub(crate) fn a_silent_peer_times_out_naming_it<B: Backend>() {
    if !B::available(2) {
        return;
    }
    let ((err, elapsed), ()) = rank_1_after_rank_0::<B, _, _>(
        Duration::from_millis(300),
        |comm| {
            let started = Instant::now();
            let err = comm.barrier().unwrap_err();
            (err, started.elapsed())
        },
        |_| (),
    );
    assert!(B::timed_out(&err, 1), "{err}");
    assert!(
        elapsed >= Duration::from_millis(250) && elapsed < Duration::from_secs(5),
        "{elapsed:?}"
    );
}

/// `abort` from another thread wakes an operation blocked on a silent peer at once,
/// every later call fails at once, and the peer learns of it within moments rather
/// than after its timeout.
pub(crate) fn abort_from_another_thread_wakes_a_blocked_operation_and_poisons_the_communicator<
    B: Backend,
>() {
    if !B::available(2) {
        return;
    }
    let ((), (err, elapsed)) = rank_1_after_rank_0::<B, _, _>(
        Duration::from_secs(60),
        |comm| {
            let (err, woke, aborted_at) = std::thread::scope(|s| {
                let aborter = s.spawn(|| {
                    // The outcome is the same whether abort lands before or during
                    // the operation: an abort, at once.
                    std::thread::sleep(Duration::from_millis(100));
                    comm.abort();
                    Instant::now()
                });
                // A broadcast from rank 1: rank 0 only waits to receive, so nothing
                // of the aborted operation is left in rank 1's socket for its next
                // call to read (an all-gather's first piece was, and rank 1's barrier
                // then failed on a mismatch instead of the lost peer).
                let err = comm.broadcast(1, &mut vec![0u8; 1 << 20]).unwrap_err();
                (err, Instant::now(), aborter.join().unwrap())
            });
            assert!(B::aborted(&err, "broadcast"), "{err}");
            assert!(woke.saturating_duration_since(aborted_at) < Duration::from_secs(2));
            // Poisoned: later calls fail at once.
            let again = comm.barrier().unwrap_err();
            assert!(matches!(again, CollectiveError::Aborted { .. }), "{again}");
        },
        |comm| {
            // Rank 0 aborted: its failure reaches this rank at once.
            let started = Instant::now();
            let err = comm.barrier().unwrap_err();
            (err, started.elapsed())
        },
    );
    assert!(B::lost(&err, 0), "{err}");
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
}

/// A rank that goes away (its communicator dropped, as a dying process's is) during
/// a run of all-gathers of 4 ranks: every survivor's operation fails well within the
/// timeout, each naming a lost or stalled peer, and some survivor names the rank that
/// went away.
pub(crate) fn survivors_of_a_peer_that_goes_away_fail_within_the_timeout<B: Backend>() {
    let world = 4;
    if !B::available(world) {
        return;
    }
    let timeout = Duration::from_secs(5);
    let (gone, leaving) = (2, 3);
    let failures = B::with_world(world, timeout, |comm| {
        let rank = comm.rank();
        let mine = vec![rank as u8; 1 << 20];
        let mut out = vec![0u8; world << 20];
        for iteration in 0..50 {
            if rank == gone && iteration == leaving {
                drop(comm);
                return None;
            }
            let started = Instant::now();
            if let Err(err) = comm.all_gather(&mine, &mut out) {
                return Some((err, started.elapsed()));
            }
        }
        panic!("rank {rank} finished every all-gather without rank {gone}");
    });
    for (rank, failure) in failures.iter().enumerate() {
        if rank == gone {
            continue;
        }
        let (err, elapsed) = failure.as_ref().expect("a survivor's failure");
        assert!(*elapsed < timeout, "rank {rank} took {elapsed:?}: {err}");
        assert!(
            (0..world).any(|peer| B::lost(err, peer) || B::timed_out(err, peer)),
            "rank {rank}: {err}"
        );
    }
    assert!(
        failures.iter().flatten().any(|(err, _)| B::lost(err, gone)),
        "no survivor names rank {gone}: {failures:?}"
    );
}

/// One test per check for `$backend`, named after the check, in the module where it
/// is invoked.
macro_rules! checks {
    ($backend:ty: $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::$check::<$backend>();
            }
        )*
    };
}

/// Every check of the suite, for `$backend`.
macro_rules! every_check {
    ($backend:ty) => {
        $crate::conformance::checks!($backend:
            every_operation_matches_a_serial_reference_for_every_world_size,
            a_barrier_returns_only_once_every_rank_has_entered,
            sizes_that_do_not_match_the_world_are_invalid_and_do_not_poison,
            a_silent_peer_times_out_naming_it,
            abort_from_another_thread_wakes_a_blocked_operation_and_poisons_the_communicator,
            survivors_of_a_peer_that_goes_away_fail_within_the_timeout,
        );
    };
}

pub(crate) use checks;
pub(crate) use every_check;
