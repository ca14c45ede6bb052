//! Health through the Rust API: replicas that agree commit healthy, a bit flipped in
//! one holder's copy is named (rank, box, block) at the save that carries it, the
//! `fail` policy refuses the commit, a non-finite value or metric marks the
//! checkpoint unhealthy, and the newest healthy checkpoint is what a resume loads.
//!
//! The world is an HSDP-like 2 x 2 (two shards, two replicas of each) in one
//! process, four checkpointers over one store: `w` is sharded on dim 0 over the
//! shard index and replicated over the replica index (replica 0 writes), `b` is held
//! whole by all four ranks (rank 0 writes), and `m` is a plain dim-0 shard per rank.

use ckpt_testkit as common;

use ckpt::catalog::Select;
use ckpt::format::HealthStatus;
use ckpt::storage::Store;
use ckpt::{
    CheckpointConfig, Checkpointer, DType, HealthCheck, LoadRequest, Region, ReplicaPolicy, State,
    as_bytes,
};
use common::{TEST_RUN, local_store};

const WORLD: usize = 4;
const SHARDS: usize = 2;
/// Rows x columns of `w`: each shard is 32 x 300 f32 = 38,400 bytes, ten slices of
/// the 4 KiB block.
const W: [u64; 2] = [64, 300];
const B: [u64; 1] = [7];
const M: [u64; 2] = [8, 16];
const BLOCK: u64 = 4096;

/// Every rank's tensors at one step: full `w`, `b`, `m`.
#[derive(Clone)]
struct Model {
    w: Vec<f32>,
    b: Vec<f32>,
    m: Vec<f32>,
}

impl Model {
    fn at(step: u64) -> Self {
        let f = |n: u64, k: u64| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 31 + k * 7 + step) % 1000) as f32 * 0.01)
                .collect()
        };
        Self {
            w: f(W[0] * W[1], 1),
            b: f(B[0], 2),
            m: f(M[0] * M[1], 3),
        }
    }
}

/// What each rank holds: its own copy of its `w` shard, of `b`, and its `m` rows.
struct Held {
    w: Vec<f32>,
    b: Vec<f32>,
    m: Vec<f32>,
}

fn held(model: &Model, rank: usize) -> Held {
    let shard = rank % SHARDS;
    let rows = (W[0] as usize / SHARDS) * W[1] as usize;
    let m_rows = (M[0] as usize / WORLD) * M[1] as usize;
    Held {
        w: model.w[shard * rows..(shard + 1) * rows].to_vec(),
        b: model.b.clone(),
        m: model.m[rank * m_rows..(rank + 1) * m_rows].to_vec(),
    }
}

fn config(rank: usize) -> CheckpointConfig {
    let mut config = CheckpointConfig::new(rank, WORLD);
    config.run_id = TEST_RUN.to_string();
    config.block_size = BLOCK;
    config
}

fn checkpointers(store: &Store, configure: impl Fn(&mut CheckpointConfig)) -> Vec<Checkpointer> {
    (0..WORLD)
        .map(|rank| {
            let mut config = config(rank);
            configure(&mut config);
            Checkpointer::new(store.clone(), config).unwrap()
        })
        .collect()
}

fn state_of<'a>(held: &'a Held, rank: usize) -> State<'a> {
    let mut state = State::new();
    let shard = rank % SHARDS;
    state
        .add_replica(
            "w",
            DType::F32,
            &W,
            Region::dim0_shard(&W, shard, SHARDS),
            as_bytes(&held.w),
            rank / SHARDS == 0,
        )
        .unwrap();
    state
        .add_replica(
            "b",
            DType::F32,
            &B,
            Region::full(&B),
            as_bytes(&held.b),
            rank == 0,
        )
        .unwrap();
    state
        .add_dim0_shard("m", DType::F32, &M, rank, WORLD, as_bytes(&held.m))
        .unwrap();
    state
}

/// Every rank saves `step` from `held` (with `extra` applied to each rank's state);
/// returns each rank's commit result.
async fn save(
    checkpointers: &[Checkpointer],
    step: u64,
    held: &[Held],
    extra: impl Fn(usize, &mut State<'_>),
) -> Vec<ckpt::Result<()>> {
    let mut handles = Vec::new();
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        let mut state = state_of(&held[rank], rank);
        extra(rank, &mut state);
        handles.push(checkpointer.save(step, &state).await.unwrap());
    }
    let mut results = Vec::new();
    for handle in &handles {
        results.push(handle.committed().await);
    }
    results
}

fn all_held(model: &Model) -> Vec<Held> {
    (0..WORLD).map(|rank| held(model, rank)).collect()
}

/// Flips bit 3 of the byte at `offset` of an f32 slice.
fn flip(values: &mut [f32], offset: usize) {
    let mut bytes = values[offset / 4].to_le_bytes();
    bytes[offset % 4] ^= 0x08;
    values[offset / 4] = f32::from_le_bytes(bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_agree_commit_healthy_and_load_bitwise() {
    let (store, _dir) = local_store("health-agree");
    let ranks = checkpointers(&store, |_| {});
    let model = Model::at(1);
    let results = save(&ranks, 1, &all_held(&model), |_, _| {}).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let manifest = ckpt::read_manifest(&store, 1).await.unwrap();
    assert_eq!(manifest.health_status(), HealthStatus::Healthy);
    // Two `w` boxes of two holders each, and `b` of four.
    assert_eq!(manifest.health.as_ref().unwrap().replicas_compared, 3);
    let (reader, loaded) = ckpt::load_latest(&store, LoadRequest::everything)
        .await
        .unwrap();
    assert_eq!(reader.step(), 1);
    let by_name = |name: &str| &loaded.tensors.iter().find(|t| t.name == name).unwrap().data;
    assert_eq!(by_name("w"), &as_bytes(&model.w).to_vec());
    assert_eq!(by_name("b"), &as_bytes(&model.b).to_vec());
    assert_eq!(by_name("m"), &as_bytes(&model.m).to_vec());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bit_flipped_in_one_of_two_or_four_replicas_is_named_at_the_save_that_carries_it() {
    let (store, _dir) = local_store("health-flip");
    let ranks = checkpointers(&store, |_| {});
    let model = Model::at(2);
    save(&ranks, 1, &all_held(&model), |_, _| {}).await;

    // One of two holders of `w`'s second shard (rank 3; rank 1 writes it), at byte
    // 20,000 of the box: slice 4 of 4 KiB.
    let mut held_w = all_held(&model);
    flip(&mut held_w[3].w, 20_000);
    let results = save(&ranks, 2, &held_w, |_, _| {}).await;
    assert!(
        results.iter().all(Result::is_ok),
        "warn commits: {results:?}"
    );
    let manifest = ckpt::read_manifest(&store, 2).await.unwrap();
    let health = manifest.health.clone().unwrap();
    assert!(!health.healthy);
    assert_eq!(health.replica_mismatches.len(), 1, "{:?}", health.reasons);
    let mismatch = &health.replica_mismatches[0];
    assert_eq!(
        (
            mismatch.tensor.as_str(),
            &mismatch.offsets[..],
            &mismatch.blocks[..],
            mismatch.written_by,
            &mismatch.disagree[..],
            mismatch.agree.len()
        ),
        ("w", &[32u64, 0][..], &[4u64][..], 1, &[3u32][..], 0)
    );
    assert!(
        health.reasons[0].contains("rank 3") && health.reasons[0].contains("block 4"),
        "{:?}",
        health.reasons
    );

    // One of four holders of `b` (rank 2; rank 0 writes), in its first slice: the
    // other two holders agree with the written copy.
    let mut held_b = all_held(&model);
    flip(&mut held_b[2].b, 5);
    save(&ranks, 3, &held_b, |_, _| {}).await;
    let health = ckpt::read_manifest(&store, 3)
        .await
        .unwrap()
        .health
        .unwrap();
    let mismatch = &health.replica_mismatches[0];
    assert_eq!(
        (
            mismatch.tensor.as_str(),
            &mismatch.blocks[..],
            mismatch.written_by,
            &mismatch.agree[..],
            &mismatch.disagree[..]
        ),
        ("b", &[0u64][..], 0, &[1u32, 3][..], &[2u32][..])
    );

    // The copy written is the writer's: a flip in the writer's own copy is caught
    // as well, every other holder disagreeing with it.
    let mut held_writer = all_held(&model);
    flip(&mut held_writer[0].b, 0);
    save(&ranks, 4, &held_writer, |_, _| {}).await;
    let health = ckpt::read_manifest(&store, 4)
        .await
        .unwrap()
        .health
        .unwrap();
    assert_eq!(health.replica_mismatches[0].disagree, vec![1, 2, 3]);

    // None of them is what a resume takes.
    let (reader, _) = ckpt::load_latest(&store, LoadRequest::everything)
        .await
        .unwrap();
    assert_eq!(reader.step(), 1);
    assert!(reader.skipped().iter().map(|s| s.step).eq([4, 3, 2]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fail_policy_refuses_the_commit_and_the_previous_one_stays_newest() {
    let (store, _dir) = local_store("health-fail");
    // One holder asking for `fail` is enough.
    let ranks = checkpointers(&store, |c| {
        if c.rank == 3 {
            c.replica_mismatch = ReplicaPolicy::Fail;
        }
    });
    let model = Model::at(5);
    assert!(
        save(&ranks, 5, &all_held(&model), |_, _| {})
            .await
            .iter()
            .all(Result::is_ok)
    );
    let mut flipped = all_held(&model);
    flip(&mut flipped[3].w, 100);
    let results = save(&ranks, 6, &flipped, |_, _| {}).await;
    for result in &results {
        let err = result.as_ref().unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("replica_mismatch is \"fail\"") && text.contains("rank 3"),
            "{text}"
        );
    }
    assert_eq!(ckpt::latest(&store).await.unwrap().unwrap().step, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_values_and_metrics_mark_the_checkpoint_and_resumes_pass_over_it() {
    let (store, _dir) = local_store("health-nan");
    let ranks = checkpointers(&store, |c| {
        c.health_check = Some(HealthCheck::new(|metrics| match metrics.get("loss") {
            Some(&loss) if loss > 100.0 => Err(format!("loss {loss} spiked")),
            _ => Ok(()),
        }));
    });
    let model = Model::at(7);
    let good = save(&ranks, 7, &all_held(&model), |_, state| {
        state.health_metric("loss", 2.5);
    })
    .await;
    assert!(good.iter().all(Result::is_ok));
    let manifest = ckpt::read_manifest(&store, 7).await.unwrap();
    assert_eq!(manifest.health_status(), HealthStatus::Healthy);
    assert_eq!(manifest.health.unwrap().metrics["loss"].0, 2.5);

    // A NaN in rank 2's rows of `m`, and an infinity in `w` (written by rank 0).
    let mut poisoned = all_held(&model);
    poisoned[2].m[5] = f32::NAN;
    poisoned[0].w[9] = f32::INFINITY;
    poisoned[2].w[9] = f32::INFINITY;
    save(&ranks, 8, &poisoned, |_, _| {}).await;
    let health = ckpt::read_manifest(&store, 8)
        .await
        .unwrap()
        .health
        .unwrap();
    assert!(!health.healthy);
    let found: Vec<(&str, u64, &[u32])> = health
        .nonfinite
        .iter()
        .map(|n| (n.tensor.as_str(), n.elements, &n.ranks[..]))
        .collect();
    assert_eq!(found, vec![("m", 1, &[2u32][..]), ("w", 1, &[0u32][..])]);

    // A metric that is not finite, and the caller's check failing.
    save(&ranks, 9, &all_held(&model), |rank, state| {
        state.health_metric("loss", if rank == 0 { f64::NAN } else { 1.0 });
    })
    .await;
    save(&ranks, 10, &all_held(&model), |_, state| {
        state.health_metric("loss", 250.0);
    })
    .await;
    let store_ref = &store;
    let reasons = |step| async move {
        ckpt::read_manifest(store_ref, step)
            .await
            .unwrap()
            .health
            .unwrap()
            .reasons
    };
    assert_eq!(
        reasons(9).await,
        vec!["metric \"loss\" is NaN (reported by rank 0)".to_string()]
    );
    assert_eq!(
        reasons(10).await,
        vec!["loss 250 spiked (reported by ranks 0, 1, 2, 3)".to_string()]
    );

    // The tools see the newest; resumes take the newest healthy, saying why.
    assert_eq!(ckpt::latest(&store).await.unwrap().unwrap().step, 10);
    let (newest, skipped) = ckpt::latest_selecting(&store, Select::Healthy)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(newest.step, 7);
    assert_eq!(
        skipped.iter().map(|s| s.step).collect::<Vec<_>>(),
        vec![10, 9, 8]
    );
    assert!(
        skipped[2].to_string().contains("non-finite"),
        "{}",
        skipped[2]
    );
    let (reader, loaded) = ckpt::load_latest(&store, LoadRequest::everything)
        .await
        .unwrap();
    assert_eq!(reader.step(), 7);
    assert_eq!(reader.skipped().len(), 3);
    let m = &loaded.tensors.iter().find(|t| t.name == "m").unwrap().data;
    assert_eq!(m, &as_bytes(&model.m).to_vec());
    let reader = ckpt::CheckpointReader::open_selecting(&store, None, Select::Any)
        .await
        .unwrap();
    assert_eq!(reader.step(), 10);
    // A step asked for by number opens whatever its health.
    let reader = ckpt::CheckpointReader::open_selecting(&store, Some(8), Select::Healthy)
        .await
        .unwrap();
    assert_eq!(reader.step(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_comparison_off_replicas_are_not_staged_and_nothing_is_compared() {
    let (store, _dir) = local_store("health-off");
    let ranks = checkpointers(&store, |c| c.replica_mismatch = ReplicaPolicy::Off);
    let model = Model::at(11);
    let mut flipped = all_held(&model);
    flip(&mut flipped[3].w, 100);
    save(&ranks, 11, &flipped, |_, _| {}).await;
    let manifest = ckpt::read_manifest(&store, 11).await.unwrap();
    let health = manifest.health.unwrap();
    assert!(health.healthy, "{:?}", health.reasons);
    assert_eq!(health.replicas_compared, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapped_and_compressed_saves_compare_replicas_too() {
    let (store, _dir) = local_store("health-overlapped");
    let ranks = checkpointers(&store, |c| {
        c.codec = ckpt::Codec::Zstd {
            level: 1,
            shuffle: 4,
        }
    });
    let model = Model::at(12);
    let mut flipped = all_held(&model);
    flip(&mut flipped[2].w, 38_399);
    let mut handles = Vec::new();
    for (rank, checkpointer) in ranks.iter().enumerate() {
        let state = state_of(&flipped[rank], rank);
        // SAFETY: the state is not written until staged() returns.
        let handle = unsafe { checkpointer.save_overlapped(12, &state) }
            .await
            .unwrap();
        handle.staged().await.unwrap();
        handles.push(handle);
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
    let health = ckpt::read_manifest(&store, 12)
        .await
        .unwrap()
        .health
        .unwrap();
    let mismatch = &health.replica_mismatches[0];
    // The box's last byte lies in its last slice (38,399 / 4,096 = 9).
    assert_eq!(
        (
            &mismatch.blocks[..],
            mismatch.written_by,
            &mismatch.disagree[..]
        ),
        (&[9u64][..], 0, &[2u32][..])
    );
}

#[test]
fn a_policy_is_read_from_its_name_and_others_are_refused() {
    assert_eq!("fail".parse::<ReplicaPolicy>(), Ok(ReplicaPolicy::Fail));
    let err = "strict".parse::<ReplicaPolicy>().unwrap_err();
    assert!(err.contains("\"strict\""), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_of_unhealthy_commits_only_says_so_and_an_empty_one_does_not_speak_of_health() {
    let (store, _dir) = local_store("verdict-empty");
    let ranks = checkpointers(&store, |_| {});
    let missing = ckpt::load_latest(&store, LoadRequest::everything)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        missing.contains("no committed checkpoint") && !missing.contains("health"),
        "{missing}"
    );
    let mut poisoned = all_held(&Model::at(13));
    poisoned[1].m[0] = f32::NAN;
    save(&ranks, 13, &poisoned, |_, _| {}).await;
    for err in [
        ckpt::load_latest(&store, LoadRequest::everything)
            .await
            .unwrap_err(),
        ckpt::CheckpointReader::open_selecting(&store, None, Select::Healthy)
            .await
            .unwrap_err(),
    ] {
        let text = err.to_string();
        assert!(
            matches!(err, ckpt::Error::NotFound(_))
                && text.contains("no healthy checkpoint")
                && text.contains("step 13")
                && text.contains("non-finite"),
            "{text}"
        );
    }
}
