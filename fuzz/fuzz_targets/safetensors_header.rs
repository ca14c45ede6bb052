//! `parse_safetensors_header` with the input as the file's first bytes: never panics,
//! errors name the object, and an accepted header's entries lie inside the file.
#![no_main]

use ckpt::format::parse_safetensors_header;
use libfuzzer_sys::fuzz_target;

const OBJECT: &str = "step-00000001/rank-00000.safetensors";

fuzz_target!(|data: &[u8]| {
    // The file size comes from the input's last byte: exactly the prefix, a file
    // longer than the prefix, or absurdly large.
    let file_size = match data.last() {
        None => 0,
        Some(0xff) => u64::MAX,
        Some(&b) if b < 0x10 => data.len() as u64 / (u64::from(b) + 1),
        Some(&b) => data.len() as u64 + u64::from(b) * 997,
    };
    match parse_safetensors_header(data, file_size, OBJECT) {
        Err(e) => assert_eq!(e.object, OBJECT),
        Ok(header) => {
            assert!(header.data_start <= file_size);
            let mut cursor = 0;
            for entry in &header.entries {
                assert_eq!(entry.data_offsets[0], cursor);
                cursor = entry.data_offsets[1];
            }
            assert!(header.data_start + cursor <= file_size);
        }
    }
});
