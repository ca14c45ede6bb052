//! `ckpt bench control-plane`: the control plane of a large job, simulated on one
//! machine with the real code that a large job runs.
//!
//! # What is real and what is simulated
//!
//! - The coordinator is the real `ckpt coordinator`, in a process of its own (so its
//!   CPU and memory can be read apart from the simulation's); with `--backend etcd`
//!   there is no coordinator and the nodes use the etcd cluster named by `--etcd`.
//! - Each node is a real [`NodeAgent`], the launcher-side code every `ckpt launch`
//!   runs, joined to the control plane over a real socket as one member holding its
//!   node's ranks.
//! - The ranks are simulated: each is a light record in this process, attached to
//!   its node's agent ([`NodeAgent::attach`]). One thread sends all their
//!   heartbeats; what their nodes tell them is read, and answered as a rank would
//!   (it asks for the next generation after a restart), by one answering thread per
//!   core, each for a share of the nodes (every rank of a node on the same thread,
//!   so each rank's lines stay in order). The protocol handling on the node's side
//!   is the one that serves real ranks.
//!
//! Why several answering threads: in a real job each rank reads its node on its own
//! machine, all at once. One thread answering for 16,384 ranks, taking a lock and
//! waking the waiting thread at every line, was the slowest part of a restart on two
//! cores: its queue never ran dry, so the time between the first survivor told and
//! the last was its own pace (about 1 s), not the control plane's. The answering
//! threads also record what they read in batches, waking the waiting thread once a
//! batch instead of once a line.
//!
//! # What it measures
//!
//! 1. Formation: every rank asks for a generation; `form_ms` is the time from the
//!    last rank's ask to the moment every rank holds its place.
//! 2. Steady state (`--steady-secs`): messages per second the control plane
//!    receives from the nodes, the coordinator's CPU and RSS, etcd's writes and
//!    database size.
//! 3. A node's loss: the last node goes silent (`--kill silence`, as a stopped
//!    machine: detected by the heartbeat timeout) or has its connections cut
//!    (`--kill close`, as a killed launcher). `detect_ms` is the time until every
//!    survivor was told to restart, `reform_ms` until every survivor holds its place
//!    in the next generation.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use ckpt_elastic::protocol::{self, ClientMessage, ServerMessage};
use ckpt_elastic::{
    Assignment, Cancel, ControlPlane, Directive, ElasticError, Member, NodeAgent, NodeConfig,
    Progress, Report, TcpControlPlane, TcpSettings, Timeouts,
};
use serde::Serialize;

/// The control plane the nodes use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Backend {
    /// The built-in coordinator (`ckpt coordinator`, started by the bench).
    Tcp,
    /// An etcd cluster (`--etcd`), no coordinator.
    Etcd,
}

/// How the node that is lost goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Kill {
    /// It stops answering and its connections stay open (a stopped or cut-off
    /// machine): found by the heartbeat timeout.
    Silence,
    /// Its connections close (its launcher killed).
    Close,
}

/// What to run.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// Simulated nodes.
    pub nodes: usize,
    /// Ranks per node.
    pub ranks_per_node: usize,
    /// The control plane.
    pub backend: Backend,
    /// etcd cluster, `etcd://HOST:PORT[,…]/PREFIX` (for `Backend::Etcd`).
    pub etcd: Option<String>,
    /// The steady-state window.
    pub steady: Duration,
    /// How the lost node goes.
    pub kill: Kill,
    /// The job's windows (heartbeat timeout and the rest).
    pub timeouts: Timeouts,
    /// The `ckpt` binary that runs the coordinator.
    pub ckpt: std::path::PathBuf,
}

/// The figures (the JSON keys are the issue's).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ControlPlaneReport {
    /// The control plane.
    pub backend: Backend,
    /// Simulated nodes.
    pub nodes: usize,
    /// Ranks per node.
    pub ranks_per_node: usize,
    /// All ranks.
    pub ranks: usize,
    /// Starting and connecting every node and rank (not a figure of the control
    /// plane: the simulation's own setup).
    pub setup_ms: f64,
    /// From the last rank's ask to every rank holding its place.
    pub form_ms: f64,
    /// Ranks that got the generation (must be `ranks`).
    pub members_with_generation: usize,
    /// Messages per second the control plane receives from the nodes, steady state.
    pub messages_per_s: f64,
    /// The coordinator's CPU in the steady state, in cores (`tcp` only).
    pub coordinator_cores: Option<f64>,
    /// The coordinator's resident memory at the end of the steady state (`tcp`).
    pub coordinator_rss_mib: Option<f64>,
    /// etcd writes per second in the steady state (`etcd` only).
    pub etcd_writes_per_s: Option<f64>,
    /// etcd's database size after the steady state (`etcd` only).
    pub etcd_db_mib: Option<f64>,
    /// This process's CPU in the steady state, in cores: the simulation itself (the
    /// nodes' agents and the simulated ranks), which shares the machine.
    pub simulation_cores: f64,
    /// How the lost node went.
    pub kill: Kill,
    /// The heartbeat timeout the loss is judged with.
    pub heartbeat_timeout_ms: f64,
    /// From the loss to the first survivor told to restart: when the control plane
    /// acted.
    pub detect_ms: f64,
    /// From the loss to the last survivor told to restart (the fan-out through the
    /// nodes to every simulated rank included).
    pub detect_all_ms: f64,
    /// From the loss to every survivor holding its place in the next generation.
    pub reform_ms: f64,
    /// Ranks in the next generation (must be `ranks - ranks_per_node`).
    pub survivors_with_generation: usize,
    /// Threads that read and answer the simulated ranks' lines (one per core, at
    /// most 16 and at most one per node): part of the simulation, not of the
    /// control plane.
    pub answering_threads: usize,
}

/// Counts the messages a node sends to the control plane.
struct Counted {
    inner: Arc<dyn ControlPlane>,
    sent: Arc<AtomicU64>,
}

impl Counted {
    fn count(&self) {
        self.sent.fetch_add(1, Ordering::Relaxed);
    }
}

impl ControlPlane for Counted {
    fn rendezvous(&self, after: u64, cancel: &Cancel) -> Result<Assignment, ElasticError> {
        self.count();
        self.inner.rendezvous(after, cancel)
    }
    fn heartbeat(&self, generation: u64, progress: &Progress) -> Result<(), ElasticError> {
        self.count();
        self.inner.heartbeat(generation, progress)
    }
    fn watch(&self, generation: u64, timeout: Duration) -> Result<Option<Directive>, ElasticError> {
        self.inner.watch(generation, timeout)
    }
    fn report(&self, generation: u64, report: &Report) -> Result<(), ElasticError> {
        self.count();
        self.inner.report(generation, report)
    }
    fn kv_set(&self, generation: u64, key: &str, value: &str) -> Result<(), ElasticError> {
        self.count();
        self.inner.kv_set(generation, key, value)
    }
    fn kv_get(
        &self,
        generation: u64,
        key: &str,
        cancel: &Cancel,
        timeout: Duration,
    ) -> Result<String, ElasticError> {
        self.inner.kv_get(generation, key, cancel, timeout)
    }
    fn commit_snapshot(&self, generation: u64, record: &str) -> Result<(), ElasticError> {
        self.count();
        self.inner.commit_snapshot(generation, record)
    }
    fn committed_snapshot(&self) -> Result<Option<String>, ElasticError> {
        self.count();
        self.inner.committed_snapshot()
    }
    fn hold(&self, ranks: usize) -> Result<(), ElasticError> {
        self.count();
        self.inner.hold(ranks)
    }
    fn kv_all(
        &self,
        generation: u64,
        known: usize,
        timeout: Duration,
    ) -> Result<Vec<(String, String)>, ElasticError> {
        self.inner.kv_all(generation, known, timeout)
    }
}

/// What one simulated rank knows.
#[derive(Debug, Clone, Default)]
struct RankState {
    /// Its newest assignment, and when it arrived.
    assigned: Option<(Assignment, Instant)>,
    /// The last restart it was told, and when.
    restarted: Option<(u64, Instant)>,
}

/// The simulated ranks: their states, and a condition variable that wakes whoever
/// waits for them.
struct Ranks {
    states: Mutex<Vec<RankState>>,
    changed: Condvar,
    /// The attached ranks (index = rank number); `None` once its node is gone.
    links: RwLock<Vec<Option<ckpt_elastic::node::AttachedRank>>>,
    step: AtomicU64,
}

impl Ranks {
    fn send(&self, i: usize, message: ClientMessage) {
        if let Some(Some(link)) = self.links.read().unwrap_or_else(|p| p.into_inner()).get(i) {
            let _ = link.send(message);
        }
    }

    /// Waits until `done` holds for the states, or `limit` passes; whether it held.
    fn wait(&self, limit: Duration, mut done: impl FnMut(&[RankState]) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if done(&states) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            states = self
                .changed
                .wait_timeout(states, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// What an answering thread read for one rank, and when.
enum Heard {
    Assigned(Assignment, Instant),
    Restarted(u64, Instant),
}

/// Lines an answering thread reads before it records them, when its queue does not
/// run dry first.
const BATCH: usize = 256;

impl Ranks {
    /// Records what was heard (in the order heard) and wakes whoever waits.
    fn record(&self, heard: &mut Vec<(usize, Heard)>) {
        if heard.is_empty() {
            return;
        }
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        for (i, what) in heard.drain(..) {
            match what {
                Heard::Assigned(assignment, at) => states[i].assigned = Some((assignment, at)),
                Heard::Restarted(generation, at) => states[i].restarted = Some((generation, at)),
            }
        }
        self.changed.notify_all();
    }
}

/// How many threads answer the simulated ranks: one per core, at most 16, and no
/// more than there are nodes.
fn answering_threads(nodes: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.clamp(1, 16).min(nodes.max(1))
}

/// Reads what the nodes tell the ranks whose lines come to `lines` and answers as
/// ranks would. Each line's time is taken when it is read; what was read is
/// recorded when the queue runs dry or after [`BATCH`] lines.
fn answer(ranks: &Ranks, lines: Receiver<(usize, Arc<str>)>) {
    let mut heard = Vec::with_capacity(BATCH);
    loop {
        let (i, line) = match lines.try_recv() {
            Ok(next) => next,
            Err(TryRecvError::Empty) => {
                ranks.record(&mut heard);
                match lines.recv() {
                    Ok(next) => next,
                    Err(_) => break,
                }
            }
            Err(TryRecvError::Disconnected) => break,
        };
        let Ok(message) = protocol::decode::<ServerMessage>(line.trim_end().as_bytes()) else {
            continue;
        };
        let now = Instant::now();
        match message {
            ServerMessage::Assigned { assignment } => {
                heard.push((i, Heard::Assigned(assignment, now)));
            }
            ServerMessage::Directive {
                directive: Directive::Restart { generation, .. },
            } => {
                heard.push((i, Heard::Restarted(generation, now)));
                ranks.send(i, ClientMessage::Rendezvous { after: generation });
            }
            _ => {}
        }
        if heard.len() >= BATCH {
            ranks.record(&mut heard);
        }
    }
    ranks.record(&mut heard);
}

/// Sends every rank's heartbeat every `interval` until `stop`.
fn heartbeats(ranks: &Ranks, interval: Duration, stop: &std::sync::atomic::AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        let started = Instant::now();
        let step = ranks.step.fetch_add(1, Ordering::Relaxed);
        let generations: Vec<u64> = {
            let states = ranks.states.lock().unwrap_or_else(|p| p.into_inner());
            states
                .iter()
                .map(|s| s.assigned.as_ref().map_or(0, |(a, _)| a.generation))
                .collect()
        };
        for (i, generation) in generations.into_iter().enumerate() {
            let progress = Progress {
                step,
                ..Progress::default()
            };
            ranks.send(
                i,
                ClientMessage::Heartbeat {
                    generation,
                    progress,
                },
            );
        }
        let spent = started.elapsed();
        std::thread::sleep(interval.saturating_sub(spent));
    }
}

/// CPU seconds (user + system) of process `pid`, from `/proc`.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((utime + stime) / ticks)
}

/// Resident memory of process `pid` in MiB, from `/proc`.
fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Raises this process's limit of open files to its hard limit: each simulated
/// node holds a listener and a connection.
fn raise_open_files() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid rlimit for getrlimit/setrlimit to read and write.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// The coordinator process, killed when dropped.
struct CoordinatorProcess {
    child: Child,
    addr: SocketAddr,
}

impl CoordinatorProcess {
    /// A coordinator for `job`: generations of `min` to `max` ranks.
    fn start(
        config: &Config,
        job: &str,
        min: usize,
        max: usize,
        secret: &str,
    ) -> Result<CoordinatorProcess, String> {
        let t = &config.timeouts;
        let mut child = Command::new(&config.ckpt)
            .env(ckpt_auth::SECRET_ENV, secret)
            .env_remove(ckpt_auth::SECRET_FILE_ENV)
            .args(["coordinator", "--listen", "127.0.0.1:0", "--job", job])
            .args(["--min-ranks", &min.to_string()])
            .args(["--max-ranks", &max.to_string()])
            .args([
                "--heartbeat-timeout-secs",
                &t.heartbeat_timeout.as_secs_f64().to_string(),
            ])
            .args([
                "--join-timeout-secs",
                &t.join_timeout.as_secs_f64().to_string(),
            ])
            .args(["--last-call-ms", &t.last_call.as_millis().to_string()])
            .env(
                "RUST_LOG",
                std::env::var("CKPT_BENCH_COORDINATOR_LOG").unwrap_or("warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", config.ckpt.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let Some(addr) = first
            .strip_prefix("coordinator: listening on ")
            .and_then(|a| a.trim().parse().ok())
        else {
            let _ = child.kill();
            return Err(format!("the coordinator did not start: {first:?}"));
        };
        // Its log of generation changes: read, so that it never blocks on a pipe.
        std::thread::spawn(move || for _ in lines {});
        Ok(CoordinatorProcess { child, addr })
    }
}

impl Drop for CoordinatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The control plane of one node, connected as `member`.
fn upstream(
    config: &Config,
    coordinator: Option<SocketAddr>,
    etcd_runtime: Option<&tokio::runtime::Handle>,
    secret: &ckpt_auth::JobSecret,
    member: Member,
) -> Result<Arc<dyn ControlPlane>, String> {
    match (config.backend, coordinator) {
        (Backend::Tcp, Some(addr)) => {
            let settings = TcpSettings {
                connect_timeout: Duration::from_secs(60),
                secret: Some(secret.clone()),
                ..TcpSettings::default()
            };
            let plane = TcpControlPlane::connect(addr, member, settings)
                .map_err(|e| format!("node {addr}: {e}"))?;
            Ok(Arc::new(plane))
        }
        #[cfg(feature = "etcd")]
        (Backend::Etcd, _) => {
            let url = config
                .etcd
                .as_deref()
                .ok_or("--backend etcd needs --etcd etcd://HOST:PORT[,…]/PREFIX")?;
            let url = ckpt_elastic::EtcdUrl::parse(url).map_err(|e| format!("{url}: {e}"))?;
            let runtime = etcd_runtime.ok_or("no runtime for the etcd clients")?;
            // TLS and the etcd user from CKPT_ETCD_CACERT…, as a launcher takes them.
            let settings =
                ckpt_elastic::EtcdSettings::from_env().map_err(|e| format!("{url}: {e}"))?;
            let plane =
                ckpt_elastic::EtcdControlPlane::connect_in(runtime, &url, member, None, settings)
                    .map_err(|e| format!("node on etcd: {e}"))?;
            Ok(Arc::new(plane))
        }
        #[cfg(not(feature = "etcd"))]
        (Backend::Etcd, _) => {
            let _ = etcd_runtime;
            Err("this ckpt was built without the etcd backend".into())
        }
        (Backend::Tcp, None) => Err("no coordinator".into()),
    }
}

/// Runs the bench; `progress` gets a line per phase.
pub(crate) fn run(config: &Config, progress: &dyn Fn(&str)) -> Result<ControlPlaneReport, String> {
    if config.nodes < 2 || config.ranks_per_node == 0 {
        return Err("at least 2 nodes of at least 1 rank".into());
    }
    raise_open_files();
    let ranks_total = config.nodes * config.ranks_per_node;
    let job = format!("bench-{}", std::process::id());
    let started = Instant::now();
    // As a large job would set it: a generation forms as soon as every rank asks
    // (the most), and survives the loss of one node (the least).
    let (min, max) = (ranks_total - config.ranks_per_node, ranks_total);
    // As a launcher would have it: every connection to the coordinator proves the
    // job's secret (etcd's clients authenticate to etcd, not to each other).
    let secret_text = ckpt_auth::JobSecret::generate_text().map_err(|e| e.to_string())?;
    let secret = ckpt_auth::JobSecret::new(&secret_text, "generated").map_err(|e| e.to_string())?;
    let coordinator = match config.backend {
        Backend::Tcp => Some(CoordinatorProcess::start(
            config,
            &job,
            min,
            max,
            &secret_text,
        )?),
        Backend::Etcd => {
            #[cfg(feature = "etcd")]
            etcd_job(config, &job, min, max)?;
            None
        }
    };
    // Every simulated node's etcd client on one runtime: a runtime (and its
    // threads) per client, as a real launcher has, made thousands of threads here.
    let etcd_runtime = match config.backend {
        Backend::Etcd => Some(
            tokio::runtime::Builder::new_multi_thread()
                .thread_name("bench-etcd")
                .enable_all()
                .build()
                .map_err(|e| format!("etcd clients' runtime: {e}"))?,
        ),
        Backend::Tcp => None,
    };
    let sent = Arc::new(AtomicU64::new(0));
    let ranks = Arc::new(Ranks {
        states: Mutex::new(vec![RankState::default(); ranks_total]),
        changed: Condvar::new(),
        links: RwLock::new(Vec::with_capacity(ranks_total)),
        step: AtomicU64::new(1),
    });
    // Node n's ranks are answered by thread n % threads.
    let threads = answering_threads(config.nodes);
    let mut queues = Vec::with_capacity(threads);
    let mut answering = Vec::with_capacity(threads);
    for t in 0..threads {
        let (queue, lines) = sync_channel::<(usize, Arc<str>)>(4 * ranks_total / threads + 1024);
        let ranks = ranks.clone();
        answering.push(
            std::thread::Builder::new()
                .name(format!("bench-answer-{t}"))
                .spawn(move || answer(&ranks, lines))
                .map_err(|e| e.to_string())?,
        );
        queues.push(queue);
    }
    progress(&format!(
        "starting {} nodes of {} ranks ({} ranks) on {:?}",
        config.nodes, config.ranks_per_node, ranks_total, config.backend
    ));
    let node_config = NodeConfig {
        timeouts: config.timeouts,
        last_call: Duration::from_secs(10),
        ..NodeConfig::new(&job)
    };
    let mut nodes: Vec<Option<NodeAgent>> = Vec::with_capacity(config.nodes);
    for n in 0..config.nodes {
        let id = format!("n{n:05}");
        let member = Member {
            ranks: config.ranks_per_node,
            ..Member::new(&job, &id, "127.0.0.1", &id)
        };
        let plane = upstream(
            config,
            coordinator.as_ref().map(|c| c.addr),
            etcd_runtime.as_ref().map(tokio::runtime::Runtime::handle),
            &secret,
            member,
        )?;
        let counted = Arc::new(Counted {
            inner: plane,
            sent: sent.clone(),
        });
        let node = NodeAgent::start(counted, "127.0.0.1:0".parse().unwrap(), node_config.clone())
            .map_err(|e| format!("node {id}: {e}"))?;
        node.expect(config.ranks_per_node);
        let mut links = ranks.links.write().unwrap_or_else(|p| p.into_inner());
        for r in 0..config.ranks_per_node {
            let i = n * config.ranks_per_node + r;
            let link = node
                .attach(i, queues[n % threads].clone())
                .ok_or_else(|| format!("node {id}: cannot attach rank {r}"))?;
            let hello = ClientMessage::Hello {
                version: protocol::VERSION,
                member: Member::new(&job, format!("{id}-r{r}"), "127.0.0.1", &id),
                seen: 0,
                checkpoint_generation: 0,
                claim: None,
            };
            link.send(hello).map_err(|e| format!("rank {i}: {e}"))?;
            links.push(Some(link));
        }
        drop(links);
        nodes.push(Some(node));
        if (n + 1) % 256 == 0 {
            progress(&format!("{} nodes up", n + 1));
        }
    }
    drop(queues);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let beating = {
        let (ranks, stop) = (ranks.clone(), stop.clone());
        let interval = ckpt_elastic::timeouts::DEFAULT_HEARTBEAT_INTERVAL;
        std::thread::Builder::new()
            .name("bench-heartbeats".into())
            .spawn(move || heartbeats(&ranks, interval, &stop))
            .map_err(|e| e.to_string())?
    };
    let setup_ms = ms(started.elapsed());
    // A standalone coordinator forms nothing until its settle window (the heartbeat
    // timeout) has passed since it started.
    let settled = started + config.timeouts.heartbeat_timeout;
    std::thread::sleep(settled.saturating_duration_since(Instant::now()));

    progress("every rank asks for a generation");
    for i in 0..ranks_total {
        ranks.send(i, ClientMessage::Rendezvous { after: 0 });
    }
    let last_join = Instant::now();
    let limit = Duration::from_secs(120);
    let formed = ranks.wait(limit, |states| states.iter().all(|s| s.assigned.is_some()));
    let (form_ms, members_with_generation, generation) = {
        let states = ranks.states.lock().unwrap_or_else(|p| p.into_inner());
        let assigned: Vec<&(Assignment, Instant)> =
            states.iter().filter_map(|s| s.assigned.as_ref()).collect();
        let generation = assigned
            .iter()
            .map(|(a, _)| a.generation)
            .max()
            .unwrap_or(0);
        let last = assigned.iter().map(|(_, at)| *at).max();
        let mut seen = vec![false; ranks_total];
        let mut members = 0;
        for (a, _) in assigned.iter().filter(|(a, _)| a.generation == generation) {
            if a.world_size == ranks_total && a.rank < ranks_total && !seen[a.rank] {
                seen[a.rank] = true;
                members += 1;
            }
        }
        let form = last.map_or(f64::NAN, |t| ms(t.saturating_duration_since(last_join)));
        (form, members, generation)
    };
    if !formed {
        progress(&format!(
            "only {members_with_generation} of {ranks_total} ranks got a generation within {limit:?}"
        ));
    }
    progress(&format!(
        "generation {generation} formed: {members_with_generation} ranks, {form_ms:.0} ms after the last ask"
    ));

    progress(&format!("steady state for {:?}", config.steady));
    let me = std::process::id();
    let coordinator_pid = coordinator.as_ref().map(|c| c.child.id());
    let etcd_before = etcd_metrics(config);
    let (sent0, cpu0, me0, t0) = (
        sent.load(Ordering::Relaxed),
        coordinator_pid.and_then(cpu_seconds),
        cpu_seconds(me),
        Instant::now(),
    );
    std::thread::sleep(config.steady);
    let window = t0.elapsed().as_secs_f64();
    let messages_per_s = (sent.load(Ordering::Relaxed) - sent0) as f64 / window;
    let coordinator_cores = match (cpu0, coordinator_pid.and_then(cpu_seconds)) {
        (Some(a), Some(b)) => Some((b - a) / window),
        _ => None,
    };
    let simulation_cores = match (me0, cpu_seconds(me)) {
        (Some(a), Some(b)) => (b - a) / window,
        _ => f64::NAN,
    };
    let coordinator_rss_mib = coordinator_pid.and_then(rss_mib);
    let etcd_after = etcd_metrics(config);
    let (etcd_writes_per_s, etcd_db_mib) = match (etcd_before, etcd_after) {
        (Some((w0, _)), Some((w1, db))) => (Some((w1 - w0) / window), Some(db)),
        _ => (None, None),
    };

    let victim = config.nodes - 1;
    let victims = victim * config.ranks_per_node..ranks_total;
    progress(&format!("node {victim} goes ({:?})", config.kill));
    let lost_at = match config.kill {
        Kill::Silence => {
            if let Some(node) = &nodes[victim] {
                node.go_silent();
            }
            Instant::now()
        }
        Kill::Close => {
            // The agent first (so that its ranks' ends are not reported as rank
            // losses), then its ranks; the last of them lets go of its connection.
            drop(nodes[victim].take());
            let mut links = ranks.links.write().unwrap_or_else(|p| p.into_inner());
            for i in victims.clone() {
                links[i] = None;
            }
            Instant::now()
        }
    };
    let survivors = 0..victim * config.ranks_per_node;
    let reformed = ranks.wait(limit, |states| {
        states[survivors.clone()].iter().all(|s| {
            s.assigned
                .as_ref()
                .is_some_and(|(a, _)| a.generation > generation)
        })
    });
    let (detect_ms, detect_all_ms, reform_ms, survivors_with_generation) = {
        let states = ranks.states.lock().unwrap_or_else(|p| p.into_inner());
        let of = &states[survivors.clone()];
        let told: Vec<Instant> = of
            .iter()
            .filter_map(|s| {
                s.restarted
                    .filter(|(g, _)| *g == generation)
                    .map(|(_, t)| t)
            })
            .collect();
        let since =
            |t: Option<Instant>| t.map_or(f64::NAN, |t| ms(t.saturating_duration_since(lost_at)));
        let next: Vec<&(Assignment, Instant)> = of
            .iter()
            .filter_map(|s| {
                s.assigned
                    .as_ref()
                    .filter(|(a, _)| a.generation > generation)
            })
            .collect();
        let reform = next.iter().map(|(_, t)| *t).max();
        let expected = ranks_total - config.ranks_per_node;
        let count = next
            .iter()
            .filter(|(a, _)| a.world_size == expected)
            .count();
        (
            since(told.iter().min().copied()),
            since(told.iter().max().copied()),
            since(reform),
            count,
        )
    };
    if !reformed {
        progress("not every survivor got the next generation in time");
    }
    progress(&format!(
        "detected in {detect_ms:.0} ms ({detect_all_ms:.0} ms until every survivor was told), every survivor in the next generation after {reform_ms:.0} ms"
    ));
    stop.store(true, Ordering::SeqCst);
    let _ = beating.join();
    for node in nodes.iter().flatten() {
        node.stop();
    }
    drop(nodes);
    ranks
        .links
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
    for thread in answering {
        let _ = thread.join();
    }
    if let Some(runtime) = etcd_runtime {
        runtime.shutdown_background();
    }
    drop(coordinator);
    Ok(ControlPlaneReport {
        backend: config.backend,
        nodes: config.nodes,
        ranks_per_node: config.ranks_per_node,
        ranks: ranks_total,
        setup_ms,
        form_ms,
        members_with_generation,
        messages_per_s,
        coordinator_cores,
        coordinator_rss_mib,
        etcd_writes_per_s,
        etcd_db_mib,
        simulation_cores,
        kill: config.kill,
        heartbeat_timeout_ms: ms(config.timeouts.heartbeat_timeout),
        detect_ms,
        detect_all_ms,
        reform_ms,
        survivors_with_generation,
        answering_threads: threads,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Publishes the job's settings in etcd (what a launcher does first).
#[cfg(feature = "etcd")]
fn etcd_job(config: &Config, job: &str, min: usize, max: usize) -> Result<(), String> {
    let url = config
        .etcd
        .as_deref()
        .ok_or("--backend etcd needs --etcd etcd://HOST:PORT[,…]/PREFIX")?;
    let url = ckpt_elastic::EtcdUrl::parse(url).map_err(|e| format!("{url}: {e}"))?;
    let coordinator = ckpt_elastic::CoordinatorConfig {
        timeouts: config.timeouts,
        ..ckpt_elastic::CoordinatorConfig::new(job, min, max)
    };
    let settings = ckpt_elastic::EtcdSettings::from_env().map_err(|e| format!("{url}: {e}"))?;
    let handle = ckpt_elastic::EtcdJob::connect(&url, &coordinator, settings)
        .map_err(|e| format!("{url}: {e}"))?;
    // The settings stay in etcd; the handle is only the launcher's view.
    drop(handle);
    Ok(())
}

/// (writes so far, database MiB) of the etcd cluster, from its members' metrics:
/// the most any member reports (they agree on what is committed).
fn etcd_metrics(config: &Config) -> Option<(f64, f64)> {
    if config.backend != Backend::Etcd {
        return None;
    }
    let url = config.etcd.as_deref()?;
    let hosts = url.strip_prefix("etcd://")?.split('/').next()?;
    let mut best: Option<(f64, f64)> = None;
    for host in hosts.split(',') {
        let Some(text) = http_get(host, "/metrics") else {
            continue;
        };
        let value = |name: &str| -> f64 {
            text.lines()
                .filter(|l| l.starts_with(name) && !l.starts_with('#'))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        let writes = value("etcd_mvcc_put_total")
            + value("etcd_mvcc_delete_total")
            + value("etcd_mvcc_txn_total");
        let db = value("etcd_mvcc_db_total_size_in_bytes") / (1024.0 * 1024.0);
        best = Some(match best {
            Some((w, d)) => (w.max(writes), d.max(db)),
            None => (writes, db),
        });
    }
    best
}

/// A plain HTTP GET of `path` on `host:port` (etcd's metrics), the body.
fn http_get(host: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(host).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response.split_once("\r\n\r\n")?.1.to_owned())
}

/// The report as a table.
pub(crate) fn render(report: &ControlPlaneReport) -> String {
    let opt = |v: Option<f64>, unit: &str| v.map_or("-".to_owned(), |v| format!("{v:.2} {unit}"));
    let rows = [
        ("backend", format!("{:?}", report.backend).to_lowercase()),
        (
            "nodes × ranks",
            format!(
                "{} × {} = {}",
                report.nodes, report.ranks_per_node, report.ranks
            ),
        ),
        ("setup (simulation)", format!("{:.0} ms", report.setup_ms)),
        (
            "formed, after the last ask",
            format!("{:.0} ms", report.form_ms),
        ),
        (
            "ranks with the generation",
            report.members_with_generation.to_string(),
        ),
        (
            "messages to the control plane",
            format!("{:.0} /s", report.messages_per_s),
        ),
        ("coordinator CPU", opt(report.coordinator_cores, "cores")),
        ("coordinator RSS", opt(report.coordinator_rss_mib, "MiB")),
        ("etcd writes", opt(report.etcd_writes_per_s, "/s")),
        ("etcd database", opt(report.etcd_db_mib, "MiB")),
        (
            "simulation CPU",
            format!("{:.2} cores", report.simulation_cores),
        ),
        (
            "node lost",
            format!(
                "{:?}, heartbeat timeout {:.0} ms",
                report.kill, report.heartbeat_timeout_ms
            )
            .to_lowercase(),
        ),
        ("detected", format!("{:.0} ms", report.detect_ms)),
        (
            "every survivor told",
            format!("{:.0} ms", report.detect_all_ms),
        ),
        (
            "every survivor re-formed",
            format!("{:.0} ms", report.reform_ms),
        ),
        (
            "ranks in the next generation",
            report.survivors_with_generation.to_string(),
        ),
        (
            "answering threads (simulation)",
            report.answering_threads.to_string(),
        ),
    ];
    let width = rows
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0);
    rows.iter()
        .map(|(k, v)| format!("{k:<width$}  {v}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assignment(generation: u64, rank: usize) -> Assignment {
        Assignment {
            generation,
            rank,
            ranks: 1,
            world_size: 2,
            members: 2,
            roster: 0,
            checkpoint_generation_floor: 0,
            cause: "initial".into(),
        }
    }

    fn line(message: &ServerMessage) -> Arc<str> {
        protocol::encode(message).unwrap().into()
    }

    #[test]
    fn answering_records_each_ranks_lines_in_the_order_read() {
        let ranks = Arc::new(Ranks {
            states: Mutex::new(vec![RankState::default(); 2]),
            changed: Condvar::new(),
            links: RwLock::new(Vec::new()),
            step: AtomicU64::new(1),
        });
        let (queue, lines) = sync_channel(16);
        let answering = {
            let ranks = ranks.clone();
            std::thread::spawn(move || answer(&ranks, lines))
        };
        let restart = ServerMessage::Directive {
            directive: Directive::Restart {
                generation: 1,
                cause: "lost member n1".into(),
            },
        };
        for (i, message) in [
            (
                0,
                ServerMessage::Assigned {
                    assignment: assignment(1, 0),
                },
            ),
            (
                1,
                ServerMessage::Assigned {
                    assignment: assignment(1, 1),
                },
            ),
            (0, restart.clone()),
            (1, restart),
            (
                0,
                ServerMessage::Assigned {
                    assignment: assignment(2, 0),
                },
            ),
        ] {
            queue.send((i, line(&message))).unwrap();
        }
        let generation_of = |s: &RankState| s.assigned.as_ref().map(|(a, _)| a.generation);
        // Woken when the answering thread records, well before the limit.
        assert!(ranks.wait(Duration::from_secs(30), |states| {
            generation_of(&states[0]) == Some(2) && states[1].restarted.is_some()
        }));
        drop(queue);
        answering.join().unwrap();
        let states = ranks.states.lock().unwrap();
        assert_eq!(generation_of(&states[0]), Some(2));
        assert_eq!(generation_of(&states[1]), Some(1));
        assert!(
            states
                .iter()
                .all(|s| s.restarted.is_some_and(|(g, _)| g == 1))
        );
        let (told, assigned) = (
            states[0].restarted.unwrap().1,
            states[0].assigned.as_ref().unwrap().1,
        );
        assert!(told <= assigned, "each line's time is when it was read");
    }

    #[test]
    fn there_is_an_answering_thread_per_core_but_never_more_than_nodes() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(answering_threads(2048), cores.clamp(1, 16));
        assert_eq!(answering_threads(1), 1);
        assert!(answering_threads(2) <= 2);
    }
}
