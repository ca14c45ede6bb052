//! `ckpt bench --coop-ranks` at 16 simulated ranks: a cooperative resume lists the
//! commit log once for the whole job and reads each needed byte from the store once,
//! where plain loads list once per rank and read a shard once per replica.

use std::process::Command;

fn coop_json(ranks: usize, replicas: usize) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let output = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["bench", "--url", &url, "--json", "--metadata-only"])
        .args(["--meta-tensors", "0", "--coop-tensors", "4"])
        .args(["--coop-ranks", &ranks.to_string()])
        .args(["--coop-replicas", &replicas.to_string()])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "ckpt bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn u(value: &serde_json::Value) -> u64 {
    value
        .as_u64()
        .unwrap_or_else(|| panic!("not a count: {value}"))
}

#[test]
fn sixteen_cooperative_ranks_list_once_and_read_each_byte_once() {
    let report = coop_json(16, 4);
    let runs = report["cooperative_scale"].as_array().unwrap();
    let layouts: Vec<&str> = runs.iter().map(|r| r["layout"].as_str().unwrap()).collect();
    assert_eq!(layouts, ["fsdp", "hsdp", "ddp"]);
    for run in runs {
        let layout = run["layout"].as_str().unwrap();
        let (plain, coop) = (&run["plain"], &run["cooperative"]);
        let replicas = u(&run["replicas"]);
        let saved = u(&run["saved_ranks"]);
        assert_eq!(u(&run["ranks"]), 16, "{layout}");
        assert_eq!(saved * replicas, 16, "{layout}");
        assert_eq!(u(&coop["store_requests"]["LIST"]), 1, "{layout}: {run}");
        assert_eq!(u(&plain["store_requests"]["LIST"]), 16, "{layout}: {run}");
        // Each shard's whole data file is needed (every chunk of it is loaded):
        // the union is every file, read once together and once per replica alone.
        // (4 tensors of 4096 x 1024 fp32, a 4 KiB header per file.)
        let unique = u(&run["unique_bytes"]);
        assert_eq!(
            unique,
            saved * 4096 + 4 * 4096 * 1024 * 4,
            "{layout}: {run}"
        );
        assert_eq!(u(&coop["data_bytes"]), unique, "{layout}: {run}");
        assert_eq!(
            u(&plain["data_bytes"]),
            unique * replicas,
            "{layout}: {run}"
        );
        // Rank 0 opens the checkpoint and reads every part (a HEAD and a GET
        // each); the owners read at least one batch each.
        let open = &run["open_requests"];
        assert_eq!(
            u(&coop["store_requests"]["HEAD"]),
            u(&open["HEAD"]) + saved,
            "{layout}: {run}"
        );
        assert!(
            u(&coop["store_requests"]["GET"]) > u(&open["GET"]) + saved,
            "{layout}: {run}"
        );
        assert!(
            u(&plain["store_requests"]["GET"]) > u(&coop["store_requests"]["GET"]),
            "{layout}: {run}"
        );
    }
}

#[test]
fn every_load_of_the_bench_reports_its_store_bytes_and_requests() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let output = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["bench", "--url", &url, "--json", "--ranks", "2"])
        .args(["--reshard-ranks", "3", "--tensors", "2", "--rows", "256"])
        .args(["--cols", "64", "--reps", "1", "--raw-mib", "1", "--no-zstd"])
        .args(["--meta-tensors", "0", "--no-direct"])
        .args(["--ranks-as", "both"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "ckpt bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let (threads, processes) = (&report["load_breakdown"], &report["processes"]);
    for (b, load, ranks) in [
        (&threads["same_size"], "same_size", 2),
        (&threads["resharded"], "resharded", 3),
        (&threads["allocating"], "allocating", 2),
        (&processes["load"], "processes: load", 2),
        (&processes["reshard_load"], "processes: reshard_load", 3),
    ] {
        let read = u(&b["bytes_read_from_store"]);
        assert!(read > 0, "{load}: {b}");
        assert_eq!(u(&b["bytes_received_from_peers"]), 0, "{load}: {b}");
        assert_eq!(u(&b["unique_bytes"]), read, "{load}: {b}");
        // Each rank lists the commit log once and reads the manifest.
        assert_eq!(u(&b["store_requests"]["LIST"]), ranks, "{load}: {b}");
        assert!(u(&b["store_requests"]["GET"]) >= ranks, "{load}: {b}");
        assert!(b["store_requests"]["HEAD"].is_u64(), "{load}: {b}");
    }
}
