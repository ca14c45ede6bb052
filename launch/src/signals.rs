//! SIGINT and SIGTERM as flags that the loops poll.
//!
//! The first signal asks for a drain: [`STOP`] is set, the ranks agree on a step,
//! save it, wait for its commit and exit with 75. After
//! [`exit_on_second_signal`], a second signal means "now": the process exits at
//! once with 128 + the signal, skipping the save the first one asked for. A
//! launcher reads [`received`] to forward every signal to its ranks.
//!
//! The handler is registered through `signal-hook`, whose registry owns the
//! process's `sigaction` for each signal and runs every action registered for it:
//! it composes with anything else in the process that registers there (tokio's
//! signal support does), where a hand-installed handler would replace theirs.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::low_level;

/// Set on the first SIGINT or SIGTERM; training loops poll it.
pub static STOP: AtomicBool = AtomicBool::new(false);

/// The signals received so far, and the last one (0 when none).
static COUNT: AtomicI32 = AtomicI32::new(0);
static LAST: AtomicI32 = AtomicI32::new(0);

/// Whether a second signal ends the process at once.
static EXIT_ON_SECOND: AtomicBool = AtomicBool::new(false);

/// The action run inside the signal handler, so it does only async-signal-safe
/// things: atomics, and `_exit`, which (unlike `exit`) runs no atexit handlers or
/// destructors that could meet a lock the signal interrupted.
fn on_signal(signal: i32) {
    LAST.store(signal, Ordering::SeqCst);
    STOP.store(true, Ordering::SeqCst);
    let count = COUNT.fetch_add(1, Ordering::SeqCst) + 1;
    if count >= 2 && EXIT_ON_SECOND.load(Ordering::SeqCst) {
        low_level::exit(128 + signal);
    }
}

/// Makes a second SIGINT/SIGTERM exit the process at once (code 128 + signal),
/// skipping the final save that the first one asked for.
pub fn exit_on_second_signal() {
    EXIT_ON_SECOND.store(true, Ordering::SeqCst);
}

/// Installs the handler for SIGINT and SIGTERM (once: a second call does nothing, so
/// no signal is counted twice).
pub fn install() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        for signal in [SIGINT, SIGTERM] {
            // SAFETY: the action, `on_signal`, is async-signal-safe: it touches only
            // atomics and calls `_exit`; it neither allocates nor locks.
            let registered = unsafe { low_level::register(signal, move || on_signal(signal)) };
            if let Err(e) = registered {
                tracing::warn!(signal, error = %e, "cannot handle the signal; it ends the process at once");
            }
        }
    });
}

/// The signals received so far and the last one (0 when none).
pub fn received() -> (i32, i32) {
    (COUNT.load(Ordering::SeqCst), LAST.load(Ordering::SeqCst))
}
