//! Host memory stays bounded across saves: the staging buffer is taken from the pool
//! and given back, so twenty consecutive saves of the same 64 MiB state do not grow
//! the resident set. Alone in its binary so that no other test moves the RSS.

use ckpt::storage::Store;
use ckpt::{CheckpointConfig, Checkpointer, DType, Region, State, as_bytes};

const TENSORS: usize = 4;
/// f32 elements per tensor: 4 × 16 MiB = 64 MiB per save.
const ROWS: u64 = 4096;
const COLS: u64 = 1024;
const SAVES: usize = 20;
/// Growth allowed between the second and the last save.
const SLACK_BYTES: u64 = 16 << 20;

/// Resident set size of this process, from /proc/self/status.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/self/status");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmRSS value in kB");
    kib * 1024
}

#[test]
fn twenty_saves_of_64_mib_keep_rss_flat() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let shape = [ROWS, COLS];
    let mut weights: Vec<Vec<f32>> = (0..TENSORS)
        .map(|t| {
            (0..ROWS * COLS)
                .map(|i| (i as f32) * 0.25 + t as f32)
                .collect()
        })
        .collect();

    let rss = runtime.block_on(async {
        let store = Store::from_url(&url).unwrap();
        let mut config = CheckpointConfig::new(0, 1);
        // Old checkpoints are deleted as new ones commit: disk stays bounded too.
        config.keep_last = Some(2);
        let checkpointer = Checkpointer::new(store, config).unwrap();
        let mut rss = Vec::with_capacity(SAVES);
        let mut last = None;
        for save in 0..SAVES {
            // The training step changes the weights between checkpoints.
            for w in &mut weights {
                w[save] += 1.0;
            }
            let mut state = State::new();
            for (t, w) in weights.iter().enumerate() {
                state
                    .add(
                        format!("layer{t}.weight"),
                        DType::F32,
                        &shape,
                        Region::full(&shape),
                        as_bytes(w),
                    )
                    .unwrap();
            }
            let handle = checkpointer.save(save as u64 + 1, &state).await.unwrap();
            handle.durable().await.unwrap();
            rss.push(rss_bytes());
            last = Some(handle);
        }
        // The last save commits and is the newest checkpoint.
        last.unwrap().committed().await.unwrap();
        let reader = ckpt::CheckpointReader::open(checkpointer.store(), None)
            .await
            .unwrap();
        assert_eq!(reader.step(), SAVES as u64);
        rss
    });

    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let series: Vec<String> = rss.iter().map(|&b| format!("{:.1}", mib(b))).collect();
    println!(
        "RSS after each of {SAVES} saves of {} MiB (MiB): {}",
        (TENSORS as u64 * ROWS * COLS * 4) >> 20,
        series.join(" ")
    );
    let (second, last) = (rss[1], rss[SAVES - 1]);
    assert!(
        last < second + SLACK_BYTES,
        "RSS grew from {:.1} MiB after save 2 to {:.1} MiB after save {SAVES} (slack {} MiB): staging buffers are not reused",
        mib(second),
        mib(last),
        SLACK_BYTES >> 20
    );
}
