//! The ckpt launcher: N rank processes of any command on one node, like torchrun.
//!
//! `ckpt launch --nproc N -- python train.py …` and `ckpt-train launch --nproc N -- …`
//! are this one launcher ([`LaunchArgs`] are their shared flags); the reference
//! trainer runs under either.
//!
//! Each rank gets torchrun's environment: `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK` (this node's id), `TORCHELASTIC_RUN_ID`, `TORCHELASTIC_RESTART_COUNT`
//! and `TORCHELASTIC_MAX_RESTARTS`, and in a fixed world also `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR` and `MASTER_PORT` (a free port chosen by the launcher unless given).
//! Its stdout and stderr are streamed line by line with a `[rank N]` prefix. The
//! ranks run in one process group of their own (printed, with every pid, at start),
//! so a terminal's Ctrl-C reaches only the launcher, which forwards SIGINT and
//! SIGTERM to every rank; tests kill the group or single pids.
//!
//! When a rank fails (non-zero exit or killed by a signal) without a signal having
//! been forwarded, the launcher sends SIGTERM to the others, then SIGKILL after
//! [`LaunchConfig::grace`]. Exit status: 0 when every rank succeeded;
//! [`EXIT_STOPPED`] when every rank stopped cleanly after a final save; otherwise the
//! first failure's code (128 + signal for a rank killed by a signal).
//!
//! # Elastic mode
//!
//! With [`LaunchConfig::elastic`] the ranks do not get `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR` or `MASTER_PORT`: they join the control plane (`CKPT_RDZV`, read by
//! `ckpt_elastic::RankEnv`), which assigns ranks per generation (Python's
//! `ckpt.elastic` sets those four variables for each generation it runs), and the
//! launcher no longer stops the survivors when one rank fails: the coordinator
//! re-forms the world without it, and the launcher relaunches the failed rank while it
//! has restarts left (`--max-restarts`), which then joins as a waiting member. A rank
//! that exits with [`EXIT_WEDGED`] (a survivor whose process group could not be
//! aborted) is started again at once without counting a restart. The
//! launcher hosts the coordinator itself (on a listener it keeps, so no other process
//! can take the port between choosing and binding it) unless `--rdzv` names one that
//! is already running. Without `--min-ranks` the world may not shrink below its
//! starting size: a failure with no restart left stops every rank, as without
//! elastic mode.
//!
//! An elastic launcher exits as soon as the job is over (its control plane says so, or
//! one of its ranks exited 0, which a rank does only when the job finished), with the
//! job's status: 75 when the ranks still in the job stopped after a final save, even
//! if it lost a rank for good on the way (it survived that loss). Ranks still
//! running then were dropped by the world (hung, stale): they get
//! [`LaunchConfig::grace`], then SIGKILL, each named; one that SIGKILL cannot end
//! (uninterruptible sleep) is named after 5 s and left behind. A
//! launcher hosting the coordinator serves it after its own ranks are gone, until the
//! job is over, when other nodes can take part.

mod args;
pub mod signals;

pub use args::{LaunchArgs, Program, parse_grace};

use std::ffi::OsString;
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ckpt_auth::JobSecret;
use ckpt_elastic::{
    Coordinator, CoordinatorConfig, Event, JobOver, Member, NodeAgent, NodeConfig, TcpControlPlane,
    TcpSettings,
};

/// Exit code of a rank (and of the launcher) that stopped on SIGTERM/SIGINT after
/// committing a final checkpoint: 75 (`EX_TEMPFAIL`, "try again later": resume).
pub const EXIT_STOPPED: i32 = 75;

/// Exit code of an elastic rank that survived a failure but could not leave its
/// generation: its training thread stayed inside a collective the abort did not
/// fail (gloo can keep waiting on connections it already closed, until the
/// group's timeout). Nothing is wrong with the rank, so the launcher starts a fresh
/// process in its place at once, without counting a restart (`ckpt.elastic`'s
/// `EXIT_WEDGED`). The fresh process's `TORCHELASTIC_RESTART_COUNT` (its slot's
/// incarnation, which also makes its member id new) still goes up by one.
pub const EXIT_WEDGED: i32 = 76;

/// Wedged ranks ([`EXIT_WEDGED`]) one launcher starts again before it counts them
/// as failures: each needs a failure to abort a generation first, so this bounds
/// only a process group that wedges at every abort.
const MAX_WEDGED_RELAUNCHES: usize = 64;

/// The environment variable that tells rank 0 which inherited descriptor is the
/// rendezvous listener the launcher bound for it.
pub const RENDEZVOUS_FD: &str = "CKPT_RENDEZVOUS_FD";

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Rank processes.
    pub nproc: usize,
    /// Rendezvous address (rank 0 listens there).
    pub master_addr: IpAddr,
    /// Rendezvous port; `None` picks a free one.
    pub master_port: Option<u16>,
    /// The program every rank runs (found on `PATH` when it has no slash).
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Hand rank 0 of a fixed world the rendezvous listener the launcher bound
    /// (`CKPT_RENDEZVOUS_FD`), so that no other process can take the port between
    /// its choice and its use. Only for a program that takes it (the reference
    /// trainer); any other gets a port the launcher bound and released.
    pub hand_over_listener: bool,
    /// Time between SIGTERM and SIGKILL of the survivors after a failure; in elastic
    /// mode also how long a rank may run on after the job is over before SIGKILL.
    pub grace: Duration,
    /// Elastic mode (a coordinator assigns ranks; failed ranks do not stop the rest).
    pub elastic: Option<ElasticLaunch>,
}

/// The elastic settings of a launcher (one per node).
#[derive(Debug, Clone)]
pub struct ElasticLaunch {
    /// Job id: every node's launcher and the coordinator must agree on it.
    pub job: String,
    /// This node's id (member ids and the `launch: rank R` labels derive from it).
    pub node_id: usize,
    /// The coordinator to join; `None`: host one (at `host_at`, else on
    /// `master_addr:master_port`, a free port when none is given).
    pub rdzv: Option<SocketAddr>,
    /// The etcd cluster that replaces the coordinator (`--rdzv etcd://…`).
    pub etcd: Option<ckpt_elastic::EtcdUrl>,
    /// Where a hosted coordinator listens (`--rdzv` with `--host-rdzv`).
    pub host_at: Option<SocketAddr>,
    /// Fewest ranks the job trains with (a smaller world waits for members).
    pub min_ranks: usize,
    /// Most ranks in a generation (more wait).
    pub max_ranks: usize,
    /// Whether `--min-ranks` was given: without it, a failure with no restart left
    /// stops every rank.
    pub shrink: bool,
    /// How many times this launcher relaunches its failed ranks, in all.
    pub max_restarts: usize,
    /// Settings of a hosted coordinator.
    pub coordinator: CoordinatorConfig,
    /// How long this launcher and its ranks keep trying to reach the coordinator
    /// (`--rdzv-connect-timeout-secs`; the ranks get it as
    /// `CKPT_RDZV_CONNECT_TIMEOUT_SECS`).
    pub connect_timeout: Duration,
}

static OUTPUT: Mutex<()> = Mutex::new(());

fn stream<R: std::io::Read + Send + 'static>(
    reader: R,
    prefix: String,
    stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(reader).split(b'\n') {
            let Ok(line) = line else { break };
            let _guard = OUTPUT.lock().unwrap_or_else(|p| p.into_inner());
            if stderr {
                let mut out = std::io::stderr().lock();
                let _ = out.write_all(prefix.as_bytes());
                let _ = out.write_all(&line);
                let _ = out.write_all(b"\n");
            } else {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(prefix.as_bytes());
                let _ = out.write_all(&line);
                let _ = out.write_all(b"\n");
                let _ = out.flush();
            }
        }
    })
}

fn say(line: std::fmt::Arguments<'_>) {
    let _guard = OUTPUT.lock().unwrap_or_else(|p| p.into_inner());
    let mut out = std::io::stdout().lock();
    let _ = out.write_fmt(line);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

fn code_of(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

fn kill(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a pid we spawned and have not reaped yet.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

/// Prints the launcher's line for a generation change of the coordinator it hosts:
/// one per recovery (an ended generation and the one formed after it), with the cause
/// and how long the world took to re-form. Rank 0 of the new generation prints the
/// per-rank timings (abort, load, first step).
fn summarize(event: &Event, last_ended: &mut Option<(u64, std::time::SystemTime)>) {
    match event {
        Event::Ended { generation, at, .. } => *last_ended = Some((*generation, *at)),
        Event::Formed {
            generation,
            world_size,
            cause,
            adopted,
            at,
            ..
        } => {
            let after = last_ended
                .take()
                .and_then(|(ended, when)| Some((ended, at.duration_since(when).ok()?)));
            match (after, adopted) {
                (_, true) => say(format_args!(
                    "launch: generation {generation} (world {world_size}) adopted by a restarted coordinator"
                )),
                (Some((ended, took)), false) => say(format_args!(
                    "launch: {}: generation {ended} ended, generation {generation} formed with world {world_size} {} ms later ({cause})",
                    if cause.starts_with("grow") {
                        "regroup"
                    } else {
                        "recovery"
                    },
                    took.as_millis()
                )),
                (None, false) => say(format_args!(
                    "launch: generation {generation} formed with world {world_size} ({cause})"
                )),
            }
        }
        Event::Left {
            generation, cause, ..
        } => say(format_args!("launch: generation {generation}: {cause}")),
        Event::Shutdown { reason, .. } => say(format_args!("launch: job shut down: {reason}")),
    }
}

/// Clears close-on-exec on `fd`, so that the program exec'd next inherits it.
fn inherit(fd: std::os::fd::RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl(2) on a descriptor number reads and writes only the kernel's
    // descriptor flags; a closed descriptor makes it fail, which is checked.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The variables torchrun gives every worker that do not change with the world:
/// the local rank, the node's rank count, the node (`GROUP_RANK`), the run id, and
/// how often this rank's slot was restarted and may be.
fn torchrun_env(
    local: usize,
    nproc: usize,
    node: usize,
    run_id: &str,
    restarts: usize,
    max_restarts: usize,
) -> [(&'static str, String); 6] {
    [
        ("LOCAL_RANK", local.to_string()),
        ("LOCAL_WORLD_SIZE", nproc.to_string()),
        ("GROUP_RANK", node.to_string()),
        ("TORCHELASTIC_RUN_ID", run_id.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", restarts.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", max_restarts.to_string()),
    ]
}

/// Starts a rank; a program that cannot be started is named (the OS error stays
/// readable).
fn spawn(command: &mut Command, program: &OsString) -> std::io::Result<Child> {
    command.spawn().map_err(|e| match e.raw_os_error() {
        Some(code) if code == libc::EPERM => e,
        _ => std::io::Error::new(
            e.kind(),
            format!("cannot start {}: {e}", program.to_string_lossy()),
        ),
    })
}

/// Runs the ranks to completion; returns the launcher's exit code.
pub fn launch(config: &LaunchConfig) -> std::io::Result<i32> {
    if let Some(elastic) = &config.elastic {
        return launch_elastic(config, elastic);
    }
    signals::install();
    // The launcher binds the rendezvous listener itself and hands it to rank 0 (an
    // inherited descriptor) when the program takes it: choosing a free port by
    // binding and releasing it would let another process take the port in between.
    // Any other program (torch's TCPStore binds MASTER_PORT itself) gets the port
    // released, as torchrun does.
    let mut rendezvous = Some(TcpListener::bind((
        config.master_addr,
        config.master_port.unwrap_or(0),
    ))?);
    let port = rendezvous
        .as_ref()
        .map(TcpListener::local_addr)
        .transpose()?
        .map_or(0, |a| a.port());
    if !config.hand_over_listener {
        rendezvous = None;
    }
    // One run id per launch, shared by its ranks: a relaunch that saves a step again
    // writes a new save attempt instead of meeting the old one's objects.
    let run_id = run_id_from_env()?;
    // Every rank of this job is started here: a secret of its own unless the
    // environment holds the job's (which the ranks inherit).
    let (_, generated_secret) = job_secret(true)?;
    let mut children: Vec<Option<Child>> = Vec::with_capacity(config.nproc);
    let mut pumps = Vec::new();
    let mut pgid = 0;
    for rank in 0..config.nproc {
        let mut command = Command::new(&config.program);
        command
            .args(&config.args)
            .envs(torchrun_env(rank, config.nproc, 0, &run_id, 0, 0))
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", config.nproc.to_string())
            .env("MASTER_ADDR", config.master_addr.to_string())
            .env("MASTER_PORT", port.to_string())
            .env("CKPT_RUN_ID", &run_id)
            .env_remove(RENDEZVOUS_FD)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(pgid);
        if let Some(text) = &generated_secret {
            command.env(ckpt_auth::SECRET_ENV, text);
        }
        if rank == 0
            && let Some(listener) = &rendezvous
        {
            let fd = listener.as_raw_fd();
            command.env(RENDEZVOUS_FD, fd.to_string());
            // SAFETY: the closure runs in the child between fork and exec, where only
            // async-signal-safe calls are allowed: `inherit` makes two fcntl(2) calls
            // on a descriptor the parent owns and keeps open until the spawn returned.
            unsafe {
                command.pre_exec(move || inherit(fd));
            }
        }
        let mut child = spawn(&mut command, &config.program)?;
        if rank == 0 {
            // Rank 0 has its copy; the launcher's would keep the port bound forever.
            rendezvous = None;
            pgid = child.id() as i32;
            say(format_args!(
                "launch: {} ranks, rendezvous {}:{port}, process group {pgid}",
                config.nproc, config.master_addr
            ));
        }
        say(format_args!("launch: rank {rank} pid {}", child.id()));
        let prefix = format!("[rank {rank}] ");
        pumps.push(stream(
            child.stdout.take().expect("piped"),
            prefix.clone(),
            false,
        ));
        pumps.push(stream(child.stderr.take().expect("piped"), prefix, true));
        children.push(Some(child));
    }

    let mut forwarded = 0;
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; config.nproc];
    let mut first_failure: Option<(usize, i32)> = None;
    let mut kill_at: Option<Instant> = None;
    let mut terminate = false;
    while statuses.iter().any(Option::is_none) {
        let (count, last) = signals::received();
        if count > forwarded {
            forwarded = count;
            say(format_args!(
                "launch: forwarding signal {last} to the ranks"
            ));
            for child in children.iter().flatten() {
                kill(child, last);
            }
        }
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            if let Some(status) = child.try_wait()? {
                let code = code_of(status);
                if code != 0 && code != EXIT_STOPPED || (code == EXIT_STOPPED && forwarded == 0) {
                    say(format_args!("launch: rank {rank} failed: {status}"));
                    if first_failure.is_none() {
                        first_failure = Some((rank, code));
                        if forwarded == 0 {
                            kill_at = Some(Instant::now() + config.grace);
                            terminate = true;
                        }
                    }
                }
                statuses[rank] = Some(status);
                *slot = None;
            }
        }
        if terminate {
            // First failure: ask the others to stop at once, kill them after the grace.
            terminate = false;
            for child in children.iter().flatten() {
                kill(child, libc::SIGTERM);
            }
        }
        if let Some(at) = kill_at
            && Instant::now() >= at
        {
            for child in children.iter().flatten() {
                kill(child, libc::SIGKILL);
            }
            kill_at = None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for pump in pumps {
        let _ = pump.join();
    }
    let codes: Vec<i32> = statuses
        .iter()
        .map(|s| code_of(s.expect("reaped")))
        .collect();
    Ok(match first_failure {
        Some((_, code)) => code,
        None if codes.iter().all(|c| *c == 0) => 0,
        None if codes.iter().all(|c| *c == EXIT_STOPPED || *c == 0) => EXIT_STOPPED,
        None => codes.into_iter().find(|c| *c != 0).unwrap_or(1),
    })
}

/// One rank slot of an elastic launcher: the process now running in it, if any.
struct Slot {
    label: usize,
    child: Option<Child>,
    incarnation: usize,
    status: Option<ExitStatus>,
    /// Failed with no restart left while `--min-ranks` let the others go on: a loss
    /// the job survived, which does not decide how the launcher exits.
    lost_for_good: bool,
}

/// Starts rank processes of one elastic node.
struct Spawner<'a> {
    config: &'a LaunchConfig,
    elastic: &'a ElasticLaunch,
    /// What the ranks get as `CKPT_RDZV`.
    rdzv: String,
    /// A job secret this launcher generated, for the ranks (one the environment
    /// holds reaches them as it is).
    generated_secret: Option<String>,
    plane: &'a Plane,
    run_id: String,
    pgid: i32,
    pumps: Vec<std::thread::JoinHandle<()>>,
}

impl Spawner<'_> {
    /// Starts local rank `local` (its `incarnation`-th process) and prints its line.
    fn spawn(&mut self, local: usize, incarnation: usize) -> std::io::Result<Child> {
        let (config, elastic) = (self.config, self.elastic);
        let label = elastic.node_id * config.nproc + local;
        let mut command = Command::new(&config.program);
        command
            .args(&config.args)
            .envs(torchrun_env(
                local,
                config.nproc,
                elastic.node_id,
                &elastic.job,
                incarnation,
                elastic.max_restarts,
            ))
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("MASTER_ADDR")
            .env_remove("MASTER_PORT")
            .env_remove(RENDEZVOUS_FD)
            .env(ckpt_elastic::env::RDZV, &self.rdzv)
            .env("CKPT_JOB_ID", &elastic.job)
            .env("CKPT_NODE_ID", elastic.node_id.to_string())
            .env(
                "CKPT_MEMBER_ID",
                format!("n{}-l{local}-i{incarnation}", elastic.node_id),
            )
            .env("CKPT_RUN_ID", &self.run_id)
            .env(
                ckpt_elastic::env::RDZV_CONNECT_TIMEOUT,
                elastic.connect_timeout.as_secs_f64().to_string(),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(self.pgid);
        // A rank is a member of its node, not of etcd: no lease of its own, and none
        // of etcd's credentials (it talks to its node agent, with the job secret).
        command.env_remove("CKPT_ETCD_LEASE");
        #[cfg(feature = "etcd")]
        for name in ckpt_elastic::etcd::security::ALL_ENV {
            command.env_remove(name);
        }
        if let Some(text) = &self.generated_secret {
            command.env(ckpt_auth::SECRET_ENV, text);
        }
        let mut child = match spawn(&mut command, &config.program) {
            // The ranks' process group is gone: every rank of this node exited, the
            // group's leader included, and a group with no member cannot be joined
            // (setpgid answers EPERM). The restarted rank leads a new one.
            Err(e) if self.pgid != 0 && e.raw_os_error() == Some(libc::EPERM) => {
                let ended = self.pgid;
                command.process_group(0);
                let child = spawn(&mut command, &config.program)?;
                self.pgid = child.id() as i32;
                say(format_args!(
                    "launch: the ranks' process group {ended} ended with its last rank; process group {} from now on",
                    self.pgid
                ));
                child
            }
            other => other?,
        };
        if self.pgid == 0 {
            self.pgid = child.id() as i32;
            say(format_args!(
                "launch: node {} with {} ranks, {} {}, job {}, process group {}",
                elastic.node_id,
                config.nproc,
                match self.plane {
                    Plane::Coordinator { .. } => "coordinator",
                    #[cfg(feature = "etcd")]
                    Plane::Etcd { .. } => "control plane",
                },
                self.plane.shown(),
                elastic.job,
                self.pgid
            ));
        }
        if incarnation == 0 {
            say(format_args!("launch: rank {label} pid {}", child.id()));
        } else {
            say(format_args!(
                "launch: rank {label} pid {} (restart {incarnation})",
                child.id()
            ));
        }
        let prefix = format!("[rank {label}] ");
        self.pumps.push(stream(
            child.stdout.take().expect("piped"),
            prefix.clone(),
            false,
        ));
        self.pumps
            .push(stream(child.stderr.take().expect("piped"), prefix, true));
        Ok(child)
    }
}

/// The control plane a launcher uses: the coordinator it hosts or joins, or etcd;
/// either way through the node agent its ranks talk to, which is this node's one
/// member of the control plane.
enum Plane {
    Coordinator {
        hosted: Option<ckpt_elastic::CoordinatorHandle>,
        address: SocketAddr,
        /// `None` when the coordinator could not be reached at the start.
        node: Option<NodeAgent>,
    },
    #[cfg(feature = "etcd")]
    Etcd {
        node: NodeAgent,
        job: ckpt_elastic::EtcdJob,
        url: ckpt_elastic::EtcdUrl,
    },
}

impl Plane {
    /// The control plane as the launcher names it: the coordinator's address, or
    /// the etcd URL (the ranks get their node's address).
    fn shown(&self) -> String {
        match self {
            Plane::Coordinator { address, .. } => address.to_string(),
            #[cfg(feature = "etcd")]
            Plane::Etcd { url, .. } => url.to_string(),
        }
    }

    /// The node agent, when the launcher runs one (not when the coordinator could not
    /// be reached at the start).
    fn node(&self) -> Option<&NodeAgent> {
        match self {
            Plane::Coordinator { node, .. } => node.as_ref(),
            #[cfg(feature = "etcd")]
            Plane::Etcd { node, .. } => Some(node),
        }
    }

    /// The launcher runs `ranks` rank processes now.
    fn expect(&self, ranks: usize) {
        if let Some(node) = self.node() {
            node.expect(ranks);
        }
    }

    fn events(&self) -> Vec<Event> {
        match self {
            Plane::Coordinator { hosted, .. } => {
                hosted.as_ref().map(|c| c.events()).unwrap_or_default()
            }
            #[cfg(feature = "etcd")]
            Plane::Etcd { job, .. } => job.events(),
        }
    }

    /// Why the job is over, when this control plane knows it (a hosted coordinator,
    /// etcd); `None` for a coordinator this launcher only joins.
    fn job_over(&self) -> Option<JobOver> {
        match self {
            Plane::Coordinator { hosted, .. } => hosted.as_ref().and_then(|c| c.job_over()),
            #[cfg(feature = "etcd")]
            Plane::Etcd { job, .. } => job.job_over(),
        }
    }
}

/// How long a rank killed with SIGKILL may take to be reaped before the launcher
/// names it and exits without it: a process in uninterruptible sleep (state D, e.g.
/// inside a driver call) dies only when that call returns, which may be never.
const REAP_BOUND: Duration = Duration::from_secs(5);

/// The state of process `pid` as `/proc/PID/stat` gives it (`R`, `S`, `D`, `T`, `Z`…),
/// `None` when it cannot be read (gone, or no procfs).
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "PID (COMM) STATE …", where COMM may itself hold parentheses.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// `proc_state` in words, for the launcher's lines.
fn describe_state(state: Option<char>) -> String {
    match state {
        Some('D') => "state D: uninterruptible sleep".into(),
        Some('T') => "state T: stopped".into(),
        Some('t') => "state t: stopped by a debugger".into(),
        Some('Z') => "state Z: exited, not yet reaped".into(),
        Some('R') => "state R: running".into(),
        Some('S') => "state S: sleeping".into(),
        Some(other) => format!("state {other}"),
        None => "state unknown".into(),
    }
}

/// The end of the job as this launcher learnt it, and what it did about the local
/// ranks still running then.
struct Ending {
    /// Why the job is over (the control plane's words, or the rank that finished).
    reason: String,
    /// It trained to its last step.
    finished: bool,
    /// Ranks still running at this instant are killed: the grace after the end.
    kill_at: Instant,
}

/// This node as one member of the control plane, holding its ranks, reached at `ip`.
fn node_member(config: &LaunchConfig, elastic: &ElasticLaunch, ip: IpAddr) -> Member {
    let node = elastic.node_id.to_string();
    Member {
        ranks: config.nproc,
        ..Member::new(&elastic.job, format!("n{node}"), ip.to_string(), node)
    }
}

/// Serves the node's ranks on `ip`, standing for them through `upstream` (the
/// node's member of the control plane) with the job's windows.
fn serve_node(
    upstream: std::sync::Arc<dyn ckpt_elastic::ControlPlane>,
    ip: IpAddr,
    elastic: &ElasticLaunch,
    timeouts: ckpt_elastic::Timeouts,
    secret: Option<&JobSecret>,
) -> std::io::Result<NodeAgent> {
    let settings = NodeConfig {
        timeouts,
        last_call: timeouts.last_call,
        secret: secret.cloned(),
        // A node that comes back after its job and coordinator ended gives up as a
        // first connection would (`--rdzv-connect-timeout-secs`).
        give_up_before_joining: elastic.connect_timeout,
        ..NodeConfig::new(&elastic.job)
    };
    NodeAgent::start(upstream, SocketAddr::new(ip, 0), settings)
}

/// Joins the coordinator at `coordinator` as this node (one member holding the
/// node's ranks) and serves the node's ranks on the address that reaches it.
fn start_node(
    config: &LaunchConfig,
    elastic: &ElasticLaunch,
    coordinator: SocketAddr,
    secret: Option<&JobSecret>,
) -> std::io::Result<NodeAgent> {
    let ip = ckpt_elastic::env::local_ip_towards(coordinator)?;
    let member = node_member(config, elastic, ip);
    let settings = TcpSettings {
        secret: secret.cloned(),
        connect_timeout: elastic.connect_timeout,
        ..TcpSettings::default()
    };
    let upstream = TcpControlPlane::connect(coordinator, member, settings)
        .map_err(|e| std::io::Error::other(format!("coordinator {coordinator}: {e}")))?;
    serve_node(
        std::sync::Arc::new(upstream),
        ip,
        elastic,
        elastic.coordinator.timeouts,
        secret,
    )
}

/// The job's secret: the one the environment names ([`ckpt_auth::SECRET_ENV`] or
/// [`ckpt_auth::SECRET_FILE_ENV`], which the ranks inherit), else, when `alone` (no
/// other launcher can be part of the job: a fixed launch, or an elastic one that
/// hosts the control plane's only entry with its ranks the most the job holds), one
/// generated here, returned as text too, to pass to the ranks. Otherwise none, said
/// once: the control plane then admits any process that reaches it, as every
/// launcher would need the same secret.
fn job_secret(alone: bool) -> std::io::Result<(Option<JobSecret>, Option<String>)> {
    let invalid = |e: ckpt_auth::SecretError| std::io::Error::new(ErrorKind::InvalidInput, e);
    if let Some(secret) = JobSecret::from_env().map_err(invalid)? {
        return Ok((Some(secret), None));
    }
    if !alone {
        say(format_args!(
            "launch: no job secret ({} or {}): the control plane admits any process that reaches it (docs/ELASTIC.md, \"A job secret\")",
            ckpt_auth::SECRET_ENV,
            ckpt_auth::SECRET_FILE_ENV
        ));
        return Ok((None, None));
    }
    let text = JobSecret::generate_text().map_err(std::io::Error::other)?;
    let secret = JobSecret::new(&text, "generated").map_err(invalid)?;
    Ok((Some(secret), Some(text)))
}

/// Joins the job in etcd at `url` as this node: one member holding the node's
/// ranks, under one lease (the node's, kept alive by its heartbeats), whose ranks
/// talk to the node agent on the address that reaches etcd.
#[cfg(feature = "etcd")]
fn start_etcd_node(
    config: &LaunchConfig,
    elastic: &ElasticLaunch,
    url: &ckpt_elastic::EtcdUrl,
    job: &ckpt_elastic::EtcdJob,
    settings: ckpt_elastic::EtcdSettings,
    secret: Option<&JobSecret>,
) -> std::io::Result<NodeAgent> {
    let toward = ckpt_elastic::Rdzv::Etcd(url.clone())
        .toward()
        .map_err(|e| std::io::Error::other(format!("{url}: {e}")))?;
    let ip = ckpt_elastic::env::local_ip_towards(toward)?;
    let member = node_member(config, elastic, ip);
    let upstream = ckpt_elastic::EtcdControlPlane::connect(url, member, None, settings)
        .map_err(|e| std::io::Error::other(format!("{url}: {e}")))?;
    serve_node(
        std::sync::Arc::new(upstream),
        ip,
        elastic,
        job.config().timeouts(),
        secret,
    )
}

fn launch_elastic(config: &LaunchConfig, elastic: &ElasticLaunch) -> std::io::Result<i32> {
    signals::install();
    let alone = elastic.rdzv.is_none() && elastic.max_ranks <= config.nproc;
    let (secret, generated_secret) = job_secret(alone)?;
    let (plane, rdzv) = match &elastic.etcd {
        #[cfg(feature = "etcd")]
        Some(url) => {
            // TLS and the etcd user (CKPT_ETCD_CACERT…): the launcher's handle and
            // its node's member connect alike.
            let settings = ckpt_elastic::EtcdSettings::from_env()
                .map_err(|e| std::io::Error::other(format!("{url}: {e}")))?;
            let job = ckpt_elastic::EtcdJob::connect(url, &elastic.coordinator, settings.clone())
                .map_err(|e| std::io::Error::other(format!("{url}: {e}")))?;
            let c = job.config();
            if job.adopted() {
                say(format_args!(
                    "launch: job {} already has settings in etcd (ranks {}..={}, heartbeat timeout {} ms); using them rather than this launcher's",
                    elastic.job, c.min_ranks, c.max_ranks, c.heartbeat_timeout_ms
                ));
            }
            let node = start_etcd_node(config, elastic, url, &job, settings, secret.as_ref())?;
            let rdzv = node.local_addr().to_string();
            (
                Plane::Etcd {
                    node,
                    job,
                    url: url.clone(),
                },
                rdzv,
            )
        }
        #[cfg(not(feature = "etcd"))]
        Some(url) => {
            return Err(std::io::Error::other(format!(
                "{url}: this launcher was built without the etcd backend"
            )));
        }
        None => {
            // Host the coordinator on a listener this process keeps, or join the one named.
            let hosted = match elastic.rdzv {
                None => Some(Coordinator::bind(
                    elastic.host_at.unwrap_or_else(|| {
                        SocketAddr::new(config.master_addr, config.master_port.unwrap_or(0))
                    }),
                    elastic.coordinator.clone(),
                )?),
                Some(_) => None,
            };
            let coordinator = match (&hosted, elastic.rdzv) {
                (Some(c), _) => c.local_addr(),
                (None, Some(addr)) => addr,
                (None, None) => unreachable!("hosted when no address is given"),
            };
            let hosted = hosted.map(|c| c.with_secret(secret.clone()).spawn());
            // This launcher is the node's member of the control plane; its ranks
            // talk to it. A coordinator that cannot be reached (a node started
            // after the job and its coordinator ended) is left to the ranks, which
            // know from the store whether anything is left to do.
            let node = match start_node(config, elastic, coordinator, secret.as_ref()) {
                Ok(node) => Some(node),
                Err(e) => {
                    say(format_args!(
                        "launch: this node cannot join the coordinator ({e}); its ranks try themselves"
                    ));
                    None
                }
            };
            let rdzv = node
                .as_ref()
                .map_or(coordinator, NodeAgent::local_addr)
                .to_string();
            (
                Plane::Coordinator {
                    hosted,
                    address: coordinator,
                    node,
                },
                rdzv,
            )
        }
    };
    let mut events_seen = 0;
    let mut last_ended: Option<(u64, std::time::SystemTime)> = None;
    let mut spawner = Spawner {
        config,
        elastic,
        rdzv,
        generated_secret,
        plane: &plane,
        run_id: run_id_from_env()?,
        pgid: 0,
        pumps: Vec::new(),
    };
    let mut slots = Vec::with_capacity(config.nproc);
    for local in 0..config.nproc {
        let child = spawner.spawn(local, 0)?;
        slots.push(Slot {
            label: elastic.node_id * config.nproc + local,
            child: Some(child),
            incarnation: 0,
            status: None,
            lost_for_good: false,
        });
    }
    plane.expect(config.nproc);
    let mut forwarded = 0;
    let mut restarts = 0;
    let mut wedged = 0;
    let mut first_failure: Option<i32> = None;
    // After a failure with no restart left and no --min-ranks: SIGKILL at this instant.
    let mut kill_at: Option<Instant> = None;
    let mut ending: Option<Ending> = None;
    // When the ranks still running were sent SIGKILL (at the end of the job, or of a
    // stop): the launcher waits `REAP_BOUND` for them at most.
    let mut killed_at: Option<Instant> = None;
    let mut serving = false;
    // Another node's ranks can use the coordinator this launcher hosts.
    let others_may_join = elastic.host_at.is_some() || elastic.max_ranks > config.nproc;
    loop {
        let (count, last) = signals::received();
        if count > forwarded {
            forwarded = count;
            say(format_args!(
                "launch: forwarding signal {last} to the ranks"
            ));
            for child in slots.iter().filter_map(|s| s.child.as_ref()) {
                kill(child, last);
            }
        }
        let events = plane.events();
        for event in events.iter().skip(events_seen) {
            summarize(event, &mut last_ended);
        }
        events_seen = events.len();
        let mut stop_all = false;
        for (local, slot) in slots.iter_mut().enumerate() {
            let Some(child) = slot.child.as_mut() else {
                continue;
            };
            let Some(status) = child.try_wait()? else {
                continue;
            };
            let label = slot.label;
            slot.child = None;
            slot.status = Some(status);
            let code = code_of(status);
            if code == 0 {
                // A rank exits 0 only when the job trained to its last step.
                ending.get_or_insert_with(|| Ending {
                    reason: format!("the job finished: rank {label} exited 0"),
                    finished: true,
                    kill_at: Instant::now() + config.grace,
                });
                continue;
            }
            if (code == EXIT_STOPPED && forwarded > 0) || killed_at.is_some() {
                continue;
            }
            if code == EXIT_WEDGED
                && forwarded == 0
                && ending.is_none()
                && wedged < MAX_WEDGED_RELAUNCHES
            {
                wedged += 1;
                let incarnation = slot.incarnation + 1;
                say(format_args!(
                    "launch: rank {label} could not leave its process group (exit {EXIT_WEDGED}); \
                     a fresh process takes its place, not counted as a restart"
                ));
                slot.child = Some(spawner.spawn(local, incarnation)?);
                slot.incarnation = incarnation;
                slot.status = None;
                continue;
            }
            say(format_args!("launch: rank {label} failed: {status}"));
            first_failure.get_or_insert(code);
            if forwarded > 0 || ending.is_some() {
                continue;
            }
            if restarts < elastic.max_restarts {
                restarts += 1;
                let incarnation = slot.incarnation + 1;
                let child = spawner.spawn(local, incarnation)?;
                slot.child = Some(child);
                slot.incarnation = incarnation;
                slot.status = None;
            } else if !elastic.shrink {
                stop_all = true;
            } else {
                slot.lost_for_good = true;
                say(format_args!(
                    "launch: rank {label} is not restarted ({restarts} of {} restarts used); the others go on",
                    elastic.max_restarts
                ));
            }
        }
        // The control plane's word on the end of the job is better than a rank's exit.
        if let Some(over) = plane.job_over() {
            match &mut ending {
                Some(end) if over.finished() || !end.finished => {
                    end.reason = over.to_string();
                    end.finished = over.finished();
                }
                Some(_) => {}
                None => {
                    ending = Some(Ending {
                        reason: over.to_string(),
                        finished: over.finished(),
                        kill_at: Instant::now() + config.grace,
                    })
                }
            }
        }
        plane.expect(slots.iter().filter(|s| s.child.is_some()).count());
        if stop_all && kill_at.is_none() {
            say(format_args!(
                "launch: no restart left and no --min-ranks: stopping every rank"
            ));
            for child in slots.iter().filter_map(|s| s.child.as_ref()) {
                kill(child, libc::SIGTERM);
            }
            kill_at = Some(Instant::now() + config.grace);
        }
        let now = Instant::now();
        let running: Vec<&Slot> = slots.iter().filter(|s| s.child.is_some()).collect();
        if running.is_empty() {
            // A coordinator this launcher hosts serves the whole job: the other nodes'
            // ranks may still train, or come back (a node restarting), and would lose
            // their control plane with this process. It serves until the job is over,
            // which includes the coordinator's own rule: too few members for the
            // rendezvous timeout shuts the job down.
            let hosting = matches!(
                plane,
                Plane::Coordinator {
                    hosted: Some(_),
                    ..
                }
            );
            if hosting && others_may_join && ending.is_none() && forwarded == 0 && kill_at.is_none()
            {
                if !serving {
                    serving = true;
                    say(format_args!(
                        "launch: every rank of this node has exited; serving the job's coordinator until the job ends (it shuts the job down after {} s with fewer than {} members)",
                        elastic
                            .coordinator
                            .timeouts
                            .rendezvous_timeout
                            .as_secs_f64(),
                        elastic.coordinator.min_ranks
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            if serving && forwarded > 0 {
                say(format_args!("launch: signalled; coordinator stops"));
            }
            break;
        }
        // Ranks still running once the job is over (after the grace), or once a stop
        // is due: the world has dropped them (hung, stale) or they ignore SIGTERM.
        let due = match (&ending, kill_at) {
            (Some(end), _) if now >= end.kill_at => Some("after the job ended"),
            (_, Some(at)) if now >= at => Some("after SIGTERM"),
            _ => None,
        };
        if killed_at.is_none()
            && let Some(why) = due
        {
            let grace = config.grace.as_secs_f64();
            for slot in &running {
                let Some(child) = &slot.child else { continue };
                say(format_args!(
                    "launch: rank {} pid {} still running {grace} s {why} ({}); SIGKILL",
                    slot.label,
                    child.id(),
                    describe_state(proc_state(child.id()))
                ));
                kill(child, libc::SIGKILL);
            }
            killed_at = Some(now);
        }
        if let Some(at) = killed_at
            && now >= at + REAP_BOUND
        {
            // SIGKILL cannot end a process until it leaves uninterruptible sleep; the
            // launcher names it and goes, rather than hold the allocation for it.
            for slot in &running {
                let Some(child) = &slot.child else { continue };
                say(format_args!(
                    "launch: rank {} pid {} did not die within {} s of SIGKILL ({}); exiting without it",
                    slot.label,
                    child.id(),
                    REAP_BOUND.as_secs(),
                    describe_state(proc_state(child.id()))
                ));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if slots.iter().all(|s| s.child.is_none()) {
        for pump in spawner.pumps {
            let _ = pump.join();
        }
    } else {
        // A rank that could not be reaped keeps its pipes open: wait for the others'
        // output, not for it.
        let until = Instant::now() + Duration::from_secs(1);
        while spawner.pumps.iter().any(|p| !p.is_finished()) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // A stop is judged by the ranks still in the job when it came: one lost for good
    // earlier was survived (the world re-formed without it), as for a finished job.
    let codes: Vec<i32> = slots
        .iter()
        .filter(|s| !s.lost_for_good)
        .filter_map(|s| s.status.map(code_of))
        .collect();
    let code = match &ending {
        // The job trained to its last step: that is this node's outcome too, whatever
        // it recovered from (its own ranks may all have been lost on the way).
        Some(end) if end.finished && kill_at.is_none() => 0,
        _ if !codes.is_empty() && codes.iter().all(|c| *c == EXIT_STOPPED) => EXIT_STOPPED,
        _ => first_failure.unwrap_or(1),
    };
    if let Some(end) = &ending {
        say(format_args!("launch: {}; exit {code}", end.reason));
    }
    Ok(code)
}

/// The run id a launch hands its ranks: `CKPT_RUN_ID` when set (the ranks check it),
/// else a fresh one. A fresh id is 16 hex digits from the OS's random source, so it
/// is a valid run id (`ckpt::RunId`: 1 to 48 letters, digits, `_` or `-`) without the
/// launcher linking the library: it moves no checkpoint bytes.
fn run_id_from_env() -> std::io::Result<String> {
    match std::env::var("CKPT_RUN_ID") {
        Ok(run) => Ok(run),
        Err(_) => fresh_id(),
    }
}

/// 16 random hex digits.
pub(crate) fn fresh_id() -> std::io::Result<String> {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes)
        .map_err(|e| std::io::Error::other(format!("no random source for a run id: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_run_id_is_one_the_library_accepts_and_differs_each_time() {
        let (a, b) = (fresh_id().unwrap(), fresh_id().unwrap());
        assert!(ckpt::RunId::is_valid(&a), "{a}");
        assert_eq!(a.len(), 16);
        assert_ne!(a, b);
    }

    #[test]
    fn the_state_of_a_stopped_process_is_read_and_named() {
        let mut child = Command::new("sleep").arg("60").spawn().unwrap();
        let pid = child.id();
        // Just after the spawn the child may still be in exec (briefly D); whatever it
        // is, it is readable and not stopped.
        let before = proc_state(pid);
        assert!(before.is_some() && before != Some('T'), "{before:?}");
        kill(&child, libc::SIGSTOP);
        // The stop is asynchronous; the state says when it took effect.
        let until = Instant::now() + Duration::from_secs(10);
        while proc_state(pid) != Some('T') && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(describe_state(proc_state(pid)), "state T: stopped");
        // SIGKILL ends a stopped process (unlike one in state D).
        kill(&child, libc::SIGKILL);
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert_eq!(describe_state(Some('D')), "state D: uninterruptible sleep");
    }
}
