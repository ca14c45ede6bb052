//! Element conversions for `diff` (to f64) and `export --dtype` (to f32, f16, bf16).
//!
//! The f16 and bf16 arithmetic is the `half` crate's (round to nearest even, the
//! CPU's F16C instructions where it has them), pinned here to the bits ckpt has
//! always produced: the tests below hold the edge cases (zeros, subnormals, ties,
//! overflow, infinities, NaN payloads) to exact bit patterns. The FP8 decoders are
//! ckpt's own, as half has no FP8 types.

use half::{bf16, f16};

use crate::dtype::DType;

/// Decodes little-endian elements of `dtype` into f64 (booleans as 0 or 1).
pub fn to_f64(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    let n = dtype.size();
    bytes
        .chunks_exact(n)
        .map(|b| match dtype {
            DType::BOOL => f64::from(u8::from(b[0] != 0)),
            DType::U8 => f64::from(b[0]),
            DType::I8 => f64::from(b[0] as i8),
            DType::F8_E4M3 => f8_e4m3_to_f32(b[0]) as f64,
            DType::F8_E5M2 => f16_to_f32(u16::from(b[0]) << 8) as f64,
            DType::F8_E8M0 => f8_e8m0_to_f32(b[0]) as f64,
            DType::I16 => f64::from(i16::from_le_bytes([b[0], b[1]])),
            DType::U16 => f64::from(u16::from_le_bytes([b[0], b[1]])),
            DType::F16 => f16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
            DType::BF16 => bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
            DType::I32 => f64::from(i32::from_le_bytes(b.try_into().expect("4 bytes"))),
            DType::U32 => f64::from(u32::from_le_bytes(b.try_into().expect("4 bytes"))),
            DType::F32 => f64::from(f32::from_le_bytes(b.try_into().expect("4 bytes"))),
            DType::F64 => f64::from_le_bytes(b.try_into().expect("8 bytes")),
            DType::I64 => i64::from_le_bytes(b.try_into().expect("8 bytes")) as f64,
            DType::U64 => u64::from_le_bytes(b.try_into().expect("8 bytes")) as f64,
        })
        .collect()
}

/// bfloat16 bits to f32 (exact, every bit pattern kept). This is bf16's definition, the
/// top half of an f32, and deliberately not `half::bf16::to_f32`, which sets the quiet
/// bit of a signaling NaN: `diff` and `export` would not see it (widening to f64 quiets
/// it anyway), but a caller of this function would.
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// f32 to bfloat16 bits, rounding to nearest even; a NaN keeps its sign and top
/// payload bits and is made quiet.
pub fn f32_to_bf16(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// IEEE half bits to f32 (exact; a NaN keeps its sign and payload and is made quiet).
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// f32 to IEEE half bits, rounding to nearest even, overflowing to infinity. Every
/// NaN becomes the quiet NaN `0x7E00` with its sign: half would keep the top payload
/// bits, and exports have always written the one NaN.
pub fn f32_to_f16(x: f32) -> u16 {
    if x.is_nan() {
        let sign = ((x.to_bits() >> 16) & 0x8000) as u16;
        return sign | 0x7E00;
    }
    f16::from_f32(x).to_bits()
}

/// OCP FP8 E4M3 (finite, one NaN encoding per sign) to f32.
pub fn f8_e4m3_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = (bits >> 3) & 0xF;
    let man = bits & 0x7;
    if exp == 0xF && man == 0x7 {
        return f32::NAN;
    }
    let value = if exp == 0 {
        f32::from(man) / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + f32::from(man) / 8.0) * 2f32.powi(i32::from(exp) - 7)
    };
    sign * value
}

/// OCP E8M0 scale (2^(e-127), 0xFF is NaN) to f32.
pub fn f8_e8m0_to_f32(bits: u8) -> f32 {
    if bits == 0xFF {
        f32::NAN
    } else {
        2f32.powi(i32::from(bits) - 127)
    }
}

/// Converts float elements of `from` into `to` (F32, F16 or BF16), little-endian.
pub fn convert_floats(from: DType, to: DType, bytes: &[u8]) -> Vec<u8> {
    if from == to {
        return bytes.to_vec();
    }
    let values = to_f64(from, bytes);
    let mut out = Vec::with_capacity(values.len() * to.size());
    for v in values {
        let v = v as f32;
        match to {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f32_to_f16(v).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&f32_to_bf16(v).to_le_bytes()),
            other => unreachable!("export converts to F32, F16 or BF16, not {other}"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_round_trips_every_finite_value() {
        for bits in 0..=u16::MAX {
            let x = f16_to_f32(bits);
            if x.is_nan() {
                assert!(f16_to_f32(f32_to_f16(x)).is_nan());
                continue;
            }
            assert_eq!(f32_to_f16(x), bits, "bits {bits:04x} value {x}");
        }
    }

    #[test]
    fn bfloat_round_trips_and_rounds_to_even() {
        for bits in [0u16, 1, 0x3F80, 0xBF80, 0x7F7F, 0x0080] {
            assert_eq!(f32_to_bf16(bf16_to_f32(bits)), bits);
        }
        // 1 + 2^-8 lies halfway between two bf16 values: ties go to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3F80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
    }

    /// f32 bits, then the f16 and bf16 bits they round to: signed zeros, ones, the
    /// f16 overflow threshold (65520 and up go to infinity), ties to even in normal and
    /// subnormal ranges (up and down), the rounding to zero below half the smallest
    /// subnormal, infinities, and NaNs with payloads (f16 gets the one quiet NaN, bf16
    /// keeps the payload's top bits, quieted).
    const NARROWED: &[(u32, u16, u16)] = &[
        (0x0000_0000, 0x0000, 0x0000),
        (0x8000_0000, 0x8000, 0x8000),
        (0x3F80_0000, 0x3C00, 0x3F80),
        (0xBF80_0000, 0xBC00, 0xBF80),
        (0x477F_E000, 0x7BFF, 0x4780),
        (0x477F_EFFF, 0x7BFF, 0x4780),
        (0x477F_F000, 0x7C00, 0x4780),
        (0xC77F_F000, 0xFC00, 0xC780),
        (0x7F7F_FFFF, 0x7C00, 0x7F80),
        (0x3F80_1000, 0x3C00, 0x3F80),
        (0x3F80_3000, 0x3C02, 0x3F80),
        (0x3F80_1001, 0x3C01, 0x3F80),
        (0x3F80_8000, 0x3C04, 0x3F80),
        (0x3F81_8000, 0x3C0C, 0x3F82),
        (0x3F80_8001, 0x3C04, 0x3F81),
        (0x3800_0000, 0x0200, 0x3800),
        (0x3880_0000, 0x0400, 0x3880),
        (0x387F_E000, 0x0400, 0x3880),
        (0x3300_0000, 0x0000, 0x3300),
        (0x3300_0001, 0x0001, 0x3300),
        (0xB300_0001, 0x8001, 0xB300),
        (0x33C0_0000, 0x0002, 0x33C0),
        (0x3420_0000, 0x0002, 0x3420),
        (0x0000_0001, 0x0000, 0x0000),
        (0x0001_0000, 0x0000, 0x0001),
        (0x007F_FFFF, 0x0000, 0x0080),
        (0x7F80_0000, 0x7C00, 0x7F80),
        (0xFF80_0000, 0xFC00, 0xFF80),
        (0x7FC0_0000, 0x7E00, 0x7FC0),
        (0xFFC0_0000, 0xFE00, 0xFFC0),
        (0x7F80_0001, 0x7E00, 0x7FC0),
        (0x7FA0_2000, 0x7E00, 0x7FE0),
        (0xFFFF_FFFF, 0xFE00, 0xFFFF),
    ];

    #[test]
    fn narrowing_keeps_its_bits_on_edge_values() {
        for &(from, to_f16, to_bf16) in NARROWED {
            let x = f32::from_bits(from);
            assert_eq!(f32_to_f16(x), to_f16, "f16 of {from:08x}");
            assert_eq!(f32_to_bf16(x), to_bf16, "bf16 of {from:08x}");
        }
        // Through `export`: f32 elements in, little-endian f16 and bf16 out.
        let src: Vec<u8> = NARROWED.iter().flat_map(|e| e.0.to_le_bytes()).collect();
        let f16s: Vec<u8> = NARROWED.iter().flat_map(|e| e.1.to_le_bytes()).collect();
        let bf16s: Vec<u8> = NARROWED.iter().flat_map(|e| e.2.to_le_bytes()).collect();
        assert_eq!(convert_floats(DType::F32, DType::F16, &src), f16s);
        assert_eq!(convert_floats(DType::F32, DType::BF16, &src), bf16s);
    }

    #[test]
    fn widening_keeps_its_bits_on_edge_values() {
        // f16 bits, then the f32 bits: zeros, the smallest and largest subnormals, the
        // smallest normal, one, the largest finite, infinities, and NaNs (a signaling
        // one comes back quiet with its payload).
        let f16s: &[(u16, u32)] = &[
            (0x0000, 0x0000_0000),
            (0x8000, 0x8000_0000),
            (0x0001, 0x3380_0000),
            (0x8001, 0xB380_0000),
            (0x03FF, 0x387F_C000),
            (0x0400, 0x3880_0000),
            (0x3C00, 0x3F80_0000),
            (0x7BFF, 0x477F_E000),
            (0x7C00, 0x7F80_0000),
            (0xFC00, 0xFF80_0000),
            (0x7E00, 0x7FC0_0000),
            (0x7C01, 0x7FC0_2000),
            (0xFD55, 0xFFEA_A000),
        ];
        for &(from, to) in f16s {
            assert_eq!(f16_to_f32(from).to_bits(), to, "f32 of f16 {from:04x}");
            let wide = to_f64(DType::F16, &from.to_le_bytes())[0];
            assert_eq!(wide.to_bits(), f64::from(f32::from_bits(to)).to_bits());
        }
        // bf16 bits, then the f32 bits (exact, even a signaling NaN) and what `diff`
        // compares: the f64, where widening has quieted that NaN.
        let bf16s: &[(u16, u32, u64)] = &[
            (0x0001, 0x0001_0000, 0x37A0_0000_0000_0000),
            (0x8080, 0x8080_0000, 0xB810_0000_0000_0000),
            (0x3F80, 0x3F80_0000, 0x3FF0_0000_0000_0000),
            (0x7F7F, 0x7F7F_0000, 0x47EF_E000_0000_0000),
            (0x7F80, 0x7F80_0000, 0x7FF0_0000_0000_0000),
            (0xFF80, 0xFF80_0000, 0xFFF0_0000_0000_0000),
            (0x7FC0, 0x7FC0_0000, 0x7FF8_0000_0000_0000),
            (0x7F81, 0x7F81_0000, 0x7FF8_2000_0000_0000),
            (0xFFC1, 0xFFC1_0000, 0xFFF8_2000_0000_0000),
        ];
        for &(from, to_f32, to_f64_bits) in bf16s {
            assert_eq!(
                bf16_to_f32(from).to_bits(),
                to_f32,
                "f32 of bf16 {from:04x}"
            );
            let wide = to_f64(DType::BF16, &from.to_le_bytes())[0];
            assert_eq!(wide.to_bits(), to_f64_bits, "f64 of bf16 {from:04x}");
        }
    }

    #[test]
    fn fp8_decodes_known_values() {
        assert_eq!(f8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(f8_e4m3_to_f32(0x7E), 448.0);
        assert!(f8_e4m3_to_f32(0x7F).is_nan());
        assert_eq!(to_f64(DType::F8_E5M2, &[0x3C])[0], 1.0);
        assert_eq!(f8_e8m0_to_f32(127), 1.0);
    }

    #[test]
    fn conversions_between_float_types() {
        let src: Vec<u8> = [1.5f32, -2.25, 0.1]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let bf = convert_floats(DType::F32, DType::BF16, &src);
        assert_eq!(to_f64(DType::BF16, &bf)[..2], [1.5, -2.25]);
        let h = convert_floats(DType::F32, DType::F16, &src);
        assert_eq!(to_f64(DType::F16, &h)[..2], [1.5, -2.25]);
    }
}
