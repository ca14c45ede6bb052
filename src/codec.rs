//! Block checksums and compression frames.
//!
//! A rank file is cut into blocks of a fixed raw size. Each block has a CRC32, so a
//! ranged read verifies exactly what it read; compressed files hold one independent
//! zstd frame per block, so a ranged read decompresses only the frames it needs while
//! the whole file stays one valid zstd stream.

use crate::format::Codec;

/// CRC32 of every `block`-byte block of `data` (the last may be short).
pub fn block_crcs(data: &[u8], block: usize) -> Vec<u32> {
    data.chunks(block).map(crc32fast::hash).collect()
}

/// Transposes `data` in groups of `width` bytes: all first bytes, then all second
/// bytes, … A tail shorter than `width` is copied unchanged.
pub fn shuffle(data: &[u8], width: usize, out: &mut Vec<u8>) {
    out.clear();
    if width <= 1 {
        out.extend_from_slice(data);
        return;
    }
    let n = data.len() / width;
    out.reserve(data.len());
    for byte in 0..width {
        out.extend((0..n).map(|i| data[i * width + byte]));
    }
    out.extend_from_slice(&data[n * width..]);
}

/// Inverse of [`shuffle`].
pub fn unshuffle(data: &[u8], width: usize, out: &mut Vec<u8>) {
    out.clear();
    if width <= 1 {
        out.extend_from_slice(data);
        return;
    }
    let n = data.len() / width;
    out.resize(data.len(), 0);
    for byte in 0..width {
        let plane = &data[byte * n..(byte + 1) * n];
        for (i, &b) in plane.iter().enumerate() {
            out[i * width + byte] = b;
        }
    }
    out[n * width..].copy_from_slice(&data[n * width..]);
}

/// Compresses one block into an independent zstd frame (with its content size, so
/// the stock `zstd -d` restores it).
pub fn compress_block(raw: &[u8], level: i32, shuffle_width: u32) -> std::io::Result<Vec<u8>> {
    if shuffle_width > 1 {
        let mut shuffled = Vec::new();
        shuffle(raw, shuffle_width as usize, &mut shuffled);
        zstd::bulk::compress(&shuffled, level)
    } else {
        zstd::bulk::compress(raw, level)
    }
}

/// Decompresses one frame that must hold exactly `raw_len` bytes.
pub fn decompress_block(frame: &[u8], raw_len: usize, codec: Codec) -> Result<Vec<u8>, String> {
    let Codec::Zstd { shuffle: width, .. } = codec else {
        return Ok(frame.to_vec());
    };
    let mut out = Vec::with_capacity(raw_len);
    let mut decoder = zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?;
    // Bounded: the capacity is the block size we expect, never what the frame claims.
    decoder
        .decompress_to_buffer(frame, &mut out)
        .map_err(|e| format!("zstd frame does not decode into {raw_len} bytes: {e}"))?;
    if out.len() != raw_len {
        return Err(format!(
            "zstd frame decodes into {} bytes, expected {raw_len}",
            out.len()
        ));
    }
    if width > 1 {
        let mut plain = Vec::new();
        unshuffle(&out, width as usize, &mut plain);
        return Ok(plain);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_round_trips_with_tails() {
        let data: Vec<u8> = (0..103u8).collect();
        for width in [0, 1, 2, 4, 8] {
            let mut s = Vec::new();
            let mut u = Vec::new();
            shuffle(&data, width, &mut s);
            unshuffle(&s, width, &mut u);
            assert_eq!(u, data, "width {width}");
        }
        let mut s = Vec::new();
        shuffle(&[1, 2, 3, 4, 5, 6, 7, 8], 4, &mut s);
        assert_eq!(s, vec![1, 5, 2, 6, 3, 7, 4, 8]);
    }

    #[test]
    fn frames_round_trip_and_concatenate_into_one_stream() {
        let data: Vec<u8> = (0..10_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        let block = 4096;
        let mut stream = Vec::new();
        for (i, raw) in data.chunks(block).enumerate() {
            let frame = compress_block(raw, 3, 0).unwrap();
            let back = decompress_block(
                &frame,
                raw.len(),
                Codec::Zstd {
                    level: 3,
                    shuffle: 0,
                },
            )
            .unwrap();
            assert_eq!(back, raw, "block {i}");
            stream.extend_from_slice(&frame);
        }
        assert_eq!(zstd::stream::decode_all(&stream[..]).unwrap(), data);
    }

    #[test]
    fn a_frame_claiming_more_than_the_block_is_refused() {
        let frame = compress_block(&[0u8; 10_000], 1, 0).unwrap();
        assert!(
            decompress_block(
                &frame,
                100,
                Codec::Zstd {
                    level: 1,
                    shuffle: 0
                }
            )
            .is_err()
        );
        assert!(
            decompress_block(
                b"garbage",
                100,
                Codec::Zstd {
                    level: 1,
                    shuffle: 0
                }
            )
            .is_err()
        );
    }
}
