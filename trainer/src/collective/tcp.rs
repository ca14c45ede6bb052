//! The TCP backend: a ring over one connection to each neighbour.
//!
//! Rank `r` writes to rank `r+1` and reads from rank `r-1` (mod the world size).
//! All-gather and reduce-scatter are the classic rings (`W-1` steps, each moving one
//! shard), so each rank sends `(W-1)/W` of the buffer: bandwidth-optimal, and the
//! uneven shards of dim-0 splits are the ring's segments as they are. An all-reduce
//! is a reduce-scatter followed by an all-gather. In each step the send runs on a
//! scoped thread while the calling thread receives (a large write could otherwise
//! fill both socket buffers and deadlock the ring); steps of at most 32 KiB write
//! inline, since a matched ring step never finds the peer's buffer full.
//!
//! Bootstrap: rank 0 listens on the rendezvous address (`MASTER_ADDR:MASTER_PORT`
//! when launched), every rank binds a data listener on the interface it reaches the
//! rendezvous from and reports it; rank 0 answers everyone with the table of
//! addresses; each rank then connects to its successor and accepts its predecessor.
//! With a job secret configured ([`TcpConfig::secret`]), every connection first runs
//! the job-secret handshake of `ckpt_auth` (a mutual HMAC challenge, the secret never
//! sent), before a byte of the ring's own protocol: whoever can reach the rendezvous
//! port or a data listener on a shared cluster (another job's process, a stale one of
//! this job, a port scanner) could otherwise take a rank's place in the table or a
//! neighbour's place in the ring, and read or corrupt its gradients. A connection
//! that fails the check is closed, counted ([`TcpCollective::refused_connections`])
//! and logged, and the listener goes on waiting for the right peer until the
//! bootstrap's deadline, so a stranger can neither make the bootstrap fail nor be
//! taken for a neighbour; each candidate's handshake runs on a thread of its own, so
//! a stranger that connects and stays silent does not hold up the peers behind it.
//! A connection this rank opens whose peer does not prove the secret is an error
//! naming that peer: another process holds its address.
//! An elastic world skips the rank-0 rendezvous ([`TcpCollective::from_peers`]): its
//! control plane's key-value space carries the addresses, so no rank is special and
//! losing any one of them does not stop the survivors from forming the next ring. The
//! ring handshake carries the generation, so a stale rank cannot join a newer ring.
//!
//! Failure: socket read and write timeouts bound every blocking call, so an operation
//! fails when a peer makes no progress for [`TcpConfig::timeout`]. On any error the
//! communicator shuts its sockets down (this is also what [`Collective::abort`]
//! does from another thread: `shutdown` wakes a blocked `read` or `write`), which
//! its neighbours see at once as a lost peer, and so on around the ring.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use ckpt_auth::{AuthError, Gatekeeper, JobSecret};

use super::{
    Collective, CollectiveError, CollectiveResult, Summable, pod_bytes, pod_bytes_mut, shard_counts,
};

/// Settings of a TCP communicator.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// An operation fails when a peer makes no progress for this long. Default 60 s.
    pub timeout: Duration,
    /// How long bootstrap waits for every rank to show up. Default 120 s.
    pub connect_timeout: Duration,
    /// The job's secret. When set, every connection the ring accepts (rank 0's
    /// rendezvous listener, each rank's data listener) must prove it before anything
    /// else is read from it, and every connection the ring opens proves it right
    /// after connecting (see `ckpt_auth` for the handshake). A connection that fails
    /// the check is closed, counted ([`TcpCollective::refused_connections`]) and
    /// logged, and the wait for the right peer goes on; a peer this rank connects to
    /// that does not prove it fails the bootstrap, naming that peer. Every rank of a
    /// world needs the same setting. Default `None`: whoever reaches the ports may
    /// join, as suits a cluster that the job owns.
    pub secret: Option<JobSecret>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(120),
            secret: None,
        }
    }
}

const MAGIC: &[u8; 8] = b"CKPTRING";
const INLINE_SEND: usize = 32 << 10;

/// The tag of each transfer, checked by the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Tag {
    AllGather = 1,
    ReduceScatter = 2,
    Broadcast = 3,
}

struct Links {
    /// To rank + 1.
    next: TcpStream,
    /// From rank - 1.
    prev: TcpStream,
}

/// A communicator over TCP (one process per rank, or threads in tests).
pub struct TcpCollective {
    rank: usize,
    world: usize,
    config: TcpConfig,
    links: Mutex<Option<Links>>,
    /// Clones of the sockets, for `abort` and poisoning without taking the lock.
    handles: Vec<TcpStream>,
    aborted: AtomicBool,
    poisoned: Mutex<Option<CollectiveError>>,
    /// Checks the job secret of every connection the bootstrap accepted, and counts
    /// the refused ones.
    gate: Arc<Gatekeeper>,
}

impl std::fmt::Debug for TcpCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("aborted", &self.aborted.load(Ordering::Relaxed))
            .field("refused_connections", &self.gate.refused())
            .finish()
    }
}

fn io_err(op: &'static str, peer: Option<usize>, e: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::Io {
        op,
        peer,
        message: e.to_string(),
    }
}

/// Never aborts: the bootstrap of a fixed world (rank 0 as rendezvous) is cut short
/// only by its deadline.
fn never() -> bool {
    false
}

/// How many job-secret handshakes one listener runs at once. More connections wait
/// in the listener's backlog meanwhile (they are not refused: the rendezvous of a large
/// world sees all its ranks at once, and a rank's own handshake waits for its turn
/// until the bootstrap's deadline). Below [`ckpt_auth::MAX_HANDSHAKES`], the
/// gatekeeper's own bound, which would refuse the excess instead.
const MAX_ADMISSIONS: usize = 16;

/// The note that a bootstrap timeout adds when connections were refused for not
/// proving the job secret: the likely reason why a rank never showed up.
fn refusals(gate: &Gatekeeper) -> String {
    match gate.refused() {
        0 => String::new(),
        1 => "; 1 connection was refused for not proving the job secret".to_string(),
        n => format!("; {n} connections were refused for not proving the job secret"),
    }
}

/// A listener that hands out only the connections whose peer proved the job secret
/// (all of them when there is none).
///
/// Each candidate's handshake runs on a thread of its own, which reports the admitted
/// stream (or the refusal) over a channel that the accept loop polls between accepts.
/// Why not a handshake on the accepting thread with a shorter bound per candidate: a
/// stranger that connects and stays silent would then hold the loop for that bound,
/// once per stranger, and a bound short enough not to matter would refuse a rank on a
/// loaded host; the right peer, queued behind, would see its own handshake stall. A
/// thread per candidate is cheap here (a handful per bootstrap, at most
/// [`MAX_ADMISSIONS`] at once), and a silent stranger holds only its own, for
/// [`ckpt_auth::HANDSHAKE_TIMEOUT`], also after the bootstrap returned (its
/// connection is then refused and dropped).
struct Door<'a> {
    listener: &'a TcpListener,
    gate: Arc<Gatekeeper>,
    tx: Sender<Option<TcpStream>>,
    rx: Receiver<Option<TcpStream>>,
    /// Handshakes started whose outcome was not received yet.
    in_flight: usize,
}

impl<'a> Door<'a> {
    fn new(
        listener: &'a TcpListener,
        gate: &Arc<Gatekeeper>,
        op: &'static str,
    ) -> CollectiveResult<Self> {
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err(op, None, e))?;
        let (tx, rx) = channel();
        Ok(Self {
            listener,
            gate: Arc::clone(gate),
            tx,
            rx,
            in_flight: 0,
        })
    }

    /// Polls the non-blocking listener until an admitted connection arrives, the
    /// deadline passes or `aborted` says so (checked every poll, so an elastic agent
    /// can cancel a bootstrap whose peers will never come).
    fn accept_until(
        &mut self,
        deadline: Instant,
        op: &'static str,
        aborted: &dyn Fn() -> bool,
    ) -> CollectiveResult<TcpStream> {
        loop {
            while let Ok(outcome) = self.rx.try_recv() {
                self.in_flight -= 1;
                if let Some(stream) = outcome {
                    return Ok(stream);
                }
            }
            if self.in_flight < MAX_ADMISSIONS {
                match self.listener.accept() {
                    Ok((stream, peer)) => {
                        stream
                            .set_nonblocking(false)
                            .map_err(|e| io_err(op, None, e))?;
                        if self.gate.secret().is_none() {
                            return Ok(stream);
                        }
                        self.screen(stream, peer);
                        continue;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => return Err(io_err(op, None, e)),
                }
            }
            if aborted() {
                return Err(CollectiveError::Aborted { op });
            }
            if Instant::now() >= deadline {
                return Err(io_err(
                    op,
                    None,
                    format!(
                        "timed out waiting for a peer to connect{}",
                        refusals(&self.gate)
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Starts the handshake of the connection from `peer`; its outcome arrives on
    /// the channel (a refused connection is closed once the gatekeeper counted it).
    fn screen(&mut self, stream: TcpStream, peer: SocketAddr) {
        let gate = Arc::clone(&self.gate);
        let tx = self.tx.clone();
        let started = std::thread::Builder::new()
            .name("ckpt-ring-admit".into())
            .spawn(move || {
                let admitted = gate.admit(&stream, peer);
                // The receiver is gone when the bootstrap already returned.
                let _ = tx.send(admitted.then_some(stream));
            });
        match started {
            Ok(_) => self.in_flight += 1,
            // The closure, and with it the connection, was dropped.
            Err(e) => self.gate.record(peer, &AuthError::Io(e)),
        }
    }
}

/// Proves the job secret (when there is one) on a connection this rank opened,
/// waiting for the peer's answers until `deadline`: the peer may have bound and
/// published its listener before it accepts (a successor still starting), which is
/// a wait, not a failure; a wrong process answers wrongly, or closes, at once.
fn prove_until(
    stream: &TcpStream,
    secret: Option<&JobSecret>,
    deadline: Instant,
) -> Result<(), AuthError> {
    match secret {
        None => Ok(()),
        Some(secret) => ckpt_auth::prove_tcp_within(
            stream,
            secret,
            deadline.saturating_duration_since(Instant::now()),
        ),
    }
}

/// Why the job-secret handshake with the peer at `addr` failed, for an error that
/// names the peer (the caller adds its rank).
fn handshake_failure(addr: SocketAddr, e: &AuthError) -> String {
    let why = match e {
        AuthError::Io(io) if matches!(io.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            "no answer before the bootstrap's deadline".to_string()
        }
        AuthError::Io(io)
            if matches!(
                io.kind(),
                ErrorKind::UnexpectedEof
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::BrokenPipe
            ) =>
        {
            format!(
                "the peer closed the connection ({io}): it runs without the job secret, or it is not this job's process"
            )
        }
        AuthError::ServerUnproven => "it did not prove the job secret that this rank holds \
             (another job's process holds that address, or this rank's secret is not the job's)"
            .to_string(),
        e => e.to_string(),
    };
    format!("{addr} failed the job-secret handshake: {why}")
}

fn read_u32(stream: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    stream.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn write_str(stream: &mut TcpStream, s: &str) -> std::io::Result<()> {
    stream.write_all(&(s.len() as u32).to_le_bytes())?;
    stream.write_all(s.as_bytes())
}

fn read_str(stream: &mut TcpStream) -> std::io::Result<String> {
    let len = read_u32(stream)? as usize;
    if len > 1024 {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "address too long",
        ));
    }
    let mut b = vec![0u8; len];
    stream.read_exact(&mut b)?;
    String::from_utf8(b).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
}

fn parse_addr(table: &[String], rank: usize) -> CollectiveResult<SocketAddr> {
    table[rank].parse().map_err(|e| {
        io_err(
            "bootstrap",
            Some(rank),
            format!("bad address {:?}: {e}", table[rank]),
        )
    })
}

/// Connects to the successor at `next_addr`, retrying while it is not reachable yet
/// (it may still be starting) until `deadline`, or until `given_up` says the accepting
/// side failed.
fn connect_next(
    next_addr: SocketAddr,
    next_rank: usize,
    deadline: Instant,
    given_up: &dyn Fn() -> bool,
) -> CollectiveResult<TcpStream> {
    let op = "bootstrap";
    loop {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), Duration::from_secs(1));
        match TcpStream::connect_timeout(&next_addr, wait) {
            Ok(stream) => return Ok(stream),
            Err(_) if given_up() => return Err(CollectiveError::Aborted { op }),
            Err(e) if Instant::now() >= deadline => return Err(io_err(op, Some(next_rank), e)),
            Err(e) => {
                tracing::debug!(error = %e, next = %next_addr, "successor not reachable yet");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// How often a wait for the greeting thread checks whether the generation was aborted.
const ABORT_POLL: Duration = Duration::from_millis(10);

/// Sends on its channel when dropped: the greeting thread's end, however it ends.
struct DropSignal(Sender<()>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// Waits until the greeting thread is done (`over` says so), or the generation is
/// aborted first.
fn greeting_unless_aborted(
    over: &Receiver<()>,
    aborted: &dyn Fn() -> bool,
) -> CollectiveResult<()> {
    loop {
        match over.recv_timeout(ABORT_POLL) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return Ok(()),
            Err(RecvTimeoutError::Timeout) if aborted() => {
                return Err(CollectiveError::Aborted { op: "bootstrap" });
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
}

/// The outgoing half of joining the ring: proves the job secret to the successor
/// (when there is one), then sends the ring's handshake (rank and generation).
fn greet(
    mut next: TcpStream,
    secret: Option<&JobSecret>,
    rank: usize,
    generation: u64,
    next_rank: usize,
    next_addr: SocketAddr,
    deadline: Instant,
) -> CollectiveResult<TcpStream> {
    let op = "bootstrap";
    prove_until(&next, secret, deadline)
        .map_err(|e| io_err(op, Some(next_rank), handshake_failure(next_addr, &e)))?;
    next.write_all(MAGIC)
        .and_then(|_| next.write_all(&(rank as u32).to_le_bytes()))
        .and_then(|_| next.write_all(&generation.to_le_bytes()))
        .map_err(|e| io_err(op, Some(next_rank), e))?;
    Ok(next)
}

/// The incoming half of joining the ring: accepts until the predecessor of this
/// generation shows up (having proved the job secret, when there is one); anything
/// else (a stale rank of an older generation, a port scanner, a process without the
/// secret) is dropped with a warning.
fn accept_prev(
    door: &mut Door<'_>,
    rank: usize,
    prev_rank: usize,
    generation: u64,
    config: &TcpConfig,
    deadline: Instant,
    stop: &dyn Fn() -> bool,
) -> CollectiveResult<TcpStream> {
    let op = "bootstrap";
    loop {
        let mut stream = door.accept_until(deadline, op, stop).map_err(|e| match e {
            CollectiveError::Aborted { .. } => e,
            e => io_err(op, Some(prev_rank), e),
        })?;
        stream
            .set_read_timeout(Some(config.connect_timeout.min(Duration::from_secs(10))))
            .map_err(|e| io_err(op, Some(prev_rank), e))?;
        let hello = (|| -> std::io::Result<(usize, u64)> {
            let mut magic = [0u8; 8];
            stream.read_exact(&mut magic)?;
            if &magic != MAGIC {
                return Err(std::io::Error::new(ErrorKind::InvalidData, "bad magic"));
            }
            let who = read_u32(&mut stream)? as usize;
            let mut g = [0u8; 8];
            stream.read_exact(&mut g)?;
            Ok((who, u64::from_le_bytes(g)))
        })();
        match hello {
            Ok((who, g)) if who == prev_rank && g == generation => return Ok(stream),
            Ok((who, g)) => tracing::warn!(
                rank,
                generation,
                "refused rank {who} of generation {g}: expected rank {prev_rank} of generation {generation}"
            ),
            Err(e) => tracing::warn!(rank, error = %e, "ignoring a bad ring connection"),
        }
    }
}

impl TcpCollective {
    /// Joins the world as `rank` of `world`; rank 0 listens on `rendezvous`, the
    /// others connect to it (retrying until [`TcpConfig::connect_timeout`]).
    pub fn bootstrap(
        rank: usize,
        world: usize,
        rendezvous: SocketAddr,
        config: TcpConfig,
    ) -> CollectiveResult<Self> {
        let op = "bootstrap";
        if world == 0 || rank >= world {
            return Err(CollectiveError::Invalid {
                op,
                message: format!("rank {rank} is not in world size {world}"),
            });
        }
        if world == 1 {
            return Ok(Self::single(config));
        }
        if rank == 0 {
            let listener = TcpListener::bind(rendezvous)
                .map_err(|e| io_err(op, None, format!("binding rendezvous {rendezvous}: {e}")))?;
            return Self::bootstrap_root(listener, world, config);
        }
        let deadline = Instant::now() + config.connect_timeout;
        let mut master = loop {
            match TcpStream::connect_timeout(&rendezvous, Duration::from_secs(1)) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "rendezvous not reachable yet");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    return Err(io_err(
                        op,
                        Some(0),
                        format!("rendezvous {rendezvous} unreachable: {e}"),
                    ));
                }
            }
        };
        prove_until(&master, config.secret.as_ref(), deadline)
            .map_err(|e| io_err(op, Some(0), handshake_failure(rendezvous, &e)))?;
        master
            .set_read_timeout(Some(config.connect_timeout))
            .map_err(|e| io_err(op, Some(0), e))?;
        let ip = master
            .local_addr()
            .map_err(|e| io_err(op, Some(0), e))?
            .ip();
        let listener = TcpListener::bind((ip, 0)).map_err(|e| io_err(op, None, e))?;
        let me = listener.local_addr().map_err(|e| io_err(op, None, e))?;
        let table = (|| -> std::io::Result<Vec<String>> {
            master.write_all(MAGIC)?;
            master.write_all(&(rank as u32).to_le_bytes())?;
            master.write_all(&(world as u32).to_le_bytes())?;
            write_str(&mut master, &me.to_string())?;
            let n = read_u32(&mut master)? as usize;
            if n != world {
                return Err(std::io::Error::new(
                    ErrorKind::InvalidData,
                    format!("rendezvous answered a table of {n} ranks, expected {world}"),
                ));
            }
            (0..n).map(|_| read_str(&mut master)).collect()
        })()
        .map_err(|e| match e.kind() {
            // What a rendezvous that requires a job secret does to a rank without it.
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset if config.secret.is_none() => {
                io_err(
                    op,
                    Some(0),
                    format!(
                        "the rendezvous {rendezvous} closed the connection ({e}): does it require a job secret that this rank lacks?"
                    ),
                )
            }
            _ => io_err(op, Some(0), e),
        })?;
        let next_addr = parse_addr(&table, (rank + 1) % world)?;
        let gate = Gatekeeper::new("ring", config.secret.clone());
        Self::connect_ring(
            rank, world, 0, listener, next_addr, config, gate, deadline, &never,
        )
    }

    /// Rank 0's side of the bootstrap, on an already bound rendezvous listener (tests
    /// bind port 0 and hand the address to the other ranks).
    pub fn bootstrap_root(
        rendezvous: TcpListener,
        world: usize,
        config: TcpConfig,
    ) -> CollectiveResult<Self> {
        let op = "bootstrap";
        if world == 1 {
            return Ok(Self::single(config));
        }
        let deadline = Instant::now() + config.connect_timeout;
        let ip = rendezvous
            .local_addr()
            .map_err(|e| io_err(op, None, e))?
            .ip();
        let listener = TcpListener::bind((ip, 0)).map_err(|e| io_err(op, None, e))?;
        let mut table = vec![String::new(); world];
        table[0] = listener
            .local_addr()
            .map_err(|e| io_err(op, None, e))?
            .to_string();
        let gate = Gatekeeper::new("ring", config.secret.clone());
        let mut door = Door::new(&rendezvous, &gate, op)?;
        let mut joined: Vec<(usize, TcpStream)> = Vec::with_capacity(world - 1);
        while joined.len() < world - 1 {
            let mut stream = door.accept_until(deadline, op, &never).map_err(|_| {
                io_err(
                    op,
                    None,
                    format!(
                        "only {} of {world} ranks joined within {:?}{}",
                        joined.len() + 1,
                        config.connect_timeout,
                        refusals(&gate)
                    ),
                )
            })?;
            stream
                .set_read_timeout(Some(config.connect_timeout))
                .map_err(|e| io_err(op, None, e))?;
            let hello = (|| -> std::io::Result<(usize, usize, String)> {
                let mut magic = [0u8; 8];
                stream.read_exact(&mut magic)?;
                if &magic != MAGIC {
                    return Err(std::io::Error::new(ErrorKind::InvalidData, "bad magic"));
                }
                let rank = read_u32(&mut stream)? as usize;
                let their_world = read_u32(&mut stream)? as usize;
                Ok((rank, their_world, read_str(&mut stream)?))
            })();
            let (rank, their_world, addr) = match hello {
                Ok(hello) => hello,
                Err(e) => {
                    tracing::warn!(error = %e, "ignoring a bad rendezvous connection");
                    continue;
                }
            };
            if their_world != world || rank == 0 || rank >= world || !table[rank].is_empty() {
                return Err(CollectiveError::Invalid {
                    op,
                    message: format!(
                        "rank {rank} of world {their_world} joined a world of {world} (duplicate or out of range)"
                    ),
                });
            }
            table[rank] = addr;
            joined.push((rank, stream));
        }
        for (rank, stream) in &mut joined {
            (|| -> std::io::Result<()> {
                stream.write_all(&(world as u32).to_le_bytes())?;
                for addr in &table {
                    write_str(stream, addr)?;
                }
                stream.flush()
            })()
            .map_err(|e| io_err(op, Some(*rank), e))?;
        }
        drop(door);
        let next_addr = parse_addr(&table, 1)?;
        Self::connect_ring(
            0, world, 0, listener, next_addr, config, gate, deadline, &never,
        )
    }

    fn single(config: TcpConfig) -> Self {
        let gate = Gatekeeper::new("ring", config.secret.clone());
        Self {
            rank: 0,
            world: 1,
            config,
            links: Mutex::new(None),
            handles: Vec::new(),
            aborted: AtomicBool::new(false),
            poisoned: Mutex::new(None),
            gate,
        }
    }

    /// How many connections the bootstrap of this communicator refused because they
    /// did not prove the job secret ([`TcpConfig::secret`]; always 0 without one).
    /// Counted until the last handshake started ends: a stranger's connection still
    /// in its handshake when the bootstrap returned is counted when it fails.
    pub fn refused_connections(&self) -> u64 {
        self.gate.refused()
    }

    /// Joins the ring of an elastic world whose membership a control plane fixed:
    /// this rank already bound `listener` (and published its address), and learned
    /// `next`, its successor's listener. The handshake carries `generation`: a rank of
    /// another generation (a stale member that woke up) is refused instead of joining.
    /// `aborted` is polled while waiting, so the agent can cancel a bootstrap whose
    /// peers are gone.
    pub fn from_peers(
        rank: usize,
        world: usize,
        generation: u64,
        listener: TcpListener,
        next: SocketAddr,
        config: TcpConfig,
        aborted: &dyn Fn() -> bool,
    ) -> CollectiveResult<Self> {
        if world == 0 || rank >= world {
            return Err(CollectiveError::Invalid {
                op: "bootstrap",
                message: format!("rank {rank} is not in world size {world}"),
            });
        }
        if world == 1 {
            return Ok(Self::single(config));
        }
        let deadline = Instant::now() + config.connect_timeout;
        let gate = Gatekeeper::new("ring", config.secret.clone());
        Self::connect_ring(
            rank, world, generation, listener, next, config, gate, deadline, aborted,
        )
    }

    /// Connects to the successor at `next_addr` and accepts the predecessor on
    /// `listener`. The outgoing half (connecting, then the job secret's handshake and
    /// the ring's) runs on a thread of its own while this thread accepts: every rank
    /// connects before it accepts, so a rank that waited for its successor before
    /// accepting would wait for a successor waiting in turn, around the ring, and a
    /// predecessor's handshake would stall meanwhile (a rank of another job would
    /// learn only at its deadline that this one refuses it).
    #[allow(clippy::too_many_arguments)]
    fn connect_ring(
        rank: usize,
        world: usize,
        generation: u64,
        listener: TcpListener,
        next_addr: SocketAddr,
        config: TcpConfig,
        gate: Arc<Gatekeeper>,
        deadline: Instant,
        aborted: &dyn Fn() -> bool,
    ) -> CollectiveResult<Self> {
        let op = "bootstrap";
        let next_rank = (rank + 1) % world;
        let prev_rank = (rank + world - 1) % world;
        let mut door = Door::new(&listener, &gate, op)?;
        let greeting_failed = AtomicBool::new(false);
        let accepting_failed = AtomicBool::new(false);
        // A clone of the connection to the successor, shut down to wake the greeting
        // thread when the accepting side fails first.
        let next_handle = OnceLock::new();
        let stop = || aborted() || greeting_failed.load(Ordering::SeqCst);
        // Says when the greeting thread is done, for a wait that also watches `aborted`.
        let (greeting_done, greeting_over) = channel::<()>();
        let (greeted, accepted) = std::thread::scope(|scope| {
            let greeter = {
                let secret = config.secret.as_ref();
                let (failed, given_up, handle) =
                    (&greeting_failed, &accepting_failed, &next_handle);
                scope.spawn(move || {
                    let _done = DropSignal(greeting_done);
                    let given_up = || given_up.load(Ordering::SeqCst);
                    let greeted =
                        connect_next(next_addr, next_rank, deadline, &given_up).and_then(|next| {
                            let clone = next
                                .try_clone()
                                .map_err(|e| io_err(op, Some(next_rank), e))?;
                            let _ = handle.set(clone);
                            // The accepting side failed before the clone was there to
                            // shut down.
                            if given_up() {
                                return Err(CollectiveError::Aborted { op });
                            }
                            greet(
                                next, secret, rank, generation, next_rank, next_addr, deadline,
                            )
                        });
                    if greeted.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    greeted
                })
            };
            // Once the predecessor is in, the greeting may still be under way (a
            // successor that refuses connections is retried until the deadline): a
            // cancelled generation must end it as it ends the accepting, or the rank
            // stays in a ring of a generation that is over, and misses the next one.
            let accepted = accept_prev(
                &mut door, rank, prev_rank, generation, &config, deadline, &stop,
            )
            .and_then(|prev| greeting_unless_aborted(&greeting_over, aborted).map(|()| prev));
            if accepted.is_err() {
                accepting_failed.store(true, Ordering::SeqCst);
                if let Some(next) = next_handle.get() {
                    let _ = next.shutdown(Shutdown::Both);
                }
            }
            let greeted = greeter.join().unwrap_or_else(|_| {
                Err(CollectiveError::Invalid {
                    op,
                    message: "the thread greeting the successor panicked".into(),
                })
            });
            (greeted, accepted)
        });
        let (next, prev) = match (greeted, accepted) {
            (Ok(next), Ok(prev)) => (next, prev),
            // The accepting side stopped because the greeting failed: that failure is
            // the error (the successor is the wrong process, or gone).
            // Connections refused meanwhile are part of the story (a rank holding another
            // secret may be why the successor gave up), so the error counts them too.
            (Err(e), Err(CollectiveError::Aborted { .. })) if !aborted() => {
                return Err(match e {
                    CollectiveError::Io { op, peer, message } => CollectiveError::Io {
                        op,
                        peer,
                        message: format!("{message}{}", refusals(&gate)),
                    },
                    e => e,
                });
            }
            (_, Err(e)) | (Err(e), Ok(_)) => return Err(e),
        };
        for s in [&next, &prev] {
            s.set_nodelay(true).map_err(|e| io_err(op, None, e))?;
            s.set_read_timeout(Some(config.timeout))
                .map_err(|e| io_err(op, None, e))?;
            s.set_write_timeout(Some(config.timeout))
                .map_err(|e| io_err(op, None, e))?;
        }
        let handles = vec![
            next.try_clone().map_err(|e| io_err(op, None, e))?,
            prev.try_clone().map_err(|e| io_err(op, None, e))?,
        ];
        Ok(Self {
            rank,
            world,
            config,
            links: Mutex::new(Some(Links { next, prev })),
            handles,
            aborted: AtomicBool::new(false),
            poisoned: Mutex::new(None),
            gate,
        })
    }

    fn next_rank(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn prev_rank(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// Takes the links for one operation, or the error that poisoned them.
    fn begin(&self, op: &'static str) -> CollectiveResult<MutexGuard<'_, Option<Links>>> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(CollectiveError::Aborted { op });
        }
        if let Some(e) = self
            .poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Err(e);
        }
        Ok(self.links.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Records the first error and shuts the sockets down, so that the other half of
    /// a ring step wakes up and the neighbours learn of the failure.
    fn fail(&self, e: CollectiveError) -> CollectiveError {
        let first = {
            let mut poisoned = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
            poisoned.get_or_insert(e).clone()
        };
        for s in &self.handles {
            let _ = s.shutdown(Shutdown::Both);
        }
        if self.aborted.load(Ordering::SeqCst) {
            return CollectiveError::Aborted { op: first.op() };
        }
        first
    }

    fn classify(&self, op: &'static str, peer: usize, e: std::io::Error) -> CollectiveError {
        if self.aborted.load(Ordering::SeqCst) {
            return CollectiveError::Aborted { op };
        }
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => CollectiveError::Timeout {
                op,
                peer,
                timeout: self.config.timeout,
            },
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe
            | ErrorKind::NotConnected => CollectiveError::PeerLost {
                op,
                peer,
                detail: if e.kind() == ErrorKind::UnexpectedEof {
                    "connection closed".to_string()
                } else {
                    e.to_string()
                },
            },
            _ => io_err(op, Some(peer), e),
        }
    }

    fn send(
        &self,
        stream: &mut TcpStream,
        op: &'static str,
        tag: Tag,
        data: &[u8],
    ) -> CollectiveResult {
        let mut header = [0u8; 12];
        header[..4].copy_from_slice(&(tag as u32).to_le_bytes());
        header[4..].copy_from_slice(&(data.len() as u64).to_le_bytes());
        stream
            .write_all(&header)
            .and_then(|_| stream.write_all(data))
            .map_err(|e| self.classify(op, self.next_rank(), e))
    }

    fn recv(
        &self,
        stream: &mut TcpStream,
        op: &'static str,
        tag: Tag,
        out: &mut [u8],
    ) -> CollectiveResult {
        let peer = self.prev_rank();
        let mut header = [0u8; 12];
        stream
            .read_exact(&mut header)
            .map_err(|e| self.classify(op, peer, e))?;
        let their_tag = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
        let len = u64::from_le_bytes(header[4..].try_into().expect("8 bytes"));
        if their_tag != tag as u32 || len != out.len() as u64 {
            return Err(CollectiveError::Invalid {
                op,
                message: format!(
                    "rank {peer} sent operation {their_tag} with {len} bytes, expected operation {} with {} bytes (ranks disagree on the sequence of collectives)",
                    tag as u32,
                    out.len()
                ),
            });
        }
        stream
            .read_exact(out)
            .map_err(|e| self.classify(op, peer, e))
    }

    /// One ring step: send `send` to the successor while receiving `recv` from the
    /// predecessor.
    fn exchange(
        &self,
        links: &mut Links,
        op: &'static str,
        tag: Tag,
        send: &[u8],
        recv: &mut [u8],
    ) -> CollectiveResult {
        let Links { next, prev } = links;
        let result = if send.len() <= INLINE_SEND {
            self.send(next, op, tag, send)
                .and_then(|_| self.recv(prev, op, tag, recv))
        } else {
            std::thread::scope(|scope| {
                let sender = scope.spawn(|| {
                    let r = self.send(next, op, tag, send);
                    if let Err(e) = &r {
                        self.fail(e.clone());
                    }
                    r
                });
                let received = self.recv(prev, op, tag, recv);
                if let Err(e) = &received {
                    self.fail(e.clone());
                }
                let sent = sender.join().unwrap_or_else(|_| {
                    Err(CollectiveError::Invalid {
                        op,
                        message: "sender thread panicked".into(),
                    })
                });
                sent.and(received)
            })
        };
        result.map_err(|e| self.fail(e))
    }

    /// Ring all-gather over `buf`, segments given by `offsets` (len W+1); each rank's
    /// own segment is already in place.
    fn ring_all_gather(
        &self,
        links: &mut Links,
        op: &'static str,
        buf: &mut [u8],
        offsets: &[usize],
    ) -> CollectiveResult {
        let (w, r) = (self.world, self.rank);
        for s in 0..w - 1 {
            let send_seg = (r + w - s) % w;
            let recv_seg = (r + w - s - 1) % w;
            let (send, recv) = split(buf, offsets, send_seg, recv_seg);
            self.exchange(links, op, Tag::AllGather, send, recv)?;
        }
        Ok(())
    }

    /// Ring reduce-scatter over `data`: afterwards segment `rank` holds the sum.
    fn ring_reduce_scatter<T: Summable>(
        &self,
        links: &mut Links,
        op: &'static str,
        data: &mut [T],
        offsets: &[usize],
    ) -> CollectiveResult {
        let (w, r) = (self.world, self.rank);
        let largest = offsets.windows(2).map(|p| p[1] - p[0]).max().unwrap_or(0);
        // Zeroed once per call (a calloc for large sizes), then reused by every
        // step: the bytes a receive writes into are always initialized.
        let mut scratch: Vec<T> = vec![T::zeroed(); largest];
        for s in 0..w - 1 {
            let send_seg = (r + 2 * w - 1 - s) % w;
            let recv_seg = (r + 2 * w - 2 - s) % w;
            let recv_len = offsets[recv_seg + 1] - offsets[recv_seg];
            let received = &mut scratch[..recv_len];
            {
                let send = pod_bytes(&data[offsets[send_seg]..offsets[send_seg + 1]]);
                self.exchange(links, op, Tag::ReduceScatter, send, pod_bytes_mut(received))?;
            }
            let target = &mut data[offsets[recv_seg]..offsets[recv_seg + 1]];
            for (t, x) in target.iter_mut().zip(received.iter()) {
                *t = T::add(*t, *x);
            }
        }
        Ok(())
    }

    fn reduce_scatter<T: Summable>(
        &self,
        op: &'static str,
        data: &mut [T],
        counts: &[usize],
        out: &mut [T],
    ) -> CollectiveResult {
        let offsets = self.offsets(op, counts, data.len())?;
        if out.len() != counts[self.rank] {
            return Err(CollectiveError::Invalid {
                op,
                message: format!(
                    "rank {} owns {} elements but the output holds {}",
                    self.rank,
                    counts[self.rank],
                    out.len()
                ),
            });
        }
        let mut links = self.begin(op)?;
        if let Some(links) = links.as_mut() {
            self.ring_reduce_scatter(links, op, data, &offsets)?;
        }
        out.copy_from_slice(&data[offsets[self.rank]..offsets[self.rank + 1]]);
        Ok(())
    }

    fn all_reduce<T: Summable>(&self, op: &'static str, data: &mut [T]) -> CollectiveResult {
        let counts = shard_counts(data.len(), self.world);
        let offsets = self.offsets(op, &counts, data.len())?;
        let mut links = self.begin(op)?;
        let Some(links) = links.as_mut() else {
            return Ok(());
        };
        self.ring_reduce_scatter(links, op, data, &offsets)?;
        let bytes: Vec<usize> = offsets
            .iter()
            .map(|o| o * std::mem::size_of::<T>())
            .collect();
        self.ring_all_gather(links, op, pod_bytes_mut(data), &bytes)
    }

    fn offsets(
        &self,
        op: &'static str,
        counts: &[usize],
        total: usize,
    ) -> CollectiveResult<Vec<usize>> {
        if counts.len() != self.world {
            return Err(CollectiveError::Invalid {
                op,
                message: format!("{} counts for a world of {}", counts.len(), self.world),
            });
        }
        let mut offsets = Vec::with_capacity(self.world + 1);
        let mut at = 0usize;
        offsets.push(0);
        for c in counts {
            at += c;
            offsets.push(at);
        }
        if at != total {
            return Err(CollectiveError::Invalid {
                op,
                message: format!("counts sum to {at} but the buffer holds {total}"),
            });
        }
        Ok(offsets)
    }
}

/// Disjoint segments `a` (read) and `b` (written) of `buf`.
fn split<'a>(buf: &'a mut [u8], offsets: &[usize], a: usize, b: usize) -> (&'a [u8], &'a mut [u8]) {
    let ra = offsets[a]..offsets[a + 1];
    let rb = offsets[b]..offsets[b + 1];
    if ra.end <= rb.start {
        let (lo, hi) = buf.split_at_mut(rb.start);
        (&lo[ra], &mut hi[..rb.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(ra.start);
        (&hi[..ra.len()], &mut lo[rb])
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather(&self, mine: &[u8], counts: &[usize], out: &mut [u8]) -> CollectiveResult {
        let op = "all_gather";
        let offsets = self.offsets(op, counts, out.len())?;
        if mine.len() != counts[self.rank] {
            return Err(CollectiveError::Invalid {
                op,
                message: format!(
                    "rank {} contributes {} bytes but counts say {}",
                    self.rank,
                    mine.len(),
                    counts[self.rank]
                ),
            });
        }
        let mut links = self.begin(op)?;
        out[offsets[self.rank]..offsets[self.rank + 1]].copy_from_slice(mine);
        match links.as_mut() {
            Some(links) => self.ring_all_gather(links, op, out, &offsets),
            None => Ok(()),
        }
    }

    fn reduce_scatter_i64(
        &self,
        data: &mut [i64],
        counts: &[usize],
        out: &mut [i64],
    ) -> CollectiveResult {
        self.reduce_scatter("reduce_scatter_i64", data, counts, out)
    }

    fn reduce_scatter_f32(
        &self,
        data: &mut [f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> CollectiveResult {
        self.reduce_scatter("reduce_scatter_f32", data, counts, out)
    }

    fn all_reduce_i64(&self, data: &mut [i64]) -> CollectiveResult {
        self.all_reduce("all_reduce_i64", data)
    }

    fn all_reduce_f32(&self, data: &mut [f32]) -> CollectiveResult {
        self.all_reduce("all_reduce_f32", data)
    }

    fn broadcast(&self, root: usize, data: &mut [u8]) -> CollectiveResult {
        let op = "broadcast";
        if root >= self.world {
            return Err(CollectiveError::Invalid {
                op,
                message: format!("root {root} is not in world size {}", self.world),
            });
        }
        let mut links = self.begin(op)?;
        let Some(links) = links.as_mut() else {
            return Ok(());
        };
        // Store and forward around the ring in pieces, so ranks overlap.
        let last = (root + self.world - 1) % self.world;
        let piece = 1 << 20;
        let result = (|| {
            let mut at = 0;
            loop {
                let end = (at + piece).min(data.len());
                if self.rank != root {
                    self.recv(&mut links.prev, op, Tag::Broadcast, &mut data[at..end])?;
                }
                if self.rank != last {
                    self.send(&mut links.next, op, Tag::Broadcast, &data[at..end])?;
                }
                if end == data.len() {
                    return Ok(());
                }
                at = end;
            }
        })();
        result.map_err(|e| self.fail(e))
    }

    fn barrier(&self) -> CollectiveResult {
        let counts = vec![1; self.world];
        let mut out = vec![0u8; self.world];
        self.all_gather(&[1], &counts, &mut out)
    }

    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for s in &self.handles {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests;
