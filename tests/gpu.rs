//! Device tensors: save from the GPU, load on the CPU and back. These tests need a
//! CUDA device; without one (no libcuda, no device) each prints a `SKIPPED:` line and
//! passes (fails with `CKPT_REQUIRE=gpu`), so that CI without a GPU still builds and
//! runs them.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use ckpt::cuda::{DeviceBuffer, DeviceLoader};
use ckpt::storage::Store;
use ckpt::{CheckpointConfig, CheckpointReader, Checkpointer, DType, LoadRequest, Region, State};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

/// The device's context and a stream, or `None` after saying loudly why not.
/// (The skip policy is ckpt-testkit's: `CKPT_REQUIRE=gpu` makes a missing device a
/// failure, as on a machine that has one.)
fn gpu(test: &str) -> Option<(Arc<CudaContext>, Arc<CudaStream>)> {
    match ckpt::cuda::context(0) {
        Ok(ctx) => {
            let stream = ctx.new_stream().expect("a stream on device 0");
            Some((ctx, stream))
        }
        Err(e) => {
            let missing = format!("no CUDA device/libcuda: {test}: {e}");
            ckpt_testkit::has_probed(ckpt_testkit::Capability::Gpu, Some(missing));
            None
        }
    }
}

/// Bytes that differ at every position and from run to run of the pattern.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn to_device(stream: &Arc<CudaStream>, bytes: &[u8]) -> CudaSlice<u8> {
    stream.clone_htod(bytes).expect("host to device")
}

fn to_host(stream: &Arc<CudaStream>, slice: &CudaSlice<u8>) -> Vec<u8> {
    stream.clone_dtoh(slice).expect("device to host")
}

fn config(rank: usize, world: usize) -> CheckpointConfig {
    let mut config = CheckpointConfig::new(rank, world);
    config.run_id = "gpu-test".into();
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_to_host_to_device_round_trip_is_bitwise_for_every_dtype() {
    let Some((ctx, stream)) = gpu("device_to_host_to_device_round_trip_is_bitwise_for_every_dtype")
    else {
        return;
    };
    let store = Store::from_url("memory://gpu-round-trip").unwrap();
    let checkpointer = Checkpointer::new(store.clone(), config(0, 1)).unwrap();
    let shape = [37u64, 5];
    let mut originals = Vec::new();
    let mut slices = Vec::new();
    for (i, dtype) in DType::ALL.iter().enumerate() {
        let bytes = pattern(37 * 5 * dtype.size(), i as u64 + 1);
        slices.push(to_device(&stream, &bytes));
        originals.push(bytes);
    }
    let mut state = State::new();
    for ((dtype, slice), i) in DType::ALL.iter().zip(&slices).zip(0..) {
        // SAFETY: the slices live until the end of the test, and are not written
        // before the save's release event completes (waited for below).
        let buffer = unsafe { DeviceBuffer::from_slice(slice, &stream) };
        state
            .add_device(
                format!("t{i}"),
                *dtype,
                &shape,
                Region::full(&shape),
                buffer,
                true,
            )
            .unwrap();
    }
    let handle = checkpointer.save(1, &state).await.unwrap();
    let released = handle
        .device_released()
        .expect("a save with device tensors has an event");
    // The caller's stream waits for the release, then overwrites the first tensor.
    stream.wait(released).unwrap();
    let zeros = vec![0u8; originals[0].len()];
    stream.memcpy_htod(&zeros, &mut slices[0]).unwrap();
    handle.wait_device_released().unwrap();
    handle.committed().await.unwrap();

    // Host load: every tensor bitwise as it was on the device at save time.
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let mut request = LoadRequest::new();
    for i in 0..DType::ALL.len() {
        request = request.tensor(format!("t{i}"), Region::full(&shape));
    }
    let loaded = reader.load(&request).await.unwrap();
    for (i, tensor) in loaded.tensors.iter().enumerate() {
        assert_eq!(
            tensor.data,
            originals[i],
            "{:?} through the host",
            DType::ALL[i]
        );
    }

    // Device load into fresh buffers.
    let targets: Vec<CudaSlice<u8>> = originals
        .iter()
        .map(|o| stream.alloc_zeros::<u8>(o.len()).unwrap())
        .collect();
    let buffers: Vec<DeviceBuffer> = targets
        .iter()
        // SAFETY: the targets live until the end of the test and nothing else
        // touches them during the load.
        .map(|t| unsafe { DeviceBuffer::from_slice(t, &stream) })
        .collect();
    let mut loader = DeviceLoader::new(&ctx).unwrap();
    loader.load_into(&reader, &request, &buffers).await.unwrap();
    for (i, target) in targets.iter().enumerate() {
        assert_eq!(
            to_host(&stream, target),
            originals[i],
            "{:?} back on the device",
            DType::ALL[i]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn save_from_gpu_load_resharded_on_cpu_and_back() {
    let Some((ctx, stream)) = gpu("save_from_gpu_load_resharded_on_cpu_and_back") else {
        return;
    };
    let store = Store::from_url("memory://gpu-reshard").unwrap();
    let shape = [10u64, 6];
    let global: Vec<u8> = pattern(10 * 6 * 4, 42);
    // Two ranks in one process, each with its dim-0 shard on the device; one of them
    // also holds a host tensor, so host and device boxes share a file.
    let host_extra: Vec<u8> = pattern(16, 7);
    let mut handles = Vec::new();
    let mut shards = Vec::new();
    for rank in 0..2 {
        let rows = Region::dim0_shard(&shape, rank, 2);
        let begin = rows.offsets[0] as usize * 6 * 4;
        let len = rows.lengths[0] as usize * 6 * 4;
        shards.push(to_device(&stream, &global[begin..begin + len]));
    }
    for (rank, shard) in shards.iter().enumerate() {
        let checkpointer = Checkpointer::new(store.clone(), config(rank, 2)).unwrap();
        let mut state = State::new();
        // SAFETY: the shards outlive the saves and are not written.
        let buffer = unsafe { DeviceBuffer::from_slice(shard, &stream) };
        state
            .add_device(
                "w",
                DType::F32,
                &shape,
                Region::dim0_shard(&shape, rank, 2),
                buffer,
                true,
            )
            .unwrap();
        if rank == 1 {
            state
                .add("extra", DType::U8, &[16], Region::full(&[16]), &host_extra)
                .unwrap();
        }
        let handle = checkpointer.save(3, &state).await.unwrap();
        handle.wait_device_released().unwrap();
        handles.push((checkpointer, handle));
    }
    for (_, handle) in &handles {
        handle.committed().await.unwrap();
    }
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    // Three CPU ranks' boxes: rows 0..3, 3..6, 6..10.
    for rank in 0..3 {
        let rows = Region::dim0_shard(&shape, rank, 3);
        let begin = rows.offsets[0] as usize * 24;
        let len = rows.lengths[0] as usize * 24;
        let loaded = reader
            .load(&LoadRequest::new().tensor("w", rows))
            .await
            .unwrap();
        assert_eq!(
            loaded.tensors[0].data,
            &global[begin..begin + len],
            "cpu rank {rank} of 3"
        );
    }
    let extra = reader
        .load(&LoadRequest::new().tensor("extra", Region::full(&[16])))
        .await
        .unwrap();
    assert_eq!(extra.tensors[0].data, host_extra);
    // And back onto the device, whole (a world of one), and rows 4..9.
    let whole = stream.alloc_zeros::<u8>(global.len()).unwrap();
    let part = stream.alloc_zeros::<u8>(5 * 24).unwrap();
    // SAFETY: both live until the end of the test; nothing else touches them.
    let targets = unsafe {
        [
            DeviceBuffer::from_slice(&whole, &stream),
            DeviceBuffer::from_slice(&part, &stream),
        ]
    };
    let request = LoadRequest::new()
        .tensor("w", Region::full(&shape))
        .tensor("w", Region::rows(&shape, 4, 5));
    let mut loader = DeviceLoader::new(&ctx).unwrap();
    loader.load_into(&reader, &request, &targets).await.unwrap();
    assert_eq!(to_host(&stream, &whole), global);
    assert_eq!(to_host(&stream, &part), &global[4 * 24..9 * 24]);
}

#[test]
fn without_a_gpu_the_context_is_a_clear_error() {
    match ckpt::cuda::context(0) {
        Ok(_) => eprintln!("a GPU is present: nothing to check here"),
        Err(e) => {
            assert!(matches!(e, ckpt::Error::Device(_)), "{e}");
            let message = e.to_string();
            assert!(
                message.contains("libcuda") || message.contains("device"),
                "{message}"
            );
        }
    }
}
