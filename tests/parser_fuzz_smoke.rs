//! The fuzz targets' properties on the stable toolchain: the parsers of untrusted
//! bytes (`Manifest::parse`, `RankPart::parse`, `parse_safetensors_header`,
//! `decompress_block`) and the check that a part agrees with its manifest never
//! panic on random bytes or on mutations of valid objects taken from a real save,
//! and every refusal names the object (and, where it gives one, an offset inside
//! the input). Box layouts of random boxes are accepted exactly when the boxes
//! tile the tensor (and, before format version 3, give no rank two boxes). The
//! save behind the fixtures gives rank 1 two pieces of one tensor, so that the
//! objects mutated are of the newest shape.

use std::sync::OnceLock;

use ckpt::codec::decompress_block;
use ckpt::format::{
    Assignments, Layout, LayoutBox, RankPart, TensorEntry, parse_safetensors_header, seal,
};
use ckpt::storage::Store;
use ckpt::{CheckpointConfig, Checkpointer, Codec, DType, Manifest, Region, State, as_bytes};
use proptest::prelude::*;

/// The save attempt's directory (generation 0, run id "0").
const DIR: &str = "step-00000007/g00000000-0";
const MANIFEST: &str = "step-00000007/g00000000-0/manifest.json";
const PART: &str = "step-00000007/g00000000-0/rank-00001.json";
/// Data file names carry a nonce; this is the name used in error messages.
const DATA: &str = "step-00000007/g00000000-0/rank-00001.safetensors";

/// Valid objects of a real two-rank save.
struct Fixtures {
    manifest: Vec<u8>,
    part: Vec<u8>,
    /// The data file's first bytes: length prefix and header JSON.
    header: Vec<u8>,
    /// Size of the whole data file.
    file_size: u64,
    /// The first zstd frame of a compressed rank file, and its raw size.
    frame: Vec<u8>,
    frame_raw_len: usize,
    frame_codec: Codec,
}

async fn save_two_ranks(url: &str, codec: Codec) -> Store {
    let store = Store::from_url(url).unwrap();
    let weights: Vec<f32> = (0..64 * 33).map(|i| i as f32 * 0.5).collect();
    let bias: Vec<u16> = (0..33).collect();
    let step: Vec<i64> = vec![7];
    let mut handles = Vec::new();
    for rank in 0..2 {
        let mut config = CheckpointConfig::new(rank, 2);
        config.block_size = 4096;
        config.codec = codec;
        config.run_id = "0".into();
        let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
        let mut state = State::new();
        // Rank 1 holds two pieces of `w` (format version 3), rank 0 the rows between.
        let pieces: &[(u64, u64)] = if rank == 0 {
            &[(16, 32)]
        } else {
            &[(0, 16), (48, 16)]
        };
        for &(start, rows) in pieces {
            let (begin, end) = ((start * 33) as usize, ((start + rows) * 33) as usize);
            state
                .add(
                    "w",
                    DType::F32,
                    &[64, 33],
                    Region::rows(&[64, 33], start, rows),
                    as_bytes(&weights[begin..end]),
                )
                .unwrap();
        }
        state
            .add_replica(
                "b",
                DType::U16,
                &[33],
                Region::full(&[33]),
                as_bytes(&bias),
                rank == 1,
            )
            .unwrap()
            .add_replica(
                "n",
                DType::I64,
                &[],
                Region::full(&[]),
                as_bytes(&step),
                rank == 0,
            )
            .unwrap();
        state.set_rank_json("cursor", serde_json::json!({ "sample": rank * 10 }));
        state.set_global_bytes("rng", &[1, 2, 3, 4]);
        state.set_metadata("run", serde_json::json!("smoke"));
        handles.push(checkpointer.save(7, &state).await.unwrap());
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
    store
}

fn fixtures() -> &'static Fixtures {
    static FIXTURES: OnceLock<Fixtures> = OnceLock::new();
    FIXTURES.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = save_two_ranks("memory://parser-fuzz-smoke-plain", Codec::None).await;
            let manifest = store.get(MANIFEST).await.unwrap().to_vec();
            let part = store.get(PART).await.unwrap().to_vec();
            let data_name = RankPart::parse(&part, PART).unwrap().file.name;
            let file = store
                .get(&format!("{DIR}/{data_name}"))
                .await
                .unwrap()
                .to_vec();
            let header_len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
            let header = file[..8 + header_len].to_vec();

            let frame_codec = Codec::Zstd {
                level: 1,
                shuffle: 4,
            };
            let store = save_two_ranks("memory://parser-fuzz-smoke-zstd", frame_codec).await;
            let zpart = RankPart::parse(&store.get(PART).await.unwrap(), PART).unwrap();
            let zfile = store
                .get(&format!("{DIR}/{}", zpart.file.name))
                .await
                .unwrap();
            let frame = zfile[..zpart.file.frame_bytes[0] as usize].to_vec();
            let frame_raw_len = zpart.block_size.min(zpart.file.raw_bytes) as usize;
            Fixtures {
                manifest,
                part,
                header,
                file_size: file.len() as u64,
                frame,
                frame_raw_len,
                frame_codec,
            }
        })
    })
}

// ------------------------------------------------------------------ oracles

fn check_manifest(bytes: &[u8]) {
    if let Err(e) = Manifest::parse(bytes, MANIFEST) {
        assert_eq!(e.object, MANIFEST, "{e}");
        assert!(e.to_string().starts_with(MANIFEST), "{e}");
        assert!(e.offset.is_none_or(|o| o <= bytes.len() as u64), "{e}");
    }
}

fn check_part(bytes: &[u8]) {
    match RankPart::parse(bytes, PART) {
        Err(e) => {
            assert_eq!(e.object, PART, "{e}");
            assert!(e.to_string().starts_with(PART), "{e}");
            assert!(e.offset.is_none_or(|o| o <= bytes.len() as u64), "{e}");
        }
        // A well-formed part is then held against the manifest it claims to
        // belong to, as the loader does before sizing any buffer.
        Ok(part) => {
            let manifest = Manifest::parse(&fixtures().manifest, MANIFEST).unwrap();
            let agreement = Assignments::new(&manifest).check_part(&manifest, 1, &part, PART);
            if let Err(e) = agreement {
                assert_eq!(e.object, PART, "{e}");
            }
        }
    }
}

fn check_header(prefix: &[u8], file_size: u64) {
    match parse_safetensors_header(prefix, file_size, DATA) {
        Ok(header) => {
            assert!(header.data_start <= file_size);
            assert!(header.data_start <= prefix.len() as u64);
        }
        Err(e) => {
            assert_eq!(e.object, DATA, "{e}");
            assert!(e.to_string().starts_with(DATA), "{e}");
            let end = file_size.max(prefix.len() as u64);
            assert!(e.offset.is_none_or(|o| o <= end), "{e}");
        }
    }
}

fn check_frame(frame: &[u8], raw_len: usize, codec: Codec) {
    if let Ok(raw) = decompress_block(frame, raw_len, codec) {
        assert_eq!(raw.len(), raw_len);
    }
}

/// Replaces the header JSON of a safetensors prefix and fixes its length prefix.
/// A committed snapshot's record as the control plane holds it.
const SNAPSHOT_RECORD: &[u8] = br#"{"step":40,"generation":3,"world":4,"dir":"step-00000040/g00000003-snap-run","table_crc32":305419896}"#;

/// The `snapshot_record` fuzz target's property: a record accepted names a snapshot
/// directory of its own step and generation and round-trips; a vote decodes or
/// votes against.
fn check_snapshot_record(bytes: &[u8]) {
    use ckpt::snapshot::{SnapshotRecord, Vote};
    if let Ok(text) = std::str::from_utf8(bytes)
        && let Ok(record) = SnapshotRecord::parse(text)
    {
        let attempt = record.attempt().expect("an accepted record has an attempt");
        assert_eq!(
            (attempt.step, attempt.generation),
            (record.step, record.generation)
        );
        assert!(record.world > 0);
        assert_eq!(SnapshotRecord::parse(&record.to_json()).ok(), Some(record));
    }
    let vote = Vote::decode(bytes);
    if vote.ready {
        assert_eq!(Vote::decode(&vote.encode()), vote);
    }
}

fn with_header_json(json: &[u8]) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json);
    out
}

/// The body of a sealed object (`{"crc32":"........","body":BODY}`).
fn body(sealed: &[u8]) -> &[u8] {
    let start = br#"{"crc32":"00000000","body":"#.len();
    &sealed[start..sealed.len() - 1]
}

// ------------------------------------------------------------------ mutations

#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Truncate { len: usize },
    Insert { at: usize, byte: u8 },
    Set { at: usize, byte: u8 },
    Remove { at: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        1 => any::<usize>().prop_map(|len| Mutation::Truncate { len }),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert { at, byte }),
        3 => (any::<usize>(), prop::sample::select(&b"0123456789-+.eE\"{}[],:ntfu \\"[..]))
            .prop_map(|(at, byte)| Mutation::Set { at, byte }),
        1 => any::<usize>().prop_map(|at| Mutation::Remove { at }),
    ]
}

fn mutate(bytes: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for m in mutations {
        let n = out.len();
        match *m {
            Mutation::Flip { at, bit } if n > 0 => out[at % n] ^= 1 << bit,
            Mutation::Truncate { len } => out.truncate(len % (n + 1)),
            Mutation::Insert { at, byte } => out.insert(at % (n + 1), byte),
            Mutation::Set { at, byte } if n > 0 => out[at % n] = byte,
            Mutation::Remove { at } if n > 0 => {
                out.remove(at % n);
            }
            _ => {}
        }
    }
    out
}

// ------------------------------------------------------------------ tests

#[test]
fn fixtures_are_valid_to_begin_with() {
    let record = std::str::from_utf8(SNAPSHOT_RECORD).unwrap();
    assert_eq!(
        ckpt::snapshot::SnapshotRecord::parse(record).unwrap().step,
        40
    );
    let f = fixtures();
    let manifest = Manifest::parse(&f.manifest, MANIFEST).unwrap();
    assert_eq!((manifest.world_size, manifest.tensors.len()), (2, 3));
    assert_eq!(manifest.format_version, ckpt::format::FORMAT_VERSION);
    let part = RankPart::parse(&f.part, PART).unwrap();
    assert_eq!(part.chunks.iter().filter(|c| c.tensor == "w").count(), 2);
    assert!(part.file.raw_bytes > 4096, "the part spans several blocks");
    let header = parse_safetensors_header(&f.header, f.file_size, DATA).unwrap();
    assert_eq!(header.data_start, f.header.len() as u64);
    let raw = decompress_block(&f.frame, f.frame_raw_len, f.frame_codec).unwrap();
    assert_eq!(raw.len(), f.frame_raw_len);
    assert_eq!(
        &raw[..8],
        &f.header[..8],
        "block 0 starts with the header length"
    );

    // `CKPT_FUZZ_SEEDS=fuzz/corpus` refreshes the fuzz targets' seed corpora.
    if let Some(dir) = std::env::var_os("CKPT_FUZZ_SEEDS") {
        let dir = std::path::PathBuf::from(dir);
        let mut frame_input = (f.frame_raw_len as u32).to_le_bytes();
        frame_input[3] = 4; // shuffle width, as the zstd_frame target decodes it
        let mut frame_seed = frame_input.to_vec();
        frame_seed.extend_from_slice(&f.frame);
        for (target, seed, file) in [
            ("manifest", f.manifest.clone(), "seed-save"),
            ("manifest", body(&f.manifest).to_vec(), "seed-body"),
            ("rank_part", f.part.clone(), "seed-save"),
            ("rank_part", body(&f.part).to_vec(), "seed-body"),
            ("safetensors_header", f.header.clone(), "seed-save"),
            ("zstd_frame", frame_seed, "seed-save"),
        ] {
            std::fs::create_dir_all(dir.join(target)).unwrap();
            std::fs::write(dir.join(target).join(file), seed).unwrap();
        }
    }
}

#[test]
fn every_truncation_is_refused_by_name() {
    let f = fixtures();
    for len in 0..f.manifest.len() {
        assert!(Manifest::parse(&f.manifest[..len], MANIFEST).is_err());
        check_manifest(&f.manifest[..len]);
    }
    for len in 0..f.part.len() {
        assert!(RankPart::parse(&f.part[..len], PART).is_err());
        check_part(&f.part[..len]);
    }
    for len in 0..f.header.len() {
        assert!(parse_safetensors_header(&f.header[..len], f.file_size, DATA).is_err());
    }
    for len in 0..f.frame.len() {
        check_frame(&f.frame[..len], f.frame_raw_len, f.frame_codec);
    }
}

/// Flips every bit of `sealed` in turn: the envelope's CRC32 catches any single flip
/// of the body; a flip in the envelope breaks its syntax or the recorded checksum,
/// except a hex digit of the checksum changing case.
fn assert_flips_caught(
    sealed: &[u8],
    object: &str,
    parse: impl Fn(&[u8]) -> Result<(), ckpt::format::FormatError>,
) {
    let crc_digits = 10..18;
    let mut flipped = sealed.to_vec();
    for at in 0..flipped.len() {
        for bit in 0..8 {
            flipped[at] ^= 1 << bit;
            match parse(&flipped) {
                Err(e) => assert_eq!(e.object, object, "{e}"),
                Ok(()) => assert!(
                    crc_digits.contains(&at) && flipped[at].eq_ignore_ascii_case(&sealed[at]),
                    "{object} with bit {bit} of byte {at} flipped parsed"
                ),
            }
            flipped[at] ^= 1 << bit;
        }
    }
}

#[test]
fn every_bit_flip_of_a_sealed_object_is_caught() {
    let f = fixtures();
    assert_flips_caught(&f.manifest, MANIFEST, |b| {
        Manifest::parse(b, MANIFEST).map(drop)
    });
    assert_flips_caught(&f.part, PART, |b| RankPart::parse(b, PART).map(drop));
}

#[test]
fn every_byte_of_a_resealed_body_can_be_anything() {
    // With the checksum recomputed, mutations reach the JSON parser and the validator.
    let f = fixtures();
    for (sealed, check) in [
        (&f.manifest, check_manifest as fn(&[u8])),
        (&f.part, check_part),
    ] {
        let mut body = body(sealed).to_vec();
        for at in 0..body.len() {
            let original = body[at];
            for byte in [b'0', b'9', b'-', b'"', b'}', b']', b' ', b'1', 0xff] {
                body[at] = byte;
                check(&seal(&body));
            }
            body[at] = original;
        }
    }
    let json = f.header[8..].to_vec();
    let mut mutated = json.clone();
    for at in 0..json.len() {
        for byte in [b'0', b'9', b'-', b'"', b'}', b']', b'x'] {
            mutated[at] = byte;
            check_header(&with_header_json(&mutated), f.file_size);
        }
        mutated[at] = json[at];
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600), raw_len in 0usize..70_000, width in 0u32..=16) {
        check_manifest(&bytes);
        check_part(&bytes);
        check_manifest(&seal(&bytes));
        check_part(&seal(&bytes));
        check_header(&bytes, bytes.len() as u64);
        check_header(&with_header_json(&bytes), u64::MAX);
        check_frame(&bytes, raw_len, Codec::Zstd { level: 1, shuffle: width });
        check_snapshot_record(&bytes);
        prop_assert!(Manifest::parse(&bytes, MANIFEST).is_err());
    }

    #[test]
    fn mutated_valid_objects_never_panic(mutations in prop::collection::vec(mutation(), 1..6), extra in 0u64..10_000) {
        let f = fixtures();
        // Mutations of the sealed bytes (the CRC32 refuses nearly all of them) ...
        check_manifest(&mutate(&f.manifest, &mutations));
        check_part(&mutate(&f.part, &mutations));
        // ... and of the body, resealed, so that the parser and validator see them.
        check_manifest(&seal(&mutate(body(&f.manifest), &mutations)));
        check_part(&seal(&mutate(body(&f.part), &mutations)));
        check_header(&mutate(&f.header, &mutations), f.file_size);
        check_header(&with_header_json(&mutate(&f.header[8..], &mutations)), f.file_size + extra);
        check_frame(&mutate(&f.frame, &mutations), f.frame_raw_len, f.frame_codec);
        check_frame(&mutate(&f.frame, &mutations), extra as usize, f.frame_codec);
        check_snapshot_record(&mutate(SNAPSHOT_RECORD, &mutations));
    }
}

// ------------------------------------------------------------------ layouts

/// The quadratic definition of a valid box layout for a tensor of `shape` in a
/// world of `world` ranks: every box well formed and inside, volumes adding up,
/// no two non-empty boxes meeting.
fn tiles_pairwise(boxes: &[LayoutBox], shape: &[u64], world: u32) -> bool {
    let regions: Option<Vec<Region>> = boxes
        .iter()
        .map(|b| {
            let region = Region {
                offsets: b.offsets.clone(),
                lengths: b.lengths.clone(),
            };
            (b.rank < world && b.offsets.len() == b.lengths.len() && region.within(shape))
                .then_some(region)
        })
        .collect();
    let Some(regions) = regions else {
        return false;
    };
    let covered: u64 = regions.iter().map(|r| r.volume().unwrap()).sum();
    covered == shape.iter().product::<u64>()
        && regions
            .iter()
            .enumerate()
            .all(|(i, a)| regions[i + 1..].iter().all(|b| a.intersect(b).is_none()))
}

/// A product grid over `shape` (cuts per dimension from `cuts`), then `moves`
/// applied: (box, dimension, step) shifts of box offsets, possibly outside.
fn grid_layout(shape: &[u64], cuts: &[u64], moves: &[(usize, usize, i8)]) -> Vec<LayoutBox> {
    let mut bounds: Vec<Vec<u64>> = Vec::new();
    for (k, &extent) in shape.iter().enumerate() {
        let mut b: Vec<u64> = vec![0, extent];
        if let Some(&cut) = cuts.get(k)
            && extent > 1
        {
            b.insert(1, 1 + cut % (extent - 1));
        }
        bounds.push(b);
    }
    let mut boxes = vec![LayoutBox {
        rank: 0,
        offsets: vec![],
        lengths: vec![],
    }];
    for b in &bounds {
        boxes = boxes
            .into_iter()
            .flat_map(|prefix| {
                b.windows(2).map(move |w| {
                    let mut next = prefix.clone();
                    next.offsets.push(w[0]);
                    next.lengths.push(w[1] - w[0]);
                    next
                })
            })
            .collect();
    }
    for (i, b) in boxes.iter_mut().enumerate() {
        b.rank = i as u32 % 2;
    }
    for &(which, k, step) in moves {
        let n = boxes.len();
        let b = &mut boxes[which % n];
        if let Some(offset) = b.offsets.get_mut(k % shape.len().max(1)) {
            *offset = offset.saturating_add_signed(i64::from(step));
        }
    }
    boxes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn box_layouts_are_accepted_exactly_when_they_tile(
        shape in prop::collection::vec(0u64..5, 0..4),
        cuts in prop::collection::vec(0u64..8, 0..4),
        moves in prop::collection::vec((0usize..16, 0usize..4, -2i8..=2), 0..3),
        stray in prop::option::of((0u32..4, prop::collection::vec(0u64..6, 0..4), prop::collection::vec(0u64..6, 0..4))),
    ) {
        let mut manifest = Manifest::parse(&fixtures().manifest, MANIFEST).unwrap();
        let mut boxes = grid_layout(&shape, &cuts, &moves);
        if let Some((rank, offsets, lengths)) = stray {
            boxes.push(LayoutBox { rank, offsets, lengths });
        }
        manifest.tensors = vec![TensorEntry {
            name: "t".into(),
            dtype: DType::F32,
            shape: shape.clone(),
            layout: 0,
        }];
        manifest.layouts = vec![Layout::Boxes(boxes.clone())];
        let mut ranks: Vec<u32> = boxes.iter().map(|b| b.rank).collect();
        ranks.sort_unstable();
        let one_box_per_rank = ranks.windows(2).all(|w| w[0] != w[1]);
        // The versions before health, whose layout rules differ.
        manifest.health = None;
        for version in [2, 3] {
            manifest.format_version = version;
            let verdict = manifest.validate(MANIFEST);
            if let Err(e) = &verdict {
                prop_assert_eq!(&e.object, MANIFEST);
            }
            prop_assert_eq!(
                verdict.is_ok(),
                tiles_pairwise(&boxes, &shape, manifest.world_size)
                    && (version >= 3 || one_box_per_rank),
                "version {}: {:?} over {:?}: {:?}", version, boxes, shape, verdict
            );
        }
    }
}
