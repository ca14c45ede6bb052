//! The copy server, its client, and the replica puller (the protocol is in the
//! [module docs](super)).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use ckpt_auth::{Gatekeeper, JobSecret};

use super::held::Shared;
use super::{CopyConfig, CopyKey, RankCopy};
use crate::budget::{HeldKind, Reservation};
use crate::format::MAX_PART_BYTES;

/// Longest request or answer line, newline included.
const MAX_LINE: usize = 1024;
/// A peer connection idle this long is closed by the server.
const IDLE: Duration = Duration::from_secs(60);
/// Bytes a replica pull asks for per request.
const PULL_PIECE: u64 = 16 << 20;

/// Reads one line of at most `max` bytes (newline included) into `line`, without
/// its newline. `Ok(false)` at the end of the stream (a torn last line included:
/// the peer died in the middle of it); an error for a longer line.
fn read_line(reader: &mut impl BufRead, max: usize, line: &mut Vec<u8>) -> std::io::Result<bool> {
    line.clear();
    let n = reader.by_ref().take(max as u64).read_until(b'\n', line)?;
    if line.last() != Some(&b'\n') {
        if n == max {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("line longer than {max} bytes"),
            ));
        }
        return Ok(false);
    }
    line.pop();
    Ok(true)
}

/// A running copy server: a thread accepting peers, and one thread per peer (which
/// first runs the job-secret handshake, when there is a secret).
#[derive(Debug)]
pub(crate) struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    gate: Arc<Gatekeeper>,
}

impl Server {
    pub(crate) fn start(
        listener: TcpListener,
        shared: Arc<Shared>,
        config: CopyConfig,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let gate = Gatekeeper::new("copies", config.secret.clone());
        let (stopped, admitting) = (stop.clone(), gate.clone());
        std::thread::Builder::new()
            .name("ckpt-copy-server".into())
            .spawn(move || accept(listener, &shared, &config, &admitting, &stopped))?;
        Ok(Self { addr, stop, gate })
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections refused for want of the job secret.
    pub(crate) fn refused(&self) -> u64 {
        self.gate.refused()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accepting thread so that it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

/// Accepts peers until stopped. The handshake runs on each peer's thread, not here:
/// a connection that never sends its half holds one of the `max_connections`
/// places until the handshake's timeout, but never the accepting.
fn accept(
    listener: TcpListener,
    shared: &Arc<Shared>,
    config: &CopyConfig,
    gate: &Arc<Gatekeeper>,
    stop: &Arc<AtomicBool>,
) {
    let serving = Arc::new(AtomicUsize::new(0));
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let (mut stream, from) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, say: let some connections end before the next.
                tracing::debug!(error = %e, "copy server cannot accept");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if serving.fetch_add(1, Ordering::SeqCst) >= config.max_connections {
            serving.fetch_sub(1, Ordering::SeqCst);
            let _ = stream.write_all(b"no too many connections\n");
            continue;
        }
        let (shared, gate, serving, stop) =
            (shared.clone(), gate.clone(), serving.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("ckpt-copy-peer".into())
            .spawn(move || {
                if let Err(e) = serve_peer(stream, from, &gate, &shared, &stop) {
                    tracing::debug!(error = %e, "copy peer connection ended");
                }
                serving.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            tracing::warn!("cannot start a thread for a copy peer");
        }
    }
}

/// Answers one peer's requests until it hangs up, stays idle for [`IDLE`], or the
/// server is stopped (checked between requests). With a job secret, the peer must
/// prove it first: a peer that does not is closed without an answer (the gatekeeper
/// counts and logs it), before any of its bytes is read as a request.
fn serve_peer(
    stream: TcpStream,
    from: SocketAddr,
    gate: &Gatekeeper,
    shared: &Shared,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    if !gate.admit(&stream, from) {
        return Ok(());
    }
    stream.set_read_timeout(Some(IDLE))?;
    let mut out = stream.try_clone()?;
    let mut reader = BufReader::with_capacity(MAX_LINE, stream);
    let mut line = Vec::with_capacity(MAX_LINE);
    loop {
        if stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        match read_line(&mut reader, MAX_LINE, &mut line) {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                out.write_all(format!("no {e}\n").as_bytes())?;
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        match answer(&String::from_utf8_lossy(&line), shared) {
            Ok(Answer::Len(len)) => out.write_all(format!("ok {len}\n").as_bytes())?,
            Ok(Answer::Raw(copy, start, end)) => {
                out.write_all(format!("ok {}\n", end - start).as_bytes())?;
                out.write_all(&copy.bytes()[start..end])?;
            }
            Ok(Answer::Bytes(bytes)) => {
                out.write_all(format!("ok {}\n", bytes.len()).as_bytes())?;
                out.write_all(&bytes)?;
            }
            Err(why) => out.write_all(format!("no {why}\n").as_bytes())?,
        }
    }
}

enum Answer {
    Len(u64),
    Raw(RankCopy, usize, usize),
    /// A snapshot's part, or a committed snapshot's table of part CRC32s.
    Bytes(Arc<Vec<u8>>),
}

/// What to answer `request` (one line, without its newline).
fn answer(request: &str, shared: &Shared) -> Result<Answer, String> {
    let bad = || {
        format!(
            "bad request {:?}",
            request.chars().take(200).collect::<String>()
        )
    };
    let words: Vec<&str> = request.split(' ').collect();
    let number = |i: usize| -> Result<u64, String> {
        words.get(i).and_then(|w| w.parse().ok()).ok_or_else(bad)
    };
    let key = || -> Result<CopyKey, String> {
        Ok(CopyKey {
            dir: words.get(1).ok_or_else(bad)?.to_string(),
            world: u32::try_from(number(2)?).map_err(|_| bad())?,
            rank: u32::try_from(number(3)?).map_err(|_| bad())?,
        })
    };
    let find = |key: &CopyKey| -> Result<RankCopy, String> {
        shared
            .lock()
            .get(key)
            .ok_or_else(|| format!("not held: {key}"))
    };
    match words.first().copied() {
        Some("len") if words.len() == 4 => Ok(Answer::Len(find(&key()?)?.len())),
        Some("raw") if words.len() == 6 => {
            let copy = find(&key()?)?;
            let (start, end) = (number(4)?, number(5)?);
            if start > end || end > copy.len() {
                return Err(format!(
                    "bytes {start}..{end} outside the copy's 0..{}",
                    copy.len()
                ));
            }
            Ok(Answer::Raw(copy, start as usize, end as usize))
        }
        Some("part") if words.len() == 4 => {
            let key = key()?;
            match shared.lock().entry(&key) {
                Some(entry) => entry
                    .part
                    .map(Answer::Bytes)
                    .ok_or_else(|| format!("{key} is not a snapshot's file")),
                None => Err(format!("not held: {key}")),
            }
        }
        Some("table") if words.len() == 2 => {
            let table = shared
                .lock()
                .snapshot_table(words[1])
                .ok_or_else(|| format!("{} is not a committed snapshot held", words[1]))?;
            let bytes = table.iter().flat_map(|c| c.to_le_bytes()).collect();
            Ok(Answer::Bytes(Arc::new(bytes)))
        }
        _ => Err(bad()),
    }
}

/// Why a request to a peer failed.
#[derive(Debug)]
pub(crate) enum Asked {
    /// The peer answered `no`: it does not hold the copy (yet), or the request was bad.
    Refused(String),
    /// The peer did not answer, or not in the protocol.
    Failed(String),
}

impl std::fmt::Display for Asked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(why) | Self::Failed(why) => f.write_str(why),
        }
    }
}

/// A connection to one peer's copy server.
pub(crate) struct Peer {
    addr: SocketAddr,
    out: TcpStream,
    reader: BufReader<TcpStream>,
    line: Vec<u8>,
    /// What a failure before the first answer may mean: set when this side proved
    /// no secret (a server that requires one closes such a connection unanswered).
    hint: Option<&'static str>,
}

impl Peer {
    /// Connects to `addr` and, with a `secret`, proves it to the server and checks
    /// the server's proof (an error naming `addr` when either fails: the peer is
    /// then as unusable as one that does not answer); every later read or write
    /// waits at most `timeout`.
    pub(crate) fn connect(
        addr: SocketAddr,
        timeout: Duration,
        secret: Option<&JobSecret>,
    ) -> Result<Self, Asked> {
        let failed = |e: std::io::Error| Asked::Failed(format!("{addr}: {e}"));
        let stream = TcpStream::connect_timeout(&addr, timeout).map_err(failed)?;
        stream.set_nodelay(true).map_err(failed)?;
        stream.set_read_timeout(Some(timeout)).map_err(failed)?;
        stream.set_write_timeout(Some(timeout)).map_err(failed)?;
        if let Some(secret) = secret {
            ckpt_auth::prove_tcp(&stream, secret)
                .map_err(|e| Asked::Failed(format!("{addr}: copy server handshake: {e}")))?;
        }
        let reader = BufReader::with_capacity(64 << 10, stream.try_clone().map_err(failed)?);
        Ok(Self {
            addr,
            out: stream,
            reader,
            line: Vec::with_capacity(MAX_LINE),
            hint: secret.is_none().then_some(
                " (if that copy server requires the job secret, this process proved none)",
            ),
        })
    }

    /// Sends `request` and reads the number of its `ok` answer.
    pub(crate) fn ask(&mut self, request: &str) -> Result<u64, Asked> {
        let addr = self.addr;
        let hint = self.hint.unwrap_or("");
        let failed = |e: std::io::Error| Asked::Failed(format!("{addr}: {e}{hint}"));
        self.out
            .write_all(format!("{request}\n").as_bytes())
            .map_err(failed)?;
        let answered = read_line(&mut self.reader, MAX_LINE, &mut self.line).map_err(failed)?;
        let line = String::from_utf8_lossy(&self.line);
        if !answered {
            return Err(Asked::Failed(format!("{addr}: connection closed{hint}")));
        }
        // Answered: whatever fails later is not the handshake that was missing.
        self.hint = None;
        if let Some(n) = line.strip_prefix("ok ") {
            return n
                .parse()
                .map_err(|_| Asked::Failed(format!("{addr}: bad answer {line:?}")));
        }
        match line.strip_prefix("no ") {
            Some(why) => Err(Asked::Refused(format!("{addr}: {why}"))),
            None => Err(Asked::Failed(format!("{addr}: bad answer {line:?}"))),
        }
    }

    /// Length of `key`'s copy.
    pub(crate) fn len(&mut self, key: &CopyKey) -> Result<u64, Asked> {
        self.ask(&format!("len {} {} {}", key.dir, key.world, key.rank))
    }

    /// The rank part of the snapshot file `key` (at most the largest part a
    /// checkpoint may have).
    pub(crate) fn part(&mut self, key: &CopyKey) -> Result<Vec<u8>, Asked> {
        let request = format!("part {} {} {}", key.dir, key.world, key.rank);
        self.bytes(&request, MAX_PART_BYTES)
    }

    /// The CRC32s of every rank's part of the committed snapshot in `dir` (at most
    /// `world` of them).
    pub(crate) fn table(&mut self, dir: &str, world: u32) -> Result<Vec<u32>, Asked> {
        let bytes = self.bytes(&format!("table {dir}"), u64::from(world) * 4)?;
        if bytes.len() % 4 != 0 {
            return Err(Asked::Failed(format!(
                "{}: a table of part CRC32s of {} bytes",
                self.addr,
                bytes.len()
            )));
        }
        Ok(bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }

    /// The answer to `request`: bytes of a length the peer announces, at most `max`.
    fn bytes(&mut self, request: &str, max: u64) -> Result<Vec<u8>, Asked> {
        let n = self.ask(request)?;
        if n > max {
            return Err(Asked::Failed(format!(
                "{}: announced {n} bytes for {request:?}, at most {max} expected",
                self.addr
            )));
        }
        let mut bytes = vec![0u8; n as usize];
        self.reader
            .read_exact(&mut bytes)
            .map_err(|e| Asked::Failed(format!("{}: {e}", self.addr)))?;
        Ok(bytes)
    }

    /// Reads bytes `at..` of `key`'s copy into `pieces`, back to back.
    pub(crate) fn raw(
        &mut self,
        key: &CopyKey,
        at: u64,
        pieces: &mut [&mut [u8]],
    ) -> Result<(), Asked> {
        let len: u64 = pieces.iter().map(|p| p.len() as u64).sum();
        let n = self.ask(&format!(
            "raw {} {} {} {at} {}",
            key.dir,
            key.world,
            key.rank,
            at + len
        ))?;
        if n != len {
            return Err(Asked::Failed(format!(
                "{}: sent {n} bytes of {key}, {len} were asked for",
                self.addr
            )));
        }
        for piece in pieces.iter_mut() {
            self.reader
                .read_exact(piece)
                .map_err(|e| Asked::Failed(format!("{}: {e}", self.addr)))?;
        }
        Ok(())
    }
}

/// A replica to pull: `key`'s copy from the copy server at `from`.
#[derive(Debug)]
pub(crate) struct Pull {
    pub(crate) from: SocketAddr,
    pub(crate) key: CopyKey,
    /// A snapshot's file: its part is pulled with it.
    pub(crate) snapshot: bool,
}

/// Pulls the replicas sent on `pulls`, one at a time, until the channel closes.
pub(crate) fn pull_replicas(pulls: mpsc::Receiver<Pull>, shared: &Shared, config: &CopyConfig) {
    for pull in pulls {
        let started = Instant::now();
        match pull_one(&pull, shared, config) {
            Ok(bytes) => tracing::debug!(
                key = ?pull.key,
                bytes,
                ms = started.elapsed().as_millis() as u64,
                "replica pulled"
            ),
            Err(why) => tracing::info!(
                key = ?pull.key,
                from = %pull.from,
                error = %why,
                "no replica of the predecessor's copy"
            ),
        }
        shared.pull_ended();
    }
}

/// The step of `key`'s save or snapshot (0 when its directory is not one's).
fn step_of_key(key: &CopyKey) -> u64 {
    key.dir
        .strip_prefix("step-")
        .and_then(|rest| rest.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Pulls one whole copy, waiting (up to the patience) for its source to have staged
/// it, and holds it. Returns its length.
fn pull_one(pull: &Pull, shared: &Shared, config: &CopyConfig) -> Result<u64, String> {
    let deadline = Instant::now() + config.pull_patience;
    let mut pause = Duration::from_millis(10);
    let mut peer = Peer::connect(pull.from, config.peer_timeout, config.secret.as_ref())
        .map_err(|e| e.to_string())?;
    let len = loop {
        match peer.len(&pull.key) {
            Ok(len) => break len,
            Err(Asked::Refused(why)) => {
                if Instant::now() + pause > deadline {
                    return Err(why);
                }
                // The source has not staged it yet: nothing signals across
                // machines, so ask again a little later.
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    // Refused before anything is allocated: a replica of a checkpoint no longer kept,
    // or one that does not fit.
    {
        let mut held = shared.lock();
        held.settle();
        if !held.kept(&pull.key.dir) {
            return Err(format!("{} is no longer kept", pull.key));
        }
        held.fits(len)?;
    }
    let size = usize::try_from(len).map_err(|_| format!("{len} bytes do not fit in memory"))?;
    let kind = match pull.snapshot {
        true => HeldKind::SnapshotReplica,
        false => HeldKind::Replica,
    };
    let reserved = match &config.budget {
        Some(budget) => Some(
            Reservation::for_step(budget, kind, len, step_of_key(&pull.key)).ok_or_else(|| {
                format!(
                    "a replica of {len} bytes does not fit the host memory budget: {}",
                    budget.held()
                )
            })?,
        ),
        None => None,
    };
    // Huge pages: a replica is written once, off the training thread, and read at a
    // recovery; they make its page faults and, when the process dies, its unmapping
    // several times cheaper (which shortens how long survivors take to notice a
    // killed rank).
    let mut bytes: Vec<u8> = crate::load::zeroed_huge(size).map_err(|e| e.to_string())?;
    let mut at = 0u64;
    while at < len {
        let end = (at + PULL_PIECE).min(len);
        peer.raw(&pull.key, at, &mut [&mut bytes[at as usize..end as usize]])
            .map_err(|e| e.to_string())?;
        at = end;
    }
    let part = match pull.snapshot {
        true => Some(Arc::new(peer.part(&pull.key).map_err(|e| e.to_string())?)),
        false => None,
    };
    shared.put_replica(RankCopy::reserved(pull.key.clone(), bytes, reserved), part)?;
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copies::Copies;

    const TIMEOUT: Duration = Duration::from_secs(5);

    fn secret(text: &str) -> JobSecret {
        JobSecret::new(text, "a test").unwrap()
    }

    fn with_secret(secret: &JobSecret) -> CopyConfig {
        CopyConfig {
            secret: Some(secret.clone()),
            ..CopyConfig::default()
        }
    }

    /// Waits until `copies` has refused `n` connections. A refusal is counted once
    /// the server has read the stranger's last byte, which can come after the
    /// stranger's own failure (one whose server proved another secret hangs up
    /// first), and nothing signals it: look every millisecond.
    fn wait_for_refusals(copies: &Copies, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while copies.refused_connections() < n {
            assert!(
                Instant::now() < deadline,
                "{} refusals, {n} expected",
                copies.refused_connections()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            copies.refused_connections(),
            n,
            "more refusals than expected"
        );
    }

    /// A server with secret `job` holding `bytes` as `key`'s copy.
    fn serving(job: &JobSecret, key: &CopyKey, bytes: &[u8]) -> Copies {
        let copies = Copies::serve("127.0.0.1".parse().unwrap(), with_secret(job)).unwrap();
        copies.keep_copy(RankCopy::new(key.clone(), bytes.to_vec()));
        copies
    }

    /// The whole of `key`'s copy, fetched over `peer`.
    fn fetch(peer: &mut Peer, key: &CopyKey) -> Result<Vec<u8>, Asked> {
        let mut bytes = vec![0; peer.len(key)? as usize];
        peer.raw(key, 0, &mut [&mut bytes])?;
        Ok(bytes)
    }

    fn key() -> CopyKey {
        CopyKey {
            dir: "step-1/g1-a".into(),
            world: 1,
            rank: 0,
        }
    }

    #[test]
    fn with_a_secret_only_peers_that_prove_it_are_served() {
        let (job, other) = (
            secret("the job's secret, 1"),
            secret("another job's secret"),
        );
        let bytes: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        let copies = serving(&job, &key(), &bytes);
        let addr = copies.addr().unwrap();
        // The job's peer: served as without a secret, many exchanges per connection.
        let mut peer = Peer::connect(addr, TIMEOUT, Some(&job)).unwrap();
        assert_eq!(fetch(&mut peer, &key()).unwrap(), bytes);
        assert_eq!(fetch(&mut peer, &key()).unwrap(), bytes);
        assert_eq!(copies.refused_connections(), 0);
        // A peer without the secret connects, but its first request is closed
        // unanswered (counted before the close that it sees).
        let mut stranger = Peer::connect(addr, TIMEOUT, None).unwrap();
        let Err(Asked::Failed(why)) = stranger.len(&key()) else {
            panic!("a peer without the secret was answered");
        };
        assert!(
            why.contains(&addr.to_string()) && why.contains("job secret"),
            "{why}"
        );
        assert_eq!(copies.refused_connections(), 1);
        // A peer with another secret: the server does not prove its secret, so the
        // peer gives up in the handshake, and the server refuses it.
        let Err(Asked::Failed(why)) = Peer::connect(addr, TIMEOUT, Some(&other)) else {
            panic!("a server with another secret was accepted");
        };
        assert!(
            why.contains(&addr.to_string()) && why.contains("did not prove"),
            "{why}"
        );
        wait_for_refusals(&copies, 2);
        // The job's connection is still served.
        assert_eq!(fetch(&mut peer, &key()).unwrap(), bytes);
    }

    #[test]
    fn strangers_refused_meanwhile_do_not_disturb_the_jobs_peers() {
        let (job, other) = (
            secret("the job's secret, 2"),
            secret("another job's secret"),
        );
        let bytes: Vec<u8> = (0..=255u8).rev().cycle().take(300_000).collect();
        let copies = serving(&job, &key(), &bytes);
        let addr = copies.addr().unwrap();
        const STRANGERS: u64 = 20;
        let start = std::sync::Barrier::new(2);
        let mut peer = Peer::connect(addr, TIMEOUT, Some(&job)).unwrap();
        let fetched = std::thread::scope(|s| {
            let legitimate = s.spawn(|| {
                start.wait();
                let mut fetched = 0;
                for round in 0..40 {
                    if round % 10 == 9 {
                        peer = Peer::connect(addr, TIMEOUT, Some(&job)).unwrap();
                    }
                    assert!(fetch(&mut peer, &key()).unwrap() == bytes, "round {round}");
                    fetched += 1;
                }
                fetched
            });
            start.wait();
            for i in 0..STRANGERS {
                let refused = if i % 2 == 0 {
                    Peer::connect(addr, TIMEOUT, None).and_then(|mut p| p.len(&key()))
                } else {
                    Peer::connect(addr, TIMEOUT, Some(&other)).map(|_| 0)
                };
                assert!(matches!(refused, Err(Asked::Failed(_))), "stranger {i}");
            }
            legitimate.join().unwrap()
        });
        assert_eq!(fetched, 40);
        wait_for_refusals(&copies, STRANGERS);
    }

    #[test]
    fn a_silent_connection_does_not_hold_up_the_others() {
        let job = secret("the job's secret, 3");
        let copies = serving(&job, &key(), b"some bytes");
        let addr = copies.addr().unwrap();
        // Connected, and never a byte of the handshake: the server waits for it on
        // the connection's own thread, not the accepting one.
        let silent = TcpStream::connect(addr).unwrap();
        let started = Instant::now();
        let mut peer = Peer::connect(addr, TIMEOUT, Some(&job)).unwrap();
        assert_eq!(fetch(&mut peer, &key()).unwrap(), b"some bytes");
        assert!(
            started.elapsed() < ckpt_auth::HANDSHAKE_TIMEOUT / 2,
            "the job's peer waited {:?} behind a silent connection",
            started.elapsed()
        );
        assert_eq!(copies.refused_connections(), 0);
        drop(silent);
        wait_for_refusals(&copies, 1);
    }

    #[test]
    fn replicas_are_pulled_only_from_a_server_with_the_same_secret() {
        let ip = "127.0.0.1".parse().unwrap();
        let (job, other) = (
            secret("the job's secret, 4"),
            secret("another job's secret"),
        );
        let key = CopyKey {
            dir: "step-1/g1-a".into(),
            world: 2,
            rank: 0,
        };
        let bytes: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
        let source = serving(&job, &key, &bytes);
        for (secret, pulled) in [(Some(&other), false), (None, false), (Some(&job), true)] {
            let config = CopyConfig {
                secret: secret.cloned(),
                ..CopyConfig::default()
            };
            let successor = Copies::serve(ip, config).unwrap();
            let own = CopyKey {
                rank: 1,
                ..key.clone()
            };
            successor.keep_copy(RankCopy::new(own, vec![1; 10]));
            successor.replicate(source.addr().unwrap(), key.clone());
            assert!(successor.wait_for_pulls(Duration::from_secs(20)));
            let got = successor.get(&key);
            assert_eq!(got.is_some(), pulled, "with {secret:?}");
            if pulled {
                assert_eq!(got.unwrap().bytes(), &bytes[..]);
            }
        }
        // The two strangers were refused, the job's puller was not.
        wait_for_refusals(&source, 2);
    }

    #[test]
    fn lines_are_bounded_and_a_torn_last_line_is_dropped() {
        let mut line = Vec::new();
        let mut wire: &[u8] = b"ok 3\nabc";
        assert!(read_line(&mut wire, 16, &mut line).unwrap());
        assert_eq!(line, b"ok 3");
        assert!(!read_line(&mut wire, 16, &mut line).unwrap(), "torn");
        let long = [b'x'; 40];
        let err = read_line(&mut &long[..], 16, &mut line).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        let mut exact: &[u8] = b"123456789012345\n";
        assert!(read_line(&mut exact, 16, &mut line).unwrap());
    }

    #[test]
    fn a_server_answers_bad_requests_with_an_error_and_stays_up() {
        let copies = Copies::serve("127.0.0.1".parse().unwrap(), CopyConfig::default()).unwrap();
        let key = CopyKey {
            dir: "step-1/g1-a".into(),
            world: 1,
            rank: 0,
        };
        copies.keep_copy(RankCopy::new(key.clone(), (0..100u8).collect()));
        let addr = copies.addr().unwrap();
        let mut peer = Peer::connect(addr, Duration::from_secs(5), None).unwrap();
        for bad in [
            "raw step-1/g1-a 1 0 5 1",
            "raw step-1/g1-a 1 0 0 101",
            "raw step-1/g1-a 1 0 18446744073709551615 0",
            "raw step-2/g1-a 1 0 0 1",
            "raw step-1/g1-a 2 0 0 1",
            "len step-1/g1-a 1 1",
            "len step-1/g1-a x 0",
            "len step-1/g1-a 99999999999 0",
            "raw step-1/g1-a 1 0 0",
            "hello",
            "",
        ] {
            assert!(matches!(peer.ask(bad), Err(Asked::Refused(_))), "{bad}");
        }
        assert_eq!(peer.len(&key).unwrap(), 100);
        let (mut a, mut b) = ([0u8; 3], [0u8; 4]);
        peer.raw(&key, 10, &mut [&mut a, &mut b]).unwrap();
        assert_eq!((a, b), ([10, 11, 12], [13, 14, 15, 16]));
        // An overlong line: an error, then the server closes this connection only.
        let long = "x".repeat(2 * MAX_LINE);
        assert!(peer.ask(&long).is_err());
        let mut peer = Peer::connect(addr, Duration::from_secs(5), None).unwrap();
        assert_eq!(peer.len(&key).unwrap(), 100);
    }

    #[test]
    fn a_replica_is_pulled_once_its_source_has_it() {
        let ip = "127.0.0.1".parse().unwrap();
        let source = Copies::serve(ip, CopyConfig::default()).unwrap();
        let successor = Copies::serve(ip, CopyConfig::default()).unwrap();
        let key = CopyKey {
            dir: "step-1/g1-a".into(),
            world: 2,
            rank: 0,
        };
        // The successor saved the same checkpoint; the source has not staged yet.
        successor.keep_copy(RankCopy::new(
            CopyKey {
                rank: 1,
                ..key.clone()
            },
            vec![1; 10],
        ));
        successor.replicate(source.addr().unwrap(), key.clone());
        let bytes: Vec<u8> = (0..=255u8).cycle().take(PULL_PIECE as usize + 5).collect();
        source.keep_copy(RankCopy::new(key.clone(), bytes.clone()));
        assert!(successor.wait_for(&key, Duration::from_secs(20)));
        assert_eq!(successor.get(&key).unwrap().bytes(), &bytes[..]);
    }
}
