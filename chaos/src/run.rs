//! Running a scenario: the launchers of the reference trainer as real processes,
//! faults fired from their output, and what happened, with times.
//!
//! The harness wraps the system from outside: it reads the lines the launchers and
//! ranks print (`launch: rank R pid P`, `[rank 0] step N loss …`, the recovery line)
//! and acts on real pids, real mounts, real namespaces and the storage proxy. The
//! trainer runs the same with or without it; what cannot be injected from outside (a
//! lost device, a stop at a given stage of a save) goes through the failpoints
//! compiled into test builds (`--fault-device-error`, `--fault-save-stage`), as the
//! crash tests do.
//!
//! The trainer may also be a Python script (`script` in the scenario) started by the
//! generic launcher, `ckpt launch -- PYTHON SCRIPT …`: the same launcher lines, the
//! lines of `python/examples/train_gpt.py` (`generation G: world W (…)`, `gen G:
//! resumed step S …`, its recovery line), and the faults that act from outside.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::env::Environment;
use crate::oracle::Damaged;
use crate::plot::{FaultMark, RecoverySpan, Sample, Timeline};
use crate::scenario::{CoordinatorKind, Fault, FaultKind, Scenario};

/// A line a launcher printed, with the node and when it arrived.
struct Line {
    node: usize,
    text: String,
}

/// The `node` of a standalone coordinator's lines.
const COORDINATOR: usize = usize::MAX;

/// A fault as it was fired.
#[derive(Debug, Clone, Serialize)]
pub struct Fired {
    /// The fault kind (`kill`, `stop`, `kill-node`, …).
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
    /// From the failure noticed to training again.
    pub back_ms: u64,
    /// When the failure was noticed (unix ms).
    #[serde(skip)]
    pub noticed_unix_ms: u64,
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
    /// The generations the launchers saw form after one ended (`launch: recovery:
    /// generation G ended, generation H formed …`): a recovery whose rank 0 is a
    /// process started after the failure (a node lost and started again in time to
    /// join) prints no recovery line of its own, but its launchers say it happened.
    pub reformed: BTreeSet<u64>,
    /// The step each resume started from, in order.
    pub resumed_from: Vec<u64>,
    /// World sizes of the generations rank 0 started, in order.
    pub worlds: Vec<usize>,
    /// The Python trainer's schedule: (first step, world size) of each generation
    /// that started training, from rank 0's `gen G: from scratch … on W ranks` and
    /// `gen G: resumed step S … on W ranks` lines. The failure-free reference replays
    /// it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub schedule: Vec<(u64, usize)>,
    /// Wall time of the run (s).
    pub wall_s: f64,
    /// Commits damaged on purpose (`corrupt` faults).
    pub damaged: Vec<Damaged>,
    /// Training time a failure-free run at this run's own pace would have needed,
    /// over the time this one took from its first step to its last (1: no time lost
    /// to faults). The pace is the median time between two steps.
    pub goodput: Option<f64>,
    /// Requests the storage proxy saw and faulted.
    pub storage: Option<crate::storage_proxy::ProxyStats>,
    /// Set when the run outlived its liveness bound (`ends_within_secs`) and the
    /// harness ended it: what it killed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cut: Option<String>,
    /// What rank 0 reported over time, for `--plot`.
    #[serde(skip)]
    pub timeline: Timeline,
    /// Every line the launchers printed, prefixed with their node.
    #[serde(skip)]
    pub log: Vec<String>,
    /// The commits resumes loaded (`ckpt-train`'s `resumed from step S of URL
    /// (commit DIR; …)`), in order: the oracle checks that none was unhealthy.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub resumed_dirs: Vec<String>,
    /// Resumes from an in-memory snapshot (`ckpt-train`'s `resumed from snapshot
    /// step S …`): (the newest step rank 0 had reported when it printed the line,
    /// the snapshot's step).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub snapshot_resumes: Vec<(u64, u64)>,
    /// What each rank that finished reported its checkpointing held in host memory
    /// at most (`final host_bytes_held {…} (rank R)`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub host_peaks: Vec<HostPeak>,
    /// The largest resident set of each rank process (by launcher label), KiB,
    /// sampled by the harness from `/proc/PID/status` ([`RssSampler`]).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub rss_max_kib: BTreeMap<usize, u64>,
    /// The rollbacks rank 0 reported: (the step left, the step of the commit
    /// reached).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rollbacks: Vec<(u64, u64)>,
    /// The poison the trainer's failpoints put in (`sdc` and `nan` faults), as the
    /// poisoning rank reported it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub poisoned: Vec<Poison>,
}

/// A fault that poisoned a rank's state, as the rank reported it: `fault: rank R
/// wrote a NaN into param/T after step K`, or `fault: rank R (replica …) flipped a
/// bit of param/T before saving step K`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Poison {
    /// `nan` or `sdc`.
    pub kind: String,
    /// The rank poisoned (its rank in the world it trained in).
    pub rank: u32,
    /// The step after which (nan), or before whose save (sdc), it happened.
    pub step: u64,
}

/// One rank's report of the host memory its checkpointing held at most.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostPeak {
    /// The launcher label of the process that reported it.
    pub label: usize,
    /// The most bytes held at once (staging, copies, replicas, snapshots).
    pub peak: u64,
    /// The budget it ran under, if any.
    pub budget: Option<u64>,
}

/// A rank's `final host_bytes_held {JSON} (rank R)` line (`rest`, after its label).
fn parse_host_peak(label: usize, rest: &str) -> Option<HostPeak> {
    let json = rest.strip_prefix("final host_bytes_held ")?;
    let json = json.rsplit_once(" (rank ").map_or(json, |(j, _)| j);
    let held: ckpt::HostBytesHeld = serde_json::from_str(json).ok()?;
    Some(HostPeak {
        label,
        peak: held.peak,
        budget: held.budget,
    })
}

/// Samples the resident set of every rank process of a run, every
/// [`RssSampler::EVERY`], on a thread of its own (a timer: no event says when a
/// process's memory grows), keeping each label's largest.
pub struct RssSampler {
    pids: Arc<Mutex<BTreeMap<usize, i32>>>,
    max: Arc<Mutex<BTreeMap<usize, u64>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    /// How often each process is sampled.
    pub const EVERY: Duration = Duration::from_millis(100);

    /// Starts sampling the processes added with [`RssSampler::watch`].
    pub fn start() -> Self {
        let pids = Arc::new(Mutex::new(BTreeMap::<usize, i32>::new()));
        let max = Arc::new(Mutex::new(BTreeMap::<usize, u64>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (pids, max, stop) = (pids.clone(), max.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    sample(&pids, &max);
                    std::thread::sleep(Self::EVERY);
                }
            })
        };
        Self {
            pids,
            max,
            stop,
            thread: Some(thread),
        }
    }

    /// Samples `pid` as the process of `label` from now on.
    pub fn watch(&self, label: usize, pid: i32) {
        self.pids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(label, pid);
    }

    /// Stops, after one last round; returns each label's largest resident set, KiB.
    pub fn finish(mut self) -> BTreeMap<usize, u64> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        sample(&self.pids, &self.max);
        self.max.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// One round of [`RssSampler`]: each live process's resident set, kept when it is
/// its label's largest.
fn sample(pids: &Mutex<BTreeMap<usize, i32>>, max: &Mutex<BTreeMap<usize, u64>>) {
    let now: Vec<(usize, i32)> = pids
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(l, p)| (*l, *p))
        .collect();
    for (label, pid) in now {
        if let Some(kib) = rss_kib(pid) {
            let mut max = max.lock().unwrap_or_else(|p| p.into_inner());
            let at = max.entry(label).or_insert(0);
            *at = (*at).max(kib);
        }
    }
}

/// A run that ends early (an error) stops its sampler too.
impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `VmRSS` of `pid` in KiB (`None`: gone, or not readable).
fn rss_kib(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The poison a rank reports, if `rest` (a line after its `[rank L] ` label) says so.
fn parse_poison(rest: &str) -> Option<Poison> {
    let rest = rest.strip_prefix("fault: rank ")?;
    let (rank, what) = rest.split_once(' ')?;
    let rank = rank.parse().ok()?;
    let (kind, step) = if let Some((_, step)) = what
        .strip_prefix("wrote a NaN into ")
        .and_then(|w| w.split_once(" after step "))
    {
        ("nan", step)
    } else {
        let (_, step) = what.split_once(" before saving step ")?;
        what.contains("flipped a bit of ").then_some(())?;
        ("sdc", step)
    };
    Some(Poison {
        kind: kind.into(),
        rank,
        step: step.trim().parse().ok()?,
    })
}

/// `(from, to)` of rank 0's `rolled back from step B to step S: REASON`.
fn parse_rollback(rest: &str) -> Option<(u64, u64)> {
    let (from, rest) = rest
        .strip_prefix("rolled back from step ")?
        .split_once(" to step ")?;
    let to = rest.split(':').next()?;
    Some((from.parse().ok()?, to.parse().ok()?))
}

/// Where the binaries are and where the run writes.
#[derive(Debug, Clone)]
pub struct Setup {
    /// `ckpt-train`.
    pub trainer: PathBuf,
    /// `ckpt` (for a standalone coordinator, and `ckpt launch` of a Python trainer).
    pub ckpt: PathBuf,
    /// The Python trainer: the interpreter and the script (`scenario.script`,
    /// resolved); `None` for `ckpt-train`.
    pub python: Option<(PathBuf, PathBuf)>,
    /// Bound on the whole run.
    pub timeout: Duration,
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
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

/// The arguments of every rank of the Python trainer (after the script): the
/// example's flags.
pub fn python_args(scenario: &Scenario, ckpt_url: &str, steps: u64) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "--ckpt".into(),
        ckpt_url.into(),
        "--steps".into(),
        steps.to_string(),
        "--ckpt-every".into(),
        scenario.ckpt_every.to_string(),
        "--seed".into(),
        scenario.seed.to_string(),
        "--log-every".into(),
        "1".into(),
    ];
    if let Some(batch) = scenario.batch {
        args.extend(["--batch".into(), batch.to_string()]);
    }
    args
}

/// The Python interpreter of Python trainers: `$CKPT_PYTHON`, else `python3`.
pub fn find_python() -> PathBuf {
    std::env::var_os("CKPT_PYTHON")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| "python3".into())
}

/// The workspace root this harness was built in (`scenario.script`s are relative to
/// it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// A scenario's `script`: absolute as it is; relative, under the workspace root, else
/// under the current directory.
pub fn resolve_script(script: &str) -> Result<PathBuf, String> {
    let path = Path::new(script);
    let candidates = if path.is_absolute() {
        vec![path.to_path_buf()]
    } else {
        vec![workspace_root().join(path), path.to_path_buf()]
    };
    candidates
        .iter()
        .find(|p| p.is_file())
        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
        .ok_or_else(|| {
            format!(
                "script {script}: not found (looked for {})",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
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
    if !scenario.memory_copies {
        args.push("--memory-copies=false".into());
    }
    if scenario.snapshot_every > 0 {
        args.extend([
            "--snapshot-every".into(),
            scenario.snapshot_every.to_string(),
        ]);
    }
    if let Some(budget) = scenario.host_memory_budget {
        args.extend(["--host-memory-budget".into(), budget.to_string()]);
    }
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
    if scenario.replicas > 1 {
        args.extend(["--replicas".into(), scenario.replicas.to_string()]);
    }
    for (kind, flag) in [
        (FaultKind::Sdc, "--fault-sdc"),
        (FaultKind::Nan, "--fault-nan"),
    ] {
        if let Some(f) = scenario.faults.iter().find(|f| f.kind == kind) {
            let (step, rank) = (f.at_step.unwrap_or(1), f.rank.unwrap_or(0));
            args.extend([flag.into(), format!("{step}:{rank}")]);
        }
    }
    if let Some(f) = scenario
        .faults
        .iter()
        .find(|f| f.kind == FaultKind::KillInSave)
    {
        args.extend([
            "--fault-save-stage".into(),
            format!(
                "{}@{}:{}",
                f.stage.as_deref().unwrap_or_default(),
                f.at_step.unwrap_or(1),
                f.rank.unwrap_or(0)
            ),
        ]);
    }
    args
}

struct Node {
    child: Child,
    killed: bool,
}

#[allow(clippy::too_many_arguments)]
fn start_node(
    setup: &Setup,
    env: &Environment,
    scenario: &Scenario,
    node: usize,
    job: &str,
    rdzv: Option<&str>,
    tx: &Sender<Line>,
) -> std::io::Result<Node> {
    // In a network namespace of its own when the scenario partitions nodes: the
    // launcher's children (the ranks) inherit it.
    // The Python trainer runs under the generic launcher, `ckpt launch`, whose flags
    // are `ckpt-train launch`'s.
    let launcher = match &setup.python {
        Some(_) => &setup.ckpt,
        None => &setup.trainer,
    };
    let mut command = match &env.network {
        Some(network) => network.command(node, launcher),
        None => Command::new(launcher),
    };
    command.envs(env.launcher_env.iter().map(|(k, v)| (k, v)));
    if let Some(shim) = &env.shim {
        command.envs(shim.env(node));
    }
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
    if let Some(secs) = scenario.rdzv_connect_timeout_secs {
        command.args(["--rdzv-connect-timeout-secs", &secs.to_string()]);
    }
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
    if env.network.is_some() && setup.python.is_some() {
        // gloo finds its address from the host name (loopback here), which the other
        // namespaces cannot reach: the node's interface instead (netns: `eth0`).
        command.env("GLOO_SOCKET_IFNAME", "eth0");
    }
    command.arg("--");
    match &setup.python {
        Some((python, script)) => {
            command
                .arg(python)
                .arg(script)
                .args(python_args(scenario, &env.url, scenario.steps))
        }
        None => command.args(train_args(scenario, &env.url)),
    };
    command
        .env(
            "RUST_LOG",
            std::env::var("CKPT_CHAOS_RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
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
    env: &Environment,
    scenario: &Scenario,
    job: &str,
    listen: &str,
    tx: &Sender<Line>,
) -> std::io::Result<(Child, String)> {
    let mut child = Command::new(&setup.ckpt)
        .envs(env.launcher_env.iter().map(|(k, v)| (k, v)))
        .args(["coordinator", "--listen", listen, "--job", job])
        .args(["--min-ranks", &scenario.min_ranks.to_string()])
        .args(["--max-ranks", &scenario.world().to_string()])
        .args([
            "--heartbeat-timeout-secs",
            &scenario.heartbeat_timeout_secs.to_string(),
        ])
        // Python ranks take seconds to import torch: the first generation waits for
        // all of them, as `ckpt launch`'s hosted coordinator does (its default).
        .args(if scenario.script.is_some() {
            vec!["--last-call-ms", "30000"]
        } else {
            vec![]
        })
        .env(
            "RUST_LOG",
            std::env::var("CKPT_CHAOS_RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| std::io::Error::other(format!("{}: {e}", setup.ckpt.display())))?;
    // What it logs goes into the run's log, as `[coordinator] …`.
    pump(COORDINATOR, child.stderr.take().expect("piped"), tx.clone());
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
    /// The newest step rank 0 reported starting to save (`at_save` triggers).
    saving: u64,
    /// Newest pid per rank label, with its node.
    pids: BTreeMap<usize, (usize, i32)>,
    coordinator: Option<String>,
    observed: Observed,
    /// Ranks (by label) that announced reaching the armed failpoint.
    at_failpoint: Vec<usize>,
    /// Rank 0 said a generation formed (`generation G: world W`, counted in
    /// `observed.worlds`) and has not yet said it starts training in it: the
    /// reference trainer's `start:` line that follows is the same generation.
    formed_not_started: bool,
    /// Samples the rank processes' resident sets while the run goes on.
    rss: Option<RssSampler>,
}

impl Watch {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            step: 0,
            saving: 0,
            pids: BTreeMap::new(),
            coordinator: None,
            observed: Observed::default(),
            at_failpoint: Vec::new(),
            formed_not_started: false,
            rss: None,
        }
    }

    fn seconds(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn take(&mut self, line: &Line) {
        let text = &line.text;
        if line.node == COORDINATOR {
            self.observed.log.push(format!("[coordinator] {text}"));
            return;
        }
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
            if let Some(rss) = &self.rss {
                rss.watch(label, pid);
            }
        }
        if let Some(formed) = parse_reformed(text) {
            self.observed.reformed.insert(formed);
        }
        if self.coordinator.is_none()
            && let Some(rest) = text.split(" coordinator ").nth(1)
            && text.starts_with("launch: node")
        {
            self.coordinator = rest.split(',').next().map(|a| format!("tcp://{a}"));
        }
        let Some((label, rest)) = text.strip_prefix("[rank ").and_then(|r| r.split_once("] "))
        else {
            return;
        };
        // Any rank may stop at the armed failpoint; the harness kills it there.
        if rest.starts_with("ckpt failpoint reached: ")
            && let Ok(label) = label.parse::<usize>()
        {
            self.at_failpoint.push(label);
            return;
        }
        // Every rank that finishes reports what its checkpointing held at most.
        if let Ok(label) = label.parse::<usize>()
            && let Some(peak) = parse_host_peak(label, rest)
        {
            self.observed.host_peaks.push(peak);
            return;
        }
        // Any rank may be the one a failpoint poisons.
        if let Some(poison) = parse_poison(rest) {
            self.observed.poisoned.push(poison);
            return;
        }
        // Steps, starts, resumes and recoveries are printed by rank 0 of the running
        // generation, whichever launcher slot (the `[rank L]` label) that is.
        if let Some((step, loss)) = rest.strip_prefix("step ").and_then(|r| {
            let mut words = r.split_whitespace();
            let step = words.next()?.parse::<u64>().ok()?;
            let loss = (words.next() == Some("loss"))
                .then(|| words.next().and_then(|l| l.parse::<f64>().ok()))
                .flatten()
                .unwrap_or(f64::NAN);
            Some((step, loss))
        }) {
            self.step = self.step.max(step);
            let world = self.observed.worlds.last().copied().unwrap_or(0);
            let t_s = self.seconds();
            self.observed.timeline.samples.push(Sample {
                t_s,
                step,
                loss,
                world,
            });
        } else if let Some(step) = saving_step(rest) {
            self.saving = self.saving.max(step);
        } else if let Some(world) = rest
            .strip_prefix("generation ")
            .and_then(|r| r.split_once(": world "))
            .and_then(|(_, r)| r.split_whitespace().next())
            .and_then(|w| w.parse().ok())
        {
            // Rank 0 as a generation forms: the Python trainer's (ckpt.elastic), or
            // the reference trainer's under a control plane.
            self.observed.worlds.push(world);
            self.formed_not_started = true;
        } else if let Some(entry) = parse_gen_line(rest) {
            // The Python trainer's rank 0, as it starts training in a generation.
            if entry.0 > 0 {
                self.observed.resumed_from.push(entry.0);
            }
            self.observed.schedule.push(entry);
        } else if let Some(world) = rest
            .strip_prefix("start: ")
            .and_then(|r| r.split(", world ").nth(1))
            .and_then(|r| r.split([',', ' ']).next())
            .and_then(|w| w.parse().ok())
        {
            // The reference trainer starts training in a generation: counted already
            // when its `generation` line came first, as it does under a control plane.
            if !std::mem::take(&mut self.formed_not_started) {
                self.observed.worlds.push(world);
            }
        } else if let Some(step) = rest
            .strip_prefix("resumed from snapshot step ")
            .and_then(|r| r.split_whitespace().next())
            .and_then(|s| s.parse().ok())
        {
            // Not a store commit: nothing for the health check to look up.
            self.observed.resumed_from.push(step);
            self.observed.snapshot_resumes.push((self.step, step));
        } else if let Some(step) = rest
            .strip_prefix("resumed from step ")
            .and_then(|r| r.split_whitespace().next())
            .and_then(|s| s.parse().ok())
        {
            self.observed.resumed_from.push(step);
            if let Some(dir) = rest
                .split(" (commit ")
                .nth(1)
                .and_then(|r| r.split(';').next())
            {
                self.observed.resumed_dirs.push(dir.to_string());
            }
        } else if let Some(rollback) = parse_rollback(rest) {
            self.observed.rollbacks.push(rollback);
        } else if rest.starts_with("recovery: generation ")
            && let Some(mut r) = parse_recovery(rest)
        {
            if r.noticed_unix_ms == 0 {
                // The Python trainer's line has no timestamp: it is printed as it is
                // back to training, `back_ms` after the failure was noticed.
                r.noticed_unix_ms = unix_ms().saturating_sub(r.back_ms);
            }
            self.observed.recoveries.push(r);
        }
    }
}

/// The generation a launcher saw form after a failure: `launch: recovery: generation
/// G ended, generation H formed with world W N ms later (CAUSE)` (a regroup to grow
/// the world says `launch: regroup: …`).
fn parse_reformed(text: &str) -> Option<u64> {
    text.strip_prefix("launch: recovery: generation ")?
        .split(", generation ")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The step of a save rank 0 reports starting: `step N: saving (stall …)` (the
/// Python trainer) or `saving step N (stall …)` (`ckpt-train`).
fn saving_step(rest: &str) -> Option<u64> {
    if let Some(r) = rest.strip_prefix("saving step ") {
        return r.split_whitespace().next()?.parse().ok();
    }
    let (step, after) = rest.strip_prefix("step ")?.split_once(": ")?;
    after.starts_with("saving").then(|| step.parse().ok())?
}

/// (first step, world) of the Python trainer's `gen G: from scratch (seed S) on W
/// ranks` or `gen G: resumed step S (saved on W0 ranks) on W ranks, cursor C, T s`.
fn parse_gen_line(rest: &str) -> Option<(u64, usize)> {
    let (generation, what) = rest.strip_prefix("gen ")?.split_once(": ")?;
    generation.parse::<u64>().ok()?;
    let world = |text: &str| -> Option<usize> {
        text.rsplit_once(" on ")?
            .1
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    if let Some(r) = what.strip_prefix("resumed step ") {
        let step = r.split_whitespace().next()?.parse().ok()?;
        let head = r.split(" ranks").take(2).collect::<Vec<_>>().join(" ranks");
        Some((step, world(&head)?))
    } else if what.starts_with("from scratch") {
        Some((0, world(what.split(" ranks").next()?)?))
    } else {
        None
    }
}

/// Parses `recovery: generation G world W (CAUSE): noticed at T ms, aborted +A ms,
/// rendezvous R ms, ring B ms, load L ms, first step F ms; back to training N ms …`
/// (`ckpt-train`), or the Python trainer's `recovery: generation G world W (CAUSE):
/// aborted +A ms, rendezvous R ms, process group P ms, load L ms, first step F ms;
/// back to training N ms …` (no timestamp: `noticed_unix_ms` is left 0).
fn parse_recovery(line: &str) -> Option<Recovery> {
    let rest = line.strip_prefix("recovery: generation ")?;
    let (generation, rest) = rest.split_once(" world ")?;
    let (world, rest) = rest.split_once(" (")?;
    let (cause, numbers) = match rest.rsplit_once("): noticed at ") {
        Some(found) => found,
        None => {
            let (cause, numbers) = rest.rsplit_once("): aborted ")?;
            (cause, numbers)
        }
    };
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
    let python = !line.contains("): noticed at ");
    let (at, abort_ms) = if python {
        let abort: u64 = numbers
            .trim_start_matches('+')
            .split(" ms")
            .next()?
            .trim()
            .parse()
            .ok()?;
        (0, abort)
    } else {
        (
            numbers.split(" ms").next()?.trim().parse().ok()?,
            number("aborted ")?,
        )
    };
    let group = number("ring ").or_else(|| number("process group "))?;
    Some(Recovery {
        generation: generation.parse().ok()?,
        world: world.parse().ok()?,
        cause: cause.to_string(),
        detect_ms: None,
        abort_ms,
        reform_ms: number("rendezvous ")? + group,
        load_ms: number("load ")?,
        first_step_ms: number("first step ")?,
        back_ms: number("back to training ").unwrap_or(0),
        noticed_unix_ms: at,
    })
}

/// Something a fault set to happen later: its end.
/// How long the harness keeps trying a remount that a file open for writing holds
/// up (EBUSY).
const REMOUNT_PATIENCE: Duration = Duration::from_secs(5);

enum Later {
    Resume(i32),
    RestartCoordinator,
    Heal(usize),
    FreeDisk(PathBuf),
    RestartEtcd(usize),
    Relaunch(usize),
    /// File calls succeed again (`io-error`).
    EndIoErrors,
    /// Sends go at once again (`net-delay`).
    EndDelay,
    /// The tmpfs is writable again (`read-only`).
    Writable,
}

/// Damages a data file of the newest commit in `store` (a local directory at `dir`).
fn corrupt(store: &ckpt::storage::Store, dir: &Path, how: &str) -> Result<Damaged, String> {
    let commits = crate::oracle::runtime()
        .block_on(ckpt::catalog::commits(store))
        .map_err(|e| e.to_string())?;
    let newest = commits.last().ok_or("no commit yet to corrupt")?;
    let commit_dir = dir.join(&newest.dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&commit_dir)
        .map_err(|e| format!("{}: {e}", commit_dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let file = files
        .first()
        .ok_or_else(|| format!("{}: no data file", commit_dir.display()))?;
    let mut bytes = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let len = bytes.len();
    if how == "truncate" {
        bytes.truncate(len / 2);
    } else {
        // A bit in the last quarter: tensor data, past the header.
        bytes[len * 3 / 4] ^= 0x10;
    }
    std::fs::write(file, bytes).map_err(|e| format!("{}: {e}", file.display()))?;
    Ok(Damaged {
        step: newest.step,
        dir: newest.dir.clone(),
    })
}

/// Fills the file system of `dir` with a file until it is full; returns the file.
fn fill_disk(dir: &Path) -> PathBuf {
    use std::io::Write;
    let path = dir.join(".chaos-disk-filler");
    if let Ok(mut file) = std::fs::File::create(&path) {
        let block = vec![0u8; 1 << 20];
        while file.write_all(&block).is_ok() {}
        // Whatever is left below a block.
        while file.write_all(&block[..4096]).is_ok() {}
        let _ = file.flush();
    }
    path
}

/// Runs `scenario` to its end (or `setup.timeout`) in `env` and reports what
/// happened.
pub fn run(scenario: &Scenario, setup: &Setup, env: &mut Environment) -> std::io::Result<Observed> {
    let (tx, rx): (Sender<Line>, Receiver<Line>) = channel();
    let job = format!("chaos-{}-{}", std::process::id(), unix_ms());
    let mut watch = Watch::new();
    watch.rss = Some(RssSampler::start());
    let store = env.store().map_err(std::io::Error::other)?;
    // The coordinator listens where every node reaches it: on the bridge when the
    // nodes live in namespaces.
    let listen = match &env.network {
        Some(network) => format!("{}:0", network.host_ip()),
        None => "127.0.0.1:0".into(),
    };
    let mut coordinator = match scenario.coordinator {
        CoordinatorKind::Standalone => {
            let (child, addr) = start_coordinator(setup, env, scenario, &job, &listen, &tx)?;
            watch.coordinator = Some(format!("tcp://{addr}"));
            Some((child, addr))
        }
        CoordinatorKind::Hosted => None,
        CoordinatorKind::Etcd => {
            watch.coordinator = env.etcd.as_ref().map(|c| c.url("chaos"));
            None
        }
    };
    let joined = watch.coordinator.clone();
    let mut nodes = vec![start_node(
        setup,
        env,
        scenario,
        0,
        &job,
        joined.as_deref(),
        &tx,
    )?];
    // The scenario's liveness bound, when it has one, ends the run: a run that
    // outlives it has failed, and waiting longer only hides what it waits for.
    let bound = scenario
        .expect
        .ends_within_secs
        .map(Duration::from_secs)
        .filter(|b| *b < setup.timeout);
    let deadline = watch.started + bound.unwrap_or(setup.timeout);
    // Node 0 hosts the coordinator; the others join it once it has said where.
    while scenario.nodes > nodes.len() {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => watch.take(&line),
            Err(_) => return Err(std::io::Error::other("node 0 never named its coordinator")),
        }
        if let Some(rdzv) = watch.coordinator.clone() {
            for node in 1..scenario.nodes {
                nodes.push(start_node(
                    setup,
                    env,
                    scenario,
                    node,
                    &job,
                    Some(&rdzv),
                    &tx,
                )?);
            }
        }
    }
    // Relaunched nodes need a sender; the loop ends when every launcher is gone and
    // no relaunch is pending.
    let relaunch_tx = tx;
    let mut pending: Vec<usize> = (0..scenario.faults.len()).collect();
    let mut later: Vec<(Instant, Later)> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    loop {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(20));
        match rx.recv_timeout(wait) {
            Ok(line) => watch.take(&line),
            Err(RecvTimeoutError::Timeout) if Instant::now() >= deadline => {
                if let Ok(dir) = std::env::var("CKPT_CHAOS_STACKS") {
                    let stacks = stacks_of(watch.pids.values().map(|&(_, pid)| pid));
                    let _ = std::fs::write(
                        Path::new(&dir).join(format!("stacks-{}.txt", std::process::id())),
                        format!("{}\n{}", watch.observed.log.join("\n"), stacks.join("\n")),
                    );
                }
                let killed = kill_everything(&mut nodes, &watch.pids, setup);
                let Some(bound) = bound else {
                    return Err(std::io::Error::other(format!(
                        "the run did not end within {:?}; killed {killed}",
                        setup.timeout
                    )));
                };
                watch.observed.cut = Some(format!(
                    "the run did not end within its bound of {} s (ends_within_secs); the harness killed {killed}",
                    bound.as_secs()
                ));
                break;
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        // Launchers all gone and nothing left to relaunch: the run is over (the
        // harness's own sender keeps the channel open).
        let running = nodes
            .iter_mut()
            .any(|n| matches!(n.child.try_wait(), Ok(None)));
        let relaunching = later.iter().any(|(_, l)| matches!(l, Later::Relaunch(_)));
        if !running && !relaunching {
            // Drain what the pumps still hold.
            while let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
                watch.take(&line);
            }
            break;
        }
        let now = Instant::now();
        let (due, not_yet): (Vec<_>, Vec<_>) = later.drain(..).partition(|(at, _)| now >= *at);
        later = not_yet;
        for (_, action) in due {
            match action {
                Later::Resume(pid) => signal(pid, libc::SIGCONT),
                Later::RestartCoordinator => {
                    if let Some((_, addr)) = &coordinator {
                        let addr = addr.clone();
                        coordinator = Some((
                            start_coordinator(setup, env, scenario, &job, &addr, &relaunch_tx)?.0,
                            addr,
                        ));
                    }
                }
                Later::Heal(node) => {
                    if let Some(network) = &env.network
                        && let Err(e) = network.heal(node)
                    {
                        notes.push(format!("healing node {node}: {e}"));
                    }
                }
                Later::FreeDisk(filler) => {
                    let _ = std::fs::remove_file(filler);
                }
                Later::RestartEtcd(member) => {
                    if let Some(cluster) = env.etcd.as_mut()
                        && let Err(e) = cluster.restart(member)
                    {
                        notes.push(format!("restarting etcd member {member}: {e}"));
                    }
                }
                Later::EndIoErrors => {
                    if let Some(shim) = &env.shim {
                        shim.fail_io(0, None);
                        notes.push(format!(
                            "io-error over: {} file calls failed so far",
                            shim.io_fired()
                        ));
                    }
                }
                Later::EndDelay => {
                    if let Some(shim) = &env.shim {
                        shim.delay_sends(0, None);
                        notes.push(format!(
                            "net-delay over: {} sends delayed so far",
                            shim.sends_delayed()
                        ));
                    }
                }
                Later::Writable => {
                    if let Err(e) = env.remount(false, REMOUNT_PATIENCE) {
                        notes.push(format!("making the checkpoints writable again: {e}"));
                    }
                }
                Later::Relaunch(node) => {
                    let rdzv = watch.coordinator.clone();
                    let fresh = start_node(
                        setup,
                        env,
                        scenario,
                        node,
                        &job,
                        rdzv.as_deref(),
                        &relaunch_tx,
                    )?;
                    nodes[node] = fresh;
                    let t_s = watch.seconds();
                    watch.observed.timeline.faults.push(FaultMark {
                        t_s,
                        label: format!("node {node} started again"),
                    });
                    watch
                        .observed
                        .log
                        .push(format!("[harness] node {node} started again"));
                }
            }
        }
        let step = watch.step;
        let elapsed_ms = watch.started.elapsed().as_millis() as u64;
        let mut fire = Vec::new();
        pending.retain(|&i| {
            let fault = &scenario.faults[i];
            let due = match fault.kind {
                // Set off by the rank itself, reaching the armed failpoint.
                FaultKind::KillInSave => !watch.at_failpoint.is_empty(),
                _ => {
                    fault.at_step.is_some_and(|s| step >= s)
                        || fault.at_ms.is_some_and(|ms| elapsed_ms >= ms)
                        || fault.at_save.is_some_and(|s| watch.saving >= s)
                }
            };
            if due {
                fire.push(i);
            }
            !due
        });
        for i in fire {
            let fault = &scenario.faults[i];
            let pause = Duration::from_millis(fault.duration_ms.unwrap_or(0));
            let rank_pid = |rank: Option<usize>| watch.pids.get(&rank.unwrap_or(0)).map(|p| p.1);
            let mut target = fault.target();
            match fault.kind {
                FaultKind::Kill => {
                    if let Some(pid) = rank_pid(fault.rank) {
                        signal(pid, libc::SIGKILL);
                    }
                }
                FaultKind::KillInSave => {
                    for label in std::mem::take(&mut watch.at_failpoint) {
                        if let Some(pid) = rank_pid(Some(label)) {
                            signal(pid, libc::SIGKILL);
                        }
                        target = format!(
                            "rank {label} at {}",
                            fault.stage.as_deref().unwrap_or_default()
                        );
                    }
                }
                FaultKind::Stop => {
                    if let Some(pid) = rank_pid(fault.rank) {
                        signal(pid, libc::SIGSTOP);
                        later.push((Instant::now() + pause, Later::Resume(pid)));
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
                        let _ = n.child.wait();
                    }
                    if fault.duration_ms.is_some() {
                        later.push((Instant::now() + pause, Later::Relaunch(node)));
                    }
                }
                // Fired by the trainer itself at that step.
                FaultKind::DeviceError | FaultKind::Sdc | FaultKind::Nan => {}
                FaultKind::KillCoordinator => {
                    if let Some((child, _)) = coordinator.as_mut() {
                        let _ = child.kill();
                        let _ = child.wait();
                        later.push((Instant::now() + pause, Later::RestartCoordinator));
                    }
                }
                FaultKind::Partition => {
                    let node = fault.node.unwrap_or(0);
                    if let Some(network) = &env.network {
                        match network.partition(node) {
                            Ok(()) => later.push((Instant::now() + pause, Later::Heal(node))),
                            Err(e) => notes.push(format!("partitioning node {node}: {e}")),
                        }
                    }
                }
                FaultKind::StorageErrors
                | FaultKind::StorageLatency
                | FaultKind::StorageReset
                | FaultKind::StorageLosePart
                | FaultKind::StorageCorrupt => {
                    if let Some(proxy) = &env.proxy {
                        proxy.inject(storage_fault(fault));
                    }
                }
                FaultKind::DiskFull => {
                    if let Some(dir) = &env.local_dir {
                        let filler = fill_disk(dir);
                        later.push((Instant::now() + pause, Later::FreeDisk(filler)));
                    }
                }
                FaultKind::Corrupt => {
                    if let Some(dir) = &env.local_dir {
                        match corrupt(&store, dir, fault.how.as_deref().unwrap_or("bit-flip")) {
                            Ok(damaged) => {
                                target = format!("step {} ({})", damaged.step, damaged.dir);
                                watch.observed.damaged.push(damaged);
                            }
                            Err(e) => notes.push(format!("corrupting: {e}")),
                        }
                    }
                }
                FaultKind::KillEtcdMember => {
                    let member = fault.member.unwrap_or(0);
                    if let Some(cluster) = env.etcd.as_mut() {
                        cluster.kill(member);
                        later.push((Instant::now() + pause, Later::RestartEtcd(member)));
                    }
                }
                FaultKind::IoError => {
                    if let Some(shim) = &env.shim {
                        let flags = match fault.how.as_deref() {
                            Some("read") => crate::shim::layout::EIO_READ,
                            _ => crate::shim::layout::EIO_WRITE,
                        };
                        shim.fail_io(flags, fault.rank);
                        later.push((Instant::now() + pause, Later::EndIoErrors));
                    }
                }
                FaultKind::ReadOnly => match env.remount(true, REMOUNT_PATIENCE) {
                    Ok(()) => later.push((Instant::now() + pause, Later::Writable)),
                    Err(e) => notes.push(format!("making the checkpoints read-only: {e}")),
                },
                FaultKind::NetDelay => {
                    if let Some(shim) = &env.shim {
                        let ms = fault.delay_ms.unwrap_or(0);
                        shim.delay_sends(u32::try_from(ms).unwrap_or(u32::MAX), fault.node);
                        later.push((Instant::now() + pause, Later::EndDelay));
                    }
                }
                FaultKind::NetLoss | FaultKind::PartitionStore | FaultKind::PartitionEtcd => {
                    let node = fault.node.unwrap_or(0);
                    let cut = match (fault.kind, &env.network) {
                        (_, None) => Err("no network namespaces".to_owned()),
                        (FaultKind::NetLoss, Some(network)) => {
                            network.lose(node, fault.percent.unwrap_or(0))
                        }
                        (FaultKind::PartitionStore, Some(network)) => match &env.proxy {
                            Some(proxy) => network.cut_off(node, &[proxy.addr()]),
                            None => Err("no storage proxy".to_owned()),
                        },
                        (_, Some(network)) => match &env.etcd {
                            Some(cluster) => network.cut_off(node, &cluster.clients()),
                            None => Err("no etcd cluster".to_owned()),
                        },
                    };
                    match cut {
                        Ok(()) => later.push((Instant::now() + pause, Later::Heal(node))),
                        Err(e) => notes.push(format!("{} on node {node}: {e}", fault.kind.name())),
                    }
                }
            }
            let at_s = watch.seconds();
            let label = format!("{} {target}", fault.kind.name());
            watch
                .observed
                .timeline
                .faults
                .push(FaultMark { t_s: at_s, label });
            watch.observed.fired.push(Fired {
                kind: fault.kind.name(),
                target,
                at_step: step,
                at_ms: watch.started.elapsed().as_millis() as u64,
                unix_ms: unix_ms(),
            });
        }
    }
    for (_, action) in later {
        match action {
            Later::Resume(pid) => signal(pid, libc::SIGCONT),
            Later::FreeDisk(filler) => {
                let _ = std::fs::remove_file(filler);
            }
            Later::Writable => {
                // The oracle reads the checkpoints; nothing must write them now,
                // but the harness's own cleanup does.
                let _ = env.remount(false, REMOUNT_PATIENCE);
            }
            _ => {}
        }
    }
    if let Some((mut child, _)) = coordinator {
        let _ = child.kill();
        let _ = child.wait();
    }
    for (i, node) in nodes.iter_mut().enumerate() {
        if node.killed {
            // Killed on purpose (a fault, or the bound): reaped if it can be.
            let _ = node.child.try_wait();
            continue;
        }
        let status = node.child.wait()?;
        watch
            .observed
            .exit_codes
            .insert(i, status.code().unwrap_or(128));
    }
    finish(&mut watch);
    watch
        .observed
        .log
        .extend(notes.iter().map(|n| format!("[harness] {n}")));
    watch.observed.storage = env.proxy.as_ref().map(|p| p.stats());
    if let Some(rss) = watch.rss.take() {
        watch.observed.rss_max_kib = rss.finish();
    }
    Ok(watch.observed)
}

/// SIGKILLs every launcher and every rank process the run started that is still
/// alive (a stopped one too: SIGKILL ends a stopped process) and reaps the
/// launchers, waiting a few seconds at most; says what it killed. A rank's pid
/// counts only while it still names the trainer, or runs the Python trainer's script
/// (a pid is reused once its process is gone).
fn kill_everything(
    nodes: &mut [Node],
    pids: &BTreeMap<usize, (usize, i32)>,
    setup: &Setup,
) -> String {
    // The kernel keeps the first 15 bytes of the program's name.
    let name: Vec<u8> = setup
        .trainer
        .file_name()
        .map(|n| n.as_encoded_bytes().iter().copied().take(15).collect())
        .unwrap_or_default();
    let script: Option<Vec<u8>> = setup
        .python
        .as_ref()
        .map(|(_, script)| script.as_os_str().as_encoded_bytes().to_vec());
    let mut killed = Vec::new();
    for (label, &(_, pid)) in pids {
        let ours = match &script {
            Some(script) => std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                cmdline
                    .split(|b| *b == 0)
                    .any(|arg| arg == script.as_slice())
            }),
            None => std::fs::read(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.strip_suffix(b"\n").unwrap_or(&comm) == name.as_slice()),
        };
        match proc_state(pid) {
            None | Some('Z') => {}
            Some(_) if !ours => {}
            Some(state) => {
                signal(pid, libc::SIGKILL);
                killed.push(format!("rank {label} (pid {pid}, state {state})"));
            }
        }
    }
    for (i, node) in nodes.iter_mut().enumerate() {
        if matches!(node.child.try_wait(), Ok(None)) {
            let _ = node.child.kill();
            node.killed = true;
            killed.push(format!(
                "the launcher of node {i} (pid {})",
                node.child.id()
            ));
        }
    }
    let until = Instant::now() + Duration::from_secs(5);
    while nodes
        .iter_mut()
        .any(|n| matches!(n.child.try_wait(), Ok(None)))
        && Instant::now() < until
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    if killed.is_empty() {
        "nothing (every process had ended)".into()
    } else {
        killed.join(", ")
    }
}

/// The state letter of `/proc/PID/stat` (`R`, `S`, `D`, `T`, `Z`…), `None` once the
/// process is gone.
pub fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Every thread's stack of each live process in `pids` (gdb, when installed): what a
/// run that hangs was waiting for.
fn stacks_of(pids: impl Iterator<Item = i32>) -> Vec<String> {
    let mut out = Vec::new();
    for pid in pids {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if let Ok(o) = Command::new("gdb")
            .args([
                "-p",
                &pid.to_string(),
                "-batch",
                "-ex",
                "thread apply all bt 30",
            ])
            .stdin(Stdio::null())
            .output()
        {
            out.push(format!(
                "== pid {pid}\n{}",
                String::from_utf8_lossy(&o.stdout)
            ));
        }
    }
    out
}

/// The proxy's fault for a storage fault of a scenario.
fn storage_fault(fault: &Fault) -> crate::storage_proxy::StorageFault {
    use crate::storage_proxy::StorageFault;
    let count = fault.count.unwrap_or(1);
    match fault.kind {
        FaultKind::StorageLatency => StorageFault::Latency {
            ms: fault.duration_ms.unwrap_or(0),
            count,
        },
        FaultKind::StorageReset => StorageFault::ResetMidBody { count },
        FaultKind::StorageLosePart => StorageFault::LosePart { count },
        FaultKind::StorageCorrupt => StorageFault::CorruptBody {
            direction: if fault.how.as_deref() == Some("get") {
                crate::storage_proxy::Direction::Get
            } else {
                crate::storage_proxy::Direction::Put
            },
            count,
        },
        _ => StorageFault::Errors {
            status: fault.status.unwrap_or(503),
            count,
        },
    }
}

/// Detection times, recovery spans, goodput and the end of the timeline.
fn finish(watch: &mut Watch) {
    let started_unix = unix_ms().saturating_sub(watch.started.elapsed().as_millis() as u64);
    let fired: Vec<u64> = watch.observed.fired.iter().map(|f| f.unix_ms).collect();
    for recovery in watch.observed.recoveries.iter_mut() {
        let noticed = recovery.noticed_unix_ms;
        recovery.detect_ms = fired
            .iter()
            .filter(|&&f| f <= noticed)
            .max()
            .map(|f| noticed - f);
        // From the fault (when one preceded it) to training again.
        let cost_ms = recovery.detect_ms.unwrap_or(0) + recovery.back_ms;
        let to_s = (noticed + recovery.back_ms).saturating_sub(started_unix) as f64 / 1e3;
        watch.observed.timeline.recoveries.push(RecoverySpan {
            from_s: to_s - cost_ms as f64 / 1e3,
            to_s,
            label: format!(
                "gen {}: {} rank{}, {:.1} s",
                recovery.generation,
                recovery.world,
                if recovery.world == 1 { "" } else { "s" },
                cost_ms as f64 / 1e3
            ),
        });
    }
    watch.observed.wall_s = watch.started.elapsed().as_secs_f64();
    watch.observed.timeline.end_s = watch.observed.wall_s;
    watch.observed.goodput = goodput(&watch.observed.timeline.samples);
}

/// Goodput from rank 0's step reports: steps × the median time between two
/// consecutive steps, over the time from the first report to the last (see
/// [`Observed::goodput`]).
pub fn goodput(samples: &[Sample]) -> Option<f64> {
    let (first, last) = (samples.first()?, samples.last()?);
    let mut gaps: Vec<f64> = samples
        .windows(2)
        .filter(|w| w[1].step == w[0].step + 1)
        .map(|w| w[1].t_s - w[0].t_s)
        .collect();
    if gaps.is_empty() {
        return None;
    }
    gaps.sort_by(f64::total_cmp);
    let pace = gaps[gaps.len() / 2];
    let needed = pace * (last.step.saturating_sub(first.step)) as f64;
    let took = last.t_s - first.t_s;
    (took > 0.0).then(|| (needed / took).min(1.0))
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
    fn a_launchers_recovery_line_gives_the_generation_formed() {
        let line = "launch: recovery: generation 1 ended, generation 2 formed with world 4 1886 ms later (member n1 (rank 2): collective failed with rank 1: all_gather: lost rank 1: connection closed)";
        assert_eq!(parse_reformed(line), Some(2));
        let regroup = "launch: regroup: generation 2 ended, generation 3 formed with world 4 12 ms later (grow: 2 waiting members (after step 15 committed))";
        assert_eq!(parse_reformed(regroup), None);
        assert_eq!(
            parse_reformed("launch: generation 1 formed with world 4 (initial)"),
            None
        );
    }

    #[test]
    fn a_recovery_line_is_parsed() {
        let line = "recovery: generation 2 world 3 (lost member n0-l2-i0: connection closed): noticed at 1795491906789 ms, aborted +4 ms, rendezvous 6 ms, ring 4 ms, load 7 ms, first step 1 ms; back to training 28 ms after the failure was noticed";
        let r = parse_recovery(line).unwrap();
        assert_eq!((r.generation, r.world), (2, 3));
        assert_eq!(r.cause, "lost member n0-l2-i0: connection closed");
        assert_eq!(
            (r.abort_ms, r.reform_ms, r.load_ms, r.first_step_ms),
            (4, 10, 7, 1)
        );
        assert_eq!((r.noticed_unix_ms, r.back_ms), (1795491906789, 28));
    }

    #[test]
    fn poisons_rollbacks_and_resumed_commits_are_parsed() {
        assert_eq!(
            parse_poison("fault: rank 2 wrote a NaN into param/layers.2.bias after step 15"),
            Some(Poison {
                kind: "nan".into(),
                rank: 2,
                step: 15
            })
        );
        assert_eq!(
            parse_poison(
                "fault: rank 3 (replica 1 of shard 1) flipped a bit of param/layers.0.weight before saving step 10"
            ),
            Some(Poison {
                kind: "sdc".into(),
                rank: 3,
                step: 10
            })
        );
        assert_eq!(parse_poison("fault: rank 1 device error at step 12"), None);
        assert_eq!(
            parse_rollback(
                "rolled back from step 15 to step 10: non-finite parameters entering step 16"
            ),
            Some((15, 10))
        );
        let mut watch = Watch::new();
        for text in [
            "[rank 0] start: preset tiny (1732 parameters), world 4 (2 replicas of 2 shards), step 0 of 30, deterministic mode",
            "[rank 0] resumed from step 10 of file:///x (commit step-00000010/g00000001-job-e1; saved by 4 ranks, resharded onto 3)",
            "[rank 3] fault: rank 3 wrote a NaN into param/layers.2.bias after step 15",
        ] {
            watch.take(&Line {
                node: 0,
                text: text.into(),
            });
        }
        assert_eq!(watch.observed.worlds, [4]);
        assert_eq!(watch.observed.resumed_from, [10]);
        assert_eq!(
            watch.observed.resumed_dirs,
            ["step-00000010/g00000001-job-e1"]
        );
        assert_eq!(watch.observed.poisoned.len(), 1);
    }

    #[test]
    fn snapshot_resumes_and_host_memory_peaks_are_parsed() {
        let mut watch = Watch::new();
        for text in [
            "[rank 0] step 15 loss 0.5",
            "[rank 0] snapshot step 14 not resumed from: no survivor holds the file of rank(s) 2 of its 4 ranks; resuming from the store",
            "[rank 0] resumed from snapshot step 14 in memory (snapshot step-00000014/g00000001-snap-job-e1; saved by 4 ranks, resharded onto 3; rows rebuilt from memory on 3 of 3 ranks (0.0 MB own, 0.0 MB from peers); load: 0 bytes from the store)",
            r#"[rank 3] final host_bytes_held {"budget":4194304,"total":56264,"peak":65964,"staging":12288,"copies":12288,"replicas":9700,"snapshots":12288,"snapshot_replicas":9700} (rank 2)"#,
            "[rank 1] final host_bytes_held {not json} (rank 1)",
        ] {
            watch.take(&Line {
                node: 0,
                text: text.into(),
            });
        }
        assert_eq!(watch.observed.resumed_from, [14]);
        assert_eq!(watch.observed.snapshot_resumes, [(15, 14)]);
        // Not a store commit: the health check has nothing to look up.
        assert!(watch.observed.resumed_dirs.is_empty());
        assert_eq!(
            watch.observed.host_peaks,
            [HostPeak {
                label: 3,
                peak: 65964,
                budget: Some(4194304)
            }]
        );
    }

    #[test]
    fn the_rss_sampler_reads_this_process() {
        let sampler = RssSampler::start();
        sampler.watch(7, std::process::id() as i32);
        // `finish` samples a last round: no wait for the timer's.
        let max = sampler.finish();
        assert!(max.get(&7).is_some_and(|kib| *kib > 0), "{max:?}");
    }

    #[test]
    fn the_python_trainers_lines_are_parsed() {
        let line = "recovery: generation 2 world 3 (lost member n0-l2-i0: connection closed (rank 2)): aborted +3 ms, rendezvous 250 ms, process group 40 ms, load 120 ms, first step 90 ms; back to training 512 ms after the failure was noticed";
        let r = parse_recovery(line).unwrap();
        assert_eq!((r.generation, r.world), (2, 3));
        assert_eq!(r.cause, "lost member n0-l2-i0: connection closed (rank 2)");
        assert_eq!(
            (
                r.abort_ms,
                r.reform_ms,
                r.load_ms,
                r.first_step_ms,
                r.back_ms
            ),
            (3, 290, 120, 90, 512)
        );
        assert_eq!(r.noticed_unix_ms, 0);
        // The same with the time it was noticed, and what the load read from memory.
        let line = "recovery: generation 2 world 3 (lost member n1-l0-i0: no heartbeat for 3010 ms): noticed at 1795738411338 ms, aborted +1 ms, rendezvous 6873 ms, process group 36 ms, load 161 ms (rank 0's rows from memory: 0.4 MB own, 0.4 MB from peers), first step 159 ms; back to training 7231 ms after the failure was noticed";
        let r = parse_recovery(line).unwrap();
        assert_eq!(
            (
                r.abort_ms,
                r.reform_ms,
                r.load_ms,
                r.first_step_ms,
                r.back_ms
            ),
            (1, 6909, 161, 159, 7231)
        );
        assert_eq!(r.noticed_unix_ms, 1795738411338);
        assert_eq!(
            parse_gen_line("gen 1: from scratch (seed 7) on 4 ranks"),
            Some((0, 4))
        );
        assert_eq!(
            parse_gen_line(
                "gen 3: resumed step 20 (saved on 4 ranks) on 3 ranks, cursor 480, 0.52s"
            ),
            Some((20, 3))
        );
        assert_eq!(
            parse_gen_line("gen 3: stopping after the commit of step 20"),
            None
        );
        assert_eq!(saving_step("step 30: saving (stall 20.1 ms)"), Some(30));
        assert_eq!(saving_step("saving step 15 (stall 0.3 ms)"), Some(15));
        assert_eq!(saving_step("step 30 loss 4.1 (2.0s)"), None);
    }

    fn rank0(text: &str) -> Line {
        Line {
            node: 0,
            text: format!("[rank 0] {text}"),
        }
    }

    #[test]
    fn each_generation_counts_once_in_the_worlds_started() {
        // The reference trainer's rank 0 says both that its generation formed and that
        // it starts training in it.
        let mut w = Watch::new();
        for (generation, world) in [(1, 4), (2, 3), (3, 1), (4, 3)] {
            w.take(&rank0(&format!(
                "generation {generation}: world {world} (initial), rendezvous 3 ms"
            )));
            w.take(&rank0(&format!(
                "start: preset tiny (1000 parameters), world {world}, step 0 of 40, deterministic mode"
            )));
        }
        assert_eq!(w.observed.worlds, vec![4, 3, 1, 3]);
        // A generation that formed and failed before it trained still counts; one
        // started without an elastic control plane says only `start:`.
        let mut w = Watch::new();
        w.take(&rank0("generation 1: world 4 (initial), rendezvous 3 ms"));
        w.take(&rank0(
            "generation 2: world 3 (lost member), rendezvous 3 ms",
        ));
        w.take(&rank0(
            "start: preset tiny (1000 parameters), world 3, step 0 of 40, fast mode",
        ));
        w.take(&rank0(
            "start: preset tiny (1000 parameters), world 2, step 10 of 40, fast mode",
        ));
        assert_eq!(w.observed.worlds, vec![4, 3, 2]);
    }

    fn sample(t_s: f64, step: u64) -> Sample {
        Sample {
            t_s,
            step,
            loss: 1.0,
            world: 4,
        }
    }

    #[test]
    fn goodput_is_the_share_of_time_a_failure_free_run_would_have_needed() {
        // Ten steps at 0.1 s: nothing lost.
        let steady: Vec<Sample> = (0..10).map(|i| sample(i as f64 * 0.1, i + 1)).collect();
        assert!((goodput(&steady).unwrap() - 1.0).abs() < 1e-9);
        // A 0.9 s outage between steps 5 and 6, then steps 4..=5 done again: the
        // run advanced 9 steps (0.9 s of work) in 2.0 s.
        let mut hurt: Vec<Sample> = (0..5).map(|i| sample(i as f64 * 0.1, i + 1)).collect();
        hurt.extend((0..7).map(|i| sample(1.3 + i as f64 * 0.1, i + 4)));
        let g = goodput(&hurt).unwrap();
        assert!((g - 0.9 / 1.9).abs() < 1e-9, "{g}");
        assert_eq!(goodput(&[]), None);
    }
}
