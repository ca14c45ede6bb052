//! Property: whatever the source layout, world size, dtype, codec and block size, every
//! box any rank of another world size asks for loads back byte for byte equal to the
//! same box of the reference global tensor.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ckpt::storage::Store;
use ckpt::{CheckpointConfig, CheckpointReader, Checkpointer, Codec, DType, LoadRequest, Region};
use ckpt::{State, format::MIN_BLOCK_SIZE};
use proptest::prelude::*;

/// How the saving world splits one tensor.
#[derive(Debug, Clone)]
enum Source {
    /// Cut points per dimension (bit `i` of a mask: cut before index `i`); the grid's
    /// cells go to distinct ranks, the other ranks hold nothing (or an empty box).
    Grid(Vec<u16>),
    /// `Region::dim0_shard` on every rank (FSDP style).
    Dim0,
    /// The whole tensor on every rank, written by one of them.
    Replica,
}

/// Which box every loading rank asks for.
#[derive(Debug, Clone)]
enum Target {
    /// A grid as above; ranks without a cell ask for an empty box or nothing.
    Grid(Vec<u16>),
    /// Even dim-0 shards of the new world.
    Dim0,
    /// The whole tensor on every rank.
    Whole,
    /// An arbitrary (possibly empty) box per rank.
    Random,
}

#[derive(Debug, Clone)]
struct TensorSpec {
    shape: Vec<u64>,
    dtype: DType,
    source: Source,
    target: Target,
}

#[derive(Debug, Clone)]
struct Case {
    source_world: usize,
    target_world: usize,
    tensors: Vec<TensorSpec>,
    /// 0: none, 1: zstd, 2: zstd with a byte shuffle of the first tensor's dtype size.
    codec: u8,
    block_size: u64,
    step: u64,
    /// Drives the reference data, rank assignments and random boxes.
    seed: u64,
}

fn extent() -> impl Strategy<Value = u64> {
    prop_oneof![1 => Just(0u64), 3 => Just(1u64), 8 => 2u64..=9]
}

fn masks() -> impl Strategy<Value = Vec<u16>> {
    prop::collection::vec(any::<u16>(), 4)
}

fn tensor_spec() -> impl Strategy<Value = TensorSpec> {
    let source = prop_oneof![
        3 => masks().prop_map(Source::Grid),
        2 => Just(Source::Dim0),
        1 => Just(Source::Replica),
    ];
    let target = prop_oneof![
        3 => masks().prop_map(Target::Grid),
        2 => Just(Target::Dim0),
        1 => Just(Target::Whole),
        2 => Just(Target::Random),
    ];
    (
        prop::collection::vec(extent(), 0..=4),
        // Many rows, so that files span several blocks.
        prop::option::weighted(0.75, 16u64..=600),
        0..DType::ALL.len(),
        source,
        target,
    )
        .prop_map(|(mut shape, rows, dtype, source, target)| {
            if let (Some(first), Some(rows)) = (shape.first_mut(), rows) {
                *first = rows;
            }
            TensorSpec {
                shape,
                dtype: DType::ALL[dtype],
                source,
                target,
            }
        })
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..=4,
        1usize..=4,
        prop::collection::vec(tensor_spec(), 1..=4),
        0u8..3,
        prop_oneof![Just(MIN_BLOCK_SIZE), MIN_BLOCK_SIZE..=64 << 10],
        0u64..1000,
        any::<u64>(),
    )
        .prop_map(
            |(source_world, shift, tensors, codec, block_size, step, seed)| Case {
                source_world,
                // A different world size: 1..=5 without `source_world`.
                target_world: (source_world + shift - 1) % 5 + 1,
                tensors,
                codec,
                block_size,
                step,
                seed,
            },
        )
}

/// splitmix64: the deterministic choices of a case.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i as u64 + 1) as usize);
        }
        p
    }
}

/// The reference global tensor: seeded bytes.
fn global_tensor(spec: &TensorSpec, seed: u64, index: usize) -> Vec<u8> {
    let len = spec.shape.iter().product::<u64>() as usize * spec.dtype.size();
    let mut rng = Rng(seed ^ ((index as u64 + 1) << 48));
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Box `region` of a row-major global tensor, copied element by element through
/// global coordinates (independent of the library's run planner).
fn extract(global: &[u8], shape: &[u64], region: &Region, elem: usize) -> Vec<u8> {
    let volume = region.volume().unwrap() as usize;
    let mut out = Vec::with_capacity(volume * elem);
    let mut coord = vec![0u64; region.ndim()];
    for flat in 0..volume {
        let mut rem = flat as u64;
        for d in (0..region.ndim()).rev() {
            coord[d] = region.offsets[d] + rem % region.lengths[d];
            rem /= region.lengths[d];
        }
        let g = (0..shape.len()).fold(0u64, |acc, d| acc * shape[d] + coord[d]) as usize;
        out.extend_from_slice(&global[g * elem..(g + 1) * elem]);
    }
    out
}

/// The cells of a grid over `shape` with at most `world` cells: cut points from
/// `masks` (bit `i` cuts at `i·n/16`, or at `i` when `n` ≤ 16), dropped from the most
/// cut dimension until the grid fits.
fn grid(shape: &[u64], masks: &[u16], world: usize) -> Vec<Region> {
    let mut cuts: Vec<Vec<u64>> = shape
        .iter()
        .zip(masks)
        .map(|(&n, &mask)| {
            let mut c: Vec<u64> = (1..16)
                .filter(|&i| mask & (1 << i) != 0)
                .map(|i| if n <= 16 { i } else { i * n / 16 })
                .filter(|&at| at < n)
                .collect();
            c.dedup();
            c
        })
        .collect();
    while cuts.iter().map(|c| c.len() + 1).product::<usize>() > world {
        let widest = (0..cuts.len()).max_by_key(|&d| cuts[d].len()).unwrap();
        cuts[widest].pop();
    }
    let spans: Vec<Vec<(u64, u64)>> = shape
        .iter()
        .zip(&cuts)
        .map(|(&n, c)| {
            let bounds: Vec<u64> = std::iter::once(0)
                .chain(c.iter().copied())
                .chain(std::iter::once(n))
                .collect();
            bounds.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
        })
        .collect();
    let mut cells = vec![Region::full(&[])];
    for dim in &spans {
        cells = cells
            .iter()
            .flat_map(|cell| {
                dim.iter().map(move |&(offset, length)| {
                    let mut next = cell.clone();
                    next.offsets.push(offset);
                    next.lengths.push(length);
                    next
                })
            })
            .collect();
    }
    cells
}

/// An empty box of `shape` (none exists for a scalar).
fn empty_box(shape: &[u64], rng: &mut Rng) -> Option<Region> {
    if shape.is_empty() {
        return None;
    }
    let mut region = Region::full(shape);
    let d = rng.below(shape.len() as u64) as usize;
    region.lengths[d] = 0;
    Some(region)
}

/// One box a rank holds: (tensor index, box, whether this rank writes it).
type Held = (usize, Region, bool);

/// Every source rank's boxes.
fn source_layout(case: &Case, rng: &mut Rng) -> Vec<Vec<Held>> {
    let world = case.source_world;
    let mut held: Vec<Vec<Held>> = vec![Vec::new(); world];
    for (t, spec) in case.tensors.iter().enumerate() {
        let shape = &spec.shape;
        match &spec.source {
            Source::Dim0 if !shape.is_empty() => {
                for (rank, boxes) in held.iter_mut().enumerate() {
                    boxes.push((t, Region::dim0_shard(shape, rank, world), true));
                }
            }
            // Every rank holds a dim-0 shard of a scalar whole: that is a replica.
            Source::Dim0 | Source::Replica => {
                let writer = rng.below(world as u64) as usize;
                for (rank, boxes) in held.iter_mut().enumerate() {
                    boxes.push((t, Region::full(shape), rank == writer));
                }
            }
            Source::Grid(masks) => {
                let cells = grid(shape, masks, world);
                let ranks = rng.permutation(world);
                for (rank, boxes) in held.iter_mut().enumerate() {
                    let slot = ranks.iter().position(|&r| r == rank).unwrap();
                    if let Some(cell) = cells.get(slot) {
                        boxes.push((t, cell.clone(), true));
                    } else if rng.below(2) == 0
                        && let Some(empty) = empty_box(shape, rng)
                    {
                        boxes.push((t, empty, true));
                    }
                }
            }
        }
    }
    held
}

/// Every target rank's wanted boxes: (tensor index, box).
fn target_layout(case: &Case, rng: &mut Rng) -> Vec<Vec<(usize, Region)>> {
    let world = case.target_world;
    let mut wants: Vec<Vec<(usize, Region)>> = vec![Vec::new(); world];
    for (t, spec) in case.tensors.iter().enumerate() {
        let shape = &spec.shape;
        match &spec.target {
            Target::Whole => wants
                .iter_mut()
                .for_each(|w| w.push((t, Region::full(shape)))),
            Target::Dim0 => {
                for (rank, w) in wants.iter_mut().enumerate() {
                    w.push((t, Region::dim0_shard(shape, rank, world)));
                }
            }
            Target::Random => {
                for w in wants.iter_mut() {
                    let mut region = Region::full(shape);
                    for (d, &n) in shape.iter().enumerate() {
                        region.offsets[d] = rng.below(n + 1);
                        region.lengths[d] = rng.below(n - region.offsets[d] + 1);
                    }
                    w.push((t, region));
                }
            }
            Target::Grid(masks) => {
                let cells = grid(shape, masks, world);
                let ranks = rng.permutation(world);
                for (rank, w) in wants.iter_mut().enumerate() {
                    let slot = ranks.iter().position(|&r| r == rank).unwrap();
                    if let Some(cell) = cells.get(slot) {
                        w.push((t, cell.clone()));
                    } else if let Some(empty) = empty_box(shape, rng) {
                        w.push((t, empty));
                    }
                }
            }
        }
    }
    wants
}

fn name(t: usize) -> String {
    format!("layers.{t}.weight")
}

static STORES: AtomicU64 = AtomicU64::new(0);

async fn run_case(case: &Case) -> Result<(), String> {
    let mut rng = Rng(case.seed);
    let globals: Vec<Vec<u8>> = case
        .tensors
        .iter()
        .enumerate()
        .map(|(t, spec)| global_tensor(spec, case.seed, t))
        .collect();
    let held = source_layout(case, &mut rng);
    let wants = target_layout(case, &mut rng);
    let codec = match case.codec {
        0 => Codec::None,
        1 => Codec::Zstd {
            level: 1,
            shuffle: 0,
        },
        _ => Codec::Zstd {
            level: 1,
            shuffle: case.tensors[0].dtype.size() as u32,
        },
    };

    let url = format!(
        "memory://reshard-proptest-{}-{}",
        std::process::id(),
        STORES.fetch_add(1, Ordering::Relaxed)
    );
    let store = Store::from_url(&url).map_err(|e| e.to_string())?;

    // Each source rank's box data, cut out of the reference tensors.
    let data: Vec<Vec<Vec<u8>>> = held
        .iter()
        .map(|boxes| {
            boxes
                .iter()
                .map(|(t, region, _)| {
                    let spec = &case.tensors[*t];
                    extract(&globals[*t], &spec.shape, region, spec.dtype.size())
                })
                .collect()
        })
        .collect();
    let mut handles = Vec::new();
    for (rank, boxes) in held.iter().enumerate() {
        let mut config = CheckpointConfig::new(rank, case.source_world);
        config.block_size = case.block_size;
        config.codec = codec;
        config.commit_timeout = Duration::from_secs(30);
        let checkpointer = Checkpointer::new(store.clone(), config).map_err(|e| e.to_string())?;
        let mut state = State::new();
        for ((t, region, write), bytes) in boxes.iter().zip(&data[rank]) {
            let spec = &case.tensors[*t];
            state
                .add_replica(
                    name(*t),
                    spec.dtype,
                    &spec.shape,
                    region.clone(),
                    bytes,
                    *write,
                )
                .map_err(|e| format!("rank {rank}: add {}: {e}", name(*t)))?;
        }
        state.set_rank_json("rank", serde_json::json!(rank));
        let outcome = checkpointer
            .save(case.step, &state)
            .await
            .map_err(|e| format!("rank {rank}: save: {e}"))?;
        handles.push(outcome);
    }
    for (rank, handle) in handles.iter().enumerate() {
        handle
            .committed()
            .await
            .map_err(|e| format!("rank {rank}: commit: {e}"))?;
    }

    let reader = CheckpointReader::open(&store, Some(case.step))
        .await
        .map_err(|e| format!("open: {e}"))?;
    if reader.manifest().tensors.len() != case.tensors.len() {
        return Err(format!(
            "manifest lists {} tensors, {} were saved",
            reader.manifest().tensors.len(),
            case.tensors.len()
        ));
    }
    let states = reader
        .rank_states()
        .await
        .map_err(|e| format!("rank states: {e}"))?;
    for (rank, state) in &states {
        let value = state.get("rank").and_then(|v| v.as_json()).cloned();
        if value != Some(serde_json::json!(*rank)) {
            return Err(format!("rank {rank}'s state reads back as {value:?}"));
        }
    }
    for (rank, boxes) in wants.iter().enumerate() {
        let mut request = LoadRequest::new();
        for (t, region) in boxes {
            let spec = &case.tensors[*t];
            request = request.expect(name(*t), spec.dtype, &spec.shape, region.clone());
        }
        let loaded = reader
            .load(&request)
            .await
            .map_err(|e| format!("target rank {rank}: load: {e}"))?;
        if loaded.tensors.len() != boxes.len() {
            return Err(format!(
                "target rank {rank}: {} tensors for {} wants",
                loaded.tensors.len(),
                boxes.len()
            ));
        }
        for ((t, region), got) in boxes.iter().zip(&loaded.tensors) {
            let spec = &case.tensors[*t];
            let expected = extract(&globals[*t], &spec.shape, region, spec.dtype.size());
            if got.region != *region || got.data != expected {
                let first_diff = got
                    .data
                    .iter()
                    .zip(&expected)
                    .position(|(a, b)| a != b)
                    .unwrap_or(got.data.len().min(expected.len()));
                return Err(format!(
                    "target rank {rank}: {} box {region} ({} {:?}): {} bytes loaded, {} expected, first difference at byte {first_diff}",
                    name(*t),
                    spec.dtype,
                    spec.shape,
                    got.data.len(),
                    expected.len()
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn any_box_of_any_layout_loads_back_exactly(case in case()) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let result = runtime.block_on(run_case(&case));
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}

#[test]
fn grids_tile_the_shape_and_fit_the_world() {
    for (shape, world) in [
        (vec![5u64, 7], 3usize),
        (vec![9, 1, 4], 4),
        (vec![], 2),
        (vec![300, 2], 5),
    ] {
        let cells = grid(&shape, &[u16::MAX; 4], world);
        assert!(
            cells.len() <= world,
            "{} cells for world {world}",
            cells.len()
        );
        let covered: u64 = cells.iter().map(|c| c.volume().unwrap()).sum();
        assert_eq!(covered, shape.iter().product::<u64>());
        for (i, a) in cells.iter().enumerate() {
            assert!(a.within(&shape));
            assert!(cells[i + 1..].iter().all(|b| a.intersect(b).is_none()));
        }
    }
}
