//! The synthetic workload every figure is measured on (seeded, so runs compare), the
//! ranks as threads, and the memcpy baseline that the stall is judged against.

use super::*;

/// Each rank's tensors: `tensors` row-major fp32 shards.
pub(super) type Workload = Vec<Vec<Vec<f32>>>;

/// splitmix64: a tiny seeded generator, so the workload is the same on every run.
pub(super) struct SplitMix(pub(super) u64);

impl SplitMix {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub(super) fn unit(&mut self) -> f64 {
        ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

/// Values from normal(0, 0.02), Box-Muller, seeded per (rank, tensor).
pub(super) fn generate(config: &BenchConfig) -> Workload {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..config.ranks)
            .map(|rank| scope.spawn(move || generate_rank(config, rank)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("generator thread panicked"))
            .collect()
    })
}

/// Rank `rank`'s tensors: its dim-0 shard of each, seeded per (rank, tensor).
pub(super) fn generate_rank(config: &BenchConfig, rank: usize) -> Vec<Vec<f32>> {
    let region = Region::dim0_shard(&[config.rows, config.cols], rank, config.ranks);
    let n = region.volume().unwrap_or(0) as usize;
    (0..config.tensors)
        .map(|t| {
            let mut rng = SplitMix(
                config.seed ^ ((rank as u64) << 32) ^ (t as u64).wrapping_mul(0x1000_0001),
            );
            let mut v = Vec::with_capacity(n);
            while v.len() < n {
                let (u1, u2) = (rng.unit(), rng.unit());
                let r = (-2.0 * u1.ln()).sqrt() * 0.02;
                let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
                v.push((r * c) as f32);
                if v.len() < n {
                    v.push((r * s) as f32);
                }
            }
            v
        })
        .collect()
}

pub(super) fn state_of<'a>(
    rank: usize,
    config: &BenchConfig,
    data: &'a [Vec<f32>],
) -> Result<State<'a>> {
    let mut state = State::new();
    for (t, values) in data.iter().enumerate() {
        state.add_dim0_shard(
            format!("layers.{t:03}.weight"),
            DType::F32,
            &[config.rows, config.cols],
            rank,
            config.ranks,
            as_bytes(values),
        )?;
    }
    state.set_rank_json("data_cursor", serde_json::json!({ "rank": rank }));
    Ok(state)
}

/// Runs `f(rank, barrier)` on `n` OS threads at once and collects the results.
pub(super) fn on_ranks<T: Send>(n: usize, f: impl Fn(usize, &Barrier) -> T + Sync) -> Vec<T> {
    let barrier = Barrier::new(n);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, barrier) = (&f, &barrier);
                scope.spawn(move || f(rank, barrier))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

pub(super) struct MemcpyFigures {
    /// Worst rank per rep, ms.
    pub(super) worst: Vec<f64>,
    /// Median per rank, ms.
    pub(super) per_rank: Vec<f64>,
}

pub(super) fn memcpy_baseline(data: &Workload, reps: usize) -> MemcpyFigures {
    let times: Vec<Vec<f64>> = on_ranks(data.len(), |rank, barrier| {
        let bytes: usize = data[rank].iter().map(|t| t.len() * 4).sum();
        // Pre-faulted destination, as the staging pool is after the first save.
        let mut dst = vec![1u8; bytes];
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            barrier.wait();
            let started = Instant::now();
            let mut offset = 0;
            for t in &data[rank] {
                let src = as_bytes(t);
                dst[offset..offset + src.len()].copy_from_slice(src);
                offset += src.len();
            }
            std::hint::black_box(&mut dst);
            times.push(ms(started.elapsed()));
        }
        times
    });
    let reps_n = times.first().map_or(0, Vec::len);
    MemcpyFigures {
        worst: (0..reps_n)
            .map(|i| times.iter().map(|t| t[i]).fold(0.0, f64::max))
            .collect(),
        per_rank: times.iter().map(|t| median(t)).collect(),
    }
}
