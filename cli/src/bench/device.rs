//! `ckpt bench --device-gib 1,8,40` (feature `cuda`): staging device state, beside
//! the copy it cannot beat.
//!
//! The PCIe link bounds how fast device memory reaches the host. The baseline is
//! therefore one plain asynchronous device-to-host copy of the whole state into
//! page-locked memory (`cuMemcpyDtoHAsync`, then a stream synchronize), timed in the
//! same run and alternated with ckpt's saves so that both see the same machine. For
//! ckpt the figures are what a trainer feels: how long `save` held the caller
//! (`stall_ms`: laying the file out and enqueueing the copies), how long until the
//! device tensors may be written again (`released_ms`, the save's
//! `device_released` event, which the trainer's optimizer stream waits on), and until
//! the checkpoint is committed. The staging pool is warmed up (allocated and pinned)
//! before the first save, as a trainer does at start-up; its time is reported too.

use std::sync::Arc;
use std::time::Instant;

use ckpt::storage::Store;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use serde::{Deserialize, Serialize};

use super::{invalid, median, ms};
use ckpt::format::step_dir;
use ckpt::save::{CheckpointConfig, Checkpointer};
use ckpt::{DType, Region, State};
use ckpt::{Error, Result};

/// Elements of one bf16 tensor row; a tensor is `rows × ROW` bf16 values.
const ROW: u64 = 16384;
/// Bytes per tensor: the state is split into tensors of this size (the last one
/// smaller), as a model's parameters are.
const TENSOR_BYTES: u64 = 256 << 20;

/// Settings of the device staging bench.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DeviceBenchConfig {
    /// State sizes to measure, GiB each.
    pub gib: Vec<f64>,
    /// Measured repetitions per size (medians are reported).
    pub reps: usize,
    /// CUDA device ordinal.
    pub device: usize,
}

/// The figures of one state size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DeviceFigures {
    /// Bytes of device state.
    pub bytes: u64,
    /// Device tensors it was split into.
    pub tensors: usize,
    /// Allocating and pinning the staging pool (`Checkpointer::warm_up`), once.
    pub warm_up_ms: f64,
    /// The baseline: one `cuMemcpyDtoHAsync` of the whole state into pinned memory.
    pub pinned_copy_ms: f64,
    /// Its rate.
    pub pinned_copy_gbps: f64,
    /// What `save` held the caller for.
    pub stall_ms: f64,
    /// From the `save` call until its `device_released` event completed.
    pub released_ms: f64,
    /// Staging rate: bytes ÷ `released_ms`.
    pub staging_gbps: f64,
    /// `released_ms / pinned_copy_ms` (goal ≤ 1.2).
    pub released_ratio: f64,
    /// `stall_ms / pinned_copy_ms`.
    pub stall_ratio: f64,
    /// From the `save` call until committed.
    pub commit_ms: f64,
    /// Every repetition's `(pinned_copy_ms, stall_ms, released_ms, commit_ms)`.
    pub samples: Vec<[f64; 4]>,
}

/// The device staging report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DeviceReport {
    /// The store measured.
    pub url: String,
    /// Settings.
    pub config: DeviceBenchConfig,
    /// The device's name, as the driver gives it.
    pub device_name: String,
    /// One entry per size, in the order asked.
    pub sizes: Vec<DeviceFigures>,
}

fn cuda(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Device(format!("{what}: {e}"))
}

/// Runs the device staging bench on `store` (a scratch location: step directories
/// are written and deleted).
pub(crate) fn run(
    store: &Store,
    rt: &tokio::runtime::Handle,
    config: &DeviceBenchConfig,
    progress: &dyn Fn(&str),
) -> Result<DeviceReport> {
    if config.gib.is_empty() || config.gib.iter().any(|g| g.is_nan() || *g <= 0.0) {
        return Err(invalid("--device-gib needs sizes above 0 GiB"));
    }
    if config.reps == 0 {
        return Err(invalid("--reps must be at least 1"));
    }
    let ctx = ckpt::cuda::context(config.device)?;
    let device_name = ctx.name().unwrap_or_else(|e| format!("unknown ({e})"));
    let stream = ctx.new_stream().map_err(|e| cuda("creating a stream", e))?;
    let mut sizes = Vec::new();
    for &gib in &config.gib {
        let bytes = ((gib * (1u64 << 30) as f64) as u64).div_ceil(2 * ROW) * 2 * ROW;
        progress(&format!("device state of {gib} GiB: allocating"));
        sizes.push(one_size(store, rt, &ctx, &stream, bytes, config, progress)?);
    }
    Ok(DeviceReport {
        url: store.url().to_string(),
        config: config.clone(),
        device_name,
        sizes,
    })
}

fn one_size(
    store: &Store,
    rt: &tokio::runtime::Handle,
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    bytes: u64,
    config: &DeviceBenchConfig,
    progress: &dyn Fn(&str),
) -> Result<DeviceFigures> {
    let len = usize::try_from(bytes).map_err(|_| invalid("state too large"))?;
    let mut source: CudaSlice<u8> = stream
        .alloc_zeros(len)
        .map_err(|e| cuda(&format!("allocating {bytes} bytes on the device"), e))?;
    // Not zeros: some value in every byte, so nothing is special about the data.
    {
        use cudarc::driver::DevicePtrMut;
        let (ptr, _sync) = source.device_ptr_mut(stream);
        // SAFETY: `ptr..ptr+len` is the allocation just made, on `stream`.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0x3c, len, stream.cu_stream()) }
            .map_err(|e| cuda("cuMemsetD8Async", e))?;
    }
    stream.synchronize().map_err(|e| cuda("synchronizing", e))?;
    // SAFETY: plain page-locked host memory (flags 0, as the staging pool uses: not
    // write-combined), written only by the device copies below.
    let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(len, 0) }
        .map_err(|e| cuda(&format!("pinning {bytes} bytes of host memory"), e))?;

    let base = {
        let (ptr, _sync) = source.device_ptr(stream);
        ptr
    };
    let mut state = State::new();
    let mut offset = 0u64;
    let mut tensors = 0;
    while offset < bytes {
        let size = TENSOR_BYTES.min(bytes - offset);
        let shape = [size / 2 / ROW, ROW];
        // SAFETY: `base + offset .. + size` lies inside `source`, which outlives every
        // save below (each waits for its release event before the next step), and
        // nothing writes it meanwhile.
        let buffer = unsafe {
            ckpt::cuda::DeviceBuffer::from_raw(
                ctx,
                base + offset,
                size as usize,
                stream.cu_stream(),
            )
        };
        state.add_device(
            format!("layer.{tensors}.weight"),
            DType::BF16,
            &shape,
            Region::full(&shape),
            buffer,
            true,
        )?;
        offset += size;
        tensors += 1;
    }

    let mut checkpoint = CheckpointConfig::new(0, 1);
    // One save in flight: the pool is one staging buffer the size of the state.
    checkpoint.max_in_flight = 1;
    checkpoint.run_id = "bench-device".into();
    let checkpointer = Checkpointer::new(store.clone(), checkpoint)?;
    progress("pinning the staging pool (warm-up)");
    let warm_up_ms = ms(checkpointer.warm_up(&state)?);

    let mut samples = Vec::new();
    for rep in 0..config.reps {
        progress(&format!("rep {}/{}: pinned copy", rep + 1, config.reps));
        let started = Instant::now();
        stream
            .memcpy_dtoh(&source, &mut pinned)
            .map_err(|e| cuda("cuMemcpyDtoHAsync", e))?;
        stream
            .synchronize()
            .map_err(|e| cuda("synchronizing the copy", e))?;
        let pinned_copy_ms = ms(started.elapsed());

        progress(&format!("rep {}/{}: ckpt save", rep + 1, config.reps));
        let step = rep as u64 + 1;
        let started = Instant::now();
        let handle = rt.block_on(checkpointer.save(step, &state))?;
        let stall_ms = ms(handle.stall());
        handle.wait_device_released()?;
        let released_ms = ms(started.elapsed());
        rt.block_on(handle.committed())?;
        let commit_ms = ms(started.elapsed());
        rt.block_on(store.delete_prefix(&step_dir(step)))?;
        samples.push([pinned_copy_ms, stall_ms, released_ms, commit_ms]);
    }
    drop(state);
    let column = |i: usize| median(&samples.iter().map(|s| s[i]).collect::<Vec<_>>());
    let (pinned_copy_ms, stall_ms, released_ms, commit_ms) =
        (column(0), column(1), column(2), column(3));
    let gbps = |ms: f64| bytes as f64 / (ms / 1e3) / 1e9;
    Ok(DeviceFigures {
        bytes,
        tensors,
        warm_up_ms,
        pinned_copy_ms,
        pinned_copy_gbps: gbps(pinned_copy_ms),
        stall_ms,
        released_ms,
        staging_gbps: gbps(released_ms),
        released_ratio: released_ms / pinned_copy_ms,
        stall_ratio: stall_ms / pinned_copy_ms,
        commit_ms,
        samples,
    })
}

/// The report as a table.
pub(crate) fn render(report: &DeviceReport) -> String {
    let mut out = format!(
        "ckpt bench on {}: device state staged from {} (device {}), medians of {}\n",
        report.url, report.device_name, report.config.device, report.config.reps
    );
    for s in &report.sizes {
        let gib = s.bytes as f64 / (1u64 << 30) as f64;
        out.push_str(&format!(
            "\n{gib:.2} GiB in {} device tensors (staging pool warm-up {:.0} ms, once)\n",
            s.tensors, s.warm_up_ms
        ));
        out.push_str(&format!(
            "  pinned copy (baseline)      {:>9.1} ms  {:>6.2} GB/s\n",
            s.pinned_copy_ms, s.pinned_copy_gbps
        ));
        out.push_str(&format!(
            "  save stall                  {:>9.1} ms  {:>6.3} x the pinned copy\n",
            s.stall_ms, s.stall_ratio
        ));
        out.push_str(&format!(
            "  until device_released       {:>9.1} ms  {:>6.2} GB/s, {:.3} x the pinned copy (goal <= 1.2)\n",
            s.released_ms, s.staging_gbps, s.released_ratio
        ));
        out.push_str(&format!(
            "  until committed             {:>9.1} ms\n",
            s.commit_ms
        ));
    }
    out
}
