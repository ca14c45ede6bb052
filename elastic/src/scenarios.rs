//! The formation policy's scenarios, as data, run through both backends' rule layers.
//!
//! # Why
//!
//! The [policy](crate::policy) is written once, but each backend still translates its
//! own state into the policy's terms and applies the answers its own way (the
//! coordinator's `Core` from connections and messages, the etcd agents from records
//! and transactions), and a rule can diverge in that translation. So each scenario
//! below (members joining, failing, hanging, leaving at given times; the generations
//! that must form, with their members, cause and time, and what each member must be
//! told) runs through the coordinator's `Core` on an explicit clock
//! (`coordinator/tests.rs`) and through a simulation of the etcd agents over
//! [`crate::etcd::rules`] (`etcd/rules/tests.rs`). Both must give what the table
//! says, hence the same as each other.
//!
//! Members act like the reference trainer's ranks: they heartbeat every tick
//! (50 ms) unless stopped, ask for the next generation only when a step says so,
//! and exit when told they are stale or to shut down (and after a fatal error or a
//! planned leave).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::policy::Policy;
use crate::timeouts::Timeouts;
use crate::{Assignment, Directive, Member, Progress, Report};

/// What a backend told a member.
#[derive(Debug, Clone)]
pub(crate) enum Told {
    /// A generation that includes it.
    Assigned(Assignment),
    /// A directive.
    Directive(Directive),
}

/// A backend's rule layer, driven on an explicit clock. Members are named by id; a
/// member's messages are applied in the order of the calls.
pub(crate) trait Backend {
    /// A new job with `policy`, whose clock starts at `t0`.
    fn start(policy: Policy, t0: Instant) -> Self;
    /// `member`'s process starts and asks for its first generation.
    fn join(&mut self, member: &Member, now: Instant);
    /// `id` asks for a generation newer than `after`.
    fn rendezvous(&mut self, id: &str, after: u64, now: Instant);
    /// `id` heartbeats for `generation` (0: in none).
    fn heartbeat(&mut self, id: &str, generation: u64, progress: &Progress, now: Instant);
    /// `id` reports about `generation`.
    fn report(&mut self, id: &str, generation: u64, report: &Report, now: Instant);
    /// `id`'s process is stopped (SIGSTOP, a partition): it neither sends nor reads.
    fn stop(&mut self, id: &str);
    /// `id` resumes and looks at `generation` again.
    fn wake(&mut self, id: &str, generation: u64, now: Instant);
    /// `id`'s process is gone: its connection closes, its lease is revoked.
    fn exit(&mut self, id: &str, now: Instant);
    /// Time passes.
    fn tick(&mut self, now: Instant);
    /// What members were told since the last call, in order.
    fn told(&mut self) -> Vec<(String, Told)>;
}

/// Something a member does. Members are numbered: member `i` is `m{i}` on node
/// `n{i % 2}`, so ranks (by node, then id) interleave the numbers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Step {
    /// These members start and ask for a generation, in this order.
    Join(&'static [usize]),
    /// These members ask for the generation after their own (after a Restart or a
    /// Regroup, or at a checkpoint boundary), in this order.
    Rejoin(&'static [usize]),
    /// These members' processes die at once (SIGKILL, OOM, their node lost).
    Crash(&'static [usize]),
    /// SIGSTOP, or its node is cut off: it stops heartbeating and reading.
    Stop(usize),
    /// SIGCONT.
    Wake(usize),
    /// Its training thread is stuck outside a collective; the process heartbeats on.
    Stuck(usize),
    /// It reports that a collective failed (peer unknown).
    CollectiveFailed(usize),
    /// It reports a fatal error (device lost) and exits.
    Fatal(usize),
    /// It leaves on purpose (preempted, after the final save) and exits.
    Leave(usize),
    /// It (rank 0) reports that `step` committed.
    Committed(usize, u64),
    /// It ended the generation at the agreed checkpoint `step`.
    Ended(usize, u64),
    /// It trained to the last step, `step`; then it leaves and exits.
    Finished(usize, u64),
}

/// A directive a member must be told.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Expect {
    /// Abort and rendezvous again; its generation `0` is over.
    Restart(u64),
    /// Finish at the next checkpoint of generation `0`, then rendezvous.
    Regroup(u64),
    /// Its generation is over and it was dropped.
    Stale,
    /// The job is over; the reason contains these words.
    Shutdown(&'static str),
}

/// One scenario of the table.
pub(crate) struct Scenario {
    /// What it shows.
    pub(crate) name: &'static str,
    pub(crate) min_ranks: usize,
    pub(crate) max_ranks: usize,
    /// (milliseconds from the start, a multiple of the tick; what happens).
    pub(crate) steps: &'static [(u64, Step)],
    /// When the scenario ends (ms).
    pub(crate) until: u64,
    /// The generations that form, in order: when (ms), the members in rank order,
    /// words of the cause.
    pub(crate) formed: &'static [(u64, &'static [usize], &'static str)],
    /// The directives members are told, in order for each member.
    pub(crate) told: &'static [(usize, Expect)],
}

/// The windows of every scenario: short, and far enough apart that each shows.
pub(crate) const TIMEOUTS: Timeouts = Timeouts {
    last_call: Duration::from_millis(300),
    heartbeat_timeout: Duration::from_secs(2),
    progress_timeout: Duration::from_secs(5),
    join_timeout: Duration::from_secs(2),
    rendezvous_timeout: Duration::from_secs(10),
};

/// How often members heartbeat and the backends tick (ms).
const TICK_MS: u64 = 50;

use Expect::{Regroup, Restart, Shutdown, Stale};
use Step::{
    CollectiveFailed, Committed, Crash, Ended, Fatal, Finished, Join, Leave, Rejoin, Stop, Stuck,
    Wake,
};

/// The table. Times are in ms; [`TIMEOUTS`] gives the windows (last call 300 ms,
/// heartbeat and join timeouts 2 s, progress 5 s, rendezvous 10 s).
pub(crate) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "members starting together share one generation, formed when the last call ends",
        min_ranks: 2,
        max_ranks: 4,
        steps: &[(0, Join(&[0, 1])), (100, Join(&[2]))],
        until: 1000,
        formed: &[(300, &[0, 2, 1], "initial")],
        told: &[],
    },
    Scenario {
        name: "below min ranks the last call does not start",
        min_ranks: 3,
        max_ranks: 4,
        steps: &[(0, Join(&[0, 1])), (1000, Join(&[2]))],
        until: 2000,
        formed: &[(1300, &[0, 2, 1], "initial")],
        told: &[],
    },
    Scenario {
        name: "max ranks form at once; survivors of a crash take the places before earlier newcomers",
        min_ranks: 1,
        max_ranks: 2,
        steps: &[
            (0, Join(&[0, 1])),
            (200, Join(&[2, 3])),
            (1000, Crash(&[1])),
            (1100, Rejoin(&[0])),
        ],
        until: 2000,
        formed: &[(0, &[0, 1], "initial"), (1100, &[0, 2], "lost member m1")],
        told: &[(0, Restart(1))],
    },
    Scenario {
        name: "a crashed member restarts the survivors, who form a smaller world as soon as all ask",
        min_ranks: 2,
        max_ranks: 4,
        steps: &[
            (0, Join(&[0, 1, 2])),
            (1000, Crash(&[2])),
            (1100, Rejoin(&[0, 1])),
        ],
        until: 2000,
        formed: &[
            (300, &[0, 2, 1], "initial"),
            (1100, &[0, 1], "lost member m2"),
        ],
        told: &[(0, Restart(1)), (1, Restart(1))],
    },
    Scenario {
        name: "a lost node (both of its ranks) restarts the other node's ranks once",
        min_ranks: 2,
        max_ranks: 8,
        steps: &[
            (0, Join(&[0, 1, 2, 3])),
            (1000, Crash(&[1, 3])),
            (1100, Rejoin(&[0, 2])),
        ],
        until: 2000,
        formed: &[
            (300, &[0, 2, 1, 3], "initial"),
            (1100, &[0, 2], "lost member m1"),
        ],
        told: &[(0, Restart(1)), (2, Restart(1))],
    },
    Scenario {
        name: "a survivor that does not ask by the join timeout is dropped and told it is stale",
        min_ranks: 1,
        max_ranks: 4,
        steps: &[
            (0, Join(&[0, 1, 2])),
            (1000, Crash(&[2])),
            (1100, Rejoin(&[0])),
        ],
        until: 3500,
        formed: &[(300, &[0, 2, 1], "initial"), (3000, &[0], "lost member m2")],
        told: &[(0, Restart(1)), (1, Restart(1)), (1, Stale)],
    },
    Scenario {
        name: "the join deadline runs from the end of the generation, not from when min ranks wait",
        min_ranks: 2,
        max_ranks: 4,
        steps: &[
            (0, Join(&[0, 1, 2])),
            (1000, Crash(&[2])),
            (1100, Rejoin(&[0])),
            (2500, Join(&[3])),
        ],
        until: 5000,
        formed: &[
            (300, &[0, 2, 1], "initial"),
            (3000, &[0, 3], "lost member m2"),
        ],
        told: &[(0, Restart(1)), (1, Restart(1)), (1, Stale)],
    },
    Scenario {
        name: "newcomers after a generation that ended with no survivor wait the last call",
        min_ranks: 1,
        max_ranks: 4,
        steps: &[(0, Join(&[0])), (500, Join(&[1])), (1000, Crash(&[0]))],
        until: 2000,
        formed: &[(300, &[0], "initial"), (1300, &[1], "lost member m0")],
        told: &[],
    },
    Scenario {
        name: "a silent member is dropped after the heartbeat timeout and told it is stale when it wakes",
        min_ranks: 2,
        max_ranks: 4,
        steps: &[
            (0, Join(&[0, 1, 2])),
            (1000, Stop(2)),
            (3500, Rejoin(&[0, 1])),
            (4000, Wake(2)),
        ],
        until: 4500,
        formed: &[
            (300, &[0, 2, 1], "initial"),
            (3500, &[0, 1], "lost member m2"),
        ],
        told: &[(0, Restart(1)), (1, Restart(1)), (2, Stale)],
    },
    Scenario {
        name: "a training thread stuck outside a collective is dropped as hung",
        min_ranks: 2,
        max_ranks: 4,
        steps: &[
            (0, Join(&[0, 1, 2])),
            (1000, Stuck(1)),
            (1500, Rejoin(&[0, 2])),
        ],
        until: 2000,
        formed: &[(300, &[0, 2, 1], "initial"), (1500, &[0, 2], "m1: hung")],
        told: &[(0, Restart(1)), (2, Restart(1)), (1, Stale)],
    },
    Scenario {
        name: "a failed collective restarts everyone and drops nobody",
        min_ranks: 2,
        max_ranks: 4,
        steps: &[
            (0, Join(&[0, 1])),
            (1000, CollectiveFailed(0)),
            (1100, Rejoin(&[0, 1])),
        ],
        until: 2000,
        formed: &[
            (300, &[0, 1], "initial"),
            (1100, &[0, 1], "member m0 (rank 0): collective failed"),
        ],
        told: &[(0, Restart(1)), (1, Restart(1))],
    },
    Scenario {
        name: "a fatal report drops the reporter, and the next generation names it",
        min_ranks: 1,
        max_ranks: 4,
        steps: &[
            (0, Join(&[0, 1, 2])),
            (1000, Fatal(2)),
            (1100, Rejoin(&[0, 1])),
        ],
        until: 2000,
        formed: &[
            (300, &[0, 2, 1], "initial"),
            (1100, &[0, 1], "member m2 (rank 1) failed: device lost"),
        ],
        told: &[(0, Restart(1)), (1, Restart(1))],
    },
    Scenario {
        name: "a member that leaves on purpose aborts nobody, and the next generation names it",
        min_ranks: 1,
        max_ranks: 4,
        steps: &[
            (0, Join(&[0, 1, 2])),
            (1000, Leave(1)),
            (1100, Rejoin(&[0, 2])),
        ],
        until: 2000,
        formed: &[
            (300, &[0, 2, 1], "initial"),
            (1100, &[0, 2], "member m1 (rank 2) left: preempted"),
        ],
        told: &[],
    },
    Scenario {
        name: "members that end the generation at a checkpoint are not aborted",
        min_ranks: 2,
        max_ranks: 4,
        steps: &[
            (0, Join(&[0, 1])),
            (1000, Ended(0, 50)),
            (1000, Ended(1, 50)),
            (1100, Rejoin(&[0, 1])),
        ],
        until: 2000,
        formed: &[
            (300, &[0, 1], "initial"),
            (1100, &[0, 1], "generation 1 ended at a checkpoint"),
        ],
        told: &[],
    },
    Scenario {
        name: "a member arriving while a generation runs waits, and the world grows at the next commit",
        min_ranks: 2,
        max_ranks: 3,
        steps: &[
            (0, Join(&[0, 1])),
            (500, Join(&[2])),
            (1000, Committed(0, 40)),
            (1100, Rejoin(&[0, 1])),
        ],
        until: 2000,
        formed: &[
            (300, &[0, 1], "initial"),
            (
                1100,
                &[0, 2, 1],
                "grow: 1 waiting member (after step 40 committed)",
            ),
        ],
        told: &[(0, Regroup(1)), (1, Regroup(1))],
    },
    Scenario {
        name: "a full world does not regroup for a waiting member",
        min_ranks: 2,
        max_ranks: 2,
        steps: &[
            (0, Join(&[0, 1])),
            (500, Join(&[2])),
            (1000, Committed(0, 40)),
        ],
        until: 2000,
        formed: &[(0, &[0, 1], "initial")],
        told: &[],
    },
    Scenario {
        name: "fewer than min ranks for the rendezvous timeout shut the job down",
        min_ranks: 2,
        max_ranks: 2,
        steps: &[
            (0, Join(&[0, 1])),
            (1000, Crash(&[1])),
            (1100, Rejoin(&[0])),
        ],
        until: 11500,
        formed: &[(0, &[0, 1], "initial")],
        told: &[
            (0, Restart(1)),
            (0, Shutdown("only 1 of at least 2 ranks for 10 s")),
        ],
    },
    Scenario {
        name: "a finished job sends waiting members away, lets running ones finish, and is not shut down after",
        min_ranks: 2,
        max_ranks: 2,
        steps: &[
            (0, Join(&[0, 1])),
            (500, Join(&[2])),
            (1000, Finished(0, 60)),
            (1100, Finished(1, 60)),
        ],
        until: 12000,
        formed: &[(0, &[0, 1], "initial")],
        told: &[(
            2,
            Shutdown("the job finished: member m0 trained to step 60"),
        )],
    },
];

/// Member `i` of the scenarios.
fn member(i: usize) -> Member {
    crate::testing::member("job", i, format!("n{}", i % 2))
}

/// What a member is doing, as the runner tracks it.
#[derive(Debug, Default)]
struct Doing {
    /// The generation it runs or last ran (0: none yet).
    generation: u64,
    started: bool,
    stopped: bool,
    stuck: bool,
    gone: bool,
    /// What it was told while stopped: it reads it when it wakes.
    unread: Vec<Told>,
}

/// A generation as its members were told it.
#[derive(Debug, PartialEq, Eq)]
struct Formed {
    /// When the first member was told (ms).
    ms: u64,
    /// Rank -> member number, as each member was told.
    members: BTreeMap<usize, usize>,
    /// What every member must have been told alike: world size, member count,
    /// roster digest.
    view: (usize, usize, u64),
    cause: String,
}

/// What a run of a scenario gave.
#[derive(Debug, Default)]
struct Transcript {
    /// Generation number -> how it formed.
    formed: BTreeMap<u64, Formed>,
    /// (member, directive), in the order told.
    told: Vec<(usize, Directive)>,
    /// What broke the rules of the protocol itself (assignments that disagree).
    broken: Vec<String>,
}

fn index(id: &str) -> usize {
    id.strip_prefix('m')
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("member id {id:?}"))
}

struct Run<B> {
    backend: B,
    t0: Instant,
    members: BTreeMap<usize, Doing>,
    transcript: Transcript,
}

impl<B: Backend> Run<B> {
    fn at(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    fn id(i: usize) -> String {
        format!("m{i}")
    }

    /// Takes in what the backend told, as the members would: a member told it is
    /// stale or that the job is over exits.
    fn read(&mut self, ms: u64) {
        loop {
            let told = self.backend.told();
            if told.is_empty() {
                return;
            }
            for (id, told) in told {
                let i = index(&id);
                let doing = self.members.entry(i).or_default();
                if doing.gone {
                    continue;
                }
                if doing.stopped {
                    doing.unread.push(told);
                } else {
                    self.take(i, told, ms);
                }
            }
        }
    }

    fn take(&mut self, i: usize, told: Told, ms: u64) {
        match told {
            Told::Assigned(a) => {
                let view = (a.world_size, a.members, a.roster);
                let entry = self
                    .transcript
                    .formed
                    .entry(a.generation)
                    .or_insert_with(|| Formed {
                        ms,
                        members: BTreeMap::new(),
                        view,
                        cause: a.cause.clone(),
                    });
                if entry.view != view || entry.cause != a.cause {
                    self.transcript.broken.push(format!(
                        "generation {} told differently: {:?} ({}) and {view:?} ({})",
                        a.generation, entry.view, entry.cause, a.cause
                    ));
                }
                if a.ranks != 1 || a.rank >= a.world_size {
                    self.transcript
                        .broken
                        .push(format!("m{i} assigned a block that is not one rank: {a:?}"));
                }
                if let Some(other) = entry.members.insert(a.rank, i).filter(|&j| j != i) {
                    self.transcript.broken.push(format!(
                        "rank {} of generation {} told to m{other} and m{i}",
                        a.rank, a.generation
                    ));
                }
                self.members.entry(i).or_default().generation = a.generation;
            }
            Told::Directive(directive) => {
                let leaves = matches!(
                    directive,
                    Directive::Stale { .. } | Directive::Shutdown { .. }
                );
                self.transcript.told.push((i, directive));
                if leaves {
                    self.exit(i, ms);
                }
            }
        }
    }

    fn exit(&mut self, i: usize, ms: u64) {
        let now = self.at(ms);
        self.members.entry(i).or_default().gone = true;
        self.backend.exit(&Self::id(i), now);
    }

    fn report(&mut self, i: usize, report: Report, ms: u64) {
        let now = self.at(ms);
        let generation = self.members.entry(i).or_default().generation;
        self.backend.report(&Self::id(i), generation, &report, now);
    }

    fn step(&mut self, step: Step, ms: u64) {
        let now = self.at(ms);
        match step {
            Join(list) => {
                for &i in list {
                    self.members.entry(i).or_default().started = true;
                    self.backend.join(&member(i), now);
                    self.read(ms);
                }
            }
            Rejoin(list) => {
                for &i in list {
                    let after = self.members.entry(i).or_default().generation;
                    self.backend.rendezvous(&Self::id(i), after, now);
                    self.read(ms);
                }
            }
            Crash(list) => {
                // All at once: none of them reads what the others' loss brings.
                for &i in list {
                    self.members.entry(i).or_default().gone = true;
                }
                for &i in list {
                    self.exit(i, ms);
                }
            }
            Stop(i) => {
                self.members.entry(i).or_default().stopped = true;
                self.backend.stop(&Self::id(i));
            }
            Wake(i) => {
                let doing = self.members.entry(i).or_default();
                doing.stopped = false;
                let (generation, unread) = (doing.generation, std::mem::take(&mut doing.unread));
                self.backend.wake(&Self::id(i), generation, now);
                for told in unread {
                    self.take(i, told, ms);
                }
            }
            Stuck(i) => self.members.entry(i).or_default().stuck = true,
            CollectiveFailed(i) => {
                let report = Report::CollectiveFailed {
                    peer: None,
                    reason: "connection reset".into(),
                };
                self.report(i, report, ms);
            }
            Fatal(i) => {
                let report = Report::Fatal {
                    reason: "device lost".into(),
                };
                self.report(i, report, ms);
                self.exit(i, ms);
            }
            Leave(i) => {
                let report = Report::Leaving {
                    reason: "preempted".into(),
                };
                self.report(i, report, ms);
                self.exit(i, ms);
            }
            Committed(i, step) => self.report(i, Report::Committed { step }, ms),
            Ended(i, step) => self.report(i, Report::Ended { step }, ms),
            Finished(i, step) => {
                self.report(i, Report::Finished { step }, ms);
                let report = Report::Leaving {
                    reason: "finished".into(),
                };
                self.report(i, report, ms);
                self.exit(i, ms);
            }
        }
        self.read(ms);
    }

    fn heartbeats(&mut self, ms: u64) {
        let now = self.at(ms);
        let idle = TIMEOUTS.progress_timeout + Duration::from_secs(1);
        let beating: Vec<(usize, u64, bool)> = self
            .members
            .iter()
            .filter(|(_, d)| d.started && !d.stopped && !d.gone)
            .map(|(&i, d)| (i, d.generation, d.stuck))
            .collect();
        for (i, generation, stuck) in beating {
            let progress = Progress {
                idle_ms: if stuck { idle.as_millis() as u64 } else { 0 },
                ..Progress::default()
            };
            self.backend
                .heartbeat(&Self::id(i), generation, &progress, now);
        }
        self.read(ms);
    }
}

/// Runs `scenario` through `B`: what formed and what members were told, in words.
fn run<B: Backend>(scenario: &Scenario) -> Transcript {
    let policy = Policy {
        min_ranks: scenario.min_ranks,
        max_ranks: scenario.max_ranks,
        timeouts: TIMEOUTS,
    };
    let t0 = Instant::now();
    let mut run = Run {
        backend: B::start(policy, t0),
        t0,
        members: BTreeMap::new(),
        transcript: Transcript::default(),
    };
    let mut steps = scenario.steps.iter().peekable();
    let mut ms = 0;
    while ms <= scenario.until {
        while let Some(&&(_, step)) = steps.peek().filter(|(at, _)| *at <= ms) {
            steps.next();
            run.step(step, ms);
        }
        run.heartbeats(ms);
        let now = run.at(ms);
        run.backend.tick(now);
        run.read(ms);
        ms += TICK_MS;
    }
    run.transcript
}

/// How the transcript differs from the table, in words (empty: it does not).
fn differences(scenario: &Scenario, transcript: &Transcript) -> Vec<String> {
    let mut wrong = transcript.broken.clone();
    let formed: Vec<(&u64, &Formed)> = transcript.formed.iter().collect();
    if formed.len() != scenario.formed.len() {
        wrong.push(format!(
            "{} generations formed, the table says {}",
            formed.len(),
            scenario.formed.len()
        ));
    }
    for (n, (&(&generation, got), (want_ms, want_members, words))) in
        formed.iter().zip(scenario.formed).enumerate()
    {
        if generation != n as u64 + 1 {
            wrong.push(format!("generation {generation} formed in place {}", n + 1));
        }
        let Formed {
            ms,
            members,
            view,
            cause,
        } = got;
        let members: Vec<usize> = members.values().copied().collect();
        let ids: Vec<String> = members.iter().map(|i| format!("m{i}")).collect();
        let roster = crate::roster_digest(ids.iter().map(|id| (id.as_str(), 1)));
        if *view != (members.len(), members.len(), roster) {
            wrong.push(format!(
                "generation {generation}: ranks {members:?} told, but the view {view:?} says otherwise"
            ));
        }
        if ms != want_ms || members.as_slice() != *want_members || !cause.contains(words) {
            wrong.push(format!(
                "generation {generation} formed at {ms} ms of {members:?} ({cause}); the table says at {want_ms} ms of {want_members:?} ({words}…)"
            ));
        }
    }
    let mut members: Vec<usize> = transcript.told.iter().map(|(i, _)| *i).collect();
    members.extend(scenario.told.iter().map(|(i, _)| *i));
    members.sort_unstable();
    members.dedup();
    for i in members {
        let got: Vec<&Directive> = transcript
            .told
            .iter()
            .filter(|(j, _)| *j == i)
            .map(|(_, d)| d)
            .collect();
        let want: Vec<Expect> = scenario
            .told
            .iter()
            .filter(|(j, _)| *j == i)
            .map(|(_, e)| *e)
            .collect();
        let same = got.len() == want.len()
            && got.iter().zip(&want).all(|(d, e)| match (d, e) {
                (Directive::Restart { generation, .. }, Restart(g))
                | (Directive::Regroup { generation, .. }, Regroup(g)) => generation == g,
                (Directive::Stale { .. }, Stale) => true,
                (Directive::Shutdown { reason }, Shutdown(words)) => reason.contains(words),
                _ => false,
            });
        if !same {
            wrong.push(format!("m{i} was told {got:?}; the table says {want:?}"));
        }
    }
    wrong
}

/// Runs every scenario through `B` and panics with every difference from the table,
/// naming `backend`.
pub(crate) fn check_all<B: Backend>(backend: &str) {
    let mut report = String::new();
    for scenario in SCENARIOS {
        let transcript = run::<B>(scenario);
        let wrong = differences(scenario, &transcript);
        if !wrong.is_empty() {
            let _ = writeln!(report, "{backend}: {}:", scenario.name);
            for line in wrong {
                let _ = writeln!(report, "  - {line}");
            }
        }
    }
    assert!(report.is_empty(), "{report}");
}
