//! `ckpt._native.Copies`: the library's in-memory copies (`ckpt::copies`), for
//! `ckpt.elastic`.
//!
//! Reading a checkpoint back from the store is the slowest part of a recovery, and
//! the survivors already hold nearly all of it: each save's staged file (kept rather
//! than reused, so keeping it copies nothing) and a replica of the ring predecessor's,
//! pulled in the background. A recovery loads each saved rank's file from its own
//! copy, then a peer's, then the store, every block checked against the save's
//! CRC32s. This binding exposes exactly the calls the reference trainer makes
//! (`trainer/src/train/copies.rs`); the process group that exchanges the holdings is
//! torch's, so the table travels as bytes.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ckpt::HostBudget;
use ckpt::copies::{CopyConfig, CopyKey, Holding};
use ckpt::snapshot::{SnapshotRecord, Vote};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::{Checkpointer, InvalidError, SaveHandle, Snapshot, held_dict, to_py};

/// This process's holder of in-memory copies, served to peers on `ip`.
#[pyclass(module = "ckpt._native", frozen)]
pub struct Copies {
    pub(crate) inner: Arc<ckpt::copies::Copies>,
}

impl Copies {
    /// The holder's host-memory budget, for a checkpointer that counts in it.
    pub(crate) fn budget(&self) -> Option<Arc<HostBudget>> {
        self.inner.config().budget.clone()
    }
}

/// The table of holdings, one record per rank, as `Copies.holding()` encodes them.
pub(crate) fn decode_table(records: &[Vec<u8>]) -> PyResult<Vec<Holding>> {
    records
        .iter()
        .enumerate()
        .map(|(rank, record)| {
            if record.len() != Holding::SIZE {
                return Err(InvalidError::new_err(format!(
                    "rank {rank}'s holding is {} bytes, not {}",
                    record.len(),
                    Holding::SIZE
                )));
            }
            Ok(Holding::decode(record))
        })
        .collect()
}

#[pymethods]
impl Copies {
    /// Serves this process's copies on `ip` (a free port). With a job secret in the
    /// environment (`CKPT_JOB_SECRET` or `CKPT_JOB_SECRET_FILE`) the server admits
    /// only peers that prove it, and this holder proves it to its peers; a bad
    /// secret there raises `InvalidError`.
    ///
    /// The holder counts what it holds in a host-memory budget: `checkpointer`'s
    /// (`host_memory_budget`), so that its staging, copies, replicas and snapshots
    /// share one bound, else one of its own, unbounded until
    /// `set_host_memory_budget`.
    #[new]
    #[pyo3(signature = (ip, checkpointer=None))]
    fn new(ip: &str, checkpointer: Option<&Checkpointer>) -> PyResult<Copies> {
        let ip: IpAddr = ip
            .parse()
            .map_err(|e| InvalidError::new_err(format!("{ip:?} is not an IP address: {e}")))?;
        // The job's secret, when the launcher set one: the server then admits only
        // the job's ranks, and this holder proves it to theirs.
        let secret = ckpt_auth::JobSecret::from_env().map_err(|e| {
            InvalidError::new_err(format!("in-memory copies need a valid job secret: {e}"))
        })?;
        let budget = match checkpointer {
            Some(c) => c.inner.host_budget().clone(),
            None => HostBudget::new(None),
        };
        let config = CopyConfig {
            secret,
            budget: Some(budget),
            ..CopyConfig::default()
        };
        let inner = ckpt::copies::Copies::serve(ip, config)
            .map_err(|e| InvalidError::new_err(format!("serving in-memory copies on {ip}: {e}")))?;
        Ok(Copies {
            inner: Arc::new(inner),
        })
    }

    /// Where peers fetch this process's copies (`ip:port`).
    #[getter]
    fn addr(&self) -> Option<String> {
        self.inner.addr().map(|a| a.to_string())
    }

    /// This process's holding (its server and the copies it holds), encoded as one
    /// record of `HOLDING_SIZE` bytes for the table every rank gathers.
    fn holding<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.holding().encode())
    }

    /// Keeps the save `handle` follows as this rank's copy (the staged file itself:
    /// its checkpointer must have `keep_copy=True`), and pulls a replica of its ring
    /// predecessor's copy in the background from the server `table` names.
    fn keep(&self, handle: &SaveHandle, table: Vec<Vec<u8>>, rank: usize) -> PyResult<()> {
        let table = decode_table(&table)?;
        self.inner
            .keep(handle.inner.as_ref())
            .map_err(|e| InvalidError::new_err(e.to_string()))?;
        let world = table.len();
        if world < 2 || rank >= world {
            return Ok(());
        }
        let predecessor = (rank + world - 1) % world;
        if let Some(from) = table[predecessor].addr {
            self.inner.replicate(
                from,
                CopyKey {
                    dir: handle.inner.attempt().dir(),
                    world: world as u32,
                    rank: predecessor as u32,
                },
            );
        }
        Ok(())
    }

    /// The save `handle` follows committed: its copies are the newest committed ones
    /// (older ones are let go).
    fn confirm(&self, handle: &SaveHandle) {
        self.inner.confirm(&handle.inner.attempt().dir());
    }

    /// Bytes of copies held (own copies and replicas).
    #[getter]
    fn held_bytes(&self) -> u64 {
        self.inner.held_bytes()
    }

    /// Host memory held in this holder's budget, by kind (as
    /// `Checkpointer.host_bytes_held`).
    fn host_bytes_held<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let held = self
            .inner
            .config()
            .budget
            .as_ref()
            .map(|b| b.held())
            .unwrap_or_default();
        held_dict(py, &held)
    }

    /// Bounds this holder's budget at `limit` bytes (None: unbounded); copies it
    /// may drop are let go at once to fit.
    #[pyo3(signature = (limit))]
    fn set_host_memory_budget(&self, limit: Option<u64>) {
        if let Some(budget) = &self.inner.config().budget {
            budget.set_limit(limit);
        }
    }

    /// Keeps `snapshot` (`SnapshotHandle.wait_ready()`) as this rank's newest
    /// snapshot; False (with the reason logged) when it does not fit.
    fn keep_snapshot(&self, snapshot: &Snapshot) -> bool {
        self.inner.keep_snapshot(&snapshot.inner)
    }

    /// Pulls, in the background, a replica of the ring predecessor's file of the
    /// same snapshot (and its part) from the server `table` names.
    fn replicate_snapshot(
        &self,
        snapshot: &Snapshot,
        table: Vec<Vec<u8>>,
        rank: usize,
    ) -> PyResult<()> {
        let table = decode_table(&table)?;
        let Some(key) = predecessor_key(snapshot) else {
            return Ok(());
        };
        if let Some(from) = table.get(key.rank as usize).and_then(|h| h.addr)
            && rank < table.len()
        {
            self.inner.replicate_snapshot(from, key);
        }
        Ok(())
    }

    /// Waits up to `timeout` seconds (GIL released) until every replica asked for
    /// so far has arrived or been given up; True once they have.
    fn wait_for_pulls(&self, py: Python<'_>, timeout: f64) -> bool {
        let inner = self.inner.clone();
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
        py.detach(move || inner.wait_for_pulls(timeout))
    }

    /// This rank's vote on committing `snapshot` (`VOTE_SIZE` bytes): ready when it
    /// holds its own file and its replica of its ring predecessor's.
    fn vote<'py>(&self, py: Python<'py>, snapshot: &Snapshot) -> Bound<'py, PyBytes> {
        let key = predecessor_key(snapshot);
        let vote = Vote::cast(&self.inner, &snapshot.inner, key.as_ref());
        PyBytes::new(py, &vote.encode())
    }

    /// Notes that the snapshot in `dir` is committed, with every rank's part CRC32
    /// (rank order, what `tally` returned): kept until a newer one commits.
    fn commit_snapshot(&self, dir: &str, part_crc32s: Vec<u32>) {
        self.inner.commit_snapshot(dir, part_crc32s);
    }

    /// The newest snapshot this rank knows to be committed: `(dir, part CRC32s)`.
    fn committed_snapshot(&self) -> Option<(String, Vec<u32>)> {
        self.inner.committed_snapshot()
    }
}

/// The key of the ring predecessor's file of `snapshot` (None in a world of one).
fn predecessor_key(snapshot: &Snapshot) -> Option<CopyKey> {
    let key = snapshot.inner.key();
    (key.world >= 2).then(|| CopyKey {
        dir: key.dir.clone(),
        world: key.world,
        rank: (key.rank + key.world - 1) % key.world,
    })
}

/// A vote against committing the snapshot of `step` (a rank that took none).
#[pyfunction]
pub(crate) fn vote_against(py: Python<'_>, step: u64) -> Bound<'_, PyBytes> {
    PyBytes::new(py, &Vote::against(step).encode())
}

/// The outcome of every rank's vote (rank order) on the snapshot of `step`:
/// `(True, part CRC32s)` when every rank voted ready on it, else `(False, the
/// ranks that did not)`.
#[pyfunction]
pub(crate) fn tally(votes: Vec<Vec<u8>>, step: u64) -> (bool, Vec<u64>) {
    let votes: Vec<Vote> = votes.iter().map(|v| Vote::decode(v)).collect();
    match ckpt::snapshot::tally(&votes, step) {
        Ok(table) => (true, table.into_iter().map(u64::from).collect()),
        Err(against) => (false, against.into_iter().map(|r| r as u64).collect()),
    }
}

/// The control plane's record (JSON) of `snapshot` committed by its world with
/// the part CRC32s `part_crc32s` (what `tally` returned).
#[pyfunction]
pub(crate) fn snapshot_record(snapshot: &Snapshot, part_crc32s: Vec<u32>) -> String {
    SnapshotRecord::new(&snapshot.attempt, snapshot.inner.key().world, &part_crc32s).to_json()
}

fn parse_record(py: Python<'_>, record: &str) -> PyResult<SnapshotRecord> {
    SnapshotRecord::parse(record).map_err(|e| to_py(py, e))
}

/// The ranks of the snapshot `record`'s world whose file no holding of `table`
/// (every rank's, `Copies.holding()`) holds: empty when the survivors cover it.
#[pyfunction]
pub(crate) fn record_uncovered(
    py: Python<'_>,
    record: &str,
    table: Vec<Vec<u8>>,
) -> PyResult<Vec<u32>> {
    let record = parse_record(py, record)?;
    Ok(record.uncovered(&decode_table(&table)?))
}

/// Gathers what every rank needs to open the committed snapshot `record`: the
/// table of part CRC32s and every part, from `copies` or the holders `table`
/// names (this rank is `rank`), checked against the record. Returns the bytes
/// `Reader.from_snapshot` opens. Blocking (TCP to the peers), GIL released.
#[pyfunction]
pub(crate) fn share_snapshot<'py>(
    py: Python<'py>,
    record: &str,
    copies: &Copies,
    table: Vec<Vec<u8>>,
    rank: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let record = parse_record(py, record)?;
    let table = decode_table(&table)?;
    let own = copies.inner.clone();
    let shared = py
        .detach(move || ckpt::snapshot::share(&record, &own, &table, rank))
        .map_err(|e| to_py(py, e))?;
    Ok(PyBytes::new(py, &shared))
}
