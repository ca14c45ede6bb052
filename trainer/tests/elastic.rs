//! Elastic recovery end to end: real launcher and rank processes of `ckpt-train`, a
//! coordinator (hosted by a launcher, or the standalone `ckpt coordinator`), real
//! SIGKILL, SIGSTOP and SIGTERM.
//!
//! The oracle is the same as for every recovery test: the final checkpoint equals,
//! bitwise, the one of a failure-free run (deterministic mode makes the weights
//! independent of the world size and of the recovery history). Faults happen at known
//! points: `--fault-hold` parks one rank at a step (the others block in their next
//! collective), and the test acts when it sees that rank's log line.

mod common;

use common::{assert_identical, runtime, tempdir, url};

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use ckpt::Commit;
use ckpt::storage::Store;

const BIN: &str = env!("CARGO_BIN_EXE_ckpt-train");
/// Generous bound on any one wait: these machines are small and shared.
const WAIT: Duration = Duration::from_secs(120);

/// One elastic job at a time: each runs 4 to 6 rank processes with heartbeat
/// deadlines, and several at once on a 2-core machine would starve them into false
/// failures (which the tests would then, rightly, report).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The control plane a test's launchers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plane {
    /// The coordinator the launcher hosts.
    Coordinator,
    /// The test command's 3-member etcd cluster (`CKPT_TEST_ETCD`), no coordinator.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    Etcd,
}

impl Plane {
    /// `launch_args` plus what selects this plane (a fresh job id named after
    /// `name` for etcd, whose keys outlive a test).
    fn args(self, launch_args: &[&str], name: &str) -> Vec<String> {
        let mut v: Vec<String> = launch_args.iter().map(|s| s.to_string()).collect();
        if self == Plane::Etcd {
            v.extend([
                "--rdzv".into(),
                etcd_url(),
                "--job-id".into(),
                unique_job(name),
            ]);
        }
        v
    }
}

/// The test command's etcd cluster.
fn etcd_url() -> String {
    // The etcd tests check `has(Capability::Etcd)` first.
    ckpt_testkit::env("CKPT_TEST_ETCD")
}

/// A job id no other run used (etcd keeps a job's keys).
fn unique_job(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{}-{nanos}", std::process::id())
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a process this test started (directly or through the
    // launcher, whose `launch: rank R pid P` lines name it).
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig}) failed");
}

/// A launcher whose stdout and stderr lines arrive, in order per stream, on a channel.
struct Launch {
    child: Child,
    lines: Receiver<String>,
    seen: String,
}

impl Launch {
    fn start(launch_args: &[&str], train_args: &[&str]) -> Launch {
        let mut child = Command::new(BIN)
            .arg("launch")
            .args(launch_args)
            .arg("--")
            .args(["--preset", "tiny", "--seed", "7", "--timeout-secs", "30"])
            .args(train_args)
            // Replica pulls are logged: a test can wait for one before a kill; and why
            // a rank did not rebuild from memory, when a test expects it to.
            .env(
                "RUST_LOG",
                "warn,ckpt::copies=debug,ckpt_trainer::train=info",
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, rx) = channel();
        for (stream, tag) in [
            (
                Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
                "",
            ),
            (Box::new(child.stderr.take().unwrap()), "stderr: "),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(format!("{tag}{line}")).is_err() {
                        break;
                    }
                }
            });
        }
        Launch {
            child,
            lines: rx,
            seen: String::new(),
        }
    }

    /// Reads lines until one satisfies `want`; returns it.
    fn expect(&mut self, what: &str, want: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push_str(&line);
                    self.seen.push('\n');
                    if want(&line) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!(
                        "no line {what} within {WAIT:?}; output so far:\n{}",
                        self.seen
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!(
                        "launcher ended without a line {what}; output:\n{}",
                        self.seen
                    )
                }
            }
        }
    }

    /// The times between rank 0's successive `step N loss` lines, read until `steps`
    /// steps were seen or `stop` says so (asked before each line, with the last step
    /// seen, 0 before the first).
    fn step_times(&mut self, steps: usize, mut stop: impl FnMut(u64) -> bool) -> Vec<Duration> {
        let mut last: Option<Instant> = None;
        let mut times = Vec::new();
        let mut step = 0;
        while times.len() < steps && !stop(step) {
            let line = self.expect("of a step", |l| {
                l.contains("[rank 0] step ") && l.contains(" loss ")
            });
            step = line
                .split("[rank 0] step ")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(step);
            let now = Instant::now();
            if let Some(last) = last {
                times.push(now - last);
            }
            last = Some(now);
        }
        times
    }

    /// Reads everything up to the end and reaps the launcher.
    fn finish(self) -> (ExitStatus, String) {
        self.finish_within(WAIT)
    }

    /// [`Launch::finish`], failing the test (and killing the launcher) when the
    /// launcher has not ended within `bound`.
    fn finish_within(mut self, bound: Duration) -> (ExitStatus, String) {
        let deadline = Instant::now() + bound;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push_str(&line);
                    self.seen.push('\n');
                }
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    panic!("launcher still running after {bound:?}:\n{}", self.seen);
                }
            }
        }
        (self.child.wait().unwrap(), std::mem::take(&mut self.seen))
    }
}

/// A test that fails (a panic in `expect`) must not leave its job running: the
/// launcher and its ranks would train on, alone, past the end of the test run.
impl Drop for Launch {
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        for line in self.lines.try_iter() {
            self.seen.push_str(&line);
            self.seen.push('\n');
        }
        // `launch: node N with R ranks, …, process group G`: the ranks' group.
        let group = self.seen.lines().find_map(|l| {
            l.split("process group ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<i32>()
                .ok()
        });
        if let Some(group) = group {
            // SAFETY: kill(2) with a negative pid signals that process group; it
            // reads and writes no memory of ours.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `launch: rank R pid P` lines: (label, pid) in the order printed.
fn pids(output: &str) -> Vec<(usize, i32)> {
    output
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("launch: rank ")?;
            let (label, rest) = rest.split_once(" pid ")?;
            let pid = rest.split_whitespace().next()?;
            Some((label.parse().ok()?, pid.parse().ok()?))
        })
        .collect()
}

fn pid_of(output: &str, label: usize) -> i32 {
    pids(output)
        .into_iter()
        .rev()
        .find(|(l, _)| *l == label)
        .unwrap_or_else(|| panic!("no pid for rank {label} in:\n{output}"))
        .1
}

/// The launcher label of the process that printed `line` (`[rank L] …`).
fn label_of(line: &str) -> usize {
    line.trim_start_matches("stderr: ")
        .strip_prefix("[rank ")
        .and_then(|l| l.split(']').next())
        .and_then(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("no [rank L] prefix on {line:?}"))
}

/// The reference: the same training, failure-free, on one fixed world.
fn reference(dir: &Path, steps: u64) {
    let output = Command::new(BIN)
        .args(["launch", "--nproc", "2", "--"])
        .args(["--preset", "tiny", "--seed", "7", "--timeout-secs", "30"])
        .args(["--steps", &steps.to_string(), "--ckpt", &url(dir)])
        .args(["--ckpt-every", "5"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "reference run failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn commits(dir: &Path) -> Vec<Commit> {
    runtime().block_on(async {
        ckpt::catalog::commits(&Store::from_url(&url(dir)).unwrap())
            .await
            .unwrap()
    })
}

fn train_args(dir: &Path, steps: u64) -> Vec<String> {
    vec![
        "--steps".into(),
        steps.to_string(),
        "--ckpt".into(),
        url(dir),
        "--ckpt-every".into(),
        "5".into(),
        "--log-every".into(),
        "1".into(),
    ]
}

/// A test's directories and arguments: the failure-free reference trained to `steps`
/// in one directory, and the arguments of the elastic run (into the other) that must
/// end with the same weights.
fn scenario(steps: u64) -> (tempfile::TempDir, tempfile::TempDir, Vec<String>) {
    let (reference_dir, dir) = (tempdir(), tempdir());
    reference(reference_dir.path(), steps);
    let args = train_args(dir.path(), steps);
    (reference_dir, dir, args)
}

/// The first line of `output` that contains `needle`.
fn line_with<'a>(output: &'a str, needle: &str) -> &'a str {
    output
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line with {needle:?}:\n{output}"))
}

fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Kills (SIGKILL) the rank that holds at `hold`, and checks that the other three
/// finish in the same processes, on three ranks, with the reference's weights.
fn kill_one_of_four(hold: &str, also_kill_during_rendezvous: bool, plane: Plane) {
    let (reference_dir, dir, mut args) = scenario(30);
    args.extend(["--fault-hold".into(), hold.into()]);
    let launch_args = plane.args(&["--nproc", "4", "--min-ranks", "2"], "kill");
    let mut launch = Launch::start(&as_strs(&launch_args), &as_strs(&args));
    let held = launch.expect("where a rank holds", |l| l.contains("fault: rank "));
    let victim = label_of(&held);
    if !also_kill_during_rendezvous {
        // The victim's successor pulls its copy of step 10 in the background; the
        // kill comes once it has, or recovering from memory would be a race.
        let successor = format!("[rank {}]", (victim + 1) % 4);
        let replica = format!("rank: {victim} }}");
        let pulled = |l: &str| {
            l.contains(&successor)
                && l.contains("replica pulled")
                && l.contains("step-00000010")
                && l.contains(&replica)
        };
        if !launch.seen.lines().any(pulled) {
            launch.expect("the successor's replica of the victim's copy", pulled);
        }
    }
    signal(pid_of(&launch.seen, victim), libc::SIGKILL);
    let mut killed = vec![victim];
    if also_kill_during_rendezvous {
        // A second kill while the survivors re-form the world.
        let second = (victim + 1) % 4;
        signal(pid_of(&launch.seen, second), libc::SIGKILL);
        killed.push(second);
    }
    let started_pids = pids(&launch.seen);
    let (status, output) = launch.finish();
    assert!(status.success(), "the survivors must finish:\n{output}");
    assert_eq!(
        pids(&output),
        started_pids,
        "no rank may be (re)started: the survivors go on in their processes\n{output}"
    );
    let world = 4 - killed.len();
    assert!(
        output.contains("recovery: generation ") && output.contains(&format!("world {world}")),
        "a recovery onto {world} ranks must be reported:\n{output}"
    );
    assert!(
        output.contains("launch: recovery: generation 1 ended, generation 2 formed with world"),
        "the launcher summarizes the recovery in one line:\n{output}"
    );
    // Every survivor rebuilds from memory when the lost rank's rows survive in its
    // successor's replica; two neighbours lost at once take the last rows with
    // them, and whoever needs those reads the store.
    let resumed = line_with(&output, "resumed from step");
    if also_kill_during_rendezvous {
        assert!(
            resumed.contains("read from the store on the others"),
            "rows of two lost neighbours come from the store: {resumed}\n{output}"
        );
    } else {
        assert!(
            resumed.contains("rows rebuilt from memory on 3 of 3 ranks"),
            "one lost rank loses no rows from memory: {resumed}\n{output}"
        );
    }
    for label in (0..4).filter(|l| !killed.contains(l)) {
        assert!(
            output.contains(&format!("[rank {label}] done: step 30")),
            "survivor {label} must finish in its own process:\n{output}"
        );
    }
    assert_identical(reference_dir.path(), dir.path());
}

#[test]
fn a_rank_killed_mid_step_leaves_three_survivors_that_finish_with_the_reference_weights() {
    let _serial = one_at_a_time();
    kill_one_of_four("12:2:before-save", false, Plane::Coordinator);
}

#[test]
fn a_rank_killed_while_its_async_save_runs_is_recovered_the_same_way() {
    let _serial = one_at_a_time();
    kill_one_of_four("10:1:after-save", false, Plane::Coordinator);
}

#[test]
fn a_second_kill_during_the_rendezvous_of_the_first_recovery_is_recovered_too() {
    let _serial = one_at_a_time();
    kill_one_of_four("12:3:before-save", true, Plane::Coordinator);
}

#[test]
fn a_stopped_rank_is_detected_by_heartbeat_and_fenced_when_it_resumes() {
    let _serial = one_at_a_time();
    stopped_rank(Plane::Coordinator);
}

fn stopped_rank(plane: Plane) {
    let (reference_dir, dir, mut args) = scenario(30);
    args.extend(["--fault-step-pause-ms".into(), "30".into()]);
    let launch_args = plane.args(
        &[
            "--nproc",
            "4",
            "--min-ranks",
            "2",
            "--heartbeat-timeout-secs",
            "2",
        ],
        "stop",
    );
    let mut launch = Launch::start(&as_strs(&launch_args), &as_strs(&args));
    launch.expect("step 12", |l| l.contains("] step 12 loss"));
    let victim = 2;
    let pid = pid_of(&launch.seen, victim);
    let stopped_at = Instant::now();
    signal(pid, libc::SIGSTOP);
    let before: Vec<u64> = commits(dir.path()).iter().map(|c| c.step).collect();
    let line = launch.expect("a recovery", |l| l.contains("recovery: generation"));
    let detected = stopped_at.elapsed();
    assert!(line.contains("world 3"), "{line}");
    assert!(
        detected < Duration::from_secs(30),
        "a stopped rank must be found by its missing heartbeats, not by the 30 s collective timeout ({detected:?})"
    );
    signal(pid, libc::SIGCONT);
    let (status, output) = launch.finish();
    assert!(status.success(), "the survivors must finish:\n{output}");
    // The resumed process either learns that it is stale and leaves, or (when its
    // own collective error reaches it first) joins again as a new, waiting member,
    // and the world grows back at the next checkpoint. Either way it never trains
    // on in the generation it was dropped from.
    let left =
        output.contains(&format!("[rank {victim}] error: member")) && output.contains("stale");
    let rejoined = output.contains("grow: 1 waiting member")
        && output.contains(&format!("[rank {victim}] done: step 30"));
    assert!(
        left || rejoined,
        "the resumed rank must leave as stale or rejoin as a new member:\n{output}"
    );
    // Nothing the stale rank's generation wrote after the stop was committed: every
    // commit of generation 1 (run id `…-e1`) predates it.
    for commit in commits(dir.path()) {
        let manifest_gen1 = commit_run_id(dir.path(), &commit).ends_with("-e1");
        if manifest_gen1 {
            // Generation 1 needs the stopped rank's part for every step it commits,
            // and that rank was stopped at step 12 or 13.
            assert!(
                commit.step <= 12,
                "step {} committed by the stale generation after the stop (committed before: {before:?})",
                commit.step
            );
        }
    }
    assert_identical(reference_dir.path(), dir.path());
}

/// The state letter of `/proc/PID/stat`, `None` once the process is gone (the
/// launcher's own reading).
fn proc_state(pid: i32) -> Option<char> {
    ckpt_launch::proc_state(pid as u32)
}

/// SIGKILLs a process this test stopped when the test ends, passed or failed, so
/// that no stopped rank outlives it.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if proc_state(self.0).is_some_and(|s| s != 'Z') {
            // SAFETY: kill(2) on a rank process this test stopped; if it is gone,
            // the call fails harmlessly.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
}

#[test]
fn a_rank_stopped_for_good_is_killed_once_the_job_finishes_and_the_launcher_exits_0() {
    let _serial = one_at_a_time();
    let (reference_dir, dir, mut args) = scenario(30);
    args.extend(["--fault-step-pause-ms".into(), "30".into()]);
    let mut launch = Launch::start(
        &[
            "--nproc",
            "4",
            "--min-ranks",
            "2",
            "--heartbeat-timeout-secs",
            "2",
            "--grace-secs",
            "2",
        ],
        &as_strs(&args),
    );
    launch.expect("step 12", |l| l.contains("] step 12 loss"));
    let victim = 2;
    let pid = pid_of(&launch.seen, victim);
    let _cleanup = KillOnDrop(pid);
    // Stopped for good: no SIGCONT ever comes, as for a rank stuck in a GPU kernel.
    signal(pid, libc::SIGSTOP);
    launch.expect("a recovery without the stopped rank", |l| {
        l.contains("recovery: generation") && l.contains("world 3")
    });
    launch.expect("the survivors' final step", |l| l.contains("done: step 30"));
    // The grace (2 s) and a generous margin for a loaded machine; before, the
    // launcher waited for the stopped rank forever.
    let (status, output) = launch.finish_within(Duration::from_secs(60));
    assert!(
        status.success(),
        "a job that finished exits 0 whatever it survived:\n{output}"
    );
    let killed = line_with(&output, &format!("launch: rank {victim} pid {pid} "));
    assert!(
        killed.contains("after the job ended") && killed.contains("SIGKILL"),
        "the launcher names the rank it kills and why: {killed}"
    );
    assert!(
        output.contains("launch: the job finished"),
        "a successful end is logged as such:\n{output}"
    );
    assert!(
        !output.contains("job shut down"),
        "a finished job is not reported as shut down:\n{output}"
    );
    assert!(
        proc_state(pid).is_none(),
        "the launcher reaps the rank it killed (state {:?})",
        proc_state(pid)
    );
    assert_identical(reference_dir.path(), dir.path());
}

fn commit_run_id(dir: &Path, commit: &Commit) -> String {
    runtime().block_on(async {
        let store = Store::from_url(&url(dir)).unwrap();
        ckpt::catalog::read_commit(&store, commit)
            .await
            .unwrap()
            .attempt
            .unwrap_or_default()
    })
}

/// Starts `ckpt coordinator` and returns it with the address it listens on.
fn coordinator(listen: &str, job: &str) -> (Child, String) {
    let mut child = Command::new(common::ckpt_cli())
        .args(["coordinator", "--listen", listen, "--job", job])
        // The job's two ranks are its whole world: no last call waits for more.
        .args(["--min-ranks", "2", "--max-ranks", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let addr = first
        .trim()
        .strip_prefix("coordinator: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_string();
    (child, addr)
}

#[test]
fn a_restarted_standalone_coordinator_lets_training_go_on() {
    let _serial = one_at_a_time();
    let (reference_dir, dir) = (tempdir(), tempdir());
    reference(reference_dir.path(), 60);
    let (mut first, addr) = coordinator("127.0.0.1:0", "restart-test");
    let rdzv = format!("tcp://{addr}");
    let mut args = train_args(dir.path(), 60);
    args.extend(["--fault-step-pause-ms".into(), "40".into()]);
    let mut launch = Launch::start(
        &[
            "--nproc",
            "2",
            "--min-ranks",
            "2",
            "--rdzv",
            &rdzv,
            "--job-id",
            "restart-test",
        ],
        &as_strs(&args),
    );
    launch.expect("step 10", |l| l.contains("] step 10 loss"));
    first.kill().unwrap();
    first.wait().unwrap();
    let (mut second, _) = coordinator(&addr, "restart-test");
    let (status, output) = launch.finish();
    let _ = second.kill();
    let _ = second.wait();
    assert!(
        status.success(),
        "training must survive the coordinator's restart:\n{output}"
    );
    assert!(output.contains("done: step 60"), "{output}");
    assert_identical(reference_dir.path(), dir.path());
}

/// Launcher flags of node `id` of a two-node job (`--rdzv`: join that coordinator;
/// none: host it).
fn node_args(id: usize, job: &str, rdzv: Option<&str>) -> Vec<String> {
    let mut v: Vec<String> = ["--nproc", "2", "--nnodes", "1:2", "--min-ranks", "2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend([
        "--node-id".into(),
        id.to_string(),
        "--job-id".into(),
        job.into(),
    ]);
    if let Some(r) = rdzv {
        v.extend(["--rdzv".to_string(), r.to_string()]);
    }
    v
}

/// The `tcp://` address of the coordinator a launcher hosts, from its first line.
fn hosted_coordinator(launch: &mut Launch) -> String {
    let header = launch.expect("the coordinator's address", |l| l.contains("coordinator "));
    let addr = header
        .split("coordinator ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap();
    format!("tcp://{addr}")
}

#[test]
fn a_node_lost_whole_is_survived_and_its_relaunch_grows_the_world_back() {
    let _serial = one_at_a_time();
    node_lost(Plane::Coordinator);
}

fn node_lost(plane: Plane) {
    let (reference_dir, dir, mut args) = scenario(200);
    args.extend(["--fault-step-pause-ms".into(), "40".into()]);
    let args = as_strs(&args);
    let (mut node0, rdzv, job) = match plane {
        Plane::Coordinator => {
            let mut node0 = Launch::start(&as_strs(&node_args(0, "two-nodes", None)), &args);
            let rdzv = hosted_coordinator(&mut node0);
            (node0, rdzv, "two-nodes".to_string())
        }
        Plane::Etcd => {
            let (rdzv, job) = (etcd_url(), unique_job("two-nodes"));
            let node0 = Launch::start(&as_strs(&node_args(0, &job, Some(&rdzv))), &args);
            (node0, rdzv, job)
        }
    };
    let mut node1 = Launch::start(&as_strs(&node_args(1, &job, Some(&rdzv))), &args);
    node0.expect("a world of 4", |l| l.contains("world 4"));
    // Lose node 1 whole: its launcher and every rank it started.
    node1.expect("node 1's ranks", |l| l.contains("launch: rank 3 pid"));
    for (_, pid) in pids(&node1.seen) {
        signal(pid, libc::SIGKILL);
    }
    signal(node1.child.id() as i32, libc::SIGKILL);
    let _ = node1.finish();
    node0.expect("recovery onto node 0 alone", |l| {
        l.contains("recovery: generation") && l.contains("world 2")
    });
    // Relaunch node 1: the world grows back at a checkpoint boundary.
    let node1 = Launch::start(&as_strs(&node_args(1, &job, Some(&rdzv))), &args);
    node0.expect("the world grown back to 4", |l| {
        l.contains("generation") && l.contains("world 4") && l.contains("grow")
    });
    let (status0, output0) = node0.finish();
    let (status1, output1) = node1.finish();
    assert!(status0.success(), "node 0:\n{output0}");
    assert!(status1.success(), "node 1 (relaunched):\n{output1}");
    assert_identical(reference_dir.path(), dir.path());
}

#[test]
fn a_moment_with_no_member_connected_does_not_end_a_job_that_can_go_on() {
    let _serial = one_at_a_time();
    let (reference_dir, dir, mut args) = scenario(200);
    args.extend(["--fault-step-pause-ms".into(), "40".into()]);
    let args = as_strs(&args);
    let job = "no-member";
    let mut node0 = Launch::start(&as_strs(&node_args(0, job, None)), &args);
    let rdzv = hosted_coordinator(&mut node0);
    let mut node1 = Launch::start(&as_strs(&node_args(1, job, Some(&rdzv))), &args);
    node0.expect("a world of 4", |l| l.contains("world 4"));
    // Lose node 1 whole; node 0's two ranks go on alone.
    node1.expect("node 1's ranks", |l| l.contains("launch: rank 3 pid"));
    for (_, pid) in pids(&node1.seen) {
        signal(pid, libc::SIGKILL);
    }
    signal(node1.child.id() as i32, libc::SIGKILL);
    let _ = node1.finish();
    node0.expect("recovery onto node 0 alone", |l| {
        l.contains("recovery: generation") && l.contains("world 2")
    });
    node0.expect("a save after the recovery", |l| l.contains("] saving step"));
    // Then node 0's ranks die too: for a moment no member of any node is connected.
    for (_, pid) in pids(&node0.seen) {
        signal(pid, libc::SIGKILL);
    }
    // In whichever order the launcher reaps them (`expect` reads on from its last
    // match: waiting for rank 0's line, then rank 1's, hung when rank 1 came first).
    let mut gone = [false, false];
    while !gone.iter().all(|g| *g) {
        let line = node0.expect("node 0's ranks gone", |l| {
            l.starts_with("launch: rank ") && l.contains(" failed")
        });
        for (label, seen) in gone.iter_mut().enumerate() {
            *seen |= line.starts_with(&format!("launch: rank {label} failed"));
        }
    }
    node0.expect("node 0 serving the coordinator on", |l| {
        l.contains("serving the job's coordinator")
    });
    // Node 1 comes back: the coordinator node 0 hosts still serves the job, which
    // goes on from its newest commit.
    let node1 = Launch::start(&as_strs(&node_args(1, job, Some(&rdzv))), &args);
    let (status1, output1) = node1.finish();
    assert!(
        status1.success(),
        "node 1 rejoins and finishes the job:\n{output1}"
    );
    assert!(output1.contains("done: step 200"), "{output1}");
    let (status0, output0) = node0.finish();
    assert!(
        status0.success(),
        "the job finished, so the launcher hosting its coordinator exits 0:\n{output0}"
    );
    assert_identical(reference_dir.path(), dir.path());
}

#[test]
fn sigterm_to_one_node_makes_a_final_save_and_the_other_node_goes_on() {
    let _serial = one_at_a_time();
    let (reference_dir, dir, mut args) = scenario(80);
    args.extend(["--fault-step-pause-ms".into(), "40".into()]);
    let args = as_strs(&args);
    let mut node0 = Launch::start(&as_strs(&node_args(0, "term", None)), &args);
    let rdzv = hosted_coordinator(&mut node0);
    let node1 = Launch::start(&as_strs(&node_args(1, "term", Some(&rdzv))), &args);
    node0.expect("a world of 4", |l| l.contains("world 4"));
    node0.expect("step 20", |l| l.contains("] step 20 loss"));
    let committed_before = commits(dir.path()).len();
    signal(node1.child.id() as i32, libc::SIGTERM);
    let (status1, output1) = node1.finish();
    assert_eq!(
        status1.code(),
        Some(75),
        "the preempted node stops after its final save:\n{output1}"
    );
    assert!(
        commits(dir.path()).len() > committed_before,
        "the preempted node's ranks helped commit a final checkpoint"
    );
    let (status0, output0) = node0.finish();
    assert!(status0.success(), "node 0 goes on alone:\n{output0}");
    assert!(output0.contains("world 2"), "{output0}");
    assert_identical(reference_dir.path(), dir.path());
}

#[test]
fn a_training_loop_stuck_in_a_live_process_is_found_by_its_progress_and_dropped() {
    let _serial = one_at_a_time();
    stuck_loop(Plane::Coordinator);
}

fn stuck_loop(plane: Plane) {
    let (reference_dir, dir, mut args) = scenario(30);
    // Rank 1's training thread parks at step 12; its process and agent stay alive
    // and keep sending heartbeats, and the other ranks wait in a collective.
    args.extend(["--fault-hold".into(), "12:1:before-save".into()]);
    let launch_args = plane.args(
        &[
            "--nproc",
            "3",
            "--min-ranks",
            "2",
            "--progress-timeout-secs",
            "3",
        ],
        "stuck",
    );
    let mut launch = Launch::start(&as_strs(&launch_args), &as_strs(&args));
    let held = launch.expect("where a rank holds", |l| l.contains("fault: rank 1 holds"));
    let victim = label_of(&held);
    let line = launch.expect("a recovery", |l| l.contains("recovery: generation"));
    assert!(line.contains("world 2"), "{line}");
    assert!(
        line.contains("no progress") || line.contains("hung") || line.contains("idle"),
        "the cause names the stuck loop: {line}"
    );
    let (status, output) = launch.finish();
    assert!(status.success(), "the others must finish:\n{output}");
    assert!(
        output.contains(&format!("[rank {victim}] error: member")),
        "the stuck rank is dropped and leaves:\n{output}"
    );
    assert_identical(reference_dir.path(), dir.path());
}

#[test]
fn a_failed_rank_is_relaunched_and_the_world_grows_back_to_its_size() {
    let _serial = one_at_a_time();
    let (reference_dir, dir, mut args) = scenario(60);
    args.extend(["--fault-hold".into(), "12:1:before-save".into()]);
    args.extend(["--fault-step-pause-ms".into(), "30".into()]);
    let mut launch = Launch::start(
        &["--nproc", "3", "--min-ranks", "2", "--max-restarts", "1"],
        &as_strs(&args),
    );
    let held = launch.expect("where a rank holds", |l| l.contains("fault: rank 1 holds"));
    let victim = label_of(&held);
    signal(pid_of(&launch.seen, victim), libc::SIGKILL);
    let restarted = launch.expect("the relaunch", |l| {
        l.starts_with(&format!("launch: rank {victim} pid")) && l.contains("(restart 1)")
    });
    // The relaunched rank joins the world again: at once when it arrives while the
    // survivors re-form, else at the next checkpoint (a regroup).
    launch.expect("the world back at 3 ranks", |l| {
        l.contains("] generation") && l.contains("world 3") && !l.contains("initial")
    });
    let (status, output) = launch.finish();
    assert!(status.success(), "{output}");
    let new_pid = restarted
        .split(" pid ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    assert_ne!(new_pid, "", "{restarted}");
    assert_identical(reference_dir.path(), dir.path());
}

#[test]
fn a_rank_that_reports_a_device_error_is_dropped_and_the_others_go_on() {
    let _serial = one_at_a_time();
    let (reference_dir, dir, mut args) = scenario(30);
    // Recovery from the store, as every recovery was before in-memory copies.
    args.extend([
        "--fault-device-error".into(),
        "12:1".into(),
        "--memory-copies=false".into(),
    ]);
    let launch = Launch::start(&["--nproc", "3", "--min-ranks", "2"], &as_strs(&args));
    let (status, output) = launch.finish();
    assert!(status.success(), "the others must finish:\n{output}");
    let resumed = line_with(&output, "resumed from step");
    // Together: rank 0 alone lists, and the world reads each byte from the store once.
    assert!(
        resumed.contains("resharded onto 2; cooperative load: ")
            && resumed.contains("LIST (by rank 0 only)")
            && !resumed.contains("rows rebuilt"),
        "without copies the survivors read the store: {resumed}"
    );
    let line = line_with(&output, "recovery: generation");
    assert!(
        line.contains("world 2") && line.contains("device error"),
        "the cause names the device error: {line}"
    );
    assert!(
        output.contains("launch: rank 1 failed"),
        "the rank with the failed device exits:\n{output}"
    );
    assert_identical(reference_dir.path(), dir.path());
}

#[test]
fn an_in_memory_copy_that_rotted_is_caught_by_the_saves_checksums_and_the_store_is_read() {
    let _serial = one_at_a_time();
    let (reference_dir, dir, mut args) = scenario(30);
    // Rank 0's copies rot after every save from step 5 on, so whichever commit the
    // survivors resume from (the save of step 10 may not have committed yet when
    // rank 1's device fails at step 12), rank 0's copy of it is rotten.
    args.extend([
        "--fault-rot-copy".into(),
        "5:0".into(),
        "--fault-device-error".into(),
        "12:1".into(),
    ]);
    let launch = Launch::start(&["--nproc", "3", "--min-ranks", "2"], &as_strs(&args));
    let (status, output) = launch.finish();
    assert!(status.success(), "the others must finish:\n{output}");
    assert!(
        output.contains("fault: rank 0 flipped a bit of its in-memory copy of step 5"),
        "the fault must happen:\n{output}"
    );
    let warning = line_with(&output, "differs from what was saved");
    assert!(
        warning.contains("(rank 0 of 3) held by rank 0") && warning.contains("block"),
        "the log names the copy, its holder and the block: {warning}"
    );
    let resumed = line_with(&output, "resumed from step");
    assert!(
        resumed.contains("read from the store on the others"),
        "the rank whose copy rotted reads the store: {resumed}"
    );
    assert_identical(reference_dir.path(), dir.path());
}

/// The memory tier: 4 ranks save to the store every 10 steps and snapshot every 2;
/// rank 2 holds at step 15, after the world voted on the snapshot of step 14, and
/// the test kills it and the ranks in `also_killed`. Returns the output of a run
/// whose three checks always hold: the survivors finish, with the reference's
/// weights, and rank 0 said whether the snapshot of step 14 committed
/// (`snapshot_14`, "committed" or "not committed").
fn snapshot_kill(extra: &[&str], also_killed: &[usize], snapshot_14: &str, plane: Plane) -> String {
    let (reference_dir, dir) = (tempdir(), tempdir());
    reference(reference_dir.path(), 30);
    let mut args: Vec<String> = [
        "--steps",
        "30",
        "--ckpt",
        &url(dir.path()),
        "--ckpt-every",
        "10",
        "--snapshot-every",
        "2",
        "--log-every",
        "1",
        "--fault-hold",
        "15:2:after-save",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let launch_args = plane.args(&["--nproc", "4", "--min-ranks", "2"], "snapshot");
    let mut launch = Launch::start(&as_strs(&launch_args), &as_strs(&args));
    let verdict = format!("[rank 0] snapshot step 14 {snapshot_14}");
    launch.expect("where rank 2 holds", |l| l.contains("fault: rank 2 holds"));
    if !launch.seen.contains(&verdict) {
        launch.expect("the vote on the snapshot of step 14", |l| {
            l.contains(&verdict)
        });
    }
    for victim in std::iter::once(&2).chain(also_killed) {
        signal(pid_of(&launch.seen, *victim), libc::SIGKILL);
    }
    let (status, output) = launch.finish();
    assert!(status.success(), "the survivors must finish:\n{output}");
    assert_identical(reference_dir.path(), dir.path());
    output
}

#[test]
fn a_rank_killed_between_store_saves_resumes_from_the_snapshot_one_interval_back() {
    let _serial = one_at_a_time();
    snapshot_resume_from_14(Plane::Coordinator);
}

/// [`snapshot_kill`] of rank 2 alone: the survivors resume from the snapshot of
/// step 14.
fn snapshot_resume_from_14(plane: Plane) {
    let output = snapshot_kill(&[], &[], "committed", plane);
    // Killed at step 15: the snapshot of step 14, not the store's commit of step 10.
    let resumed = line_with(&output, "] resumed from");
    assert!(
        resumed.contains("resumed from snapshot step 14 in memory")
            && resumed.contains("saved by 4 ranks, resharded onto 3")
            && resumed.contains("rows rebuilt from memory on 3 of 3 ranks"),
        "{resumed}\n{output}"
    );
    assert!(
        line_with(&output, "snapshot step 14 committed").contains("recorded in the control plane"),
        "{output}"
    );
    let start = line_with(&output, "world 3, step 14 of 30");
    assert!(start.contains("host_bytes_held {\"budget\""), "{start}");
}

#[test]
fn two_ring_neighbours_killed_leave_a_snapshot_file_uncovered_and_the_store_commit_is_used() {
    let _serial = one_at_a_time();
    // Rank 2's snapshot lived on rank 2 and its successor, rank 3.
    let output = snapshot_kill(&[], &[3], "committed", Plane::Coordinator);
    assert!(
        line_with(&output, "snapshot step 14 not resumed from")
            .contains("no survivor holds the file of rank(s) 2 of its 4 ranks"),
        "{output}"
    );
    let resumed = line_with(&output, "] resumed from");
    assert!(
        resumed.contains("resumed from step 10 of "),
        "{resumed}\n{output}"
    );
}

#[test]
fn a_snapshot_one_rank_did_not_finish_is_not_committed_and_the_previous_one_is_used() {
    let _serial = one_at_a_time();
    let output = snapshot_kill(
        &["--fault-snapshot-vote", "14:1"],
        &[],
        "not committed",
        Plane::Coordinator,
    );
    assert!(
        output.contains("fault: rank 1 votes against the snapshot of step 14")
            && line_with(&output, "snapshot step 14 not committed").contains("rank(s) 1 did"),
        "{output}"
    );
    let resumed = line_with(&output, "] resumed from");
    assert!(
        resumed.contains("resumed from snapshot step 12 in memory"),
        "{resumed}\n{output}"
    );
}

#[test]
fn a_rollback_resumes_from_the_store_not_from_a_newer_snapshot() {
    let _serial = one_at_a_time();
    let (reference_dir, dir) = (tempdir(), tempdir());
    reference(reference_dir.path(), 30);
    let mut args = train_args(dir.path(), 30);
    // Saves every 5 steps: snapshot 12 is committed at step 13's boundary, newer than
    // the store's commit of step 10, when the NaN written after step 13 rolls the
    // world back.
    args.extend(
        ["--snapshot-every", "2", "--fault-nan", "13:1"]
            .iter()
            .map(|s| s.to_string()),
    );
    let launch = Launch::start(&["--nproc", "3", "--min-ranks", "2"], &as_strs(&args));
    let (status, output) = launch.finish();
    assert!(status.success(), "{output}");
    assert!(
        output.contains("[rank 0] snapshot step 12 committed"),
        "{output}"
    );
    assert!(
        line_with(&output, "rolled back from step 13").contains("to step 10"),
        "{output}"
    );
    assert!(!output.contains("resumed from snapshot"), "{output}");
    assert_identical(reference_dir.path(), dir.path());
}

/// The recovery scenarios above, on etcd instead of a coordinator: same faults, same
/// outcomes, the same bitwise oracle.
#[cfg(feature = "etcd")]
mod on_etcd {
    use super::*;
    use ckpt_testkit::{Capability, has};

    #[test]
    fn a_rank_killed_mid_step_is_recovered_on_etcd() {
        if !has(Capability::Etcd) {
            return;
        }
        let _serial = one_at_a_time();
        kill_one_of_four("12:2:before-save", false, Plane::Etcd);
    }

    #[test]
    fn a_rank_killed_between_store_saves_resumes_from_the_snapshot_on_etcd() {
        if !has(Capability::Etcd) {
            return;
        }
        let _serial = one_at_a_time();
        snapshot_resume_from_14(Plane::Etcd);
    }

    #[test]
    fn a_second_kill_during_the_rendezvous_is_recovered_on_etcd() {
        if !has(Capability::Etcd) {
            return;
        }
        let _serial = one_at_a_time();
        kill_one_of_four("12:3:before-save", true, Plane::Etcd);
    }

    #[test]
    fn a_stopped_rank_is_dropped_by_its_lease_and_fenced_on_etcd() {
        if !has(Capability::Etcd) {
            return;
        }
        let _serial = one_at_a_time();
        stopped_rank(Plane::Etcd);
    }

    #[test]
    fn a_node_lost_whole_is_survived_on_etcd() {
        if !has(Capability::Etcd) {
            return;
        }
        let _serial = one_at_a_time();
        node_lost(Plane::Etcd);
    }

    #[test]
    fn a_stuck_training_loop_is_found_by_its_own_agent_on_etcd() {
        if !has(Capability::Etcd) {
            return;
        }
        let _serial = one_at_a_time();
        stuck_loop(Plane::Etcd);
    }

    // A private 3-member cluster (these tests kill its members; the test command's
    // shared one must stay whole).
    use ckpt_testkit::etcd::private_cluster;

    /// Reads `count` more step lines of rank 0 and returns the largest gap between
    /// two of them (the lines carry no timestamps: the test times their arrival).
    fn steps(launch: &mut Launch, count: usize) -> Duration {
        let mut widest = Duration::ZERO;
        let mut last = Instant::now();
        for _ in 0..count {
            launch.expect("a step", |l| l.starts_with("[rank 0] step "));
            widest = widest.max(last.elapsed());
            last = Instant::now();
        }
        widest
    }

    fn job_args(url: &str, name: &str) -> Vec<String> {
        [
            "--nproc",
            "4",
            "--min-ranks",
            "2",
            "--rdzv",
            url,
            "--job-id",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([unique_job(name)])
        .collect()
    }

    #[test]
    fn killing_the_etcd_leader_mid_run_does_not_stop_training_and_it_rejoins() {
        if !has(Capability::Etcd) {
            return;
        }
        let _serial = one_at_a_time();
        let Some(mut cluster) = private_cluster() else {
            return;
        };
        let (reference_dir, dir, mut args) = scenario(150);
        args.extend(["--fault-step-pause-ms".into(), "40".into()]);
        let mut launch = Launch::start(
            &as_strs(&job_args(&cluster.url("leader"), "leader")),
            &as_strs(&args),
        );
        launch.expect("step 20", |l| l.contains("[rank 0] step 20 loss"));
        let leader = cluster.leader().unwrap();
        cluster.kill(leader);
        // Election (1 s) plus a keep-alive period is the most the job may notice.
        let widest = steps(&mut launch, 30);
        assert!(
            widest < Duration::from_secs(4),
            "training paused {widest:?} while etcd elected a new leader"
        );
        let new_leader = cluster.leader().unwrap();
        assert_ne!(new_leader, leader, "a new etcd leader was elected");
        cluster.restart(leader).unwrap();
        cluster.wait_healthy(leader).unwrap();
        let (status, output) = launch.finish();
        assert!(status.success(), "{output}");
        assert!(
            !output.contains("generation 2"),
            "losing the etcd leader must not end the generation:\n{output}"
        );
        assert_identical(reference_dir.path(), dir.path());
    }

    #[test]
    fn without_etcd_quorum_training_goes_on_and_a_failure_is_handled_once_it_returns() {
        if !has(Capability::Etcd) {
            return;
        }
        let _serial = one_at_a_time();
        let Some(mut cluster) = private_cluster() else {
            return;
        };
        let (reference_dir, dir, mut args) = scenario(100);
        args.extend(["--fault-step-pause-ms".into(), "40".into()]);
        let mut launch = Launch::start(
            &as_strs(&job_args(&cluster.url("quorum"), "quorum")),
            &as_strs(&args),
        );
        launch.expect("step 20", |l| l.contains("[rank 0] step 20 loss"));
        cluster.kill(1);
        cluster.kill(2);
        // No quorum: the current generation trains on.
        launch.expect("step 40 without quorum", |l| {
            l.contains("[rank 0] step 40 loss")
        });
        let committed = commits(dir.path()).len();
        signal(pid_of(&launch.seen, 2), libc::SIGKILL);
        // The node sees its rank crash, reports it and asks for a new generation for
        // the survivors, which cannot form without quorum: it says that etcd does
        // not take its writes (the ranks talk to their node, not to etcd), at its
        // first report (each later one waits out etcd's request timeout, ~3 s).
        let retrying = |l: &str| {
            l.contains("cannot report to the control plane")
                && l.contains("the report is queued and written when etcd answers")
        };
        if !launch.seen.lines().any(retrying) {
            launch.expect("the node retrying its writes", retrying);
        }
        assert!(
            !launch.seen.contains("generation 2"),
            "no generation may form without etcd quorum:\n{}",
            launch.seen
        );
        cluster.restart(1).unwrap();
        cluster.restart(2).unwrap();
        let line = launch.expect("the recovery once quorum is back", |l| {
            l.contains("recovery: generation 2") && l.contains("world 3")
        });
        assert!(line.contains("world 3"), "{line}");
        let (status, output) = launch.finish();
        assert!(status.success(), "{output}");
        assert!(
            commits(dir.path()).len() >= committed,
            "no committed checkpoint may be lost"
        );
        assert_identical(reference_dir.path(), dir.path());
    }

    #[test]
    fn two_launchers_with_different_world_ideas_converge_on_one_generation() {
        if !has(Capability::Etcd) {
            return;
        }
        let _serial = one_at_a_time();
        let (reference_dir, dir, args) = scenario(60);
        let args = as_strs(&args);
        let (url, job) = (etcd_url(), unique_job("converge"));
        // Node 0 would train with 2 ranks; node 1 insists on 4 (two full nodes).
        let mut a = node_args(0, &job, Some(&url));
        a.extend(["--max-ranks".into(), "4".into()]);
        let b: Vec<String> = [
            "--nproc",
            "2",
            "--nnodes",
            "2",
            "--node-id",
            "1",
            "--job-id",
            &job,
            "--rdzv",
            &url,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let node0 = Launch::start(&as_strs(&a), &args);
        let node1 = Launch::start(&as_strs(&b), &args);
        let (status0, output0) = node0.finish();
        let (status1, output1) = node1.finish();
        assert!(status0.success(), "node 0:\n{output0}");
        assert!(status1.success(), "node 1:\n{output1}");
        let adopted = [&output0, &output1]
            .iter()
            .filter(|o| o.contains("already has settings in etcd"))
            .count();
        assert_eq!(
            adopted, 1,
            "exactly one launcher adopts the other's settings:\n{output0}\n{output1}"
        );
        // Both launchers saw the same generations with the same worlds.
        let formed = |o: &str| -> Vec<String> {
            o.lines()
                .filter(|l| l.starts_with("launch:") && l.contains("formed with world"))
                .map(|l| {
                    let g = l.split("generation ").last().unwrap();
                    g.split(" (").next().unwrap().to_string()
                })
                .collect()
        };
        let (f0, f1) = (formed(&output0), formed(&output1));
        assert!(!f0.is_empty(), "{output0}");
        let common = f0.len().min(f1.len());
        assert_eq!(
            f0[f0.len() - common..],
            f1[f1.len() - common..],
            "\n{output0}\n{output1}"
        );
        for output in [&output0, &output1] {
            assert!(output.contains("done: step 60"), "{output}");
        }
        assert_identical(reference_dir.path(), dir.path());
    }
}

/// The TCP ports that processes `pids` listen on (IPv4 and IPv6), from `/proc`.
fn listening_ports(pids: &[i32]) -> Vec<u16> {
    let mut inodes = std::collections::HashSet::new();
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path())
                && let Some(inode) = target
                    .to_str()
                    .and_then(|t| t.strip_prefix("socket:["))
                    .and_then(|t| t.strip_suffix(']'))
            {
                inodes.insert(inode.to_owned());
            }
        }
    }
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local address, state (0A: LISTEN), inode
            if fields.len() > 9 && fields[3] == "0A" && inodes.contains(fields[9]) {
                let port = fields[1].rsplit(':').next().unwrap();
                ports.push(u16::from_str_radix(port, 16).unwrap());
            }
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// Steps measured before and after the flood.
const WINDOW: usize = if cfg!(debug_assertions) { 50 } else { 500 };

/// Counts a flooding thread as finished when dropped (its loop ended, or it panicked).
struct Finished<'a>(&'a AtomicUsize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// The median of `times` in milliseconds, with their count ("–" when none).
fn median_ms(times: &[Duration]) -> String {
    let mut sorted = times.to_vec();
    sorted.sort();
    match sorted.get(sorted.len() / 2) {
        Some(m) => format!("{:.2} ms ({} steps)", m.as_secs_f64() * 1e3, sorted.len()),
        None => "– (0 steps)".into(),
    }
}

/// A job's listeners (its coordinator, its node agent, its ranks' ring and copy
/// servers) under a flood of strangers: up to 10,000 connections that speak nonsense or
/// prove another job's secret. Every one is refused, and the job trains on to the
/// failure-free run's weights, with no generation ended; what was refused is logged
/// with its peer.
#[test]
fn strangers_at_every_port_of_a_job_are_refused_and_training_is_not_disturbed() {
    let _serial = one_at_a_time();
    // A step takes about half a millisecond; the flood took 0.5 s here, longer in CI
    // beside other tests, and it ends by FLOOD_ENDS_BY at the latest (below), so the
    // job still trains when it is over.
    let steps = 24_000;
    let reference_dir = tempdir();
    let every = ["--ckpt-every", "4000"];
    let output = Command::new(BIN)
        .args(["launch", "--nproc", "2", "--"])
        .args(["--preset", "tiny", "--seed", "7", "--timeout-secs", "30"])
        .args([
            "--steps",
            &steps.to_string(),
            "--ckpt",
            &url(reference_dir.path()),
        ])
        .args(every)
        .output()
        .unwrap();
    assert!(output.status.success(), "reference run failed");
    let stranger = ckpt_auth::JobSecret::new("another job's secret, not this one", "test")
        .expect("a valid secret");
    // The flood ends after FLOOD connections, or earlier when rank 0 reaches
    // FLOOD_ENDS_BY: how long either takes depends on the machine and what else
    // runs on it, and the job must still be training when the flood is over.
    const FLOOD: usize = 10_000;
    const FLOOD_ENDS_BY: u64 = 16_000;
    // One node, hosting its coordinator: the launcher generates the job's secret.
    let dir = tempdir();
    let args = [
        "--steps".to_string(),
        steps.to_string(),
        "--ckpt".into(),
        url(dir.path()),
        every[0].into(),
        every[1].into(),
        "--log-every".into(),
        "1".into(),
    ];
    let mut launch = Launch::start(&["--nproc", "2", "--min-ranks", "1"], &as_strs(&args));
    launch.expect("of step 5", |l| l.contains("step 5 loss"));
    let mut pids: Vec<i32> = pids(&launch.seen).into_iter().map(|(_, p)| p).collect();
    pids.push(launch.child.id() as i32);
    let ports = listening_ports(&pids);
    assert!(
        ports.len() >= 4,
        "a coordinator, a node agent and two copy servers at least: {ports:?}"
    );
    // Step times (rank 0's lines as they arrive) before, during and after the flood:
    // a figure, printed, not asserted (docs/BENCHMARKS.md has the release run's).
    let before = launch.step_times(WINDOW, |_| false);
    let from_flood = Instant::now();
    let flooders_done = AtomicUsize::new(0);
    let connections = AtomicUsize::new(0);
    let halt = AtomicBool::new(false);
    let during = std::thread::scope(|scope| {
        for t in 0..4 {
            let (ports, stranger) = (&ports, &stranger);
            let (done, connections, halt) = (&flooders_done, &connections, &halt);
            scope.spawn(move || {
                let _count = Finished(done);
                for i in (t..FLOOD).step_by(4) {
                    if halt.load(Ordering::SeqCst) {
                        break;
                    }
                    let port = ports[i % ports.len()];
                    // Each call bounded, so that a flooder sees the halt in time.
                    let to = std::net::SocketAddr::from(([127, 0, 0, 1], port));
                    let Ok(mut stream) =
                        std::net::TcpStream::connect_timeout(&to, Duration::from_secs(1))
                    else {
                        continue;
                    };
                    connections.fetch_add(1, Ordering::SeqCst);
                    if (i / ports.len()) % 10 == 0 {
                        // Every tenth round over the ports: a stranger that speaks
                        // the handshake, with its own secret.
                        let _ =
                            ckpt_auth::prove_tcp_within(&stream, stranger, Duration::from_secs(1));
                    } else {
                        let _ = std::io::Write::write_all(&mut stream, b"GET / HTTP/1.1\r\n\r\n");
                    }
                }
            });
        }
        let during = launch.step_times(usize::MAX, |step| {
            if step >= FLOOD_ENDS_BY {
                halt.store(true, Ordering::SeqCst);
            }
            flooders_done.load(Ordering::SeqCst) == 4
        });
        // Should reading the lines fail, the flooders stop rather than run on.
        halt.store(true, Ordering::SeqCst);
        during
    });
    let flood_took = from_flood.elapsed();
    assert!(
        launch.child.try_wait().unwrap().is_none(),
        "the job was still running when the flood ended (or the test proves nothing)"
    );
    let connections = connections.into_inner();
    assert!(
        connections >= 20 * ports.len(),
        "the flood made only {connections} connections to {} ports before the job \
         reached step {FLOOD_ENDS_BY}: too few to prove anything",
        ports.len()
    );
    let after = launch.step_times(WINDOW, |_| false);
    eprintln!(
        "{connections} connections to ports {ports:?} in {:.1} s; median step time before {}, during {}, after the flood {}",
        flood_took.as_secs_f64(),
        median_ms(&before),
        median_ms(&during),
        median_ms(&after),
    );
    let (status, output) = launch.finish();
    assert!(status.success(), "the job must finish:\n{output}");
    assert!(
        !output.contains("recovery:"),
        "no generation may end:\n{output}"
    );
    assert_identical(reference_dir.path(), dir.path());
    for service in ["coordinator", "node agent", "copies"] {
        assert!(
            output
                .lines()
                .any(|l| l.contains("connection refused") && l.contains(service)),
            "{service} logs what it refused, with the peer:\n{output}"
        );
    }
}
