//! Crash safety with real processes: a saving process is killed (SIGKILL) at each
//! seam of the save protocol, and readers still see the previous commit or the new
//! one, complete, never a partial checkpoint.
//!
//! Every test here is both parent and child. The parent runs the scenario; a child is
//! this same test binary, started on the same test with `CKPT_CRASH_CHILD` set, which
//! saves one rank and parks at the failpoint named by `CKPT_FAILPOINT` (feature
//! `failpoints`, enabled for tests). The parent waits for the child's
//! `ckpt failpoint reached: NAME` line on stderr, kills it, and checks as a reader.
//!
//! Scenario: world of 2. Step 1 is committed by both ranks. For step 2, rank 0 is
//! saved by a first child killed at `after-rank-part` (its part is written, it never
//! tried to commit), then rank 1 by a second child killed at the stage under test, so
//! `after-rank-part` and `before-commit` really are the last rank before the commit.
//! Step 3 is then saved with `keep_last` and must collect the partial step 2.

use ckpt_testkit as common;

use std::os::unix::process::ExitStatusExt;
use std::sync::mpsc;
use std::time::Duration;

use ckpt::storage::Store;
use ckpt::{CheckpointConfig, CheckpointReader, Checkpointer, LoadRequest, load_latest};
use common::child::ChildTest;
use common::{Tensor, assert_loads, assert_same, dim0_state, eventually, model, open_local};

const CHILD: &str = "CKPT_CRASH_CHILD";
const DIR: &str = "CKPT_CRASH_DIR";
const RANK: &str = "CKPT_CRASH_RANK";
const WORLD: &str = "CKPT_CRASH_WORLD";
const ROWS: &str = "CKPT_CRASH_ROWS";
const FINISHED: &str = "crash child: save finished";
/// How long a child may take to reach its failpoint before the test gives up.
const CHILD_LIMIT: Duration = Duration::from_secs(120);
/// How long the failpoint line may trail the child's report that its save finished.
const FINISHED_GRACE: Duration = Duration::from_secs(10);

/// Rows of the step's weight matrix: rank 1's shard of the weight
/// (`rows / 2 × 256` f32) must exceed one 5 MiB part for `during-data-upload`.
fn rows_for(failpoint: &str) -> u64 {
    if failpoint == "during-data-upload" {
        10_600
    } else {
        64
    }
}

/// What the killed save left behind, by stage.
#[derive(Debug, Clone, Copy)]
struct Expect {
    /// Rank 1's data file is visible after the kill.
    data_file: bool,
    /// Rank 1's manifest part is visible after the kill.
    part: bool,
    /// Step 2 is committed after the kill.
    committed: bool,
}

/// Child role: save rank `CKPT_CRASH_RANK` of step 2 and never return. Parks at the
/// failpoint; if the save finishes instead, says so and waits to be killed.
async fn child() -> ! {
    let dir = std::env::var(DIR).expect("child needs CKPT_CRASH_DIR");
    let rank: usize = std::env::var(RANK).unwrap().parse().unwrap();
    let world: usize = std::env::var(WORLD).unwrap().parse().unwrap();
    let rows: u64 = std::env::var(ROWS).unwrap().parse().unwrap();
    let step = 2;
    let store = open_local(std::path::Path::new(&dir));
    let checkpointer =
        Checkpointer::new(store, CheckpointConfig::new(rank, world)).expect("checkpointer");
    let tensors = model(step, rows);
    let state = dim0_state(&tensors, step, rank, world);
    let outcome = checkpointer.save(step, &state).await;
    let result = match outcome {
        Ok(handle) => handle.committed().await,
        Err(e) => Err(e),
    };
    eprintln!("{FINISHED}: {result:?}");
    std::future::pending::<()>().await;
    unreachable!("pending never completes")
}

/// Starts this test binary on `test` as a child saving `rank` of step 2, waits for
/// it to announce `failpoint`, and kills it with SIGKILL.
fn run_child_until(test: &str, dir: &std::path::Path, rank: usize, rows: u64, failpoint: &str) {
    let env = [
        (CHILD, "1".to_string()),
        (DIR, dir.display().to_string()),
        (RANK, rank.to_string()),
        (WORLD, "2".to_string()),
        (ROWS, rows.to_string()),
    ];
    let mut child = ChildTest::spawn(test, &env, Some(failpoint));
    let marker = format!("ckpt failpoint reached: {failpoint}");
    let mut limit = CHILD_LIMIT;
    let outcome = loop {
        match child.next_line(limit) {
            Ok(line) if line.contains(&marker) => break Ok(()),
            // `committed()` can see the manifest before the committing task reaches
            // `after-commit`: the failpoint line may still follow, but not much later.
            Ok(line) if line.contains(FINISHED) => {
                child.seen.push(line);
                limit = FINISHED_GRACE;
            }
            Ok(line) => child.seen.push(line),
            Err(mpsc::RecvTimeoutError::Timeout) if limit == FINISHED_GRACE => {
                break Err("the save finished without reaching the failpoint");
            }
            Err(mpsc::RecvTimeoutError::Timeout) => break Err("timed out"),
            Err(mpsc::RecvTimeoutError::Disconnected) => break Err("the child exited"),
        }
    };
    let seen = std::mem::take(&mut child.seen);
    let status = child.kill();
    if let Err(why) = outcome {
        panic!(
            "child (rank {rank}) never reached failpoint {failpoint}: {why}; status {status}; stderr:\n{}",
            seen.join("\n")
        );
    }
    assert_eq!(
        status.signal(),
        Some(9),
        "the child (rank {rank}) must die of SIGKILL at {failpoint}, got {status}"
    );
}

/// The whole scenario for a kill of rank 1 at `failpoint`.
async fn crash_scenario(test: &str, failpoint: &str, expect: Expect) {
    if std::env::var_os(CHILD).is_some() {
        child().await;
    }
    let rows = rows_for(failpoint);
    let dir = tempfile::Builder::new()
        .prefix("ckpt-crash-")
        .tempdir()
        .expect("temp dir");
    let store = open_local(dir.path());

    // Step 1: committed by both ranks.
    let step1 = model(1, rows);
    common::save_world(&store, 1, 2, &step1, |_| {}).await;

    // Step 2: rank 0's part written by a process that dies before trying to commit,
    // then rank 1 killed at the stage under test.
    run_child_until(test, dir.path(), 0, rows, "after-rank-part");
    run_child_until(test, dir.path(), 1, rows, failpoint);

    let step2 = model(2, rows);
    let (expected_step, expected) = if expect.committed {
        (2, &step2)
    } else {
        (1, &step1)
    };
    check_reader_view(&store, expected_step, expected).await;

    let info = ckpt::list_checkpoints(&store).await.expect("list");
    let two = info
        .iter()
        .find(|c| c.step == 2)
        .expect("step 2 directory exists (rank 0's part)");
    assert_eq!(two.committed, expect.committed, "step 2 committed: {two:?}");
    let parts: Vec<u32> = if expect.part { vec![0, 1] } else { vec![0] };
    assert_eq!(two.ranks_present, parts, "parts of step 2 after the kill");
    // Rank 1's data file, in the attempt's directory (its name carries a nonce).
    let attempt = ckpt::Attempt::new(2, 0, "0").unwrap();
    let visible = store
        .list(&attempt.dir())
        .await
        .expect("list the attempt")
        .iter()
        .any(|o| o.key.contains("/rank-00001-") && o.key.ends_with(".safetensors"));
    assert_eq!(
        visible,
        expect.data_file,
        "rank 1's data file in {} visible after a kill at {failpoint}",
        attempt.dir()
    );
    if !expect.committed {
        let e = CheckpointReader::open(&store, Some(2)).await.unwrap_err();
        assert!(matches!(e, ckpt::Error::NotFound(_)), "{e}");
        assert!(e.to_string().contains("step 2"), "{e}");
    }

    // A later save commits, and retention collects what the killed save left.
    let step3 = model(3, rows);
    common::save_world(&store, 3, 2, &step3, |c| {
        c.keep_last = Some(2);
        // What the killed save left is older than the newest commit: no reader can
        // want it, so no grace period is needed to show that retention collects it.
        c.retention_grace = Duration::ZERO;
    })
    .await;
    let wanted: Vec<(u64, bool)> = if expect.committed {
        vec![(2, true), (3, true)]
    } else {
        vec![(1, true), (3, true)]
    };
    eventually(
        Duration::from_secs(30),
        "retention keeps 2 commits",
        || async { common::steps(&store).await == wanted },
    )
    .await;
    let reader = CheckpointReader::open(&store, None).await.expect("open");
    assert_eq!(reader.step(), 3);
    assert_loads(&reader, &step3).await;
    let older = CheckpointReader::open(&store, Some(wanted[0].0))
        .await
        .expect("the older kept commit still opens");
    assert_loads(&older, if expect.committed { &step2 } else { &step1 }).await;
}

/// `latest`, `load_latest` and the reader agree on `step`, and its data is exactly
/// `expected`.
async fn check_reader_view(store: &Store, step: u64, expected: &[Tensor]) {
    let manifest = ckpt::latest(store)
        .await
        .expect("latest")
        .expect("a commit");
    assert_eq!(manifest.step, step, "latest committed step");
    let (reader, loaded) = load_latest(store, LoadRequest::everything)
        .await
        .expect("load_latest");
    assert_eq!(reader.step(), step);
    assert_same(&loaded.tensors, expected);
    let states = reader.rank_states().await.expect("rank states");
    assert_eq!(states.len(), 2);
    for (rank, state) in states {
        assert_eq!(
            state["cursor"].as_json(),
            Some(&serde_json::json!({ "step": step, "rank": rank })),
        );
    }
}

macro_rules! crash_test {
    ($name:ident, $failpoint:literal, $expect:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            crash_scenario(stringify!($name), $failpoint, $expect).await;
        }
    };
}

const NOTHING: Expect = Expect {
    data_file: false,
    part: false,
    committed: false,
};

crash_test!(
    kill_during_staging_leaves_previous_commit_loadable,
    "during-staging",
    NOTHING
);
crash_test!(
    kill_before_data_upload_leaves_previous_commit_loadable,
    "before-data-upload",
    NOTHING
);
crash_test!(
    kill_during_multipart_data_upload_leaves_no_data_file_and_previous_commit_loadable,
    "during-data-upload",
    NOTHING
);
crash_test!(
    kill_after_data_upload_leaves_previous_commit_loadable,
    "after-data-upload",
    Expect {
        data_file: true,
        ..NOTHING
    }
);
crash_test!(
    kill_after_rank_part_leaves_previous_commit_loadable,
    "after-rank-part",
    Expect {
        data_file: true,
        part: true,
        committed: false,
    }
);
crash_test!(
    kill_before_commit_leaves_every_part_but_no_commit,
    "before-commit",
    Expect {
        data_file: true,
        part: true,
        committed: false,
    }
);
crash_test!(
    kill_after_commit_leaves_the_new_checkpoint_complete,
    "after-commit",
    Expect {
        data_file: true,
        part: true,
        committed: true,
    }
);

/// Runs this test binary on `test` once per rank in `ranks`, as child processes saving
/// under `dir` with no failpoint, and asserts that every one succeeds.
fn run_ranks(test: &str, dir: &std::path::Path, ranks: std::ops::Range<usize>) {
    let children: Vec<_> = ranks
        .map(|rank| {
            let env = [
                (CHILD, "1".to_string()),
                (DIR, dir.display().to_string()),
                (RANK, rank.to_string()),
            ];
            (rank, ChildTest::spawn(test, &env, None))
        })
        .collect();
    for (rank, mut child) in children {
        let mut stderr = Vec::new();
        while let Ok(line) = child.next_line(CHILD_LIMIT) {
            stderr.push(line);
        }
        let status = child.wait();
        assert!(
            status.success(),
            "rank {rank} failed ({status}): {}",
            stderr.join("\n")
        );
    }
}

/// One rank per process: three processes each save one rank of the same step to a
/// `file://` store; the last part written commits; the parent loads it resharded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_rank_per_process_commits_a_checkpoint_the_parent_loads() {
    const TEST: &str = "one_rank_per_process_commits_a_checkpoint_the_parent_loads";
    const WORLD_SIZE: usize = 3;
    const STEP: u64 = 7;
    const ROWS_HERE: u64 = 48;
    if std::env::var_os(CHILD).is_some() {
        let dir = std::env::var(DIR).unwrap();
        let rank: usize = std::env::var(RANK).unwrap().parse().unwrap();
        let store = open_local(std::path::Path::new(&dir));
        let checkpointer =
            Checkpointer::new(store, CheckpointConfig::new(rank, WORLD_SIZE)).unwrap();
        let tensors = model(STEP, ROWS_HERE);
        let state = dim0_state(&tensors, STEP, rank, WORLD_SIZE);
        let handle = checkpointer.save(STEP, &state).await.unwrap();
        handle.committed().await.expect("commit");
        return;
    }
    let (store, dir) = common::local_store("per-process");
    run_ranks(TEST, dir.path(), 0..WORLD_SIZE);
    let reader = CheckpointReader::open(&store, None).await.expect("open");
    assert_eq!(reader.step(), STEP);
    assert_eq!(reader.manifest().world_size, WORLD_SIZE as u32);
    let tensors = model(STEP, ROWS_HERE);
    assert_loads(&reader, &tensors).await;
    // Resharded onto 2 ranks: each gets its rows back.
    for rank in 0..2 {
        let request = LoadRequest::dim0_shards(reader.manifest(), rank, 2);
        let loaded = reader.load(&request).await.expect("load shard");
        for t in &tensors {
            let got = loaded.tensors.iter().find(|l| l.name == t.name).unwrap();
            assert_eq!(common::to_f32(&got.data), t.shard(rank, 2), "{}", t.name);
        }
    }
    let states = reader.rank_states().await.expect("rank states");
    assert_eq!(
        states
            .iter()
            .map(|(rank, s)| (*rank, s["cursor"].as_json().cloned()))
            .collect::<Vec<_>>(),
        (0..WORLD_SIZE)
            .map(|r| (
                r as u32,
                Some(serde_json::json!({ "step": STEP, "rank": r }))
            ))
            .collect::<Vec<_>>()
    );
}

/// Liveness: the rank that would commit (rank 0) dies right after its part is
/// durable. Another committer takes over: every surviving rank's `committed()`
/// returns Ok, long before `commit_timeout`, and the checkpoint loads whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commit_happens_when_the_committing_rank_dies_after_its_part() {
    const TEST: &str = "the_commit_happens_when_the_committing_rank_dies_after_its_part";
    const WORLD_SIZE: usize = 3;
    const STEP: u64 = 4;
    const ROWS_HERE: u64 = 48;
    if std::env::var_os(CHILD).is_some() {
        let dir = std::env::var(DIR).unwrap();
        let rank: usize = std::env::var(RANK).unwrap().parse().unwrap();
        let store = open_local(std::path::Path::new(&dir));
        let mut config = CheckpointConfig::new(rank, WORLD_SIZE);
        config.run_id = "liveness".into();
        // Far beyond the test's own limit: only a takeover can end the wait in time.
        config.commit_timeout = Duration::from_secs(3600);
        let checkpointer = Checkpointer::new(store, config).unwrap();
        let tensors = model(STEP, ROWS_HERE);
        let state = dim0_state(&tensors, STEP, rank, WORLD_SIZE);
        let handle = checkpointer.save(STEP, &state).await.unwrap();
        let result = handle.committed().await;
        eprintln!("{FINISHED}: {result:?}");
        result.expect("commit");
        return;
    }
    let (store, dir) = common::local_store("liveness");
    assert_eq!(
        CheckpointConfig::new(0, WORLD_SIZE).committers()[0],
        0,
        "rank 0 is the first committer"
    );
    // Rank 0 parks right after its part is durable, before any commit attempt.
    let env = [
        (CHILD, "1".to_string()),
        (DIR, dir.path().display().to_string()),
        (RANK, "0".to_string()),
    ];
    let mut rank0 = ChildTest::spawn(TEST, &env, Some("after-rank-part"));
    let parked = rank0.line_matching(CHILD_LIMIT, |line| {
        line.contains("ckpt failpoint reached: after-rank-part")
    });
    assert!(parked.is_some(), "rank 0 never parked: {:?}", rank0.seen);
    assert_eq!(rank0.kill().signal(), Some(9));
    let started = std::time::Instant::now();
    run_ranks(TEST, dir.path(), 1..WORLD_SIZE);
    // Bounded by the takeover delay, not by the hour-long commit timeout.
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "the survivors learned the outcome after {:?}",
        started.elapsed()
    );
    let reader = CheckpointReader::open(&store, None).await.expect("open");
    assert_eq!(reader.step(), STEP);
    assert_loads(&reader, &model(STEP, ROWS_HERE)).await;
}
