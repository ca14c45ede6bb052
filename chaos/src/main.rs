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
            scenarios, json, ..
        } => run(scenarios, json, options),
        Commands::Soak {
            seed,
            runs,
            json,
            out,
            ..
        } => soak(seed, runs, json, &out, options),
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
    })
}

fn soak(seed: u64, runs: u64, json: bool, out: &std::path::Path, options: Options) -> ExitCode {
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
        if verdict != "pass" {
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
        } else if !json {
            let faults: Vec<String> = scenario
                .faults
                .iter()
                .map(|f| format!("{:?}@{}", f.kind, f.at_step.unwrap_or(0)))
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

fn run(scenarios: Vec<PathBuf>, json: bool, options: Options) -> ExitCode {
    let mut reports = Vec::new();
    let mut failed = false;
    for path in &scenarios {
        let name = path.display().to_string();
        let outcome = Scenario::load(path)
            .map_err(|e| e.to_string())
            .and_then(|s| run_scenario(&name, &s, &options));
        match outcome {
            Ok(report) => {
                failed |= !report.passed();
                if !json {
                    println!("{}", report.summary());
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

fn tempfile_dir() -> std::io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("ckpt-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
