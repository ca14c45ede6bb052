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

use ckpt::copies::{CopyConfig, CopyKey, Holding};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::{InvalidError, SaveHandle};

/// This process's holder of in-memory copies, served to peers on `ip`.
#[pyclass(module = "ckpt._native", frozen)]
pub struct Copies {
    pub(crate) inner: Arc<ckpt::copies::Copies>,
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
    #[new]
    fn new(ip: &str) -> PyResult<Copies> {
        let ip: IpAddr = ip
            .parse()
            .map_err(|e| InvalidError::new_err(format!("{ip:?} is not an IP address: {e}")))?;
        // The job's secret, when the launcher set one: the server then admits only
        // the job's ranks, and this holder proves it to theirs.
        let secret = ckpt_auth::JobSecret::from_env().map_err(|e| {
            InvalidError::new_err(format!("in-memory copies need a valid job secret: {e}"))
        })?;
        let config = CopyConfig {
            secret,
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
}
