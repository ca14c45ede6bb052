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
//!
//! # HTTP handling
//!
//! Each client connection is served in a loop (keep-alive) and relayed over
//! an upstream connection of its own, opened lazily and reused while the
//! upstream keeps it alive. Request bodies are framed by `Content-Length` or
//! `Transfer-Encoding: chunked`; response bodies by `Content-Length`,
//! chunked, or until the upstream closes. Responses to `HEAD` and `1xx`,
//! `204` and `304` responses carry no body. Bodies are streamed through a
//! fixed buffer, never held whole in memory; chunked bodies are re-chunked
//! as they pass. `Expect: 100-continue` is answered by the proxy itself
//! (the expectation is not forwarded). Malformed input closes the
//! connection; an upstream that cannot be reached or answers garbage yields
//! a `502 Bad Gateway`, which S3 clients treat as retryable.

use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, TcpListener as StdTcpListener, ToSocketAddrs};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// Largest request or response head accepted, in bytes.
const MAX_HEAD: usize = 64 * 1024;
/// Largest chunk-size or trailer line accepted, in bytes.
const MAX_LINE: usize = 8 * 1024;
/// Size of the per-connection read buffer bodies stream through.
const IO_BUF: usize = 64 * 1024;
/// Pause between sending the first half of a body and resetting the
/// connection, so the bytes written reach the peer before the RST discards
/// whatever is still queued in the socket.
const RESET_PAUSE: Duration = Duration::from_millis(20);

/// A fault applied to the next matching requests.
///
/// Serialized with an internal `kind` tag in kebab case, e.g.
/// `{"kind":"errors","status":503,"count":3}` or
/// `{"kind":"reset-mid-body","count":1}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum StorageFault {
    /// Answer the next `count` requests with HTTP `status` (500 or 503
    /// typically) and an S3-style XML error body, without forwarding them
    /// (the request body is read and discarded first). Matches any request.
    Errors {
        /// HTTP status to answer with.
        status: u16,
        /// Number of requests to fail.
        count: usize,
    },
    /// Delay each of the next `count` requests by `ms` before forwarding it.
    /// Matches any request.
    Latency {
        /// Delay in milliseconds.
        ms: u64,
        /// Number of requests to delay.
        count: usize,
    },
    /// For the next `count` requests that carry a body (a PUT's request
    /// body, or a GET's response body): forward about half of the body, then
    /// reset the client connection (TCP RST).
    ///
    /// Matches a PUT with a non-empty request body, or any GET. A GET whose
    /// response turns out to have no body hands the claim back, so the fault
    /// waits for a request it can really cut. For bodies of unknown length
    /// (chunked, or until close) the cut falls in the middle of the first
    /// chunk or read.
    ResetMidBody {
        /// Number of bodies to cut.
        count: usize,
    },
    /// The next `count` multipart UploadPart requests (PUT with
    /// `partNumber=` and `uploadId=` in the query) are swallowed: body read
    /// and discarded, answered `200 OK` with a made-up `ETag`, never
    /// forwarded. The CompleteMultipartUpload that follows then fails at the
    /// server (`InvalidPart`), so a client can never end up with an object
    /// missing a part.
    LosePart {
        /// Number of parts to lose.
        count: usize,
    },
}

impl StorageFault {
    fn count(&self) -> usize {
        match *self {
            StorageFault::Errors { count, .. }
            | StorageFault::Latency { count, .. }
            | StorageFault::ResetMidBody { count }
            | StorageFault::LosePart { count } => count,
        }
    }
}

/// Counters of what the proxy has seen and done so far.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ProxyStats {
    /// Requests received from clients (relayed or answered by a fault).
    pub requests: u64,
    /// Requests answered with an injected error status.
    pub errors: u64,
    /// Requests delayed by an injected latency.
    pub delayed: u64,
    /// Connections reset in the middle of a body.
    pub resets: u64,
    /// Multipart upload parts swallowed and acknowledged with a fake ETag.
    pub lost_parts: u64,
}

/// A queued fault with the number of requests it may still claim.
#[derive(Debug)]
struct Pending {
    /// Injection order; used to put a handed-back claim where it was.
    id: u64,
    fault: StorageFault,
    remaining: usize,
}

/// State shared between the handle and the connection tasks.
#[derive(Debug, Default)]
struct Shared {
    queue: VecDeque<Pending>,
    next_id: u64,
    stats: ProxyStats,
}

#[derive(Debug, Default)]
struct SharedState(Mutex<Shared>);

impl SharedState {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        // The state stays consistent even if a holder panicked: every
        // critical section is a handful of plain field updates.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn bump(&self, f: impl FnOnce(&mut ProxyStats)) {
        f(&mut self.lock().stats);
    }
}

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
        let upstream = resolve_upstream(upstream)?;
        let std_listener = StdTcpListener::bind(("127.0.0.1", 0))?;
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

    /// The proxy's base URL, `"http://127.0.0.1:PORT"`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Queues a fault; faults queue in order and each applies to the next
    /// requests it matches. A request is claimed by the earliest pending
    /// fault that matches it, and by no other. A fault with `count == 0`
    /// does nothing.
    pub fn inject(&self, fault: StorageFault) {
        let remaining = fault.count();
        if remaining == 0 {
            return;
        }
        let mut shared = self.shared.lock();
        let id = shared.next_id;
        shared.next_id += 1;
        shared.queue.push_back(Pending {
            id,
            fault,
            remaining,
        });
    }

    /// Counters so far.
    pub fn stats(&self) -> ProxyStats {
        self.shared.lock().stats.clone()
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
                tokio::spawn(serve_client(stream, upstream, shared));
            }
            // Out of file descriptors or a connection aborted before it was
            // accepted: wait a little rather than spin.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

// ---------------------------------------------------------------------------
// Buffered connection
// ---------------------------------------------------------------------------

/// A TCP stream with a read buffer. The stream is kept whole (not split) so
/// that it can be reset.
struct Conn {
    stream: TcpStream,
    buf: Box<[u8]>,
    pos: usize,
    len: usize,
}

impl Conn {
    fn new(stream: TcpStream) -> Conn {
        let _ = stream.set_nodelay(true);
        Conn {
            stream,
            buf: vec![0; IO_BUF].into_boxed_slice(),
            pos: 0,
            len: 0,
        }
    }

    fn buffered(&self) -> &[u8] {
        &self.buf[self.pos..self.len]
    }

    /// Makes buffered bytes available; returns how many are buffered, 0 at
    /// end of stream.
    async fn fill(&mut self) -> io::Result<usize> {
        if self.pos == self.len {
            self.pos = 0;
            self.len = self.stream.read(&mut self.buf).await?;
        }
        Ok(self.len - self.pos)
    }

    /// Reads a message head up to and including its blank line. Returns
    /// `None` on a clean end of stream before any byte of a head.
    async fn read_head(&mut self) -> io::Result<Option<Vec<u8>>> {
        let mut head = Vec::new();
        loop {
            if self.fill().await? == 0 {
                return if head.is_empty() {
                    Ok(None)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                };
            }
            let avail = &self.buf[self.pos..self.len];
            for (i, &b) in avail.iter().enumerate() {
                head.push(b);
                if b != b'\n' {
                    continue;
                }
                if head == b"\r\n" || head == b"\n" {
                    // Empty lines before a message are ignored (RFC 9112 2.2).
                    head.clear();
                } else if head.ends_with(b"\r\n\r\n") || head.ends_with(b"\n\n") {
                    self.pos += i + 1;
                    return Ok(Some(head));
                }
            }
            self.pos = self.len;
            if head.len() > MAX_HEAD {
                return Err(malformed("message head too large"));
            }
        }
    }

    /// Reads one line and returns it without its line ending.
    async fn read_line(&mut self) -> io::Result<Vec<u8>> {
        let mut line = Vec::new();
        loop {
            if self.fill().await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let avail = &self.buf[self.pos..self.len];
            if let Some(i) = avail.iter().position(|&b| b == b'\n') {
                line.extend_from_slice(&avail[..i]);
                self.pos += i + 1;
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(line);
            }
            line.extend_from_slice(avail);
            self.pos = self.len;
            if line.len() > MAX_LINE {
                return Err(malformed("line too long"));
            }
        }
    }

    /// Copies exactly `n` bytes to `dst`, or discards them when `dst` is
    /// `None`.
    async fn copy_exact(&mut self, mut dst: Option<&mut TcpStream>, mut n: u64) -> io::Result<()> {
        while n > 0 {
            if self.fill().await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let avail = self.buffered();
            let take = avail.len().min(usize::try_from(n).unwrap_or(usize::MAX));
            if let Some(dst) = dst.as_deref_mut() {
                dst.write_all(&avail[..take]).await?;
            }
            self.pos += take;
            n -= take as u64;
        }
        Ok(())
    }

    /// Whether a pooled connection still looks open: nothing unexpected
    /// buffered and no end of stream or error pending on the socket.
    fn looks_reusable(&self) -> bool {
        if !self.buffered().is_empty() {
            return false;
        }
        let mut probe = [0u8; 1];
        matches!(self.stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Closes the connection with a TCP RST rather than a FIN.
    fn reset(self) {
        // A zero linger makes close() abort the connection; with zero it does
        // not block, which is why tokio's deprecation does not apply here.
        #[allow(deprecated)]
        let _ = self.stream.set_linger(Some(Duration::ZERO));
        drop(self);
    }
}

fn malformed(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.to_owned())
}

// ---------------------------------------------------------------------------
// Message heads
// ---------------------------------------------------------------------------

/// A parsed request or response head: the start line and the header fields,
/// values kept as raw bytes.
struct Head {
    start: Vec<u8>,
    headers: Vec<(String, Vec<u8>)>,
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

impl Head {
    fn parse(raw: &[u8]) -> io::Result<Head> {
        let mut lines = raw.split(|&b| b == b'\n').map(|line| match line {
            [rest @ .., b'\r'] => rest,
            line => line,
        });
        let start = lines.next().unwrap_or_default().to_vec();
        let mut headers = Vec::new();
        for line in lines {
            if line.is_empty() {
                continue;
            }
            if matches!(line.first(), Some(b' ' | b'\t')) {
                return Err(malformed("obsolete header line folding"));
            }
            let colon = line
                .iter()
                .position(|&b| b == b':')
                .ok_or_else(|| malformed("header line without a colon"))?;
            let name = &line[..colon];
            if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
                return Err(malformed("bad header name"));
            }
            let value = trim_ows(&line[colon + 1..]);
            if value.iter().any(|&b| b == b'\r' || b == 0) {
                return Err(malformed("bad header value"));
            }
            // `name` is all tchars, hence ASCII.
            let name = String::from_utf8_lossy(name).into_owned();
            headers.push((name, value.to_vec()));
        }
        Ok(Head { start, headers })
    }

    fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// The comma-separated list elements of all fields named `name`.
    fn list<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.values(name)
            .flat_map(|v| v.split(|&b| b == b','))
            .map(trim_ows)
            .filter(|e| !e.is_empty())
    }

    fn has_token(&self, name: &str, token: &str) -> bool {
        self.list(name)
            .any(|e| e.eq_ignore_ascii_case(token.as_bytes()))
    }

    /// Body framing as declared by the headers; `None` when neither
    /// `Transfer-Encoding` nor `Content-Length` is present.
    fn declared_framing(&self) -> io::Result<Option<Framing>> {
        if let Some(last) = self.list("transfer-encoding").last() {
            return Ok(Some(if last.eq_ignore_ascii_case(b"chunked") {
                Framing::Chunked
            } else {
                Framing::UntilClose
            }));
        }
        let mut length = None;
        for element in self.list("content-length") {
            let n = std::str::from_utf8(element)
                .ok()
                .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| malformed("bad content-length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(malformed("conflicting content-length"));
            }
            length = Some(n);
        }
        if length.is_none() && self.values("content-length").next().is_some() {
            return Err(malformed("empty content-length"));
        }
        Ok(length.map(Framing::Length))
    }

    /// Appends the header fields a proxy may forward: everything except the
    /// hop-by-hop fields (and `Content-Length` when the message is chunked,
    /// as `Transfer-Encoding` overrides it).
    fn write_end_to_end(&self, out: &mut Vec<u8>, also_drop: &[&str]) {
        let chunked = self.values("transfer-encoding").next().is_some();
        let connection_named: Vec<&[u8]> = self.list("connection").collect();
        for (name, value) in &self.headers {
            let hop_by_hop = [
                "connection",
                "keep-alive",
                "proxy-connection",
                "te",
                "upgrade",
            ]
            .iter()
            .chain(also_drop)
            .any(|h| name.eq_ignore_ascii_case(h))
                || connection_named
                    .iter()
                    .any(|c| c.eq_ignore_ascii_case(name.as_bytes()));
            if hop_by_hop || (chunked && name.eq_ignore_ascii_case("content-length")) {
                continue;
            }
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
    }
}

/// How a message body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked,
    UntilClose,
}

impl Framing {
    fn is_empty(self) -> bool {
        self == Framing::Length(0)
    }
}

/// A parsed client request.
struct Request {
    head: Head,
    method: String,
    target: String,
    framing: Framing,
    expect_continue: bool,
    keep_alive: bool,
}

impl Request {
    fn parse(raw: &[u8]) -> io::Result<Request> {
        let head = Head::parse(raw)?;
        let mut parts = head.start.split(|&b| b == b' ');
        let (Some(method), Some(target), Some(version), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed("bad request line"));
        };
        if method.is_empty() || !method.iter().all(|&b| is_tchar(b)) {
            return Err(malformed("bad method"));
        }
        if target.is_empty() || !target.iter().all(|&b| b.is_ascii_graphic()) {
            return Err(malformed("bad request target"));
        }
        let http10 = match version {
            b"HTTP/1.1" => false,
            b"HTTP/1.0" => true,
            _ => return Err(malformed("unsupported HTTP version")),
        };
        let framing = match head.declared_framing()? {
            Some(Framing::UntilClose) => {
                return Err(malformed("request transfer-coding is not chunked"));
            }
            Some(framing) => framing,
            None => Framing::Length(0),
        };
        let keep_alive = if http10 {
            head.has_token("connection", "keep-alive")
        } else {
            !head.has_token("connection", "close")
        };
        // Both are ASCII (checked above).
        let method = String::from_utf8_lossy(method).into_owned();
        let target = String::from_utf8_lossy(target).into_owned();
        Ok(Request {
            expect_continue: head.has_token("expect", "100-continue"),
            head,
            method,
            target,
            framing,
            keep_alive,
        })
    }

    fn is_multipart_part_upload(&self) -> bool {
        if self.method != "PUT" {
            return false;
        }
        let Some((_, query)) = self.target.split_once('?') else {
            return false;
        };
        let has = |key: &str| {
            query
                .split('&')
                .any(|pair| pair.split_once('=').map_or(pair, |(k, _)| k) == key)
        };
        has("partNumber") && has("uploadId")
    }

    /// The head sent upstream: same method, target and end-to-end headers,
    /// always HTTP/1.1 and without the `Expect` the proxy answers itself.
    fn upstream_head(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(512);
        out.extend_from_slice(self.method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.target.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        self.head.write_end_to_end(&mut out, &["expect"]);
        out.extend_from_slice(b"\r\n");
        out
    }
}

/// A parsed upstream response head.
struct Response {
    head: Head,
    status: u16,
    reason: Vec<u8>,
    keep_alive: bool,
}

impl Response {
    fn parse(raw: &[u8]) -> io::Result<Response> {
        let head = Head::parse(raw)?;
        let line = head.start.as_slice();
        let (version, rest) = match line.iter().position(|&b| b == b' ') {
            Some(sp) => (&line[..sp], &line[sp + 1..]),
            None => return Err(malformed("bad status line")),
        };
        let http10 = match version {
            b"HTTP/1.1" => false,
            b"HTTP/1.0" => true,
            _ => return Err(malformed("unsupported HTTP version")),
        };
        let (code, reason) = match rest {
            [a, b, c] => ([*a, *b, *c], &[][..]),
            [a, b, c, b' ', reason @ ..] => ([*a, *b, *c], reason),
            _ => return Err(malformed("bad status line")),
        };
        if !code.iter().all(u8::is_ascii_digit) {
            return Err(malformed("bad status code"));
        }
        let status = code
            .iter()
            .fold(0u16, |acc, &d| acc * 10 + u16::from(d - b'0'));
        let keep_alive = if http10 {
            head.has_token("connection", "keep-alive")
        } else {
            !head.has_token("connection", "close")
        };
        Ok(Response {
            reason: reason.to_vec(),
            head,
            status,
            keep_alive,
        })
    }

    fn framing(&self, request_method: &str) -> io::Result<Framing> {
        if request_method == "HEAD" || self.status < 200 || self.status == 204 || self.status == 304
        {
            return Ok(Framing::Length(0));
        }
        Ok(self.head.declared_framing()?.unwrap_or(Framing::UntilClose))
    }

    /// The head sent to the client. `close` adds `Connection: close`.
    fn client_head(&self, close: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(512);
        out.extend_from_slice(format!("HTTP/1.1 {} ", self.status).as_bytes());
        out.extend_from_slice(&self.reason);
        out.extend_from_slice(b"\r\n");
        self.head.write_end_to_end(&mut out, &[]);
        if close {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }
}

// ---------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------

/// What the proxy does with one request.
enum Action {
    Relay,
    Delay(u64),
    Error(u16),
    ResetRequestBody,
    ResetResponseBody(Claim),
    LosePart,
}

/// A claim on a queued fault that may be handed back unused.
struct Claim {
    id: u64,
    fault: StorageFault,
}

/// Counts the request and lets the earliest matching fault claim it.
fn claim_fault(shared: &SharedState, req: &Request) -> Action {
    let mut state = shared.lock();
    state.stats.requests += 1;
    let mut chosen = None;
    for (index, pending) in state.queue.iter().enumerate() {
        let action = match pending.fault {
            StorageFault::Errors { status, .. } => Some(Action::Error(status)),
            StorageFault::Latency { ms, .. } => Some(Action::Delay(ms)),
            StorageFault::ResetMidBody { .. } => {
                if req.method == "PUT" && !req.framing.is_empty() {
                    Some(Action::ResetRequestBody)
                } else if req.method == "GET" {
                    Some(Action::ResetResponseBody(Claim {
                        id: pending.id,
                        fault: pending.fault,
                    }))
                } else {
                    None
                }
            }
            StorageFault::LosePart { .. } => {
                req.is_multipart_part_upload().then_some(Action::LosePart)
            }
        };
        if let Some(action) = action {
            chosen = Some((index, action));
            break;
        }
    }
    let Some((index, action)) = chosen else {
        return Action::Relay;
    };
    if let Some(pending) = state.queue.get_mut(index) {
        pending.remaining -= 1;
        if pending.remaining == 0 {
            state.queue.remove(index);
        }
    }
    match action {
        Action::Error(_) => state.stats.errors += 1,
        Action::Delay(_) => state.stats.delayed += 1,
        Action::LosePart => state.stats.lost_parts += 1,
        _ => {}
    }
    action
}

/// Returns an unused claim to the queue, in its original place.
fn give_back(shared: &SharedState, claim: Claim) {
    let mut state = shared.lock();
    if let Some(pending) = state.queue.iter_mut().find(|p| p.id == claim.id) {
        pending.remaining += 1;
        return;
    }
    let at = state
        .queue
        .iter()
        .position(|p| p.id > claim.id)
        .unwrap_or(state.queue.len());
    state.queue.insert(
        at,
        Pending {
            id: claim.id,
            fault: claim.fault,
            remaining: 1,
        },
    );
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        408 => "Request Timeout",
        409 => "Conflict",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Injected Fault",
    }
}

/// The S3 error code and message a real store sends with `status`.
fn s3_error(status: u16) -> (&'static str, &'static str) {
    match status {
        500 => (
            "InternalError",
            "We encountered an internal error. Please try again.",
        ),
        503 => ("SlowDown", "Please reduce your request rate."),
        429 => ("SlowDown", "Please reduce your request rate."),
        502 => (
            "BadGateway",
            "The storage proxy could not reach the upstream.",
        ),
        504 => ("RequestTimeout", "The upstream did not answer in time."),
        _ => ("InjectedFault", "Fault injected by the storage proxy."),
    }
}

/// A complete response generated by the proxy itself.
fn synthetic_response(
    status: u16,
    extra_headers: &[(&str, &str)],
    body: &str,
    head_only: bool,
    close: bool,
) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status} {}\r\n", reason_phrase(status));
    for (name, value) in extra_headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str(&format!("Content-Length: {}\r\n", body.len()));
    if close {
        out.push_str("Connection: close\r\n");
    }
    out.push_str("\r\n");
    if !head_only {
        out.push_str(body);
    }
    out.into_bytes()
}

fn s3_error_response(status: u16, request_id: &str, head_only: bool, close: bool) -> Vec<u8> {
    let (code, message) = s3_error(status);
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
         <Message>{message}</Message><RequestId>{request_id}</RequestId></Error>"
    );
    synthetic_response(
        status,
        &[
            ("Content-Type", "application/xml"),
            ("x-amz-request-id", request_id),
        ],
        &body,
        head_only,
        close,
    )
}

// ---------------------------------------------------------------------------
// Relaying
// ---------------------------------------------------------------------------

/// What to do with the client connection after a request.
enum Next {
    KeepAlive,
    Close,
    Reset,
}

/// Whether a body was relayed whole or cut at the fault's point.
#[derive(PartialEq, Eq)]
enum BodyEnd {
    Complete,
    Cut,
}

async fn serve_client(stream: TcpStream, upstream: SocketAddr, shared: Arc<SharedState>) {
    let mut client = Conn::new(stream);
    let mut pooled: Option<Conn> = None;
    let mut served: u64 = 0;
    loop {
        let raw = match client.read_head().await {
            Ok(Some(raw)) => raw,
            Ok(None) | Err(_) => return,
        };
        let req = match Request::parse(&raw) {
            Ok(req) => req,
            Err(_) => {
                let reply = synthetic_response(400, &[], "", false, true);
                let _ = client.stream.write_all(&reply).await;
                let _ = client.stream.shutdown().await;
                return;
            }
        };
        served += 1;
        let request_id = format!("ckpt-proxy-{served}");
        let next = handle(
            &shared,
            upstream,
            &mut client,
            &mut pooled,
            &req,
            &request_id,
        )
        .await;
        match next {
            Ok(Next::KeepAlive) => {}
            Ok(Next::Close) => {
                let _ = client.stream.shutdown().await;
                return;
            }
            Ok(Next::Reset) => {
                client.reset();
                return;
            }
            // A broken client or upstream mid-message: the client connection
            // cannot be kept in sync any more.
            Err(_) => return,
        }
    }
}

async fn handle(
    shared: &SharedState,
    upstream: SocketAddr,
    client: &mut Conn,
    pooled: &mut Option<Conn>,
    req: &Request,
    request_id: &str,
) -> io::Result<Next> {
    let head_only = req.method == "HEAD";
    match claim_fault(shared, req) {
        Action::Relay => relay(upstream, client, pooled, req, Cut::None, shared).await,
        Action::Delay(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            relay(upstream, client, pooled, req, Cut::None, shared).await
        }
        Action::ResetRequestBody => {
            relay(upstream, client, pooled, req, Cut::RequestBody, shared).await
        }
        Action::ResetResponseBody(claim) => {
            relay(
                upstream,
                client,
                pooled,
                req,
                Cut::ResponseBody(claim),
                shared,
            )
            .await
        }
        Action::Error(status) => {
            discard_body(client, req).await?;
            let reply = s3_error_response(status, request_id, head_only, !req.keep_alive);
            client.stream.write_all(&reply).await?;
            Ok(if req.keep_alive {
                Next::KeepAlive
            } else {
                Next::Close
            })
        }
        Action::LosePart => {
            discard_body(client, req).await?;
            let etag = format!("\"6c6f737470617274{:016x}\"", lost_part_serial());
            let reply = synthetic_response(
                200,
                &[("ETag", &etag), ("x-amz-request-id", request_id)],
                "",
                false,
                !req.keep_alive,
            );
            client.stream.write_all(&reply).await?;
            Ok(if req.keep_alive {
                Next::KeepAlive
            } else {
                Next::Close
            })
        }
    }
}

/// A process-wide serial number that makes every fake ETag distinct.
fn lost_part_serial() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SERIAL: AtomicU64 = AtomicU64::new(1);
    SERIAL.fetch_add(1, Ordering::Relaxed)
}

/// Reads and drops a request body the proxy answers itself.
async fn discard_body(client: &mut Conn, req: &Request) -> io::Result<()> {
    if req.framing.is_empty() {
        return Ok(());
    }
    if req.expect_continue {
        client
            .stream
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await?;
    }
    relay_body(client, None, req.framing, false).await?;
    Ok(())
}

/// Where a `ResetMidBody` fault cuts a relayed exchange.
enum Cut {
    None,
    RequestBody,
    ResponseBody(Claim),
}

/// Sends `head` upstream over the pooled connection if it still looks
/// usable, else over a fresh one.
async fn upstream_for(
    upstream: SocketAddr,
    pooled: &mut Option<Conn>,
    head: &[u8],
) -> io::Result<Conn> {
    if let Some(mut conn) = pooled.take().filter(Conn::looks_reusable)
        && conn.stream.write_all(head).await.is_ok()
    {
        return Ok(conn);
    }
    let mut conn = Conn::new(TcpStream::connect(upstream).await?);
    conn.stream.write_all(head).await?;
    Ok(conn)
}

async fn relay(
    upstream: SocketAddr,
    client: &mut Conn,
    pooled: &mut Option<Conn>,
    req: &Request,
    cut: Cut,
    shared: &SharedState,
) -> io::Result<Next> {
    let (cut_request, mut response_claim) = match cut {
        Cut::None => (false, None),
        Cut::RequestBody => (true, None),
        Cut::ResponseBody(claim) => (false, Some(claim)),
    };
    let head_only = req.method == "HEAD";

    let mut up = match upstream_for(upstream, pooled, &req.upstream_head()).await {
        Ok(conn) => conn,
        Err(_) => {
            if let Some(claim) = response_claim.take() {
                give_back(shared, claim);
            }
            // The request body is still unread: answer and close.
            let reply = s3_error_response(502, "ckpt-proxy-upstream", head_only, true);
            client.stream.write_all(&reply).await?;
            return Ok(Next::Close);
        }
    };

    if !req.framing.is_empty() {
        if req.expect_continue {
            client
                .stream
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .await?;
        }
        if relay_body(client, Some(&mut up.stream), req.framing, cut_request).await? == BodyEnd::Cut
        {
            shared.bump(|s| s.resets += 1);
            up.reset();
            return Ok(Next::Reset);
        }
    }

    // Read the final response head, passing interim (1xx) responses on.
    let resp = loop {
        let parsed = match up.read_head().await {
            Ok(Some(raw)) => Response::parse(&raw).ok(),
            Ok(None) | Err(_) => None,
        };
        let Some(resp) = parsed.filter(|r| r.status != 101) else {
            if let Some(claim) = response_claim.take() {
                give_back(shared, claim);
            }
            let reply = s3_error_response(502, "ckpt-proxy-upstream", head_only, !req.keep_alive);
            client.stream.write_all(&reply).await?;
            return Ok(if req.keep_alive {
                Next::KeepAlive
            } else {
                Next::Close
            });
        };
        if resp.status >= 200 {
            break resp;
        }
        client.stream.write_all(&resp.client_head(false)).await?;
    };

    let framing = resp.framing(&req.method)?;
    if framing.is_empty()
        && let Some(claim) = response_claim.take()
    {
        // Nothing to cut: the fault waits for a response that has a body.
        give_back(shared, claim);
    }
    let until_close = framing == Framing::UntilClose;
    let client_keep_alive = req.keep_alive && !until_close;
    client
        .stream
        .write_all(&resp.client_head(!client_keep_alive))
        .await?;
    let end = relay_body(
        &mut up,
        Some(&mut client.stream),
        framing,
        response_claim.is_some(),
    )
    .await?;
    if end == BodyEnd::Cut {
        shared.bump(|s| s.resets += 1);
        up.reset();
        return Ok(Next::Reset);
    }
    if resp.keep_alive && !until_close {
        *pooled = Some(up);
    }
    Ok(if client_keep_alive {
        Next::KeepAlive
    } else {
        Next::Close
    })
}

/// Relays one body from `src` to `dst` (or discards it when `dst` is
/// `None`). With `cut`, stops after about half of it and pauses briefly so
/// the bytes reach the peer before the caller resets the connection.
async fn relay_body(
    src: &mut Conn,
    mut dst: Option<&mut TcpStream>,
    framing: Framing,
    cut: bool,
) -> io::Result<BodyEnd> {
    let end = match framing {
        Framing::Length(n) => {
            if cut {
                src.copy_exact(dst.as_deref_mut(), n / 2).await?;
                BodyEnd::Cut
            } else {
                src.copy_exact(dst.as_deref_mut(), n).await?;
                BodyEnd::Complete
            }
        }
        Framing::Chunked => relay_chunked(src, dst.as_deref_mut(), cut).await?,
        Framing::UntilClose => loop {
            let n = src.fill().await?;
            if n == 0 {
                break BodyEnd::Complete;
            }
            let take = if cut { n / 2 } else { n };
            if let Some(dst) = dst.as_deref_mut() {
                dst.write_all(&src.buffered()[..take]).await?;
            }
            src.pos += take;
            if cut {
                break BodyEnd::Cut;
            }
        },
    };
    if end == BodyEnd::Cut {
        if let Some(dst) = dst {
            dst.flush().await?;
        }
        tokio::time::sleep(RESET_PAUSE).await;
    }
    Ok(end)
}

fn parse_chunk_size(line: &[u8]) -> io::Result<u64> {
    let size = line.split(|&b| b == b';').next().unwrap_or_default();
    let size = trim_ows(size);
    if size.is_empty() || size.len() > 15 {
        return Err(malformed("bad chunk size"));
    }
    size.iter().try_fold(0u64, |acc, &b| {
        let digit = (b as char)
            .to_digit(16)
            .ok_or_else(|| malformed("bad chunk size"))?;
        Ok(acc * 16 + u64::from(digit))
    })
}

/// Relays a chunked body, re-chunking it as it passes. With `cut`, stops in
/// the middle of the first chunk (or before the last chunk of an empty
/// body).
async fn relay_chunked(
    src: &mut Conn,
    mut dst: Option<&mut TcpStream>,
    cut: bool,
) -> io::Result<BodyEnd> {
    loop {
        let size = parse_chunk_size(&src.read_line().await?)?;
        if size == 0 {
            if cut {
                return Ok(BodyEnd::Cut);
            }
            let mut tail = b"0\r\n".to_vec();
            loop {
                let trailer = src.read_line().await?;
                if trailer.is_empty() {
                    break;
                }
                if tail.len() + trailer.len() > MAX_HEAD {
                    return Err(malformed("trailers too large"));
                }
                tail.extend_from_slice(&trailer);
                tail.extend_from_slice(b"\r\n");
            }
            tail.extend_from_slice(b"\r\n");
            if let Some(dst) = dst.as_deref_mut() {
                dst.write_all(&tail).await?;
            }
            return Ok(BodyEnd::Complete);
        }
        if let Some(dst) = dst.as_deref_mut() {
            dst.write_all(format!("{size:x}\r\n").as_bytes()).await?;
        }
        if cut {
            src.copy_exact(dst.as_deref_mut(), size / 2).await?;
            return Ok(BodyEnd::Cut);
        }
        src.copy_exact(dst.as_deref_mut(), size).await?;
        if !src.read_line().await?.is_empty() {
            return Err(malformed("chunk data not followed by CRLF"));
        }
        if let Some(dst) = dst.as_deref_mut() {
            dst.write_all(b"\r\n").await?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(raw: &str) -> Request {
        match Request::parse(raw.as_bytes()) {
            Ok(req) => req,
            Err(e) => panic!("parse failed: {e}"),
        }
    }

    #[test]
    fn parses_request_framing() {
        let req = request("PUT /b/k HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n");
        assert_eq!(req.framing, Framing::Length(5));
        assert!(req.keep_alive);
        let req = request(
            "PUT /b/k HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 5\r\n\
             Connection: close\r\n\r\n",
        );
        assert_eq!(req.framing, Framing::Chunked);
        assert!(!req.keep_alive);
        let head = String::from_utf8_lossy(&req.upstream_head()).into_owned();
        assert!(!head.to_ascii_lowercase().contains("content-length"));
        assert!(!head.to_ascii_lowercase().contains("connection"));
        let req = request("GET / HTTP/1.1\r\n\r\n");
        assert_eq!(req.framing, Framing::Length(0));
    }

    #[test]
    fn rejects_malformed_requests() {
        for raw in [
            "GET /\r\n\r\n",
            "GET / HTTP/2.0\r\n\r\n",
            "GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
            "GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
            "PUT / HTTP/1.1\r\nContent-Length: 5, 6\r\n\r\n",
            "PUT / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            "PUT / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        ] {
            assert!(Request::parse(raw.as_bytes()).is_err(), "accepted {raw:?}");
        }
    }

    #[test]
    fn recognises_upload_part() {
        assert!(
            request("PUT /b/k?partNumber=1&uploadId=abc HTTP/1.1\r\n\r\n")
                .is_multipart_part_upload()
        );
        assert!(!request("PUT /b/k?uploadId=abc HTTP/1.1\r\n\r\n").is_multipart_part_upload());
        assert!(
            !request("POST /b/k?partNumber=1&uploadId=abc HTTP/1.1\r\n\r\n")
                .is_multipart_part_upload()
        );
        assert!(!request("PUT /b/k HTTP/1.1\r\n\r\n").is_multipart_part_upload());
    }

    #[test]
    fn parses_chunk_sizes() {
        assert_eq!(parse_chunk_size(b"1a").ok(), Some(26));
        assert_eq!(parse_chunk_size(b"10;ext=1").ok(), Some(16));
        assert!(parse_chunk_size(b"").is_err());
        assert!(parse_chunk_size(b"zz").is_err());
        assert!(parse_chunk_size(b"ffffffffffffffffff").is_err());
    }

    #[test]
    fn parses_status_lines() {
        let resp = match Response::parse(b"HTTP/1.1 204 No Content\r\n\r\n") {
            Ok(resp) => resp,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(resp.status, 204);
        assert_eq!(resp.framing("GET").ok(), Some(Framing::Length(0)));
        assert!(Response::parse(b"HTTP/1.1 2x4 No\r\n\r\n").is_err());
    }

    #[test]
    fn faults_claim_in_order_and_hand_back() {
        let shared = SharedState::default();
        {
            let mut state = shared.lock();
            for (id, fault) in [
                StorageFault::LosePart { count: 1 },
                StorageFault::ResetMidBody { count: 1 },
                StorageFault::Errors {
                    status: 503,
                    count: 1,
                },
            ]
            .into_iter()
            .enumerate()
            {
                state.queue.push_back(Pending {
                    id: id as u64,
                    fault,
                    remaining: fault.count(),
                });
            }
        }
        let get = request("GET /b/k HTTP/1.1\r\n\r\n");
        let Action::ResetResponseBody(claim) = claim_fault(&shared, &get) else {
            panic!("GET not claimed by ResetMidBody");
        };
        give_back(&shared, claim);
        let ids: Vec<u64> = shared.lock().queue.iter().map(|p| p.id).collect();
        assert_eq!(ids, [0, 1, 2]);
        let part =
            request("PUT /b/k?partNumber=2&uploadId=u HTTP/1.1\r\nContent-Length: 3\r\n\r\n");
        assert!(matches!(claim_fault(&shared, &part), Action::LosePart));
        assert!(matches!(
            claim_fault(&shared, &part),
            Action::ResetRequestBody
        ));
        assert!(matches!(claim_fault(&shared, &part), Action::Error(503)));
        assert!(matches!(claim_fault(&shared, &part), Action::Relay));
        let stats = shared.lock().stats.clone();
        assert_eq!((stats.requests, stats.errors, stats.lost_parts), (5, 1, 1));
    }

    #[test]
    fn faults_serialize_with_kind_tag() {
        let json = serde_json::to_string(&StorageFault::ResetMidBody { count: 2 }).ok();
        assert_eq!(
            json.as_deref(),
            Some(r#"{"kind":"reset-mid-body","count":2}"#)
        );
        let back: Option<StorageFault> =
            serde_json::from_str(r#"{"kind":"errors","status":503,"count":3}"#).ok();
        assert_eq!(
            back,
            Some(StorageFault::Errors {
                status: 503,
                count: 3
            })
        );
    }

    #[test]
    fn resolves_upstreams() {
        assert!(resolve_upstream("http://127.0.0.1:5555").is_ok());
        assert!(resolve_upstream("http://127.0.0.1:5555/").is_ok());
        assert!(resolve_upstream("https://127.0.0.1:5555").is_err());
        assert!(resolve_upstream("http://127.0.0.1:5555/bucket").is_err());
    }
}
