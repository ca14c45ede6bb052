//! `ckpt._native`: the Python binding of the ckpt library, as thin as it can be.
//!
//! The torch-facing API (`ckpt.torch`, the DCP plugin) is pure Python on top of this
//! module; this module only moves what the library needs across the boundary and
//! back. Three rules shape it:
//!
//! - **Tensor memory is never copied here.** Python passes each tensor as its address
//!   and length (`tensor.data_ptr()`, `tensor.nbytes`) and keeps the tensor alive for
//!   as long as the library may touch it (until a save is staged, until a load
//!   returns); the library reads or writes that memory where it lies. The only copy
//!   of a save is the library's own one into its staging buffer, and a load from
//!   local disk reads straight into the destination.
//! - **The GIL is released for every copy and I/O.** Every call that waits runs its
//!   work as a task on one shared tokio runtime and waits for it with the GIL
//!   released, waking every `SIGNAL_POLL` to let Python run its signal handlers: a
//!   `KeyboardInterrupt` there cancels the wait (and a load itself: the call returns
//!   only once nothing writes into the caller's tensors any more).
//! - **Errors keep the library's kind.** Each [`ckpt::Error`] variant becomes its own
//!   exception class under `CkptError`, with the library's message (a corrupt block
//!   names the object and offset) and a `kind` attribute. The classes live in module
//!   `ckpt` (where the package exports them), so pickle finds them: DCP gathers every
//!   rank's exception with `gather_object`, and a class pickle cannot find kills the
//!   failing rank while the others wait for the gather.

mod cooperative;
mod copies;
mod elastic;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ckpt::catalog::{Select, Skipped};
use ckpt::storage::{ErrorKind, Store, StoreConfig};
use ckpt::{
    CheckpointConfig, CheckpointReader, Codec, DType, LoadRequest, Manifest, Region, ReplicaPolicy,
    StateValue,
};
use futures::FutureExt;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString};

create_exception!(ckpt, CkptError, PyException, "A ckpt operation failed.");
create_exception!(
    ckpt,
    CorruptionError,
    CkptError,
    "A checkpoint object is corrupt, truncated or hostile; the message names the object and offset. An older checkpoint may load."
);
create_exception!(
    ckpt,
    NotFoundError,
    CkptError,
    "No such checkpoint, step or tensor."
);
create_exception!(
    ckpt,
    MismatchError,
    CkptError,
    "The request does not match the checkpoint (dtype, shape, box)."
);
create_exception!(
    ckpt,
    InvalidError,
    CkptError,
    "An argument or setting is invalid."
);
create_exception!(
    ckpt,
    StorageError,
    CkptError,
    "The store failed; `transient` says whether retrying may help."
);
create_exception!(
    ckpt,
    CommitTimeoutError,
    CkptError,
    "Waiting for a commit took longer than allowed."
);
create_exception!(
    ckpt,
    SaveFailedError,
    CkptError,
    "A background save failed."
);
create_exception!(
    ckpt,
    FencedError,
    CkptError,
    "The save was fenced off by a newer generation or a reused run id."
);
create_exception!(
    ckpt,
    MutatedError,
    CkptError,
    "An overlapped save's tensor changed before it was staged."
);
create_exception!(ckpt, DeviceError, CkptError, "The GPU path failed.");
create_exception!(
    ckpt,
    OverBudgetError,
    CkptError,
    "Holding this would pass the host memory budget (`host_memory_budget`), even after letting go of every copy that may be dropped."
);
create_exception!(
    ckpt,
    ElasticError,
    CkptError,
    "A call to the elastic control plane failed (`kind`: cancelled, timeout, rejected, unreachable, protocol, shutdown)."
);

/// How often a blocking wait wakes to let Python handle signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// The runtime every call runs its work on, started on first use.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("ckpt")
            .enable_all()
            .build()
            .expect("starting the tokio runtime of ckpt")
    })
}

/// The Python exception for a library error: its class by variant, the library's
/// message, and `kind` and `transient` attributes.
fn to_py(py: Python<'_>, error: ckpt::Error) -> PyErr {
    let message = error.to_string();
    let (err, kind) = match &error {
        ckpt::Error::Storage(_) => (StorageError::new_err(message), "storage"),
        ckpt::Error::Corrupt(_) => (CorruptionError::new_err(message), "corrupt"),
        ckpt::Error::NotFound(_) => (NotFoundError::new_err(message), "not_found"),
        ckpt::Error::Mismatch(_) => (MismatchError::new_err(message), "mismatch"),
        ckpt::Error::Invalid(_) => (InvalidError::new_err(message), "invalid"),
        ckpt::Error::Timeout(_) => (CommitTimeoutError::new_err(message), "timeout"),
        ckpt::Error::Failed(_) => (SaveFailedError::new_err(message), "failed"),
        ckpt::Error::Fenced(_) => (FencedError::new_err(message), "fenced"),
        ckpt::Error::Mutated(_) => (MutatedError::new_err(message), "mutated"),
        ckpt::Error::Device(_) => (DeviceError::new_err(message), "device"),
        ckpt::Error::OverBudget(_) => (OverBudgetError::new_err(message), "over_budget"),
    };
    let value = err.value(py);
    // Setting attributes on a fresh exception instance cannot fail.
    let _ = value.setattr("kind", kind);
    let _ = value.setattr("transient", error.is_transient());
    err
}

fn invalid(message: impl Into<String>) -> PyErr {
    InvalidError::new_err(message.into())
}

/// Runs `work` on the runtime and waits for it with the GIL released. A signal
/// handler that raises (Ctrl-C) aborts the task, waits until it has stopped (so
/// nothing it borrowed is touched after this returns) and raises.
fn run<T: Send + 'static>(
    py: Python<'_>,
    work: impl Future<Output = ckpt::Result<T>> + Send + 'static,
) -> PyResult<T> {
    let mut task = runtime().spawn(work);
    loop {
        let polled = py.detach(|| {
            runtime().block_on(async { tokio::time::timeout(SIGNAL_POLL, &mut task).await })
        });
        match polled {
            Ok(Ok(result)) => return result.map_err(|e| to_py(py, e)),
            Ok(Err(join)) => {
                return Err(CkptError::new_err(format!("a ckpt task failed: {join}")));
            }
            Err(_still_running) => {
                if let Err(interrupt) = py.check_signals() {
                    task.abort();
                    let _ = py.detach(|| runtime().block_on(&mut task));
                    return Err(interrupt);
                }
            }
        }
    }
}

/// The primary context of device `ordinal` (the one torch uses), retained once.
#[cfg(feature = "cuda")]
fn cuda_context(ordinal: usize) -> ckpt::Result<Arc<cudarc::driver::CudaContext>> {
    static CONTEXTS: OnceLock<
        std::sync::Mutex<std::collections::HashMap<usize, Arc<cudarc::driver::CudaContext>>>,
    > = OnceLock::new();
    let mut contexts = CONTEXTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(ctx) = contexts.get(&ordinal) {
        return Ok(ctx.clone());
    }
    let ctx = ckpt::cuda::context(ordinal)?;
    contexts.insert(ordinal, ctx.clone());
    Ok(ctx)
}

fn dtype(name: &str) -> PyResult<DType> {
    DType::ALL
        .into_iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| {
            invalid(format!(
                "unknown dtype {name:?} (safetensors names: F32, BF16, …)"
            ))
        })
}

/// One tensor box as Python describes it: where its memory lies and where the box
/// sits in the global tensor.
struct TensorView {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    region: Region,
    ptr: usize,
    nbytes: usize,
    write: bool,
    /// Where the memory lies: host memory, or device memory of a CUDA device with
    /// the stream whose work produces (save) or consumes (load) it.
    place: Place,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Host,
    Device { ordinal: usize, stream: usize },
}

impl Place {
    /// From Python's `(device, stream)`: device -1 is host memory.
    fn new(device: i64, stream: usize) -> Self {
        match usize::try_from(device) {
            Ok(ordinal) => Place::Device { ordinal, stream },
            Err(_) => Place::Host,
        }
    }
}

/// A box to save: `(name, dtype, shape, offsets, lengths, ptr, nbytes, write,
/// device, stream)`, device -1 for host memory.
type TensorTuple = (
    String,
    String,
    Vec<u64>,
    Vec<u64>,
    Vec<u64>,
    usize,
    usize,
    bool,
    i64,
    usize,
);
/// A box to load: `(name, dtype, shape, offsets, lengths, ptr, nbytes, device,
/// stream)`.
type WantTuple = (
    String,
    String,
    Vec<u64>,
    Vec<u64>,
    Vec<u64>,
    usize,
    usize,
    i64,
    usize,
);

impl TensorView {
    fn from_tuple(
        (name, dtype_name, shape, offsets, lengths, ptr, nbytes, write, device, stream): TensorTuple,
    ) -> PyResult<Self> {
        if offsets.len() != shape.len() || lengths.len() != shape.len() {
            return Err(invalid(format!(
                "tensor {name:?}: box offsets {offsets:?} and lengths {lengths:?} do not match shape {shape:?}"
            )));
        }
        if ptr == 0 && nbytes != 0 {
            return Err(invalid(format!("tensor {name:?}: null data pointer")));
        }
        Ok(Self {
            dtype: dtype(&dtype_name)?,
            name,
            shape,
            region: Region::new(offsets, lengths),
            ptr,
            nbytes,
            write,
            place: Place::new(device, stream),
        })
    }

    /// The device memory of a box on a CUDA device (feature `cuda`).
    ///
    /// # Safety
    /// `ptr..ptr+nbytes` is device memory of the device and `stream` a live stream
    /// of its primary context (torch's); the Python layer keeps the tensor alive and
    /// unwritten until the save's device copy is released, or the load returned.
    #[cfg(feature = "cuda")]
    unsafe fn device_buffer(&self, py: Python<'_>) -> PyResult<ckpt::cuda::DeviceBuffer> {
        let Place::Device { ordinal, stream } = self.place else {
            return Err(invalid(format!("tensor {:?} is in host memory", self.name)));
        };
        let ctx = cuda_context(ordinal).map_err(|e| to_py(py, e))?;
        // SAFETY: the caller's contract above.
        Ok(unsafe {
            ckpt::cuda::DeviceBuffer::from_raw(
                &ctx,
                self.ptr as cudarc::driver::sys::CUdeviceptr,
                self.nbytes,
                stream as cudarc::driver::sys::CUstream,
            )
        })
    }

    /// Refuses device memory in a build without the `cuda` feature.
    #[cfg(not(feature = "cuda"))]
    fn check_host(&self) -> PyResult<()> {
        match self.place {
            Place::Host => Ok(()),
            Place::Device { ordinal, .. } => Err(DeviceError::new_err(format!(
                "tensor {:?} is on cuda:{ordinal}, but this build of ckpt has no GPU path \
                 (build the package with the cargo feature `cuda`: \
                 MATURIN_PEP517_ARGS=\"--features cuda\" pip install ./python)",
                self.name
            ))),
        }
    }

    /// The tensor's bytes.
    ///
    /// # Safety
    /// The memory at `ptr` must hold `nbytes` readable bytes for `'static`, i.e. for
    /// as long as the library uses the slice: the Python layer keeps the tensor alive
    /// and unwritten until the save is staged.
    unsafe fn bytes(&self) -> &'static [u8] {
        if self.nbytes == 0 {
            return &[];
        }
        // SAFETY: the caller's contract above.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.nbytes) }
    }

    /// The tensor's bytes, for writing.
    ///
    /// # Safety
    /// As for [`TensorView::bytes`], for writing, and no other slice may alias it
    /// while the load runs (the Python layer passes distinct, contiguous tensors).
    unsafe fn bytes_mut(&self) -> &'static mut [u8] {
        if self.nbytes == 0 {
            return &mut [];
        }
        // SAFETY: the caller's contract above.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.nbytes) }
    }
}

/// Where a non-tensor value goes: this rank's own state, or the global state.
#[derive(Debug, Clone, Copy)]
enum Scope {
    Rank,
    Global,
}

/// Adds Python's non-tensor values (`{key: JSON text or bytes}`) to `state`: bytes
/// as bytes, text parsed as JSON.
fn add_values(
    state: &mut ckpt::State<'_>,
    scope: Scope,
    values: &Bound<'_, PyDict>,
) -> PyResult<()> {
    for (key, value) in values.iter() {
        let key: String = key.extract()?;
        if let Ok(bytes) = value.cast::<PyBytes>() {
            match scope {
                Scope::Rank => state.set_rank_bytes(key, bytes.as_bytes()),
                Scope::Global => state.set_global_bytes(key, bytes.as_bytes()),
            };
            continue;
        }
        let text: String = value.extract().map_err(|_| {
            invalid(format!(
                "non-tensor state {key:?}: expected a JSON text or bytes"
            ))
        })?;
        let json = serde_json::from_str(&text)
            .map_err(|e| invalid(format!("non-tensor state {key:?} is not valid JSON: {e}")))?;
        match scope {
            Scope::Rank => state.set_rank_json(key, json),
            Scope::Global => state.set_global_json(key, json),
        };
    }
    Ok(())
}

/// A stored non-tensor value for Python: `("json", text)` or `("bytes", bytes)`.
fn state_to_py<'py>(py: Python<'py>, value: &StateValue) -> PyResult<Bound<'py, PyAny>> {
    match value {
        StateValue::Json(json) => ("json", json.to_string())
            .into_pyobject(py)
            .map(|t| t.into_any()),
        StateValue::Base64(_) => {
            let bytes = value.to_bytes().map_err(|e| {
                CorruptionError::new_err(format!("non-tensor state is not valid base64: {e}"))
            })?;
            ("bytes", PyBytes::new(py, &bytes))
                .into_pyobject(py)
                .map(|t| t.into_any())
        }
    }
}

fn seconds(key: &str, value: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let secs: f64 = value.extract()?;
    Duration::try_from_secs_f64(secs).map_err(|_| {
        invalid(format!(
            "{key} must be a non-negative number of seconds, got {secs}"
        ))
    })
}

fn codec(text: &str) -> PyResult<Codec> {
    match text.split_once(':') {
        None if text == "none" => Ok(Codec::None),
        None if text == "zstd" => Ok(Codec::Zstd {
            level: 3,
            shuffle: 0,
        }),
        Some(("zstd", level)) => level
            .parse()
            .map(|level| Codec::Zstd { level, shuffle: 0 })
            .map_err(|_| invalid(format!("codec {text:?}: the zstd level is not a number"))),
        _ => Err(invalid(format!(
            "codec {text:?}: expected \"none\", \"zstd\" or \"zstd:LEVEL\""
        ))),
    }
}

/// The settings of a checkpointer from keyword arguments, named as
/// `ckpt::CheckpointConfig`'s fields (durations in seconds, the codec as text).
fn config(
    rank: usize,
    world_size: usize,
    settings: Option<&Bound<'_, PyDict>>,
) -> PyResult<CheckpointConfig> {
    let mut config = CheckpointConfig::new(rank, world_size);
    for (key, value) in settings.into_iter().flat_map(|d| d.iter()) {
        let key: String = key.extract()?;
        match key.as_str() {
            "generation" => config.generation = value.extract()?,
            "run_id" => config.run_id = value.extract()?,
            "block_size" => config.block_size = value.extract()?,
            "codec" => config.codec = codec(&value.extract::<String>()?)?,
            "max_in_flight" => config.max_in_flight = value.extract()?,
            "keep_last" => config.keep_last = value.extract()?,
            "commit_timeout" => config.commit_timeout = seconds(&key, &value)?,
            "commit_takeover" => config.commit_takeover = seconds(&key, &value)?,
            "retention_grace" => config.retention_grace = seconds(&key, &value)?,
            "direct_io" => config.direct_io = value.extract()?,
            "copy_threads" => config.copy_threads = value.extract()?,
            "check_staging" => config.check_staging = value.extract()?,
            "keep_copy" => config.keep_copy = value.extract()?,
            "host_memory_budget" => config.host_memory_budget = value.extract()?,
            "replica_mismatch" => {
                let text: String = value.extract()?;
                config.replica_mismatch = text
                    .parse::<ReplicaPolicy>()
                    .map_err(PyValueError::new_err)?;
            }
            other => {
                return Err(invalid(format!(
                    "unknown setting {other:?}; the settings are generation, run_id, block_size, \
                     codec, max_in_flight, keep_last, commit_timeout, commit_takeover, \
                     retention_grace, direct_io, copy_threads, check_staging, keep_copy, \
                     replica_mismatch, host_memory_budget"
                )));
            }
        }
    }
    Ok(config)
}

/// Opens the store at `url`, with Python's `store_options={...}` applied in order by
/// [`StoreConfig::set`]: the one mapping from a key and its text to a setting, which
/// the `ckpt` command line's `-o KEY=VALUE` goes through too. A key or value the
/// store refuses raises `ValueError` naming it; any other failure to open keeps its
/// library error.
fn open_store(url: &str, store_options: Option<&Bound<'_, PyDict>>) -> PyResult<Store> {
    let mut config = StoreConfig::default();
    let mut given = false;
    for (key, value) in store_options.into_iter().flat_map(|d| d.iter()) {
        let key: String = key.extract().map_err(|_| {
            PyValueError::new_err(format!("store_options: key {key} is not a string"))
        })?;
        config
            .set(&key, &option_text(&key, &value)?)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        given = true;
    }
    Store::open(url, config).map_err(|e| {
        // An unknown backend option, or settings that do not fit together, fail only
        // when the store opens; the options are at fault when the URL opens without.
        if given && e.kind() == ErrorKind::Config && Store::from_url(url).is_ok() {
            PyValueError::new_err(format!("store_options: {e}"))
        } else {
            Python::attach(|py| to_py(py, ckpt::Error::from(e)))
        }
    })
}

/// A store option's value as the text [`StoreConfig::set`] parses: a bool as `true`
/// or `false`, a number as Python writes it (durations are seconds), a str as is.
fn option_text(key: &str, value: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(flag) = value.cast::<PyBool>() {
        return Ok(flag.is_true().to_string());
    }
    if value.is_instance_of::<PyInt>()
        || value.is_instance_of::<PyFloat>()
        || value.is_instance_of::<PyString>()
    {
        return Ok(value.str()?.to_string());
    }
    Err(PyValueError::new_err(format!(
        "store option {key}: expected a str, int, float or bool, got {}",
        value.get_type().name()?
    )))
}

/// A save's boxes, converted and checked once (`SavePlan(tensors)`, the tuples
/// `Checkpointer.save` takes): the Python layer keeps one while the state keeps its
/// structure and its memory (the same tensors at the same addresses), so that a
/// save of that state converts nothing per tensor here.
#[pyclass(frozen, module = "ckpt._native")]
struct SavePlan {
    views: Arc<Vec<TensorView>>,
}

#[pymethods]
impl SavePlan {
    #[new]
    fn new(tensors: Vec<TensorTuple>) -> PyResult<Self> {
        let views = tensors
            .into_iter()
            .map(TensorView::from_tuple)
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self {
            views: Arc::new(views),
        })
    }

    fn __len__(&self) -> usize {
        self.views.len()
    }
}

/// The boxes of a save: a [`SavePlan`], or a list of tuples converted now.
fn save_views(tensors: &Bound<'_, PyAny>) -> PyResult<Arc<Vec<TensorView>>> {
    if let Ok(plan) = tensors.cast::<SavePlan>() {
        return Ok(plan.get().views.clone());
    }
    let tuples: Vec<TensorTuple> = tensors.extract()?;
    SavePlan::new(tuples).map(|plan| plan.views)
}

/// Runs a save's registration on the calling thread when it completes without
/// waiting (a free slot for the save: the usual case), with the GIL released:
/// handing it to the runtime's threads would cost two thread wake-ups, which on a
/// machine whose cores are busy copying the other ranks' saves take milliseconds.
/// A registration that must wait (every slot busy) is waited for as [`run`] waits.
fn register<T: Send + 'static>(
    py: Python<'_>,
    work: impl Future<Output = ckpt::Result<T>> + Send + 'static,
) -> PyResult<T> {
    let mut work = Box::pin(work);
    let ready = py.detach(|| {
        let _entered = runtime().enter();
        (&mut work).now_or_never()
    });
    match ready {
        Some(result) => result.map_err(|e| to_py(py, e)),
        None => run(py, work),
    }
}

/// The library's state of one save or snapshot, built with the GIL held so that a
/// bad box is an error before anything starts; and whether it has device tensors.
fn build_state(
    py: Python<'_>,
    tensors: &Bound<'_, PyAny>,
    rank_state: &Bound<'_, PyDict>,
    global_state: &Bound<'_, PyDict>,
    metadata: &str,
) -> PyResult<(ckpt::State<'static>, bool)> {
    let views = save_views(tensors)?;
    let metadata: BTreeMap<String, serde_json::Value> = serde_json::from_str(metadata)
        .map_err(|e| invalid(format!("metadata is not a JSON object: {e}")))?;
    let mut state = ckpt::State::new();
    let mut on_device = false;
    for view in views.iter() {
        if view.place != Place::Host {
            on_device = true;
            #[cfg(feature = "cuda")]
            {
                // SAFETY: the Python layer keeps the tensor alive and waits for
                // the handle's device release before the tensor is written.
                let buffer = unsafe { view.device_buffer(py)? };
                state
                    .add_device(
                        &view.name,
                        view.dtype,
                        &view.shape,
                        view.region.clone(),
                        buffer,
                        view.write,
                    )
                    .map_err(|e| to_py(py, e))?;
                continue;
            }
            #[cfg(not(feature = "cuda"))]
            view.check_host()?;
        }
        // SAFETY: the Python layer keeps every tensor alive and unwritten until
        // this save is staged (`SaveHandle._tensors`), and a save without
        // `overlapped` returns only after staging.
        let data = unsafe { view.bytes() };
        state
            .add_replica(
                &view.name,
                view.dtype,
                &view.shape,
                view.region.clone(),
                data,
                view.write,
            )
            .map_err(|e| to_py(py, e))?;
    }
    add_values(&mut state, Scope::Rank, rank_state)?;
    add_values(&mut state, Scope::Global, global_state)?;
    for (key, value) in metadata {
        state.set_metadata(key, value);
    }
    Ok((state, on_device))
}

/// `HostBytesHeld` as a dict of its fields.
pub(crate) fn held_dict<'py>(
    py: Python<'py>,
    held: &ckpt::HostBytesHeld,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("budget", held.budget)?;
    out.set_item("total", held.total)?;
    out.set_item("peak", held.peak)?;
    out.set_item("staging", held.staging)?;
    out.set_item("copies", held.copies)?;
    out.set_item("replicas", held.replicas)?;
    out.set_item("snapshots", held.snapshots)?;
    out.set_item("snapshot_replicas", held.snapshot_replicas)?;
    out.set_item("summary", held.to_string())?;
    Ok(out)
}

/// One rank's checkpointer (`ckpt::Checkpointer`).
#[pyclass(frozen, module = "ckpt._native")]
pub(crate) struct Checkpointer {
    pub(crate) inner: Arc<ckpt::Checkpointer>,
    url: String,
}

#[pymethods]
impl Checkpointer {
    #[new]
    #[pyo3(signature = (url, rank, world_size, settings=None, store_options=None, budget_of=None))]
    fn new(
        py: Python<'_>,
        url: &str,
        rank: usize,
        world_size: usize,
        settings: Option<&Bound<'_, PyDict>>,
        store_options: Option<&Bound<'_, PyDict>>,
        budget_of: Option<&copies::Copies>,
    ) -> PyResult<Self> {
        let store = open_store(url, store_options)?;
        let config = config(rank, world_size, settings)?;
        let _entered = runtime().enter();
        // `budget_of`: an in-memory copies holder that outlives this checkpointer
        // (an elastic rank's), whose host-memory budget the checkpointer counts in.
        let inner = match budget_of.and_then(|c| c.budget()) {
            Some(budget) => ckpt::Checkpointer::with_budget(store, config, budget),
            None => ckpt::Checkpointer::new(store, config),
        }
        .map_err(|e| to_py(py, e))?;
        Ok(Self {
            inner: Arc::new(inner),
            url: url.to_string(),
        })
    }

    /// The checkpoint root's URL.
    #[getter]
    fn url(&self) -> &str {
        &self.url
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.config().rank
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.inner.config().world_size
    }

    /// Saves `tensors` (tuples `(name, dtype, shape, offsets, lengths, ptr, nbytes,
    /// write, device, stream)`, or a [`SavePlan`] of them) and non-tensor state as
    /// checkpoint `step`. Blocks until the tensors are staged, or with `overlapped`
    /// only until the save is registered (then the caller must keep the tensors
    /// alive and unwritten until `wait_staged`). `health` are the caller's metrics
    /// (`State::health_metric`), `unhealthy` the reasons its own check failed
    /// (`State::mark_unhealthy`).
    #[pyo3(signature = (step, tensors, rank_state, global_state, metadata, overlapped, health=None, unhealthy=None))]
    // One argument per part of a save, as the Python layer passes them.
    #[allow(clippy::too_many_arguments)]
    fn save(
        &self,
        py: Python<'_>,
        step: u64,
        tensors: &Bound<'_, PyAny>,
        rank_state: &Bound<'_, PyDict>,
        global_state: &Bound<'_, PyDict>,
        metadata: &str,
        overlapped: bool,
        health: Option<BTreeMap<String, f64>>,
        unhealthy: Option<Vec<String>>,
    ) -> PyResult<SaveHandle> {
        let (mut state, on_device) = build_state(py, tensors, rank_state, global_state, metadata)?;
        for (name, value) in health.into_iter().flatten() {
            state.health_metric(name, value);
        }
        for reason in unhealthy.into_iter().flatten() {
            state.mark_unhealthy(reason);
        }
        let checkpointer = self.inner.clone();
        let handle = register(py, async move {
            if overlapped {
                // SAFETY: as above: the tensors stay alive and unwritten until the
                // handle's `wait_staged` returns or the handle is dropped.
                unsafe { checkpointer.save_overlapped(step, &state) }.await
            } else {
                checkpointer.save(step, &state).await
            }
        })?;
        Ok(SaveHandle {
            inner: Arc::new(handle),
            step,
            on_device,
        })
    }

    /// Snapshots `tensors` and non-tensor state (as `save` takes them) at `step`
    /// into host memory (`ckpt::Checkpointer::snapshot`): staged as a save stages,
    /// checksummed in the background, written nowhere. Blocks until the tensors are
    /// staged, or with `overlapped` only until the snapshot is registered (then the
    /// caller keeps the tensors alive and unwritten until `wait_staged`). Raises
    /// `OverBudgetError` when it does not fit the host memory budget: the snapshot
    /// is not taken.
    #[pyo3(signature = (step, tensors, rank_state, global_state, metadata, overlapped))]
    // One argument per part of a snapshot, as the Python layer passes them.
    #[allow(clippy::too_many_arguments)]
    fn snapshot(
        &self,
        py: Python<'_>,
        step: u64,
        tensors: &Bound<'_, PyAny>,
        rank_state: &Bound<'_, PyDict>,
        global_state: &Bound<'_, PyDict>,
        metadata: &str,
        overlapped: bool,
    ) -> PyResult<SnapshotHandle> {
        let (state, on_device) = build_state(py, tensors, rank_state, global_state, metadata)?;
        if on_device {
            // A snapshot's handle has no device release to wait for (a save's
            // `wait_device_released`): its device tensors would be readable by the
            // copy after `wait_staged` returned.
            return Err(invalid(
                "snapshot: device tensors are not supported yet; snapshot a host copy",
            ));
        }
        let checkpointer = self.inner.clone();
        let handle = register(py, async move {
            if overlapped {
                // SAFETY: the Python layer keeps the tensors alive and unwritten
                // until the handle's `wait_staged` returns or the handle is dropped.
                unsafe { checkpointer.snapshot_overlapped(step, &state) }.await
            } else {
                checkpointer.snapshot(step, &state).await
            }
        })?;
        Ok(SnapshotHandle {
            inner: Arc::new(handle),
        })
    }

    /// Host memory held by this rank's checkpointing now, by kind (`budget`,
    /// `total`, `peak`, `staging`, `copies`, `replicas`, `snapshots`,
    /// `snapshot_replicas`; `budget` None when unbounded).
    fn host_bytes_held<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        held_dict(py, &self.inner.host_bytes_held())
    }

    /// Waits for every save's background work, then refuses further saves.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let checkpointer = self.inner.clone();
        run(py, async move { checkpointer.close().await })
    }
}

/// Follows one rank's save (`ckpt::SaveHandle`).
#[pyclass(frozen, module = "ckpt._native")]
struct SaveHandle {
    inner: Arc<ckpt::SaveHandle>,
    step: u64,
    /// Whether the save has device tensors (whose copy ends with an event).
    on_device: bool,
}

#[pymethods]
impl SaveHandle {
    #[getter]
    fn step(&self) -> u64 {
        self.step
    }

    /// Seconds the caller was blocked by the save.
    #[getter]
    fn stall(&self) -> f64 {
        self.inner.stall().as_secs_f64()
    }

    /// Whether the tensors have been copied (they may change again).
    fn is_staged(&self) -> bool {
        self.inner.is_staged()
    }

    /// Waits until the tensors are staged (device tensors included: their copies to
    /// the pinned buffers have completed); returns the seconds the copy took.
    fn wait_staged(&self, py: Python<'_>) -> PyResult<f64> {
        let handle = self.inner.clone();
        let on_device = self.on_device;
        run(py, async move {
            let secs = handle.staged().await?.as_secs_f64();
            #[cfg(feature = "cuda")]
            if on_device {
                tokio::task::spawn_blocking(move || handle.wait_device_released())
                    .await
                    .map_err(|e| {
                        ckpt::Error::Device(format!("waiting for the device copy: {e}"))
                    })??;
            }
            #[cfg(not(feature = "cuda"))]
            debug_assert!(
                !on_device,
                "device tensors are refused without the cuda feature"
            );
            Ok(secs)
        })
    }

    /// Waits until this rank's part is durable in the store.
    fn wait_durable(&self, py: Python<'_>) -> PyResult<()> {
        let handle = self.inner.clone();
        run(py, async move { handle.durable().await })
    }

    /// Waits until the whole checkpoint is committed (or the save failed).
    fn wait_committed(&self, py: Python<'_>) -> PyResult<()> {
        let handle = self.inner.clone();
        run(py, async move { handle.committed().await })
    }

    /// Host memory held by the rank's checkpointing now, by kind (as
    /// `Checkpointer.host_bytes_held`).
    fn host_bytes_held<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        held_dict(py, &self.inner.host_bytes_held())
    }

    /// Whether the checkpoint is committed yet (non-blocking): False while the save
    /// runs, True once committed; a failed save raises.
    fn done(&self, py: Python<'_>) -> PyResult<bool> {
        let _entered = runtime().enter();
        match self.inner.committed().now_or_never() {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(to_py(py, e)),
        }
    }
}

/// Follows one rank's snapshot while it is staged and checksummed
/// (`ckpt::SnapshotHandle`).
#[pyclass(frozen, module = "ckpt._native")]
pub(crate) struct SnapshotHandle {
    inner: Arc<ckpt::SnapshotHandle>,
}

#[pymethods]
impl SnapshotHandle {
    #[getter]
    fn step(&self) -> u64 {
        self.inner.step()
    }

    /// Seconds the caller was blocked by the snapshot.
    #[getter]
    fn stall(&self) -> f64 {
        self.inner.stall().as_secs_f64()
    }

    /// Waits until the tensors are staged; returns the seconds the copy took.
    fn wait_staged(&self, py: Python<'_>) -> PyResult<f64> {
        let handle = self.inner.clone();
        run(py, async move { Ok(handle.staged().await?.as_secs_f64()) })
    }

    /// Waits until the snapshot is staged and checksummed, and returns it.
    fn wait_ready(&self, py: Python<'_>) -> PyResult<Snapshot> {
        let handle = self.inner.clone();
        let snapshot = run(py, async move { handle.ready().await })?;
        Ok(Snapshot {
            inner: snapshot,
            attempt: self.inner.attempt().clone(),
        })
    }

    /// Host memory held by the rank's checkpointing now, by kind.
    fn host_bytes_held<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        held_dict(py, &self.inner.host_bytes_held())
    }
}

/// One rank's snapshot, staged and checksummed (`ckpt::Snapshot`): what
/// `Copies.keep_snapshot` keeps and a vote is cast on.
#[pyclass(frozen, module = "ckpt._native")]
pub(crate) struct Snapshot {
    pub(crate) inner: ckpt::Snapshot,
    pub(crate) attempt: ckpt::Attempt,
}

#[pymethods]
impl Snapshot {
    #[getter]
    fn step(&self) -> u64 {
        self.inner.step()
    }

    /// The snapshot's directory (`step-N/gG-snap-RUN`), the same on every rank of
    /// the world that took it.
    #[getter]
    fn dir(&self) -> String {
        self.inner.key().dir.clone()
    }

    #[getter]
    fn generation(&self) -> u64 {
        self.attempt.generation
    }

    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.key().world
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.inner.key().rank
    }

    /// CRC32 of this rank's part (what its vote carries).
    #[getter]
    fn part_crc32(&self) -> u32 {
        self.inner.part_crc32()
    }

    /// Bytes of the rank's file held.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.copy().len()
    }
}

/// A committed checkpoint opened for reading (`ckpt::CheckpointReader`).
#[pyclass(frozen, module = "ckpt._native")]
struct Reader {
    inner: Arc<CheckpointReader>,
    url: String,
}

#[pymethods]
impl Reader {
    /// Opens checkpoint `step` under `url`, or the newest committed one: with
    /// `healthy`, the newest that is not judged unhealthy (`skipped` then lists the
    /// unhealthy ones passed over); an explicit `step` opens whatever its health.
    #[new]
    #[pyo3(signature = (url, step=None, store_options=None, healthy=false))]
    fn new(
        py: Python<'_>,
        url: &str,
        step: Option<u64>,
        store_options: Option<&Bound<'_, PyDict>>,
        healthy: bool,
    ) -> PyResult<Self> {
        let store = open_store(url, store_options)?;
        let select = if healthy {
            Select::Healthy
        } else {
            Select::Any
        };
        let reader = run(py, async move {
            CheckpointReader::open_selecting(&store, step, select).await
        })?;
        Ok(Self {
            inner: Arc::new(reader),
            url: url.to_string(),
        })
    }

    #[getter]
    fn url(&self) -> &str {
        &self.url
    }

    #[getter]
    fn step(&self) -> u64 {
        self.inner.step()
    }

    /// Ranks of the world that saved it.
    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.manifest().world_size
    }

    #[getter]
    fn generation(&self) -> u64 {
        self.inner.manifest().generation
    }

    /// The checkpoint's health as the manifest's JSON text (`healthy`, `reasons`,
    /// `nonfinite`, `replica_mismatches`, `replicas_compared`, `metrics`; a metric
    /// that is not finite as the string `"NaN"`, `"inf"` or `"-inf"`), or None when
    /// unknown (written before health was recorded).
    #[getter]
    fn health(&self) -> Option<String> {
        health_json(self.inner.manifest())
    }

    /// The unhealthy commits passed over to open this one (newest first), as
    /// `(step, dir, reasons)`.
    #[getter]
    fn skipped(&self) -> Vec<(u64, String, Vec<String>)> {
        skipped_tuples(self.inner.skipped())
    }

    /// The manifest's user metadata, as JSON text.
    #[getter]
    fn metadata(&self) -> String {
        serde_json::to_string(&self.inner.manifest().metadata).unwrap_or_else(|_| "{}".into())
    }

    /// Every tensor: `(name, dtype, shape, chunks)` with chunks `(rank, offsets,
    /// lengths)`, the boxes the saving ranks wrote.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let manifest = self.inner.manifest();
        let out = PyList::empty(py);
        for tensor in &manifest.tensors {
            let layout = manifest
                .layouts
                .get(tensor.layout as usize)
                .ok_or_else(|| {
                    CorruptionError::new_err(format!(
                        "tensor {:?} names layout {} of {}",
                        tensor.name,
                        tensor.layout,
                        manifest.layouts.len()
                    ))
                })?;
            let chunks: Vec<(u32, Vec<u64>, Vec<u64>)> = layout
                .boxes(&tensor.shape)
                .into_iter()
                .map(|(rank, region)| (rank, region.offsets, region.lengths))
                .collect();
            out.append((
                tensor.name.as_str(),
                tensor.dtype.name(),
                tensor.shape.clone(),
                chunks,
            ))?;
        }
        Ok(out)
    }

    /// Every saved rank's non-tensor state: `[(rank, {key: (kind, value)})]` with
    /// kind `"json"` (value: JSON text) or `"bytes"`.
    fn rank_states<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let reader = self.inner.clone();
        let states = run(py, async move { reader.rank_states().await })?;
        let out = PyList::empty(py);
        for (rank, state) in states {
            let values = PyDict::new(py);
            for (key, value) in &state {
                values.set_item(key, state_to_py(py, value)?)?;
            }
            out.append((rank, values))?;
        }
        Ok(out)
    }

    /// The global non-tensor state: `{key: (kind, value)}` as in `rank_states`.
    fn global_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let reader = self.inner.clone();
        let state = run(py, async move { reader.global_state().await })?;
        let out = PyDict::new(py);
        for (key, value) in &state {
            out.set_item(key, state_to_py(py, value)?)?;
        }
        Ok(out)
    }

    /// Loads boxes in place: `wants` are tuples `(name, dtype, shape, offsets,
    /// lengths, ptr, nbytes)`, each `ptr` the start of `nbytes` of contiguous,
    /// writable memory that receives the box row-major. Verified block by block.
    /// Returns the load's counters.
    ///
    /// With `copies` (this process's `Copies`) and `table` (every rank's holding, by
    /// rank, this one's at `rank`), each saved rank's file of host boxes is read from
    /// an in-memory copy first — this rank's own, then its peers' — and from the
    /// store when no copy delivers it; the counters then also say how many bytes came
    /// from where (`own_bytes`, `peer_bytes`, `files`, `files_from_store`) and why a
    /// copy was passed over (`fallbacks`).
    #[pyo3(signature = (wants, copies = None, table = None, rank = 0))]
    fn load_into<'py>(
        &self,
        py: Python<'py>,
        wants: Vec<WantTuple>,
        copies: Option<&copies::Copies>,
        table: Option<Vec<Vec<u8>>>,
        rank: usize,
    ) -> PyResult<Bound<'py, PyDict>> {
        let views = load_views(wants)?;
        // Without the GPU path a device destination is refused before any I/O.
        #[cfg(not(feature = "cuda"))]
        views.iter().try_for_each(TensorView::check_host)?;
        let (host, device): (Vec<TensorView>, Vec<TensorView>) =
            views.into_iter().partition(|v| v.place == Place::Host);
        check_disjoint(&host)?;
        let request = request_of(&host);
        // SAFETY: the Python layer keeps every destination alive until this call
        // returns, and `run` returns only once the task has ended (also when
        // interrupted); `check_disjoint` made sure no two outputs overlap.
        let mut outputs: Vec<&'static mut [u8]> =
            host.iter().map(|v| unsafe { v.bytes_mut() }).collect();
        let reader = self.inner.clone();
        let from_memory = match (copies, table) {
            (Some(copies), Some(table)) => {
                Some((copies.inner.clone(), copies::decode_table(&table)?))
            }
            (None, None) => None,
            _ => return Err(invalid("load_into: copies and table go together")),
        };
        let out = PyDict::new(py);
        let mut stats = match from_memory {
            None => run(
                py,
                async move { reader.load_into(&request, &mut outputs).await },
            )?,
            Some((own, table)) => {
                let got = run(py, async move {
                    let sources = ckpt::copies::Sources {
                        own: &own,
                        table: &table,
                        rank,
                        cancelled: None,
                    };
                    let mut outputs: Vec<&mut [u8]> =
                        outputs.iter_mut().map(|o| &mut **o).collect();
                    ckpt::copies::load_into(&reader, &request, &mut outputs, &sources).await
                })?;
                out.set_item("files", got.files)?;
                out.set_item("files_from_store", got.files_from_store)?;
                out.set_item("own_bytes", got.own_bytes)?;
                out.set_item("peer_bytes", got.peer_bytes)?;
                out.set_item(
                    "fallbacks",
                    got.fallbacks
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>(),
                )?;
                got.store
            }
        };
        if !device.is_empty() {
            let device_stats = self.load_device(py, &device)?;
            add_counters(&mut stats, &device_stats);
        }
        stats.store_requests = self.inner.store_requests();
        put_stats(&out, &stats)?;
        Ok(out)
    }

    /// Fetches every rank part and returns the bytes that let the other ranks of
    /// the job open this checkpoint with `Reader.from_shared`, without a request to
    /// the store.
    fn share<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let reader = self.inner.clone();
        let shared = run(py, async move { reader.share().await })?;
        Ok(PyBytes::new(py, &shared))
    }

    /// Opens the checkpoint that another rank's `share()` describes (checked as if
    /// read from the store: the manifest validated, every part against its CRC32).
    #[staticmethod]
    #[pyo3(signature = (url, shared, store_options=None))]
    fn from_shared(
        url: &str,
        shared: &[u8],
        store_options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: Arc::new(cooperative::from_shared(url, shared, store_options)?),
            url: url.to_string(),
        })
    }

    /// Opens the committed snapshot that `copies.share_snapshot` describes: a reader
    /// whose manifest and parts are in memory, for `load_into` with `copies` and
    /// `table` (its files are read from the in-memory copies, each block checked;
    /// no store holds them, so a file no copy delivers fails the load).
    #[staticmethod]
    fn from_snapshot(py: Python<'_>, shared: &[u8]) -> PyResult<Self> {
        let _entered = runtime().enter();
        let reader = ckpt::snapshot::open_shared(shared).map_err(|e| to_py(py, e))?;
        Ok(Self {
            inner: Arc::new(reader),
            url: "memory://".to_string(),
        })
    }

    /// Requests this reader's store handle sent since it was opened, by kind:
    /// `{"LIST": n, "GET": n, "HEAD": n}` (the opening's included).
    #[getter]
    fn store_requests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        requests_dict(py, &self.inner.store_requests())
    }

    /// Starts this rank's part of a cooperative load of `wants` (host memory, as
    /// `load_into` takes them) by `world` ranks: see `Cooperation`.
    fn cooperate(
        &self,
        py: Python<'_>,
        wants: Vec<WantTuple>,
        rank: usize,
        world: usize,
    ) -> PyResult<cooperative::Cooperation> {
        cooperative::cooperate(py, &self.inner, wants, rank, world)
    }
}

/// A store's requests by kind, as `{"LIST": n, "GET": n, "HEAD": n}`.
fn requests_dict<'py>(
    py: Python<'py>,
    counts: &ckpt::storage::RequestCounts,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("LIST", counts.list)?;
    out.set_item("GET", counts.get)?;
    out.set_item("HEAD", counts.head)?;
    Ok(out)
}

/// A load's counters into `out`.
fn put_stats(out: &Bound<'_, PyDict>, stats: &ckpt::load::LoadStats) -> PyResult<()> {
    out.set_item("bytes_requested", stats.bytes_requested)?;
    out.set_item("bytes_read", stats.bytes_read)?;
    out.set_item("bytes_verified", stats.bytes_verified)?;
    out.set_item("bytes_copied", stats.bytes_copied)?;
    out.set_item("parts_read", stats.parts_read)?;
    out.set_item("bytes_read_from_store", stats.bytes_read_from_store)?;
    out.set_item("bytes_received_from_peers", stats.bytes_received_from_peers)?;
    out.set_item("peer_blocks_rejected", stats.peer_blocks_rejected)?;
    out.set_item("unique_bytes", stats.unique_bytes)?;
    out.set_item(
        "store_requests",
        requests_dict(out.py(), &stats.store_requests)?,
    )?;
    Ok(())
}

impl Reader {
    /// Loads boxes into device memory through the library's pinned buffers, one
    /// device at a time; the copies to the device have completed when this returns.
    #[cfg(feature = "cuda")]
    fn load_device(&self, py: Python<'_>, views: &[TensorView]) -> PyResult<ckpt::load::LoadStats> {
        let mut ordinals: Vec<usize> = views
            .iter()
            .filter_map(|v| match v.place {
                Place::Device { ordinal, .. } => Some(ordinal),
                Place::Host => None,
            })
            .collect();
        ordinals.sort_unstable();
        ordinals.dedup();
        let mut total = ckpt::load::LoadStats::default();
        for ordinal in ordinals {
            let on: Vec<&TensorView> = views
                .iter()
                .filter(|v| matches!(v.place, Place::Device { ordinal: o, .. } if o == ordinal))
                .collect();
            let mut request = LoadRequest::new();
            let mut targets = Vec::with_capacity(on.len());
            for view in &on {
                request = request.expect(&view.name, view.dtype, &view.shape, view.region.clone());
                // SAFETY: the Python layer keeps the destination alive, and nothing
                // else uses it, until this call returns.
                targets.push(unsafe { view.device_buffer(py)? });
            }
            let ctx = cuda_context(ordinal).map_err(|e| to_py(py, e))?;
            let reader = self.inner.clone();
            let stats = run(py, async move {
                let mut loader = ckpt::cuda::DeviceLoader::new(&ctx)?;
                loader.load_into(&reader, &request, &targets).await
            })?;
            add_counters(&mut total, &stats);
        }
        Ok(total)
    }

    #[cfg(not(feature = "cuda"))]
    fn load_device(
        &self,
        _py: Python<'_>,
        views: &[TensorView],
    ) -> PyResult<ckpt::load::LoadStats> {
        views.iter().try_for_each(TensorView::check_host)?;
        Ok(ckpt::load::LoadStats::default())
    }
}

/// Adds the byte counters of another load of the same checkpoint (its parts are
/// the same parts: the larger count, not the sum).
fn add_counters(total: &mut ckpt::load::LoadStats, other: &ckpt::load::LoadStats) {
    total.bytes_requested += other.bytes_requested;
    total.bytes_read += other.bytes_read;
    total.bytes_verified += other.bytes_verified;
    total.bytes_copied += other.bytes_copied;
    total.parts_read = total.parts_read.max(other.parts_read);
}

/// The destinations of a load, as Python describes them (`Reader.load_into`'s
/// tuples), writable.
fn load_views(wants: Vec<WantTuple>) -> PyResult<Vec<TensorView>> {
    wants
        .into_iter()
        .map(
            |(name, dtype, shape, offsets, lengths, ptr, nbytes, device, stream)| {
                TensorView::from_tuple((
                    name, dtype, shape, offsets, lengths, ptr, nbytes, true, device, stream,
                ))
            },
        )
        .collect()
}

/// The load request for `views`, in order.
fn request_of(views: &[TensorView]) -> LoadRequest {
    views.iter().fold(LoadRequest::new(), |request, view| {
        request.expect(&view.name, view.dtype, &view.shape, view.region.clone())
    })
}

/// Refuses destinations whose memory overlaps: the library writes each output from
/// its own threads without locks.
fn check_disjoint(views: &[TensorView]) -> PyResult<()> {
    let mut spans: Vec<(usize, usize, &str)> = views
        .iter()
        .filter(|v| v.nbytes > 0)
        .map(|v| (v.ptr, v.ptr.saturating_add(v.nbytes), v.name.as_str()))
        .collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(invalid(format!(
                "the destinations of {:?} and {:?} share memory",
                pair[0].2, pair[1].2
            )));
        }
    }
    Ok(())
}

/// A manifest's health as JSON text, None when unknown.
fn health_json(manifest: &Manifest) -> Option<String> {
    manifest
        .health
        .as_ref()
        .map(|h| serde_json::to_string(h).unwrap_or_else(|_| "null".into()))
}

fn skipped_tuples(skipped: &[Skipped]) -> Vec<(u64, String, Vec<String>)> {
    skipped
        .iter()
        .map(|s| (s.step, s.dir.clone(), s.reasons.clone()))
        .collect()
}

/// The newest committed checkpoint under `url`, or with `healthy` the newest that
/// is not judged unhealthy: a dict (`step`, `generation`, `world_size`, `tensors`,
/// `created_unix_ms`, `healthy` (True, False, or None when unknown), `reasons`,
/// and `skipped`: the unhealthy commits passed over, as `(step, dir, reasons)`),
/// or None when there is none.
#[pyfunction]
#[pyo3(signature = (url, store_options=None, healthy=false))]
fn latest<'py>(
    py: Python<'py>,
    url: &str,
    store_options: Option<&Bound<'py, PyDict>>,
    healthy: bool,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    let store = open_store(url, store_options)?;
    let select = if healthy {
        Select::Healthy
    } else {
        Select::Any
    };
    let found = run(py, async move {
        ckpt::catalog::latest_selecting(&store, select).await
    })?;
    found
        .map(|(m, skipped)| {
            let out = PyDict::new(py);
            out.set_item("step", m.step)?;
            out.set_item("generation", m.generation)?;
            out.set_item("world_size", m.world_size)?;
            out.set_item("tensors", m.tensors.len())?;
            out.set_item("created_unix_ms", m.created_unix_ms)?;
            let status = m.health_status();
            out.set_item("healthy", status.healthy())?;
            out.set_item("reasons", status.reasons().to_vec())?;
            out.set_item("skipped", skipped_tuples(&skipped))?;
            Ok(out)
        })
        .transpose()
}

/// Every checkpoint directory under `url`, commits in commit order first: dicts
/// (`step`, `dir`, `status`, `committed`, `generation`, `ranks_present`, `bytes`).
#[pyfunction(name = "list")]
#[pyo3(signature = (url, store_options=None))]
fn list_checkpoints<'py>(
    py: Python<'py>,
    url: &str,
    store_options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyList>> {
    let store = open_store(url, store_options)?;
    let infos = run(py, async move { ckpt::list_checkpoints(&store).await })?;
    let out = PyList::empty(py);
    for info in infos {
        let entry = PyDict::new(py);
        entry.set_item("step", info.step)?;
        entry.set_item("dir", &info.dir)?;
        entry.set_item("status", info.status.as_str())?;
        entry.set_item("committed", info.committed)?;
        entry.set_item("generation", info.generation)?;
        entry.set_item("ranks_present", info.ranks_present.clone())?;
        entry.set_item("bytes", info.bytes)?;
        out.append(entry)?;
    }
    Ok(out)
}

/// Every checkpoint under `url` as `ckpt ls --json` shows it (health included: one
/// manifest read per commit), as JSON text: a list of objects with `step`, `dir`,
/// `status`, `latest`, `resume`, `healthy` (null when unknown), `health_reasons`, ….
#[pyfunction]
#[pyo3(signature = (url, store_options=None))]
fn ls_json(
    py: Python<'_>,
    url: &str,
    store_options: Option<&Bound<'_, PyDict>>,
) -> PyResult<String> {
    let store = open_store(url, store_options)?;
    let listed = run(py, async move { ckpt::tools::inspect::ls(&store).await })?;
    serde_json::to_string(&listed).map_err(|e| CkptError::new_err(format!("listing as JSON: {e}")))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Checkpointer>()?;
    m.add_class::<SaveHandle>()?;
    m.add_class::<SnapshotHandle>()?;
    m.add_class::<Snapshot>()?;
    m.add_class::<SavePlan>()?;
    m.add_class::<Reader>()?;
    m.add_class::<cooperative::Cooperation>()?;
    m.add_class::<elastic::Agent>()?;
    m.add_class::<copies::Copies>()?;
    m.add("HOLDING_SIZE", ckpt::copies::Holding::SIZE)?;
    m.add("VOTE_SIZE", ckpt::snapshot::Vote::SIZE)?;
    m.add_function(wrap_pyfunction!(latest, m)?)?;
    m.add_function(wrap_pyfunction!(copies::tally, m)?)?;
    m.add_function(wrap_pyfunction!(copies::vote_against, m)?)?;
    m.add_function(wrap_pyfunction!(copies::snapshot_record, m)?)?;
    m.add_function(wrap_pyfunction!(copies::record_uncovered, m)?)?;
    m.add_function(wrap_pyfunction!(copies::share_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(list_checkpoints, m)?)?;
    m.add_function(wrap_pyfunction!(ls_json, m)?)?;
    m.add("CkptError", py.get_type::<CkptError>())?;
    m.add("CorruptionError", py.get_type::<CorruptionError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("MismatchError", py.get_type::<MismatchError>())?;
    m.add("InvalidError", py.get_type::<InvalidError>())?;
    m.add("StorageError", py.get_type::<StorageError>())?;
    m.add("CommitTimeoutError", py.get_type::<CommitTimeoutError>())?;
    m.add("SaveFailedError", py.get_type::<SaveFailedError>())?;
    m.add("FencedError", py.get_type::<FencedError>())?;
    m.add("MutatedError", py.get_type::<MutatedError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("OverBudgetError", py.get_type::<OverBudgetError>())?;
    m.add("ElasticError", py.get_type::<ElasticError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Whether device tensors are staged through the library (cargo feature `cuda`).
    m.add("HAS_CUDA", cfg!(feature = "cuda"))?;
    Ok(())
}
