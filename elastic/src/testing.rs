//! Fixtures shared by the crate's unit tests.

use crate::Member;

/// Member `m{i}` of `job` on `node` (its host is loopback).
pub(crate) fn member(job: &str, i: usize, node: impl Into<String>) -> Member {
    Member::new(job, format!("m{i}"), "127.0.0.1", node)
}
