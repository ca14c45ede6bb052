//! Checks that the CUDA driver and NCCL libraries can be loaded, before cudarc
//! touches them.
//!
//! cudarc loads `libcuda` and `libnccl` on first use and panics when it finds
//! neither the library nor a symbol it looks up. A checkpointing library must not
//! take its trainer down that way: [`driver`] and [`nccl`] first try to `dlopen`
//! (through libloading, as cudarc itself does) exactly the file names cudarc will
//! try (its own list, so the two cannot drift apart), then look up every symbol
//! ckpt calls, and return [`Error::Device`] naming the library, the names tried and
//! how to fix it. Only after a probe has
//! succeeded does any code of this crate call into cudarc, so the only way left to
//! panic there is a library that changes between the probe and the call.
//!
//! The results are cached: a library found once stays loaded (cudarc keeps it for
//! the life of the process), and a library missing once is reported again without
//! searching anew.

use std::ffi::c_void;
use std::sync::OnceLock;

use libloading::os::unix::{Library as Loaded, RTLD_LOCAL, RTLD_NOW};

use crate::error::{Error, Result};

/// The driver API symbols ckpt calls (checked by [`driver`]).
pub const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
];

/// The NCCL symbols ckpt's NCCL layer calls (checked by [`nccl`]). Newer calls
/// (`ncclCommShrink`, NCCL 2.27) are looked up separately and are optional.
pub const NCCL_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclGetErrorString",
    "ncclCommInitRankConfig",
    "ncclCommGetAsyncError",
    "ncclCommAbort",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclAllGather",
    "ncclAllReduce",
    "ncclReduceScatter",
    "ncclBroadcast",
];

/// A library that was found and has every symbol ckpt needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Library {
    /// What it is: `"libcuda"` (the CUDA driver) or `"libnccl"`.
    pub what: &'static str,
    /// The file name that loaded (as given to `dlopen`, resolved through the
    /// dynamic linker's search path: `LD_LIBRARY_PATH`, the cache, the defaults).
    pub file: String,
    /// The library's version as it reports it: the driver's `cuDriverGetVersion`
    /// (e.g. 13000 for CUDA 13.0) or `ncclGetVersion` (e.g. 22703 for 2.27.3).
    pub version: i32,
}

/// The names cudarc tries for the CUDA driver, in its order (without repeats).
pub fn driver_candidates() -> Vec<String> {
    distinct(
        ["cuda", "nvcuda"]
            .iter()
            .flat_map(|name| cudarc::get_lib_name_candidates(name)),
    )
}

fn distinct(names: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for name in names {
        if !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

/// The names cudarc tries for NCCL, in its order. `libnccl.so.2`, the name NCCL's
/// own packages (and the `nvidia-nccl-cu12/13` wheels) install, is not among them:
/// see [`nccl`].
pub fn nccl_candidates() -> Vec<String> {
    distinct(cudarc::get_lib_name_candidates("nccl"))
}

/// Probes the CUDA driver library: loadable under one of cudarc's names, with every
/// symbol of [`DRIVER_SYMBOLS`]. Does not initialise CUDA.
pub fn driver() -> Result<Library> {
    static DRIVER: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            probe(
                "libcuda",
                &driver_candidates(),
                DRIVER_SYMBOLS,
                "the CUDA driver is not installed or not on the loader's path: install the \
                 NVIDIA driver (it ships libcuda.so.1), or add the directory holding \
                 libcuda.so.1 to LD_LIBRARY_PATH",
                driver_version,
            )
        })
        .clone()
        .map_err(Error::Device)
}

/// Probes NCCL: loadable under one of cudarc's names, with every symbol of
/// [`NCCL_SYMBOLS`].
///
/// cudarc does not look for `libnccl.so.2`. Where NCCL comes as a Python wheel
/// (`site-packages/nvidia/nccl/lib/libnccl.so.2`) or a distribution package without
/// its development symlink, make one in a directory on `LD_LIBRARY_PATH`:
/// `ln -s …/libnccl.so.2 DIR/libnccl.so` (docs/GPU.md).
pub fn nccl() -> Result<Library> {
    static NCCL: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    NCCL.get_or_init(|| {
        probe(
            "libnccl",
            &nccl_candidates(),
            NCCL_SYMBOLS,
            "NCCL is not installed under a name cudarc looks for: where only libnccl.so.2 \
             exists (the nvidia-nccl wheels, packages without the -dev symlink), create a \
             symlink named libnccl.so to it in a directory on LD_LIBRARY_PATH",
            nccl_version,
        )
    })
    .clone()
    .map_err(Error::Device)
}

/// The number of CUDA devices, asked of the driver only after [`driver`] succeeded.
/// Zero devices is an error too ([`Error::Device`]), so that `device_count()?`
/// answers "can this process use a GPU".
pub fn device_count() -> Result<usize> {
    driver()?;
    cudarc::driver::result::init()
        .map_err(|e| Error::Device(format!("cuInit failed: {e} (is a GPU visible?)")))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| Error::Device(format!("cuDeviceGetCount failed: {e}")))?;
    if n <= 0 {
        return Err(Error::Device(
            "the CUDA driver reports no device (CUDA_VISIBLE_DEVICES hides them all?)".into(),
        ));
    }
    Ok(n as usize)
}

/// Tries `candidates` in order; the first that loads must have every symbol.
fn probe(
    what: &'static str,
    candidates: &[String],
    symbols: &[&str],
    fix: &str,
    version: fn(&Loaded) -> i32,
) -> std::result::Result<Library, String> {
    let mut reasons = Vec::new();
    for file in candidates {
        // RTLD_NOW: a library whose own dependencies do not resolve fails here, in
        // the probe, rather than at its first call.
        // SAFETY: loading a library runs its initialisers, which is what cudarc would
        // do next anyway.
        let library = match unsafe { Loaded::open(Some(file.as_str()), RTLD_NOW | RTLD_LOCAL) } {
            Ok(library) => library,
            Err(e) => {
                // The loader's message names the file itself: keep only what it says of it.
                let error = loader_message(&e);
                let error = error
                    .strip_prefix(file.as_str())
                    .and_then(|e| e.strip_prefix(": "))
                    .map_or(error.clone(), str::to_string);
                reasons.push(error);
                continue;
            }
        };
        let missing: Vec<&str> = symbols
            .iter()
            .copied()
            .filter(|s| !has_symbol(&library, s))
            .collect();
        if !missing.is_empty() {
            // Dropping `library` closes it.
            return Err(format!(
                "{what}: {file} loads but lacks {} (too old a version?); ckpt needs every \
                 one of {symbols:?}",
                missing.join(", ")
            ));
        }
        let version = version(&library);
        // The library is deliberately left open: cudarc opens the same file next and
        // keeps it for the life of the process.
        std::mem::forget(library);
        return Ok(Library {
            what,
            file: file.clone(),
            version,
        });
    }
    Err(format!(
        "{what} could not be loaded: tried {} ({}); {fix}",
        listed(candidates),
        summarize(&reasons)
    ))
}

/// The file names tried, all of them when they are few, else the first ones and
/// a count: the full list is cudarc's, and `*_candidates()` return it.
fn listed(candidates: &[String]) -> String {
    const SHOWN: usize = 6;
    if candidates.len() <= SHOWN {
        return format!("{candidates:?}");
    }
    format!(
        "{:?} and {} more names",
        &candidates[..SHOWN],
        candidates.len() - SHOWN
    )
}

/// The first distinct loader messages, so that a long list of "not found" stays short.
fn summarize(reasons: &[String]) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for r in reasons {
        let message = r.as_str();
        if !seen.contains(&message) {
            seen.push(message);
        }
    }
    if seen.is_empty() {
        "no candidate".to_string()
    } else {
        seen.iter().take(3).copied().collect::<Vec<_>>().join("; ")
    }
}

/// What the dynamic loader said (`dlerror`), without libloading's own summary.
fn loader_message(error: &libloading::Error) -> String {
    match error {
        libloading::Error::DlOpen { source } => source.to_string(),
        other => other.to_string(),
    }
}

/// True when `library` exports `name` (as a non-null address).
fn has_symbol(library: &Loaded, name: &str) -> bool {
    // SAFETY: the symbol is only looked up, as an untyped address, never used.
    unsafe { library.get::<*mut c_void>(name) }.is_ok_and(|address| !address.is_null())
}

fn driver_version(library: &Loaded) -> i32 {
    call_version(library, "cuDriverGetVersion")
}

fn nccl_version(library: &Loaded) -> i32 {
    call_version(library, "ncclGetVersion")
}

/// Calls `int f(int *out)` (both version queries have that shape); 0 on failure.
fn call_version(library: &Loaded, name: &str) -> i32 {
    type Query = unsafe extern "C" fn(*mut i32) -> i32;
    // SAFETY: both `cuDriverGetVersion(int*)` and `ncclGetVersion(int*)` take one
    // pointer to an int and return an int status; neither needs initialisation. The
    // `Option` makes a null address `None` rather than a function to call.
    let Ok(Some(f)) = (unsafe { library.get::<Option<Query>>(name) }).map(|f| *f) else {
        return 0;
    };
    let mut version = 0i32;
    // SAFETY: `version` is a valid, writable int for the duration of the call.
    let status = unsafe { f(&mut version) };
    if status == 0 { version } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_are_cudarcs_and_lack_the_wheel_name() {
        let nccl = nccl_candidates();
        assert_eq!(nccl[0], "libnccl.so");
        assert!(!nccl.iter().any(|n| n == "libnccl.so.2"), "{nccl:?}");
        let driver = driver_candidates();
        assert!(driver.iter().any(|n| n == "libcuda.so.1"), "{driver:?}");
        let mut unique = driver.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), driver.len(), "no name is tried twice");
    }

    #[test]
    fn a_missing_library_is_a_clear_error_not_a_panic() {
        let Err(message) = probe(
            "libnothing",
            &[
                "libckpt-surely-absent.so".to_string(),
                "libckpt-absent-too.so.1".into(),
            ],
            &["nothing"],
            "install nothing",
            |_| 0,
        ) else {
            panic!("a library that does not exist loaded");
        };
        assert!(
            message.contains("libnothing could not be loaded"),
            "{message}"
        );
        assert!(message.contains("libckpt-surely-absent.so"), "{message}");
        assert!(message.contains("libckpt-absent-too.so.1"), "{message}");
        assert!(message.contains("install nothing"), "{message}");
    }

    #[test]
    fn a_library_without_a_symbol_names_the_symbol() {
        // libc is always loadable; it has no CUDA symbols.
        let Err(message) = probe(
            "libc",
            &["libc.so.6".to_string()],
            &["malloc", "cuNoSuchCall"],
            "",
            |_| 0,
        ) else {
            panic!("libc claims to have cuNoSuchCall");
        };
        assert!(message.contains("lacks cuNoSuchCall"), "{message}");
        assert!(!message.contains("lacks malloc"), "{message}");
        let found = probe("libc", &["libc.so.6".to_string()], &["malloc"], "", |_| 7)
            .expect("libc with malloc");
        assert_eq!(found.file, "libc.so.6");
        assert_eq!(found.version, 7);
    }

    /// On a machine without a GPU the probes answer with errors that say what to do;
    /// on one with a GPU they succeed. Either way nothing panics.
    #[test]
    fn probes_answer_without_panicking() {
        match driver() {
            Ok(lib) => {
                assert!(lib.version > 0, "{lib:?}");
                device_count().expect("a driver is present: cuInit and a device count");
            }
            Err(e) => {
                let message = e.to_string();
                assert!(message.contains("libcuda could not be loaded"), "{message}");
                assert!(message.contains("libcuda.so.1"), "{message}");
                assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
                let again = device_count().expect_err("no driver, no devices");
                assert!(matches!(again, Error::Device(_)), "{again}");
                eprintln!("SKIPPED (device part): no libcuda: {message}");
            }
        }
        match nccl() {
            Ok(lib) => assert!(lib.version >= 2_00_00, "{lib:?}"),
            Err(e) => {
                let message = e.to_string();
                assert!(message.contains("libnccl"), "{message}");
                assert!(message.contains("libnccl.so"), "{message}");
                assert!(message.contains("symlink"), "{message}");
            }
        }
    }
}
