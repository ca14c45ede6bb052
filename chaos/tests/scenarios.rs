//! The fixed scenario set (`chaos/scenarios/`, one per fault kind, tiny preset) run
//! through the `ckpt-chaos` binary, one test per scenario file (those whose fault the
//! Python suite runs too, `RUN_BY_THE_PYTHON_SUITE`, in `scripts/test --chaos` only),
//! and the oracle shown able to fail: a wrong expectation and a corrupted checkpoint
//! are both caught.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ckpt_chaos::run::{Observed, Poison, proc_state};
use ckpt_chaos::scenario::{FaultKind, Scenario};
use ckpt_chaos::{Options, oracle, run_scenario};
use ckpt_testkit::{Capability, has_probed};

const CHAOS: &str = env!("CARGO_BIN_EXE_ckpt-chaos");

/// One job at a time under `cargo test`: each runs several rank processes with
/// heartbeat deadlines, and many at once on a 2-core machine would starve them into
/// false failures. Under nextest (scripts/test) every test is a process of its own and
/// `.config/nextest.toml` decides instead: the light runs two at a time, the 4-rank
/// Python scenarios alone.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `ckpt-train` of this workspace (and `ckpt` beside it): the ones `cargo test
/// --workspace` built (with the workspace's features), else built now.
fn trainer() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    // `ckpt coordinator` too, for the scenarios with a standalone coordinator, and
    // the fault shim the harness preloads (a cdylib, which `cargo test` leaves out).
    for (package, file, target) in [
        ("ckpt-trainer", "ckpt-train", "--bin"),
        ("ckpt-cli", "ckpt", "--bin"),
        ("ckpt-fault-shim", ckpt_chaos::shim::LIBRARY, "--lib"),
    ] {
        if !dir.join(file).exists() {
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut build = Command::new(cargo);
            build
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .args(["build", "--quiet", "-p", package, target]);
            if target == "--bin" {
                build.arg(file);
            }
            let status = build.status().unwrap();
            assert!(status.success(), "building {file} failed");
        }
    }
    dir.join("ckpt-train")
}

/// The capability the Python-trainer scenarios need, by its name in `CKPT_REQUIRE`: a
/// Python (`CKPT_PYTHON`, else `python3`) that imports torch and the `ckpt` package
/// (`pip install ./python`, or `PYTHONPATH=python` with the extension built).
const TORCH: &str = "torch";

/// Whether `CKPT_REQUIRE` names `capability` (or says `all`): then a missing one
/// fails instead of skipping (ckpt-testkit's policy).
fn required(capability: &str) -> bool {
    std::env::var("CKPT_REQUIRE").is_ok_and(|list| {
        list.split(',')
            .map(str::trim)
            .any(|item| item == "all" || item == capability)
    })
}

/// One test per scenario file, named after it (`-` as `_`): a failure names its
/// scenario, and `cargo test --test scenarios scenario::kill_node` runs one (the
/// prefix `scenario::` runs the whole set). `every_scenario_file_has_a_test` fails
/// when a file and this list part ways.
macro_rules! scenario_tests {
    ($($name:ident),* $(,)?) => {
        mod scenario {
            $(
                #[test]
                fn $name() {
                    super::the_scenario_passes(stringify!($name));
                }
            )*
        }

        /// The names of the scenario tests.
        const SCENARIO_TESTS: &[&str] = &[$(stringify!($name)),*];
    };
}

scenario_tests![
    corrupt_then_recover,
    demo,
    device_error,
    disk_full,
    io_error_on_read,
    io_error_on_write,
    kill_coordinator,
    kill_etcd_member,
    kill_every_rank_of_the_coordinator_node,
    kill_in_save_after_commit,
    kill_in_save_after_rank_part,
    kill_in_save_before_commit,
    kill_in_save_during_data_upload,
    kill_in_save_during_staging,
    kill_node,
    kill_one_rank,
    kill_rank_while_coordinator_down,
    nan_then_rollback,
    net_delay_between_nodes,
    net_loss_between_nodes,
    no_member_for_a_moment_while_a_node_restarts,
    node_back_after_the_job_and_its_coordinator_ended,
    node_back_after_the_job_finished,
    node_back_while_the_coordinator_restarts,
    partition_etcd,
    partition_node,
    partition_store,
    partition_while_the_other_node_finishes,
    python_disk_full,
    python_io_error_on_write,
    python_kill_during_save,
    python_kill_node,
    python_kill_one_rank,
    python_node_back_after_its_coordinator_is_gone,
    python_node_back_after_the_job_and_its_coordinator_ended,
    python_partition_node,
    python_stop_one_rank,
    python_storage_s3_faults,
    read_only_checkpoints,
    sdc_in_one_replica,
    snapshot_kill_one_rank,
    snapshot_kill_ring_neighbours,
    stop_one_rank,
    storage_corrupt,
    storage_reset_fails_a_save,
    storage_s3_faults,
    truncate_then_recover,
];

/// Scenario tests whose fault the Python suite runs on the same trainer, world and
/// steps, judged by the same oracle (every commit verified, none of the periodic
/// ones lost, every data cursor, the final weights bitwise against a replay of the
/// run's schedule) and more (the recovery read from memory in the same processes, a
/// stopped rank killed, the stale generation fenced): the test named beside each.
/// `scripts/test` runs them in its chaos tier (`scripts/test --chaos`), not in the
/// full run CI makes, where the Python test runs the fault once.
const RUN_BY_THE_PYTHON_SUITE: &[(&str, &str)] = &[
    (
        "python_kill_during_save",
        "python/tests/test_elastic.py::test_sigkill_during_a_save",
    ),
    (
        "python_kill_node",
        "python/tests/test_elastic.py::test_a_node_killed_whole_and_started_again_grows_back_to_four",
    ),
    (
        "python_kill_one_rank",
        "python/tests/test_elastic.py::test_sigkill_mid_step_survivors_finish_on_three",
    ),
    (
        "python_stop_one_rank",
        "python/tests/test_elastic.py::test_sigstop_is_dropped_by_heartbeat_fenced_and_killed \
         and test_sigcont_after_the_drop_leaves_as_stale",
    ),
];

#[test]
fn the_scenarios_the_python_suite_runs_load_and_their_tests_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let script = std::fs::read_to_string(root.join("scripts/test")).unwrap();
    let chaos_tier = script
        .lines()
        .find(|l| l.starts_with("CHAOS_TIER="))
        .expect("scripts/test defines CHAOS_TIER");
    for (name, test) in RUN_BY_THE_PYTHON_SUITE {
        let (_, file) = scenario_files()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no file under chaos/scenarios/ for {name}"));
        let scenario = Scenario::load(&file).unwrap_or_else(|e| panic!("{e}"));
        assert!(scenario.script.is_some(), "{name} is a Python scenario");
        let short = name.trim_start_matches("python_");
        assert!(
            chaos_tier.contains(short),
            "scripts/test's CHAOS_TIER does not name {name}"
        );
        let (path, tests) = test.split_once("::").unwrap();
        let source = std::fs::read_to_string(root.join(path)).unwrap();
        for test in tests.split(" and ") {
            assert!(
                source.contains(&format!("def {test}(")),
                "{name} is run by {path}::{test}, which does not exist"
            );
        }
    }
}

/// The scenario files under `chaos/scenarios/`, each with the name of its test.
fn scenario_files() -> Vec<(String, PathBuf)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut files: Vec<(String, PathBuf)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .map(|p| {
            let stem = p.file_stem().unwrap().to_string_lossy();
            (stem.replace('-', "_"), p)
        })
        .collect();
    files.sort();
    files
}

#[test]
fn every_scenario_file_has_a_test() {
    let files: Vec<String> = scenario_files().into_iter().map(|(n, _)| n).collect();
    assert!(files.len() >= 4, "one scenario per fault kind: {files:?}");
    let untested: Vec<&String> = files
        .iter()
        .filter(|f| !SCENARIO_TESTS.contains(&f.as_str()))
        .collect();
    let without_file: Vec<&&str> = SCENARIO_TESTS
        .iter()
        .filter(|t| !files.iter().any(|f| f == *t))
        .collect();
    assert!(
        untested.is_empty(),
        "scenario files without a test (add them to scenario_tests! in tests/scenarios.rs): \
         {untested:?}"
    );
    assert!(
        without_file.is_empty(),
        "scenario tests without a file under chaos/scenarios/: {without_file:?}"
    );
}

/// Runs the scenario file whose test is `test` through `ckpt-chaos run` and checks
/// its report: it passed, its faults fired, and the oracle's counts add up.
fn the_scenario_passes(test: &str) {
    let _serial = one_at_a_time();
    let Some((_, file)) = scenario_files().into_iter().find(|(n, _)| n == test) else {
        panic!("no file under chaos/scenarios/ for the test {test}");
    };
    let cache = tempfile::tempdir().unwrap();
    let output = Command::new(CHAOS)
        .arg("run")
        .arg(&file)
        .args(["--json", "--trainer"])
        .arg(trainer())
        .arg("--cache")
        .arg(cache.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{}", String::from_utf8_lossy(&output.stderr)));
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{report:#}");
    let run = &runs[0];
    if run["verdict"] == "skip" {
        // Only where the machine lacks the part: no S3 server (scripts/test starts
        // one), or not root (namespaces and mounts). As root under scripts/test,
        // every scenario runs.
        // The one skip policy: a failure where CKPT_REQUIRE names the capability.
        let why = run["reasons"].to_string();
        if why.contains("no Python with torch") {
            // The Python-trainer scenarios (`script`): ckpt-testkit's Capability has
            // no tier for them; the same policy under the name `torch`.
            let missing = format!("scenario {}: {why}", run["scenario"]);
            assert!(
                !required(TORCH),
                "{} needs {TORCH} (required by CKPT_REQUIRE): {missing}",
                std::thread::current().name().unwrap_or("this test")
            );
            eprintln!(
                "SKIPPED: {} needs {TORCH}: {missing}",
                std::thread::current().name().unwrap_or("this test")
            );
            return;
        }
        // The fault shim is part of the workspace: `cargo test --workspace` builds it.
        assert!(
            !why.contains(ckpt_chaos::shim::LIBRARY),
            "the fault shim is missing (cargo build -p ckpt-fault-shim): {why}"
        );
        // What the harness skips for (chaos/src/env.rs): no S3 server, no etcd binary,
        // no tmpfs mount (root), no network namespaces.
        let capability = if why.contains("S3") {
            Capability::Servers
        } else if why.contains("etcd") {
            Capability::Etcd
        } else if why.contains("mount") {
            Capability::Root
        } else {
            Capability::Netns
        };
        let missing = format!("scenario {}: {why}", run["scenario"]);
        assert!(!has_probed(capability, Some(missing)));
        return;
    }
    assert_eq!(run["verdict"], "pass", "{run:#}");
    assert!(
        !run["observed"]["fired"].as_array().unwrap().is_empty(),
        "{run:#}"
    );
    let j = &run["judgement"];
    assert_eq!(j["identical"], true, "{run:#}");
    // Every commit verifies but those damaged on purpose, which verify finds.
    assert_eq!(
        j["commits"].as_u64().unwrap(),
        j["verified"].as_u64().unwrap() + j["detected"].as_u64().unwrap(),
        "{run:#}"
    );
    assert_eq!(
        j["corrupted"].as_u64().unwrap(),
        j["detected"].as_u64().unwrap() + j["superseded"].as_u64().unwrap(),
        "{run:#}"
    );
    // The Python trainer's: every commit's data cursors were checked.
    let scenario = Scenario::load(&file).unwrap();
    if scenario.script.is_some() {
        assert_eq!(j["cursors_checked"], j["commits"], "{run:#}");
    }
    // Every poison the trainer's failpoints put in was caught.
    let poisons = scenario
        .faults
        .iter()
        .filter(|f| matches!(f.kind, FaultKind::Sdc | FaultKind::Nan))
        .count() as u64;
    assert_eq!(j["poisoned"], poisons, "{run:#}");
    assert_eq!(j["caught"], poisons, "{run:#}");
    assert!(output.status.success(), "{run:#}");
}

#[test]
fn a_wrong_expectation_fails_the_run_with_its_reason() {
    let _serial = one_at_a_time();
    let cache = tempfile::tempdir().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/kill-one-rank.toml");
    let mut scenario = Scenario::load(&path).unwrap();
    scenario.expect.final_world = Some(4);
    let options = Options {
        trainer: trainer(),
        cache: cache.path().into(),
        scratch: scratch.path().join("run"),
        timeout: Duration::from_secs(300),
        logs: None,
        plot: None,
    };
    let report = run_scenario("wrong", &scenario, &options).unwrap();
    assert!(!report.passed(), "{}", report.summary());
    assert!(
        report
            .reasons
            .iter()
            .any(|r| r.contains("finish on 4 ranks")),
        "{:?}",
        report.reasons
    );
    // The invariants themselves held.
    assert_eq!(report.judgement.identical, Some(true));
}

#[test]
fn a_corrupted_checkpoint_is_caught_by_the_oracle() {
    let _serial = one_at_a_time();
    let cache = tempfile::tempdir().unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/kill-one-rank.toml");
    let scenario = Scenario::load(&path).unwrap();
    let trainer = trainer();
    let reference = oracle::reference(&scenario, &trainer, cache.path()).unwrap();
    // A second failure-free run, then one bit flipped in one of its data files.
    let copy = tempfile::tempdir().unwrap();
    let run = oracle::reference(&scenario, &trainer, copy.path()).unwrap();
    let data = find(&run, "safetensors").expect("a data file");
    let mut bytes = std::fs::read(&data).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x10;
    std::fs::write(&data, bytes).unwrap();
    let seen = Default::default();
    let store = ckpt::storage::Store::from_url(&oracle::file_url(&run)).unwrap();
    let j = oracle::judge(&store, &seen, &[], Some(&reference), scenario.steps);
    assert!(j.verified < j.commits, "{j:?}");
    assert!(
        j.problems.iter().any(|p| p.contains("does not verify")),
        "{:?}",
        j.problems
    );
}

/// The health checks fail a poison that no commit caught, a NaN that no rollback
/// followed, and a resume that loaded an unhealthy commit: shown on a store one
/// plain run wrote, with its run id as a job's first generation names it.
#[test]
fn an_uncaught_poison_and_an_unhealthy_resume_fail_the_oracle() {
    let dir = tempfile::tempdir().unwrap();
    let url = oracle::file_url(dir.path());
    let output = Command::new(trainer())
        .args(["--preset", "tiny", "--steps", "15", "--ckpt", &url])
        .args(["--ckpt-every", "5", "--fault-nan", "10:0"])
        .env("CKPT_RUN_ID", "chaos-e1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    let store = ckpt::storage::Store::from_url(&url).unwrap();
    let commits = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(ckpt::catalog::commits(&store))
        .unwrap();
    let steps: Vec<u64> = commits.iter().map(|c| c.step).collect();
    // Step 10 twice: poisoned, then trained again after the rollback.
    assert_eq!(steps, [5, 10, 10, 15], "{stdout}");
    let poison = |kind: &str, step| Poison {
        kind: kind.into(),
        rank: 0,
        step,
    };
    let judged = |observed: &Observed| {
        let mut j = oracle::Judgement::default();
        oracle::check_health(&store, observed, &mut j);
        j
    };
    // As the run went: the NaN caught by step 10's commit, and rolled back from.
    let mut observed = Observed {
        poisoned: vec![poison("nan", 10)],
        rollbacks: vec![(10, 5)],
        resumed_dirs: vec![commits[0].dir.clone()],
        ..Observed::default()
    };
    let j = judged(&observed);
    assert_eq!((j.poisoned, j.caught, j.resumes_checked), (1, 1, 1));
    assert!(j.problems.is_empty(), "{:?}", j.problems);
    // A flipped bit that step 5's healthy commit did not see, no rollback after the
    // NaN, and a resume from the poisoned commit.
    observed.poisoned.push(poison("sdc", 5));
    observed.rollbacks.clear();
    observed.resumed_dirs.push(commits[1].dir.clone());
    let j = judged(&observed);
    assert_eq!((j.poisoned, j.caught, j.resumes_checked), (2, 1, 2));
    let all = j.problems.join("\n");
    assert_eq!(j.problems.len(), 3, "{all}");
    assert!(all.contains("sdc on rank 0 at step 5: its commit"), "{all}");
    assert!(all.contains("no rollback from step 10 followed"), "{all}");
    assert!(
        all.contains("a resume loaded the unhealthy commit"),
        "{all}"
    );
}

fn find(dir: &Path, extension: &str) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()? {
        let path = entry.ok()?.path();
        if path.is_dir() {
            if let Some(found) = find(&path, extension) {
                return Some(found);
            }
        } else if path.extension().is_some_and(|e| e == extension) {
            return Some(path);
        }
    }
    None
}

#[test]
fn a_seeded_soak_reports_every_run_and_replays_failures() {
    let _serial = one_at_a_time();
    let cache = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let soak = |trainer: &Path, runs: &[&str]| {
        Command::new(CHAOS)
            .args(["soak", "--seed", "7", "--json"])
            .args(runs)
            .arg("--trainer")
            .arg(trainer)
            .arg("--cache")
            .arg(cache.path())
            .arg("--out")
            .arg(out.path())
            .output()
            .unwrap()
    };
    // Two runs in two sittings: run 0, then run 1 (each run also makes its
    // failure-free reference, so every run counts twice in this test's time).
    let mut fired = 0;
    for (runs, numbers) in [(["--first", "0"], [0].as_slice()), (["--first", "1"], &[1])] {
        let output = soak(
            &trainer(),
            &[runs[0], runs[1], "--runs", &numbers.len().to_string()],
        );
        let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        let runs = report["runs"].as_array().unwrap();
        let seen: Vec<u64> = runs.iter().map(|r| r["run"].as_u64().unwrap()).collect();
        assert_eq!(seen, numbers);
        for run in runs {
            assert_eq!(run["verdict"], "pass", "{run:#}");
            let scenario = Scenario::parse(run["scenario_toml"].as_str().unwrap()).unwrap();
            assert_eq!(
                scenario,
                ckpt_chaos::soak::draw(7, run["run"].as_u64().unwrap())
            );
            fired += run["observed"]["fired"].as_array().unwrap().len();
        }
        assert!(output.status.success());
        std::fs::write(
            out.path().join(format!("report-{}.json", numbers[0])),
            &output.stdout,
        )
        .unwrap();
    }
    // `totals` adds the two sittings up as one soak.
    let totals = Command::new(CHAOS)
        .args(["totals", "--json"])
        .arg(out.path().join("report-0.json"))
        .arg(out.path().join("report-1.json"))
        .output()
        .unwrap();
    assert!(totals.status.success(), "{totals:?}");
    let totals: serde_json::Value = serde_json::from_slice(&totals.stdout).unwrap();
    assert_eq!(
        (totals["runs"].as_u64(), totals["passed"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(totals["faults"].as_u64(), Some(fired as u64), "{totals:#}");
    // A run that cannot pass (here: no trainer at all) fails, says why, and leaves a
    // scenario file that replays it.
    let output = soak(Path::new("/nonexistent/ckpt-train"), &["--runs", "1"]);
    assert!(!output.status.success());
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let first = &report["runs"][0];
    assert_eq!(first["verdict"], "fail");
    let replay = PathBuf::from(first["replay"].as_str().unwrap());
    let replayed = Scenario::load(&replay).unwrap();
    assert_eq!(replayed, ckpt_chaos::soak::draw(7, 0));
    assert!(String::from_utf8_lossy(&output.stderr).contains("replay: ckpt-chaos run"));
}

#[test]
fn a_run_past_its_liveness_bound_is_ended_and_failed_and_what_it_started_is_killed() {
    let _serial = one_at_a_time();
    let cache = tempfile::tempdir().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/stop-one-rank.toml");
    let mut scenario = Scenario::load(&path).unwrap();
    // A stop that outlives the run, in a run far longer than its bound.
    scenario.steps = 1000;
    scenario.faults[0].duration_ms = Some(600_000);
    let bound = 10;
    scenario.expect.ends_within_secs = Some(bound);
    let options = Options {
        trainer: trainer(),
        cache: cache.path().into(),
        scratch: scratch.path().join("run"),
        timeout: Duration::from_secs(300),
        logs: None,
        plot: None,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let started = std::time::Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(run_scenario("outlives its bound", &scenario, &options));
    });
    // The reference run comes first (cached per configuration); then the run itself
    // must end at its bound, not at the harness's 300 s timeout.
    let waited = Duration::from_secs(bound + 60);
    let report = rx
        .recv_timeout(waited)
        .unwrap_or_else(|_| panic!("the harness did not return within {waited:?}"))
        .unwrap();
    assert!(started.elapsed() < waited);
    assert_eq!(report.verdict, "fail", "{}", report.summary());
    assert!(
        report
            .reasons
            .iter()
            .any(|r| r.contains(&format!("did not end within its bound of {bound} s"))),
        "{}",
        report.summary()
    );
    assert!(
        report.observed.wall_s < (bound + 15) as f64,
        "the run was cut at its bound: {} s",
        report.observed.wall_s
    );
    assert!(!report.observed.fired.is_empty(), "{}", report.summary());
    // Every rank it started is gone (the stopped one too), not left running.
    let pids: Vec<i32> = report
        .observed
        .log
        .iter()
        .filter_map(|l| {
            l.split(" pid ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert!(pids.len() >= 4, "{:?}", report.observed.log);
    for pid in pids {
        let state = proc_state(pid);
        assert!(
            state.is_none() || state == Some('Z'),
            "pid {pid} is still alive (state {state:?})"
        );
    }
}
