//! `ckpt bench` end to end on a tiny workload: the JSON report carries the keys
//! scripts track, as positive numbers. Timings are never asserted (machines differ);
//! only that each figure was measured.

use std::process::Command;

fn bench_json(args: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let output = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["bench", "--url", &url, "--json"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "ckpt bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// Keys of the core figures, at the top (ranks as threads) and under `processes`.
const CORE_KEYS: [&str; 13] = [
    "stall_ms",
    "memcpy_ms",
    "overlap_stall_ms",
    "overlap_staged_ms",
    "cold_stall_ms",
    "warm_up_ms",
    "commit_ms",
    "raw_write_gbps",
    "raw_read_gbps",
    "load_ms",
    "read_ratio",
    "reshard_load_ms",
    "reshard_ratio",
];

/// Each key of `report` is a positive finite number.
fn assert_positive<'a>(
    report: &serde_json::Value,
    prefix: &str,
    keys: impl Iterator<Item = &'a &'a str>,
) {
    for key in keys {
        let value = report[*key]
            .as_f64()
            .unwrap_or_else(|| panic!("{prefix}{key} missing: {report}"));
        assert!(value > 0.0 && value.is_finite(), "{prefix}{key} = {value}");
    }
}

#[test]
fn tiny_bench_reports_every_tracked_ratio_as_a_positive_number() {
    let report = bench_json(&[
        "--ranks",
        "2",
        "--reshard-ranks",
        "3",
        "--tensors",
        "3",
        "--rows",
        "96",
        "--cols",
        "64",
        "--reps",
        "1",
        "--block-size",
        "4096",
        "--raw-mib",
        "1",
        "--codec-sample-mib",
        "1",
        "--meta-tensors",
        "10",
        "--meta-ranks",
        "8",
        "--rss-saves",
        "2",
    ]);
    let extra = ["reshard_read_amplification", "write_ratio", "load_alloc_ms"];
    assert_positive(&report, "", CORE_KEYS.iter().chain(&extra));
    // Every saved byte was read at least once, and no more than the blocks touched.
    assert!(report["reshard_read_amplification"].as_f64().unwrap() >= 1.0);
    let zstd = report["zstd"].as_array().unwrap();
    assert_eq!(zstd.len(), 2, "zstd with and without shuffle: {report}");
    for run in zstd {
        assert!(run["stored_bytes"].as_u64().unwrap() > 0);
        assert!(run["ratio"].as_f64().unwrap() > 0.0);
    }
    let samples = report["codec_samples"].as_array().unwrap();
    assert_eq!(
        samples.len(),
        4,
        "fp32 and bf16, each with and without shuffle"
    );
    let metadata = &report["metadata"];
    assert_eq!(metadata["chunks"].as_u64(), Some(80));
    assert!(metadata["manifest_bytes"].as_u64().unwrap() > 0);
    assert!(metadata["plan_bytes_read"].as_u64().unwrap() > 0);
    assert_eq!(report["rss"]["rss_mib"].as_array().unwrap().len(), 2);
    assert!(!report["targets"].as_array().unwrap().is_empty());
    // The core again, one process per rank.
    let processes = &report["processes"];
    assert_eq!(processes["ranks"].as_u64(), Some(2), "{processes}");
    assert_positive(processes, "processes.", CORE_KEYS.iter());
    // Where each kind of load spent its time, as the tool reports it.
    for kind in ["same_size", "resharded", "allocating"] {
        let b = &report["load_breakdown"][kind];
        for key in ["wall_ms", "plan_ms", "read_ms", "verify_ms"] {
            let value = b[key]
                .as_f64()
                .unwrap_or_else(|| panic!("load_breakdown.{kind}.{key} missing: {report}"));
            assert!(value > 0.0 && value.is_finite(), "{kind}.{key} = {value}");
        }
        for key in [
            "read_cpu_ms",
            "io_wait_ms",
            "copy_ms",
            "bytes_copied",
            "minor_faults",
        ] {
            assert!(
                b[key].as_f64().is_some(),
                "load_breakdown.{kind}.{key}: {report}"
            );
        }
    }
    assert!(
        report["load_breakdown"]["same_size"]["prefault_ms"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

#[test]
fn metadata_only_bench_skips_the_data_runs() {
    let started = std::time::Instant::now();
    let report = bench_json(&[
        "--metadata-only",
        "--meta-tensors",
        "20",
        "--meta-ranks",
        "16",
    ]);
    let wall_ms = started.elapsed().as_secs_f64() * 1000.0;
    let metadata = &report["metadata"];
    assert_eq!(metadata["chunks"].as_u64(), Some(320));
    // Planning was timed, within the run that timed it.
    for key in ["open_ms", "plan_ms", "reshard_plan_ms"] {
        let ms = metadata[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key}: {report}"));
        assert!(
            ms > 0.0 && ms < wall_ms,
            "{key} = {ms} in a {wall_ms} ms run"
        );
    }
    // A plan reads the manifest and at least one part.
    let least =
        metadata["manifest_bytes"].as_u64().unwrap() + metadata["part_bytes"].as_u64().unwrap();
    assert!(
        metadata["plan_bytes_read"].as_u64().unwrap() >= least,
        "{metadata}"
    );
    assert!(report["zstd"].as_array().unwrap().is_empty());
}

#[test]
fn bench_without_a_url_is_a_usage_error() {
    let output = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["bench", "--reps", "1"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
}

/// The control plane at the smoke size: 128 simulated nodes of 8 ranks against a
/// real coordinator process. Every rank gets the generation, and after a node goes
/// silent every survivor gets the next one, without the lost node's ranks.
#[test]
fn the_control_plane_bench_forms_1024_ranks_and_reforms_without_a_silent_node() {
    let output = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args([
            "bench",
            "control-plane",
            "--nodes",
            "128",
            "--ranks-per-node",
            "8",
        ])
        .args(["--backend", "tcp", "--steady-secs", "2"])
        .args(["--heartbeat-timeout-secs", "2", "--json"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "ckpt bench control-plane failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["ranks"], 1024, "{report:#}");
    assert_eq!(report["members_with_generation"], 1024, "{report:#}");
    assert_eq!(report["survivors_with_generation"], 1016, "{report:#}");
    let keys = [
        "form_ms",
        "detect_ms",
        "reform_ms",
        "messages_per_s",
        "coordinator_rss_mib",
    ];
    assert_positive(&report, "", keys.iter());
    // An idle coordinator may use no whole clock tick in a short window.
    let cores = report["coordinator_cores"].as_f64().unwrap();
    assert!(cores >= 0.0 && cores.is_finite(), "{report:#}");
    assert!(report["etcd_writes_per_s"].is_null(), "{report:#}");
    // The simulated ranks are answered by one thread per core (at most 16), not one
    // for all: the figures must not be one thread's pace.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(
        report["answering_threads"],
        cores.clamp(1, 16),
        "{report:#}"
    );
}

/// The store flags reach the bench and, passed on, its rank processes.
#[test]
fn bench_takes_store_settings_and_timeouts_and_passes_them_to_its_ranks() {
    let report = bench_json(&[
        "-o",
        "retries=0",
        "-o",
        "part_size=8MiB",
        "--request-timeout",
        "30",
        "--connect-timeout",
        "2",
        "--ranks-as",
        "processes",
        "--ranks",
        "2",
        "--reshard-ranks",
        "2",
        "--tensors",
        "2",
        "--rows",
        "32",
        "--cols",
        "16",
        "--reps",
        "1",
        "--raw-mib",
        "1",
        "--meta-tensors",
        "0",
        "--no-zstd",
    ]);
    assert_eq!(report["processes"]["ranks"].as_u64(), Some(2), "{report}");
}
