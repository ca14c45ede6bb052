//! Cooperative loads through the Rust API, the collectives played by the test: a
//! world of ranks in one process, each with its own store handle (so its requests
//! are counted on their own), passing the library's requests and buffers between
//! them as an all-to-all would.
//!
//! Each case loads what a plain load of the same request returns, bit for bit, and
//! the job reads every needed block from the store once: the ranks' store bytes
//! add up to the unique bytes, and only the rank that opened the checkpoint lists.

use ckpt_testkit as common;

use ckpt::load::LoadStats;
use ckpt::storage::Store;
use ckpt::{
    CheckpointConfig, CheckpointReader, Checkpointer, DType, LoadRequest, Region, State, as_bytes,
};
use common::{TEST_RUN, Tensor, local_store, model, save_world};

/// How the test's "network" treats a buffer in flight: `(from, to)` whose buffer
/// gets a bit flipped.
#[derive(Default, Clone, Copy)]
struct Faults {
    flip: Option<(usize, usize)>,
}

/// Runs a cooperative load of `requests` (one per rank) and returns each rank's
/// outputs and counters, checked against a plain load of the same request.
async fn cooperative_load(
    store: &Store,
    requests: &[LoadRequest],
    faults: Faults,
) -> (Vec<Vec<Vec<u8>>>, Vec<LoadStats>) {
    let world = requests.len();
    let plain_reader = CheckpointReader::open(store, None).await.unwrap();
    let handles: Vec<Store> = (0..world).map(|_| store.with_own_counter()).collect();
    // Rank 0 looks at the store; the others open what it shares.
    let opener = CheckpointReader::open(&handles[0], None).await.unwrap();
    let shared = opener.share().await.unwrap();
    let mut readers = vec![opener];
    for handle in &handles[1..] {
        readers.push(CheckpointReader::from_shared(handle, &shared).unwrap());
    }
    let mut jobs = Vec::new();
    for (rank, (reader, request)) in readers.iter().zip(requests).enumerate() {
        let plan = reader.plan(request).await.unwrap();
        jobs.push(reader.cooperate(plan, rank, world).unwrap());
    }
    // All-to-all of the requests: asked[owner][from].
    let asks: Vec<Vec<Vec<u8>>> = jobs.iter().map(|j| j.asks()).collect();
    let mut sent: Vec<Vec<Vec<u8>>> = Vec::new();
    for (owner, job) in jobs.iter_mut().enumerate() {
        let asked: Vec<&[u8]> = (0..world)
            .map(|from| asks[from][owner].as_slice())
            .collect();
        let sizes = job.serve(&asked).await.unwrap();
        let buffers: Vec<Vec<u8>> = (0..world).map(|to| job.sent(to).unwrap()).collect();
        for (to, b) in buffers.iter().enumerate() {
            assert_eq!(b.len() as u64, sizes[to], "{owner} -> {to}");
        }
        sent.push(buffers);
    }
    if let Some((from, to)) = faults.flip {
        let buffer = &mut sent[from][to];
        assert!(!buffer.is_empty(), "rank {from} sends rank {to} nothing");
        let middle = buffer.len() / 2;
        buffer[middle] ^= 0x10;
    }
    let unique: u64 = jobs.iter().map(|j| j.unique_bytes_served()).sum();
    let mut outputs = Vec::new();
    let mut stats = Vec::new();
    for (rank, job) in jobs.into_iter().enumerate() {
        let expected = job.expected();
        let received: Vec<&[u8]> = (0..world).map(|from| sent[from][rank].as_slice()).collect();
        for (from, bytes) in received.iter().enumerate() {
            if from != rank {
                assert_eq!(bytes.len() as u64, expected[from], "{from} -> {rank}");
            }
        }
        let plain = plain_reader.load(&requests[rank]).await.unwrap();
        let mut mine: Vec<Vec<u8>> = plain
            .tensors
            .iter()
            .map(|t| vec![0xAB; t.data.len()])
            .collect();
        let mut views: Vec<&mut [u8]> = mine.iter_mut().map(Vec::as_mut_slice).collect();
        let mut got = job
            .finish(&requests[rank], &received, &mut views)
            .await
            .unwrap();
        got.unique_bytes = unique;
        for (i, t) in plain.tensors.iter().enumerate() {
            assert!(
                mine[i] == t.data,
                "rank {rank}: {} differs from a plain load",
                t.name
            );
        }
        got.store_requests = handles[rank].request_counts();
        outputs.push(mine);
        stats.push(got);
    }
    (outputs, stats)
}

/// The job-wide figures every case checks: store bytes equal the unique bytes, one
/// listing, and no metadata request but rank 0's.
fn assert_read_once(stats: &[LoadStats], plain_reads: u64) {
    let from_store: u64 = stats.iter().map(|s| s.bytes_read_from_store).sum();
    let unique = stats[0].unique_bytes;
    assert_eq!(from_store, unique, "store bytes vs unique bytes");
    // The plain loads above were counted on the same handles; a cooperative load
    // alone costs what's left.
    assert!(unique > 0 && unique <= plain_reads);
    assert!(stats[0].store_requests.list >= 1);
    for (rank, s) in stats.iter().enumerate().skip(1) {
        let r = s.store_requests;
        assert_eq!((r.list, r.head), (0, 0), "rank {rank} sent {r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resharded_load_four_to_three_reads_each_block_once() {
    let (store, _dir) = local_store("coop-reshard");
    let tensors = model(3, 96);
    save_world(&store, 3, 4, &tensors, |c| c.block_size = 4096).await;
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let requests: Vec<LoadRequest> = (0..3)
        .map(|r| LoadRequest::dim0_shards(reader.manifest(), r, 3))
        .collect();
    let plain: u64 = {
        let mut sum = 0;
        for r in &requests {
            sum += reader.load(r).await.unwrap().stats.bytes_read;
        }
        sum
    };
    let (_, stats) = cooperative_load(&store, &requests, Faults::default()).await;
    assert_read_once(&stats, plain);
    // Boundaries shared by two new ranks are read once, not twice.
    assert!(
        stats[0].unique_bytes < plain,
        "{} vs {plain}",
        stats[0].unique_bytes
    );
    assert!(stats.iter().all(|s| s.bytes_received_from_peers > 0));
}

/// A DDP-style save: rank 0 writes the whole model, ranks 1..4 hold replicas.
async fn save_replicated(store: &Store, world: usize, tensors: &[Tensor], zstd: bool) {
    let mut handles = Vec::new();
    let mut checkpointers = Vec::new();
    for rank in 0..world {
        let mut config = CheckpointConfig::new(rank, world);
        config.run_id = TEST_RUN.to_string();
        config.block_size = 4096;
        if zstd {
            config.codec = ckpt::Codec::Zstd {
                level: 1,
                shuffle: 4,
            };
        }
        checkpointers.push(Checkpointer::new(store.clone(), config).unwrap());
    }
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        let mut state = State::new();
        for t in tensors {
            state
                .add_replica(
                    t.name.clone(),
                    DType::F32,
                    &t.shape,
                    Region::full(&t.shape),
                    as_bytes(&t.data),
                    rank == 0,
                )
                .unwrap();
        }
        handles.push(checkpointer.save(5, &state).await.unwrap());
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_replicas_read_a_quarter_each() {
    for zstd in [false, true] {
        let (store, _dir) = local_store("coop-ddp");
        let tensors = model(5, 128);
        save_replicated(&store, 4, &tensors, zstd).await;
        let reader = CheckpointReader::open(&store, None).await.unwrap();
        let everything = LoadRequest::everything(reader.manifest());
        let plain = reader.load(&everything).await.unwrap().stats.bytes_read;
        let requests = vec![everything; 4];
        let (_, stats) = cooperative_load(&store, &requests, Faults::default()).await;
        assert_read_once(&stats, plain * 4);
        assert_eq!(stats[0].unique_bytes, plain, "zstd {zstd}");
        // Balanced: no rank reads more than a third of the file (a quarter, give
        // or take a block, or a frame when compressed).
        for (rank, s) in stats.iter().enumerate() {
            assert!(
                s.bytes_read_from_store * 3 < plain,
                "zstd {zstd}: rank {rank} read {} of {plain}",
                s.bytes_read_from_store
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_block_from_a_peer_is_caught_and_read_from_the_store() {
    let (store, _dir) = local_store("coop-corrupt");
    let tensors = model(5, 128);
    save_replicated(&store, 4, &tensors, false).await;
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let everything = LoadRequest::everything(reader.manifest());
    let requests = vec![everything; 4];
    let (_, stats) = cooperative_load(&store, &requests, Faults { flip: Some((1, 2)) }).await;
    // Rank 2 rejected what rank 1 sent and read it itself; nobody else did.
    assert!(stats[2].peer_blocks_rejected > 0);
    assert!(
        stats
            .iter()
            .enumerate()
            .all(|(r, s)| r == 2 || s.peer_blocks_rejected == 0)
    );
    let from_store: u64 = stats.iter().map(|s| s.bytes_read_from_store).sum();
    assert!(from_store > stats[0].unique_bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_bytes_that_were_tampered_with_are_refused() {
    let (store, _dir) = local_store("coop-shared");
    let tensors = model(3, 32);
    save_world(&store, 3, 2, &tensors, |_| {}).await;
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let shared = reader.share().await.unwrap();
    assert!(CheckpointReader::from_shared(&store, &shared).is_ok());
    // A byte of the last part changed: its CRC32 no longer matches the manifest.
    let mut tampered = shared.clone();
    let last = tampered.len() - 10;
    tampered[last] ^= 1;
    let e = CheckpointReader::from_shared(&store, &tampered)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank-") && e.contains("crc32"), "{e}");
    // Cut short, or claiming more than there is: an error naming the offset.
    for cut in [4, 20, shared.len() - 1] {
        let e = CheckpointReader::from_shared(&store, &shared[..cut])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("offset") || e.contains("truncated"),
            "{cut}: {e}"
        );
    }
    // A reader without the parts cannot cooperate.
    let plan = reader
        .plan(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap();
    let fresh = CheckpointReader::open(&store, None).await.unwrap();
    assert!(fresh.cooperate(plan, 0, 2).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_shared_bytes_and_requests_are_errors_not_panics() {
    let (store, _dir) = local_store("coop-hostile");
    let tensors = model(3, 32);
    save_world(&store, 3, 2, &tensors, |c| c.block_size = 4096).await;
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let shared = reader.share().await.unwrap();
    // Every single-byte change and every cut: an error or the same checkpoint.
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    for round in 0..400 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut bytes = shared.clone();
        if round % 2 == 0 {
            let at = (seed as usize) % bytes.len();
            bytes[at] ^= 1 << (seed % 8);
        } else {
            bytes.truncate((seed as usize) % bytes.len());
        }
        if let Ok(opened) = CheckpointReader::from_shared(&store, &bytes) {
            assert_eq!(opened.manifest(), reader.manifest(), "round {round}");
        }
    }
    // Requests naming a saved rank or blocks that do not exist.
    let plan = reader
        .plan(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap();
    let mut coop = reader.cooperate(plan, 0, 2).unwrap();
    let entry = |saved: u32, start: u64, end: u64| {
        let mut e = saved.to_le_bytes().to_vec();
        e.extend_from_slice(&start.to_le_bytes());
        e.extend_from_slice(&end.to_le_bytes());
        e
    };
    for (bad, says) in [
        (entry(7, 0, 1), "names saved rank 7"),
        (entry(0, 0, u64::MAX), "asks blocks 0.."),
        (entry(0, 3, 3), "asks blocks 3..3"),
        (vec![1, 2, 3], "not whole entries"),
    ] {
        let e = coop.serve(&[&[], &bad]).await.unwrap_err().to_string();
        assert!(e.contains("rank 1's request") && e.contains(says), "{e}");
    }
}
