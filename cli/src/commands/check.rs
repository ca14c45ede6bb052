//! `ckpt verify` and `ckpt diff`: the commands whose answer is a verdict, exit 0
//! when the checkpoint is sound (or the two are the same), 1 when not.

use ckpt::tools::{diff, verify};
use ckpt::{CheckpointReader, Error};

use super::render::{Table, bytes, progress};
use crate::exit;
use crate::output::{out, outln, print_json};
use crate::store::StoreArgs;

pub(super) async fn verify_cmd(
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
    Ok(if ok { exit::OK } else { exit::CHECK_FAILED })
}

pub(super) async fn diff_cmd(
    a: &str,
    b: &str,
    step_a: Option<u64>,
    step_b: Option<u64>,
    options: diff::DiffOptions,
    json: bool,
    args: &StoreArgs,
) -> Result<u8, Error> {
    let (store_a, store_b) = (args.open(a)?, args.open(b)?);
    let reader_a = CheckpointReader::open(&store_a, step_a).await?;
    let reader_b = CheckpointReader::open(&store_b, step_b).await?;
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
    Ok(if same { exit::OK } else { exit::CHECK_FAILED })
}
