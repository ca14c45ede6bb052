//! `ckpt-chaos`: fault scenarios against the reference trainer, judged by an oracle.
//!
//! The harness drives `ckpt-train` and the checkpoint store from outside, as an
//! operator's worst day would: it kills, stops and loses ranks and nodes while a job
//! trains, then checks what must hold whatever happened (see [`oracle`]): training
//! reached its final step, every committed checkpoint verifies, no commit was lost,
//! and the final weights equal a failure-free run's bitwise. A [`scenario`] is a TOML
//! file; [`run`] executes it; [`Report`] is the verdict, for people and for scripts.

pub mod netns;
pub mod oracle;
pub mod plot;
pub mod run;
pub mod scenario;
pub mod soak;
pub mod storage_proxy;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use scenario::Scenario;

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
}

/// The verdict on one run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The scenario file (or `-`).
    pub scenario: String,
    /// `pass` or `fail`.
    pub verdict: &'static str,
    /// Why it failed (empty on a pass).
    pub reasons: Vec<String>,
    /// What the run showed.
    pub observed: run::Observed,
    /// What the oracle found.
    pub judgement: oracle::Judgement,
}

impl Report {
    /// True on a pass.
    pub fn passed(&self) -> bool {
        self.verdict == "pass"
    }

    /// A few lines for a person.
    pub fn summary(&self) -> String {
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
                "\n  recovery: generation {} on {} ranks: detect {detect}, abort {} ms, re-form {} ms, load {} ms, first step {} ms ({})",
                r.generation, r.world, r.abort_ms, r.reform_ms, r.load_ms, r.first_step_ms, r.cause
            );
        }
        let j = &self.judgement;
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
        for reason in &self.reasons {
            out += &format!("\n  reason: {reason}");
        }
        out
    }
}

/// Runs `scenario` and judges it.
pub fn run_scenario(name: &str, scenario: &Scenario, options: &Options) -> Result<Report, String> {
    scenario.validate()?;
    let reference = oracle::reference(scenario, &options.trainer, &options.cache)?;
    let _ = std::fs::remove_dir_all(&options.scratch);
    std::fs::create_dir_all(&options.scratch)
        .map_err(|e| format!("{}: {e}", options.scratch.display()))?;
    let url = oracle::file_url(&options.scratch);
    let watcher = oracle::CommitWatcher::start(&url, Duration::from_millis(200))?;
    let setup = run::Setup {
        trainer: options.trainer.clone(),
        ckpt: run::find_ckpt(&options.trainer),
        ckpt_url: url.clone(),
        timeout: options.timeout,
    };
    let observed = run::run(scenario, &setup);
    let seen = watcher.finish();
    let observed = observed.map_err(|e| format!("running {name}: {e}"))?;
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
    let judgement = oracle::judge(&url, &seen, &reference, scenario.steps);
    let mut reasons = judgement.problems.clone();
    // A launcher whose every rank was hit by a fault has nothing left to finish: its
    // exit code reports those failures. Any other launcher must finish cleanly.
    let hit: Vec<usize> = scenario.faults.iter().filter_map(|f| f.rank).collect();
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
    if let Some(n) = expect.recoveries_at_least
        && observed.recoveries.len() < n
    {
        reasons.push(format!(
            "expected at least {n} recoveries, saw {}",
            observed.recoveries.len()
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
    {
        reasons.push(format!(
            "the run took {:.1} s; expected to end within {limit} s",
            observed.wall_s
        ));
    }
    let fired = observed.fired.len();
    if fired < scenario.faults.len() {
        reasons.push(format!(
            "only {fired} of {} faults fired (the run ended first)",
            scenario.faults.len()
        ));
    }
    Ok(Report {
        scenario: name.to_string(),
        verdict: if reasons.is_empty() { "pass" } else { "fail" },
        reasons,
        observed,
        judgement,
    })
}

/// The default cache of failure-free runs.
pub fn default_cache() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("ckpt-chaos")
}
