//! `ckpt-chaos`: run fault scenarios against the reference trainer.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use ckpt_chaos::scenario::Scenario;
use ckpt_chaos::storage_proxy::StorageProxy;
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
    /// The demo: 4 ranks on 2 nodes on local disk lose a rank, then a node; the node
    /// comes back; the final weights are compared with a failure-free run, bit for bit.
    Demo {
        /// Also draw the run (SVG).
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
        /// The number of the first run: `--first 100 --runs 100` runs 100 to 199 of
        /// the seed, the second half of a 200-run soak made in two sittings
        /// (`ckpt-chaos totals` adds their reports up).
        #[arg(long, default_value_t = 0)]
        first: u64,
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
        /// Draw runs of this Python trainer (a path relative to the repository root,
        /// or absolute; e.g. python/examples/train_gpt.py) under `ckpt launch`
        /// instead of ckpt-train: device errors become kills, save-stage kills
        /// become kills while that save is in flight.
        #[arg(long, value_name = "SCRIPT")]
        script: Option<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Runs the storage proxy alone, with no fault queued, in front of an S3-compatible
    /// server: prints `listening on http://ADDR`, relays until SIGTERM, SIGINT or the
    /// end of its standard input, then prints its counters (requests by kind, body
    /// bytes each way) as one line of JSON.
    Proxy {
        /// The server, `http://host:port`.
        #[arg(long)]
        upstream: String,
        /// Where to listen (port 0: one the system picks).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        /// Cap on the body bytes relayed, all connections together, in MiB/s
        /// (none when absent).
        #[arg(long, value_name = "MIB_PER_S")]
        rate_mib_per_s: Option<f64>,
    },
    /// Adds up the JSON reports of soaks (`soak --json`), as one soak of all their
    /// runs: faults by kind, recoveries, checkpoints, corruption, goodput.
    Totals {
        /// Reports written by `soak --json`.
        #[arg(required = true)]
        reports: Vec<PathBuf>,
        /// The totals as JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let command = Cli::parse().command;
    if let Commands::Totals { reports, json } = &command {
        return add_up(reports, *json);
    }
    if let Commands::Proxy {
        upstream,
        listen,
        rate_mib_per_s,
    } = &command
    {
        return proxy(upstream, *listen, *rate_mib_per_s);
    }
    let common = match &command {
        Commands::Run { common, .. }
        | Commands::Soak { common, .. }
        | Commands::Demo { common, .. } => common,
        Commands::Totals { .. } | Commands::Proxy { .. } => unreachable!("answered above"),
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
            first,
            json,
            out,
            shrink,
            script,
            ..
        } => soak(
            seed,
            first..first.saturating_add(runs),
            json,
            &out,
            shrink,
            script.as_deref(),
            options,
        ),
        Commands::Demo { plot, .. } => demo(plot, options),
        Commands::Totals { .. } | Commands::Proxy { .. } => unreachable!("answered above"),
    }
}

/// `ckpt-chaos proxy`: a proxy of its own until a signal or the end of stdin.
fn proxy(upstream: &str, listen: SocketAddr, rate_mib_per_s: Option<f64>) -> ExitCode {
    // SIGTERM and SIGINT are blocked before any thread starts, so that every
    // thread inherits the mask and the one waiting in sigwait takes them.
    // SAFETY: plain libc calls on a set this function owns.
    let signals = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let proxy = match StorageProxy::start_at(upstream, listen) {
        Ok(proxy) => proxy,
        Err(e) => {
            eprintln!("error: proxy on {listen} in front of {upstream}: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(mib) = rate_mib_per_s {
        if mib.is_nan() || mib <= 0.0 {
            eprintln!("error: --rate-mib-per-s must be positive, not {mib}");
            return ExitCode::from(2);
        }
        proxy.limit_rate(Some((mib * (1u64 << 20) as f64) as u64));
    }
    println!("listening on {}", proxy.endpoint());
    let _ = std::io::stdout().flush();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let on_eof = stop.clone();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ = on_eof.send(());
    });
    std::thread::spawn(move || {
        let mut signal = 0;
        // SAFETY: `signals` is an initialised set; sigwait writes one int.
        unsafe { libc::sigwait(&signals, &mut signal) };
        let _ = stop.send(());
    });
    let _ = stopped.recv();
    let stats = proxy.stats();
    drop(proxy);
    match serde_json::to_string(&stats) {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("error: proxy statistics: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// `ckpt-chaos totals`: the runs of every report, added up.
fn add_up(files: &[PathBuf], json: bool) -> ExitCode {
    let mut runs = Vec::new();
    for file in files {
        let report = std::fs::read_to_string(file)
            .map_err(|e| e.to_string())
            .and_then(|text| {
                serde_json::from_str::<serde_json::Value>(&text).map_err(|e| e.to_string())
            });
        match report {
            Ok(report) => match report["runs"].as_array() {
                Some(more) => runs.extend(more.iter().cloned()),
                None => {
                    eprintln!(
                        "error: {}: no \"runs\" (not a report of `soak --json`)",
                        file.display()
                    );
                    return ExitCode::from(2);
                }
            },
            Err(e) => {
                eprintln!("error: {}: {e}", file.display());
                return ExitCode::from(2);
            }
        }
    }
    let totals = totals(&runs);
    if json {
        println!("{totals}");
    } else {
        println!("{}", describe_totals(&totals));
    }
    ExitCode::SUCCESS
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
    runs: std::ops::Range<u64>,
    json: bool,
    out: &std::path::Path,
    shrink_failures: bool,
    script: Option<&str>,
    options: Options,
) -> ExitCode {
    let mut reports = Vec::new();
    let mut failed = 0;
    let count = runs.end - runs.start;
    for run in runs {
        let scenario = match script {
            Some(script) => ckpt_chaos::soak::draw_for_script(seed, run, script),
            None => ckpt_chaos::soak::draw(seed, run),
        };
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
    let totals = totals(&reports);
    if json {
        println!(
            "{}",
            serde_json::json!({"seed": seed, "runs": reports, "failed": failed, "totals": totals})
        );
    } else {
        println!("{} of {count} runs passed", count - failed);
        println!("{}", describe_totals(&totals));
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

/// Sorted `values`' median, 95th percentile and maximum.
fn spread(mut values: Vec<f64>) -> serde_json::Value {
    if values.is_empty() {
        return serde_json::Value::Null;
    }
    values.sort_by(f64::total_cmp);
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    serde_json::json!({"count": values.len(), "median": at(0.5), "p95": at(0.95), "max": at(1.0), "min": at(0.0)})
}

/// What a soak's runs add up to: faults by kind, recoveries and their times,
/// checkpoints, lost commits, corruption found and missed, goodput.
fn totals(reports: &[serde_json::Value]) -> serde_json::Value {
    let mut by_kind = std::collections::BTreeMap::<String, u64>::new();
    let (mut passed, mut failed, mut skipped) = (0u64, 0u64, 0u64);
    let (mut commits, mut verified, mut lost) = (0u64, 0u64, 0u64);
    let (mut corrupted, mut detected, mut superseded, mut undetected) = (0u64, 0u64, 0u64, 0u64);
    let (mut poisoned, mut caught, mut rollbacks, mut resumes) = (0u64, 0u64, 0u64, 0u64);
    let (mut recovery_ms, mut back_ms, mut goodput) = (Vec::new(), Vec::new(), Vec::new());
    let u = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    for run in reports {
        match run["verdict"].as_str() {
            Some("pass") => passed += 1,
            Some("skip") => {
                skipped += 1;
                continue;
            }
            _ => failed += 1,
        }
        let observed = &run["observed"];
        for fault in observed["fired"].as_array().into_iter().flatten() {
            *by_kind
                .entry(fault["kind"].as_str().unwrap_or("?").to_string())
                .or_default() += 1;
        }
        for r in observed["recoveries"].as_array().into_iter().flatten() {
            let back = u(&r["back_ms"]) as f64;
            back_ms.push(back);
            if let Some(detect) = r["detect_ms"].as_u64() {
                recovery_ms.push(detect as f64 + back);
            }
        }
        if let Some(g) = observed["goodput"].as_f64() {
            goodput.push(g);
        }
        let j = &run["judgement"];
        commits += u(&j["commits"]);
        verified += u(&j["verified"]);
        lost += j["lost"].as_array().map_or(0, |l| l.len() as u64);
        corrupted += u(&j["corrupted"]);
        detected += u(&j["detected"]);
        superseded += u(&j["superseded"]);
        poisoned += u(&j["poisoned"]);
        caught += u(&j["caught"]);
        resumes += u(&j["resumes_checked"]);
        rollbacks += observed["rollbacks"]
            .as_array()
            .map_or(0, |r| r.len() as u64);
        undetected += j["problems"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p.as_str().is_some_and(|p| p.contains("did not notice")))
            .count() as u64;
    }
    serde_json::json!({
        "runs": reports.len(),
        "passed": passed,
        "failed": failed,
        "skipped": skipped,
        "faults": by_kind.values().sum::<u64>(),
        "faults_by_kind": by_kind,
        "recoveries": back_ms.len(),
        "recovery_ms": spread(recovery_ms),
        "back_to_training_ms": spread(back_ms),
        "commits": commits,
        "verified": verified,
        "lost_commits": lost,
        "corrupted": corrupted,
        "corruption_detected": detected,
        "corruption_superseded": superseded,
        "corruption_undetected": undetected,
        "poisoned": poisoned,
        "poison_caught": caught,
        "rollbacks": rollbacks,
        "resumes_checked": resumes,
        "goodput": spread(goodput),
    })
}

fn describe_totals(t: &serde_json::Value) -> String {
    let ms = |v: &serde_json::Value| {
        if v.is_null() {
            "-".to_string()
        } else {
            format!(
                "median {:.0} ms, p95 {:.0} ms, max {:.0} ms",
                v["median"].as_f64().unwrap_or(0.0),
                v["p95"].as_f64().unwrap_or(0.0),
                v["max"].as_f64().unwrap_or(0.0)
            )
        }
    };
    let kinds: Vec<String> = t["faults_by_kind"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    format!(
        "runs: {} ({} passed, {} failed, {} skipped)\nfaults: {} ({})\nrecoveries: {}; fault to training again: {}; noticed to training again: {}\ncheckpoints: {} committed, {} verified, {} lost\ncorrupted on purpose: {}; found by verify {}, replaced by a later save {}, missed {}\npoisoned by sdc or nan: {}; caught at their saves {}; rollbacks {}; resumes checked for health {}\ngoodput: {}",
        t["runs"],
        t["passed"],
        t["failed"],
        t["skipped"],
        t["faults"],
        kinds.join(", "),
        t["recoveries"],
        ms(&t["recovery_ms"]),
        ms(&t["back_to_training_ms"]),
        t["commits"],
        t["verified"],
        t["lost_commits"],
        t["corrupted"],
        t["corruption_detected"],
        t["corruption_superseded"],
        t["corruption_undetected"],
        t["poisoned"],
        t["poison_caught"],
        t["rollbacks"],
        t["resumes_checked"],
        if t["goodput"].is_null() {
            "-".to_string()
        } else {
            format!(
                "median {:.0} %, min {:.0} %",
                t["goodput"]["median"].as_f64().unwrap_or(0.0) * 100.0,
                t["goodput"]["min"].as_f64().unwrap_or(0.0) * 100.0
            )
        }
    )
}

/// The demo scenario, built in (the same file as `chaos/scenarios/demo.toml`).
const DEMO: &str = include_str!("../scenarios/demo.toml");

fn demo(plot: Option<PathBuf>, mut options: Options) -> ExitCode {
    let scenario = match Scenario::parse(DEMO) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: the built-in demo scenario: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "ckpt demo: {} ranks on {} nodes train a tiny model for {} steps, checkpointing every {} steps to local disk.",
        scenario.world(),
        scenario.nodes,
        scenario.steps,
        scenario.ckpt_every
    );
    println!(
        "The harness kills rank 1 at step 15, then node 1 (its launcher and both ranks) at step 30, and starts node 1 again a second later."
    );
    println!(
        "Then it checks every checkpoint and compares the final weights with a failure-free run of the same job.\n"
    );
    options.plot = plot;
    let report = match run_scenario("demo", &scenario, &options) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let _ = std::fs::remove_dir_all(&options.scratch);
    println!("{}", report.summary());
    if let Some(p) = &options.plot {
        println!("\nThe run, drawn: {}", p.display());
    }
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
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
