//! Overlapped saves (`Checkpointer::save_overlapped`): the copy into the staging
//! buffer runs after `save_overlapped` returns, the handle says when the caller's
//! tensors are free again, and a tensor changed before its copy is caught.

use std::time::Duration;

use ckpt::storage::Store;
use ckpt::{
    CheckpointConfig, CheckpointReader, Checkpointer, DType, Error, LoadRequest, Region, State,
    as_bytes,
};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) as f32 / 1e9)
        .collect()
}

fn file_store(dir: &tempfile::TempDir) -> Store {
    Store::from_url(&format!("file://{}", dir.path().display())).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlapped_save_stages_after_returning_and_round_trips_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir);
    let world = 2;
    // Several tensors of a few MiB, so that the copy is split over threads.
    let tensors: Vec<Vec<Vec<f32>>> = (0..world)
        .map(|rank| {
            (0..5)
                .map(|t| values(3 << 20, (rank * 10 + t) as u32))
                .collect()
        })
        .collect();
    let mut handles = Vec::new();
    for (rank, own) in tensors.iter().enumerate() {
        let mut config = CheckpointConfig::new(rank, world);
        config.run_id = "overlap".into();
        config.copy_threads = 3;
        config.check_staging = true;
        let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
        let mut state = State::new();
        for (t, data) in own.iter().enumerate() {
            let shape = [(world * (3 << 20)) as u64];
            state
                .add_dim0_shard(
                    format!("t{t}"),
                    DType::F32,
                    &shape,
                    rank,
                    world,
                    as_bytes(data),
                )
                .unwrap();
        }
        assert!(checkpointer.warm_up(&state).unwrap() > Duration::ZERO);
        // SAFETY: `tensors` outlives the handles and is not written until staged().
        let handle = unsafe { checkpointer.save_overlapped(7, &state) }
            .await
            .unwrap();
        let staged_after = handle.staged().await.unwrap();
        assert!(handle.is_staged());
        assert!(staged_after >= handle.stall());
        assert_eq!(handle.wait_staged().unwrap(), staged_after);
        handles.push((checkpointer, handle));
    }
    for (_, handle) in &handles {
        handle.committed().await.unwrap();
    }
    let reader = CheckpointReader::open(&store, Some(7)).await.unwrap();
    let n = (world * (3 << 20)) as u64;
    for t in 0..5 {
        let loaded = reader
            .load(&LoadRequest::new().tensor(format!("t{t}"), Region::full(&[n])))
            .await
            .unwrap();
        let expected: Vec<u8> = tensors
            .iter()
            .flat_map(|own| as_bytes(&own[t]).to_vec())
            .collect();
        assert!(loaded.tensors[0].data == expected, "tensor t{t}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_save_is_staged_when_it_returns() {
    let store = Store::from_url("memory://blocking-staged").unwrap();
    let checkpointer = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    let data = values(1000, 3);
    let mut state = State::new();
    state
        .add_dim0_shard("w", DType::F32, &[1000], 0, 1, as_bytes(&data))
        .unwrap();
    let handle = checkpointer.save(1, &state).await.unwrap();
    assert!(handle.is_staged());
    assert!(handle.wait_staged().unwrap() <= handle.stall());
    handle.committed().await.unwrap();
}

/// The copy is held after its first tensor, the caller writes the second one (a
/// contract violation), and the save must fail naming it, and commit nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_written_before_it_was_staged_fails_the_save_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir);
    let mut config = CheckpointConfig::new(0, 1);
    config.check_staging = true;
    config.commit_timeout = Duration::from_secs(5);
    let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
    let first = values(4096, 1);
    let mut second = values(4096, 2);
    let ptr = second.as_mut_ptr();
    let handle = {
        let mut state = State::new();
        state
            .add_dim0_shard(
                "layers.0.weight",
                DType::F32,
                &[4096],
                0,
                1,
                as_bytes(&first),
            )
            .unwrap()
            .add_dim0_shard(
                "layers.1.weight",
                DType::F32,
                &[4096],
                0,
                1,
                as_bytes(&second),
            )
            .unwrap();
        let hold = ckpt::failpoint::hold("during-staging").unwrap();
        // SAFETY: the test breaks the contract on purpose, but only by writing
        // through `ptr` while the staging thread is held, not reading: no data race.
        let handle = unsafe { checkpointer.save_overlapped(1, &state) }
            .await
            .unwrap();
        assert!(
            hold.wait_reached(Duration::from_secs(30)),
            "the staging copy never reached its failpoint"
        );
        assert!(!handle.is_staged());
        // SAFETY: `ptr` points into `second`, alive; the copy thread is parked.
        unsafe { *ptr.add(100) += 1.0 };
        hold.release();
        handle
    };
    let error = handle.staged().await.unwrap_err();
    assert!(matches!(error, Error::Mutated(_)), "{error}");
    let message = error.to_string();
    assert!(message.contains("layers.1.weight"), "{message}");
    assert!(!message.contains("layers.0.weight"), "{message}");
    assert!(matches!(handle.committed().await, Err(Error::Mutated(_))));
    assert!(ckpt::latest(&store).await.unwrap().is_none());
    drop(second);
}

/// The threads of this process named `name`, with their scheduling policy and nice
/// value (`/proc/self/task/*/stat` fields 41 and 19).
#[cfg(target_os = "linux")]
fn threads_named(name: &str) -> Vec<(u32, i64)> {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let task = task.unwrap().path();
        let Ok(comm) = std::fs::read_to_string(task.join("comm")) else {
            continue; // a thread that ended meanwhile
        };
        if comm.trim_end() != name {
            continue;
        }
        let stat = std::fs::read_to_string(task.join("stat")).unwrap();
        // The fields after the command (in parentheses, which may hold spaces).
        let rest: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        // `rest[0]` is field 3 (state): field N is rest[N - 3].
        found.push((rest[41 - 3].parse().unwrap(), rest[19 - 3].parse().unwrap()));
    }
    found
}

/// Overlapped copies run on a thread the checkpointer keeps (not a thread per
/// save, whose start cost the caller milliseconds when the process was busy), under
/// SCHED_BATCH at a lower priority, so that they do not take a core from the
/// training loop; a save of the same checkpointer still stages and commits.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapped_copies_run_on_one_kept_thread_that_yields_to_training() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir);
    let mut config = CheckpointConfig::new(0, 1);
    config.run_id = "kept-thread".into();
    let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
    let data = values(1 << 20, 3);
    let mut state = State::new();
    state
        .add_dim0_shard("w", DType::F32, &[1 << 20], 0, 1, as_bytes(&data))
        .unwrap();
    for step in 1..=3 {
        // SAFETY: `data` outlives the handle and is not written.
        let handle = unsafe { checkpointer.save_overlapped(step, &state) }
            .await
            .unwrap();
        handle.staged().await.unwrap();
        handle.committed().await.unwrap();
    }
    // Every copy is done, and the thread stays (a thread per save ended with its
    // copy). Other tests of this binary may run checkpointers of their own beside
    // this one (`cargo test` runs them in one process), so this counts none.
    let stage_threads = threads_named("ckpt-stage");
    assert!(
        !stage_threads.is_empty(),
        "the staging thread outlives its copies"
    );
    const SCHED_BATCH: u32 = 3;
    assert!(
        stage_threads
            .iter()
            .any(|&(policy, nice)| policy == SCHED_BATCH && nice > 0),
        "the staging thread runs at SCHED_BATCH and a positive nice: {stage_threads:?}"
    );
    let reader = CheckpointReader::open(&store, Some(3)).await.unwrap();
    let loaded = reader
        .load(&LoadRequest::new().tensor("w", Region::full(&[1 << 20])))
        .await
        .unwrap();
    assert!(loaded.tensors[0].data == as_bytes(&data), "the saved bytes");
}
