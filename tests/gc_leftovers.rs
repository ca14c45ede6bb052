//! Staging files of a save killed mid-write never become part of a commit, and
//! `ckpt gc` (the retention engine) removes them.

use ckpt_testkit as common;

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

/// A retention pass cut short after it removed a directory but before it removed the
/// directory's log record leaves a record that names nothing; the next pass removes
/// it (after the grace period), and never the newest record, which the fence reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_removes_log_records_whose_checkpoint_is_gone_but_never_the_newest() {
    let (store, dir) = local_store("gc-dangling");
    for step in 1..=3 {
        save_world(&store, step, 2, &model(step, 16), |_| {}).await;
    }
    let records = || async {
        ckpt::commits::read_all(&store)
            .await
            .unwrap()
            .iter()
            .map(|r| r.seq)
            .collect::<Vec<_>>()
    };
    assert_eq!(records().await.len(), 3);
    // What a cut-short removal of step 1 leaves: its directory gone, its record there.
    let whole_step = |step| dir.path().join(step_dir(step)).parent().unwrap().to_owned();
    std::fs::remove_dir_all(whole_step(1)).unwrap();
    // And the newest commit's directory gone too: its record must stay anyway.
    std::fs::remove_dir_all(whole_step(3)).unwrap();

    // Inside the grace period nothing goes.
    let plan = gc::plan(&store, 5, Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(plan.remove.is_empty(), "{plan:#?}");

    let plan = gc::plan(&store, 5, Duration::ZERO).await.unwrap();
    let dangling: Vec<_> = plan.remove.iter().flat_map(|r| r.only.clone()).collect();
    let all = records().await;
    assert_eq!(
        dangling,
        vec![ckpt::commits::record_key(all[0])],
        "only step 1's record: {plan:#?}"
    );
    gc::apply(&store, &plan, &|_| {}).await.unwrap();
    assert_eq!(records().await, all[1..].to_vec());
    // Step 2 is untouched and still the newest checkpoint that opens.
    common::assert_loads(
        &ckpt::CheckpointReader::open(&store, Some(2)).await.unwrap(),
        &model(2, 16),
    )
    .await;
}
