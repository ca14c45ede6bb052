//! The memory tier (`ckpt::snapshot`): ranks snapshot into host memory, replicate to
//! their ring successor, vote, commit; a world that lost ranks opens the newest
//! committed snapshot its survivors cover and loads its new boxes from the copies,
//! bitwise what was snapshotted, or learns that it must resume from the store.

use std::time::Duration;

use ckpt::copies::{Copies, CopyConfig, CopyKey, Holding, RankCopy, Sources, load_into};
use ckpt::snapshot::{self, SnapshotRecord, Vote};
use ckpt::storage::Store;
use ckpt::{
    CheckpointConfig, Checkpointer, DType, HostBudget, LoadRequest, Region, Snapshot, State,
    StateValue,
};

const WAIT: Duration = Duration::from_secs(20);
const ROWS: u64 = 1000;
const COLS: u64 = 64;

/// Every byte of the tensor at `step`, row-major (f32 bit patterns).
fn full(step: u64) -> Vec<u8> {
    (0..ROWS * COLS)
        .flat_map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ step as u32).to_le_bytes())
        .collect()
}

fn shard(step: u64, rank: usize, world: usize) -> (Region, Vec<u8>) {
    let region = Region::dim0_shard(&[ROWS, COLS], rank, world);
    let row = (COLS * 4) as usize;
    let start = region.offsets[0] as usize * row;
    let end = start + region.lengths[0] as usize * row;
    (region, full(step)[start..end].to_vec())
}

/// One world of ranks, each with a checkpointer (its store never written) and a
/// copy holder serving on loopback.
struct World {
    checkpointers: Vec<Checkpointer>,
    copies: Vec<Option<Copies>>,
}

fn world(n: usize, budget: Option<u64>) -> World {
    let store = Store::from_url("memory://snapshots-never-written").unwrap();
    let mut checkpointers = Vec::new();
    let mut copies = Vec::new();
    for rank in 0..n {
        let mut config = CheckpointConfig::new(rank, n);
        config.block_size = 4096;
        config.generation = 3;
        config.run_id = "memtier".into();
        config.host_memory_budget = budget;
        let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
        let holder = Copies::serve(
            "127.0.0.1".parse().unwrap(),
            CopyConfig {
                budget: Some(checkpointer.host_budget().clone()),
                ..CopyConfig::default()
            },
        )
        .unwrap();
        checkpointers.push(checkpointer);
        copies.push(Some(holder));
    }
    World {
        checkpointers,
        copies,
    }
}

impl World {
    fn holder(&self, rank: usize) -> &Copies {
        self.copies[rank].as_ref().expect("a live rank")
    }

    fn size(&self) -> usize {
        self.checkpointers.len()
    }

    /// Every rank snapshots `step` and keeps it, pulls its predecessor's; returns the
    /// snapshots (by rank).
    async fn snapshot(&self, step: u64) -> Vec<Snapshot> {
        let n = self.size();
        let mut snaps = Vec::new();
        for rank in 0..n {
            let (region, bytes) = shard(step, rank, n);
            let mut state = State::new();
            state
                .add("w", DType::F32, &[ROWS, COLS], region, &bytes)
                .unwrap();
            state.set_global_json("step", serde_json::json!(step));
            state.set_rank_json("cursor", serde_json::json!(step * 100 + rank as u64));
            let handle = self.checkpointers[rank]
                .snapshot(step, &state)
                .await
                .unwrap();
            let snap = handle.ready().await.unwrap();
            assert!(handle.host_bytes_held().snapshots >= snap.copy().len());
            assert!(self.holder(rank).keep_snapshot(&snap));
            snaps.push(snap);
        }
        for rank in 0..n {
            let pred = (rank + n - 1) % n;
            let from = self.holder(pred).addr().unwrap();
            self.holder(rank)
                .replicate_snapshot(from, snaps[pred].key().clone());
        }
        for rank in 0..n {
            assert!(self.holder(rank).wait_for_pulls(WAIT));
        }
        snaps
    }

    /// Every rank votes on `snaps`; when all are ready, every rank commits and the
    /// record is returned.
    fn vote(&self, snaps: &[Snapshot]) -> Result<SnapshotRecord, Vec<usize>> {
        let n = self.size();
        let step = snaps[0].step();
        // All-gathered as bytes, as a collective would.
        let votes: Vec<Vote> = (0..n)
            .map(|rank| {
                let pred = snaps[(rank + n - 1) % n].key();
                Vote::decode(&Vote::cast(self.holder(rank), &snaps[rank], Some(pred)).encode())
            })
            .collect();
        let table = snapshot::tally(&votes, step)?;
        let attempt =
            ckpt::Attempt::parse(step, snaps[0].key().dir.split_once('/').unwrap().1).unwrap();
        let record = SnapshotRecord::new(&attempt, n as u32, &table);
        for rank in 0..n {
            self.holder(rank)
                .commit_snapshot(&record.dir, table.clone());
        }
        Ok(SnapshotRecord::parse(&record.to_json()).unwrap())
    }

    fn survivors(&self) -> Vec<&Copies> {
        self.copies.iter().flatten().collect()
    }

    fn holdings(&self) -> Vec<Holding> {
        self.survivors()
            .iter()
            .map(|c| Holding::decode(&c.holding().encode()))
            .collect()
    }
}

/// Opens `record` as the new world of survivors would (rank 0 shares, every rank
/// opens), loads every new rank's shard from the copies, and checks it against
/// `step`'s bytes; returns each rank's non-tensor state as loaded.
async fn recover(world: &World, record: &SnapshotRecord) -> ckpt::Result<Vec<StateValue>> {
    let holdings = world.holdings();
    let survivors = world.survivors();
    let n = survivors.len();
    let shared = {
        let (record, own, holdings) = (record.clone(), survivors[0], holdings.clone());
        // Blocking TCP: off the runtime's workers, as a trainer would.
        tokio::task::block_in_place(|| snapshot::share(&record, own, &holdings, 0))?
    };
    let mut cursors = Vec::new();
    for (rank, own) in survivors.iter().enumerate() {
        let reader = snapshot::open_shared(&shared)?;
        assert_eq!(reader.step(), record.step);
        let (region, expected) = shard(record.step, rank, n);
        let request = LoadRequest::new().expect("w", DType::F32, &[ROWS, COLS], region);
        let mut out = vec![0u8; expected.len()];
        let sources = Sources {
            own,
            table: &holdings,
            rank,
            cancelled: None,
        };
        let got = load_into(&reader, &request, &mut [&mut out[..]], &sources).await?;
        assert!(got.all_from_memory());
        assert!(
            out == expected,
            "rank {rank} of {n}: not the snapshot's bytes"
        );
        let global = reader.global_state().await?;
        assert_eq!(
            global.get("step"),
            Some(&StateValue::Json(serde_json::json!(record.step)))
        );
        cursors.extend(
            reader
                .rank_states()
                .await?
                .into_iter()
                .filter_map(|(_, s)| s.get("cursor").cloned()),
        );
    }
    Ok(cursors)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_rank_resumes_from_the_snapshot_bitwise_resharded_onto_the_survivors() {
    let mut w = world(4, None);
    let first = w.snapshot(1).await;
    w.vote(&first).unwrap();
    let second = w.snapshot(5).await;
    w.vote(&second).unwrap();
    let snaps = w.snapshot(10).await;
    let record = w.vote(&snaps).unwrap();
    assert_eq!((record.step, record.generation, record.world), (10, 3, 4));
    // The newest committed snapshot and the one before it are held, nothing older.
    let old = |snaps: &[Snapshot]| CopyKey {
        dir: snaps[0].key().dir.clone(),
        world: 4,
        rank: 0,
    };
    assert!(w.holder(0).get(&old(&first)).is_none());
    assert!(w.holder(0).get(&old(&second)).is_some());
    // Rank 1 dies: its file is held by its successor, rank 2.
    w.copies[1] = None;
    assert!(record.uncovered(&w.holdings()).is_empty());
    let cursors = recover(&w, &record).await.unwrap();
    // Every saved rank's non-tensor state came with it (the dead rank's too).
    let expected: Vec<StateValue> = (0..4u64)
        .map(|r| StateValue::Json(serde_json::json!(1000 + r)))
        .collect();
    assert_eq!(&cursors[..4], &expected[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_control_plane_never_recorded_leaves_the_recorded_snapshot_covered() {
    // Every rank commits step 10 after the vote, but the control plane refuses its
    // record (the generation ended between the vote and the record): a recovery is
    // told to use step 5, which the survivors must still hold, with its table.
    let mut w = world(4, None);
    let recorded = w.vote(&w.snapshot(5).await).unwrap();
    let unrecorded = w.vote(&w.snapshot(10).await).unwrap();
    assert_eq!(
        w.holder(3).committed_snapshot().unwrap().0,
        unrecorded.dir,
        "the vote committed step 10 on every rank"
    );
    w.copies[2] = None;
    assert!(recorded.uncovered(&w.holdings()).is_empty());
    recover(&w, &recorded).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_lost_ring_neighbours_leave_a_file_uncovered() {
    let mut w = world(4, None);
    let snaps = w.snapshot(7).await;
    let record = w.vote(&snaps).unwrap();
    // Ranks 1 and 2: rank 1's file lived on 1 (own) and 2 (replica).
    w.copies[1] = None;
    w.copies[2] = None;
    assert_eq!(record.uncovered(&w.holdings()), vec![1]);
    let err = recover(&w, &record).await.unwrap_err();
    assert!(err.to_string().contains("rank 1's part"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotted_copy_is_detected_and_the_next_holder_serves_it() {
    let mut w = world(3, None);
    let snaps = w.snapshot(4).await;
    let record = w.vote(&snaps).unwrap();
    // Rank 1's own copy rots in memory (one bit); its replica on rank 2 is sound.
    let rotted = {
        let mut bytes = snaps[1].copy().bytes().to_vec();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        Snapshot::new(
            RankCopy::new(snaps[1].key().clone(), bytes),
            snaps[1].part().to_vec(),
        )
        .unwrap()
    };
    assert!(w.holder(1).keep_snapshot(&rotted));
    let holdings = w.holdings();
    let own = w.holder(1);
    let shared =
        tokio::task::block_in_place(|| snapshot::share(&record, w.holder(0), &holdings, 0))
            .unwrap();
    let reader = snapshot::open_shared(&shared).unwrap();
    // Rank 1 of 3 needs its own rows: its copy fails its CRC32, rank 2's replica
    // delivers.
    let (region, expected) = shard(4, 1, 3);
    let request = LoadRequest::new().expect("w", DType::F32, &[ROWS, COLS], region);
    let mut out = vec![0u8; expected.len()];
    let sources = Sources {
        own,
        table: &holdings,
        rank: 1,
        cancelled: None,
    };
    let got = load_into(&reader, &request, &mut [&mut out[..]], &sources)
        .await
        .unwrap();
    assert!(out == expected);
    assert!(
        got.fallbacks
            .iter()
            .any(|f| matches!(f.reason, ckpt::copies::FallbackReason::Mismatch(_))),
        "{:?}",
        got.fallbacks
    );
    // With the sound holder gone too, the load fails: the caller resumes from the
    // store.
    w.copies[2] = None;
    let holdings = w.holdings();
    let sources = Sources {
        own: w.holder(1),
        table: &holdings,
        rank: 1,
        cancelled: None,
    };
    assert!(
        load_into(&reader, &request, &mut [&mut out[..]], &sources)
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_snapshot_is_not_committed_and_the_previous_one_is_used() {
    let mut w = world(3, None);
    let first = w.snapshot(3).await;
    let committed = w.vote(&first).unwrap();
    // Step 6: rank 2 never took it (its vote is against), so nobody commits.
    let n = w.size();
    let mut votes = Vec::new();
    let mut snaps = Vec::new();
    for rank in 0..2 {
        let (region, bytes) = shard(6, rank, n);
        let mut state = State::new();
        state
            .add("w", DType::F32, &[ROWS, COLS], region, &bytes)
            .unwrap();
        let snap = w.checkpointers[rank]
            .snapshot(6, &state)
            .await
            .unwrap()
            .ready()
            .await
            .unwrap();
        assert!(w.holder(rank).keep_snapshot(&snap));
        votes.push(Vote::cast(w.holder(rank), &snap, None));
        snaps.push(snap);
    }
    votes.push(Vote::against(6));
    assert_eq!(snapshot::tally(&votes, 6), Err(vec![2]));
    // A vote on another step counts against too.
    let mut stale = votes.clone();
    stale[2] = Vote {
        step: 3,
        ..stale[0]
    };
    assert_eq!(snapshot::tally(&stale, 6), Err(vec![2]));
    // The committed snapshot of step 3 is still held (newer uncommitted ones never
    // push it out), and a rank loss recovers from it.
    w.copies[0] = None;
    assert_eq!(w.holder(1).committed_snapshot().unwrap().0, committed.dir);
    recover(&w, &committed).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_stay_inside_the_host_memory_budget() {
    // Each rank's file is ~86 KiB (1000 × 64 f32 / 3 plus a header): a budget of
    // 300 KiB holds a committed snapshot and its replica plus one more file, not two
    // full snapshots with replicas.
    let budget = 300 << 10;
    let w = world(3, Some(budget));
    let first = w.snapshot(1).await;
    let committed = w.vote(&first).unwrap();
    let second = w.snapshot(2).await;
    for rank in 0..3 {
        let held = w.checkpointers[rank].host_bytes_held();
        assert!(held.peak <= budget, "rank {rank}: {held}");
        assert!(held.total <= budget, "rank {rank}: {held}");
        // The committed snapshot was never dropped to make room.
        let key = committed.key(rank as u32);
        assert!(w.holder(rank).snapshot_part(&key).is_some(), "rank {rank}");
    }
    // The newer one could not be held whole everywhere: not committed.
    assert!(w.vote(&second).is_err());
    // A budget smaller than one file: the snapshot is refused, not an OOM.
    let tiny = world(1, Some(16 << 10));
    let (region, bytes) = shard(1, 0, 1);
    let mut state = State::new();
    state
        .add("w", DType::F32, &[ROWS, COLS], region, &bytes)
        .unwrap();
    let err = tiny.checkpointers[0].snapshot(1, &state).await.unwrap_err();
    assert!(matches!(err, ckpt::Error::OverBudget(_)), "{err}");
}

#[test]
fn hostile_records_and_votes_are_refused() {
    for bad in [
        "",
        "{}",
        "not json",
        r#"{"step":5,"generation":3,"world":4,"dir":"../x","table_crc32":1}"#,
        r#"{"step":5,"generation":2,"world":4,"dir":"step-00000005/g00000003-snap-x","table_crc32":1}"#,
        r#"{"step":5,"generation":3,"world":0,"dir":"step-00000005/g00000003-snap-x","table_crc32":1}"#,
        r#"{"step":6,"generation":3,"world":4,"dir":"step-00000005/g00000003-snap-x","table_crc32":1}"#,
    ] {
        assert!(SnapshotRecord::parse(bad).is_err(), "{bad:?}");
    }
    assert!(SnapshotRecord::parse(&"x".repeat(10_000)).is_err());
    let good = r#"{"step":5,"generation":3,"world":4,"dir":"step-00000005/g00000003-snap-x","table_crc32":1}"#;
    assert_eq!(SnapshotRecord::parse(good).unwrap().world, 4);
    assert!(!Vote::decode(b"short").ready);
    let mut bytes = Vote {
        step: 9,
        ready: true,
        part_crc32: 7,
    }
    .encode();
    assert!(Vote::decode(&bytes).ready);
    bytes[12] = 2;
    assert!(!Vote::decode(&bytes).ready);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_shared_across_checkpointers_lets_the_holders_copies_go_for_a_new_generation() {
    // An elastic rank: one copies holder for the process, a checkpointer per
    // generation, one budget for all of them.
    let budget = HostBudget::new(Some(400 << 10));
    let store = Store::from_url("memory://snapshots-shared-budget").unwrap();
    let holder = Copies::new(CopyConfig {
        budget: Some(budget.clone()),
        ..CopyConfig::default()
    });
    let (region, bytes) = shard(1, 0, 1);
    let mut state = State::new();
    state
        .add("w", DType::F32, &[ROWS, COLS], region, &bytes)
        .unwrap();
    for generation in 1..=3u64 {
        let mut config = CheckpointConfig::new(0, 1);
        config.generation = generation;
        config.block_size = 4096;
        let checkpointer =
            Checkpointer::with_budget(store.clone(), config, budget.clone()).unwrap();
        // Each generation's snapshot pushes the previous generation's (older,
        // uncommitted) one out of the shared budget: ~256 KiB each would not fit twice.
        let snap = checkpointer
            .snapshot(generation * 10, &state)
            .await
            .unwrap()
            .ready()
            .await
            .unwrap();
        assert!(holder.keep_snapshot(&snap));
        let held = budget.held();
        assert!(held.peak <= 400 << 10, "{held}");
        assert!(
            held.snapshots > 0 && held.snapshots <= snap.copy().len() * 2,
            "{held}"
        );
    }
    // A config's own bound replaces the shared one's.
    let mut config = CheckpointConfig::new(0, 1);
    config.host_memory_budget = Some(1 << 20);
    let _ = Checkpointer::with_budget(store, config, budget.clone()).unwrap();
    assert_eq!(budget.limit(), Some(1 << 20));
}
