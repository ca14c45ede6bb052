//! A fault-injecting HTTP/1.1 proxy for S3-compatible object stores.
//!
//! # Why it exists
//!
//! Checkpoints are written to object storage through the real `object_store`
//! S3 client. That client has its own retry loop, connection pool and
//! multipart-upload logic, and the failures that matter in production happen
//! *inside* that machinery: a throttled request, a slow response, a
//! connection torn down halfway through a body, an upload part the server
//! never stored. Mocking the storage API above the client would skip all of
//! it. Instead this proxy sits on loopback between the client and an
//! S3-compatible server (moto in the tests) and damages the HTTP traffic
//! itself, so the client's retries and the server's validation meet real
//! faults on real sockets.
//!
//! The proxy is meant for synchronous (std thread) harnesses: it owns its own
//! tokio runtime on a thread of its own, and [`StorageProxy`] stops that
//! runtime when dropped.
//!
//! # Faults and what they stand for
//!
//! Faults are queued with [`StorageProxy::inject`]. Every incoming request is
//! claimed by at most one fault: the earliest queued fault that matches it.
//! A fault is spent after it has claimed `count` requests. A request that no
//! pending fault matches is relayed untouched (apart from the hop-by-hop
//! headers a proxy must own), so a fault never reaches past what it claims.
//!
//! * [`StorageFault::Errors`] answers with an HTTP error status and an S3
//!   XML error body (`SlowDown` for 503, `InternalError` for 500) without
//!   forwarding the request. This is what S3 does when a prefix is throttled
//!   or a front end has an internal error; clients are expected to back off
//!   and retry.
//! * [`StorageFault::Latency`] holds a request back before forwarding it,
//!   like a congested network path or a slow storage front end. It exercises
//!   client timeouts and slow-path code without failing anything.
//! * [`StorageFault::ResetMidBody`] forwards about half of a body and then
//!   resets the client's TCP connection (`SO_LINGER` 0, then close, which
//!   sends an RST). For a PUT the half-sent request body goes upstream and the
//!   upstream connection is reset as well, so the server never completes the
//!   write; for a GET the client receives the response head and half of the
//!   bytes. This is a load balancer or NAT dropping a connection, or a
//!   storage node dying mid-transfer. Uploads must be retried whole; ranged
//!   reads must resume or restart and still return the right bytes.
//! * [`StorageFault::LosePart`] swallows a multipart `UploadPart` request and
//!   answers `200 OK` with a made-up `ETag`, never forwarding it. It models
//!   a part acknowledged but not durably stored (or an acknowledgement that
//!   belongs to something else). S3 validates every part's ETag in
//!   `CompleteMultipartUpload` and rejects the upload with `InvalidPart`, so
//!   the client must see the upload fail rather than end up with an object
//!   that is missing a part.
//! * [`StorageFault::CorruptBody`] relays a body whole, with its length, but
//!   with its middle byte inverted: a PUT's request body (the server stores
//!   bytes other than those the client checksummed) or a ranged GET's response
//!   body (the client receives them). TCP's checksum is weak and ends at each
//!   hop; a faulty NIC, a bad RAM cell in a middlebox or a buggy proxy damages
//!   bytes where no transport checksum sees it. The loader must catch a GET on
//!   the block CRC32 and read again; a PUT must never leave a part stored whose
//!   bytes differ from what was checksummed.
//!
//! # Bandwidth cap
//!
//! [`StorageProxy::limit_rate`] caps the bodies relayed (response bodies to
//! clients and request bodies upstream) at a number of bytes per second shared
//! by all connections: a token bucket (`rate`) that lets one relay buffer go at
//! once and then holds each run of bytes until the rate has paid for it. It
//! stands for a store slower than the network in front of it, so that loads
//! which read each byte once can be told from loads that read it per replica by
//! their wall time, not only their request counts. Heads are not paced: a
//! request costs a round trip, not bandwidth.
//!
//! # Statistics
//!
//! [`ProxyStats`] counts requests (all, and by kind: the method, with bucket
//! listings as `LIST`), the faults applied, and the body bytes relayed each way,
//! so that any client's traffic (ckpt's `object_store`, s3fs under DCP) is
//! counted alike. `ckpt-chaos proxy` runs a proxy on its own and prints these
//! counters as JSON when it stops.
//!
//! # HTTP handling
//!
//! Each client connection is served in a loop (keep-alive) and relayed over
//! an upstream connection of its own, opened lazily and reused while the
//! upstream keeps it alive. Heads are parsed by `httparse`. Request bodies
//! are framed by `Content-Length` or `Transfer-Encoding: chunked`; response
//! bodies by `Content-Length`, chunked, or until the upstream closes.
//! Responses to `HEAD` and `1xx`, `204` and `304` responses carry no body.
//! Bodies are streamed through a fixed buffer, never held whole in memory;
//! chunked bodies are re-chunked as they pass. `Expect: 100-continue` is
//! answered by the proxy itself (the expectation is not forwarded).
//! Malformed input is answered `400` and closes the connection; an upstream
//! that cannot be reached or answers garbage yields a `502 Bad Gateway`,
//! which S3 clients treat as retryable.
//!
//! # Layout
//!
//! This file holds the handle and the runtime it starts. The parts below it:
//! `faults` (the queue and which fault claims a request), `http` (heads,
//! framing, hop-by-hop fields), `conn` (a buffered socket that can be reset),
//! `replies` (the S3-style responses the proxy makes up), `rate` (the
//! bandwidth cap) and `relay` (one client connection, where faults meet
//! bytes).

mod conn;
mod faults;
mod http;
mod rate;
mod relay;
mod replies;

use std::io;
use std::net::{SocketAddr, TcpListener as StdTcpListener, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub use faults::{Direction, ProxyStats, StorageFault};

use faults::SharedState;

/// A running fault-injecting proxy in front of one S3-compatible upstream.
///
/// Dropping it stops the proxy: the listener closes, in-flight connections
/// are dropped and the runtime thread is joined.
#[derive(Debug)]
pub struct StorageProxy {
    addr: SocketAddr,
    shared: Arc<SharedState>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl StorageProxy {
    /// Starts on 127.0.0.1:0 in front of `upstream` (`"http://host:port"`).
    ///
    /// The upstream address is resolved once, here. Only plain `http://`
    /// upstreams without a path are supported.
    pub fn start(upstream: &str) -> io::Result<StorageProxy> {
        StorageProxy::start_on(upstream, std::net::Ipv4Addr::LOCALHOST.into())
    }

    /// Starts on `ip`, port 0 (the host side of the nodes' bridge when nodes run
    /// in network namespaces, which loopback would not reach), in front of
    /// `upstream`.
    pub fn start_on(upstream: &str, ip: std::net::IpAddr) -> io::Result<StorageProxy> {
        StorageProxy::start_at(upstream, SocketAddr::new(ip, 0))
    }

    /// Starts listening on `listen` (port 0: one the system picks) in front of
    /// `upstream`.
    pub fn start_at(upstream: &str, listen: SocketAddr) -> io::Result<StorageProxy> {
        let upstream = resolve_upstream(upstream)?;
        let std_listener = StdTcpListener::bind(listen)?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("storage-proxy-worker")
            .enable_io()
            .enable_time()
            .build()?;
        let listener = {
            let _guard = runtime.enter();
            TcpListener::from_std(std_listener)?
        };
        let shared = Arc::new(SharedState::default());
        let (shutdown_tx, shutdown_rx) = oneshot::channel();
        let task_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("storage-proxy".to_owned())
            .spawn(move || {
                runtime.block_on(async move {
                    tokio::select! {
                        () = accept_loop(listener, upstream, task_shared) => {}
                        _ = shutdown_rx => {}
                    }
                });
                runtime.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(StorageProxy {
            addr,
            shared,
            shutdown: Some(shutdown_tx),
            thread: Some(thread),
        })
    }

    /// Where the proxy listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The proxy's base URL, `"http://127.0.0.1:PORT"`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Queues a fault; faults queue in order and each applies to the next
    /// requests it matches. A request is claimed by the earliest pending
    /// fault that matches it, and by no other. A fault with `count == 0`
    /// does nothing.
    pub fn inject(&self, fault: StorageFault) {
        self.shared.push(fault);
    }

    /// Caps the body bytes relayed, both ways and all connections together, at
    /// `bytes_per_second`; `None` lifts the cap. Bytes already booked keep their
    /// slots; a new cap starts from an idle bucket.
    pub fn limit_rate(&self, bytes_per_second: Option<u64>) {
        self.shared.limit_rate(bytes_per_second);
    }

    /// Counters so far.
    pub fn stats(&self) -> ProxyStats {
        self.shared.stats()
    }
}

impl Drop for StorageProxy {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Parses `http://host[:port][/]` and resolves it to one socket address.
fn resolve_upstream(upstream: &str) -> io::Result<SocketAddr> {
    let invalid = |why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("upstream {upstream:?}: {why}"),
        )
    };
    let rest = match upstream.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case("http://") => &upstream[7..],
        _ => return Err(invalid("only http:// upstreams are supported")),
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains(['/', '?', '#', '@']) {
        return Err(invalid("expected http://host:port"));
    }
    let has_port = match authority.rfind(':') {
        Some(colon) => !authority[colon..].contains(']'),
        None => false,
    };
    let with_port = if has_port {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    with_port
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| invalid("resolves to no address"))
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, shared: Arc<SharedState>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let shared = Arc::clone(&shared);
                tokio::spawn(relay::serve_client(stream, upstream, shared));
            }
            // Out of file descriptors or a connection aborted before it was
            // accepted: wait a little rather than spin.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_upstreams() {
        assert!(resolve_upstream("http://127.0.0.1:5555").is_ok());
        assert!(resolve_upstream("http://127.0.0.1:5555/").is_ok());
        assert!(resolve_upstream("http://localhost").is_ok());
        assert!(resolve_upstream("https://127.0.0.1:5555").is_err());
        assert!(resolve_upstream("http://127.0.0.1:5555/bucket").is_err());
        assert!(resolve_upstream("http://user@127.0.0.1:5555").is_err());
    }
}
