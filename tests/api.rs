//! The public API's promises that are not about bytes: which types cross threads,
//! what `try_save` and `close` do.

use std::time::Duration;

use ckpt::storage::Store;
use ckpt::{CheckpointConfig, CheckpointReader, Checkpointer, Error, SaveHandle};
use ckpt_testkit as common;

/// Compiles only for types that may be moved to and shared between threads.
fn send_sync<T: Send + Sync>() {}

#[test]
fn the_types_a_trainer_shares_between_threads_are_send_and_sync() {
    send_sync::<Checkpointer>();
    send_sync::<SaveHandle>();
    send_sync::<CheckpointReader>();
    send_sync::<CheckpointConfig>();
    send_sync::<Store>();
    send_sync::<Error>();
    send_sync::<ckpt::State<'static>>();
    send_sync::<ckpt::Loaded>();
}

fn store(name: &str) -> Store {
    Store::from_url(&format!("memory://{}", common::unique(name))).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_waits_for_every_save_to_end_and_refuses_saves_after_it() {
    let store = store("close");
    let tensors = common::model(1, 64);
    let mut config = CheckpointConfig::new(0, 1);
    config.max_in_flight = 2;
    let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
    let first = checkpointer
        .save(1, &common::dim0_state(&tensors, 1, 0, 1))
        .await
        .unwrap();
    let second = checkpointer
        .save(2, &common::dim0_state(&tensors, 2, 0, 1))
        .await
        .unwrap();
    checkpointer.close().await.unwrap();
    // Both saves ended: their outcomes are there without waiting.
    for handle in [&first, &second] {
        let outcome = tokio::time::timeout(Duration::ZERO, handle.committed()).await;
        assert!(
            matches!(outcome, Ok(Ok(()))),
            "step {}: {outcome:?}",
            handle.step()
        );
    }
    // Concurrent saves commit in either order.
    let mut steps = common::steps(&store).await;
    steps.sort_unstable();
    assert_eq!(steps, vec![(1, true), (2, true)]);
    let refused = checkpointer
        .save(3, &common::dim0_state(&tensors, 3, 0, 1))
        .await
        .expect_err("a closed checkpointer saves nothing");
    assert!(refused.to_string().contains("closed"), "{refused}");
    let skipped = checkpointer
        .try_save(3, &common::dim0_state(&tensors, 3, 0, 1))
        .await
        .expect_err("a closed checkpointer does not skip a save: it refuses it");
    assert!(skipped.to_string().contains("closed"), "{skipped}");
    // Closing again is harmless.
    checkpointer.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_close_retention_has_run_on_whichever_rank_committed() {
    // Two ranks, keep one checkpoint, no grace: once both checkpointers are closed,
    // only the newest checkpoint is left, whichever rank committed each step.
    let store = store("close-retention");
    let tensors = common::model(1, 64);
    let checkpointers: Vec<_> = (0..2)
        .map(|rank| {
            let mut config = CheckpointConfig::new(rank, 2);
            config.keep_last = Some(1);
            config.retention_grace = Duration::ZERO;
            Checkpointer::new(store.clone(), config).unwrap()
        })
        .collect();
    for step in 1..=3 {
        let mut handles = Vec::new();
        for (rank, checkpointer) in checkpointers.iter().enumerate() {
            let state = common::dim0_state(&tensors, step, rank, 2);
            handles.push(checkpointer.save(step, &state).await.unwrap());
        }
        for handle in &handles {
            handle.committed().await.unwrap();
        }
    }
    for checkpointer in &checkpointers {
        checkpointer.close().await.unwrap();
    }
    assert_eq!(common::steps(&store).await, vec![(3, true)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_save_starts_a_save_once_the_previous_one_has_written_its_part() {
    // (That it returns None while one is writing is shown in tests/s3.rs, where a
    // gate holds the upload.)
    let store = store("try-save");
    let tensors = common::model(1, 64);
    let checkpointer = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    let first = checkpointer
        .try_save(1, &common::dim0_state(&tensors, 1, 0, 1))
        .await
        .unwrap()
        .expect("nothing runs yet");
    first.committed().await.unwrap();
    let again = checkpointer
        .try_save(2, &common::dim0_state(&tensors, 2, 0, 1))
        .await
        .unwrap()
        .expect("the first save has ended");
    again.committed().await.unwrap();
    checkpointer.close().await.unwrap();
    assert_eq!(common::steps(&store).await, vec![(1, true), (2, true)]);
}
