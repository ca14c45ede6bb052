//! Failpoints at the seams of the save protocol, for crash tests.
//!
//! Compiled in only with the `failpoints` feature. When the environment variable
//! `CKPT_FAILPOINT` names a failpoint, the process announces on stderr
//! (`ckpt failpoint reached: NAME`) that it got there and then stops making progress,
//! so that a test can kill it (SIGKILL) at exactly that point of the protocol.
//! Names: `during-staging`, `before-data-upload`, `during-data-upload`,
//! `after-data-upload`, `after-rank-part`, `before-commit`, `after-commit`.

/// Stops here forever when `CKPT_FAILPOINT` names `name` (feature `failpoints`).
#[cfg(feature = "failpoints")]
pub(crate) fn hit(name: &str) {
    use std::io::Write;
    use std::sync::OnceLock;
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| std::env::var("CKPT_FAILPOINT").ok());
    if armed.as_deref() == Some(name) {
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
