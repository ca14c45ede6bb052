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
        /// The `ckpt-train` binary (default: next to this one, or $CKPT_TRAIN).
        #[arg(long)]
        trainer: Option<PathBuf>,
        /// Where failure-free reference runs are cached.
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Bound on each run, in seconds.
        #[arg(long, default_value_t = 300)]
        timeout_secs: u64,
    },
}

fn main() -> ExitCode {
    let Commands::Run {
        scenarios,
        json,
        trainer,
        cache,
        timeout_secs,
    } = Cli::parse().command;
    let trainer = match find_trainer(trainer.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let scratch = match tempfile_dir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: scratch directory: {e}");
            return ExitCode::from(2);
        }
    };
    let options = Options {
        trainer,
        cache: cache.unwrap_or_else(default_cache),
        scratch: scratch.clone(),
        timeout: Duration::from_secs(timeout_secs),
    };
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
    let _ = std::fs::remove_dir_all(&scratch);
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
