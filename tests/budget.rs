//! A save larger than the host memory budget: staged and uploaded in pieces, it
//! commits a checkpoint that loads back bit for bit and that describes itself (block
//! CRCs, frames, health) exactly as a whole-file save of the same state does, while
//! the budget's peak and the process's resident memory stay at the budget, not the
//! file.

use ckpt_testkit::{self as common, Capability};

use std::io::Write;
use std::sync::{Arc, Mutex};

use ckpt::format::{Codec, RankPart};
use ckpt::storage::{Store, StoreConfig};
use ckpt::{
    CheckpointConfig, CheckpointReader, Checkpointer, DType, Error, LoadRequest, Region, State,
    as_bytes,
};
use common::{Tensor, local_store, s3_store};

const MIB: u64 = 1 << 20;

/// The tensors of `world` ranks: a weight sharded on dim 0 (each rank's shard
/// `shard_mib` MiB, with a NaN in rank 0's), a bias, and a small replicated box
/// that rank 0 writes and the others only hold.
fn tensors(shard_mib: u64, world: u64) -> Vec<Tensor> {
    let rows = shard_mib * MIB * world / (256 * 4);
    let mut weight = Tensor::new("weight", &[rows, 256], 7);
    weight.data[12_345] = f32::NAN;
    vec![
        weight,
        Tensor::new("bias", &[rows], 8),
        Tensor::new("scale", &[4, 1000], 9),
    ]
}

fn state(tensors: &[Tensor], rank: usize, world: usize) -> State<'_> {
    let mut state = State::new();
    for t in &tensors[..2] {
        state
            .add_dim0_shard(
                t.name.clone(),
                DType::F32,
                &t.shape,
                rank,
                world,
                as_bytes(t.shard(rank, world)),
            )
            .unwrap();
    }
    let scale = &tensors[2];
    state
        .add_replica(
            scale.name.clone(),
            DType::F32,
            &scale.shape,
            Region::full(&scale.shape),
            as_bytes(&scale.data),
            rank == 0,
        )
        .unwrap();
    state.set_global_json("step", serde_json::json!(1));
    state
}

fn config(rank: usize, world: usize, budget: Option<u64>, codec: Codec) -> CheckpointConfig {
    let mut config = CheckpointConfig::new(rank, world);
    config.run_id = "budget".into();
    config.block_size = 64 << 10;
    config.host_memory_budget = budget;
    config.codec = codec;
    config
}

/// Saves step 1 of `tensors` from `world` ranks with `budget` each; returns every
/// rank's peak of held host memory once committed.
async fn save(
    store: &Store,
    tensors: &[Tensor],
    world: usize,
    budget: Option<u64>,
    codec: Codec,
) -> Vec<u64> {
    let checkpointers: Vec<Checkpointer> = (0..world)
        .map(|rank| Checkpointer::new(store.clone(), config(rank, world, budget, codec)).unwrap())
        .collect();
    let mut handles = Vec::new();
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        handles.push(
            checkpointer
                .save(1, &state(tensors, rank, world))
                .await
                .unwrap(),
        );
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
    checkpointers
        .iter()
        .map(|c| c.host_bytes_held().peak)
        .collect()
}

/// Every tensor loads back bit for bit (the NaN included).
async fn assert_loads_bitwise(store: &Store, tensors: &[Tensor]) {
    let reader = CheckpointReader::open(store, None).await.unwrap();
    let loaded = reader
        .load(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap();
    for t in tensors {
        let got = loaded.tensors.iter().find(|l| l.name == t.name).unwrap();
        assert!(got.data == as_bytes(&t.data), "{} differs", t.name);
    }
}

async fn parts(store: &Store, world: u32) -> Vec<RankPart> {
    let reader = CheckpointReader::open(store, None).await.unwrap();
    let mut out = Vec::new();
    for rank in 0..world {
        out.push((*reader.part(rank).await.unwrap()).clone());
    }
    out
}

/// Saves from `world` ranks, over a budget of a third of a rank's file, and checks
/// the commit against a whole-file save of the same state on local disk.
async fn piecewise_matches_a_whole_save(
    store: &Store,
    world: usize,
    shard_mib: u64,
    budget: u64,
    codec: Codec,
) {
    let tensors = tensors(shard_mib, world as u64);
    let peaks = save(store, &tensors, world, Some(budget), codec).await;
    for (rank, peak) in peaks.iter().enumerate() {
        assert!(
            *peak <= budget,
            "rank {rank} held {peak} bytes at its peak, over {budget}"
        );
        assert!(*peak > 0, "rank {rank} staged nothing");
    }
    assert_loads_bitwise(store, &tensors).await;

    let (whole_store, _dir) = local_store("budget-whole");
    save(&whole_store, &tensors, world, None, codec).await;
    let world = world as u32;
    let (pieced, whole) = (parts(store, world).await, parts(&whole_store, world).await);
    for (p, w) in pieced.iter().zip(&whole) {
        assert!(
            p.file.raw_bytes >= 3 * budget,
            "rank {}'s file ({} bytes) is not 3x the budget",
            p.rank,
            p.file.raw_bytes
        );
        assert_eq!(p.file.raw_bytes, w.file.raw_bytes);
        assert_eq!(p.file.stored_bytes, w.file.stored_bytes);
        assert_eq!(p.file.block_crc32, w.file.block_crc32, "rank {}", p.rank);
        assert_eq!(p.file.frame_bytes, w.file.frame_bytes, "rank {}", p.rank);
        assert_eq!(p.chunks, w.chunks);
        assert_eq!(p.health, w.health, "rank {}", p.rank);
    }
    let health = pieced[0].health.as_ref().unwrap();
    assert_eq!(health.nonfinite.len(), 1, "the NaN is counted: {health:?}");
    for part in &pieced {
        let replicas = &part.health.as_ref().unwrap().replicas;
        assert_eq!(replicas.len(), 1, "rank {}'s replica is hashed", part.rank);
        assert_eq!(replicas[0].written, part.rank == 0);
    }
}

const ZSTD: Codec = Codec::Zstd {
    level: 1,
    shuffle: 4,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_three_times_the_budget_commits_in_pieces_on_local_disk() {
    // 2 MiB: below one 5 MiB part, so each window's bytes wait in the store's part.
    let (store, _dir) = local_store("budget-plain");
    piecewise_matches_a_whole_save(&store, 2, 6, 2 * MIB, Codec::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_save_three_times_the_budget_commits_in_pieces_on_local_disk() {
    let (store, _dir) = local_store("budget-zstd");
    piecewise_matches_a_whole_save(&store, 2, 6, 2 * MIB, ZSTD).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_three_times_the_budget_commits_in_pieces_on_s3() {
    if !common::has(Capability::Servers) {
        return;
    }
    // 6 MiB: one 5 MiB part per window, uploaded straight from it.
    piecewise_matches_a_whole_save(&s3_store("budget-plain"), 1, 18, 6 * MIB, Codec::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_save_three_times_the_budget_commits_in_pieces_on_s3() {
    if !common::has(Capability::Servers) {
        return;
    }
    piecewise_matches_a_whole_save(&s3_store("budget-zstd"), 1, 18, 6 * MIB, ZSTD).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_piecewise_save_keeps_no_copy_and_says_why() {
    let (store, _dir) = local_store("budget-copy");
    let tensors = tensors(1, 1);
    let mut config = config(0, 1, Some(MIB / 2), Codec::None);
    config.keep_copy = true;
    let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
    let handle = checkpointer.save(1, &state(&tensors, 0, 1)).await.unwrap();
    handle.committed().await.unwrap();
    assert!(handle.copy().is_none());
    let error = handle.staged_copy().await.unwrap_err().to_string();
    assert!(error.contains("in pieces"), "{error}");
    assert_loads_bitwise(&store, &tensors).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlapped_save_over_the_budget_returns_staged_once_its_file_is_stored() {
    let (store, _dir) = local_store("budget-overlapped");
    let tensors = tensors(3, 1);
    let checkpointer =
        Checkpointer::new(store.clone(), config(0, 1, Some(MIB), Codec::None)).unwrap();
    let state = state(&tensors, 0, 1);
    // SAFETY: the tensors outlive the handle and are not written.
    let handle = unsafe { checkpointer.save_overlapped(1, &state) }
        .await
        .unwrap();
    assert!(
        handle.is_staged(),
        "the pieces were read before it returned"
    );
    assert!(handle.stall() >= handle.staged().await.unwrap());
    handle.committed().await.unwrap();
    assert!(checkpointer.host_bytes_held().peak <= MIB);
    assert_loads_bitwise(&store, &tensors).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_below_one_block_refuses_the_save() {
    let (store, _dir) = local_store("budget-block");
    let tensors = tensors(1, 1);
    let checkpointer = Checkpointer::new(store, config(0, 1, Some(32 << 10), Codec::None)).unwrap();
    let error = checkpointer
        .save(1, &state(&tensors, 0, 1))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, Error::OverBudget(m) if m.contains("not even one block")),
        "{error}"
    );
}

// Resident memory: a child process (this binary again, this test alone) saves a
// state of three times its budget and reports its peak resident set.

const CHILD: &str = "CKPT_BUDGET_RSS_CHILD";
const STATE_MIB: u64 = 96;
const BUDGET_MIB: u64 = 32;
/// What the process may hold besides the state and the budget while saving: the
/// runtime's and the encode threads' stacks, the upload's requests, the part being
/// described, allocator slack. Measured: about 4 MiB (the window is whole parts, so
/// the store copies none of it): the resident set grows by 36 MiB.
const SLACK_MIB: u64 = 24;

/// `VmRSS` or `VmHWM` of this process, in bytes.
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn measure_in_child() {
    let log = Log::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || writer.clone())
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The default 16 MiB parts: the 32 MiB window is two of them.
    let store = Store::open(
        &format!("file://{}", dir.path().display()),
        StoreConfig::default(),
    )
    .unwrap();
    let rows = STATE_MIB * MIB / (1024 * 4);
    let data = common::floats((rows * 1024) as usize, 3);
    let mut state = State::new();
    state
        .add_dim0_shard("w", DType::F32, &[rows, 1024], 0, 1, as_bytes(&data))
        .unwrap();
    let before = status_kib("VmRSS:");
    let (stall, peak) = runtime.block_on(async {
        let config = config(0, 1, Some(BUDGET_MIB * MIB), Codec::None);
        let checkpointer = Checkpointer::new(store, config).unwrap();
        let handle = checkpointer.save(1, &state).await.unwrap();
        handle.committed().await.unwrap();
        (handle.stall(), checkpointer.host_bytes_held().peak)
    });
    let hwm = status_kib("VmHWM:");
    let text = String::from_utf8_lossy(&log.0.lock().unwrap()).into_owned();
    let warnings = text
        .lines()
        .filter(|l| l.contains("staging in pieces"))
        .count();
    println!(
        "measured: rss_before={before} hwm={hwm} peak={peak} stall_ms={} warnings={warnings}",
        stall.as_millis()
    );
    eprintln!("{text}");
}

#[test]
fn a_piecewise_save_holds_the_budget_not_the_file_in_resident_memory() {
    if std::env::var_os(CHILD).is_some() {
        measure_in_child();
        return;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "a_piecewise_save_holds_the_budget_not_the_file_in_resident_memory",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "child failed: {stdout}\n{stderr}");
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("measured:").map(|(_, m)| m))
        .unwrap_or_else(|| panic!("no measurement: {stdout}\n{stderr}"));
    let value = |key: &str| -> u64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
            .unwrap()
            .parse()
            .unwrap()
    };
    eprintln!("{line}");
    let (before, hwm) = (value("rss_before"), value("hwm"));
    assert!(before >= STATE_MIB * MIB, "the state is resident: {line}");
    assert!(
        hwm - before < (BUDGET_MIB + SLACK_MIB) * MIB,
        "saving a {STATE_MIB} MiB state over a {BUDGET_MIB} MiB budget grew the resident set by \
         {} MiB: {line}",
        (hwm - before) / MIB
    );
    assert!(value("peak") <= BUDGET_MIB * MIB, "{line}");
    assert_eq!(
        value("warnings"),
        1,
        "one warning per piecewise save: {stderr}"
    );
}
