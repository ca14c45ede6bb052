//! Helpers shared by the trainer's end-to-end tests.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use ckpt::CheckpointReader;
use ckpt::storage::Store;
use ckpt::tools::diff::{DiffOptions, diff};

/// The `ckpt` command line of this workspace, built now if needed. The trainer links
/// the library without its command-line feature, so building the trainer's tests
/// does not build the binary; building it here (a no-op when fresh) also makes sure
/// it is not a stale copy. Panics, and so fails the test, when it cannot be built.
pub fn ckpt_cli() -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    // The profile this test was built with, from `<target>/<profile dir>/deps/<exe>`.
    let exe = std::env::current_exe().unwrap();
    let profile = match exe
        .parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .and_then(|name| name.to_str())
    {
        Some("debug") | None => "dev".to_string(),
        Some(other) => other.to_string(),
    };
    let output = Command::new(&cargo)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--quiet", "-p", "ckpt", "--bin", "ckpt"])
        .args(["--profile", &profile, "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cargo:?} to build the ckpt binary: {e}"));
    assert!(
        output.status.success(),
        "building the ckpt binary failed ({})",
        output.status
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let executable = stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["reason"] == "compiler-artifact")
        .filter(|message| message["target"]["name"] == "ckpt")
        .find_map(|message| message["executable"].as_str().map(PathBuf::from));
    let executable = executable
        .unwrap_or_else(|| panic!("cargo built no ckpt executable; its messages:\n{stdout}"));
    assert!(executable.is_file(), "{} is missing", executable.display());
    executable
}

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
