//! A save that one rank cannot write, through the chaos proxy in front of the real
//! S3-compatible test server: every rank must learn the outcome at once (not after
//! the commit timeout), and a connection reset while a rank writes its part is
//! retried like any other request.
//!
//! Needs `CKPT_TEST_S3_ENDPOINT` and `CKPT_TEST_S3_BUCKET` (the test command starts
//! the server); without them each test says SKIPPED and returns.

use std::time::{Duration, Instant};

use ckpt::storage::Store;
use ckpt::{CheckpointConfig, Checkpointer, DType, SaveHandle, State};
use ckpt_chaos::storage_proxy::{StorageFault, StorageProxy};

mod common;

use common::{committed_steps, config_at, server, unique_prefix};

/// One test at a time: a failpoint hold stops every save of the process.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The store at `s3://bucket/prefix` reached at `endpoint`.
fn store_at(endpoint: &str, bucket: &str, prefix: &str, max_retries: usize) -> Store {
    Store::open(
        &format!("s3://{bucket}/{prefix}"),
        config_at(endpoint, max_retries),
    )
    .unwrap()
}

/// 16 rows of 64 f32, different per step.
const SHAPE: [u64; 2] = [16, 64];

fn weights(step: u64) -> Vec<u8> {
    (0..16 * 64u32)
        .flat_map(|i| (i as f32 * 0.25 + step as f32).to_le_bytes())
        .collect()
}

/// Rank `rank` of `world` saves its rows of `weights(step)`.
async fn save(saver: &Checkpointer, step: u64, rank: usize, world: usize) -> SaveHandle {
    let data = weights(step);
    let rows = ckpt::Region::dim0_shard(&SHAPE, rank, world);
    let row_bytes = SHAPE[1] as usize * 4;
    let first = rows.offsets[0] as usize;
    let mine = &data[first * row_bytes..(first + rows.lengths[0] as usize) * row_bytes];
    let mut state = State::new();
    state
        .add_dim0_shard("w", DType::F32, &SHAPE, rank, world, mine)
        .unwrap();
    saver.save(step, &state).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_cannot_upload_fails_the_save_for_every_rank_at_once() {
    let Some((endpoint, bucket)) = server() else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let proxy = StorageProxy::start(&endpoint).unwrap();
    let prefix = unique_prefix("cannot-upload");
    // Rank 0 reaches the store through the proxy; the others directly. Four ranks:
    // three committers (0, 3 and 2) and one rank (1) that only reads the outcome.
    let world = 4;
    let savers: Vec<Checkpointer> = (0..world)
        .map(|rank| {
            let store = if rank == 0 {
                store_at(&proxy.endpoint(), &bucket, &prefix, 2)
            } else {
                store_at(&endpoint, &bucket, &prefix, 2)
            };
            Checkpointer::new(store, CheckpointConfig::new(rank, world)).unwrap()
        })
        .collect();
    // Rank 0's data file: its first try and both retries reset mid-body, so its
    // save fails; the commit timeout (10 min by default) is not what ends it.
    proxy.inject(StorageFault::ResetMidBody { count: 3 });
    let mut handles = Vec::new();
    for (rank, saver) in savers.iter().enumerate() {
        handles.push(save(saver, 1, rank, world).await);
    }
    let started = Instant::now();
    for (rank, handle) in handles.iter().enumerate() {
        let outcome = tokio::time::timeout(Duration::from_secs(60), handle.committed())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "rank {rank} still waits for step 1 after {:?}, although rank 0's save failed",
                    started.elapsed()
                )
            });
        let error = outcome.expect_err("step 1 cannot commit without rank 0's data");
        if rank != 0 {
            assert!(
                error.to_string().contains("rank 0"),
                "rank {rank} is told which rank failed: {error}"
            );
        }
    }
    assert_eq!(proxy.stats().resets, 3, "{:?}", proxy.stats());
    let store = savers[1].store();
    assert!(committed_steps(store).await.is_empty());

    // The next save, with nothing reset, commits on every rank.
    let mut handles = Vec::new();
    for (rank, saver) in savers.iter().enumerate() {
        handles.push(save(saver, 2, rank, world).await);
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
    assert_eq!(committed_steps(store).await, [2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_while_a_rank_writes_its_part_is_retried_and_the_save_commits() {
    let Some((endpoint, bucket)) = server() else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let proxy = StorageProxy::start(&endpoint).unwrap();
    let store = store_at(&proxy.endpoint(), &bucket, &unique_prefix("part-reset"), 4);
    let saver = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    // The data file goes up untouched; the next body after it, the rank's part (a
    // create-if-absent put), is cut once.
    let hold = ckpt::failpoint::hold("after-data-upload").unwrap();
    let handle = save(&saver, 1, 0, 1).await;
    let reached = tokio::task::block_in_place(|| hold.wait_reached(Duration::from_secs(60)));
    assert!(reached, "the save reached its data file's end");
    proxy.inject(StorageFault::ResetMidBody { count: 1 });
    hold.release();
    handle
        .committed()
        .await
        .expect("a reset part write is retried");
    assert_eq!(proxy.stats().resets, 1, "{:?}", proxy.stats());
    assert_eq!(committed_steps(&store).await, [1]);
}
