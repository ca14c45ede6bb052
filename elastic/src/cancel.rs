//! [`Cancel`]: a clonable, one-way cancellation token that both threads and async
//! tasks can wait on.
//!
//! The training thread blocks in places the control plane must be able to interrupt
//! (a rendezvous, a key-value lookup, a collective's bootstrap). Every clone shares one
//! flag; cancelling is idempotent and cannot be undone, so a waiter that checks the
//! flag after registering cannot miss the wake-up.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::ElasticError;

/// A callback run once when the token is cancelled (see [`Cancel::on_cancel`]).
pub(crate) type Waker = Box<dyn FnOnce() + Send>;

/// A cancellation token. Clones share the same state: cancelling one cancels all.
///
/// Blocking waits use [`Cancel::wait_timeout`]; async code awaits
/// [`Cancel::cancelled`] (usable in `tokio::select!`).
#[derive(Clone, Default)]
pub struct Cancel {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: Mutex<State>,
    condvar: Condvar,
    notify: Notify,
}

#[derive(Default)]
struct State {
    cancelled: bool,
    next_waker: u64,
    wakers: BTreeMap<u64, Waker>,
}

/// Waits on `state` (whose changes `changed` signals) until `done` gives a result,
/// `cancel` fires, or `deadline` passes (then `on_timeout`). `done` also sees the time:
/// the wait wakes at least every `recheck` for conditions that depend on it. `wake`
/// runs on the cancelling thread: it must lock `state` and notify `changed`, so that a
/// cancellation ends the wait without polling.
pub(crate) fn wait_on<S, T>(
    state: &Mutex<S>,
    changed: &Condvar,
    cancel: Option<(&Cancel, Waker)>,
    deadline: Option<Instant>,
    recheck: Duration,
    mut done: impl FnMut(&mut S, Instant) -> Option<Result<T, ElasticError>>,
    on_timeout: impl FnOnce() -> Result<T, ElasticError>,
) -> Result<T, ElasticError> {
    let token = cancel.as_ref().map(|(token, _)| *token);
    let _guard = cancel.map(|(token, wake)| token.on_cancel(wake));
    let mut guard = state.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        if token.is_some_and(Cancel::is_cancelled) {
            return Err(ElasticError::Cancelled);
        }
        let now = Instant::now();
        if let Some(result) = done(&mut guard, now) {
            return result;
        }
        let mut pause = recheck;
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                return on_timeout();
            }
            pause = pause.min(left);
        }
        guard = changed
            .wait_timeout(guard, pause)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

impl std::fmt::Debug for Cancel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cancel")
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}

impl Cancel {
    /// A token that is not cancelled.
    pub fn new() -> Cancel {
        Cancel::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a flag and a map: a panic elsewhere cannot leave it torn.
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Cancels the token: every waiter wakes, every later check sees it. Idempotent.
    pub fn cancel(&self) {
        let wakers = {
            let mut state = self.lock();
            if state.cancelled {
                return;
            }
            state.cancelled = true;
            std::mem::take(&mut state.wakers)
        };
        self.inner.condvar.notify_all();
        self.inner.notify.notify_waiters();
        for waker in wakers.into_values() {
            waker();
        }
    }

    /// True once [`Cancel::cancel`] was called on this token or a clone.
    pub fn is_cancelled(&self) -> bool {
        self.lock().cancelled
    }

    /// Completes once the token is cancelled (at once if it already is).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future loses nothing: the flag stays set and a new call sees it.
    pub async fn cancelled(&self) {
        loop {
            let mut notified = std::pin::pin!(self.inner.notify.notified());
            // Register before checking, so a cancel between the check and the await
            // still wakes this future.
            notified.as_mut().enable();
            if self.is_cancelled() {
                return;
            }
            notified.await;
        }
    }

    /// Blocks until the token is cancelled or `timeout` passes; true when cancelled.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.lock();
        while !state.cancelled {
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                return false;
            }
            state = self
                .inner
                .condvar
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// Runs `waker` once when the token is cancelled (at once, on this thread, if it
    /// already is) unless the returned guard is dropped first. Lets a wait on some
    /// other condition variable also wake on cancellation, without polling.
    pub(crate) fn on_cancel(&self, waker: impl FnOnce() + Send + 'static) -> CancelGuard {
        let mut state = self.lock();
        if state.cancelled {
            drop(state);
            waker();
            return CancelGuard {
                cancel: None,
                id: 0,
            };
        }
        let id = state.next_waker;
        state.next_waker += 1;
        state.wakers.insert(id, Box::new(waker));
        CancelGuard {
            cancel: Some(self.clone()),
            id,
        }
    }
}

/// Unregisters a waker of [`Cancel::on_cancel`] when dropped, so that waits that end
/// for other reasons do not pile wakers up on a long-lived token.
pub(crate) struct CancelGuard {
    cancel: Option<Cancel>,
    id: u64,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if let Some(cancel) = &self.cancel {
            cancel.lock().wakers.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn cancel_wakes_a_blocked_waiter_in_another_thread() {
        let cancel = Cancel::new();
        let waiter = {
            let cancel = cancel.clone();
            std::thread::spawn(move || cancel.wait_timeout(Duration::from_secs(30)))
        };
        cancel.cancel();
        assert!(waiter.join().unwrap());
        assert!(cancel.is_cancelled());
    }

    #[test]
    fn wait_timeout_returns_false_when_nobody_cancels() {
        let cancel = Cancel::new();
        let started = Instant::now();
        assert!(!cancel.wait_timeout(Duration::from_millis(30)));
        assert!(started.elapsed() >= Duration::from_millis(30));
        assert!(!cancel.is_cancelled());
    }

    #[test]
    fn cancelled_future_completes_in_select() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let cancel = Cancel::new();
        let other = cancel.clone();
        let finished = runtime.block_on(async move {
            let waiting = tokio::spawn(async move { other.cancelled().await });
            tokio::task::yield_now().await;
            cancel.cancel();
            waiting.await.is_ok()
        });
        assert!(finished);
    }

    #[test]
    fn wakers_run_once_and_dropped_guards_unregister() {
        let cancel = Cancel::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = |runs: &Arc<AtomicUsize>| {
            let runs = runs.clone();
            move || {
                runs.fetch_add(1, Ordering::SeqCst);
            }
        };
        let kept = cancel.on_cancel(counted(&runs));
        drop(cancel.on_cancel(counted(&runs)));
        assert_eq!(cancel.lock().wakers.len(), 1);
        cancel.cancel();
        cancel.cancel();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        drop(kept);
        let _late = cancel.on_cancel(counted(&runs));
        assert_eq!(runs.load(Ordering::SeqCst), 2, "a late waker runs at once");
    }
}
