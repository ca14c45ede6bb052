//! [`TcpControlPlane`]: the [`ControlPlane`] backend that talks to a [`Coordinator`]
//! over one TCP connection.
//!
//! A background reader thread owns the connection's read side and folds every
//! message into shared state (the newest assignment, queued directives, the
//! generation's keys); the blocking calls wait on that state with a condition
//! variable, so any number of threads can wait at once and none of them reads the
//! socket. When the connection breaks, the reader reconnects to the same address
//! with backoff and says hello again, claiming the generation this member is
//! running, so a restarted coordinator can adopt it; a pending rendezvous is sent
//! again. Writes are short and bounded by a write timeout.
//!
//! [`Coordinator`]: super::Coordinator

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::cancel::{Waker, wait_on};
use super::protocol::{self, ClientMessage, LineReader, ServerMessage};
use super::{
    Assignment, Cancel, ControlPlane, Directive, ElasticError, Member, Progress, Report,
    check_snapshot_record,
};

/// Directives kept until watched; older ones are dropped first.
const MAX_DIRECTIVES: usize = 64;
/// Keys kept per generation.
const MAX_KEYS: usize = 4096;
/// First pause between reconnection attempts.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

/// How a [`TcpControlPlane`] connects and how long it tolerates an absent
/// coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSettings {
    /// How long [`TcpControlPlane::connect`] keeps trying to reach the coordinator
    /// and get its welcome (30 s).
    pub connect_timeout: Duration,
    /// Longest pause between reconnection attempts (1 s).
    pub reconnect_backoff_max: Duration,
    /// Once the coordinator has been unreachable this long, `rendezvous` and `watch`
    /// fail with [`ElasticError::Io`] (60 s). Reconnecting goes on regardless. A
    /// member that never joined a generation has no training to protect: for it the
    /// bound is `connect_timeout` when that is shorter (a coordinator that went away
    /// before it joined is one it could not connect to).
    pub unreachable_timeout: Duration,
    /// Bound on one write to the coordinator (5 s), and on the wait for its answer
    /// to a request that has one (a snapshot commit or read).
    pub write_timeout: Duration,
    /// The job's secret, proved on every connection before the hello (`None`: the
    /// coordinator admits anyone, and no proof is offered).
    pub secret: Option<ckpt_auth::JobSecret>,
}

impl Default for TcpSettings {
    fn default() -> Self {
        TcpSettings {
            connect_timeout: Duration::from_secs(30),
            reconnect_backoff_max: Duration::from_secs(1),
            unreachable_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(5),
            secret: None,
        }
    }
}

/// A member's connection to a coordinator. Dropping it closes the connection (the
/// coordinator sees a crash unless the member reported `Leaving` first).
pub struct TcpControlPlane {
    inner: Arc<Inner>,
    reader: Option<JoinHandle<()>>,
}

struct Inner {
    addr: SocketAddr,
    /// Who this member is; only its ranks change ([`ControlPlane::hold`]).
    member: Mutex<Member>,
    settings: TcpSettings,
    /// The write side of the current connection, `None` while disconnected.
    writer: Mutex<Option<TcpStream>>,
    state: Mutex<State>,
    changed: Condvar,
    closing: AtomicBool,
}

#[derive(Default)]
struct State {
    welcomed: bool,
    disconnected_since: Option<Instant>,
    /// Newest assignment received.
    assignment: Option<Assignment>,
    /// Newest generation number heard of.
    seen: u64,
    /// Newest generation known to be over.
    over: u64,
    directives: VecDeque<Directive>,
    kv_generation: u64,
    kv: HashMap<String, String>,
    /// The `after` of a rendezvous not yet answered (sent again on reconnect).
    pending_rendezvous: Option<u64>,
    checkpoint_generation: u64,
    /// A fatal refusal: the coordinator will never accept this member.
    rejected: Option<String>,
    shutdown: Option<String>,
    /// The token of the newest [`ClientMessage::Sync`] sent, and of the newest
    /// answered.
    sync_sent: u64,
    synced: u64,
    /// Connections lost so far: a sync sent on a connection that broke is never
    /// answered.
    disconnects: u64,
    /// The token of the newest snapshot request sent, the tokens of those still
    /// waited for, and the answers to them not yet taken.
    snapshot_asked: u64,
    snapshot_awaited: HashSet<u64>,
    snapshot_answers: HashMap<u64, Result<Option<String>, ElasticError>>,
}

impl State {
    fn apply(&mut self, message: ServerMessage, addr: SocketAddr) {
        match message {
            ServerMessage::Welcome { generation, .. } => {
                self.welcomed = true;
                self.seen = self.seen.max(generation);
            }
            ServerMessage::Assigned { assignment } => {
                let newer = self
                    .assignment
                    .as_ref()
                    .is_none_or(|a| assignment.generation > a.generation);
                if newer {
                    self.seen = self.seen.max(assignment.generation);
                    if self
                        .pending_rendezvous
                        .is_some_and(|after| assignment.generation > after)
                    {
                        self.pending_rendezvous = None;
                    }
                    self.kv_generation = assignment.generation;
                    self.kv.clear();
                    self.assignment = Some(assignment);
                }
            }
            ServerMessage::Directive { directive } => {
                match &directive {
                    Directive::Restart { generation, .. } => {
                        self.over = self.over.max(*generation);
                    }
                    Directive::Regroup { .. } => {}
                    Directive::Stale { current } => {
                        self.seen = self.seen.max(*current);
                        if let Some(a) = &self.assignment
                            && a.generation <= *current
                        {
                            self.over = self.over.max(a.generation);
                        }
                    }
                    Directive::Shutdown { reason } => self.shutdown = Some(reason.clone()),
                }
                if self.directives.len() >= MAX_DIRECTIVES {
                    self.directives.pop_front();
                }
                self.directives.push_back(directive);
            }
            ServerMessage::Kv {
                generation,
                key,
                value,
            } => {
                if generation == self.kv_generation
                    && (self.kv.len() < MAX_KEYS || self.kv.contains_key(&key))
                {
                    self.kv.insert(key, value);
                }
            }
            ServerMessage::Synced { token } => self.synced = self.synced.max(token),
            ServerMessage::SnapshotAnswer {
                token,
                record,
                refused,
                transient,
            } => {
                // An answer nobody waits for (its caller timed out) is dropped.
                if self.snapshot_awaited.contains(&token) {
                    let answer = match refused {
                        None => Ok(record),
                        Some(why) if transient => Err(ElasticError::Io(why)),
                        Some(why) => Err(ElasticError::Rejected(why)),
                    };
                    self.snapshot_answers.insert(token, answer);
                }
            }
            ServerMessage::Error { message, fatal } => {
                warn!(coordinator = %addr, fatal, "coordinator refused a message: {message}");
                if fatal {
                    self.rejected = Some(message);
                }
            }
        }
    }

    /// The generation to claim on reconnect: the newest assignment, unless over.
    fn claim(&self) -> Option<Assignment> {
        self.assignment
            .as_ref()
            .filter(|a| a.generation > self.over)
            .cloned()
    }

    fn unreachable_for(&self, now: Instant) -> Duration {
        self.disconnected_since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn member(&self) -> Member {
        self.member
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn lock_writer(&self) -> MutexGuard<'_, Option<TcpStream>> {
        self.writer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn notify(&self) {
        let _state = self.lock();
        self.changed.notify_all();
    }

    fn send(&self, message: &ClientMessage) -> Result<(), ElasticError> {
        let line = protocol::encode(message).map_err(|e| ElasticError::Rejected(e.to_string()))?;
        let mut writer = self.lock_writer();
        let Some(stream) = writer.as_mut() else {
            return Err(ElasticError::Io(format!(
                "not connected to the coordinator at {} (reconnecting)",
                self.addr
            )));
        };
        if let Err(e) = stream.write_all(line.as_bytes()) {
            // Let the reader notice and reconnect.
            let _ = stream.shutdown(Shutdown::Both);
            *writer = None;
            return Err(ElasticError::Io(format!(
                "cannot write to the coordinator at {}: {e}",
                self.addr
            )));
        }
        Ok(())
    }

    /// Sends the message `message` builds around a token that `take` draws from the
    /// state, holding the writer's lock throughout, so that tokens go out in order:
    /// the token and the connection it went out on.
    fn send_numbered(
        &self,
        take: impl FnOnce(&mut State) -> u64,
        message: impl FnOnce(u64) -> ClientMessage,
    ) -> Result<(u64, u64), ElasticError> {
        let mut writer = self.lock_writer();
        let Some(stream) = writer.as_mut() else {
            return Err(ElasticError::Io(format!(
                "not connected to the coordinator at {} (reconnecting)",
                self.addr
            )));
        };
        let (token, connection) = {
            let mut state = self.lock();
            (take(&mut state), state.disconnects)
        };
        let line =
            protocol::encode(&message(token)).map_err(|e| ElasticError::Rejected(e.to_string()))?;
        if let Err(e) = stream.write_all(line.as_bytes()) {
            let _ = stream.shutdown(Shutdown::Both);
            *writer = None;
            return Err(ElasticError::Io(format!(
                "cannot write to the coordinator at {}: {e}",
                self.addr
            )));
        }
        Ok((token, connection))
    }

    /// Sends a [`ClientMessage::Sync`] and waits up to `timeout` for its answer: every
    /// message sent before it was handled.
    fn sync(self: &Arc<Self>, timeout: Duration) -> Result<(), ElasticError> {
        let (token, connection) = self.send_numbered(
            |state| {
                state.sync_sent += 1;
                state.sync_sent
            },
            |token| ClientMessage::Sync { token },
        )?;
        let addr = self.addr;
        self.wait(
            None,
            Some(Instant::now() + timeout),
            |state, _| {
                if state.synced >= token {
                    Some(Ok(()))
                } else {
                    Self::answer_lost(state, connection, addr).map(Err)
                }
            },
            || {
                Err(ElasticError::Timeout(format!(
                    "the coordinator at {addr} did not answer a sync within {} ms",
                    timeout.as_millis()
                )))
            },
        )
    }

    /// Why the answer to a request sent on connection `connection` will never come,
    /// if it will not: this member was refused for good, or that connection broke.
    fn answer_lost(state: &State, connection: u64, addr: SocketAddr) -> Option<ElasticError> {
        if let Some(reason) = &state.rejected {
            Some(ElasticError::Rejected(reason.clone()))
        } else {
            (state.disconnects != connection).then(|| {
                ElasticError::Io(format!(
                    "the connection to the coordinator at {addr} broke before it answered"
                ))
            })
        }
    }

    /// Sends the snapshot request `message` builds around a fresh token and waits
    /// for its answer (up to the write timeout): the record read, if any.
    fn ask_snapshot(
        self: &Arc<Self>,
        what: &str,
        message: impl FnOnce(u64) -> ClientMessage,
    ) -> Result<Option<String>, ElasticError> {
        let mut drawn = None;
        let sent = self.send_numbered(
            |state| {
                state.snapshot_asked += 1;
                state.snapshot_awaited.insert(state.snapshot_asked);
                drawn = Some(state.snapshot_asked);
                state.snapshot_asked
            },
            message,
        );
        let (token, connection) = match sent {
            Ok(sent) => sent,
            Err(e) => {
                if let Some(token) = drawn {
                    self.lock().snapshot_awaited.remove(&token);
                }
                return Err(e);
            }
        };
        let addr = self.addr;
        let timeout = self.settings.write_timeout;
        let answer = self.wait(
            None,
            Some(Instant::now() + timeout),
            |state, _| match state.snapshot_answers.remove(&token) {
                Some(answer) => Some(answer),
                None => Self::answer_lost(state, connection, addr).map(Err),
            },
            || {
                Err(ElasticError::Timeout(format!(
                    "the coordinator at {addr} did not answer a {what} within {} ms",
                    timeout.as_millis()
                )))
            },
        );
        let mut state = self.lock();
        state.snapshot_awaited.remove(&token);
        state.snapshot_answers.remove(&token);
        answer
    }

    /// Says hello on a fresh connection (claiming the running generation, repeating
    /// a pending rendezvous) and makes it the one writes go to. Holding the writer
    /// lock throughout orders the hello before any other message.
    /// Proves the job's secret on a new connection, when there is one. A proof
    /// refused (or a coordinator that proves another secret) rejects this member
    /// for good: the same secret would be refused again. A connection that failed
    /// during the handshake is retried like any lost connection.
    fn prove(&self, stream: &TcpStream) -> bool {
        let Some(secret) = &self.settings.secret else {
            return true;
        };
        match ckpt_auth::prove_tcp(stream, secret) {
            Ok(()) => true,
            Err(ckpt_auth::AuthError::Io(e)) => {
                warn!(coordinator = %self.addr, "{}", ckpt_auth::AuthError::Io(e));
                false
            }
            Err(e) => {
                let mut state = self.lock();
                state.rejected = Some(format!("the control plane at {}: {e}", self.addr));
                self.changed.notify_all();
                false
            }
        }
    }

    fn install(&self, stream: &TcpStream) -> bool {
        let mut writer = self.lock_writer();
        let (hello, rendezvous) = {
            let state = self.lock();
            let hello = ClientMessage::Hello {
                version: protocol::VERSION,
                member: self.member(),
                seen: state.seen,
                checkpoint_generation: state.checkpoint_generation,
                claim: state.claim(),
            };
            let rendezvous = state
                .pending_rendezvous
                .map(|after| ClientMessage::Rendezvous { after });
            (hello, rendezvous)
        };
        let mut lines = String::new();
        for message in std::iter::once(hello).chain(rendezvous) {
            match protocol::encode(&message) {
                Ok(line) => lines.push_str(&line),
                Err(e) => {
                    warn!(error = %e, "cannot encode hello");
                    return false;
                }
            }
        }
        let _ = stream.set_nodelay(true);
        let _ = stream.set_write_timeout(Some(self.settings.write_timeout));
        let Ok(mut write_side) = stream.try_clone() else {
            return false;
        };
        if write_side.write_all(lines.as_bytes()).is_err() {
            return false;
        }
        *writer = Some(write_side);
        drop(writer);
        let mut state = self.lock();
        state.disconnected_since = None;
        self.changed.notify_all();
        true
    }

    fn disconnected(&self) {
        if let Some(stream) = self.lock_writer().take() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        let mut state = self.lock();
        state.welcomed = false;
        state.disconnects += 1;
        state.disconnected_since.get_or_insert_with(Instant::now);
        self.changed.notify_all();
    }

    /// Waits `pause` unless the plane is closing; false when closing.
    fn pause(&self, pause: Duration) -> bool {
        let state = self.lock();
        if self.closing.load(Ordering::SeqCst) {
            return false;
        }
        let _ = self.changed.wait_timeout(state, pause);
        !self.closing.load(Ordering::SeqCst)
    }

    /// The reader thread: reads the connection, reconnects when it breaks.
    fn run(self: Arc<Self>, first: TcpStream) {
        let mut next = Some(first);
        let mut backoff = FIRST_BACKOFF;
        while !self.closing.load(Ordering::SeqCst) {
            let stream = match next.take() {
                Some(stream) => stream,
                None => match TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)) {
                    Ok(stream) => stream,
                    Err(e) => {
                        debug!(coordinator = %self.addr, error = %e, "reconnect failed");
                        if !self.pause(backoff) {
                            return;
                        }
                        backoff = (backoff * 2).min(self.settings.reconnect_backoff_max);
                        continue;
                    }
                },
            };
            backoff = FIRST_BACKOFF;
            if !self.prove(&stream) {
                if self.lock().rejected.is_some() {
                    return;
                }
                if !self.pause(backoff) {
                    return;
                }
                continue;
            }
            if self.install(&stream) {
                self.read(stream);
            }
            self.disconnected();
            if self.lock().rejected.is_some() {
                return;
            }
            if !self.closing.load(Ordering::SeqCst) {
                warn!(coordinator = %self.addr, "connection to the coordinator lost; reconnecting");
            }
        }
    }

    fn read(&self, stream: TcpStream) {
        let mut reader = LineReader::new(stream);
        loop {
            let line = match reader.next_line() {
                Ok(Some(line)) => line,
                Ok(None) => return,
                Err(e) => {
                    if !self.closing.load(Ordering::SeqCst) {
                        warn!(coordinator = %self.addr, error = %e, "reading from the coordinator failed");
                    }
                    return;
                }
            };
            match protocol::decode::<ServerMessage>(line) {
                Ok(message) => {
                    let fatal = matches!(message, ServerMessage::Error { fatal: true, .. });
                    let mut state = self.lock();
                    state.apply(message, self.addr);
                    self.changed.notify_all();
                    drop(state);
                    if fatal {
                        return;
                    }
                }
                Err(e) => {
                    warn!(coordinator = %self.addr, error = %e, "unreadable message from the coordinator; ignored");
                }
            }
        }
    }

    /// Waits on the state until `done` returns a result, `cancel` fires, or
    /// `deadline` passes (then `on_timeout`); wakes now and then to notice the
    /// unreachable timeout.
    fn wait<T>(
        self: &Arc<Self>,
        cancel: Option<&Cancel>,
        deadline: Option<Instant>,
        done: impl FnMut(&mut State, Instant) -> Option<Result<T, ElasticError>>,
        on_timeout: impl FnOnce() -> Result<T, ElasticError>,
    ) -> Result<T, ElasticError> {
        let cancel = cancel.map(|cancel| {
            let inner = self.clone();
            (cancel, Box::new(move || inner.notify()) as Waker)
        });
        wait_on(
            &self.state,
            &self.changed,
            cancel,
            deadline,
            Duration::from_millis(500),
            done,
            on_timeout,
        )
    }

    fn unreachable(&self, state: &State, now: Instant) -> Option<ElasticError> {
        let down = state.unreachable_for(now);
        let bound = if state.assignment.is_none() {
            self.settings
                .unreachable_timeout
                .min(self.settings.connect_timeout)
        } else {
            self.settings.unreachable_timeout
        };
        (down >= bound).then(|| {
            ElasticError::Io(format!(
                "the coordinator at {} has been unreachable for {} s",
                self.addr,
                down.as_secs()
            ))
        })
    }
}

impl TcpControlPlane {
    /// Connects to the coordinator at `addr` as `member` and waits for its welcome,
    /// retrying for `settings.connect_timeout`. A coordinator of another job (or
    /// another protocol version) is an [`ElasticError::Rejected`].
    pub fn connect(
        addr: SocketAddr,
        member: Member,
        settings: TcpSettings,
    ) -> Result<TcpControlPlane, ElasticError> {
        let deadline = Instant::now() + settings.connect_timeout;
        let mut backoff = FIRST_BACKOFF;
        let stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = left.clamp(Duration::from_millis(1), Duration::from_secs(5));
            match TcpStream::connect_timeout(&addr, attempt) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() + backoff >= deadline => {
                    // Said with how long it tried: a coordinator that is gone for
                    // good and one that was slow to start read differently.
                    return Err(ElasticError::Io(format!(
                        "cannot reach the coordinator at {addr}, tried for {:.1} s: {e}",
                        settings.connect_timeout.as_secs_f64()
                    )));
                }
                Err(_) => {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(settings.reconnect_backoff_max);
                }
            }
        };
        let inner = Arc::new(Inner {
            addr,
            member: Mutex::new(member),
            settings,
            writer: Mutex::new(None),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            closing: AtomicBool::new(false),
        });
        let reader = {
            let inner = inner.clone();
            std::thread::Builder::new()
                .name("ckpt-elastic-tcp".into())
                .spawn(move || inner.run(stream))
                .map_err(|e| ElasticError::Io(format!("cannot start the reader thread: {e}")))?
        };
        let plane = TcpControlPlane {
            inner,
            reader: Some(reader),
        };
        plane.inner.wait(
            None,
            Some(deadline),
            |state, _| {
                if let Some(reason) = &state.rejected {
                    Some(Err(ElasticError::Rejected(reason.clone())))
                } else if state.welcomed {
                    Some(Ok(()))
                } else {
                    None
                }
            },
            || {
                Err(ElasticError::Timeout(format!(
                    "no welcome from the coordinator at {addr}"
                )))
            },
        )?;
        Ok(plane)
    }

    /// The coordinator's address.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// This member.
    pub fn member(&self) -> Member {
        self.inner.member()
    }

    /// True while connected to the coordinator.
    pub fn is_connected(&self) -> bool {
        self.inner.lock().disconnected_since.is_none()
    }
}

impl Drop for TcpControlPlane {
    fn drop(&mut self) {
        self.inner.closing.store(true, Ordering::SeqCst);
        self.inner.disconnected();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

impl ControlPlane for TcpControlPlane {
    fn rendezvous(&self, after: u64, cancel: &Cancel) -> Result<Assignment, ElasticError> {
        {
            let mut state = self.inner.lock();
            if let Some(a) = state.assignment.as_ref().filter(|a| a.generation > after) {
                return Ok(a.clone());
            }
            state.pending_rendezvous = Some(after);
        }
        // While disconnected, the reconnect sends it.
        let _ = self.inner.send(&ClientMessage::Rendezvous { after });
        self.inner.wait(
            Some(cancel),
            None,
            |state, now| {
                if let Some(a) = state.assignment.as_ref().filter(|a| a.generation > after) {
                    Some(Ok(a.clone()))
                } else if let Some(reason) = &state.shutdown {
                    Some(Err(ElasticError::Shutdown(reason.clone())))
                } else if let Some(reason) = &state.rejected {
                    Some(Err(ElasticError::Rejected(reason.clone())))
                } else {
                    self.inner.unreachable(state, now).map(Err)
                }
            },
            || Err(ElasticError::Timeout("rendezvous".into())),
        )
    }

    fn heartbeat(&self, generation: u64, progress: &Progress) -> Result<(), ElasticError> {
        {
            let mut state = self.inner.lock();
            state.checkpoint_generation = state
                .checkpoint_generation
                .max(progress.checkpoint_generation);
        }
        self.inner.send(&ClientMessage::Heartbeat {
            generation,
            progress: progress.clone(),
        })
    }

    fn unreachable_for(&self) -> Option<Duration> {
        let down = self.inner.lock().unreachable_for(Instant::now());
        (!down.is_zero()).then_some(down)
    }

    fn watch(&self, generation: u64, timeout: Duration) -> Result<Option<Directive>, ElasticError> {
        self.inner.wait(
            None,
            Some(Instant::now() + timeout),
            |state, now| {
                while let Some(directive) = state.directives.pop_front() {
                    let relevant = match &directive {
                        Directive::Restart { generation: g, .. }
                        | Directive::Regroup { generation: g, .. } => *g >= generation,
                        Directive::Stale { current } => *current >= generation,
                        Directive::Shutdown { .. } => true,
                    };
                    if relevant {
                        return Some(Ok(Some(directive)));
                    }
                }
                if let Some(reason) = &state.rejected {
                    return Some(Err(ElasticError::Rejected(reason.clone())));
                }
                self.inner.unreachable(state, now).map(Err)
            },
            || Ok(None),
        )
    }

    fn report(&self, generation: u64, report: &Report) -> Result<(), ElasticError> {
        self.inner.send(&ClientMessage::Report {
            generation,
            report: report.clone(),
        })
    }

    fn report_handled(
        &self,
        generation: u64,
        report: &Report,
        timeout: Duration,
    ) -> Result<(), ElasticError> {
        self.report(generation, report)?;
        self.inner.sync(timeout)
    }

    fn kv_set(&self, generation: u64, key: &str, value: &str) -> Result<(), ElasticError> {
        self.inner.send(&ClientMessage::KvSet {
            generation,
            key: key.to_owned(),
            value: value.to_owned(),
        })
    }

    fn commit_snapshot(&self, generation: u64, record: &str) -> Result<(), ElasticError> {
        check_snapshot_record(record)?;
        self.inner
            .ask_snapshot("snapshot commit", |token| ClientMessage::CommitSnapshot {
                token,
                generation,
                record: record.to_owned(),
            })
            .map(|_| ())
    }

    fn committed_snapshot(&self) -> Result<Option<String>, ElasticError> {
        self.inner
            .ask_snapshot("snapshot read", |token| ClientMessage::ReadSnapshot {
                token,
            })
    }

    fn hold(&self, ranks: usize) -> Result<(), ElasticError> {
        // The hello after a reconnect says it too.
        self.inner
            .member
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ranks = ranks;
        match self.inner.send(&ClientMessage::Hold { ranks }) {
            Err(ElasticError::Io(_)) => Ok(()),
            other => other,
        }
    }

    fn kv_all(
        &self,
        generation: u64,
        known: usize,
        timeout: Duration,
    ) -> Result<Vec<(String, String)>, ElasticError> {
        self.inner.wait(
            None,
            Some(Instant::now() + timeout),
            |state, _| {
                if state.kv_generation == generation && state.kv.len() > known {
                    let all = state.kv.iter().map(|(k, v)| (k.clone(), v.clone()));
                    return Some(Ok(all.collect()));
                }
                let newer = state
                    .assignment
                    .as_ref()
                    .is_some_and(|a| a.generation > generation);
                (state.over >= generation || newer || state.shutdown.is_some())
                    .then(|| Err(ElasticError::generation_over(generation, "*")))
            },
            || Ok(Vec::new()),
        )
    }

    fn kv_get(
        &self,
        generation: u64,
        key: &str,
        cancel: &Cancel,
        timeout: Duration,
    ) -> Result<String, ElasticError> {
        self.inner.wait(
            Some(cancel),
            Some(Instant::now() + timeout),
            |state, _| {
                if state.kv_generation == generation
                    && let Some(value) = state.kv.get(key)
                {
                    return Some(Ok(value.clone()));
                }
                if let Some(reason) = &state.shutdown {
                    return Some(Err(ElasticError::Shutdown(reason.clone())));
                }
                let newer = state
                    .assignment
                    .as_ref()
                    .is_some_and(|a| a.generation > generation);
                (state.over >= generation || newer)
                    .then(|| Err(ElasticError::generation_over(generation, key)))
            },
            || Err(ElasticError::key_timeout(generation, key, timeout)),
        )
    }
}
