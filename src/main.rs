//! The `ckpt` command line.

mod cli;

use std::process::ExitCode;

use ckpt::probe::probe;
use ckpt::storage::{Store, StoreConfig};
use clap::{Parser, Subcommand};

/// Exit code: everything checked out.
const EXIT_OK: u8 = 0;
/// Exit code: a check failed (the store misbehaved, a checkpoint is unsound).
const EXIT_CHECK_FAILED: u8 = 1;
/// Exit code: bad usage or configuration (bad URL, unknown option).
const EXIT_USAGE: u8 = 2;

#[derive(Parser)]
#[command(
    name = "ckpt",
    version,
    about = "Fault-tolerant sharded checkpoints for distributed training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check that a store URL supports everything ckpt needs (put, ranged reads,
    /// multipart upload, create-if-absent, list, delete), cleaning up after itself.
    #[command(
        after_help = "Example:\n  ckpt probe file://./runs/demo\n  AWS_ENDPOINT=http://127.0.0.1:9000 AWS_ALLOW_HTTP=true ckpt probe s3://bucket/run1 --json"
    )]
    Probe {
        /// Store URL: file:///dir, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix
        url: String,
        /// Backend option KEY=VALUE as object_store names it (e.g. aws_endpoint=http://127.0.0.1:9000); repeatable.
        #[arg(long = "option", short = 'o', value_name = "KEY=VALUE")]
        options: Vec<String>,
        /// Print a JSON report instead of a table.
        #[arg(long)]
        json: bool,
    },
    #[command(flatten)]
    Tool(cli::Tool),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match cli.command {
        Command::Probe { url, options, json } => runtime.block_on(run_probe(&url, &options, json)),
        Command::Tool(tool) => runtime.block_on(cli::run(tool)),
    }
}

fn store_config(options: &[String]) -> Result<StoreConfig, String> {
    let mut config = StoreConfig::default();
    for option in options {
        let (key, value) = option
            .split_once('=')
            .ok_or_else(|| format!("option {option:?} is not KEY=VALUE"))?;
        config = config.with_option(key.trim(), value.trim());
    }
    Ok(config)
}

async fn run_probe(url: &str, options: &[String], json: bool) -> ExitCode {
    let store =
        match store_config(options).and_then(|c| Store::open(url, c).map_err(|e| e.to_string())) {
            Ok(store) => store,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(EXIT_USAGE);
            }
        };
    let report = probe(&store).await;
    if json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("error: cannot encode the report: {e}");
                return ExitCode::from(EXIT_CHECK_FAILED);
            }
        }
    } else {
        println!("probe of {}", report.url);
        for step in &report.steps {
            let status = if step.ok { "ok" } else { "FAILED" };
            println!("  {:<18} {:>6}  {:>9.1} ms", step.step, status, step.ms);
            if let Some(error) = &step.error {
                println!("    {error}");
            }
        }
    }
    if report.ok() {
        ExitCode::from(EXIT_OK)
    } else {
        ExitCode::from(EXIT_CHECK_FAILED)
    }
}
