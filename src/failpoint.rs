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

/// Failpoints held by [`hold`], and whether a thread has reached each.
static HELD: Mutex<Vec<(String, bool)>> = Mutex::new(Vec::new());
/// Signals a thread reaching a held failpoint, and a release.
static HELD_CHANGED: std::sync::Condvar = std::sync::Condvar::new();

/// A failpoint held with [`hold`]: threads that reach it wait there until this is
/// released (or dropped). For tests that need a save paused at a precise point, e.g.
/// an overlapped save's staging copy after its first tensor.
#[derive(Debug)]
pub struct Hold {
    name: String,
}

/// Makes threads that reach failpoint `name` wait there, until the returned
/// [`Hold`] is released. Process-wide: every save of the process is affected.
pub fn hold(name: &str) -> Result<Hold, String> {
    if !available() {
        return Err(
            "this build has no failpoints (build with the `ckpt/failpoints` feature)".into(),
        );
    }
    if !NAMES.contains(&name) {
        return Err(format!("unknown failpoint {name:?}"));
    }
    HELD.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((name.to_string(), false));
    Ok(Hold {
        name: name.to_string(),
    })
}

impl Hold {
    /// Waits until some thread has reached the failpoint (true), or `limit` passed.
    pub fn wait_reached(&self, limit: std::time::Duration) -> bool {
        let held = HELD.lock().unwrap_or_else(|p| p.into_inner());
        let (held, _) = HELD_CHANGED
            .wait_timeout_while(held, limit, |held| {
                !held.iter().any(|(n, reached)| *n == self.name && *reached)
            })
            .unwrap_or_else(|p| p.into_inner());
        held.iter().any(|(n, reached)| *n == self.name && *reached)
    }

    /// Lets the waiting threads go on.
    pub fn release(self) {}
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = held.iter().position(|(n, _)| *n == self.name) {
            held.remove(i);
        }
        HELD_CHANGED.notify_all();
    }
}

/// Waits while `name` is held by [`hold`].
#[cfg(feature = "failpoints")]
fn wait_if_held(name: &str) {
    let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(entry) = held.iter_mut().find(|(n, _)| n == name) {
        entry.1 = true;
        HELD_CHANGED.notify_all();
        let _released = HELD_CHANGED
            .wait_while(held, |held| held.iter().any(|(n, _)| n == name))
            .unwrap_or_else(|p| p.into_inner());
    }
}

/// Stops here forever when `name` is armed, and waits here while it is held
/// (feature `failpoints`).
#[cfg(feature = "failpoints")]
pub(crate) fn hit(name: &str) {
    use std::io::Write;
    wait_if_held(name);
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
