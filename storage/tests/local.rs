//! Local-disk specifics: what a crash leaves behind and how it is cleaned up.

use ckpt_storage::{MIN_PART_SIZE, Store, StoreConfig};

fn store(dir: &std::path::Path) -> Store {
    let config = StoreConfig {
        part_size: MIN_PART_SIZE,
        ..StoreConfig::default()
    };
    Store::open(&format!("file://{}", dir.display()), config).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_prefix_removes_staging_files_of_abandoned_uploads() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    store.put("step-1/done", &b"x"[..]).await.unwrap();
    let mut upload = store.upload("step-1/big").unwrap();
    upload.write(vec![1u8; MIN_PART_SIZE + 1]).await.unwrap();
    // A writer that dies mid-upload never finishes or aborts, and runs no destructor
    // (object_store's drop of a local upload would remove the staging file in a
    // background task, racing this test): forget it, as a SIGKILL would.
    std::mem::forget(upload);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("step-1"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains('#'))
        .collect();
    assert_eq!(
        leftovers.len(),
        1,
        "the staging file of the abandoned upload"
    );
    assert_eq!(
        store.list("step-1").await.unwrap().len(),
        1,
        "listings hide it"
    );

    assert_eq!(store.delete_prefix("step-1").await.unwrap(), 1);
    assert!(
        !dir.path().join("step-1").exists(),
        "nothing of the step is left on disk"
    );
    // Idempotent.
    assert_eq!(store.delete_prefix("step-1").await.unwrap(), 0);
}
