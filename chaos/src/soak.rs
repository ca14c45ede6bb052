//! Seeded random scenarios: `ckpt-chaos soak --seed S --runs N`.
//!
//! Run `i` of seed `S` is drawn from its own stream (`S` and `i` mixed), so any one run
//! can be drawn again alone, and a failure is written out as a scenario file that
//! replays it with `ckpt-chaos run`.

use crate::scenario::{CoordinatorKind, Expect, Fault, FaultKind, Scenario, StorageKind};

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

/// Draws run `run` of `seed`: tiny preset, one or two nodes, one to three faults on
/// distinct ranks (or a node), at distinct steps.
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
    let count = rng.range(1, 3.min(world as u64 - 1)) as usize;
    let mut targets: Vec<usize> = (0..world).collect();
    let mut at_steps: Vec<u64> = Vec::new();
    let mut faults = Vec::new();
    let mut node_lost = false;
    // One run in four has a standalone coordinator, which a fault may kill.
    let coordinator = if rng.range(0, 3) == 0 {
        CoordinatorKind::Standalone
    } else {
        CoordinatorKind::Hosted
    };
    let mut coordinator_killed = false;
    for i in 0..count {
        let mut at_step = rng.range(6, steps - 10);
        while at_steps.contains(&at_step) {
            at_step = rng.range(6, steps - 10);
        }
        at_steps.push(at_step);
        // The trainer's device-error failpoint acts in the first generation only:
        // drawn only as the first fault.
        let kinds: &[FaultKind] = match (i, nodes, node_lost) {
            (0, 2, _) => &[
                FaultKind::Kill,
                FaultKind::Stop,
                FaultKind::KillNode,
                FaultKind::DeviceError,
            ],
            (0, _, _) => &[FaultKind::Kill, FaultKind::Stop, FaultKind::DeviceError],
            (_, 2, false) => &[FaultKind::Kill, FaultKind::Stop, FaultKind::KillNode],
            _ => &[FaultKind::Kill, FaultKind::Stop],
        };
        let mut kinds = kinds.to_vec();
        if coordinator == CoordinatorKind::Standalone && !coordinator_killed {
            kinds.push(FaultKind::KillCoordinator);
        }
        let kind = kinds[rng.range(0, kinds.len() as u64 - 1) as usize];
        let mut fault = Fault::at(kind, at_step);
        if kind == FaultKind::KillCoordinator {
            coordinator_killed = true;
            fault.duration_ms = Some(rng.range(200, 2000));
        } else if kind == FaultKind::KillNode {
            // A hosted coordinator lives in node 0's launcher: losing that node ends
            // the job by design (docs/RELIABILITY.md), so only node 1 is lost whole.
            let node = match coordinator {
                CoordinatorKind::Hosted => 1,
                CoordinatorKind::Standalone | CoordinatorKind::Etcd => rng.range(0, 1) as usize,
            };
            node_lost = true;
            targets.retain(|r| r / ranks != node);
            fault.node = Some(node);
        } else {
            if targets.len() <= 1 {
                break;
            }
            let rank = targets.remove(rng.range(0, targets.len() as u64 - 1) as usize);
            fault.rank = Some(rank);
            if kind == FaultKind::Stop {
                // Longer than the heartbeat timeout (2 s) by a margin: a hang the
                // control plane must find.
                fault.duration_ms = Some(rng.range(3000, 4000));
            }
        }
        faults.push(fault);
    }
    // Device errors come first (the failpoint's generation).
    faults.sort_by_key(|f| (f.kind != FaultKind::DeviceError, f.at_step));
    if let Some(pos) = faults.iter().position(|f| f.kind == FaultKind::DeviceError) {
        let earliest = faults.iter().filter_map(|f| f.at_step).min().unwrap_or(6);
        faults[pos].at_step = Some(earliest.saturating_sub(1).max(5));
    }
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
        step_pause_ms: 40,
        heartbeat_timeout_secs: 2,
        coordinator,
        storage: StorageKind::File,
        disk_mib: None,
        memory_copies: true,
        expect: Expect {
            // A coordinator that dies and comes back alone changes no generation.
            recoveries_at_least: faults
                .iter()
                .any(|f| f.kind != FaultKind::KillCoordinator)
                .then_some(1),
            ..Expect::default()
        },
        faults,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_valid_repeatable_and_varied() {
        let mut kinds = std::collections::BTreeSet::new();
        for run in 0..300 {
            let s = draw(42, run);
            s.validate()
                .unwrap_or_else(|e| panic!("run {run}: {e}\n{}", s.to_toml()));
            assert_eq!(s, draw(42, run), "run {run} is drawn the same again");
            assert!(!s.faults.is_empty() && s.faults.len() <= 3);
            kinds.extend(s.faults.iter().map(|f| format!("{:?}", f.kind)));
        }
        assert_eq!(kinds.len(), 5, "every fault kind is drawn: {kinds:?}");
        assert_ne!(draw(42, 0), draw(43, 0));
    }
}
