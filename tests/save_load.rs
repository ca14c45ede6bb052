//! Save and load through the public API on local disk: world sizes, layouts,
//! replicas, non-tensor state, compression, retention, and the files' formats.

use ckpt_testkit as common;

use std::collections::BTreeSet;
use std::time::Duration;

use ckpt::format::{Codec, Layout};
use ckpt::storage::Store;
use ckpt::{
    CheckpointConfig, CheckpointReader, Checkpointer, DType, Error, LoadRequest, Region, State,
    StateValue, as_bytes,
};
use common::{
    Tensor, assert_loads, columns_of, dim0_state, local_store, model, rows_of, save_world, steps,
    to_f32,
};
use common::{rank_file_name_in, step_dir};

/// Loads `rank`'s even dim-0 shards of `world` and checks them against `expected`.
async fn assert_dim0_shards(reader: &CheckpointReader, expected: &[Tensor], world: usize) {
    for rank in 0..world {
        let request = LoadRequest::dim0_shards(reader.manifest(), rank, world);
        let loaded = reader.load(&request).await.expect("load shards");
        for t in expected {
            let got = loaded.tensors.iter().find(|l| l.name == t.name).unwrap();
            assert_eq!(
                got.region,
                Region::dim0_shard(&t.shape, rank, world),
                "{}",
                t.name
            );
            assert_eq!(
                to_f32(&got.data),
                t.shard(rank, world),
                "{} rank {rank}/{world}",
                t.name
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_ranks_in_one_process_save_and_reshard_onto_any_world() {
    let (store, _dir) = local_store("many-ranks");
    let tensors = model(5, 40);
    save_world(&store, 5, 8, &tensors, |c| c.block_size = 4096).await;
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    assert_eq!(reader.step(), 5);
    assert_eq!(reader.manifest().world_size, 8);
    assert_loads(&reader, &tensors).await;
    for world in [1, 3, 5, 8, 13] {
        assert_dim0_shards(&reader, &tensors, world).await;
    }
    // A box of rows that straddles several saved shards, and a column window.
    let w = &tensors[0];
    let region = Region::new(vec![3, 17], vec![30, 100]);
    let loaded = reader
        .load(&LoadRequest::new().tensor(w.name.clone(), region))
        .await
        .unwrap();
    let expected: Vec<f32> = columns_of(rows_of(&w.data, 256, 3, 30), 256, 17, 100);
    assert_eq!(to_f32(&loaded.tensors[0].data), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_tensor_is_written_once_and_loads_on_every_rank() {
    let (store, dir) = local_store("replica");
    let weight = Tensor::new("w", &[16, 8], 1);
    let scale = Tensor::new("scale", &[32], 2);
    let mut handles = Vec::new();
    let checkpointers: Vec<_> = (0..2)
        .map(|rank| Checkpointer::new(store.clone(), CheckpointConfig::new(rank, 2)).unwrap())
        .collect();
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        let mut state = State::new();
        state
            .add_dim0_shard(
                "w",
                DType::F32,
                &weight.shape,
                rank,
                2,
                as_bytes(weight.shard(rank, 2)),
            )
            .unwrap();
        state
            .add_replica(
                "scale",
                DType::F32,
                &scale.shape,
                Region::full(&scale.shape),
                as_bytes(&scale.data),
                rank == 0,
            )
            .unwrap();
        assert_eq!(
            state.bytes_to_write(),
            (weight.data.len() / 2 + if rank == 0 { 32 } else { 0 }) as u64 * 4
        );
        handles.push(checkpointer.save(1, &state).await.unwrap());
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }

    let reader = CheckpointReader::open(&store, Some(1)).await.unwrap();
    let manifest = reader.manifest();
    let entry = manifest.tensor("scale").unwrap();
    let boxes = manifest.layouts[entry.layout as usize].boxes(&entry.shape);
    assert_eq!(boxes, vec![(0, Region::full(&[32]))], "one copy, by rank 0");
    let names = |rank: u32| -> BTreeSet<String> {
        let path = dir
            .path()
            .join(step_dir(1))
            .join(rank_file_name_in(dir.path(), 1, rank));
        let bytes = std::fs::read(path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        file.names().into_iter().map(str::to_string).collect()
    };
    assert_eq!(names(0), BTreeSet::from(["scale".into(), "w".into()]));
    assert_eq!(names(1), BTreeSet::from(["w".into()]));
    assert_loads(&reader, &[weight, scale.clone()]).await;
    // Every rank of another world gets the whole replica.
    for rank in 0..3 {
        let request =
            LoadRequest::new().expect("scale", DType::F32, &[32], Region::full(&scale.shape));
        let loaded = reader.load(&request).await.unwrap();
        assert_eq!(to_f32(&loaded.tensors[0].data), scale.data, "rank {rank}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_parallel_column_splits_saved_by_two_load_as_dim0_shards_by_three() {
    let (store, _dir) = local_store("tp-columns");
    let (rows, cols) = (12usize, 10usize);
    let w = Tensor::new("attn.qkv", &[rows as u64, cols as u64], 7);
    let halves: Vec<Vec<f32>> = (0..2)
        .map(|r| columns_of(&w.data, cols, r * 5, 5))
        .collect();
    let checkpointers: Vec<_> = (0..2)
        .map(|rank| Checkpointer::new(store.clone(), CheckpointConfig::new(rank, 2)).unwrap())
        .collect();
    let mut handles = Vec::new();
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        let mut state = State::new();
        let region = Region::new(vec![0, rank as u64 * 5], vec![rows as u64, 5]);
        state
            .add(
                "attn.qkv",
                DType::F32,
                &w.shape,
                region,
                as_bytes(&halves[rank]),
            )
            .unwrap();
        handles.push(checkpointer.save(3, &state).await.unwrap());
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let entry = reader.manifest().tensor("attn.qkv").unwrap();
    assert!(
        matches!(&reader.manifest().layouts[entry.layout as usize], Layout::Boxes(b) if b.len() == 2),
        "column splits are recorded as boxes"
    );
    assert_dim0_shards(&reader, std::slice::from_ref(&w), 3).await;
    assert_loads(&reader, &[w]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_tensor_dtype_and_shape_mismatch_give_precise_errors() {
    let (store, _dir) = local_store("mismatch");
    let tensors = model(1, 8);
    save_world(&store, 1, 2, &tensors, |_| {}).await;
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let bias = Region::full(&[8]);

    let e = reader
        .load(&LoadRequest::new().tensor("layers.9.weight", bias.clone()))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e:?}");
    assert!(e.to_string().contains("\"layers.9.weight\""), "{e}");
    assert!(e.to_string().contains("step 1"), "{e}");

    let e = reader
        .load(&LoadRequest::new().expect("layers.0.bias", DType::BF16, &[8], bias.clone()))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Mismatch(_)), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("\"layers.0.bias\"") && text.contains("BF16") && text.contains("F32"),
        "{e}"
    );

    let e = reader
        .load(&LoadRequest::new().expect("layers.0.bias", DType::F32, &[9], bias.clone()))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Mismatch(_)), "{e:?}");
    assert!(
        e.to_string().contains("\"layers.0.bias\"") && e.to_string().contains("[9]"),
        "{e}"
    );

    let e = reader
        .load(&LoadRequest::new().tensor("layers.0.bias", Region::rows(&[8], 4, 5)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Mismatch(_)), "{e:?}");
    assert!(e.to_string().contains("outside"), "{e}");

    let e = CheckpointReader::open(&store, Some(2)).await.unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e:?}");
    let (empty, _empty_dir) = local_store("mismatch-empty");
    let e = ckpt::load_latest(&empty, LoadRequest::everything)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_saved_ranks_state_is_readable_after_a_world_size_change() {
    let (store, _dir) = local_store("rank-state");
    let tensors = model(4, 12);
    let checkpointers: Vec<_> = (0..3)
        .map(|rank| Checkpointer::new(store.clone(), CheckpointConfig::new(rank, 3)).unwrap())
        .collect();
    let rng: Vec<Vec<u8>> = (0..3u8).map(|r| vec![r, 0xff, 0, r ^ 0x5a, 7]).collect();
    let mut handles = Vec::new();
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        let mut state = dim0_state(&tensors, 4, rank, 3);
        state.set_rank_bytes("rng", &rng[rank]);
        handles.push(checkpointer.save(4, &state).await.unwrap());
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
    // A world of 2 resumes: it reads all three saved ranks' states.
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let states = reader.rank_states().await.unwrap();
    assert_eq!(states.len(), 3);
    for (rank, state) in &states {
        let r = *rank as usize;
        assert_eq!(
            state["cursor"],
            StateValue::Json(serde_json::json!({ "step": 4, "rank": r }))
        );
        assert_eq!(state["rng"].to_bytes().unwrap(), rng[r]);
    }
    assert_dim0_shards(&reader, &tensors, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_state_and_metadata_round_trip() {
    let (store, _dir) = local_store("global-state");
    let w = Tensor::new("w", &[6, 3], 3);
    let checkpointers: Vec<_> = (0..2)
        .map(|rank| {
            let mut config = CheckpointConfig::new(rank, 2);
            config.generation = 42;
            Checkpointer::new(store.clone(), config).unwrap()
        })
        .collect();
    let blob: Vec<u8> = (0..=255).collect();
    let mut handles = Vec::new();
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        let mut state = State::new();
        state
            .add_dim0_shard(
                "w",
                DType::F32,
                &w.shape,
                rank,
                2,
                as_bytes(w.shard(rank, 2)),
            )
            .unwrap();
        // Global state is identical on every rank; only one copy is kept.
        state.set_global_json("scheduler", serde_json::json!({ "lr": 0.5, "warmup": 100 }));
        state.set_global_bytes("optimizer.blob", &blob);
        state.set_metadata("run", serde_json::json!("nightly-7"));
        state.set_metadata(
            "git",
            serde_json::json!({ "commit": "abc123", "dirty": false }),
        );
        handles.push(checkpointer.save(9, &state).await.unwrap());
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let manifest = reader.manifest();
    assert_eq!(manifest.generation, 42);
    assert_eq!(manifest.global_state_rank, Some(0));
    assert_eq!(manifest.metadata["run"], serde_json::json!("nightly-7"));
    assert_eq!(
        manifest.metadata["git"],
        serde_json::json!({ "commit": "abc123", "dirty": false })
    );
    let global = reader.global_state().await.unwrap();
    assert_eq!(global.len(), 2);
    assert_eq!(
        global["scheduler"].as_json(),
        Some(&serde_json::json!({ "lr": 0.5, "warmup": 100 }))
    );
    assert_eq!(global["optimizer.blob"].to_bytes().unwrap(), blob);
    assert_loads(&reader, &[w]).await;
}

/// The safetensors file `bytes` holds exactly `tensors`' boxes of `rank` in `world`,
/// under their global names, and says it is a ckpt file.
fn assert_safetensors_of_rank(bytes: &[u8], tensors: &[Tensor], rank: usize, world: usize) {
    let file = safetensors::SafeTensors::deserialize(bytes).expect("a valid safetensors file");
    let names: BTreeSet<&str> = file.names().into_iter().collect();
    let global: BTreeSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, global, "entries are the global tensor names");
    for t in tensors {
        let view = file.tensor(&t.name).unwrap();
        assert_eq!(view.dtype(), safetensors::Dtype::F32);
        let region = Region::dim0_shard(&t.shape, rank, world);
        let lengths: Vec<usize> = region.lengths.iter().map(|&l| l as usize).collect();
        assert_eq!(view.shape(), lengths.as_slice(), "{} holds its box", t.name);
        assert_eq!(to_f32(view.data()), t.shard(rank, world), "{}", t.name);
    }
    let (_, metadata) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let meta = metadata.metadata().clone().expect("__metadata__");
    assert_eq!(meta.get("format").map(String::as_str), Some("ckpt"));
    assert_eq!(meta.get("ckpt.rank"), Some(&rank.to_string()));
    assert!(meta.contains_key("ckpt.boxes"), "{meta:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_plain_rank_file_is_a_safetensors_file_of_global_names() {
    let (store, dir) = local_store("plain-files");
    let tensors = model(2, 24);
    save_world(&store, 2, 3, &tensors, |_| {}).await;
    for rank in 0..3 {
        let path = dir
            .path()
            .join(step_dir(2))
            .join(rank_file_name_in(dir.path(), 2, rank as u32));
        assert_safetensors_of_rank(&std::fs::read(path).unwrap(), &tensors, rank, 3);
    }
}

/// Decompresses a whole `.zst` file as one stream, with the `zstd` tool when there is
/// one, else with the zstd crate.
fn zstd_decompress(path: &std::path::Path) -> Vec<u8> {
    let tool = std::process::Command::new("sh")
        .args(["-c", "command -v zstd"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if tool {
        let out = std::process::Command::new("zstd")
            .args(["-d", "-c", "-q"])
            .arg(path)
            .output()
            .expect("run zstd");
        assert!(
            out.status.success(),
            "zstd -d {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    } else {
        zstd::stream::decode_all(std::fs::File::open(path).unwrap()).expect("one zstd stream")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_rank_files_decompress_as_one_stream_into_safetensors_files() {
    let (store, dir) = local_store("zstd");
    let tensors = model(6, 96);
    let codec = Codec::Zstd {
        level: 3,
        shuffle: 0,
    };
    save_world(&store, 6, 2, &tensors, |c| {
        c.codec = codec;
        c.block_size = 16 << 10;
    })
    .await;
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    assert_eq!(reader.manifest().codec, codec);
    for rank in 0..2 {
        let part = reader.part(rank).await.unwrap();
        assert!(
            part.file.name.starts_with(&format!("rank-{rank:05}-"))
                && part.file.name.ends_with(".safetensors.zst"),
            "{}",
            part.file.name
        );
        assert!(part.file.frame_bytes.len() > 1, "several frames");
        let path = dir.path().join(step_dir(6)).join(&part.file.name);
        let plain = zstd_decompress(&path);
        assert_eq!(plain.len() as u64, part.file.raw_bytes);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            part.file.stored_bytes
        );
        assert_safetensors_of_rank(&plain, &tensors, rank as usize, 2);
    }
    assert_loads(&reader, &tensors).await;
    assert_dim0_shards(&reader, &tensors, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shuffled_zstd_round_trips() {
    let (store, _dir) = local_store("zstd-shuffle");
    let tensors = model(6, 40);
    save_world(&store, 6, 2, &tensors, |c| {
        c.codec = Codec::Zstd {
            level: 1,
            shuffle: 4,
        };
        c.block_size = 8 << 10;
    })
    .await;
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    assert_loads(&reader, &tensors).await;
    assert_dim0_shards(&reader, &tensors, 5).await;
}

/// Rank 0 alone saves `step` of a world of 2: a partial checkpoint. Returns once its
/// part is durable.
async fn partial(store: &Store, step: u64, tensors: &[Tensor]) {
    let checkpointer = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 2)).unwrap();
    let state = dim0_state(tensors, step, 0, 2);
    let handle = checkpointer.save(step, &state).await.unwrap();
    handle.durable().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_last_keeps_the_newest_commits_and_collects_older_partials() {
    let (store, _dir) = local_store("retention");
    let tensors = model(1, 8);
    save_world(&store, 1, 2, &tensors, |_| {}).await;
    partial(&store, 2, &tensors).await;
    save_world(&store, 3, 2, &tensors, |_| {}).await;
    partial(&store, 4, &tensors).await;
    // A save still in progress, newer than any commit: retention must keep it.
    partial(&store, 9, &tensors).await;
    // Commits in commit order first, then saves that never committed.
    assert_eq!(
        steps(&store).await,
        vec![(1, true), (3, true), (2, false), (4, false), (9, false)]
    );

    let last = model(5, 8);
    save_world(&store, 5, 2, &last, |c| {
        c.keep_last = Some(2);
        // Saves that died before the newest commit are collected at once.
        c.retention_grace = Duration::ZERO;
    })
    .await;
    // A save still in progress, written after the newest commit: retention (commit
    // order and time, not step numbers) keeps it, even with no grace period.
    partial(&store, 8, &tensors).await;
    ckpt::retention::after_commit(
        &store,
        ckpt::retention::Policy {
            keep: 2,
            grace: Duration::ZERO,
        },
    )
    .await
    .unwrap();
    let after = steps(&store).await;
    assert_eq!(&after[..2], &[(3, true), (5, true)], "{after:?}");
    assert!(
        after.contains(&(8, false)),
        "a save newer than the newest commit stays: {after:?}"
    );
    assert!(
        !after.iter().any(|s| matches!(s.0, 1 | 2 | 4 | 9)),
        "{after:?}"
    );
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    assert_eq!(reader.step(), 5);
    assert_loads(&reader, &last).await;
    assert_loads(
        &CheckpointReader::open(&store, Some(3)).await.unwrap(),
        &tensors,
    )
    .await;
    assert!(matches!(
        CheckpointReader::open(&store, Some(1)).await.unwrap_err(),
        Error::NotFound(_)
    ));

    // keep_last 0 would delete the newest commit: refused, naming the field.
    let mut config = CheckpointConfig::new(0, 1);
    config.keep_last = Some(0);
    let e = Checkpointer::new(store.clone(), config).unwrap_err();
    assert!(e.to_string().contains("keep_last"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_step_with_another_world_size_is_the_latest() {
    let (store, _dir) = local_store("world-change");
    let first = model(10, 20);
    save_world(&store, 10, 4, &first, |_| {}).await;
    let second = model(11, 20);
    save_world(&store, 11, 3, &second, |_| {}).await;
    let (reader, loaded) = ckpt::load_latest(&store, |m| LoadRequest::dim0_shards(m, 1, 2))
        .await
        .unwrap();
    assert_eq!(reader.step(), 11);
    assert_eq!(reader.manifest().world_size, 3);
    for t in &second {
        let got = loaded.tensors.iter().find(|l| l.name == t.name).unwrap();
        assert_eq!(to_f32(&got.data), t.shard(1, 2), "{}", t.name);
    }
    assert_loads(
        &CheckpointReader::open(&store, Some(10)).await.unwrap(),
        &first,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_is_reported_not_waited_out() {
    let (store, _dir) = local_store("failed-commit");
    let data = vec![1.0f32; 8];
    let mut handles = Vec::new();
    let mut checkpointers = Vec::new();
    for rank in 0..2 {
        let mut config = CheckpointConfig::new(rank, 2);
        config.commit_timeout = Duration::from_secs(120);
        checkpointers.push(Checkpointer::new(store.clone(), config).unwrap());
    }
    for checkpointer in &checkpointers {
        // Both ranks claim to write the whole tensor: the boxes overlap.
        let mut state = State::new();
        state
            .add("w", DType::F32, &[8], Region::full(&[8]), as_bytes(&data))
            .unwrap();
        handles.push(checkpointer.save(1, &state).await.unwrap());
    }
    // The rank whose commit attempt fails reports it at once; the other rank would
    // only learn by waiting, so the first answer is the failure.
    let first = tokio::select! {
        r = handles[0].committed() => r,
        r = handles[1].committed() => r,
    };
    match first {
        Err(Error::Failed(message)) => assert!(message.contains("overlap"), "{message}"),
        other => panic!("expected the overlap to fail the commit, got {other:?}"),
    }
    assert!(ckpt::latest(&store).await.unwrap().is_none());
}

/// Saves step `step` on every rank of `world` (`configure` adjusts each rank's
/// config, `state_of` builds each rank's state) and waits until it is committed.
async fn save_and_commit<'a>(
    store: &Store,
    step: u64,
    world: usize,
    configure: impl Fn(&mut CheckpointConfig),
    state_of: impl Fn(usize) -> State<'a>,
) {
    let mut handles = Vec::new();
    for rank in 0..world {
        let mut config = CheckpointConfig::new(rank, world);
        configure(&mut config);
        let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
        let outcome = checkpointer.save(step, &state_of(rank)).await.unwrap();
        handles.push(outcome);
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
}

/// Tensors with no elements (`[0, 5]`, `[5, 0]`, `[0]`) and a 0-d scalar, saved as
/// dim-0 shards by 2 ranks with and without compression, load whole and as dim-0
/// shards of 1, 2 and 3 ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_element_and_scalar_tensors_round_trip_onto_any_world() {
    let scalar = [2.5f32];
    let rows: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let shapes: [(&str, Vec<u64>); 5] = [
        ("empty", vec![0]),
        ("empty_cols", vec![5, 0]),
        ("empty_rows", vec![0, 5]),
        ("scalar", vec![]),
        ("w", vec![4, 3]),
    ];
    let data_of = |name: &str| -> &[f32] {
        match name {
            "scalar" => &scalar,
            "w" => &rows,
            _ => &[],
        }
    };
    for codec in [
        Codec::None,
        Codec::Zstd {
            level: 1,
            shuffle: 4,
        },
    ] {
        let (store, _dir) = local_store("zero-element");
        let configure = |c: &mut CheckpointConfig| c.codec = codec;
        save_and_commit(&store, 1, 2, configure, |rank| {
            let mut state = State::new();
            for (name, shape) in &shapes {
                let region = Region::dim0_shard(shape, rank, 2);
                let data = data_of(name);
                let start = region.offsets.first().copied().unwrap_or(0) as usize
                    * shape.iter().skip(1).product::<u64>() as usize;
                let len = region.volume().unwrap() as usize;
                let shard = if data.is_empty() {
                    data
                } else {
                    &data[start..start + len]
                };
                state
                    .add_dim0_shard(*name, DType::F32, shape, rank, 2, as_bytes(shard))
                    .unwrap();
            }
            state
        })
        .await;

        let reader = CheckpointReader::open(&store, Some(1)).await.unwrap();
        let listed: Vec<(&str, &[u64])> = reader
            .manifest()
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape.as_slice()))
            .collect();
        let expected: Vec<(&str, &[u64])> =
            shapes.iter().map(|(n, s)| (*n, s.as_slice())).collect();
        assert_eq!(
            listed, expected,
            "{codec:?}: every tensor is in the manifest"
        );
        for world in 1..=3 {
            for rank in 0..world {
                let request = LoadRequest::dim0_shards(reader.manifest(), rank, world);
                let loaded = reader.load(&request).await.unwrap();
                for tensor in &loaded.tensors {
                    let shape = &tensor.shape;
                    let region = Region::dim0_shard(shape, rank, world);
                    assert_eq!(tensor.region, region, "{}", tensor.name);
                    let data = data_of(&tensor.name);
                    let want: &[f32] = if region.is_empty() {
                        &[]
                    } else {
                        let row = shape.iter().skip(1).product::<u64>() as usize;
                        let start = region.offsets.first().copied().unwrap_or(0) as usize * row;
                        &data[start..start + region.volume().unwrap() as usize]
                    };
                    assert_eq!(
                        to_f32(&tensor.data),
                        want,
                        "{codec:?} {} on rank {rank} of {world}",
                        tensor.name
                    );
                }
            }
        }
    }
}

/// The same tensors saved whole by one rank (box layouts rather than dim-0) load
/// whole and in parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_element_and_scalar_replicas_round_trip() {
    let (store, _dir) = local_store("zero-element-replica");
    let scalar = [7.0f32];
    let shapes: [(&str, Vec<u64>); 4] = [
        ("empty", vec![0]),
        ("empty_cols", vec![5, 0]),
        ("empty_rows", vec![0, 5]),
        ("scalar", vec![]),
    ];
    save_and_commit(
        &store,
        3,
        2,
        |_| {},
        |rank| {
            let mut state = State::new();
            for (name, shape) in &shapes {
                let data: &[f32] = if shape.is_empty() { &scalar } else { &[] };
                let full = Region::full(shape);
                state
                    .add_replica(*name, DType::F32, shape, full, as_bytes(data), rank == 1)
                    .unwrap();
            }
            state
        },
    )
    .await;
    let reader = CheckpointReader::open(&store, Some(3)).await.unwrap();
    assert_eq!(reader.manifest().tensors.len(), 4);
    let loaded = reader
        .load(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap();
    for tensor in &loaded.tensors {
        let want: &[f32] = if tensor.shape.is_empty() {
            &scalar
        } else {
            &[]
        };
        assert_eq!(to_f32(&tensor.data), want, "{}", tensor.name);
    }
    // A part of an empty tensor is empty too.
    let request = LoadRequest::new().tensor("empty_cols", Region::new(vec![1, 0], vec![3, 0]));
    let loaded = reader.load(&request).await.unwrap();
    assert!(loaded.tensors[0].data.is_empty());
}
