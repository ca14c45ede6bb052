//! Element conversions for `diff` (to f64) and `export --dtype` (to f32, f16, bf16).

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

/// True for floating-point dtypes.
pub fn is_float(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F8_E4M3
            | DType::F8_E5M2
            | DType::F8_E8M0
            | DType::F16
            | DType::BF16
            | DType::F32
            | DType::F64
    )
}

/// bfloat16 bits to f32 (exact).
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// f32 to bfloat16 bits, rounding to nearest even; NaN stays NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// IEEE half bits to f32 (exact).
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits >> 15) << 31;
    let exp = u32::from((bits >> 10) & 0x1F);
    let man = u32::from(bits & 0x3FF);
    let out = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: value = man * 2^-24.
            let value = man as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -value } else { value };
        }
        (0x1F, 0) => sign | 0x7F80_0000,
        (0x1F, _) => sign | 0x7FC0_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(out)
}

/// f32 to IEEE half bits, rounding to nearest even, overflowing to infinity.
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    if x.is_nan() {
        return sign | 0x7E00;
    }
    let abs = x.abs();
    if abs >= 65520.0 {
        return sign | 0x7C00;
    }
    if abs < f32::from_bits(0x3300_0000) {
        // Below half the smallest subnormal: rounds to zero.
        return sign;
    }
    let exp = ((bits >> 23) & 0xFF) as i32 - 127;
    if exp < -14 {
        // Subnormal half: value / 2^-24, rounded to nearest even.
        let scaled = abs / f32::from_bits(0x3380_0000);
        let rounded = round_half_even(scaled);
        return sign | rounded as u16;
    }
    let man = bits & 0x7F_FFFF;
    let mut half = (((exp + 15) as u32) << 10) | (man >> 13);
    let rest = man & 0x1FFF;
    if rest > 0x1000 || (rest == 0x1000 && half & 1 == 1) {
        half += 1;
    }
    sign | half as u16
}

fn round_half_even(x: f32) -> u32 {
    let floor = x.floor();
    let diff = x - floor;
    let f = floor as u32;
    if diff > 0.5 || (diff == 0.5 && f % 2 == 1) {
        f + 1
    } else {
        f
    }
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
