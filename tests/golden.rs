//! Golden bytes: a fixed small checkpoint must serialize to exactly the committed
//! files in tests/golden/, so any change to the on-storage format is deliberate
//! (bump the format version, update docs/FORMAT.md, then re-bless with
//! `CKPT_BLESS=1 cargo test --test golden`).

use std::path::PathBuf;

use ckpt::format::Manifest;
use ckpt::storage::Store;
use ckpt::{CheckpointConfig, Checkpointer, Codec, DType, Region, State, as_bytes};

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn check(name: &str, actual: &[u8]) {
    let path = golden(name);
    if std::env::var_os("CKPT_BLESS").is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (bless with CKPT_BLESS=1)", path.display()));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_checkpoint_serializes_to_the_golden_bytes() {
    let store = Store::from_url("memory://golden").unwrap();
    let weight: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
    let bias: Vec<u16> = vec![0x3F80, 0xBF80, 0x0000];
    let step: Vec<i64> = vec![42];
    for codec in [
        Codec::None,
        Codec::Zstd {
            level: 3,
            shuffle: 0,
        },
    ] {
        let mut handles = Vec::new();
        let mut checkpointers = Vec::new();
        for rank in 0..2usize {
            let mut config = CheckpointConfig::new(rank, 2);
            config.block_size = 4096;
            config.codec = codec;
            checkpointers.push(Checkpointer::new(store.clone(), config).unwrap());
        }
        let dir_step = if codec == Codec::None { 1 } else { 2 };
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
            // Column split of a bf16 vector is impossible; a replica written by rank 1.
            state
                .add_replica(
                    "b",
                    DType::BF16,
                    &[3],
                    Region::full(&[3]),
                    as_bytes(&bias),
                    rank == 1,
                )
                .unwrap();
            state
                .add_dim0_shard("step", DType::I64, &[], rank, 2, as_bytes(&step))
                .unwrap();
            state.set_global_json("lr", serde_json::json!(0.001));
            state.set_rank_bytes("rng", &[rank as u8; 4]);
            state.set_metadata("run", serde_json::json!("golden"));
            handles.push(
                checkpointer
                    .save(dir_step, &state)
                    .await
                    .unwrap()
                    .handle()
                    .unwrap(),
            );
        }
        for handle in &handles {
            handle.committed().await.unwrap();
        }
        let dir = format!("step-{dir_step:08}");
        let suffix = if codec == Codec::None {
            "plain"
        } else {
            "zstd"
        };
        for rank in 0..2 {
            let file = if codec == Codec::None {
                format!("rank-{rank:05}.safetensors")
            } else {
                format!("rank-{rank:05}.safetensors.zst")
            };
            check(
                &format!("{suffix}-{file}"),
                &store.get(&format!("{dir}/{file}")).await.unwrap(),
            );
            let part = format!("rank-{rank:05}.json");
            check(
                &format!("{suffix}-{part}"),
                &store.get(&format!("{dir}/{part}")).await.unwrap(),
            );
        }
        // The manifest carries its commit time: compare it with the time zeroed.
        let key = format!("{dir}/manifest.json");
        let mut manifest = Manifest::parse(&store.get(&key).await.unwrap(), &key).unwrap();
        manifest.created_unix_ms = 0;
        manifest.step = 0;
        check(&format!("{suffix}-manifest.json"), &manifest.to_bytes());
    }
}
