//! The library's save path against storage faults injected by the chaos proxy in
//! front of the real S3-compatible test server: the faults the reference trainer's
//! tiny checkpoints are too small to meet (a lost multipart part needs objects
//! larger than one part), on a checkpoint large enough to be uploaded in parts.
//!
//! Needs `CKPT_TEST_S3_ENDPOINT` and `CKPT_TEST_S3_BUCKET` (the test command starts
//! the server); without them each test says SKIPPED and returns.

use ckpt::storage::{Store, StoreConfig};
use ckpt::tools::verify::{VerifyOptions, verify};
use ckpt::{CheckpointConfig, CheckpointReader, Checkpointer, DType, LoadRequest, Region, State};
use ckpt_chaos::storage_proxy::{StorageFault, StorageProxy};

const PART: usize = ckpt::storage::MIN_PART_SIZE;

mod common;

use common::{committed_steps, config_at, server, unique_prefix};

/// A store on a fresh prefix reached through `proxy`, cutting objects into parts
/// of the smallest size S3 accepts, retrying fast.
fn store_through(proxy: &StorageProxy, bucket: &str, name: &str) -> Store {
    let config = StoreConfig {
        part_size: PART,
        ..config_at(&proxy.endpoint(), 4)
    };
    Store::open(&format!("s3://{bucket}/{}", unique_prefix(name)), config).unwrap()
}

/// 12 MiB of f32 (three parts of 5 MiB, the last short), different per step.
fn weights(step: u64) -> Vec<u8> {
    (0..3 * 1024 * 1024u32)
        .flat_map(|i| (i as f32 * 0.5 + step as f32).to_le_bytes())
        .collect()
}

/// Tensor `w` of step `step`, whole.
async fn read_back(store: &Store, step: u64, shape: &[u64]) -> Vec<u8> {
    let reader = CheckpointReader::open(store, Some(step)).await.unwrap();
    let request = LoadRequest::new().tensor("w", Region::full(shape));
    let mut loaded = reader.load(&request).await.unwrap();
    loaded.tensors.remove(0).data
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_part_fails_the_save_and_the_next_save_commits() {
    let Some((endpoint, bucket)) = server() else {
        return;
    };
    let proxy = StorageProxy::start(&endpoint).unwrap();
    let store = store_through(&proxy, &bucket, "lost-part");
    let saver = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    let shape = [3 * 1024 * 1024u64];

    // The proxy answers one UploadPart with 200 and drops it: the upload's
    // completion is refused, so the save fails and commits nothing.
    proxy.inject(StorageFault::LosePart { count: 1 });
    let data = weights(1);
    let mut state = State::new();
    state
        .add_dim0_shard("w", DType::F32, &shape, 0, 1, &data)
        .unwrap();
    let handle = saver.save(1, &state).await.unwrap();
    let error = handle.committed().await.unwrap_err();
    assert_eq!(
        proxy.stats().lost_parts,
        1,
        "the fault met a multipart upload"
    );
    assert!(
        committed_steps(&store).await.is_empty(),
        "no commit after a lost part ({error})"
    );

    // The next save, with nothing lost, commits and reads back bitwise.
    let data = weights(2);
    let mut state = State::new();
    state
        .add_dim0_shard("w", DType::F32, &shape, 0, 1, &data)
        .unwrap();
    let handle = saver.save(2, &state).await.unwrap();
    handle.committed().await.unwrap();
    assert_eq!(committed_steps(&store).await, [2]);
    let report = verify(&store, 2, &VerifyOptions::default(), &|_| {})
        .await
        .unwrap();
    assert!(report.ok, "{:?}", report.faults);
    assert!(
        read_back(&store, 2, &shape).await == data,
        "step 2 reads back bitwise"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_and_resets_within_the_retry_budget_cost_a_multipart_save_nothing() {
    let Some((endpoint, bucket)) = server() else {
        return;
    };
    let proxy = StorageProxy::start(&endpoint).unwrap();
    let store = store_through(&proxy, &bucket, "retried");
    let saver = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    let shape = [3 * 1024 * 1024u64];
    proxy.inject(StorageFault::Errors {
        status: 503,
        count: 2,
    });
    proxy.inject(StorageFault::ResetMidBody { count: 2 });
    proxy.inject(StorageFault::Latency { ms: 200, count: 3 });
    let data = weights(7);
    let mut state = State::new();
    state
        .add_dim0_shard("w", DType::F32, &shape, 0, 1, &data)
        .unwrap();
    let handle = saver.save(7, &state).await.unwrap();
    handle.committed().await.unwrap();
    let stats = proxy.stats();
    assert_eq!(
        (stats.errors, stats.resets, stats.delayed),
        (2, 2, 3),
        "every fault met a request: {stats:?}"
    );
    let report = verify(&store, 7, &VerifyOptions::default(), &|_| {})
        .await
        .unwrap();
    assert!(report.ok, "{:?}", report.faults);
    assert!(read_back(&store, 7, &shape).await == data);
}
