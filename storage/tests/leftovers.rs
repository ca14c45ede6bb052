//! Staging leftovers of crashed local writes (`KEY#…`): found and removed by the
//! calls that retention uses, and nothing else is.

use ckpt_storage::Store;

#[tokio::test]
async fn leftovers_are_found_and_removed_and_objects_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::from_url(&format!("file://{}", dir.path().display())).unwrap();
    store.put("step-1/a/rank-0.json", "part").await.unwrap();
    std::fs::write(
        dir.path().join("step-1/a/rank-0.safetensors#direct"),
        [0u8; 64],
    )
    .unwrap();
    let found = store.staging_leftovers("step-1").await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].key, "step-1/a/rank-0.safetensors#direct");
    assert_eq!(found[0].size, 64);
    assert!(store.delete_leftover("step-1/../x#1").await.is_err());
    assert!(store.delete_leftover("step-1/a/rank-0.json").await.is_err());
    store.delete_leftover(&found[0].key).await.unwrap();
    assert!(store.staging_leftovers("").await.unwrap().is_empty());
    assert_eq!(store.get("step-1/a/rank-0.json").await.unwrap(), "part");
    // Other backends have none.
    let memory = Store::from_url("memory://leftovers").unwrap();
    assert!(memory.staging_leftovers("").await.unwrap().is_empty());
}
