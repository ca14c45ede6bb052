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
        "", "STEP", "STATUS", "HEALTH", "WORLD", "TENSORS", "DATA", "STORED", "CODEC", "AGE",
    ]);
    for c in &listed {
        let mark = match (c.latest, c.resume) {
            (true, _) => "*",
            (false, true) => ">",
            (false, false) => "",
        };
        let health = match (c.healthy, c.status) {
            (Some(true), _) => "healthy",
            (Some(false), _) => "UNHEALTHY",
            (None, "committed" | "abandoned") => "unknown",
            (None, _) => "-",
        };
        table.row(vec![
            mark.into(),
            c.step.to_string(),
            c.status.to_string(),
            health.into(),
            c.world_size.map_or("-".into(), |w| w.to_string()),
            c.tensors.map_or("-".into(), |t| t.to_string()),
            c.tensor_bytes.map_or("-".into(), bytes),
            bytes(c.stored_bytes),
            c.compression.clone().unwrap_or_else(|| "-".into()),
            c.age_s.map_or("-".into(), age),
        ]);
    }
    out!("{}", table.render(&[1, 4, 5, 6, 7]));
    for c in &listed {
        if let Some(problem) = &c.problem {
            outln!("step {}: {problem}", c.step);
        }
        if let Some(first) = c.health_reasons.first() {
            let more = match c.health_reasons.len() - 1 {
                0 => String::new(),
                n => format!(" (+{n} more: ckpt inspect --step {})", c.step),
            };
            outln!(
                "step {}: unhealthy: {}{more}",
                c.step,
                truncate(first, REASON_CHARS)
            );
        }
    }
    outln!("* = latest: the newest commit whose manifest is valid");
    if listed.iter().any(|c| c.resume && !c.latest) {
        outln!("> = what a resume loads: the newest commit not judged unhealthy");
    }
    Ok(exit::OK)
}

/// Characters of an unhealthy checkpoint's first reason that `ls` prints.
const REASON_CHARS: usize = 160;

/// `text`, cut to `max` characters with an ellipsis when longer.
fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

/// The health section of `inspect`.
fn health_lines(view: &inspect::Inspection) {
    let Some(health) = &view.health else {
        outln!(
            "health       unknown: no health recorded (format v{}: written before v4, or by an offline tool)",
            view.format_version
        );
        return;
    };
    if health.healthy {
        outln!("health       healthy");
    } else {
        outln!("health       UNHEALTHY: a resume passes over it unless asked for it");
    }
    for reason in &health.reasons {
        outln!("  reason     {reason}");
    }
    for found in &health.nonfinite {
        outln!(
            "non-finite   {}: {} element{} (rank{} {})",
            found.tensor,
            found.elements,
            if found.elements == 1 { "" } else { "s" },
            if found.ranks.len() == 1 { "" } else { "s" },
            ranks_list(&found.ranks)
        );
    }
    match health.replicas_compared {
        0 if health.replica_mismatches.is_empty() => outln!("replicas     none compared"),
        n => outln!(
            "replicas     {n} box{} compared, {} disagree",
            if n == 1 { "" } else { "es" },
            health.replica_mismatches.len()
        ),
    }
    for m in &health.replica_mismatches {
        outln!(
            "  mismatch   {} {}: blocks {}; written by rank {}; agree: {}; disagree: {}",
            m.tensor,
            ckpt::Region::new(m.offsets.clone(), m.lengths.clone()),
            m.blocks
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(","),
            m.written_by,
            ranks_list(&m.agree),
            ranks_list(&m.disagree)
        );
    }
    if !health.metrics.is_empty() {
        let metrics: Vec<String> = health
            .metrics
            .iter()
            .map(|(name, value)| format!("{name} = {value}"))
            .collect();
        outln!("metrics      {}", metrics.join(", "));
    }
}

/// Ranks as `0-3,7`, or `none`.
fn ranks_list(ranks: &[u32]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.is_empty() {
        "none".into()
    } else {
        inspect::ranges_text(&sorted)
    }
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
    health_lines(&view);
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
