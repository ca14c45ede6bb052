//! `Manifest::parse` on arbitrary bytes: never panics, errors name the object, and a
//! manifest it accepts survives a round trip and can be planned against.
#![no_main]

use ckpt::Manifest;
use ckpt::format::seal;
use ckpt::region::Region;
use libfuzzer_sys::fuzz_target;

const OBJECT: &str = "step-00000001/manifest.json";

fuzz_target!(|data: &[u8]| {
    // As given (the envelope and its CRC32 refuse nearly every mutation), and sealed,
    // so that mutations reach the JSON parser and the validator.
    check(data);
    check(&seal(data));
});

fn check(data: &[u8]) {
    match Manifest::parse(data, OBJECT) {
        Err(e) => assert_eq!(e.object, OBJECT),
        Ok(manifest) => {
            let again = Manifest::parse(&manifest.to_bytes(), OBJECT).expect("round trip");
            assert_eq!(again, manifest);
            // What the load planner does with a validated manifest must not panic
            // either: look every tensor up and intersect its layout with the whole.
            for tensor in &manifest.tensors {
                let _ = manifest.tensor(&tensor.name);
                let layout = &manifest.layouts[tensor.layout as usize];
                let whole = Region::full(&tensor.shape);
                let _ = layout.boxes(&tensor.shape);
                let _ = layout.overlapping(&tensor.shape, &whole);
            }
            let _ = manifest.tensor_bytes();
        }
    }
}
