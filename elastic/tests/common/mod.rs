//! What the control plane's integration tests share: members, job ids, and the check
//! that assignments make one generation.

// Each test file is a crate of its own and uses only part of this.
#![allow(dead_code)]

use std::time::Duration;

use ckpt_elastic::{Agent, Assignment, Member, TcpSettings, roster_digest};

/// Member `m{i}` of `job`; two members per node (`n{i / 2}`), so that ranks follow
/// (node, id) rather than the numbers alone.
pub(crate) fn member(job: &str, i: usize) -> Member {
    Member::new(job, format!("m{i}"), "127.0.0.1", node_of(i))
}

/// The node of member `m{i}`.
fn node_of(i: usize) -> String {
    format!("n{}", i / 2)
}

/// A job id no earlier run used (etcd keeps a job's keys after it ends).
pub(crate) fn unique_job(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{}-{nanos}", std::process::id())
}

/// Asserts that `assignments` (one per member, in any order) make one generation of
/// exactly `ids` (members of [`member`], one rank each): one number and one roster
/// for all, ranks `0..n` each held once, and the roster's digest that of `ids`
/// sorted by (node, id). Returns its number.
pub(crate) fn assert_one_generation(assignments: &[Assignment], ids: &[&str]) -> u64 {
    let first = &assignments[0];
    let mut ranks: Vec<usize> = Vec::new();
    for a in assignments {
        assert_eq!(a.generation, first.generation, "{assignments:#?}");
        assert_eq!(
            (a.members, a.roster),
            (first.members, first.roster),
            "one world for all"
        );
        assert_eq!(a.world_size, assignments.len());
        assert_eq!(a.ranks, 1);
        ranks.push(a.rank);
    }
    ranks.sort_unstable();
    assert_eq!(
        ranks,
        (0..assignments.len()).collect::<Vec<_>>(),
        "contiguous ranks"
    );
    let mut want: Vec<(String, &str)> = ids
        .iter()
        .map(|id| {
            let i: usize = id[1..].parse().expect("ids are m{i}");
            (node_of(i), *id)
        })
        .collect();
    want.sort_unstable();
    assert_eq!(first.members, ids.len(), "members");
    assert_eq!(
        first.roster,
        roster_digest(want.iter().map(|(_, id)| (*id, 1))),
        "the members are {ids:?}, ranked by (node, id)"
    );
    first.generation
}

/// Settings of a member's connection, with the tests' short timeouts.
pub(crate) fn settings() -> TcpSettings {
    TcpSettings {
        connect_timeout: Duration::from_secs(5),
        reconnect_backoff_max: Duration::from_millis(100),
        unreachable_timeout: Duration::from_secs(30),
        write_timeout: Duration::from_secs(2),
        secret: None,
    }
}

/// Every agent rendezvouses at once; their assignments, in the agents' order.
pub(crate) fn rendezvous_all(agents: &[&Agent]) -> Vec<Assignment> {
    std::thread::scope(|scope| {
        let waits: Vec<_> = agents
            .iter()
            .map(|agent| scope.spawn(|| agent.rendezvous()))
            .collect();
        waits
            .into_iter()
            .map(|w| w.join().unwrap().expect("rendezvous"))
            .collect()
    })
}
