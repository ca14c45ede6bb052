//! Hostile checkpoints: roots crafted from docs/FORMAT.md, checksums recomputed, that
//! try to make a command choose the wrong checkpoint, read or delete outside the
//! root through symbolic links, or read a huge object whole. Every command is run as
//! a user would run it, through the `ckpt` binary.

use ckpt_testkit as common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, SystemTime};

use ckpt::Attempt;
use ckpt::storage::Store;
use ckpt::testing::{CommitRecord, record_key};
use common::*;
use serde_json::Value;

const ROWS: u64 = 32;

fn ckpt(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run the ckpt binary")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("exit code")
}

fn url_of(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

/// `{"crc32":"…","body":BODY}` with the CRC of BODY, as docs/FORMAT.md section 2
/// says: what a forger with the format at hand writes.
fn sealed(body: &str) -> Vec<u8> {
    format!(
        "{{\"crc32\":\"{:08x}\",\"body\":{body}}}",
        crc32fast::hash(body.as_bytes())
    )
    .into_bytes()
}

fn record_body(attempt: &Attempt, world: u32) -> String {
    serde_json::to_string(&CommitRecord::new(attempt, world)).unwrap()
}

/// Appends record `seq` for `attempt` to the log, whatever the log already holds.
async fn put_record(store: &Store, seq: u64, attempt: &Attempt) {
    store
        .put_if_absent(&record_key(seq), sealed(&record_body(attempt, 2)))
        .await
        .expect("write the crafted record");
}

/// A root with steps 1 and 2 committed by a world of 2 (log records 1 and 2).
async fn two_commits(name: &str) -> (Store, tempfile::TempDir) {
    let (store, dir) = local_store(name);
    for step in [1, 2] {
        save_world(&store, step, 2, &model(step, ROWS), |_| {}).await;
    }
    (store, dir)
}

/// The ways a newest log record can name no commit: its slot is empty (a crash
/// between commit steps 3 and 4), holds a tombstone, or its directory is gone.
#[derive(Debug, Clone, Copy)]
enum NoCommit {
    EmptySlot,
    Tombstone,
    MissingDirectory,
}

async fn append_record_without_commit(store: &Store, root: &Path, how: NoCommit) -> Attempt {
    let attempt = Attempt::new(2, 0, format!("{how:?}").to_lowercase()).unwrap();
    let dir = root.join(attempt.dir());
    match how {
        NoCommit::EmptySlot => {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("rank-00000.json"), b"a part, say").unwrap();
        }
        NoCommit::Tombstone => {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(
                dir.join("manifest.json"),
                sealed(r#"{"failed":{"reason":"crafted"}}"#),
            )
            .unwrap();
        }
        NoCommit::MissingDirectory => {}
    }
    put_record(store, 3, &attempt).await;
    attempt
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newest_record_that_names_no_commit_is_skipped_by_every_command() {
    for how in [
        NoCommit::EmptySlot,
        NoCommit::Tombstone,
        NoCommit::MissingDirectory,
    ] {
        let (store, dir) = two_commits("no-commit").await;
        append_record_without_commit(&store, dir.path(), how).await;
        let url = url_of(dir.path());
        let scratch = tempfile::tempdir().unwrap();
        let context = format!("{how:?}");

        let out = ckpt(&["ls", &url, "--json"]);
        assert_eq!(code(&out), 0, "{context}: {}", text(&out));
        let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
        let latest: Vec<&Value> = listed["checkpoints"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["latest"] == true)
            .collect();
        assert_eq!(latest.len(), 1, "{context}: {listed}");
        assert_eq!(latest[0]["dir"], step_dir(2), "{context}: {listed}");

        for args in [
            vec!["verify", &url],
            vec!["verify", &url, "--all"],
            vec!["verify", &url, "--step", "2"],
        ] {
            let out = ckpt(&args);
            assert_eq!(code(&out), 0, "{context}: {args:?}: {}", text(&out));
            assert!(
                text(&out).contains("step 2: ok"),
                "{context}: {}",
                text(&out)
            );
        }
        let out = ckpt(&["inspect", &url, "--step", "2", "--json"]);
        assert_eq!(code(&out), 0, "{context}: {}", text(&out));
        let view: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(view["dir"], step_dir(2), "{context}");

        let exported = scratch.path().join("out.safetensors");
        let out = ckpt(&["export", &url, exported.to_str().unwrap(), "--step", "2"]);
        assert_eq!(code(&out), 0, "{context}: {}", text(&out));
        let out = ckpt(&["diff", &url, &url, "--step-a", "2", "--step-b", "2"]);
        assert_eq!(code(&out), 0, "{context}: {}", text(&out));
        let resharded = url_of(&scratch.path().join("resharded"));
        let out = ckpt(&[
            "reshard",
            &url,
            &resharded,
            "--world-size",
            "1",
            "--step",
            "2",
        ]);
        assert_eq!(code(&out), 0, "{context}: {}", text(&out));

        let manifest = ckpt::read_manifest(&store, 2).await.unwrap();
        assert_eq!(manifest.dir(), step_dir(2), "{context}");
        let (reader, _) = ckpt::load_latest(&store, |_| ckpt::LoadRequest::new())
            .await
            .unwrap();
        assert_eq!(reader.manifest().dir(), step_dir(2), "{context}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_after_a_duplicate_record_leaves_the_log_naming_a_commit_and_verify_passing() {
    let (store, dir) = two_commits("duplicate").await;
    // A second record of step 1's attempt, after step 2's: two committers whose log
    // tails missed each other. Step 1 keeps its first place in commit order.
    put_record(&store, 3, &Attempt::new(1, 0, TEST_RUN).unwrap()).await;
    let url = url_of(dir.path());
    let out = ckpt(&["verify", &url]);
    assert_eq!(code(&out), 0, "{}", text(&out));
    assert!(text(&out).contains("step 2: ok"), "{}", text(&out));

    let out = ckpt(&["gc", &url, "--keep", "1", "--grace", "0"]);
    assert_eq!(code(&out), 0, "{}", text(&out));

    let out = ckpt(&["verify", &url]);
    assert_eq!(code(&out), 0, "{}", text(&out));
    assert!(text(&out).contains("step 2: ok"), "{}", text(&out));
    // The newest record, which the fence reads, names a directory that still
    // holds its manifest.
    let newest = ckpt::testing::newest(&store).await.unwrap().unwrap();
    let slot = dir
        .path()
        .join(newest.record.attempt().dir())
        .join("manifest.json");
    assert!(
        slot.is_file(),
        "the log's newest record names {slot:?}, which is gone"
    );
}

/// Sets the modification time of every file under `dir` an hour back, so retention
/// takes them for an old dead save.
fn age(dir: &Path) {
    let then = SystemTime::now() - Duration::from_secs(3600);
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            age(&path);
        } else {
            std::fs::File::options()
                .write(true)
                .open(&path)
                .unwrap()
                .set_modified(then)
                .unwrap();
        }
    }
}

/// A directory outside the root that looks like a step directory's content: an
/// attempt with a rank part, and a file that must survive everything.
fn outside_step(outside: &Path, root: &Path) -> PathBuf {
    let attempt = outside.join("g00000000-0");
    std::fs::create_dir_all(&attempt).unwrap();
    std::fs::copy(
        root.join(step_dir(1)).join("rank-00000.json"),
        attempt.join("rank-00000.json"),
    )
    .unwrap();
    let precious = attempt.join("precious.txt");
    std::fs::write(&precious, b"not a checkpoint").unwrap();
    age(outside);
    precious
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_never_deletes_through_a_link_out_of_the_root() {
    // A step directory that is a link, and an attempt directory that is one.
    for attempt_link in [false, true] {
        let (_store, dir) = two_commits("gc-link").await;
        let outside = tempfile::tempdir().unwrap();
        let precious = outside_step(outside.path(), dir.path());
        let link = if attempt_link {
            let step = dir.path().join("step-00000009");
            std::fs::create_dir(&step).unwrap();
            std::os::unix::fs::symlink(
                outside.path().join("g00000000-0"),
                step.join("g00000000-0"),
            )
            .unwrap();
            "step-00000009/g00000000-0"
        } else {
            std::os::unix::fs::symlink(outside.path(), dir.path().join("step-00000009")).unwrap();
            "step-00000009"
        };
        let out = ckpt(&["gc", &url_of(dir.path()), "--keep", "1", "--grace", "0"]);
        assert!(
            precious.is_file(),
            "gc deleted {precious:?} through {link}: {}",
            text(&out)
        );
        assert!(
            outside.path().join("g00000000-0/rank-00000.json").is_file(),
            "{}",
            text(&out)
        );
        assert_ne!(code(&out), 0, "{link}: {}", text(&out));
        assert!(
            text(&out).contains(link),
            "the error names {link}: {}",
            text(&out)
        );
        assert!(text(&out).contains("symbolic link"), "{}", text(&out));
    }
}

/// Moves `key` of the root out of it and leaves a symbolic link to it in its place:
/// same bytes, read through a link.
fn move_out_and_link(root: &Path, key: &str, outside: &Path) {
    let target = outside.join(key.replace('/', "_"));
    std::fs::rename(root.join(key), &target).unwrap();
    std::os::unix::fs::symlink(&target, root.join(key)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_refuse_a_link_out_of_the_root_and_name_it() {
    let manifest = format!("{}/manifest.json", step_dir(2));
    let part = format!("{}/rank-00001.json", step_dir(2));
    for what in [
        "data file",
        "part",
        "manifest",
        "attempt directory",
        "commit log",
    ] {
        let (_store, dir) = two_commits("read-link").await;
        let data = format!("{}/{}", step_dir(2), rank_file_name_in(dir.path(), 2, 1));
        let key = match what {
            "data file" => data,
            "part" => part.clone(),
            "manifest" => manifest.clone(),
            "attempt directory" => step_dir(2),
            _ => "commits".to_string(),
        };
        let outside = tempfile::tempdir().unwrap();
        move_out_and_link(dir.path(), &key, outside.path());
        let url = url_of(dir.path());
        for args in [vec!["verify", &url, "--step", "2"], vec!["ls", &url]] {
            let out = ckpt(&args);
            assert_ne!(
                code(&out),
                0,
                "{what}: {args:?} accepted a link: {}",
                text(&out)
            );
            assert!(
                text(&out).contains(&key) && text(&out).contains("symbolic link"),
                "{what}: {args:?} does not name the link {key}: {}",
                text(&out)
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_to_an_ancestor_of_the_root_is_refused_not_walked() {
    let above = tempfile::tempdir().unwrap();
    let root = above.path().join("a").join("root");
    std::fs::create_dir_all(&root).unwrap();
    let store = open_local(&root);
    save_world(&store, 1, 2, &model(1, ROWS), |_| {}).await;
    std::os::unix::fs::symlink("../..", root.join("step-00000005")).unwrap();
    let url = url_of(&root);
    for args in [
        vec!["ls", &url],
        vec!["gc", &url, "--keep", "1", "--grace", "0"],
    ] {
        let out = ckpt(&args);
        assert_ne!(code(&out), 0, "{args:?}: {}", text(&out));
        assert!(
            text(&out).contains("step-00000005") && text(&out).contains("symbolic link"),
            "{args:?}: {}",
            text(&out)
        );
        assert!(!text(&out).contains("loop"), "{args:?}: {}", text(&out));
    }
    assert!(root.join(step_dir(1)).join("manifest.json").is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ls_reads_only_a_bounded_prefix_of_a_partial_saves_part() {
    let (_store, dir) = two_commits("huge-part").await;
    // A partial save whose rank part is 300 MiB (sparse: no disk is used), over the
    // 256 MiB limit; its leading fields say which world saved.
    let attempt = dir.path().join("step-00000009/g00000000-0");
    std::fs::create_dir_all(&attempt).unwrap();
    let body = r#"{"format_version":2,"step":9,"attempt":"g00000000-0","rank":0,"world_size":4,"generation":0,"#;
    let head = format!("{{\"crc32\":\"00000000\",\"body\":{body}");
    let part = attempt.join("rank-00000.json");
    std::fs::write(&part, head.as_bytes()).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&part)
        .unwrap()
        .set_len(300 << 20)
        .unwrap();
    let out = ckpt(&["ls", &url_of(dir.path()), "--json"]);
    assert_eq!(code(&out), 0, "{}", text(&out));
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let partial = listed["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["step"] == 9)
        .expect("the partial save is listed")
        .clone();
    assert_eq!(partial["status"], "partial", "{partial}");
    assert_eq!(partial["world_size"], 4, "{partial}");
    assert_eq!(partial["missing_ranks"], serde_json::json!([1, 2, 3]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_keeps_the_directory_the_newest_record_names_even_when_it_did_not_commit() {
    for how in [NoCommit::EmptySlot, NoCommit::Tombstone] {
        let (store, dir) = two_commits("newest-record").await;
        let attempt = append_record_without_commit(&store, dir.path(), how).await;
        let attempt_dir = dir.path().join(attempt.dir());
        // Old enough for retention to take it for a dead save.
        age(&attempt_dir);
        let out = ckpt(&["gc", &url_of(dir.path()), "--keep", "1", "--grace", "0"]);
        assert_eq!(code(&out), 0, "{how:?}: {}", text(&out));
        let left = std::fs::read_dir(&attempt_dir).map_or(0, |d| d.count());
        assert_eq!(
            left,
            1,
            "{how:?}: gc removed {attempt_dir:?}, which the log's newest record names: {}",
            text(&out)
        );
        let out = ckpt(&["verify", &url_of(dir.path())]);
        assert_eq!(code(&out), 0, "{how:?}: {}", text(&out));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_ignores_a_huge_or_malformed_commit_log_hint_and_says_so() {
    let (_store, dir) = two_commits("hostile-hint").await;
    let head = dir.path().join("commits/HEAD");
    let url = url_of(dir.path());
    // 2 GiB (sparse: no disk is used), then a few bytes that are no number.
    let huge = || {
        std::fs::File::options()
            .write(true)
            .open(&head)
            .unwrap()
            .set_len(2 << 30)
            .unwrap()
    };
    let malformed = || std::fs::write(&head, "seventeen").unwrap();
    for (what, make, says) in [
        ("huge", &huge as &dyn Fn(), "2147483648 bytes"),
        ("malformed", &malformed as &dyn Fn(), "\"seventeen\""),
    ] {
        make();
        let out = Command::new(env!("CARGO_BIN_EXE_ckpt"))
            .args(["verify", &url])
            .env("RUST_LOG", "warn")
            .output()
            .expect("run the ckpt binary");
        assert_eq!(code(&out), 0, "{what}: {}", text(&out));
        assert!(text(&out).contains("step 2: ok"), "{what}: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("ignoring the hint commits/HEAD") && stderr.contains(says),
            "{what}: the hint's rejection is reported, naming it: {stderr}"
        );
    }
}
