//! `ckpt gc`: removes old and partial checkpoints by the library's retention
//! rule, or with `--dry-run` shows what it would remove.

use std::time::Duration;

use ckpt::Error;
use ckpt::tools::gc;

use super::render::bytes;
use crate::exit;
use crate::output::{outln, print_json};
use crate::store::StoreArgs;

pub(super) async fn gc_cmd(
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
        for held in &plan.held {
            outln!("keeping step {} {}: {}", held.step, held.dir, held.reason);
        }
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
    Ok(exit::OK)
}
