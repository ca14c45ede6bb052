//! What the control plane's integration tests share: members, job ids, and the check
//! that assignments make one generation.

// Each test file is a crate of its own and uses only part of this.
#![allow(dead_code)]

use ckpt_elastic::{Assignment, Member};

/// Member `m{i}` of `job`; two members per node (`n{i / 2}`), so that ranks follow
/// (node, id) rather than the numbers alone.
pub(crate) fn member(job: &str, i: usize) -> Member {
    Member {
        job: job.into(),
        id: format!("m{i}"),
        host: "127.0.0.1".into(),
        node: format!("n{}", i / 2),
    }
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
/// exactly `ids`: one number and one member list for all, ranks `0..n` each held
/// once, members sorted by (node, id). Returns its number.
pub(crate) fn assert_one_generation(assignments: &[Assignment], ids: &[&str]) -> u64 {
    let first = &assignments[0];
    let mut ranks: Vec<usize> = Vec::new();
    for a in assignments {
        assert_eq!(a.generation, first.generation, "{assignments:#?}");
        assert_eq!(a.members, first.members, "one world for all");
        assert_eq!(a.world_size, assignments.len());
        ranks.push(a.rank);
    }
    ranks.sort_unstable();
    assert_eq!(
        ranks,
        (0..assignments.len()).collect::<Vec<_>>(),
        "contiguous ranks"
    );
    let mut sorted = first.members.clone();
    sorted.sort_by(|a, b| (&a.node, &a.id).cmp(&(&b.node, &b.id)));
    assert_eq!(first.members, sorted, "ranks follow (node, id)");
    let mut got: Vec<&str> = first.members.iter().map(|m| m.id.as_str()).collect();
    let mut want = ids.to_vec();
    got.sort_unstable();
    want.sort_unstable();
    assert_eq!(got, want, "members");
    first.generation
}
