//! `ckpt ls` and `ckpt inspect`: what a root holds and what one checkpoint
//! describes, as tables or JSON.

use ckpt::Error;
use ckpt::tools::inspect;

use super::render::{self, Table, age, bytes};
use crate::exit;
use crate::output::{out, outln, print_json};
use crate::store::StoreArgs;

pub(super) async fn ls(url: &str, json: bool, args: &StoreArgs) -> Result<u8, Error> {
    let store = args.open(url)?;
    let listed = inspect::ls(&store).await?;
    if json {
        print_json(&serde_json::json!({ "url": store.url(), "checkpoints": listed }));
        return Ok(exit::OK);
    }
    if listed.is_empty() {
        outln!("no checkpoints under {}", store.url());
        return Ok(exit::OK);
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
    Ok(exit::OK)
}

pub(super) async fn inspect_cmd(
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
        return Ok(exit::OK);
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
    Ok(exit::OK)
}
