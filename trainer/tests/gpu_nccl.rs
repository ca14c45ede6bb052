//! The NCCL backend on one GPU (a world of one): all-reduce, abort while an
//! operation is pending, re-initialisation with a new unique id, use again. Without a
//! GPU or NCCL each test prints a `SKIPPED:` line and passes (fails with
//! `CKPT_REQUIRE=gpu`).
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use ckpt_trainer::collective::guard::{GuardConfig, KeyValue, LocalKv};
use ckpt_trainer::collective::nccl::{DeviceBytes, NcclCollective};
use ckpt_trainer::collective::{CollectiveError, DeviceCollective, ReduceType};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

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
    GuardConfig {
        timeout: Duration::from_secs(30),
        init_timeout: Duration::from_secs(60),
        ..GuardConfig::default()
    }
}

fn bytes_of(slice: &CudaSlice<i64>, stream: &CudaStream) -> DeviceBytes {
    let (ptr, _sync) = slice.device_ptr(stream);
    // SAFETY: the slice outlives every use in these tests, which synchronize (or
    // wait for the abort) before dropping it.
    unsafe { DeviceBytes::from_raw(ptr, slice.num_bytes()) }
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

#[test]
fn nccl_all_gather_reduce_scatter_and_broadcast_on_one_rank() {
    let Some((ctx, stream)) = gpu("nccl_all_gather_reduce_scatter_and_broadcast_on_one_rank")
    else {
        return;
    };
    let id = ckpt_trainer::collective::nccl::unique_id().unwrap();
    let comm = NcclCollective::init(&ctx, 0, 1, &id, config()).unwrap();
    let values: Vec<i64> = (0..64).collect();
    let src = stream.clone_htod(&values).unwrap();
    let dst = stream.alloc_zeros::<i64>(64).unwrap();
    let mine = bytes_of(&src, &stream);
    let mut out = bytes_of(&dst, &stream);
    comm.all_gather(&mine, &mut out, &stream).unwrap();
    comm.synchronize(&stream).unwrap();
    assert_eq!(stream.clone_dtoh(&dst).unwrap(), values);
    let dst2 = stream.alloc_zeros::<i64>(64).unwrap();
    let mut out2 = bytes_of(&dst2, &stream);
    comm.reduce_scatter(&mine, &mut out2, ReduceType::I64, &stream)
        .unwrap();
    let mut again = bytes_of(&src, &stream);
    comm.broadcast(0, &mut again, &stream).unwrap();
    comm.synchronize(&stream).unwrap();
    assert_eq!(stream.clone_dtoh(&dst2).unwrap(), values);
    // A mismatched size is refused before NCCL is called, and does not poison.
    let small = stream.alloc_zeros::<i64>(8).unwrap();
    let mut small = bytes_of(&small, &stream);
    let bad = comm.all_gather(&mine, &mut small, &stream).unwrap_err();
    assert!(matches!(bad, CollectiveError::Invalid { .. }), "{bad}");
    comm.synchronize(&stream).unwrap();
    comm.shutdown().unwrap();
}
