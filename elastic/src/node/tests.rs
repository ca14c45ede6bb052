//! The node's rules driven directly: a node whose ranks are attached in process,
//! over an upstream that never answers, so that each race found in the field is
//! replayed step by step.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::state::{Generation, Local, Outbox, Shared};
use super::{NodeConfig, UNREACHABLE_GIVE_UP};
use crate::protocol::{self, ClientMessage, ServerMessage};
use crate::{Assignment, Cancel, ControlPlane, Directive, ElasticError, Member, Progress, Report};

/// An upstream that accepts everything, keeps what it is reported, and never
/// answers; [`Quiet::out_of_reach_for`] `Some(d)` says it has been reconnecting
/// to a coordinator out of reach for `d` (as the TCP client does before its
/// calls fail).
#[derive(Default)]
struct Quiet {
    unreachable: Option<Duration>,
    reports: Mutex<Vec<(u64, Report)>>,
}

impl Quiet {
    fn out_of_reach_for(d: Option<Duration>) -> Quiet {
        Quiet {
            unreachable: d,
            ..Quiet::default()
        }
    }

    fn reports(&self) -> Vec<(u64, Report)> {
        self.reports.lock().unwrap().clone()
    }
}

impl ControlPlane for Quiet {
    fn unreachable_for(&self) -> Option<Duration> {
        self.unreachable
    }
    fn rendezvous(&self, _: u64, _: &Cancel) -> Result<Assignment, ElasticError> {
        Err(ElasticError::Timeout("quiet".into()))
    }
    fn heartbeat(&self, _: u64, _: &Progress) -> Result<(), ElasticError> {
        Ok(())
    }
    fn watch(&self, _: u64, _: Duration) -> Result<Option<Directive>, ElasticError> {
        Ok(None)
    }
    fn report(&self, generation: u64, report: &Report) -> Result<(), ElasticError> {
        self.reports
            .lock()
            .unwrap()
            .push((generation, report.clone()));
        Ok(())
    }
    fn kv_set(&self, _: u64, _: &str, _: &str) -> Result<(), ElasticError> {
        Ok(())
    }
    fn kv_get(&self, _: u64, _: &str, _: &Cancel, _: Duration) -> Result<String, ElasticError> {
        Err(ElasticError::Timeout("quiet".into()))
    }
    fn commit_snapshot(&self, _: u64, _: &str) -> Result<(), ElasticError> {
        Ok(())
    }
    fn committed_snapshot(&self) -> Result<Option<String>, ElasticError> {
        Ok(None)
    }
}

fn assignment(generation: u64, ranks: usize, cause: &str) -> Assignment {
    Assignment {
        generation,
        rank: 0,
        ranks,
        world_size: ranks,
        members: 1,
        roster: 0,
        checkpoint_generation_floor: 0,
        cause: cause.into(),
    }
}

/// A node with an upstream that never answers, whose ranks `ids` (tags 0, 1, …)
/// are seated in generation 1; those named in `asking` already ask for a newer
/// one. Returns it and what its ranks are sent.
fn node_in_generation_1(
    ids: &[&str],
    asking: &[&str],
) -> (Shared, std::sync::mpsc::Receiver<(usize, Arc<str>)>) {
    node_over(Arc::new(Quiet::default()), ids, asking)
}

/// [`node_in_generation_1`] over `upstream`.
fn node_over(
    upstream: Arc<dyn ControlPlane>,
    ids: &[&str],
    asking: &[&str],
) -> (Shared, std::sync::mpsc::Receiver<(usize, Arc<str>)>) {
    let shared = Shared::new(NodeConfig::new("job"), upstream);
    let (queue, lines) = std::sync::mpsc::sync_channel(16);
    let now = Instant::now();
    {
        let mut state = shared.lock();
        for (tag, id) in ids.iter().enumerate() {
            let c = state.next_local;
            state.next_local += 1;
            state.locals.insert(
                c,
                Local {
                    outbox: Outbox::Attached {
                        tag,
                        queue: queue.clone(),
                    },
                    member: Some(Member::new("job", *id, "127.0.0.1", "n0")),
                    last_seen: now,
                    progress: None,
                    wants: asking.contains(id).then_some((1, now)),
                    out: false,
                },
            );
        }
        state.joined = true;
        state.generation = Some(Generation {
            assignment: assignment(1, ids.len() + 1, "initial"),
            seats: ids
                .iter()
                .enumerate()
                .map(|(i, id)| (id.to_string(), i))
                .collect(),
            formed: now,
            over: false,
            told: false,
            at_boundary: false,
            kv: Vec::new(),
        });
    }
    (shared, lines)
}

/// Whether the rank tagged `tag` was given its place in `generation`.
fn assigned(got: &[(usize, ServerMessage)], tag: usize, generation: u64) -> bool {
    got.iter().any(|(t, m)| {
        *t == tag
            && matches!(m, ServerMessage::Assigned { assignment } if assignment.generation == generation)
    })
}

fn sent(lines: &std::sync::mpsc::Receiver<(usize, Arc<str>)>) -> Vec<(usize, ServerMessage)> {
    lines
        .try_iter()
        .map(|(tag, line)| (tag, protocol::decode(line.as_bytes()).unwrap()))
        .collect()
}

/// Found by the PyTorch elastic tests: a node alone in its job lost a rank, a
/// survivor whose collective failed asked again at once, and the coordinator
/// formed the next generation at once. The node installed it before its other
/// thread relayed the restart of the old one, which then found no generation
/// of the node's to end: the survivor blocked in a collective was never aborted
/// and was dropped by the join timeout. A rank still in the replaced generation
/// is now told at the install; one already asking gets its place instead.
///
/// Found again by the trainer's elastic tests (node 1 killed whole, node 0's
/// rank 1 dropped by the join timeout): the install told nobody when the node
/// had asked because one of its ranks did, which is how a survivor's ask goes,
/// since the ask marks the old generation over. The test goes through that ask.
#[test]
fn installing_a_newer_generation_ends_the_running_one_for_its_ranks() {
    let (shared, lines) = node_in_generation_1(&["blocked", "asking"], &["asking"]);
    let ask = shared.start_asking(&mut shared.lock(), Instant::now());
    assert_eq!(
        ask.map(|(after, ranks, _)| (after, ranks)),
        Some((1, 2)),
        "the node asks for both its ranks"
    );
    shared.lock().asking = None;
    shared.install(
        assignment(2, 2, "lost member gone: connection closed"),
        Instant::now(),
    );
    let got = sent(&lines);
    let restart = ServerMessage::Directive {
        directive: Directive::Restart {
            generation: 1,
            cause: "lost member gone: connection closed".into(),
        },
    };
    assert!(got.contains(&(0, restart.clone())), "{got:?}");
    assert!(!got.contains(&(1, restart)), "{got:?}");
    assert!(assigned(&got, 1, 2), "{got:?}");
}

/// Found by the trainer's elastic tests (a node killed whole): its two ranks
/// died nearly together. The first loss ended the generation; the second
/// disconnect came after the control plane's restart was relayed, so the rank
/// was no longer seated in a running generation and the node reported nothing.
/// The node neither asked again (no live rank) nor left, and the coordinator
/// waited out its rejoin window for it. A node left with no live rank leaves,
/// whenever its last rank goes, and drops an ask it has in flight.
#[test]
fn a_node_whose_last_rank_goes_after_its_generation_ended_leaves() {
    let upstream = Arc::new(Quiet::default());
    let (shared, _lines) = node_over(upstream.clone(), &["first", "second"], &["second"]);
    shared.forget(0, "connection closed");
    assert!(
        matches!(
            upstream.reports().as_slice(),
            [(1, Report::RankLost { .. })]
        ),
        "{:?}",
        upstream.reports()
    );
    shared.relay(Directive::Restart {
        generation: 1,
        cause: "lost member first: connection closed".into(),
    });
    let (_, _, ask) = shared
        .start_asking(&mut shared.lock(), Instant::now())
        .expect("the survivor's ask goes upstream");
    shared.forget(1, "connection closed");
    let reports = upstream.reports();
    assert!(
        matches!(reports.as_slice(), [_, (1, Report::Leaving { .. })]),
        "{reports:?}"
    );
    assert!(ask.is_cancelled(), "the ask for a rank that is gone stands");
    shared.lock().asking = None;
    assert!(
        shared
            .start_asking(&mut shared.lock(), Instant::now())
            .is_none(),
        "a node with no live rank asks for nothing"
    );
}

/// At a checkpoint boundary (a regroup, or a stop elsewhere) the first rank to
/// ask reported the generation ended there; a rank still finishing the same
/// commit is not aborted by the install, and gets its place when it asks.
#[test]
fn a_generation_ended_at_a_boundary_is_not_aborted_for_the_ranks_still_in_it() {
    let (shared, lines) = node_in_generation_1(&["finishing", "asking"], &[]);
    let asking = 1;
    shared
        .apply(
            asking,
            ClientMessage::Report {
                generation: 1,
                report: Report::Ended { step: 10 },
            },
        )
        .unwrap();
    shared
        .apply(asking, ClientMessage::Rendezvous { after: 1 })
        .unwrap();
    assert!(
        shared
            .start_asking(&mut shared.lock(), Instant::now())
            .is_some()
    );
    shared.lock().asking = None;
    shared.install(assignment(2, 2, "grow: 1 waiting member"), Instant::now());
    let got = sent(&lines);
    assert!(
        !got.iter().any(|(tag, m)| *tag == 0
            && matches!(
                m,
                ServerMessage::Directive {
                    directive: Directive::Restart { .. }
                }
            )),
        "{got:?}"
    );
    shared
        .apply(0, ClientMessage::Rendezvous { after: 1 })
        .unwrap();
    let got = sent(&lines);
    assert!(assigned(&got, 0, 2), "{got:?}");
}

/// The control plane's Restart, relayed before the install, is what the ranks
/// still in the old generation hear: the install does not say it again.
#[test]
fn a_restart_relayed_before_the_install_is_not_sent_again() {
    let (shared, lines) = node_in_generation_1(&["blocked", "asking"], &["asking"]);
    let _ = shared.start_asking(&mut shared.lock(), Instant::now());
    let restart = Directive::Restart {
        generation: 1,
        cause: "lost member gone: connection closed".into(),
    };
    shared.relay(restart.clone());
    shared.lock().asking = None;
    shared.install(
        assignment(2, 2, "lost member gone: connection closed"),
        Instant::now(),
    );
    let restarts = sent(&lines)
        .into_iter()
        .filter(|(tag, m)| {
            *tag == 0
                && *m
                    == ServerMessage::Directive {
                        directive: restart.clone(),
                    }
        })
        .count();
    assert_eq!(restarts, 1);
}

/// Found by the chaos soak (seed 2027 run 45 of the Python example): the
/// coordinator was gone for good (its launcher exited with the job), and the node
/// asked it again every 50 ms for ever while its ranks waited. It now gives up
/// after failing for [`UNREACHABLE_GIVE_UP`] without a call that got through, and
/// tells its ranks why.
#[test]
fn a_node_whose_control_plane_stays_unreachable_shuts_its_ranks_down() {
    let (shared, lines) = node_in_generation_1(&["asking", "blocked"], &["asking"]);
    let gone =
        ElasticError::Io("the coordinator at 127.0.0.1:1 has been unreachable for 60 s".into());
    let t0 = Instant::now();
    assert!(!shared.unreachable(&gone, t0));
    assert!(!shared.unreachable(&gone, t0 + UNREACHABLE_GIVE_UP / 2));
    // A call that gets through starts the count again.
    shared.reached();
    let t1 = t0 + UNREACHABLE_GIVE_UP;
    assert!(!shared.unreachable(&gone, t1));
    assert!(sent(&lines).is_empty(), "nothing told yet");
    assert!(shared.unreachable(&gone, t1 + UNREACHABLE_GIVE_UP));
    let got = sent(&lines);
    for tag in [0, 1] {
        assert!(
            got.iter().any(|(t, m)| *t == tag
                && matches!(m, ServerMessage::Directive { directive: Directive::Shutdown { reason } }
                    if reason.contains("has been out of reach of this node for 60 s")
                        && reason.contains("unreachable"))),
            "rank {tag} hears why: {got:?}"
        );
    }
    assert_eq!(
        shared.should_ask(&shared.lock(), Instant::now()),
        None,
        "the node asks no more"
    );
}

/// Found by the Python chaos scenario of a node back while its job finished: the
/// TCP client hid the first 60 s of the coordinator's absence (reconnecting)
/// before a call failed, and the node then failed calls for its own 60 s: its
/// ranks waited two minutes for a job that was over. The outage the backend hid
/// counts.
#[test]
fn the_outage_the_backend_hid_counts_toward_the_nodes_patience() {
    let joined = Shared::new(
        NodeConfig::new("job"),
        Arc::new(Quiet::out_of_reach_for(Some(UNREACHABLE_GIVE_UP))),
    );
    joined.lock().joined = true;
    let gone = ElasticError::Io("the coordinator at 127.0.0.1:1 is gone".into());
    assert!(
        joined.unreachable(&gone, Instant::now()),
        "the first failed call comes after the backend's 60 s: the node gives up"
    );
    assert!(
        joined
            .lock()
            .shutdown
            .as_deref()
            .is_some_and(|r| r.contains("out of reach of this node for 60 s")),
        "{:?}",
        joined.lock().shutdown
    );
    // A shorter hidden outage leaves the rest of the patience.
    let brief = Shared::new(
        NodeConfig::new("job"),
        Arc::new(Quiet::out_of_reach_for(Some(Duration::from_secs(5)))),
    );
    brief.lock().joined = true;
    let t0 = Instant::now();
    assert!(!brief.unreachable(&gone, t0));
    assert!(brief.unreachable(&gone, t0 + UNREACHABLE_GIVE_UP));
}

/// The same scenario's other half: the node had come back (its ranks still
/// importing torch) and never joined a generation when the coordinator left
/// with the finished job. It gives up as a first connection would, after
/// `give_up_before_joining` (the launcher's connect timeout), not 60 s.
#[test]
fn a_node_that_never_joined_gives_up_after_its_connect_timeout() {
    let config = NodeConfig {
        give_up_before_joining: Duration::from_secs(3),
        ..NodeConfig::new("job")
    };
    let fresh = Shared::new(config.clone(), Arc::new(Quiet::default()));
    let gone = ElasticError::Io("the coordinator at 127.0.0.1:1 is gone".into());
    let t0 = Instant::now();
    assert!(!fresh.unreachable(&gone, t0));
    assert!(!fresh.unreachable(&gone, t0 + Duration::from_secs(2)));
    assert!(fresh.unreachable(&gone, t0 + Duration::from_secs(3)));
    // Once it joined, the full patience again.
    let joined = Shared::new(config, Arc::new(Quiet::default()));
    joined.lock().joined = true;
    assert!(!joined.unreachable(&gone, t0));
    assert!(!joined.unreachable(&gone, t0 + Duration::from_secs(3)));
    assert!(joined.unreachable(&gone, t0 + UNREACHABLE_GIVE_UP));
}

/// Found by the chaos soak (seed 2027 run 58): a node cut off from the
/// coordinator for longer than the heartbeat timeout. The other node finished
/// the job meanwhile. Once the network healed, this node's ranks found their
/// peers gone and asked for a new generation; then the coordinator's old word
/// that the node was dropped arrived. The node took its asking ranks for stale:
/// it forgot their asks and left them out of everything after, the end of the
/// job included. They waited in their rendezvous for ever. A rank that already
/// asks for a newer generation knows the old one is over: its ask stands, and
/// the end of the job reaches every rank still connected.
#[test]
fn ranks_already_asking_keep_their_ask_when_the_node_is_dropped_and_hear_the_job_end() {
    let (shared, lines) = node_in_generation_1(&["asking", "blocked"], &["asking"]);
    shared.relay(Directive::Stale { current: 1 });
    let got = sent(&lines);
    assert!(
        !got.iter().any(|(tag, _)| *tag == 0),
        "the asking rank is not told it is stale: {got:?}"
    );
    assert!(
        got.iter().any(|(tag, m)| *tag == 1
            && matches!(
                m,
                ServerMessage::Directive {
                    directive: Directive::Stale { .. }
                }
            )),
        "the rank still in the old generation is: {got:?}"
    );
    assert_eq!(
        shared.should_ask(&shared.lock(), Instant::now()),
        Some((1, 1)),
        "the node asks for its one asking rank"
    );
    let shutdown = Directive::Shutdown {
        reason: "the job finished".into(),
    };
    shared.relay(shutdown.clone());
    let got = sent(&lines);
    for tag in [0, 1] {
        assert!(
            got.contains(&(
                tag,
                ServerMessage::Directive {
                    directive: shutdown.clone()
                }
            )),
            "rank {tag} hears the job ended: {got:?}"
        );
    }
}
