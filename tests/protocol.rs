//! The commit protocol of format v2 under the timelines that elastic recovery makes
//! routine: a late writer of an older generation, a step saved again by another
//! world or another run, retention by commit order, and a reader holding a
//! checkpoint across a retention pass.
//!
//! The late-writer tests use real processes: the test binary starts itself again
//! with `CKPT_PROTO_CHILD` set, and the child saves one rank of one attempt (parking
//! at the failpoint named by `CKPT_FAILPOINT` when one is set, feature `failpoints`).
//! A child that finishes reports its save's result on stderr.

use ckpt_testkit::{self as common, Capability};

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, SystemTime};

use ckpt::catalog::Status;
use ckpt::retention::Policy;
use ckpt::storage::Store;
use ckpt::{Attempt, CheckpointConfig, CheckpointReader, Checkpointer, Error, SaveHandle};
use common::child::ChildTest;
use common::{Tensor, assert_loads, dim0_state, model, s3_config, test_config};

const CHILD: &str = "CKPT_PROTO_CHILD";
const URL: &str = "CKPT_PROTO_URL";
const RANK: &str = "CKPT_PROTO_RANK";
const WORLD: &str = "CKPT_PROTO_WORLD";
const STEP: &str = "CKPT_PROTO_STEP";
const GENERATION: &str = "CKPT_PROTO_GENERATION";
const RUN: &str = "CKPT_PROTO_RUN";
const SEED: &str = "CKPT_PROTO_SEED";
const FINISHED: &str = "protocol child: save finished: ";
/// How long a child may take to reach its failpoint or finish.
const CHILD_LIMIT: Duration = Duration::from_secs(120);
/// Rows of the small model every test saves.
const ROWS: u64 = 64;

/// Opens the store at `url` as the tests configure it (the S3 test server's options
/// for `s3://` URLs).
fn open_url(url: &str) -> Store {
    let config = if url.starts_with("s3://") {
        s3_config(&common::env("CKPT_TEST_S3_ENDPOINT"), test_config())
    } else {
        test_config()
    };
    Store::open(url, config).expect("open store")
}

/// One save attempt of a world: who saves, and which tensors.
#[derive(Debug, Clone)]
struct Save {
    step: u64,
    world: usize,
    generation: u64,
    run: &'static str,
    /// Seed of the saved model (different seeds, different values).
    seed: u64,
}

impl Save {
    fn tensors(&self) -> Vec<Tensor> {
        model(self.seed, ROWS)
    }

    fn attempt(&self) -> Attempt {
        Attempt::new(self.step, self.generation, self.run).unwrap()
    }

    fn config(&self, rank: usize) -> CheckpointConfig {
        let mut config = CheckpointConfig::new(rank, self.world);
        config.generation = self.generation;
        config.run_id = self.run.to_string();
        config
    }

    /// Starts `rank`'s save; returns once its part is durable.
    async fn rank(
        &self,
        store: &Store,
        rank: usize,
        tensors: &[Tensor],
        configure: impl Fn(&mut CheckpointConfig),
    ) -> SaveHandle {
        let mut config = self.config(rank);
        configure(&mut config);
        let checkpointer = Checkpointer::new(store.clone(), config).expect("checkpointer");
        let state = dim0_state(tensors, self.step, rank, self.world);
        let handle = checkpointer.save(self.step, &state).await.expect("save");
        handle.durable().await.expect("durable");
        handle
    }

    /// Every rank saves; returns once the attempt committed (retention, when
    /// configured, has run: the committer's `committed()` waits for it).
    async fn commit(&self, store: &Store, configure: impl Fn(&mut CheckpointConfig) + Copy) {
        let tensors = self.tensors();
        let mut handles = Vec::new();
        for rank in 0..self.world {
            handles.push(self.rank(store, rank, &tensors, configure).await);
        }
        for handle in &handles {
            handle.committed().await.expect("committed");
        }
    }
}

/// Child role: saves rank `CKPT_PROTO_RANK` of the attempt described by the
/// environment, reports the result of `committed()` and returns.
async fn child() {
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("child needs {name}"));
    let store = open_url(&var(URL));
    let save = Save {
        step: var(STEP).parse().unwrap(),
        world: var(WORLD).parse().unwrap(),
        generation: var(GENERATION).parse().unwrap(),
        run: Box::leak(var(RUN).into_boxed_str()),
        seed: var(SEED).parse().unwrap(),
    };
    let rank: usize = var(RANK).parse().unwrap();
    let checkpointer = Checkpointer::new(store, save.config(rank)).expect("checkpointer");
    let tensors = save.tensors();
    let state = dim0_state(&tensors, save.step, rank, save.world);
    let result = match checkpointer.save(save.step, &state).await {
        Ok(handle) => handle.committed().await,
        Err(e) => Err(e),
    };
    let verdict = match &result {
        Ok(()) => "committed".to_string(),
        Err(e) if e.is_fenced() => format!("fenced: {e}"),
        Err(e) => format!("error: {e}"),
    };
    eprintln!("{FINISHED}{verdict}");
}

/// Starts this test binary on `test` as a child saving `rank` of `save` on `url`.
/// With a failpoint: waits until the child parks there and kills it (SIGKILL).
/// Without: waits until it finishes and returns its verdict line.
fn run_child(test: &str, url: &str, save: &Save, rank: usize, failpoint: Option<&str>) -> String {
    let env = [
        (CHILD, "1".to_string()),
        (URL, url.to_string()),
        (RANK, rank.to_string()),
        (WORLD, save.world.to_string()),
        (STEP, save.step.to_string()),
        (GENERATION, save.generation.to_string()),
        (RUN, save.run.to_string()),
        (SEED, save.seed.to_string()),
    ];
    let mut child = ChildTest::spawn(test, &env, failpoint);
    let marker = failpoint.map(|f| format!("ckpt failpoint reached: {f}"));
    let found = child.line_matching(CHILD_LIMIT, |line| match &marker {
        Some(m) => line.contains(m.as_str()),
        None => line.contains(FINISHED),
    });
    let seen = std::mem::take(&mut child.seen);
    let status = if failpoint.is_some() {
        child.kill()
    } else {
        child.wait()
    };
    let Some(line) = found else {
        panic!(
            "child (rank {rank} of {save:?}) neither reached {failpoint:?} nor finished; \
             status {status}; stderr:\n{}",
            seen.join("\n")
        );
    };
    if failpoint.is_some() {
        assert_eq!(status.signal(), Some(9), "the parked child dies of SIGKILL");
    } else {
        assert!(status.success(), "the child exits cleanly: {status}");
    }
    line
}

/// Every object under `prefix`, with its bytes.
async fn snapshot(store: &Store, prefix: &str) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for object in store.list(prefix).await.expect("list") {
        let bytes = store.get(&object.key).await.expect("get");
        out.insert(object.key, bytes.to_vec());
    }
    out
}

/// A writer of generation 1 that finishes after generation 2 committed the same step
/// cannot change what generation 2's manifest references.
///
/// Generation 1 (world 2) saves step 5: rank 0 here (its part durable, it is the
/// first committer and waits for rank 1), rank 1 in a child parked after its data
/// upload and killed there. Generation 2 (a new run) saves and commits step 5. Then
/// a second child finishes generation 1's rank 1: every part of generation 1 is now
/// there, and its commit is fenced.
async fn late_writer_scenario(test: &str, store: &Store) {
    let url = store.url().to_string();
    let old = Save {
        step: 5,
        world: 2,
        generation: 1,
        run: "genone",
        seed: 5,
    };
    let new = Save {
        step: 5,
        world: 2,
        generation: 2,
        run: "gentwo",
        seed: 500,
    };
    let old_tensors = old.tensors();
    let old_rank0 = old.rank(store, 0, &old_tensors, |_| {}).await;
    run_child(test, &url, &old, 1, Some("after-data-upload"));

    new.commit(store, |_| {}).await;
    let new_dir = new.attempt().dir();
    let before = snapshot(store, &new_dir).await;
    let manifest = ckpt::read_manifest(store, 5)
        .await
        .expect("step 5 manifest");
    assert_eq!(manifest.dir(), new_dir, "generation 2 committed step 5");
    for entry in &manifest.ranks {
        for name in [&entry.file, &entry.part] {
            let key = format!("{new_dir}/{name}");
            assert!(
                before.contains_key(&key),
                "{key} is among {:?}",
                before.keys()
            );
        }
    }

    // Generation 1 finishes late, in a process of its own.
    let verdict = run_child(test, &url, &old, 1, None);
    assert!(
        verdict.contains("fenced:") && verdict.contains("generation 2"),
        "the late rank learns that generation 2 committed first: {verdict}"
    );
    let e = old_rank0.committed().await.unwrap_err();
    assert!(
        matches!(e, Error::Fenced(_)),
        "generation 1's committer: {e}"
    );

    // Generation 2's checkpoint is untouched and is the one readers get.
    assert_eq!(
        snapshot(store, &new_dir).await,
        before,
        "objects of {new_dir}"
    );
    let manifest = ckpt::read_manifest(store, 5)
        .await
        .expect("step 5 manifest");
    assert_eq!(manifest.dir(), new_dir);
    assert_eq!(manifest.generation, 2);
    let latest = ckpt::latest(store).await.unwrap().expect("a commit");
    assert_eq!(latest.dir(), new_dir, "the newest commit");
    let reader = CheckpointReader::open(store, Some(5))
        .await
        .expect("open 5");
    assert_loads(&reader, &new.tensors()).await;

    // Generation 1's attempt is recorded as superseded, in its own directory.
    let survey = ckpt::list_checkpoints(store).await.unwrap();
    let old_dir = old.attempt().dir();
    let buried = survey
        .iter()
        .find(|c| c.dir == old_dir)
        .unwrap_or_else(|| panic!("{old_dir} in {survey:?}"));
    assert_eq!(buried.status, Status::Failed, "{buried:?}");
    assert!(!buried.committed);
    assert!(
        buried
            .failure
            .as_deref()
            .is_some_and(|f| f.contains("superseded")),
        "{buried:?}"
    );
    assert_eq!(buried.ranks_present, vec![0, 1]);
    let commits: Vec<_> = survey.iter().filter(|c| c.committed).collect();
    assert_eq!(commits.len(), 1, "one commit of step 5: {survey:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_writer_cannot_change_a_newer_commit_on_local_disk() {
    if std::env::var_os(CHILD).is_some() {
        return child().await;
    }
    let (store, _dir) = common::local_store("late-writer");
    late_writer_scenario(
        "a_late_writer_cannot_change_a_newer_commit_on_local_disk",
        &store,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_writer_cannot_change_a_newer_commit_on_s3() {
    if std::env::var_os(CHILD).is_some() {
        return child().await;
    }
    if !common::has(Capability::Servers) {
        return;
    }
    let store = common::s3_store("late-writer");
    late_writer_scenario("a_late_writer_cannot_change_a_newer_commit_on_s3", &store).await;
}

/// A run that resumes from step 15 after a crash left parts of step 20 from a 4-rank
/// world, then saves step 20 on 3 ranks, commits: the old parts live in another
/// attempt's directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_smaller_world_saves_a_step_that_a_dead_world_left_parts_of() {
    let (store, _dir) = common::local_store("reused-names");
    let four = |step, seed| Save {
        step,
        world: 4,
        generation: 1,
        run: "four",
        seed,
    };
    four(15, 15).commit(&store, |_| {}).await;
    // Step 20: ranks 0..3 write their parts, rank 3 never does (the world died).
    let dead = four(20, 20);
    let tensors = dead.tensors();
    let mut orphans = Vec::new();
    for rank in 0..3 {
        orphans.push(dead.rank(&store, rank, &tensors, |_| {}).await);
    }
    drop(orphans);

    let three = Save {
        step: 20,
        world: 3,
        generation: 2,
        run: "three",
        seed: 2000,
    };
    three.commit(&store, |_| {}).await;
    let latest = ckpt::latest(&store).await.unwrap().expect("a commit");
    assert_eq!((latest.step, latest.world_size), (20, 3));
    assert_eq!(latest.dir(), three.attempt().dir());
    let reader = CheckpointReader::open(&store, Some(20)).await.unwrap();
    assert_loads(&reader, &three.tensors()).await;
    // The dead world's parts are still there, as a partial save beside the commit.
    let survey = ckpt::list_checkpoints(&store).await.unwrap();
    let partial = survey
        .iter()
        .find(|c| c.dir == dead.attempt().dir())
        .expect("the dead world's attempt");
    assert_eq!(partial.status, Status::Partial);
    assert_eq!(partial.ranks_present, vec![0, 1, 2]);
}

/// A step saved again after it was committed once (a run that resumed from an older
/// checkpoint) is a new commit that `latest()` returns; the old commits stay readable
/// until retention, and `list_checkpoints` shows them as abandoned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_saved_again_is_a_new_commit_and_the_old_one_stays_readable() {
    let (store, _dir) = common::local_store("saved-again");
    let first = |step| two_ranks(step, 1, "first");
    for step in [10, 20, 30] {
        first(step).commit(&store, |_| {}).await;
    }
    let old20 = ckpt::read_manifest(&store, 20).await.unwrap();
    let old_objects = snapshot(&store, &old20.dir()).await;

    // The second run resumed from step 10 and reaches step 20 again.
    let again = Save {
        step: 20,
        world: 2,
        generation: 2,
        run: "second",
        seed: 2020,
    };
    again.commit(&store, |_| {}).await;

    let latest = ckpt::latest(&store).await.unwrap().expect("a commit");
    assert_eq!(
        latest.dir(),
        again.attempt().dir(),
        "latest is the new step 20"
    );
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    assert_loads(&reader, &again.tensors()).await;
    let by_step = CheckpointReader::open(&store, Some(20)).await.unwrap();
    assert_eq!(by_step.manifest().dir(), again.attempt().dir());

    // The first run's step 20 is intact and loads, byte for byte what it was.
    assert_eq!(snapshot(&store, &old20.dir()).await, old_objects);
    let old_reader = CheckpointReader::from_manifest(&store, old20.clone());
    assert_loads(&old_reader, &first(20).tensors()).await;
    // Step 30 is only the first run's: still readable by step.
    let reader30 = CheckpointReader::open(&store, Some(30)).await.unwrap();
    assert_loads(&reader30, &first(30).tensors()).await;

    let survey = ckpt::list_checkpoints(&store).await.unwrap();
    let status = |dir: String| {
        let info = survey
            .iter()
            .find(|c| c.dir == dir)
            .unwrap_or_else(|| panic!("{dir} in {survey:?}"));
        (info.status, info.abandoned_for)
    };
    assert_eq!(status(first(10).attempt().dir()), (Status::Committed, None));
    assert_eq!(
        status(first(20).attempt().dir()),
        (Status::Abandoned, Some(20))
    );
    assert_eq!(
        status(first(30).attempt().dir()),
        (Status::Abandoned, Some(20))
    );
    assert_eq!(status(again.attempt().dir()), (Status::Committed, None));
}

/// Overwrites the middle of `dir`'s manifest on local disk (a manifest that no longer
/// opens: its checksum fails).
fn damage_manifest(root: &std::path::Path, dir: &str) {
    let path = root.join(dir).join("manifest.json");
    let mut bytes = std::fs::read(&path).expect("manifest");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x5a;
    std::fs::write(&path, bytes).expect("damage manifest");
}

/// A save of step `step` by 2 ranks (the model of seed `step`).
fn two_ranks(step: u64, generation: u64, run: &'static str) -> Save {
    Save {
        step,
        world: 2,
        generation,
        run,
        seed: step,
    }
}

/// Save-time retention that keeps one commit, without grace.
fn keep_one(config: &mut CheckpointConfig) {
    config.keep_last = Some(1);
    config.retention_grace = Duration::ZERO;
}

/// Committed directories, in commit order.
async fn committed_dirs(store: &Store) -> Vec<String> {
    ckpt::list_checkpoints(store)
        .await
        .unwrap()
        .into_iter()
        .filter(|c| c.committed)
        .map(|c| c.dir)
        .collect()
}

/// With a corrupt newer step N and keep_last = 1, commits below N are kept: retention
/// goes by commit order, and N (older in commit order) is what goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_with_a_corrupt_newer_step_keeps_the_new_commits() {
    let (store, dir) = common::local_store("corrupt-newer");
    let newer = two_ranks(50, 1, "first");
    newer.commit(&store, keep_one).await;
    damage_manifest(dir.path(), &newer.attempt().dir());

    // The next run falls back past the corrupt 50 and saves 10, then 20.
    let ten = two_ranks(10, 2, "second");
    ten.commit(&store, keep_one).await;
    assert_eq!(committed_dirs(&store).await, vec![ten.attempt().dir()]);
    let twenty = two_ranks(20, 2, "second");
    twenty.commit(&store, keep_one).await;
    assert_eq!(committed_dirs(&store).await, vec![twenty.attempt().dir()]);
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    assert_eq!(reader.manifest().dir(), twenty.attempt().dir());
    assert_loads(&reader, &twenty.tensors()).await;
}

/// An abandoned newer step (a run resumed below it) does not make retention delete
/// the new commits either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_with_an_abandoned_newer_step_keeps_the_new_commits() {
    let (store, _dir) = common::local_store("abandoned-newer");
    two_ranks(10, 1, "first").commit(&store, |_| {}).await;
    two_ranks(50, 1, "first").commit(&store, |_| {}).await;
    let resumed = two_ranks(20, 2, "second");
    resumed.commit(&store, keep_one).await;
    assert_eq!(committed_dirs(&store).await, vec![resumed.attempt().dir()]);
    let latest = ckpt::latest(&store).await.unwrap().expect("a commit");
    assert_eq!(latest.dir(), resumed.attempt().dir());
}

/// When the newest commit is corrupt, the newest valid one is never deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_never_deletes_the_newest_valid_commit() {
    let (store, dir) = common::local_store("newest-valid");
    let save = |step| two_ranks(step, 1, "only");
    for step in [10, 20] {
        save(step).commit(&store, |_| {}).await;
    }
    damage_manifest(dir.path(), &save(20).attempt().dir());
    let policy = Policy {
        keep: 1,
        grace: Duration::ZERO,
    };
    let removed = ckpt::retention::after_commit(&store, policy).await.unwrap();
    assert!(removed.is_empty(), "removed {removed:?}");
    assert_eq!(
        committed_dirs(&store).await,
        vec![save(10).attempt().dir(), save(20).attempt().dir()]
    );
    let latest = ckpt::latest(&store).await.unwrap().expect("a valid commit");
    assert_eq!(latest.dir(), save(10).attempt().dir());
    let reader = CheckpointReader::from_manifest(&store, latest);
    assert_loads(&reader, &save(10).tensors()).await;
}

/// A reader that opened a checkpoint before it was superseded finishes its load
/// across a retention pass; the checkpoint goes only once the grace period is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_holding_a_checkpoint_across_retention_finishes() {
    let (store, _dir) = common::local_store("reader-lease");
    let save = |step| two_ranks(step, 1, "lease");
    save(10).commit(&store, |_| {}).await;
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    assert_eq!(reader.step(), 10);

    save(20).commit(&store, |_| {}).await;
    let grace = Duration::from_secs(3);
    let policy = Policy { keep: 1, grace };
    let removed = ckpt::retention::after_commit(&store, policy).await.unwrap();
    let superseded_at = ckpt::list_checkpoints(&store)
        .await
        .unwrap()
        .into_iter()
        .find(|c| c.dir == save(20).attempt().dir())
        .and_then(|c| c.committed_at)
        .expect("step 20's commit time");
    assert!(
        SystemTime::now() < superseded_at + grace,
        "the first pass must run within the grace period (the machine is too slow \
         for this test's {grace:?})"
    );
    assert!(removed.is_empty(), "within the grace: {removed:?}");
    assert_loads(&reader, &save(10).tensors()).await;

    // The grace period is measured on the store's clock against the commit time of
    // the successor: no event marks its end, so waiting for the clock is the event.
    let end = superseded_at + grace;
    if let Ok(left) = end.duration_since(SystemTime::now()) {
        tokio::time::sleep(left + Duration::from_millis(50)).await;
    }
    let removed = ckpt::retention::after_commit(&store, policy).await.unwrap();
    let gone: Vec<_> = removed.iter().map(|r| r.dir.clone()).collect();
    assert_eq!(gone, vec![save(10).attempt().dir()]);
    assert_eq!(committed_dirs(&store).await, vec![save(20).attempt().dir()]);
    let e = CheckpointReader::open(&store, Some(10)).await.unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e}");
}
