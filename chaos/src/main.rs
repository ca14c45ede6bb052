//! `ckpt-chaos`: run fault scenarios against the reference trainer.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use ckpt_chaos::scenario::Scenario;
use ckpt_chaos::{Options, default_cache, run::find_trainer, run_scenario};

/// Fault scenarios against the reference trainer, judged by a bitwise oracle.
#[derive(Parser)]
#[command(name = "ckpt-chaos", version)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

/// What every subcommand needs.
#[derive(clap::Args)]
struct Common {
    /// The `ckpt-train` binary (default: next to this one, or $CKPT_TRAIN).
    #[arg(long)]
    trainer: Option<PathBuf>,
    /// Where failure-free reference runs are cached.
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Bound on each run, in seconds.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
    /// Also write every line the launchers printed to DIR/RUN.log.
    #[arg(long, value_name = "DIR")]
    logs: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Commands {
    /// Runs scenario files and gives a verdict for each (exit 1 when any fails).
    Run {
        /// Scenario files (TOML).
        #[arg(required = true)]
        scenarios: Vec<PathBuf>,
        /// One JSON report on stdout instead of the summary.
        #[arg(long)]
        json: bool,
        /// Draw each run as an SVG: world size, steps per second and loss over wall
        /// time, each fault and recovery marked (with several scenarios, `-N` is added
        /// to the name of each file after the first).
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
        #[command(flatten)]
        common: Common,
    },
    /// Runs N scenarios drawn from a seed; a failure is written out as a scenario file
    /// that replays it (exit 1 when any run fails).
    Soak {
        /// The seed runs are drawn from.
        #[arg(long)]
        seed: u64,
        /// How many runs.
        #[arg(long, default_value_t = 10)]
        runs: u64,
        /// One JSON report on stdout instead of a line per run.
        #[arg(long)]
        json: bool,
        /// Where replay files of failed runs go.
        #[arg(long, default_value = ".")]
        out: PathBuf,
        /// Shrink each failed run: drop its faults one at a time while it still
        /// fails, and write the smallest failing scenario beside the replay file.
        #[arg(long)]
        shrink: bool,
        #[command(flatten)]
        common: Common,
    },
}

fn main() -> ExitCode {
    let command = Cli::parse().command;
    let common = match &command {
        Commands::Run { common, .. } | Commands::Soak { common, .. } => common,
    };
    let options = match options(common) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match command {
        Commands::Run {
            scenarios,
            json,
            plot,
            ..
        } => run(scenarios, json, plot, options),
        Commands::Soak {
            seed,
            runs,
            json,
            out,
            shrink,
            ..
        } => soak(seed, runs, json, &out, shrink, options),
    }
}

fn options(common: &Common) -> Result<Options, String> {
    let trainer = find_trainer(common.trainer.as_deref())?;
    let scratch = tempfile_dir().map_err(|e| format!("scratch directory: {e}"))?;
    Ok(Options {
        trainer,
        cache: common.cache.clone().unwrap_or_else(default_cache),
        scratch,
        timeout: Duration::from_secs(common.timeout_secs),
        logs: common.logs.clone(),
        plot: None,
    })
}

/// The smallest failing variant of `scenario`: faults dropped one at a time (latest
/// first) as long as the run without it still fails.
fn shrink(name: &str, scenario: &Scenario, options: &Options) -> Option<Scenario> {
    let mut smallest = scenario.clone();
    let mut shrunk = false;
    let mut i = smallest.faults.len();
    while i > 0 && smallest.faults.len() > 1 {
        i -= 1;
        let mut candidate = smallest.clone();
        candidate.faults.remove(i);
        // Fewer faults may mean fewer recoveries: only the oracle's invariants and
        // the other expectations still hold the candidate to account.
        candidate.expect.recoveries_at_least = None;
        if candidate.validate().is_err() {
            continue;
        }
        let failed = match run_scenario(&format!("{name} shrinking"), &candidate, options) {
            Ok(report) => !report.passed() && !report.skipped(),
            Err(_) => true,
        };
        eprintln!(
            "  shrink: without fault {} ({}): {}",
            i + 1,
            scenario.faults[i].kind.name(),
            if failed { "still fails" } else { "passes" }
        );
        if failed {
            smallest = candidate;
            shrunk = true;
        }
    }
    shrunk.then_some(smallest)
}

fn soak(
    seed: u64,
    runs: u64,
    json: bool,
    out: &std::path::Path,
    shrink_failures: bool,
    options: Options,
) -> ExitCode {
    let mut reports = Vec::new();
    let mut failed = 0;
    for run in 0..runs {
        let scenario = ckpt_chaos::soak::draw(seed, run);
        let name = format!("seed {seed} run {run}");
        let outcome = run_scenario(&name, &scenario, &options);
        let (verdict, reasons, value) = match outcome {
            Ok(report) => (
                report.verdict,
                report.reasons.clone(),
                serde_json::to_value(&report).unwrap_or_default(),
            ),
            Err(e) => ("fail", vec![e.clone()], serde_json::json!({"reasons": [e]})),
        };
        let mut value = value;
        value["run"] = run.into();
        value["seed"] = seed.into();
        value["verdict"] = verdict.into();
        value["scenario_toml"] = scenario.to_toml().into();
        if verdict == "skip" {
            eprintln!("SKIPPED seed {seed} run {run}: {}", reasons.join("; "));
        } else if verdict != "pass" {
            failed += 1;
            let file = out.join(format!("chaos-replay-seed{seed}-run{run}.toml"));
            let text = format!(
                "# replay: ckpt-chaos run {}\n{}",
                file.display(),
                scenario.to_toml()
            );
            match std::fs::write(&file, text) {
                Ok(()) => eprintln!(
                    "FAIL seed {seed} run {run}: {}\n  replay: ckpt-chaos run {}",
                    reasons.join("; "),
                    file.display()
                ),
                Err(e) => eprintln!(
                    "FAIL seed {seed} run {run}: {} (replay file: {e})",
                    reasons.join("; ")
                ),
            }
            value["replay"] = file.display().to_string().into();
            if shrink_failures && let Some(small) = shrink(&name, &scenario, &options) {
                let file = out.join(format!("chaos-replay-seed{seed}-run{run}-shrunk.toml"));
                let text = format!(
                    "# replay: ckpt-chaos run {}\n# (seed {seed} run {run} with {} of its {} faults)\n{}",
                    file.display(),
                    small.faults.len(),
                    scenario.faults.len(),
                    small.to_toml()
                );
                if std::fs::write(&file, text).is_ok() {
                    eprintln!("  shrunk replay: ckpt-chaos run {}", file.display());
                    value["shrunk_replay"] = file.display().to_string().into();
                }
            }
        } else if !json {
            let faults: Vec<String> = scenario
                .faults
                .iter()
                .map(|f| format!("{}@{}", f.kind.name(), f.at_step.unwrap_or(0)))
                .collect();
            println!(
                "pass seed {seed} run {run}: {} ranks, {}",
                scenario.world(),
                faults.join(" ")
            );
        }
        reports.push(value);
    }
    let _ = std::fs::remove_dir_all(&options.scratch);
    if json {
        println!(
            "{}",
            serde_json::json!({"seed": seed, "runs": reports, "failed": failed})
        );
    } else {
        println!("{} of {runs} runs passed", runs - failed);
    }
    if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn run(scenarios: Vec<PathBuf>, json: bool, plot: Option<PathBuf>, options: Options) -> ExitCode {
    let mut reports = Vec::new();
    let mut failed = false;
    for (i, path) in scenarios.iter().enumerate() {
        let name = path.display().to_string();
        let mut options = options.clone();
        options.plot = plot.as_ref().map(|p| numbered(p, i));
        let outcome = Scenario::load(path)
            .map_err(|e| e.to_string())
            .and_then(|s| run_scenario(&name, &s, &options));
        match outcome {
            Ok(report) => {
                failed |= !report.passed() && !report.skipped();
                if report.skipped() {
                    eprintln!("SKIPPED {name}: {}", report.reasons.join("; "));
                }
                if !json {
                    println!("{}", report.summary());
                }
                if let Some(p) = &options.plot
                    && !report.skipped()
                {
                    eprintln!("plot: {}", p.display());
                }
                reports.push(serde_json::to_value(&report).unwrap_or_default());
            }
            Err(e) => {
                failed = true;
                eprintln!("error: {e}");
                reports
                    .push(serde_json::json!({"scenario": name, "verdict": "fail", "reasons": [e]}));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&options.scratch);
    if json {
        println!("{}", serde_json::json!({ "runs": reports }));
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// `path` for the first scenario, `path` with `-N` before its extension after.
fn numbered(path: &std::path::Path, i: usize) -> PathBuf {
    if i == 0 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}-{i}.{}", ext.to_string_lossy()),
        None => format!("{stem}-{i}"),
    };
    path.with_file_name(name)
}

fn tempfile_dir() -> std::io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("ckpt-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
