//! Golden bytes: the on-storage format, pinned.
//!
//! - **Version 1** (`tests/golden/*`): bytes written by the version-1 writer, kept
//!   as they are. This build must still read them: they are put at their version-1
//!   paths (`step-N/manifest.json`, `step-N/rank-RRRRR.json`,
//!   `step-N/rank-RRRRR.safetensors[.zst]`) and loaded, verified and ordered.
//! - **Version 2** (`tests/golden/v2/*`): the fixed checkpoint as the version-2
//!   writer saved it, normalized as below, kept as it is: this build reads it, with
//!   health unknown, and a resume that wants a healthy checkpoint takes it.
//! - **Version 4** (`tests/golden/v4/*`, the current version): a fixed checkpoint
//!   saved by this build must serialize to exactly these files. Two things in a version-2 save differ
//!   from run to run by design: the data file names carry a random nonce
//!   (`rank-00000-<16 hex>.safetensors`), which the part and the manifest name, and
//!   the manifest records its commit time. Before comparing, the test checks every
//!   relation those fields take part in against the objects actually stored (the
//!   nonce is 16 lowercase hex digits, occurs once in each part, the manifest's
//!   `part_bytes`/`part_crc32` are the stored part's length and CRC, the
//!   manifest re-serializes to its stored bytes), then replaces the nonce with a
//!   same-length placeholder, zeroes `created_unix_ms`, re-seals, and recomputes
//!   `part_crc32` for the normalized part. Every other byte (data files, commit
//!   log records, every other field of parts and manifests, the envelopes) is
//!   compared exactly. The normalized files are themselves a valid checkpoint, and
//!   the test loads them back, so a later format version can keep them as its
//!   "still readable" golden.
//!
//! Any change to these bytes must be deliberate: bump the format version, update
//! docs/FORMAT.md, then re-bless with `CKPT_BLESS=1 cargo test --test golden`
//! (blessing writes the current version's files only; older versions' files never
//! change).

use std::collections::BTreeMap;
use std::path::PathBuf;

use ckpt::format::{Manifest, seal, unseal};
use ckpt::storage::Store;
use ckpt::tools::verify::{VerifyOptions, verify};
use ckpt::{
    CheckpointConfig, CheckpointReader, Checkpointer, Codec, DType, LoadRequest, Region, State,
    StateValue, as_bytes,
};

/// Stands in for the per-save nonce of data file names (same length).
const NONCE_PLACEHOLDER: &str = "xxxxxxxxxxxxxxxx";
/// The folder of the current version's golden files.
const CURRENT: &str = "v4";
/// The run id of the golden saves.
const RUN: &str = "golden";

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn read_golden(name: &str) -> Vec<u8> {
    let path = golden(name);
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (bless with CKPT_BLESS=1)", path.display()))
}

/// Compares `actual` with golden file `name` (or writes it, when blessing).
fn check(name: &str, actual: &[u8]) {
    let path = golden(name);
    if std::env::var_os("CKPT_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = read_golden(name);
    if expected != actual {
        let at = expected
            .iter()
            .zip(actual)
            .position(|(a, b)| a != b)
            .unwrap_or(expected.len().min(actual.len()));
        panic!(
            "{name} differs from its golden copy at byte {at} ({} vs {} bytes): the format changed",
            actual.len(),
            expected.len()
        );
    }
}

/// The two encodings pinned, with the step each is saved at and its file prefix.
fn variants() -> [(Codec, u64, &'static str); 2] {
    [
        (Codec::None, 1, "plain"),
        (
            Codec::Zstd {
                level: 3,
                shuffle: 0,
            },
            2,
            "zstd",
        ),
    ]
}

fn weight() -> Vec<f32> {
    (0..12).map(|i| i as f32 * 0.5 - 1.0).collect()
}

const BIAS: [u16; 3] = [0x3F80, 0xBF80, 0x0000];
const STEP: [i64; 1] = [42];

/// Saves the fixed checkpoint (two ranks) at `step` with generation 0 and run
/// [`RUN`], and waits for the commit.
async fn save_fixed(store: &Store, step: u64, codec: Codec) {
    let weight = weight();
    let mut checkpointers = Vec::new();
    for rank in 0..2usize {
        let mut config = CheckpointConfig::new(rank, 2);
        config.block_size = 4096;
        config.codec = codec;
        config.generation = 0;
        config.run_id = RUN.to_string();
        checkpointers.push(Checkpointer::new(store.clone(), config).unwrap());
    }
    let mut handles = Vec::new();
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        let mut state = State::new();
        let rows = Region::dim0_shard(&[4, 3], rank, 2);
        let start = (rows.offsets[0] * 3) as usize;
        state
            .add_dim0_shard(
                "w",
                DType::F32,
                &[4, 3],
                rank,
                2,
                as_bytes(&weight[start..start + 6]),
            )
            .unwrap();
        // A replica written by rank 1 only.
        state
            .add_replica(
                "b",
                DType::BF16,
                &[3],
                Region::full(&[3]),
                as_bytes(&BIAS),
                rank == 1,
            )
            .unwrap();
        state
            .add_dim0_shard("step", DType::I64, &[], rank, 2, as_bytes(&STEP))
            .unwrap();
        state.set_global_json("lr", serde_json::json!(0.001));
        state.set_rank_bytes("rng", &[rank as u8; 4]);
        state.set_metadata("run", serde_json::json!("golden"));
        handles.push(checkpointer.save(step, &state).await.unwrap());
    }
    for handle in &handles {
        handle.committed().await.unwrap();
    }
}

/// Loads checkpoint `step` whole and checks every value, the non-tensor state, and
/// that `verify` finds no fault.
async fn assert_reads_fixed_checkpoint(store: &Store, step: u64) {
    let reader = CheckpointReader::open(store, Some(step)).await.unwrap();
    assert_eq!(reader.step(), step);
    let loaded = reader
        .load(&LoadRequest::everything(reader.manifest()))
        .await
        .unwrap();
    let by_name: BTreeMap<&str, &ckpt::LoadedTensor> = loaded
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    assert_eq!(by_name.len(), 3, "tensors: {:?}", by_name.keys());
    assert_eq!(by_name["w"].dtype, DType::F32);
    assert_eq!(by_name["w"].shape, vec![4, 3]);
    assert_eq!(by_name["w"].data, as_bytes(&weight()));
    assert_eq!(by_name["b"].dtype, DType::BF16);
    assert_eq!(by_name["b"].data, as_bytes(&BIAS));
    assert_eq!(by_name["step"].shape, Vec::<u64>::new());
    assert_eq!(by_name["step"].data, as_bytes(&STEP));

    let global = reader.global_state().await.unwrap();
    assert_eq!(
        global.get("lr"),
        Some(&StateValue::Json(serde_json::json!(0.001)))
    );
    assert_eq!(
        reader.manifest().metadata.get("run"),
        Some(&serde_json::json!("golden"))
    );
    let ranks = reader.rank_states().await.unwrap();
    assert_eq!(ranks.len(), 2);
    for (rank, state) in ranks {
        assert_eq!(
            state.get("rng").unwrap().to_bytes().unwrap(),
            vec![rank as u8; 4]
        );
    }

    let report = verify(store, step, &VerifyOptions::default(), &|_| {})
        .await
        .unwrap();
    assert!(report.ok, "verify of step {step}: {:?}", report.faults);
    assert_eq!(report.files, 2);
}

/// Puts the version-1 golden files at their version-1 paths. The golden manifests
/// were blessed with `step` zeroed (their only change from the stored bytes besides
/// the commit time): the step is put back in the body and the envelope re-sealed.
/// Everything the manifest vouches for (parts by CRC, data files by size and block
/// CRCs) is the original bytes.
async fn put_v1(store: &Store) {
    for (codec, step, prefix) in variants() {
        let dir = format!("step-{step:08}");
        for rank in 0..2 {
            let part = format!("rank-{rank:05}.json");
            store
                .put(
                    &format!("{dir}/{part}"),
                    read_golden(&format!("{prefix}-{part}")),
                )
                .await
                .unwrap();
            let file = if codec == Codec::None {
                format!("rank-{rank:05}.safetensors")
            } else {
                format!("rank-{rank:05}.safetensors.zst")
            };
            store
                .put(
                    &format!("{dir}/{file}"),
                    read_golden(&format!("{prefix}-{file}")),
                )
                .await
                .unwrap();
        }
        let sealed = read_golden(&format!("{prefix}-manifest.json"));
        let (body, _) = unseal(&sealed, "golden manifest", 1 << 20).unwrap();
        let body = String::from_utf8(body.to_vec()).unwrap();
        assert!(
            body.starts_with(r#"{"format_version":1,"step":0,"#),
            "{body}"
        );
        let body = body.replacen(r#""step":0,"#, &format!(r#""step":{step},"#), 1);
        store
            .put(&format!("{dir}/manifest.json"), seal(body.as_bytes()))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_1_checkpoints_stay_readable_and_come_before_every_logged_commit() {
    let store = Store::from_url("memory://golden-v1").unwrap();
    put_v1(&store).await;

    // Without a commit log, the newest version-1 step is the newest checkpoint.
    let latest = ckpt::latest(&store).await.unwrap().unwrap();
    assert_eq!((latest.format_version, latest.step), (1, 2));
    assert_eq!(latest.attempt, None);
    for (_, step, _) in variants() {
        assert_reads_fixed_checkpoint(&store, step).await;
    }

    // A version-2 commit of a lower step is newer than every version-1 checkpoint:
    // commit order puts version 1 first, by step, then the log.
    save_fixed(&store, 1, Codec::None).await;
    let order: Vec<(Option<u64>, u64, String)> = ckpt::catalog::commits(&store)
        .await
        .unwrap()
        .into_iter()
        .map(|c| (c.seq, c.step, c.dir))
        .collect();
    assert_eq!(
        order,
        vec![
            (None, 1, "step-00000001".to_string()),
            (None, 2, "step-00000002".to_string()),
            (Some(1), 1, "step-00000001/g00000000-golden".to_string()),
        ]
    );
    let latest = ckpt::latest(&store).await.unwrap().unwrap();
    assert_eq!(
        (latest.format_version, latest.step),
        (ckpt::format::FORMAT_VERSION, 1)
    );
    assert_eq!(latest.dir(), "step-00000001/g00000000-golden");

    // The version-1 checkpoints are abandoned (the newest commit went back to step
    // 1), not lost: step 2 still opens by step.
    let survey = ckpt::list_checkpoints(&store).await.unwrap();
    let status: Vec<(&str, &str, Option<u64>)> = survey
        .iter()
        .map(|c| (c.dir.as_str(), c.status.as_str(), c.abandoned_for))
        .collect();
    assert_eq!(
        status,
        vec![
            ("step-00000001", "abandoned", Some(1)),
            ("step-00000002", "abandoned", Some(1)),
            ("step-00000001/g00000000-golden", "committed", None),
        ]
    );
    assert_reads_fixed_checkpoint(&store, 2).await;
    assert_reads_fixed_checkpoint(&store, 1).await;
    let manifest = ckpt::read_manifest(&store, 1).await.unwrap();
    assert_eq!(
        manifest.format_version,
        ckpt::format::FORMAT_VERSION,
        "step 1's newest commit is of the current version"
    );
}

/// The nonce in data file name `name` of `rank`, checked to be 16 lowercase hex
/// digits.
fn nonce_of(name: &str, rank: u32, codec: Codec) -> String {
    let ext = if codec == Codec::None {
        ".safetensors"
    } else {
        ".safetensors.zst"
    };
    let nonce = name
        .strip_prefix(&format!("rank-{rank:05}-"))
        .and_then(|rest| rest.strip_suffix(ext))
        .unwrap_or_else(|| panic!("data file name {name:?}"));
    assert!(
        nonce.len() == 16
            && nonce
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "nonce {nonce:?}"
    );
    nonce.to_string()
}

/// Puts the normalized golden files of `version` (`v2`, `v4`) back as the
/// checkpoint they describe: both steps' attempts and the commit log.
async fn put_normalized(store: &Store, version: &str) {
    for (seq, (codec, step, prefix)) in (1u64..).zip(variants()) {
        let dir = format!("step-{step:08}/g00000000-{RUN}");
        for rank in 0..2u32 {
            let part = format!("rank-{rank:05}.json");
            store
                .put(
                    &format!("{dir}/{part}"),
                    read_golden(&format!("{version}/{prefix}-{part}")),
                )
                .await
                .unwrap();
            let ext = if codec == Codec::None {
                "safetensors"
            } else {
                "safetensors.zst"
            };
            store
                .put(
                    &format!("{dir}/rank-{rank:05}-{NONCE_PLACEHOLDER}.{ext}"),
                    read_golden(&format!("{version}/{prefix}-rank-{rank:05}.{ext}")),
                )
                .await
                .unwrap();
        }
        store
            .put(
                &format!("{dir}/manifest.json"),
                read_golden(&format!("{version}/{prefix}-manifest.json")),
            )
            .await
            .unwrap();
        store
            .put(
                &ckpt::commits::record_key(seq),
                read_golden(&format!("{version}/{prefix}-commit.json")),
            )
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_2_checkpoints_stay_readable_with_health_unknown() {
    let store = Store::from_url("memory://golden-v2-read").unwrap();
    put_normalized(&store, "v2").await;
    for (_, step, _) in variants() {
        assert_reads_fixed_checkpoint(&store, step).await;
        let manifest = ckpt::read_manifest(&store, step).await.unwrap();
        assert_eq!(manifest.format_version, 2);
        assert_eq!(manifest.health_status(), ckpt::HealthStatus::Unknown);
    }
    // Nothing is known against it: the newest healthy checkpoint is the newest.
    let (newest, skipped) = ckpt::latest_selecting(&store, ckpt::Select::Healthy)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((newest.step, skipped.len()), (2, 0));
    let (reader, _) = ckpt::load_latest(&store, LoadRequest::everything)
        .await
        .unwrap();
    assert_eq!(reader.step(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_checkpoint_serializes_to_the_golden_bytes_of_the_current_version() {
    let store = Store::from_url("memory://golden-current").unwrap();
    // The normalized files, put back as a checkpoint of their own and read.
    let replay = Store::from_url("memory://golden-current-replay").unwrap();
    for (seq, (codec, step, prefix)) in (1u64..).zip(variants()) {
        save_fixed(&store, step, codec).await;
        let dir = format!("step-{step:08}/g00000000-{RUN}");
        let key = format!("{dir}/manifest.json");
        let stored_manifest = store.get(&key).await.unwrap();
        let mut manifest = Manifest::parse(&stored_manifest, &key).unwrap();
        assert_eq!(
            manifest.to_bytes(),
            stored_manifest.to_vec(),
            "the manifest re-serializes to its stored bytes"
        );
        assert_eq!(manifest.format_version, ckpt::format::FORMAT_VERSION);
        assert_eq!(manifest.attempt.as_deref(), Some("g00000000-golden"));
        // Two replicated boxes (the bias, the step scalar), each held by both ranks
        // and compared; the values are finite.
        let health = manifest.health.as_ref().expect("health recorded");
        assert!(health.healthy, "{:?}", health.reasons);
        assert_eq!(health.replicas_compared, 2);

        let mut expected_objects = vec![key.clone()];
        for rank in 0..2u32 {
            let entry = &mut manifest.ranks[rank as usize];
            let nonce = nonce_of(&entry.file, rank, codec);
            let file_key = format!("{dir}/{}", entry.file);
            let part_key = format!("{dir}/{}", entry.part);
            expected_objects.extend([file_key.clone(), part_key.clone()]);

            // The data file holds no name: its bytes are compared exactly.
            let data = store.get(&file_key).await.unwrap();
            let file = if codec == Codec::None {
                format!("rank-{rank:05}.safetensors")
            } else {
                format!("rank-{rank:05}.safetensors.zst")
            };
            check(&format!("{CURRENT}/{prefix}-{file}"), &data);

            // The part names its data file: that name is normalized, nothing else.
            let part = store.get(&part_key).await.unwrap();
            assert_eq!(entry.part_bytes, part.len() as u64);
            assert_eq!(entry.part_crc32, crc32fast::hash(&part));
            let (body, _) = unseal(&part, &part_key, 1 << 20).unwrap();
            let body = String::from_utf8(body.to_vec()).unwrap();
            assert_eq!(body.matches(&nonce).count(), 1, "{body}");
            let normalized = seal(body.replace(&nonce, NONCE_PLACEHOLDER).as_bytes());
            let part_name = format!("rank-{rank:05}.json");
            check(&format!("{CURRENT}/{prefix}-{part_name}"), &normalized);

            entry.file = entry.file.replace(&nonce, NONCE_PLACEHOLDER);
            entry.part_crc32 = crc32fast::hash(&normalized);
            replay
                .put(&format!("{dir}/{part_name}"), normalized)
                .await
                .unwrap();
            replay
                .put(&format!("{dir}/{}", entry.file), data)
                .await
                .unwrap();
        }
        // Nothing else is written into the attempt's directory.
        let mut listed: Vec<String> = store
            .list(&dir)
            .await
            .unwrap()
            .into_iter()
            .map(|o| o.key)
            .collect();
        listed.sort();
        expected_objects.sort();
        assert_eq!(listed, expected_objects);

        manifest.created_unix_ms = 0;
        let normalized = manifest.to_bytes();
        check(&format!("{CURRENT}/{prefix}-manifest.json"), &normalized);
        replay.put(&key, normalized).await.unwrap();

        // The commit log record holds no nonce and no time: compared exactly.
        let record_key = ckpt::commits::record_key(seq);
        let record = store.get(&record_key).await.unwrap();
        check(&format!("{CURRENT}/{prefix}-commit.json"), &record);
        replay.put(&record_key, record).await.unwrap();
    }
    for (_, step, _) in variants() {
        assert_reads_fixed_checkpoint(&store, step).await;
        assert_reads_fixed_checkpoint(&replay, step).await;
    }
    let latest = ckpt::latest(&replay).await.unwrap().unwrap();
    assert_eq!(latest.step, 2);
}
