//! A rank that holds several disjoint boxes of one tensor (format version 3): a
//! `ShardedTensor` whose spec gives a rank two shards, row- and column-wise pieces a
//! resharding leaves on one rank. The save, the commit, the loader, the verifier,
//! `ckpt export`, `reshard` and `diff`, and the in-memory copies' header rebuild all
//! take it; boxes that overlap, entry names that would collide and parts that
//! disagree with their manifest are refused by name.
//!
//! The layouts mirror the specs of torch's own DCP tests
//! (`test_load_with_different_shard_plan`, `test_switch_between_sharded_tensor_to_tensor`
//! in torch/distributed/checkpoint's tests): the same pieces, saved through the Rust
//! API.

use ckpt_testkit as common;

use std::collections::BTreeMap;

use ckpt::format::{
    Assignments, FORMAT_VERSION, Layout, LayoutBox, Manifest, RankPart, rank_part_name, seal,
    unseal,
};
use ckpt::storage::Store;
use ckpt::tools::diff::{DiffOptions, diff};
use ckpt::tools::export::{ExportOptions, export};
use ckpt::tools::reshard::{LayoutFile, ReshardOptions, Target, reshard};
use ckpt::tools::verify::{VerifyOptions, verify};
use ckpt::{
    CheckpointConfig, CheckpointReader, Checkpointer, DType, Error, LoadRequest, Region, State,
    as_bytes,
};
use common::{Tensor, columns_of, local_store, rows_of, step_dir, to_f32};

/// `w` [10, 20] in five row pieces, as torch's EnumerableShardingSpec of
/// `test_load_with_different_shard_plan` places them: rank 0 holds three of them.
const W_PIECES: [(usize, u64, u64); 5] = [(0, 0, 2), (1, 2, 1), (0, 3, 3), (1, 6, 3), (0, 9, 1)];

/// The saved model: `w` (row pieces), `m` [6, 8] with rank 0 holding columns 0..2
/// and 6..8 and rank 1 columns 2..6, and `b` [7] an ordinary dim-0 split.
fn model() -> Vec<Tensor> {
    vec![
        Tensor::new("w", &[10, 20], 31),
        Tensor::new("m", &[6, 8], 32),
        Tensor::new("b", &[7], 33),
    ]
}

/// (box, data) of every piece rank `rank` holds, tensor by tensor.
fn pieces(tensors: &[Tensor], rank: usize) -> Vec<(String, Vec<u64>, Region, Vec<f32>)> {
    let (w, m, b) = (&tensors[0], &tensors[1], &tensors[2]);
    let mut out = Vec::new();
    for &(owner, start, rows) in &W_PIECES {
        if owner == rank {
            let data = rows_of(&w.data, 20, start as usize, rows as usize).to_vec();
            out.push((
                "w".to_string(),
                w.shape.clone(),
                Region::rows(&w.shape, start, rows),
                data,
            ));
        }
    }
    let columns: &[(u64, u64)] = if rank == 0 {
        &[(0, 2), (6, 2)]
    } else {
        &[(2, 4)]
    };
    for &(start, width) in columns {
        out.push((
            "m".to_string(),
            m.shape.clone(),
            Region::new(vec![0, start], vec![6, width]),
            columns_of(&m.data, 8, start as usize, width as usize),
        ));
    }
    out.push((
        "b".to_string(),
        b.shape.clone(),
        Region::dim0_shard(&b.shape, rank, 2),
        b.shard(rank, 2).to_vec(),
    ));
    out
}

fn config(rank: usize) -> CheckpointConfig {
    let mut config = CheckpointConfig::new(rank, 2);
    config.run_id = common::TEST_RUN.to_string();
    config.block_size = 4096;
    config
}

/// Both ranks save their pieces of `tensors` at `step`; returns once committed.
async fn save_pieces(store: &Store, step: u64, tensors: &[Tensor]) {
    let held: Vec<_> = (0..2).map(|rank| pieces(tensors, rank)).collect();
    let mut handles = Vec::new();
    for (rank, pieces) in held.iter().enumerate() {
        let checkpointer = Checkpointer::new(store.clone(), config(rank)).unwrap();
        let mut state = State::new();
        for (name, shape, region, data) in pieces {
            state
                .add(
                    name.as_str(),
                    DType::F32,
                    shape,
                    region.clone(),
                    as_bytes(data),
                )
                .unwrap();
        }
        handles.push(checkpointer.save(step, &state).await.unwrap());
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
}

/// Loads `region` of `tensor` and compares it, element for element, with the saved
/// values.
async fn assert_box(reader: &CheckpointReader, tensor: &Tensor, region: Region) {
    let cols = tensor.row_len();
    let loaded = reader
        .load(&LoadRequest::new().tensor(tensor.name.clone(), region.clone()))
        .await
        .unwrap_or_else(|e| panic!("{} {region}: {e}", tensor.name));
    let expected: Vec<f32> = if tensor.shape.len() == 1 {
        let (o, l) = (region.offsets[0] as usize, region.lengths[0] as usize);
        tensor.data[o..o + l].to_vec()
    } else {
        let rows = rows_of(
            &tensor.data,
            cols,
            region.offsets[0] as usize,
            region.lengths[0] as usize,
        );
        columns_of(
            rows,
            cols,
            region.offsets[1] as usize,
            region.lengths[1] as usize,
        )
    };
    assert_eq!(
        to_f32(&loaded.tensors[0].data),
        expected,
        "{} {region}",
        tensor.name
    );
}

fn part_of(dir: &std::path::Path, step: u64, rank: u32) -> RankPart {
    let key = format!("{}/{}", step_dir(step), rank_part_name(rank));
    RankPart::parse(&std::fs::read(dir.join(&key)).unwrap(), &key).unwrap()
}

// Contract of torch's test_load_with_different_shard_plan: a tensor saved with one
// shard plan (a rank holding several pieces) loads whole and under any other plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_holding_several_pieces_of_one_tensor_saves_and_loads_whole_and_resharded() {
    let (store, dir) = local_store("several-boxes");
    let tensors = model();
    save_pieces(&store, 4, &tensors).await;

    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let manifest = reader.manifest();
    // Version 4: the manifest carries health. That a rank holds two boxes of w
    // is version 3's, which the data file's header says (below).
    assert_eq!(manifest.format_version, 4);
    let w = manifest.tensor("w").unwrap();
    let Layout::Boxes(boxes) = &manifest.layouts[w.layout as usize] else {
        panic!("w's pieces need a box layout");
    };
    assert_eq!(boxes.iter().filter(|b| b.rank == 0).count(), 3);
    let b = manifest.tensor("b").unwrap();
    assert!(
        matches!(manifest.layouts[b.layout as usize], Layout::Dim0(_)),
        "one box per rank keeps the dim-0 form"
    );
    let part = part_of(dir.path(), 4, 0);
    assert_eq!(part.format_version, 4);
    assert_eq!(part.chunks.iter().filter(|c| c.tensor == "w").count(), 3);
    assert_eq!(
        part_of(dir.path(), 4, 1).format_version,
        4,
        "rank 1 holds two pieces of w, and its part carries health"
    );

    // Whole, and under other plans: even dim-0 splits over 1..=4 ranks, the
    // other torch spec (rank 1 rows 0..8, rank 0 rows 8..10), columns, a window.
    for t in &tensors {
        assert_box(&reader, t, Region::full(&t.shape)).await;
        for world in 1..=4 {
            for rank in 0..world {
                let region = Region::dim0_shard(&t.shape, rank, world);
                if !region.is_empty() {
                    assert_box(&reader, t, region).await;
                }
            }
        }
    }
    let (w, m) = (&tensors[0], &tensors[1]);
    assert_box(&reader, w, Region::rows(&w.shape, 0, 8)).await;
    assert_box(&reader, w, Region::rows(&w.shape, 8, 2)).await;
    assert_box(&reader, w, Region::new(vec![1, 3], vec![8, 11])).await;
    assert_box(&reader, m, Region::new(vec![0, 1], vec![6, 6])).await;
    assert_box(&reader, m, Region::new(vec![2, 0], vec![3, 8])).await;
    // Several boxes of one tensor in one request, as a rank with two shards asks.
    let loaded = reader
        .load(
            &LoadRequest::new()
                .tensor("w", Region::rows(&w.shape, 0, 3))
                .tensor("w", Region::rows(&w.shape, 7, 3)),
        )
        .await
        .unwrap();
    assert_eq!(to_f32(&loaded.tensors[0].data), rows_of(&w.data, 20, 0, 3));
    assert_eq!(to_f32(&loaded.tensors[1].data), rows_of(&w.data, 20, 7, 3));

    let report = verify(&store, 4, &VerifyOptions::default(), &|_| {})
        .await
        .unwrap();
    assert!(report.ok, "{:?}", report.faults);
    assert_eq!(report.files, 2);

    // `ckpt export` consolidates every tensor whole, in slabs smaller than a piece.
    let out = dir.path().join("export.safetensors");
    let options = ExportOptions {
        memory_budget: 160,
        ..ExportOptions::default()
    };
    export(&store, &reader, &out, &options, &|_| {})
        .await
        .unwrap();
    let bytes = std::fs::read(&out).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for t in &tensors {
        assert_eq!(
            to_f32(file.tensor(&t.name).unwrap().data()),
            t.data,
            "{}",
            t.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_box_of_a_tensor_split_on_one_rank_is_a_safetensors_entry_named_by_its_slice() {
    let (store, dir) = local_store("several-boxes-names");
    let tensors = model();
    save_pieces(&store, 2, &tensors).await;
    let path = dir
        .path()
        .join(step_dir(2))
        .join(common::rank_file_name_in(dir.path(), 2, 0));
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<&str> = file.names().into_iter().collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "b",
            "m[0:6,0:2]",
            "m[0:6,6:8]",
            "w[0:2,0:20]",
            "w[3:6,0:20]",
            "w[9:10,0:20]"
        ]
    );
    let piece = file.tensor("w[3:6,0:20]").unwrap();
    assert_eq!(piece.shape(), &[3, 20]);
    assert_eq!(to_f32(piece.data()), rows_of(&tensors[0].data, 20, 3, 3));
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = metadata.metadata().clone().unwrap();
    assert_eq!(metadata["ckpt.format_version"], "3");
    let described: serde_json::Value = serde_json::from_str(&metadata["ckpt.boxes"]).unwrap();
    assert_eq!(
        described["w[3:6,0:20]"],
        serde_json::json!({"tensor": "w", "shape": [10, 20], "offsets": [3, 0]})
    );
    assert_eq!(
        described["b"],
        serde_json::json!({"shape": [7], "offsets": [0]})
    );

    // The in-memory copies rebuild the header from the part alone: same bytes.
    let part = part_of(dir.path(), 2, 0);
    let header = ckpt::copies::file_header(&part, "copy").unwrap();
    assert_eq!(&bytes[..header.len()], &header[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_whose_ranks_hold_one_box_per_tensor_keeps_version_2_data_files() {
    let (store, dir) = local_store("several-boxes-v2");
    let tensors = common::model(1, 8);
    common::save_world(&store, 1, 2, &tensors, |_| {}).await;
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    // The manifest and the parts carry health (version 4); the data files carry
    // none and keep the lowest version that describes them, which any
    // safetensors-reading tool of version 2 reads.
    assert_eq!(reader.manifest().format_version, 4);
    assert_eq!(part_of(dir.path(), 1, 0).format_version, 4);
    let file = common::rank_file_name_in(dir.path(), 1, 0);
    let bytes = std::fs::read(dir.path().join(step_dir(1)).join(file)).unwrap();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        metadata.metadata().clone().unwrap()["ckpt.format_version"],
        "2"
    );
    assert_eq!(FORMAT_VERSION, 4, "the newest version this build reads");
}

#[test]
fn overlapping_boxes_of_one_tensor_on_one_rank_are_refused_naming_both() {
    let data = [0u8; 4 * 40];
    let mut state = State::new();
    // Rows of `w` [10, 20] from `start`, two of them (of F32 unless said).
    let mut add = |start: u64, dtype: DType| {
        let region = Region::new(vec![start, 0], vec![2, 20]);
        let bytes = &data[..40 * dtype.size()];
        state.add("w", dtype, &[10, 20], region, bytes).map(drop)
    };
    add(0, DType::F32).unwrap();
    add(4, DType::F32).unwrap();
    let err = add(5, DType::F32).unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("\"w\"") && text.contains("[5..7, 0..20]") && text.contains("[4..6, 0..20]"),
        "{text}"
    );
    let err = add(0, DType::F32).unwrap_err();
    assert!(err.to_string().contains("added twice"), "{err}");
    let err = add(8, DType::F16).unwrap_err();
    assert!(
        err.to_string().contains("F16") && err.to_string().contains("F32"),
        "{err}"
    );
    assert_eq!(state.tensors().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_named_like_another_tensors_piece_is_refused_at_save() {
    let (store, _dir) = local_store("several-boxes-collide");
    let data = vec![1f32; 40];
    let checkpointer = Checkpointer::new(store.clone(), CheckpointConfig::new(0, 1)).unwrap();
    let mut state = State::new();
    // `w` split in two on this rank, and a tensor named like its second piece.
    for (name, shape, region) in [
        ("w", [4, 20], Region::rows(&[4, 20], 0, 2)),
        ("w", [4, 20], Region::rows(&[4, 20], 2, 2)),
        ("w[2:4,0:20]", [2, 20], Region::full(&[2, 20])),
    ] {
        state
            .add(name, DType::F32, &shape, region, as_bytes(&data))
            .unwrap();
    }
    let err = match checkpointer.save(1, &state).await {
        Ok(_) => panic!("a save whose entry names collide went ahead"),
        Err(e) => e,
    };
    assert!(matches!(err, Error::Invalid(_)), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("\"w[2:4,0:20]\"") && text.contains("tensor \"w\""),
        "{text}"
    );
}

// The other half of test_load_with_different_shard_plan's contract, offline: a
// checkpoint resharded into a plan that gives a rank several pieces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshard_writes_a_layout_that_gives_one_rank_several_pieces() {
    let (src, _src_dir) = local_store("several-boxes-reshard-src");
    let (dst, _dst_dir) = local_store("several-boxes-reshard-dst");
    let tensors = common::model(3, 12);
    common::save_world(&src, 3, 3, &tensors, |c| c.block_size = 4096).await;
    let source = CheckpointReader::open(&src, None).await.unwrap();
    let piece = |rank: u32, start: u64, rows: u64| LayoutBox {
        rank,
        offsets: vec![start, 0],
        lengths: vec![rows, 256],
    };
    let layout = LayoutFile {
        world_size: 2,
        default: "dim0".into(),
        tensors: BTreeMap::from([(
            "layers.0.weight".to_string(),
            vec![piece(0, 0, 3), piece(1, 3, 5), piece(0, 8, 4)],
        )]),
    };
    reshard(
        &src,
        &source,
        &dst,
        &Target::Layout(layout),
        &ReshardOptions::default(),
        &|_| {},
    )
    .await
    .unwrap();
    let reader = CheckpointReader::open(&dst, None).await.unwrap();
    assert_eq!(reader.manifest().format_version, 3);
    common::assert_loads(&reader, &tensors).await;
    let report = verify(&dst, 3, &VerifyOptions::default(), &|_| {})
        .await
        .unwrap();
    assert!(report.ok, "{:?}", report.faults);
    // `ckpt diff` finds the two layouts bitwise identical.
    let compared = diff(&source, &reader, &DiffOptions::default(), &|_| {})
        .await
        .unwrap();
    assert!(compared.identical, "{:?}", compared.tensors);
    assert_eq!(compared.tensors.len(), tensors.len());
}

/// Rewrites the sealed object `key` under `root` with `edit` applied to its JSON.
fn edit_sealed(root: &std::path::Path, key: &str, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = root.join(key);
    let bytes = std::fs::read(&path).unwrap();
    let (body, _) = unseal(&bytes, key, 1 << 30).unwrap();
    let mut value: serde_json::Value = serde_json::from_slice(body).unwrap();
    edit(&mut value);
    std::fs::write(&path, seal(&serde_json::to_vec(&value).unwrap())).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_descriptions_of_several_boxes_are_refused_by_name() {
    let (store, dir) = local_store("several-boxes-hostile");
    let tensors = model();
    save_pieces(&store, 5, &tensors).await;
    let manifest_key = format!("{}/manifest.json", step_dir(5));
    let manifest =
        Manifest::parse(&std::fs::read(dir.path().join(&manifest_key)).unwrap(), "m").unwrap();
    let part0 = part_of(dir.path(), 5, 0);
    let part1 = part_of(dir.path(), 5, 1);
    let assignments = Assignments::new(&manifest);
    assignments.check_part(&manifest, 0, &part0, "p0").unwrap();
    assignments.check_part(&manifest, 1, &part1, "p1").unwrap();

    // A part that lists one of its boxes twice (and so lacks none by count).
    let mut twice = part0.clone();
    let first_w = twice.chunks.iter().position(|c| c.tensor == "w").unwrap();
    let last_w = twice.chunks.iter().rposition(|c| c.tensor == "w").unwrap();
    twice.chunks[last_w] = twice.chunks[first_w].clone();
    let e = RankPart::parse(&twice.to_bytes(), "rank-00000.json").unwrap_err();
    assert!(
        e.message.contains("\"w\"") && e.message.contains("twice"),
        "{e}"
    );

    // A part that holds another rank's box of w instead of one of its own.
    let mut swapped = part0.clone();
    let other = part1.chunks.iter().find(|c| c.tensor == "w").unwrap();
    swapped.chunks[last_w].offsets = other.offsets.clone();
    swapped.chunks[last_w].lengths = other.lengths.clone();
    swapped.chunks[last_w].bytes[1] =
        swapped.chunks[last_w].bytes[0] + other.lengths.iter().product::<u64>() * 4;
    let part = RankPart::parse(&swapped.to_bytes(), "rank-00000.json").unwrap();
    let e = assignments
        .check_part(&manifest, 0, &part, "rank-00000.json")
        .unwrap_err();
    assert!(
        e.message.contains("\"w\"") && e.message.contains("does not give rank 0"),
        "{e}"
    );

    // A part that drops one of its boxes.
    let mut short = part0.clone();
    short.chunks.remove(last_w);
    let e = assignments
        .check_part(&manifest, 0, &short, "rank-00000.json")
        .unwrap_err();
    assert!(e.message.contains("holds 5 of the 6 boxes"), "{e}");

    // A version-2 part may not list a tensor twice, nor a version-2 manifest give a
    // rank two boxes of one tensor.
    let mut old = part0.clone();
    old.format_version = 2;
    old.health = None;
    let e = RankPart::parse(&old.to_bytes(), "rank-00000.json").unwrap_err();
    assert!(
        e.message.contains("format_version 2") && e.message.contains("\"w\""),
        "{e}"
    );
    let mut old = manifest.clone();
    old.format_version = 2;
    old.health = None;
    let e = old.validate("manifest.json").unwrap_err();
    assert!(
        e.message.contains("format_version 2") && e.message.contains("rank 0"),
        "{e}"
    );

    // Rank 0's piece 9..10 of w moved onto its piece 3..6: two of one rank's
    // boxes overlap (and row 9 is in none); the tiling check refuses it.
    edit_sealed(dir.path(), &manifest_key, |m| {
        for layout in m["layouts"].as_array_mut().unwrap() {
            let Some(boxes) = layout.get_mut("boxes").and_then(|b| b.as_array_mut()) else {
                continue;
            };
            for b in boxes.iter_mut().filter(|b| b["offsets"][0] == 9) {
                b["offsets"][0] = 5.into();
            }
        }
    });
    let e = CheckpointReader::open(&store, Some(5)).await.unwrap_err();
    assert!(e.is_corruption(), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("\"w\"") && text.contains("overlap"), "{text}");
}
