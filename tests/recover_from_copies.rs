//! Recovery from in-memory copies (`ckpt::copies`): every rank keeps the file its save
//! staged and a replica of its ring predecessor's, and a world that lost ranks loads
//! its new boxes from those, verified against the commit's block CRC32s, with the
//! store for whatever they cannot deliver. The oracle is always the bytes saved.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use ckpt::copies::{
    Copies, CopyConfig, CopyKey, FallbackReason, FromCopies, Holding, JobSecret, RankCopy, Sources,
    load_into,
};
use ckpt::region::for_each_run;
use ckpt::storage::Store;
use ckpt::{
    CheckpointConfig, CheckpointReader, Checkpointer, Codec, DType, LoadRequest, Region,
    SaveHandle, State,
};

const WAIT: Duration = Duration::from_secs(20);

/// A global tensor and how the ranks split it.
struct Tensor {
    name: &'static str,
    dtype: DType,
    shape: Vec<u64>,
    /// Split along dimension 1 instead of 0 (a box layout other than dim-0 shards).
    by_columns: bool,
}

/// Tensors of several dtypes and layouts, some spanning many 4 KiB blocks.
fn tensors() -> Vec<Tensor> {
    let t = |name, dtype, shape: &[u64], by_columns| Tensor {
        name,
        dtype,
        shape: shape.to_vec(),
        by_columns,
    };
    vec![
        t("w/f32", DType::F32, &[700, 3], false),
        t("m/bf16", DType::BF16, &[333, 5], false),
        t("steps/i64", DType::I64, &[257], false),
        t("mask/u8", DType::U8, &[4001, 2], false),
        t("cols/f32", DType::F32, &[6, 40], true),
    ]
}

impl Tensor {
    /// Every byte of the tensor, row-major.
    fn full(&self) -> Vec<u8> {
        let n = self.shape.iter().product::<u64>() as usize * self.dtype.size();
        let seed = self.name.len() as u32;
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13 ^ seed) as u8)
            .collect()
    }

    /// The box `rank` of `world` holds.
    fn region(&self, rank: usize, world: usize) -> Region {
        if !self.by_columns {
            return Region::dim0_shard(&self.shape, rank, world);
        }
        let cols = self.shape[1];
        let start = cols * rank as u64 / world as u64;
        let end = cols * (rank as u64 + 1) / world as u64;
        Region::new(vec![0, start], vec![self.shape[0], end - start])
    }

    /// The bytes of box `region`, row-major.
    fn bytes(&self, region: &Region) -> Vec<u8> {
        let elem = self.dtype.size();
        let mut out = vec![0u8; region.volume().unwrap() as usize * elem];
        let full = self.full();
        for_each_run(
            region,
            &Region::full(&self.shape),
            region,
            elem,
            |s, d, len| {
                out[d as usize..(d + len) as usize]
                    .copy_from_slice(&full[s as usize..(s + len) as usize])
            },
        );
        out
    }
}

/// A store of its own (memory:// stores of one name are shared by the process).
fn store() -> Store {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Store::from_url(&format!("memory://recover-{call}")).unwrap()
}

/// A world that saved step 10 with copies kept: each rank's checkpointer, save and
/// holder, the holders serving on loopback, each with its predecessor's replica.
struct Saved {
    store: Store,
    checkpointers: Vec<Checkpointer>,
    handles: Vec<SaveHandle>,
    copies: Vec<Option<Copies>>,
}

async fn save_world(world: usize, codec: Codec, config: CopyConfig) -> Saved {
    let store = store();
    let tensors = tensors();
    let mut checkpointers = Vec::new();
    let mut handles = Vec::new();
    let mut copies = Vec::new();
    for rank in 0..world {
        let mut config_r = CheckpointConfig::new(rank, world);
        config_r.block_size = 4096;
        config_r.codec = codec;
        config_r.generation = 1;
        config_r.run_id = "copies".into();
        config_r.keep_copy = true;
        let checkpointer = Checkpointer::new(store.clone(), config_r).unwrap();
        let boxes: Vec<(Region, Vec<u8>)> = tensors
            .iter()
            .map(|t| {
                let region = t.region(rank, world);
                let bytes = t.bytes(&region);
                (region, bytes)
            })
            .collect();
        let mut state = State::new();
        for (t, (region, bytes)) in tensors.iter().zip(&boxes) {
            state
                .add(t.name, t.dtype, &t.shape, region.clone(), bytes)
                .unwrap();
        }
        state.set_global_json("step", serde_json::json!(10));
        let handle = checkpointer.save(10, &state).await.unwrap();
        let holder = Copies::serve("127.0.0.1".parse().unwrap(), config.clone()).unwrap();
        holder.keep(&handle).unwrap();
        checkpointers.push(checkpointer);
        handles.push(handle);
        copies.push(Some(holder));
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
    let saved = Saved {
        store,
        checkpointers,
        handles,
        copies,
    };
    for rank in 0..world {
        let holder = saved.holder(rank);
        holder.confirm(&saved.handles[rank].attempt().dir());
        if world > 1 {
            let predecessor = (rank + world - 1) % world;
            let from = saved.holder(predecessor).addr().unwrap();
            holder.replicate(from, saved.key(predecessor));
        }
    }
    for rank in 0..world {
        assert!(
            saved.holder(rank).wait_for_pulls(WAIT),
            "pulls of rank {rank}"
        );
    }
    saved
}

impl Saved {
    fn holder(&self, rank: usize) -> &Copies {
        self.copies[rank].as_ref().expect("a live rank")
    }

    fn dir(&self) -> String {
        self.handles[0].attempt().dir()
    }

    fn key(&self, rank: usize) -> CopyKey {
        CopyKey {
            dir: self.dir(),
            world: self.handles.len() as u32,
            rank: rank as u32,
        }
    }

    /// The holders of the ranks still alive, in order: the new world.
    fn survivors(&self) -> Vec<&Copies> {
        self.copies.iter().flatten().collect()
    }

    /// The new world's table of holdings, through the fixed-size records.
    fn table(&self) -> Vec<Holding> {
        self.survivors()
            .iter()
            .map(|c| Holding::decode(&c.holding().encode()))
            .collect()
    }
}

/// Loads rank `rank` of `world`'s boxes of the commit from the copies of `table`
/// (`own` is the rank's holder), and checks every byte against what was saved.
async fn load_checked(
    store: &Store,
    own: &Copies,
    table: &[Holding],
    rank: usize,
    world: usize,
) -> FromCopies {
    let reader = CheckpointReader::open(store, None).await.unwrap();
    let tensors = tensors();
    let mut request = LoadRequest::new();
    let mut outputs: Vec<Vec<u8>> = Vec::new();
    for t in &tensors {
        let region = t.region(rank, world);
        outputs.push(vec![0xAA; t.bytes(&region).len()]);
        request = request.expect(t.name, t.dtype, &t.shape, region);
    }
    let mut out: Vec<&mut [u8]> = outputs.iter_mut().map(Vec::as_mut_slice).collect();
    let sources = Sources {
        own,
        table,
        rank,
        cancelled: None,
    };
    let got = load_into(&reader, &request, &mut out, &sources)
        .await
        .unwrap();
    for (t, out) in tensors.iter().zip(&outputs) {
        assert!(
            *out == t.bytes(&t.region(rank, world)),
            "rank {rank} of {world}: {} differs from what was saved",
            t.name
        );
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_rank_is_rebuilt_bitwise_from_its_successors_replica_and_the_survivors_copies() {
    for codec in [
        Codec::None,
        Codec::Zstd {
            level: 1,
            shuffle: 2,
        },
    ] {
        let mut saved = save_world(4, codec, CopyConfig::default()).await;
        // The own copy is the staging buffer itself, the bytes the CRC32s cover.
        let own = saved.handles[2].copy().unwrap();
        assert!(own.is_staging_buffer());
        assert_eq!(own.key(), &saved.key(2));
        drop(own);
        // Rank 2 is lost; its successor (rank 3) holds its replica.
        assert!(saved.holder(3).get(&saved.key(2)).is_some());
        saved.copies[2] = None;
        let table = saved.table();
        let mut peer_bytes = 0;
        for (rank, own) in saved.survivors().into_iter().enumerate() {
            let got = load_checked(&saved.store, own, &table, rank, 3).await;
            assert!(
                got.all_from_memory() && got.fallbacks.is_empty(),
                "{codec:?} rank {rank}: {got:?}"
            );
            assert!(got.own_bytes > 0, "{got:?}");
            peer_bytes += got.peer_bytes;
        }
        // The resharded world needs rows the lost rank saved, held by its successor.
        assert!(peer_bytes > 0);
        // Two ring neighbours lost: rank 1's file is held by nobody, and is read from
        // the store, by the ranks that need it only.
        saved.copies[1] = None;
        let table = saved.table();
        let got = load_checked(&saved.store, saved.holder(0), &table, 0, 2).await;
        assert_eq!(got.files_from_store, 1, "{got:?}");
        assert!(
            got.fallbacks
                .iter()
                .all(|f| f.reason == FallbackReason::NotHeld && f.saved_rank == 1),
            "{got:?}"
        );
        assert!(got.store.bytes_read > 0 && got.own_bytes > 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotten_copy_is_caught_by_the_saves_checksums_and_the_store_is_read() {
    let mut saved = save_world(2, Codec::None, CopyConfig::default()).await;
    // Rank 0's own copy rots: one bit of its last byte (tensor data).
    let mut bytes = saved.handles[0].copy().unwrap().bytes().to_vec();
    *bytes.last_mut().unwrap() ^= 0x01;
    assert!(
        saved
            .holder(0)
            .keep_copy(RankCopy::new(saved.key(0), bytes))
    );
    // Rank 1 is lost; rank 0 alone needs both files (its successor's replica of rank 0
    // is gone with it).
    saved.copies[1] = None;
    let table = saved.table();
    let got = load_checked(&saved.store, saved.holder(0), &table, 0, 1).await;
    assert_eq!(got.files_from_store, 1, "{got:?}");
    let [fallback] = &got.fallbacks[..] else {
        panic!("one fallback expected: {got:?}");
    };
    let FallbackReason::Mismatch(why) = &fallback.reason else {
        panic!("a mismatch expected: {fallback:?}");
    };
    assert_eq!((fallback.saved_rank, fallback.holder), (0, Some(0)));
    assert!(
        why.contains("(rank 0 of 2) held by rank 0") && why.contains("block"),
        "the copy, its holder and the block are named: {why}"
    );
    // Rank 1's file came from the replica rank 0 pulled.
    assert!(got.own_bytes > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_serving_a_rotten_copy_is_caught_and_the_next_holder_serves_the_file() {
    let saved = save_world(3, Codec::None, CopyConfig::default()).await;
    // Rank 1 loads everything: rank 2's file is held by rank 0 (its successor's
    // replica) and by rank 2, asked in rank order. Rank 0's replica rots.
    let mut bytes = saved.holder(0).get(&saved.key(2)).unwrap().bytes().to_vec();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    assert!(
        saved
            .holder(0)
            .keep_copy(RankCopy::new(saved.key(2), bytes))
    );
    let table = saved.table();
    let reader = CheckpointReader::open(&saved.store, None).await.unwrap();
    let request = LoadRequest::everything(reader.manifest());
    let mut outputs: Vec<Vec<u8>> = request
        .wants
        .iter()
        .map(|w| {
            let t = reader.manifest().tensor(&w.name).unwrap();
            vec![0; (w.region.volume().unwrap() as usize) * t.dtype.size()]
        })
        .collect();
    let mut out: Vec<&mut [u8]> = outputs.iter_mut().map(Vec::as_mut_slice).collect();
    let got = load_into(
        &reader,
        &request,
        &mut out,
        &Sources {
            own: saved.holder(1),
            table: &table,
            rank: 1,
            cancelled: None,
        },
    )
    .await
    .unwrap();
    assert!(got.all_from_memory(), "{got:?}");
    let [fallback] = &got.fallbacks[..] else {
        panic!("one fallback expected: {got:?}");
    };
    assert_eq!((fallback.saved_rank, fallback.holder), (2, Some(0)));
    assert!(
        matches!(&fallback.reason, FallbackReason::Mismatch(why) if why.contains("held by rank 0")),
        "{fallback:?}"
    );
    let tensors = tensors();
    for (want, out) in request.wants.iter().zip(&outputs) {
        let t = tensors.iter().find(|t| t.name == want.name).unwrap();
        assert!(*out == t.bytes(&want.region), "{}", want.name);
    }
}

/// A copy server that answers every request line with `answer`, then (with `close`)
/// hangs up.
fn fake_server(answer: &'static [u8], close: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                if stream.write_all(answer).is_err() || close {
                    break;
                }
                line.clear();
            }
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_answers_garbage_or_is_gone_sends_its_file_to_the_store() {
    let mut saved = save_world(2, Codec::None, CopyConfig::default()).await;
    let len = saved.handles[1].copy().unwrap().len();
    // Rank 1 is lost, and rank 0 holds only its own copy; the table still names a
    // server for rank 1's file, which misbehaves, each time in another way.
    saved.copies[1] = None;
    let own = Copies::new(CopyConfig::default());
    assert!(own.keep_copy(saved.handles[0].copy().unwrap()));
    let gone = {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let truncated: &'static [u8] = Box::leak(
        format!("ok {len}\nonly a few bytes")
            .into_bytes()
            .into_boxed_slice(),
    );
    for (what, addr) in [
        ("garbage", fake_server(b"hello there\n", false)),
        ("a length then a hang-up", fake_server(truncated, true)),
        ("nothing at all", fake_server(b"", true)),
        ("a closed port", gone),
    ] {
        let table = vec![
            own.holding(),
            Holding {
                addr: Some(addr),
                held: vec![saved.key(1)],
            },
        ];
        let got = load_checked(&saved.store, &own, &table, 0, 1).await;
        assert_eq!(got.files_from_store, 1, "{what}: {got:?}");
        assert!(
            matches!(&got.fallbacks[..], [f] if f.holder == Some(1)
                && matches!(f.reason, FallbackReason::Unavailable(_))),
            "{what}: {got:?}"
        );
    }
}

/// Waits until `copies` has refused `n` connections, and checks it refused no more.
/// Nothing signals a refusal, which the server counts once it has read the
/// stranger's last byte (possibly after the stranger gave up): look every
/// millisecond.
fn wait_for_refusals(copies: &Copies, n: u64) {
    let deadline = std::time::Instant::now() + WAIT;
    while copies.refused_connections() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "{} refusals, {n} expected",
            copies.refused_connections()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(copies.refused_connections(), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_job_secret_is_passed_over_and_its_file_is_read_from_the_store() {
    let job = JobSecret::new("the secret of this job", "a test").unwrap();
    let with = |secret: Option<&JobSecret>| CopyConfig {
        secret: secret.cloned(),
        ..CopyConfig::default()
    };
    // Every rank holds the job's secret: the replicas are pulled through it.
    let saved = save_world(2, Codec::None, with(Some(&job))).await;
    assert!(
        saved.holder(0).get(&saved.key(1)).is_some(),
        "replica pulled"
    );
    assert!(
        saved.holder(1).get(&saved.key(0)).is_some(),
        "replica pulled"
    );
    let server = saved.holder(1);
    let addr = server.addr().unwrap();
    let table = |own: &Copies| {
        vec![
            own.holding(),
            Holding {
                addr: Some(addr),
                held: vec![saved.key(1)],
            },
        ]
    };
    // Rank 0 of the new world holds only its own copy: rank 1's file must come from
    // rank 1's server. With the job's secret, it does.
    let own = Copies::new(with(Some(&job)));
    assert!(own.keep_copy(saved.handles[0].copy().unwrap()));
    let got = load_checked(&saved.store, &own, &table(&own), 0, 1).await;
    assert!(
        got.all_from_memory() && got.fallbacks.is_empty() && got.peer_bytes > 0,
        "{got:?}"
    );
    assert_eq!(server.refused_connections(), 0);
    // With another secret, or none, the server is passed over like one that does
    // not answer: the file comes from the store, bitwise the same.
    let other = JobSecret::new("the secret of another job", "a test").unwrap();
    for (n, (what, secret)) in [("another secret", Some(&other)), ("no secret", None)]
        .into_iter()
        .enumerate()
    {
        let stranger = Copies::new(with(secret));
        assert!(stranger.keep_copy(saved.handles[0].copy().unwrap()));
        let got = load_checked(&saved.store, &stranger, &table(&stranger), 0, 1).await;
        assert_eq!(
            (got.files_from_store, got.peer_bytes),
            (1, 0),
            "{what}: {got:?}"
        );
        let [fallback] = &got.fallbacks[..] else {
            panic!("{what}: one fallback expected: {got:?}");
        };
        assert_eq!(
            (fallback.saved_rank, fallback.holder),
            (1, Some(1)),
            "{what}"
        );
        assert!(
            matches!(&fallback.reason, FallbackReason::Unavailable(why)
                if why.contains(&addr.to_string())),
            "{what}: the peer is named: {fallback:?}"
        );
        wait_for_refusals(server, n as u64 + 1);
    }
    // The job's ranks are still served.
    let got = load_checked(&saved.store, &own, &table(&own), 0, 1).await;
    assert!(got.all_from_memory() && got.peer_bytes > 0, "{got:?}");
    assert_eq!(server.refused_connections(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_another_world_or_attempt_or_length_are_refused() {
    let saved = save_world(1, Codec::None, CopyConfig::default()).await;
    let bytes = saved.handles[0].copy().unwrap().bytes().to_vec();
    let holder = saved.holder(0);
    for (what, key, bytes) in [
        (
            "another world",
            CopyKey {
                world: 2,
                ..saved.key(0)
            },
            bytes.clone(),
        ),
        (
            "another attempt",
            CopyKey {
                dir: "step-00000010/g00000002-copies".into(),
                ..saved.key(0)
            },
            bytes.clone(),
        ),
    ] {
        let other = Copies::new(CopyConfig::default());
        assert!(other.keep_copy(RankCopy::new(key, bytes)));
        let table = vec![other.holding()];
        let got = load_checked(&saved.store, &other, &table, 0, 1).await;
        assert!(
            got.files_from_store == 1
                && got.own_bytes == 0
                && got.fallbacks[0].reason == FallbackReason::NotHeld,
            "{what}: {got:?}"
        );
    }
    // The right name, the wrong length: refused before any byte is used.
    assert!(holder.keep_copy(RankCopy::new(
        saved.key(0),
        bytes[..bytes.len() - 1].to_vec()
    )));
    let table = vec![holder.holding()];
    let got = load_checked(&saved.store, holder, &table, 0, 1).await;
    assert!(
        matches!(&got.fallbacks[0].reason, FallbackReason::Mismatch(why) if why.contains("the committed file has")),
        "{got:?}"
    );
    assert_eq!(got.own_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_keeps_no_more_bytes_than_its_budget() {
    // Room for one rank's file, not two: the own copy is kept, the replica is not.
    let len = save_world(2, Codec::None, CopyConfig::default())
        .await
        .handles[0]
        .copy()
        .unwrap()
        .len();
    let budget = len + len / 2;
    let saved = save_world(
        2,
        Codec::None,
        CopyConfig {
            max_bytes: budget,
            ..CopyConfig::default()
        },
    )
    .await;
    for rank in 0..2 {
        let holder = saved.holder(rank);
        assert!(holder.get(&saved.key(rank)).is_some(), "own copy kept");
        assert!(
            holder.get(&saved.key(1 - rank)).is_none(),
            "no replica past the budget"
        );
        assert!(holder.held_bytes() <= budget);
    }
    // A budget below one file keeps nothing, and the recovery reads the store.
    let saved = save_world(
        1,
        Codec::None,
        CopyConfig {
            max_bytes: len / 2,
            ..CopyConfig::default()
        },
    )
    .await;
    assert_eq!(saved.holder(0).held_bytes(), 0);
    let table = saved.table();
    let got = load_checked(&saved.store, saved.holder(0), &table, 0, 1).await;
    assert_eq!(got.files_from_store, got.files);
    drop(saved.checkpointers);
}
