//! The streaming rank-file writer and the commit check on data files.

use ckpt_testkit as common;

use ckpt::format::Codec;
use ckpt::writer::{PlannedBox, RankFileWriter, commit};
use ckpt::{Attempt, CheckpointReader, DType, LoadRequest, Region, as_bytes};
use common::*;

fn boxes(rank: u32, world: u32) -> Vec<PlannedBox> {
    vec![PlannedBox {
        name: "w".into(),
        dtype: DType::F32,
        shape: vec![10, 3],
        region: Region::dim0_shard(&[10, 3], rank as usize, world as usize),
    }]
}

fn attempt(step: u64) -> Attempt {
    Attempt::new(step, 0, "writer-test").unwrap()
}

async fn write_rank(store: &ckpt::storage::Store, rank: u32, data: &[f32]) {
    let planned = boxes(rank, 2);
    let mut writer =
        RankFileWriter::begin(store, &attempt(7), rank, 2, 4096, Codec::None, &planned)
            .await
            .unwrap();
    let region = &planned[0].region;
    let start = (region.offsets[0] * 3) as usize;
    let len = (region.lengths[0] * 3) as usize;
    // In two pieces: the writer takes any cut.
    let bytes = as_bytes(&data[start..start + len]);
    writer.write(&bytes[..5]).await.unwrap();
    writer.write(&bytes[5..]).await.unwrap();
    writer
        .finish(None, Default::default(), Default::default())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_rank_files_commit_and_load() {
    let (store, _dir) = local_store("writer");
    let data: Vec<f32> = (0..30).map(|i| i as f32).collect();
    write_rank(&store, 0, &data).await;
    assert!(
        !commit(&store, &attempt(7), 2).await.unwrap(),
        "rank 1 is missing"
    );
    write_rank(&store, 1, &data).await;
    assert!(commit(&store, &attempt(7), 2).await.unwrap());
    let reader = CheckpointReader::open(&store, Some(7)).await.unwrap();
    let loaded = reader
        .load(&LoadRequest::new().tensor("w", Region::full(&[10, 3])))
        .await
        .unwrap();
    assert_eq!(to_f32(&loaded.tensors[0].data), data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_refuses_when_a_data_file_vanished() {
    let (store, _dir) = local_store("writer-vanished");
    let data: Vec<f32> = (0..30).map(|i| i as f32).collect();
    write_rank(&store, 0, &data).await;
    write_rank(&store, 1, &data).await;
    let data_file = store
        .list(&attempt(7).dir())
        .await
        .unwrap()
        .into_iter()
        .find(|o| o.key.contains("rank-00000-") && o.key.ends_with(".safetensors"))
        .expect("rank 0's data file")
        .key;
    store.delete(&data_file).await.unwrap();
    let err = commit(&store, &attempt(7), 2)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("{data_file} is missing")), "{err}");
    assert!(
        ckpt::latest(&store).await.unwrap().is_none(),
        "nothing committed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_refuses_too_many_or_too_few_bytes() {
    let (store, _dir) = local_store("writer-sizes");
    let planned = boxes(0, 2);
    let mut writer = RankFileWriter::begin(&store, &attempt(1), 0, 2, 4096, Codec::None, &planned)
        .await
        .unwrap();
    let too_many = vec![0u8; 1000];
    assert!(writer.write(&too_many).await.is_err());
    writer.write(&[0u8; 8]).await.unwrap();
    let err = writer
        .finish(None, Default::default(), Default::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("never written"), "{err}");
    assert!(
        store.list("").await.unwrap().is_empty(),
        "nothing left behind"
    );
}
