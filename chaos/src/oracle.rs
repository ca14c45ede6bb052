//! The oracle: what every run must show, whatever its faults.
//!
//! - every committed checkpoint verifies (`ckpt verify` on each);
//! - no commit ever seen disappears (retention is off in chaos runs, so a commit that
//!   goes missing was lost);
//! - the final checkpoint equals, bitwise, the one of a failure-free run of the same
//!   configuration (the trainer's deterministic mode makes the weights independent of
//!   the world size and of the recovery history). The failure-free run is computed once
//!   per configuration and cached. The Python trainer's float sums depend on the
//!   world size, so its reference replays the run's schedule instead: the same
//!   world sizes from the same steps, each a fixed-world launch resumed from the
//!   commit the previous one left, one launch per change of world
//!   ([`python_reference`]);
//! - (the Python trainer) no sample was skipped or repeated: every committed step's
//!   saved data cursors are step × batch ([`check_cursors`]);
//! - (`sdc` and `nan` faults) every poison is caught at the save that carries it: the
//!   commit judged unhealthy, naming the poisoned rank, or never made; a NaN rolls
//!   the world back; and no resume, whatever its cause, loads an unhealthy commit
//!   ([`check_health`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ckpt::CheckpointReader;
use ckpt::storage::Store;
use ckpt::tools::diff::{DiffOptions, diff};
use ckpt::tools::verify::{VerifyOptions, verify};

use crate::run::train_args;
use crate::scenario::Scenario;

/// A runtime for the harness's own store calls (it is otherwise synchronous).
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// The committed steps, by the catalog's one definition of a commit (a record whose
/// slot holds a manifest), as every command and every rank sees them.
fn committed_steps(runtime: &tokio::runtime::Runtime, store: &Store) -> Result<Vec<u64>, String> {
    runtime
        .block_on(ckpt::catalog::newest_commit_per_step(store))
        .map(|c| c.iter().map(|c| c.step).collect())
        .map_err(|e| e.to_string())
}

/// Lists the commit log every `every` while a run goes on, keeping every step ever
/// seen committed.
pub struct CommitWatcher {
    seen: Arc<Mutex<BTreeSet<u64>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CommitWatcher {
    /// Starts watching `store`.
    pub fn start(store: Store, every: Duration) -> Result<CommitWatcher, String> {
        let seen = Arc::new(Mutex::new(BTreeSet::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (seen, stop) = (seen.clone(), stop.clone());
            std::thread::spawn(move || {
                let runtime = runtime();
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(steps) = committed_steps(&runtime, &store) {
                        seen.lock().unwrap_or_else(|p| p.into_inner()).extend(steps);
                    }
                    std::thread::sleep(every);
                }
            })
        };
        Ok(CommitWatcher {
            seen,
            stop,
            thread: Some(thread),
        })
    }

    /// Stops watching; returns every step seen committed.
    pub fn finish(mut self) -> BTreeSet<u64> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// What the oracle found.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Judgement {
    /// Committed checkpoints at the end.
    pub commits: usize,
    /// Of those, how many verified.
    pub verified: usize,
    /// Steps seen committed during the run and missing at the end.
    pub lost: Vec<u64>,
    /// The final step of the run's newest commit.
    pub final_step: Option<u64>,
    /// Commits the scenario damaged on purpose (`corrupt` faults).
    pub corrupted: usize,
    /// Of those, how many `verify` found damaged (the goal: all of them).
    pub detected: usize,
    /// Damaged commits that a later save of the same step replaced.
    pub superseded: usize,
    /// Bitwise equal to the failure-free run.
    pub identical: Option<bool>,
    /// Committed steps whose saved data cursors were checked (the Python trainer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cursors_checked: Option<usize>,
    /// Poisons the trainer's failpoints put in (`sdc`, `nan`).
    pub poisoned: usize,
    /// Of those, how many the save that carried them caught (its commit unhealthy
    /// and naming the rank, or refused).
    pub caught: usize,
    /// Resumes whose commit the oracle checked for health.
    pub resumes_checked: usize,
    /// Resumes from an in-memory snapshot whose lost steps were checked.
    #[serde(skip_serializing_if = "is_zero")]
    pub snapshot_resumes: usize,
    /// The largest host-memory peak any rank reported (with a budget to check).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_peak: Option<u64>,
    /// Everything wrong, in words.
    pub problems: Vec<String>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The memory tier's checks (`snapshot_every`, `host_memory_budget`):
///
/// - no step is trained twice beyond the snapshot interval: each resume from a
///   snapshot started at most `snapshot_every + 1` steps before the newest step
///   rank 0 had reported (the snapshot of step S is committed at step S + 1's
///   boundary, so a failure before the next one's commit loses at most the
///   interval and that step);
/// - the budget was never exceeded: every rank that finished reported its
///   checkpointing's peak (`final host_bytes_held`), and none is over the budget
///   (the resident sets the harness sampled are in the run's report, for a reader:
///   they include the process's own memory, which no budget bounds).
///
/// The final weights' bitwise comparison with the failure-free run
/// ([`judge`]) covers resumes from snapshots as it does resumes from the store:
/// deterministic mode makes them independent of where and on how many ranks the
/// run resumed.
pub fn check_memory_tier(scenario: &Scenario, observed: &crate::run::Observed, j: &mut Judgement) {
    if scenario.snapshot_every > 0 {
        let bound = scenario.snapshot_every + 1;
        for &(reported, resumed) in &observed.snapshot_resumes {
            j.snapshot_resumes += 1;
            if reported.saturating_sub(resumed) > bound {
                j.problems.push(format!(
                    "a resume from the snapshot of step {resumed} trains again the steps up to {reported}: more than the snapshot interval and one ({bound})"
                ));
            }
        }
    }
    if let Some(budget) = scenario.host_memory_budget {
        j.host_peak = observed.host_peaks.iter().map(|p| p.peak).max();
        if observed.host_peaks.is_empty() {
            j.problems.push(format!(
                "no rank reported its host memory peak, to check against the budget of {budget} bytes"
            ));
        }
        for p in observed.host_peaks.iter().filter(|p| p.peak > budget) {
            j.problems.push(format!(
                "rank process {} held {} bytes of host memory at its peak, over the budget of {budget}",
                p.label, p.peak
            ));
        }
    }
}

/// A commit damaged on purpose: its step and directory.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Damaged {
    /// The step.
    pub step: u64,
    /// The commit's directory (`step-N/gG-RUN`).
    pub dir: String,
}

/// Judges the checkpoints in `store` against the failure-free `reference` directory
/// (`None`: there is none to compare with, and the caller says why).
/// `damaged` are the commits the scenario corrupted on purpose: each must fail
/// verification (unless a later save of its step replaced it), and no other may.
pub fn judge(
    store: &Store,
    seen: &BTreeSet<u64>,
    damaged: &[Damaged],
    reference: Option<&Path>,
    steps: u64,
) -> Judgement {
    let mut j = Judgement::default();
    let runtime = runtime();
    let url = store.url().to_string();
    let commits = match runtime.block_on(ckpt::catalog::newest_commit_per_step(store)) {
        Ok(c) => c,
        Err(e) => {
            j.problems
                .push(format!("listing the commits of {url}: {e}"));
            return j;
        }
    };
    // The commit that counts for each step: its newest (the catalog's).
    let newest: std::collections::BTreeMap<u64, &str> =
        commits.iter().map(|c| (c.step, c.dir.as_str())).collect();
    let present: BTreeSet<u64> = newest.keys().copied().collect();
    j.commits = present.len();
    j.lost = seen.difference(&present).copied().collect();
    if !j.lost.is_empty() {
        j.problems
            .push(format!("committed steps lost: {:?}", j.lost));
    }
    j.corrupted = damaged.len();
    for &step in &present {
        let on_purpose = damaged
            .iter()
            .any(|d| d.step == step && newest.get(&step) == Some(&d.dir.as_str()));
        let verdict = runtime.block_on(verify(store, step, &VerifyOptions::default(), &|_| {}));
        if on_purpose {
            match verdict {
                Ok(report) if report.ok => j.problems.push(format!(
                    "step {step} was corrupted on purpose and verify did not notice"
                )),
                Ok(_) => j.detected += 1,
                Err(e) => j.problems.push(format!("step {step}: verify failed: {e}")),
            }
            continue;
        }
        match verdict {
            Ok(report) if report.ok => j.verified += 1,
            Ok(report) => j.problems.push(format!(
                "step {step} does not verify: {}",
                report
                    .faults
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            )),
            Err(e) => j.problems.push(format!("step {step}: verify failed: {e}")),
        }
    }
    j.superseded = damaged
        .iter()
        .filter(|d| newest.get(&d.step) != Some(&d.dir.as_str()))
        .count();
    j.final_step = present.last().copied();
    if j.final_step != Some(steps) {
        j.problems.push(format!(
            "training did not commit its final step {steps} (newest commit: {:?})",
            j.final_step
        ));
        return j;
    }
    let Some(reference) = reference else {
        return j;
    };
    let compared = runtime.block_on(async {
        let reference = Store::from_url(&file_url(reference)).map_err(|e| e.to_string())?;
        let a = CheckpointReader::open(store, Some(steps))
            .await
            .map_err(|e| e.to_string())?;
        let b = CheckpointReader::open(&reference, Some(steps))
            .await
            .map_err(|e| e.to_string())?;
        diff(&a, &b, &DiffOptions::default(), &|_| {})
            .await
            .map_err(|e| e.to_string())
    });
    match compared {
        Ok(report) => {
            j.identical = Some(report.identical);
            if !report.identical {
                let differing: Vec<&str> = report
                    .tensors
                    .iter()
                    .filter(|t| t.status != "identical")
                    .map(|t| t.name.as_str())
                    .collect();
                j.problems.push(format!(
                    "final weights differ from the failure-free run: {differing:?} {:?}",
                    report.state_differences
                ));
            }
        }
        Err(e) => j
            .problems
            .push(format!("comparing with the failure-free run: {e}")),
    }
    j
}

/// `file://` URL of a directory.
pub fn file_url(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

/// The failure-free run of `scenario`'s configuration (preset, seed, steps,
/// interval), trained once on 2 ranks and kept under `cache`.
pub fn reference(scenario: &Scenario, trainer: &Path, cache: &Path) -> Result<PathBuf, String> {
    let dir = cache.join(format!(
        "reference-{}-seed{}-steps{}-every{}",
        scenario.preset, scenario.seed, scenario.steps, scenario.ckpt_every
    ));
    let done = dir.join(".complete");
    if done.exists() {
        return Ok(dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut plain = scenario.clone();
    plain.faults.clear();
    plain.step_pause_ms = 0;
    let output = Command::new(trainer)
        .args(["launch", "--nproc", "2", "--"])
        .args(train_args(&plain, &file_url(&dir)))
        .env("RUST_LOG", "warn")
        .output()
        .map_err(|e| format!("{}: {e}", trainer.display()))?;
    if !output.status.success() {
        return Err(format!(
            "the failure-free run failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    std::fs::write(&done, b"").map_err(|e| format!("{}: {e}", done.display()))?;
    Ok(dir)
}

/// The no-skip, no-repeat check of the Python trainer: every committed step's rank
/// states (every saved rank's) hold `data.cursor` = step × `batch`, the index of the
/// next global sample (the value as `ckpt.torch` writes it: JSON). Returns the steps
/// checked and what is wrong.
pub fn check_cursors(store: &Store, batch: u64) -> (usize, Vec<String>) {
    let runtime = runtime();
    let mut problems = Vec::new();
    let commits = match runtime.block_on(ckpt::catalog::newest_commit_per_step(store)) {
        Ok(c) => c,
        Err(e) => return (0, vec![format!("listing the commits: {e}")]),
    };
    let mut checked = 0;
    for commit in &commits {
        let step = commit.step;
        let states = runtime.block_on(async {
            let reader = CheckpointReader::open(store, Some(step)).await?;
            reader.rank_states().await
        });
        let states = match states {
            Ok(s) => s,
            Err(e) => {
                problems.push(format!("step {step}: reading the rank states: {e}"));
                continue;
            }
        };
        let expected = step * batch;
        let wrong: Vec<String> = states
            .iter()
            .filter_map(|(rank, state)| {
                let value = state.get("data.cursor");
                let cursor = match value {
                    Some(ckpt::StateValue::Json(v)) => v.as_u64(),
                    _ => None,
                };
                (cursor != Some(expected)).then(|| match value {
                    Some(ckpt::StateValue::Json(v)) => format!("rank {rank}: {v}"),
                    Some(other) => format!("rank {rank}: {other:?}"),
                    None => format!("rank {rank}: none saved"),
                })
            })
            .collect();
        checked += 1;
        if !wrong.is_empty() {
            problems.push(format!(
                "step {step}: data cursors are not {step} × {batch} = {expected} (a sample skipped or repeated): {}",
                wrong.join(", ")
            ));
        }
    }
    (checked, problems)
}

/// The fixed-world launches that replay `schedule` (first step, world size of each
/// generation that trained): (from, until, world), each until the next one's first
/// step, the last to `steps`; a generation that committed nothing new before the
/// next one started (until <= from) is left out, and generations in a row on the
/// same world are one launch. That is what ckpt promises (a resume on the same
/// world continues bitwise as if never stopped), so the replay is not merely cheaper
/// by a torch import per rank: it checks that promise too.
pub fn reference_plan(schedule: &[(u64, usize)], steps: u64) -> Vec<(u64, u64, usize)> {
    let mut plan: Vec<(u64, u64, usize)> = Vec::new();
    for (i, &(from, world)) in schedule.iter().enumerate() {
        let until = schedule.get(i + 1).map_or(steps, |next| next.0);
        if until <= from {
            continue;
        }
        match plan.last_mut() {
            Some(last) if last.2 == world && last.1 == from => last.1 = until,
            _ => plan.push((from, until, world)),
        }
    }
    plan
}

/// The failure-free reference of a Python trainer's run with `schedule`: each entry
/// of [`reference_plan`] a fixed-world `ckpt launch --nproc W -- PYTHON SCRIPT …
/// --steps UNTIL` into one directory, each resuming from the commit the previous one
/// left. Cached under `cache`, keyed by the script's contents, seed, steps,
/// interval, batch and the schedule.
pub fn python_reference(
    scenario: &Scenario,
    schedule: &[(u64, usize)],
    ckpt: &Path,
    python: &Path,
    script: &Path,
    cache: &Path,
) -> Result<PathBuf, String> {
    use std::hash::{Hash, Hasher};
    if schedule.first().is_none_or(|first| first.0 != 0) {
        return Err(format!(
            "no schedule to replay: rank 0 reported no `gen 1: from scratch` line first ({schedule:?})"
        ));
    }
    let plan = reference_plan(schedule, scenario.steps);
    let source = std::fs::read(script).map_err(|e| format!("{}: {e}", script.display()))?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut hasher);
    let stem = script
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let worlds: Vec<String> = plan
        .iter()
        .map(|(from, _, world)| format!("{world}@{from}"))
        .collect();
    let dir = cache.join(format!(
        "reference-py-{stem}-{:016x}-seed{}-steps{}-every{}-batch{}-{}",
        hasher.finish(),
        scenario.seed,
        scenario.steps,
        scenario.ckpt_every,
        scenario.batch(),
        worlds.join("-")
    ));
    let done = dir.join(".complete");
    if done.exists() {
        return Ok(dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for &(from, until, world) in &plan {
        let output = Command::new(ckpt)
            .args(["launch", "--nproc", &world.to_string(), "--"])
            .arg(python)
            .arg(script)
            .args(crate::run::python_args(scenario, &file_url(&dir), until))
            .env("RUST_LOG", "warn")
            .output()
            .map_err(|e| format!("{}: {e}", ckpt.display()))?;
        if !output.status.success() {
            return Err(format!(
                "the failure-free reference (steps {from}..{until} on {world} ranks) failed:\n{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    std::fs::write(&done, b"").map_err(|e| format!("{}: {e}", done.display()))?;
    Ok(dir)
}

/// The checks of a run's poisons and resumes: each poison (`observed.poisoned`,
/// deduplicated) is caught by the first commit of its step that the job's first
/// generation made (its run id ends in `-e1`; the trainer's failpoints fire in that
/// generation only): judged unhealthy, naming the poisoned rank (a replica mismatch
/// it wrote or disagreed in, for `sdc`; a tensor with non-finite elements in its
/// boxes, for `nan`), or no such commit (the save was refused or never completed).
/// A NaN is also followed by a rollback from its step, unless a recovery (a new
/// generation) came first. And every commit a resume loaded (`resumed_dirs`) is of
/// acceptable health. Adds what it checked to `j`, and what is wrong to its
/// problems.
pub fn check_health(store: &Store, observed: &crate::run::Observed, j: &mut Judgement) {
    let runtime = runtime();
    if observed.poisoned.is_empty() && observed.resumed_dirs.is_empty() {
        return;
    }
    let commits = match runtime.block_on(ckpt::catalog::commits(store)) {
        Ok(c) => c,
        Err(e) => {
            j.problems.push(format!("listing the commits: {e}"));
            return;
        }
    };
    let manifest = |commit: &ckpt::Commit| {
        runtime
            .block_on(ckpt::catalog::read_commit(store, commit))
            .map_err(|e| format!("reading commit {}: {e}", commit.dir))
    };
    let mut poisons = observed.poisoned.clone();
    poisons.dedup();
    j.poisoned = poisons.len();
    for poison in &poisons {
        let (kind, rank, step) = (poison.kind.as_str(), poison.rank, poison.step);
        let what = format!("{kind} on rank {rank} at step {step}");
        let first = commits
            .iter()
            .find(|c| c.step == step && c.attempt().is_some_and(|a| a.run.ends_with("-e1")));
        match first.map(manifest) {
            // Refused, or the save never completed: nothing unhealthy to resume.
            None => j.caught += 1,
            Some(Err(e)) => j.problems.push(format!("{what}: {e}")),
            Some(Ok(m)) => {
                let named = m.health.as_ref().is_some_and(|h| {
                    !h.healthy
                        && match kind {
                            "sdc" => h
                                .replica_mismatches
                                .iter()
                                .any(|r| r.written_by == rank || r.disagree.contains(&rank)),
                            _ => h.nonfinite.iter().any(|n| n.ranks.contains(&rank)),
                        }
                });
                if named {
                    j.caught += 1;
                } else {
                    j.problems.push(format!(
                        "{what}: its commit {} is not judged unhealthy naming the rank ({}: {:?})",
                        m.dir(),
                        m.health_status().as_str(),
                        m.health_status().reasons()
                    ));
                }
            }
        }
        if kind == "nan"
            && observed.recoveries.is_empty()
            && !observed.rollbacks.iter().any(|&(from, _)| from == step)
        {
            j.problems.push(format!(
                "{what}: no rollback from step {step} followed (rollbacks: {:?})",
                observed.rollbacks
            ));
        }
    }
    for dir in &observed.resumed_dirs {
        j.resumes_checked += 1;
        let Some(commit) = commits.iter().find(|c| &c.dir == dir) else {
            j.problems
                .push(format!("a resume loaded {dir}, which is not a commit"));
            continue;
        };
        match manifest(commit) {
            Ok(m) if !m.health_status().acceptable() => j.problems.push(format!(
                "a resume loaded the unhealthy commit {dir}: {:?}",
                m.health_status().reasons()
            )),
            Ok(_) => {}
            Err(e) => j.problems.push(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_resume_too_far_back_and_a_peak_over_the_budget_are_problems() {
        let mut scenario = Scenario::parse(
            "ranks = 4\nmin_ranks = 2\nsteps = 30\nckpt_every = 10\nsnapshot_every = 2\nhost_memory_budget = 1000",
        )
        .unwrap();
        let mut observed = crate::run::Observed {
            snapshot_resumes: vec![(15, 12), (21, 14)],
            ..Default::default()
        };
        observed.host_peaks.push(crate::run::HostPeak {
            label: 1,
            peak: 900,
            budget: Some(1000),
        });
        let mut j = Judgement::default();
        check_memory_tier(&scenario, &observed, &mut j);
        assert_eq!(j.snapshot_resumes, 2);
        assert_eq!(j.problems.len(), 1, "{:?}", j.problems);
        assert!(
            j.problems[0].contains("snapshot of step 14"),
            "{:?}",
            j.problems
        );
        observed.host_peaks[0].peak = 1001;
        scenario.snapshot_every = 0;
        let mut j = Judgement::default();
        check_memory_tier(&scenario, &observed, &mut j);
        assert_eq!(j.problems.len(), 1, "{:?}", j.problems);
        assert!(
            j.problems[0].contains("over the budget of 1000"),
            "{:?}",
            j.problems
        );
        // No rank reported: nothing shows the budget held.
        observed.host_peaks.clear();
        let mut j = Judgement::default();
        check_memory_tier(&scenario, &observed, &mut j);
        assert!(
            j.problems[0].contains("no rank reported"),
            "{:?}",
            j.problems
        );
    }

    #[test]
    fn the_reference_replays_the_schedule_one_launch_per_change_of_world() {
        assert_eq!(reference_plan(&[(0, 4)], 60), vec![(0, 60, 4)]);
        assert_eq!(
            reference_plan(&[(0, 4), (20, 3)], 60),
            vec![(0, 20, 4), (20, 60, 3)]
        );
        // Generation 2 failed before it committed: generation 3 resumed where it did.
        assert_eq!(
            reference_plan(&[(0, 4), (20, 3), (20, 2), (40, 4)], 60),
            vec![(0, 20, 4), (20, 40, 2), (40, 60, 4)]
        );
        // A generation formed after the final commit trains nothing.
        assert_eq!(reference_plan(&[(0, 4), (60, 3)], 60), vec![(0, 60, 4)]);
        // Generations in a row on one world are one launch, also across one that
        // added nothing.
        assert_eq!(
            reference_plan(&[(0, 2), (15, 2), (30, 3)], 60),
            vec![(0, 30, 2), (30, 60, 3)]
        );
        assert_eq!(
            reference_plan(&[(0, 4), (20, 3), (20, 4), (40, 4)], 60),
            vec![(0, 60, 4)]
        );
    }
}
