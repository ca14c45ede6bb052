//! The checkpoint subcommands of `ckpt` (ls, inspect, verify, diff, reshard,
//! export, import, gc): their flags and the dispatch to each command's file. The
//! work itself is in `ckpt::tools`; exit codes are in [`crate::exit`], the store
//! flags in [`crate::store`].

mod check;
mod convert;
mod gc;
mod inspect;
mod parse;
mod render;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use ckpt::tools::{diff, export, import};
use ckpt::{Codec, DType};
use clap::Subcommand;
use parse::{parse_dtype, parse_duration, parse_size};

use crate::exit;
use crate::store::StoreArgs;

/// The checkpoint subcommands.
#[derive(Subcommand, Debug)]
pub(crate) enum Tool {
    /// List the checkpoints under a root.
    ///
    /// Step, committed or partial (and which ranks are missing), health (healthy,
    /// UNHEALTHY with its first reason, or unknown), world size, tensors, bytes,
    /// compression, age; `*` marks the latest commit, `>` what a resume loads when
    /// the latest is unhealthy. Reads every commit's manifest.
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
    /// Step, world size, layouts, format, metadata, health (reasons, non-finite
    /// tensors, replica mismatches, metrics); with --tensors each tensor's dtype,
    /// shape and chunk boxes; with --ranks each rank's files.
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
    /// Never removes the newest commit, nor the newest one not judged unhealthy
    /// (what a resume loads, kept beyond --keep when the newer ones are unhealthy),
    /// nor one superseded less than --grace ago (a reader may be loading it), nor a
    /// partial one newer than the newest commit (a save in progress).
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

/// Runs a checkpoint subcommand.
pub(crate) async fn run(tool: Tool) -> ExitCode {
    let result = match tool {
        Tool::Ls { url, json, store } => inspect::ls(&url, json, &store).await,
        Tool::Inspect {
            url,
            step,
            tensors,
            ranks,
            filter,
            json,
            store,
        } => inspect::inspect_cmd(&url, step, tensors, ranks, &filter, json, &store).await,
        Tool::Verify {
            url,
            step,
            all,
            memory_budget,
            json,
            store,
        } => check::verify_cmd(&url, step, all, memory_budget, json, &store).await,
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
            check::diff_cmd(
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
            convert::reshard_cmd(
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
            convert::export_cmd(&src, &out, step, &options, json, &store).await
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
            convert::import_cmd(&input, &dst, &options, json, &store).await
        }
        Tool::Gc {
            url,
            keep,
            grace,
            dry_run,
            json,
            store,
        } => gc::gc_cmd(&url, keep, grace, dry_run, json, &store).await,
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => exit::fail(&e),
    }
}
