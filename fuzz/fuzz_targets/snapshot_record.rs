//! `SnapshotRecord::parse` and `Vote::decode` on arbitrary bytes: what the control
//! plane and a peer's all-gathered vote hand a recovering rank. Never panics; a
//! record it accepts names a snapshot directory of its own step and generation.
#![no_main]

use ckpt::snapshot::{SnapshotRecord, Vote};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(record) = SnapshotRecord::parse(text)
    {
        let attempt = record.attempt().expect("an accepted record has an attempt");
        assert_eq!(attempt.step, record.step);
        assert_eq!(attempt.generation, record.generation);
        assert!(record.world > 0);
        assert_eq!(SnapshotRecord::parse(&record.to_json()).ok(), Some(record));
    }
    let vote = Vote::decode(data);
    if vote.ready {
        assert_eq!(Vote::decode(&vote.encode()), vote);
    }
});
