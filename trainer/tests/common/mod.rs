//! Helpers shared by the trainer's end-to-end tests.

#![allow(dead_code, unreachable_pub)]

use std::path::Path;

use ckpt::CheckpointReader;
use ckpt::storage::Store;
use ckpt::tools::diff::{DiffOptions, diff};

pub use ckpt_testkit::ckpt_cli;

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub fn url(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Asserts that the newest checkpoints under `a` and `b` are at the same step and
/// bitwise identical (tensors and non-tensor state), with the library's `ckpt diff`.
pub fn assert_identical(a: &Path, b: &Path) {
    runtime().block_on(async {
        let ra = CheckpointReader::open(&Store::from_url(&url(a)).unwrap(), None)
            .await
            .unwrap();
        let rb = CheckpointReader::open(&Store::from_url(&url(b)).unwrap(), None)
            .await
            .unwrap();
        assert_eq!(ra.step(), rb.step(), "different final steps");
        let report = diff(&ra, &rb, &DiffOptions::default(), &|_| {})
            .await
            .unwrap();
        assert!(
            report.identical,
            "{} (world {}) and {} (world {}) differ: {report:#?}",
            a.display(),
            ra.manifest().world_size,
            b.display(),
            rb.manifest().world_size
        );
        assert_eq!(
            report.tensors.len(),
            18,
            "params and both Adam moments of 6 tensors"
        );
        assert!(report.only_in_a.is_empty() && report.only_in_b.is_empty());
    });
}
