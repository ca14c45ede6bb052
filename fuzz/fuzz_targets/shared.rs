//! `CheckpointReader::from_shared` on arbitrary bytes: what one rank of a cooperative
//! load receives from another. Never panics; what it accepts opens a checkpoint
//! whose parts all passed their CRC32 against the manifest.
#![no_main]

use ckpt::CheckpointReader;
use ckpt::storage::Store;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let store = Store::from_url("memory://fuzz-shared").expect("a memory store");
    if let Ok(reader) = CheckpointReader::from_shared(&store, data) {
        let manifest = reader.manifest();
        assert_eq!(manifest.ranks.len(), manifest.world_size as usize);
    }
});
