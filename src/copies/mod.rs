//! In-memory copies of the newest checkpoints, so that the survivors of a failure
//! rebuild their state from RAM instead of reading it back from the store.
//!
//! # Why
//!
//! When one rank of N dies, the survivors already hold almost all of the checkpoint
//! they are about to resume from (each saved its share a few steps ago), and the store
//! is the slowest place to read it back from. So with
//! [`CheckpointConfig::keep_copy`](crate::CheckpointConfig::keep_copy) every rank
//! keeps, through a [`Copies`] holder:
//!
//! - its **own copy** of each save: the rank's data file exactly as the
//!   [`Checkpointer`](crate::Checkpointer) staged it (safetensors header and boxes,
//!   raw, whatever the dtypes, the boxes and the codec), shared with the save rather
//!   than copied ([`SaveHandle::copy`](crate::SaveHandle::copy));
//! - a **replica** of its ring predecessor's copy, pulled in the background over TCP
//!   from the predecessor's copy server once the predecessor has staged it
//!   ([`Copies::replicate`]).
//!
//! Any set of lost ranks of which no two are ring neighbours therefore loses no byte.
//! At a recovery the ranks publish which copies they hold ([`Holding`], exchanged by
//! the trainer's own collective), and each rank loads what it needs in the new world
//! with [`load_into`]: the same [`LoadRequest`](crate::LoadRequest) and in-place
//! outputs as [`CheckpointReader::load_into`](crate::CheckpointReader::load_into),
//! each saved rank's file taken from its own copy, else a peer's, else the store.
//!
//! # Safety rules
//!
//! - **Memory never decides what is committed.** The caller opens the checkpoint to
//!   resume from through the store's commit log, as for any load; copies are only a
//!   faster place to read the committed bytes from.
//! - **Memory is not trusted more than the store.** Every block taken from a copy, a
//!   peer's or the rank's own, is checked against the block CRC32s that the committed
//!   rank part records before its bytes count; a copy that differs (memory that
//!   rotted, a peer serving other bytes) is named in a [`Fallback`], with its holder
//!   and the block, and that file is read from the next holder or the store. A copy's
//!   block checks as exactly what the save wrote, so the sources may be mixed: the
//!   result is bitwise the store's.
//! - **A copy is named by its save** ([`CopyKey`]): the attempt directory
//!   (`step-N/gG-RUN`, which names exactly one commit) and the layout (world size and
//!   rank) of the save. Copies of another attempt or another world than the commit's
//!   are never used, and a copy whose length is not the committed file's is refused.
//! - **Two checkpoints held at most**: the newest this rank saved, and the newest it
//!   knows to be committed (the one a failure would resume from). Older copies and
//!   replicas are let go as soon as a newer save or commit supersedes them. The same
//!   holds for snapshots ([`Copies::keep_snapshot`], [`Copies::commit_snapshot`]):
//!   the newest taken and the newest committed, each file with its rank part, and
//!   the one committed before it while room allows (every rank commits after the
//!   vote, the control plane records it a moment later and refuses it when the
//!   generation ended meanwhile: a recovery may then be told to use the previous one).
//! - **Bounded memory**: [`CopyConfig::max_bytes`] caps the bytes of copies held; a
//!   copy or replica that does not fit is not kept (recovery then reads the store for
//!   it). With [`CopyConfig::budget`] the holder shares the rank's host-memory budget
//!   ([`crate::budget`]): a replica is reserved before it is pulled, and the oldest
//!   copies of earlier steps are let go to make room (never the newest committed
//!   checkpoint's or snapshot's). The copy server streams from the held bytes, allocates nothing per request
//!   beyond a 1 KiB request line, serves at most [`CopyConfig::max_connections`]
//!   peers at once, and answers a bad request with an error line (the connection
//!   stays usable) or, for an overlong line, an error and a close.
//!
//! # Bytes copied, per path
//!
//! - Own copy at a save: **none**. The staging buffer the save copied the tensors into
//!   is kept instead of going back to the pool; it returns when the copy is let go.
//!   The price is memory: one staging buffer per copy held, so the save after a copy
//!   is kept takes another buffer from the pool (or maps a fresh one; see
//!   [`Checkpointer::warm_up`](crate::Checkpointer::warm_up)).
//! - Replica: one copy, from the predecessor's memory through the socket into a buffer
//!   of the holder's own (the file's raw length), off the training thread.
//! - Recovery from an own copy: one CRC32 pass over the copy's blocks that the request
//!   touches, then one copy of the requested bytes into the outputs.
//! - Recovery from a peer: the blocks the request touches travel once, from the
//!   peer's memory through the socket straight into the outputs (the bytes between
//!   the requested runs into scratch), and are checked there; a block that fails
//!   leaves those outputs to be overwritten by the next source.
//!
//! Compressed saves (zstd) need nothing special: the staging buffer holds the raw
//! file and the block CRC32s are of raw blocks, so a copy of a compressed save is
//! checked and read exactly like one of a plain save (and replicas move raw bytes).
//!
//! # The copy server and its protocol
//!
//! With a job secret ([`CopyConfig::secret`]), every connection opens with the
//! mutual job-secret handshake of `ckpt-auth` (the client proves the secret, the
//! server proves it back, neither sends it): the server reads no request line of a
//! peer that has not proved it, and closes such a connection without an answer
//! (counted by [`Copies::refused_connections`] and logged). A copy is a rank's whole
//! training state, so on a shared cluster (Kubernetes, a multi-tenant Slurm) a
//! server that answers anyone hands the model to any process that can reach the
//! port; and a client that fetched from anyone could be fed bytes made to pass the
//! block CRC32s (which catch rot, not forgery), so the client checks the server's
//! proof too. A client that fails the handshake, or whose server does not prove the
//! secret, treats that server like one that does not answer: a replica is not
//! pulled, a recovery reads the file from the next holder or the store. The
//! handshake runs on the peer's own thread, so a connection that never sends its
//! half holds one of [`CopyConfig::max_connections`] places until the handshake's
//! timeout (5 s), but never blocks other peers. Without a secret there is no
//! handshake, and the exchanges below start at once.
//!
//! Then one request line, at most 1 KiB, and one answer per exchange, many exchanges
//! per connection; `DIR WORLD RANK` is a [`CopyKey`]:
//!
//! - `len DIR WORLD RANK` is answered by `ok N`, the copy's length in bytes;
//! - `raw DIR WORLD RANK START END` by `ok N` (N = END − START) and the copy's bytes
//!   START..END;
//! - `part DIR WORLD RANK` (a snapshot's file, [`crate::snapshot`]) by `ok N` and the
//!   N bytes of the snapshot's rank part;
//! - `table DIR` by `ok N` and the CRC32s (4 bytes each, little-endian, rank order)
//!   of every rank's part of the committed snapshot in `DIR`, when it is the one this
//!   rank holds committed;
//! - anything else, a copy not held, or a range outside the copy, by `no REASON`.
//!
//! It lives here, with the data path, rather than beside the control plane's line
//! protocol in `ckpt-elastic`: the holder, the server and the recovery are one piece
//! any trainer uses (the Python one too) whether or not it runs the elastic control
//! plane, and the exchange of holdings goes through the trainer's collective, not the
//! control plane. Depending on `ckpt-elastic` for its line reader would pull the
//! control plane into every user of the library; the reverse would pull the data
//! path (zstd, the object store) into the coordinator. The bounded read of a request
//! line is a few lines on top of the standard library, so the copy server has its
//! own, and the library's default build gains no dependency for it. Without a
//! [`CopyConfig::secret`] the copy servers trust the cluster network, like the
//! training ring: they answer any peer that connects.

mod held;
mod load;
mod net;
mod verify;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::budget::Reservation;
use crate::staging::Pooled;

/// The job's secret that [`CopyConfig::secret`] holds (from `ckpt-auth`).
pub use ckpt_auth::JobSecret;
pub use held::{Copies, CopyConfig, Holding, PendingCopy};
pub use load::{Fallback, FallbackReason, FromCopies, Sources, load_into};
pub use verify::{ReadBox, VerifiedBytes, file_header, read_verified};

/// A connection to the copy server at `addr` (for [`crate::snapshot`]).
pub(crate) fn connect(
    addr: std::net::SocketAddr,
    timeout: std::time::Duration,
    secret: Option<&JobSecret>,
) -> std::result::Result<net::Peer, net::Asked> {
    net::Peer::connect(addr, timeout, secret)
}

/// Which copy: the save (its attempt directory) and the layout of the file.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CopyKey {
    /// The attempt directory of the save, `step-N/gG-RUN`
    /// ([`Attempt::dir`](crate::Attempt::dir)).
    pub dir: String,
    /// World size of the save.
    pub world: u32,
    /// Rank whose data file this is.
    pub rank: u32,
}

impl std::fmt::Display for CopyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (rank {} of {})", self.dir, self.rank, self.world)
    }
}

/// One rank's data file of one save, held in memory: the raw bytes the save's block
/// CRC32s cover (safetensors header, then the boxes). Cheap to clone (shared).
#[derive(Clone)]
pub struct RankCopy {
    key: CopyKey,
    bytes: Bytes,
}

/// Where a copy's bytes live.
#[derive(Clone)]
enum Bytes {
    /// A save's staging buffer, lent out (back to the pool when the last clone goes).
    Staged(Arc<Pooled>),
    /// Memory of the copy's own: a replica, or bytes given to [`RankCopy::new`].
    Owned(Arc<OwnedBytes>),
}

/// A copy's own bytes, and their reservation in the host-memory budget (a replica
/// pulled inside one), given back when the last clone goes.
struct OwnedBytes {
    bytes: Vec<u8>,
    _reserved: Option<Reservation>,
}

impl RankCopy {
    /// A copy of `key`'s file made of `bytes` (a replica, or a file kept elsewhere).
    pub fn new(key: CopyKey, bytes: Vec<u8>) -> Self {
        Self::reserved(key, bytes, None)
    }

    /// A copy of `key`'s file made of `bytes`, counted in a budget by `reserved`.
    pub(crate) fn reserved(key: CopyKey, bytes: Vec<u8>, reserved: Option<Reservation>) -> Self {
        Self {
            key,
            bytes: Bytes::Owned(Arc::new(OwnedBytes {
                bytes,
                _reserved: reserved,
            })),
        }
    }

    /// A save's staged file, shared with the save.
    pub(crate) fn staged(key: CopyKey, buffer: Arc<Pooled>) -> Self {
        Self {
            key,
            bytes: Bytes::Staged(buffer),
        }
    }

    /// Which copy this is.
    pub fn key(&self) -> &CopyKey {
        &self.key
    }

    /// The file's raw bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Staged(buffer) => buffer,
            Bytes::Owned(owned) => &owned.bytes,
        }
    }

    /// Length of the file in bytes.
    pub fn len(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// True for a file of no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }

    /// True when the bytes are a save's staging buffer, shared rather than copied.
    pub fn is_staging_buffer(&self) -> bool {
        matches!(self.bytes, Bytes::Staged(_))
    }
}

impl AsRef<[u8]> for RankCopy {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl std::fmt::Debug for RankCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankCopy")
            .field("key", &self.key)
            .field("len", &self.len())
            .field("staged", &self.is_staging_buffer())
            .finish()
    }
}

/// One rank's snapshot ([`Checkpointer::snapshot`](crate::Checkpointer::snapshot)):
/// its staged data file, in memory, and the rank part that describes it (block CRC32s, chunks, non-tensor state). Cheap to clone (shared).
#[derive(Clone)]
pub struct Snapshot {
    copy: RankCopy,
    part: Arc<Vec<u8>>,
    part_crc32: u32,
    step: u64,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("key", self.copy.key())
            .field("bytes", &self.copy.len())
            .field("part_crc32", &format_args!("{:08x}", self.part_crc32))
            .finish()
    }
}

impl Snapshot {
    /// A snapshot made of a file's bytes and its part's (a replica, or a test's).
    pub fn new(copy: RankCopy, part: Vec<u8>) -> crate::Result<Self> {
        let parsed = crate::format::RankPart::parse(&part, &copy.key().to_string())?;
        Ok(Self {
            part_crc32: crc32fast::hash(&part),
            step: parsed.step,
            copy,
            part: Arc::new(part),
        })
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Which file this is (the snapshot's attempt directory, world size and rank).
    pub fn key(&self) -> &CopyKey {
        self.copy.key()
    }

    /// The staged data file.
    pub fn copy(&self) -> &RankCopy {
        &self.copy
    }

    /// The rank part's bytes (JSON, as a store save would write it).
    pub fn part(&self) -> &[u8] {
        &self.part
    }

    /// CRC32 of [`Snapshot::part`]: what the commit records for this rank.
    pub fn part_crc32(&self) -> u32 {
        self.part_crc32
    }

    /// The shared part bytes.
    pub(crate) fn part_shared(&self) -> Arc<Vec<u8>> {
        self.part.clone()
    }

    /// A snapshot just staged (its part written by this library, not parsed again).
    pub(crate) fn staged(copy: RankCopy, part: Vec<u8>, step: u64) -> Self {
        Self {
            part_crc32: crc32fast::hash(&part),
            step,
            copy,
            part: Arc::new(part),
        }
    }
}
