//! Integrity: bit flips, truncations, corrupt or hostile manifests and headers give
//! precise errors (object and byte offset), never a panic or a huge allocation, and
//! `load_latest` falls back to the previous valid commit with a warning.

use ckpt_testkit as common;

use std::path::Path;

use ckpt::format::{
    Chunk, Codec, FileEntry, FormatError, Layout, MANIFEST, Manifest, RankPart,
    parse_safetensors_header, rank_part_name, seal,
};
use ckpt::storage::Store;
use ckpt::{CheckpointReader, DType, Error, LoadRequest, Region, load_latest};
use common::{Tensor, assert_same, local_store, model, rank_file_name_in, save_world, step_dir};

const BLOCK: u64 = 4096;

/// A hostile variation: the text its error must contain, and how to make it.
type Case<T> = (&'static str, Box<dyn Fn(&mut T)>);
const ROWS: u64 = 64;

/// Steps 1 and 2 of a world of 2, committed, with 4 KiB checksum blocks.
async fn two_commits(store: &Store, codec: Codec) -> (Vec<Tensor>, Vec<Tensor>) {
    let (one, two) = (model(1, ROWS), model(2, ROWS));
    let configure = |c: &mut ckpt::CheckpointConfig| {
        c.block_size = BLOCK;
        c.codec = codec;
    };
    save_world(store, 1, 2, &one, configure).await;
    save_world(store, 2, 2, &two, configure).await;
    (one, two)
}

fn file_of(root: &Path, step: u64, name: &str) -> std::path::PathBuf {
    root.join(step_dir(step)).join(name)
}

fn flip_bit(path: &Path, offset: u64, bit: u8) {
    let mut bytes = std::fs::read(path).expect("read file to corrupt");
    bytes[offset as usize] ^= 1 << bit;
    std::fs::write(path, bytes).expect("write corrupted file");
}

fn format_error(e: &Error) -> &FormatError {
    match e {
        Error::Corrupt(f) => f,
        other => panic!("expected a corruption error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_bit_in_a_data_file_names_file_and_offset_and_load_latest_falls_back() {
    let (store, dir) = local_store("bitflip");
    let (one, two) = two_commits(&store, Codec::None).await;
    let name = rank_file_name_in(dir.path(), 2, 1);
    let path = file_of(dir.path(), 2, &name);
    let size = std::fs::metadata(&path).unwrap().len();
    let at = size / 2 + 123;
    flip_bit(&path, at, 5);

    let reader = CheckpointReader::open(&store, Some(2)).await.unwrap();
    let e = reader
        .load(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap_err();
    assert!(e.is_corruption(), "{e}");
    let f = format_error(&e);
    assert_eq!(f.object, format!("{}/{name}", step_dir(2)));
    assert_eq!(f.offset, Some(at / BLOCK * BLOCK), "{e}");
    assert!(e.to_string().contains("CRC32"), "{e}");
    assert!(e.to_string().contains(&name), "{e}");

    // Boxes that do not touch the damaged block still load (rank 0's rows).
    let rows = LoadRequest::dim0_shards(reader.manifest(), 0, 2);
    let loaded = reader.load(&rows).await.expect("undamaged rows load");
    for t in &two {
        let got = loaded.tensors.iter().find(|l| l.name == t.name).unwrap();
        assert_eq!(common::to_f32(&got.data), t.shard(0, 2), "{}", t.name);
    }

    // The manifest itself is intact: `latest` still names step 2 ...
    assert_eq!(ckpt::latest(&store).await.unwrap().unwrap().step, 2);
    // ... and load_latest falls back to step 1 (its warning is checked in
    // tests/fallback_warnings.rs, a binary of its own so no other test's tracing
    // setup interferes).
    let (reader, loaded) = load_latest(&store, LoadRequest::everything)
        .await
        .expect("falls back");
    assert_eq!(reader.step(), 1);
    assert_same(&loaded.tensors, &one);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_bit_in_a_compressed_frame_names_the_frame_offset() {
    let (store, dir) = local_store("bitflip-zst");
    let codec = Codec::Zstd {
        level: 3,
        shuffle: 4,
    };
    let (one, _) = two_commits(&store, codec).await;
    let reader = CheckpointReader::open(&store, Some(2)).await.unwrap();
    let part = reader.part(0).await.unwrap();
    assert!(part.file.frame_bytes.len() > 3, "{:?}", part.file);
    let frame = 2;
    let start: u64 = part.file.frame_bytes[..frame].iter().sum();
    let path = file_of(dir.path(), 2, &part.file.name);
    flip_bit(&path, start + part.file.frame_bytes[frame] / 2, 0);

    let e = reader
        .load(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap_err();
    let f = format_error(&e);
    assert_eq!(f.object, format!("{}/{}", step_dir(2), part.file.name));
    assert_eq!(f.offset, Some(start), "{e}");
    assert!(f.message.contains("block 2"), "{e}");

    let (reader, loaded) = load_latest(&store, LoadRequest::everything).await.unwrap();
    assert_eq!(reader.step(), 1);
    assert_same(&loaded.tensors, &one);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_data_file_fails_naming_it_and_load_latest_falls_back() {
    let (store, dir) = local_store("truncated-data");
    let (one, _) = two_commits(&store, Codec::None).await;
    let name = rank_file_name_in(dir.path(), 2, 0);
    let path = file_of(dir.path(), 2, &name);
    let size = std::fs::metadata(&path).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(size - 1000).unwrap();
    drop(file);

    let reader = CheckpointReader::open(&store, Some(2)).await.unwrap();
    let e = reader
        .load(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap_err();
    let f = format_error(&e);
    assert_eq!(f.object, format!("{}/{name}", step_dir(2)), "{e}");
    let offset = f.offset.expect("an offset");
    assert!(offset < size, "{e}");
    assert!(f.message.contains("truncated"), "{e}");

    let (reader, loaded) = load_latest(&store, LoadRequest::everything).await.unwrap();
    assert_eq!(reader.step(), 1);
    assert_same(&loaded.tensors, &one);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_data_file_in_a_committed_checkpoint_is_corruption() {
    let (store, dir) = local_store("missing-data");
    let (one, _) = two_commits(&store, Codec::None).await;
    let key = format!("{}/{}", step_dir(2), rank_file_name_in(dir.path(), 2, 1));
    store.delete(&key).await.unwrap();
    let reader = CheckpointReader::open(&store, Some(2)).await.unwrap();
    let e = reader
        .load(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap_err();
    assert_eq!(format_error(&e).object, key);
    assert!(e.to_string().contains("missing"), "{e}");
    let (reader, loaded) = load_latest(&store, LoadRequest::everything).await.unwrap();
    assert_eq!(reader.step(), 1);
    assert_same(&loaded.tensors, &one);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_manifest_is_corrupt_and_latest_skips_it_with_a_warning() {
    let (store, _dir) = local_store("truncated-manifest");
    two_commits(&store, Codec::None).await;
    let key = format!("{}/{MANIFEST}", step_dir(2));
    let bytes = store.get(&key).await.unwrap();
    store
        .put(&key, bytes.slice(..bytes.len() / 2))
        .await
        .unwrap();

    let e = ckpt::read_manifest(&store, 2).await.unwrap_err();
    let f = format_error(&e);
    assert_eq!(f.object, key);
    assert!(f.message.contains("truncated"), "{e}");
    assert!(f.offset.is_some(), "{e}");

    let latest = ckpt::latest(&store).await.unwrap().expect("step 1");
    assert_eq!(latest.step, 1);
    assert_eq!(
        CheckpointReader::open(&store, None).await.unwrap().step(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_with_a_broken_crc_is_refused_at_the_body_offset() {
    let (store, _dir) = local_store("manifest-crc");
    two_commits(&store, Codec::None).await;
    let key = format!("{}/{MANIFEST}", step_dir(2));
    let mut bytes = store.get(&key).await.unwrap().to_vec();
    let body_at = find(&bytes, b"\"body\":") + 7;
    // Change a digit of the step inside the body: still valid JSON, wrong CRC.
    let step_at = find(&bytes, b"\"step\":2") + 7;
    bytes[step_at] = b'3';
    store.put(&key, bytes).await.unwrap();

    let e = ckpt::read_manifest(&store, 2).await.unwrap_err();
    let f = format_error(&e);
    assert_eq!(f.object, key);
    assert_eq!(f.offset, Some(body_at as u64), "{e}");
    assert!(f.message.contains("checksum mismatch"), "{e}");
    assert_eq!(ckpt::latest(&store).await.unwrap().unwrap().step, 1);
}

fn find(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{:?} not found", String::from_utf8_lossy(needle)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_json_under_a_valid_crc_names_the_object_and_offset() {
    let (store, _dir) = local_store("corrupt-json");
    two_commits(&store, Codec::None).await;
    let key = format!("{}/{MANIFEST}", step_dir(2));
    let manifest = ckpt::read_manifest(&store, 2).await.unwrap();
    let body = serde_json::to_vec(&manifest).unwrap();
    let sealed_header = seal(b"x").len() - 2; // everything before the body
    for cut in [body.len() / 3, body.len() - 1] {
        store.put(&key, seal(&body[..cut])).await.unwrap();
        let e = ckpt::read_manifest(&store, 2).await.unwrap_err();
        let f = format_error(&e);
        assert_eq!(f.object, key);
        assert!(f.message.contains("invalid JSON"), "{e}");
        let offset = f.offset.expect("offset") as usize;
        assert!(
            offset + 2 >= sealed_header + cut && offset <= sealed_header + cut,
            "offset {offset} for a body cut at {cut} (body starts at {sealed_header}): {e}"
        );
    }
    // A syntax error in the middle: a string where a number belongs.
    let text = String::from_utf8(body).unwrap();
    let at = text.find("\"world_size\":2").unwrap() + "\"world_size\":".len();
    let broken = format!("{}[}}{}", &text[..at], &text[at + 1..]);
    store.put(&key, seal(broken.as_bytes())).await.unwrap();
    let e = ckpt::read_manifest(&store, 2).await.unwrap_err();
    let offset = format_error(&e).offset.expect("offset") as usize;
    assert!(
        (sealed_header + at - 1..=sealed_header + at + 2).contains(&offset),
        "offset {offset}, error at body byte {at}: {e}"
    );
}

/// Writes `manifest` (sealed, so the CRC is valid) as step 2's manifest and returns
/// what reading it says.
async fn refuse(store: &Store, manifest: &Manifest) -> Error {
    let key = format!("{}/{MANIFEST}", step_dir(2));
    store.put(&key, manifest.to_bytes()).await.unwrap();
    let e = ckpt::read_manifest(store, 2)
        .await
        .expect_err("a hostile manifest must be refused");
    assert_eq!(format_error(&e).object, key, "{e}");
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_with_paths_leaving_the_checkpoint_is_refused() {
    let (store, _dir) = local_store("manifest-paths");
    two_commits(&store, Codec::None).await;
    let good = ckpt::read_manifest(&store, 2).await.unwrap();
    for bad in [
        "../step-00000001/rank-00000.safetensors",
        "..",
        "/etc/passwd",
        "sub/rank-00000.safetensors",
        "..\\x",
        "",
    ] {
        let mut m = good.clone();
        m.ranks[0].file = bad.to_string();
        let e = refuse(&store, &m).await;
        assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        let mut m = good.clone();
        m.ranks[1].part = bad.to_string();
        let e = refuse(&store, &m).await;
        assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
    }
    // The manifest's guard holds: `latest` skips the hostile step.
    assert_eq!(ckpt::latest(&store).await.unwrap().unwrap().step, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_part_naming_a_file_outside_the_checkpoint_is_refused() {
    let (store, _dir) = local_store("part-paths");
    let (one, _) = two_commits(&store, Codec::None).await;
    let mut manifest = ckpt::read_manifest(&store, 2).await.unwrap();
    let part_key = format!("{}/{}", step_dir(2), rank_part_name(1));
    let mut part = RankPart::parse(&store.get(&part_key).await.unwrap(), &part_key).unwrap();
    part.file.name = "../step-00000001/rank-00001.safetensors".into();
    let bytes = part.to_bytes();
    // The manifest vouches for the hostile part (size and CRC), so only the part's
    // own validation stands between it and the reader.
    manifest.ranks[1].part_bytes = bytes.len() as u64;
    manifest.ranks[1].part_crc32 = crc32fast::hash(&bytes);
    store.put(&part_key, bytes).await.unwrap();
    store
        .put(&format!("{}/{MANIFEST}", step_dir(2)), manifest.to_bytes())
        .await
        .unwrap();

    let reader = CheckpointReader::open(&store, Some(2)).await.unwrap();
    let e = reader
        .load(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap_err();
    let f = format_error(&e);
    assert_eq!(f.object, part_key);
    assert!(f.message.contains("'..'"), "{e}");
    let (reader, loaded) = load_latest(&store, LoadRequest::everything).await.unwrap();
    assert_eq!(reader.step(), 1);
    assert_same(&loaded.tensors, &one);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_part_swapped_for_another_steps_is_refused_by_its_checksum() {
    let (store, _dir) = local_store("part-swap");
    let (one, _) = two_commits(&store, Codec::None).await;
    let old = store
        .get(&format!("{}/{}", step_dir(1), rank_part_name(1)))
        .await
        .unwrap();
    let key = format!("{}/{}", step_dir(2), rank_part_name(1));
    store.put(&key, old).await.unwrap();
    let reader = CheckpointReader::open(&store, Some(2)).await.unwrap();
    let e = reader.rank_states().await.unwrap_err();
    let f = format_error(&e);
    assert_eq!(f.object, key);
    assert!(
        f.message.contains("the manifest says"),
        "size or crc32 against the manifest: {e}"
    );
    let (reader, loaded) = load_latest(&store, LoadRequest::everything).await.unwrap();
    assert_eq!(reader.step(), 1);
    assert_same(&loaded.tensors, &one);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_of_another_step_is_refused() {
    let (store, _dir) = local_store("manifest-step");
    two_commits(&store, Codec::None).await;
    let one = store
        .get(&format!("{}/{MANIFEST}", step_dir(1)))
        .await
        .unwrap();
    store
        .put(&format!("{}/{MANIFEST}", step_dir(2)), one)
        .await
        .unwrap();
    let e = ckpt::read_manifest(&store, 2).await.unwrap_err();
    assert!(e.to_string().contains("says step 1"), "{e}");
    assert_eq!(ckpt::latest(&store).await.unwrap().unwrap().step, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_with_absurd_sizes_is_refused_without_allocating() {
    let (store, _dir) = local_store("manifest-sizes");
    two_commits(&store, Codec::None).await;
    let good = ckpt::read_manifest(&store, 2).await.unwrap();
    let cases: Vec<Case<Manifest>> = vec![
        (
            "exceeds",
            Box::new(|m| m.tensors[0].shape = vec![u64::MAX, u64::MAX]),
        ),
        (
            "exceeds",
            Box::new(|m| m.tensors[0].shape = vec![1 << 40, 1 << 40, 8]),
        ),
        (
            "more than 32",
            Box::new(|m| m.tensors[0].shape = vec![1; 10_000]),
        ),
        ("limit", Box::new(|m| m.ranks[0].part_bytes = u64::MAX)),
        ("world_size", Box::new(|m| m.world_size = u32::MAX)),
        ("world_size", Box::new(|m| m.world_size = 0)),
        ("block_size", Box::new(|m| m.block_size = 0)),
        ("block_size", Box::new(|m| m.block_size = u64::MAX)),
        ("format_version", Box::new(|m| m.format_version = 99)),
        ("layout", Box::new(|m| m.tensors[0].layout = u32::MAX)),
        (
            "global_state_rank",
            Box::new(|m| m.global_state_rank = Some(7)),
        ),
        ("ranks", Box::new(|m| drop(m.ranks.pop()))),
        (
            "boundaries",
            Box::new(|m| m.layouts = vec![Layout::Dim0(vec![0; 1_000]); m.layouts.len()]),
        ),
        (
            "cover",
            Box::new(|m| {
                let shape = m.tensors[0].shape.clone();
                m.layouts[m.tensors[0].layout as usize] =
                    Layout::Boxes(vec![ckpt::format::LayoutBox {
                        rank: 0,
                        offsets: vec![0; shape.len()],
                        lengths: shape.iter().map(|&d| d / 2).collect(),
                    }]);
            }),
        ),
        (
            "overlap",
            Box::new(|m| {
                let shape = m.tensors[0].shape.clone();
                let half = Region::rows(&shape, 0, shape[0] / 2);
                let boxes = [0, 1, 1]
                    .iter()
                    .enumerate()
                    .map(|(i, &rank)| {
                        let region = if i == 0 {
                            half.clone()
                        } else {
                            Region::rows(&shape, shape[0] / 4, shape[0] / 4)
                        };
                        ckpt::format::LayoutBox {
                            rank,
                            offsets: region.offsets,
                            lengths: region.lengths,
                        }
                    })
                    .collect();
                m.layouts[m.tensors[0].layout as usize] = Layout::Boxes(boxes);
            }),
        ),
        (
            "offsets",
            Box::new(|m| {
                m.layouts[m.tensors[0].layout as usize] =
                    Layout::Boxes(vec![ckpt::format::LayoutBox {
                        rank: 0,
                        offsets: vec![0],
                        lengths: vec![1, 2, 3],
                    }]);
            }),
        ),
    ];
    for (expected, mutate) in cases {
        let mut m = good.clone();
        mutate(&mut m);
        let e = refuse(&store, &m).await;
        assert!(e.to_string().contains(expected), "{expected:?}: {e}");
    }
}

/// A rank part of step 2 of one rank, for hostile variations.
fn sample_part() -> RankPart {
    RankPart {
        format_version: 1,
        step: 2,
        attempt: None,
        rank: 0,
        world_size: 1,
        generation: 0,
        block_size: BLOCK,
        codec: Codec::None,
        file: FileEntry {
            name: ckpt::format::rank_file_name(0, false),
            raw_bytes: 2 * BLOCK,
            stored_bytes: 2 * BLOCK,
            block_crc32: vec![1, 2],
            frame_bytes: Vec::new(),
        },
        chunks: vec![Chunk {
            tensor: "w".into(),
            dtype: DType::F32,
            shape: vec![16, 16],
            offsets: vec![0, 0],
            lengths: vec![16, 16],
            bytes: [1024, 2048],
        }],
        global_state: None,
        rank_state: Default::default(),
        metadata: Default::default(),
        health: None,
    }
}

#[test]
fn rank_parts_with_absurd_sizes_or_frame_tables_are_refused() {
    let object = "step-00000002/rank-00000.json";
    RankPart::parse(&sample_part().to_bytes(), object).expect("the sample is valid");
    let zstd = Codec::Zstd {
        level: 3,
        shuffle: 0,
    };
    let cases: Vec<Case<RankPart>> = vec![
        (
            "block checksums",
            Box::new(|p| {
                p.file.raw_bytes = u64::MAX;
                p.file.stored_bytes = u64::MAX;
            }),
        ),
        (
            "frames",
            Box::new(move |p| {
                p.codec = zstd;
                p.file.frame_bytes = vec![100];
            }),
        ),
        (
            "frames add up",
            Box::new(move |p| {
                p.codec = zstd;
                p.file.stored_bytes = 300;
                p.file.frame_bytes = vec![100, 100];
            }),
        ),
        (
            "overflow",
            Box::new(move |p| {
                p.codec = zstd;
                p.file.frame_bytes = vec![u64::MAX, 2];
            }),
        ),
        (
            "stores",
            Box::new(|p| p.file.stored_bytes = p.file.raw_bytes + 1),
        ),
        (
            "claims bytes",
            Box::new(|p| p.chunks[0].bytes = [1024, 4096]),
        ),
        (
            "claims bytes",
            Box::new(|p| p.chunks[0].bytes = [u64::MAX - 10, u64::MAX]),
        ),
        (
            "claims bytes",
            Box::new(|p| p.chunks[0].bytes = [2048, 1024]),
        ),
        (
            "exceeds",
            Box::new(|p| p.chunks[0].shape = vec![u64::MAX, 16]),
        ),
        (
            "outside shape",
            Box::new(|p| p.chunks[0].offsets = vec![u64::MAX, 0]),
        ),
        ("outside shape", Box::new(|p| p.chunks[0].offsets = vec![0])),
        (
            "two chunks",
            Box::new(|p| p.chunks.push(p.chunks[0].clone())),
        ),
        ("rank 3", Box::new(|p| p.rank = 3)),
        ("'..'", Box::new(|p| p.file.name = "../../x".into())),
    ];
    for (expected, mutate) in cases {
        let mut part = sample_part();
        mutate(&mut part);
        let e =
            RankPart::parse(&part.to_bytes(), object).expect_err("a hostile part must be refused");
        assert_eq!(e.object, object);
        assert!(e.to_string().contains(expected), "{expected:?}: {e}");
    }
    // Not even JSON, or a CRC that does not match: refused at a byte offset.
    for garbage in [&b""[..], b"{", b"not json at all", &[0xff; 64]] {
        let e = RankPart::parse(garbage, object).unwrap_err();
        assert!(e.offset.is_some(), "{e}");
    }
    let mut sealed = sample_part().to_bytes();
    let last = sealed.len() - 2;
    sealed[last] ^= 0x20;
    let e = RankPart::parse(&sealed, object).unwrap_err();
    assert!(e.message.contains("checksum mismatch"), "{e}");
}

#[test]
fn safetensors_headers_with_absurd_lengths_are_refused_without_allocating() {
    let object = "step-00000002/rank-00000.safetensors";
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}      ");
    let e = parse_safetensors_header(&huge, u64::MAX, object).unwrap_err();
    assert_eq!((e.object.as_str(), e.offset), (object, Some(0)));
    assert!(e.message.contains("limit"), "{e}");

    let mut past = 64u64.to_le_bytes().to_vec();
    past.extend_from_slice(b"{}");
    let e = parse_safetensors_header(&past, 16, object).unwrap_err();
    assert!(e.message.contains("past the end"), "{e}");

    let e = parse_safetensors_header(&[8, 0, 0], 3, object).unwrap_err();
    assert!(e.message.contains("truncated"), "{e}");

    // Header says 64 bytes, only 10 of them are here.
    let e = parse_safetensors_header(&past, 1 << 20, object).unwrap_err();
    assert!(e.message.contains("truncated"), "{e}");

    let header = |json: &str| {
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(json.as_bytes());
        bytes
    };
    let cases = [
        (
            r#"{"w":{"dtype":"F32","shape":[18446744073709551615,4],"data_offsets":[0,16]}}"#,
            "absurd size",
        ),
        (
            r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}}"#,
            "do not hold",
        ),
        (
            r#"{"w":{"dtype":"F32","shape":[1024],"data_offsets":[0,4096]}}"#,
            "past the end",
        ),
        (
            r#"{"w":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}}"#,
            "F99",
        ),
        (
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
            "gap or overlap",
        ),
        (r#"{"w":{"dtype":"F32","shape":[1],"#, "invalid header JSON"),
        (r#"[1,2,3]"#, "not a JSON object"),
    ];
    for (json, expected) in cases {
        let bytes = header(json);
        let e = parse_safetensors_header(&bytes, bytes.len() as u64 + 64, object)
            .expect_err("hostile header");
        assert_eq!(e.object, object);
        assert!(e.offset.is_some(), "{e}");
        assert!(e.message.contains(expected), "{expected:?}: {e}");
    }
}

/// A manifest and a rank part that vouch for each other (valid checksums) claiming a
/// 1 TiB tensor: loading it must be an error naming the data file, never an attempt
/// to allocate 1 TiB (which aborts the process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documents_vouching_for_a_huge_tensor_cannot_make_a_load_allocate_it() {
    use ckpt::format::{Chunk, Layout, MANIFEST, RankPart, TensorEntry, rank_part_name};
    let (store, _dir) = local_store("huge-claim");
    save_world(&store, 1, 1, &model(1, 8), |c| c.block_size = 256 << 20).await;
    let mut manifest = ckpt::read_manifest(&store, 1).await.unwrap();
    let key = format!("{}/{}", step_dir(1), rank_part_name(0));
    let mut part = RankPart::parse(&store.get(&key).await.unwrap(), &key).unwrap();
    let huge: u64 = 1 << 40;
    let start = part.file.raw_bytes;
    part.file.raw_bytes = start + huge;
    part.file.stored_bytes = start + huge;
    part.file.block_crc32 = vec![0; (start + huge).div_ceil(256 << 20) as usize];
    part.chunks.push(Chunk {
        tensor: "a.huge".into(),
        dtype: DType::U8,
        shape: vec![huge],
        offsets: vec![0],
        lengths: vec![huge],
        bytes: [start, start + huge],
    });
    let bytes = part.to_bytes();
    manifest.ranks[0].part_bytes = bytes.len() as u64;
    manifest.ranks[0].part_crc32 = crc32fast::hash(&bytes);
    manifest.ranks[0].raw_bytes = start + huge;
    manifest.ranks[0].stored_bytes = start + huge;
    store.put(&key, bytes).await.unwrap();
    manifest.layouts.push(Layout::Dim0(vec![0, huge]));
    let layout = (manifest.layouts.len() - 1) as u32;
    manifest.tensors.insert(
        0,
        TensorEntry {
            name: "a.huge".into(),
            dtype: DType::U8,
            shape: vec![huge],
            layout,
        },
    );
    store
        .put(&format!("{}/{MANIFEST}", step_dir(1)), manifest.to_bytes())
        .await
        .unwrap();
    let err = load_latest(&store, LoadRequest::everything)
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(err.is_corruption(), "{message}");
    assert!(message.contains("/rank-00000-"), "{message}");
    assert!(message.contains("its part records"), "{message}");
}

/// The 2-D sharding the format is meant for: a 64x64 tensor as a 32x32 grid of 2x2
/// boxes over 1,024 ranks, each box on its own rank.
fn grid_manifest(good: &Manifest) -> Manifest {
    use ckpt::format::{LayoutBox, TensorEntry};
    let mut m = good.clone();
    m.world_size = 1024;
    m.ranks = (0..1024)
        .map(|rank| {
            let mut entry = good.ranks[0].clone();
            entry.rank = rank;
            entry.part = rank_part_name(rank);
            entry.file = ckpt::format::rank_file_name(rank, false);
            entry
        })
        .collect();
    m.global_state_rank = None;
    m.tensors = vec![TensorEntry {
        name: "w".into(),
        dtype: DType::F32,
        shape: vec![64, 64],
        layout: 0,
    }];
    let boxes = (0..1024u32)
        .map(|rank| LayoutBox {
            rank,
            offsets: vec![u64::from(rank / 32) * 2, u64::from(rank % 32) * 2],
            lengths: vec![2, 2],
        })
        .collect();
    m.layouts = vec![Layout::Boxes(boxes)];
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_balanced_by_a_hole_is_refused_at_1024_ranks() {
    let (store, _dir) = local_store("grid-overlap");
    two_commits(&store, Codec::None).await;
    let good = ckpt::read_manifest(&store, 2).await.unwrap();
    let grid = grid_manifest(&good);
    grid.validate("grid")
        .expect("the exact 32x32 grid is a valid layout");

    // Rank 5*32+7 holds rows 10..12, columns 14..16; shifted one column right it
    // overlaps rank 5*32+8's columns 16..18 by one column and leaves column 14 to
    // nobody, so the volumes still add up.
    let mut shifted = grid.clone();
    let Layout::Boxes(boxes) = &mut shifted.layouts[0] else {
        unreachable!("the grid is a box layout")
    };
    boxes[5 * 32 + 7].offsets[1] += 1;
    let e = refuse(&store, &shifted).await;
    let message = e.to_string();
    assert!(message.contains("\"w\""), "{message}");
    assert!(message.contains("[10..12, 15..17]"), "{message}");
    assert!(message.contains("[10..12, 16..18]"), "{message}");
    assert!(message.contains("overlap"), "{message}");
    assert_eq!(ckpt::latest(&store).await.unwrap().unwrap().step, 1);
}

/// Rewrites step 2's manifest through `mutate`, sealed again so its CRC passes,
/// and returns the error a load of `wanted` (tensor names) gives; the error must
/// name a rank part of step 2.
async fn load_against_hostile_manifest(
    store: &Store,
    wanted: &[&str],
    mutate: impl FnOnce(&mut Manifest),
) -> FormatError {
    let mut manifest = ckpt::read_manifest(store, 2).await.unwrap();
    mutate(&mut manifest);
    store
        .put(&format!("{}/{MANIFEST}", step_dir(2)), manifest.to_bytes())
        .await
        .unwrap();
    let reader = CheckpointReader::open(store, Some(2))
        .await
        .expect("the manifest alone is self-consistent");
    let mut request = LoadRequest::new();
    for name in wanted {
        let tensor = reader.manifest().tensor(name).unwrap();
        request = request.tensor(*name, Region::full(&tensor.shape));
    }
    let e = reader
        .load(&request)
        .await
        .expect_err("manifest and parts disagree");
    let f = format_error(&e).clone();
    assert!(
        f.object.starts_with(&format!("{}/rank-", step_dir(2))) && f.object.ends_with(".json"),
        "{e}"
    );
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_dtype_that_disagrees_with_the_parts_is_refused_without_a_panic() {
    let (store, _dir) = local_store("dtype-disagrees");
    let (one, _) = two_commits(&store, Codec::None).await;
    // The manifest sizes buffers at 2 bytes an element, the parts copy 4.
    let f = load_against_hostile_manifest(&store, &["layers.0.bias"], |m| {
        let i = m
            .tensors
            .iter()
            .position(|t| t.name == "layers.0.bias")
            .unwrap();
        m.tensors[i].dtype = DType::F16;
    })
    .await;
    assert!(f.message.contains("layers.0.bias"), "{f}");
    assert!(
        f.message.contains("F32") && f.message.contains("F16"),
        "{f}"
    );
    let (reader, loaded) = load_latest(&store, LoadRequest::everything).await.unwrap();
    assert_eq!(reader.step(), 1);
    assert_same(&loaded.tensors, &one);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_boxes_that_disagree_with_the_parts_are_refused() {
    let (store, _dir) = local_store("boxes-disagree");
    two_commits(&store, Codec::None).await;
    // "embed" moves one row from rank 0 to rank 1 in the manifest only; the load
    // asks for another tensor, so only the parts' agreement can catch it.
    let f = load_against_hostile_manifest(&store, &["layers.0.weight"], |m| {
        let embed = m.tensor("embed").unwrap().clone();
        let Layout::Dim0(bounds) = m.layouts[embed.layout as usize].clone() else {
            panic!("the model saves dim-0 layouts")
        };
        let mut moved = bounds.clone();
        moved[1] -= 1;
        m.layouts.push(Layout::Dim0(moved));
        let layout = (m.layouts.len() - 1) as u32;
        let i = m.tensors.iter().position(|t| t.name == "embed").unwrap();
        m.tensors[i].layout = layout;
    })
    .await;
    assert!(f.message.contains("embed"), "{f}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_raw_and_stored_sizes_must_match_the_parts() {
    let (store, _dir) = local_store("sizes-disagree");
    two_commits(&store, Codec::None).await;
    let f = load_against_hostile_manifest(&store, &["layers.0.weight"], |m| {
        m.ranks[0].raw_bytes = 1 << 63;
        m.ranks[0].stored_bytes = 1 << 63;
    })
    .await;
    assert!(f.message.contains(&(1u64 << 63).to_string()), "{f}");
    let f = load_against_hostile_manifest(&store, &["layers.0.weight"], |m| {
        m.block_size *= 2;
    })
    .await;
    assert!(f.message.contains("block_size"), "{f}");
}

/// Bytes this process has read through system calls, all threads together.
fn bytes_read_by_this_process() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io (Linux)");
    io.lines()
        .find_map(|line| line.strip_prefix("rchar: "))
        .and_then(|n| n.trim().parse().ok())
        .expect("rchar in /proc/self/io")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_part_swollen_to_2_gib_is_refused_before_it_is_read() {
    let (store, dir) = local_store("swollen-part");
    two_commits(&store, Codec::None).await;
    let path = file_of(dir.path(), 2, &rank_part_name(0));
    let swollen: u64 = 2 << 30;
    // Sparse: costs no disk, but reading it whole would read 2 GiB of zeros.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(swollen)
        .unwrap();
    let reader = CheckpointReader::open(&store, Some(2)).await.unwrap();
    let before = bytes_read_by_this_process();
    let e = reader.part(0).await.unwrap_err();
    let read = bytes_read_by_this_process() - before;
    let f = format_error(&e);
    assert_eq!(f.object, format!("{}/{}", step_dir(2), rank_part_name(0)));
    assert!(
        f.message
            .starts_with(&format!("{swollen} bytes, the manifest says")),
        "{e}"
    );
    // Other tests of this binary run at the same time and read small checkpoints:
    // far below the 2 GiB that reading the part whole costs.
    assert!(read < 256 << 20, "{read} bytes read to refuse the part");
}
