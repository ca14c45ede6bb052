//! `decompress_block` on arbitrary frames with a bounded expected size: never panics,
//! never returns other than `raw_len` bytes; and compress/decompress round-trips.
#![no_main]

use ckpt::Codec;
use ckpt::codec::{compress_block, decompress_block};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((head, frame)) = data.split_first_chunk::<4>() else {
        return;
    };
    // Up to 256 KiB expected, any shuffle width the config allows (0..=16).
    let raw_len = u32::from_le_bytes([head[0], head[1], head[2] & 0x03, 0]) as usize;
    let codec = Codec::Zstd {
        level: 1,
        shuffle: u32::from(head[3] % 17),
    };
    if let Ok(raw) = decompress_block(frame, raw_len, codec) {
        assert_eq!(raw.len(), raw_len);
    }
    let Codec::Zstd { shuffle, .. } = codec else {
        unreachable!()
    };
    let compressed = compress_block(frame, 1, shuffle).expect("compress");
    let back = decompress_block(&compressed, frame.len(), codec).expect("round trip");
    assert_eq!(back, frame);
});
