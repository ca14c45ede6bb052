//! The NCCL backend (feature `cuda`): a [`DeviceCollective`] over NCCL's
//! non-blocking communicators, made fault tolerant by [`Guard`].
//!
//! cudarc's safe `nccl::Comm` cannot be used for this: it initialises blocking, has
//! no asynchronous-error query, aborts only in `Drop` (and panics if that fails), and
//! is not `Send`, so no watchdog thread could abort it. This module is a thin layer
//! over NCCL's C API instead, using cudarc for the library (its loader and its type
//! definitions: `ncclUniqueId`, `ncclConfig_t`, the data types) but declaring every
//! function it calls itself with an `int` result: NCCL may return result codes newer
//! than cudarc's `ncclResult_t` enum knows, and an out-of-range value in a Rust enum
//! is undefined behaviour. Symbols are looked up once, after the [`ckpt::cuda::probe`]
//! found the library, so a missing library or symbol is an error, never a panic;
//! `ncclCommShrink` (NCCL ≥ 2.27) is optional and gated on the loaded version.
//!
//! Everything about timeouts, poisoning and aborts lives in [`Guard`] and is tested on
//! CPU; what is here is the mapping onto NCCL, and it is exercised only on a GPU
//! (tests `nccl_*` in `tests/gpu.rs`, which skip loudly without one).

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys as cuda};
use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId,
};

use super::device::{
    DeviceCollective, DeviceMemory, ReduceType, check_all_gather, check_elements,
    check_reduce_scatter,
};
use super::guard::{Guard, GuardConfig, KeyValue, RawComm, RawStatus, share_unique_id};
use super::{CollectiveError, CollectiveResult};

/// `NCCL_VERSION(2, 30, 0)`: the newest `ncclConfig_t` layout cudarc's bindings know.
pub const BINDINGS_VERSION: i32 = 2_30_00;
/// The oldest NCCL this backend accepts (non-blocking init, finalize and the config
/// fields it fills exist from 2.22 on, cudarc's oldest bindings).
pub const MIN_VERSION: i32 = 2_22_00;
/// `ncclCommShrink` exists from NCCL 2.27.
pub const SHRINK_VERSION: i32 = 2_27_00;
/// `NCCL_CONFIG_UNDEF_INT`: a config field left to NCCL.
const UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_SHRINK_DEFAULT` and `NCCL_SHRINK_ABORT` (nccl.h).
const SHRINK_DEFAULT: c_int = 0;
const SHRINK_ABORT: c_int = 1;
/// `ncclInProgress`.
const IN_PROGRESS: c_int = 7;

/// The name of an NCCL result code.
pub fn result_name(code: c_int) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "an NCCL result unknown to this build",
    }
}

/// The bytes of `ncclConfig_t` an NCCL of version `version` knows: its `size` field.
/// Fields were appended over the releases (2.26 `trafficClass`; 2.27 `commName` …
/// `nvlsCTAs`; 2.28 `nChannelsPerNetPeer`, `nvlinkCentricSched`; 2.29
/// `graphUsageMode`, `numRmaCtx`; 2.30 `maxP2pPeers`), so an older library is given
/// the prefix it understands, rounded up to the struct's alignment as its own
/// `sizeof` is.
pub fn config_size(version: i32) -> usize {
    use std::mem::{align_of, offset_of, size_of};
    let end = if version >= 2_30_00 {
        size_of::<ncclConfig_t>()
    } else if version >= 2_29_00 {
        offset_of!(ncclConfig_t, maxP2pPeers)
    } else if version >= 2_28_00 {
        offset_of!(ncclConfig_t, graphUsageMode)
    } else if version >= 2_27_00 {
        offset_of!(ncclConfig_t, nChannelsPerNetPeer)
    } else if version >= 2_26_00 {
        offset_of!(ncclConfig_t, commName)
    } else {
        offset_of!(ncclConfig_t, trafficClass)
    };
    end.next_multiple_of(align_of::<ncclConfig_t>())
}

/// `NCCL_CONFIG_INITIALIZER` for the loaded NCCL (`version`, from `ncclGetVersion`),
/// non-blocking: `size` is what that version knows ([`config_size`]), `magic` is
/// `0xcafebeef`, `version` the older of the library's and the bindings', and every
/// other field is unset (`INT_MIN`, or NULL for pointers), so NCCL picks its
/// defaults.
pub fn nonblocking_config(version: i32) -> ncclConfig_t {
    ncclConfig_t {
        size: config_size(version),
        magic: 0xcafe_beef,
        version: version.min(BINDINGS_VERSION) as u32,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

/// Whether an NCCL of `version` has `ncclCommShrink`.
pub fn has_shrink(version: i32) -> bool {
    version >= SHRINK_VERSION
}

type Comm = ncclComm_t;

/// The NCCL functions this backend calls, with `int` results.
struct Api {
    version: i32,
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_last_error: Option<unsafe extern "C" fn(Comm) -> *const c_char>,
    init_rank_config:
        unsafe extern "C" fn(*mut Comm, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> c_int,
    get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    abort: unsafe extern "C" fn(Comm) -> c_int,
    finalize: unsafe extern "C" fn(Comm) -> c_int,
    destroy: unsafe extern "C" fn(Comm) -> c_int,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        Comm,
        cudaStream_t,
    ) -> c_int,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        Comm,
        cudaStream_t,
    ) -> c_int,
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        Comm,
        cudaStream_t,
    ) -> c_int,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        Comm,
        cudaStream_t,
    ) -> c_int,
    shrink: Option<
        unsafe extern "C" fn(Comm, *mut c_int, c_int, *mut Comm, *mut ncclConfig_t, c_int) -> c_int,
    >,
}

/// Looks a symbol up in the library cudarc loaded.
///
/// # Safety
/// `F` must be the function's true C signature.
unsafe fn symbol<F: Copy>(name: &str) -> Result<F, String> {
    // SAFETY: `culib` is called only after the probe found the library under one of
    // the names cudarc tries, so it loads instead of panicking.
    let lib = unsafe { cudarc::nccl::sys::culib() };
    // SAFETY: the caller vouches for the signature.
    unsafe { lib.get::<F>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("NCCL lacks {name}: {e}"))
}

fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        let lib = ckpt::cuda::probe::nccl().map_err(|e| e.to_string())?;
        if lib.version < MIN_VERSION {
            return Err(format!(
                "{} is NCCL {}, older than the {} this backend needs",
                lib.file,
                version_string(lib.version),
                version_string(MIN_VERSION)
            ));
        }
        // SAFETY: each signature below is the one nccl.h declares, with the
        // `ncclResult_t` result read as the `int` it is.
        unsafe {
            Ok(Api {
                version: lib.version,
                get_unique_id: symbol("ncclGetUniqueId")?,
                get_error_string: symbol("ncclGetErrorString")?,
                get_last_error: symbol("ncclGetLastError").ok(),
                init_rank_config: symbol("ncclCommInitRankConfig")?,
                get_async_error: symbol("ncclCommGetAsyncError")?,
                abort: symbol("ncclCommAbort")?,
                finalize: symbol("ncclCommFinalize")?,
                destroy: symbol("ncclCommDestroy")?,
                all_gather: symbol("ncclAllGather")?,
                all_reduce: symbol("ncclAllReduce")?,
                reduce_scatter: symbol("ncclReduceScatter")?,
                broadcast: symbol("ncclBroadcast")?,
                shrink: if has_shrink(lib.version) {
                    symbol("ncclCommShrink").ok()
                } else {
                    None
                },
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// `22703` as `2.27.3`.
pub fn version_string(version: i32) -> String {
    format!(
        "{}.{}.{}",
        version / 10000,
        version / 100 % 100,
        version % 100
    )
}

/// The loaded NCCL's version (`ncclGetVersion`), after probing it.
pub fn version() -> Result<i32, CollectiveError> {
    api()
        .map(|a| a.version)
        .map_err(|message| CollectiveError::Device {
            op: "nccl",
            message,
        })
}

/// A new unique id (`ncclGetUniqueId`), as bytes.
pub fn unique_id() -> Result<Vec<u8>, String> {
    let api = api()?;
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid, writable ncclUniqueId.
    let status = unsafe { (api.get_unique_id)(&mut id) };
    if status != 0 {
        return Err(describe(api, status, None));
    }
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

fn describe(api: &Api, code: c_int, comm: Option<Comm>) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let what = unsafe { cstr((api.get_error_string)(code)) };
    let last = match (comm, api.get_last_error) {
        // SAFETY: `comm` is live (the caller holds the guard's raw mutex) and the
        // returned string is NCCL's, NUL-terminated; it is copied at once.
        (Some(comm), Some(f)) => unsafe { cstr(f(comm)) },
        _ => String::new(),
    };
    let mut message = format!("{} ({code}): {what}", result_name(code));
    if !last.is_empty() {
        message.push_str(": ");
        message.push_str(&last);
    }
    message
}

/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: forwarded from the caller.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// One NCCL communicator, raw: [`Guard`] serializes every call on it.
pub struct RawNccl {
    api: &'static Api,
    comm: Comm,
    ctx: Arc<CudaContext>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no two calls
// on it run at once; `Guard` makes every call with its raw mutex held, and binds the
// CUDA context of the calling thread first (`bind`).
unsafe impl Send for RawNccl {}

impl RawNccl {
    fn bind(&self) -> Result<(), String> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e}"))
    }

    fn status(&self, code: c_int) -> RawStatus {
        match code {
            0 => RawStatus::Done,
            IN_PROGRESS => RawStatus::InProgress,
            code => RawStatus::Failed(describe(self.api, code, Some(self.comm))),
        }
    }

    /// Starts a non-blocking `ncclCommInitRankConfig`.
    fn init(ctx: &Arc<CudaContext>, rank: usize, world: usize, id: &[u8]) -> Result<Self, String> {
        let api = api()?;
        let mut internal = [0 as c_char; 128];
        if id.len() != internal.len() {
            return Err(format!("a unique id has 128 bytes, got {}", id.len()));
        }
        for (d, s) in internal.iter_mut().zip(id) {
            *d = *s as c_char;
        }
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e}"))?;
        let mut config = nonblocking_config(api.version);
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid and writable for the call; NCCL copies
        // the config; the unique id is passed by value.
        let code = unsafe {
            (api.init_rank_config)(
                &mut comm,
                world as c_int,
                ncclUniqueId { internal },
                rank as c_int,
                &mut config,
            )
        };
        if code != 0 && code != IN_PROGRESS {
            let message = describe(api, code, None);
            if !comm.is_null() {
                // SAFETY: a communicator NCCL handed out, never used again.
                unsafe { (api.abort)(comm) };
            }
            return Err(message);
        }
        Ok(Self {
            api,
            comm,
            ctx: ctx.clone(),
        })
    }

    fn collective(
        &mut self,
        op: &'static str,
        call: impl FnOnce(&Api, Comm) -> c_int,
    ) -> RawStatus {
        if let Err(e) = self.bind() {
            return RawStatus::Failed(format!("{op}: {e}"));
        }
        let code = call(self.api, self.comm);
        self.status(code)
    }
}

impl RawComm for RawNccl {
    type Stream = CudaStream;
    type Marker = CudaEvent;

    fn async_status(&mut self) -> RawStatus {
        if let Err(e) = self.bind() {
            return RawStatus::Failed(e);
        }
        let mut async_code: c_int = 0;
        // SAFETY: the communicator is live; `async_code` is a writable int (the
        // `ncclResult_t*` parameter, read as int).
        let code = unsafe { (self.api.get_async_error)(self.comm, &mut async_code) };
        if code != 0 {
            return self.status(code);
        }
        self.status(async_code)
    }

    fn record(&mut self, stream: &CudaStream) -> Result<CudaEvent, String> {
        stream
            .record_event(None)
            .map_err(|e| format!("cuEventRecord: {e}"))
    }

    fn reached(&mut self, marker: &CudaEvent) -> Result<bool, String> {
        // The watchdog thread queries too: the event's context must be current.
        self.bind()?;
        marker
            .try_is_complete()
            .map_err(|e| format!("cuEventQuery: {e}"))
    }

    fn abort(&mut self) -> Result<(), String> {
        self.bind()?;
        // SAFETY: the communicator is live and, with the guard's raw mutex held by
        // the caller, no other thread is inside NCCL on it; it is not used again.
        let code = unsafe { (self.api.abort)(self.comm) };
        match code {
            0 | IN_PROGRESS => Ok(()),
            code => Err(describe(self.api, code, None)),
        }
    }

    fn finalize(&mut self) -> RawStatus {
        self.collective("finalize", |api, comm| {
            // SAFETY: the communicator is live; calls are serialized by the guard.
            unsafe { (api.finalize)(comm) }
        })
    }

    fn destroy(&mut self) -> Result<(), String> {
        self.bind()?;
        // SAFETY: called once, after a completed finalize; not used again.
        let code = unsafe { (self.api.destroy)(self.comm) };
        match code {
            0 => Ok(()),
            code => Err(describe(self.api, code, None)),
        }
    }
}

/// Device memory an NCCL operation reads or writes: a CUDA device pointer and a
/// length in bytes, on the communicator's device.
#[derive(Debug)]
pub struct DeviceBytes {
    ptr: cuda::CUdeviceptr,
    len: usize,
}

impl DeviceBytes {
    /// Describes `len` bytes of device memory at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be device memory of the communicator's device (or
    /// accessible from it), allocated until every operation that uses it has
    /// completed (until [`DeviceCollective::synchronize`] returned, or the
    /// communicator was aborted and [`NcclCollective::wait_aborted`] returned), and
    /// not written by other work meanwhile.
    pub unsafe fn from_raw(ptr: cuda::CUdeviceptr, len: usize) -> Self {
        Self { ptr, len }
    }

    /// The device pointer.
    pub fn ptr(&self) -> cuda::CUdeviceptr {
        self.ptr
    }
}

impl DeviceMemory for DeviceBytes {
    fn byte_len(&self) -> usize {
        self.len
    }
}

fn nccl_type(ty: ReduceType) -> ncclDataType_t {
    match ty {
        ReduceType::I64 => ncclDataType_t::ncclInt64,
        ReduceType::F32 => ncclDataType_t::ncclFloat32,
    }
}

fn raw_stream(stream: &CudaStream) -> cudaStream_t {
    stream.cu_stream() as cudaStream_t
}

/// A fault-tolerant NCCL communicator; see the module docs and [`Guard`].
#[derive(Debug)]
pub struct NcclCollective {
    guard: Guard<RawNccl>,
    ctx: Arc<CudaContext>,
}

impl NcclCollective {
    /// Starts a non-blocking initialisation as `rank` of `world` from a unique id
    /// (`unique_id` on one rank, shared with the others). Returns at once; the first
    /// operation (or [`NcclCollective::wait_ready`]) waits for the initialisation,
    /// within [`GuardConfig::init_timeout`].
    pub fn init(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        id: &[u8],
        config: GuardConfig,
    ) -> CollectiveResult<Self> {
        if world == 0 || rank >= world {
            return Err(CollectiveError::Invalid {
                op: "init",
                message: format!("rank {rank} is not in world size {world}"),
            });
        }
        let raw =
            RawNccl::init(ctx, rank, world, id).map_err(|message| CollectiveError::Device {
                op: "init",
                message,
            })?;
        Ok(Self {
            guard: Guard::start(raw, rank, world, config),
            ctx: ctx.clone(),
        })
    }

    /// Builds a communicator for the world of `kv` (a control plane's key-value
    /// space, scoped to the generation): rank 0 makes a unique id and publishes it
    /// under `nccl/id/<attempt>`, the others read it. Use a new `attempt` for every
    /// re-creation within one generation.
    pub fn connect(
        ctx: &Arc<CudaContext>,
        kv: &dyn KeyValue,
        rank: usize,
        world: usize,
        attempt: u64,
        config: GuardConfig,
    ) -> CollectiveResult<Self> {
        let id = share_unique_id(kv, rank, 0, &format!("nccl/id/{attempt}"), 128, unique_id)?;
        Self::init(ctx, rank, world, &id, config)
    }

    /// Waits for the initialisation to complete.
    pub fn wait_ready(&self) -> CollectiveResult {
        self.guard.wait_ready("init")
    }

    /// Waits until the communicator is aborted (after [`DeviceCollective::abort`] or
    /// a failure), so that its buffers may be freed and a new one built.
    pub fn wait_aborted(&self) {
        self.guard.wait_aborted()
    }

    /// The orderly end: waits for enqueued work, `ncclCommFinalize`,
    /// `ncclCommDestroy`; aborts instead if any of that fails.
    pub fn shutdown(self) -> CollectiveResult {
        self.guard.shutdown()
    }

    /// A communicator without the ranks of `exclude` (`ncclCommShrink`, NCCL ≥
    /// 2.27; with its abort flag when this one failed). Errors with
    /// [`CollectiveError::Device`] naming the loaded version when it is older.
    pub fn shrink(&self, exclude: &[usize]) -> CollectiveResult<Self> {
        let api = api().map_err(|message| CollectiveError::Device {
            op: "shrink",
            message,
        })?;
        let Some(shrink) = api.shrink else {
            return Err(CollectiveError::Device {
                op: "shrink",
                message: format!(
                    "ncclCommShrink needs NCCL {} or newer; the loaded NCCL is {}",
                    version_string(SHRINK_VERSION),
                    version_string(api.version)
                ),
            });
        };
        let mut excluded: Vec<c_int> = exclude.iter().map(|&r| r as c_int).collect();
        let guard = self.guard.shrink(exclude, |raw, failed| {
            raw.bind()?;
            let mut config = nonblocking_config(api.version);
            let mut child: Comm = std::ptr::null_mut();
            let flags = if failed { SHRINK_ABORT } else { SHRINK_DEFAULT };
            // SAFETY: the parent is live and no other thread is inside NCCL on it (the
            // guard's raw mutex is held); the arrays and out-pointers are valid for
            // the call.
            let code = unsafe {
                shrink(
                    raw.comm,
                    excluded.as_mut_ptr(),
                    excluded.len() as c_int,
                    &mut child,
                    &mut config,
                    flags,
                )
            };
            if code != 0 && code != IN_PROGRESS {
                return Err(describe(api, code, Some(raw.comm)));
            }
            Ok(RawNccl {
                api,
                comm: child,
                ctx: raw.ctx.clone(),
            })
        })?;
        Ok(Self {
            guard,
            ctx: self.ctx.clone(),
        })
    }
}

impl DeviceCollective for NcclCollective {
    type Buffer = DeviceBytes;
    type Stream = CudaStream;

    fn rank(&self) -> usize {
        self.guard.rank()
    }

    fn world_size(&self) -> usize {
        self.guard.world_size()
    }

    fn all_gather(
        &self,
        mine: &DeviceBytes,
        out: &mut DeviceBytes,
        stream: &CudaStream,
    ) -> CollectiveResult {
        let op = "all_gather";
        check_all_gather(op, self.world_size(), mine.len, out.len)?;
        let s = raw_stream(stream);
        self.guard.enqueue(op, stream, |raw| {
            raw.collective(op, |api, comm| {
                // SAFETY: `DeviceBytes::from_raw`'s contract keeps both buffers valid
                // until the operation completes; the sizes were checked above.
                unsafe {
                    (api.all_gather)(
                        mine.ptr as *const c_void,
                        out.ptr as *mut c_void,
                        mine.len,
                        ncclDataType_t::ncclUint8,
                        comm,
                        s,
                    )
                }
            })
        })
    }

    fn reduce_scatter(
        &self,
        data: &DeviceBytes,
        out: &mut DeviceBytes,
        ty: ReduceType,
        stream: &CudaStream,
    ) -> CollectiveResult {
        let op = "reduce_scatter";
        check_reduce_scatter(op, self.world_size(), data.len, out.len, ty)?;
        let s = raw_stream(stream);
        self.guard.enqueue(op, stream, |raw| {
            raw.collective(op, |api, comm| {
                // SAFETY: as in all_gather; `out.len` is a whole number of elements.
                unsafe {
                    (api.reduce_scatter)(
                        data.ptr as *const c_void,
                        out.ptr as *mut c_void,
                        out.len / ty.size(),
                        nccl_type(ty),
                        ncclRedOp_t::ncclSum,
                        comm,
                        s,
                    )
                }
            })
        })
    }

    fn all_reduce(
        &self,
        data: &mut DeviceBytes,
        ty: ReduceType,
        stream: &CudaStream,
    ) -> CollectiveResult {
        let op = "all_reduce";
        check_elements(op, data.len, ty)?;
        let s = raw_stream(stream);
        self.guard.enqueue(op, stream, |raw| {
            raw.collective(op, |api, comm| {
                // SAFETY: as in all_gather; in place (NCCL allows send == recv).
                unsafe {
                    (api.all_reduce)(
                        data.ptr as *const c_void,
                        data.ptr as *mut c_void,
                        data.len / ty.size(),
                        nccl_type(ty),
                        ncclRedOp_t::ncclSum,
                        comm,
                        s,
                    )
                }
            })
        })
    }

    fn broadcast(
        &self,
        root: usize,
        data: &mut DeviceBytes,
        stream: &CudaStream,
    ) -> CollectiveResult {
        let op = "broadcast";
        if root >= self.world_size() {
            return Err(CollectiveError::Invalid {
                op,
                message: format!("root {root} is not in world size {}", self.world_size()),
            });
        }
        let s = raw_stream(stream);
        self.guard.enqueue(op, stream, |raw| {
            raw.collective(op, |api, comm| {
                // SAFETY: as in all_gather; in place.
                unsafe {
                    (api.broadcast)(
                        data.ptr as *const c_void,
                        data.ptr as *mut c_void,
                        data.len,
                        ncclDataType_t::ncclUint8,
                        root as c_int,
                        comm,
                        s,
                    )
                }
            })
        })
    }

    fn synchronize(&self, stream: &CudaStream) -> CollectiveResult {
        self.guard.synchronize("synchronize", stream)
    }

    fn abort(&self) {
        self.guard.abort()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn the_config_says_what_each_nccl_version_knows() {
        let c = nonblocking_config(2_27_03);
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.version, 2_27_03);
        assert_eq!(c.blocking, 0, "non-blocking");
        assert_eq!(c.size, 72, "2.27's ncclConfig_t ends after nvlsCTAs");
        assert_eq!(c.size, offset_of!(ncclConfig_t, nChannelsPerNetPeer));
        for unset in [
            c.cgaClusterSize,
            c.minCTAs,
            c.maxCTAs,
            c.splitShare,
            c.nvlsCTAs,
        ] {
            assert_eq!(unset, c_int::MIN);
        }
        assert!(c.netName.is_null() && c.commName.is_null());
        assert_eq!(config_size(2_22_03), 48, "2.22: up to splitShare, padded");
        assert_eq!(
            config_size(2_26_05),
            48,
            "2.26: trafficClass fills the padding"
        );
        assert_eq!(config_size(2_28_09), 80);
        assert_eq!(config_size(2_29_02), 88);
        assert_eq!(config_size(2_30_01), size_of::<ncclConfig_t>());
        // A newer NCCL than the bindings gets the bindings' layout and version.
        let newer = nonblocking_config(2_31_00);
        assert_eq!(newer.size, size_of::<ncclConfig_t>());
        assert_eq!(newer.version, BINDINGS_VERSION as u32);
    }

    #[test]
    fn shrink_is_gated_on_2_27() {
        assert!(!has_shrink(2_26_05));
        assert!(has_shrink(2_27_00));
        assert!(has_shrink(2_30_01));
        assert_eq!(version_string(2_27_03), "2.27.3");
    }

    #[test]
    fn result_codes_have_names_and_unknown_ones_do_not_panic() {
        assert_eq!(result_name(6), "ncclRemoteError");
        assert_eq!(result_name(7), "ncclInProgress");
        assert!(result_name(99).contains("unknown"));
    }

    #[test]
    fn without_nccl_the_backend_answers_with_an_error() {
        match version() {
            Ok(v) => assert!(v >= MIN_VERSION),
            Err(e) => {
                let message = e.to_string();
                assert!(message.contains("libnccl"), "{message}");
                eprintln!("SKIPPED (NCCL part): {message}");
            }
        }
    }
}
