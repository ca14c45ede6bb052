//! Checkpoints on an S3-compatible server (moto on loopback, started by
//! `scripts/test`): save, load back, reshard, retention and corruption fallback go
//! through the same code as on local disk, and backpressure (`try_save`,
//! `max_in_flight`) is shown deterministically by holding the server's connections
//! behind a gate.

use ckpt_testkit::{self as common, Capability};

use std::time::Duration;

use ckpt::format::Codec;
use ckpt::{CheckpointConfig, CheckpointReader, Checkpointer, LoadRequest, load_latest};
use common::{Tensor, assert_loads, assert_same, dim0_state, model, s3_store};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_saved_to_s3_loads_back_resharded() {
    if !common::has(Capability::Servers) {
        return;
    }
    let store = s3_store("ckpt-s3-roundtrip");
    // Each rank's file is above one 5 MiB part: a multipart upload.
    let tensors = model(1, 11_000);
    common::save_world(&store, 1, 2, &tensors, |_| {}).await;
    let reader = CheckpointReader::open(&store, None).await.expect("open");
    assert_eq!(reader.step(), 1);
    for entry in &reader.manifest().ranks {
        let key = format!("{}/{}", reader.manifest().dir(), entry.file);
        let size = store.head(&key).await.expect("data file").size;
        assert!(size > ckpt::storage::MIN_PART_SIZE as u64, "{key}: {size}");
    }
    assert_loads(&reader, &tensors).await;
    for rank in 0..3 {
        let loaded = reader
            .load(&LoadRequest::dim0_shards(reader.manifest(), rank, 3))
            .await
            .unwrap();
        for t in &tensors {
            let got = loaded.tensors.iter().find(|l| l.name == t.name).unwrap();
            assert_eq!(common::to_f32(&got.data), t.shard(rank, 3), "{}", t.name);
        }
    }
    let states = reader.rank_states().await.unwrap();
    assert_eq!(states.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_checkpoints_on_s3_keep_the_last_and_fall_back_on_corruption() {
    if !common::has(Capability::Servers) {
        return;
    }
    let store = s3_store("ckpt-s3-zstd");
    let codec = Codec::Zstd {
        level: 3,
        shuffle: 0,
    };
    let steps: Vec<Vec<Tensor>> = (1..=3).map(|s| model(s, 64)).collect();
    for (i, tensors) in steps.iter().enumerate() {
        common::save_world(&store, i as u64 + 1, 2, tensors, |c| {
            c.codec = codec;
            c.block_size = 8 << 10;
            c.keep_last = Some(2);
            c.retention_grace = Duration::ZERO;
        })
        .await;
    }
    // The committer's `committed()` returns once its retention pass has ended.
    assert_eq!(
        common::steps(&store).await,
        vec![(2, true), (3, true)],
        "step 1 is collected"
    );
    assert_loads(
        &CheckpointReader::open(&store, Some(3)).await.unwrap(),
        &steps[2],
    )
    .await;

    // Flip a bit in step 3's rank 1 file on the server: load_latest uses step 2.
    let manifest = ckpt::read_manifest(&store, 3).await.unwrap();
    let key = format!("{}/{}", manifest.dir(), manifest.ranks[1].file);
    let mut bytes = store.get(&key).await.unwrap().to_vec();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x10;
    store.put(&key, bytes).await.unwrap();
    let reader = CheckpointReader::open(&store, Some(3)).await.unwrap();
    let e = reader
        .load(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap_err();
    assert!(e.is_corruption(), "{e}");
    assert!(e.to_string().contains(&key), "{e}");
    let (reader, loaded) = load_latest(&store, LoadRequest::everything).await.unwrap();
    assert_eq!(reader.step(), 2);
    assert_same(&loaded.tensors, &steps[1]);
}

/// A TCP gate in front of `target` (`http://host:port`): connections are accepted at
/// once but forwarded only once the gate opens, so requests hang until then.
async fn gated_endpoint(target: &str) -> (String, watch::Sender<bool>) {
    let target = target
        .strip_prefix("http://")
        .expect("an http:// endpoint")
        .trim_end_matches('/')
        .to_string();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (open, opened) = watch::channel(false);
    tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            let mut opened = opened.clone();
            let target = target.clone();
            tokio::spawn(async move {
                if opened.wait_for(|&open| open).await.is_err() {
                    return;
                }
                if let Ok(mut outbound) = TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (format!("http://{addr}"), open)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_save_drops_a_step_and_save_waits_beyond_max_in_flight() {
    if !common::has(Capability::Servers) {
        return;
    }
    let (endpoint, gate) = gated_endpoint(&common::env("CKPT_TEST_S3_ENDPOINT")).await;
    let store = common::s3_store_at("ckpt-s3-busy", &endpoint, common::test_config());
    let tensors = model(1, 16);

    let skipper = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    let mut wait_config = CheckpointConfig::new(0, 1);
    wait_config.max_in_flight = 2;
    let waiter = Checkpointer::new(store.clone(), wait_config).unwrap();

    // While the store holds every request, uploads cannot finish.
    let state = |step| dim0_state(&tensors, step, 0, 1);
    let first = skipper
        .try_save(1, &state(1))
        .await
        .unwrap()
        .expect("nothing runs yet");
    assert!(
        skipper.try_save(2, &state(2)).await.unwrap().is_none(),
        "a second try_save must be skipped while one runs"
    );
    let ten = waiter.save(10, &state(10)).await.unwrap();
    let eleven = waiter.save(11, &state(11)).await.unwrap();
    let twelve_state = state(12);
    let twelve = waiter.save(12, &twelve_state);
    tokio::pin!(twelve);
    assert!(
        futures::poll!(&mut twelve).is_pending(),
        "a third save waits while max_in_flight = 2 saves run"
    );

    gate.send(true).unwrap();
    let twelve = twelve.await.unwrap();
    for handle in [&first, &ten, &eleven, &twelve] {
        handle.committed().await.unwrap();
    }
    // Concurrent saves commit in any order: compare the set of steps.
    let mut steps = common::steps(&store).await;
    steps.sort_unstable();
    assert_eq!(
        steps,
        vec![(1, true), (10, true), (11, true), (12, true)],
        "the skipped step 2 left nothing"
    );
    assert_loads(
        &CheckpointReader::open(&store, None).await.unwrap(),
        &tensors,
    )
    .await;
}
