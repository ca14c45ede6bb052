//! Staging files of a save killed mid-write never become part of a commit, and
//! `ckpt gc` (the retention engine) removes them.

mod common;

use std::time::Duration;

use ckpt::tools::gc;
use common::{local_store, model, save_world, step_dir};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_removes_staging_leftovers_and_keeps_every_commit() {
    let (store, dir) = local_store("gc-leftovers");
    save_world(&store, 1, 2, &model(1, 32), |_| {}).await;
    save_world(&store, 2, 2, &model(2, 32), |_| {}).await;
    // What a SIGKILL during a direct write leaves: a staging file beside the data.
    let leftover = dir
        .path()
        .join(step_dir(2))
        .join("rank-00001-0123456789abcdef.safetensors#direct");
    std::fs::write(&leftover, vec![0u8; 1 << 16]).unwrap();
    // It is not part of the commit.
    let manifest = ckpt::read_manifest(&store, 2).await.unwrap();
    assert!(manifest.ranks.iter().all(|r| !r.file.contains('#')));

    let plan = gc::plan(&store, 5, Duration::ZERO).await.unwrap();
    assert_eq!(plan.remove.len(), 1, "{plan:#?}");
    assert_eq!(
        plan.remove[0].only,
        vec![format!(
            "{}/rank-00001-0123456789abcdef.safetensors#direct",
            step_dir(2)
        )]
    );
    gc::apply(&store, &plan, &|_| {}).await.unwrap();
    assert!(!leftover.exists());
    assert_eq!(common::steps(&store).await, vec![(1, true), (2, true)]);
    common::assert_loads(
        &ckpt::CheckpointReader::open(&store, None).await.unwrap(),
        &model(2, 32),
    )
    .await;

    // With a grace period, a fresh leftover stays (a write may still be going on).
    std::fs::write(&leftover, b"x").unwrap();
    let plan = gc::plan(&store, 5, Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(plan.remove.is_empty(), "{plan:#?}");
}
