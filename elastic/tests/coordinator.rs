//! The elastic control plane over real TCP: a coordinator (in process, or the real
//! `ckpt coordinator` binary where it must die and come back) and members made of
//! [`TcpControlPlane`]s and [`Agent`]s, with timeouts of about a second.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

mod common;

use ckpt_elastic::protocol::{self, ClientMessage, MAX_LINE, ServerMessage};
use ckpt_elastic::{
    Agent, AgentConfig, Assignment, Cancel, ControlPlane, Coordinator, CoordinatorConfig,
    CoordinatorHandle, Directive, ElasticError, Event, Member, Progress, Report, TcpControlPlane,
    TcpSettings, Timeouts,
};
use common::{assert_one_generation, rendezvous_all, settings};

const JOB: &str = "elastic-test";
/// Bound on waits for something that must happen.
const PATIENCE: Duration = Duration::from_secs(10);

fn config(min_ranks: usize, max_ranks: usize) -> CoordinatorConfig {
    CoordinatorConfig {
        job: JOB.into(),
        min_ranks,
        max_ranks,
        timeouts: Timeouts {
            last_call: Duration::from_millis(200),
            heartbeat_timeout: Duration::from_secs(1),
            progress_timeout: Duration::from_secs(30),
            join_timeout: Duration::from_secs(2),
            rendezvous_timeout: Duration::from_secs(30),
        },
        settle: Duration::from_secs(1),
        max_connections: CoordinatorConfig::DEFAULT_MAX_CONNECTIONS,
    }
}

fn start(config: CoordinatorConfig) -> CoordinatorHandle {
    Coordinator::bind("127.0.0.1:0".parse().unwrap(), config)
        .expect("bind a coordinator")
        .spawn()
}

/// Member `i` of this file's job.
fn member(i: usize) -> Member {
    common::member(JOB, i)
}

fn plane(addr: SocketAddr, i: usize) -> Arc<TcpControlPlane> {
    Arc::new(TcpControlPlane::connect(addr, member(i), settings()).expect("connect"))
}

fn agent_on(plane: Arc<TcpControlPlane>) -> Agent {
    let config = AgentConfig {
        heartbeat_interval: Duration::from_millis(100),
    };
    Agent::new(plane, config)
}

fn agents(addr: SocketAddr, ids: std::ops::Range<usize>) -> Vec<Agent> {
    ids.map(|i| agent_on(plane(addr, i))).collect()
}

/// A coordinator of one to three ranks, and members m0, m1, m2 in its first
/// generation (returned).
fn three_in_one_generation() -> (CoordinatorHandle, Vec<Agent>, u64) {
    let coordinator = start(config(1, 3));
    let agents = agents(coordinator.local_addr(), 0..3);
    let generation = assert_one_generation(
        &rendezvous_all(&agents.iter().collect::<Vec<_>>()),
        &["m0", "m1", "m2"],
    );
    (coordinator, agents, generation)
}

/// A rendezvous on its own thread, cancellable.
fn spawn_rendezvous(
    plane: Arc<TcpControlPlane>,
    after: u64,
    cancel: Cancel,
) -> Receiver<Result<Assignment, ElasticError>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(plane.rendezvous(after, &cancel));
    });
    rx
}

/// Members `m0`.. of nodes `n0, n0, n1, n1, ..` hold ranks in the order of their
/// numbers.
fn assert_rank_is(agent: &Agent, rank: usize) {
    let a = agent.assignment().expect("assigned");
    assert_eq!(a.rank, rank);
}

/// Waits (bounded) until `check` holds, for state that has no event to wait on.
fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn counting_hook(agent: &Agent) -> Arc<AtomicUsize> {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    agent.set_abort_hook(Box::new(move || {
        counted.fetch_add(1, Ordering::SeqCst);
    }));
    calls
}

fn restart_cause(agent: &Agent, generation: u64) -> String {
    match agent.directive() {
        Some(Directive::Restart {
            generation: g,
            cause,
        }) => {
            assert_eq!(g, generation);
            cause
        }
        other => panic!("expected Restart for generation {generation}, got {other:?}"),
    }
}

#[test]
fn a_joining_member_keeps_trying_while_the_coordinator_is_unreachable_and_says_for_how_long() {
    // A port nobody listens on (yet).
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let joining = std::thread::spawn(move || TcpControlPlane::connect(addr, member(0), settings()));
    // The coordinator comes up after the member's first attempts were refused (a
    // launcher restarting, a node hosting it that starts later): the member joins.
    std::thread::sleep(Duration::from_millis(300));
    let coordinator = Coordinator::bind(addr, config(1, 1)).unwrap().spawn();
    let plane = joining
        .join()
        .unwrap()
        .expect("joins once the coordinator is up");
    assert!(plane.is_connected());
    drop(plane);
    drop(coordinator);
    // Never up: the error says how long it tried.
    let short = TcpSettings {
        connect_timeout: Duration::from_millis(300),
        ..settings()
    };
    let started = Instant::now();
    let Err(ElasticError::Io(message)) = TcpControlPlane::connect(addr, member(1), short) else {
        panic!("nothing listens at {addr}");
    };
    assert!(started.elapsed() >= Duration::from_millis(250), "{message}");
    assert!(message.contains("tried for 0.3 s"), "{message}");
}

/// A member that never joined a generation (a node come back while its job
/// finished) has no training to protect: once the coordinator is gone its calls
/// fail after the connect timeout, not the unreachable timeout (60 s by default),
/// and `unreachable_for` says how long it has been gone.
#[test]
fn a_member_that_never_joined_gives_up_on_a_gone_coordinator_after_its_connect_timeout() {
    let coordinator = start(config(2, 2));
    let settings = TcpSettings {
        connect_timeout: Duration::from_millis(500),
        unreachable_timeout: Duration::from_secs(30),
        ..settings()
    };
    let plane =
        TcpControlPlane::connect(coordinator.local_addr(), member(0), settings).expect("connects");
    assert_eq!(plane.unreachable_for(), None);
    drop(coordinator);
    let started = Instant::now();
    let failed = loop {
        match plane.watch(0, Duration::from_millis(200)) {
            Ok(_) => assert!(
                started.elapsed() < Duration::from_secs(10),
                "still no failure after 10 s: the 30 s unreachable timeout applies"
            ),
            Err(e) => break e,
        }
    };
    assert!(matches!(failed, ElasticError::Io(_)), "{failed:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "{failed}");
    assert!(
        plane
            .unreachable_for()
            .is_some_and(|d| d >= Duration::from_millis(500)),
        "{:?}",
        plane.unreachable_for()
    );
}

#[test]
fn four_members_rendezvous_into_one_generation_with_contiguous_ranks() {
    let coordinator = start(config(4, 4));
    let agents = agents(coordinator.local_addr(), 0..4);
    let assignments = rendezvous_all(&agents.iter().collect::<Vec<_>>());
    let generation = assert_one_generation(&assignments, &["m0", "m1", "m2", "m3"]);
    assert!(generation >= 1);
    assert_eq!(assignments[0].cause, "initial");
    for (i, agent) in agents.iter().enumerate() {
        assert_rank_is(agent, i);
        assert_eq!(agent.generation(), Some(generation));
    }
    let formed = coordinator.events();
    assert!(matches!(
        &formed[..],
        [Event::Formed { generation: g, members, adopted: false, .. }] if *g == generation && members.len() == 4
    ));
}

#[test]
fn members_arriving_within_the_last_call_share_one_generation_and_later_ones_wait() {
    let mut config = config(2, 8);
    config.timeouts.last_call = Duration::from_millis(1500);
    let coordinator = start(config);
    let addr = coordinator.local_addr();
    let started = Instant::now();
    let early: Vec<_> = (0..2).map(|i| plane(addr, i)).collect();
    let early_waits: Vec<_> = early
        .iter()
        .map(|p| spawn_rendezvous(p.clone(), 0, Cancel::new()))
        .collect();
    // The settle window (heartbeat timeout, 1 s) ends, min_ranks are there, and the
    // last call (1.5 s) runs: a member arriving half a second into it is included.
    std::thread::sleep(Duration::from_millis(1500).saturating_sub(started.elapsed()));
    let third = plane(addr, 2);
    let third_wait = spawn_rendezvous(third.clone(), 0, Cancel::new());
    let mut assignments: Vec<Assignment> = early_waits
        .iter()
        .chain([&third_wait])
        .map(|w| w.recv_timeout(PATIENCE).unwrap().unwrap())
        .collect();
    assignments.sort_by_key(|a| a.rank);
    assert_one_generation(&assignments, &["m0", "m1", "m2"]);

    // A fourth member now waits: the generation runs.
    let fourth = plane(addr, 3);
    let cancel = Cancel::new();
    let fourth_wait = spawn_rendezvous(fourth, 0, cancel.clone());
    eventually("the fourth member waits", || coordinator.waiting() == 1);
    assert!(
        fourth_wait
            .recv_timeout(Duration::from_millis(500))
            .is_err()
    );
    cancel.cancel();
    assert_eq!(
        fourth_wait.recv_timeout(PATIENCE).unwrap(),
        Err(ElasticError::Cancelled)
    );
}

#[test]
fn a_fifth_member_waits_when_max_ranks_is_four() {
    let coordinator = start(config(4, 4));
    let addr = coordinator.local_addr();
    let planes: Vec<_> = (0..5).map(|i| plane(addr, i)).collect();
    let cancels: Vec<Cancel> = (0..5).map(|_| Cancel::new()).collect();
    let waits: Vec<_> = planes
        .iter()
        .zip(&cancels)
        .map(|(p, c)| spawn_rendezvous(p.clone(), 0, c.clone()))
        .collect();
    let (tx, rx) = mpsc::channel();
    for (i, wait) in waits.into_iter().enumerate() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            if let Ok(result) = wait.recv() {
                let _ = tx.send((i, result));
            }
        });
    }
    let mut assigned = Vec::new();
    for _ in 0..4 {
        let (i, result) = rx
            .recv_timeout(PATIENCE)
            .expect("four members are assigned");
        assigned.push((i, result.expect("rendezvous")));
    }
    let assignments: Vec<Assignment> = assigned.iter().map(|(_, a)| a.clone()).collect();
    let ids: Vec<String> = assigned.iter().map(|(i, _)| format!("m{i}")).collect();
    assert_one_generation(
        &assignments,
        &ids.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(
        rx.recv_timeout(Duration::from_millis(1000)).is_err(),
        "the fifth member must wait"
    );
    assert_eq!(coordinator.waiting(), 1);
    let fifth = (0..5)
        .find(|i| assigned.iter().all(|(j, _)| j != i))
        .unwrap();
    cancels[fifth].cancel();
    let (i, result) = rx.recv_timeout(PATIENCE).unwrap();
    assert_eq!((i, result), (fifth, Err(ElasticError::Cancelled)));
}

#[test]
fn a_dropped_connection_restarts_the_others_within_a_second_into_a_smaller_world() {
    let coordinator = start(config(3, 4));
    let mut agents = agents(coordinator.local_addr(), 0..4);
    let first = rendezvous_all(&agents.iter().collect::<Vec<_>>());
    let generation = assert_one_generation(&first, &["m0", "m1", "m2", "m3"]);
    let hooks: Vec<_> = agents.iter().map(counting_hook).collect();

    let lost = Instant::now();
    drop(agents.pop());
    for agent in &agents {
        assert!(agent.cancel().wait_timeout(Duration::from_secs(1)));
    }
    assert!(
        lost.elapsed() < Duration::from_secs(1),
        "{:?}",
        lost.elapsed()
    );
    for (agent, calls) in agents.iter().zip(&hooks) {
        let cause = restart_cause(agent, generation);
        assert!(
            cause.contains("m3") && cause.contains("connection closed"),
            "{cause}"
        );
        eventually("the abort hook ran", || calls.load(Ordering::SeqCst) == 1);
    }

    let second = rendezvous_all(&agents.iter().collect::<Vec<_>>());
    let next = assert_one_generation(&second, &["m0", "m1", "m2"]);
    assert!(next > generation);
    for (i, agent) in agents.iter().enumerate() {
        assert_rank_is(agent, i);
        assert!(
            !agent.cancel().is_cancelled(),
            "a fresh Cancel per generation"
        );
        assert_eq!(agent.directive(), None);
    }
    assert_eq!(
        hooks[0].load(Ordering::SeqCst),
        1,
        "called once per generation"
    );
}

#[test]
fn a_member_without_heartbeats_is_dropped_and_told_stale() {
    let coordinator = start(config(2, 3));
    let addr = coordinator.local_addr();
    let agents = agents(addr, 0..2);
    let silent = plane(addr, 2);
    let silent_wait = spawn_rendezvous(silent.clone(), 0, Cancel::new());
    let assignments = rendezvous_all(&agents.iter().collect::<Vec<_>>());
    let silent_assignment = silent_wait.recv_timeout(PATIENCE).unwrap().unwrap();
    let generation = assignments[0].generation;
    assert_eq!(silent_assignment.generation, generation);
    assert_eq!(silent_assignment.world_size, 3);

    for agent in &agents {
        assert!(agent.cancel().wait_timeout(PATIENCE));
        let cause = restart_cause(agent, generation);
        assert!(
            cause.contains("m2") && cause.contains("no heartbeat"),
            "{cause}"
        );
    }
    // It wakes up and speaks for its old generation: it is told Stale.
    let _ = silent.heartbeat(generation, &Progress::default());
    let directive = silent.watch(generation, PATIENCE).unwrap();
    assert!(
        matches!(directive, Some(Directive::Stale { current }) if current >= generation),
        "{directive:?}"
    );
    let cancel = Cancel::new();
    let over = silent.kv_get(generation, "anything", &cancel, PATIENCE);
    assert!(matches!(over, Err(ElasticError::Rejected(_))), "{over:?}");

    let next = rendezvous_all(&agents.iter().collect::<Vec<_>>());
    assert!(assert_one_generation(&next, &["m0", "m1"]) > generation);
}

#[test]
fn a_member_idle_outside_a_collective_is_dropped_as_hung() {
    let mut config = config(2, 3);
    config.timeouts.progress_timeout = Duration::from_secs(1);
    let coordinator = start(config);
    let agents = agents(coordinator.local_addr(), 0..3);
    let first = rendezvous_all(&agents.iter().collect::<Vec<_>>());
    let generation = assert_one_generation(&first, &["m0", "m1", "m2"]);
    // m0 and m1 wait in a collective for m2, whose training thread is stuck.
    agents[0].collective_started();
    agents[1].collective_started();

    assert!(agents[2].cancel().wait_timeout(PATIENCE));
    assert!(matches!(
        agents[2].directive(),
        Some(Directive::Stale { .. })
    ));
    for agent in &agents[..2] {
        assert!(agent.cancel().wait_timeout(PATIENCE));
        let cause = restart_cause(agent, generation);
        assert!(cause.contains("m2") && cause.contains("hung"), "{cause}");
        assert!(!cause.contains("m0") && !cause.contains("m1"), "{cause}");
    }
    let next = rendezvous_all(&[&agents[0], &agents[1]]);
    assert!(assert_one_generation(&next, &["m0", "m1"]) > generation);
}

#[test]
fn members_idle_inside_a_collective_are_not_blamed() {
    let mut config = config(2, 2);
    config.timeouts.progress_timeout = Duration::from_millis(500);
    let coordinator = start(config);
    let agents = agents(coordinator.local_addr(), 0..2);
    rendezvous_all(&agents.iter().collect::<Vec<_>>());
    for agent in &agents {
        agent.collective_started();
    }
    // Four progress timeouts pass with heartbeats saying "idle, in a collective".
    assert!(!agents[0].cancel().wait_timeout(Duration::from_secs(2)));
    for agent in &agents {
        assert!(!agent.cancel().is_cancelled());
        assert_eq!(agent.directive(), None);
    }
    assert_eq!(coordinator.events().len(), 1, "{:?}", coordinator.events());
}

/// A `ckpt coordinator` child process, killed when dropped.
struct CoordinatorProcess {
    child: Child,
    addr: SocketAddr,
}

impl CoordinatorProcess {
    fn start(listen: &str) -> CoordinatorProcess {
        let mut child = Command::new(ckpt_testkit::ckpt_cli())
            .args([
                "coordinator",
                "--listen",
                listen,
                "--job",
                JOB,
                "--min-ranks",
                "3",
                "--max-ranks",
                "3",
                "--heartbeat-timeout-secs",
                "1",
                "--join-timeout-secs",
                "2",
                "--last-call-ms",
                "100",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start ckpt coordinator");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("read the listening line");
        let addr = line
            .trim()
            .strip_prefix("coordinator: listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .parse()
            .expect("an address");
        CoordinatorProcess { child, addr }
    }
}

impl Drop for CoordinatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_restarted_coordinator_process_keeps_generations_moving_forward() {
    let first = CoordinatorProcess::start("127.0.0.1:0");
    let addr = first.addr;
    let planes: Vec<_> = (0..3).map(|i| plane(addr, i)).collect();
    let agents: Vec<Agent> = planes.iter().map(|p| agent_on(p.clone())).collect();
    let refs: Vec<&Agent> = agents.iter().collect();
    let g1 = assert_one_generation(&rendezvous_all(&refs), &["m0", "m1", "m2"]);
    // Move on to a second generation, so a coordinator that forgot would go back.
    agents[0]
        .report(Report::CollectiveFailed {
            peer: None,
            reason: "test".into(),
        })
        .unwrap();
    for agent in &agents {
        assert!(agent.cancel().wait_timeout(PATIENCE));
    }
    let g2 = assert_one_generation(&rendezvous_all(&refs), &["m0", "m1", "m2"]);
    assert!(g2 > g1);

    drop(first);
    eventually("the members notice", || {
        planes.iter().all(|p| !p.is_connected())
    });
    let second = CoordinatorProcess::start(&addr.to_string());
    eventually("the members reconnect", || {
        planes.iter().all(|p| p.is_connected())
    });

    // Either the new coordinator adopted g2 (keys work in it, nobody restarted) or
    // it restarted everybody into a newer generation; never an older number.
    let generation = if agents[0].cancel().wait_timeout(Duration::from_millis(1500)) {
        let g3 = assert_one_generation(&rendezvous_all(&refs), &["m0", "m1", "m2"]);
        assert!(g3 > g2, "{g3} after {g2}");
        eprintln!("generation {g2} was not adopted; restarted into {g3}");
        g3
    } else {
        eprintln!("generation {g2} adopted");
        agents[0].kv_set("after-restart", "yes").unwrap();
        for agent in &agents {
            assert_eq!(agent.generation(), Some(g2));
            assert_eq!(agent.kv_get("after-restart", PATIENCE).unwrap(), "yes");
            assert!(!agent.cancel().is_cancelled());
        }
        g2
    };
    // The new coordinator detects failures and numbers above everything it saw.
    drop(planes);
    let mut agents = agents;
    drop(agents.pop());
    for agent in &agents {
        assert!(agent.cancel().wait_timeout(PATIENCE));
        let cause = restart_cause(agent, generation);
        assert!(
            cause.contains("m2") && cause.contains("connection closed"),
            "{cause}"
        );
    }
    // min_ranks is 3: a new member joins the two survivors.
    let newcomer = agent_on(plane(second.addr, 5));
    let next = rendezvous_all(&[&agents[0], &agents[1], &newcomer]);
    assert!(assert_one_generation(&next, &["m0", "m1", "m5"]) > generation);
}

/// A raw protocol connection, for what a well-behaved plane never sends.
struct Raw {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Raw {
    fn connect(addr: SocketAddr) -> Raw {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        let reader = BufReader::new(stream.try_clone().unwrap());
        Raw { stream, reader }
    }

    fn send_line(&mut self, line: &[u8]) {
        let _ = self.stream.write_all(line);
    }

    fn send(&mut self, message: &ClientMessage) {
        let line = protocol::encode(message).unwrap();
        self.send_line(line.as_bytes());
    }

    /// The next message other than Welcome.
    fn recv(&mut self) -> ServerMessage {
        loop {
            let mut line = String::new();
            let n = self.reader.read_line(&mut line).expect("a reply");
            assert!(n > 0, "connection closed without a reply");
            let message = protocol::decode(line.trim_end().as_bytes()).unwrap();
            if !matches!(message, ServerMessage::Welcome { .. }) {
                return message;
            }
        }
    }

    fn hello(&mut self, member: Member, claim: Option<Assignment>) {
        self.send(&ClientMessage::Hello {
            version: protocol::VERSION,
            member,
            seen: 0,
            checkpoint_generation: 0,
            claim,
        });
    }

    fn closed(&mut self) -> bool {
        let mut rest = Vec::new();
        self.reader.read_to_end(&mut rest).is_ok() && rest.is_empty()
    }
}

fn error_text(message: ServerMessage, fatal: bool) -> String {
    match message {
        ServerMessage::Error { message, fatal: f } if f == fatal => message,
        other => panic!("expected an error (fatal: {fatal}), got {other:?}"),
    }
}

#[test]
fn a_connection_beyond_max_connections_is_refused_with_a_fatal_error_line() {
    let mut config = config(1, 1);
    config.max_connections = 1;
    let coordinator = start(config);
    let addr = coordinator.local_addr();
    let mut first = Raw::connect(addr);
    first.hello(member(0), None);
    eventually("the first member is connected", || {
        coordinator.members() == 1
    });
    let mut second = Raw::connect(addr);
    let text = error_text(second.recv(), true);
    assert!(text.contains("too many connections"), "{text}");
    assert!(second.closed(), "a refused connection is closed");
    drop(second);
    // The member already served is still served.
    first.send(&ClientMessage::Rendezvous { after: 0 });
    assert!(matches!(first.recv(), ServerMessage::Assigned { .. }));
}

#[test]
fn bad_input_gets_a_clear_error_and_the_others_are_still_served() {
    let coordinator = start(config(2, 2));
    let addr = coordinator.local_addr();
    let agents = agents(addr, 0..2);
    let refs: Vec<&Agent> = agents.iter().collect();
    let g1 = assert_one_generation(&rendezvous_all(&refs), &["m0", "m1"]);
    let old = agents[0].assignment().unwrap();
    agents[0]
        .report(Report::CollectiveFailed {
            peer: Some(1),
            reason: "test".into(),
        })
        .unwrap();
    for agent in &agents {
        assert!(agent.cancel().wait_timeout(PATIENCE));
    }
    let g2 = assert_one_generation(&rendezvous_all(&refs), &["m0", "m1"]);
    assert!(g2 > g1);

    let mut garbage = Raw::connect(addr);
    garbage.send_line(b"this is not json\n");
    let text = error_text(garbage.recv(), false);
    assert!(text.contains("malformed"), "{text}");
    garbage.send(&ClientMessage::Rendezvous { after: 0 });
    let text = error_text(garbage.recv(), true);
    assert!(text.contains("hello"), "{text}");

    let mut oversize = Raw::connect(addr);
    oversize.send_line(&vec![b'x'; MAX_LINE + 1]);
    let text = error_text(oversize.recv(), true);
    assert!(text.contains("longer than 65536 bytes"), "{text}");
    assert!(oversize.closed());

    let mut other_job = Raw::connect(addr);
    let mut stranger = member(7);
    stranger.job = "another-job".into();
    other_job.hello(stranger.clone(), None);
    let text = error_text(other_job.recv(), true);
    assert!(
        text.contains("job mismatch") && text.contains("another-job"),
        "{text}"
    );
    let refused = TcpControlPlane::connect(addr, stranger, settings());
    assert!(
        matches!(&refused, Err(ElasticError::Rejected(m)) if m.contains("job mismatch")),
        "{:?}",
        refused.err()
    );

    // A member claiming generation g1, which is over and was never its own.
    let mut late = Raw::connect(addr);
    late.hello(member(8), Some(old.clone()));
    assert_eq!(
        late.recv(),
        ServerMessage::Directive {
            directive: Directive::Stale { current: g2 }
        }
    );
    late.send(&ClientMessage::KvSet {
        generation: g1,
        key: "k".into(),
        value: "v".into(),
    });
    let text = error_text(late.recv(), false);
    assert!(
        text.contains(&format!("generation {g1} is not running")),
        "{text}"
    );
    late.send(&ClientMessage::Heartbeat {
        generation: g2 + 100,
        progress: Progress::default(),
    });
    let text = error_text(late.recv(), false);
    assert!(text.contains("from the future"), "{text}");

    // Nobody else noticed.
    agents[1].kv_set("still", "served").unwrap();
    for agent in &agents {
        assert_eq!(agent.kv_get("still", PATIENCE).unwrap(), "served");
        assert!(!agent.cancel().is_cancelled());
        assert_eq!(agent.generation(), Some(g2));
    }
    assert_eq!(coordinator.generation(), g2);
}

#[test]
fn keys_set_in_a_generation_reach_every_member() {
    let coordinator = start(config(3, 3));
    let agents = agents(coordinator.local_addr(), 0..3);
    let refs: Vec<&Agent> = agents.iter().collect();
    rendezvous_all(&refs);
    for (i, agent) in agents.iter().enumerate() {
        agent
            .kv_set(&format!("addr/{i}"), &format!("10.0.0.{i}:29500"))
            .unwrap();
    }
    for agent in &agents {
        for i in 0..3 {
            let value = agent.kv_get(&format!("addr/{i}"), PATIENCE).unwrap();
            assert_eq!(value, format!("10.0.0.{i}:29500"));
        }
    }
    let missing = agents[0].kv_get("nobody-sets-this", Duration::from_millis(200));
    assert!(
        matches!(missing, Err(ElasticError::Timeout(_))),
        "{missing:?}"
    );
}

#[test]
fn kv_get_is_unblocked_by_cancel_and_by_a_restart() {
    let coordinator = start(config(2, 2));
    let addr = coordinator.local_addr();
    let planes: Vec<_> = (0..2).map(|i| plane(addr, i)).collect();
    let agents: Vec<Agent> = planes.iter().map(|p| agent_on(p.clone())).collect();
    let generation = rendezvous_all(&agents.iter().collect::<Vec<_>>())[0].generation;

    let cancel = Cancel::new();
    let (tx, rx) = mpsc::channel();
    {
        let (plane, cancel) = (planes[0].clone(), cancel.clone());
        std::thread::spawn(move || {
            let _ = tx.send(plane.kv_get(generation, "never", &cancel, Duration::from_secs(60)));
        });
    }
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "it blocks"
    );
    cancel.cancel();
    assert_eq!(
        rx.recv_timeout(PATIENCE).unwrap(),
        Err(ElasticError::Cancelled)
    );

    let (tx, rx) = mpsc::channel();
    std::thread::scope(|scope| {
        let waiter = &agents[0];
        scope.spawn(move || {
            let _ = tx.send(waiter.kv_get("never", Duration::from_secs(60)));
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "it blocks"
        );
        agents[1]
            .report(Report::CollectiveFailed {
                peer: Some(0),
                reason: "test".into(),
            })
            .unwrap();
        let result = rx.recv_timeout(PATIENCE).expect("unblocked by the restart");
        assert!(
            matches!(
                result,
                Err(ElasticError::Cancelled) | Err(ElasticError::Rejected(_))
            ),
            "{result:?}"
        );
    });
}

#[test]
fn a_waiting_member_and_a_commit_regroup_the_world_into_a_bigger_generation() {
    let coordinator = start(config(2, 3));
    let addr = coordinator.local_addr();
    let agents = agents(addr, 0..3);
    let g1 = assert_one_generation(&rendezvous_all(&[&agents[0], &agents[1]]), &["m0", "m1"]);
    std::thread::scope(|scope| {
        let newcomer = scope.spawn(|| agents[2].rendezvous());
        eventually("the newcomer waits", || coordinator.waiting() == 1);
        // Without a commit, nobody is asked to regroup.
        assert!(!agents[0].cancel().wait_timeout(Duration::from_millis(300)));
        assert!(!agents[0].regroup_requested());

        agents[0].report(Report::Committed { step: 40 }).unwrap();
        eventually("the members are asked to regroup", || {
            agents[..2].iter().all(Agent::regroup_requested)
        });
        for agent in &agents[..2] {
            match agent.directive() {
                Some(Directive::Regroup { generation, cause }) => {
                    assert_eq!(generation, g1);
                    assert!(cause.contains("grow") && cause.contains("40"), "{cause}");
                }
                other => panic!("expected Regroup, got {other:?}"),
            }
            assert!(!agent.cancel().is_cancelled(), "regroup does not abort");
        }
        let mut assignments = rendezvous_all(&[&agents[0], &agents[1]]);
        assignments.push(newcomer.join().unwrap().unwrap());
        let g2 = assert_one_generation(&assignments, &["m0", "m1", "m2"]);
        assert!(g2 > g1);
        assert!(
            assignments[0].cause.contains("grow"),
            "{}",
            assignments[0].cause
        );
    });
}

#[test]
fn a_report_waited_for_is_handled_when_the_call_returns() {
    let (coordinator, agents, g1) = three_in_one_generation();
    agents[2]
        .report_handled(
            Report::Fatal {
                reason: "device lost".into(),
            },
            PATIENCE,
        )
        .unwrap();
    // No wait: the generation already ended on m2's account, so a peer's error about
    // m2's closed connections, sent from now on, cannot be taken for the cause.
    let ended: Vec<Event> = coordinator
        .events()
        .into_iter()
        .filter(|e| matches!(e, Event::Ended { generation, .. } if *generation == g1))
        .collect();
    assert!(
        matches!(&ended[..], [Event::Ended { cause, .. }] if cause.contains("m2") && cause.contains("device lost")),
        "{ended:?}"
    );
    agents[0]
        .report(Report::CollectiveFailed {
            peer: Some(2),
            reason: "lost rank 2: broken pipe".into(),
        })
        .unwrap();
    let g2 = assert_one_generation(&rendezvous_all(&[&agents[0], &agents[1]]), &["m0", "m1"]);
    assert!(g2 > g1);
}

#[test]
fn fatal_and_leaving_reports_drop_the_reporting_member() {
    let (coordinator, agents, g1) = three_in_one_generation();

    agents[2]
        .report(Report::Fatal {
            reason: "device lost".into(),
        })
        .unwrap();
    for agent in &agents[..2] {
        assert!(agent.cancel().wait_timeout(PATIENCE));
        let cause = restart_cause(agent, g1);
        assert!(
            cause.contains("m2") && cause.contains("device lost"),
            "{cause}"
        );
    }
    let g2 = assert_one_generation(&rendezvous_all(&[&agents[0], &agents[1]]), &["m0", "m1"]);
    assert!(g2 > g1);

    // Leaving is not a failure: the other member is not aborted, and when it
    // rendezvous again (as it does after the save both agreed on) the next
    // generation forms without the one that left, at once (no join timeout).
    agents[1]
        .report(Report::Leaving {
            reason: "preempted".into(),
        })
        .unwrap();
    // The report and the other member's rendezvous travel on different connections:
    // wait until the coordinator has taken the leave, as a launcher sees it.
    let left = coordinator.wait_for_event(PATIENCE, |e| {
        matches!(e, Event::Left { generation, member, .. } if *generation == g2 && member == "m1")
    });
    assert!(
        matches!(&left, Some(Event::Left { cause, .. }) if cause.contains("preempted")),
        "{left:?}"
    );
    let started = Instant::now();
    let g3 = assert_one_generation(&rendezvous_all(&[&agents[0]]), &["m0"]);
    assert!(g3 > g2);
    assert!(
        !agents[0].cancel().is_cancelled(),
        "a member that leaves must not abort the others"
    );
    assert!(
        started.elapsed() < PATIENCE,
        "the next generation must not wait for the member that left"
    );
    let cause = agents[0].assignment().expect("assigned").cause;
    assert!(
        cause.contains("m1") && cause.contains("preempted"),
        "{cause}"
    );
}

#[test]
fn fewer_than_min_ranks_for_longer_than_the_rendezvous_timeout_shuts_the_job_down() {
    let mut config = config(2, 2);
    config.timeouts.join_timeout = Duration::from_millis(500);
    config.timeouts.rendezvous_timeout = Duration::from_secs(1);
    let coordinator = start(config);
    let addr = coordinator.local_addr();
    let mut agents = agents(addr, 0..2);
    rendezvous_all(&agents.iter().collect::<Vec<_>>());
    drop(agents.pop());
    assert!(agents[0].cancel().wait_timeout(PATIENCE));
    let started = Instant::now();
    let result = agents[0].rendezvous();
    assert!(
        matches!(&result, Err(ElasticError::Shutdown(reason)) if reason.contains("at least 2")),
        "{result:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(500));
    assert!(
        coordinator
            .wait_for_event(PATIENCE, |e| matches!(e, Event::Shutdown { .. }))
            .is_some()
    );
    // A member arriving afterwards is told at once.
    let late = plane(addr, 5);
    let result = late.rendezvous(0, &Cancel::new());
    assert!(
        matches!(result, Err(ElasticError::Shutdown(_))),
        "{result:?}"
    );
}
