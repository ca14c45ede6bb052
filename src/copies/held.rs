//! The holder of one rank's copies: which it keeps, for how long, within what memory.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use ckpt_auth::JobSecret;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::net::{Pull, Server, pull_replicas};
use super::{CopyKey, RankCopy, Snapshot};
use crate::budget::{Dropper, HostBudget};
use crate::error::{Error, Result};

/// What [`Copies::keep`] needs of a save: its step, its checkpoint's directory, and
/// where its staged file is published once staged (`None` when the save keeps no
/// copy). The save path makes one from a [`SaveHandle`](crate::SaveHandle); the copies
/// need nothing else of the save, so they do not depend on it.
#[derive(Debug, Clone)]
pub struct PendingCopy {
    /// The step saved.
    pub step: u64,
    /// The save attempt's directory (its checkpoint's name).
    pub dir: String,
    /// Where the staged file arrives.
    pub copy: Option<watch::Receiver<Option<RankCopy>>>,
}

/// Settings of a [`Copies`] holder.
#[derive(Debug, Clone)]
pub struct CopyConfig {
    /// Most bytes of copies (own copies and replicas together) held at once; a copy
    /// that would pass it is not kept. Default: no bound (two checkpoints' own copies
    /// and replicas, about four times the rank's share of a checkpoint).
    pub max_bytes: u64,
    /// How long a peer may take to accept a connection or answer one request before it
    /// is given up on. Default 5 s.
    pub peer_timeout: Duration,
    /// How long a replica pull waits for its source to have staged the copy. Default
    /// 30 s.
    pub pull_patience: Duration,
    /// Peer connections the copy server serves at once; further ones are answered
    /// with an error and closed. Default 64.
    pub max_connections: usize,
    /// The job's secret ([`JobSecret::from_env`]): with one, the copy server admits
    /// only peers that prove it (a mutual handshake before any request, see the
    /// [module docs](super)), and this holder proves it to every copy server it
    /// connects to (replica pulls, [`load_into`](super::load_into)); a server that
    /// does not prove it back is treated like one that does not answer. Every rank
    /// of a job must hold the same one. Default `None`: no handshake, any peer that
    /// connects is answered.
    pub secret: Option<JobSecret>,
    /// The rank's host-memory budget, shared with its checkpointer
    /// ([`Checkpointer::host_budget`](crate::Checkpointer::host_budget)): replicas are
    /// reserved from it before they are pulled, and the holder lets go of its oldest
    /// droppable copy when a reservation does not fit ([`crate::budget`]). Default
    /// `None`: replicas are bounded by `max_bytes` only.
    pub budget: Option<Arc<HostBudget>>,
}

impl Default for CopyConfig {
    fn default() -> Self {
        Self {
            max_bytes: u64::MAX,
            peer_timeout: Duration::from_secs(5),
            pull_patience: Duration::from_secs(30),
            max_connections: 64,
            secret: None,
            budget: None,
        }
    }
}

/// One copy held: a file of a save or of a snapshot, the rank's own or a replica.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) copy: RankCopy,
    /// A replica of a peer's copy (not this rank's own).
    pub(crate) replica: bool,
    /// A snapshot's file: its rank part (the block CRC32s its checks need).
    pub(crate) part: Option<Arc<Vec<u8>>>,
}

/// The copies one rank holds, shared with its copy server and replica puller.
#[derive(Debug, Default)]
pub(crate) struct Held {
    /// Own copies and replicas, of saves and snapshots, oldest first.
    copies: Vec<Entry>,
    /// Own copies of saves still staging: (attempt directory, where the copy comes).
    pending: Vec<(String, watch::Receiver<Option<RankCopy>>)>,
    /// The newest checkpoint this rank saved.
    newest: Option<String>,
    /// The newest checkpoint this rank knows to be committed.
    confirmed: Option<String>,
    /// The newest snapshot this rank took (its attempt directory).
    newest_snapshot: Option<String>,
    /// The newest snapshot known to be committed, and the CRC32 of every rank's
    /// part of it (in rank order) that its commit agreed on.
    committed_snapshot: Option<(String, Arc<Vec<u32>>)>,
    /// The snapshot committed before it, kept while room allows: every rank commits
    /// after the vote, but the control plane records the commit a moment later and
    /// may refuse it (the generation ended meanwhile), so the snapshot a recovery is
    /// told to use can be this one.
    previous_snapshot: Option<(String, Arc<Vec<u32>>)>,
    max_bytes: u64,
    /// Replica pulls asked for, and ended (arrived or given up).
    pulls_asked: u64,
    pulls_ended: u64,
}

impl Held {
    /// True when copies of the save or snapshot in `dir` are kept.
    pub(crate) fn kept(&self, dir: &str) -> bool {
        self.newest.as_deref() == Some(dir)
            || self.confirmed.as_deref() == Some(dir)
            || self.newest_snapshot.as_deref() == Some(dir)
            || self.committed_snapshot_dir() == Some(dir)
            || self.previous_snapshot.as_ref().map(|(d, _)| d.as_str()) == Some(dir)
    }

    fn committed_snapshot_dir(&self) -> Option<&str> {
        self.committed_snapshot.as_ref().map(|(d, _)| d.as_str())
    }

    /// True when `dir`'s copies must not be dropped to make room: the newest
    /// committed checkpoint's and snapshot's, until their successors commit. (The
    /// previously committed snapshot is not: it is the first to go.)
    fn protected(&self, dir: &str) -> bool {
        self.confirmed.as_deref() == Some(dir) || self.committed_snapshot_dir() == Some(dir)
    }

    /// Bytes of the copies held.
    pub(crate) fn bytes(&self) -> u64 {
        self.copies.iter().map(|e| e.copy.len()).sum()
    }

    /// Takes the own copies whose saves have staged since the last look; drops those
    /// whose saves failed to stage.
    pub(crate) fn settle(&mut self) {
        let mut staged = Vec::new();
        self.pending.retain(|(_, copy)| {
            if let Some(copy) = copy.borrow().clone() {
                staged.push(copy);
                return false;
            }
            // Closed without a copy: the save failed while staging.
            copy.has_changed().is_ok()
        });
        for copy in staged {
            if let Err(why) = self.put(copy, false, None) {
                tracing::info!("{why}");
            }
        }
    }

    /// Lets go of every copy of a checkpoint that is neither the newest saved nor the
    /// newest committed.
    fn evict(&mut self) {
        let copies = std::mem::take(&mut self.copies);
        self.copies = copies
            .into_iter()
            .filter(|e| self.kept(&e.copy.key.dir))
            .collect();
        let pending = std::mem::take(&mut self.pending);
        self.pending = pending
            .into_iter()
            .filter(|(dir, _)| self.kept(dir))
            .collect();
    }

    /// Lets go of the oldest copy of a step before `before` that is not protected
    /// ([`Held::protected`]); false when there is none.
    fn drop_oldest(&mut self, before: u64) -> bool {
        let Some(at) = self
            .copies
            .iter()
            .position(|e| step_of(&e.copy.key.dir) < before && !self.protected(&e.copy.key.dir))
        else {
            return false;
        };
        let gone = self.copies.remove(at);
        tracing::info!(
            copy = %gone.copy.key,
            bytes = gone.copy.len(),
            "in-memory copy let go to stay inside the host memory budget"
        );
        true
    }

    /// Holds `copy` (an own copy, or a `replica`), replacing one of the same key, if
    /// its checkpoint is kept and it fits the budget; says why not otherwise. Own
    /// copies come first: to fit one, replicas are let go (an own copy serves this
    /// rank's recovery and its successor's replica; a replica only a neighbour's).
    pub(crate) fn put(
        &mut self,
        copy: RankCopy,
        replica: bool,
        part: Option<Arc<Vec<u8>>>,
    ) -> std::result::Result<(), String> {
        if !self.kept(&copy.key.dir) {
            return Err(format!(
                "copy of {} not kept: neither the newest nor the committed checkpoint or snapshot",
                copy.key
            ));
        }
        self.copies.retain(|e| e.copy.key != copy.key);
        if !replica {
            while self.fits(copy.len()).is_err() {
                let Some(at) = self.copies.iter().position(|e| e.replica) else {
                    break;
                };
                let evicted = self.copies.remove(at).copy;
                tracing::info!(
                    "replica of {} let go to make room for this rank's own copy",
                    evicted.key
                );
            }
        }
        self.fits(copy.len())
            .map_err(|why| format!("copy of {} not kept: {why}", copy.key))?;
        self.copies.push(Entry {
            copy,
            replica,
            part,
        });
        Ok(())
    }

    /// Whether `len` more bytes fit the budget.
    pub(crate) fn fits(&self, len: u64) -> std::result::Result<(), String> {
        let held = self.bytes();
        if held.saturating_add(len) > self.max_bytes {
            return Err(format!(
                "{len} bytes would pass the budget of {} bytes ({held} held)",
                self.max_bytes
            ));
        }
        Ok(())
    }

    /// The copy named `key`, if held.
    pub(crate) fn get(&mut self, key: &CopyKey) -> Option<RankCopy> {
        self.entry(key).map(|e| e.copy)
    }

    /// The entry of the copy named `key`, if held.
    pub(crate) fn entry(&mut self, key: &CopyKey) -> Option<Entry> {
        self.settle();
        self.copies.iter().find(|e| &e.copy.key == key).cloned()
    }

    /// The part CRC32s of the committed snapshot in `dir`, if it is the newest
    /// committed or the one before it.
    pub(crate) fn snapshot_table(&self, dir: &str) -> Option<Arc<Vec<u32>>> {
        [&self.committed_snapshot, &self.previous_snapshot]
            .into_iter()
            .flatten()
            .find(|(d, _)| d == dir)
            .map(|(_, t)| t.clone())
    }
}

/// A lock on the held copies, with the condition signalled whenever one arrives.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    held: Mutex<Held>,
    arrived: Condvar,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds a replica that just arrived (with its part, for a snapshot's), and
    /// wakes whoever waits for it.
    pub(crate) fn put_replica(
        &self,
        copy: RankCopy,
        part: Option<Arc<Vec<u8>>>,
    ) -> std::result::Result<(), String> {
        let result = self.lock().put(copy, true, part);
        self.arrived.notify_all();
        result
    }

    /// Counts a replica pull as ended, and wakes whoever waits for that.
    pub(crate) fn pull_ended(&self) {
        self.lock().pulls_ended += 1;
        self.arrived.notify_all();
    }
}

impl Dropper for Shared {
    fn drop_oldest(&self, before: u64) -> bool {
        self.lock().drop_oldest(before)
    }
}

/// The step of an attempt directory (`step-N/…`); 0 for a name of another form.
fn step_of(dir: &str) -> u64 {
    dir.strip_prefix("step-")
        .and_then(|rest| rest.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// This rank's in-memory copies: its own copies of its saves, the replicas it pulled
/// of its ring predecessor's, and (with [`Copies::serve`]) the server that hands
/// them to peers. See the [module docs](super) for what is kept and why.
///
/// Dropping it stops its server and its replica puller: the puller ends after the
/// pull under way, and a peer connection still open is closed before its next request
/// (an idle one within a minute).
#[derive(Debug)]
pub struct Copies {
    config: CopyConfig,
    shared: Arc<Shared>,
    server: Option<Server>,
    pulls: Option<Mutex<mpsc::Sender<Pull>>>,
}

impl Copies {
    /// A holder without a server: it keeps its own copies and reads peers' at a
    /// recovery, but serves none and pulls no replica.
    pub fn new(config: CopyConfig) -> Self {
        let shared = Arc::new(Shared::default());
        shared.lock().max_bytes = config.max_bytes;
        if let Some(budget) = &config.budget {
            let dropper: Arc<dyn Dropper> = shared.clone();
            budget.register(Arc::downgrade(&dropper));
        }
        Self {
            config,
            shared,
            server: None,
            pulls: None,
        }
    }

    /// A holder whose copies are served to peers on `ip` (any free port, see
    /// [`Copies::addr`]), with a background thread that pulls the replicas asked for
    /// by [`Copies::replicate`].
    pub fn serve(ip: IpAddr, config: CopyConfig) -> std::io::Result<Self> {
        let mut copies = Self::new(config);
        let listener = TcpListener::bind((ip, 0))?;
        copies.server = Some(Server::start(
            listener,
            copies.shared.clone(),
            copies.config.clone(),
        )?);
        let (tx, rx) = mpsc::channel::<Pull>();
        let (shared, config) = (copies.shared.clone(), copies.config.clone());
        std::thread::Builder::new()
            .name("ckpt-copy-pull".into())
            .spawn(move || pull_replicas(rx, &shared, &config))?;
        copies.pulls = Some(Mutex::new(tx));
        Ok(copies)
    }

    /// Where peers fetch this rank's copies (`None` without a server).
    pub fn addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(Server::addr)
    }

    /// The settings.
    pub fn config(&self) -> &CopyConfig {
        &self.config
    }

    /// Connections the copy server refused because the peer did not prove the job
    /// secret ([`CopyConfig::secret`]) since it started; 0 without a server or a
    /// secret. Each refusal is also logged (the first ones one by one, then one line
    /// per thousand).
    pub fn refused_connections(&self) -> u64 {
        self.server.as_ref().map_or(0, Server::refused)
    }

    /// Keeps the save `save` follows (a [`SaveHandle`](crate::SaveHandle), or its
    /// [`PendingCopy`]) as this rank's own copy, once it has staged (the holder takes
    /// it then, without waiting here); its checkpoint is now the newest, and copies of
    /// checkpoints neither newest nor committed are let go.
    ///
    /// Errors: [`Error::Invalid`] when the save keeps no copy (its checkpointer lacks
    /// [`CheckpointConfig::keep_copy`](crate::CheckpointConfig::keep_copy)).
    pub fn keep(&self, save: impl Into<PendingCopy>) -> Result<()> {
        let PendingCopy { step, dir, copy } = save.into();
        let copy = copy.ok_or_else(|| {
            Error::invalid(format!(
                "step {step}: the save keeps no copy (CheckpointConfig::keep_copy is off)"
            ))
        })?;
        let mut held = self.shared.lock();
        held.newest = Some(dir.clone());
        held.pending.retain(|(d, _)| *d != dir);
        held.pending.push((dir, copy));
        held.evict();
        held.settle();
        Ok(())
    }

    /// Keeps `copy` as this rank's own copy of a save (made elsewhere: an adapter's,
    /// or a test's); its checkpoint is now the newest. Returns false, with the reason
    /// logged, when it does not fit [`CopyConfig::max_bytes`].
    pub fn keep_copy(&self, copy: RankCopy) -> bool {
        let mut held = self.shared.lock();
        held.newest = Some(copy.key.dir.clone());
        held.evict();
        held.settle();
        let kept = held.put(copy, false, None);
        drop(held);
        self.shared.arrived.notify_all();
        match kept {
            Ok(()) => true,
            Err(why) => {
                tracing::info!("{why}");
                false
            }
        }
    }

    /// Keeps `snapshot` (from [`SnapshotHandle::ready`](crate::SnapshotHandle::ready))
    /// as this rank's newest snapshot, its part with it; snapshots neither newest nor
    /// committed are let go. Returns false, with the reason logged, when it does not
    /// fit [`CopyConfig::max_bytes`].
    pub fn keep_snapshot(&self, snapshot: &Snapshot) -> bool {
        let mut held = self.shared.lock();
        held.newest_snapshot = Some(snapshot.key().dir.clone());
        held.evict();
        let kept = held.put(snapshot.copy().clone(), false, Some(snapshot.part_shared()));
        drop(held);
        self.shared.arrived.notify_all();
        match kept {
            Ok(()) => true,
            Err(why) => {
                tracing::info!("{why}");
                false
            }
        }
    }

    /// Starts pulling, in the background, a replica of the snapshot file `key` and
    /// its part from the copy server at `from` (as [`Copies::replicate`]).
    pub fn replicate_snapshot(&self, from: SocketAddr, key: CopyKey) {
        if let Some(pulls) = &self.pulls {
            let pulls = pulls.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.lock().pulls_asked += 1;
            let pull = Pull {
                from,
                key,
                snapshot: true,
            };
            if pulls.send(pull).is_err() {
                self.shared.pull_ended();
            }
        }
    }

    /// Notes that the snapshot in `dir` is committed, with the CRC32 of every rank's
    /// part of it in rank order (what its commit agreed on): it is kept until a newer
    /// snapshot commits, and its table answers peers' `table` requests at a
    /// recovery. The one committed before it is kept too while the budget allows (the
    /// control plane records a commit a moment after the ranks make it, and may refuse
    /// it when the generation has ended meanwhile); older snapshots are let go.
    pub fn commit_snapshot(&self, dir: &str, part_crc32s: Vec<u32>) {
        let mut held = self.shared.lock();
        let table = Arc::new(part_crc32s);
        match held.committed_snapshot.replace((dir.to_string(), table)) {
            Some(before) if before.0 != dir => held.previous_snapshot = Some(before),
            _ => {}
        }
        held.evict();
    }

    /// The CRC32 of every rank's part of the committed snapshot in `dir`, if this rank
    /// knows it (the newest committed snapshot or the one before it).
    pub fn snapshot_table(&self, dir: &str) -> Option<Vec<u32>> {
        self.shared.lock().snapshot_table(dir).map(|t| t.to_vec())
    }

    /// The newest snapshot this rank knows to be committed: its directory and the
    /// CRC32 of every rank's part.
    pub fn committed_snapshot(&self) -> Option<(String, Vec<u32>)> {
        self.shared
            .lock()
            .committed_snapshot
            .as_ref()
            .map(|(d, t)| (d.clone(), t.to_vec()))
    }

    /// The part of the snapshot file `key`, if this rank holds the file (its own or
    /// a replica).
    pub fn snapshot_part(&self, key: &CopyKey) -> Option<Arc<Vec<u8>>> {
        self.shared.lock().entry(key).and_then(|e| e.part)
    }

    /// Notes that the checkpoint saved in `dir` is committed: a failure resumes from
    /// it until a newer one is, so its copies are kept until then.
    pub fn confirm(&self, dir: &str) {
        let mut held = self.shared.lock();
        held.confirmed = Some(dir.to_string());
        held.evict();
    }

    /// Starts pulling, in the background, a replica of `key`'s copy from the copy
    /// server at `from` (which may not have staged it yet: the pull waits up to
    /// [`CopyConfig::pull_patience`]). Does nothing on a holder without a server. A
    /// replica is kept only while its checkpoint is (see [`Copies::keep`]) and within
    /// the budget; it is logged at debug level when it arrives ("replica pulled"), and
    /// at info level when it does not.
    pub fn replicate(&self, from: SocketAddr, key: CopyKey) {
        if let Some(pulls) = &self.pulls {
            let pulls = pulls.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.lock().pulls_asked += 1;
            if pulls
                .send(Pull {
                    from,
                    key,
                    snapshot: false,
                })
                .is_err()
            {
                self.shared.pull_ended();
            }
        }
    }

    /// Waits up to `timeout` until every replica asked for so far has arrived or been
    /// given up; true once they have.
    pub fn wait_for_pulls(&self, timeout: Duration) -> bool {
        self.wait_until(timeout, |held| held.pulls_ended >= held.pulls_asked)
    }

    /// The copy named `key`, if held.
    pub fn get(&self, key: &CopyKey) -> Option<RankCopy> {
        self.shared.lock().get(key)
    }

    /// Waits up to `timeout` for the copy named `key` to be held (a replica being
    /// pulled, an own copy still staging); true once it is.
    pub fn wait_for(&self, key: &CopyKey, timeout: Duration) -> bool {
        self.wait_until(timeout, |held| held.get(key).is_some())
    }

    /// Waits up to `timeout` for `done` to hold of the held copies.
    fn wait_until(&self, timeout: Duration, mut done: impl FnMut(&mut Held) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut held = self.shared.lock();
        loop {
            if done(&mut held) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            // Own copies settle without a signal: look again at least every 10 ms.
            let pause = left.min(Duration::from_millis(10));
            held = self
                .shared
                .arrived
                .wait_timeout(held, pause)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Bytes of the copies held.
    pub fn held_bytes(&self) -> u64 {
        let mut held = self.shared.lock();
        held.settle();
        held.bytes()
    }

    /// This rank's record for the table of holdings: its server and every copy held.
    pub fn holding(&self) -> Holding {
        let mut held = self.shared.lock();
        held.settle();
        Holding {
            addr: self.addr(),
            held: held.copies.iter().map(|e| e.copy.key.clone()).collect(),
        }
    }
}

impl Drop for Copies {
    fn drop(&mut self) {
        // The puller ends when its channel closes; the server is stopped by its own
        // drop.
        self.pulls = None;
    }
}

/// What one rank holds, as published to the others at the start of a recovery (an
/// all-gather of fixed-size records, [`Holding::encode`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    /// Its copy server, if it has one.
    pub addr: Option<SocketAddr>,
    /// The copies it holds.
    pub held: Vec<CopyKey>,
}

/// Size of one rank's record in the table of holdings (JSON, padded with spaces).
const RECORD: usize = 1024;

impl Holding {
    /// Size of one record.
    pub const SIZE: usize = RECORD;

    /// The fixed-size record ([`Holding::SIZE`] bytes) exchanged with an all-gather:
    /// the keys grouped by attempt directory (a rank holds a few files of each of a
    /// few saves and snapshots). Copies that do not fit are left out, the oldest
    /// directories first: they are only an optimization, and a recovery wants the
    /// newest.
    pub fn encode(&self) -> Vec<u8> {
        let mut groups: Vec<(String, u32, Vec<u32>)> = Vec::new();
        for key in &self.held {
            match groups.last_mut() {
                Some((dir, world, ranks)) if *dir == key.dir && *world == key.world => {
                    ranks.push(key.rank)
                }
                _ => groups.push((key.dir.clone(), key.world, vec![key.rank])),
            }
        }
        let mut first = 0;
        loop {
            let record = Wire {
                addr: self.addr,
                held: groups[first..].to_vec(),
            };
            let mut bytes = serde_json::to_vec(&record).expect("a holding serializes");
            if bytes.len() <= RECORD {
                bytes.resize(RECORD, b' ');
                return bytes;
            }
            first += 1;
        }
    }

    /// Reads a record; a malformed one holds nothing.
    pub fn decode(record: &[u8]) -> Self {
        let Ok(wire) = serde_json::from_slice::<Wire>(record.trim_ascii_end()) else {
            return Self::default();
        };
        let held = wire
            .held
            .into_iter()
            .flat_map(|(dir, world, ranks)| {
                ranks.into_iter().map(move |rank| CopyKey {
                    dir: dir.clone(),
                    world,
                    rank,
                })
            })
            .collect();
        Self {
            addr: wire.addr,
            held,
        }
    }
}

/// A [`Holding`] as exchanged: (attempt directory, world, ranks held) per directory.
#[derive(Serialize, Deserialize)]
struct Wire {
    addr: Option<SocketAddr>,
    held: Vec<(String, u32, Vec<u32>)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(dir: &str, rank: u32) -> CopyKey {
        CopyKey {
            dir: dir.into(),
            world: 2,
            rank,
        }
    }

    fn copy(dir: &str, rank: u32, len: usize) -> RankCopy {
        RankCopy::new(key(dir, rank), vec![rank as u8; len])
    }

    #[test]
    fn only_the_newest_and_the_confirmed_checkpoints_are_kept() {
        let copies = Copies::new(CopyConfig::default());
        assert!(copies.keep_copy(copy("a", 0, 10)));
        copies.confirm("a");
        assert!(copies.keep_copy(copy("b", 0, 10)));
        assert!(copies.get(&key("a", 0)).is_some() && copies.get(&key("b", 0)).is_some());
        assert!(copies.keep_copy(copy("c", 0, 10)));
        assert!(copies.get(&key("a", 0)).is_some(), "confirmed: kept");
        assert!(
            copies.get(&key("b", 0)).is_none(),
            "neither newest nor confirmed"
        );
        copies.confirm("c");
        assert!(copies.get(&key("a", 0)).is_none());
        assert_eq!(copies.holding().held, vec![key("c", 0)]);
        assert_eq!(copies.held_bytes(), 10);
        // A replica of a checkpoint that is not kept is refused.
        let refused = copies
            .shared
            .put_replica(copy("b", 1, 10), None)
            .unwrap_err();
        assert!(refused.contains("neither the newest"), "{refused}");
        copies.shared.put_replica(copy("c", 1, 10), None).unwrap();
        assert_eq!(copies.holding().held, vec![key("c", 0), key("c", 1)]);
    }

    #[test]
    fn the_snapshot_committed_before_the_newest_is_kept_until_room_is_needed() {
        let snap = |step: u64| format!("step-{step:08}/g00000001-snap-r");
        // (`keep_copy` marks each the newest save: only its own step is kept by that.)
        let copies = Copies::new(CopyConfig::default());
        for step in [5, 10] {
            assert!(copies.keep_copy(copy(&snap(step), 0, 10)));
            copies.commit_snapshot(&snap(step), vec![step as u32]);
        }
        // Step 5's commit may be the one the control plane recorded: kept, with its
        // table.
        assert!(copies.get(&key(&snap(5), 0)).is_some());
        assert_eq!(copies.snapshot_table(&snap(5)), Some(vec![5]));
        assert_eq!(copies.committed_snapshot().unwrap().0, snap(10));
        // Committing the same snapshot again keeps the one before it.
        copies.commit_snapshot(&snap(10), vec![10]);
        assert_eq!(copies.snapshot_table(&snap(5)), Some(vec![5]));
        // Under pressure it is the first to go; the newest committed never is.
        assert!(copies.keep_copy(copy(&snap(15), 0, 10)));
        let mut held = copies.shared.lock();
        assert!(held.drop_oldest(15));
        assert!(held.get(&key(&snap(5), 0)).is_none());
        assert!(!held.drop_oldest(15), "step 10 is protected");
        drop(held);
        // A newer commit lets the one two back go, table and all.
        copies.commit_snapshot(&snap(15), vec![15]);
        assert_eq!(copies.snapshot_table(&snap(5)), None);
        assert_eq!(copies.snapshot_table(&snap(10)), Some(vec![10]));
        assert_eq!(
            copies.holding().held,
            vec![key(&snap(10), 0), key(&snap(15), 0)]
        );
    }

    #[test]
    fn copies_past_the_budget_are_not_kept() {
        let copies = Copies::new(CopyConfig {
            max_bytes: 25,
            ..CopyConfig::default()
        });
        assert!(copies.keep_copy(copy("a", 0, 10)));
        copies.shared.put_replica(copy("a", 1, 10), None).unwrap();
        let over = copies
            .shared
            .put_replica(copy("a", 1, 16), None)
            .unwrap_err();
        assert!(over.contains("budget of 25 bytes"), "{over}");
        assert!(copies.held_bytes() <= 25);
        // A newer save lets the old copies go, and its own fits again.
        assert!(copies.keep_copy(copy("b", 0, 20)));
        assert_eq!(copies.held_bytes(), 20);
        assert!(!copies.keep_copy(copy("b", 0, 26)), "alone over the budget");
        assert!(copies.held_bytes() <= 25);
        // An own copy that arrives after a replica takes its room.
        copies.shared.put_replica(copy("b", 1, 20), None).unwrap();
        assert!(copies.keep_copy(copy("b", 0, 10)));
        assert_eq!(copies.holding().held, vec![key("b", 0)]);
    }

    #[test]
    fn oversized_holdings_drop_copies_instead_of_failing() {
        let held: Vec<CopyKey> = (0..100)
            .map(|r| CopyKey {
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
        // The newest are kept.
        assert_eq!(back.held[..], h.held[100 - back.held.len()..]);
        assert_eq!(back.addr, h.addr);
        assert_eq!(Holding::decode(b"garbage"), Holding::default());
        // What a rank of a job with store saves and snapshots holds at once (two
        // saves', three snapshots' own files and replicas) fits whole.
        let dirs = ["", "", "-snap", "-snap", "-snap"].iter().enumerate();
        let held: Vec<CopyKey> = dirs
            .flat_map(|(i, kind)| {
                let dir = format!(
                    "step-{:08}/g00000012{kind}-job-4dac01946c8ef19f-e12",
                    100 + i
                );
                [3, 2].map(|rank| CopyKey {
                    dir: dir.clone(),
                    world: 16384,
                    rank,
                })
            })
            .collect();
        let h = Holding {
            addr: Some("[fd00::1234:5678]:65535".parse().unwrap()),
            held,
        };
        assert_eq!(Holding::decode(&h.encode()), h);
    }
}
