//! The coordinator's threads and sockets: accepting connections, reading each
//! member's lines into the core, writing the core's answers from a bounded outbox,
//! and ticking the clock.
//!
//! Nothing here decides anything: every line and every tick goes to the `Core`
//! under the shared mutex. Kept apart from the core so that the rules can be read
//! (and tested) without the I/O, and the I/O without the rules.

use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, sync_channel};
use std::time::{Duration, Instant};

use tracing::warn;

use super::Shared;
use super::core::Outcome;
use crate::protocol::{self, ClientMessage, LineError, LineReader, ServerMessage};

/// Lines queued for one member before it counts as not reading and is disconnected.
pub(super) const OUTBOX: usize = 256;
/// Time a new connection has to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on one write to a member.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the timeouts are checked.
const TICK: Duration = Duration::from_millis(10);

pub(super) fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
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

pub(super) fn tick_loop(shared: &Shared) {
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
