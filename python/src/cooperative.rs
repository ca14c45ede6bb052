//! `ckpt._native.Cooperation`: one rank's side of a cooperative load
//! (`ckpt::load::Cooperative`), for `ckpt.torch`.
//!
//! The library plans which rank reads which blocks from the store and verifies
//! what peers send; the bytes travel over the caller's `torch.distributed` process
//! group, driven from Python (`ckpt/torch/_cooperative.py`). So each step is a call
//! here, its inputs and outputs plain bytes or memory that Python allocated as
//! tensors (the buffers to send and receive are written and read in place: no copy
//! through Python objects).

use std::sync::{Arc, Mutex};

use ckpt::load::Cooperative;
use ckpt::{CheckpointReader, LoadRequest};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::{Place, WantTuple, check_disjoint, invalid, open_store, run};

/// One rank's cooperative load: `asks` to every rank, `serve` what was asked of
/// this one, fill the buffers to send (`write_sent`), receive, then `finish`.
#[pyclass(module = "ckpt._native", frozen)]
pub struct Cooperation {
    inner: Arc<tokio::sync::Mutex<Option<Cooperative>>>,
    request: LoadRequest,
    /// Where each want's box goes: (address, bytes), kept alive by the caller
    /// until `finish` returns.
    outputs: Vec<(usize, usize)>,
    /// Bytes to send each rank, known once `serve` ran.
    sizes: Mutex<Vec<u64>>,
}

/// Starts a cooperative load of `wants` (tuples as `Reader.load_into` takes them,
/// host memory only) by `world` ranks, this one `rank`. The reader must hold every
/// rank part (`Reader.share` or `Reader.from_shared`).
pub(crate) fn cooperate(
    py: Python<'_>,
    reader: &Arc<CheckpointReader>,
    wants: Vec<WantTuple>,
    rank: usize,
    world: usize,
) -> PyResult<Cooperation> {
    let views = super::load_views(wants)?;
    // The Python layer stages device tensors in host memory for the exchange.
    if let Some(view) = views.iter().find(|v| v.place != Place::Host) {
        return Err(invalid(format!(
            "cooperative load: tensor {:?} is in device memory; stage it on the host",
            view.name
        )));
    }
    check_disjoint(&views)?;
    let request = super::request_of(&views);
    let outputs = views.iter().map(|v| (v.ptr, v.nbytes)).collect();
    let (reader, planned) = (reader.clone(), request.clone());
    let coop = run(py, async move {
        let plan = reader.plan(&planned).await?;
        reader.cooperate(plan, rank, world)
    })?;
    Ok(Cooperation {
        inner: Arc::new(tokio::sync::Mutex::new(Some(coop))),
        request,
        outputs,
        sizes: Mutex::new(Vec::new()),
    })
}

/// Opens the checkpoint another rank's `Reader.share` describes, without a request
/// to the store.
pub(crate) fn from_shared(
    url: &str,
    shared: &[u8],
    store_options: Option<&Bound<'_, PyDict>>,
) -> PyResult<CheckpointReader> {
    let store = open_store(url, store_options)?;
    let _entered = super::runtime().enter();
    CheckpointReader::from_shared(&store, shared)
        .map_err(|e| Python::attach(|py| super::to_py(py, e)))
}

impl Cooperation {
    fn taken(&self) -> PyResult<tokio::sync::MutexGuard<'_, Option<Cooperative>>> {
        self.inner
            .try_lock()
            .map_err(|_| invalid("this cooperative load is busy in another call"))
    }
}

#[pymethods]
impl Cooperation {
    /// What this rank asks of each rank, by rank (empty bytes for none).
    fn asks<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let guard = self.taken()?;
        let coop = guard
            .as_ref()
            .ok_or_else(|| invalid("this cooperative load has finished"))?;
        Ok(coop.asks().iter().map(|a| PyBytes::new(py, a)).collect())
    }

    /// Bytes this rank will receive from each rank, by rank.
    fn expected(&self) -> PyResult<Vec<u64>> {
        let guard = self.taken()?;
        let coop = guard
            .as_ref()
            .ok_or_else(|| invalid("this cooperative load has finished"))?;
        Ok(coop.expected())
    }

    /// Reads from the store what the ranks asked of this one (`asked`: every
    /// rank's request to this one, by rank), verified; returns the bytes to send
    /// each rank, by rank.
    fn serve(&self, py: Python<'_>, asked: Vec<Vec<u8>>) -> PyResult<Vec<u64>> {
        let inner = self.inner.clone();
        let sizes = run(py, async move {
            let mut guard = inner.lock().await;
            let coop = guard
                .as_mut()
                .ok_or_else(|| ckpt::Error::Invalid("this cooperative load has finished".into()))?;
            let asked: Vec<&[u8]> = asked.iter().map(Vec::as_slice).collect();
            coop.serve(&asked).await
        })?;
        *self.sizes.lock().unwrap_or_else(|e| e.into_inner()) = sizes.clone();
        Ok(sizes)
    }

    /// The stored bytes of everything asked of this rank, once `serve` ran.
    #[getter]
    fn unique_bytes_served(&self) -> PyResult<u64> {
        let guard = self.taken()?;
        let coop = guard
            .as_ref()
            .ok_or_else(|| invalid("this cooperative load has finished"))?;
        Ok(coop.unique_bytes_served())
    }

    /// Writes the bytes for rank `to` into `nbytes` bytes at address `ptr` (a
    /// tensor the caller allocated with the size `serve` gave and keeps alive
    /// during the call).
    fn write_sent(&self, py: Python<'_>, to: usize, ptr: usize, nbytes: usize) -> PyResult<()> {
        let want = self
            .sizes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(to)
            .copied()
            .ok_or_else(|| invalid(format!("write_sent: no rank {to} (or serve has not run)")))?;
        if want != nbytes as u64 || (nbytes > 0 && ptr == 0) {
            return Err(invalid(format!(
                "write_sent: a buffer of {nbytes} bytes for rank {to}, which gets {want}"
            )));
        }
        let guard = self.taken()?;
        let coop = guard
            .as_ref()
            .ok_or_else(|| invalid("this cooperative load has finished"))?;
        let out: &mut [u8] = if nbytes == 0 {
            &mut []
        } else {
            // SAFETY: the caller owns `nbytes` writable bytes at `ptr` for this call
            // (a contiguous uint8 tensor), and nothing else touches them meanwhile.
            unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, nbytes) }
        };
        py.detach(|| coop.write_sent(to, out))
            .map_err(|e| super::to_py(py, e))
    }

    /// Verifies what the ranks sent (`received`: `(ptr, nbytes)` of the buffer
    /// received from each rank, by rank, of `expected`'s sizes; this rank's own
    /// entry is ignored), reads any block that fails its CRC32 from the store, and
    /// writes every want's box. Returns the load's counters.
    fn finish<'py>(
        &self,
        py: Python<'py>,
        received: Vec<(usize, usize)>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let coop = self
            .taken()?
            .take()
            .ok_or_else(|| invalid("this cooperative load has finished"))?;
        if received.iter().any(|&(ptr, n)| n > 0 && ptr == 0) {
            return Err(invalid("finish: a received buffer with no address"));
        }
        let request = self.request.clone();
        // SAFETY: the Python layer keeps every destination and every received
        // buffer alive until this call returns, and `run` returns only once the task
        // has ended (also when interrupted); the destinations were checked not to
        // overlap, and nothing else reads or writes them meanwhile.
        let received: Vec<&'static [u8]> = received
            .iter()
            .map(|&(ptr, n)| {
                if n == 0 {
                    &[][..]
                } else {
                    // SAFETY: see above: a received buffer the caller keeps alive
                    // and leaves alone until this call returns.
                    unsafe { std::slice::from_raw_parts(ptr as *const u8, n) }
                }
            })
            .collect();
        let mut outputs: Vec<&'static mut [u8]> = self
            .outputs
            .iter()
            .map(|&(ptr, n)| {
                if n == 0 {
                    &mut [][..]
                } else {
                    // SAFETY: see above: a destination the caller keeps alive, checked
                    // not to overlap another, written by this load alone.
                    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, n) }
                }
            })
            .collect();
        let stats = run(py, async move {
            coop.finish(&request, &received, &mut outputs).await
        })?;
        let out = PyDict::new(py);
        super::put_stats(&out, &stats)?;
        Ok(out)
    }
}
