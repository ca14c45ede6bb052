//! In-memory copies of the newest checkpoints, so that the survivors of a failure
//! rebuild their state from RAM instead of reading it back from the store.
//!
//! Why: when one rank of N dies, the survivors already hold almost all of the
//! checkpoint they are about to resume from (each saved its own rows a few steps
//! ago), and the store is the slowest place to read those rows back from. So every
//! elastic rank keeps, beside what it saves:
//!
//! - its **own copy**: the rows it saved, copied when it stages the save;
//! - a **replica** of its ring predecessor's copy, pulled in the background (over
//!   loopback or the network) once the predecessor has staged it.
//!
//! Any set of lost ranks of which no two are ring neighbours therefore loses no row.
//! At a recovery the ranks still agree on *what* to resume from through the store's
//! commit log (memory never decides that something is committed); they publish which
//! copies of that checkpoint they hold, and each rank assembles its new rows from its
//! own copies and its peers', falling back to the store for anything nobody holds or
//! any peer that fails to answer. The copies are the very bytes that were written, so
//! both sources give bitwise the same state, and ranks may mix them.
//!
//! Memory is not trusted more than the store: every row taken from a copy, a peer's or
//! its own, is checked against the block CRC32s the save computed (read from the
//! committed rank parts, through [`ckpt::copies`]), and a copy that does not match
//! them sends the rank to the store, named in the log. The non-tensor state (the loss
//! history) is always read from the store's global part, which its own checksum
//! covers.
//!
//! A copy is named by the attempt directory of its save (`step-N/gG-RUN`, which names
//! exactly one commit) and by the layout (world size, rank) its rows follow. A rank
//! keeps the copies of two checkpoints at most: the newest it saved, and the newest
//! it knows to be committed (the one a failure would resume from).
//!
//! The wire protocol between ranks is one request line and one answer per exchange:
//! `rows DIR WORLD RANK INDEX START END` answered by `ok N` and N little-endian f32
//! values, or `no REASON`.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckpt::format::{Chunk, RankPart};
use ckpt_elastic::protocol::{LineError, LineReader};
use serde::{Deserialize, Serialize};

use crate::collective::{pod_bytes, pod_bytes_mut, shard_range};

/// Tensors of one copy, in this order for each model tensor: parameters, Adam's
/// first moment, Adam's second moment.
pub const KINDS: usize = 3;

/// Longest request line a server reads.
const MAX_LINE: usize = 1024;
/// Size of one rank's record in the table of holdings (JSON, padded with spaces).
const RECORD: usize = 1024;
/// How long a peer may take to answer one request before it is given up on.
const PEER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a replica pull waits for its source to have staged the copy.
const PULL_PATIENCE: Duration = Duration::from_secs(30);

/// Which copy: the checkpoint (its attempt directory) and the layout of its rows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Key {
    /// The attempt directory of the save, `step-N/gG-RUN`.
    pub dir: String,
    /// World size of the layout.
    pub world: usize,
    /// Rank of the layout whose rows these are.
    pub rank: usize,
}

/// One rank's rows of one checkpoint.
#[derive(Debug)]
pub struct RankCopy {
    key: Key,
    /// `KINDS` vectors per model tensor, the rank's rows of each.
    tensors: Vec<Vec<f32>>,
}

impl RankCopy {
    /// A copy of `tensors` (see [`KINDS`] for the order) under `key`.
    pub fn new(key: Key, tensors: Vec<Vec<f32>>) -> Self {
        Self { key, tensors }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.len() * 4).sum()
    }
}

#[derive(Debug, Default)]
struct Inner {
    copies: Vec<Arc<RankCopy>>,
    /// The newest checkpoint this rank saved.
    newest: Option<String>,
    /// The newest checkpoint this rank knows to be committed.
    confirmed: Option<String>,
    /// Vectors of evicted copies, for the next copies: memory already faulted in
    /// fills several times faster than fresh pages, and a save's copy is made on
    /// the training thread.
    free: Vec<Vec<f32>>,
}

impl Inner {
    fn kept(&self, dir: &str) -> bool {
        self.newest.as_deref() == Some(dir) || self.confirmed.as_deref() == Some(dir)
    }

    fn evict(&mut self) {
        let (newest, confirmed) = (self.newest.clone(), self.confirmed.clone());
        let (kept, evicted): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.copies).into_iter().partition(|c| {
                Some(&c.key.dir) == newest.as_ref() || Some(&c.key.dir) == confirmed.as_ref()
            });
        self.copies = kept;
        let mut room = 0;
        for copy in evicted {
            room = room.max(2 * copy.tensors.len());
            // A copy still being sent to a peer is simply dropped when that ends.
            if let Ok(copy) = Arc::try_unwrap(copy) {
                self.free
                    .extend(copy.tensors.into_iter().filter(|t| t.capacity() > 0));
            }
        }
        // At most one checkpoint's copy and replica wait for reuse (vectors that no
        // longer fit, after the world shrank, would otherwise pile up): the largest.
        if room > 0 && self.free.len() > room {
            self.free.sort_by_key(|v| std::cmp::Reverse(v.capacity()));
            self.free.truncate(room);
        }
    }

    /// The free vector that best fits `len` elements (the smallest large enough).
    fn reuse(&mut self, len: usize) -> Option<Vec<f32>> {
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= len)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i)?;
        let mut v = self.free.swap_remove(best);
        v.clear();
        Some(v)
    }

    fn put(&mut self, copy: Arc<RankCopy>) {
        self.copies.retain(|c| c.key != copy.key);
        self.copies.push(copy);
    }

    fn get(&self, key: &Key) -> Option<Arc<RankCopy>> {
        self.copies.iter().find(|c| &c.key == key).cloned()
    }
}

/// A replica to pull: `key`'s copy from the rank serving at `from`, whose tensors
/// have the lengths `lens`.
struct Pull {
    from: SocketAddr,
    key: Key,
    lens: Vec<usize>,
}

/// This rank's in-memory copies and the server that hands them to its peers.
#[derive(Debug)]
pub struct Memory {
    addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
    pulls: Mutex<mpsc::Sender<Pull>>,
}

impl Memory {
    /// Binds the server on `ip` (any free port) and starts it and the replica puller.
    pub fn start(ip: IpAddr) -> std::io::Result<Arc<Self>> {
        let listener = TcpListener::bind((ip, 0))?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Mutex::new(Inner::default()));
        {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new()
                .name("ckpt-memory-server".into())
                .spawn(move || serve(listener, inner))?;
        }
        let (tx, rx) = mpsc::channel::<Pull>();
        {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new()
                .name("ckpt-memory-pull".into())
                .spawn(move || {
                    for pull in rx {
                        let started = Instant::now();
                        let buffer = |len: usize| {
                            let reused = inner.lock().unwrap_or_else(|p| p.into_inner()).reuse(len);
                            match reused {
                                Some(mut v) => {
                                    v.resize(len, 0f32);
                                    v
                                }
                                None => huge_zeros(len),
                            }
                        };
                        match pull_copy(&pull, &buffer) {
                            Ok(copy) => {
                                let bytes = copy.bytes();
                                let mut inner = inner.lock().unwrap_or_else(|p| p.into_inner());
                                if inner.kept(&copy.key.dir) {
                                    inner.put(Arc::new(copy));
                                    tracing::debug!(key = ?pull.key, bytes, ms = started.elapsed().as_millis() as u64, "replica pulled");
                                }
                            }
                            Err(e) => {
                                tracing::info!(key = ?pull.key, from = %pull.from, error = %e, "no replica of the predecessor's copy")
                            }
                        }
                    }
                })?;
        }
        Ok(Arc::new(Self {
            addr,
            inner,
            pulls: Mutex::new(tx),
        }))
    }

    /// Where peers fetch this rank's copies.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of `data` for a [`RankCopy`], in the memory of an evicted copy when one
    /// fits.
    pub fn copy_of(&self, data: &[f32]) -> Vec<f32> {
        match self.lock().reuse(data.len()) {
            Some(mut v) => {
                v.extend_from_slice(data);
                v
            }
            None => huge_copy(data),
        }
    }

    /// Keeps `copy`, the rows this rank just staged for a save; it is now the newest.
    pub fn keep_own(&self, copy: RankCopy) {
        let mut inner = self.lock();
        inner.newest = Some(copy.key.dir.clone());
        inner.put(Arc::new(copy));
        inner.evict();
    }

    /// Notes that the checkpoint saved in `dir` is committed (a failure resumes from
    /// it until a newer one is).
    pub fn confirm(&self, dir: &str) {
        let mut inner = self.lock();
        inner.confirmed = Some(dir.to_string());
        inner.evict();
    }

    /// Starts pulling, in the background, a replica of `key`'s copy from the rank
    /// serving at `from` (it may not have staged it yet: the pull waits a while).
    pub fn replicate(&self, from: SocketAddr, key: Key, lens: Vec<usize>) {
        let pulls = self.pulls.lock().unwrap_or_else(|p| p.into_inner());
        let _ = pulls.send(Pull { from, key, lens });
    }

    /// The copy named `key`, if held.
    pub fn get(&self, key: &Key) -> Option<Arc<RankCopy>> {
        self.lock().get(key)
    }

    /// This rank's record for the table of holdings: its address and every copy held.
    pub fn holding(&self) -> Holding {
        let inner = self.lock();
        Holding {
            addr: Some(self.addr),
            held: inner.copies.iter().map(|c| c.key.clone()).collect(),
        }
    }
}

/// What one rank holds, as published to the others when a generation starts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Holding {
    /// Its server, if it keeps copies at all.
    pub addr: Option<SocketAddr>,
    /// The copies it holds.
    pub held: Vec<Key>,
}

impl Holding {
    /// The fixed-size record exchanged with an all-gather. Copies that do not fit are
    /// left out (they are only an optimization).
    pub fn encode(&self) -> Vec<u8> {
        let mut record = self.clone();
        loop {
            let mut bytes = serde_json::to_vec(&record).expect("a holding serializes");
            if bytes.len() <= RECORD {
                bytes.resize(RECORD, b' ');
                return bytes;
            }
            record.held.pop();
        }
    }

    /// Reads a record; a malformed one holds nothing.
    pub fn decode(record: &[u8]) -> Self {
        serde_json::from_slice(record.trim_ascii_end()).unwrap_or_default()
    }

    /// Size of one record.
    pub const SIZE: usize = RECORD;
}

fn serve(listener: TcpListener, inner: Arc<Mutex<Inner>>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let inner = Arc::clone(&inner);
        let _ = std::thread::Builder::new()
            .name("ckpt-memory-peer".into())
            .spawn(move || {
                if let Err(e) = serve_peer(stream, &inner) {
                    tracing::debug!(error = %e, "memory peer connection ended");
                }
            });
    }
}

fn serve_peer(stream: TcpStream, inner: &Mutex<Inner>) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut out = stream.try_clone()?;
    let mut reader = LineReader::with_max(stream, MAX_LINE);
    loop {
        let line = match reader.next_line() {
            Ok(Some(line)) => line,
            Ok(None) => return Ok(()),
            Err(LineError::TooLong { max }) => {
                out.write_all(format!("no request line longer than {max} bytes\n").as_bytes())?;
                return Ok(());
            }
            Err(LineError::Io(e)) => return Err(e),
            Err(e) => return Err(std::io::Error::other(e.to_string())),
        };
        match answer(&String::from_utf8_lossy(line), inner) {
            Ok(Answer::Rows(copy, index, range)) => {
                let data = &copy.tensors[index][range];
                out.write_all(format!("ok {}\n", data.len()).as_bytes())?;
                out.write_all(pod_bytes(data))?;
            }
            Err(why) => out.write_all(format!("no {why}\n").as_bytes())?,
        }
    }
}

enum Answer {
    Rows(Arc<RankCopy>, usize, Range<usize>),
}

fn answer(request: &str, inner: &Mutex<Inner>) -> Result<Answer, String> {
    let words: Vec<&str> = request.split(' ').collect();
    let number = |i: usize| -> Result<usize, String> {
        words
            .get(i)
            .and_then(|w| w.parse().ok())
            .ok_or_else(|| format!("bad request {request:?}"))
    };
    let key = |words: &[&str]| -> Result<Key, String> {
        Ok(Key {
            dir: words
                .get(1)
                .ok_or_else(|| format!("bad request {request:?}"))?
                .to_string(),
            world: number(2)?,
            rank: number(3)?,
        })
    };
    let find = |key: &Key| -> Result<Arc<RankCopy>, String> {
        inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .ok_or_else(|| {
                format!(
                    "not held: {} (world {}, rank {})",
                    key.dir, key.world, key.rank
                )
            })
    };
    match words.first().copied() {
        Some("rows") if words.len() == 7 => {
            let copy = find(&key(&words)?)?;
            let (index, start, end) = (number(4)?, number(5)?, number(6)?);
            let len = copy
                .tensors
                .get(index)
                .ok_or_else(|| format!("no tensor {index}"))?
                .len();
            if start > end || end > len {
                return Err(format!("elements {start}..{end} outside 0..{len}"));
            }
            Ok(Answer::Rows(copy, index, start..end))
        }
        _ => Err(format!("bad request {request:?}")),
    }
}

/// A connection to one peer's server.
struct Peer {
    addr: SocketAddr,
    out: TcpStream,
    reader: LineReader<TcpStream>,
}

/// A peer's answer that is not `ok`: the copy is not (or no longer) there.
#[derive(Debug)]
enum FetchError {
    Refused(String),
    Failed(String),
}

impl std::fmt::Display for FetchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(why) | Self::Failed(why) => f.write_str(why),
        }
    }
}

impl Peer {
    fn connect(addr: SocketAddr) -> Result<Self, FetchError> {
        let failed = |e: std::io::Error| FetchError::Failed(format!("{addr}: {e}"));
        let stream = TcpStream::connect_timeout(&addr, PEER_TIMEOUT).map_err(failed)?;
        stream.set_nodelay(true).map_err(failed)?;
        stream
            .set_read_timeout(Some(PEER_TIMEOUT))
            .map_err(failed)?;
        stream
            .set_write_timeout(Some(PEER_TIMEOUT))
            .map_err(failed)?;
        let reader = LineReader::with_max(stream.try_clone().map_err(failed)?, MAX_LINE);
        Ok(Self {
            addr,
            out: stream,
            reader,
        })
    }

    /// Sends `request` and reads the count of the `ok` answer.
    fn ask(&mut self, request: &str) -> Result<usize, FetchError> {
        let addr = self.addr;
        let failed = |e: std::io::Error| FetchError::Failed(format!("{addr}: {e}"));
        self.out
            .write_all(format!("{request}\n").as_bytes())
            .map_err(failed)?;
        let line = match self.reader.next_line() {
            Ok(Some(line)) => String::from_utf8_lossy(line).into_owned(),
            Ok(None) => String::new(),
            Err(e) => return Err(FetchError::Failed(format!("{addr}: {e}"))),
        };
        if let Some(count) = line.strip_prefix("ok ") {
            return count
                .parse()
                .map_err(|_| FetchError::Failed(format!("{addr}: bad answer {line:?}")));
        }
        match line.strip_prefix("no ") {
            Some(why) => Err(FetchError::Refused(format!("{addr}: {why}"))),
            None => Err(FetchError::Failed(format!(
                "{addr}: bad answer {line:?} (connection closed?)"
            ))),
        }
    }

    /// Reads elements `range` of tensor `index` of `key`'s copy into `out`.
    /// `out` holds the elements' bytes (4 per f32), wherever the caller wants them.
    fn rows(
        &mut self,
        key: &Key,
        index: usize,
        range: Range<usize>,
        out: &mut [u8],
    ) -> Result<(), FetchError> {
        let n = self.ask(&format!(
            "rows {} {} {} {index} {} {}",
            key.dir, key.world, key.rank, range.start, range.end
        ))?;
        if n.checked_mul(4) != Some(out.len()) {
            return Err(FetchError::Failed(format!(
                "{}: sent {n} elements of tensor {index}, {} were asked for",
                self.addr,
                out.len() / 4
            )));
        }
        self.reader
            .read_exact(out)
            .map_err(|e| FetchError::Failed(format!("{}: {e}", self.addr)))
    }
}

/// Below this many bytes a buffer is left to the allocator as it is.
const HUGE_MIN: usize = 4 << 20;
/// The huge page size (x86-64 and most aarch64 kernels).
const HUGE_PAGE: usize = 2 << 20;

/// An empty vector with room for `n` elements whose memory the kernel is asked to
/// back with transparent huge pages. Recovery writes a rank's whole state into
/// fresh memory, and with 4 KiB pages the page faults cost several times the copy
/// itself (on a small machine, 60 ms against 10 ms for 100 MB).
pub fn huge_vec<T: Copy>(n: usize) -> Vec<T> {
    let v: Vec<T> = Vec::with_capacity(n);
    advise_huge(v.as_ptr() as usize, n * std::mem::size_of::<T>());
    v
}

/// Asks for huge pages under the whole huge pages inside `bytes` bytes at `addr`.
fn advise_huge(addr: usize, bytes: usize) {
    #[cfg(target_os = "linux")]
    if bytes >= HUGE_MIN {
        let start = addr.next_multiple_of(HUGE_PAGE);
        let end = (addr + bytes) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: the range lies inside one live allocation (the caller's
            // vector), and MADV_HUGEPAGE only changes how the kernel backs its
            // pages, never their contents; a failure leaves ordinary pages.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (addr, bytes, HUGE_MIN, HUGE_PAGE);
}

/// A copy of `data` in memory backed by huge pages (see [`huge_vec`]).
pub fn huge_copy<T: Copy>(data: &[T]) -> Vec<T> {
    let mut v = huge_vec(data.len());
    v.extend_from_slice(data);
    v
}

/// `n` default values (zeros, for numbers) in memory backed by huge pages. The zeros cost nothing up front: a large
/// zeroed allocation is fresh mapped memory, which the kernel zeroes as it faults
/// each (huge) page in on first write.
pub fn huge_zeros<T: Clone + Default>(n: usize) -> Vec<T> {
    let v = vec![T::default(); n];
    advise_huge(v.as_ptr() as usize, n * std::mem::size_of::<T>());
    v
}

/// Pulls a whole copy, waiting (a while) for the source to have staged it.
fn pull_copy(pull: &Pull, buffer: &dyn Fn(usize) -> Vec<f32>) -> Result<RankCopy, String> {
    let deadline = Instant::now() + PULL_PATIENCE;
    let mut pause = Duration::from_millis(10);
    let mut peer = Peer::connect(pull.from).map_err(|e| e.to_string())?;
    loop {
        let mut tensors = Vec::with_capacity(pull.lens.len());
        let mut refused = None;
        for (index, &len) in pull.lens.iter().enumerate() {
            let mut data = buffer(len);
            match peer.rows(&pull.key, index, 0..len, pod_bytes_mut(&mut data)) {
                Ok(()) => tensors.push(data),
                Err(FetchError::Refused(why)) => {
                    refused = Some(why);
                    break;
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        if refused.is_none() {
            return Ok(RankCopy::new(pull.key.clone(), tensors));
        }
        if Instant::now() + pause > deadline {
            return Err(refused.unwrap_or_default());
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// The shape of one model tensor: rows (dimension 0, the one sharded) and columns.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Rows.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
}

/// A rank's state rebuilt from the copies.
#[derive(Debug)]
pub struct Assembled {
    /// `KINDS` vectors per model tensor: this rank's rows in the new layout.
    pub tensors: Vec<Vec<f32>>,
    /// World size of the save (of the copies used, when they agree).
    pub saved_world: usize,
    /// Bytes copied from this rank's own copies.
    pub local_bytes: usize,
    /// Bytes fetched from peers.
    pub peer_bytes: usize,
}

/// How many verified spans of saved files `assemble` keeps for the next pieces.
const RECENT_SPANS: usize = 4;

/// What the rows taken from copies are checked against: the save's rank parts.
pub struct Saved<'a> {
    /// The name each tensor of a copy was saved under (`KINDS` per model tensor, in
    /// the copies' order).
    pub names: &'a [String],
    /// The committed rank part of saved rank `r` (read from the store and verified
    /// there); asked once for each saved rank whose rows are used.
    pub part: &'a dyn Fn(usize) -> Result<Arc<RankPart>, String>,
}

/// Why assembling from the copies failed; either way the caller reads the store.
#[derive(Debug)]
pub enum AssembleError {
    /// The copies do not cover the rows, a peer did not answer, or the wait was
    /// cancelled.
    Unavailable(String),
    /// A copy's bytes differ from what the save checksummed: the copy, the block and
    /// its offset are named.
    Mismatch(String),
}

impl std::fmt::Display for AssembleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unavailable(why) | Self::Mismatch(why) => f.write_str(why),
        }
    }
}

impl From<String> for AssembleError {
    fn from(why: String) -> Self {
        Self::Unavailable(why)
    }
}

/// A saved rank's part and its data file's header, for checking its copies.
struct Checked {
    part: Arc<RankPart>,
    header: Vec<u8>,
}

/// Rebuilds rank `rank` of `world`'s rows of checkpoint `dir` from the copies that
/// `table` (one holding per rank of this world; `table[rank]` is this rank's) says are
/// held, every row checked against `saved`'s block CRC32s. Fails, without side
/// effects, when some rows are held by nobody, a peer does not deliver or a copy does
/// not match its save; the caller then reads the store instead. `cancelled` is
/// checked between requests.
#[allow(clippy::too_many_arguments)]
pub fn assemble(
    memory: &Memory,
    table: &[Holding],
    rank: usize,
    world: usize,
    dir: &str,
    shapes: &[Shape],
    saved: &Saved<'_>,
    spare: Vec<Vec<f32>>,
    cancelled: &dyn Fn() -> bool,
) -> Result<Assembled, AssembleError> {
    if saved.names.len() != shapes.len() * KINDS {
        return Err(format!(
            "{} names for {} copy tensors",
            saved.names.len(),
            shapes.len() * KINDS
        )
        .into());
    }
    // Sources in order of preference: this rank's own copies, then the peers'.
    let mut sources: Vec<(usize, &Key)> = Vec::new();
    for (holder, holding) in table.iter().enumerate() {
        if holder != rank && holding.addr.is_none() {
            continue;
        }
        for key in holding.held.iter().filter(|k| k.dir == dir) {
            if key.world > 0 && key.rank < key.world {
                sources.push((holder, key));
            }
        }
    }
    sources.sort_by_key(|(holder, _)| (*holder != rank, *holder));
    if sources.is_empty() {
        return Err(format!("no rank holds a copy of {dir}").into());
    }
    // Plan every piece before fetching anything: a gap fails fast.
    struct Piece {
        holder: usize,
        key: Key,
        tensor: usize,
        /// Rows of the tensor, absolute.
        rows: Range<usize>,
        /// The same rows as elements of the holder's copy.
        elements: Range<usize>,
    }
    let mut pieces = Vec::new();
    for (tensor, shape) in shapes.iter().enumerate() {
        let need = shard_range(shape.rows, rank, world);
        let mut at = need.start;
        while at < need.end {
            let (holder, key, held) = sources
                .iter()
                .find_map(|(holder, key)| {
                    let held = shard_range(shape.rows, key.rank, key.world);
                    held.contains(&at).then_some((*holder, *key, held))
                })
                .ok_or_else(|| format!("row {at} of tensor {tensor} of {dir} is held by nobody"))?;
            let end = need.end.min(held.end);
            pieces.push(Piece {
                holder,
                key: key.clone(),
                tensor,
                rows: at..end,
                elements: (at - held.start) * shape.cols..(end - held.start) * shape.cols,
            });
            at = end;
        }
    }
    // What the pieces are checked against: the part of every saved rank they come
    // from (a copy of a world other than the commit's is no copy of it).
    let mut checked: Vec<Option<Checked>> = Vec::new();
    for piece in &pieces {
        let r = piece.key.rank;
        if checked.len() <= r {
            checked.resize_with(r + 1, || None);
        }
        if checked[r].is_none() {
            let part = (saved.part)(r)?;
            if part.world_size as usize != piece.key.world {
                return Err(format!(
                    "copies of {dir} follow a world of {}, the commit's of {}",
                    piece.key.world, part.world_size
                )
                .into());
            }
            let object = format!("{dir} rank {r}");
            let header = ckpt::copies::file_header(&part, &object).map_err(|e| e.to_string())?;
            checked[r] = Some(Checked { part, header });
        }
    }
    // Destinations: the spare vectors (memory already faulted in) where given, sized
    // anew; fresh memory otherwise.
    let mut spare = spare.into_iter();
    let mut tensors: Vec<Vec<f32>> = shapes
        .iter()
        .flat_map(|s| {
            let n = shard_range(s.rows, rank, world).len() * s.cols;
            [n; KINDS]
        })
        .map(|n| match spare.next() {
            Some(mut v) if v.capacity() > 0 => {
                v.clear();
                v.reserve_exact(n);
                v.resize(n, 0f32);
                v
            }
            _ => huge_zeros(n),
        })
        .collect();
    drop(spare);
    let mut peers: Vec<Option<Peer>> = (0..table.len()).map(|_| None).collect();
    // The spans verified last (saved rank, bytes), reused by the pieces they cover.
    let mut recent: Vec<(usize, ckpt::copies::VerifiedBytes)> = Vec::new();
    let (mut local_bytes, mut peer_bytes) = (0, 0);
    for piece in &pieces {
        if cancelled() {
            return Err("cancelled".to_string().into());
        }
        let Checked { part, header } = checked[piece.key.rank].as_ref().expect("checked above");
        let own = if piece.holder == rank {
            Some(
                memory
                    .get(&piece.key)
                    .ok_or_else(|| format!("own copy {:?} is gone", piece.key))?,
            )
        } else {
            connected(&mut peers, table, piece.holder)?;
            None
        };
        let peer = &mut peers[piece.holder];
        let cols = shapes[piece.tensor].cols;
        let need = shard_range(shapes[piece.tensor].rows, rank, world);
        let into = (piece.rows.start - need.start) * cols..(piece.rows.end - need.start) * cols;
        let object = format!(
            "copy of {dir} (rank {} of {}) held by rank {}",
            piece.key.rank, piece.key.world, piece.holder
        );
        for kind in 0..KINDS {
            let index = piece.tensor * KINDS + kind;
            let chunk = part
                .chunks
                .iter()
                .find(|c| c.tensor == saved.names[index])
                .ok_or_else(|| {
                    format!(
                        "{dir} rank {} saved no {:?}",
                        piece.key.rank, saved.names[index]
                    )
                })?;
            let want = chunk.bytes[0] + 4 * piece.elements.start as u64
                ..chunk.bytes[0] + 4 * piece.elements.end as u64;
            // A span verified for an earlier piece may cover this one (a small file is
            // one block, which every piece of it shares).
            let hit = recent
                .iter()
                .position(|(r, v)| *r == piece.key.rank && v.slice(want.clone()).is_some());
            let at = match hit {
                Some(at) => at,
                None => {
                    // Fills a share of a block from the copy of the chunk's tensor.
                    let mut read =
                        |chunk: &Chunk, bytes: Range<u64>, out: &mut [u8]| -> Result<(), String> {
                            let index = saved
                                .names
                                .iter()
                                .position(|n| *n == chunk.tensor)
                                .ok_or_else(|| {
                                    format!("{dir} holds {:?}, which no copy has", chunk.tensor)
                                })?;
                            if !bytes.start.is_multiple_of(4) || !bytes.end.is_multiple_of(4) {
                                return Err(format!(
                                    "bytes {bytes:?} of {:?} split an f32",
                                    chunk.tensor
                                ));
                            }
                            let elements = bytes.start as usize / 4..bytes.end as usize / 4;
                            match (&own, &mut *peer) {
                                (Some(copy), _) => {
                                    let from = copy
                                        .tensors
                                        .get(index)
                                        .and_then(|t| t.get(elements))
                                        .ok_or_else(|| {
                                            format!("own copy {:?} lacks tensor {index}", piece.key)
                                        })?;
                                    out.copy_from_slice(pod_bytes(from));
                                    local_bytes += out.len();
                                }
                                (None, Some(peer)) => {
                                    peer.rows(&piece.key, index, elements, out)
                                        .map_err(|e| format!("rank {}: {e}", piece.holder))?;
                                    peer_bytes += out.len();
                                }
                                (None, None) => unreachable!("connected above"),
                            }
                            Ok(())
                        };
                    let verified =
                        ckpt::copies::read_verified(part, header, want.clone(), &object, &mut read)
                            .map_err(|e| match e {
                                ckpt::Error::Corrupt(_) => AssembleError::Mismatch(e.to_string()),
                                other => AssembleError::Unavailable(other.to_string()),
                            })?;
                    if recent.len() == RECENT_SPANS {
                        recent.remove(0);
                    }
                    recent.push((piece.key.rank, verified));
                    recent.len() - 1
                }
            };
            let bytes = recent[at]
                .1
                .slice(want)
                .expect("a verified span covers what was asked");
            pod_bytes_mut(&mut tensors[index][into.clone()]).copy_from_slice(bytes);
        }
    }
    Ok(Assembled {
        tensors,
        saved_world: sources[0].1.world,
        local_bytes,
        peer_bytes,
    })
}

/// The connection to `holder`'s copy server, opened on first use.
fn connected<'p>(
    peers: &'p mut [Option<Peer>],
    table: &[Holding],
    holder: usize,
) -> Result<&'p mut Peer, String> {
    match &mut peers[holder] {
        Some(peer) => Ok(peer),
        slot => {
            let addr = table[holder]
                .addr
                .ok_or_else(|| format!("rank {holder} has no copy server"))?;
            Ok(slot.insert(Peer::connect(addr).map_err(|e| e.to_string())?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shapes whose rows span several 4 KiB blocks (and one that fits in one), so
    /// pieces and blocks straddle each other.
    fn shapes() -> Vec<Shape> {
        vec![Shape { rows: 700, cols: 3 }, Shape { rows: 3, cols: 2 }]
    }

    /// What the copies of the tensors of `shapes()` are saved as.
    fn names(shapes: &[Shape]) -> Vec<String> {
        (0..shapes.len() * KINDS)
            .map(|i| format!("t{}/k{}", i / KINDS, i % KINDS))
            .collect()
    }

    /// The rank parts of a real save of `full(shapes)` by `world` ranks (4 KiB blocks,
    /// so that the checks cross block boundaries).
    fn saved_parts(shapes: &[Shape], world: usize) -> Vec<Arc<RankPart>> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let full = full(shapes);
        let names = names(shapes);
        runtime.block_on(async {
            // memory:// stores of one name are shared by the process: one per call.
            static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let store = ckpt::storage::Store::from_url(&format!("memory://copies-{call}")).unwrap();
            let mut handles = Vec::new();
            for rank in 0..world {
                let mut config = ckpt::CheckpointConfig::new(rank, world);
                config.block_size = 4096;
                let checkpointer = ckpt::Checkpointer::new(store.clone(), config).unwrap();
                let mut state = ckpt::State::new();
                for (index, tensor) in full.iter().enumerate() {
                    let s = shapes[index / KINDS];
                    let rows = shard_range(s.rows, rank, world);
                    state
                        .add_dim0_shard(
                            names[index].clone(),
                            ckpt::DType::F32,
                            &[s.rows as u64, s.cols as u64],
                            rank,
                            world,
                            pod_bytes(&tensor[rows.start * s.cols..rows.end * s.cols]),
                        )
                        .unwrap();
                }
                handles.push(checkpointer.save(10, &state).await.unwrap());
            }
            for handle in &handles {
                handle.committed().await.unwrap();
            }
            let reader = ckpt::CheckpointReader::open(&store, None).await.unwrap();
            let mut parts = Vec::new();
            for rank in 0..world {
                parts.push(reader.part(rank as u32).await.unwrap());
            }
            parts
        })
    }

    /// `assemble` against the rank parts `parts`.
    #[allow(clippy::too_many_arguments)]
    fn assemble_checked(
        memory: &Memory,
        table: &[Holding],
        rank: usize,
        world: usize,
        dir: &str,
        parts: &[Arc<RankPart>],
        spare: Vec<Vec<f32>>,
    ) -> Result<Assembled, AssembleError> {
        let shapes = shapes();
        let names = names(&shapes);
        let part = |r: usize| parts.get(r).cloned().ok_or_else(|| format!("no part {r}"));
        let saved = Saved {
            names: &names,
            part: &part,
        };
        assemble(
            memory,
            table,
            rank,
            world,
            dir,
            &shapes,
            &saved,
            spare,
            &|| false,
        )
    }

    /// The full tensors: element value = tensor index * 1000 + position.
    fn full(shapes: &[Shape]) -> Vec<Vec<f32>> {
        shapes
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                (0..KINDS).map(move |k| {
                    (0..s.rows * s.cols)
                        .map(|e| ((i * KINDS + k) * 1000 + e) as f32)
                        .collect()
                })
            })
            .collect()
    }

    fn copy_of(dir: &str, shapes: &[Shape], rank: usize, world: usize) -> RankCopy {
        let full = full(shapes);
        let tensors = full
            .iter()
            .enumerate()
            .map(|(index, t)| {
                let s = shapes[index / KINDS];
                let rows = shard_range(s.rows, rank, world);
                t[rows.start * s.cols..rows.end * s.cols].to_vec()
            })
            .collect();
        RankCopy::new(
            Key {
                dir: dir.into(),
                world,
                rank,
            },
            tensors,
        )
    }

    fn expected(shapes: &[Shape], rank: usize, world: usize) -> Vec<Vec<f32>> {
        copy_of("x", shapes, rank, world).tensors
    }

    #[test]
    fn a_lost_rank_is_rebuilt_from_its_successors_replica_and_the_survivors_copies() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let shapes = shapes();
        let parts = saved_parts(&shapes, 4);
        let dir = "step-10/g00000001-job-e1";
        // Four ranks saved; rank 2 is lost; rank 3 pulled rank 2's copy as a replica.
        let survivors: Vec<Arc<Memory>> = [0, 1, 3]
            .into_iter()
            .map(|old| {
                let m = Memory::start(ip).unwrap();
                m.keep_own(copy_of(dir, &shapes, old, 4));
                m
            })
            .collect();
        let lens: Vec<usize> = copy_of(dir, &shapes, 2, 4)
            .tensors
            .iter()
            .map(Vec::len)
            .collect();
        let source = Memory::start(ip).unwrap();
        source.keep_own(copy_of(dir, &shapes, 2, 4));
        let key2 = Key {
            dir: dir.into(),
            world: 4,
            rank: 2,
        };
        survivors[2].replicate(source.addr(), key2.clone(), lens);
        let deadline = Instant::now() + Duration::from_secs(10);
        while survivors[2].get(&key2).is_none() {
            assert!(Instant::now() < deadline, "the replica never arrived");
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(source);
        let table: Vec<Holding> = survivors.iter().map(|m| m.holding()).collect();
        let table: Vec<Holding> = table.iter().map(|h| Holding::decode(&h.encode())).collect();
        for (rank, memory) in survivors.iter().enumerate() {
            let got = assemble_checked(memory, &table, rank, 3, dir, &parts, Vec::new()).unwrap();
            assert_eq!(got.tensors, expected(&shapes, rank, 3), "rank {rank}");
            assert_eq!(got.saved_world, 4);
        }
        // Rank 1 of 3 needs rows that rank 2 of 4 owned: they came from a peer.
        let got = assemble_checked(
            &survivors[1],
            &table,
            1,
            3,
            dir,
            &parts,
            vec![vec![7.0; 2]; 6],
        )
        .unwrap();
        assert!(got.peer_bytes > 0 && got.local_bytes > 0, "{got:?}");
        // Spare vectors (of other sizes and contents) are only memory to fill.
        assert_eq!(got.tensors, expected(&shapes, 1, 3));
    }

    #[test]
    fn rows_nobody_holds_fail_before_anything_is_fetched() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let shapes = shapes();
        let dir = "step-10/g00000001-job-e1";
        let memory = Memory::start(ip).unwrap();
        memory.keep_own(copy_of(dir, &shapes, 0, 2));
        let table = vec![memory.holding(), Holding::default()];
        // No part is asked for: the plan fails first.
        let err = assemble_checked(&memory, &table, 0, 1, dir, &[], Vec::new()).unwrap_err();
        assert!(
            matches!(&err, AssembleError::Unavailable(e) if e.contains("held by nobody")),
            "{err}"
        );
        let err =
            assemble_checked(&memory, &table, 0, 1, "step-20/g1-x", &[], Vec::new()).unwrap_err();
        assert!(
            matches!(&err, AssembleError::Unavailable(e) if e.contains("no rank holds")),
            "{err}"
        );
    }

    #[test]
    fn only_the_newest_and_the_confirmed_checkpoints_are_kept() {
        let memory = Memory::start("127.0.0.1".parse().unwrap()).unwrap();
        let shapes = shapes();
        let key = |dir: &str| Key {
            dir: dir.into(),
            world: 1,
            rank: 0,
        };
        memory.keep_own(copy_of("a", &shapes, 0, 1));
        memory.confirm("a");
        memory.keep_own(copy_of("b", &shapes, 0, 1));
        assert!(memory.get(&key("a")).is_some() && memory.get(&key("b")).is_some());
        memory.keep_own(copy_of("c", &shapes, 0, 1));
        assert!(memory.get(&key("a")).is_some(), "confirmed: kept");
        assert!(
            memory.get(&key("b")).is_none(),
            "neither newest nor confirmed"
        );
        memory.confirm("c");
        assert!(memory.get(&key("a")).is_none());
        assert_eq!(memory.holding().held, vec![key("c")]);
        // The evicted copies' vectors are reused, contents replaced.
        let free = memory.lock().free.len();
        assert!(free >= 2 * shapes.len() * KINDS, "{free} free vectors");
        let v = memory.copy_of(&[1.0, 2.0]);
        assert_eq!(v, vec![1.0, 2.0]);
        assert_eq!(memory.lock().free.len(), free - 1);
    }

    #[test]
    fn a_server_answers_bad_requests_with_an_error_and_stays_up() {
        let memory = Memory::start("127.0.0.1".parse().unwrap()).unwrap();
        memory.keep_own(copy_of("a", &shapes(), 0, 1));
        let mut peer = Peer::connect(memory.addr()).unwrap();
        for bad in [
            "rows a 1 0 0 5 1",
            "rows a 1 0 99 0 1",
            "rows a 1 0 0 0 100000",
            "rows b 1 0 0 0 1",
            "rows a x 0 0 0 1",
            "hello",
        ] {
            assert!(
                matches!(peer.ask(bad), Err(FetchError::Refused(_))),
                "{bad}"
            );
        }
        let long = "x".repeat(2000);
        assert!(peer.ask(&long).is_err());
        let mut peer = Peer::connect(memory.addr()).unwrap();
        let mut out = vec![0f32; 3];
        let key = Key {
            dir: "a".into(),
            world: 1,
            rank: 0,
        };
        peer.rows(&key, 1, 0..3, pod_bytes_mut(&mut out)).unwrap();
        assert_eq!(out, vec![1000.0, 1001.0, 1002.0]);
    }

    /// Two survivors of a world of two, rank 1 serving a copy with one flipped bit:
    /// the rows it serves fail the save's checksums, and the error names the copy,
    /// its holder and the block.
    #[test]
    fn a_peer_serving_a_corrupted_copy_is_caught_by_the_saves_checksums() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let shapes = shapes();
        let parts = saved_parts(&shapes, 2);
        let dir = "step-10/g00000001-job-e1";
        let (healthy, rotten) = (Memory::start(ip).unwrap(), Memory::start(ip).unwrap());
        healthy.keep_own(copy_of(dir, &shapes, 0, 2));
        let mut bad = copy_of(dir, &shapes, 1, 2);
        // Tensor 1 (t0/k1), well inside rank 1's rows, one bit of one element.
        bad.tensors[1][500] = f32::from_bits(bad.tensors[1][500].to_bits() ^ 1);
        rotten.keep_own(bad);
        let table = vec![healthy.holding(), rotten.holding()];
        // World 1: rank 0 needs every row, half of them from rank 1.
        let err = assemble_checked(&healthy, &table, 0, 1, dir, &parts, Vec::new()).unwrap_err();
        let AssembleError::Mismatch(why) = &err else {
            panic!("expected a checksum mismatch, got {err}");
        };
        assert!(
            why.contains("held by rank 1") && why.contains("block"),
            "{why}"
        );
        // The same rows from an intact copy pass: the check is of the bytes, not of
        // where they come from.
        let intact = Memory::start(ip).unwrap();
        intact.keep_own(copy_of(dir, &shapes, 1, 2));
        let table = vec![healthy.holding(), intact.holding()];
        let got = assemble_checked(&healthy, &table, 0, 1, dir, &parts, Vec::new()).unwrap();
        assert_eq!(got.tensors, expected(&shapes, 0, 1));
    }

    /// A rank's own copy is checked too: memory can rot in the process that saved.
    #[test]
    fn a_rotten_own_copy_is_caught_and_an_intact_one_passes() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let shapes = shapes();
        let parts = saved_parts(&shapes, 1);
        let dir = "step-10/g00000001-job-e1";
        let memory = Memory::start(ip).unwrap();
        let mut bad = copy_of(dir, &shapes, 0, 1);
        let last = bad.tensors[KINDS].len() - 1;
        bad.tensors[KINDS][last] += 1.0;
        memory.keep_own(bad);
        let table = vec![memory.holding()];
        let err = assemble_checked(&memory, &table, 0, 1, dir, &parts, Vec::new()).unwrap_err();
        assert!(
            matches!(&err, AssembleError::Mismatch(e) if e.contains("held by rank 0")),
            "{err}"
        );
        memory.keep_own(copy_of(dir, &shapes, 0, 1));
        let got = assemble_checked(&memory, &table, 0, 1, dir, &parts, Vec::new()).unwrap();
        assert_eq!(got.tensors, expected(&shapes, 0, 1));
        assert!(got.local_bytes > 0 && got.peer_bytes == 0);
    }

    /// Copies laid out for another world than the commit's are not copies of it.
    #[test]
    fn copies_of_another_world_than_the_commits_are_refused() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let shapes = shapes();
        let parts = saved_parts(&shapes, 2);
        let dir = "step-10/g00000001-job-e1";
        let memory = Memory::start(ip).unwrap();
        memory.keep_own(copy_of(dir, &shapes, 0, 1));
        let table = vec![memory.holding()];
        let err = assemble_checked(&memory, &table, 0, 1, dir, &parts, Vec::new()).unwrap_err();
        assert!(
            matches!(&err, AssembleError::Unavailable(e) if e.contains("world of 1")),
            "{err}"
        );
    }

    #[test]
    fn oversized_holdings_drop_copies_instead_of_failing() {
        let held: Vec<Key> = (0..100)
            .map(|r| Key {
                dir: format!("step-{r}/g00000001-some-long-run-id"),
                world: 100,
                rank: r,
            })
            .collect();
        let h = Holding {
            addr: Some("127.0.0.1:1".parse().unwrap()),
            held,
        };
        let record = h.encode();
        assert_eq!(record.len(), Holding::SIZE);
        let back = Holding::decode(&record);
        assert!(!back.held.is_empty() && back.held.len() < 100);
        assert_eq!(back.held[..], h.held[..back.held.len()]);
        assert_eq!(Holding::decode(b"garbage"), Holding::default());
    }
}
