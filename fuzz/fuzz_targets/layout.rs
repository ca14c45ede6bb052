//! `Manifest::validate` on box layouts decoded from arbitrary bytes: never panics,
//! errors name the object, and a layout is accepted exactly when its boxes tile the
//! tensor (checked against the pairwise definition) and, in a manifest of format
//! version 2, list no rank twice (version 3 lets a rank hold several boxes).
#![no_main]

use ckpt::DType;
use ckpt::Manifest;
use ckpt::format::{Layout, LayoutBox, TensorEntry};
use ckpt::region::Region;
use libfuzzer_sys::fuzz_target;

const OBJECT: &str = "step-00000007/manifest.json";
/// A valid manifest of a two-rank save, whose tensors the input replaces.
const SEED: &[u8] = include_bytes!("../corpus/manifest/seed-save");

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let dims = usize::from(first % 4);
    let version = if first & 4 == 0 { 2 } else { 3 };
    let (shape, rest) = rest.split_at(dims.min(rest.len()));
    let shape: Vec<u64> = shape.iter().map(|&b| u64::from(b % 6)).collect();
    if shape.len() != dims {
        return;
    }
    let boxes: Vec<LayoutBox> = rest
        .chunks_exact(1 + 2 * dims)
        .take(64)
        .map(|b| LayoutBox {
            rank: u32::from(b[0] % 3),
            offsets: b[1..1 + dims].iter().map(|&x| u64::from(x % 7)).collect(),
            lengths: b[1 + dims..].iter().map(|&x| u64::from(x % 7)).collect(),
        })
        .collect();
    let mut manifest = Manifest::parse(SEED, OBJECT).expect("the seed is valid");
    manifest.tensors = vec![TensorEntry {
        name: "t".into(),
        dtype: DType::F32,
        shape: shape.clone(),
        layout: 0,
    }];
    manifest.layouts = vec![Layout::Boxes(boxes.clone())];
    manifest.format_version = version;
    let verdict = manifest.validate(OBJECT);
    if let Err(e) = &verdict {
        assert_eq!(e.object, OBJECT);
    }
    let mut ranks: Vec<u32> = boxes.iter().map(|b| b.rank).collect();
    ranks.sort_unstable();
    let one_box_per_rank = ranks.windows(2).all(|w| w[0] != w[1]);
    assert_eq!(
        verdict.is_ok(),
        tiles_pairwise(&boxes, &shape, manifest.world_size) && (version >= 3 || one_box_per_rank)
    );
});

fn tiles_pairwise(boxes: &[LayoutBox], shape: &[u64], world: u32) -> bool {
    let mut regions = Vec::with_capacity(boxes.len());
    for b in boxes {
        let region = Region {
            offsets: b.offsets.clone(),
            lengths: b.lengths.clone(),
        };
        if b.rank >= world || !region.within(shape) {
            return false;
        }
        regions.push(region);
    }
    let covered: u64 = regions.iter().map(|r| r.volume().unwrap_or(0)).sum();
    covered == shape.iter().product::<u64>()
        && regions
            .iter()
            .enumerate()
            .all(|(i, a)| regions[i + 1..].iter().all(|b| a.intersect(b).is_none()))
}
