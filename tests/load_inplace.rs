//! In-place loads (`CheckpointReader::load_into`) against the allocating `load`: the
//! same bytes for every box, world size, dtype, codec and backend; wrong buffers are
//! refused before any I/O; a damaged data file is an error naming it and the offset,
//! never a panic, and never bytes that failed their check passed off as a load.
//!
//! Small blocks and small batches make every tensor straddle blocks and every file
//! span several batches, so the vectored in-place reads, the scratch between runs and
//! the copy path for overlapping wants are all exercised.

use ckpt_testkit as common;

use ckpt::load::{LoadStats, ReadConfig};
use ckpt::storage::Store;
use ckpt::{
    CheckpointConfig, CheckpointReader, Checkpointer, Codec, DType, Error, LoadRequest, Loaded,
    Region, State, format::MIN_BLOCK_SIZE,
};
use common::{TEST_RUN, local_store, model, rank_file_name_in, save_world, step_dir, unique};
use proptest::prelude::*;

/// Batches of five minimum-size blocks: most runs span more than one batch.
fn small_batches() -> ReadConfig {
    ReadConfig {
        batch_bytes: 5 * MIN_BLOCK_SIZE,
        file_concurrency: 3,
        batches_in_flight: 3,
    }
}

/// Loads `request` both ways and checks that they agree byte for byte; the in-place
/// outputs start out filled with `0xA5`, so a byte the load skipped shows up.
async fn in_place_matches_allocating(
    reader: &CheckpointReader,
    request: &LoadRequest,
) -> (Loaded, LoadStats) {
    let loaded = reader.load(request).await.expect("allocating load");
    let mut buffers: Vec<Vec<u8>> = loaded
        .tensors
        .iter()
        .map(|t| vec![0xA5; t.data.len()])
        .collect();
    let mut outputs: Vec<&mut [u8]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
    let stats = reader
        .load_into(request, &mut outputs)
        .await
        .expect("in-place load");
    assert_eq!(stats.bytes_requested, loaded.stats.bytes_requested);
    assert_eq!(stats.bytes_verified, loaded.stats.bytes_verified);
    for (t, b) in loaded.tensors.iter().zip(&buffers) {
        if let Some(i) = t.data.iter().zip(b).position(|(x, y)| x != y) {
            panic!(
                "{} box {}: byte {i} is {:#04x} in place, {:#04x} allocated",
                t.name, t.region, b[i], t.data[i]
            );
        }
    }
    (loaded, stats)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_equals_allocating_same_world_and_resharded_on_disk_and_in_memory() {
    let tensors = model(1, 300);
    for codec in [
        Codec::None,
        Codec::Zstd {
            level: 1,
            shuffle: 4,
        },
    ] {
        let (disk, _dir) = local_store("inplace");
        let memory = Store::from_url(&format!("memory://{}", unique("inplace"))).unwrap();
        for store in [&disk, &memory] {
            save_world(store, 1, 4, &tensors, |c| {
                c.block_size = MIN_BLOCK_SIZE;
                c.codec = codec;
            })
            .await;
            let reader = CheckpointReader::open(store, Some(1))
                .await
                .unwrap()
                .with_read_config(small_batches());
            for world in [4, 3, 1, 5] {
                for rank in 0..world {
                    let request = LoadRequest::dim0_shards(reader.manifest(), rank, world);
                    let (loaded, stats) = in_place_matches_allocating(&reader, &request).await;
                    for t in &tensors {
                        let got = loaded.tensors.iter().find(|l| l.name == t.name).unwrap();
                        assert_eq!(common::to_f32(&got.data), t.shard(rank, world));
                    }
                    // Plain files on local disk are read in place, without a copy.
                    if store.local_root().is_some() && codec == Codec::None {
                        assert_eq!(stats.bytes_copied, 0, "{world} ranks, rank {rank}");
                    } else {
                        assert_eq!(stats.bytes_copied, stats.bytes_requested);
                    }
                }
            }
        }
    }
}

/// Two wants of the same bytes cannot both be the target of one read: such batches
/// go through scratch and are copied, and still load right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_wants_of_one_tensor_load_in_place() {
    let tensors = model(1, 200);
    let (store, _dir) = local_store("inplace-overlap");
    save_world(&store, 1, 2, &tensors, |c| c.block_size = MIN_BLOCK_SIZE).await;
    let reader = CheckpointReader::open(&store, Some(1))
        .await
        .unwrap()
        .with_read_config(small_batches());
    let shape = [200u64, 256];
    let request = LoadRequest::new()
        .tensor("layers.0.weight", Region::rows(&shape, 10, 150))
        .tensor("layers.0.weight", Region::rows(&shape, 90, 100))
        .tensor("layers.0.weight", Region::new(vec![3, 17], vec![190, 5]));
    let (_, stats) = in_place_matches_allocating(&reader, &request).await;
    assert!(stats.bytes_copied > 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_output_sizes_or_counts_are_refused_before_any_io() {
    let (store, _dir) = local_store("inplace-sizes");
    save_world(&store, 1, 2, &model(1, 64), |_| {}).await;
    let counted = store.with_own_counter();
    let reader = CheckpointReader::open(&counted, Some(1)).await.unwrap();
    let request = LoadRequest::dim0_shards(reader.manifest(), 0, 2);
    let sizes: Vec<usize> = request
        .wants
        .iter()
        .map(|w| {
            let t = reader.manifest().tensor(&w.name).unwrap();
            w.region.volume().unwrap() as usize * t.dtype.size()
        })
        .collect();
    let before = counted.requests();

    // One byte short on the second want.
    let mut buffers: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![7u8; n]).collect();
    buffers[1].pop();
    let mut outputs: Vec<&mut [u8]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
    let e = reader
        .load_into(&request, &mut outputs)
        .await
        .expect_err("a short buffer");
    let message = e.to_string();
    assert!(matches!(e, Error::Invalid(_)), "{e:?}");
    assert!(message.contains(&request.wants[1].name), "{message}");
    assert!(message.contains(&(sizes[1] - 1).to_string()), "{message}");
    assert!(message.contains(&sizes[1].to_string()), "{message}");

    // One buffer missing.
    let mut buffers: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![7u8; n]).collect();
    buffers.pop();
    let mut outputs: Vec<&mut [u8]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
    let e = reader
        .load_into(&request, &mut outputs)
        .await
        .expect_err("a buffer missing");
    assert!(matches!(e, Error::Invalid(_)), "{e:?}");
    assert!(
        e.to_string().contains(&format!(
            "{} output buffers for {}",
            sizes.len() - 1,
            sizes.len()
        )),
        "{e}"
    );

    assert_eq!(counted.requests(), before, "refused before any request");

    // Through a plan: the same checks, before the data files are touched.
    let plan = reader.plan(&request).await.unwrap();
    let planned = counted.requests();
    let mut buffers: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![7u8; n + 1]).collect();
    let mut outputs: Vec<&mut [u8]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
    let e = reader
        .execute_into(&request, plan, &mut outputs)
        .await
        .expect_err("long buffers");
    assert!(matches!(e, Error::Invalid(_)), "{e:?}");
    assert_eq!(counted.requests(), planned, "no data read");
    assert!(
        buffers.iter().flatten().all(|&b| b == 7),
        "outputs untouched"
    );
}

/// Flips one bit of rank 1's data file; returns the file's object key and the
/// block-aligned offset of the damage.
fn damage(dir: &std::path::Path, block: u64) -> (String, u64) {
    let name = rank_file_name_in(dir, 1, 1);
    let path = dir.join(step_dir(1)).join(&name);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() as u64 / 2 + 77;
    bytes[at as usize] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    (format!("{}/{name}", step_dir(1)), at / block * block)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_block_fails_an_in_place_load_naming_file_and_offset() {
    for codec in [
        Codec::None,
        Codec::Zstd {
            level: 1,
            shuffle: 0,
        },
    ] {
        let (store, dir) = local_store("inplace-corrupt");
        save_world(&store, 1, 2, &model(1, 300), |c| {
            c.block_size = MIN_BLOCK_SIZE;
            c.codec = codec;
        })
        .await;
        let (object, offset) = damage(dir.path(), MIN_BLOCK_SIZE);
        let reader = CheckpointReader::open(&store, Some(1))
            .await
            .unwrap()
            .with_read_config(small_batches());
        // Whole tensors (in place), and overlapping wants (through scratch).
        let everything = LoadRequest::everything(reader.manifest());
        let mut overlapping = everything.clone();
        overlapping.wants.extend(everything.wants.iter().cloned());
        for request in [everything, overlapping] {
            let sizes: Vec<usize> = request
                .wants
                .iter()
                .map(|w| {
                    let t = reader.manifest().tensor(&w.name).unwrap();
                    w.region.volume().unwrap() as usize * t.dtype.size()
                })
                .collect();
            let mut buffers: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
            let mut outputs: Vec<&mut [u8]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
            let e = reader
                .load_into(&request, &mut outputs)
                .await
                .expect_err("a flipped bit");
            assert!(e.is_corruption(), "{e}");
            let Error::Corrupt(f) = &e else {
                unreachable!()
            };
            assert_eq!(f.object, object, "{e}");
            match codec {
                // Plain: the offset of the block that failed its CRC32.
                Codec::None => {
                    assert_eq!(f.offset, Some(offset), "{e}");
                    assert!(e.to_string().contains("CRC32"), "{e}");
                }
                // Compressed: the offset of the frame that failed to decode or check.
                Codec::Zstd { .. } => assert!(f.offset.is_some(), "{e}"),
            }
            // The allocating load fails the same way.
            let e = reader.load(&request).await.expect_err("a flipped bit");
            assert!(e.is_corruption(), "{e}");
        }
    }
}

/// A load dropped midway (its future cancelled) leaves no task writing into the
/// outputs afterwards: the buffers can be used (here: freed and reused) at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_an_in_place_load_midway_waits_for_its_reads() {
    let (store, _dir) = local_store("inplace-cancel");
    let tensors = model(1, 600);
    save_world(&store, 1, 2, &tensors, |c| c.block_size = MIN_BLOCK_SIZE).await;
    let reader = CheckpointReader::open(&store, Some(1))
        .await
        .unwrap()
        .with_read_config(small_batches());
    let request = LoadRequest::everything(reader.manifest());
    let sizes: Vec<usize> = request
        .wants
        .iter()
        .map(|w| {
            let t = reader.manifest().tensor(&w.name).unwrap();
            w.region.volume().unwrap() as usize * t.dtype.size()
        })
        .collect();
    for polls in [1usize, 2, 5, 20] {
        let mut buffers: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        {
            let mut outputs: Vec<&mut [u8]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
            let load = reader.load_into(&request, &mut outputs);
            let mut load = std::pin::pin!(load);
            for _ in 0..polls {
                if futures::poll!(load.as_mut()).is_ready() {
                    break;
                }
                tokio::task::yield_now().await;
            }
        }
        // Nothing writes into the buffers any more: overwrite and check them.
        for b in &mut buffers {
            b.fill(0x3C);
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(
            buffers.iter().flatten().all(|&b| b == 0x3C),
            "after {polls} polls"
        );
    }
    in_place_matches_allocating(&reader, &request).await;
}

// ---------------------------------------------------------------------------------
// Property: arbitrary boxes of tensors of every dtype size.

#[derive(Debug, Clone)]
struct Case {
    world: usize,
    /// (shape, dtype index) per tensor.
    tensors: Vec<(Vec<u64>, usize)>,
    /// (tensor index, box seed) per want; the same tensor may come back.
    wants: Vec<(usize, u64)>,
    block_size: u64,
    on_disk: bool,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..=4,
        prop::collection::vec(
            (prop::collection::vec(1u64..=24, 0..=3), 0..DType::ALL.len()),
            1..=3,
        ),
        prop::collection::vec((0usize..3, any::<u64>()), 1..=5),
        prop_oneof![Just(MIN_BLOCK_SIZE), Just(3 * MIN_BLOCK_SIZE)],
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(world, tensors, wants, block_size, on_disk, seed)| {
            let n = tensors.len();
            Case {
                world,
                wants: wants.into_iter().map(|(t, s)| (t % n, s)).collect(),
                tensors,
                block_size,
                on_disk,
                seed,
            }
        })
}

/// splitmix64.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// An arbitrary (possibly empty) box of `shape`.
fn random_box(shape: &[u64], seed: u64) -> Region {
    let mut s = seed;
    let (mut offsets, mut lengths) = (Vec::new(), Vec::new());
    for &n in shape {
        s = mix(s);
        let off = s % (n + 1);
        s = mix(s);
        let len = s % (n - off + 1);
        offsets.push(off);
        lengths.push(len);
    }
    Region::new(offsets, lengths)
}

async fn run_case(case: Case) {
    let elems = |shape: &[u64]| shape.iter().product::<u64>() as usize;
    let globals: Vec<Vec<u8>> = case
        .tensors
        .iter()
        .enumerate()
        .map(|(i, (shape, dtype))| {
            let len = elems(shape) * DType::ALL[*dtype].size();
            (0..len)
                .map(|k| mix(case.seed ^ ((i as u64) << 40) ^ k as u64) as u8)
                .collect()
        })
        .collect();
    let (disk, _dir) = local_store("inplace-prop");
    let store = if case.on_disk {
        disk
    } else {
        Store::from_url(&format!("memory://{}", unique("inplace-prop"))).unwrap()
    };
    let mut handles = Vec::new();
    let mut checkpointers = Vec::new();
    for rank in 0..case.world {
        let mut config = CheckpointConfig::new(rank, case.world);
        config.run_id = TEST_RUN.to_string();
        config.block_size = case.block_size;
        checkpointers.push(Checkpointer::new(store.clone(), config).unwrap());
    }
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        let mut state = State::new();
        for (i, (shape, dtype)) in case.tensors.iter().enumerate() {
            let dtype = DType::ALL[*dtype];
            let region = Region::dim0_shard(shape, rank, case.world);
            let row = shape.iter().skip(1).product::<u64>() as usize * dtype.size();
            let (start, end) = match shape.first() {
                Some(_) => (
                    region.offsets[0] as usize * row,
                    (region.offsets[0] + region.lengths[0]) as usize * row,
                ),
                None => (0, dtype.size()),
            };
            state
                .add_dim0_shard(
                    format!("t{i}"),
                    dtype,
                    shape,
                    rank,
                    case.world,
                    &globals[i][start..end],
                )
                .unwrap();
        }
        handles.push(checkpointer.save(1, &state).await.unwrap());
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
    let reader = CheckpointReader::open(&store, Some(1))
        .await
        .unwrap()
        .with_read_config(ReadConfig {
            batch_bytes: 2 * case.block_size,
            file_concurrency: 2,
            batches_in_flight: 2,
        });
    let mut request = LoadRequest::new();
    for &(t, seed) in &case.wants {
        request = request.tensor(format!("t{t}"), random_box(&case.tensors[t].0, seed));
    }
    let (loaded, _) = in_place_matches_allocating(&reader, &request).await;
    // And both equal the box cut out of the global tensor element by element.
    for (got, &(t, _)) in loaded.tensors.iter().zip(&case.wants) {
        let (shape, dtype) = &case.tensors[t];
        let elem = DType::ALL[*dtype].size();
        let mut expected = Vec::new();
        let region = &got.region;
        let volume = region.volume().unwrap() as usize;
        let mut coord = vec![0u64; region.ndim()];
        for flat in 0..volume {
            let mut rem = flat as u64;
            for d in (0..region.ndim()).rev() {
                coord[d] = region.offsets[d] + rem % region.lengths[d];
                rem /= region.lengths[d];
            }
            let g = (0..shape.len()).fold(0u64, |acc, d| acc * shape[d] + coord[d]) as usize;
            expected.extend_from_slice(&globals[t][g * elem..(g + 1) * elem]);
        }
        assert_eq!(got.data, expected, "t{t} box {region}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn in_place_equals_allocating_for_arbitrary_boxes_of_every_dtype(case in case()) {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(run_case(case));
    }
}
