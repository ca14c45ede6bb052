//! Node agents between ranks and the coordinator, over real TCP: each node joins the
//! coordinator as one member holding its ranks, and its ranks (the library's own
//! `Agent`s over `TcpControlPlane`s) connect to their node as they would to a
//! coordinator. Timeouts of about a second.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

mod common;

use common::{rendezvous_all, settings};

use ckpt_elastic::{
    Agent, AgentConfig, ControlPlane, Coordinator, CoordinatorConfig, CoordinatorHandle, Directive,
    ElasticError, Event, Member, NodeAgent, NodeConfig, Report, TcpControlPlane, Timeouts,
};

const JOB: &str = "node-test";
/// Bound on waits for something that must happen.
const PATIENCE: Duration = Duration::from_secs(10);

fn timeouts() -> Timeouts {
    Timeouts {
        last_call: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(1),
        progress_timeout: Duration::from_secs(1),
        join_timeout: Duration::from_secs(2),
        rendezvous_timeout: Duration::from_secs(30),
    }
}

fn coordinator(min_ranks: usize, max_ranks: usize) -> CoordinatorHandle {
    let config = CoordinatorConfig {
        timeouts: timeouts(),
        settle: Duration::ZERO,
        ..CoordinatorConfig::new(JOB, min_ranks, max_ranks)
    };
    Coordinator::bind("127.0.0.1:0".parse().unwrap(), config)
        .expect("bind a coordinator")
        .spawn()
}

/// Node `n` of `ranks` ranks, joined to the coordinator at `addr`.
fn node(addr: SocketAddr, n: usize, ranks: usize) -> NodeAgent {
    let member = Member {
        ranks,
        ..Member::new(JOB, format!("n{n}"), "127.0.0.1", format!("n{n}"))
    };
    let upstream = TcpControlPlane::connect(addr, member, settings()).expect("node connects");
    let config = NodeConfig {
        timeouts: timeouts(),
        last_call: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(100),
        ..NodeConfig::new(JOB)
    };
    let node = NodeAgent::start(Arc::new(upstream), "127.0.0.1:0".parse().unwrap(), config)
        .expect("start a node agent");
    node.expect(ranks);
    node
}

/// Rank `i` (member `m{i}`, node `n{i / 2}`) connected to its node.
fn rank(node: &NodeAgent, i: usize) -> Agent {
    let plane = TcpControlPlane::connect(node.local_addr(), common::member(JOB, i), settings())
        .expect("rank connects to its node");
    let config = AgentConfig {
        heartbeat_interval: Duration::from_millis(100),
    };
    Agent::new(Arc::new(plane), config)
}

/// Shows progress on `ranks`' training threads until dropped, so that only a rank
/// left out looks hung.
struct Training {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn training<'a>(ranks: impl IntoIterator<Item = &'a Arc<Agent>>) -> Training {
    let ranks: Vec<Arc<Agent>> = ranks.into_iter().cloned().collect();
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut step = 0;
            while !stop.load(Ordering::SeqCst) {
                step += 1;
                for rank in &ranks {
                    rank.progress(step);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    Training {
        stop,
        thread: Some(thread),
    }
}

impl Drop for Training {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Waits until `rank` is told to restart its generation; the cause.
fn restarted(rank: &Agent) -> String {
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        if let Some(Directive::Restart { cause, .. }) = rank.directive() {
            return cause;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no restart within {PATIENCE:?}: {:?}", rank.directive());
}

/// Two nodes of two ranks each, in one generation of four.
struct World {
    coordinator: CoordinatorHandle,
    nodes: Vec<Option<NodeAgent>>,
    ranks: Vec<Option<Arc<Agent>>>,
    generation: u64,
}

fn two_nodes_of_two() -> World {
    let coordinator = coordinator(1, 8);
    let nodes: Vec<NodeAgent> = (0..2)
        .map(|n| node(coordinator.local_addr(), n, 2))
        .collect();
    let ranks: Vec<Agent> = (0..4).map(|i| rank(&nodes[i / 2], i)).collect();
    let assignments = rendezvous_all(&ranks.iter().collect::<Vec<_>>());
    let generation = assignments[0].generation;
    for (i, a) in assignments.iter().enumerate() {
        assert_eq!(
            (a.generation, a.rank, a.ranks, a.world_size, a.members),
            (generation, i, 1, 4, 2),
            "m{i}: nodes n0 and n1 hold ranks 0-1 and 2-3"
        );
    }
    World {
        coordinator,
        nodes: nodes.into_iter().map(Some).collect(),
        ranks: ranks.into_iter().map(|r| Some(Arc::new(r))).collect(),
        generation,
    }
}

impl World {
    fn rank(&self, i: usize) -> &Arc<Agent> {
        self.ranks[i].as_ref().expect("rank still running")
    }
}

#[test]
fn nodes_join_as_one_member_each_and_their_ranks_are_contiguous() {
    let world = two_nodes_of_two();
    let formed = world.coordinator.wait_for_event(
        PATIENCE,
        |e| matches!(e, Event::Formed { generation, .. } if *generation == world.generation),
    );
    let Some(Event::Formed {
        members,
        world_size,
        ..
    }) = formed
    else {
        panic!("no Formed event: {:?}", world.coordinator.events());
    };
    assert_eq!((members, world_size), (vec!["n0".into(), "n1".into()], 4));
    assert_eq!(world.coordinator.members(), 2, "two connections, not four");
    let node = world.nodes[1].as_ref().unwrap().assignment().unwrap();
    assert_eq!((node.rank, node.ranks), (2, 2));
    // Keys set by one rank reach every rank, through the nodes.
    world.rank(3).kv_set("addr", "10.0.0.3:29500").unwrap();
    for i in 0..4 {
        assert_eq!(
            world.rank(i).kv_get("addr", PATIENCE).unwrap(),
            "10.0.0.3:29500"
        );
    }
}

#[test]
fn a_rank_killed_is_named_and_its_node_comes_back_holding_fewer() {
    let mut world = two_nodes_of_two();
    let lost_at = Instant::now();
    drop(world.ranks[1].take());
    for i in [0, 2, 3] {
        let cause = restarted(world.rank(i));
        assert!(
            cause.contains("lost member m1: connection closed"),
            "{cause}"
        );
    }
    let noticed = lost_at.elapsed();
    assert!(
        noticed < Duration::from_secs(1),
        "a crash is seen at once: {noticed:?}"
    );
    let survivors: Vec<&Agent> = [0, 2, 3].iter().map(|&i| world.rank(i).as_ref()).collect();
    let next = rendezvous_all(&survivors);
    let ranks: Vec<(usize, usize)> = next.iter().map(|a| (a.rank, a.world_size)).collect();
    assert_eq!(ranks, [(0, 3), (1, 3), (2, 3)]);
    assert!(next[0].generation > world.generation);
    assert!(
        next[0].cause.contains("lost member m1"),
        "{}",
        next[0].cause
    );
}

#[test]
fn a_rank_that_fails_is_named_even_when_its_peers_report_their_broken_collectives_at_once() {
    let world = two_nodes_of_two();
    // m1 fails and waits until its node has the report; only then does it close its
    // collectives, and its peer on the same node reports the broken connection at
    // once. The node's two reports travel upstream in that order.
    world
        .rank(1)
        .report_handled(
            Report::Fatal {
                reason: "device error".into(),
            },
            PATIENCE,
        )
        .unwrap();
    world
        .rank(0)
        .report(Report::CollectiveFailed {
            peer: Some(1),
            reason: "all_gather: lost rank 1: broken pipe".into(),
        })
        .unwrap();
    for i in [0, 2, 3] {
        let cause = restarted(world.rank(i));
        assert!(
            cause.contains("m1") && cause.contains("device error"),
            "rank {i}: {cause}"
        );
    }
    let survivors: Vec<&Agent> = [0, 2, 3].iter().map(|&i| world.rank(i).as_ref()).collect();
    let next = rendezvous_all(&survivors);
    assert_eq!(
        next.iter().map(|a| a.world_size).collect::<Vec<_>>(),
        [3, 3, 3],
        "the failed rank is not waited for"
    );
}

#[test]
fn a_hung_rank_is_reported_by_its_node_within_the_progress_timeout() {
    let world = two_nodes_of_two();
    // Every training thread but m2's shows progress.
    let others = [0, 1, 3].map(|i| world.rank(i));
    let _training = training(others);
    let started = Instant::now();
    let cause = restarted(world.rank(0));
    let took = started.elapsed();
    assert!(cause.contains("lost member m2: hung"), "{cause}");
    let bound = timeouts().progress_timeout + Duration::from_secs(1);
    assert!(took < bound, "detected in {took:?}, bound {bound:?}");
    // The hung rank is told it is stale, so that it writes nothing more.
    let deadline = Instant::now() + PATIENCE;
    while !matches!(world.rank(2).directive(), Some(Directive::Stale { .. })) {
        assert!(Instant::now() < deadline, "{:?}", world.rank(2).directive());
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_node_killed_whole_is_dropped_and_the_other_node_goes_on() {
    let mut world = two_nodes_of_two();
    let _training = training([0, 1, 2, 3].map(|i| world.rank(i)));
    let killed_at = Instant::now();
    // The node and its ranks die together: every connection closes.
    drop(world.ranks[2].take());
    drop(world.ranks[3].take());
    drop(world.nodes[1].take());
    let cause = restarted(world.rank(0));
    let took = killed_at.elapsed();
    assert!(took < timeouts().heartbeat_timeout, "{took:?}");
    assert!(
        cause.contains("lost member n1") || cause.contains("lost member m2"),
        "{cause}"
    );
    let next = rendezvous_all(&[world.rank(0).as_ref(), world.rank(1).as_ref()]);
    assert_eq!(
        next.iter().map(|a| a.world_size).collect::<Vec<_>>(),
        [2, 2]
    );
}

#[test]
fn a_rank_started_again_waits_and_the_world_grows_at_the_next_commit() {
    let mut world = two_nodes_of_two();
    drop(world.ranks[3].take());
    let survivors: Vec<&Agent> = (0..3).map(|i| world.rank(i).as_ref()).collect();
    for rank in &survivors {
        restarted(rank);
    }
    let second = rendezvous_all(&survivors);
    assert_eq!(second[0].world_size, 3);
    let generation = second[0].generation;
    // m3 starts again on node n1 and asks to join while the world of 3 trains.
    let again = Arc::new(rank(world.nodes[1].as_ref().unwrap(), 3));
    let joining = {
        let again = again.clone();
        std::thread::spawn(move || again.rendezvous())
    };
    let deadline = Instant::now() + PATIENCE;
    // Rank 0 commits step 10: the coordinator asks the world to regroup.
    loop {
        world
            .rank(0)
            .report(ckpt_elastic::Report::Committed { step: 10 })
            .unwrap();
        if world.rank(0).regroup_requested() {
            break;
        }
        assert!(Instant::now() < deadline, "no regroup");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Every survivor is told, through its node (rank 0 may hear it first).
    for rank in &survivors {
        while !matches!(rank.directive(), Some(Directive::Regroup { generation: g, .. }) if g == generation)
        {
            assert!(Instant::now() < deadline, "{:?}", rank.directive());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // At the boundary every rank asks again: the world is four once more.
    for rank in &survivors {
        rank.report(ckpt_elastic::Report::Ended { step: 20 })
            .unwrap();
    }
    let third = rendezvous_all(&survivors);
    let joined = joining.join().unwrap().expect("the restarted rank joins");
    assert_eq!(joined.world_size, 4);
    assert_eq!(joined.rank, 3);
    assert!(
        third
            .iter()
            .all(|a| a.world_size == 4 && a.generation == joined.generation)
    );
    world.ranks[3] = Some(again);
}

#[test]
fn a_rank_of_another_job_is_refused_by_its_node() {
    let coordinator = coordinator(1, 4);
    let node = node(coordinator.local_addr(), 0, 1);
    let stranger = Member::new("another-job", "x", "127.0.0.1", "n0");
    let refused = TcpControlPlane::connect(node.local_addr(), stranger, settings());
    assert!(
        matches!(&refused, Err(ckpt_elastic::ElasticError::Rejected(m)) if m.contains("job mismatch")),
        "{:?}",
        refused.err()
    );
    // A rank of a node holds one rank; a second node cannot hide behind the first.
    let nested = Member {
        ranks: 3,
        ..common::member(JOB, 0)
    };
    let refused = TcpControlPlane::connect(node.local_addr(), nested, settings());
    assert!(
        matches!(&refused, Err(ckpt_elastic::ElasticError::Rejected(m)) if m.contains("holds 3 ranks")),
        "{:?}",
        refused.err()
    );
}

#[test]
fn a_rank_that_connects_after_its_node_asked_is_counted_before_the_generation_forms() {
    // At least two ranks; the node's last call is short, so it asks for its first
    // rank alone, and the world cannot form until the second one is counted.
    let coordinator = coordinator(2, 2);
    let member = Member {
        ranks: 2,
        ..Member::new(JOB, "n0", "127.0.0.1", "n0")
    };
    let upstream = TcpControlPlane::connect(coordinator.local_addr(), member, settings()).unwrap();
    let config = NodeConfig {
        timeouts: timeouts(),
        last_call: Duration::from_millis(50),
        heartbeat_interval: Duration::from_millis(100),
        ..NodeConfig::new(JOB)
    };
    let node =
        NodeAgent::start(Arc::new(upstream), "127.0.0.1:0".parse().unwrap(), config).unwrap();
    node.expect(2);
    let first = Arc::new(rank(&node, 0));
    let asking = {
        let first = first.clone();
        std::thread::spawn(move || first.rendezvous())
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(node.assignment().is_none(), "one rank is below the minimum");
    let second = rank(&node, 1);
    let late = second.rendezvous().expect("the late rank joins");
    let early = asking.join().unwrap().expect("the first rank joins");
    assert_eq!((early.rank, late.rank, late.world_size), (0, 1, 2));
}

#[test]
fn a_snapshot_record_committed_through_a_node_is_read_back_after_a_failure_and_fenced() {
    let world = two_nodes_of_two();
    let g1 = world.generation;
    assert_eq!(world.rank(0).committed_snapshot().unwrap(), None);
    world.rank(3).commit_snapshot("step 10").unwrap();
    assert_eq!(
        world.rank(0).committed_snapshot().unwrap().as_deref(),
        Some("step 10"),
        "committed on node n1, read on node n0"
    );
    world
        .rank(0)
        .report(Report::CollectiveFailed {
            peer: None,
            reason: "test".into(),
        })
        .unwrap();
    for i in 0..4 {
        restarted(world.rank(i));
    }
    let everyone: Vec<&Agent> = (0..4).map(|i| world.rank(i).as_ref()).collect();
    let g2 = rendezvous_all(&everyone)[0].generation;
    assert!(g2 > g1);
    assert_eq!(
        world.rank(2).committed_snapshot().unwrap().as_deref(),
        Some("step 10"),
        "the record outlives the generation that committed it"
    );
    let oversize = world
        .rank(1)
        .commit_snapshot(&"x".repeat(ckpt_elastic::MAX_SNAPSHOT_RECORD + 1));
    assert!(
        matches!(&oversize, Err(ElasticError::Rejected(why)) if why.contains("bound")),
        "{oversize:?}"
    );
    world.rank(1).commit_snapshot("step 20").unwrap();
    // A rank still speaking for the old generation is refused by its node, and
    // changes nothing.
    let late = TcpControlPlane::connect(
        world.nodes[0].as_ref().unwrap().local_addr(),
        common::member(JOB, 9),
        settings(),
    )
    .expect("m9 connects");
    let stale = late.commit_snapshot(g1, "step 11 (stale)");
    assert!(
        matches!(&stale, Err(ElasticError::Rejected(why)) if why.starts_with(&format!("generation {g1} is not running"))),
        "{stale:?}"
    );
    assert_eq!(
        world.rank(3).committed_snapshot().unwrap().as_deref(),
        Some("step 20")
    );
}
