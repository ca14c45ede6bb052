//! SIGINT/SIGTERM as flags: handlers only store the signal number in an atomic
//! (async-signal-safe); loops poll it.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

static LAST: AtomicI32 = AtomicI32::new(0);
static COUNT: AtomicI32 = AtomicI32::new(0);

/// Set by the handler on the first SIGINT or SIGTERM; training loops poll it.
pub static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(signum: libc::c_int) {
    LAST.store(signum, Ordering::SeqCst);
    STOP.store(true, Ordering::SeqCst);
    let count = COUNT.fetch_add(1, Ordering::SeqCst) + 1;
    if count >= 2 && EXIT_ON_SECOND.load(Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe (unlike `exit`, it runs no atexit
        // handlers or destructors that could meet a lock this handler interrupted),
        // so calling it from a signal handler is sound. A second signal means "now".
        unsafe { libc::_exit(128 + signum) };
    }
}

static EXIT_ON_SECOND: AtomicBool = AtomicBool::new(false);

/// Makes a second SIGINT/SIGTERM exit the process at once (code 128 + signal),
/// skipping the final save that the first one asked for.
pub fn exit_on_second_signal() {
    EXIT_ON_SECOND.store(true, Ordering::SeqCst);
}

/// Installs the handler for SIGINT and SIGTERM.
pub fn install() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: all-zero bytes are a valid `sigaction` (a C struct of integers,
        // a signal set and a function pointer stored as an integer); the pointers
        // handed to `sigemptyset` and `sigaction` point at that live local; and the
        // installed handler does only async-signal-safe things (atomics, `_exit`).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as usize;
            libc::sigemptyset(&mut action.sa_mask);
            action.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// The signals received so far and the last one (0 when none).
pub fn received() -> (i32, i32) {
    (COUNT.load(Ordering::SeqCst), LAST.load(Ordering::SeqCst))
}
