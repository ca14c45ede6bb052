//! The library's save path against storage faults injected by the chaos proxy in
//! front of the real S3-compatible test server: the faults the reference trainer's
//! tiny checkpoints are too small to meet (a lost multipart part needs objects
//! larger than one part), on a checkpoint large enough to be uploaded in parts.
//!
//! Needs `CKPT_TEST_S3_ENDPOINT` and `CKPT_TEST_S3_BUCKET` (the test command starts
//! the server); without them each test says SKIPPED and returns.

use ckpt::storage::{Store, StoreConfig};
use ckpt::tools::verify::{VerifyOptions, verify};
use ckpt::{
    CheckpointConfig, CheckpointReader, Checkpointer, DType, LoadRequest, Region, State,
    load_latest,
};
use ckpt_chaos::storage_proxy::{Direction, StorageFault, StorageProxy};

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
    let handle = saver.save(1, &state_of(&shape, &data)).await.unwrap();
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
    let handle = saver.save(2, &state_of(&shape, &data)).await.unwrap();
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

/// 64 KiB of f32, different per step: one plain data file written in one PUT and
/// read back in one ranged GET, as the reference trainer's tiny checkpoints are.
fn small_weights(step: u64) -> Vec<u8> {
    (0..16 * 1024u32)
        .flat_map(|i| (i as f32 * 0.25 + step as f32).to_le_bytes())
        .collect()
}

/// Saves `small_weights(step)` as tensor `w` and waits for its commit.
async fn save_small(saver: &Checkpointer, step: u64) -> Vec<u8> {
    let data = small_weights(step);
    let mut state = State::new();
    state
        .add_dim0_shard("w", DType::F32, &[16 * 1024], 0, 1, &data)
        .unwrap();
    saver
        .save(step, &state)
        .await
        .unwrap()
        .committed()
        .await
        .unwrap();
    data
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_flipped_in_a_read_is_read_again_and_the_load_succeeds() {
    let Some((endpoint, bucket)) = server() else {
        return;
    };
    let proxy = StorageProxy::start(&endpoint).unwrap();
    let store = store_through(&proxy, &bucket, "corrupt-get");
    let saver = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    save_small(&saver, 1).await;
    let data = save_small(&saver, 2).await;

    // The block CRC32 finds the damaged response; a second read gets the stored
    // bytes: the newest checkpoint loads, bitwise, and is not taken for corrupt.
    let reads_before = store.requests();
    proxy.inject(StorageFault::CorruptBody {
        direction: Direction::Get,
        count: 1,
    });
    let (reader, mut loaded) = load_latest(&store, LoadRequest::everything).await.unwrap();
    assert_eq!(proxy.stats().corrupted, 1, "the fault met a read");
    assert_eq!(reader.step(), 2, "no fallback for a damaged response");
    assert!(
        loaded.tensors.remove(0).data == data,
        "step 2 loads bitwise"
    );
    assert!(
        store.requests() > reads_before,
        "the load went through the store"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_damaged_every_time_falls_back_naming_the_object_and_offset() {
    let Some((endpoint, bucket)) = server() else {
        return;
    };
    let proxy = StorageProxy::start(&endpoint).unwrap();
    let store = store_through(&proxy, &bucket, "corrupt-get-thrice");
    let saver = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    let one = save_small(&saver, 1).await;
    save_small(&saver, 2).await;
    // Fetch step 2's rank part first, so that the damaged reads all meet its data.
    let reader = CheckpointReader::open(&store, Some(2)).await.unwrap();
    reader.rank_states().await.unwrap();

    // Three reads, three damaged responses: corruption, named.
    proxy.inject(StorageFault::CorruptBody {
        direction: Direction::Get,
        count: 3,
    });
    let request = LoadRequest::new().tensor("w", Region::full(&[16 * 1024]));
    let error = reader.load(&request).await.unwrap_err();
    assert_eq!(proxy.stats().corrupted, 3);
    assert!(error.is_corruption(), "{error}");
    let message = error.to_string();
    assert!(
        message.contains(".bin at byte 0") || message.contains("at byte 0: block 0"),
        "names the data file and the offset: {message}"
    );
    assert!(message.contains("3 reads"), "{message}");

    // The same through load_latest: the commit before is used.
    proxy.inject(StorageFault::CorruptBody {
        direction: Direction::Get,
        count: 3,
    });
    let (reader, mut loaded) = load_latest(&store, LoadRequest::everything).await.unwrap();
    assert_eq!(reader.step(), 1, "fell back to the commit before");
    assert!(loaded.tensors.remove(0).data == one);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_flipped_in_a_put_is_written_again_and_the_save_commits_sound_bytes() {
    let Some((endpoint, bucket)) = server() else {
        return;
    };
    let proxy = StorageProxy::start(&endpoint).unwrap();
    let store = store_through(&proxy, &bucket, "corrupt-put");
    let saver = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    // The first PUT of a save is its data file: damaged once, then twice.
    for (step, damaged) in [(1, 1), (2, 2)] {
        proxy.inject(StorageFault::CorruptBody {
            direction: Direction::Put,
            count: damaged,
        });
        let before = proxy.stats().corrupted;
        let data = save_small(&saver, step).await;
        assert_eq!(proxy.stats().corrupted - before, damaged as u64);
        let report = verify(&store, step, &VerifyOptions::default(), &|_| {})
            .await
            .unwrap();
        assert!(report.ok, "step {step}: {:?}", report.faults);
        assert!(
            read_back(&store, step, &[16 * 1024]).await == data,
            "step {step} reads back bitwise"
        );
    }
    assert_eq!(committed_steps(&store).await, [1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_and_creates_never_leave_bytes_other_than_those_sent() {
    let Some((endpoint, bucket)) = server() else {
        return;
    };
    let proxy = StorageProxy::start(&endpoint).unwrap();
    let store = store_through(&proxy, &bucket, "corrupt-put-store");
    let body = bytes::Bytes::from(small_weights(9));
    let damage = |count| {
        proxy.inject(StorageFault::CorruptBody {
            direction: Direction::Put,
            count,
        })
    };
    // A put and a create (how rank parts, commit records and manifests are
    // written) damaged twice are written a third time, whole.
    damage(2);
    store.put("put", body.clone()).await.unwrap();
    assert!(store.get("put").await.unwrap() == body);
    damage(2);
    store.put_if_absent("create", body.clone()).await.unwrap();
    assert!(store.get("create").await.unwrap() == body);
    // The create still wins once only.
    let again = store.put_if_absent("create", body.clone()).await;
    assert!(again.is_err_and(|e| e.is_already_exists()));
    // Damaged every time: a transient error naming the object and the offset, and
    // a create leaves nothing behind.
    damage(3);
    let error = store
        .put_if_absent("create-3", body.clone())
        .await
        .unwrap_err();
    assert!(error.is_retryable(), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("/create-3:")
            && message.contains(&format!("from byte {}", body.len() / 2)),
        "{message}"
    );
    assert!(store.get("create-3").await.is_err_and(|e| e.is_not_found()));
    assert_eq!(proxy.stats().corrupted, 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_flipped_in_a_multipart_part_fails_the_upload_and_leaves_nothing() {
    let Some((endpoint, bucket)) = server() else {
        return;
    };
    let proxy = StorageProxy::start(&endpoint).unwrap();
    let store = store_through(&proxy, &bucket, "corrupt-part");
    let data = bytes::Bytes::from(weights(3));
    proxy.inject(StorageFault::CorruptBody {
        direction: Direction::Put,
        count: 1,
    });
    let mut upload = store.upload("big").unwrap();
    for piece in data.chunks(PART) {
        upload.write(data.slice_ref(piece)).await.unwrap();
    }
    let error = upload.finish().await.unwrap_err();
    assert_eq!(proxy.stats().corrupted, 1);
    assert!(error.is_retryable(), "{error}");
    assert!(error.to_string().contains("/big: "), "{error}");
    assert!(store.get("big").await.is_err_and(|e| e.is_not_found()));
    // Uploaded again, clean: whole.
    let mut upload = store.upload("big").unwrap();
    for piece in data.chunks(PART) {
        upload.write(data.slice_ref(piece)).await.unwrap();
    }
    upload.finish().await.unwrap();
    assert!(store.get("big").await.unwrap() == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_damaged_in_a_save_is_uploaded_again_and_the_save_commits() {
    let Some((endpoint, bucket)) = server() else {
        return;
    };
    let proxy = StorageProxy::start(&endpoint).unwrap();
    let store = store_through(&proxy, &bucket, "corrupt-part-save");
    let saver = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    let shape = [3 * 1024 * 1024u64];

    // One part of the data file's three damaged: the file goes again, whole.
    let data = weights(1);
    proxy.inject(StorageFault::CorruptBody {
        direction: Direction::Put,
        count: 1,
    });
    let handle = saver.save(1, &state_of(&shape, &data)).await.unwrap();
    handle.committed().await.unwrap();
    assert_eq!(proxy.stats().corrupted, 1);
    let report = verify(&store, 1, &VerifyOptions::default(), &|_| {})
        .await
        .unwrap();
    assert!(report.ok, "{:?}", report.faults);
    assert!(
        read_back(&store, 1, &shape).await == data,
        "step 1 reads back bitwise"
    );

    // Damaged in every upload (each sends three parts, one at least of which is
    // damaged): the save fails naming the damage, and nothing is committed.
    proxy.inject(StorageFault::CorruptBody {
        direction: Direction::Put,
        count: 7,
    });
    let handle = saver.save(2, &state_of(&shape, &weights(2))).await.unwrap();
    let error = handle.committed().await.unwrap_err();
    assert_eq!(proxy.stats().corrupted, 8);
    assert!(
        error.to_string().contains("other bytes than those sent"),
        "{error}"
    );
    assert_eq!(committed_steps(&store).await, [1]);
}

/// One tensor `w` of `shape`, whole on a world of one.
fn state_of<'a>(shape: &[u64], data: &'a [u8]) -> State<'a> {
    let mut state = State::new();
    state
        .add_dim0_shard("w", DType::F32, shape, 0, 1, data)
        .unwrap();
    state
}
