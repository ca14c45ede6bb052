//! One conformance suite, every backend: memory, local disk, an S3-compatible
//! server (moto), a GCS emulator (fake-gcs-server) and Azurite.
//!
//! Each check is an async function over a fresh, empty store; the macro at the end
//! instantiates it per backend, so the test output reads `s3::create_if_absent_race`.
//! The GCS emulator accepts no writes through object_store's XML API (see
//! docs/STORAGE.md): on GCS the read-side checks run on objects seeded through the
//! emulator's JSON API, and the write-side checks are not instantiated.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use bytes::Bytes;
use ckpt_storage::{ErrorKind, Store};
use common::*;

struct Fixture {
    store: Store,
    gcs: bool,
    _dir: Option<tempfile::TempDir>,
}

impl Fixture {
    fn memory(name: &str) -> Option<Self> {
        Some(Self {
            store: memory_store(name, test_config()),
            gcs: false,
            _dir: None,
        })
    }
    fn local(name: &str) -> Option<Self> {
        let (store, dir) = local_store(name, test_config());
        Some(Self {
            store,
            gcs: false,
            _dir: Some(dir),
        })
    }
    fn s3(name: &str) -> Option<Self> {
        if !has(Capability::Servers) {
            return None;
        }
        Some(Self {
            store: s3_store(name, test_config()),
            gcs: false,
            _dir: None,
        })
    }
    fn gcs(name: &str) -> Option<Self> {
        if !has(Capability::Servers) {
            return None;
        }
        Some(Self {
            store: gcs_store(name, test_config()),
            gcs: true,
            _dir: None,
        })
    }
    fn azure(name: &str) -> Option<Self> {
        if !has(Capability::Servers) {
            return None;
        }
        Some(Self {
            store: azure_store(name, test_config()),
            gcs: false,
            _dir: None,
        })
    }

    /// Puts an object through the store, or through the emulator's side door on GCS.
    async fn seed(&self, key: &str, data: &[u8]) {
        if self.gcs {
            gcs_seed(&self.store, key, data).await;
        } else {
            self.store
                .put(key, Bytes::copy_from_slice(data))
                .await
                .unwrap_or_else(|e| panic!("seeding {key}: {e}"));
        }
    }
}

fn crc(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

// ---------------------------------------------------------------- read side

async fn round_trip(f: &Fixture) {
    let data = pattern(10_000, 1);
    f.seed("dir/object.bin", &data).await;
    assert_eq!(f.store.get("dir/object.bin").await.unwrap(), &data[..]);
    let info = f.store.head("dir/object.bin").await.unwrap();
    assert_eq!(info.size, data.len() as u64);
    assert_eq!(info.key, "dir/object.bin");
    // Overwrite replaces the whole object.
    f.seed("dir/object.bin", b"short").await;
    assert_eq!(f.store.get("dir/object.bin").await.unwrap(), &b"short"[..]);
}

async fn empty_and_one_byte_objects(f: &Fixture) {
    f.seed("empty", b"").await;
    f.seed("one", b"x").await;
    assert_eq!(f.store.get("empty").await.unwrap().len(), 0);
    assert_eq!(f.store.head("empty").await.unwrap().size, 0);
    assert_eq!(f.store.get("one").await.unwrap(), &b"x"[..]);
    assert_eq!(f.store.get_range("one", 0..1).await.unwrap(), &b"x"[..]);
    assert_eq!(f.store.get_range("empty", 0..0).await.unwrap().len(), 0);
    let past = f.store.get_range("empty", 0..1).await.unwrap_err();
    assert_eq!(past.kind(), ErrorKind::Permanent, "{past}");
}

async fn large_object_integrity(f: &Fixture) {
    let data = pattern(64 * 1024 * 1024 + 123, 2);
    let expected = crc(&data);
    f.seed("large.bin", &data).await;
    let back = f.store.get("large.bin").await.unwrap();
    assert_eq!(back.len(), data.len());
    assert_eq!(crc(&back), expected, "64 MiB object came back different");
    // The same object read as many ranges, coalesced and concurrent.
    let chunk = 3 * 1024 * 1024 + 17;
    let ranges: Vec<_> = (0..data.len() as u64)
        .step_by(chunk)
        .map(|s| s..(s + chunk as u64).min(data.len() as u64))
        .collect();
    let parts = f.store.get_ranges("large.bin", &ranges).await.unwrap();
    let mut hasher = crc32fast::Hasher::new();
    for part in &parts {
        hasher.update(part);
    }
    assert_eq!(hasher.finalize(), expected);
}

async fn ranged_reads_at_every_edge(f: &Fixture) {
    let data = pattern(1000, 3);
    let n = data.len() as u64;
    f.seed("ranges.bin", &data).await;
    let s = &f.store;
    for range in [0..0, 0..1, 0..n, 1..n, n - 1..n, 500..501, 123..877, n..n] {
        let got = s.get_range("ranges.bin", range.clone()).await.unwrap();
        assert_eq!(
            got,
            &data[range.start as usize..range.end as usize],
            "range {range:?}"
        );
    }
    for range in [n - 1..n + 1, 0..n + 1, n..n + 1, n + 10..n + 20] {
        let err = s.get_range("ranges.bin", range.clone()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Permanent, "range {range:?}: {err}");
        let message = err.to_string();
        assert!(message.contains("ranges.bin"), "{message}");
        assert!(message.contains("past the end"), "{message}");
    }
    #[allow(clippy::reversed_empty_ranges)]
    let inverted = s.get_range("ranges.bin", 10..5).await.unwrap_err();
    assert_eq!(inverted.kind(), ErrorKind::Permanent);

    // Several ranges: unsorted, overlapping, adjacent, empty, far apart.
    let ranges = vec![900..1000, 0..10, 5..15, 15..20, 20..20, 400..450, 0..n];
    let got = s.get_ranges("ranges.bin", &ranges).await.unwrap();
    for (range, bytes) in ranges.iter().zip(&got) {
        assert_eq!(bytes, &data[range.start as usize..range.end as usize]);
    }
    let err = s
        .get_ranges("ranges.bin", &[0..10, 990..1001])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Permanent, "{err}");
    assert!(s.get_ranges("ranges.bin", &[]).await.unwrap().is_empty());
}

async fn reads_bounded_by_a_limit(f: &Fixture) {
    f.seed("hint", b"12345").await;
    f.seed("empty", b"").await;
    assert_eq!(f.store.get_at_most("hint", 5).await.unwrap(), &b"12345"[..]);
    assert_eq!(f.store.get_at_most("empty", 0).await.unwrap().len(), 0);
    let over = f.store.get_at_most("hint", 4).await.unwrap_err();
    assert_eq!(over.kind(), ErrorKind::Permanent, "{over}");
    assert!(
        over.to_string().contains("5 bytes") && over.to_string().contains("4-byte limit"),
        "names the size and the limit: {over}"
    );
    let missing = f.store.get_at_most("absent", 5).await.unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::NotFound, "{missing}");
}

async fn missing_objects_are_not_found(f: &Fixture) {
    let s = &f.store;
    for err in [
        s.get("nope/missing").await.unwrap_err(),
        s.head("nope/missing").await.unwrap_err(),
        s.get_range("nope/missing", 0..4).await.unwrap_err(),
        s.get_ranges("nope/missing", &[0..4, 8..9])
            .await
            .unwrap_err(),
    ] {
        assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
        let message = err.to_string();
        assert!(message.contains("nope/missing"), "{message}");
        assert!(message.contains(s.url()), "{message}");
    }
    assert!(s.list("nope").await.unwrap().is_empty());
}

async fn listing_with_many_keys_and_a_delimiter(f: &Fixture) {
    // 250 keys: more than one page on the S3 server (started with 100 keys a page).
    let mut expected = BTreeSet::new();
    let mut seeds = Vec::new();
    for i in 0..200 {
        expected.insert(format!("run/step-{:03}/rank-{}", i / 4, i % 4));
    }
    for i in 0..50 {
        expected.insert(format!("run/file-{i:02}"));
    }
    for key in &expected {
        seeds.push(f.seed(key, key.as_bytes()));
    }
    futures::future::join_all(seeds).await;
    f.seed("runner/other", b"x").await; // shares "run" as a string prefix only

    let all = f.store.list("run").await.unwrap();
    let keys: Vec<String> = all.iter().map(|o| o.key.clone()).collect();
    assert_eq!(keys, expected.iter().cloned().collect::<Vec<_>>());
    assert!(all.iter().all(|o| o.size == o.key.len() as u64));

    let top = f.store.list_dir("run").await.unwrap();
    assert_eq!(top.objects.len(), 50);
    assert_eq!(top.prefixes.len(), 50);
    assert_eq!(top.prefixes[0], "run/step-000");
    assert_eq!(top.objects[0].key, "run/file-00");
    let step = f.store.list_dir("run/step-007").await.unwrap();
    assert_eq!(step.objects.len(), 4);
    assert!(step.prefixes.is_empty());
    let root = f.store.list_dir("").await.unwrap();
    assert_eq!(root.prefixes, vec!["run".to_string(), "runner".to_string()]);
}

/// `list_after` returns the keys after a given key, in order, across pages (the
/// commit log reads its tail this way).
async fn listing_after_a_key(f: &Fixture) {
    let keys: Vec<String> = (0..150).map(|i| format!("log/{i:04}.json")).collect();
    futures::future::join_all(keys.iter().map(|k| f.seed(k, b"r"))).await;
    f.seed("log/HEAD", b"149").await;
    f.seed("logger/x", b"x").await; // shares "log" as a string prefix only
    let after: Vec<String> = f
        .store
        .list_after("log", "log/0041.json")
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect();
    let mut expected: Vec<String> = keys[42..].to_vec();
    expected.push("log/HEAD".to_string());
    assert_eq!(after, expected);
    // An offset that is not a key, and one past the end.
    let after = f.store.list_after("log", "log/0148").await.unwrap();
    assert_eq!(after.len(), 3, "{after:?}");
    assert!(f.store.list_after("log", "log/z").await.unwrap().is_empty());
}

/// `list_between` returns the keys of one range, in order, across pages (a
/// committer lists the part names of a group of ranks this way).
async fn listing_a_range_of_keys(f: &Fixture) {
    let keys: Vec<String> = (0..250).map(|i| format!("dir/rank-{i:05}.json")).collect();
    futures::future::join_all(keys.iter().map(|k| f.seed(k, b"p"))).await;
    f.seed("dir/manifest.json", b"m").await;
    f.seed("dirt/rank-00001.json", b"x").await; // shares "dir" as a string prefix only
    let between = |after: &'static str, until: &'static str| async move {
        f.store
            .list_between("dir", after, until)
            .await
            .unwrap()
            .into_iter()
            .map(|o| o.key)
            .collect::<Vec<String>>()
    };
    assert_eq!(between("dir/rank-", "dir/rank-00249.json").await, keys);
    assert_eq!(
        between("dir/rank-00099.json", "dir/rank-00199.json").await,
        keys[100..200].to_vec()
    );
    // Bounds that are not keys.
    assert_eq!(
        between("dir/rank-00010", "dir/rank-00012").await,
        keys[10..12].to_vec()
    );
    assert!(
        between("dir/rank-00249.json", "dir/rank-99999")
            .await
            .is_empty()
    );
}

async fn delete_and_delete_by_prefix(f: &Fixture) {
    for i in 0..20 {
        f.seed(&format!("old/step-{i}/data"), b"d").await;
    }
    f.seed("old-sibling/keep", b"k").await;
    f.seed("single", b"s").await;

    f.store.delete("single").await.unwrap();
    assert_eq!(
        f.store.head("single").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // Deleting what is not there succeeds, so cleanup can be retried.
    f.store.delete("single").await.unwrap();

    assert_eq!(f.store.delete_prefix("old").await.unwrap(), 20);
    assert!(f.store.list("old").await.unwrap().is_empty());
    assert_eq!(f.store.list("old-sibling").await.unwrap().len(), 1);
    assert_eq!(f.store.delete_prefix("old").await.unwrap(), 0);
    assert_eq!(
        f.store.delete_prefix("").await.unwrap_err().kind(),
        ErrorKind::Config
    );
}

// ---------------------------------------------------------------- write side

async fn multipart_upload_with_three_parts(f: &Fixture) {
    let part = f.store.config().part_size;
    let data = pattern(3 * part + 12_345, 4);
    let mut upload = f.store.upload("multi/object.bin").unwrap();
    // Odd-sized writes, so parts are cut across write boundaries.
    for chunk in data.chunks(1_000_003) {
        upload.write(Bytes::copy_from_slice(chunk)).await.unwrap();
        // Nothing is visible before finish.
    }
    assert_eq!(
        f.store.head("multi/object.bin").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    upload.finish().await.unwrap();
    let back = f.store.get("multi/object.bin").await.unwrap();
    assert_eq!(back.len(), data.len());
    assert_eq!(crc(&back), crc(&data));
}

async fn small_upload_is_one_put(f: &Fixture) {
    let mut upload = f.store.upload("small").unwrap();
    upload.write(&b"hello "[..]).await.unwrap();
    upload.write(&b"world"[..]).await.unwrap();
    upload.finish().await.unwrap();
    assert_eq!(f.store.get("small").await.unwrap(), &b"hello world"[..]);
}

async fn aborted_multipart_is_invisible(f: &Fixture) {
    let part = f.store.config().part_size;
    let mut upload = f.store.upload("aborted/object").unwrap();
    upload.write(pattern(2 * part + 1, 5)).await.unwrap();
    upload.abort().await.unwrap();
    assert_eq!(
        f.store.head("aborted/object").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );

    // A dropped upload (a crash of the writer, a cancelled future) leaves nothing.
    let mut dropped = f.store.upload("aborted/dropped").unwrap();
    dropped.write(pattern(part + 1, 6)).await.unwrap();
    drop(dropped);
    assert_eq!(
        f.store.head("aborted/dropped").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    assert!(f.store.list("aborted").await.unwrap().is_empty());
}

async fn create_if_absent_race(f: &Fixture) {
    let store = Arc::new(f.store.clone());
    for round in 0..4 {
        let key = format!("race/{round}/manifest.json");
        let writers = 12;
        let tasks: Vec<_> = (0..writers)
            .map(|w| {
                let store = store.clone();
                let key = key.clone();
                tokio::spawn(async move {
                    let payload = format!("writer-{w}").into_bytes();
                    (w, store.put_if_absent(&key, payload).await)
                })
            })
            .collect();
        let mut winners = Vec::new();
        for task in tasks {
            let (w, result) = task.await.unwrap();
            match result {
                Ok(()) => winners.push(w),
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "writer {w}: {e}");
                    assert!(e.to_string().contains(&key), "{e}");
                }
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        let stored = store.get(&key).await.unwrap();
        assert_eq!(stored, format!("writer-{}", winners[0]).as_bytes());
    }
}

async fn create_if_absent_after_put(f: &Fixture) {
    f.store.put("exists", &b"first"[..]).await.unwrap();
    let err = f
        .store
        .put_if_absent("exists", &b"second"[..])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::AlreadyExists);
    assert_eq!(f.store.get("exists").await.unwrap(), &b"first"[..]);
}

macro_rules! suite {
    ($backend:ident, $fixture:path, [$($check:ident),* $(,)?]) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $check() {
                    let Some(fixture) = $fixture(stringify!($check)) else {
                        return;
                    };
                    super::$check(&fixture).await;
                }
            )*
        }
    };
}

macro_rules! full_suite {
    ($backend:ident, $fixture:path) => {
        suite!(
            $backend,
            $fixture,
            [
                round_trip,
                empty_and_one_byte_objects,
                large_object_integrity,
                ranged_reads_at_every_edge,
                reads_bounded_by_a_limit,
                missing_objects_are_not_found,
                listing_with_many_keys_and_a_delimiter,
                listing_after_a_key,
                listing_a_range_of_keys,
                delete_and_delete_by_prefix,
                multipart_upload_with_three_parts,
                small_upload_is_one_put,
                aborted_multipart_is_invisible,
                create_if_absent_race,
                create_if_absent_after_put,
            ]
        );
    };
}

full_suite!(memory, super::Fixture::memory);
full_suite!(local, super::Fixture::local);
full_suite!(s3, super::Fixture::s3);
full_suite!(azure, super::Fixture::azure);
suite!(
    gcs,
    super::Fixture::gcs,
    [
        round_trip,
        empty_and_one_byte_objects,
        large_object_integrity,
        ranged_reads_at_every_edge,
        reads_bounded_by_a_limit,
        missing_objects_are_not_found,
        listing_with_many_keys_and_a_delimiter,
        listing_after_a_key,
        listing_a_range_of_keys,
        delete_and_delete_by_prefix,
    ]
);

/// The GCS emulator refuses object_store's XML-API writes (docs/STORAGE.md). This
/// checks that the refusal surfaces as one clear error naming the key, and fails the
/// day the emulator starts accepting writes, so the write checks get enabled for GCS.
#[tokio::test]
async fn gcs_emulator_refuses_xml_api_writes_with_a_clear_error() {
    let Some(fixture) = Fixture::gcs("gcs-write-gap") else {
        return;
    };
    match fixture.store.put("gap/object", &b"x"[..]).await {
        Ok(()) => panic!(
            "the GCS emulator accepted an object_store write: instantiate the write-side \
             checks for gcs in this suite and update docs/STORAGE.md"
        ),
        Err(e) => {
            assert!(
                matches!(e.kind(), ErrorKind::Permanent | ErrorKind::Config),
                "{e}"
            );
            assert!(e.to_string().contains("gap/object"), "{e}");
        }
    }
}
