//! [`Agent`]: what a rank process links to take part in the elastic world.
//!
//! The training thread cannot watch for failures itself: when a peer dies it is
//! blocked inside a collective that will never complete. So the agent runs its own
//! thread that heartbeats every `heartbeat_interval` (with the training thread's
//! progress marks, which are plain atomics and cost nothing on the hot path) and
//! watches for directives. On Restart, Stale or Shutdown for the current generation
//! it cancels the generation's [`Cancel`] and calls the abort hook (e.g. the
//! communicator's abort), which is what unblocks the training thread.
//!
//! Directives race with assignments (a member can fail right after a generation
//! forms, before the training thread has taken its new assignment): directives for a
//! generation newer than the current one are kept and applied when the training
//! thread installs that generation.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{error, info, warn};

use super::timeouts::DEFAULT_HEARTBEAT_INTERVAL;
use super::{Assignment, Cancel, ControlPlane, Directive, ElasticError, Progress, Report};

/// Directives for not-yet-installed generations kept at most.
const MAX_EARLY: usize = 16;

/// How the agent behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// Time between heartbeats (500 ms); keep it well below the coordinator's
    /// heartbeat timeout.
    pub heartbeat_interval: Duration,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
        }
    }
}

/// The member side of the control plane: one per rank process.
///
/// Dropping the agent stops its thread (waiting up to one heartbeat interval) and
/// releases the plane.
pub struct Agent {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// The abort hook.
type Hook = Arc<dyn Fn() + Send + Sync>;

struct Shared {
    plane: Arc<dyn ControlPlane>,
    config: AgentConfig,
    epoch: Instant,
    state: Mutex<State>,
    step: AtomicU64,
    /// Milliseconds after `epoch` of the last progress mark.
    last_mark_ms: AtomicU64,
    in_collective: AtomicBool,
    checkpoint_generation: AtomicU64,
    stop: Cancel,
}

struct State {
    assignment: Option<Assignment>,
    cancel: Cancel,
    hook: Option<Hook>,
    /// The hook was called for this generation.
    hook_called: bool,
    directive: Option<Directive>,
    regroup: bool,
    early: Vec<Directive>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn mark(&self) {
        self.last_mark_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    fn generation(&self) -> Option<u64> {
        self.lock().assignment.as_ref().map(|a| a.generation)
    }

    fn progress(&self) -> Progress {
        Progress {
            step: self.step.load(Ordering::Relaxed),
            in_collective: self.in_collective.load(Ordering::Relaxed),
            idle_ms: self
                .now_ms()
                .saturating_sub(self.last_mark_ms.load(Ordering::Relaxed)),
            checkpoint_generation: self.checkpoint_generation.load(Ordering::Relaxed),
        }
    }

    /// Applies a directive; returns the hook to call (outside the lock).
    fn apply(&self, state: &mut State, directive: Directive) -> Option<Hook> {
        let current = state.assignment.as_ref().map(|a| a.generation);
        let (applies, aborts) = match &directive {
            Directive::Restart { generation, .. } => (current == Some(*generation), true),
            Directive::Regroup { generation, .. } => (current == Some(*generation), false),
            Directive::Stale { current: newest } => (current.is_some_and(|g| g <= *newest), true),
            Directive::Shutdown { .. } => (true, true),
        };
        let for_later = match &directive {
            Directive::Restart { generation, .. } | Directive::Regroup { generation, .. } => {
                current.is_none_or(|g| *generation > g)
            }
            Directive::Stale { current: newest } => current.is_none_or(|g| *newest > g),
            Directive::Shutdown { .. } => false,
        };
        if for_later {
            if state.early.len() >= MAX_EARLY {
                state.early.remove(0);
            }
            state.early.push(directive.clone());
        }
        if !applies {
            return None;
        }
        info!(generation = ?current, ?directive, "directive");
        state.directive = Some(directive);
        if !aborts {
            state.regroup = true;
            return None;
        }
        state.cancel.cancel();
        if state.hook_called {
            return None;
        }
        state.hook_called = true;
        state.hook.clone()
    }

    fn run(&self) {
        let interval = self.config.heartbeat_interval.max(Duration::from_millis(1));
        let mut next_beat = Instant::now();
        let mut failing = false;
        while !self.stop.is_cancelled() {
            let now = Instant::now();
            let generation = self.generation().unwrap_or(0);
            if now >= next_beat {
                if let Err(e) = self.plane.heartbeat(generation, &self.progress()) {
                    if !failing {
                        warn!(error = %e, "heartbeat failed");
                    }
                    failing = true;
                } else {
                    failing = false;
                }
                next_beat = now + interval;
            }
            let wait = next_beat
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            match self.plane.watch(generation, wait) {
                Ok(Some(directive)) => {
                    let hook = self.apply(&mut self.lock(), directive);
                    if let Some(hook) = hook {
                        hook();
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    if !failing {
                        warn!(error = %e, "watching for directives failed");
                    }
                    failing = true;
                    self.stop.wait_timeout(wait);
                }
            }
        }
    }
}

impl Agent {
    /// Starts the agent thread (heartbeats + watch loop) over `plane`.
    pub fn new(plane: Arc<dyn ControlPlane>, config: AgentConfig) -> Agent {
        let shared = Arc::new(Shared {
            plane,
            config,
            epoch: Instant::now(),
            state: Mutex::new(State {
                assignment: None,
                cancel: Cancel::new(),
                hook: None,
                hook_called: false,
                directive: None,
                regroup: false,
                early: Vec::new(),
            }),
            step: AtomicU64::new(0),
            last_mark_ms: AtomicU64::new(0),
            in_collective: AtomicBool::new(false),
            checkpoint_generation: AtomicU64::new(0),
            stop: Cancel::new(),
        });
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("ckpt-elastic-agent".into())
                .spawn(move || shared.run())
        };
        let thread = match thread {
            Ok(thread) => Some(thread),
            Err(e) => {
                // Without heartbeats the coordinator drops this member: visible, safe.
                error!(error = %e, "cannot start the agent thread; no heartbeats will be sent");
                None
            }
        };
        Agent { shared, thread }
    }

    /// Training thread: blocks until a generation newer than the last one includes
    /// this member; installs a fresh Cancel for it and clears the abort hook and the
    /// regroup flag.
    pub fn rendezvous(&self) -> Result<Assignment, ElasticError> {
        let after = self.shared.generation().unwrap_or(0);
        let assignment = self.shared.plane.rendezvous(after, &self.shared.stop)?;
        self.shared.mark();
        self.shared.in_collective.store(false, Ordering::Relaxed);
        let mut state = self.shared.lock();
        state.assignment = Some(assignment.clone());
        state.cancel = Cancel::new();
        state.hook = None;
        state.hook_called = false;
        state.directive = None;
        state.regroup = false;
        for directive in std::mem::take(&mut state.early) {
            // No hook is set yet; a cancelled generation calls it once set.
            let _ = self.shared.apply(&mut state, directive);
        }
        Ok(assignment)
    }

    /// The current generation's Cancel: cancelled (once) when a Restart, Stale or
    /// Shutdown directive arrives for it; the agent thread then also calls the abort
    /// hook.
    pub fn cancel(&self) -> Cancel {
        self.shared.lock().cancel.clone()
    }

    /// Called from the agent thread at most once per generation, on
    /// Restart/Stale/Shutdown (e.g. `comm.abort()`). Replaces the previous hook. If
    /// the generation is already cancelled when set, it is called at once (on this
    /// thread).
    pub fn set_abort_hook(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let hook: Hook = Arc::from(hook);
        let call_now = {
            let mut state = self.shared.lock();
            state.hook = Some(hook.clone());
            let call_now = state.cancel.is_cancelled();
            if call_now {
                state.hook_called = true;
            }
            call_now
        };
        if call_now {
            hook();
        }
    }

    /// Last directive received for the current generation, if any.
    pub fn directive(&self) -> Option<Directive> {
        self.shared.lock().directive.clone()
    }

    /// True once a Regroup arrived for the current generation.
    pub fn regroup_requested(&self) -> bool {
        self.shared.lock().regroup
    }

    /// Training thread: step `step` made progress.
    pub fn progress(&self, step: u64) {
        self.shared.step.store(step, Ordering::Relaxed);
        self.shared.mark();
    }

    /// Training thread: entering a collective (waiting on peers is not being hung).
    pub fn collective_started(&self) {
        self.shared.mark();
        self.shared.in_collective.store(true, Ordering::Relaxed);
    }

    /// Training thread: the collective completed.
    pub fn collective_done(&self) {
        self.shared.in_collective.store(false, Ordering::Relaxed);
        self.shared.mark();
    }

    /// The checkpoint generation this member saves with (reported in heartbeats;
    /// the coordinator keeps later floors above it).
    pub fn set_checkpoint_generation(&self, g: u64) {
        self.shared
            .checkpoint_generation
            .fetch_max(g, Ordering::Relaxed);
    }

    /// Sends a report about the current generation.
    pub fn report(&self, report: Report) -> Result<(), ElasticError> {
        let generation = self.shared.generation().unwrap_or(0);
        self.shared.plane.report(generation, &report)
    }

    /// Sends a report about the current generation and waits up to `timeout` until
    /// the control plane has handled it ([`ControlPlane::report_handled`]).
    pub fn report_handled(&self, report: Report, timeout: Duration) -> Result<(), ElasticError> {
        let generation = self.shared.generation().unwrap_or(0);
        self.shared
            .plane
            .report_handled(generation, &report, timeout)
    }

    /// Sets a key in the current generation.
    pub fn kv_set(&self, key: &str, value: &str) -> Result<(), ElasticError> {
        let generation = self.current()?;
        self.shared.plane.kv_set(generation, key, value)
    }

    /// Gets a key of the current generation, waiting up to `timeout`; fails at once
    /// when the generation's Cancel fires.
    pub fn kv_get(&self, key: &str, timeout: Duration) -> Result<String, ElasticError> {
        let generation = self.current()?;
        let cancel = self.cancel();
        self.shared.plane.kv_get(generation, key, &cancel, timeout)
    }

    /// Records `record` as the job's newest committed in-memory snapshot, on behalf
    /// of the current generation ([`ControlPlane::commit_snapshot`]): refused once
    /// that generation is over, so a member left behind by a re-formation can never
    /// replace what the newer generation committed. Returns once the control plane
    /// stored it.
    pub fn commit_snapshot(&self, record: &str) -> Result<(), ElasticError> {
        let generation = self.current()?;
        self.shared.plane.commit_snapshot(generation, record)
    }

    /// The job's newest committed snapshot record, whichever generation committed
    /// it (`None`: none yet): what a generation formed after a failure restores
    /// from ([`ControlPlane::committed_snapshot`]).
    pub fn committed_snapshot(&self) -> Result<Option<String>, ElasticError> {
        self.shared.plane.committed_snapshot()
    }

    /// The current generation, if the member has one.
    pub fn generation(&self) -> Option<u64> {
        self.shared.generation()
    }

    /// The current assignment, if the member has one.
    pub fn assignment(&self) -> Option<Assignment> {
        self.shared.lock().assignment.clone()
    }

    fn current(&self) -> Result<u64, ElasticError> {
        self.shared.generation().ok_or_else(|| {
            ElasticError::Rejected("not in a generation yet: call rendezvous first".into())
        })
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shared.stop.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Condvar;
    use std::sync::atomic::AtomicUsize;

    /// A scripted control plane: directives and assignments pushed by the test.
    #[derive(Default)]
    struct Fake {
        state: Mutex<FakeState>,
        changed: Condvar,
    }

    #[derive(Default)]
    struct FakeState {
        directives: VecDeque<Directive>,
        assignment: Option<Assignment>,
        heartbeats: Vec<(u64, Progress)>,
        watch_calls: usize,
    }

    impl Fake {
        fn lock(&self) -> MutexGuard<'_, FakeState> {
            self.state.lock().unwrap()
        }

        fn push(&self, directive: Directive) {
            self.lock().directives.push_back(directive);
            self.changed.notify_all();
        }

        fn assign(&self, generation: u64) {
            self.lock().assignment = Some(Assignment {
                generation,
                rank: 0,
                ranks: 1,
                world_size: 1,
                members: 1,
                roster: 0,
                checkpoint_generation_floor: 0,
                cause: "test".into(),
            });
            self.changed.notify_all();
        }

        /// Waits (bounded) until the agent thread has taken and applied every
        /// directive: it watches again only after applying the last one.
        fn drained(&self) {
            let limit = Duration::from_secs(10);
            let state = self.lock();
            let (state, _) = self
                .changed
                .wait_timeout_while(state, limit, |s| !s.directives.is_empty())
                .unwrap();
            assert!(state.directives.is_empty(), "the agent did not watch");
            let calls = state.watch_calls;
            let (state, _) = self
                .changed
                .wait_timeout_while(state, limit, |s| s.watch_calls <= calls)
                .unwrap();
            assert!(state.watch_calls > calls, "the agent did not watch again");
        }
    }

    impl ControlPlane for Fake {
        fn rendezvous(&self, after: u64, _: &Cancel) -> Result<Assignment, ElasticError> {
            let state = self.lock();
            let (state, _) = self
                .changed
                .wait_timeout_while(state, Duration::from_secs(10), |s| {
                    s.assignment.as_ref().is_none_or(|a| a.generation <= after)
                })
                .unwrap();
            state
                .assignment
                .clone()
                .ok_or_else(|| ElasticError::Timeout("no assignment".into()))
        }

        fn heartbeat(&self, generation: u64, progress: &Progress) -> Result<(), ElasticError> {
            self.lock().heartbeats.push((generation, progress.clone()));
            self.changed.notify_all();
            Ok(())
        }

        fn watch(&self, _: u64, timeout: Duration) -> Result<Option<Directive>, ElasticError> {
            let mut state = self.lock();
            state.watch_calls += 1;
            self.changed.notify_all();
            let (mut state, _) = self
                .changed
                .wait_timeout_while(state, timeout, |s| s.directives.is_empty())
                .unwrap();
            let directive = state.directives.pop_front();
            self.changed.notify_all();
            Ok(directive)
        }

        fn report(&self, _: u64, _: &Report) -> Result<(), ElasticError> {
            Ok(())
        }

        fn kv_set(&self, _: u64, _: &str, _: &str) -> Result<(), ElasticError> {
            Ok(())
        }

        fn kv_get(&self, _: u64, _: &str, _: &Cancel, _: Duration) -> Result<String, ElasticError> {
            Err(ElasticError::Timeout("fake".into()))
        }

        fn commit_snapshot(&self, _: u64, _: &str) -> Result<(), ElasticError> {
            Ok(())
        }

        fn committed_snapshot(&self) -> Result<Option<String>, ElasticError> {
            Ok(None)
        }
    }

    fn agent(fake: &Arc<Fake>) -> Agent {
        let config = AgentConfig {
            heartbeat_interval: Duration::from_millis(20),
        };
        Agent::new(fake.clone(), config)
    }

    fn restart(generation: u64) -> Directive {
        Directive::Restart {
            generation,
            cause: "test".into(),
        }
    }

    fn counter(agent: &Agent) -> Arc<AtomicUsize> {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        agent.set_abort_hook(Box::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        }));
        calls
    }

    #[test]
    fn a_restart_that_overtakes_its_assignment_still_cancels_that_generation() {
        let fake = Arc::new(Fake::default());
        let agent = agent(&fake);
        fake.push(restart(1));
        fake.drained();
        fake.assign(1);
        agent.rendezvous().unwrap();
        assert!(agent.cancel().is_cancelled());
        assert_eq!(agent.directive(), Some(restart(1)));
        // The hook set afterwards runs at once.
        assert_eq!(counter(&agent).load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_abort_hook_runs_once_per_generation() {
        let fake = Arc::new(Fake::default());
        let agent = agent(&fake);
        fake.assign(1);
        agent.rendezvous().unwrap();
        let calls = counter(&agent);
        fake.push(restart(0));
        fake.push(Directive::Regroup {
            generation: 1,
            cause: "grow".into(),
        });
        fake.drained();
        assert!(agent.regroup_requested());
        assert!(
            !agent.cancel().is_cancelled(),
            "old restarts and regroups do not abort"
        );
        fake.push(restart(1));
        fake.push(Directive::Stale { current: 1 });
        fake.drained();
        assert!(agent.cancel().wait_timeout(Duration::from_secs(10)));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(agent.directive(), Some(Directive::Stale { current: 1 }));

        fake.assign(2);
        agent.rendezvous().unwrap();
        assert!(!agent.cancel().is_cancelled());
        assert!(!agent.regroup_requested());
        assert_eq!(agent.directive(), None);
        let calls = counter(&agent);
        fake.push(Directive::Stale { current: 1 });
        fake.drained();
        assert!(
            !agent.cancel().is_cancelled(),
            "stale about an older generation"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn heartbeats_carry_the_generation_and_the_training_threads_marks() {
        let fake = Arc::new(Fake::default());
        let agent = agent(&fake);
        fake.assign(3);
        agent.rendezvous().unwrap();
        agent.progress(17);
        agent.collective_started();
        agent.set_checkpoint_generation(5);
        agent.set_checkpoint_generation(4);
        let state = fake.lock();
        let (state, _) = fake
            .changed
            .wait_timeout_while(state, Duration::from_secs(10), |s| {
                !s.heartbeats
                    .iter()
                    .any(|(g, p)| *g == 3 && p.in_collective && p.step == 17)
            })
            .unwrap();
        let (_, progress) = state
            .heartbeats
            .iter()
            .rev()
            .find(|(g, p)| *g == 3 && p.in_collective)
            .expect("a heartbeat from inside the collective");
        assert_eq!(progress.checkpoint_generation, 5);
    }
}
