//! `ckpt-chaos`: fault scenarios against the reference trainer, judged by an oracle.
//!
//! The harness drives `ckpt-train` and the checkpoint store from outside, as an
//! operator's worst day would: it kills, stops and loses ranks and nodes while a job
//! trains, then checks what must hold whatever happened (see [`oracle`]): training
//! reached its final step, every committed checkpoint verifies, no commit was lost,
//! and the final weights equal a failure-free run's bitwise. A [`scenario`] is a TOML
//! file; [`run`] executes it; [`Report`] is the verdict, for people and for scripts.
//! A scenario may name a Python script as its trainer (`script`): it runs under
//! `ckpt launch`, and the oracle also checks its data cursors and compares it with a
//! reference that replays its schedule of world sizes.

pub mod env;
pub mod netns;
pub mod oracle;
pub mod plot;
pub mod run;
pub mod scenario;
pub mod shim;
pub mod soak;
pub mod storage_proxy;

/// The private etcd cluster of scenarios on the etcd backend, shared with the tests
/// that kill etcd members.
pub use ckpt_testkit::etcd;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use scenario::{FaultKind, Scenario};

/// Where a run finds its tools and keeps its files.
#[derive(Debug, Clone)]
pub struct Options {
    /// `ckpt-train`.
    pub trainer: PathBuf,
    /// Failure-free runs, kept per configuration.
    pub cache: PathBuf,
    /// Scratch space of the run (its checkpoints).
    pub scratch: PathBuf,
    /// Bound on the run.
    pub timeout: Duration,
    /// Where to write each run's log (every line its launchers printed).
    pub logs: Option<PathBuf>,
    /// Where to draw the run (SVG: world size, steps per second and loss over time).
    pub plot: Option<PathBuf>,
}

/// The verdict on one run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The scenario file (or `-`).
    pub scenario: String,
    /// `pass`, `fail`, or `skip` (the machine lacks what the scenario needs).
    pub verdict: &'static str,
    /// Why it failed or was skipped (empty on a pass).
    pub reasons: Vec<String>,
    /// What the run showed.
    pub observed: run::Observed,
    /// What the oracle found.
    pub judgement: oracle::Judgement,
    /// The last lines the launchers printed, when the run failed (all of them are
    /// kept with `--logs`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub log_tail: Vec<String>,
}

impl Report {
    /// True on a pass.
    pub fn passed(&self) -> bool {
        self.verdict == "pass"
    }

    /// True when the scenario could not run here.
    pub fn skipped(&self) -> bool {
        self.verdict == "skip"
    }

    fn skipped_because(name: &str, why: String) -> Report {
        Report {
            scenario: name.to_string(),
            verdict: "skip",
            reasons: vec![why],
            observed: Default::default(),
            judgement: Default::default(),
            log_tail: Vec::new(),
        }
    }

    /// A few lines for a person.
    pub fn summary(&self) -> String {
        if self.skipped() {
            return format!("{}: SKIPPED: {}", self.scenario, self.reasons.join("; "));
        }
        let mut out = format!(
            "{}: {} in {:.1} s",
            self.scenario,
            self.verdict.to_uppercase(),
            self.observed.wall_s
        );
        for f in &self.observed.fired {
            out += &format!(
                "\n  fault: {} {} at step {} (+{} ms)",
                f.kind, f.target, f.at_step, f.at_ms
            );
        }
        for r in &self.observed.recoveries {
            let detect = r
                .detect_ms
                .map(|d| format!("{d} ms"))
                .unwrap_or_else(|| "-".into());
            out += &format!(
                "\n  recovery: generation {} on {} rank(s): detect {detect}, abort {} ms, re-form {} ms, load {} ms, first step {} ms ({})",
                r.generation, r.world, r.abort_ms, r.reform_ms, r.load_ms, r.first_step_ms, r.cause
            );
        }
        if let Some(worlds) = ranks_training(&self.observed.worlds) {
            out += &format!("\n  ranks training: {worlds}");
        }
        if !self.observed.schedule.is_empty() {
            let schedule: Vec<String> = self
                .observed
                .schedule
                .iter()
                .map(|(from, world)| format!("{world} ranks from step {from}"))
                .collect();
            out += &format!(
                "\n  schedule (replayed by the reference): {}",
                schedule.join(", ")
            );
        }
        if let Some(g) = self.observed.goodput {
            out += &format!("\n  goodput: {:.0} %", g * 100.0);
        }
        if let Some(s) = &self.observed.storage {
            out += &format!(
                "\n  storage proxy: {} requests, {} answered with errors, {} delayed, {} reset mid-body, {} parts lost",
                s.requests, s.errors, s.delayed, s.resets, s.lost_parts
            );
        }
        let j = &self.judgement;
        if j.corrupted > 0 {
            out += &format!(
                "\n  corrupted on purpose: {}; found by verify: {}; replaced by a later save: {}",
                j.corrupted, j.detected, j.superseded
            );
        }
        out += &format!(
            "\n  checkpoints: {} committed, {} verified, {} lost; final weights {}",
            j.commits,
            j.verified,
            j.lost.len(),
            match j.identical {
                Some(true) => "bitwise identical to the failure-free run",
                Some(false) => "DIFFER from the failure-free run",
                None => "not compared",
            }
        );
        if j.poisoned > 0 || !self.observed.rollbacks.is_empty() {
            out += &format!(
                "\n  poisoned by sdc or nan: {}; caught at their saves: {}; rollbacks: {}",
                j.poisoned,
                j.caught,
                self.observed.rollbacks.len()
            );
        }
        if j.resumes_checked > 0 {
            out += &format!("\n  resumes checked for health: {}", j.resumes_checked);
        }
        if let Some(n) = j.cursors_checked {
            out += &format!("\n  data cursors checked on {n} committed steps");
        }
        for reason in &self.reasons {
            out += &format!("\n  reason: {reason}");
        }
        out
    }
}

/// The world sizes a run went through, one entry per change: a generation that
/// replaced a lost rank at once, or one seen twice, is no change. The summary's
/// `ranks training` line and the plot's title say the same from this one rule.
pub(crate) fn world_changes(worlds: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let mut changes: Vec<usize> = Vec::new();
    for world in worlds {
        if changes.last() != Some(&world) {
            changes.push(world);
        }
    }
    changes
}

/// The summary's `ranks training` line (`4 → 3 → 1 → 3`); `None` when no
/// generation started.
fn ranks_training(worlds: &[usize]) -> Option<String> {
    let shown: Vec<String> = world_changes(worlds.iter().copied())
        .iter()
        .map(|w| w.to_string())
        .collect();
    (!shown.is_empty()).then(|| shown.join(" → "))
}

/// Runs `scenario` and judges it. A scenario the machine cannot run (no Python with
/// torch for a `script`, no S3 server, not root for namespaces or a tmpfs, no etcd)
/// is reported as skipped, with why.
pub fn run_scenario(name: &str, scenario: &Scenario, options: &Options) -> Result<Report, String> {
    scenario.validate()?;
    let ckpt = run::find_ckpt(&options.trainer);
    let python = match &scenario.script {
        Some(script) => {
            let script = run::resolve_script(script)?;
            if !ckpt.exists() {
                return Err(format!(
                    "{}: no `ckpt` to launch the Python trainer with (cargo build -p ckpt-cli, or CKPT_BIN)",
                    ckpt.display()
                ));
            }
            let interpreter = run::find_python();
            if let Err(why) = probe_python(&interpreter) {
                return Ok(Report::skipped_because(name, why));
            }
            Some((interpreter, script))
        }
        None => None,
    };
    // ckpt-train's reference is one run per configuration, made first; the Python
    // trainer's replays the run's schedule, known only after it.
    let reference = match &python {
        None => Some(oracle::reference(
            scenario,
            &options.trainer,
            &options.cache,
        )?),
        Some(_) => None,
    };
    let mut env = match env::Environment::prepare(scenario, &options.scratch) {
        Ok(env) => env,
        Err(env::Unavailable::Skip(why)) => return Ok(Report::skipped_because(name, why)),
        Err(env::Unavailable::Error(e)) => return Err(format!("{name}: {e}")),
    };
    let store = env.store()?;
    let watcher = oracle::CommitWatcher::start(store.clone(), Duration::from_millis(200))?;
    let setup = run::Setup {
        trainer: options.trainer.clone(),
        ckpt: ckpt.clone(),
        python: python.clone(),
        timeout: options.timeout,
    };
    let observed = run::run(scenario, &setup, &mut env);
    let seen = watcher.finish();
    let observed = observed.map_err(|e| format!("running {name}: {e}"))?;
    if let Some(path) = &options.plot {
        plot::draw(&observed.timeline, name, path)?;
    }
    if let Some(dir) = &options.logs {
        let file: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = dir.join(format!("{file}.log"));
        std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&path, observed.log.join("\n") + "\n"))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let mut reasons: Vec<String> = observed.cut.iter().cloned().collect();
    let reference = match (&python, reference) {
        (Some((interpreter, script)), _) => {
            // Only a run that trained to its end is compared (judge says so otherwise).
            match oracle::python_reference(
                scenario,
                &observed.schedule,
                &ckpt,
                interpreter,
                script,
                &options.cache,
            ) {
                Ok(dir) => Some(dir),
                Err(e) => {
                    reasons.push(e);
                    None
                }
            }
        }
        (None, reference) => reference,
    };
    let mut judgement = oracle::judge(
        &store,
        &seen,
        &observed.damaged,
        reference.as_deref(),
        scenario.steps,
    );
    oracle::check_health(&store, &observed, &mut judgement);
    oracle::check_memory_tier(scenario, &observed, &mut judgement);
    if python.is_some() {
        let (checked, problems) = oracle::check_cursors(&store, scenario.batch());
        judgement.cursors_checked = Some(checked);
        judgement.problems.extend(problems);
    }
    drop(env);
    reasons.extend(judgement.problems.iter().cloned());
    // A launcher whose every rank was hit by a fault has nothing left to finish: its
    // exit code reports those failures. Any other launcher must finish cleanly.
    let hit: Vec<usize> = scenario
        .faults
        .iter()
        .filter(|f| {
            matches!(
                f.kind,
                FaultKind::Kill | FaultKind::Stop | FaultKind::DeviceError | FaultKind::KillInSave
            )
        })
        .filter_map(|f| f.rank)
        .chain(
            // A partitioned node's ranks are cut off: they may fail.
            scenario
                .faults
                .iter()
                .filter(|f| matches!(f.kind, FaultKind::Partition | FaultKind::PartitionEtcd))
                .filter_map(|f| f.node)
                .flat_map(|n| n * scenario.ranks..(n + 1) * scenario.ranks),
        )
        .collect();
    for (node, code) in &observed.exit_codes {
        let all_hit =
            (0..scenario.ranks).all(|local| hit.contains(&(node * scenario.ranks + local)));
        if *code != 0 && !all_hit {
            reasons.push(format!("the launcher of node {node} exited with {code}"));
        }
    }
    if !observed.exit_codes.values().any(|c| *c == 0) {
        reasons.push("no launcher finished cleanly".into());
    }
    let expect = &scenario.expect;
    if let Some(world) = expect.final_world
        && observed.worlds.last() != Some(&world)
    {
        reasons.push(format!(
            "expected to finish on {world} ranks; generations started on {:?}",
            observed.worlds
        ));
    }
    if let Some(step) = expect.resumes_from
        && observed.resumed_from.first() != Some(&step)
    {
        reasons.push(format!(
            "expected the first recovery to resume from step {step}; resumed from {:?}",
            observed.resumed_from
        ));
    }
    if let Some(snapshot) = expect.first_resume_from_snapshot {
        let first = observed.resumed_from.first();
        let from_snapshot = first.is_some()
            && observed
                .snapshot_resumes
                .first()
                .is_some_and(|(_, step)| Some(step) == first);
        if first.is_none() || from_snapshot != snapshot {
            reasons.push(format!(
                "expected the first recovery to resume from {}; it resumed from {:?} (from snapshots: {:?})",
                if snapshot { "a snapshot" } else { "the store" },
                first,
                observed.snapshot_resumes
            ));
        }
    }
    // Rank 0's recovery lines, or the launchers' where rank 0 was a process started
    // after the failure (it has no recovery of its own to tell).
    let recoveries = observed.recoveries.len().max(observed.reformed.len());
    if let Some(n) = expect.recoveries_at_least
        && recoveries < n
    {
        reasons.push(format!(
            "expected at least {n} recoveries, saw {recoveries}"
        ));
    }
    if let Some(words) = &expect.first_cause_contains {
        let cause = observed.recoveries.first().map(|r| r.cause.as_str());
        if !cause.is_some_and(|c| c.contains(words.as_str())) {
            reasons.push(format!(
                "expected the first recovery's cause to contain {words:?}; it was {cause:?}"
            ));
        }
    }
    if let Some(limit) = expect.ends_within_secs
        && observed.wall_s > limit as f64
        && observed.cut.is_none()
    {
        reasons.push(format!(
            "the run took {:.1} s; expected to end within {limit} s",
            observed.wall_s
        ));
    }
    reasons.extend(unexplained_recoveries(&observed));
    let fired = observed.fired.len();
    if fired < scenario.faults.len() {
        reasons.push(format!(
            "only {fired} of {} faults fired (the run ended first)",
            scenario.faults.len()
        ));
    }
    let log_tail = if reasons.is_empty() {
        Vec::new()
    } else {
        let skip = observed.log.len().saturating_sub(120);
        observed.log[skip..].to_vec()
    };
    Ok(Report {
        scenario: name.to_string(),
        verdict: if reasons.is_empty() { "pass" } else { "fail" },
        reasons,
        observed,
        judgement,
        log_tail,
    })
}

/// Whether `python` can run the Python trainer: it imports torch and the `ckpt`
/// package with its native extension. Says what is missing otherwise (the scenario
/// is then skipped, or fails where `CKPT_REQUIRE` names `torch`).
pub fn probe_python(python: &Path) -> Result<(), String> {
    let output = std::process::Command::new(python)
        .args(["-c", "import torch, ckpt.elastic, ckpt._native"])
        .stdin(std::process::Stdio::null())
        .output();
    match output {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "no Python with torch and the ckpt package: {} -c 'import torch, ckpt.elastic' says: {} (set CKPT_PYTHON, and PYTHONPATH or pip install ./python)",
            python.display(),
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("nothing")
        )),
        Err(e) => Err(format!(
            "no Python with torch and the ckpt package: {}: {e} (set CKPT_PYTHON)",
            python.display()
        )),
    }
}

/// Faults that take a rank away (kill it, hang it, cut its node off from the others
/// or from etcd, or make it report a lost device), and so may end a generation. The
/// others (storage errors, corruption and partitions, I/O errors, a full or
/// read-only disk, corruption at rest, latency and packet loss, the coordinator or
/// an etcd member restarting) must cost at most a checkpoint, never a generation.
pub const RANK_LOSING_FAULTS: &[FaultKind] = &[
    FaultKind::Kill,
    FaultKind::Stop,
    FaultKind::KillNode,
    FaultKind::DeviceError,
    FaultKind::KillInSave,
    FaultKind::Partition,
    FaultKind::PartitionEtcd,
];

/// A reason for each recovery that no fault explains: no fault of
/// [`RANK_LOSING_FAULTS`] fired before the failure was noticed (a second of slack
/// for the trainer's and the harness's clocks read at different moments). Such a
/// recovery is a bug even when the oracle passes: the job stopped for something
/// that should not have stopped it.
pub fn unexplained_recoveries(observed: &run::Observed) -> Vec<String> {
    let losing: Vec<String> = RANK_LOSING_FAULTS.iter().map(|k| k.name()).collect();
    observed
        .recoveries
        .iter()
        .filter(|r| {
            !observed
                .fired
                .iter()
                .any(|f| losing.contains(&f.kind) && f.unix_ms <= r.noticed_unix_ms + 1000)
        })
        .map(|r| {
            format!(
                "generation {} (world {}) formed although no rank was lost before it: {}",
                r.generation, r.world, r.cause
            )
        })
        .collect()
}

/// The default cache of failure-free runs.
pub fn default_cache() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("ckpt-chaos")
}

#[cfg(test)]
mod tests {
    use super::*;
    use run::{Fired, Observed, Recovery};

    fn fired(kind: FaultKind, unix_ms: u64) -> Fired {
        Fired {
            kind: kind.name(),
            target: String::new(),
            at_step: 15,
            at_ms: 0,
            unix_ms,
        }
    }

    fn recovery(noticed_unix_ms: u64) -> Recovery {
        Recovery {
            generation: 2,
            world: 3,
            cause: "collective failed with rank 2: all_gather: rank 2 made no progress for 30s"
                .into(),
            detect_ms: None,
            abort_ms: 0,
            reform_ms: 0,
            load_ms: 0,
            first_step_ms: 0,
            back_ms: 0,
            noticed_unix_ms,
        }
    }

    #[test]
    fn the_ranks_training_line_has_one_entry_per_change_of_world_size() {
        // The demo's generations, each seen twice (as it forms and as it starts).
        assert_eq!(
            ranks_training(&[4, 4, 3, 3, 1, 1, 3, 3]).as_deref(),
            Some("4 → 3 → 1 → 3")
        );
        // A generation that replaced a lost rank at once keeps the world's size.
        assert_eq!(ranks_training(&[4, 4, 2]).as_deref(), Some("4 → 2"));
        assert_eq!(ranks_training(&[4]).as_deref(), Some("4"));
        assert_eq!(ranks_training(&[]), None);
    }

    #[test]
    fn a_recovery_after_storage_faults_only_is_unexplained() {
        let observed = Observed {
            fired: vec![fired(FaultKind::StorageReset, 1_000)],
            recoveries: vec![recovery(31_000)],
            ..Observed::default()
        };
        let reasons = unexplained_recoveries(&observed);
        assert_eq!(reasons.len(), 1, "{reasons:?}");
        assert!(reasons[0].contains("no rank was lost"), "{reasons:?}");
        assert!(reasons[0].contains("made no progress"), "{reasons:?}");
    }

    #[test]
    fn a_recovery_after_a_lost_rank_is_explained_and_one_before_it_is_not() {
        let observed = Observed {
            fired: vec![
                fired(FaultKind::StorageReset, 1_000),
                fired(FaultKind::Kill, 40_000),
            ],
            recoveries: vec![recovery(31_000), recovery(40_050)],
            ..Observed::default()
        };
        let reasons = unexplained_recoveries(&observed);
        assert_eq!(reasons.len(), 1, "only the first: {reasons:?}");
        let observed = Observed {
            fired: vec![fired(FaultKind::Stop, 1_000)],
            recoveries: vec![recovery(3_000)],
            ..Observed::default()
        };
        assert!(unexplained_recoveries(&observed).is_empty());
    }
}
