//! Fault tolerance for an asynchronous communicator: a watchdog, poisoning, timeouts
//! and abort from any thread, over any raw communicator.
//!
//! NCCL's non-blocking communicators give the pieces but not the policy: calls
//! return `ncclInProgress` and must be polled with `ncclCommGetAsyncError`; a hung
//! peer makes a collective wait forever; `ncclCommAbort` is the only way out, and it
//! must not run while another thread is inside NCCL on the same communicator.
//! [`Guard`] adds the policy of the [`Collective`](super::Collective) contract, and
//! is generic over [`RawComm`] (the handful of raw calls it makes) so that every
//! rule below is tested on CPU with a fake communicator that hangs, fails or
//! reports errors on demand; the `nccl` module (feature `cuda`) implements `RawComm` with NCCL.
//!
//! # States
//!
//! ```text
//! Initializing ──async status ok──▶ Ready ──first error / timeout / abort()──▶ Failed(e)
//!      └──────────error / init timeout──────────────────────────────────────────▲
//! Failed(e) ──watchdog: ncclCommAbort──▶ aborted (the raw communicator is gone)
//! ```
//!
//! - *Failed* keeps the first error; every later call returns it (*poisoned*), or
//!   [`CollectiveError::Aborted`] once [`Guard::abort`] was called.
//! - One watchdog thread per communicator polls the asynchronous status every
//!   [`GuardConfig::poll`], drives initialisation, retires completed operations and
//!   fails the communicator when the oldest incomplete one is older than
//!   [`GuardConfig::timeout`] ([`CollectiveError::Stalled`]) or initialisation takes
//!   longer than [`GuardConfig::init_timeout`].
//! - Every raw call is made with one mutex held, and calls are non-blocking, so the
//!   mutex is held only briefly. A call that answers `InProgress` keeps the
//!   communicator *busy* until the status says it is through: meanwhile no other call
//!   starts (only status queries and the abort run), as NCCL requires. The watchdog aborts with that mutex held: no other
//!   thread is inside the library while it aborts. [`Guard::abort`] itself only
//!   records the request and wakes the watchdog, so it never blocks and may be
//!   called from any thread, a signal-handling or control-plane thread included.
//! - On a failure the watchdog aborts the raw communicator (unless
//!   [`GuardConfig::abort_on_failure`] is off, for a caller that wants to
//!   [`Guard::shrink`] it first). Aborting is also how the failure reaches the peers:
//!   their operations with this rank stop progressing and fail in turn.
//! - [`Guard::shutdown`] is the orderly end: wait for the enqueued work, finalize,
//!   destroy. Dropping a guard that was not shut down aborts.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{CollectiveError, CollectiveResult};

/// The answer of a non-blocking raw call, or of the asynchronous status query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawStatus {
    /// Complete (`ncclSuccess`).
    Done,
    /// Still running (`ncclInProgress`): poll the asynchronous status.
    InProgress,
    /// Failed; the library's error, named.
    Failed(String),
}

/// The raw operations of one communicator that [`Guard`] needs; implemented with
/// NCCL's non-blocking API by the `nccl` module (feature `cuda`), and by fakes in tests.
pub trait RawComm: Send + 'static {
    /// Where operations are enqueued (a CUDA stream).
    type Stream: ?Sized;
    /// A point in a stream after some operations (a CUDA event).
    type Marker: Send + 'static;

    /// The asynchronous status (`ncclCommGetAsyncError`): `InProgress` while an
    /// initialisation or a non-blocking call is still being carried out.
    fn async_status(&mut self) -> RawStatus;
    /// Marks the point of `stream` after everything enqueued on it so far.
    fn record(&mut self, stream: &Self::Stream) -> Result<Self::Marker, String>;
    /// Whether every operation before `marker` has completed.
    fn reached(&mut self, marker: &Self::Marker) -> Result<bool, String>;
    /// Aborts (`ncclCommAbort`): stops all operations and frees the communicator.
    fn abort(&mut self) -> Result<(), String>;
    /// Starts an orderly end (`ncclCommFinalize`): flushes enqueued operations.
    fn finalize(&mut self) -> RawStatus;
    /// Frees the communicator after a completed finalize (`ncclCommDestroy`).
    fn destroy(&mut self) -> Result<(), String>;
}

/// Timing settings of a [`Guard`].
#[derive(Debug, Clone)]
pub struct GuardConfig {
    /// An enqueued operation fails the communicator when it has not completed this
    /// long after it was enqueued. Default 60 s, as the TCP backend.
    pub timeout: Duration,
    /// Initialisation fails the communicator after this long. Default 120 s.
    pub init_timeout: Duration,
    /// How often the watchdog and waiting threads poll. Default 1 ms.
    pub poll: Duration,
    /// Abort the raw communicator as soon as it fails. Default true. Off, the
    /// failed communicator stays allocated until [`Guard::abort`], a drop, or a
    /// [`Guard::shrink`] that excludes the lost ranks.
    pub abort_on_failure: bool,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            init_timeout: Duration::from_secs(120),
            poll: Duration::from_millis(1),
            abort_on_failure: true,
        }
    }
}

#[derive(Debug, Clone)]
enum Phase {
    Initializing { deadline: Instant },
    Ready,
    Failed(CollectiveError),
}

struct Control {
    phase: Phase,
    /// `abort()` was called: errors read as `Aborted`.
    user_abort: bool,
    /// The watchdog should abort the raw communicator.
    abort_requested: bool,
    /// The raw communicator is gone (aborted, destroyed or handed to a shrink).
    raw_gone: bool,
    /// The guard is being dropped or shut down: the watchdog exits once the raw
    /// communicator is gone.
    closing: bool,
}

struct Pending<M> {
    op: &'static str,
    marker: M,
    deadline: Instant,
}

struct Live<R: RawComm> {
    comm: R,
    pending: VecDeque<Pending<R::Marker>>,
    /// A call answered `InProgress` and its caller is polling the status: no other
    /// call may start, and no work may be enqueued on its stream, until it is
    /// through (NCCL's rule for non-blocking communicators). Only the status query
    /// and the abort may run meanwhile.
    busy: bool,
}

struct Shared<R: RawComm> {
    rank: usize,
    world: usize,
    config: GuardConfig,
    /// Every raw call is made with this held.
    raw: Mutex<Option<Live<R>>>,
    control: Mutex<Control>,
    changed: Condvar,
}

/// A fault-tolerant communicator over a raw one; see the module docs.
pub struct Guard<R: RawComm> {
    shared: Arc<Shared<R>>,
    watchdog: Option<JoinHandle<()>>,
}

impl<R: RawComm> std::fmt::Debug for Guard<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let control = self.shared.lock_control();
        f.debug_struct("Guard")
            .field("rank", &self.shared.rank)
            .field("world", &self.shared.world)
            .field("phase", &control.phase)
            .field("aborted", &control.raw_gone)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<R: RawComm> Shared<R> {
    fn lock_control(&self) -> MutexGuard<'_, Control> {
        lock(&self.control)
    }

    /// The error a call named `op` returns now, if the communicator failed.
    fn error(&self, control: &Control, op: &'static str) -> Option<CollectiveError> {
        if control.user_abort {
            return Some(CollectiveError::Aborted { op });
        }
        match &control.phase {
            Phase::Failed(e) => Some(e.clone()),
            _ => None,
        }
    }

    /// Records `e` unless an earlier error is there, asks for the abort, and returns
    /// the error callers see.
    fn fail(&self, e: CollectiveError) -> CollectiveError {
        let mut control = self.lock_control();
        if !matches!(control.phase, Phase::Failed(_)) {
            tracing::warn!(rank = self.rank, error = %e, "communicator failed");
            control.phase = Phase::Failed(e.clone());
        }
        if self.config.abort_on_failure {
            control.abort_requested = true;
        }
        self.changed.notify_all();
        self.error(&control, e.op()).unwrap_or(e)
    }

    /// Waits up to one poll interval for a change of state.
    fn pause<'a>(&self, control: MutexGuard<'a, Control>) -> MutexGuard<'a, Control> {
        self.changed
            .wait_timeout(control, self.config.poll)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }
}

impl<R: RawComm> Guard<R> {
    /// Takes over `comm`, whose (non-blocking) initialisation has been started, and
    /// starts its watchdog. `rank` and `world` are what it was initialised with.
    pub fn start(comm: R, rank: usize, world: usize, config: GuardConfig) -> Self {
        let deadline = Instant::now() + config.init_timeout;
        let shared = Arc::new(Shared {
            rank,
            world,
            config,
            raw: Mutex::new(Some(Live {
                comm,
                pending: VecDeque::new(),
                busy: false,
            })),
            control: Mutex::new(Control {
                phase: Phase::Initializing { deadline },
                user_abort: false,
                abort_requested: false,
                raw_gone: false,
                closing: false,
            }),
            changed: Condvar::new(),
        });
        let for_watchdog = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name(format!("comm-watchdog-{rank}"))
            .spawn(move || watchdog(&for_watchdog))
            .expect("spawning the communicator watchdog thread");
        Self {
            shared,
            watchdog: Some(watchdog),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.shared.world
    }

    /// The settings.
    pub fn config(&self) -> &GuardConfig {
        &self.shared.config
    }

    /// The first error, if the communicator failed (as a call named `op` would see it).
    pub fn error(&self, op: &'static str) -> Option<CollectiveError> {
        self.shared.error(&self.shared.lock_control(), op)
    }

    /// Blocks until initialisation completed, or returns why it did not (its error,
    /// a [`CollectiveError::Stalled`] after the init timeout, an abort).
    pub fn wait_ready(&self, op: &'static str) -> CollectiveResult {
        let mut control = self.shared.lock_control();
        loop {
            if let Some(e) = self.shared.error(&control, op) {
                return Err(e);
            }
            if matches!(control.phase, Phase::Ready) {
                return Ok(());
            }
            control = self.shared.pause(control);
        }
    }

    /// Enqueues one operation: `call` makes the raw call on the raw communicator;
    /// when it answers `InProgress` the asynchronous status is polled (with the raw
    /// mutex released between polls) until the call is through. Then a marker is
    /// recorded on `stream`, and the watchdog fails the communicator if the marker is
    /// not reached within the timeout.
    pub fn enqueue(
        &self,
        op: &'static str,
        stream: &R::Stream,
        call: impl FnOnce(&mut R) -> RawStatus,
    ) -> CollectiveResult {
        self.wait_ready(op)?;
        let deadline = Instant::now() + self.shared.config.timeout;
        let mut raw = self.lock_idle(op, deadline)?;
        let live = raw.as_mut().expect("lock_idle returns a live communicator");
        let mut status = call(&mut live.comm);
        loop {
            match status {
                RawStatus::Done => break,
                RawStatus::Failed(message) => {
                    if let Some(live) = raw.as_mut() {
                        live.busy = false;
                    }
                    drop(raw);
                    return Err(self.shared.fail(CollectiveError::Device { op, message }));
                }
                RawStatus::InProgress => {}
            }
            if let Some(live) = raw.as_mut() {
                live.busy = true;
            }
            drop(raw);
            let stop = {
                let control = self.shared.lock_control();
                if let Some(e) = self.shared.error(&control, op) {
                    Some(e)
                } else if Instant::now() >= deadline {
                    drop(control);
                    Some(self.shared.fail(CollectiveError::Stalled {
                        op,
                        timeout: self.shared.config.timeout,
                    }))
                } else {
                    drop(self.shared.pause(control));
                    None
                }
            };
            raw = lock(&self.shared.raw);
            if let Some(e) = stop {
                // Not busy any more: a failed communicator may still be shrunk.
                if let Some(live) = raw.as_mut() {
                    live.busy = false;
                }
                return Err(e);
            }
            status = match raw.as_mut() {
                Some(live) => live.comm.async_status(),
                None => return Err(self.gone(op)),
            };
        }
        let live = raw.as_mut().expect("checked above, lock held");
        live.busy = false;
        match live.comm.record(stream) {
            Ok(marker) => {
                live.pending.push_back(Pending {
                    op,
                    marker,
                    deadline,
                });
                Ok(())
            }
            Err(message) => {
                drop(raw);
                Err(self.shared.fail(CollectiveError::Device { op, message }))
            }
        }
    }

    /// Locks the raw communicator once no call is in progress on it (see
    /// `Live::busy`); fails when the communicator failed or is gone, or at
    /// `deadline`.
    fn lock_idle(
        &self,
        op: &'static str,
        deadline: Instant,
    ) -> CollectiveResult<MutexGuard<'_, Option<Live<R>>>> {
        loop {
            let raw = lock(&self.shared.raw);
            match raw.as_ref() {
                None => return Err(self.gone(op)),
                Some(live) if !live.busy => return Ok(raw),
                Some(_) => {}
            }
            drop(raw);
            let control = self.shared.lock_control();
            if let Some(e) = self.shared.error(&control, op) {
                return Err(e);
            }
            if Instant::now() >= deadline {
                drop(control);
                return Err(self.shared.fail(CollectiveError::Stalled {
                    op,
                    timeout: self.shared.config.timeout,
                }));
            }
            drop(self.shared.pause(control));
        }
    }

    /// Blocks until everything enqueued on `stream` so far has completed; fails with
    /// the communicator's first error (a peer's failure, a timeout, an abort) instead.
    pub fn synchronize(&self, op: &'static str, stream: &R::Stream) -> CollectiveResult {
        if let Some(e) = self.error(op) {
            return Err(e);
        }
        let deadline = Instant::now() + self.shared.config.timeout;
        let marker = {
            let mut raw = self.lock_idle(op, deadline)?;
            let live = raw.as_mut().expect("lock_idle returns a live communicator");
            live.comm
                .record(stream)
                .map_err(|message| CollectiveError::Device { op, message })
        };
        let marker = marker.map_err(|e| self.shared.fail(e))?;
        loop {
            let reached = {
                let mut raw = lock(&self.shared.raw);
                match raw.as_mut() {
                    Some(live) => live.comm.reached(&marker),
                    None => return Err(self.gone(op)),
                }
            };
            let control = self.shared.lock_control();
            if let Some(e) = self.shared.error(&control, op) {
                return Err(e);
            }
            match reached {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(message) => {
                    drop(control);
                    return Err(self.shared.fail(CollectiveError::Device { op, message }));
                }
            }
            if Instant::now() >= deadline {
                drop(control);
                return Err(self.shared.fail(CollectiveError::Stalled {
                    op,
                    timeout: self.shared.config.timeout,
                }));
            }
            drop(self.shared.pause(control));
        }
    }

    /// Fails the communicator with [`CollectiveError::Aborted`] and has the watchdog
    /// abort the raw communicator. Never blocks; any thread.
    pub fn abort(&self) {
        let mut control = self.shared.lock_control();
        control.user_abort = true;
        control.abort_requested = true;
        if !matches!(control.phase, Phase::Failed(_)) {
            control.phase = Phase::Failed(CollectiveError::Aborted { op: "abort" });
        }
        self.shared.changed.notify_all();
    }

    /// Blocks until the raw communicator is gone (after [`Guard::abort`] or a
    /// failure: the watchdog has returned from the raw abort), so that buffers its
    /// operations used may be freed and a new communicator built on the same device.
    pub fn wait_aborted(&self) {
        let mut control = self.shared.lock_control();
        while !control.raw_gone {
            control = self.shared.pause(control);
        }
    }

    /// True once the raw communicator is gone.
    pub fn is_aborted(&self) -> bool {
        self.shared.lock_control().raw_gone
    }

    /// Builds a new communicator from this one without the ranks of `exclude`
    /// (`ncclCommShrink`): `shrink` receives the raw communicator and whether it has
    /// failed (NCCL then needs its abort flag) and returns the new raw communicator,
    /// initialising. The new guard's ranks are this one's, renumbered without the
    /// excluded ones. This guard is then aborted (it is not used again).
    ///
    /// Only possible while the raw communicator still exists: before a failure, or
    /// after one with [`GuardConfig::abort_on_failure`] off.
    pub fn shrink(
        &self,
        exclude: &[usize],
        shrink: impl FnOnce(&mut R, bool) -> Result<R, String>,
    ) -> CollectiveResult<Guard<R>> {
        let op = "shrink";
        let world = self.shared.world;
        let rank = self.shared.rank;
        if exclude.contains(&rank) || exclude.iter().any(|&r| r >= world) {
            return Err(CollectiveError::Invalid {
                op,
                message: format!(
                    "cannot exclude {exclude:?} from a world of {world} as rank {rank}"
                ),
            });
        }
        let mut excluded = exclude.to_vec();
        excluded.sort_unstable();
        excluded.dedup();
        let failed = {
            let control = self.shared.lock_control();
            if control.user_abort {
                return Err(CollectiveError::Aborted { op });
            }
            matches!(control.phase, Phase::Failed(_))
        };
        let mut raw = self.lock_idle(op, Instant::now() + self.shared.config.timeout)?;
        let live = raw.as_mut().expect("lock_idle returns a live communicator");
        let new = shrink(&mut live.comm, failed)
            .map_err(|message| CollectiveError::Device { op, message })?;
        drop(raw);
        // This communicator is done: abort it (NCCL allows the parent to be aborted
        // or destroyed once the child exists).
        self.abort();
        let new_rank = rank - excluded.iter().filter(|&&r| r < rank).count();
        Ok(Guard::start(
            new,
            new_rank,
            world - excluded.len(),
            self.shared.config.clone(),
        ))
    }

    /// The orderly end: waits for every enqueued operation, finalizes (flushing), and
    /// destroys the raw communicator. On any failure on the way, aborts instead and
    /// returns the error.
    pub fn shutdown(mut self) -> CollectiveResult {
        let op = "shutdown";
        let result = self.finish(op);
        if result.is_err() {
            self.shared.fail(CollectiveError::Aborted { op });
        }
        self.close();
        result
    }

    fn finish(&self, op: &'static str) -> CollectiveResult {
        self.wait_ready(op)?;
        // Wait for the pending operations (the watchdog retires them).
        let deadline = Instant::now() + self.shared.config.timeout;
        loop {
            let empty = lock(&self.shared.raw)
                .as_ref()
                .is_none_or(|live| live.pending.is_empty());
            let control = self.shared.lock_control();
            if let Some(e) = self.shared.error(&control, op) {
                return Err(e);
            }
            if empty {
                break;
            }
            if Instant::now() >= deadline {
                return Err(CollectiveError::Stalled {
                    op,
                    timeout: self.shared.config.timeout,
                });
            }
            drop(self.shared.pause(control));
        }
        let mut raw = self.lock_idle(op, deadline)?;
        let live = raw.as_mut().expect("lock_idle returns a live communicator");
        let mut status = live.comm.finalize();
        live.busy = status == RawStatus::InProgress;
        while status == RawStatus::InProgress {
            if Instant::now() >= deadline {
                return Err(CollectiveError::Stalled {
                    op,
                    timeout: self.shared.config.timeout,
                });
            }
            drop(raw);
            drop(self.shared.pause(self.shared.lock_control()));
            raw = lock(&self.shared.raw);
            let Some(live) = raw.as_mut() else {
                return Err(self.gone(op));
            };
            status = live.comm.async_status();
        }
        if let RawStatus::Failed(message) = status {
            return Err(CollectiveError::Device { op, message });
        }
        let mut live = raw.take().expect("checked above, lock held");
        drop(raw);
        let destroyed = live.comm.destroy();
        let mut control = self.shared.lock_control();
        control.raw_gone = true;
        self.shared.changed.notify_all();
        drop(control);
        destroyed.map_err(|message| CollectiveError::Device { op, message })
    }

    /// The error of a call made after the raw communicator is gone.
    fn gone(&self, op: &'static str) -> CollectiveError {
        self.error(op).unwrap_or(CollectiveError::Aborted { op })
    }

    /// Stops the watchdog, aborting the raw communicator if it still exists.
    fn close(&mut self) {
        {
            let mut control = self.shared.lock_control();
            control.closing = true;
            if !control.raw_gone {
                control.abort_requested = true;
            }
            self.shared.changed.notify_all();
        }
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
    }
}

impl<R: RawComm> Drop for Guard<R> {
    /// Aborts the raw communicator unless [`Guard::shutdown`] ended it, and waits for
    /// the watchdog to exit.
    fn drop(&mut self) {
        self.close();
    }
}

/// The watchdog: drives initialisation, retires completed operations, enforces the
/// timeouts, and performs every abort.
fn watchdog<R: RawComm>(shared: &Shared<R>) {
    let mut control = shared.lock_control();
    loop {
        if control.abort_requested && !control.raw_gone {
            drop(control);
            // Taking the raw mutex waits for any thread inside a raw call (they are
            // non-blocking, so briefly); no other call can start while it is held.
            let taken = lock(&shared.raw).take();
            if let Some(mut live) = taken {
                live.pending.clear();
                if let Err(e) = live.comm.abort() {
                    tracing::warn!(rank = shared.rank, error = %e, "communicator abort failed");
                }
            }
            control = shared.lock_control();
            control.raw_gone = true;
            shared.changed.notify_all();
            continue;
        }
        if control.raw_gone {
            if control.closing {
                return;
            }
            // Nothing left to watch: sleep until the guard closes.
            control = shared
                .changed
                .wait(control)
                .unwrap_or_else(|p| p.into_inner());
            continue;
        }
        if matches!(control.phase, Phase::Failed(_)) {
            // Failed, abort left to the caller (`abort_on_failure` off): wait for it.
            control = shared
                .changed
                .wait(control)
                .unwrap_or_else(|p| p.into_inner());
            continue;
        }
        let phase = control.phase.clone();
        drop(control);
        if let Some(e) = check(shared, &phase) {
            shared.fail(e);
        }
        control = shared.lock_control();
        if !control.abort_requested {
            control = shared.pause(control);
        }
    }
}

/// One watchdog poll of a healthy communicator; an error fails it.
fn check<R: RawComm>(shared: &Shared<R>, phase: &Phase) -> Option<CollectiveError> {
    let now = Instant::now();
    let mut raw = lock(&shared.raw);
    let live = raw.as_mut()?;
    match live.comm.async_status() {
        RawStatus::Failed(message) => {
            let op = live.pending.front().map_or("async", |p| p.op);
            let op = if matches!(phase, Phase::Initializing { .. }) {
                "init"
            } else {
                op
            };
            return Some(CollectiveError::Device { op, message });
        }
        RawStatus::InProgress => {
            if let Phase::Initializing { deadline } = phase {
                if now >= *deadline {
                    return Some(CollectiveError::Stalled {
                        op: "init",
                        timeout: shared.config.init_timeout,
                    });
                }
                return None;
            }
        }
        RawStatus::Done => {
            if matches!(phase, Phase::Initializing { .. }) {
                drop(raw);
                let mut control = shared.lock_control();
                if matches!(control.phase, Phase::Initializing { .. }) {
                    control.phase = Phase::Ready;
                    shared.changed.notify_all();
                }
                return None;
            }
        }
    }
    while let Some(front) = live.pending.front() {
        match live.comm.reached(&front.marker) {
            Ok(true) => {
                live.pending.pop_front();
            }
            Ok(false) => {
                if now >= front.deadline {
                    return Some(CollectiveError::Stalled {
                        op: front.op,
                        timeout: shared.config.timeout,
                    });
                }
                break;
            }
            Err(message) => {
                return Some(CollectiveError::Device {
                    op: front.op,
                    message,
                });
            }
        }
    }
    None
}

/// A key-value space shared by the ranks of one world (the control plane's, scoped
/// to the generation), through which a communicator's unique id travels.
pub trait KeyValue {
    /// Publishes `value` under `key`.
    fn set(&self, key: &str, value: &str) -> Result<(), String>;
    /// Waits until `key` is published and returns its value.
    fn get(&self, key: &str) -> Result<String, String>;
}

/// An elastic agent's key-value space: keys are scoped to its current generation,
/// so a new generation always builds its communicator from a fresh unique id.
pub struct AgentKv<'a> {
    /// The agent.
    pub agent: &'a ckpt_elastic::Agent,
    /// How long a `get` waits.
    pub timeout: Duration,
}

impl KeyValue for AgentKv<'_> {
    fn set(&self, key: &str, value: &str) -> Result<(), String> {
        self.agent.kv_set(key, value).map_err(|e| e.to_string())
    }

    fn get(&self, key: &str) -> Result<String, String> {
        self.agent
            .kv_get(key, self.timeout)
            .map_err(|e| e.to_string())
    }
}

/// A key-value space inside one process: for a world of one rank, or of ranks
/// that are threads of one process (benches, tests). `get` does not wait: a key not
/// yet published is an error.
#[derive(Debug, Default)]
pub struct LocalKv(Mutex<std::collections::HashMap<String, String>>);

impl KeyValue for LocalKv {
    fn set(&self, key: &str, value: &str) -> Result<(), String> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.into(), value.into());
        Ok(())
    }

    fn get(&self, key: &str) -> Result<String, String> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .cloned()
            .ok_or_else(|| format!("{key} was not published"))
    }
}

/// Shares a communicator's unique id: rank `root` makes one with `make` and
/// publishes it (hex) under `key`; every other rank reads it. Within one
/// generation, every re-creation of the communicator uses a new `key` (e.g.
/// `nccl/id/<attempt>`), so a stale id is never reused.
pub fn share_unique_id(
    kv: &dyn KeyValue,
    rank: usize,
    root: usize,
    key: &str,
    len: usize,
    make: impl FnOnce() -> Result<Vec<u8>, String>,
) -> CollectiveResult<Vec<u8>> {
    let op = "unique_id";
    let io = |message: String| CollectiveError::Io {
        op,
        peer: (rank != root).then_some(root),
        message,
    };
    if rank == root {
        let id = make().map_err(|m| CollectiveError::Device { op, message: m })?;
        if id.len() != len {
            return Err(CollectiveError::Invalid {
                op,
                message: format!("the unique id has {} bytes, expected {len}", id.len()),
            });
        }
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        kv.set(key, &hex)
            .map_err(|e| io(format!("publishing {key}: {e}")))?;
        return Ok(id);
    }
    let hex = kv.get(key).map_err(|e| io(format!("reading {key}: {e}")))?;
    let bytes = hex.as_bytes();
    if bytes.len() != 2 * len {
        return Err(io(format!(
            "{key} holds {} characters, expected {} (hex of {len} bytes)",
            bytes.len(),
            2 * len
        )));
    }
    bytes
        .chunks_exact(2)
        .map(|pair| {
            std::str::from_utf8(pair)
                .ok()
                .and_then(|s| u8::from_str_radix(s, 16).ok())
                .ok_or_else(|| io(format!("{key} is not hexadecimal: {pair:?}")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// What the fake does, shared with the test.
    #[derive(Default)]
    struct Script {
        /// Initialisation completes once this is set.
        init_done: AtomicBool,
        /// The asynchronous status reports this error when set.
        async_error: Mutex<Option<String>>,
        /// Operations complete (their markers are reached) when set.
        ops_complete: AtomicBool,
        /// The next operation answers InProgress this many times first.
        in_progress: AtomicUsize,
        /// Raw calls by name.
        calls: Mutex<Vec<&'static str>>,
        /// Set while a thread is inside a raw call; a second entrant fails the test.
        inside: AtomicBool,
        overlap: AtomicBool,
    }

    struct Fake(Arc<Script>);

    impl Fake {
        fn enter(&self, name: &'static str) -> impl Drop + '_ {
            if self.0.inside.swap(true, Ordering::SeqCst) {
                self.0.overlap.store(true, Ordering::SeqCst);
            }
            lock(&self.0.calls).push(name);
            struct Exit<'a>(&'a AtomicBool);
            impl Drop for Exit<'_> {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::SeqCst);
                }
            }
            Exit(&self.0.inside)
        }

        fn all_reduce(&mut self) -> RawStatus {
            let _in = self.enter("all_reduce");
            if self.0.in_progress.load(Ordering::SeqCst) > 0 {
                RawStatus::InProgress
            } else {
                RawStatus::Done
            }
        }
    }

    impl RawComm for Fake {
        type Stream = ();
        type Marker = ();

        fn async_status(&mut self) -> RawStatus {
            let _in = self.enter("async_status");
            if let Some(e) = lock(&self.0.async_error).clone() {
                return RawStatus::Failed(e);
            }
            if !self.0.init_done.load(Ordering::SeqCst) {
                return RawStatus::InProgress;
            }
            let left = self.0.in_progress.load(Ordering::SeqCst);
            if left > 0 {
                self.0.in_progress.store(left - 1, Ordering::SeqCst);
                return RawStatus::InProgress;
            }
            RawStatus::Done
        }

        fn record(&mut self, _: &()) -> Result<(), String> {
            let _in = self.enter("record");
            Ok(())
        }

        fn reached(&mut self, _: &()) -> Result<bool, String> {
            let _in = self.enter("reached");
            Ok(self.0.ops_complete.load(Ordering::SeqCst))
        }

        fn abort(&mut self) -> Result<(), String> {
            let _in = self.enter("abort");
            Ok(())
        }

        fn finalize(&mut self) -> RawStatus {
            let _in = self.enter("finalize");
            RawStatus::InProgress
        }

        fn destroy(&mut self) -> Result<(), String> {
            let _in = self.enter("destroy");
            Ok(())
        }
    }

    fn config(timeout_ms: u64) -> GuardConfig {
        GuardConfig {
            timeout: Duration::from_millis(timeout_ms),
            init_timeout: Duration::from_millis(timeout_ms),
            poll: Duration::from_millis(1),
            abort_on_failure: true,
        }
    }

    fn started(script: &Arc<Script>, timeout_ms: u64) -> Guard<Fake> {
        Guard::start(Fake(script.clone()), 0, 1, config(timeout_ms))
    }

    fn calls(script: &Script, name: &str) -> usize {
        lock(&script.calls).iter().filter(|c| **c == name).count()
    }

    #[test]
    fn an_operation_waits_for_initialisation_then_completes() {
        let script = Arc::new(Script::default());
        let guard = started(&script, 10_000);
        std::thread::scope(|s| {
            let worker = s.spawn(|| {
                guard.enqueue("all_reduce", &(), Fake::all_reduce)?;
                guard.synchronize("all_reduce", &())
            });
            // The worker is blocked in wait_ready: initialisation is not complete.
            assert!(!worker.is_finished());
            script.init_done.store(true, Ordering::SeqCst);
            script.ops_complete.store(true, Ordering::SeqCst);
            worker.join().unwrap().unwrap();
        });
        assert_eq!(calls(&script, "all_reduce"), 1);
        guard.shutdown().unwrap();
        assert_eq!(calls(&script, "finalize"), 1);
        assert_eq!(calls(&script, "destroy"), 1);
        assert_eq!(calls(&script, "abort"), 0, "an orderly end does not abort");
        assert!(!script.overlap.load(Ordering::SeqCst));
    }

    #[test]
    fn an_in_progress_call_is_polled_until_it_is_through() {
        let script = Arc::new(Script::default());
        script.init_done.store(true, Ordering::SeqCst);
        script.ops_complete.store(true, Ordering::SeqCst);
        script.in_progress.store(3, Ordering::SeqCst);
        let guard = started(&script, 10_000);
        guard.enqueue("all_reduce", &(), Fake::all_reduce).unwrap();
        assert_eq!(script.in_progress.load(Ordering::SeqCst), 0);
        assert_eq!(calls(&script, "record"), 1, "the marker follows the call");
        guard.synchronize("all_reduce", &()).unwrap();
        assert!(guard.error("next").is_none());
    }

    #[test]
    fn no_call_starts_while_another_is_in_progress() {
        let script = Arc::new(Script::default());
        script.init_done.store(true, Ordering::SeqCst);
        script.ops_complete.store(true, Ordering::SeqCst);
        script.in_progress.store(200, Ordering::SeqCst);
        let guard = started(&script, 10_000);
        guard.wait_ready("init").unwrap();
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..3)
                .map(|_| s.spawn(|| guard.enqueue("all_reduce", &(), Fake::all_reduce)))
                .collect();
            let sync = s.spawn(|| guard.synchronize("synchronize", &()));
            for w in workers {
                w.join().unwrap().unwrap();
            }
            sync.join().unwrap().unwrap();
        });
        // Each call's marker is recorded before the next call starts: no call (and
        // no work on the stream) while another is in progress.
        let order: Vec<&str> = lock(&script.calls)
            .iter()
            .copied()
            .filter(|c| *c == "all_reduce" || *c == "record")
            .collect();
        assert_eq!(order.len(), 7, "{order:?}");
        for pair in order.windows(2) {
            assert!(
                !(pair[0] == "all_reduce" && pair[1] == "all_reduce"),
                "a call started while another was in progress: {order:?}"
            );
        }
        assert!(!script.overlap.load(Ordering::SeqCst));
    }

    #[test]
    fn initialisation_past_its_timeout_fails_and_aborts() {
        let script = Arc::new(Script::default());
        let guard = started(&script, 30);
        let err = guard.wait_ready("init").unwrap_err();
        assert!(
            matches!(err, CollectiveError::Stalled { op: "init", .. }),
            "{err}"
        );
        guard.wait_aborted();
        assert_eq!(calls(&script, "abort"), 1);
        // Poisoned: every later call returns the first error.
        let again = guard
            .enqueue("all_reduce", &(), Fake::all_reduce)
            .unwrap_err();
        assert!(
            matches!(again, CollectiveError::Stalled { op: "init", .. }),
            "{again}"
        );
        assert_eq!(calls(&script, "all_reduce"), 0);
    }

    #[test]
    fn an_operation_that_hangs_fails_with_stalled_and_the_watchdog_aborts() {
        let script = Arc::new(Script::default());
        script.init_done.store(true, Ordering::SeqCst);
        let guard = started(&script, 50);
        guard.enqueue("all_gather", &(), Fake::all_reduce).unwrap();
        let err = guard.synchronize("all_gather", &()).unwrap_err();
        assert!(
            matches!(
                err,
                CollectiveError::Stalled {
                    op: "all_gather",
                    ..
                }
            ),
            "{err}"
        );
        guard.wait_aborted();
        assert_eq!(calls(&script, "abort"), 1);
        assert!(
            !script.overlap.load(Ordering::SeqCst),
            "a raw call ran during the abort"
        );
    }

    #[test]
    fn an_asynchronous_error_poisons_with_the_first_error() {
        let script = Arc::new(Script::default());
        script.init_done.store(true, Ordering::SeqCst);
        let guard = started(&script, 10_000);
        guard
            .enqueue("reduce_scatter", &(), Fake::all_reduce)
            .unwrap();
        *lock(&script.async_error) = Some("ncclRemoteError (6): peer 1 gone".into());
        let err = guard.synchronize("reduce_scatter", &()).unwrap_err();
        match &err {
            CollectiveError::Device { op, message } => {
                assert_eq!(*op, "reduce_scatter", "the pending operation is named");
                assert!(message.contains("peer 1 gone"), "{message}");
            }
            other => panic!("expected a device error, got {other}"),
        }
        guard.wait_aborted();
        let later = guard.synchronize("broadcast", &()).unwrap_err();
        assert!(
            matches!(
                later,
                CollectiveError::Device {
                    op: "reduce_scatter",
                    ..
                }
            ),
            "{later}"
        );
    }

    #[test]
    fn abort_from_another_thread_wakes_a_waiting_caller_and_never_overlaps_a_raw_call() {
        let script = Arc::new(Script::default());
        script.init_done.store(true, Ordering::SeqCst);
        let guard = started(&script, 60_000);
        guard.enqueue("all_reduce", &(), Fake::all_reduce).unwrap();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| guard.synchronize("all_reduce", &()));
            // abort() returns at once; the waiter then returns Aborted.
            guard.abort();
            let err = waiter.join().unwrap().unwrap_err();
            assert!(
                matches!(err, CollectiveError::Aborted { op: "all_reduce" }),
                "{err}"
            );
        });
        guard.wait_aborted();
        assert!(guard.is_aborted());
        assert_eq!(calls(&script, "abort"), 1);
        assert!(
            !script.overlap.load(Ordering::SeqCst),
            "a raw call ran during the abort"
        );
        let later = guard.enqueue("barrier", &(), Fake::all_reduce).unwrap_err();
        assert!(
            matches!(later, CollectiveError::Aborted { op: "barrier" }),
            "{later}"
        );
    }

    #[test]
    fn dropping_an_unfinished_guard_aborts_once() {
        let script = Arc::new(Script::default());
        script.init_done.store(true, Ordering::SeqCst);
        let guard = started(&script, 60_000);
        guard.wait_ready("init").unwrap();
        drop(guard);
        assert_eq!(calls(&script, "abort"), 1);
        assert_eq!(calls(&script, "destroy"), 0);
    }

    #[test]
    fn shrink_renumbers_ranks_and_retires_the_parent() {
        let script = Arc::new(Script::default());
        script.init_done.store(true, Ordering::SeqCst);
        let guard = Guard::start(Fake(script.clone()), 2, 4, config(60_000));
        let bad = guard.shrink(&[2], |_, _| unreachable!("own rank excluded"));
        assert!(matches!(bad, Err(CollectiveError::Invalid { .. })));
        let child_script = Arc::new(Script::default());
        child_script.init_done.store(true, Ordering::SeqCst);
        let mut saw_failed = None;
        let child = guard
            .shrink(&[0, 3, 0], |_, failed| {
                saw_failed = Some(failed);
                Ok(Fake(child_script.clone()))
            })
            .unwrap();
        assert_eq!(saw_failed, Some(false));
        assert_eq!((child.rank(), child.world_size()), (1, 2));
        child.wait_ready("init").unwrap();
        guard.wait_aborted();
        assert_eq!(calls(&script, "abort"), 1);
        assert_eq!(calls(&child_script, "abort"), 0);
    }

    #[test]
    fn a_failed_communicator_can_be_shrunk_when_the_abort_is_left_to_the_caller() {
        let script = Arc::new(Script::default());
        script.init_done.store(true, Ordering::SeqCst);
        let mut cfg = config(60_000);
        cfg.abort_on_failure = false;
        let guard = Guard::start(Fake(script.clone()), 0, 3, cfg);
        guard.wait_ready("init").unwrap();
        *lock(&script.async_error) = Some("ncclRemoteError (6)".into());
        let err = guard.synchronize("all_reduce", &()).unwrap_err();
        assert!(matches!(err, CollectiveError::Device { .. }), "{err}");
        assert!(!guard.is_aborted(), "abort_on_failure is off");
        let child_script = Arc::new(Script::default());
        let child = guard
            .shrink(&[1], |_, failed| {
                assert!(failed, "NCCL needs its abort flag for a failed parent");
                Ok(Fake(child_script.clone()))
            })
            .unwrap();
        assert_eq!((child.rank(), child.world_size()), (0, 2));
        guard.wait_aborted();
        assert_eq!(calls(&script, "abort"), 1);
    }

    #[test]
    fn the_unique_id_travels_through_the_key_value_space() {
        let kv = LocalKv::default();
        let id: Vec<u8> = (0..128u8).map(|i| i.wrapping_mul(37)).collect();
        let made = share_unique_id(&kv, 0, 0, "nccl/id/0", 128, || Ok(id.clone())).unwrap();
        assert_eq!(made, id);
        let read = share_unique_id(&kv, 1, 0, "nccl/id/0", 128, || unreachable!()).unwrap();
        assert_eq!(read, id);
        // A key nobody published, and garbage under a key, are errors naming the key.
        let missing = share_unique_id(&kv, 1, 0, "nccl/id/1", 128, || unreachable!());
        assert!(format!("{:?}", missing.unwrap_err()).contains("nccl/id/1"));
        kv.set("nccl/id/2", &"zz".repeat(128)).unwrap();
        let garbage = share_unique_id(&kv, 1, 0, "nccl/id/2", 128, || unreachable!());
        assert!(matches!(
            garbage,
            Err(CollectiveError::Io { peer: Some(0), .. })
        ));
        kv.set("nccl/id/3", "00").unwrap();
        let short = share_unique_id(&kv, 1, 0, "nccl/id/3", 128, || unreachable!());
        assert!(format!("{:?}", short.unwrap_err()).contains("expected 256"));
    }
}
