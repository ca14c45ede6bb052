//! Health in the tools and in retention: `ckpt ls` and `ckpt inspect` show what each
//! commit's save found (non-finite values, replicas that disagree, the caller's
//! metrics), and retention — `ckpt gc` and the one a save runs with `keep_last` —
//! never removes the newest checkpoint a resume would load. The checkpoints are real
//! saves of the library (2 ranks in this process); the one of unknown health is a
//! real save whose manifest is rewritten as a version-2 writer left it.

use std::process::{Command, Output};

use ckpt::catalog::Select;
use ckpt::format::Manifest;
use ckpt::storage::Store;
use ckpt::{CheckpointConfig, Checkpointer, DType, Region, as_bytes};
use ckpt_testkit::{TEST_RUN, Tensor, dim0_state, local_store, model, step_dir, steps};
use serde_json::{Value, json};

const ROWS: u64 = 64;
const WORLD: usize = 2;
/// Elements of the replicated tensor every rank holds whole.
const SHARED: u64 = 8;

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

fn json_of(output: &Output) -> Value {
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}{}",
        stdout(output),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(output)))
}

/// What one save puts in the state beyond the model's dim-0 shards.
#[derive(Default)]
struct Extras<'a> {
    /// A NaN at this element of `layers.0.weight`.
    nan_at: Option<usize>,
    /// Rank 1's copy of the replicated tensor differs from rank 0's (the written one).
    diverged_replica: bool,
    /// The caller's metrics.
    metrics: &'a [(&'a str, f64)],
}

/// Both ranks save `step` (fresh checkpointers, as a restarted job has) and the
/// commit lands.
async fn save(store: &Store, step: u64, extras: Extras<'_>) {
    let mut tensors: Vec<Tensor> = model(step, ROWS);
    if let Some(at) = extras.nan_at {
        tensors[0].data[at] = f32::NAN;
    }
    let shared: Vec<Vec<f32>> = (0..WORLD)
        .map(|rank| {
            let mut copy = vec![0.5f32; SHARED as usize];
            if extras.diverged_replica && rank == 1 {
                copy[3] = 0.25;
            }
            copy
        })
        .collect();
    let mut handles = Vec::new();
    for (rank, copy) in shared.iter().enumerate() {
        let mut config = CheckpointConfig::new(rank, WORLD);
        config.run_id = TEST_RUN.to_string();
        let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
        let mut state = dim0_state(&tensors, step, rank, WORLD);
        state
            .add_replica(
                "shared",
                DType::F32,
                &[SHARED],
                Region::full(&[SHARED]),
                as_bytes(copy),
                rank == 0,
            )
            .unwrap();
        for (name, value) in extras.metrics {
            state.health_metric(*name, *value);
        }
        handles.push((checkpointer.save(step, &state).await.unwrap(), checkpointer));
    }
    for (handle, _) in &handles {
        handle.committed().await.unwrap();
    }
}

/// Rewrites the manifest of `step` as a writer before health (format version 2)
/// left it: health unknown.
async fn forget_health(store: &Store, step: u64) {
    let key = format!("{}/manifest.json", step_dir(step));
    let mut manifest = Manifest::parse(&store.get(&key).await.unwrap(), &key).unwrap();
    assert!(manifest.health.is_some(), "this build records health");
    manifest.health = None;
    manifest.format_version = 2;
    store.put(&key, manifest.to_bytes()).await.unwrap();
}

/// The row-major index of an element of `layers.0.weight` in rank 1's shard.
const NAN_ON_RANK_1: usize = (ROWS as usize / 2 + 1) * 256 + 3;

/// Step 1 of unknown health, step 2 healthy, step 3 unhealthy (a NaN on rank 1 and a
/// replica rank 1 holds that differs), step 4 unhealthy (a metric that is not
/// finite).
async fn mixed_root() -> (Store, tempfile::TempDir, String) {
    let (store, dir) = local_store("health");
    save(&store, 1, Extras::default()).await;
    forget_health(&store, 1).await;
    let metrics = [("loss", 1.5)];
    save(
        &store,
        2,
        Extras {
            metrics: &metrics,
            ..Extras::default()
        },
    )
    .await;
    let metrics = [("loss", 2.5)];
    save(
        &store,
        3,
        Extras {
            nan_at: Some(NAN_ON_RANK_1),
            diverged_replica: true,
            metrics: &metrics,
        },
    )
    .await;
    let metrics = [("grad_norm", f64::INFINITY), ("loss", 3.5)];
    save(
        &store,
        4,
        Extras {
            metrics: &metrics,
            ..Extras::default()
        },
    )
    .await;
    let url = format!("file://{}", dir.path().display());
    (store, dir, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ls_and_inspect_show_health_reasons_replicas_and_metrics() {
    let (_store, _dir, url) = mixed_root().await;

    let listed = json_of(&ckpt(&["ls", &url, "--json"]));
    let rows: Vec<(u64, Value, bool, bool)> = listed["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["step"].as_u64().unwrap(),
                c["healthy"].clone(),
                c["latest"].as_bool().unwrap(),
                c["resume"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (1, Value::Null, false, false),
            (2, json!(true), false, true),
            (3, json!(false), false, false),
            (4, json!(false), true, false),
        ],
        "health per checkpoint; the latest is step 4, a resume loads step 2"
    );
    let checkpoints = listed["checkpoints"].as_array().unwrap();
    assert!(checkpoints[1].get("health_reasons").is_none(), "{listed}");
    let reasons = checkpoints[2]["health_reasons"].to_string();
    assert!(reasons.contains("layers.0.weight"), "{reasons}");
    assert!(reasons.contains("shared"), "{reasons}");
    let reasons = checkpoints[3]["health_reasons"].to_string();
    assert!(reasons.contains("grad_norm"), "{reasons}");

    let text = stdout(&ckpt(&["ls", &url]));
    let row = |step: &str| {
        text.lines()
            .find(|l| l.trim_start_matches(['*', '>']).split_whitespace().next() == Some(step))
            .unwrap_or_else(|| panic!("a row for step {step}: {text}"))
            .to_string()
    };
    assert!(text.lines().next().unwrap().contains("HEALTH"), "{text}");
    assert!(row("1").contains(" unknown "), "{text}");
    assert!(
        row("2").starts_with('>') && row("2").contains(" healthy "),
        "{text}"
    );
    assert!(row("3").contains(" UNHEALTHY "), "{text}");
    assert!(
        row("4").starts_with('*') && row("4").contains(" UNHEALTHY "),
        "{text}"
    );
    let why = text
        .lines()
        .find(|l| l.starts_with("step 3: unhealthy: "))
        .unwrap_or_else(|| panic!("step 3's first reason: {text}"));
    assert!(why.contains("(+1 more: ckpt inspect --step 3)"), "{text}");
    assert!(text.contains("> = what a resume loads"), "{text}");

    // The newest checkpoint, whatever its health, is what inspect opens.
    let view = json_of(&ckpt(&["inspect", &url, "--json"]));
    assert_eq!(view["step"], 4);
    assert_eq!(view["healthy"], false);
    assert_eq!(
        view["health"]["metrics"],
        json!({"grad_norm": "inf", "loss": 3.5})
    );
    assert_eq!(view["health"]["nonfinite"], json!([]));

    let view = json_of(&ckpt(&["inspect", &url, "--step", "3", "--json"]));
    assert_eq!(view["healthy"], false);
    let health = &view["health"];
    assert_eq!(health["healthy"], false);
    assert_eq!(health["reasons"].as_array().unwrap().len(), 2, "{health}");
    assert_eq!(
        health["nonfinite"],
        json!([{"tensor": "layers.0.weight", "elements": 1, "ranks": [1]}])
    );
    assert_eq!(
        health["replica_mismatches"],
        json!([{
            "tensor": "shared", "offsets": [0], "lengths": [SHARED], "blocks": [0],
            "written_by": 0, "agree": [], "disagree": [1]
        }])
    );
    assert_eq!(health["replicas_compared"], 1);
    assert_eq!(health["metrics"], json!({"loss": 2.5}));

    let view = json_of(&ckpt(&["inspect", &url, "--step", "2", "--json"]));
    assert_eq!(view["healthy"], true);
    assert_eq!(view["health"]["reasons"], json!([]));
    assert_eq!(view["health"]["replica_mismatches"], json!([]));
    assert_eq!(view["health"]["replicas_compared"], 1);

    let view = json_of(&ckpt(&["inspect", &url, "--step", "1", "--json"]));
    assert_eq!(view["format_version"], 2);
    assert_eq!(view["healthy"], Value::Null);
    assert_eq!(view["health"], Value::Null);

    let text = stdout(&ckpt(&["inspect", &url, "--step", "3"]));
    for line in [
        "health       UNHEALTHY",
        "non-finite   layers.0.weight: 1 element (rank 1)",
        "replicas     1 box compared, 1 disagree",
        "  mismatch   shared [0..8]: blocks 0; written by rank 0; agree: none; disagree: 1",
        "metrics      loss = 2.5",
    ] {
        assert!(text.contains(line), "{line:?} in {text}");
    }
    let text = stdout(&ckpt(&["inspect", &url, "--step", "1"]));
    assert!(text.contains("health       unknown"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_keeps_the_newest_healthy_commit_whatever_keep_says() {
    let (store, _dir, url) = mixed_root().await;
    let out = ckpt(&["gc", &url, "--keep", "1", "--grace", "0", "--dry-run"]);
    let text = stdout(&out);
    assert!(
        text.contains(&format!(
            "keeping step 2 {}: the newest healthy checkpoint, which a resume loads",
            step_dir(2)
        )),
        "{text}"
    );
    assert!(text.contains("would remove step 1"), "{text}");
    assert!(text.contains("would remove step 3"), "{text}");
    assert!(!text.contains("would remove step 2"), "{text}");

    let plan = json_of(&ckpt(&[
        "gc", &url, "--keep", "1", "--grace", "0", "--json",
    ]));
    assert_eq!(plan["plan"]["held"][0]["step"], 2, "{plan}");
    let removed: Vec<u64> = plan["plan"]["remove"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(removed, vec![1, 3]);
    assert_eq!(steps(&store).await, vec![(2, true), (4, true)]);
    // What a resume loads is what gc kept.
    let (resumed, skipped) = ckpt::catalog::latest_selecting(&store, Select::Healthy)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resumed.step, 2);
    assert_eq!(skipped.len(), 1, "step 4 passed over");

    // Once a newer commit is healthy, the older healthy one is no longer held.
    save(&store, 5, Extras::default()).await;
    let plan = json_of(&ckpt(&[
        "gc", &url, "--keep", "1", "--grace", "0", "--json",
    ]));
    assert!(plan["plan"].get("held").is_none(), "{plan}");
    assert_eq!(steps(&store).await, vec![(5, true)]);
}

/// The retention a save runs with `keep_last` keeps the newest checkpoint a resume
/// would load: one of unknown health as one judged healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_after_a_commit_keeps_the_newest_healthy_commit() {
    let (store, _dir) = local_store("health-retention");
    let tensors = model(1, ROWS);
    // One rank, keep 1, no grace; each phase's checkpointer is closed, which waits
    // for the retention after its last commit.
    let phase = |steps: &[(u64, bool)]| {
        let store = store.clone();
        let tensors = &tensors;
        let steps = steps.to_vec();
        async move {
            let mut config = CheckpointConfig::new(0, 1);
            config.run_id = TEST_RUN.to_string();
            config.keep_last = Some(1);
            config.retention_grace = std::time::Duration::ZERO;
            let checkpointer = Checkpointer::new(store, config).unwrap();
            for (step, healthy) in steps {
                let mut state = dim0_state(tensors, step, 0, 1);
                if !healthy {
                    state.mark_unhealthy("the loss spiked");
                }
                let handle = checkpointer.save(step, &state).await.unwrap();
                handle.committed().await.unwrap();
            }
            checkpointer.close().await.unwrap();
        }
    };
    phase(&[(1, true)]).await;
    forget_health(&store, 1).await;
    phase(&[(2, false), (3, false)]).await;
    assert_eq!(
        steps(&store).await,
        vec![(1, true), (3, true)],
        "step 1 (health unknown) stays beside the newest, step 2 goes"
    );
    phase(&[(4, true)]).await;
    assert_eq!(steps(&store).await, vec![(4, true)]);
    phase(&[(5, false)]).await;
    assert_eq!(steps(&store).await, vec![(4, true), (5, true)]);
    let (resumed, _) = ckpt::catalog::latest_selecting(&store, Select::Healthy)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resumed.step, 4);
}
