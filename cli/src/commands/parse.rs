//! Parsers of the checkpoint tools' flag values: sizes (`512MiB`), durations
//! (`10m`) and dtypes (`bf16`), with errors that show the expected form.

use std::time::Duration;

use ckpt::DType;

pub(super) fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 512MiB or 2GiB"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {text:?}")),
    };
    let value = number * scale as f64;
    if !(1.0..=1e18).contains(&value) {
        return Err(format!("size {text:?} is out of range"));
    }
    Ok(value as u64)
}

pub(super) fn parse_dtype(text: &str) -> Result<DType, String> {
    match text.to_ascii_lowercase().as_str() {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => Err(format!("--dtype {other:?}: expected bf16, f16 or f32")),
    }
}

pub(super) fn parse_duration(text: &str) -> Result<Duration, String> {
    if text.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(text)
        .map_err(|e| format!("{text:?} is not a duration like 10m or 1h: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_parse() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("0").is_err());
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_dtype("int8").is_err());
    }
}
