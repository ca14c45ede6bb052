//! zstd on samples of the workload: bytes stored, ratio and throughput, with and
//! without the byte-shuffle filter, fp32 and bf16.

use super::*;

pub(super) fn codec_samples(
    data: &Workload,
    config: &BenchConfig,
    level: i32,
) -> Result<Vec<CodecSample>> {
    let block = config.block_size as usize;
    let mut fp32 = Vec::new();
    for t in &data[0] {
        if fp32.len() as u64 >= config.codec_sample_bytes {
            break;
        }
        fp32.extend_from_slice(as_bytes(t));
    }
    fp32.truncate(config.codec_sample_bytes as usize);
    // bf16: each fp32 rounded to nearest even.
    let bf16: Vec<u8> = fp32
        .chunks_exact(4)
        .flat_map(|b| {
            half::bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes()
        })
        .collect();
    let mut out = Vec::new();
    for (name, bytes, width) in [("fp32", &fp32, 4u32), ("bf16", &bf16, 2u32)] {
        for shuffle in [0, width] {
            let codec = Codec::Zstd { level, shuffle };
            let (mut c_times, mut d_times) = (Vec::new(), Vec::new());
            let mut stored = 0usize;
            for _ in 0..config.reps.min(3) {
                let started = Instant::now();
                let frames: Vec<Vec<u8>> = bytes
                    .chunks(block)
                    .map(|raw| codec::compress_block(raw, level, shuffle))
                    .collect::<std::io::Result<_>>()
                    .map_err(|e| Error::Failed(format!("bench: zstd: {e}")))?;
                c_times.push(started.elapsed().as_secs_f64());
                stored = frames.iter().map(Vec::len).sum();
                let started = Instant::now();
                for (frame, raw) in frames.iter().zip(bytes.chunks(block)) {
                    let back = codec::decompress_block(frame, raw.len(), codec)
                        .map_err(|e| Error::Failed(format!("bench: zstd: {e}")))?;
                    std::hint::black_box(back);
                }
                d_times.push(started.elapsed().as_secs_f64());
            }
            out.push(CodecSample {
                data: name,
                shuffle,
                level,
                ratio: bytes.len() as f64 / stored.max(1) as f64,
                compress_gbps: gbps(bytes.len() as u64, median(&c_times)),
                decompress_gbps: gbps(bytes.len() as u64, median(&d_times)),
            });
        }
    }
    Ok(out)
}
