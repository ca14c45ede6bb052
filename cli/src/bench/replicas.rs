//! `ckpt bench --replicas R`: what replica agreement costs a save.
//!
//! The world is `ranks / R` shards of every tensor, each held by R ranks (one
//! process each, as HSDP's replicas are); replica 0 writes, the others only
//! checksum their copy for the commit to compare. Every repetition saves twice
//! through checkpointers that differ only in `replica_mismatch`: `warn` (agreement
//! on, the default) and `off` (the non-writing replicas stage nothing), in
//! alternating order so that drift in the machine's speed falls on both. The figures
//! are the job's: the worst rank's stall, the time from the first rank's call to the
//! last rank's data file and part being durable, and to the commit.
//!
//! The CRC throughput per core that bounds agreement is measured in this process on
//! one thread: plain block CRCs, the save's scan (block CRCs and the float check),
//! and the scan of a box that is also replicated (its slice CRCs combined from the
//! same pieces).

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use super::processes::{Order, Ranks, rank_executable};
use super::{BenchConfig, generate_rank, median};
use ckpt::format::step_dir;
use ckpt::health::{ScanChunk, join_scans, scan_blocks};
use ckpt::storage::Store;
use ckpt::{DType, Result};

/// Replica agreement's cost.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct ReplicasReport {
    /// Rank processes.
    pub ranks: usize,
    /// Replicas of each shard.
    pub replicas: usize,
    /// Bytes each rank holds (and a writer writes).
    pub bytes_per_rank: u64,
    /// Medians over the repetitions: `{stall,durable,commit}_ms` with agreement and
    /// `..._off_ms` without, the same with `overlap_` for overlapped saves (and
    /// `overlap_staged_ms`, the copy their tensors wait for),
    /// `[overlap_]durable_overhead` (with ÷ without − 1), and the
    /// single-thread throughputs `crc_gbps_per_core`, `scan_gbps_per_core`,
    /// `replica_scan_gbps_per_core`.
    pub figures: BTreeMap<String, f64>,
    /// Every repetition's figures.
    pub samples: BTreeMap<String, Vec<f64>>,
}

/// Runs the agreement bench against `store`.
pub(crate) fn run(
    store: &Store,
    rt: &tokio::runtime::Handle,
    config: &BenchConfig,
    progress: &dyn Fn(&str),
) -> Result<ReplicasReport> {
    let shards = config.ranks / config.replicas;
    let mut sharded = config.clone();
    sharded.ranks = shards;
    let bytes_per_rank = sharded.bytes_per_rank(0);
    progress(&format!(
        "replicas: {} rank processes, {shards} shards x {} replicas, {:.0} MiB per rank",
        config.ranks,
        config.replicas,
        bytes_per_rank as f64 / (1 << 20) as f64
    ));
    let mut samples: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut push = |key: &str, value: f64| samples.entry(key.to_string()).or_default().push(value);

    progress("replicas: CRC throughput per core");
    let sample = generate_rank(&sharded, 0);
    let bytes: Vec<u8> = sample
        .iter()
        .flat_map(|t| ckpt::as_bytes(t).iter().copied())
        .take(256 << 20)
        .collect();
    for _ in 0..config.reps {
        for (key, gbps) in crc_throughput(&bytes, config.block_size as usize) {
            push(key, gbps);
        }
    }

    let mut ranks = Ranks::spawn(&rank_executable()?, store, config)?;
    progress("replicas: staging warm-up, then a first save of each kind");
    ranks.all(&Order::WarmUp)?;
    let mut step = 1_000_000u64;
    for no_agreement in [false, true] {
        ranks.all(&save(step, no_agreement))?;
        rt.block_on(store.delete_prefix(&step_dir(step)))?;
        step += 1;
    }
    for rep in 0..config.reps {
        // Alternating which goes first, so drift falls on both.
        let order = if rep % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for overlapped in [false, true] {
            for no_agreement in order {
                progress(&format!(
                    "replicas: rep {}/{}: {} save {} agreement",
                    rep + 1,
                    config.reps,
                    if overlapped { "overlapped" } else { "blocking" },
                    if no_agreement { "without" } else { "with" }
                ));
                let answers = ranks.all(&Order::Save {
                    step,
                    overlapped,
                    no_agreement,
                })?;
                // Processes beyond the saving world (the resharded load's) answer
                // skipped.
                let answers: Vec<_> = answers.into_iter().filter(|a| !a.skipped).collect();
                let prefix = if overlapped { "overlap_" } else { "" };
                let suffix = if no_agreement { "_off" } else { "" };
                let start = answers.iter().map(|a| a.start_ns).min().unwrap_or(0);
                let span = |end: u64| end.saturating_sub(start) as f64 / 1e6;
                push(
                    &format!("{prefix}stall{suffix}_ms"),
                    answers.iter().map(|a| a.stall_ms).fold(0.0, f64::max),
                );
                if overlapped {
                    // The copy the caller's tensors wait for before they change.
                    push(
                        &format!("overlap_staged{suffix}_ms"),
                        answers.iter().map(|a| a.staged_ms).fold(0.0, f64::max),
                    );
                }
                push(
                    &format!("{prefix}durable{suffix}_ms"),
                    span(answers.iter().map(|a| a.durable_ns).max().unwrap_or(0)),
                );
                push(
                    &format!("{prefix}commit{suffix}_ms"),
                    span(answers.iter().map(|a| a.end_ns).min().unwrap_or(0)),
                );
                if !no_agreement {
                    let manifest = rt.block_on(ckpt::read_manifest(store, step))?;
                    let compared = manifest.health.map_or(0, |h| {
                        assert!(h.healthy, "replicas of the bench disagree: {:?}", h.reasons);
                        h.replicas_compared
                    });
                    push("replicas_compared", compared as f64);
                }
                rt.block_on(store.delete_prefix(&step_dir(step)))?;
                step += 1;
            }
        }
    }
    drop(ranks);
    let mut figures: BTreeMap<String, f64> = samples
        .iter()
        .map(|(k, v)| (k.clone(), median(v)))
        .collect();
    for prefix in ["", "overlap_"] {
        if let (Some(with), Some(without)) = (
            figures.get(&format!("{prefix}durable_ms")),
            figures.get(&format!("{prefix}durable_off_ms")),
        ) {
            let overhead = with / without - 1.0;
            figures.insert(format!("{prefix}durable_overhead"), overhead);
        }
    }
    Ok(ReplicasReport {
        ranks: config.ranks,
        replicas: config.replicas,
        bytes_per_rank,
        figures,
        samples,
    })
}

fn save(step: u64, no_agreement: bool) -> Order {
    Order::Save {
        step,
        overlapped: false,
        no_agreement,
    }
}

/// GB/s of one thread over `bytes` (fp32 values): plain block CRCs, the save's scan
/// of a float box, and the scan of a replicated float box.
fn crc_throughput(bytes: &[u8], block: usize) -> [(&'static str, f64); 3] {
    let gbps = |f: &dyn Fn()| {
        let started = Instant::now();
        f();
        bytes.len() as f64 / started.elapsed().as_secs_f64() / 1e9
    };
    let blocks = bytes.len().div_ceil(block);
    let scan = |replicated: bool| {
        let chunks = [ScanChunk::new(0, bytes.len(), DType::F32, replicated)];
        let found = join_scans(
            vec![scan_blocks(bytes, 0..blocks, block, &chunks)],
            &chunks,
            block,
        );
        std::hint::black_box(found);
    };
    [
        (
            "crc_gbps_per_core",
            gbps(&|| {
                std::hint::black_box(ckpt::codec::block_crcs(bytes, block));
            }),
        ),
        ("scan_gbps_per_core", gbps(&|| scan(false))),
        ("replica_scan_gbps_per_core", gbps(&|| scan(true))),
    ]
}
