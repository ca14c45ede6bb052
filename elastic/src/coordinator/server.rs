//! The coordinator's I/O: accepting connections, reading each member's lines into
//! the core, writing the core's answers from a bounded outbox, and ticking the clock.
//!
//! All of it runs as tasks on one single-threaded tokio runtime, on the one thread
//! the coordinator owns: a connection costs two small tasks (a reader and a writer),
//! a socket and its buffers, never a thread. The core is synchronous and its
//! critical sections are short, so the tasks take its mutex directly.
//!
//! Nothing here decides anything: every line and every tick goes to the `Core`
//! under the shared mutex. Kept apart from the core so that the rules can be read
//! (and tested) without the I/O, and the I/O without the rules.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::{MissedTickBehavior, timeout};
use tracing::{debug, info, warn};

use super::Shared;
use super::core::Outcome;
use crate::protocol::{self, ClientMessage, LineError, MAX_LINE, ServerMessage};

/// Lines queued for one member before it counts as not reading and is disconnected.
pub(super) const OUTBOX: usize = 256;
/// Time a new connection has to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on one write to a member.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the timeouts are checked.
const TICK: Duration = Duration::from_millis(10);
/// Read buffer of one connection. Members' lines are small (a heartbeat is a few
/// hundred bytes); a longer one is read in several fills, up to [`MAX_LINE`].
const READ_BUFFER: usize = 4 * 1024;
/// Descriptors kept free beyond one per connection (the listener, logs, the
/// process's own files).
#[cfg(unix)]
const SPARE_FILES: libc::rlim_t = 64;

/// Ends one connection's tasks from anywhere (the core, under its mutex), without
/// blocking: the reader stops reading and the writer stops writing, so that the
/// socket closes. Cheap to clone; hanging up twice is harmless.
#[derive(Clone)]
pub(super) struct Hangup(Arc<watch::Sender<bool>>);

impl Hangup {
    fn new() -> Hangup {
        Hangup(Arc::new(watch::Sender::new(false)))
    }

    pub(super) fn hang_up(&self) {
        self.0.send_replace(true);
    }

    /// Completes once [`Hangup::hang_up`] was called (at once if it already was).
    async fn heard(&self) {
        let mut seen = self.0.subscribe();
        // The sender lives in `self`: waiting cannot fail.
        let _ = seen.wait_for(|&hung_up| hung_up).await;
    }
}

/// Accepts connections until the coordinator stops, with the ticker beside it.
pub(super) async fn serve(shared: Arc<Shared>, listener: TcpListener) {
    let ticker = tokio::spawn(tick(shared.clone()));
    loop {
        let accepted = tokio::select! {
            () = shared.stop.notified() => break,
            accepted = listener.accept() => accepted,
        };
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        match accepted {
            Ok((stream, peer)) => {
                tokio::spawn(serve_connection(shared.clone(), stream, peer));
            }
            Err(e) => {
                // Out of file descriptors and the like: wait a little, keep serving.
                warn!(error = %e, "accept failed");
                tokio::select! {
                    () = shared.stop.notified() => break,
                    () = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
    }
    ticker.abort();
}

async fn tick(shared: Arc<Shared>) {
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        shared.with_core(|core| core.tick(Instant::now()));
    }
}

/// Lines of at most [`MAX_LINE`] bytes from one connection.
struct Lines {
    inner: BufReader<OwnedReadHalf>,
    line: Vec<u8>,
}

impl Lines {
    fn new(socket: OwnedReadHalf) -> Lines {
        Lines {
            inner: BufReader::with_capacity(READ_BUFFER, socket),
            line: Vec::new(),
        }
    }

    /// The next line without its newline; `None` at a clean end of stream (a final
    /// line without a newline is dropped: the peer died in the middle of it). Not
    /// cancel safe: a cancelled call loses the part of a line it read.
    async fn next_line(&mut self) -> Result<Option<&[u8]>, LineError> {
        self.line.clear();
        loop {
            let available = self.inner.fill_buf().await?;
            if available.is_empty() {
                return Ok(None);
            }
            let (take, done) = protocol::append_line_part(&mut self.line, available, MAX_LINE)?;
            self.inner.consume(take);
            if done {
                return Ok(Some(&self.line));
            }
        }
    }
}

/// Writes the core's lines until the core drops the connection (then what is
/// queued, a final error, still goes out), a write fails or takes longer than
/// [`WRITE_TIMEOUT`] (the member stopped reading), or the connection is hung up.
async fn write_lines(
    mut socket: OwnedWriteHalf,
    mut outbox: mpsc::Receiver<Arc<str>>,
    hangup: Hangup,
    peer: SocketAddr,
) {
    loop {
        let line = tokio::select! {
            biased;
            () = hangup.heard() => return,
            line = outbox.recv() => line,
        };
        let Some(line) = line else {
            break;
        };
        let written = tokio::select! {
            biased;
            () = hangup.heard() => return,
            written = timeout(WRITE_TIMEOUT, socket.write_all(line.as_bytes())) => written,
        };
        match written {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                debug!(%peer, error = %e, "write failed");
                break;
            }
            Err(_) => {
                warn!(%peer, "a write took longer than {WRITE_TIMEOUT:?}; disconnecting");
                break;
            }
        }
    }
    let _ = timeout(WRITE_TIMEOUT, socket.shutdown()).await;
    // The reader ends too (it may be waiting for a peer that says nothing).
    hangup.hang_up();
}

/// Tells a connection beyond the cap why it is closed, then closes it.
async fn refuse(stream: &mut TcpStream, message: &str) {
    let error = ServerMessage::Error {
        message: message.to_owned(),
        fatal: true,
    };
    if let Ok(line) = protocol::encode(&error) {
        let _ = timeout(Duration::from_secs(1), stream.write_all(line.as_bytes())).await;
    }
    let _ = timeout(Duration::from_secs(1), stream.shutdown()).await;
}

async fn serve_connection(shared: Arc<Shared>, mut stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    match shared.gate.screen_async(&mut stream, peer).await {
        Ok(()) => {}
        Err(ckpt_auth::AuthError::NoHandshake) => {
            // Most likely one of the job's processes started without the secret:
            // say so in its own protocol.
            refuse(&mut stream, &protocol::without_secret()).await;
            return;
        }
        Err(_) => return,
    }
    let (outbox, lines) = mpsc::channel(OUTBOX);
    let hangup = Hangup::new();
    let id = shared.with_core(|core| core.register(Some(hangup.clone()), outbox, peer));
    let Some(id) = id else {
        let max = shared.lock().config.max_connections;
        let message = format!("too many connections (max_connections is {max})");
        warn!(%peer, "{message}; refused");
        refuse(&mut stream, &message).await;
        return;
    };
    let (read, write) = stream.into_split();
    tokio::spawn(write_lines(write, lines, hangup.clone(), peer));
    let mut reader = Lines::new(read);
    let hello_timeout = tokio::time::sleep(HELLO_TIMEOUT);
    tokio::pin!(hello_timeout);
    let mut welcomed = false;
    let reason = loop {
        let read = tokio::select! {
            biased;
            () = hangup.heard() => break "connection closed".to_owned(),
            () = &mut hello_timeout, if !welcomed => {
                let message = format!("no hello within {HELLO_TIMEOUT:?}");
                shared.with_core(|core| core.error(id, &message, true));
                break message;
            }
            read = reader.next_line() => read,
        };
        match read {
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
                    Outcome::Welcomed => welcomed = true,
                    Outcome::Close(reason) => break reason,
                }
            }
            Err(LineError::TooLong { max }) => {
                let message = format!("line longer than {max} bytes; closing the connection");
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

/// Raises the process's soft limit on open files toward its hard limit when it is
/// below what `connections` need (one descriptor each, and some to spare). Logs what
/// it did; never fails: past the limit, accepting fails and is retried, and members
/// reconnect.
#[cfg(unix)]
pub(super) fn raise_file_limit(connections: usize) {
    let need = libc::rlim_t::try_from(connections)
        .unwrap_or(libc::rlim_t::MAX)
        .saturating_add(SPARE_FILES);
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the call's duration.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        warn!(error = %io::Error::last_os_error(), "cannot read the open-file limit");
        return;
    }
    let (soft, hard) = (limit.rlim_cur, limit.rlim_max);
    if soft >= need {
        return;
    }
    let raised = need.min(hard);
    if raised > soft {
        let wanted = libc::rlimit {
            rlim_cur: raised,
            rlim_max: hard,
        };
        // SAFETY: `wanted` is a valid rlimit, only read by the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) } != 0 {
            let error = io::Error::last_os_error();
            warn!(soft, hard, %error, "cannot raise the open-file limit");
            return;
        }
        info!(
            from = soft,
            to = raised,
            connections,
            "raised the open-file limit"
        );
    }
    if raised < need {
        warn!(
            hard,
            connections,
            "the open-file hard limit allows about {} connections, below max_connections",
            raised.saturating_sub(SPARE_FILES)
        );
    }
}

/// Descriptor limits are a unix matter.
#[cfg(not(unix))]
pub(super) fn raise_file_limit(_connections: usize) {}

/// Lets `listener` queue up to `connections` connections not accepted yet (the
/// kernel caps it, at `net.core.somaxconn` on Linux). The standard library listens
/// with a backlog of 128: when thousands of members connect at once, the ones
/// beyond it have their connection attempts dropped and retried a second or more
/// later. Listening again on a listening socket only changes its backlog.
#[cfg(unix)]
pub(super) fn widen_backlog(listener: &std::net::TcpListener, connections: usize) {
    use std::os::fd::AsRawFd;
    let backlog = libc::c_int::try_from(connections).unwrap_or(libc::c_int::MAX);
    // SAFETY: the descriptor is the listener's own, open for the call's duration.
    if unsafe { libc::listen(listener.as_raw_fd(), backlog) } != 0 {
        let error = io::Error::last_os_error();
        warn!(%error, "cannot widen the listen backlog; bursts of connections may wait");
    }
}

/// Listen backlogs are set this way on unix only.
#[cfg(not(unix))]
pub(super) fn widen_backlog(_listener: &std::net::TcpListener, _connections: usize) {}
