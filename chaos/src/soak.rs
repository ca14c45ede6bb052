//! Seeded random scenarios: `ckpt-chaos soak --seed S --runs N`.
//!
//! Run `i` of seed `S` is drawn from its own stream (`S` and `i` mixed), so any one run
//! can be drawn again alone, and a failure is written out as a scenario file that
//! replays it with `ckpt-chaos run`.

use crate::scenario::{
    CoordinatorKind, Expect, Fault, FaultKind, SAVE_STAGES, Scenario, StorageKind,
};

/// Faults that install a node's nftables rules (or hold its sends): at most one of
/// them a run, since each replaces the others on its node.
const NETWORK_FAULTS: [FaultKind; 5] = [
    FaultKind::Partition,
    FaultKind::NetDelay,
    FaultKind::NetLoss,
    FaultKind::PartitionStore,
    FaultKind::PartitionEtcd,
];

/// SplitMix64: small, fast, and good enough to draw fault plans from.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The stream of run `run` of `seed`.
    pub fn for_run(seed: u64, run: u64) -> Rng {
        let mut rng = Rng(seed ^ run.wrapping_mul(0xD1B5_4A32_D192_ED03));
        rng.next_u64();
        rng
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `low..=high`.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.next_u64() % (high - low + 1)
    }
}

/// Draws run `run` of `seed`: tiny preset, one or two nodes, a control plane (the
/// hosted or a standalone coordinator, or etcd), a store (local disk, a small tmpfs,
/// or S3 through the fault proxy), and one to three faults of the kinds that setup
/// allows, on distinct ranks (or a node), at distinct steps.
pub fn draw(seed: u64, run: u64) -> Scenario {
    let mut rng = Rng::for_run(seed, run);
    let nodes = rng.range(1, 2) as usize;
    let ranks = if nodes == 2 {
        2
    } else {
        rng.range(3, 4) as usize
    };
    let world = ranks * nodes;
    let steps = 40;
    // The faults on the network between nodes need a coordinator off the nodes: a
    // standalone one or etcd in five runs of eight.
    let coordinator = match rng.range(0, 7) {
        0..=2 => CoordinatorKind::Standalone,
        3 | 4 => CoordinatorKind::Etcd,
        _ => CoordinatorKind::Hosted,
    };
    let storage = match rng.range(0, 7) {
        0 => StorageKind::Tmpfs,
        1 => StorageKind::S3,
        _ => StorageKind::File,
    };
    // One run in three recovers from the store rather than from memory.
    let memory_copies = rng.range(0, 2) != 0;
    let count = rng.range(1, 3.min(world as u64 - 1)) as usize;
    let mut targets: Vec<usize> = (0..world).collect();
    let mut at_steps: Vec<u64> = Vec::new();
    let mut faults = Vec::new();
    let mut node_lost = false;
    let mut once: Vec<FaultKind> = Vec::new();
    for i in 0..count {
        let mut at_step = rng.range(6, steps - 10);
        while at_steps.contains(&at_step) {
            at_step = rng.range(6, steps - 10);
        }
        at_steps.push(at_step);
        let mut kinds = vec![FaultKind::Kill, FaultKind::Stop];
        // Set off by the trainer in the first generation only: the first fault. A
        // flipped bit needs replicas to be seen: an even world, two of each shard.
        if i == 0 {
            kinds.extend([
                FaultKind::DeviceError,
                FaultKind::KillInSave,
                FaultKind::Nan,
            ]);
            if world.is_multiple_of(2) {
                kinds.push(FaultKind::Sdc);
            }
        }
        if nodes == 2 && !node_lost {
            kinds.push(FaultKind::KillNode);
            if coordinator == CoordinatorKind::Standalone && storage != StorageKind::S3 {
                kinds.push(FaultKind::Partition);
            }
        }
        // Nodes in network namespaces reach the servers on the host side of their
        // bridge: a coordinator of their own (hosted) is reached by one node only.
        let namespaced = nodes == 1 || coordinator != CoordinatorKind::Hosted;
        // The network faults, which only some setups allow, are drawn three times as
        // often as the others where they are: each still comes up in a few percent
        // of the runs.
        if nodes == 2 && coordinator != CoordinatorKind::Hosted && !node_lost {
            kinds.extend([FaultKind::NetDelay, FaultKind::NetLoss].repeat(3));
        }
        match coordinator {
            CoordinatorKind::Standalone => kinds.push(FaultKind::KillCoordinator),
            CoordinatorKind::Etcd => {
                kinds.push(FaultKind::KillEtcdMember);
                if nodes == 2 && !node_lost {
                    kinds.extend([FaultKind::PartitionEtcd].repeat(3));
                }
            }
            CoordinatorKind::Hosted => {}
        }
        match storage {
            StorageKind::File => kinds.extend([FaultKind::Corrupt, FaultKind::IoError]),
            StorageKind::Tmpfs => kinds.extend([
                FaultKind::Corrupt,
                FaultKind::DiskFull,
                FaultKind::IoError,
                FaultKind::ReadOnly,
            ]),
            StorageKind::S3 => {
                kinds.extend([
                    FaultKind::StorageErrors,
                    FaultKind::StorageLatency,
                    FaultKind::StorageReset,
                    FaultKind::StorageCorrupt,
                ]);
                if namespaced {
                    kinds.extend([FaultKind::PartitionStore].repeat(3));
                }
            }
        }
        kinds.retain(|k| !once.contains(k));
        let kind = kinds[rng.range(0, kinds.len() as u64 - 1) as usize];
        let mut fault = Fault::at(kind, at_step);
        match kind {
            FaultKind::KillCoordinator | FaultKind::KillEtcdMember => {
                once.push(kind);
                fault.duration_ms = Some(rng.range(200, 2000));
                if kind == FaultKind::KillEtcdMember {
                    fault.member = Some(rng.range(0, 2) as usize);
                }
            }
            FaultKind::KillNode | FaultKind::Partition => {
                if kind == FaultKind::Partition {
                    once.extend(NETWORK_FAULTS);
                }
                // A hosted coordinator lives in node 0's launcher: losing that node
                // ends the job by design (docs/RELIABILITY.md), so only node 1 is
                // lost whole there.
                let node = match coordinator {
                    CoordinatorKind::Hosted => 1,
                    _ => rng.range(0, 1) as usize,
                };
                node_lost = true;
                targets.retain(|r| r / ranks != node);
                fault.node = Some(node);
                if kind == FaultKind::Partition {
                    // Longer than the heartbeat timeout: the control plane must notice.
                    fault.duration_ms = Some(rng.range(3000, 4000));
                } else if rng.range(0, 1) == 0 {
                    // Half the lost nodes come back, and the world grows again.
                    fault.duration_ms = Some(rng.range(500, 2000));
                }
            }
            FaultKind::StorageErrors | FaultKind::StorageLatency | FaultKind::StorageReset => {
                fault.count = Some(rng.range(1, 4) as usize);
                if kind == FaultKind::StorageErrors {
                    fault.status = Some(if rng.range(0, 1) == 0 { 500 } else { 503 });
                }
                if kind == FaultKind::StorageLatency {
                    fault.duration_ms = Some(rng.range(100, 1000));
                }
            }
            FaultKind::StorageCorrupt => {
                // Fewer bodies than a write's or a read's attempts (3): in flight, a
                // damaged body costs one more request, never a checkpoint.
                fault.count = Some(rng.range(1, 2) as usize);
                fault.how = Some(if rng.range(0, 1) == 0 { "get" } else { "put" }.into());
            }
            FaultKind::DiskFull | FaultKind::ReadOnly => {
                once.extend([FaultKind::DiskFull, FaultKind::ReadOnly]);
                // Shorter than --max-failed-saves (3) checkpoint intervals.
                fault.duration_ms = Some(if kind == FaultKind::DiskFull {
                    rng.range(100, 250)
                } else {
                    rng.range(200, 600)
                });
            }
            FaultKind::IoError => {
                once.push(kind);
                // Writes: shorter than --max-failed-saves (3) checkpoint intervals,
                // as a full disk. Reads fail only while a recovery reads the store.
                let read = rng.range(0, 1) == 0;
                fault.how = Some(if read { "read" } else { "write" }.into());
                fault.duration_ms = Some(if read {
                    rng.range(500, 1500)
                } else {
                    rng.range(200, 600)
                });
                if rng.range(0, 1) == 0 {
                    fault.rank = Some(rng.range(0, world as u64 - 1) as usize);
                }
            }
            FaultKind::NetDelay | FaultKind::NetLoss | FaultKind::PartitionStore => {
                // One network fault a run: each replaces the node's rules.
                once.extend(NETWORK_FAULTS);
                fault.node = Some(rng.range(0, nodes as u64 - 1) as usize);
                fault.duration_ms = Some(rng.range(1000, 3000));
                match kind {
                    FaultKind::NetDelay => fault.delay_ms = Some(rng.range(5, 40)),
                    // Little enough that TCP's retransmissions stay well inside the
                    // heartbeat timeout.
                    FaultKind::NetLoss => fault.percent = Some(rng.range(2, 10) as u32),
                    _ => {}
                }
            }
            FaultKind::PartitionEtcd => {
                once.extend(NETWORK_FAULTS);
                let node = rng.range(0, 1) as usize;
                node_lost = true;
                targets.retain(|r| r / ranks != node);
                fault.node = Some(node);
                // Longer than the node's lease, with the margin hangs on etcd get.
                fault.duration_ms = Some(rng.range(4500, 5500));
            }
            FaultKind::Corrupt => {
                once.push(kind);
                fault.how = Some(
                    if rng.range(0, 1) == 0 {
                        "bit-flip"
                    } else {
                        "truncate"
                    }
                    .into(),
                );
            }
            _ => {
                if targets.len() <= 1 {
                    break;
                }
                let rank = targets.remove(rng.range(0, targets.len() as u64 - 1) as usize);
                fault.rank = Some(rank);
                if kind == FaultKind::Stop {
                    // Longer than the heartbeat timeout (2 s) by a margin: a hang the
                    // control plane must find. On etcd the margin is wider: a lease
                    // outlives its time to live by up to an election timeout when
                    // the leader changes (an etcd member kill), and etcd rounds short
                    // leases up (soak seed 2026 run 18: a 3.5 s stop went unnoticed).
                    let margin = if coordinator == CoordinatorKind::Etcd {
                        1500
                    } else {
                        0
                    };
                    fault.duration_ms = Some(rng.range(3000, 4000) + margin);
                }
                if kind == FaultKind::KillInSave {
                    let stage = SAVE_STAGES[rng.range(0, SAVE_STAGES.len() as u64 - 1) as usize];
                    fault.stage = Some(stage.into());
                    if stage.contains("commit") {
                        // The committing rank: put the drawn rank back, hit rank 0.
                        targets.push(rank);
                        targets.retain(|&r| r != 0);
                        fault.rank = Some(0);
                    }
                }
            }
        }
        faults.push(fault);
    }
    // Faults the trainer sets off come first, before any other changes the
    // generation: a device error just before the earliest other fault, a save-stage
    // kill armed so that the save it stops (a multiple of 5) comes before it, a NaN
    // three steps before it (its rollback has a step to be found in), a flipped bit
    // in the last save before it.
    faults.sort_by_key(|f| (!f.kind.set_off_by_the_trainer(), f.at_step));
    let earliest = faults
        .iter()
        .filter(|f| !f.kind.set_off_by_the_trainer())
        .filter_map(|f| f.at_step)
        .min();
    if let Some(first) = faults.first_mut() {
        match (first.kind, earliest) {
            (FaultKind::DeviceError, Some(e)) => first.at_step = Some(e.saturating_sub(1).max(5)),
            (FaultKind::KillInSave, Some(e)) => first.at_step = Some(e.saturating_sub(5).max(1)),
            (FaultKind::Nan, Some(e)) => first.at_step = Some(e.saturating_sub(3).max(2)),
            _ => {}
        }
        if first.kind == FaultKind::Sdc {
            // A saved step (a multiple of 5), before any other fault.
            let before = earliest.unwrap_or(steps).min(steps) - 1;
            first.at_step = Some((before / 5 * 5).max(5));
        }
    }
    let replicas = if faults.iter().any(|f| f.kind == FaultKind::Sdc) {
        2
    } else {
        1
    };
    // A node cut off from etcd trains on with the others until its lease ends: when
    // the job finishes first, nothing was lost (soak seed 2027 run 76). It may cost a
    // generation (the oracle allows it), but is not expected to.
    let recovers = faults.iter().any(|f| {
        matches!(
            f.kind,
            FaultKind::Kill
                | FaultKind::Stop
                | FaultKind::KillNode
                | FaultKind::DeviceError
                | FaultKind::KillInSave
                | FaultKind::Partition
        )
    });
    Scenario {
        description: format!("soak seed {seed} run {run}"),
        ranks,
        nodes,
        min_ranks: 1,
        max_restarts: 0,
        preset: "tiny".into(),
        seed: 7,
        steps,
        ckpt_every: 5,
        snapshot_every: 0,
        host_memory_budget: None,
        step_pause_ms: 40,
        heartbeat_timeout_secs: 2,
        rdzv_connect_timeout_secs: None,
        coordinator,
        storage,
        disk_mib: (storage == StorageKind::Tmpfs).then_some(16),
        memory_copies,
        replicas,
        expect: Expect {
            // Storage, corruption and control-plane faults alone change no generation.
            recoveries_at_least: recovers.then_some(1),
            ..Expect::default()
        },
        faults,
        script: None,
        batch: None,
    }
}

/// Run `run` of `seed` ([`draw`]) with the Python trainer `script` instead of
/// `ckpt-train`: what only `ckpt-train` has is replaced by its nearest equivalent
/// from outside. A device error becomes a kill of its rank at its step; a kill at a
/// save stage becomes a kill of its rank while the save it aimed at is in flight
/// (`at_save`); the pause per step goes (the Python steps are slower), and the
/// ranks keep their in-memory copies, since the Python trainer's command line has
/// no switch to turn them off (a `corrupt` fault there is found by verify).
pub fn draw_for_script(seed: u64, run: u64, script: &str) -> Scenario {
    let mut scenario = draw(seed, run);
    scenario.script = Some(script.into());
    scenario.replicas = 1;
    scenario.step_pause_ms = 0;
    scenario.memory_copies = true;
    let (every, steps) = (scenario.ckpt_every, scenario.steps);
    for fault in &mut scenario.faults {
        match fault.kind {
            // What ckpt-train's failpoints poison, the Python trainer cannot: a kill
            // of that rank at that step instead.
            FaultKind::DeviceError | FaultKind::Nan | FaultKind::Sdc => {
                fault.kind = FaultKind::Kill
            }
            FaultKind::KillInSave => {
                let at = fault.at_step.unwrap_or(1);
                let save = at.div_ceil(every) * every;
                fault.kind = FaultKind::Kill;
                fault.stage = None;
                if save < steps {
                    fault.at_step = None;
                    fault.at_save = Some(save);
                }
            }
            _ => {}
        }
    }
    scenario
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_valid_repeatable_and_varied() {
        let mut kinds = std::collections::BTreeSet::new();
        for run in 0..1000 {
            let s = draw(42, run);
            s.validate()
                .unwrap_or_else(|e| panic!("run {run}: {e}\n{}", s.to_toml()));
            assert_eq!(s, draw(42, run), "run {run} is drawn the same again");
            assert!(!s.faults.is_empty() && s.faults.len() <= 3);
            kinds.extend(s.faults.iter().map(|f| format!("{:?}", f.kind)));
        }
        assert_eq!(
            kinds.len(),
            22,
            "every fault kind but a lost part is drawn: {kinds:?}"
        );
        assert_ne!(draw(42, 0), draw(43, 0));
    }

    #[test]
    fn draws_for_a_python_script_are_valid() {
        let script = "python/examples/train_gpt.py";
        for run in 0..300 {
            let s = draw_for_script(42, run, script);
            s.validate()
                .unwrap_or_else(|e| panic!("run {run}: {e}\n{}", s.to_toml()));
            assert_eq!(s.script.as_deref(), Some(script));
            assert_eq!(Scenario::parse(&s.to_toml()).unwrap(), s);
        }
    }
}
