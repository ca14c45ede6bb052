//! The rules of [`Core`] with an explicit clock and no sockets.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{Receiver, channel};

use super::core::{ConnId, Core, Outcome, Phase};
use super::server::OUTBOX;
use super::{CoordinatorConfig, Event};
use crate::policy::Policy;
use crate::protocol::{self, ClientMessage, ServerMessage};
use crate::scenarios::{self, Backend, Told};
use crate::testing;
use crate::{Assignment, Directive, Member, Progress, Report, roster_digest};

struct Harness {
    core: Core,
    t0: Instant,
    inboxes: HashMap<ConnId, Receiver<Arc<str>>>,
}

/// Member `i` on node `n{9 - i}`: ranks run against the ids.
fn member(i: usize) -> Member {
    testing::member("job", i, format!("n{}", 9 - i))
}

impl Harness {
    fn new(min: usize, max: usize) -> Harness {
        let mut config = CoordinatorConfig::new("job", min, max);
        config.timeouts.heartbeat_timeout = Duration::from_secs(1);
        config.settle = config.timeouts.heartbeat_timeout;
        let t0 = Instant::now();
        Harness {
            core: Core::new(config, t0),
            t0,
            inboxes: HashMap::new(),
        }
    }

    fn at(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    fn hello(&mut self, i: usize, seen: u64, claim: Option<Assignment>, ms: u64) -> ConnId {
        let outcome = self.hello_as(member(i), seen, claim, ms);
        assert_eq!(outcome.1, Outcome::Welcomed);
        outcome.0
    }

    /// A connection that says hello as `member`, and what the core made of it.
    fn hello_as(
        &mut self,
        member: Member,
        seen: u64,
        claim: Option<Assignment>,
        ms: u64,
    ) -> (ConnId, Outcome) {
        let (tx, rx) = channel(OUTBOX);
        let c = self
            .core
            .register(None, tx, "127.0.0.1:1".parse().unwrap())
            .unwrap();
        self.inboxes.insert(c, rx);
        let hello = ClientMessage::Hello {
            version: protocol::VERSION,
            member,
            seen,
            checkpoint_generation: 0,
            claim,
        };
        (c, self.core.handle(c, hello, self.at(ms)))
    }

    fn send(&mut self, c: ConnId, message: ClientMessage, ms: u64) {
        let now = self.at(ms);
        assert_eq!(self.core.handle(c, message, now), Outcome::Continue);
    }

    /// Messages sent to `c` since the last call, Welcome left out.
    fn received(&mut self, c: ConnId) -> Vec<ServerMessage> {
        let inbox = self.inboxes.get_mut(&c).unwrap();
        std::iter::from_fn(|| inbox.try_recv().ok())
            .map(|line| protocol::decode(line.trim_end().as_bytes()).unwrap())
            .filter(|m| !matches!(m, ServerMessage::Welcome { .. }))
            .collect()
    }

    /// Members 0 and 1 join at 0 ms and run a generation from 1000 ms (the
    /// settle window): their connections and its number.
    fn two_running(&mut self) -> (ConnId, ConnId, u64) {
        let a = self.hello(0, 0, None, 0);
        let b = self.hello(1, 0, None, 0);
        self.send(a, ClientMessage::Rendezvous { after: 0 }, 0);
        self.send(b, ClientMessage::Rendezvous { after: 0 }, 0);
        self.core.tick(self.at(1000));
        let generation = self.assigned(a).unwrap().generation;
        (a, b, generation)
    }

    fn assigned(&mut self, c: ConnId) -> Option<Assignment> {
        self.received(c).into_iter().find_map(|m| match m {
            ServerMessage::Assigned { assignment } => Some(assignment),
            _ => None,
        })
    }
}

/// The claim of the member at `rank` of generation `generation` of `ids` (one rank
/// each, in rank order).
fn claim(generation: u64, ids: &[usize], rank: usize) -> Assignment {
    let members: Vec<Member> = ids.iter().map(|&i| member(i)).collect();
    Assignment {
        generation,
        rank,
        ranks: 1,
        world_size: members.len(),
        members: members.len(),
        roster: roster_digest(members.iter().map(|m| (m.id.as_str(), m.ranks))),
        checkpoint_generation_floor: 3,
        cause: "initial".into(),
    }
}

fn restart(generation: u64) -> impl Fn(&ServerMessage) -> bool {
    move |m| matches!(m, ServerMessage::Directive { directive: Directive::Restart { generation: g, .. } } if *g == generation)
}

#[test]
fn a_finished_job_sends_every_member_outside_its_generation_away_and_leaves_running_ones_alone() {
    // Found by the chaos harness: a member that rejoined as a newcomer just before
    // the others finished waited out the whole rendezvous timeout. And by the soak
    // (seed 2027 run 45 of the Python example): a node killed whole and started
    // again had connected its agent, whose ranks were still importing torch, when
    // the job finished. Nobody told the agent; the launcher hosting the
    // coordinator then exited, and the node's ranks waited for ever.
    let mut h = Harness::new(2, 2);
    let (a, b, generation) = h.two_running();
    let late = h.hello(2, 0, None, 1100);
    h.send(late, ClientMessage::Rendezvous { after: 0 }, 1100);
    let idle = h.hello(3, 0, None, 1100);
    for c in [late, idle] {
        assert!(h.received(c).is_empty(), "waits while the generation runs");
    }
    let finished = ClientMessage::Report {
        generation,
        report: Report::Finished { step: 60 },
    };
    h.send(a, finished, 1200);
    let shutdown = |m: &ServerMessage| matches!(m, ServerMessage::Directive { directive: Directive::Shutdown { reason } } if reason.contains("finished"));
    for (c, who) in [(late, "asking"), (idle, "connected, not asking")] {
        let got = h.received(c);
        assert!(
            got.iter().any(shutdown),
            "the member {who} is told: {got:?}"
        );
    }
    assert!(
        !h.received(b).iter().any(shutdown),
        "running members are not interrupted"
    );
    // A member asking later is sent away too.
    let later = h.hello(4, 0, None, 1300);
    h.send(later, ClientMessage::Rendezvous { after: 0 }, 1300);
    assert!(h.received(later).iter().any(shutdown));
}

#[test]
fn a_finished_job_whose_members_left_is_not_shut_down_for_lack_of_members() {
    // Found from outside: a job that trained to its end logged "job shut down:
    // only 0 of at least 2 members for 120 s" once its members had left.
    let mut h = Harness::new(2, 2);
    let (a, b, generation) = h.two_running();
    for (c, ms) in [(a, 2000), (b, 2001)] {
        let report = Report::Finished { step: 60 };
        h.send(c, ClientMessage::Report { generation, report }, ms);
        let report = Report::Leaving {
            reason: "finished".into(),
        };
        h.send(c, ClientMessage::Report { generation, report }, ms);
        h.core.remove(c, "connection closed", h.at(ms));
    }
    let long_after = 2001 + h.core.config.timeouts.rendezvous_timeout.as_millis() as u64 * 2;
    h.core.tick(h.at(3000));
    h.core.tick(h.at(long_after));
    assert!(h.core.shutdown.is_none(), "{:?}", h.core.shutdown);
    assert!(
        !h.core
            .events
            .iter()
            .any(|e| matches!(e, Event::Shutdown { .. })),
        "{:?}",
        h.core.events
    );
    assert!(h.core.finished.is_some());
}

#[test]
fn a_generation_formed_by_a_restarted_coordinator_for_members_of_an_older_one_says_so() {
    // The members lost generation 3 while the coordinator was down (found by the
    // chaos harness: the new generation's cause read "initial").
    let mut h = Harness::new(2, 4);
    let a = h.hello(0, 3, None, 0);
    let b = h.hello(1, 3, None, 0);
    h.send(a, ClientMessage::Rendezvous { after: 3 }, 0);
    h.send(b, ClientMessage::Rendezvous { after: 3 }, 0);
    h.core.tick(h.at(1000));
    h.core.tick(h.at(1300));
    let assigned = h.assigned(a).unwrap();
    assert_eq!(assigned.generation, 4);
    assert!(
        assigned.cause.contains("generation 3") && assigned.cause.contains("restarted"),
        "{}",
        assigned.cause
    );
}

#[test]
fn a_generation_forms_when_the_last_call_after_min_ranks_ends() {
    let mut h = Harness::new(2, 4);
    let a = h.hello(0, 0, None, 0);
    let b = h.hello(1, 0, None, 0);
    h.send(a, ClientMessage::Rendezvous { after: 0 }, 0);
    h.send(b, ClientMessage::Rendezvous { after: 0 }, 0);
    // Settling until 1 s, then the last call (300 ms) runs from there.
    h.core.tick(h.at(999));
    h.core.tick(h.at(1000));
    h.core.tick(h.at(1299));
    assert!(h.received(a).is_empty());
    h.core.tick(h.at(1300));
    let (ra, rb) = (h.assigned(a).unwrap(), h.assigned(b).unwrap());
    assert_eq!((ra.generation, rb.generation), (1, 1));
    // Nodes are n9 (m0) and n8 (m1): m1 gets rank 0.
    assert_eq!((ra.rank, rb.rank), (1, 0));
    assert_eq!(ra.members, 2);
    assert_eq!(ra.roster, roster_digest([("m1", 1), ("m0", 1)]));
}

#[test]
fn a_complete_consistent_claim_is_adopted_and_numbers_continue_above_it() {
    let mut h = Harness::new(1, 4);
    let a = h.hello(0, 7, Some(claim(7, &[0, 1], 0)), 10);
    assert!(matches!(h.core.phase, Phase::Settling { .. }));
    let b = h.hello(1, 7, Some(claim(7, &[0, 1], 1)), 20);
    assert!(matches!(&h.core.phase, Phase::Running(r) if r.generation == 7));
    assert!(matches!(
        &h.core.events[..],
        [Event::Formed {
            generation: 7,
            adopted: true,
            ..
        }]
    ));
    assert!(h.received(a).is_empty(), "adopted members are told nothing");
    // A member of an older generation is stale.
    let c = h.hello(2, 5, Some(claim(5, &[2], 0)), 30);
    assert_eq!(
        h.received(c),
        vec![ServerMessage::Directive {
            directive: Directive::Stale { current: 7 }
        }]
    );
    h.core.remove(b, "connection closed", h.at(40));
    assert!(h.received(a).iter().any(restart(7)));
    h.send(a, ClientMessage::Rendezvous { after: 7 }, 50);
    let next = h.assigned(a).unwrap();
    assert_eq!(next.generation, 8);
    assert_eq!(
        next.checkpoint_generation_floor, 3,
        "the claimed floor survives"
    );
}

#[test]
fn an_incomplete_claim_is_restarted_above_every_number_announced() {
    let mut h = Harness::new(2, 4);
    let a = h.hello(0, 7, Some(claim(7, &[0, 1], 0)), 0);
    let b = h.hello(2, 9, None, 0);
    h.send(b, ClientMessage::Rendezvous { after: 0 }, 10);
    h.core.tick(h.at(500));
    assert!(h.received(a).is_empty(), "still settling");
    h.core.tick(h.at(1000));
    assert!(h.received(a).iter().any(restart(7)));
    h.send(a, ClientMessage::Rendezvous { after: 7 }, 1100);
    let assignment = h.assigned(a).unwrap();
    assert_eq!(assignment.generation, 10);
    assert_eq!(assignment.world_size, 2);
}

#[test]
fn late_heartbeats_are_ignored_and_stale_is_said_once() {
    let mut h = Harness::new(1, 1);
    let a = h.hello(0, 0, Some(claim(4, &[0], 0)), 0);
    let heartbeat = |generation| ClientMessage::Heartbeat {
        generation,
        progress: Progress::default(),
    };
    // Sent before it read its newer assignment.
    h.send(a, heartbeat(3), 10);
    assert!(h.received(a).is_empty());
    // Silent for longer than the heartbeat timeout: dropped, told Stale once.
    h.core.tick(h.at(1200));
    let stale = ServerMessage::Directive {
        directive: Directive::Stale { current: 4 },
    };
    assert_eq!(h.received(a), vec![stale]);
    h.send(a, heartbeat(4), 1300);
    h.send(a, heartbeat(4), 1400);
    assert!(h.received(a).is_empty());
    h.send(a, heartbeat(u64::MAX), 1450);
    assert!(
        matches!(&h.received(a)[..], [ServerMessage::Error { message, .. }] if message.contains("out of range"))
    );
    h.send(a, heartbeat(40), 1500);
    assert!(matches!(
        &h.received(a)[..],
        [ServerMessage::Error { fatal: false, .. }]
    ));
}

#[test]
fn a_hung_member_is_blamed_but_one_in_a_collective_is_not() {
    let mut h = Harness::new(2, 2);
    h.core.config.timeouts.progress_timeout = Duration::from_millis(500);
    let a = h.hello(0, 0, Some(claim(2, &[0, 1], 0)), 0);
    let b = h.hello(1, 0, Some(claim(2, &[0, 1], 1)), 0);
    let progress = |in_collective, idle_ms| Progress {
        step: 1,
        in_collective,
        idle_ms,
        checkpoint_generation: 0,
    };
    let heartbeat = |p| ClientMessage::Heartbeat {
        generation: 2,
        progress: p,
    };
    h.send(a, heartbeat(progress(true, 5000)), 100);
    h.send(b, heartbeat(progress(false, 100)), 100);
    h.core.tick(h.at(150));
    assert!(matches!(h.core.phase, Phase::Running(_)));
    h.send(b, heartbeat(progress(false, 600)), 200);
    h.core.tick(h.at(210));
    assert!(h.received(a).iter().any(restart(2)));
    assert!(matches!(
        &h.received(b)[..],
        [ServerMessage::Directive {
            directive: Directive::Stale { current: 2 }
        }]
    ));
}

#[test]
fn messages_before_hello_and_wrong_jobs_close_the_connection() {
    let mut h = Harness::new(1, 1);
    let (tx, _rx) = channel(OUTBOX);
    let c = h
        .core
        .register(None, tx, "127.0.0.1:1".parse().unwrap())
        .unwrap();
    let early = h
        .core
        .handle(c, ClientMessage::Rendezvous { after: 0 }, h.t0);
    assert!(matches!(early, Outcome::Close(reason) if reason.contains("hello")));
    let mut stranger = member(0);
    stranger.job = "other".into();
    let hello = ClientMessage::Hello {
        version: protocol::VERSION,
        member: stranger,
        seen: 0,
        checkpoint_generation: 0,
        claim: None,
    };
    let refused = h.core.handle(c, hello, h.t0);
    assert!(matches!(refused, Outcome::Close(reason) if reason.contains("job mismatch")));
}

/// The coordinator's `Core` as a [`Backend`] of the shared scenarios: one connection
/// per member, its outbox read back as what the member is told.
struct Scenarios {
    core: Core,
    conns: HashMap<String, ConnId>,
    inboxes: Vec<(String, Receiver<Arc<str>>)>,
}

impl Scenarios {
    fn send(&mut self, id: &str, message: ClientMessage, now: Instant) {
        let c = self.conns[id];
        self.core.handle(c, message, now);
    }
}

impl Backend for Scenarios {
    fn start(policy: Policy, t0: Instant) -> Self {
        let mut config = CoordinatorConfig::new("job", policy.min_ranks, policy.max_ranks);
        config.timeouts = policy.timeouts;
        // A coordinator a launcher starts for a new job: nothing to adopt.
        config.settle = Duration::ZERO;
        Scenarios {
            core: Core::new(config, t0),
            conns: HashMap::new(),
            inboxes: Vec::new(),
        }
    }

    fn join(&mut self, member: &Member, now: Instant) {
        let (tx, rx) = channel(OUTBOX);
        let c = self
            .core
            .register(None, tx, "127.0.0.1:1".parse().unwrap())
            .unwrap();
        self.conns.insert(member.id.clone(), c);
        self.inboxes.push((member.id.clone(), rx));
        let hello = ClientMessage::Hello {
            version: protocol::VERSION,
            member: member.clone(),
            seen: 0,
            checkpoint_generation: 0,
            claim: None,
        };
        self.send(&member.id, hello, now);
        self.send(&member.id, ClientMessage::Rendezvous { after: 0 }, now);
    }

    fn rendezvous(&mut self, id: &str, after: u64, now: Instant) {
        self.send(id, ClientMessage::Rendezvous { after }, now);
    }

    fn heartbeat(&mut self, id: &str, generation: u64, progress: &Progress, now: Instant) {
        let progress = progress.clone();
        self.send(
            id,
            ClientMessage::Heartbeat {
                generation,
                progress,
            },
            now,
        );
    }

    fn report(&mut self, id: &str, generation: u64, report: &Report, now: Instant) {
        let report = report.clone();
        self.send(id, ClientMessage::Report { generation, report }, now);
    }

    fn stop(&mut self, _: &str) {
        // A stopped member sends nothing; what the coordinator sends waits in its
        // socket, which the runner holds back until it wakes.
    }

    fn wake(&mut self, id: &str, generation: u64, now: Instant) {
        self.heartbeat(id, generation, &Progress::default(), now);
    }

    fn exit(&mut self, id: &str, now: Instant) {
        if let Some(c) = self.conns.remove(id) {
            self.core.remove(c, "connection closed", now);
        }
    }

    fn tick(&mut self, now: Instant) {
        self.core.tick(now);
    }

    fn told(&mut self) -> Vec<(String, Told)> {
        let mut told = Vec::new();
        for (id, inbox) in &mut self.inboxes {
            while let Ok(line) = inbox.try_recv() {
                match protocol::decode(line.trim_end().as_bytes()).unwrap() {
                    ServerMessage::Assigned { assignment } => {
                        told.push((id.clone(), Told::Assigned(assignment)));
                    }
                    ServerMessage::Directive { directive } => {
                        told.push((id.clone(), Told::Directive(directive)));
                    }
                    _ => {}
                }
            }
        }
        told
    }
}

#[test]
fn the_shared_scenarios_hold_on_the_coordinator() {
    scenarios::check_all::<Scenarios>("coordinator");
}

/// A node's launcher holding `ranks` ranks, as one member.
fn node(id: &str, node: &str, ranks: usize) -> Member {
    Member {
        ranks,
        ..Member::new("job", id, "127.0.0.1", node)
    }
}

#[test]
fn members_holding_several_ranks_get_contiguous_blocks_and_sizes_count_ranks() {
    // At least 10 ranks, at most 12: two nodes of 8 and 4 fill the world, and a
    // single rank that asked after them waits.
    let mut h = Harness::new(10, 12);
    let (big, _) = h.hello_as(node("big", "n1", 8), 0, None, 0);
    let (small, _) = h.hello_as(node("small", "n0", 4), 0, None, 0);
    let (single, _) = h.hello_as(node("single", "n2", 1), 0, None, 0);
    for c in [big, small, single] {
        h.send(c, ClientMessage::Rendezvous { after: 0 }, 0);
    }
    // 13 ranks wait, more than the 12 that fit: it forms when settling ends.
    h.core.tick(h.at(1000));
    let (b, s) = (h.assigned(big).unwrap(), h.assigned(small).unwrap());
    assert!(h.assigned(single).is_none(), "13 ranks do not fit in 12");
    // Node n0 comes first: ranks 0..4, then n1's 4..12.
    assert_eq!((s.rank, s.ranks, b.rank, b.ranks), (0, 4, 4, 8));
    for a in [&s, &b] {
        assert_eq!((a.world_size, a.members), (12, 2));
        assert_eq!(a.roster, roster_digest([("small", 4), ("big", 8)]));
    }
    // The node of 8 is lost: 5 ranks remain, below the minimum of 10; nothing forms.
    h.core.remove(big, "connection closed", h.at(1400));
    assert!(h.received(small).iter().any(restart(b.generation)));
    h.send(
        small,
        ClientMessage::Rendezvous {
            after: b.generation,
        },
        1500,
    );
    h.core.tick(h.at(5000));
    assert!(h.assigned(small).is_none() && h.assigned(single).is_none());
}

#[test]
fn claims_of_several_ranks_are_adopted_only_when_their_blocks_tile_the_world() {
    let roster = roster_digest([("a", 8), ("b", 4)]);
    let claim_of = |rank: usize, ranks: usize| Assignment {
        generation: 5,
        rank,
        ranks,
        world_size: 12,
        members: 2,
        roster,
        checkpoint_generation_floor: 1,
        cause: "initial".into(),
    };
    // b claims a block that overlaps a's: no adoption.
    let mut h = Harness::new(1, 16);
    h.hello_as(node("a", "n0", 8), 5, Some(claim_of(0, 8)), 0);
    h.hello_as(node("b", "n1", 4), 5, Some(claim_of(6, 4)), 0);
    assert!(matches!(h.core.phase, Phase::Settling { .. }));
    // The same with the right blocks is adopted.
    let mut h = Harness::new(1, 16);
    h.hello_as(node("a", "n0", 8), 5, Some(claim_of(0, 8)), 0);
    h.hello_as(node("b", "n1", 4), 5, Some(claim_of(8, 4)), 0);
    let Phase::Running(running) = &h.core.phase else {
        panic!("not adopted");
    };
    assert_eq!((running.generation, running.world_size), (5, 12));
    // A claim whose size is not the member's is ignored with an error.
    let mut h = Harness::new(1, 16);
    let (c, _) = h.hello_as(node("a", "n0", 4), 5, Some(claim_of(0, 8)), 0);
    assert!(h.received(c).iter().any(
        |m| matches!(m, ServerMessage::Error { message, fatal: false } if message.contains("not coherent"))
    ));
}

#[test]
fn a_member_holding_no_ranks_is_refused() {
    let mut h = Harness::new(1, 4);
    let (c, outcome) = h.hello_as(node("empty", "n0", 0), 0, None, 0);
    assert!(matches!(outcome, Outcome::Close(reason) if reason.contains("holds 0 ranks")));
    assert!(h.received(c).iter().any(
        |m| matches!(m, ServerMessage::Error { message, fatal: true } if message.contains("holds 0 ranks"))
    ));
}

impl Harness {
    /// What the core answers `c`'s snapshot request `message` (token 7), sent at
    /// `ms`: the record read, or why it was refused.
    fn ask_snapshot(
        &mut self,
        c: ConnId,
        message: impl FnOnce(u64) -> ClientMessage,
        ms: u64,
    ) -> Result<Option<String>, String> {
        self.send(c, message(7), ms);
        let answers: Vec<_> = self
            .received(c)
            .into_iter()
            .filter_map(|m| match m {
                ServerMessage::SnapshotAnswer {
                    token,
                    record,
                    refused,
                    transient,
                } => {
                    assert_eq!((token, transient), (7, false));
                    Some(refused.map_or(Ok(record), Err))
                }
                _ => None,
            })
            .collect();
        assert_eq!(answers.len(), 1, "one answer per request: {answers:?}");
        answers.into_iter().next().unwrap()
    }

    fn commit_snapshot(
        &mut self,
        c: ConnId,
        generation: u64,
        record: &str,
        ms: u64,
    ) -> Result<Option<String>, String> {
        let record = record.to_owned();
        self.ask_snapshot(
            c,
            |token| ClientMessage::CommitSnapshot {
                token,
                generation,
                record,
            },
            ms,
        )
    }

    fn committed_snapshot(&mut self, c: ConnId, ms: u64) -> Option<String> {
        self.ask_snapshot(c, |token| ClientMessage::ReadSnapshot { token }, ms)
            .expect("a read is never refused")
    }
}

#[test]
fn a_snapshot_record_outlives_its_generation_and_a_stale_generation_cannot_replace_it() {
    let mut h = Harness::new(2, 2);
    let (a, b, g1) = h.two_running();
    h.received(b);
    assert_eq!(h.committed_snapshot(a, 1100), None, "a new job has none");
    assert_eq!(h.commit_snapshot(a, g1, "step 10", 1100), Ok(None));
    assert_eq!(h.committed_snapshot(b, 1100).as_deref(), Some("step 10"));

    // A failure re-forms the world: the key-value space is cleared, the record is
    // not.
    let failed = Report::CollectiveFailed {
        peer: None,
        reason: "test".into(),
    };
    h.send(
        a,
        ClientMessage::Report {
            generation: g1,
            report: failed,
        },
        1200,
    );
    h.send(a, ClientMessage::Rendezvous { after: g1 }, 1200);
    h.send(b, ClientMessage::Rendezvous { after: g1 }, 1200);
    h.core.tick(h.at(1300));
    let g2 = h
        .assigned(a)
        .expect("the next generation formed")
        .generation;
    assert!(g2 > g1);
    h.received(b);
    assert_eq!(h.committed_snapshot(b, 1300).as_deref(), Some("step 10"));

    // A member still speaking for the old generation is refused, by name, and
    // changes nothing.
    let stale = h
        .commit_snapshot(b, g1, "step 11 (stale)", 1300)
        .unwrap_err();
    assert!(
        stale.contains(&format!("generation {g1} is not running")),
        "{stale}"
    );
    assert_eq!(h.committed_snapshot(a, 1300).as_deref(), Some("step 10"));

    // Oversize: refused, naming the bound.
    let big = "x".repeat(crate::MAX_SNAPSHOT_RECORD + 1);
    let refused = h.commit_snapshot(a, g2, &big, 1300).unwrap_err();
    assert!(refused.contains("4096-byte bound"), "{refused}");
    assert_eq!(h.committed_snapshot(a, 1300).as_deref(), Some("step 10"));

    // The running generation replaces it.
    assert_eq!(h.commit_snapshot(b, g2, "step 20", 1300), Ok(None));
    assert_eq!(h.committed_snapshot(a, 1300).as_deref(), Some("step 20"));
}

#[test]
fn a_snapshot_record_of_a_newer_generation_is_never_replaced() {
    // Defensive: the running generation is the newest, so only a record left by
    // a generation numbered above it (none, today) could trigger this.
    let mut h = Harness::new(2, 2);
    let (a, _, g1) = h.two_running();
    h.core.snapshot = Some((g1 + 5, "from the future".into()));
    let refused = h.commit_snapshot(a, g1, "step 10", 1100).unwrap_err();
    assert!(
        refused.contains(&format!("newer generation {}", g1 + 5)),
        "{refused}"
    );
    assert_eq!(
        h.committed_snapshot(a, 1100).as_deref(),
        Some("from the future")
    );
}
