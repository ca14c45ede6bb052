//! Failpoints at the seams of the save protocol, for crash tests and the chaos harness.
//!
//! Compiled in only with the `failpoints` feature. When a failpoint is armed (the
//! environment variable `CKPT_FAILPOINT` names it, or a test called [`arm`]), the
//! process announces on stderr (`ckpt failpoint reached: NAME`) that it got there and
//! then stops making progress in that thread, so that a test can kill it (SIGKILL) at
//! exactly that point of the protocol. Without the feature every seam is an empty
//! inline function and [`arm`] refuses.

use std::sync::Mutex;

/// Every failpoint, in the order a save reaches them. `during-staging` is inside
/// `save()` (the copy of the caller's tensors); the data file is written between
/// `before-data-upload` and `after-data-upload`; `after-rank-part` follows this rank's
/// part of the manifest; `before-commit` and `after-commit` bracket the commit record,
/// which only the committing rank (rank 0, or a rank taking over) writes.
pub const NAMES: &[&str] = &[
    "during-staging",
    "before-data-upload",
    "during-data-upload",
    "after-data-upload",
    "after-rank-part",
    "before-commit",
    "after-commit",
];

/// The armed failpoint: `None` until first read from `CKPT_FAILPOINT`.
static ARMED: Mutex<Option<Option<String>>> = Mutex::new(None);

/// True when this build has failpoints (the `failpoints` feature).
pub const fn available() -> bool {
    cfg!(feature = "failpoints")
}

/// Arms `name` for the rest of the process (replacing `CKPT_FAILPOINT`): the next
/// time any thread reaches it, it announces itself and stops there.
pub fn arm(name: &str) -> Result<(), String> {
    if !available() {
        return Err(
            "this build has no failpoints (build with the `ckpt/failpoints` feature)".into(),
        );
    }
    if !NAMES.contains(&name) {
        return Err(format!(
            "unknown failpoint {name:?}; known: {}",
            NAMES.join(", ")
        ));
    }
    *ARMED.lock().unwrap_or_else(|p| p.into_inner()) = Some(Some(name.to_string()));
    Ok(())
}

/// Stops here forever when `name` is armed (feature `failpoints`).
#[cfg(feature = "failpoints")]
pub(crate) fn hit(name: &str) {
    use std::io::Write;
    let armed = {
        let mut armed = ARMED.lock().unwrap_or_else(|p| p.into_inner());
        armed
            .get_or_insert_with(|| std::env::var("CKPT_FAILPOINT").ok())
            .as_deref()
            == Some(name)
    };
    if armed {
        let mut stderr = std::io::stderr();
        let _ = writeln!(stderr, "ckpt failpoint reached: {name}");
        let _ = stderr.flush();
        loop {
            std::thread::park();
        }
    }
}

/// No-op without the `failpoints` feature.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn hit(_name: &str) {}
