//! The etcd rules without etcd: the record transitions, the directives, and the
//! shared scenarios (`crate::scenarios`) run through a simulation of the agents.

use super::*;
use crate::Progress;
use crate::scenarios::{self, Backend, Told};

/// Member `i`, two per node.
fn member(i: usize) -> Member {
    crate::testing::member("j", i, format!("n{}", i / 2))
}

fn config(min: usize, max: usize) -> JobConfig {
    JobConfig::from_coordinator(&CoordinatorConfig::new("j", min, max))
}

fn live(records: &[(usize, Option<u64>, u64)]) -> BTreeMap<String, Live> {
    records
        .iter()
        .enumerate()
        .map(|(order, &(i, wants, generation))| {
            (
                format!("m{i}"),
                Live {
                    record: MemberRecord {
                        member: member(i),
                        wants,
                        generation,
                        checkpoint_generation: i as u64,
                    },
                    revision: order as i64 + 10,
                },
            )
        })
        .collect()
}

fn running(generation: u64, ids: &[usize]) -> GenRecord {
    GenRecord {
        generation,
        members: ids.iter().map(|&i| Seat::from(&member(i))).collect(),
        floor: 0,
        cause: "initial".into(),
        state: GenState::Running {
            regroup: None,
            at_boundary: false,
            left: None,
        },
        finished: None,
        waiting: 0,
    }
}

#[test]
fn the_first_generation_forms_after_the_last_call_or_at_max() {
    let t0 = Instant::now();
    let mut timers = Timers::default();
    let c = config(2, 4);
    let three = live(&[(0, Some(0), 0), (1, Some(0), 0), (2, Some(0), 0)]);
    let none = GenRecord::none();
    assert_eq!(next(&none, &three, &c, &mut timers, t0), None);
    let later = t0 + Duration::from_millis(c.last_call_ms);
    let formed = next(&none, &three, &c, &mut timers, later).expect("formed after the last call");
    assert_eq!(formed.generation, 1);
    assert_eq!(formed.members.len(), 3);
    // Floors stay above every checkpoint generation a member saved with.
    assert_eq!(formed.floor, 3);
    let four = live(&[
        (0, Some(0), 0),
        (1, Some(0), 0),
        (2, Some(0), 0),
        (3, Some(0), 0),
    ]);
    let mut fresh = Timers::default();
    assert!(
        next(&none, &four, &c, &mut fresh, t0).is_some(),
        "max forms at once"
    );
}

#[test]
fn a_lost_member_ends_the_generation_and_survivors_form_the_next_without_waiting() {
    let t0 = Instant::now();
    let mut timers = Timers::default();
    let c = config(2, 4);
    let current = running(3, &[0, 1, 2]);
    let two = live(&[(0, None, 3), (1, None, 3)]);
    let ended = next(&current, &two, &c, &mut timers, t0).expect("lost member ends it");
    match &ended.state {
        GenState::Ended {
            abort,
            expected,
            dropped,
            ..
        } => {
            assert!(abort);
            assert_eq!(expected, &["m0", "m1"]);
            assert_eq!(dropped, &["m2"]);
        }
        other => panic!("{other:?}"),
    }
    let d = directive("m0", 3, Some(&ended), &ended, false, false);
    assert!(
        matches!(d, Some(Directive::Restart { generation: 3, .. })),
        "{d:?}"
    );
    // One survivor asked: wait for the other (until the join timeout).
    let one_in = live(&[(0, Some(3), 3), (1, None, 3), (5, Some(0), 0)]);
    assert_eq!(next(&ended, &one_in, &c, &mut timers, t0), None);
    let both = live(&[(0, Some(3), 3), (1, Some(3), 3), (5, Some(0), 0)]);
    let formed = next(&ended, &both, &c, &mut timers, t0).expect("all survivors in");
    assert_eq!(formed.generation, 4);
    assert_eq!(formed.members.len(), 3, "the newcomer joins too");
    // After the join timeout, a survivor that did not ask is dropped.
    let mut timers = Timers::default();
    assert_eq!(next(&ended, &one_in, &c, &mut timers, t0), None);
    let late = t0 + Duration::from_millis(c.join_timeout_ms);
    let formed = next(&ended, &one_in, &c, &mut timers, late).expect("join timeout");
    assert!(formed.rank_of("m1").is_none());
    // Late: stale, as the coordinator says it, whether or not it saw the Restart.
    for of_generation in [Some(&ended), None] {
        let d = directive("m1", 3, of_generation, &formed, false, false);
        assert_eq!(d, Some(Directive::Stale { current: 4 }));
    }
    // Asking for the next generation by then, it waits as a newcomer instead.
    assert_eq!(directive("m1", 3, None, &formed, true, false), None);
}

#[test]
fn survivors_are_preferred_over_newcomers_and_ranks_follow_node_then_id() {
    let c = config(1, 2);
    let current = running(1, &[3, 1, 0]);
    let ended = on_report(
        &current,
        "m0",
        1,
        &Report::Fatal {
            reason: "gpu".into(),
        },
        0,
        &c,
    )
    .unwrap();
    let records = live(&[(5, Some(0), 0), (3, Some(1), 1), (1, Some(1), 1)]);
    let formed = next(&ended, &records, &c, &mut Timers::default(), Instant::now()).unwrap();
    let ids: Vec<&str> = formed.members.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["m1", "m3"]);
    assert!(
        formed.cause.contains("m0") && formed.cause.contains("gpu"),
        "{}",
        formed.cause
    );
}

#[test]
fn reports_regroup_leave_and_end_at_boundaries_without_aborting() {
    let c = config(1, 4);
    let current = running(2, &[0, 1]);
    assert_eq!(
        on_report(&current, "m0", 2, &Report::Committed { step: 5 }, 0, &c),
        None
    );
    let regroup = on_report(&current, "m0", 2, &Report::Committed { step: 5 }, 1, &c).unwrap();
    let d = directive("m1", 2, Some(&regroup), &regroup, false, false);
    assert!(
        matches!(d, Some(Directive::Regroup { generation: 2, .. })),
        "{d:?}"
    );
    let ended = on_leave_running(&regroup, "m0", &c).unwrap();
    assert!(matches!(ended.state, GenState::Ended { abort: false, .. }));
    assert_eq!(directive("m1", 2, Some(&ended), &ended, false, false), None);
    // A member leaving a running generation on its own aborts the others.
    let left = on_leave_running(&current, "m1", &c).unwrap();
    let d = directive("m0", 2, Some(&left), &left, false, false);
    assert!(matches!(d, Some(Directive::Restart { .. })), "{d:?}");
    // Reports for another generation or from a non-member change nothing.
    assert_eq!(
        on_report(&current, "m9", 2, &Report::Ended { step: 1 }, 0, &c),
        None
    );
    assert_eq!(
        on_report(&current, "m0", 1, &Report::Ended { step: 1 }, 0, &c),
        None
    );
}

#[test]
fn a_finished_job_sends_waiting_members_away_and_forms_nothing_more() {
    let c = config(1, 4);
    let current = running(5, &[0, 1]);
    let done = on_report(&current, "m0", 5, &Report::Finished { step: 60 }, 1, &c).unwrap();
    assert!(done.finished.is_some());
    let d = directive("m7", 0, None, &done, true, false);
    assert!(matches!(d, Some(Directive::Shutdown { .. })), "{d:?}");
    assert_eq!(directive("m1", 5, Some(&done), &done, false, false), None);
    let waiting = live(&[(7, Some(0), 0)]);
    let ended = on_report(
        &done,
        "m1",
        5,
        &Report::Leaving {
            reason: "done".into(),
        },
        1,
        &c,
    );
    let ended = on_report(
        &ended.unwrap(),
        "m0",
        5,
        &Report::Leaving {
            reason: "done".into(),
        },
        1,
        &c,
    )
    .unwrap();
    assert_eq!(
        next(&ended, &waiting, &c, &mut Timers::default(), Instant::now()),
        None
    );
}

#[test]
fn a_hung_member_is_stale_and_shutdown_comes_after_the_rendezvous_timeout() {
    let current = running(4, &[0, 1]);
    let ended = on_hung(&current, "m1", 99_000).unwrap();
    assert_eq!(
        directive("m1", 4, Some(&ended), &ended, false, false),
        Some(Directive::Stale { current: 4 })
    );
    assert_eq!(
        directive("m0", 4, None, &current, false, true),
        Some(Directive::Stale { current: 4 })
    );
    let c = config(2, 2);
    let t0 = Instant::now();
    let mut timers = Timers::default();
    let alone = live(&[(0, Some(4), 4)]);
    assert_eq!(next(&ended, &alone, &c, &mut timers, t0), None);
    let late = t0 + Duration::from_millis(c.rendezvous_timeout_ms);
    let shut = next(&ended, &alone, &c, &mut timers, late).unwrap();
    assert!(matches!(
        directive("m0", 0, None, &shut, true, false),
        Some(Directive::Shutdown { .. })
    ));
}

/// One member process of the etcd simulation: its record as it would write it, its
/// lease, and its watch.
struct Agent {
    member: Member,
    /// It asked for a generation newer than this one.
    wants: Option<u64>,
    /// The generation it runs (0: none).
    generation: u64,
    checkpoint_generation: u64,
    last_keepalive: Instant,
    lease_lost: bool,
    stopped: bool,
    hung_in: u64,
    /// The last directive its watch returned (it returns each once).
    delivered: Option<(u64, Directive)>,
}

/// The etcd agents of a job over [`rules`](super), as a [`Backend`] of the shared
/// scenarios: one store (the generation record, its history, the member records with
/// their revisions), every agent's record writes and reports applied in a
/// transaction at once, and one agent's timers for the rules (any agent's proposal
/// is valid; the transaction picks one).
struct Simulation {
    config: JobConfig,
    current: GenRecord,
    history: BTreeMap<u64, GenRecord>,
    live: BTreeMap<String, Live>,
    agents: BTreeMap<String, Agent>,
    timers: Timers,
    revision: i64,
    told: Vec<(String, Told)>,
}

impl Simulation {
    fn publish(&mut self, id: &str) {
        let Some(agent) = self.agents.get(id).filter(|a| !a.lease_lost) else {
            return;
        };
        self.revision += 1;
        let record = MemberRecord {
            member: agent.member.clone(),
            wants: agent.wants,
            generation: agent.generation,
            checkpoint_generation: agent.checkpoint_generation,
        };
        let revision = self.revision;
        self.live.insert(id.to_owned(), Live { record, revision });
    }

    fn write(&mut self, record: Option<GenRecord>) {
        if let Some(record) = record {
            self.revision += 1;
            self.history.insert(record.generation, record.clone());
            self.current = record;
        }
    }

    /// Proposes what the rules ask for until they ask for nothing, then lets every
    /// agent that watches take its assignment and its directive.
    fn settle(&mut self, now: Instant) {
        for _ in 0..16 {
            let proposal = next(
                &self.current,
                &self.live,
                &self.config,
                &mut self.timers,
                now,
            );
            if proposal.is_none() {
                break;
            }
            self.write(proposal);
        }
        let ids: Vec<String> = self.agents.keys().cloned().collect();
        for id in ids {
            let agent = &self.agents[&id];
            if agent.stopped {
                continue;
            }
            if let Some(after) = agent.wants
                && let Some(assignment) = self.current.assignment(&id)
                && assignment.generation > after
            {
                let agent = self.agents.get_mut(&id).unwrap();
                agent.wants = None;
                agent.generation = assignment.generation;
                self.told.push((id.clone(), Told::Assigned(assignment)));
                self.publish(&id);
            }
            let agent = &self.agents[&id];
            let lost = agent.lease_lost || !self.live.contains_key(&id);
            let told = directive(
                &id,
                agent.generation,
                self.history.get(&agent.generation),
                &self.current,
                agent.wants.is_some(),
                agent.generation > 0 && lost,
            );
            let agent = self.agents.get_mut(&id).unwrap();
            if let Some(d) = told
                && agent.delivered.as_ref() != Some(&(agent.generation, d.clone()))
            {
                agent.delivered = Some((agent.generation, d.clone()));
                self.told.push((id.clone(), Told::Directive(d)));
            }
        }
    }
}

impl Backend for Simulation {
    fn start(policy: Policy, _: Instant) -> Self {
        let mut coordinator = CoordinatorConfig::new("job", policy.min_ranks, policy.max_ranks);
        coordinator.timeouts = policy.timeouts;
        Simulation {
            config: JobConfig::from_coordinator(&coordinator),
            current: GenRecord::none(),
            history: BTreeMap::new(),
            live: BTreeMap::new(),
            agents: BTreeMap::new(),
            timers: Timers::default(),
            revision: 0,
            told: Vec::new(),
        }
    }

    fn join(&mut self, member: &Member, now: Instant) {
        let agent = Agent {
            member: member.clone(),
            wants: None,
            generation: 0,
            checkpoint_generation: 0,
            last_keepalive: now,
            lease_lost: false,
            stopped: false,
            hung_in: 0,
            delivered: None,
        };
        self.agents.insert(member.id.clone(), agent);
        self.publish(&member.id);
        self.rendezvous(&member.id, 0, now);
    }

    fn rendezvous(&mut self, id: &str, after: u64, now: Instant) {
        // As `EtcdControlPlane::rendezvous`: a running member asking ends its
        // generation, then it says what it waits for.
        if self.current.generation <= after {
            let ended = on_leave_running(&self.current, id, &self.config);
            self.write(ended);
        }
        if let Some(agent) = self.agents.get_mut(id) {
            agent.wants = Some(after);
        }
        self.publish(id);
        self.settle(now);
    }

    fn heartbeat(&mut self, id: &str, generation: u64, progress: &Progress, now: Instant) {
        let hung = generation > 0 && self.config.policy().hung(progress);
        let Some(agent) = self.agents.get_mut(id) else {
            return;
        };
        if hung && std::mem::replace(&mut agent.hung_in, generation) != generation {
            if self.current.generation == generation {
                let ended = on_hung(&self.current, id, progress.idle_ms);
                self.write(ended);
            }
        } else if !agent.lease_lost {
            agent.last_keepalive = now;
        }
        self.settle(now);
    }

    fn report(&mut self, id: &str, generation: u64, report: &Report, now: Instant) {
        if crate::policy::ends_membership(report) {
            if let Some(agent) = self.agents.get_mut(id) {
                agent.wants = None;
            }
            self.publish(id);
        }
        // As an agent reports: with the count of waiting members that the rules
        // keep in the record.
        let next = on_report(
            &self.current,
            id,
            generation,
            report,
            self.current.waiting,
            &self.config,
        );
        self.write(next);
        self.settle(now);
    }

    fn stop(&mut self, id: &str) {
        if let Some(agent) = self.agents.get_mut(id) {
            agent.stopped = true;
        }
    }

    fn wake(&mut self, id: &str, _: u64, now: Instant) {
        if let Some(agent) = self.agents.get_mut(id) {
            agent.stopped = false;
        }
        self.settle(now);
    }

    fn exit(&mut self, id: &str, now: Instant) {
        // The launcher revokes the lease of a process that exits: its record goes.
        self.agents.remove(id);
        self.live.remove(id);
        self.settle(now);
    }

    fn tick(&mut self, now: Instant) {
        let ttl = Duration::from_secs(self.config.lease_ttl_secs() as u64);
        for (id, agent) in &mut self.agents {
            if !agent.lease_lost && now.saturating_duration_since(agent.last_keepalive) >= ttl {
                agent.lease_lost = true;
                self.live.remove(id);
            }
        }
        self.settle(now);
    }

    fn told(&mut self) -> Vec<(String, Told)> {
        std::mem::take(&mut self.told)
    }
}

#[test]
fn the_shared_scenarios_hold_on_the_etcd_rules() {
    scenarios::check_all::<Simulation>("etcd rules");
}
