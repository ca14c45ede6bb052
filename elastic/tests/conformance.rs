//! One set of behavioural checks over the [`ControlPlane`] trait, run on every
//! backend: the built-in coordinator over TCP, and etcd (with the `etcd` feature,
//! against the 3-member cluster `scripts/test` starts). The etcd checks follow the
//! tests' one skip policy (`ckpt_testkit::has`): without etcd they say `SKIPPED`
//! under a plain `cargo test`, and fail under `scripts/test`, which requires it.
//!
//! The agent and the trainer do not know which backend they use, so whatever one
//! backend guarantees through the trait, the other must too. Each check is written
//! once, generically over [`Backend`] (how to start a job, connect a member, and see
//! the job's events as its launcher does), and [`every_check!`] makes one test per
//! check and backend. The backends' own tests (`coordinator.rs`, `etcd.rs`) keep
//! what only one of them has: a restarted coordinator, hostile input on the wire,
//! garbage in etcd's keys, etcd's request rate.
//!
//! Members here are bare planes with a heartbeat thread of their own (one that a
//! check can stop, which an `Agent` cannot), so that every call the checks make
//! goes through the trait.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod common;

use ckpt_elastic::{
    Assignment, Cancel, ControlPlane, CoordinatorConfig, Directive, ElasticError, Event, JobOver,
    Progress, Report, Timeouts, roster_digest,
};
use common::{assert_one_generation, member, unique_job};

/// Bound on waits for something that must happen.
const PATIENCE: Duration = Duration::from_secs(20);

/// The suite's windows: short, and a heartbeat timeout of 2 s, etcd's shortest lease.
fn timeouts() -> Timeouts {
    Timeouts {
        last_call: Duration::from_millis(200),
        heartbeat_timeout: Duration::from_secs(2),
        progress_timeout: Duration::from_secs(30),
        join_timeout: Duration::from_secs(2),
        rendezvous_timeout: Duration::from_secs(30),
    }
}

/// A control-plane backend as a launcher sees it.
trait Backend: Sized {
    /// Whether the backend can run here (else the test returns, loudly, or fails
    /// where `CKPT_REQUIRE` asks for it).
    fn available() -> bool {
        true
    }
    /// Starts (or publishes the settings of) a new job named after `name`.
    fn start(name: &str, min_ranks: usize, max_ranks: usize, timeouts: Timeouts) -> Self;
    /// Member `i`'s plane (`m{i}` on node `n{i / 2}`), connected.
    fn connect(&self, i: usize) -> Arc<dyn ControlPlane>;
    /// Waits for an event of the job, as the launcher sees it.
    fn wait_for_event(&self, predicate: impl FnMut(&Event) -> bool) -> Option<Event>;
    /// Why the job is over, once the launcher knows it is.
    fn job_over(&self) -> Option<JobOver>;

    /// Starts a job of `min_ranks..=max_ranks` with the suite's windows, and `n`
    /// ranks (`m0`…) that form its first generation together: the job (keep it: the
    /// built-in coordinator stops when dropped), the ranks, the generation's number.
    fn first_generation(
        name: &str,
        min_ranks: usize,
        max_ranks: usize,
        n: usize,
    ) -> (Self, Vec<Rank>, u64) {
        let backend = Self::start(name, min_ranks, max_ranks, timeouts());
        let ranks = ranks(&backend, 0..n);
        let ids: Vec<String> = (0..n).map(|i| format!("m{i}")).collect();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let assignments = rendezvous_all(&ranks.iter().collect::<Vec<_>>(), 0);
        let generation = assert_one_generation(&assignments, &ids);
        (backend, ranks, generation)
    }
}

/// The built-in coordinator, in process, and members over TCP.
struct Tcp {
    coordinator: ckpt_elastic::CoordinatorHandle,
    job: String,
}

impl Backend for Tcp {
    fn start(name: &str, min_ranks: usize, max_ranks: usize, timeouts: Timeouts) -> Self {
        let job = unique_job(&format!("conformance-{name}"));
        let config = CoordinatorConfig {
            job: job.clone(),
            min_ranks,
            max_ranks,
            timeouts,
            // A new job: nothing to adopt.
            settle: Duration::ZERO,
            max_connections: CoordinatorConfig::DEFAULT_MAX_CONNECTIONS,
        };
        let coordinator = ckpt_elastic::Coordinator::bind("127.0.0.1:0".parse().unwrap(), config)
            .expect("bind a coordinator")
            .spawn();
        Tcp { coordinator, job }
    }

    fn connect(&self, i: usize) -> Arc<dyn ControlPlane> {
        let settings = ckpt_elastic::TcpSettings {
            connect_timeout: Duration::from_secs(5),
            ..ckpt_elastic::TcpSettings::default()
        };
        let addr = self.coordinator.local_addr();
        let plane = ckpt_elastic::TcpControlPlane::connect(addr, member(&self.job, i), settings);
        Arc::new(plane.expect("connect to the coordinator"))
    }

    fn wait_for_event(&self, predicate: impl FnMut(&Event) -> bool) -> Option<Event> {
        self.coordinator.wait_for_event(PATIENCE, predicate)
    }

    fn job_over(&self) -> Option<JobOver> {
        self.coordinator.job_over()
    }
}

/// etcd: a launcher's handle that publishes the job's settings, and members that
/// register under leases of their own.
#[cfg(feature = "etcd")]
struct Etcd {
    launcher: ckpt_elastic::EtcdJob,
    url: ckpt_elastic::EtcdUrl,
    job: String,
}

#[cfg(feature = "etcd")]
impl Backend for Etcd {
    fn available() -> bool {
        ckpt_testkit::has(ckpt_testkit::Capability::Etcd)
    }

    fn start(name: &str, min_ranks: usize, max_ranks: usize, timeouts: Timeouts) -> Self {
        let url = ckpt_elastic::EtcdUrl::parse(&ckpt_testkit::env("CKPT_TEST_ETCD")).unwrap();
        let job = unique_job(&format!("conformance-{name}"));
        let mut config = CoordinatorConfig::new(job.clone(), min_ranks, max_ranks);
        config.timeouts = timeouts;
        let settings = ckpt_elastic::EtcdSettings::default();
        let launcher = ckpt_elastic::EtcdJob::connect(&url, &config, settings).unwrap();
        Etcd { launcher, url, job }
    }

    fn connect(&self, i: usize) -> Arc<dyn ControlPlane> {
        let member = member(&self.job, i);
        let settings = ckpt_elastic::EtcdSettings::default();
        let plane = ckpt_elastic::EtcdControlPlane::connect(&self.url, member, None, settings);
        Arc::new(plane.expect("join the job in etcd"))
    }

    fn wait_for_event(&self, predicate: impl FnMut(&Event) -> bool) -> Option<Event> {
        self.launcher.wait_for_event(PATIENCE, predicate)
    }

    fn job_over(&self) -> Option<JobOver> {
        self.launcher.job_over()
    }
}

/// A member process: its plane, and a thread that heartbeats for the generation it
/// is in until stopped (as SIGSTOP would) or dropped (as its exit would: dropping
/// the last reference to the plane closes its connection, or revokes its lease).
struct Rank {
    plane: Arc<dyn ControlPlane>,
    generation: Arc<AtomicU64>,
    beating: Arc<AtomicBool>,
    heart: Option<JoinHandle<()>>,
}

impl Rank {
    fn new(plane: Arc<dyn ControlPlane>) -> Rank {
        let generation = Arc::new(AtomicU64::new(0));
        let beating = Arc::new(AtomicBool::new(true));
        let heart = {
            let (plane, generation, beating) = (plane.clone(), generation.clone(), beating.clone());
            std::thread::spawn(move || {
                while beating.load(Ordering::SeqCst) {
                    let _ =
                        plane.heartbeat(generation.load(Ordering::SeqCst), &Progress::default());
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        Rank {
            plane,
            generation,
            beating,
            heart: Some(heart),
        }
    }

    /// Stops heartbeating (the process is stopped or cut off).
    fn stop(&mut self) {
        self.beating.store(false, Ordering::SeqCst);
        if let Some(heart) = self.heart.take() {
            let _ = heart.join();
        }
    }

    fn rendezvous(&self, after: u64) -> Result<Assignment, ElasticError> {
        let assignment = self.plane.rendezvous(after, &Cancel::new())?;
        self.generation
            .store(assignment.generation, Ordering::SeqCst);
        Ok(assignment)
    }

    /// The next directive for `generation`, waiting up to [`PATIENCE`].
    fn directive(&self, generation: u64) -> Directive {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no directive for generation {generation}");
            if let Some(d) = self
                .plane
                .watch(generation, left.min(Duration::from_secs(1)))
                .unwrap()
            {
                return d;
            }
        }
    }

    /// Asserts that no directive for `generation` comes within `window`.
    fn no_directive(&self, generation: u64, window: Duration) {
        let d = self.plane.watch(generation, window).unwrap();
        assert_eq!(d, None, "no directive expected for generation {generation}");
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.stop();
    }
}

fn ranks<B: Backend>(backend: &B, ids: std::ops::Range<usize>) -> Vec<Rank> {
    ids.map(|i| Rank::new(backend.connect(i))).collect()
}

/// Every rank of `ranks` asks at once for the generation after `after`.
fn rendezvous_all(ranks: &[&Rank], after: u64) -> Vec<Assignment> {
    std::thread::scope(|scope| {
        let asks: Vec<_> = ranks
            .iter()
            .map(|rank| scope.spawn(move || rank.rendezvous(after).expect("rendezvous")))
            .collect();
        asks.into_iter().map(|a| a.join().unwrap()).collect()
    })
}

fn restart_cause(directive: Directive, generation: u64) -> String {
    match directive {
        Directive::Restart {
            generation: g,
            cause,
        } if g == generation => cause,
        other => panic!("expected Restart for generation {generation}, got {other:?}"),
    }
}

fn rendezvous_into_one_generation_with_contiguous_ranks<B: Backend>() {
    let backend = B::start("one", 4, 4, timeouts());
    let ranks = ranks(&backend, 0..4);
    let assignments = rendezvous_all(&ranks.iter().collect::<Vec<_>>(), 0);
    assert_one_generation(&assignments, &["m0", "m1", "m2", "m3"]);
    for (i, a) in assignments.iter().enumerate() {
        assert_eq!(a.rank, i, "m{i} holds rank {i}: nodes n0, n0, n1, n1");
        assert_eq!(a.cause, "initial");
    }
}

fn a_lost_member_restarts_the_others_into_a_smaller_world<B: Backend>() {
    let (_job, mut ranks, g1) = B::first_generation("lost", 2, 3, 3);
    // m2's process exits.
    drop(ranks.pop());
    for rank in &ranks {
        let cause = restart_cause(rank.directive(g1), g1);
        assert!(cause.contains("lost member m2"), "{cause}");
    }
    let next = rendezvous_all(&ranks.iter().collect::<Vec<_>>(), g1);
    let g2 = assert_one_generation(&next, &["m0", "m1"]);
    assert!(g2 > g1);
    assert!(next[0].cause.contains("m2"), "{}", next[0].cause);
}

fn keys_reach_every_member_and_stay_in_their_generation<B: Backend>() {
    let (_job, ranks, g1) = B::first_generation("keys", 3, 3, 3);
    for (i, rank) in ranks.iter().enumerate() {
        rank.plane
            .kv_set(g1, &format!("ring/{i}"), &format!("10.0.0.{i}:29500"))
            .unwrap();
    }
    for rank in &ranks {
        for i in 0..3 {
            let value = rank
                .plane
                .kv_get(g1, &format!("ring/{i}"), &Cancel::new(), PATIENCE)
                .unwrap();
            assert_eq!(value, format!("10.0.0.{i}:29500"));
        }
    }
    let missing = ranks[0].plane.kv_get(
        g1,
        "nobody-sets-this",
        &Cancel::new(),
        Duration::from_millis(300),
    );
    assert!(
        matches!(missing, Err(ElasticError::Timeout(_))),
        "{missing:?}"
    );
    // The next generation starts with no keys, and the old one's are over.
    ranks[0]
        .plane
        .report(
            g1,
            &Report::CollectiveFailed {
                peer: None,
                reason: "test".into(),
            },
        )
        .unwrap();
    for rank in &ranks {
        restart_cause(rank.directive(g1), g1);
    }
    let g2 = assert_one_generation(
        &rendezvous_all(&ranks.iter().collect::<Vec<_>>(), g1),
        &["m0", "m1", "m2"],
    );
    let fresh = ranks[1]
        .plane
        .kv_get(g2, "ring/0", &Cancel::new(), Duration::from_millis(300));
    assert!(matches!(fresh, Err(ElasticError::Timeout(_))), "{fresh:?}");
    let over = ranks[1]
        .plane
        .kv_get(g1, "nobody-sets-this", &Cancel::new(), PATIENCE);
    assert!(matches!(over, Err(ElasticError::Rejected(_))), "{over:?}");
}

fn a_silent_member_is_dropped_and_refused_as_stale<B: Backend>() {
    let (_job, mut ranks, g1) = B::first_generation("stale", 2, 3, 3);
    // m2 stops (SIGSTOP, a partition): no more heartbeats.
    ranks[2].stop();
    for rank in &ranks[..2] {
        let cause = restart_cause(rank.directive(g1), g1);
        assert!(cause.contains("m2"), "{cause}");
    }
    let g2 = assert_one_generation(&rendezvous_all(&[&ranks[0], &ranks[1]], g1), &["m0", "m1"]);
    // It wakes up and looks at its generation: it is stale, and the generation's
    // keys are refused to it.
    match ranks[2].directive(g1) {
        Directive::Stale { current } => assert!(current >= g1, "{current}"),
        other => panic!("expected Stale, got {other:?}"),
    }
    let over = ranks[2]
        .plane
        .kv_get(g1, "ring/0", &Cancel::new(), PATIENCE);
    assert!(matches!(over, Err(ElasticError::Rejected(_))), "{over:?}");
    assert!(g2 > g1);
}

fn a_collective_failure_restarts_everyone_and_drops_nobody<B: Backend>() {
    let (_job, ranks, g1) = B::first_generation("collective", 2, 2, 2);
    let report = Report::CollectiveFailed {
        peer: Some(1),
        reason: "connection reset".into(),
    };
    ranks[0].plane.report(g1, &report).unwrap();
    for rank in &ranks {
        let cause = restart_cause(rank.directive(g1), g1);
        assert!(cause.contains("collective failed with rank 1"), "{cause}");
    }
    let g2 = assert_one_generation(
        &rendezvous_all(&ranks.iter().collect::<Vec<_>>(), g1),
        &["m0", "m1"],
    );
    assert!(g2 > g1);
}

fn a_fatal_report_drops_the_reporting_member<B: Backend>() {
    let (_job, ranks, g1) = B::first_generation("fatal", 1, 3, 3);
    let report = Report::Fatal {
        reason: "device lost".into(),
    };
    ranks[2].plane.report(g1, &report).unwrap();
    for rank in &ranks[..2] {
        let cause = restart_cause(rank.directive(g1), g1);
        assert!(
            cause.contains("m2") && cause.contains("device lost"),
            "{cause}"
        );
    }
    // The next generation does not wait for the member that failed (it is still
    // connected, and does not ask).
    let started = Instant::now();
    let g2 = assert_one_generation(&rendezvous_all(&[&ranks[0], &ranks[1]], g1), &["m0", "m1"]);
    assert!(g2 > g1);
    assert!(
        started.elapsed() < timeouts().join_timeout,
        "{:?}",
        started.elapsed()
    );
}

fn a_member_that_leaves_on_purpose_aborts_nobody<B: Backend>() {
    let (backend, ranks, g1) = B::first_generation("leave", 1, 3, 3);
    let report = Report::Leaving {
        reason: "preempted".into(),
    };
    ranks[1].plane.report(g1, &report).unwrap();
    let left = backend.wait_for_event(|e| {
        matches!(e, Event::Left { generation, member, .. } if *generation == g1 && member == "m1")
    });
    assert!(
        matches!(&left, Some(Event::Left { cause, .. }) if cause.contains("preempted")),
        "{left:?}"
    );
    for rank in [&ranks[0], &ranks[2]] {
        rank.no_directive(g1, Duration::from_millis(500));
    }
    // The others come to the rendezvous by themselves, at the boundary they agreed
    // on, and go on without it.
    let next = rendezvous_all(&[&ranks[0], &ranks[2]], g1);
    let g2 = assert_one_generation(&next, &["m0", "m2"]);
    assert!(g2 > g1);
    assert!(
        next[0].cause.contains("m1") && next[0].cause.contains("preempted"),
        "{}",
        next[0].cause
    );
}

fn a_waiting_member_joins_when_the_world_regroups_after_a_commit<B: Backend>() {
    let backend = B::start("grow", 2, 3, timeouts());
    let ranks = ranks(&backend, 0..3);
    let g1 = assert_one_generation(&rendezvous_all(&[&ranks[0], &ranks[1]], 0), &["m0", "m1"]);
    std::thread::scope(|scope| {
        let newcomer = scope.spawn(|| ranks[2].rendezvous(0));
        // Without a commit nobody regroups (the newcomer may still be on its way).
        ranks[0].no_directive(g1, Duration::from_millis(500));
        let mut regrouped = false;
        let deadline = Instant::now() + PATIENCE;
        while !regrouped {
            assert!(Instant::now() < deadline, "no regroup after commits");
            ranks[0]
                .plane
                .report(g1, &Report::Committed { step: 40 })
                .unwrap();
            regrouped = ranks[0]
                .plane
                .watch(g1, Duration::from_millis(200))
                .unwrap()
                .is_some();
        }
        match ranks[1].directive(g1) {
            Directive::Regroup { generation, cause } => {
                assert_eq!(generation, g1);
                assert!(cause.contains("grow: 1 waiting member"), "{cause}");
            }
            other => panic!("expected Regroup, got {other:?}"),
        }
        let mut next = rendezvous_all(&[&ranks[0], &ranks[1]], g1);
        next.push(newcomer.join().unwrap().expect("the newcomer joins"));
        let g2 = assert_one_generation(&next, &["m0", "m1", "m2"]);
        assert!(g2 > g1);
        assert!(next[0].cause.contains("grow"), "{}", next[0].cause);
    });
}

fn a_member_holding_two_ranks_gets_a_block_and_grows_at_the_next_commit<B: Backend>() {
    // 3 to 4 ranks: a node's member holding 2 ranks (m0, node n0) and a rank of its
    // own (m2, node n1) make the smallest world.
    let backend = B::start("hold", 3, 4, timeouts());
    let node = backend.connect(0);
    node.hold(2).expect("hold 2 ranks");
    let ranks = [Rank::new(node), Rank::new(backend.connect(2))];
    let first = rendezvous_all(&[&ranks[0], &ranks[1]], 0);
    let g1 = first[0].generation;
    let blocks: Vec<(usize, usize)> = first.iter().map(|a| (a.rank, a.ranks)).collect();
    assert_eq!(blocks, [(0, 2), (2, 1)], "n0's block of 2 comes first");
    for a in &first {
        assert_eq!((a.generation, a.world_size, a.members), (g1, 3, 2));
        assert_eq!(a.roster, roster_digest([("m0", 2), ("m2", 1)]));
    }
    // The node's third rank starts: the running member now holds more ranks than
    // its place, which counts as a member waiting, so the world grows at the next
    // commit (and not before).
    ranks[0].plane.hold(3).expect("hold 3 ranks");
    ranks[1].no_directive(g1, Duration::from_millis(500));
    let deadline = Instant::now() + PATIENCE;
    loop {
        assert!(Instant::now() < deadline, "no regroup after commits");
        ranks[0]
            .plane
            .report(g1, &Report::Committed { step: 40 })
            .unwrap();
        if ranks[0]
            .plane
            .watch(g1, Duration::from_millis(200))
            .unwrap()
            .is_some()
        {
            break;
        }
    }
    match ranks[1].directive(g1) {
        Directive::Regroup { generation, cause } => {
            assert_eq!(generation, g1);
            assert!(cause.contains("grow: 1 waiting member"), "{cause}");
        }
        other => panic!("expected Regroup, got {other:?}"),
    }
    let next = rendezvous_all(&[&ranks[0], &ranks[1]], g1);
    let blocks: Vec<(usize, usize)> = next.iter().map(|a| (a.rank, a.ranks)).collect();
    assert_eq!(blocks, [(0, 3), (3, 1)], "n0 now holds 3 ranks");
    assert!(next[0].generation > g1);
    assert_eq!((next[0].world_size, next[1].world_size), (4, 4));
    assert_eq!(next[0].roster, roster_digest([("m0", 3), ("m2", 1)]));
    assert!(next[0].cause.contains("grow"), "{}", next[0].cause);
}

fn too_few_members_for_the_rendezvous_timeout_shut_the_job_down<B: Backend>() {
    let short = Timeouts {
        join_timeout: Duration::from_millis(500),
        rendezvous_timeout: Duration::from_secs(3),
        ..timeouts()
    };
    let backend = B::start("shutdown", 2, 2, short);
    let mut ranks = ranks(&backend, 0..2);
    let g1 = assert_one_generation(
        &rendezvous_all(&ranks.iter().collect::<Vec<_>>(), 0),
        &["m0", "m1"],
    );
    drop(ranks.pop());
    restart_cause(ranks[0].directive(g1), g1);
    let result = ranks[0].rendezvous(g1);
    assert!(
        matches!(&result, Err(ElasticError::Shutdown(reason)) if reason.contains("at least 2")),
        "{result:?}"
    );
    assert!(
        backend
            .wait_for_event(|e| matches!(e, Event::Shutdown { .. }))
            .is_some()
    );
    assert!(matches!(backend.job_over(), Some(JobOver::ShutDown(_))));
    // A member arriving afterwards is told at once.
    let late = Rank::new(backend.connect(5));
    let result = late.rendezvous(0);
    assert!(
        matches!(result, Err(ElasticError::Shutdown(_))),
        "{result:?}"
    );
}

fn a_finished_job_sends_waiting_members_away<B: Backend>() {
    let backend = B::start("finished", 2, 2, timeouts());
    let ranks = ranks(&backend, 0..3);
    let g1 = assert_one_generation(&rendezvous_all(&[&ranks[0], &ranks[1]], 0), &["m0", "m1"]);
    std::thread::scope(|scope| {
        let waiting = scope.spawn(|| ranks[2].rendezvous(0));
        ranks[0]
            .plane
            .report(g1, &Report::Finished { step: 60 })
            .unwrap();
        let result = waiting.join().unwrap();
        assert!(
            matches!(&result, Err(ElasticError::Shutdown(reason)) if reason.contains("finished")),
            "{result:?}"
        );
    });
    // The running generation is not interrupted.
    ranks[1].no_directive(g1, Duration::from_millis(300));
    // The launcher learns it on its own watch (etcd), which has no event for it.
    let deadline = Instant::now() + PATIENCE;
    let over = loop {
        match backend.job_over() {
            Some(over) => break over,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            None => panic!("the launcher never learnt that the job finished"),
        }
    };
    assert!(over.finished(), "{over}");
}

fn a_committed_snapshot_outlives_its_generation_and_a_stale_one_cannot_replace_it<B: Backend>() {
    let (_job, ranks, g1) = B::first_generation("snapshot", 2, 2, 2);
    assert_eq!(ranks[0].plane.committed_snapshot().unwrap(), None);
    ranks[0].plane.commit_snapshot(g1, "step 10").unwrap();
    assert_eq!(
        ranks[1].plane.committed_snapshot().unwrap().as_deref(),
        Some("step 10")
    );
    // A failure re-forms the world; the record is still there.
    ranks[0]
        .plane
        .report(
            g1,
            &Report::CollectiveFailed {
                peer: None,
                reason: "test".into(),
            },
        )
        .unwrap();
    for rank in &ranks {
        restart_cause(rank.directive(g1), g1);
    }
    let g2 = assert_one_generation(
        &rendezvous_all(&ranks.iter().collect::<Vec<_>>(), g1),
        &["m0", "m1"],
    );
    assert_eq!(
        ranks[1].plane.committed_snapshot().unwrap().as_deref(),
        Some("step 10")
    );
    // A member still speaking for the old generation is refused by name.
    let stale = ranks[1].plane.commit_snapshot(g1, "step 11 (stale)");
    assert!(
        matches!(&stale, Err(ElasticError::Rejected(why)) if why.starts_with(&format!("generation {g1} is not running"))),
        "{stale:?}"
    );
    let big = "x".repeat(ckpt_elastic::MAX_SNAPSHOT_RECORD + 1);
    let oversize = ranks[0].plane.commit_snapshot(g2, &big);
    assert!(
        matches!(&oversize, Err(ElasticError::Rejected(why)) if why.contains("bound")),
        "{oversize:?}"
    );
    assert_eq!(
        ranks[0].plane.committed_snapshot().unwrap().as_deref(),
        Some("step 10")
    );
    // The running generation replaces it.
    ranks[1].plane.commit_snapshot(g2, "step 20").unwrap();
    assert_eq!(
        ranks[0].plane.committed_snapshot().unwrap().as_deref(),
        Some("step 20")
    );
}

/// One test per check for `$backend`, named after the check, in the module where it
/// is invoked.
macro_rules! checks {
    ($backend:ident: $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                use super::Backend as _;
                if super::$backend::available() {
                    super::$check::<super::$backend>();
                }
            }
        )*
    };
}

/// Every check of the suite, for `$backend`.
macro_rules! every_check {
    ($backend:ident) => {
        checks!($backend:
            rendezvous_into_one_generation_with_contiguous_ranks,
            a_lost_member_restarts_the_others_into_a_smaller_world,
            keys_reach_every_member_and_stay_in_their_generation,
            a_silent_member_is_dropped_and_refused_as_stale,
            a_collective_failure_restarts_everyone_and_drops_nobody,
            a_fatal_report_drops_the_reporting_member,
            a_member_that_leaves_on_purpose_aborts_nobody,
            a_waiting_member_joins_when_the_world_regroups_after_a_commit,
            a_member_holding_two_ranks_gets_a_block_and_grows_at_the_next_commit,
            too_few_members_for_the_rendezvous_timeout_shut_the_job_down,
            a_finished_job_sends_waiting_members_away,
            a_committed_snapshot_outlives_its_generation_and_a_stale_one_cannot_replace_it,
        );
    };
}

mod tcp {
    every_check!(Tcp);
}

#[cfg(feature = "etcd")]
mod etcd {
    every_check!(Etcd);
}
