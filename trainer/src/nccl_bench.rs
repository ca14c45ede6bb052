//! `ckpt-train bench-nccl` (feature `cuda`): how long recovery spends on the
//! communicator itself — building one, aborting it, building the next.
//!
//! A world of one rank on one GPU, so that the figures are NCCL's own costs, not a
//! peer's: each iteration connects (a new unique id through a key-value space, then
//! the non-blocking initialisation until ready), all-reduces a small i64 buffer and
//! synchronizes (the communicator works), then aborts it from another thread and
//! waits until the watchdog has aborted it. The first connect is reported apart: it
//! includes loading NCCL and its one-time setup.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::DevicePtr;
use serde::Serialize;

use crate::collective::guard::{GuardConfig, LocalKv};
use crate::collective::nccl::{self, DeviceBytes, NcclCollective};
use crate::collective::{CollectiveError, DeviceCollective, ReduceType};

/// The figures, milliseconds (medians over the iterations after the first).
#[derive(Debug, Clone, Serialize)]
pub struct NcclReport {
    /// The loaded NCCL, e.g. "2.27.7".
    pub nccl_version: String,
    /// Iterations measured.
    pub iters: usize,
    /// The first connect until ready (library loading included).
    pub first_init_ms: f64,
    /// Connect until ready, later iterations.
    pub init_ms: f64,
    /// `abort()` from another thread until the communicator is aborted.
    pub abort_ms: f64,
    /// Abort plus the next connect until ready: what a survivor pays to rebuild.
    pub recreate_ms: f64,
    /// One all-reduce of 1 MiB of i64 and its synchronize.
    pub all_reduce_ms: f64,
    /// Every iteration's `(init_ms, abort_ms, all_reduce_ms)`.
    pub samples: Vec<[f64; 3]>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn device_err(op: &'static str, e: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::Device {
        op,
        message: e.to_string(),
    }
}

/// Runs `iters` build–use–abort cycles on device `device` (`iters` ≥ 2: the first
/// is reported apart).
pub fn run(device: usize, iters: usize) -> Result<NcclReport, CollectiveError> {
    if iters < 2 {
        return Err(CollectiveError::Invalid {
            op: "bench-nccl",
            message: "--iters must be at least 2 (the first connect is reported apart)".into(),
        });
    }
    let ctx = ckpt::cuda::context(device).map_err(|e| device_err("bench-nccl", e))?;
    let version = nccl::version()?;
    let stream = ctx.new_stream().map_err(|e| device_err("bench-nccl", e))?;
    let values: Vec<i64> = (0..(1 << 17)).collect();
    let data = stream
        .clone_htod(&values)
        .map_err(|e| device_err("bench-nccl", e))?;
    let (ptr, _sync) = data.device_ptr(&stream);
    let kv = LocalKv::default();
    let config = GuardConfig {
        timeout: Duration::from_secs(60),
        init_timeout: Duration::from_secs(120),
        ..GuardConfig::default()
    };
    let mut samples = Vec::new();
    for attempt in 0..iters as u64 {
        let started = Instant::now();
        let comm = Arc::new(NcclCollective::connect(
            &ctx,
            &kv,
            0,
            1,
            attempt,
            config.clone(),
        )?);
        comm.wait_ready()?;
        let init_ms = ms(started.elapsed());

        let started = Instant::now();
        // SAFETY: `data` outlives the operation: it is synchronized below, before
        // the communicator is aborted and long before `data` is dropped.
        let mut buffer = unsafe { DeviceBytes::from_raw(ptr, data.num_bytes()) };
        comm.all_reduce(&mut buffer, ReduceType::I64, &stream)?;
        comm.synchronize(&stream)?;
        let all_reduce_ms = ms(started.elapsed());

        let started = Instant::now();
        let aborter = {
            let comm = comm.clone();
            std::thread::spawn(move || comm.abort())
        };
        comm.wait_aborted();
        let abort_ms = ms(started.elapsed());
        aborter.join().map_err(|_| CollectiveError::Invalid {
            op: "bench-nccl",
            message: "the aborting thread panicked".into(),
        })?;
        samples.push([init_ms, abort_ms, all_reduce_ms]);
    }
    let later = &samples[1..];
    let column = |i: usize| median(later.iter().map(|s| s[i]).collect());
    let (init_ms, abort_ms, all_reduce_ms) = (column(0), column(1), column(2));
    Ok(NcclReport {
        nccl_version: nccl::version_string(version),
        iters,
        first_init_ms: samples[0][0],
        init_ms,
        abort_ms,
        recreate_ms: abort_ms + init_ms,
        all_reduce_ms,
        samples,
    })
}
