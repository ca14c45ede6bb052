//! The checkpoint subcommands of `ckpt`: argument parsing, human and JSON output,
//! progress and exit codes. The work itself is in `ckpt::tools`.
//!
//! Exit codes (documented in docs/CLI.md): 0 ok, 1 a check failed (verify found a
//! fault, diff found a difference), 2 usage or configuration error, 3 not found (no
//! checkpoint, no such step or tensor), 4 the checkpoint is corrupt, 5 storage or I/O
//! failure (unreachable store, disk full).

mod render;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use ckpt::storage::{ErrorKind, Store, StoreConfig};
use ckpt::tools::{diff, export, gc, import, inspect, reshard, verify};
use ckpt::{CheckpointReader, Codec, DType, Error};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use render::{Table, age, bytes, print_json};

use crate::output::{errln, out, outln};

/// Exit code: everything checked out.
pub(crate) const EXIT_OK: u8 = 0;
/// Exit code: a check failed.
pub(crate) const EXIT_CHECK_FAILED: u8 = 1;
/// Exit code: bad usage or configuration.
pub(crate) const EXIT_USAGE: u8 = 2;
/// Exit code: no checkpoint, no such step, no such tensor.
pub(crate) const EXIT_NOT_FOUND: u8 = 3;
/// Exit code: the checkpoint is corrupt.
pub(crate) const EXIT_CORRUPT: u8 = 4;
/// Exit code: the store or the disk failed.
pub(crate) const EXIT_STORAGE: u8 = 5;

/// Options every command that opens a store takes.
#[derive(Args, Debug, Clone)]
pub(crate) struct StoreArgs {
    /// Backend option KEY=VALUE as object_store names it (e.g.
    /// aws_endpoint=http://127.0.0.1:9000); repeatable; applies to every URL.
    #[arg(long = "option", short = 'o', value_name = "KEY=VALUE")]
    pub(crate) options: Vec<String>,
    /// Retries of a failed request to a remote store.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub(crate) retries: usize,
}

impl StoreArgs {
    pub(crate) fn open(&self, url: &str) -> Result<Store, Error> {
        let mut config = StoreConfig::default();
        config.retry.max_retries = self.retries;
        config.retry.retry_timeout = Duration::from_secs(60);
        for option in &self.options {
            let (key, value) = option
                .split_once('=')
                .ok_or_else(|| Error::Invalid(format!("option {option:?} is not KEY=VALUE")))?;
            config = config.with_option(key.trim(), value.trim());
        }
        Ok(Store::open(url, config)?)
    }
}

fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 512MiB or 2GiB"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {text:?}")),
    };
    let value = number * scale as f64;
    if !(1.0..=1e18).contains(&value) {
        return Err(format!("size {text:?} is out of range"));
    }
    Ok(value as u64)
}

fn parse_dtype(text: &str) -> Result<DType, String> {
    match text.to_ascii_lowercase().as_str() {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => Err(format!("--dtype {other:?}: expected bf16, f16 or f32")),
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    if text.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(text)
        .map_err(|e| format!("{text:?} is not a duration like 10m or 1h: {e}"))
}

/// The checkpoint subcommands.
#[derive(Subcommand, Debug)]
pub(crate) enum Tool {
    /// List the checkpoints under a root.
    ///
    /// Step, committed or partial (and which ranks are missing), world size,
    /// tensors, bytes, compression, age; `*` marks the latest commit.
    #[command(
        after_help = "Example:\n  ckpt ls file://./runs/demo\n  ckpt ls s3://bucket/run1 --json"
    )]
    Ls {
        /// Checkpoint root URL.
        url: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Show a checkpoint's manifest.
    ///
    /// Step, world size, layouts, format, metadata; with --tensors each tensor's
    /// dtype, shape and chunk boxes; with --ranks each rank's files.
    #[command(
        after_help = "Example:\n  ckpt inspect file://./runs/demo --tensors --filter 'layers.0.*'\n  ckpt inspect s3://bucket/run1 --step 1200 --ranks --json"
    )]
    Inspect {
        /// Checkpoint root URL.
        url: String,
        /// Step (default: the newest committed).
        #[arg(long)]
        step: Option<u64>,
        /// List tensors and their chunks.
        #[arg(long)]
        tensors: bool,
        /// List ranks and their files.
        #[arg(long)]
        ranks: bool,
        /// Glob on tensor names (with --tensors).
        #[arg(long, default_value = "*")]
        filter: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Check every byte of a checkpoint.
    ///
    /// Reads everything and checks every block checksum, the manifest and part
    /// checksums, and that chunks tile each tensor exactly once. Exit 0 when sound,
    /// 1 with each fault's file, tensors and byte offset.
    #[command(
        after_help = "Example:\n  ckpt verify file://./runs/demo\n  ckpt verify s3://bucket/run1 --all --memory-budget 256MiB --json"
    )]
    Verify {
        /// Checkpoint root URL.
        url: String,
        /// Step (default: the newest committed).
        #[arg(long, conflicts_with = "all")]
        step: Option<u64>,
        /// Verify every committed checkpoint.
        #[arg(long)]
        all: bool,
        /// Data in flight at once.
        #[arg(long, default_value = "1GiB", value_parser = parse_size)]
        memory_budget: u64,
        /// JSON output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Compare two checkpoints tensor by tensor.
    ///
    /// Whatever their layouts and world sizes: bitwise identical, or max abs / max
    /// rel difference and the count of differing elements; tensors on one side
    /// only; non-tensor state. Exit 0 only when identical (or within --atol/--rtol).
    #[command(
        after_help = "Example:\n  ckpt diff file://./runs/a file://./runs/b\n  ckpt diff s3://bucket/run1 file://./resharded --step-a 1200 --atol 1e-6 --json"
    )]
    Diff {
        /// Root URL of checkpoint A.
        a: String,
        /// Root URL of checkpoint B.
        b: String,
        /// Step of A (default: newest committed).
        #[arg(long)]
        step_a: Option<u64>,
        /// Step of B (default: newest committed).
        #[arg(long)]
        step_b: Option<u64>,
        /// Absolute tolerance.
        #[arg(long, default_value_t = 0.0)]
        atol: f64,
        /// Relative tolerance.
        #[arg(long, default_value_t = 0.0)]
        rtol: f64,
        /// Data held at once (both sides).
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        memory_budget: u64,
        /// JSON output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Rewrite a checkpoint for another world size or layout.
    ///
    /// Streams from SRC to DST (even dim-0 split with --world-size, any boxes with
    /// --layout); DST gets a committed checkpoint of the same step.
    #[command(
        after_help = "Example:\n  ckpt reshard file://./runs/demo file://./runs/demo-3 --world-size 3\n  ckpt reshard s3://bucket/run1 s3://bucket/run1-tp --layout tp2.json --step 1200\n\nLayout file: {\"world_size\": 2, \"default\": \"dim0\", \"tensors\": {\"w\": [{\"rank\": 0, \"offsets\": [0, 0], \"lengths\": [8, 2]}, {\"rank\": 1, \"offsets\": [0, 2], \"lengths\": [8, 2]}]}}"
    )]
    Reshard {
        /// Source root URL.
        src: String,
        /// Destination root URL.
        dst: String,
        /// New world size (even dim-0 split of every tensor).
        #[arg(long, required_unless_present = "layout", conflicts_with = "layout")]
        world_size: Option<u32>,
        /// Layout file: per tensor, the box of each rank.
        #[arg(long)]
        layout: Option<PathBuf>,
        /// Step (default: the newest committed).
        #[arg(long)]
        step: Option<u64>,
        /// Compress the destination with zstd at this level (default: as the source).
        #[arg(long, value_name = "LEVEL")]
        zstd: Option<i32>,
        /// Write the destination uncompressed.
        #[arg(long, conflicts_with = "zstd")]
        no_compress: bool,
        /// Tensor data held at once.
        #[arg(long, default_value = "1GiB", value_parser = parse_size)]
        memory_budget: u64,
        /// JSON output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Consolidate a checkpoint into one safetensors file.
    ///
    /// A standard file of whole tensors, what Hugging Face tools load.
    #[command(
        after_help = "Example:\n  ckpt export file://./runs/demo model.safetensors --dtype bf16\n  ckpt export s3://bucket/run1 head.safetensors --step 1200 --tensors 'head.*'"
    )]
    Export {
        /// Checkpoint root URL.
        src: String,
        /// Output file.
        out: PathBuf,
        /// Step (default: the newest committed).
        #[arg(long)]
        step: Option<u64>,
        /// Glob on tensor names.
        #[arg(long, default_value = "*")]
        tensors: String,
        /// Convert float tensors: bf16, f16 or f32.
        #[arg(long, value_parser = parse_dtype)]
        dtype: Option<DType>,
        /// Tensor data held at once.
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        memory_budget: u64,
        /// JSON output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Start a sharded checkpoint from a safetensors file.
    ///
    /// Every tensor is split evenly on dim 0 over --world-size ranks and committed
    /// at --step.
    #[command(
        after_help = "Example:\n  ckpt import model.safetensors file://./runs/finetune --world-size 8"
    )]
    Import {
        /// Input safetensors file.
        input: PathBuf,
        /// Destination root URL.
        dst: String,
        /// Ranks to split over.
        #[arg(long)]
        world_size: u32,
        /// Step of the new checkpoint.
        #[arg(long, default_value_t = 0)]
        step: u64,
        /// Compress with zstd at this level.
        #[arg(long, value_name = "LEVEL")]
        zstd: Option<i32>,
        /// Tensor data held at once.
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        memory_budget: u64,
        /// JSON output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Remove old and partial checkpoints, keeping the K newest.
    ///
    /// Never removes the newest commit, nor one superseded less than --grace ago (a
    /// reader may be loading it), nor a partial one newer than the newest commit (a
    /// save in progress).
    #[command(
        after_help = "Example:\n  ckpt gc file://./runs/demo --keep 3 --dry-run\n  ckpt gc s3://bucket/run1 --keep 5 --grace 30m --json"
    )]
    Gc {
        /// Checkpoint root URL.
        url: String,
        /// Committed checkpoints to keep (at least 1).
        #[arg(long)]
        keep: usize,
        /// How long a superseded commit stays readable.
        #[arg(long, default_value = "10m", value_parser = parse_duration)]
        grace: Duration,
        /// Show what would be removed, remove nothing.
        #[arg(long)]
        dry_run: bool,
        /// JSON output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
}

/// The exit code for a library error.
pub(crate) fn exit_code(error: &Error) -> u8 {
    match error {
        Error::Storage(e) => match e.kind() {
            ErrorKind::Config => EXIT_USAGE,
            ErrorKind::NotFound => EXIT_NOT_FOUND,
            _ => EXIT_STORAGE,
        },
        Error::Corrupt(_) => EXIT_CORRUPT,
        Error::NotFound(_) => EXIT_NOT_FOUND,
        Error::Mismatch(_) | Error::Invalid(_) => EXIT_USAGE,
        Error::Timeout(_) | Error::Failed(_) | Error::Fenced(_) | Error::Mutated(_) => EXIT_STORAGE,
        Error::Device(_) => EXIT_STORAGE,
    }
}

/// Prints the error as one sentence and returns its exit code.
pub(crate) fn fail(error: &Error) -> ExitCode {
    errln!("error: {error}");
    ExitCode::from(exit_code(error))
}

/// A byte-progress bar on stderr, hidden when stderr is not a terminal.
fn progress(total: u64, message: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

async fn open_reader(store: &Store, step: Option<u64>) -> Result<CheckpointReader, Error> {
    CheckpointReader::open(store, step).await
}

/// Runs a checkpoint subcommand.
pub(crate) async fn run(tool: Tool) -> ExitCode {
    let result = match tool {
        Tool::Ls { url, json, store } => ls(&url, json, &store).await,
        Tool::Inspect {
            url,
            step,
            tensors,
            ranks,
            filter,
            json,
            store,
        } => inspect_cmd(&url, step, tensors, ranks, &filter, json, &store).await,
        Tool::Verify {
            url,
            step,
            all,
            memory_budget,
            json,
            store,
        } => verify_cmd(&url, step, all, memory_budget, json, &store).await,
        Tool::Diff {
            a,
            b,
            step_a,
            step_b,
            atol,
            rtol,
            memory_budget,
            json,
            store,
        } => {
            diff_cmd(
                &a,
                &b,
                step_a,
                step_b,
                diff::DiffOptions {
                    atol,
                    rtol,
                    memory_budget,
                },
                json,
                &store,
            )
            .await
        }
        Tool::Reshard {
            src,
            dst,
            world_size,
            layout,
            step,
            zstd,
            no_compress,
            memory_budget,
            json,
            store,
        } => {
            reshard_cmd(
                &src,
                &dst,
                world_size,
                layout,
                step,
                zstd,
                no_compress,
                memory_budget,
                json,
                &store,
            )
            .await
        }
        Tool::Export {
            src,
            out,
            step,
            tensors,
            dtype,
            memory_budget,
            json,
            store,
        } => {
            let options = export::ExportOptions {
                tensors,
                dtype,
                memory_budget,
            };
            export_cmd(&src, &out, step, &options, json, &store).await
        }
        Tool::Import {
            input,
            dst,
            world_size,
            step,
            zstd,
            memory_budget,
            json,
            store,
        } => {
            let mut options = import::ImportOptions::new(world_size);
            options.step = step;
            options.memory_budget = memory_budget;
            if let Some(level) = zstd {
                options.codec = Codec::Zstd { level, shuffle: 0 };
            }
            import_cmd(&input, &dst, &options, json, &store).await
        }
        Tool::Gc {
            url,
            keep,
            grace,
            dry_run,
            json,
            store,
        } => gc_cmd(&url, keep, grace, dry_run, json, &store).await,
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => fail(&e),
    }
}

async fn ls(url: &str, json: bool, args: &StoreArgs) -> Result<u8, Error> {
    let store = args.open(url)?;
    let listed = inspect::ls(&store).await?;
    if json {
        print_json(&serde_json::json!({ "url": store.url(), "checkpoints": listed }));
        return Ok(EXIT_OK);
    }
    if listed.is_empty() {
        outln!("no checkpoints under {}", store.url());
        return Ok(EXIT_OK);
    }
    let mut table = Table::new(&[
        "", "STEP", "STATUS", "WORLD", "TENSORS", "DATA", "STORED", "CODEC", "AGE",
    ]);
    for c in &listed {
        table.row(vec![
            if c.latest { "*".into() } else { String::new() },
            c.step.to_string(),
            c.status.to_string(),
            c.world_size.map_or("-".into(), |w| w.to_string()),
            c.tensors.map_or("-".into(), |t| t.to_string()),
            c.tensor_bytes.map_or("-".into(), bytes),
            bytes(c.stored_bytes),
            c.compression.clone().unwrap_or_else(|| "-".into()),
            c.age_s.map_or("-".into(), age),
        ]);
    }
    out!("{}", table.render(&[1, 3, 4, 5, 6]));
    for c in listed.iter().filter(|c| c.problem.is_some()) {
        outln!(
            "step {}: {}",
            c.step,
            c.problem.as_deref().unwrap_or_default()
        );
    }
    outln!("* = latest: the newest commit whose manifest is valid");
    Ok(EXIT_OK)
}

async fn inspect_cmd(
    url: &str,
    step: Option<u64>,
    tensors: bool,
    ranks: bool,
    filter: &str,
    json: bool,
    args: &StoreArgs,
) -> Result<u8, Error> {
    let store = args.open(url)?;
    let view = inspect::inspect(&store, step, tensors, ranks, filter).await?;
    if json {
        print_json(&view);
        return Ok(EXIT_OK);
    }
    outln!(
        "checkpoint   {}/{}",
        store.url().trim_end_matches('/'),
        view.dir
    );
    outln!("step         {}", view.step);
    outln!("world size   {}", view.world_size);
    outln!("generation   {}", view.generation);
    outln!(
        "format       v{}, blocks of {}, compression {}",
        view.format_version,
        bytes(view.block_size),
        view.compression
    );
    outln!(
        "tensors      {} ({} of data, {} stored)",
        view.tensor_count,
        bytes(view.tensor_bytes),
        bytes(view.stored_bytes)
    );
    let layouts: Vec<String> = view
        .layouts
        .iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect();
    outln!("layouts      {}", layouts.join(", "));
    outln!("committed    {}", render::unix_ms(view.created_unix_ms));
    if !view.global_state.is_empty() {
        outln!("global state {}", view.global_state.join(", "));
    }
    for (key, value) in &view.metadata {
        outln!("metadata     {key} = {value}");
    }
    if let Some(tensors) = &view.tensors {
        outln!();
        let mut table = Table::new(&[
            "TENSOR",
            "DTYPE",
            "SHAPE",
            "BYTES",
            "LAYOUT",
            "CHUNKS (rank: box)",
        ]);
        for t in tensors {
            let chunks: Vec<String> = t
                .chunks
                .iter()
                .take(4)
                .map(|c| {
                    format!(
                        "{}: {}",
                        c.rank,
                        ckpt::Region::new(c.offsets.clone(), c.lengths.clone())
                    )
                })
                .collect();
            let more = t.chunks.len().saturating_sub(4);
            let mut chunk_text = chunks.join("  ");
            if more > 0 {
                chunk_text.push_str(&format!("  (+{more} more)"));
            }
            table.row(vec![
                t.name.clone(),
                t.dtype.clone(),
                format!("{:?}", t.shape),
                bytes(t.bytes),
                t.layout.to_string(),
                chunk_text,
            ]);
        }
        out!("{}", table.render(&[3]));
    }
    if let Some(ranks) = &view.ranks {
        outln!();
        let mut table = Table::new(&[
            "RANK",
            "FILE",
            "STORED",
            "RAW",
            "PART",
            "CHUNKS",
            "RANK STATE",
        ]);
        for r in ranks {
            table.row(vec![
                r.rank.to_string(),
                r.file.clone(),
                bytes(r.stored_bytes),
                bytes(r.raw_bytes),
                bytes(r.part_bytes),
                r.chunks.to_string(),
                r.rank_state.join(","),
            ]);
        }
        out!("{}", table.render(&[0, 2, 3, 4, 5]));
    }
    Ok(EXIT_OK)
}

async fn verify_cmd(
    url: &str,
    step: Option<u64>,
    all: bool,
    budget: u64,
    json: bool,
    args: &StoreArgs,
) -> Result<u8, Error> {
    let store = args.open(url)?;
    // A step named on the command line is looked up in the log; otherwise the
    // commits found are verified as they are, without a second lookup.
    let targets: Vec<(u64, Option<ckpt::Commit>)> = if all {
        let mut newest = ckpt::catalog::newest_commit_per_step(&store).await?;
        newest.reverse();
        newest.into_iter().map(|c| (c.step, Some(c))).collect()
    } else {
        match step {
            Some(step) => vec![(step, None)],
            None => {
                let newest = ckpt::catalog::newest_commit(&store).await?;
                vec![newest.map(|c| (c.step, Some(c))).ok_or_else(|| {
                    Error::NotFound(format!("no committed checkpoint in {}", store.url()))
                })?]
            }
        }
    };
    if targets.is_empty() {
        return Err(Error::NotFound(format!(
            "no committed checkpoint in {}",
            store.url()
        )));
    }
    let options = verify::VerifyOptions {
        memory_budget: budget,
        ..Default::default()
    };
    let mut reports = Vec::new();
    for (step, commit) in targets {
        let bar = progress(0, &format!("verify step {step}"));
        let heard = |event: verify::VerifyProgress| match event {
            verify::VerifyProgress::Total(total) => bar.set_length(total),
            verify::VerifyProgress::Verified(n) => bar.inc(n),
        };
        let report = match &commit {
            Some(commit) => verify::verify_commit(&store, commit, &options, &heard).await?,
            None => verify::verify(&store, step, &options, &heard).await?,
        };
        bar.finish_and_clear();
        if !json {
            if report.ok {
                outln!(
                    "step {}: ok ({} files, {} blocks, {} verified)",
                    report.step,
                    report.files,
                    report.blocks,
                    bytes(report.bytes_verified)
                );
            } else {
                outln!("step {}: {} fault(s)", report.step, report.faults.len());
                for f in &report.faults {
                    outln!("  {f}");
                }
            }
        }
        reports.push(report);
    }
    let ok = reports.iter().all(|r| r.ok);
    if json {
        print_json(&serde_json::json!({ "url": store.url(), "ok": ok, "checkpoints": reports }));
    }
    Ok(if ok { EXIT_OK } else { EXIT_CHECK_FAILED })
}

async fn diff_cmd(
    a: &str,
    b: &str,
    step_a: Option<u64>,
    step_b: Option<u64>,
    options: diff::DiffOptions,
    json: bool,
    args: &StoreArgs,
) -> Result<u8, Error> {
    let (store_a, store_b) = (args.open(a)?, args.open(b)?);
    let reader_a = open_reader(&store_a, step_a).await?;
    let reader_b = open_reader(&store_b, step_b).await?;
    let bar = progress(reader_a.manifest().tensor_bytes(), "diff");
    let report = diff::diff(&reader_a, &reader_b, &options, &|n| bar.inc(n)).await?;
    bar.finish_and_clear();
    let same =
        report.identical || ((options.atol > 0.0 || options.rtol > 0.0) && report.within_tolerance);
    if json {
        print_json(&report);
    } else {
        outln!(
            "A: {} step {} (world {})   B: {} step {} (world {})",
            store_a.url(),
            report.step_a,
            report.world_sizes[0],
            store_b.url(),
            report.step_b,
            report.world_sizes[1]
        );
        let differing: Vec<_> = report
            .tensors
            .iter()
            .filter(|t| t.status != "identical")
            .collect();
        if !differing.is_empty() {
            let mut table = Table::new(&[
                "TENSOR",
                "STATUS",
                "DIFFERING",
                "OF",
                "MAX ABS",
                "MAX REL",
                "IN TOL",
            ]);
            for t in &differing {
                table.row(vec![
                    t.name.clone(),
                    t.detail
                        .as_ref()
                        .map_or(t.status.to_string(), |d| format!("{} ({d})", t.status)),
                    t.differing.to_string(),
                    t.elements.to_string(),
                    format!("{:.3e}", t.max_abs),
                    format!("{:.3e}", t.max_rel),
                    if t.within_tolerance { "yes" } else { "no" }.to_string(),
                ]);
            }
            out!("{}", table.render(&[2, 3, 4, 5]));
        }
        for name in &report.only_in_a {
            outln!("only in A: {name}");
        }
        for name in &report.only_in_b {
            outln!("only in B: {name}");
        }
        for d in &report.state_differences {
            outln!("{d}");
        }
        if report.identical {
            outln!("identical: {} tensors, bitwise", report.tensors.len());
        } else if same {
            outln!(
                "within tolerance (atol {}, rtol {})",
                options.atol,
                options.rtol
            );
        } else {
            outln!("different");
        }
    }
    Ok(if same { EXIT_OK } else { EXIT_CHECK_FAILED })
}

#[allow(clippy::too_many_arguments)]
async fn reshard_cmd(
    src: &str,
    dst: &str,
    world_size: Option<u32>,
    layout: Option<PathBuf>,
    step: Option<u64>,
    zstd: Option<i32>,
    no_compress: bool,
    budget: u64,
    json: bool,
    args: &StoreArgs,
) -> Result<u8, Error> {
    let target = match (world_size, layout) {
        (Some(world), _) => reshard::Target::WorldSize(world),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                Error::Invalid(format!("cannot read layout file {}: {e}", path.display()))
            })?;
            let layout: reshard::LayoutFile = serde_json::from_str(&text).map_err(|e| {
                Error::Invalid(format!("layout file {} is not valid: {e}", path.display()))
            })?;
            reshard::Target::Layout(layout)
        }
        (None, None) => return Err(Error::Invalid("give --world-size or --layout".into())),
    };
    let (src_store, dst_store) = (args.open(src)?, args.open(dst)?);
    let reader = open_reader(&src_store, step).await?;
    let codec = match (zstd, no_compress) {
        (Some(level), _) => Some(Codec::Zstd { level, shuffle: 0 }),
        (None, true) => Some(Codec::None),
        _ => None,
    };
    let options = reshard::ReshardOptions {
        memory_budget: budget,
        codec,
        ..Default::default()
    };
    let bar = progress(reader.manifest().tensor_bytes(), "reshard");
    let report = reshard::reshard(&src_store, &reader, &dst_store, &target, &options, &|n| {
        bar.inc(n)
    })
    .await?;
    bar.finish_and_clear();
    if json {
        print_json(&report);
    } else {
        outln!(
            "resharded step {} from {} to {} ranks: {} tensors, {} written to {}",
            report.step,
            report.from_world_size,
            report.to_world_size,
            report.tensors,
            bytes(report.bytes),
            dst_store.url()
        );
    }
    Ok(EXIT_OK)
}

async fn export_cmd(
    src: &str,
    out: &std::path::Path,
    step: Option<u64>,
    options: &export::ExportOptions,
    json: bool,
    args: &StoreArgs,
) -> Result<u8, Error> {
    let store = args.open(src)?;
    let reader = open_reader(&store, step).await?;
    let bar = progress(reader.manifest().tensor_bytes(), "export");
    let report = export::export(&store, &reader, out, options, &|n| bar.inc(n)).await?;
    bar.finish_and_clear();
    if json {
        print_json(&report);
    } else {
        outln!(
            "exported step {}: {} tensors, {} to {}",
            report.step,
            report.tensors,
            bytes(report.bytes),
            report.path
        );
    }
    Ok(EXIT_OK)
}

async fn import_cmd(
    input: &std::path::Path,
    dst: &str,
    options: &import::ImportOptions,
    json: bool,
    args: &StoreArgs,
) -> Result<u8, Error> {
    let store = args.open(dst)?;
    let size = std::fs::metadata(input).map(|m| m.len()).unwrap_or(0);
    let bar = progress(size, "import");
    let report = import::import(input, &store, options, &|n| bar.inc(n)).await?;
    bar.finish_and_clear();
    if json {
        print_json(&report);
    } else {
        outln!(
            "imported {} tensors ({}) as step {} over {} ranks into {}",
            report.tensors,
            bytes(report.bytes),
            report.step,
            report.world_size,
            store.url()
        );
    }
    Ok(EXIT_OK)
}

async fn gc_cmd(
    url: &str,
    keep: usize,
    grace: Duration,
    dry_run: bool,
    json: bool,
    args: &StoreArgs,
) -> Result<u8, Error> {
    if keep == 0 {
        return Err(Error::Invalid(
            "--keep must be at least 1: the newest commit is never removed".into(),
        ));
    }
    let store = args.open(url)?;
    let plan = gc::plan(&store, keep, grace).await?;
    if !dry_run {
        gc::apply(&store, &plan, &|r| {
            if !json {
                outln!(
                    "removed step {} {} ({}): {}",
                    r.step,
                    r.dir,
                    bytes(r.bytes),
                    r.reason
                );
            }
        })
        .await?;
    }
    if json {
        print_json(&serde_json::json!({ "url": store.url(), "dry_run": dry_run, "plan": plan }));
    } else {
        if dry_run {
            for r in &plan.remove {
                outln!(
                    "would remove step {} {} ({}): {}",
                    r.step,
                    r.dir,
                    bytes(r.bytes),
                    r.reason
                );
            }
        }
        outln!(
            "{} {} checkpoint(s), {}; kept {}",
            if dry_run { "would remove" } else { "removed" },
            plan.remove.len(),
            bytes(plan.bytes_freed),
            plan.kept.len()
        );
    }
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_parse() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("0").is_err());
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_dtype("int8").is_err());
    }
}
