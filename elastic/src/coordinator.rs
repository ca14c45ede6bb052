//! The coordinator: a TCP server that forms generations and tells members what to do.
//!
//! One thread accepts connections; each connection has a reader thread (parses lines,
//! applies them to the shared state) and a writer thread (drains a bounded outbox,
//! so that a member that stops reading can never block the coordinator: when its
//! outbox is full it is disconnected). A ticker thread applies the timeouts. All
//! decisions are made by one `Core` under one mutex, from messages and the clock only,
//! which keeps the rules in one place and testable without sockets.
//!
//! The coordinator keeps nothing that matters across its own restart: generation
//! numbers, the checkpoint-generation floor and the running membership are rebuilt
//! from what the members announce when they reconnect (see the module docs of
//! [`crate`]).

use std::collections::{BTreeSet, HashMap};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use tracing::{info, warn};

use super::protocol::{self, ClientMessage, LineError, LineReader, ServerMessage};
use super::timeouts::{Timeouts, validate_ranks};
use super::{Assignment, Directive, Member, Progress, Report};

/// Lines queued for one member before it counts as not reading and is disconnected.
const OUTBOX: usize = 256;
/// Connections served at once; more are refused with an error line.
const MAX_CONNECTIONS: usize = 1024;
/// Keys per generation's key-value space.
const MAX_KEYS: usize = 4096;
/// Largest generation number accepted from a member: far beyond any real job, and
/// small enough that counting up from it cannot overflow.
const MAX_GENERATION: u64 = 1 << 53;
/// Longest member id accepted.
const MAX_ID: usize = 256;
/// Time a new connection has to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on one write to a member.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the timeouts are checked.
const TICK: Duration = Duration::from_millis(10);
/// Events kept for [`CoordinatorHandle::events`].
const MAX_EVENTS: usize = 4096;

/// What a coordinator decides with. Durations are wall-clock on the coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// The job id members must announce.
    pub job: String,
    /// Fewest members a generation may have.
    pub min_ranks: usize,
    /// Most members a generation may have; more wait.
    pub max_ranks: usize,
    /// The formation and failure windows ([`Timeouts::DEFAULT`] unless set).
    pub timeouts: Timeouts,
    /// How long a freshly started coordinator waits for the members of a running
    /// generation to reconnect and announce it before forming a new one (by default
    /// the heartbeat timeout: a member that cannot come back by then would be
    /// declared lost anyway). A launcher that starts a new job with its own
    /// coordinator sets zero: there is no running generation to adopt.
    pub settle: Duration,
}

impl CoordinatorConfig {
    /// A configuration for `job` with the default timeouts.
    pub fn new(job: impl Into<String>, min_ranks: usize, max_ranks: usize) -> Self {
        CoordinatorConfig {
            job: job.into(),
            min_ranks,
            max_ranks,
            timeouts: Timeouts::DEFAULT,
            settle: Timeouts::DEFAULT.heartbeat_timeout,
        }
    }

    /// Checks that the settings make sense together; the error names the values.
    pub fn validate(&self) -> Result<(), String> {
        if self.job.is_empty() {
            return Err("job id is empty".into());
        }
        validate_ranks(self.min_ranks, self.max_ranks)?;
        self.timeouts.validate()
    }
}

/// A change of generation, for a launcher's recovery summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A generation formed (or was adopted after a coordinator restart).
    Formed {
        /// Its number.
        generation: u64,
        /// Member ids, index = rank.
        members: Vec<String>,
        /// Why it formed.
        cause: String,
        /// True when adopted from reconnecting members rather than formed anew.
        adopted: bool,
        /// When.
        at: SystemTime,
    },
    /// A generation ended (Restart sent to its remaining members).
    Ended {
        /// Its number.
        generation: u64,
        /// Why.
        cause: String,
        /// When.
        at: SystemTime,
    },
    /// The job was shut down.
    Shutdown {
        /// Why.
        reason: String,
        /// When.
        at: SystemTime,
    },
}

/// Why a job is over, as its control plane knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobOver {
    /// A member trained to the last step: the job succeeded, whatever it recovered
    /// from on the way.
    Finished(String),
    /// The job was shut down without finishing (too few members for too long).
    ShutDown(String),
}

impl JobOver {
    /// True when the job trained to its last step.
    pub fn finished(&self) -> bool {
        matches!(self, JobOver::Finished(_))
    }
}

impl std::fmt::Display for JobOver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobOver::Finished(reason) => f.write_str(reason),
            JobOver::ShutDown(reason) => write!(f, "job shut down: {reason}"),
        }
    }
}

/// A bound coordinator, not yet serving.
pub struct Coordinator {
    listener: TcpListener,
    config: CoordinatorConfig,
}

impl Coordinator {
    /// Validates `config` and binds `addr` (port 0 picks a free port).
    pub fn bind(addr: SocketAddr, config: CoordinatorConfig) -> io::Result<Coordinator> {
        config
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let listener = TcpListener::bind(addr)?;
        Ok(Coordinator { listener, config })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves on background threads. Dropping the handle stops the coordinator.
    pub fn spawn(self) -> CoordinatorHandle {
        let addr = self.local_addr();
        let shared = Arc::new(Shared {
            core: Mutex::new(Core::new(self.config, Instant::now())),
            events_changed: Condvar::new(),
            ticker: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let accept = {
            let shared = shared.clone();
            let listener = self.listener;
            std::thread::Builder::new()
                .name("ckpt-coordinator-accept".into())
                .spawn(move || accept_loop(&shared, &listener))
        };
        let ticker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("ckpt-coordinator-tick".into())
                .spawn(move || tick_loop(&shared))
        };
        let mut threads = Vec::new();
        let mut spawn_error = None;
        for thread in [accept, ticker] {
            match thread {
                Ok(thread) => threads.push(thread),
                Err(e) => spawn_error = Some(e),
            }
        }
        let handle = CoordinatorHandle {
            shared,
            addr,
            threads,
            spawn_error,
        };
        if handle.spawn_error.is_some() {
            handle.stop();
        }
        handle
    }

    /// Serves on this thread until stopped (the `ckpt coordinator` command).
    pub fn run(self) -> io::Result<()> {
        self.spawn().join()
    }
}

/// A running coordinator.
pub struct CoordinatorHandle {
    shared: Arc<Shared>,
    addr: SocketAddr,
    threads: Vec<JoinHandle<()>>,
    spawn_error: Option<io::Error>,
}

impl CoordinatorHandle {
    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving: closes the listener and every connection (members see what
    /// they would see if the coordinator process died). Idempotent.
    pub fn stop(&self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        {
            let core = self.shared.lock();
            for conn in core.conns.values() {
                conn.close();
            }
        }
        self.shared.ticker.notify_all();
        self.shared.events_changed.notify_all();
        // Wake the accept loop, which then sees `stopping`.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }

    /// Waits for the coordinator's threads to end (after [`CoordinatorHandle::stop`],
    /// or never).
    pub fn join(mut self) -> io::Result<()> {
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        match self.spawn_error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The newest generation number known.
    pub fn generation(&self) -> u64 {
        self.shared.lock().newest
    }

    /// Members waiting for a generation (new members while one runs, members
    /// beyond `max_ranks`, survivors between generations).
    pub fn waiting(&self) -> usize {
        self.shared.lock().waiting()
    }

    /// Why the job is over, once it is: it trained to its last step, or it was shut
    /// down (too few members for too long, a fatal report). `None` while it may
    /// still train.
    pub fn job_over(&self) -> Option<JobOver> {
        let core = self.shared.lock();
        core.finished
            .clone()
            .map(JobOver::Finished)
            .or_else(|| core.shutdown.clone().map(JobOver::ShutDown))
    }

    /// Members connected now (training, waiting or between generations), from every
    /// node.
    pub fn members(&self) -> usize {
        self.shared
            .lock()
            .conns
            .values()
            .filter(|c| c.member.is_some())
            .count()
    }

    /// Every event so far (the newest 4096), oldest first.
    pub fn events(&self) -> Vec<Event> {
        self.shared.lock().events.clone()
    }

    /// Blocks until an event (past or future) satisfies `predicate`, or `timeout`
    /// passes.
    pub fn wait_for_event(
        &self,
        timeout: Duration,
        mut predicate: impl FnMut(&Event) -> bool,
    ) -> Option<Event> {
        let deadline = Instant::now() + timeout;
        let mut core = self.shared.lock();
        loop {
            if let Some(event) = core.events.iter().find(|e| predicate(e)) {
                return Some(event.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.shared.stopping.load(Ordering::SeqCst) {
                return None;
            }
            core = self
                .shared
                .events_changed
                .wait_timeout(core, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for CoordinatorHandle {
    fn drop(&mut self) {
        self.stop();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

struct Shared {
    core: Mutex<Core>,
    events_changed: Condvar,
    ticker: Condvar,
    stopping: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Core> {
        // Core's methods leave it consistent between statements that can panic (none
        // should); keep serving rather than poison every connection.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the core and wakes event waiters if it logged events.
    fn with_core<T>(&self, f: impl FnOnce(&mut Core) -> T) -> T {
        let mut core = self.lock();
        let before = core.event_count;
        let result = f(&mut core);
        let changed = core.event_count != before;
        drop(core);
        if changed {
            self.events_changed.notify_all();
        }
        result
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            Ok((stream, peer)) => {
                let shared = shared.clone();
                let spawned = std::thread::Builder::new()
                    .name("ckpt-coordinator-conn".into())
                    .spawn(move || serve_connection(&shared, stream, peer));
                if let Err(e) = spawned {
                    warn!(%peer, error = %e, "cannot start a thread for a connection");
                }
            }
            Err(e) => {
                // Out of file descriptors and the like: wait a little, keep serving.
                warn!(error = %e, "accept failed");
                let core = shared.lock();
                let _ = shared.ticker.wait_timeout(core, Duration::from_millis(100));
            }
        }
    }
}

fn tick_loop(shared: &Shared) {
    loop {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        shared.with_core(|core| core.tick(Instant::now()));
        let core = shared.lock();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let _ = shared.ticker.wait_timeout(core, TICK);
    }
}

fn write_lines(mut socket: TcpStream, outbox: Receiver<Arc<str>>) {
    // A member that stops reading fills its socket buffer, then this times out.
    let _ = socket.set_write_timeout(Some(WRITE_TIMEOUT));
    for line in outbox {
        if socket.write_all(line.as_bytes()).is_err() {
            break;
        }
    }
    // The core dropped the connection (or the peer stopped reading): close it, so
    // its reader thread ends too.
    let _ = socket.shutdown(Shutdown::Both);
}

fn refuse(mut stream: TcpStream, message: &str) {
    let error = ServerMessage::Error {
        message: message.to_owned(),
        fatal: true,
    };
    if let Ok(line) = protocol::encode(&error) {
        let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = stream.write_all(line.as_bytes());
    }
    let _ = stream.shutdown(Shutdown::Both);
}

fn serve_connection(shared: &Shared, stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let clones = (stream.try_clone(), stream.try_clone());
    let (Ok(for_writer), Ok(for_core)) = clones else {
        warn!(%peer, "cannot clone a connection's socket");
        return;
    };
    let (outbox, lines) = sync_channel(OUTBOX);
    let id = shared.with_core(|core| core.register(Some(for_core), outbox, peer));
    let Some(id) = id else {
        warn!(%peer, "too many connections; refused");
        refuse(stream, "too many connections");
        return;
    };
    let writer = std::thread::Builder::new()
        .name("ckpt-coordinator-write".into())
        .spawn(move || write_lines(for_writer, lines));
    if writer.is_err() {
        shared.with_core(|core| core.remove(id, "no thread to write", Instant::now()));
        return;
    }
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let mut reader = LineReader::new(stream);
    let reason = loop {
        match reader.next_line() {
            Ok(None) => break "connection closed".to_owned(),
            Ok(Some(line)) => {
                let message = protocol::decode::<ClientMessage>(line);
                let outcome = shared.with_core(|core| match message {
                    Ok(message) => core.handle(id, message, Instant::now()),
                    Err(e) => {
                        core.error(id, &e.to_string(), false);
                        Outcome::Continue
                    }
                });
                match outcome {
                    Outcome::Continue => {}
                    Outcome::Welcomed => {
                        let _ = reader.get_ref().set_read_timeout(None);
                    }
                    Outcome::Close(reason) => break reason,
                }
            }
            Err(LineError::TooLong { max }) => {
                let message = format!("line longer than {max} bytes; closing the connection");
                shared.with_core(|core| core.error(id, &message, true));
                break message;
            }
            Err(LineError::Io(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                let message = format!("no hello within {HELLO_TIMEOUT:?}");
                shared.with_core(|core| core.error(id, &message, true));
                break message;
            }
            Err(e) => break e.to_string(),
        }
    };
    if !shared.stopping.load(Ordering::SeqCst) {
        shared.with_core(|core| core.remove(id, &reason, Instant::now()));
    }
}

type ConnId = u64;

/// What the connection's reader does after a message.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Continue,
    /// Hello accepted: the connection may now be quiet for long.
    Welcomed,
    /// Close the connection, for this reason.
    Close(String),
}

struct Conn {
    outbox: SyncSender<Arc<str>>,
    /// `None` only in unit tests of [`Core`].
    socket: Option<TcpStream>,
    peer: SocketAddr,
    member: Option<Member>,
    last_seen: Instant,
    progress: Option<Progress>,
    /// The generation it announced in hello (only kept while settling).
    claim: Option<Assignment>,
    /// Waiting for a generation: (after, arrival order).
    wants: Option<(u64, u64)>,
    /// The generation it is in (running, or ended and rejoining from).
    generation: Option<u64>,
    /// The newest generation it was told Stale for.
    stale_for: Option<u64>,
}

impl Conn {
    fn close(&self) {
        if let Some(socket) = &self.socket {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }

    fn id(&self) -> &str {
        self.member.as_ref().map_or("?", |m| m.id.as_str())
    }
}

struct Running {
    generation: u64,
    /// Member ids, index = rank.
    members: Vec<String>,
    regroup_sent: bool,
    /// A member ended the generation at an agreed checkpoint boundary (a regroup,
    /// a stop, a member leaving after its final save): those who come to the
    /// rendezvous are not a failure, and the others are not aborted.
    at_boundary: bool,
}

enum Phase {
    /// Freshly started: collecting claims of running generations until `until`.
    Settling {
        until: Instant,
    },
    /// No generation: waiting for `min_ranks` members (and the last call).
    Gathering {
        min_since: Option<Instant>,
    },
    Running(Running),
    /// A generation ended: waiting for its survivors to ask for the next one.
    Rejoin {
        previous: u64,
        expected: BTreeSet<String>,
        deadline: Instant,
    },
}

/// The coordinator's decisions: every rule lives here, driven by messages and an
/// explicit clock.
struct Core {
    config: CoordinatorConfig,
    phase: Phase,
    conns: HashMap<ConnId, Conn>,
    by_member: HashMap<String, ConnId>,
    next_conn: ConnId,
    next_arrival: u64,
    /// Newest generation number issued, adopted or announced by any member.
    newest: u64,
    /// This coordinator formed or adopted a generation (else, after a restart, it
    /// knows nothing of how the members' last one ended).
    formed_any: bool,
    /// Max checkpoint generation reported + 1.
    floor: u64,
    /// The running generation's key-value space.
    kv: HashMap<String, String>,
    /// Why the next generation forms.
    cause: String,
    below_min_since: Option<Instant>,
    members_seen: bool,
    shutdown: Option<String>,
    /// The job finished (a member reported its final step): who asks to join now is
    /// told to shut down.
    finished: Option<String>,
    events: Vec<Event>,
    event_count: u64,
}

impl Core {
    fn new(config: CoordinatorConfig, now: Instant) -> Core {
        let until = now + config.settle;
        Core {
            config,
            phase: Phase::Settling { until },
            conns: HashMap::new(),
            by_member: HashMap::new(),
            next_conn: 0,
            next_arrival: 0,
            newest: 0,
            formed_any: false,
            finished: None,
            floor: 0,
            kv: HashMap::new(),
            cause: "initial".into(),
            below_min_since: None,
            members_seen: false,
            shutdown: None,
            events: Vec::new(),
            event_count: 0,
        }
    }

    fn register(
        &mut self,
        socket: Option<TcpStream>,
        outbox: SyncSender<Arc<str>>,
        peer: SocketAddr,
    ) -> Option<ConnId> {
        if self.conns.len() >= MAX_CONNECTIONS {
            return None;
        }
        let id = self.next_conn;
        self.next_conn += 1;
        self.conns.insert(
            id,
            Conn {
                outbox,
                socket,
                peer,
                member: None,
                last_seen: Instant::now(),
                progress: None,
                claim: None,
                wants: None,
                generation: None,
                stale_for: None,
            },
        );
        Some(id)
    }

    fn event(&mut self, event: Event) {
        if self.events.len() >= MAX_EVENTS {
            self.events.remove(0);
        }
        self.events.push(event);
        self.event_count += 1;
    }

    fn send(&mut self, c: ConnId, message: &ServerMessage) {
        let Some(conn) = self.conns.get(&c) else {
            return;
        };
        let line = match protocol::encode(message) {
            Ok(line) => Arc::<str>::from(line),
            Err(e) => {
                warn!(member = conn.id(), error = %e, "cannot encode a message");
                return;
            }
        };
        match conn.outbox.try_send(line) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => {
                warn!(member = conn.id(), peer = %conn.peer, "member does not read; disconnecting it");
                conn.close();
            }
        }
    }

    fn directive(&mut self, c: ConnId, directive: Directive) {
        self.send(c, &ServerMessage::Directive { directive });
    }

    fn error(&mut self, c: ConnId, message: &str, fatal: bool) {
        if let Some(conn) = self.conns.get(&c) {
            warn!(member = conn.id(), peer = %conn.peer, fatal, "refused: {message}");
        }
        self.send(
            c,
            &ServerMessage::Error {
                message: message.to_owned(),
                fatal,
            },
        );
    }

    fn conn_of(&self, id: &str) -> Option<ConnId> {
        self.by_member.get(id).copied()
    }

    fn handle(&mut self, c: ConnId, message: ClientMessage, now: Instant) -> Outcome {
        let Some(conn) = self.conns.get_mut(&c) else {
            return Outcome::Close("unknown connection".into());
        };
        conn.last_seen = now;
        let hello_done = conn.member.is_some();
        let numbers = match &message {
            ClientMessage::Hello { seen, claim, .. } => {
                vec![*seen, claim.as_ref().map_or(0, |a| a.generation)]
            }
            ClientMessage::Rendezvous { after } => vec![*after],
            ClientMessage::Heartbeat { generation, .. }
            | ClientMessage::Report { generation, .. }
            | ClientMessage::KvSet { generation, .. } => vec![*generation],
        };
        if let Some(bad) = numbers.into_iter().find(|&g| g > MAX_GENERATION) {
            let text = format!("generation {bad} is out of range (at most {MAX_GENERATION})");
            self.error(c, &text, false);
            return Outcome::Continue;
        }
        match message {
            ClientMessage::Hello {
                version,
                member,
                seen,
                checkpoint_generation,
                claim,
            } => {
                if hello_done {
                    self.error(c, "hello sent twice on one connection", false);
                    return Outcome::Continue;
                }
                self.hello(c, version, member, seen, checkpoint_generation, claim, now)
            }
            _ if !hello_done => {
                let text = "the first message must be hello";
                self.error(c, text, true);
                Outcome::Close(text.into())
            }
            ClientMessage::Rendezvous { after } => {
                self.rendezvous(c, after, now);
                Outcome::Continue
            }
            ClientMessage::Heartbeat {
                generation,
                progress,
            } => {
                self.heartbeat(c, generation, progress);
                Outcome::Continue
            }
            ClientMessage::Report { generation, report } => {
                self.report(c, generation, report, now);
                Outcome::Continue
            }
            ClientMessage::KvSet {
                generation,
                key,
                value,
            } => {
                self.kv_set(c, generation, key, value);
                Outcome::Continue
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn hello(
        &mut self,
        c: ConnId,
        version: u32,
        member: Member,
        seen: u64,
        checkpoint_generation: u64,
        claim: Option<Assignment>,
        now: Instant,
    ) -> Outcome {
        let refusal = if version != protocol::VERSION {
            Some(format!(
                "protocol version {version} is not supported (this coordinator speaks {})",
                protocol::VERSION
            ))
        } else if member.job != self.config.job {
            Some(format!(
                "job mismatch: this coordinator serves job {:?}, member {:?} belongs to job {:?}",
                self.config.job, member.id, member.job
            ))
        } else if member.id.is_empty() || member.id.len() > MAX_ID {
            Some(format!(
                "member id must be 1 to {MAX_ID} bytes, got {}",
                member.id.len()
            ))
        } else {
            None
        };
        if let Some(refusal) = refusal {
            self.error(c, &refusal, true);
            return Outcome::Close(refusal);
        }
        let claim = match claim {
            Some(claim) if !claim_is_coherent(&claim, &member) => {
                self.error(
                    c,
                    &format!(
                        "claimed generation {} does not list member {:?} at rank {}; claim ignored",
                        claim.generation, member.id, claim.rank
                    ),
                    false,
                );
                None
            }
            claim => claim,
        };
        self.members_seen = true;
        self.newest = self.newest.max(seen);
        self.floor = self.floor.max(checkpoint_generation.saturating_add(1));
        if let Some(claim) = &claim {
            self.newest = self.newest.max(claim.generation);
            self.floor = self.floor.max(claim.checkpoint_generation_floor);
        }
        let id = member.id.clone();
        // A second connection for the same member replaces the first: it keeps the
        // first one's place only if it claims exactly the running generation.
        let reattach = match (&self.phase, &claim) {
            (Phase::Running(running), Some(claim)) => {
                claim.generation == running.generation
                    && running.members.get(claim.rank) == Some(&id)
                    && claim.members.len() == running.members.len()
                    && claim
                        .members
                        .iter()
                        .zip(&running.members)
                        .all(|(m, r)| &m.id == r)
            }
            _ => false,
        };
        if let Some(old) = self.conn_of(&id).filter(|&old| old != c) {
            if reattach {
                self.by_member.insert(id.clone(), c);
                self.remove(old, "replaced by a new connection", now);
            } else {
                self.remove(
                    old,
                    "replaced by a new connection without its generation",
                    now,
                );
            }
        }
        self.by_member.insert(id.clone(), c);
        let Some(conn) = self.conns.get_mut(&c) else {
            return Outcome::Close("connection removed".into());
        };
        conn.member = Some(member);
        let welcome = ServerMessage::Welcome {
            job: self.config.job.clone(),
            generation: self.newest,
        };
        self.send(c, &welcome);
        if let Some(reason) = self.shutdown.clone() {
            self.directive(c, Directive::Shutdown { reason });
            return Outcome::Welcomed;
        }
        let Some(claim) = claim else {
            return Outcome::Welcomed;
        };
        let claimed = claim.generation;
        match &self.phase {
            Phase::Settling { .. } => {
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = Some(claimed);
                    conn.claim = Some(claim);
                }
                self.try_adopt(now);
            }
            Phase::Running(_) if reattach => {
                info!(member = %id, generation = claimed, "member reconnected to its generation");
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = Some(claimed);
                }
            }
            Phase::Rejoin {
                previous, expected, ..
            } if *previous == claimed && expected.contains(&id) => {
                // It may have missed the Restart while it was disconnected.
                let cause = self.cause.clone();
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = Some(claimed);
                }
                self.directive(
                    c,
                    Directive::Restart {
                        generation: claimed,
                        cause,
                    },
                );
            }
            _ => self.tell_stale(c, claimed),
        }
        Outcome::Welcomed
    }

    fn tell_stale(&mut self, c: ConnId, generation: u64) {
        let current = self.newest;
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        if conn.stale_for.is_some_and(|told| told >= generation) {
            return;
        }
        conn.stale_for = Some(generation);
        if conn.generation == Some(generation) {
            conn.generation = None;
        }
        info!(
            member = conn.id(),
            generation, current, "member told its generation is stale"
        );
        self.directive(c, Directive::Stale { current });
    }

    /// A message about a generation this connection is not in.
    fn not_in_generation(&mut self, c: ConnId, generation: u64, what: &str) {
        if matches!(self.phase, Phase::Settling { .. }) {
            // Members announce numbers from before the restart; they are not errors.
            self.newest = self.newest.max(generation);
            return;
        }
        if generation > self.newest {
            let message = format!(
                "{what} for generation {generation}, which is from the future: the newest is {}",
                self.newest
            );
            self.error(c, &message, false);
        } else {
            self.tell_stale(c, generation);
        }
    }

    fn rendezvous(&mut self, c: ConnId, after: u64, now: Instant) {
        if let Some(reason) = self.shutdown.clone().or_else(|| self.finished.clone()) {
            self.directive(c, Directive::Shutdown { reason });
            return;
        }
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        let id = conn.id().to_owned();
        let in_generation = conn.generation;
        conn.claim = None;
        if let Phase::Running(running) = &self.phase
            && in_generation == Some(running.generation)
        {
            if running.generation > after {
                // Asked again (after a reconnect): answer again.
                let running_generation = running.generation;
                self.assign_again(c, running_generation);
                return;
            }
            self.leave_running(&id, now);
        }
        // Numbers stay above whatever the member knew (also from before a restart).
        if after > 0 && !self.formed_any && self.cause == "initial" {
            // A generation this coordinator never saw ended while it was down.
            self.cause = format!(
                "members of generation {after} rejoined a restarted coordinator (what ended generation {after} happened while it was down)"
            );
        }
        self.newest = self.newest.max(after);
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        if let Some(conn) = self.conns.get_mut(&c)
            && conn.wants.is_none()
        {
            conn.wants = Some((after, arrival));
        }
        self.try_form(now);
    }

    fn assign_again(&mut self, c: ConnId, generation: u64) {
        let Phase::Running(running) = &self.phase else {
            return;
        };
        let members: Vec<Member> = running
            .members
            .iter()
            .filter_map(|id| self.conn_of(id))
            .filter_map(|conn| self.conns.get(&conn)?.member.clone())
            .collect();
        let Some(member) = self.conns.get(&c).and_then(|conn| conn.member.clone()) else {
            return;
        };
        if members.len() != running.members.len() {
            return;
        }
        let Some(rank) = members.iter().position(|m| m.id == member.id) else {
            return;
        };
        let assignment = Assignment {
            generation,
            rank,
            world_size: members.len(),
            members,
            checkpoint_generation_floor: self.floor,
            cause: self.cause.clone(),
        };
        self.send(c, &ServerMessage::Assigned { assignment });
    }

    /// A running member asked for a new generation: the running one is over.
    fn leave_running(&mut self, id: &str, now: Instant) {
        let Phase::Running(running) = &self.phase else {
            return;
        };
        if running.regroup_sent || running.at_boundary {
            // Everybody comes at their checkpoint boundary: no abort.
            let previous = running.generation;
            let expected = self.connected(&running.members);
            info!(
                generation = previous,
                "generation ended for regroup: {}", self.cause
            );
            let cause = self.cause.clone();
            self.event(Event::Ended {
                generation: previous,
                cause,
                at: SystemTime::now(),
            });
            self.kv.clear();
            self.phase = Phase::Rejoin {
                previous,
                expected,
                deadline: now + self.config.timeouts.join_timeout,
            };
        } else {
            let cause = format!(
                "member {id} left generation {} to rendezvous again",
                running.generation
            );
            self.restart(cause, &[id.to_owned()], false, now);
        }
    }

    fn connected(&self, ids: &[String]) -> BTreeSet<String> {
        ids.iter()
            .filter(|id| self.by_member.contains_key(*id))
            .cloned()
            .collect()
    }

    fn heartbeat(&mut self, c: ConnId, generation: u64, progress: Progress) {
        self.floor = self
            .floor
            .max(progress.checkpoint_generation.saturating_add(1));
        if generation == 0 {
            return;
        }
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        match conn.generation {
            Some(g) if g == generation => {
                conn.progress = Some(progress);
            }
            // Sent before it read its newer assignment.
            Some(g) if g > generation => {}
            _ => self.not_in_generation(c, generation, "heartbeat"),
        }
    }

    fn report(&mut self, c: ConnId, generation: u64, report: Report, now: Instant) {
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        let id = conn.id().to_owned();
        if matches!(report, Report::Fatal { .. } | Report::Leaving { .. }) {
            conn.wants = None;
        }
        let in_it = generation != 0 && conn.generation == Some(generation);
        if let Report::Finished { step } = report {
            if in_it {
                self.finish(format!(
                    "the job finished: member {id} trained to step {step}"
                ));
            }
            return;
        }
        match &mut self.phase {
            Phase::Running(running) if in_it && running.generation == generation => {
                let rank = running.members.iter().position(|m| *m == id).unwrap_or(0);
                match report {
                    Report::CollectiveFailed { peer, reason } => {
                        let peer = peer.map(|p| format!(" with rank {p}")).unwrap_or_default();
                        let cause =
                            format!("member {id} (rank {rank}): collective failed{peer}: {reason}");
                        self.restart(cause, &[], false, now);
                    }
                    Report::Fatal { reason } => {
                        let cause = format!("member {id} (rank {rank}) failed: {reason}");
                        self.restart(cause, &[id], false, now);
                    }
                    Report::Leaving { reason } => {
                        // Leaving is not a failure: the member leaves at a point the
                        // whole world agreed on (its final save committed, or the job
                        // finished), so the others are not aborted; they rendezvous
                        // again by themselves and form the next generation without
                        // it. (If they went on training instead, the member's exit
                        // would fail their next collective, which they report.)
                        let cause = format!("member {id} (rank {rank}) left: {reason}");
                        info!(generation, "{cause}");
                        running.members.retain(|m| *m != id);
                        running.at_boundary = true;
                        if let Some(conn) = self.conns.get_mut(&c) {
                            conn.generation = None;
                        }
                        self.cause = cause;
                        if running.members.is_empty() {
                            self.phase = Phase::Gathering { min_since: None };
                        }
                    }
                    Report::Committed { step } => self.maybe_regroup(step),
                    Report::Finished { .. } => {}
                    Report::Ended { step } => {
                        info!(
                            generation,
                            step, "member {id} (rank {rank}) ended the generation at a checkpoint"
                        );
                        running.at_boundary = true;
                    }
                }
            }
            Phase::Rejoin {
                previous, expected, ..
            } if in_it && *previous == generation => {
                if let Report::Fatal { reason } = &report {
                    // The root cause of the restart, when the peers' collective
                    // errors reached the coordinator before the failed member's own
                    // report: the next generation names it.
                    self.cause = format!("member {id} failed: {reason}");
                }
                if matches!(report, Report::Fatal { .. } | Report::Leaving { .. }) {
                    expected.remove(&id);
                    if let Some(conn) = self.conns.get_mut(&c) {
                        conn.generation = None;
                    }
                    self.try_form(now);
                }
            }
            _ if generation == 0 || in_it => {}
            _ => self.not_in_generation(c, generation, "report"),
        }
    }

    /// The job is done: members waiting to join (and any that ask later) are told
    /// to shut down; the running generation's members leave by themselves.
    fn finish(&mut self, reason: String) {
        if self.finished.is_some() {
            return;
        }
        info!("{reason}");
        self.finished = Some(reason.clone());
        let waiting: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, conn)| conn.wants.is_some())
            .map(|(&c, _)| c)
            .collect();
        for c in waiting {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.wants = None;
            }
            self.directive(
                c,
                Directive::Shutdown {
                    reason: reason.clone(),
                },
            );
        }
    }

    fn maybe_regroup(&mut self, step: u64) {
        let Phase::Running(running) = &mut self.phase else {
            return;
        };
        let waiting = self.conns.values().filter(|c| c.wants.is_some()).count();
        if waiting == 0 || running.regroup_sent || running.members.len() >= self.config.max_ranks {
            return;
        }
        running.regroup_sent = true;
        let generation = running.generation;
        let plural = if waiting == 1 { "" } else { "s" };
        let cause = format!("grow: {waiting} waiting member{plural} (after step {step} committed)");
        info!(generation, "regroup: {cause}");
        self.cause = cause.clone();
        let members: Vec<ConnId> = running
            .members
            .iter()
            .filter_map(|id| self.by_member.get(id).copied())
            .collect();
        for c in members {
            self.directive(
                c,
                Directive::Regroup {
                    generation,
                    cause: cause.clone(),
                },
            );
        }
    }

    fn kv_set(&mut self, c: ConnId, generation: u64, key: String, value: String) {
        let Some(conn) = self.conns.get(&c) else {
            return;
        };
        let running = match &self.phase {
            Phase::Running(running) if running.generation == generation => running,
            _ => {
                if generation > self.newest {
                    self.not_in_generation(c, generation, "kv_set");
                } else {
                    let message = format!(
                        "generation {generation} is not running (newest {}); key {key:?} not set",
                        self.newest
                    );
                    self.error(c, &message, false);
                }
                return;
            }
        };
        if conn.generation != Some(generation) {
            let message = format!(
                "member {:?} is not in generation {generation}; key {key:?} not set",
                conn.id()
            );
            self.error(c, &message, false);
            return;
        }
        if self.kv.len() >= MAX_KEYS && !self.kv.contains_key(&key) {
            let message =
                format!("generation {generation} already has {MAX_KEYS} keys; key {key:?} not set");
            self.error(c, &message, false);
            return;
        }
        let members: Vec<ConnId> = running
            .members
            .iter()
            .filter_map(|id| self.by_member.get(id).copied())
            .collect();
        let update = ServerMessage::Kv {
            generation,
            key: key.clone(),
            value: value.clone(),
        };
        self.kv.insert(key, value);
        for member in members {
            self.send(member, &update);
        }
    }

    /// Ends the running generation: drops `dropped` (telling them Stale when
    /// `stale`), sends Restart to the rest and waits for them to rejoin.
    fn restart(&mut self, cause: String, dropped: &[String], stale: bool, now: Instant) {
        let Phase::Running(running) = &self.phase else {
            return;
        };
        let generation = running.generation;
        let remaining: Vec<String> = running
            .members
            .iter()
            .filter(|id| !dropped.contains(id))
            .cloned()
            .collect();
        info!(generation, "generation ended: {cause}");
        self.event(Event::Ended {
            generation,
            cause: cause.clone(),
            at: SystemTime::now(),
        });
        self.cause = cause.clone();
        self.kv.clear();
        for id in dropped {
            if let Some(c) = self.conn_of(id) {
                if stale {
                    self.tell_stale(c, generation);
                } else if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = None;
                }
            }
        }
        let expected = self.connected(&remaining);
        for id in &expected {
            if let Some(c) = self.conn_of(id) {
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.progress = None;
                }
                self.directive(
                    c,
                    Directive::Restart {
                        generation,
                        cause: cause.clone(),
                    },
                );
            }
        }
        self.phase = if expected.is_empty() {
            Phase::Gathering { min_since: None }
        } else {
            Phase::Rejoin {
                previous: generation,
                expected,
                deadline: now + self.config.timeouts.join_timeout,
            }
        };
        self.try_form(now);
    }

    fn waiting(&self) -> usize {
        self.conns
            .values()
            .filter(|c| c.wants.is_some() && c.member.is_some())
            .count()
    }

    fn try_form(&mut self, now: Instant) {
        if self.shutdown.is_some() {
            return;
        }
        let waiting = self.waiting();
        let min = self.config.min_ranks;
        match &mut self.phase {
            Phase::Settling { .. } | Phase::Running(_) => {}
            Phase::Gathering { min_since } => {
                if waiting < min {
                    *min_since = None;
                    return;
                }
                let since = *min_since.get_or_insert(now);
                if waiting >= self.config.max_ranks || now >= since + self.config.timeouts.last_call
                {
                    self.form(now);
                }
            }
            Phase::Rejoin {
                expected, deadline, ..
            } => {
                expected.retain(|id| self.by_member.contains_key(id));
                let all_in = expected.iter().all(|id| {
                    self.by_member
                        .get(id)
                        .and_then(|c| self.conns.get(c))
                        .is_some_and(|c| c.wants.is_some())
                });
                if all_in && waiting >= min {
                    self.form(now);
                } else if now >= *deadline {
                    let missing: Vec<String> = expected
                        .iter()
                        .filter(|id| {
                            self.by_member
                                .get(*id)
                                .and_then(|c| self.conns.get(c))
                                .is_some_and(|c| c.wants.is_none())
                        })
                        .cloned()
                        .collect();
                    let previous = match &self.phase {
                        Phase::Rejoin { previous, .. } => *previous,
                        _ => 0,
                    };
                    for id in &missing {
                        warn!(member = %id, generation = previous, "member did not rejoin in time; dropped");
                        if let Some(c) = self.conn_of(id) {
                            self.tell_stale(c, previous);
                        }
                    }
                    self.phase = Phase::Gathering { min_since: None };
                    if waiting >= min {
                        self.form(now);
                    }
                }
            }
        }
    }

    fn form(&mut self, now: Instant) {
        let preferred = match &self.phase {
            Phase::Rejoin { expected, .. } => expected.clone(),
            _ => BTreeSet::new(),
        };
        let mut candidates: Vec<(bool, u64, ConnId)> = self
            .conns
            .iter()
            .filter_map(|(&c, conn)| {
                let (_, arrival) = conn.wants?;
                let member = conn.member.as_ref()?;
                Some((!preferred.contains(&member.id), arrival, c))
            })
            .collect();
        candidates.sort();
        candidates.truncate(self.config.max_ranks);
        let mut chosen: Vec<(Member, ConnId)> = candidates
            .iter()
            .filter_map(|&(_, _, c)| Some((self.conns.get(&c)?.member.clone()?, c)))
            .collect();
        chosen.sort_by(|(a, _), (b, _)| (&a.node, &a.id).cmp(&(&b.node, &b.id)));
        let generation = self.newest + 1;
        self.newest = generation;
        self.formed_any = true;
        let cause = std::mem::replace(&mut self.cause, "initial".into());
        let members: Vec<Member> = chosen.iter().map(|(m, _)| m.clone()).collect();
        for (rank, (_, c)) in chosen.iter().enumerate() {
            if let Some(conn) = self.conns.get_mut(c) {
                conn.wants = None;
                conn.generation = Some(generation);
                conn.last_seen = now;
                conn.progress = None;
                conn.claim = None;
                conn.stale_for = None;
            }
            let assignment = Assignment {
                generation,
                rank,
                world_size: members.len(),
                members: members.clone(),
                checkpoint_generation_floor: self.floor,
                cause: cause.clone(),
            };
            self.send(*c, &ServerMessage::Assigned { assignment });
        }
        let ids: Vec<String> = members.iter().map(|m| m.id.clone()).collect();
        info!(
            generation,
            world_size = ids.len(),
            members = ?ids,
            "generation formed: {cause}"
        );
        self.event(Event::Formed {
            generation,
            members: ids.clone(),
            cause: cause.clone(),
            adopted: false,
            at: SystemTime::now(),
        });
        self.cause = cause;
        self.kv.clear();
        self.below_min_since = None;
        self.phase = Phase::Running(Running {
            generation,
            members: ids,
            regroup_sent: false,
            at_boundary: false,
        });
    }

    /// While settling: adopts the newest claimed generation once all its members are
    /// back with the same view of it.
    fn try_adopt(&mut self, now: Instant) {
        let Some(newest_claim) = self
            .conns
            .values()
            .filter_map(|c| c.claim.as_ref().map(|a| a.generation))
            .max()
        else {
            return;
        };
        let claimants: Vec<(ConnId, &Assignment)> = self
            .conns
            .iter()
            .filter_map(|(&c, conn)| Some((c, conn.claim.as_ref()?)))
            .filter(|(_, claim)| claim.generation == newest_claim)
            .collect();
        let Some(&(_, first)) = claimants.first() else {
            return;
        };
        let complete = claimants.len() == first.members.len()
            && claimants
                .iter()
                .all(|(_, claim)| claim.members == first.members);
        if !complete {
            return;
        }
        let ids: Vec<String> = first.members.iter().map(|m| m.id.clone()).collect();
        let adopted: Vec<ConnId> = claimants.iter().map(|&(c, _)| c).collect();
        let older: Vec<(ConnId, u64)> = self
            .conns
            .iter()
            .filter_map(|(&c, conn)| Some((c, conn.claim.as_ref()?.generation)))
            .filter(|(c, _)| !adopted.contains(c))
            .collect();
        for c in adopted {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.generation = Some(newest_claim);
                conn.claim = None;
                conn.last_seen = now;
                conn.progress = None;
            }
        }
        self.newest = self.newest.max(newest_claim);
        self.formed_any = true;
        let cause = "adopted after a coordinator restart".to_owned();
        info!(generation = newest_claim, members = ?ids, "generation {cause}");
        self.event(Event::Formed {
            generation: newest_claim,
            members: ids.clone(),
            cause: cause.clone(),
            adopted: true,
            at: SystemTime::now(),
        });
        self.cause = cause;
        self.phase = Phase::Running(Running {
            generation: newest_claim,
            members: ids,
            regroup_sent: false,
            at_boundary: false,
        });
        for (c, generation) in older {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.claim = None;
            }
            self.tell_stale(c, generation);
        }
    }

    /// The settle window passed without an adoption: restart every claimant into a
    /// new generation numbered above every claim.
    fn end_settling(&mut self, now: Instant) {
        let claimants: Vec<(ConnId, String, u64)> = self
            .conns
            .iter()
            .filter_map(|(&c, conn)| {
                let claim = conn.claim.as_ref()?;
                Some((c, conn.id().to_owned(), claim.generation))
            })
            .collect();
        let Some(newest_claim) = claimants.iter().map(|&(_, _, g)| g).max() else {
            self.phase = Phase::Gathering { min_since: None };
            self.try_form(now);
            return;
        };
        let cause = format!(
            "coordinator restarted; generation {newest_claim} could not be adopted (not all of its members came back)"
        );
        info!(generation = newest_claim, "generation ended: {cause}");
        self.event(Event::Ended {
            generation: newest_claim,
            cause: cause.clone(),
            at: SystemTime::now(),
        });
        self.cause = cause.clone();
        let mut expected = BTreeSet::new();
        for (c, id, generation) in claimants {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.claim = None;
            }
            if generation == newest_claim {
                expected.insert(id);
            }
            self.directive(
                c,
                Directive::Restart {
                    generation,
                    cause: cause.clone(),
                },
            );
        }
        self.phase = Phase::Rejoin {
            previous: newest_claim,
            expected,
            deadline: now + self.config.timeouts.join_timeout,
        };
        self.try_form(now);
    }

    fn tick(&mut self, now: Instant) {
        if self.shutdown.is_some() {
            return;
        }
        match &self.phase {
            Phase::Settling { until } => {
                if now >= *until {
                    self.end_settling(now);
                }
            }
            Phase::Running(running) => {
                let mut lost = Vec::new();
                let mut causes = Vec::new();
                let progress_ms = u64::try_from(self.config.timeouts.progress_timeout.as_millis())
                    .unwrap_or(u64::MAX);
                for id in &running.members {
                    let Some(conn) = self.by_member.get(id).and_then(|c| self.conns.get(c)) else {
                        continue;
                    };
                    let silent = now.saturating_duration_since(conn.last_seen);
                    if silent > self.config.timeouts.heartbeat_timeout {
                        lost.push(id.clone());
                        causes.push(format!(
                            "lost member {id}: no heartbeat for {} ms",
                            silent.as_millis()
                        ));
                    } else if let Some(p) = &conn.progress
                        && !p.in_collective
                        && p.idle_ms > progress_ms
                    {
                        lost.push(id.clone());
                        causes.push(format!(
                            "lost member {id}: hung (training thread idle {} ms outside a collective)",
                            p.idle_ms
                        ));
                    }
                }
                if !lost.is_empty() {
                    self.restart(causes.join("; "), &lost, true, now);
                }
            }
            Phase::Gathering { .. } | Phase::Rejoin { .. } => self.try_form(now),
        }
        match self.phase {
            Phase::Running(_) | Phase::Settling { .. } => self.below_min_since = None,
            // A finished job is over already: nobody is awaited, and it is not
            // shut down for lack of members once they have left.
            _ if !self.members_seen || self.finished.is_some() => {}
            _ => {
                let waiting = self.waiting();
                if waiting >= self.config.min_ranks {
                    self.below_min_since = None;
                } else {
                    let since = *self.below_min_since.get_or_insert(now);
                    if now.saturating_duration_since(since)
                        >= self.config.timeouts.rendezvous_timeout
                    {
                        let reason = format!(
                            "only {waiting} of at least {} members for {} s",
                            self.config.min_ranks,
                            self.config.timeouts.rendezvous_timeout.as_secs_f64()
                        );
                        self.shut_down(reason);
                    }
                }
            }
        }
    }

    fn shut_down(&mut self, reason: String) {
        warn!("job shut down: {reason}");
        self.event(Event::Shutdown {
            reason: reason.clone(),
            at: SystemTime::now(),
        });
        self.shutdown = Some(reason.clone());
        self.kv.clear();
        self.phase = Phase::Gathering { min_since: None };
        let all: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, conn)| conn.member.is_some())
            .map(|(&c, _)| c)
            .collect();
        for c in all {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.wants = None;
                conn.generation = None;
            }
            self.directive(
                c,
                Directive::Shutdown {
                    reason: reason.clone(),
                },
            );
        }
    }

    /// The connection is gone (closed, broken, replaced).
    fn remove(&mut self, c: ConnId, reason: &str, now: Instant) {
        let Some(conn) = self.conns.remove(&c) else {
            return;
        };
        // Dropping the outbox lets the writer send what is queued (a final error),
        // then close the socket.
        let Some(member) = conn.member else {
            return;
        };
        if self.by_member.get(&member.id) != Some(&c) {
            return;
        }
        self.by_member.remove(&member.id);
        let id = member.id;
        match &self.phase {
            Phase::Running(running) if running.members.contains(&id) => {
                let cause = format!("lost member {id}: {reason}");
                self.restart(cause, std::slice::from_ref(&id), false, now);
            }
            Phase::Settling { .. } | Phase::Running(_) => {}
            Phase::Gathering { .. } | Phase::Rejoin { .. } => self.try_form(now),
        }
    }
}

/// True when `claim` is internally consistent and names `member` at its rank.
fn claim_is_coherent(claim: &Assignment, member: &Member) -> bool {
    claim.generation > 0
        && claim.world_size == claim.members.len()
        && claim.members.get(claim.rank).map(|m| &m.id) == Some(&member.id)
        && claim.members.iter().all(|m| m.job == member.job)
}

#[cfg(test)]
mod tests {
    //! The rules of [`Core`] with an explicit clock and no sockets.

    use super::*;

    struct Harness {
        core: Core,
        t0: Instant,
        inboxes: HashMap<ConnId, Receiver<Arc<str>>>,
    }

    fn member(i: usize) -> Member {
        Member {
            job: "job".into(),
            id: format!("m{i}"),
            host: "h".into(),
            node: format!("n{}", 9 - i),
        }
    }

    impl Harness {
        fn new(min: usize, max: usize) -> Harness {
            let mut config = CoordinatorConfig::new("job", min, max);
            config.timeouts.heartbeat_timeout = Duration::from_secs(1);
            config.settle = config.timeouts.heartbeat_timeout;
            let t0 = Instant::now();
            Harness {
                core: Core::new(config, t0),
                t0,
                inboxes: HashMap::new(),
            }
        }

        fn at(&self, ms: u64) -> Instant {
            self.t0 + Duration::from_millis(ms)
        }

        fn hello(&mut self, i: usize, seen: u64, claim: Option<Assignment>, ms: u64) -> ConnId {
            let (tx, rx) = sync_channel(OUTBOX);
            let c = self
                .core
                .register(None, tx, "127.0.0.1:1".parse().unwrap())
                .unwrap();
            self.inboxes.insert(c, rx);
            let hello = ClientMessage::Hello {
                version: protocol::VERSION,
                member: member(i),
                seen,
                checkpoint_generation: 0,
                claim,
            };
            assert_eq!(self.core.handle(c, hello, self.at(ms)), Outcome::Welcomed);
            c
        }

        fn send(&mut self, c: ConnId, message: ClientMessage, ms: u64) {
            let now = self.at(ms);
            assert_eq!(self.core.handle(c, message, now), Outcome::Continue);
        }

        /// Messages sent to `c` since the last call, Welcome left out.
        fn received(&self, c: ConnId) -> Vec<ServerMessage> {
            self.inboxes[&c]
                .try_iter()
                .map(|line| protocol::decode(line.trim_end().as_bytes()).unwrap())
                .filter(|m| !matches!(m, ServerMessage::Welcome { .. }))
                .collect()
        }

        /// Members 0 and 1 join at 0 ms and run a generation from 1000 ms (the
        /// settle window): their connections and its number.
        fn two_running(&mut self) -> (ConnId, ConnId, u64) {
            let a = self.hello(0, 0, None, 0);
            let b = self.hello(1, 0, None, 0);
            self.send(a, ClientMessage::Rendezvous { after: 0 }, 0);
            self.send(b, ClientMessage::Rendezvous { after: 0 }, 0);
            self.core.tick(self.at(1000));
            let generation = self.assigned(a).unwrap().generation;
            (a, b, generation)
        }

        fn assigned(&self, c: ConnId) -> Option<Assignment> {
            self.received(c).into_iter().find_map(|m| match m {
                ServerMessage::Assigned { assignment } => Some(assignment),
                _ => None,
            })
        }
    }

    fn claim(generation: u64, ids: &[usize], rank: usize) -> Assignment {
        let members: Vec<Member> = ids.iter().map(|&i| member(i)).collect();
        Assignment {
            generation,
            rank,
            world_size: members.len(),
            members,
            checkpoint_generation_floor: 3,
            cause: "initial".into(),
        }
    }

    fn restart(generation: u64) -> impl Fn(&ServerMessage) -> bool {
        move |m| matches!(m, ServerMessage::Directive { directive: Directive::Restart { generation: g, .. } } if *g == generation)
    }

    #[test]
    fn a_finished_job_sends_waiting_members_away_and_leaves_running_ones_alone() {
        // Found by the chaos harness: a member that rejoined as a newcomer just before
        // the others finished waited out the whole rendezvous timeout.
        let mut h = Harness::new(2, 2);
        let (a, b, generation) = h.two_running();
        let late = h.hello(2, 0, None, 1100);
        h.send(late, ClientMessage::Rendezvous { after: 0 }, 1100);
        assert!(
            h.received(late).is_empty(),
            "waits while the generation runs"
        );
        let finished = ClientMessage::Report {
            generation,
            report: Report::Finished { step: 60 },
        };
        h.send(a, finished, 1200);
        let shutdown = |m: &ServerMessage| matches!(m, ServerMessage::Directive { directive: Directive::Shutdown { reason } } if reason.contains("finished"));
        assert!(
            h.received(late).iter().any(shutdown),
            "{:?}",
            h.received(late)
        );
        assert!(
            !h.received(b).iter().any(shutdown),
            "running members are not interrupted"
        );
        // A member asking later is sent away too.
        let later = h.hello(3, 0, None, 1300);
        h.send(later, ClientMessage::Rendezvous { after: 0 }, 1300);
        assert!(h.received(later).iter().any(shutdown));
    }

    #[test]
    fn a_finished_job_whose_members_left_is_not_shut_down_for_lack_of_members() {
        // Found from outside: a job that trained to its end logged "job shut down:
        // only 0 of at least 2 members for 120 s" once its members had left.
        let mut h = Harness::new(2, 2);
        let (a, b, generation) = h.two_running();
        for (c, ms) in [(a, 2000), (b, 2001)] {
            let report = Report::Finished { step: 60 };
            h.send(c, ClientMessage::Report { generation, report }, ms);
            let report = Report::Leaving {
                reason: "finished".into(),
            };
            h.send(c, ClientMessage::Report { generation, report }, ms);
            h.core.remove(c, "connection closed", h.at(ms));
        }
        let long_after = 2001 + h.core.config.timeouts.rendezvous_timeout.as_millis() as u64 * 2;
        h.core.tick(h.at(3000));
        h.core.tick(h.at(long_after));
        assert!(h.core.shutdown.is_none(), "{:?}", h.core.shutdown);
        assert!(
            !h.core
                .events
                .iter()
                .any(|e| matches!(e, Event::Shutdown { .. })),
            "{:?}",
            h.core.events
        );
        assert!(h.core.finished.is_some());
    }

    #[test]
    fn a_generation_formed_by_a_restarted_coordinator_for_members_of_an_older_one_says_so() {
        // The members lost generation 3 while the coordinator was down (found by the
        // chaos harness: the new generation's cause read "initial").
        let mut h = Harness::new(2, 4);
        let a = h.hello(0, 3, None, 0);
        let b = h.hello(1, 3, None, 0);
        h.send(a, ClientMessage::Rendezvous { after: 3 }, 0);
        h.send(b, ClientMessage::Rendezvous { after: 3 }, 0);
        h.core.tick(h.at(1000));
        h.core.tick(h.at(1300));
        let assigned = h.assigned(a).unwrap();
        assert_eq!(assigned.generation, 4);
        assert!(
            assigned.cause.contains("generation 3") && assigned.cause.contains("restarted"),
            "{}",
            assigned.cause
        );
    }

    #[test]
    fn a_generation_forms_when_the_last_call_after_min_ranks_ends() {
        let mut h = Harness::new(2, 4);
        let a = h.hello(0, 0, None, 0);
        let b = h.hello(1, 0, None, 0);
        h.send(a, ClientMessage::Rendezvous { after: 0 }, 0);
        h.send(b, ClientMessage::Rendezvous { after: 0 }, 0);
        // Settling until 1 s, then the last call (300 ms) runs from there.
        h.core.tick(h.at(999));
        h.core.tick(h.at(1000));
        h.core.tick(h.at(1299));
        assert!(h.received(a).is_empty());
        h.core.tick(h.at(1300));
        let (ra, rb) = (h.assigned(a).unwrap(), h.assigned(b).unwrap());
        assert_eq!((ra.generation, rb.generation), (1, 1));
        // Nodes are n9 (m0) and n8 (m1): m1 gets rank 0.
        assert_eq!((ra.rank, rb.rank), (1, 0));
        assert_eq!(ra.members, vec![member(1), member(0)]);
    }

    #[test]
    fn a_complete_consistent_claim_is_adopted_and_numbers_continue_above_it() {
        let mut h = Harness::new(1, 4);
        let a = h.hello(0, 7, Some(claim(7, &[0, 1], 0)), 10);
        assert!(matches!(h.core.phase, Phase::Settling { .. }));
        let b = h.hello(1, 7, Some(claim(7, &[0, 1], 1)), 20);
        assert!(matches!(&h.core.phase, Phase::Running(r) if r.generation == 7));
        assert!(matches!(
            &h.core.events[..],
            [Event::Formed {
                generation: 7,
                adopted: true,
                ..
            }]
        ));
        assert!(h.received(a).is_empty(), "adopted members are told nothing");
        // A member of an older generation is stale.
        let c = h.hello(2, 5, Some(claim(5, &[2], 0)), 30);
        assert_eq!(
            h.received(c),
            vec![ServerMessage::Directive {
                directive: Directive::Stale { current: 7 }
            }]
        );
        h.core.remove(b, "connection closed", h.at(40));
        assert!(h.received(a).iter().any(restart(7)));
        h.send(a, ClientMessage::Rendezvous { after: 7 }, 50);
        let next = h.assigned(a).unwrap();
        assert_eq!(next.generation, 8);
        assert_eq!(
            next.checkpoint_generation_floor, 3,
            "the claimed floor survives"
        );
    }

    #[test]
    fn an_incomplete_claim_is_restarted_above_every_number_announced() {
        let mut h = Harness::new(2, 4);
        let a = h.hello(0, 7, Some(claim(7, &[0, 1], 0)), 0);
        let b = h.hello(2, 9, None, 0);
        h.send(b, ClientMessage::Rendezvous { after: 0 }, 10);
        h.core.tick(h.at(500));
        assert!(h.received(a).is_empty(), "still settling");
        h.core.tick(h.at(1000));
        assert!(h.received(a).iter().any(restart(7)));
        h.send(a, ClientMessage::Rendezvous { after: 7 }, 1100);
        let assignment = h.assigned(a).unwrap();
        assert_eq!(assignment.generation, 10);
        assert_eq!(assignment.world_size, 2);
    }

    #[test]
    fn late_heartbeats_are_ignored_and_stale_is_said_once() {
        let mut h = Harness::new(1, 1);
        let a = h.hello(0, 0, Some(claim(4, &[0], 0)), 0);
        let heartbeat = |generation| ClientMessage::Heartbeat {
            generation,
            progress: Progress::default(),
        };
        // Sent before it read its newer assignment.
        h.send(a, heartbeat(3), 10);
        assert!(h.received(a).is_empty());
        // Silent for longer than the heartbeat timeout: dropped, told Stale once.
        h.core.tick(h.at(1200));
        let stale = ServerMessage::Directive {
            directive: Directive::Stale { current: 4 },
        };
        assert_eq!(h.received(a), vec![stale]);
        h.send(a, heartbeat(4), 1300);
        h.send(a, heartbeat(4), 1400);
        assert!(h.received(a).is_empty());
        h.send(a, heartbeat(u64::MAX), 1450);
        assert!(
            matches!(&h.received(a)[..], [ServerMessage::Error { message, .. }] if message.contains("out of range"))
        );
        h.send(a, heartbeat(40), 1500);
        assert!(matches!(
            &h.received(a)[..],
            [ServerMessage::Error { fatal: false, .. }]
        ));
    }

    #[test]
    fn a_hung_member_is_blamed_but_one_in_a_collective_is_not() {
        let mut h = Harness::new(2, 2);
        h.core.config.timeouts.progress_timeout = Duration::from_millis(500);
        let a = h.hello(0, 0, Some(claim(2, &[0, 1], 0)), 0);
        let b = h.hello(1, 0, Some(claim(2, &[0, 1], 1)), 0);
        let progress = |in_collective, idle_ms| Progress {
            step: 1,
            in_collective,
            idle_ms,
            checkpoint_generation: 0,
        };
        let heartbeat = |p| ClientMessage::Heartbeat {
            generation: 2,
            progress: p,
        };
        h.send(a, heartbeat(progress(true, 5000)), 100);
        h.send(b, heartbeat(progress(false, 100)), 100);
        h.core.tick(h.at(150));
        assert!(matches!(h.core.phase, Phase::Running(_)));
        h.send(b, heartbeat(progress(false, 600)), 200);
        h.core.tick(h.at(210));
        assert!(h.received(a).iter().any(restart(2)));
        assert!(matches!(
            &h.received(b)[..],
            [ServerMessage::Directive {
                directive: Directive::Stale { current: 2 }
            }]
        ));
    }

    #[test]
    fn messages_before_hello_and_wrong_jobs_close_the_connection() {
        let mut h = Harness::new(1, 1);
        let (tx, _rx) = sync_channel(OUTBOX);
        let c = h
            .core
            .register(None, tx, "127.0.0.1:1".parse().unwrap())
            .unwrap();
        let early = h
            .core
            .handle(c, ClientMessage::Rendezvous { after: 0 }, h.t0);
        assert!(matches!(early, Outcome::Close(reason) if reason.contains("hello")));
        let mut stranger = member(0);
        stranger.job = "other".into();
        let hello = ClientMessage::Hello {
            version: protocol::VERSION,
            member: stranger,
            seen: 0,
            checkpoint_generation: 0,
            claim: None,
        };
        let refused = h.core.handle(c, hello, h.t0);
        assert!(matches!(refused, Outcome::Close(reason) if reason.contains("job mismatch")));
    }
}
