//! `ckpt reshard`, `ckpt export` and `ckpt import`: the commands that stream a
//! checkpoint into another shape (another world size or layout, one safetensors
//! file, or a new sharded checkpoint from one).

use std::path::{Path, PathBuf};

use ckpt::tools::{export, import, reshard};
use ckpt::{CheckpointReader, Codec, Error};

use super::render::{bytes, progress};
use crate::exit;
use crate::output::{outln, print_json};
use crate::store::StoreArgs;

#[allow(clippy::too_many_arguments)]
pub(super) async fn reshard_cmd(
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
    let reader = CheckpointReader::open(&src_store, step).await?;
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
    Ok(exit::OK)
}

pub(super) async fn export_cmd(
    src: &str,
    out: &Path,
    step: Option<u64>,
    options: &export::ExportOptions,
    json: bool,
    args: &StoreArgs,
) -> Result<u8, Error> {
    let store = args.open(src)?;
    let reader = CheckpointReader::open(&store, step).await?;
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
    Ok(exit::OK)
}

pub(super) async fn import_cmd(
    input: &Path,
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
    Ok(exit::OK)
}
