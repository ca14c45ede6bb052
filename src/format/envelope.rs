//! The checksummed JSON envelope `{"crc32":"xxxxxxxx","body":BODY}` that wraps the
//! manifest and the rank parts, and JSON parsing with errors at byte offsets. Kept
//! apart because it is the first thing to read untrusted bytes and is fuzzed alone.

use serde::Deserialize;

use super::{FResult, FormatError};

const ENVELOPE_PREFIX: &str = "{\"crc32\":\"";
const ENVELOPE_MIDDLE: &str = "\",\"body\":";

/// Wraps a JSON body as `{"crc32":"xxxxxxxx","body":BODY}`, the CRC32 taken over
/// the exact bytes of BODY.
pub fn seal(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 40);
    out.extend_from_slice(ENVELOPE_PREFIX.as_bytes());
    out.extend_from_slice(format!("{:08x}", crc32fast::hash(body)).as_bytes());
    out.extend_from_slice(ENVELOPE_MIDDLE.as_bytes());
    out.extend_from_slice(body);
    out.push(b'}');
    out
}

/// Checks the envelope and its CRC and returns BODY and its offset in `bytes`.
pub fn unseal<'a>(bytes: &'a [u8], object: &str, cap: u64) -> FResult<(&'a [u8], usize)> {
    if bytes.len() as u64 > cap {
        return Err(FormatError::new(
            object,
            None,
            format!("{} bytes exceeds the {cap}-byte limit", bytes.len()),
        ));
    }
    let header_len = ENVELOPE_PREFIX.len() + 8 + ENVELOPE_MIDDLE.len();
    let bad =
        |offset: usize, what: &str| FormatError::new(object, Some(offset as u64), what.to_string());
    if bytes.len() < header_len + 1 {
        return Err(bad(
            bytes.len(),
            "truncated: too short for a checksummed JSON object",
        ));
    }
    if !bytes.starts_with(ENVELOPE_PREFIX.as_bytes()) {
        return Err(bad(
            0,
            "not a checksummed JSON object (expected {\"crc32\":\"...\",\"body\":...})",
        ));
    }
    let hex = &bytes[ENVELOPE_PREFIX.len()..ENVELOPE_PREFIX.len() + 8];
    let expected = std::str::from_utf8(hex)
        .ok()
        .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| bad(ENVELOPE_PREFIX.len(), "crc32 is not 8 hex digits"))?;
    if &bytes[ENVELOPE_PREFIX.len() + 8..header_len] != ENVELOPE_MIDDLE.as_bytes() {
        return Err(bad(
            ENVELOPE_PREFIX.len() + 8,
            "expected \",\"body\": after the crc32",
        ));
    }
    if bytes.last() != Some(&b'}') {
        return Err(bad(bytes.len() - 1, "truncated: missing the closing brace"));
    }
    let body = &bytes[header_len..bytes.len() - 1];
    let actual = crc32fast::hash(body);
    if actual != expected {
        return Err(bad(
            header_len,
            &format!("checksum mismatch: body has crc32 {actual:08x}, header says {expected:08x}"),
        ));
    }
    Ok((body, header_len))
}

/// BODY's first bytes in a prefix of an envelope (the object read only in part), or
/// `None` when the prefix does not start the way an envelope does. Nothing is
/// checked against the CRC, which covers the whole object.
pub fn body_prefix(prefix: &[u8]) -> Option<&[u8]> {
    let header_len = ENVELOPE_PREFIX.len() + 8 + ENVELOPE_MIDDLE.len();
    let hex = prefix.get(ENVELOPE_PREFIX.len()..ENVELOPE_PREFIX.len() + 8)?;
    let shaped = prefix.starts_with(ENVELOPE_PREFIX.as_bytes())
        && hex.iter().all(u8::is_ascii_hexdigit)
        && prefix.get(ENVELOPE_PREFIX.len() + 8..header_len)? == ENVELOPE_MIDDLE.as_bytes();
    shaped.then(|| &prefix[header_len..])
}

pub(crate) fn parse_json<T: for<'de> Deserialize<'de>>(
    body: &[u8],
    body_offset: usize,
    object: &str,
) -> FResult<T> {
    serde_json::from_slice(body).map_err(|e| {
        let offset = byte_offset(body, e.line(), e.column()) + body_offset;
        FormatError::new(object, Some(offset as u64), format!("invalid JSON: {e}"))
    })
}

/// Converts serde_json's 1-based line and column into a byte offset.
pub(crate) fn byte_offset(text: &[u8], line: usize, column: usize) -> usize {
    let mut offset = 0;
    for _ in 1..line.max(1) {
        match text[offset..].iter().position(|&b| b == b'\n') {
            Some(i) => offset += i + 1,
            None => return text.len(),
        }
    }
    (offset + column.saturating_sub(1)).min(text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips_and_detects_flips() {
        let sealed = seal(br#"{"a":1}"#);
        let (body, offset) = unseal(&sealed, "m", 1 << 20).unwrap();
        assert_eq!(body, br#"{"a":1}"#);
        assert_eq!(&sealed[offset..offset + body.len()], body);
        let mut flipped = sealed.clone();
        flipped[offset + 5] ^= 0x01;
        let e = unseal(&flipped, "m", 1 << 20).unwrap_err();
        assert!(e.message.contains("checksum mismatch"), "{e}");
        assert!(unseal(&sealed[..sealed.len() - 1], "m", 1 << 20).is_err());
        assert!(
            unseal(&sealed, "m", 4)
                .unwrap_err()
                .message
                .contains("limit")
        );
    }

    #[test]
    fn json_errors_carry_byte_offsets() {
        let body = b"{\n  \"a\": tru\n}";
        let e = parse_json::<serde_json::Value>(body, 100, "obj").unwrap_err();
        let offset = e.offset.unwrap();
        assert!((100 + 9..=100 + 13).contains(&offset), "{e}");
    }
}
