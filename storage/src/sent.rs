//! Did a PUT store the bytes it sent? The ETag check of writes to S3.
//!
//! # Why
//!
//! Bytes can change on their way to the server where no transport checksum sees
//! them: TCP's 16-bit checksum is weak and ends at every hop, and a proxy, a load
//! balancer or a NIC with a bad memory cell rewrites the body after it was checked.
//! A checkpoint's block CRC32s are computed before the upload, so a body damaged in
//! flight is stored as a data file that fails its checksums, or a JSON object that
//! fails its own, and a save committed over it loses the checkpoint.
//!
//! AWS itself refuses such a body when the request carries a checksum of it (the
//! SigV4 payload hash object_store signs by default, or `x-amz-checksum-*`), but an
//! S3-compatible server need not check either: moto, the test server, stores a PUT
//! whose `x-amz-checksum-sha256` or `Content-MD5` does not match its body and
//! answers 200 (measured with moto 5.2.5). Enabling object_store's
//! `with_checksum_algorithm` would therefore prove nothing there.
//!
//! What every S3 implementation we know of does return is an ETag that is the MD5
//! of the stored bytes for a single PUT of an unencrypted (or SSE-S3) object, and
//! the MD5 of the parts' MD5s followed by `-N` for an N-part upload. So the store
//! computes the MD5 of what it sends, compares it with the ETag the server
//! answers, and treats a difference as a write that did not happen:
//!
//! - [`Store::put`](crate::Store::put) and a single-request upload write again
//!   (bounded; an overwrite is what the put means anyway);
//! - [`Store::put_if_absent`](crate::Store::put_if_absent) deletes the object it
//!   has just won and creates again (nobody else could have written it in between:
//!   the create won), so a create never leaves damaged bytes behind under a name
//!   that can never be written again;
//! - a multipart [`Upload`](crate::Upload) cannot send its parts again (it streams
//!   them), so it deletes the object and fails with a transient error naming the
//!   key and the first differing part ([`Error::is_damaged_in_flight`]); a caller
//!   that still holds the bytes (the library's save does) uploads them again.
//!
//! [`Error::is_damaged_in_flight`]: crate::Error::is_damaged_in_flight
//!
//! An ETag that is not an MD5 at all (SSE-KMS, SSE-C) would differ every time. A
//! difference is therefore settled by reading the object back once: same bytes
//! means this bucket's ETags are not MD5s, and the store stops comparing (with a
//! warning; those servers are AWS, which checks the signed payload hash itself).
//!
//! # Cost
//!
//! One MD5 pass over every byte written to S3 (0.54 GB/s on one core of the
//! development machine, release build, measured by `md5_throughput` below with `--ignored`),
//! on the uploading task, no extra request unless the ETag differs. A verification
//! read after every write (the alternative) would double the traffic and the
//! latency of every save; an MD5 is a fraction of the network time of the same
//! bytes.

use bytes::Bytes;
use md5::{Digest, Md5};

/// How many times a put or a create is made before a store that keeps storing
/// other bytes than those sent is reported as failing.
pub(crate) const ATTEMPTS: usize = 3;

/// The MD5 of `pieces`, back to back.
pub(crate) fn md5_of(pieces: &[Bytes]) -> [u8; 16] {
    let mut hasher = Md5::new();
    for piece in pieces {
        hasher.update(piece);
    }
    hasher.finalize().into()
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The ETag's value without quotes or a weak marker.
pub(crate) fn bare(e_tag: &str) -> &str {
    let e_tag = e_tag.strip_prefix("W/").unwrap_or(e_tag);
    e_tag.trim_matches('"')
}

/// The ETag S3 gives an upload of these parts: the MD5 of one part, or for several
/// the MD5 of their MD5s followed by `-N`.
pub(crate) fn expected_e_tag(parts: &[[u8; 16]], multipart: bool) -> String {
    if !multipart && let [one] = parts {
        return hex(one);
    }
    let mut hasher = Md5::new();
    for part in parts {
        hasher.update(part);
    }
    let digest: [u8; 16] = hasher.finalize().into();
    format!("{}-{}", hex(&digest), parts.len())
}

/// The offset of the first byte where `stored` differs from `sent` (its length
/// when one is a prefix of the other), `None` when they are equal.
pub(crate) fn first_difference(sent: &[Bytes], stored: &[u8]) -> Option<u64> {
    let mut at = 0usize;
    for piece in sent {
        let end = at + piece.len();
        let Some(theirs) = stored.get(at..end) else {
            let same = stored.len().saturating_sub(at);
            let common = piece
                .iter()
                .zip(&stored[at.min(stored.len())..])
                .position(|(a, b)| a != b)
                .unwrap_or(same);
            return Some((at + common) as u64);
        };
        if let Some(k) = piece.iter().zip(theirs).position(|(a, b)| a != b) {
            return Some((at + k) as u64);
        }
        at = end;
    }
    (stored.len() != at).then_some(at as u64)
}

/// The MD5s of the parts of a streaming upload, cut where object_store's
/// `WriteMultipart` cuts them: every `part_size` bytes.
#[derive(Clone)]
pub(crate) struct PartDigests {
    part_size: usize,
    current: Md5,
    filled: usize,
    done: Vec<[u8; 16]>,
}

impl PartDigests {
    pub(crate) fn new(part_size: usize) -> Self {
        Self {
            part_size: part_size.max(1),
            current: Md5::new(),
            filled: 0,
            done: Vec::new(),
        }
    }

    /// Adds the next bytes of the object.
    pub(crate) fn update(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let take = (self.part_size - self.filled).min(data.len());
            self.current.update(&data[..take]);
            self.filled += take;
            data = &data[take..];
            if self.filled == self.part_size {
                let full = std::mem::replace(&mut self.current, Md5::new());
                self.done.push(full.finalize().into());
                self.filled = 0;
            }
        }
    }

    /// The digests of every part, the last (short) one included.
    pub(crate) fn finish(mut self) -> Vec<[u8; 16]> {
        if self.filled > 0 || self.done.is_empty() {
            self.done.push(self.current.finalize().into());
        }
        self.done
    }

    /// Bytes per part.
    pub(crate) fn part_size(&self) -> usize {
        self.part_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_and_multipart_e_tags_are_what_s3_answers() {
        // md5("hello world"), as S3 (and moto) answer a PUT of it.
        let one = md5_of(&[Bytes::from_static(b"hello world")]);
        assert_eq!(
            expected_e_tag(&[one], false),
            "5eb63bbbe01eeed093cb22bb8f5acdc3"
        );
        assert_eq!(bare("\"5eb63bbbe01eeed093cb22bb8f5acdc3\""), hex(&one));
        // Parts are cut every part_size bytes, however the writes come.
        let mut parts = PartDigests::new(4);
        for piece in [&b"hel"[..], b"lo w", b"orld"] {
            parts.update(piece);
        }
        let digests = parts.finish();
        assert_eq!(
            digests,
            [&b"hell"[..], b"o wo", b"rld"].map(|p| md5_of(&[Bytes::copy_from_slice(p)]))
        );
        assert!(expected_e_tag(&digests, true).ends_with("-3"));
    }

    #[test]
    fn the_first_difference_is_found_across_pieces() {
        let sent = [Bytes::from_static(b"abc"), Bytes::from_static(b"def")];
        assert_eq!(first_difference(&sent, b"abcdef"), None);
        assert_eq!(first_difference(&sent, b"abcdXf"), Some(4));
        assert_eq!(first_difference(&sent, b"abcd"), Some(4));
        assert_eq!(first_difference(&sent, b"abcdefg"), Some(6));
    }

    /// `cargo test -p ckpt-storage --release md5_throughput -- --ignored --nocapture`
    #[test]
    #[ignore = "a measurement"]
    fn md5_throughput() {
        let data = Bytes::from(vec![7u8; 256 << 20]);
        let started = std::time::Instant::now();
        let digest = md5_of(std::slice::from_ref(&data));
        let secs = started.elapsed().as_secs_f64();
        println!(
            "md5 of {} MiB: {:.0} ms, {:.2} GB/s ({})",
            data.len() >> 20,
            secs * 1e3,
            data.len() as f64 / secs / 1e9,
            hex(&digest)
        );
    }
}
