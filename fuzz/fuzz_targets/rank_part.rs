//! `RankPart::parse` on arbitrary bytes: never panics, errors name the object, and a
//! part it accepts survives a round trip.
#![no_main]

use ckpt::format::{RankPart, seal};
use libfuzzer_sys::fuzz_target;

const OBJECT: &str = "step-00000001/rank-00000.json";

fuzz_target!(|data: &[u8]| {
    // As given (the envelope and its CRC32 refuse nearly every mutation), and sealed,
    // so that mutations reach the JSON parser and the validator.
    check(data);
    check(&seal(data));
});

fn check(data: &[u8]) {
    match RankPart::parse(data, OBJECT) {
        Err(e) => assert_eq!(e.object, OBJECT),
        Ok(part) => {
            let again = RankPart::parse(&part.to_bytes(), OBJECT).expect("round trip");
            assert_eq!(again, part);
            assert_eq!(part.block_count(), part.file.block_crc32.len() as u64);
            for chunk in &part.chunks {
                let _ = chunk.region().volume();
            }
        }
    }
}
