//! The `ckpt` binary, run as a user would, on checkpoints the library makes here:
//! every command, its JSON, its exit codes, corrupt inputs, reshard round trips, and
//! export read back by the Python `safetensors` package.

use ckpt_testkit::{self as common, Capability};

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ckpt::storage::Store;
use ckpt::{CheckpointConfig, CheckpointReader, Checkpointer, LoadRequest};
use common::*;
use serde_json::Value;

const ROWS: u64 = 64;

fn ckpt(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run the ckpt binary")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("exit code")
}

fn json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", stdout(output), stderr(output)))
}

/// A local root with committed steps 1 and 2 (4 ranks) and a partial step 3 (rank 0
/// only).
async fn local_root() -> (Store, tempfile::TempDir, String) {
    let (store, dir) = local_store("cli");
    for step in [1, 2] {
        save_world(&store, step, 4, &model(step, ROWS), |_| {}).await;
    }
    let tensors = model(3, ROWS);
    let checkpointer = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 4)).unwrap();
    let state = dim0_state(&tensors, 3, 0, 4);
    let handle = checkpointer.save(3, &state).await.unwrap();
    handle.durable().await.unwrap();
    let url = format!("file://{}", dir.path().display());
    (store, dir, url)
}

fn data_file(dir: &Path, step: u64, rank: u32) -> PathBuf {
    dir.join(step_dir(step))
        .join(rank_file_name_in(dir, step, rank))
}

/// The key of a data file, as error messages name it.
fn data_key(dir: &Path, step: u64, rank: u32) -> String {
    format!("{}/{}", step_dir(step), rank_file_name_in(dir, step, rank))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ls_shows_committed_partial_missing_ranks_and_latest() {
    let (_store, _dir, url) = local_root().await;
    let out = ckpt(&["ls", &url]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("STEP"), "{text}");
    let latest_line = text
        .lines()
        .find(|l| l.starts_with('*'))
        .expect("a latest mark");
    assert!(latest_line.contains(" 2 "), "{text}");
    assert!(text.contains("partial"), "{text}");
    assert!(text.contains("missing ranks 1-3"), "{text}");

    let out = ckpt(&["ls", &url, "--json"]);
    let listed = json(&out);
    let checkpoints = listed["checkpoints"].as_array().unwrap();
    assert_eq!(checkpoints.len(), 3);
    assert_eq!(checkpoints[1]["status"], "committed");
    assert_eq!(checkpoints[1]["latest"], true);
    assert_eq!(checkpoints[1]["world_size"], 4);
    assert_eq!(checkpoints[1]["tensors"], 3);
    assert_eq!(checkpoints[2]["status"], "partial");
    assert_eq!(
        checkpoints[2]["missing_ranks"],
        serde_json::json!([1, 2, 3])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_describes_tensors_ranks_and_filters() {
    let (_store, _dir, url) = local_root().await;
    let out = ckpt(&["inspect", &url, "--tensors", "--ranks", "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let view = json(&out);
    assert_eq!(view["step"], 2);
    assert_eq!(view["world_size"], 4);
    assert_eq!(view["format_version"], ckpt::format::HEALTH_VERSION);
    assert_eq!(view["healthy"], true);
    assert_eq!(view["tensors"].as_array().unwrap().len(), 3);
    let weight = view["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "layers.0.weight")
        .unwrap();
    assert_eq!(weight["dtype"], "F32");
    assert_eq!(weight["shape"], serde_json::json!([ROWS, 256]));
    assert_eq!(weight["chunks"].as_array().unwrap().len(), 4);
    assert_eq!(weight["chunks"][1]["offsets"], serde_json::json!([16, 0]));
    assert_eq!(view["ranks"].as_array().unwrap().len(), 4);
    assert_eq!(
        view["ranks"][3]["rank_state"],
        serde_json::json!(["cursor"])
    );

    let out = ckpt(&[
        "inspect",
        &url,
        "--step",
        "1",
        "--tensors",
        "--filter",
        "layers.*",
        "--json",
    ]);
    let view = json(&out);
    assert_eq!(view["step"], 1);
    assert_eq!(view["tensors"].as_array().unwrap().len(), 2);

    let out = ckpt(&["inspect", &url, "--tensors"]);
    assert!(stdout(&out).contains("layers.0.weight"), "{}", stdout(&out));
    assert!(stdout(&out).contains("world size   4"), "{}", stdout(&out));

    let out = ckpt(&["inspect", &url, "--step", "3"]);
    assert_eq!(code(&out), 3, "a partial step is not a checkpoint");
    assert!(stderr(&out).contains("step 3"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_passes_then_names_file_tensor_and_offset_of_a_bit_flip() {
    let (_store, dir, url) = local_root().await;
    let out = ckpt(&["verify", &url, "--all"]);
    assert_eq!(code(&out), 0, "{}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains("step 1: ok"), "{}", stdout(&out));
    assert!(stdout(&out).contains("step 2: ok"), "{}", stdout(&out));

    let path = data_file(dir.path(), 2, 2);
    let flipped = data_key(dir.path(), 2, 2);
    let mut bytes = std::fs::read(&path).unwrap();
    let offset = bytes.len() - 100;
    bytes[offset] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();

    let out = ckpt(&["verify", &url]);
    assert_eq!(code(&out), 1, "{}", stdout(&out));
    let text = stdout(&out);
    assert!(text.contains(&format!("{flipped} at byte")), "{text}");
    assert!(text.contains("CRC32"), "{text}");

    let out = ckpt(&["verify", &url, "--json"]);
    assert_eq!(code(&out), 1);
    let report = json(&out);
    assert_eq!(report["ok"], false);
    let fault = &report["checkpoints"][0]["faults"][0];
    assert_eq!(fault["object"], flipped.as_str());
    assert!(fault["offset"].as_u64().unwrap() <= offset as u64);
    let named = fault["tensors"].to_string();
    assert!(
        named.contains("embed"),
        "the last tensor holds the flipped byte: {named}"
    );
    // Step 1 is untouched.
    assert_eq!(code(&ckpt(&["verify", &url, "--step", "1"])), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reports_truncated_missing_and_escaping_files() {
    let (store, dir, url) = local_root().await;
    let (truncated_key, missing_key) = (data_key(dir.path(), 2, 1), data_key(dir.path(), 2, 3));
    let truncated = data_file(dir.path(), 2, 1);
    let bytes = std::fs::read(&truncated).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    std::fs::remove_file(data_file(dir.path(), 2, 3)).unwrap();
    let out = ckpt(&["verify", &url, "--json"]);
    assert_eq!(code(&out), 1);
    let faults = json(&out)["checkpoints"][0]["faults"].clone();
    let text = faults.to_string();
    assert!(text.contains(&truncated_key), "{text}");
    assert!(text.contains("bytes stored, the part records"), "{text}");
    assert!(text.contains(&missing_key), "{text}");
    assert!(text.contains("missing"), "{text}");

    // A manifest naming a file outside the checkpoint, with a valid checksum.
    let key = &format!("{}/manifest.json", step_dir(1));
    let mut manifest = ckpt::format::Manifest::parse(&store.get(key).await.unwrap(), key).unwrap();
    manifest.ranks[0].file = "../step-00000002/rank-00000.safetensors".to_string();
    store.put(key, manifest.to_bytes()).await.unwrap();
    let out = ckpt(&["verify", &url, "--step", "1"]);
    assert_eq!(code(&out), 1);
    assert!(
        stdout(&out).contains("must not contain '..'"),
        "{}",
        stdout(&out)
    );
    // Commands that load refuse it as corrupt (exit 4), in one sentence.
    let out = ckpt(&["inspect", &url, "--step", "1"]);
    assert_eq!(code(&out), 4, "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with(&format!("error: corrupt checkpoint: {key}")),
        "{}",
        stderr(&out)
    );
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshard_4_to_3_to_5_is_identical_to_the_original() {
    let (_store, dir, url) = local_root().await;
    let three = dir.path().join("three");
    let five = dir.path().join("five");
    let (three_url, five_url) = (
        format!("file://{}", three.display()),
        format!("file://{}", five.display()),
    );
    let out = ckpt(&["reshard", &url, &three_url, "--world-size", "3"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stdout(&out).contains("from 4 to 3 ranks"),
        "{}",
        stdout(&out)
    );
    let out = ckpt(&[
        "reshard",
        &three_url,
        &five_url,
        "--world-size",
        "5",
        "--json",
        "--memory-budget",
        "16KiB",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["to_world_size"], 5);

    let out = ckpt(&["diff", &url, &five_url]);
    assert_eq!(code(&out), 0, "{}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains("identical"), "{}", stdout(&out));
    let out = ckpt(&["verify", &five_url]);
    assert_eq!(code(&out), 0, "{}", stdout(&out));

    // The library sees 5 ranks and the original values.
    let store = Store::from_url(&five_url).unwrap();
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    assert_eq!(reader.manifest().world_size, 5);
    assert_loads(&reader, &model(2, ROWS)).await;
    // Per-rank state of the 4 saved ranks survives the world-size change.
    let global = reader.global_state().await.unwrap();
    let kept = global["ckpt.source_rank_states"].as_json().unwrap();
    assert_eq!(kept["world_size"], 4);
    assert_eq!(kept["ranks"].as_array().unwrap().len(), 4);

    // Resharding onto an existing commit is refused.
    let out = ckpt(&["reshard", &url, &five_url, "--world-size", "2"]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshard_with_a_layout_file_splits_columns() {
    let (_store, dir, url) = local_root().await;
    let layout = dir.path().join("tp.json");
    std::fs::write(
        &layout,
        serde_json::json!({
            "world_size": 2,
            "default": "replicate",
            "tensors": {"layers.0.weight": [
                {"rank": 0, "offsets": [0, 0], "lengths": [ROWS, 128]},
                {"rank": 1, "offsets": [0, 128], "lengths": [ROWS, 128]}
            ]}
        })
        .to_string(),
    )
    .unwrap();
    let tp = format!("file://{}", dir.path().join("tp").display());
    let out = ckpt(&["reshard", &url, &tp, "--layout", layout.to_str().unwrap()]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let view = json(&ckpt(&["inspect", &tp, "--tensors", "--json"]));
    let weight = view["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "layers.0.weight")
        .unwrap()
        .clone();
    assert_eq!(weight["layout"], "boxes");
    assert_eq!(weight["chunks"][1]["offsets"], serde_json::json!([0, 128]));
    assert_eq!(code(&ckpt(&["diff", &url, &tp])), 0);

    // A layout that leaves a gap is refused before anything is written.
    std::fs::write(
        &layout,
        serde_json::json!({"world_size": 2, "tensors": {"layers.0.weight": [
            {"rank": 0, "offsets": [0, 0], "lengths": [ROWS, 100]}]}})
        .to_string(),
    )
    .unwrap();
    let bad = format!("file://{}", dir.path().join("bad").display());
    let out = ckpt(&["reshard", &url, &bad, "--layout", layout.to_str().unwrap()]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("tile the tensor"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diff_reports_differences_and_honours_tolerances() {
    let (store, dir, url) = local_root().await;
    let out = ckpt(&[
        "diff", &url, &url, "--step-a", "1", "--step-b", "2", "--json",
    ]);
    assert_eq!(code(&out), 1);
    let report = json(&out);
    assert_eq!(report["identical"], false);
    let weight = report["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "layers.0.weight")
        .unwrap()
        .clone();
    assert_eq!(weight["status"], "different");
    assert!(weight["differing"].as_u64().unwrap() > 0);
    assert!(weight["max_abs"].as_f64().unwrap() > 0.0);
    assert!(
        report["state_differences"]
            .to_string()
            .contains("global state")
    );

    // A copy with one element nudged: different bitwise, equal within --atol.
    let mut tensors = model(2, ROWS);
    tensors[0].data[5] += 1e-3;
    let (other, _other_dir) = local_store("cli-nudged");
    save_world(&other, 2, 2, &tensors, |_| {}).await;
    let other_url = other.url().to_string();
    let out = ckpt(&["diff", &url, &other_url]);
    assert_eq!(code(&out), 1, "{}", stdout(&out));
    assert!(stdout(&out).contains("layers.0.weight"), "{}", stdout(&out));
    let out = ckpt(&["diff", &url, &other_url, "--atol", "0.01"]);
    assert_eq!(code(&out), 0, "{}", stdout(&out));
    assert!(
        stdout(&out).contains("within tolerance"),
        "{}",
        stdout(&out)
    );
    drop((store, dir));
}

/// The Python of the test servers' virtual environment, with safetensors and numpy.
fn python() -> String {
    env("CKPT_TEST_PYTHON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_is_read_by_python_safetensors_with_equal_values() {
    if !common::has(Capability::Python) {
        return;
    }
    let (_store, dir, url) = local_root().await;
    let out_file = dir.path().join("model.safetensors");
    let out = ckpt(&["export", &url, out_file.to_str().unwrap(), "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["tensors"], 3);
    let half = dir.path().join("model-f16.safetensors");
    let out = ckpt(&[
        "export",
        &url,
        half.to_str().unwrap(),
        "--dtype",
        "f16",
        "--tensors",
        "layers.*",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    // The expected values, as raw little-endian f32 files next to the exports.
    let tensors = model(2, ROWS);
    for t in &tensors {
        std::fs::write(
            dir.path().join(format!("{}.f32", t.name)),
            ckpt::as_bytes(&t.data),
        )
        .unwrap();
    }
    let script = r#"
import sys, numpy as np
from safetensors.numpy import load_file
d = sys.argv[1]
full = load_file(d + "/model.safetensors")
half = load_file(d + "/model-f16.safetensors")
assert sorted(full) == ["embed", "layers.0.bias", "layers.0.weight"], sorted(full)
assert sorted(half) == ["layers.0.bias", "layers.0.weight"], sorted(half)
for name, value in full.items():
    expected = np.fromfile(d + "/" + name + ".f32", dtype="<f4").reshape(value.shape)
    assert value.dtype == np.float32, value.dtype
    assert np.array_equal(value, expected), name
for name, value in half.items():
    expected = np.fromfile(d + "/" + name + ".f32", dtype="<f4").reshape(value.shape)
    assert value.dtype == np.float16, value.dtype
    assert np.array_equal(value, expected.astype(np.float16)), name
print("python-ok", full["layers.0.weight"].shape)
"#;
    let out = Command::new(python())
        .args(["-c", script, dir.path().to_str().unwrap()])
        .output()
        .expect("run python");
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stdout(&out).contains(&format!("python-ok ({ROWS}, 256)")),
        "{}",
        stdout(&out)
    );

    // bf16 (numpy has no bf16): the Rust reference reader checks the conversion.
    let bf = dir.path().join("model-bf16.safetensors");
    assert_eq!(
        code(&ckpt(&[
            "export",
            &url,
            bf.to_str().unwrap(),
            "--dtype",
            "bf16"
        ])),
        0
    );
    let bytes = std::fs::read(&bf).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = file.tensor("layers.0.weight").unwrap();
    assert_eq!(view.dtype(), safetensors::Dtype::BF16);
    for (i, pair) in view.data().chunks_exact(2).enumerate().take(1000) {
        let value = f32::from_bits(u32::from(u16::from_le_bytes([pair[0], pair[1]])) << 16);
        let exact = tensors[0].data[i];
        // bf16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of it.
        assert!(
            (value - exact).abs() <= exact.abs() / 256.0,
            "element {i}: {value} vs {exact}"
        );
    }

    let out = ckpt(&[
        "export",
        &url,
        bf.to_str().unwrap(),
        "--tensors",
        "nothing*",
    ]);
    assert_eq!(code(&out), 3);
    let out = ckpt(&["export", &url, bf.to_str().unwrap(), "--dtype", "int8"]);
    assert_eq!(code(&out), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_then_export_round_trips_bitwise() {
    let (_store, dir, url) = local_root().await;
    let original = dir.path().join("original.safetensors");
    assert_eq!(
        code(&ckpt(&["export", &url, original.to_str().unwrap()])),
        0
    );
    let imported = format!("file://{}", dir.path().join("imported").display());
    let out = ckpt(&[
        "import",
        original.to_str().unwrap(),
        &imported,
        "--world-size",
        "3",
        "--step",
        "2",
        "--zstd",
        "3",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stdout(&out).contains("over 3 ranks"), "{}", stdout(&out));
    let again = dir.path().join("again.safetensors");
    assert_eq!(
        code(&ckpt(&["export", &imported, again.to_str().unwrap()])),
        0
    );
    assert_eq!(
        std::fs::read(&original).unwrap(),
        std::fs::read(&again).unwrap()
    );
    let out = ckpt(&["verify", &imported, "--json"]);
    assert_eq!(code(&out), 0, "{}", stdout(&out));
    let view = json(&ckpt(&["inspect", &imported, "--json"]));
    assert_eq!(view["world_size"], 3);
    assert_eq!(view["compression"], "zstd-3");

    // A hostile input file: an absurd header length is refused, not allocated.
    let hostile = dir.path().join("hostile.safetensors");
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&hostile, bytes).unwrap();
    let out = ckpt(&[
        "import",
        hostile.to_str().unwrap(),
        &format!("{imported}-x"),
        "--world-size",
        "2",
    ]);
    assert_eq!(code(&out), 4, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("hostile.safetensors"),
        "{}",
        stderr(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_keeps_the_newest_and_removes_the_rest_after_the_grace() {
    let (store, _dir, url) = local_root().await;
    save_world(&store, 4, 4, &model(4, ROWS), |_| {}).await;
    // Within the default grace nothing superseded a moment ago is removed.
    let out = ckpt(&["gc", &url, "--keep", "1", "--dry-run", "--json"]);
    assert_eq!(code(&out), 0);
    assert_eq!(json(&out)["plan"]["remove"].as_array().unwrap().len(), 0);
    let out = ckpt(&["gc", &url, "--keep", "1", "--grace", "0", "--dry-run"]);
    assert!(
        stdout(&out).contains("would remove step 1"),
        "{}",
        stdout(&out)
    );
    assert!(
        stdout(&out).contains("would remove step 3"),
        "{}",
        stdout(&out)
    );
    assert_eq!(steps(&store).await.len(), 4, "dry run removes nothing");
    let out = ckpt(&["gc", &url, "--keep", "2", "--grace", "0"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(steps(&store).await, vec![(2, true), (4, true)]);
    assert_eq!(code(&ckpt(&["gc", &url, "--keep", "0"])), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_one_sentence_with_documented_exit_codes() {
    let empty = tempfile::tempdir().unwrap();
    let empty_url = format!("file://{}", empty.path().display());
    let cases: Vec<(Vec<String>, i32, &str)> = vec![
        (
            vec!["ls".into(), "ftp://host/x".into()],
            2,
            "unknown scheme",
        ),
        (
            vec!["inspect".into(), empty_url.clone()],
            3,
            "no committed checkpoint",
        ),
        (
            vec![
                "verify".into(),
                empty_url.clone(),
                "--step".into(),
                "7".into(),
            ],
            3,
            "step 7",
        ),
        (
            // Nothing listens on port 1 of loopback.
            vec![
                "ls".into(),
                "s3://bucket/x".into(),
                "-o".into(),
                "aws_endpoint=http://127.0.0.1:1".into(),
                "-o".into(),
                "aws_allow_http=true".into(),
                "-o".into(),
                "aws_access_key_id=a".into(),
                "-o".into(),
                "aws_secret_access_key=b".into(),
                "-o".into(),
                "aws_region=us-east-1".into(),
                "--retries".into(),
                "0".into(),
            ],
            5,
            "unreachable",
        ),
    ];
    for (args, expected, words) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = ckpt(&args);
        assert_eq!(code(&out), expected, "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(err.contains(words), "{args:?}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: one sentence, no backtrace: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_to_a_full_disk_is_one_clear_error() {
    let (_store, dir, url) = local_root().await;
    let small = dir.path().join("small-fs");
    std::fs::create_dir_all(&small).unwrap();
    let mounted = Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            "size=64k",
            "tmpfs",
            small.to_str().unwrap(),
        ])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    let missing = (!mounted).then(|| "cannot mount a small tmpfs here".to_string());
    if !common::has_probed(Capability::Root, missing) {
        return;
    }
    let out = ckpt(&[
        "export",
        &url,
        small.join("model.safetensors").to_str().unwrap(),
    ]);
    let _ = Command::new("umount").arg(&small).status();
    assert_eq!(code(&out), 5, "{}", stderr(&out));
    assert!(stderr(&out).contains("No space left"), "{}", stderr(&out));
    assert_eq!(
        stderr(&out).trim_end().lines().count(),
        1,
        "{}",
        stderr(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_work_on_the_s3_server() {
    if !common::has(Capability::Servers) {
        return;
    }
    let store = s3_store("cli");
    save_world(&store, 5, 4, &model(5, ROWS), |_| {}).await;
    let endpoint = env("CKPT_TEST_S3_ENDPOINT");
    let options = [
        "-o".to_string(),
        format!("aws_endpoint={endpoint}"),
        "-o".into(),
        "aws_allow_http=true".into(),
        "-o".into(),
        "aws_region=us-east-1".into(),
        "-o".into(),
        "aws_access_key_id=test".into(),
        "-o".into(),
        "aws_secret_access_key=test".into(),
    ];
    let run = |args: &[&str]| {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(options.iter().map(String::as_str));
        ckpt(&all)
    };
    let url = store.url().to_string();
    let out = run(&["ls", &url, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["checkpoints"][0]["status"], "committed");
    assert_eq!(code(&run(&["verify", &url])), 0);
    assert_eq!(json(&run(&["inspect", &url, "--json"]))["world_size"], 4);
    let resharded = format!("{url}-3");
    let out = run(&["reshard", &url, &resharded, "--world-size", "3"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let out = run(&["diff", &url, &resharded]);
    assert_eq!(code(&out), 0, "{}{}", stdout(&out), stderr(&out));
    let out_dir = tempfile::tempdir().unwrap();
    let file = out_dir.path().join("m.safetensors");
    assert_eq!(
        code(&run(&["export", &resharded, file.to_str().unwrap()])),
        0
    );
    let imported = format!("{url}-imported");
    assert_eq!(
        code(&run(&[
            "import",
            file.to_str().unwrap(),
            &imported,
            "--world-size",
            "2",
            "--step",
            "5"
        ])),
        0
    );
    // Tensors survive export and import bitwise; non-tensor state does not travel
    // through a safetensors file, and diff says so.
    let out = run(&["diff", &url, &imported, "--json"]);
    assert_eq!(code(&out), 1);
    let report = json(&out);
    assert!(
        report["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["status"] == "identical"),
        "{report}"
    );
    assert!(
        report["state_differences"]
            .to_string()
            .contains("only in A"),
        "{report}"
    );
    assert_eq!(code(&run(&["gc", &url, "--keep", "1", "--grace", "0"])), 0);

    // The library loads what the CLI wrote on S3.
    let reader = CheckpointReader::open(
        &Store::open(&resharded, s3_config(&endpoint, test_config())).unwrap(),
        None,
    )
    .await
    .unwrap();
    let loaded = reader
        .load(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap();
    assert_same(&loaded.tensors, &model(5, ROWS));
}

#[test]
fn every_command_has_help_with_an_example() {
    for command in [
        "probe", "ls", "inspect", "verify", "diff", "reshard", "export", "import", "gc",
    ] {
        let out = ckpt(&[command, "--help"]);
        assert_eq!(code(&out), 0, "{command}");
        assert!(
            stdout(&out).contains("Example:"),
            "{command} --help lacks an example"
        );
        assert!(
            stdout(&out).contains(&format!("ckpt {command}")),
            "{command} --help example"
        );
    }
}

/// Runs `ckpt args`, reads one line of its output, then closes the pipe while the
/// command still has much more to write (more than a pipe holds, so it is blocked
/// writing when the pipe closes). Returns its status, that line and its stderr.
fn ckpt_with_stdout_closed_early(args: &[&str]) -> (std::process::ExitStatus, String, String) {
    use std::io::{BufRead, Read};
    let mut child = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the ckpt binary");
    let mut first = String::new();
    {
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        out.read_line(&mut first).expect("first line");
    }
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    (child.wait().expect("wait"), first, err)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_output_pipe_stops_a_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let (store, dir) = local_store("pipe");
    // Enough tensors that the listings run to megabytes: far more than a pipe holds.
    let tensors: Vec<Tensor> = (0..5000)
        .map(|i| Tensor::new(&format!("block.{i:05}.scale"), &[2], i))
        .collect();
    save_world(&store, 1, 1, &tensors, |_| {}).await;
    let url = format!("file://{}", dir.path().display());
    for args in [
        vec!["inspect", &url, "--tensors", "--json"],
        vec!["inspect", &url, "--tensors"],
    ] {
        let (status, first, err) = ckpt_with_stdout_closed_early(&args);
        assert!(!first.is_empty(), "{args:?} printed nothing: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(err, "", "{args:?} stops without a word");
        // As Unix tools do: ended by SIGPIPE (a shell shows status 141).
        assert_eq!(status.signal(), Some(13), "{args:?}: {status:?}");
    }
    // With the reader kept open the same command runs to its end.
    let out = ckpt(&["inspect", &url, "--tensors", "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["tensors"].as_array().unwrap().len(), 5000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_counts_missing_rank_parts_in_one_fault() {
    use ckpt::format::{Layout, Manifest, rank_file_name, rank_part_name};
    const WORLD: u32 = 1 << 20;
    let (store, dir) = local_store("wide");
    save_world(&store, 1, 4, &model(1, ROWS), |_| {}).await;
    // A self-consistent manifest that lists the most ranks the format allows, of
    // which only the 4 saved ones have parts.
    let key = &format!("{}/manifest.json", step_dir(1));
    let mut manifest = Manifest::parse(&store.get(key).await.unwrap(), key).unwrap();
    let template = manifest.ranks[3].clone();
    manifest.ranks.extend((4..WORLD).map(|rank| {
        let mut entry = template.clone();
        entry.rank = rank;
        entry.part = rank_part_name(rank);
        entry.file = rank_file_name(rank, false);
        entry
    }));
    manifest.world_size = WORLD;
    for layout in &mut manifest.layouts {
        if let Layout::Dim0(bounds) = layout {
            let rows = *bounds.last().unwrap();
            bounds.resize(WORLD as usize + 1, rows);
        }
    }
    store.put(key, manifest.to_bytes()).await.unwrap();
    drop(manifest);
    let url = format!("file://{}", dir.path().display());

    let out = ckpt(&["verify", &url]);
    assert_eq!(code(&out), 1, "{}", stderr(&out));
    let text = stdout(&out);
    // One line for the missing ranks, and at most one for each of the 4 parts
    // present (their world size disagrees with this hostile manifest too).
    assert!(
        text.lines().count() <= 6 + 4,
        "one fault, not one per rank: {} lines, starting {:?}",
        text.lines().count(),
        text.lines().take(4).collect::<Vec<_>>()
    );
    let missing = WORLD - 4;
    assert!(
        text.contains(&format!("{missing} of {WORLD} rank parts are missing")),
        "{text}"
    );
    assert!(text.contains("ranks 4, 5, 6, 7, 8"), "{text}");

    let out = ckpt(&["verify", &url, "--json"]);
    assert_eq!(code(&out), 1);
    let faults = json(&out)["checkpoints"][0]["faults"].clone();
    let missing_faults: Vec<_> = faults
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| {
            f["message"]
                .as_str()
                .unwrap()
                .contains("rank parts are missing")
        })
        .collect();
    assert_eq!(missing_faults.len(), 1, "{faults}");
    assert_eq!(missing_faults[0]["object"], key.as_str());
    assert!(faults.as_array().unwrap().len() <= 5, "{faults}");
}

/// Replaces the safetensors header of rank `rank`'s data file of `step` with
/// `header` (length prefix and JSON, as a hostile writer would), keeps the data, and
/// recomputes every checksum that vouches for the file (block CRCs, part, manifest),
/// so that only the header is wrong.
async fn replace_data_header(store: &Store, step: u64, rank: usize, header: Vec<u8>) {
    use ckpt::format::{Manifest, RankPart};
    let manifest_key = format!("{}/manifest.json", step_dir(step));
    let mut manifest =
        Manifest::parse(&store.get(&manifest_key).await.unwrap(), &manifest_key).unwrap();
    let entry = &mut manifest.ranks[rank];
    let part_key = format!("{}/{}", step_dir(step), entry.part);
    let mut part = RankPart::parse(&store.get(&part_key).await.unwrap(), &part_key).unwrap();
    assert_eq!(part.codec, ckpt::Codec::None, "the test rewrites raw files");
    let data_key = format!("{}/{}", step_dir(step), part.file.name);
    let old = store.get(&data_key).await.unwrap();
    let old_start = 8 + u64::from_le_bytes(old[..8].try_into().unwrap());
    let new_start = header.len() as u64;
    let mut data = header;
    data.extend_from_slice(&old[old_start as usize..]);
    for chunk in &mut part.chunks {
        chunk.bytes = chunk.bytes.map(|b| b - old_start + new_start);
    }
    part.file.raw_bytes = data.len() as u64;
    part.file.stored_bytes = data.len() as u64;
    part.file.block_crc32 = data
        .chunks(part.block_size as usize)
        .map(crc32fast::hash)
        .collect();
    let part_bytes = part.to_bytes();
    entry.part_bytes = part_bytes.len() as u64;
    entry.part_crc32 = crc32fast::hash(&part_bytes);
    entry.raw_bytes = data.len() as u64;
    entry.stored_bytes = data.len() as u64;
    store.put(&data_key, data).await.unwrap();
    store.put(&part_key, part_bytes).await.unwrap();
    store.put(&manifest_key, manifest.to_bytes()).await.unwrap();
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flat_map(|e| {
            let path = e.unwrap().path();
            if path.is_dir() {
                files_under(&path)
            } else {
                vec![path]
            }
        })
        .collect()
}

/// The command failed as corrupt (exit 4) with one sentence naming `object`, a byte
/// offset in it, and `words`.
fn assert_corrupt_at(out: &Output, object: &str, words: &str, context: &str) {
    let err = stderr(out);
    assert_eq!(code(out), 4, "{context}: {err}");
    assert!(
        err.starts_with(&format!("error: corrupt checkpoint: {object} at byte ")),
        "{context}: {err}"
    );
    assert!(err.contains(words), "{context}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{context}: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_and_reshard_refuse_a_data_file_whose_header_is_broken() {
    // Each hostile header, made from the original one (length prefix and JSON).
    type Breaker = fn(&[u8]) -> Vec<u8>;
    let cases: [(&str, Breaker, &str); 3] = [
        (
            "a header length of 2^64-1",
            |old| [&u64::MAX.to_le_bytes()[..], &old[8..]].concat(),
            "header length",
        ),
        (
            "a dtype changed",
            |old| {
                let text = String::from_utf8(old[8..].to_vec()).unwrap();
                assert!(text.contains("\"F32\""), "{text}");
                let json = text.replacen("\"F32\"", "\"I32\"", 1);
                [&old[..8], json.as_bytes()].concat()
            },
            "disagrees with the part",
        ),
        (
            "100k nested brackets",
            |_| {
                let json = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
                [&(json.len() as u64).to_le_bytes()[..], json.as_bytes()].concat()
            },
            "invalid header JSON",
        ),
    ];
    for (what, breaker, words) in cases {
        let (store, dir) = local_store("header");
        save_world(&store, 1, 2, &model(1, ROWS), |_| {}).await;
        let old = std::fs::read(data_file(dir.path(), 1, 1)).unwrap();
        let old_len = u64::from_le_bytes(old[..8].try_into().unwrap()) as usize;
        replace_data_header(&store, 1, 1, breaker(&old[..8 + old_len])).await;
        let url = format!("file://{}", dir.path().display());
        let object = &data_key(dir.path(), 1, 1);

        // verify rejects it: the reference the other commands must match.
        let out = ckpt(&["verify", &url]);
        assert_eq!(code(&out), 1, "{what}: {}", stdout(&out));
        assert!(stdout(&out).contains(object), "{what}: {}", stdout(&out));

        let exported = dir.path().join("out").join("model.safetensors");
        std::fs::create_dir_all(exported.parent().unwrap()).unwrap();
        let out = ckpt(&["export", &url, exported.to_str().unwrap()]);
        assert_corrupt_at(&out, object, words, &format!("{what}: export"));
        assert_eq!(
            files_under(exported.parent().unwrap()),
            Vec::<PathBuf>::new(),
            "{what}: export leaves nothing behind"
        );

        let resharded = dir.path().join("resharded");
        let out = ckpt(&[
            "reshard",
            &url,
            &format!("file://{}", resharded.display()),
            "--world-size",
            "3",
        ]);
        assert_corrupt_at(&out, object, words, &format!("{what}: reshard"));
        assert_eq!(
            files_under(&resharded),
            Vec::<PathBuf>::new(),
            "{what}: reshard writes nothing"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_sizes_that_disagree_with_the_parts_are_reported() {
    let (store, dir) = local_store("sizes");
    save_world(&store, 1, 2, &model(1, ROWS), |_| {}).await;
    let key = &format!("{}/manifest.json", step_dir(1));
    let mut manifest = ckpt::format::Manifest::parse(&store.get(key).await.unwrap(), key).unwrap();
    for entry in &mut manifest.ranks {
        entry.raw_bytes = 1 << 63;
        entry.stored_bytes = 1 << 63;
    }
    store.put(key, manifest.to_bytes()).await.unwrap();
    let url = format!("file://{}", dir.path().display());

    // inspect reads rank 0's part (global state), which disagrees: corrupt, named.
    let out = ckpt(&["inspect", &url, "--json"]);
    assert_eq!(code(&out), 4, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("rank-00000.json: raw_bytes"),
        "{}",
        stderr(&out)
    );
    // verify compares them with the parts and reports each rank.
    let out = ckpt(&["verify", &url, "--json"]);
    assert_eq!(code(&out), 1, "{}{}", stdout(&out), stderr(&out));
    let faults = json(&out)["checkpoints"][0]["faults"].to_string();
    assert!(faults.contains("rank-00000"), "{faults}");
    assert!(faults.contains("rank-00001"), "{faults}");
    // Commands that read the parts refuse the checkpoint as corrupt.
    let out = ckpt(&["inspect", &url, "--ranks"]);
    assert_eq!(code(&out), 4, "inspect --ranks: {}", stdout(&out));
    let exported = dir.path().join("model.safetensors");
    let out = ckpt(&["export", &url, exported.to_str().unwrap()]);
    assert_eq!(code(&out), 4, "export: {}", stderr(&out));
    assert!(!exported.exists());
    let resharded = dir.path().join("resharded");
    let out = ckpt(&[
        "reshard",
        &url,
        &format!("file://{}", resharded.display()),
        "--world-size",
        "3",
    ]);
    assert_eq!(code(&out), 4, "reshard: {}", stderr(&out));
    assert_eq!(files_under(&resharded), Vec::<PathBuf>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_element_and_scalar_tensors_round_trip_through_import_reshard_and_export() {
    use safetensors::tensor::TensorView;
    use safetensors::{Dtype, SafeTensors};
    let dir = tempfile::tempdir().unwrap();
    let weight = floats(12, 7);
    let bias = floats(3, 8);
    let scalar = [2.5f32];
    let tensors: Vec<(&str, Vec<usize>, &[f32])> = vec![
        ("empty_rows", vec![0, 5], &[]),
        ("empty_cols", vec![5, 0], &[]),
        ("scalar", vec![], &scalar),
        ("w", vec![4, 3], &weight),
        ("b", vec![3], &bias),
    ];
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, data)| {
            let view = TensorView::new(Dtype::F32, shape.clone(), ckpt::as_bytes(data)).unwrap();
            (name.to_string(), view)
        })
        .collect();
    let input = dir.path().join("input.safetensors");
    std::fs::write(&input, safetensors::serialize(views, None).unwrap()).unwrap();

    let imported = format!("file://{}", dir.path().join("imported").display());
    let out = ckpt(&[
        "import",
        input.to_str().unwrap(),
        &imported,
        "--world-size",
        "3",
        "--json",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["tensors"], 5);
    let view = json(&ckpt(&["inspect", &imported, "--tensors", "--json"]));
    assert_eq!(view["tensor_count"], 5, "{view}");
    let out = ckpt(&["verify", &imported]);
    assert_eq!(code(&out), 0, "{}", stdout(&out));
    let resharded = format!("file://{}", dir.path().join("resharded").display());
    let out = ckpt(&["reshard", &imported, &resharded, "--world-size", "2"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let out = ckpt(&["verify", &resharded]);
    assert_eq!(code(&out), 0, "{}", stdout(&out));

    for (root, file) in [(&imported, "a.safetensors"), (&resharded, "b.safetensors")] {
        let exported = dir.path().join(file);
        let out = ckpt(&["export", root, exported.to_str().unwrap()]);
        assert_eq!(code(&out), 0, "{root}: {}", stderr(&out));
        let bytes = std::fs::read(&exported).unwrap();
        let read = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(read.len(), tensors.len(), "{root}: {:?}", read.names());
        for (name, shape, data) in &tensors {
            let view = read
                .tensor(name)
                .unwrap_or_else(|e| panic!("{root}: {name}: {e}"));
            assert_eq!(view.dtype(), Dtype::F32, "{root}: {name}");
            assert_eq!(view.shape(), shape.as_slice(), "{root}: {name}");
            assert_eq!(view.data(), ckpt::as_bytes(data), "{root}: {name}");
        }
    }
}

/// A run that resumed from step 10 and committed step 15 leaves the older timeline's
/// step 20 committed but abandoned: `ls` says so, in commit order, and marks step 15
/// (the newest commit) as the latest, although 20 is the larger step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ls_shows_commits_in_commit_order_and_marks_abandoned_ones() {
    let (store, dir) = local_store("abandoned");
    for step in [10, 20] {
        save_world(&store, step, 2, &model(step, ROWS), |_| {}).await;
    }
    save_world(&store, 15, 2, &model(15, ROWS), |c| {
        c.run_id = "resumed".into();
        c.generation = 1;
    })
    .await;
    let url = format!("file://{}", dir.path().display());
    let out = ckpt(&["ls", &url, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let listed = json(&out)["checkpoints"].clone();
    let rows: Vec<(u64, String, bool)> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["step"].as_u64().unwrap(),
                c["status"].as_str().unwrap().to_string(),
                c["latest"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (10, "committed".to_string(), false),
            (20, "abandoned".to_string(), false),
            (15, "committed".to_string(), true),
        ]
    );
    let text = stdout(&ckpt(&["ls", &url]));
    assert!(text.contains("abandoned: a later run went back"), "{text}");
    // A resume takes step 15.
    assert_eq!(ckpt::latest(&store).await.unwrap().unwrap().step, 15);
}

/// A URL of an empty local directory, which lives as long as the guard.
fn empty_root() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    (dir, url)
}

#[test]
fn a_bad_store_option_value_exits_2_naming_the_key_and_the_value() {
    let (_dir, url) = empty_root();
    let cases: [Vec<&str>; 4] = [
        vec!["ls", &url, "-o", "retries=lots"],
        vec!["verify", &url, "-o", "request_timeout=soon"],
        vec!["probe", &url, "-o", "part_size=huge"],
        vec!["bench", "--url", &url, "--reps", "1", "-o", "fsync=maybe"],
    ];
    for args in cases {
        let out = ckpt(&args);
        let err = stderr(&out);
        assert_eq!(code(&out), 2, "{args:?}: {err}");
        let (key, value) = args.last().unwrap().split_once('=').unwrap();
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(err.contains(key), "{args:?}: {err}");
        assert!(err.contains(value), "{args:?}: {err}");
    }
}

#[test]
fn store_settings_and_timeouts_are_accepted_by_a_checkpoint_tool() {
    let (_dir, url) = empty_root();
    let out = ckpt(&[
        "ls",
        &url,
        "-o",
        "retries=0",
        "-o",
        "max_backoff=500ms",
        "--retries",
        "1",
        "--request-timeout",
        "2.5",
        "--connect-timeout",
        "1",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stdout(&out).contains("no checkpoints under"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn a_timeout_that_is_not_positive_seconds_is_a_usage_error() {
    let (_dir, url) = empty_root();
    for bad in ["0", "-1", "soon"] {
        let out = ckpt(&["ls", &url, "--connect-timeout", bad]);
        assert_eq!(code(&out), 2, "{bad}: {}", stderr(&out));
    }
}
