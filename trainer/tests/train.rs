//! End-to-end runs of the real `ckpt-train` binary through its launcher, on `file://`
//! stores in temporary directories, with the `tiny` preset.
//!
//! The oracle is bitwise identity: the final checkpoint of an interrupted, resumed,
//! resharded run must equal the one of an uninterrupted run, tensor by tensor and in
//! its global state (step, data position, loss history), as `ckpt diff` compares them.
//! Kills happen at known points: a hidden `--fault-hold` option parks one rank at a
//! step, the others block in their next collective (mid-step), the test sees the
//! rank's log line and SIGKILLs every rank by pid.

mod common;

use common::{assert_identical, runtime, tempdir, url};

use std::io::{BufRead, BufReader, Lines};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use ckpt::storage::Store;
use ckpt::tools::verify::{VerifyOptions, verify};
use ckpt::{CheckpointReader, list_checkpoints};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt-train");

/// `ckpt-train launch --nproc N -- --preset tiny … ARGS`, to completion.
fn launch(nproc: usize, args: &[&str]) -> Output {
    let output = Command::new(BIN)
        .args(["launch", "--nproc", &nproc.to_string(), "--"])
        .args(["--preset", "tiny", "--seed", "7", "--timeout-secs", "30"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "launch {nproc} {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn train(nproc: usize, dir: &Path, steps: u64, extra: &[&str]) -> String {
    let steps = steps.to_string();
    let url = url(dir);
    let mut args = vec!["--steps", &steps, "--ckpt", &url, "--ckpt-every", "10"];
    args.extend_from_slice(extra);
    String::from_utf8(launch(nproc, &args).stdout).unwrap()
}

fn latest_step(dir: &Path) -> Option<u64> {
    runtime().block_on(async {
        ckpt::latest(&Store::from_url(&url(dir)).unwrap())
            .await
            .unwrap()
            .map(|m| m.step)
    })
}

/// A launch running in the background, its output read as the test goes.
struct Running {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    /// Everything read so far.
    seen: String,
}

impl Running {
    /// `ckpt-train launch --nproc N -- --preset tiny … ARGS`, its stdout piped to
    /// the test.
    fn start(nproc: usize, args: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args(["launch", "--nproc", &nproc.to_string(), "--"])
            .args(["--preset", "tiny", "--seed", "7", "--timeout-secs", "30"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Running {
            child,
            lines,
            seen: String::new(),
        }
    }

    /// Reads up to the first line that contains `marker`; panics with everything
    /// seen when the output ends first.
    fn read_until(&mut self, marker: &str) {
        for line in self.lines.by_ref() {
            let line = line.unwrap();
            self.seen.push_str(&line);
            self.seen.push('\n');
            if line.contains(marker) {
                return;
            }
        }
        panic!("never saw {marker:?}:\n{}", self.seen);
    }

    /// The rank processes' pids the launcher printed so far.
    fn rank_pids(&self) -> Vec<i32> {
        self.seen
            .lines()
            .filter_map(|l| l.strip_prefix("launch: rank ")?.split(" pid ").nth(1))
            .map(|pid| pid.trim().parse().unwrap())
            .collect()
    }

    /// Reads the rest of the output and reaps the launcher: its status and
    /// everything it printed.
    fn finish(mut self) -> (ExitStatus, String) {
        for line in self.lines {
            self.seen.push_str(&line.unwrap());
            self.seen.push('\n');
        }
        (self.child.wait().unwrap(), self.seen)
    }
}

/// Starts a launch, waits until a line containing `marker` appears on its output,
/// then SIGKILLs every rank process (by the pids the launcher prints) and reaps the
/// launcher. Returns everything printed.
fn kill_all_ranks_at(nproc: usize, args: &[&str], marker: &str) -> String {
    let mut launch = Running::start(nproc, args);
    launch.read_until(marker);
    let pids = launch.rank_pids();
    assert_eq!(pids.len(), nproc, "{}", launch.seen);
    for pid in &pids {
        // SAFETY: kill(2) on rank processes this test started (through the launcher)
        // and that are still running: the launcher has not reaped them.
        assert_eq!(unsafe { libc::kill(*pid, libc::SIGKILL) }, 0);
    }
    let (status, seen) = launch.finish();
    assert!(
        !status.success(),
        "killed ranks must fail the launch:\n{seen}"
    );
    assert!(seen.contains("failed: signal: 9"), "{seen}");
    seen
}

fn resumed_from(output: &str) -> u64 {
    output
        .lines()
        .find_map(|l| l.split("resumed from step ").nth(1))
        .and_then(|r| r.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no resume line in:\n{output}"))
}

#[test]
fn world_sizes_one_to_four_end_with_bitwise_identical_weights() {
    let dirs: Vec<_> = (1..=4).map(|_| tempdir()).collect();
    for (i, dir) in dirs.iter().enumerate() {
        train(i + 1, dir.path(), 40, &[]);
        assert_eq!(latest_step(dir.path()), Some(40));
    }
    for dir in &dirs[1..] {
        assert_identical(dirs[0].path(), dir.path());
    }
    // The same verdict from the `ckpt` command line.
    let out = Command::new(common::ckpt_cli())
        .args(["diff", &url(dirs[0].path()), &url(dirs[3].path())])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ckpt diff: {text}");
    assert!(text.contains("identical"), "{text}");
}

/// One launcher, not two: the reference trainer runs under `ckpt launch` as under its
/// own `launch` subcommand, fixed (without the listener hand-over) and elastic, and
/// trains the same bits, through a rollback in both.
#[test]
fn the_reference_trainer_runs_under_ckpt_launch_fixed_and_elastic() {
    let (own, fixed, elastic) = (tempdir(), tempdir(), tempdir());
    train(2, own.path(), 20, &[]);
    for (dir, flags) in [(&fixed, &[][..]), (&elastic, &["--min-ranks", "1"][..])] {
        let target = url(dir.path());
        let out = Command::new(common::ckpt_cli())
            .args(["launch", "--nproc", "2"])
            .args(flags)
            .args([
                "--",
                BIN,
                "--preset",
                "tiny",
                "--seed",
                "7",
                "--timeout-secs",
                "30",
            ])
            .args(["--steps", "20", "--ckpt", &target, "--ckpt-every", "10"])
            // A NaN in rank 1's parameters after step 15: the world rolls back to
            // step 10 in the same processes and trains the steps again, to the
            // same bits.
            .args(["--fault-nan", "15:1"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "ckpt launch {flags:?}: {text}");
        assert!(
            text.contains(
                "rolled back from step 15 to step 10: non-finite parameters entering step 16"
            ),
            "{text}"
        );
        assert_eq!(latest_step(dir.path()), Some(20), "{text}");
        assert_identical(own.path(), dir.path());
    }
}

/// Overlapped saves copy the state while the next step computes: they must save
/// exactly what blocking saves save. Debug builds check every overlapped copy against
/// a checksum taken at save time, so a rank that wrote its rows too early would fail.
#[test]
fn overlapped_and_blocking_saves_hold_bitwise_identical_weights() {
    let (blocking, overlapped) = (tempdir(), tempdir());
    train(3, blocking.path(), 30, &["--staging", "blocking"]);
    let out = train(
        3,
        overlapped.path(),
        30,
        &["--staging", "overlapped", "--check-staging"],
    );
    assert!(out.contains("done: step 30"), "{out}");
    assert_eq!(latest_step(overlapped.path()), Some(30));
    assert_identical(blocking.path(), overlapped.path());
}

#[test]
fn the_fast_mode_also_trains_but_sums_gradients_in_f32() {
    let (a, b) = (tempdir(), tempdir());
    let fast = ["--deterministic=false", "--log-every", "1"];
    let one = train(1, a.path(), 20, &fast);
    let three = train(3, b.path(), 20, &fast);
    assert!(one.contains("fast mode") && three.contains("fast mode"));
    assert_eq!(latest_step(b.path()), Some(20));
    for (world, output) in [(1, &one), (3, &three)] {
        let losses = printed_losses(output);
        let steps: Vec<u64> = losses.iter().map(|&(step, _)| step).collect();
        assert_eq!(
            steps,
            (1..=20).collect::<Vec<_>>(),
            "world {world}:\n{output}"
        );
        let (first, last) = (losses[0].1, losses[19].1);
        assert!(
            last < first / 2.0,
            "world {world}: the loss went from {first} to {last} in 20 steps:\n{output}"
        );
    }
}

/// The `(step, loss)` pairs rank 0 printed (`[rank 0] step N loss X`).
fn printed_losses(output: &str) -> Vec<(u64, f64)> {
    output
        .lines()
        .filter_map(|line| line.strip_prefix("[rank 0] step "))
        .filter_map(|rest| {
            let (step, loss) = rest.split_once(" loss ")?;
            Some((step.parse().ok()?, loss.trim().parse().ok()?))
        })
        .collect()
}

fn kill_at_20_then_resume(before: usize, after: usize) {
    let (reference, run) = (tempdir(), tempdir());
    train(before, reference.path(), 40, &[]);

    // Rank 0 parks after starting the save of step 20; the others block in step
    // 21's first all-gather: the world is killed mid-step with a save in flight.
    let run_url = url(run.path());
    let hold = "20:0:after-save";
    let seen = kill_all_ranks_at(
        before,
        &[
            "--steps",
            "1000",
            "--ckpt",
            &run_url,
            "--ckpt-every",
            "5",
            "--log-every",
            "1",
            "--fault-hold",
            hold,
        ],
        "fault: rank 0 holds after saving step 20",
    );
    assert!(seen.contains("[rank 0] step 20 loss"), "{seen}");
    let saved = latest_step(run.path()).expect("a commit before the kill");
    assert!((5..=20).contains(&saved), "latest commit {saved}");

    let out = train(after, run.path(), 40, &["--resume"]);
    assert_eq!(resumed_from(&out), saved);
    assert_eq!(latest_step(run.path()), Some(40));
    assert_identical(reference.path(), run.path());
}

#[test]
fn four_ranks_killed_at_step_20_resume_on_three_bitwise_identical_to_an_uninterrupted_run() {
    kill_at_20_then_resume(4, 3);
}

#[test]
fn two_ranks_killed_at_step_20_resume_on_five_bitwise_identical_to_an_uninterrupted_run() {
    kill_at_20_then_resume(2, 5);
}

#[test]
fn a_save_in_flight_when_killed_never_commits_and_resume_uses_the_previous_commit() {
    let (reference, run) = (tempdir(), tempdir());
    train(4, reference.path(), 40, &[]);

    // Rank 1 parks before saving step 20: ranks 0, 2 and 3 wait for step 15 to
    // commit, then start writing their parts of step 20, which can therefore never be
    // complete; rank 0's line says its save started, and everything is killed.
    let run_url = url(run.path());
    kill_all_ranks_at(
        4,
        &[
            "--steps",
            "1000",
            "--ckpt",
            &run_url,
            "--ckpt-every",
            "5",
            "--log-every",
            "1",
            "--fault-hold",
            "20:1:before-save",
        ],
        "[rank 0] saving step 20",
    );
    let listed = runtime().block_on(async {
        list_checkpoints(&Store::from_url(&run_url).unwrap())
            .await
            .unwrap()
    });
    assert!(
        listed.iter().all(|c| c.step < 20 || !c.committed),
        "step 20 must not commit: {listed:?}"
    );
    assert_eq!(latest_step(run.path()), Some(15));
    // Every commit that exists is whole: every byte verifies.
    runtime().block_on(async {
        let store = Store::from_url(&run_url).unwrap();
        for c in listed.iter().filter(|c| c.committed) {
            let report = verify(&store, c.step, &VerifyOptions::default(), &|_| {})
                .await
                .unwrap();
            assert!(report.ok, "step {}: {:?}", c.step, report.faults);
        }
    });

    let out = train(3, run.path(), 40, &["--resume"]);
    assert_eq!(resumed_from(&out), 15);
    assert_identical(reference.path(), run.path());
}

#[test]
fn the_tiny_loss_falls_below_half_of_its_start() {
    let dir = tempdir();
    train(2, dir.path(), 40, &[]);
    let losses: Vec<f64> = runtime().block_on(async {
        let reader = CheckpointReader::open(&Store::from_url(&url(dir.path())).unwrap(), None)
            .await
            .unwrap();
        let global = reader.global_state().await.unwrap();
        serde_json::from_value(global["loss_history"].as_json().unwrap().clone()).unwrap()
    });
    assert_eq!(losses.len(), 40);
    let first = losses[0];
    let last5 = losses[35..].iter().sum::<f64>() / 5.0;
    assert!(
        last5 < first / 2.0,
        "loss went from {first} to {last5} (mean of the last 5 steps)"
    );
}

#[test]
fn sigterm_makes_a_final_save_and_exits_with_a_distinct_code() {
    let (run, reference) = (tempdir(), tempdir());
    let run_url = url(run.path());
    let mut launch = Running::start(
        2,
        &[
            "--steps",
            "100000",
            "--ckpt",
            &run_url,
            "--ckpt-every",
            "0",
            "--log-every",
            "1",
        ],
    );
    launch.read_until("[rank 0] step 5 loss");
    let launcher = launch.child.id() as i32;
    // SAFETY: kill(2) on the launcher this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(launcher, libc::SIGTERM) }, 0);
    let (status, seen) = launch.finish();
    assert_eq!(status.code(), Some(75), "{seen}");
    let stopped: u64 = seen
        .lines()
        .find_map(|l| l.split("stopped at step ").nth(1))
        .and_then(|r| r.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no stop line:\n{seen}"));
    assert!(stopped >= 5);
    assert_eq!(latest_step(run.path()), Some(stopped));

    // The stop lost nothing: continuing to stop + 5 equals an uninterrupted run.
    let target = stopped + 5;
    train(3, run.path(), target, &["--resume"]);
    train(1, reference.path(), target, &[]);
    assert_identical(reference.path(), run.path());
}

/// Whether `signal` waits, sent but not yet taken by a handler, on process `pid`
/// (either pending set of `/proc/PID/status`: the process's or its main thread's).
fn signal_pending(pid: i32, signal: i32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let bit = 1u64 << (signal - 1);
    status
        .lines()
        .filter_map(|l| l.strip_prefix("SigPnd:").or(l.strip_prefix("ShdPnd:")))
        .any(|mask| u64::from_str_radix(mask.trim(), 16).unwrap() & bit != 0)
}

/// A second SIGTERM means "now": a rank that got one and has not finished its final
/// save (here `--fault-hold` parks it before the save) exits at once with 128 + 15,
/// and nothing is saved.
#[test]
fn a_second_sigterm_exits_at_once_without_the_final_save() {
    let run = tempdir();
    let run_url = url(run.path());
    let mut launch = Running::start(
        1,
        &[
            "--steps",
            "100",
            "--ckpt",
            &run_url,
            "--fault-hold",
            "3:0:before-save",
        ],
    );
    launch.read_until("holds before saving step 3");
    let [pid] = launch.rank_pids()[..] else {
        panic!("not one rank pid:\n{}", launch.seen);
    };
    // A parked rank outlives a failed test: a rank that ignores the second signal is
    // killed after a minute (and the assertions below report it), and so is one left
    // behind by a panic (which drops `exited`).
    let (exited, watch) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if watch.recv_timeout(Duration::from_secs(60)).is_err() {
            // SAFETY: kill(2) on the rank, which has not exited (so not been reaped).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    // SAFETY: kill(2) on the rank this test started (through the launcher), parked
    // and not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    // Two signals sent before the first is taken merge into one: wait until the
    // handler has taken the first.
    let deadline = Instant::now() + Duration::from_secs(30);
    while signal_pending(pid, libc::SIGTERM) {
        assert!(Instant::now() < deadline, "SIGTERM never taken");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        ckpt_launch::proc_state(pid as u32).is_some_and(|s| s != 'Z'),
        "the first SIGTERM only asks for a drain:\n{}",
        launch.seen
    );
    // SAFETY: as above; the rank is still running.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let (status, seen) = launch.finish();
    // (An error here: the watchdog fired and is gone.)
    let _ = exited.send(());
    watchdog.join().unwrap();
    assert!(
        seen.contains("launch: rank 0 failed: exit status: 143"),
        "{seen}"
    );
    assert_eq!(status.code(), Some(143), "{seen}");
    assert_eq!(latest_step(run.path()), None, "{seen}");
}

/// The resume decision is one decision for the whole world. A byte flipped in the
/// middle of rank 0's data file of step 40 is read by some ranks of a 3-rank world and
/// not by others: before, ranks chose 30 and 40 on their own and the job could never
/// resume ("ranks found different newest checkpoints: [30, 30, 40]"). Now every rank
/// falls back to step 30 together, trains on, and ends bitwise equal to a run that
/// never failed.
#[test]
fn a_checkpoint_damaged_where_only_some_ranks_read_makes_the_whole_world_fall_back() {
    let (reference, run) = (tempdir(), tempdir());
    train(1, reference.path(), 60, &[]);
    train(2, run.path(), 40, &[]);

    // Rank 0's data file of step 40, wherever its save attempt put it.
    let step40 = run.path().join("step-00000040");
    let attempt = std::fs::read_dir(&step40)
        .unwrap()
        .flatten()
        .find(|e| e.file_type().unwrap().is_dir())
        .expect("step 40's attempt directory")
        .path();
    let data = std::fs::read_dir(&attempt)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("rank-00000-") && name.ends_with(".safetensors")
        })
        .expect("rank 0's data file");
    let mut bytes = std::fs::read(&data).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&data, bytes).unwrap();

    let output = train(3, run.path(), 60, &["--keep", "1", "--resume"]);
    assert_eq!(resumed_from(&output), 30, "{output}");
    assert!(output.contains("falling back"), "{output}");
    assert_eq!(latest_step(run.path()), Some(60));
    assert_identical(reference.path(), run.path());
}

#[test]
fn a_grace_that_is_not_a_number_of_seconds_is_a_usage_error_not_a_panic() {
    for grace in ["-1", "nan", "inf", "soon"] {
        let output = Command::new(BIN)
            .args([
                "launch",
                "--nproc",
                "1",
                &format!("--grace-secs={grace}"),
                "--",
            ])
            .args(["--preset", "tiny", "--steps", "1"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(2),
            "--grace-secs {grace}: {stderr}"
        );
        assert!(
            stderr.contains("--grace-secs"),
            "--grace-secs {grace}: {stderr}"
        );
        assert!(
            !stderr.contains("panicked"),
            "--grace-secs {grace}: {stderr}"
        );
    }
}

/// Every commit of the store under `dir`, in commit order, by its manifest.
fn manifests(dir: &Path) -> Vec<ckpt::Manifest> {
    runtime().block_on(async {
        let store = Store::from_url(&url(dir)).unwrap();
        let mut manifests = Vec::new();
        for commit in ckpt::catalog::commits(&store).await.unwrap() {
            manifests.push(ckpt::catalog::read_commit(&store, &commit).await.unwrap());
        }
        manifests
    })
}

/// Two replicas of two shards train the same bits as two ranks without replicas;
/// every save compares the replicas, which agree; one bit flipped in one replica's
/// memory right before a save makes that commit unhealthy, naming the rank, the
/// tensor, the box and the block; the replicated checkpoints resume on a world that
/// the replicas do not divide, past the unhealthy commit. With `--replica-mismatch
/// fail` that commit is refused instead.
#[test]
fn replicas_agree_and_a_bit_flipped_in_one_is_named_by_the_commit_of_its_save() {
    let (reference, run) = (tempdir(), tempdir());
    train(2, reference.path(), 30, &[]);
    // Rank 3 is replica 1 of shard 1: rank 1 writes that shard.
    let out = train(
        4,
        run.path(),
        20,
        &["--replicas", "2", "--fault-sdc", "10:3"],
    );
    assert!(out.contains("world 4 (2 replicas of 2 shards)"), "{out}");
    assert!(
        out.contains("fault: rank 3 (replica 1 of shard 1) flipped a bit of param/layers.0.weight before saving step 10"),
        "{out}"
    );
    let commits = manifests(run.path());
    let steps: Vec<u64> = commits.iter().map(|m| m.step).collect();
    assert_eq!(steps, [10, 20], "{out}");
    let flipped = commits[0].health.as_ref().expect("health recorded");
    assert!(!flipped.healthy, "{flipped:?}");
    assert!(flipped.nonfinite.is_empty(), "{flipped:?}");
    let [mismatch] = &flipped.replica_mismatches[..] else {
        panic!("one mismatch expected: {flipped:?}");
    };
    assert_eq!(mismatch.tensor, "param/layers.0.weight");
    assert_eq!((mismatch.written_by, &mismatch.disagree[..]), (1, &[3][..]));
    assert_eq!(mismatch.blocks, [0]);
    // Rows 16..32 of 32: shard 1 of 2.
    assert_eq!(mismatch.offsets, [16, 0]);
    assert!(
        flipped.reasons.iter().any(|r| r.contains("rank 3")),
        "{flipped:?}"
    );
    let agreed = commits[1].health.as_ref().expect("health recorded");
    assert!(agreed.healthy, "{agreed:?}");
    // Every box of the second replica group compared: 6 tensors x 3 x 2 shards.
    assert_eq!(agreed.replicas_compared, 36, "{agreed:?}");
    for metric in ["loss", "grad_norm"] {
        let value = agreed.metrics.get(metric).expect("recorded").0;
        assert!(value.is_finite() && value > 0.0, "{metric} {value}");
    }

    // Three ranks: no replicas; the resume takes the newest healthy commit.
    let out = train(3, run.path(), 30, &["--resume", "--replicas", "2"]);
    assert!(
        out.contains("world 3 (no replicas: 2 does not divide the world)"),
        "{out}"
    );
    assert_eq!(resumed_from(&out), 20);
    assert_identical(reference.path(), run.path());

    // `--replica-mismatch fail`: the commit of step 10 is refused, a failed save
    // that training survives.
    let refused = tempdir();
    let out = train(
        4,
        refused.path(),
        20,
        &[
            "--replicas",
            "2",
            "--replica-mismatch",
            "fail",
            "--fault-sdc",
            "10:3",
        ],
    );
    assert!(
        out.contains("checkpoint of step 10 failed")
            && out.contains("replica_mismatch is \"fail\""),
        "{out}"
    );
    let steps: Vec<u64> = manifests(refused.path()).iter().map(|m| m.step).collect();
    assert_eq!(steps, [20], "{out}");
}

/// A NaN written into one rank's parameters after a saved step: that commit is
/// unhealthy, the next step finds the NaN, and every rank rolls back in place to the
/// commit before it, passing over the unhealthy one, and trains on to the same bits
/// as a run without the fault. A poison that every retry meets again stops the job
/// after `--max-rollbacks` rollbacks in a row, naming the step.
#[test]
fn a_nan_rolls_back_to_the_newest_healthy_commit_and_a_persistent_one_stops_the_job() {
    let (reference, run, poisoned) = (tempdir(), tempdir(), tempdir());
    train(2, reference.path(), 30, &[]);
    let out = train(3, run.path(), 30, &["--fault-nan", "20:2"]);
    assert!(
        out.contains("skipped unhealthy checkpoint step 20: tensor \"param/layers.2.bias\" holds 1 non-finite element (written by rank 2)"),
        "{out}"
    );
    assert!(
        out.contains("rolled back from step 20 to step 10: non-finite parameters entering step 21"),
        "{out}"
    );
    let health: Vec<(u64, Option<bool>)> = manifests(run.path())
        .iter()
        .map(|m| (m.step, m.health_status().healthy()))
        .collect();
    assert_eq!(
        health,
        [
            (10, Some(true)),
            (20, Some(false)),
            (20, Some(true)),
            (30, Some(true))
        ]
    );
    assert_identical(reference.path(), run.path());

    let target = url(poisoned.path());
    let output = Command::new(BIN)
        .args(["launch", "--nproc", "2", "--"])
        .args(["--preset", "tiny", "--seed", "7", "--timeout-secs", "30"])
        .args(["--steps", "30", "--ckpt", &target, "--ckpt-every", "10"])
        .args(["--fault-nan", "15:1:persistent", "--max-rollbacks", "2"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(!output.status.success(), "{stdout}");
    assert_eq!(
        stdout
            .matches("rolled back from step 15 to step 10")
            .count(),
        2,
        "{stdout}"
    );
    let all = format!("{stdout}{stderr}");
    assert!(
        all.contains("step 15 went bad again after 2 rollbacks in a row to step 10 (non-finite parameters entering step 16); stopping (--max-rollbacks 2)"),
        "{all}"
    );
    assert_eq!(latest_step(poisoned.path()), Some(10));
}

/// The figures of the resume line's load, summed over the world.
#[derive(Debug)]
struct LoadFigures {
    /// Loaded cooperatively (rather than rank by rank).
    cooperative: bool,
    /// Bytes read from the store's data files.
    from_store: u64,
    /// The checkpoint's bytes the world needed, each counted once (cooperative).
    unique: Option<u64>,
    /// Bytes passed between ranks (cooperative).
    from_peers: Option<u64>,
    list: u64,
    get: u64,
    /// Which ranks listed: `rank 0 only`, `ranks 0, 1, 2`.
    listed_by: String,
}

fn load_figures(output: &str) -> LoadFigures {
    let line = output
        .lines()
        .find(|l| l.contains("resumed from step "))
        .unwrap_or_else(|| panic!("no resume line in:\n{output}"));
    let number = |text: &str, after: &str| -> Option<u64> {
        text.split(after)
            .nth(1)?
            .split([' ', ')', ','])
            .next()?
            .parse()
            .ok()
    };
    let (cooperative, load) = match line.split_once("; cooperative load: ") {
        Some((_, load)) => (true, load),
        None => (false, line.split_once("; load: ").expect(line).1),
    };
    let count = |kind: &str| -> u64 {
        let before = load.split(&format!(" {kind}")).next().expect(line);
        before.rsplit(' ').next().unwrap().parse().expect(line)
    };
    LoadFigures {
        cooperative,
        from_store: load
            .split(" ")
            .next()
            .and_then(|n| n.parse().ok())
            .expect(line),
        unique: number(load, "from the store (").filter(|_| cooperative),
        from_peers: load
            .split(" bytes from peers")
            .next()
            .and_then(|t| t.rsplit(' ').next()?.parse().ok())
            .filter(|_| cooperative),
        list: count("LIST"),
        get: count("GET"),
        listed_by: load
            .split("(by ")
            .nth(1)
            .and_then(|t| t.split(')').next())
            .expect(line)
            .to_string(),
    }
}

/// A world of two replicas of two shards resumes on the same world, on three ranks
/// and on three shards of two replicas: cooperatively, rank 0 alone lists and reads
/// the commit, and the world reads from the store exactly the unique bytes it needs
/// (the replicas' and neighbours' shares pass between the ranks); rank by rank
/// (`--cooperative-load=false`) every rank lists and each replica reads its shard
/// again. Both end bitwise equal to a run that never stopped. A data file gone from
/// the commit is found by the rank that owns its blocks, and the whole world falls
/// back to the commit before it with a line naming that rank.
#[test]
fn replicas_resume_cooperatively_reading_each_byte_from_the_store_once() {
    let reference = tempdir();
    train(4, reference.path(), 40, &["--replicas", "2"]);
    for after in [4, 3, 6] {
        let mut store_bytes = Vec::new();
        for cooperative in [true, false] {
            let run = tempdir();
            train(4, run.path(), 20, &["--replicas", "2"]);
            let flag = format!("--cooperative-load={cooperative}");
            let out = train(
                after,
                run.path(),
                40,
                &["--resume", "--replicas", "2", &flag],
            );
            assert_eq!(resumed_from(&out), 20, "{out}");
            let load = load_figures(&out);
            assert_eq!(load.cooperative, cooperative, "{load:?}");
            assert!(load.get > 0, "{load:?}");
            if cooperative {
                assert_eq!(
                    Some(load.from_store),
                    load.unique,
                    "{after} ranks: {load:?}"
                );
                assert!(load.from_peers > Some(0), "{after} ranks: {load:?}");
                assert_eq!(
                    (load.list, load.listed_by.as_str()),
                    (1, "rank 0 only"),
                    "{load:?}"
                );
            } else {
                let everyone = (0..after).map(|r| r.to_string()).collect::<Vec<_>>();
                assert_eq!(load.listed_by, format!("ranks {}", everyone.join(", ")));
                assert!(load.list >= after as u64, "{load:?}");
            }
            store_bytes.push(load.from_store);
            assert_identical(reference.path(), run.path());
        }
        let [together, alone] = store_bytes[..] else {
            unreachable!()
        };
        // Rank by rank, each replica reads its shard again, and a new shard that
        // straddles two saved ones reads both of their blocks: at least twice.
        assert!(
            alone >= 2 * together,
            "{after} ranks: {alone} vs {together}"
        );
        if after == 4 {
            assert_eq!(alone, 2 * together);
        }
    }

    // Rank 1's data file of step 20 removed: its owner's read fails, every rank
    // falls back to step 10 together.
    let run = tempdir();
    train(4, run.path(), 20, &["--replicas", "2"]);
    let attempt = std::fs::read_dir(run.path().join("step-00000020"))
        .unwrap()
        .flatten()
        .find(|e| e.file_type().unwrap().is_dir())
        .expect("step 20's attempt directory")
        .path();
    let data = std::fs::read_dir(&attempt)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("rank-00001-") && name.ends_with(".safetensors")
        })
        .expect("rank 1's data file");
    std::fs::remove_file(&data).unwrap();
    let out = train(4, run.path(), 40, &["--resume", "--replicas", "2"]);
    assert!(
        out.contains(
            "checkpoint step 20 does not load (reading its blocks from the store failed on rank "
        ) && out.contains("rank-00001-")
            && out.contains("falling back to the commit before it"),
        "{out}"
    );
    assert_eq!(resumed_from(&out), 10, "{out}");
    assert_identical(reference.path(), run.path());
}

/// `final host_bytes_held {JSON} (rank R)` lines: each rank's report, parsed.
fn final_holdings(output: &str) -> Vec<ckpt::HostBytesHeld> {
    output
        .lines()
        .filter_map(|l| l.split("final host_bytes_held ").nth(1))
        .map(|rest| {
            let json = rest.rsplit_once(" (rank ").map_or(rest, |(j, _)| j);
            serde_json::from_str(json).unwrap_or_else(|e| panic!("{json}: {e}"))
        })
        .collect()
}

#[test]
fn a_fixed_world_commits_its_snapshots_in_memory_inside_the_budget_with_the_same_weights() {
    let (reference, dir) = (tempdir(), tempdir());
    train(2, reference.path(), 20, &[]);
    let budget = 4u64 << 20;
    let output = train(
        3,
        dir.path(),
        20,
        &[
            "--snapshot-every",
            "2",
            "--host-memory-budget",
            &budget.to_string(),
        ],
    );
    // Every snapshot before the last step, a step that saves to the store included,
    // is committed; with no control plane, in the ranks' memory only.
    for step in [2, 10, 18] {
        let line = output
            .lines()
            .find(|l| l.contains(&format!("[rank 0] snapshot step {step} committed (")))
            .unwrap_or_else(|| panic!("snapshot {step} not committed:\n{output}"));
        assert!(
            line.contains("held in memory only (no control plane)"),
            "{line}"
        );
    }
    assert!(
        !output.contains("snapshot step 20"),
        "none at the last step:\n{output}"
    );
    let held = final_holdings(&output);
    assert_eq!(held.len(), 3, "every rank reports:\n{output}");
    for h in &held {
        assert_eq!(h.budget, Some(budget));
        assert!(h.peak <= budget && h.snapshots > 0, "{h:?}");
        // A fixed world keeps no copies of store saves (no one would recover from
        // them); it holds its snapshot and a replica of its predecessor's.
        assert_eq!(h.copies, 0, "{h:?}");
        assert!(h.snapshot_replicas > 0, "{h:?}");
    }
    assert!(
        line_with_saving(&output).contains("host_bytes_held {\"budget\":4194304"),
        "{output}"
    );
    assert_identical(reference.path(), dir.path());
}

/// Rank 0's first `saving step` line.
fn line_with_saving(output: &str) -> &str {
    output
        .lines()
        .find(|l| l.contains("[rank 0] saving step "))
        .unwrap_or_else(|| panic!("no save line:\n{output}"))
}
