//! `ckpt::copies`: bytes of a data file held outside the store (an in-memory copy of
//! the boxes a rank saved) are checked against the save's block CRC32s, exactly as a
//! read from the store is.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use ckpt::copies::{file_header, read_verified};
use ckpt::format::{Chunk, RankPart};
use ckpt::storage::Store;
use ckpt::{CheckpointConfig, CheckpointReader, Checkpointer, Codec, DType, Error, State};

/// Boxes of several dtypes and sizes, some spanning many 4 KiB blocks, one empty.
fn boxes() -> Vec<(String, DType, Vec<u64>, Vec<u8>)> {
    let bytes = |n: usize, seed: u8| (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
    vec![
        ("a/f32".into(), DType::F32, vec![1000, 3], bytes(12_000, 1)),
        ("b/bf16".into(), DType::BF16, vec![7], bytes(14, 2)),
        ("c/u8".into(), DType::U8, vec![9000], bytes(9000, 3)),
        ("d/empty".into(), DType::F64, vec![0, 4], Vec::new()),
        ("e/i64".into(), DType::I64, vec![300], bytes(2400, 4)),
    ]
}

/// One rank's save of `boxes()` (4 KiB blocks, `codec`): its part, and its data file's
/// raw bytes read back through a plain load of every box.
async fn saved(codec: Codec) -> (Arc<RankPart>, HashMap<String, Vec<u8>>) {
    // memory:// stores of one name are shared by the process: one per call.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let store = Store::from_url(&format!("memory://copies-{call}")).unwrap();
    let mut config = CheckpointConfig::new(0, 1);
    config.block_size = 4096;
    config.codec = codec;
    let checkpointer = Checkpointer::new(store.clone(), config).unwrap();
    let mut state = State::new();
    let boxes = boxes();
    for (name, dtype, shape, data) in &boxes {
        state
            .add_dim0_shard(name.clone(), *dtype, shape, 0, 1, data)
            .unwrap();
    }
    let handle = checkpointer.save(5, &state).await.unwrap();
    handle.committed().await.unwrap();
    let reader = CheckpointReader::open(&store, None).await.unwrap();
    let part = reader.part(0).await.unwrap();
    let data = boxes
        .into_iter()
        .map(|(name, _, _, data)| (name, data))
        .collect();
    (part, data)
}

/// A reader over the boxes `data` holds, counting the bytes it hands out.
fn from<'a>(
    data: &'a HashMap<String, Vec<u8>>,
    served: &'a mut u64,
) -> impl FnMut(&Chunk, Range<u64>, &mut [u8]) -> Result<(), String> + 'a {
    move |chunk, bytes, out| {
        let held = data.get(&chunk.tensor).ok_or("not held")?;
        out.copy_from_slice(&held[bytes.start as usize..bytes.end as usize]);
        *served += out.len() as u64;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_box_of_an_intact_copy_verifies_and_reads_back_its_bytes() {
    for codec in [
        Codec::None,
        Codec::Zstd {
            level: 1,
            shuffle: 4,
        },
    ] {
        let (part, data) = saved(codec).await;
        let header = file_header(&part, "copy").unwrap();
        assert_eq!(header.len() as u64, part.chunks[0].bytes[0]);
        for chunk in &part.chunks {
            let want = chunk.bytes[0]..chunk.bytes[1];
            let mut served = 0;
            let got = read_verified(
                &part,
                &header,
                want.clone(),
                "copy",
                &mut from(&data, &mut served),
            )
            .unwrap();
            assert_eq!(
                got.slice(want.clone()).unwrap(),
                &data[&chunk.tensor][..],
                "{codec:?} {}",
                chunk.tensor
            );
            // Whole blocks, no more: the start and end are block boundaries (or the
            // file's end), within one block of what was asked for.
            assert_eq!(got.raw.start % 4096, 0);
            assert!(got.raw.end.is_multiple_of(4096) || got.raw.end == part.file.raw_bytes);
            assert!(got.raw.start + 4096 > want.start && got.raw.end < want.end + 4096);
            assert!(served <= got.raw.end - got.raw.start);
        }
        // Any range, not only whole boxes: a few bytes across a box boundary.
        let edge = part.chunks[1].bytes[0];
        let mut served = 0;
        let got = read_verified(
            &part,
            &header,
            edge - 3..edge + 5,
            "copy",
            &mut from(&data, &mut served),
        )
        .unwrap();
        assert_eq!(got.slice(edge..edge + 5).unwrap(), &data["b/bf16"][..5]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_anywhere_in_a_copy_names_the_copy_and_the_block() {
    let (part, data) = saved(Codec::None).await;
    let header = file_header(&part, "copy").unwrap();
    for chunk in part.chunks.iter().filter(|c| c.bytes[1] > c.bytes[0]) {
        let len = (chunk.bytes[1] - chunk.bytes[0]) as usize;
        for at in [0, len / 2, len - 1] {
            let mut rotten = data.clone();
            rotten.get_mut(&chunk.tensor).unwrap()[at] ^= 0x10;
            let raw = chunk.bytes[0] + at as u64;
            let mut served = 0;
            let err = read_verified(
                &part,
                &header,
                chunk.bytes[0]..chunk.bytes[1],
                "copy of rank 0 held by rank 3",
                &mut from(&rotten, &mut served),
            )
            .unwrap_err();
            let Error::Corrupt(e) = &err else {
                panic!("expected corruption, got {err}");
            };
            let block = raw / 4096;
            assert_eq!(e.offset, Some(block * 4096), "{err}");
            assert!(
                e.object == "copy of rank 0 held by rank 3"
                    && err.to_string().contains(&format!("block {block} ")),
                "{err}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_cannot_answer_or_a_range_outside_the_file_is_an_error_not_a_panic() {
    let (part, data) = saved(Codec::None).await;
    let header = file_header(&part, "copy").unwrap();
    let mut refuse = |_: &Chunk, _: Range<u64>, _: &mut [u8]| Err("peer went away".to_string());
    let err = read_verified(&part, &header, 0..10, "copy", &mut refuse).unwrap_err();
    assert!(
        matches!(&err, Error::NotFound(m) if m == "peer went away"),
        "{err}"
    );
    let end = part.file.raw_bytes;
    let mut served = 0;
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 5..4;
    for bad in [end..end + 1, reversed, 0..u64::MAX] {
        let err = read_verified(
            &part,
            &header,
            bad.clone(),
            "copy",
            &mut from(&data, &mut served),
        )
        .unwrap_err();
        assert!(matches!(err, Error::Invalid(_)), "{bad:?}: {err}");
    }
    assert_eq!(served, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_whose_boxes_do_not_follow_the_header_back_to_back_has_no_rebuilt_header() {
    let (part, _) = saved(Codec::None).await;
    let mut gap = (*part).clone();
    gap.chunks[1].bytes[0] += 8;
    let err = file_header(&gap, "rank-00000.json").unwrap_err();
    assert!(
        matches!(&err, Error::Corrupt(e) if e.object == "rank-00000.json"),
        "{err}"
    );
    let mut short = (*part).clone();
    short.file.raw_bytes += 1;
    assert!(matches!(file_header(&short, "p"), Err(Error::Corrupt(_))));
    let mut renamed = (*part).clone();
    renamed.step += 1;
    // Same layout, other header bytes: the rebuild succeeds, the first block's CRC
    // then fails, as it must for a header the save did not write.
    let header = file_header(&renamed, "p").unwrap();
    let data: HashMap<String, Vec<u8>> = boxes().into_iter().map(|(n, _, _, d)| (n, d)).collect();
    let mut served = 0;
    let err =
        read_verified(&renamed, &header, 0..16, "p", &mut from(&data, &mut served)).unwrap_err();
    assert!(
        matches!(&err, Error::Corrupt(e) if e.offset == Some(0)),
        "{err}"
    );
}
