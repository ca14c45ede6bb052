//! The node's listener and each rank process's connection: the threads that
//! accept, screen for the job's secret, read lines into [`Shared`] and write the
//! rank's queued lines out. They decide nothing; a rank that does not read is cut
//! off by its bounded queue.

use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, sync_channel};
use std::time::Duration;

use tracing::warn;

use super::ranks::error;
use super::state::{Outbox, Shared};
use crate::protocol::{self, ClientMessage, LineError, LineReader};

/// Lines queued for one rank before it counts as not reading.
const OUTBOX: usize = 256;
/// Time a rank's new connection has to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on one write to a rank.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("ckpt-node-rank".into())
            .spawn(move || serve_rank(&shared, stream, peer));
        if let Err(e) = spawned {
            warn!(%peer, error = %e, "cannot start a thread for a rank");
        }
    }
}

fn write_lines(mut socket: TcpStream, outbox: Receiver<Arc<str>>) {
    let _ = socket.set_write_timeout(Some(WRITE_TIMEOUT));
    for line in outbox {
        if socket.write_all(line.as_bytes()).is_err() {
            break;
        }
    }
    let _ = socket.shutdown(Shutdown::Both);
}

fn serve_rank(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    match shared.gate.screen(&stream, peer) {
        Ok(()) => {}
        Err(ckpt_auth::AuthError::NoHandshake) => {
            // One of the node's ranks started without the secret, most likely: say
            // so in its own protocol.
            if let Ok(line) = protocol::encode(&error(&protocol::without_secret(), true)) {
                let _ = (&stream).write_all(line.as_bytes());
            }
            return;
        }
        Err(_) => return,
    }
    let (Ok(for_writer), Ok(for_state)) = (stream.try_clone(), stream.try_clone()) else {
        warn!(%peer, "cannot clone a rank's socket");
        return;
    };
    let (queue, lines) = sync_channel(OUTBOX);
    let outbox = Outbox::Socket {
        queue,
        socket: for_state,
    };
    let Some(c) = shared.register(outbox) else {
        warn!(%peer, "too many rank connections; refused");
        return;
    };
    let writer = std::thread::Builder::new()
        .name("ckpt-node-write".into())
        .spawn(move || write_lines(for_writer, lines));
    if writer.is_err() {
        shared.remove(c, "no thread to write");
        return;
    }
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let mut reader = LineReader::new(stream);
    let reason = loop {
        match reader.next_line() {
            Ok(None) => break "connection closed".to_owned(),
            Ok(Some(line)) => match protocol::decode::<ClientMessage>(line) {
                Ok(message) => match shared.handle(c, message) {
                    Ok(true) => {
                        let _ = reader.get_ref().set_read_timeout(None);
                    }
                    Ok(false) => {}
                    Err(reason) => break reason,
                },
                Err(e) => shared.lock().send(c, &error(&e.to_string(), false)),
            },
            Err(LineError::TooLong { max }) => {
                let message = format!("line longer than {max} bytes; closing the connection");
                shared.lock().send(c, &error(&message, true));
                break message;
            }
            Err(LineError::Io(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                break format!("no hello within {HELLO_TIMEOUT:?}");
            }
            Err(e) => break e.to_string(),
        }
    };
    shared.remove(c, &reason);
}
