//! The NCCL backend: the collectives' conformance suite (`conformance/`), one rank
//! per GPU, and what only a device backend has, on one GPU (a world of one): abort
//! while an operation is pending, re-initialisation with a new unique id, use again.
//! Without a GPU or NCCL each test prints a `SKIPPED:` line and passes (fails with
//! `CKPT_REQUIRE=gpu`); a check that needs more ranks than there are GPUs says
//! `SKIPPED:` and passes whatever `CKPT_REQUIRE` says (a GPU is there; the machine is
//! too small for that world).
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use ckpt_trainer::collective::guard::{GuardConfig, KeyValue, LocalKv};
use ckpt_trainer::collective::nccl::{DeviceBytes, NcclCollective};
use ckpt_trainer::collective::{CollectiveError, CollectiveResult, DeviceCollective, ReduceType};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr};

mod conformance;

use conformance::{Backend, Rank};

fn gpu(test: &str) -> Option<(Arc<CudaContext>, Arc<CudaStream>)> {
    use ckpt_testkit::{Capability, has_probed};
    let ctx = match ckpt::cuda::context(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            has_probed(
                Capability::Gpu,
                Some(format!("no CUDA device/libcuda: {test}: {e}")),
            );
            return None;
        }
    };
    if let Err(e) = ckpt_trainer::collective::nccl::version() {
        has_probed(
            Capability::Gpu,
            Some(format!("no usable NCCL: {test}: {e}")),
        );
        return None;
    }
    let stream = ctx.new_stream().expect("a stream");
    Some((ctx, stream))
}

fn config() -> GuardConfig {
    with_timeout(Duration::from_secs(30))
}

fn with_timeout(timeout: Duration) -> GuardConfig {
    GuardConfig {
        timeout,
        init_timeout: Duration::from_secs(60),
        ..GuardConfig::default()
    }
}

fn bytes_of<T: DeviceRepr>(slice: &CudaSlice<T>, stream: &CudaStream) -> DeviceBytes {
    let (ptr, _sync) = slice.device_ptr(stream);
    // SAFETY: the slice outlives every use in these tests, which synchronize (or
    // wait for the abort) before dropping it.
    unsafe { DeviceBytes::from_raw(ptr, slice.num_bytes()) }
}

/// A rank of the conformance suite: its communicator on GPU `rank`, and a stream.
struct NcclRank {
    comm: NcclCollective,
    stream: Arc<CudaStream>,
}

impl NcclRank {
    /// A copy of `bytes` in device memory.
    fn upload(&self, bytes: &[u8]) -> CudaSlice<u8> {
        self.stream.clone_htod(bytes).expect("copy to the device")
    }

    /// Waits for what `enqueued` enqueued; after a failure, for the abort that
    /// follows it, so that the buffers may be freed.
    fn finish(&self, enqueued: CollectiveResult) -> CollectiveResult {
        // An operation refused when enqueued left nothing on the stream.
        enqueued?;
        let done = self.comm.synchronize(&self.stream);
        if done.is_err() {
            self.comm.wait_aborted();
        }
        done
    }

    /// Copies `device` back into `host` once the operation succeeded.
    fn download(
        &self,
        result: CollectiveResult,
        device: &CudaSlice<u8>,
        host: &mut [u8],
    ) -> CollectiveResult {
        result?;
        host.copy_from_slice(
            &self
                .stream
                .clone_dtoh(device)
                .expect("copy from the device"),
        );
        Ok(())
    }
}

impl Rank for NcclRank {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_gather(&self, mine: &[u8], out: &mut [u8]) -> CollectiveResult {
        let (src, dst) = (self.upload(mine), self.upload(out));
        let enqueued = self.comm.all_gather(
            &bytes_of(&src, &self.stream),
            &mut bytes_of(&dst, &self.stream),
            &self.stream,
        );
        self.download(self.finish(enqueued), &dst, out)
    }

    fn reduce_scatter(&self, data: &[u8], out: &mut [u8], ty: ReduceType) -> CollectiveResult {
        let (src, dst) = (self.upload(data), self.upload(out));
        let enqueued = self.comm.reduce_scatter(
            &bytes_of(&src, &self.stream),
            &mut bytes_of(&dst, &self.stream),
            ty,
            &self.stream,
        );
        self.download(self.finish(enqueued), &dst, out)
    }

    fn all_reduce(&self, data: &mut [u8], ty: ReduceType) -> CollectiveResult {
        let buffer = self.upload(data);
        let enqueued = self
            .comm
            .all_reduce(&mut bytes_of(&buffer, &self.stream), ty, &self.stream);
        self.download(self.finish(enqueued), &buffer, data)
    }

    fn broadcast(&self, root: usize, data: &mut [u8]) -> CollectiveResult {
        let buffer = self.upload(data);
        let enqueued =
            self.comm
                .broadcast(root, &mut bytes_of(&buffer, &self.stream), &self.stream);
        self.download(self.finish(enqueued), &buffer, data)
    }

    fn barrier(&self) -> CollectiveResult {
        self.all_reduce(&mut [0u8; 8], ReduceType::I64)
    }

    fn abort(&self) {
        self.comm.abort()
    }
}

/// NCCL in the conformance suite: one rank per GPU, on threads, from one unique id.
/// NCCL does not say which peer failed: a stall is [`CollectiveError::Stalled`], a
/// lost peer NCCL's remote error or a stall, an abort surfaces at the wait.
struct Nccl;

impl Backend for Nccl {
    type Rank = NcclRank;

    fn available(world: usize) -> bool {
        let thread = std::thread::current();
        let test = thread.name().unwrap_or("this test");
        if gpu(test).is_none() {
            return false;
        }
        let gpus = Self::capacity();
        if world > gpus {
            eprintln!(
                "SKIPPED: {test} needs {world} ranks, one per GPU (NCCL refuses two on one \
                 device); this machine has {gpus}"
            );
            return false;
        }
        true
    }

    fn capacity() -> usize {
        ckpt::cuda::probe::device_count().unwrap_or(0)
    }

    fn with_world<T: Send>(
        world: usize,
        timeout: Duration,
        body: impl Fn(Self::Rank) -> T + Sync,
    ) -> Vec<T> {
        let id = ckpt_trainer::collective::nccl::unique_id().expect("an NCCL unique id");
        std::thread::scope(|s| {
            let threads: Vec<_> = (0..world)
                .map(|rank| {
                    let (body, id) = (&body, &id);
                    s.spawn(move || {
                        let ctx = ckpt::cuda::context(rank)
                            .unwrap_or_else(|e| panic!("a context on GPU {rank}: {e}"));
                        let stream = ctx.new_stream().expect("a stream");
                        let comm =
                            NcclCollective::init(&ctx, rank, world, id, with_timeout(timeout))
                                .expect("NCCL init");
                        comm.wait_ready().expect("NCCL ready");
                        body(NcclRank { comm, stream })
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        })
    }

    fn timed_out(err: &CollectiveError, _peer: usize) -> bool {
        matches!(err, CollectiveError::Stalled { .. })
    }

    fn lost(err: &CollectiveError, _peer: usize) -> bool {
        matches!(
            err,
            CollectiveError::Device { .. } | CollectiveError::Stalled { .. }
        )
    }

    fn aborted(err: &CollectiveError, _op: &str) -> bool {
        matches!(err, CollectiveError::Aborted { .. })
    }
}

mod nccl {
    crate::conformance::every_check!(crate::Nccl);
}

#[test]
fn nccl_world_of_one_all_reduces_aborts_while_pending_and_reinitialises() {
    let Some((ctx, stream)) =
        gpu("nccl_world_of_one_all_reduces_aborts_while_pending_and_reinitialises")
    else {
        return;
    };
    let kv = LocalKv::default();
    let values: Vec<i64> = (0..1024).map(|i| i * 3 - 7).collect();
    let data = stream.clone_htod(&values).unwrap();

    // First communicator: an all-reduce over one rank leaves the values as they are.
    let comm = NcclCollective::connect(&ctx, &kv, 0, 1, 0, config()).unwrap();
    comm.wait_ready().unwrap();
    let mut buffer = bytes_of(&data, &stream);
    comm.all_reduce(&mut buffer, ReduceType::I64, &stream)
        .unwrap();
    comm.synchronize(&stream).unwrap();
    assert_eq!(stream.clone_dtoh(&data).unwrap(), values);

    // Enqueue work, then abort before waiting for it: the wait reports the abort,
    // and so does every later call.
    for _ in 0..16 {
        comm.all_reduce(&mut buffer, ReduceType::I64, &stream)
            .unwrap();
    }
    comm.abort();
    let err = comm.synchronize(&stream).unwrap_err();
    assert!(matches!(err, CollectiveError::Aborted { .. }), "{err}");
    comm.wait_aborted();
    let later = comm
        .all_reduce(&mut buffer, ReduceType::I64, &stream)
        .unwrap_err();
    assert!(matches!(later, CollectiveError::Aborted { .. }), "{later}");
    drop(comm);
    stream.synchronize().unwrap();

    // Re-initialise with a new unique id (a new key), and use it again.
    let comm = NcclCollective::connect(&ctx, &kv, 0, 1, 1, config()).unwrap();
    assert_ne!(kv.get("nccl/id/0").unwrap(), kv.get("nccl/id/1").unwrap());
    let fresh = stream.clone_htod(&values).unwrap();
    let mut buffer = bytes_of(&fresh, &stream);
    comm.all_reduce(&mut buffer, ReduceType::I64, &stream)
        .unwrap();
    comm.synchronize(&stream).unwrap();
    assert_eq!(stream.clone_dtoh(&fresh).unwrap(), values);
    comm.shutdown().unwrap();
}
