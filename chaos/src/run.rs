//! Running a scenario: the launchers of the reference trainer as real processes,
//! faults fired from their output, and what happened, with times.
//!
//! The harness wraps the system from outside: it reads the lines the launchers and
//! ranks print (`launch: rank R pid P`, `[rank 0] step N loss …`, the recovery line)
//! and acts on real pids. The trainer runs the same with or without it; the one
//! fault it cannot inject from outside, a lost device, goes through the trainer's
//! own failpoint (`--fault-device-error`), as its tests do.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::scenario::{CoordinatorKind, FaultKind, Scenario};

/// A line a launcher printed, with the node and when it arrived.
struct Line {
    node: usize,
    text: String,
}

/// A fault as it was fired.
#[derive(Debug, Clone, Serialize)]
pub struct Fired {
    /// `kill`, `stop`, `kill-node`, `device-error`.
    pub kind: String,
    /// What was hit (`rank 2`, `node 1`).
    pub target: String,
    /// The step rank 0 had reported.
    pub at_step: u64,
    /// Milliseconds after the start of the run.
    pub at_ms: u64,
    /// Unix time in ms (to compare with the trainer's own timestamps).
    #[serde(skip)]
    pub unix_ms: u64,
}

/// One recovery, from the line rank 0 of the new generation prints.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    /// The new generation.
    pub generation: u64,
    /// Its world size.
    pub world: usize,
    /// Why it formed.
    pub cause: String,
    /// From the fault to the survivors noticing (when a fault preceded it).
    pub detect_ms: Option<u64>,
    /// Stopping the failed generation.
    pub abort_ms: u64,
    /// Rendezvous and the new ring.
    pub reform_ms: u64,
    /// The resharded load.
    pub load_ms: u64,
    /// The first step of the new generation.
    pub first_step_ms: u64,
}

/// Everything a run showed.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Observed {
    /// Exit codes of the launchers that were not killed on purpose.
    pub exit_codes: BTreeMap<usize, i32>,
    /// The faults fired.
    pub fired: Vec<Fired>,
    /// The recoveries.
    pub recoveries: Vec<Recovery>,
    /// The step each resume started from, in order.
    pub resumed_from: Vec<u64>,
    /// World sizes of the generations rank 0 started, in order.
    pub worlds: Vec<usize>,
    /// Wall time of the run (s).
    pub wall_s: f64,
    /// Every line the launchers printed, prefixed with their node.
    #[serde(skip)]
    pub log: Vec<String>,
}

/// Where the binaries are and where the run writes.
#[derive(Debug, Clone)]
pub struct Setup {
    /// `ckpt-train`.
    pub trainer: PathBuf,
    /// `ckpt` (for a standalone coordinator).
    pub ckpt: PathBuf,
    /// Checkpoint URL of the run.
    pub ckpt_url: String,
    /// Bound on the whole run.
    pub timeout: Duration,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a pid this run's launchers reported starting (or a
    // launcher this harness started); a pid that is gone makes it fail, harmlessly.
    unsafe {
        libc::kill(pid, sig);
    }
}

fn pump(node: usize, stream: impl std::io::Read + Send + 'static, tx: Sender<Line>) {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(text) = line else { break };
            if tx.send(Line { node, text }).is_err() {
                break;
            }
        }
    });
}

/// The arguments of every rank.
pub fn train_args(scenario: &Scenario, ckpt_url: &str) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "--preset".into(),
        scenario.preset.clone(),
        "--seed".into(),
        scenario.seed.to_string(),
        "--steps".into(),
        scenario.steps.to_string(),
        "--ckpt".into(),
        ckpt_url.into(),
        "--ckpt-every".into(),
        scenario.ckpt_every.to_string(),
        "--log-every".into(),
        "1".into(),
        // Nothing is removed by retention: a commit that disappears was lost.
        "--keep".into(),
        "1000000".into(),
        "--timeout-secs".into(),
        "30".into(),
    ];
    if scenario.step_pause_ms > 0 {
        args.extend([
            "--fault-step-pause-ms".into(),
            scenario.step_pause_ms.to_string(),
        ]);
    }
    if let Some(f) = scenario
        .faults
        .iter()
        .find(|f| f.kind == FaultKind::DeviceError)
    {
        let (step, rank) = (f.at_step.unwrap_or(1), f.rank.unwrap_or(0));
        args.extend(["--fault-device-error".into(), format!("{step}:{rank}")]);
    }
    args
}

struct Node {
    child: Child,
    killed: bool,
}

fn start_node(
    setup: &Setup,
    scenario: &Scenario,
    node: usize,
    job: &str,
    rdzv: Option<&str>,
    tx: &Sender<Line>,
) -> std::io::Result<Node> {
    let mut command = Command::new(&setup.trainer);
    command.arg("launch").args([
        "--nproc",
        &scenario.ranks.to_string(),
        "--min-ranks",
        &scenario.min_ranks.to_string(),
        "--max-restarts",
        &scenario.max_restarts.to_string(),
        "--heartbeat-timeout-secs",
        &scenario.heartbeat_timeout_secs.to_string(),
    ]);
    if scenario.nodes > 1 {
        command.args([
            "--nnodes",
            &format!("1:{}", scenario.nodes),
            "--node-id",
            &node.to_string(),
        ]);
    }
    if scenario.nodes > 1 || rdzv.is_some() {
        command.args(["--job-id", job]);
    }
    if let Some(rdzv) = rdzv {
        command.args(["--rdzv", rdzv]);
    }
    command
        .arg("--")
        .args(train_args(scenario, &setup.ckpt_url))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn()?;
    pump(node, child.stdout.take().expect("piped"), tx.clone());
    pump(node, child.stderr.take().expect("piped"), tx.clone());
    Ok(Node {
        child,
        killed: false,
    })
}

/// Starts `ckpt coordinator` for the job on `listen`; returns it and its address.
fn start_coordinator(
    setup: &Setup,
    scenario: &Scenario,
    job: &str,
    listen: &str,
) -> std::io::Result<(Child, String)> {
    let mut child = Command::new(&setup.ckpt)
        .args(["coordinator", "--listen", listen, "--job", job])
        .args(["--min-ranks", &scenario.min_ranks.to_string()])
        .args(["--max-ranks", &scenario.world().to_string()])
        .args([
            "--heartbeat-timeout-secs",
            &scenario.heartbeat_timeout_secs.to_string(),
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| std::io::Error::other(format!("{}: {e}", setup.ckpt.display())))?;
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut first)?;
    let addr = first
        .trim()
        .strip_prefix("coordinator: listening on ")
        .ok_or_else(|| std::io::Error::other(format!("ckpt coordinator said {first:?}")))?
        .to_string();
    Ok((child, addr))
}

/// What the run has seen so far, for triggers.
struct Watch {
    started: Instant,
    step: u64,
    /// Newest pid per rank label, per node.
    pids: BTreeMap<usize, (usize, i32)>,
    coordinator: Option<String>,
    observed: Observed,
    noticed: Vec<u64>,
}

impl Watch {
    fn take(&mut self, line: &Line) {
        let text = &line.text;
        self.observed
            .log
            .push(format!("[node {}] {text}", line.node));
        if let Some(rest) = text.strip_prefix("launch: rank ")
            && let Some((label, rest)) = rest.split_once(" pid ")
            && let (Ok(label), Some(pid)) = (
                label.parse::<usize>(),
                rest.split_whitespace().next().and_then(|p| p.parse().ok()),
            )
        {
            self.pids.insert(label, (line.node, pid));
        }
        if self.coordinator.is_none()
            && let Some(rest) = text.split(" coordinator ").nth(1)
            && text.starts_with("launch: node")
        {
            self.coordinator = rest.split(',').next().map(|a| format!("tcp://{a}"));
        }
        // Steps, starts, resumes and recoveries are printed by rank 0 of the running
        // generation, whichever launcher slot (the `[rank L]` label) that is.
        let Some(rest) = text
            .strip_prefix("[rank ")
            .and_then(|r| r.split_once("] "))
            .map(|(_, rest)| rest)
        else {
            return;
        };
        if let Some(step) = rest
            .strip_prefix("step ")
            .and_then(|r| r.split_whitespace().next())
            .and_then(|s| s.parse::<u64>().ok())
        {
            self.step = self.step.max(step);
        } else if let Some(world) = rest
            .strip_prefix("start: ")
            .and_then(|r| r.split(", world ").nth(1))
            .and_then(|r| r.split(',').next())
            .and_then(|w| w.parse().ok())
        {
            self.observed.worlds.push(world);
        } else if let Some(step) = rest
            .strip_prefix("resumed from step ")
            .and_then(|r| r.split_whitespace().next())
            .and_then(|s| s.parse().ok())
        {
            self.observed.resumed_from.push(step);
        } else if rest.starts_with("recovery: generation ")
            && let Some(r) = parse_recovery(rest, &mut self.noticed)
        {
            self.observed.recoveries.push(r);
        }
    }
}

/// Parses `recovery: generation G world W (CAUSE): noticed at T ms, aborted +A ms,
/// rendezvous R ms, ring B ms, load L ms, first step F ms; …`.
fn parse_recovery(line: &str, noticed: &mut Vec<u64>) -> Option<Recovery> {
    let rest = line.strip_prefix("recovery: generation ")?;
    let (generation, rest) = rest.split_once(" world ")?;
    let (world, rest) = rest.split_once(" (")?;
    let (cause, numbers) = rest.rsplit_once("): noticed at ")?;
    let number = |key: &str| -> Option<u64> {
        let after = numbers.split(key).nth(1)?;
        after
            .trim_start_matches('+')
            .split(" ms")
            .next()?
            .trim()
            .parse()
            .ok()
    };
    let at: u64 = numbers.split(" ms").next()?.trim().parse().ok()?;
    noticed.push(at);
    Some(Recovery {
        generation: generation.parse().ok()?,
        world: world.parse().ok()?,
        cause: cause.to_string(),
        detect_ms: None,
        abort_ms: number("aborted ")?,
        reform_ms: number("rendezvous ")? + number("ring ")?,
        load_ms: number("load ")?,
        first_step_ms: number("first step ")?,
    })
}

/// Runs `scenario` to its end (or `setup.timeout`) and reports what happened.
pub fn run(scenario: &Scenario, setup: &Setup) -> std::io::Result<Observed> {
    let (tx, rx): (Sender<Line>, Receiver<Line>) = channel();
    let job = format!("chaos-{}-{}", std::process::id(), unix_ms());
    let mut watch = Watch {
        started: Instant::now(),
        step: 0,
        pids: BTreeMap::new(),
        coordinator: None,
        observed: Observed::default(),
        noticed: Vec::new(),
    };
    let mut coordinator = match scenario.coordinator {
        CoordinatorKind::Standalone => {
            let (child, addr) = start_coordinator(setup, scenario, &job, "127.0.0.1:0")?;
            watch.coordinator = Some(format!("tcp://{addr}"));
            Some((child, addr))
        }
        CoordinatorKind::Hosted => None,
    };
    let joined = watch.coordinator.clone();
    let mut nodes = vec![start_node(
        setup,
        scenario,
        0,
        &job,
        joined.as_deref(),
        &tx,
    )?];
    let deadline = Instant::now() + setup.timeout;
    // Node 0 hosts the coordinator; the others join it once it has said where.
    while scenario.nodes > nodes.len() {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => watch.take(&line),
            Err(_) => return Err(std::io::Error::other("node 0 never named its coordinator")),
        }
        if let Some(rdzv) = watch.coordinator.clone() {
            for node in 1..scenario.nodes {
                nodes.push(start_node(setup, scenario, node, &job, Some(&rdzv), &tx)?);
            }
        }
    }
    drop(tx);
    let mut pending: Vec<usize> = (0..scenario.faults.len()).collect();
    let mut resume: Vec<(Instant, i32)> = Vec::new();
    let mut restart_coordinator: Option<Instant> = None;
    loop {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(20));
        match rx.recv_timeout(wait) {
            Ok(line) => watch.take(&line),
            Err(RecvTimeoutError::Timeout) if Instant::now() >= deadline => {
                for node in &mut nodes {
                    let _ = node.child.kill();
                }
                return Err(std::io::Error::other(format!(
                    "the run did not end within {:?}",
                    setup.timeout
                )));
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if let Some(at) = restart_coordinator
            && Instant::now() >= at
            && let Some((_, addr)) = &coordinator
        {
            restart_coordinator = None;
            let addr = addr.clone();
            coordinator = Some((start_coordinator(setup, scenario, &job, &addr)?.0, addr));
        }
        resume.retain(|&(at, pid)| {
            let due = Instant::now() >= at;
            if due {
                signal(pid, libc::SIGCONT);
            }
            !due
        });
        let step = watch.step;
        let mut fire = Vec::new();
        pending.retain(|&i| {
            let due = scenario.faults[i].at_step.is_some_and(|s| step >= s);
            if due {
                fire.push(i);
            }
            !due
        });
        for i in fire {
            let fault = &scenario.faults[i];
            let target = match fault.kind {
                FaultKind::KillNode => format!("node {}", fault.node.unwrap_or(0)),
                FaultKind::KillCoordinator => "the coordinator".to_string(),
                _ => format!("rank {}", fault.rank.unwrap_or(0)),
            };
            match fault.kind {
                FaultKind::Kill => {
                    if let Some(&(_, pid)) = watch.pids.get(&fault.rank.unwrap_or(0)) {
                        signal(pid, libc::SIGKILL);
                    }
                }
                FaultKind::Stop => {
                    if let Some(&(_, pid)) = watch.pids.get(&fault.rank.unwrap_or(0)) {
                        signal(pid, libc::SIGSTOP);
                        let pause = Duration::from_millis(fault.duration_ms.unwrap_or(0));
                        resume.push((Instant::now() + pause, pid));
                    }
                }
                FaultKind::KillNode => {
                    let node = fault.node.unwrap_or(0);
                    for (_, &(n, pid)) in watch.pids.iter() {
                        if n == node {
                            signal(pid, libc::SIGKILL);
                        }
                    }
                    if let Some(n) = nodes.get_mut(node) {
                        n.killed = true;
                        let _ = n.child.kill();
                    }
                }
                // Fired by the trainer itself at that step.
                FaultKind::DeviceError => {}
                FaultKind::KillCoordinator => {
                    if let Some((child, _)) = coordinator.as_mut() {
                        let _ = child.kill();
                        let _ = child.wait();
                        let pause = Duration::from_millis(fault.duration_ms.unwrap_or(0));
                        restart_coordinator = Some(Instant::now() + pause);
                    }
                }
            }
            watch.observed.fired.push(Fired {
                kind: serde_json::to_value(fault.kind)
                    .ok()
                    .and_then(|v| v.as_str().map(String::from))
                    .unwrap_or_default(),
                target,
                at_step: step,
                at_ms: watch.started.elapsed().as_millis() as u64,
                unix_ms: unix_ms(),
            });
        }
    }
    for (_, pid) in resume {
        signal(pid, libc::SIGCONT);
    }
    if let Some((mut child, _)) = coordinator {
        let _ = child.kill();
        let _ = child.wait();
    }
    for (i, node) in nodes.iter_mut().enumerate() {
        let status = node.child.wait()?;
        if !node.killed {
            watch
                .observed
                .exit_codes
                .insert(i, status.code().unwrap_or(128));
        }
    }
    // Detection: from the latest fault before each recovery's "noticed" time.
    let fired: Vec<u64> = watch.observed.fired.iter().map(|f| f.unix_ms).collect();
    for (recovery, noticed) in watch.observed.recoveries.iter_mut().zip(&watch.noticed) {
        recovery.detect_ms = fired
            .iter()
            .filter(|&&f| f <= *noticed)
            .max()
            .map(|f| noticed - f);
    }
    watch.observed.wall_s = watch.started.elapsed().as_secs_f64();
    Ok(watch.observed)
}

/// The `ckpt` command line next to `trainer` (its build directory), or on `CKPT_BIN`.
pub fn find_ckpt(trainer: &Path) -> PathBuf {
    std::env::var_os("CKPT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| trainer.with_file_name("ckpt"))
}

/// The `ckpt-train` next to this executable, or on `CKPT_TRAIN`.
pub fn find_trainer(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(path) = explicit {
        return Ok(path.to_path_buf());
    }
    if let Some(path) = std::env::var_os("CKPT_TRAIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let sibling = exe.with_file_name("ckpt-train");
    if sibling.exists() {
        return Ok(sibling);
    }
    Err(format!(
        "ckpt-train not found next to {} (cargo build -p ckpt-trainer), nor on --trainer or CKPT_TRAIN",
        exe.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recovery_line_is_parsed() {
        let line = "recovery: generation 2 world 3 (lost member n0-l2-i0: connection closed): noticed at 1795491906789 ms, aborted +4 ms, rendezvous 6 ms, ring 4 ms, load 7 ms, first step 1 ms; back to training 28 ms after the failure was noticed";
        let mut noticed = Vec::new();
        let r = parse_recovery(line, &mut noticed).unwrap();
        assert_eq!((r.generation, r.world), (2, 3));
        assert_eq!(r.cause, "lost member n0-l2-i0: connection closed");
        assert_eq!(
            (r.abort_ms, r.reform_ms, r.load_ms, r.first_step_ms),
            (4, 10, 7, 1)
        );
        assert_eq!(noticed, [1795491906789]);
    }
}
