//! The job's secret at the coordinator and at a node's agent, over real TCP: members
//! that prove it are served as before; a process without it, or with another job's,
//! is refused with a reason, counted, and disturbs nothing; a flood of such
//! connections leaves a running generation alone.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::{assert_one_generation, rendezvous_all, settings};

use ckpt_auth::JobSecret;
use ckpt_elastic::{
    Agent, AgentConfig, Coordinator, CoordinatorConfig, CoordinatorHandle, ElasticError, Event,
    Member, NodeAgent, NodeConfig, TcpControlPlane, TcpSettings, Timeouts,
};

const JOB: &str = "secret-test";
/// Bound on waits for something that must happen.
const PATIENCE: Duration = Duration::from_secs(20);

fn secret() -> JobSecret {
    JobSecret::new("this job's secret, shared by its ranks", "test").unwrap()
}

fn strangers_secret() -> JobSecret {
    JobSecret::new("another job's secret, not this one's", "test").unwrap()
}

fn timeouts() -> Timeouts {
    Timeouts {
        last_call: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(2),
        progress_timeout: Duration::from_secs(30),
        join_timeout: Duration::from_secs(2),
        rendezvous_timeout: Duration::from_secs(30),
    }
}

fn coordinator(ranks: usize, secret: Option<JobSecret>) -> CoordinatorHandle {
    let config = CoordinatorConfig {
        timeouts: timeouts(),
        settle: Duration::ZERO,
        ..CoordinatorConfig::new(JOB, ranks, ranks)
    };
    Coordinator::bind("127.0.0.1:0".parse().unwrap(), config)
        .expect("bind a coordinator")
        .with_secret(secret)
        .spawn()
}

fn with(secret: Option<JobSecret>) -> TcpSettings {
    TcpSettings {
        secret,
        ..settings()
    }
}

fn agent(addr: SocketAddr, i: usize, secret: Option<JobSecret>) -> Agent {
    let plane = TcpControlPlane::connect(addr, common::member(JOB, i), with(secret))
        .expect("a member with the job's secret connects");
    let config = AgentConfig {
        heartbeat_interval: Duration::from_millis(100),
    };
    Agent::new(Arc::new(plane), config)
}

fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !check() {
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The refusal a member gets from `addr` with `secret`.
fn refusal(addr: SocketAddr, i: usize, secret: Option<JobSecret>) -> String {
    let short = TcpSettings {
        connect_timeout: Duration::from_secs(3),
        ..with(secret)
    };
    match TcpControlPlane::connect(addr, common::member(JOB, i), short) {
        Err(ElasticError::Rejected(message)) => message,
        Err(e) => panic!("refused for the wrong reason: {e}"),
        Ok(_) => panic!("a member without the job's secret was admitted"),
    }
}

/// A running generation of two members, and the coordinator's events so far.
fn running_pair(coordinator: &CoordinatorHandle) -> (Vec<Agent>, u64) {
    let addr = coordinator.local_addr();
    let agents = vec![
        agent(addr, 0, Some(secret())),
        agent(addr, 1, Some(secret())),
    ];
    let assignments = rendezvous_all(&agents.iter().collect::<Vec<_>>());
    let generation = assert_one_generation(&assignments, &["m0", "m1"]);
    (agents, generation)
}

/// Nothing happened to the generation: one formation, both members still in it.
fn undisturbed(coordinator: &CoordinatorHandle, agents: &[Agent], generation: u64) {
    let events = coordinator.events();
    assert!(
        matches!(&events[..], [Event::Formed { generation: g, .. }] if *g == generation),
        "{events:#?}"
    );
    for a in agents {
        assert_eq!(a.generation(), Some(generation));
        assert!(a.directive().is_none(), "{:?}", a.directive());
    }
    assert_eq!(coordinator.generation(), generation);
}

#[test]
fn a_coordinator_with_a_secret_admits_only_members_that_prove_it() {
    let coordinator = coordinator(2, Some(secret()));
    let addr = coordinator.local_addr();
    let (agents, generation) = running_pair(&coordinator);

    // A member started without the secret is told what it lacks.
    let message = refusal(addr, 2, None);
    assert!(message.contains("CKPT_JOB_SECRET"), "{message}");
    // One with another job's secret finds that the coordinator is not its job's.
    let message = refusal(addr, 3, Some(strangers_secret()));
    assert!(
        message.contains("did not prove this job's secret"),
        "{message}"
    );
    // A stranger speaking nonsense is dropped.
    let mut junk = TcpStream::connect(addr).unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    drop(junk);
    eventually("three refusals counted", || {
        coordinator.refused_connections() == 3
    });
    undisturbed(&coordinator, &agents, generation);

    // Without a secret configured, nothing is asked (the behaviour so far).
    let open = self::coordinator(1, None);
    let plain = agent(open.local_addr(), 0, None);
    let first = rendezvous_all(&[&plain]);
    assert_one_generation(&first, &["m0"]);
    assert_eq!(open.refused_connections(), 0);
}

#[test]
fn a_flood_of_connections_without_the_secret_leaves_the_generation_alone() {
    let coordinator = coordinator(2, Some(secret()));
    let addr = coordinator.local_addr();
    let (agents, generation) = running_pair(&coordinator);
    // 10,000 connections from four threads, each a stranger's opening, at once.
    const FLOOD: u64 = 10_000;
    const THREADS: u64 = 4;
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..THREADS {
            scope.spawn(|| {
                for _ in 0..FLOOD / THREADS {
                    // The listen queue may overflow for a moment: retry, as a
                    // determined flooder would.
                    let mut stream = loop {
                        match TcpStream::connect(addr) {
                            Ok(s) => break s,
                            Err(_) => std::thread::yield_now(),
                        }
                    };
                    let _ = stream.write_all(b"CKPTJS00 not a proof of anything at all");
                }
            });
        }
    });
    eventually("every flood connection refused", || {
        coordinator.refused_connections() == FLOOD
    });
    eprintln!(
        "{FLOOD} refused connections in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // The members heartbeat every 100 ms with a 2 s timeout throughout: a
    // coordinator kept from reading them would have ended the generation.
    undisturbed(&coordinator, &agents, generation);
}

#[test]
fn a_node_agent_with_a_secret_serves_only_ranks_that_prove_it() {
    let coordinator = coordinator(2, Some(secret()));
    let node_member = Member {
        ranks: 2,
        ..Member::new(JOB, "n0", "127.0.0.1", "n0")
    };
    let upstream =
        TcpControlPlane::connect(coordinator.local_addr(), node_member, with(Some(secret())))
            .expect("the node proves the secret upstream");
    let config = NodeConfig {
        timeouts: timeouts(),
        last_call: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(100),
        secret: Some(secret()),
        ..NodeConfig::new(JOB)
    };
    let node = NodeAgent::start(Arc::new(upstream), "127.0.0.1:0".parse().unwrap(), config)
        .expect("start a node agent");
    node.expect(2);
    let ranks = [
        agent(node.local_addr(), 0, Some(secret())),
        agent(node.local_addr(), 1, Some(secret())),
    ];
    let assignments = rendezvous_all(&ranks.iter().collect::<Vec<_>>());
    let generation = assignments[0].generation;
    let mut places: Vec<usize> = assignments.iter().map(|a| a.rank).collect();
    places.sort_unstable();
    assert_eq!(places, [0, 1], "{assignments:#?}");
    assert!(
        assignments
            .iter()
            .all(|a| a.generation == generation && a.world_size == 2)
    );

    let message = refusal(node.local_addr(), 2, None);
    assert!(message.contains("CKPT_JOB_SECRET"), "{message}");
    let message = refusal(node.local_addr(), 3, Some(strangers_secret()));
    assert!(
        message.contains("did not prove this job's secret"),
        "{message}"
    );
    eventually("two refusals counted", || node.refused_connections() == 2);
    for r in &ranks {
        assert_eq!(r.generation(), Some(generation));
        assert!(r.directive().is_none(), "{:?}", r.directive());
    }
    assert_eq!(coordinator.refused_connections(), 0);
}
