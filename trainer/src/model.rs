//! The model, the synthetic task and the arithmetic, all pure functions of the seed.
//!
//! The student is a ReLU multi-layer perceptron (`layers.{i}.weight` `[out, in]`,
//! `layers.{i}.bias` `[out]`); the task is regression (mean squared error) onto the
//! outputs of a random *teacher* network (`tanh`, one hidden layer) on random inputs.
//! The teacher is not representable exactly by the student, but smooth enough that
//! the loss falls fast and far.
//!
//! Everything random is counter-based: a value is `splitmix64` of a hash of
//! (seed, stream, indices), never the continuation of a sequential generator. A
//! parameter row depends only on (seed, tensor, row); a training sample only on
//! (seed, step, sample). So no generator state needs checkpointing or resharding: the
//! data position is the step, and any rank can produce any row or any chunk.
//!
//! Determinism: a chunk's forward and backward run the same code on the same
//! (all-gathered, bitwise identical) parameters whatever rank computes it, with a
//! single-threaded GEMM ([`matrixmultiply`] without its `threading` feature), whose
//! result depends only on the shapes and the CPU features it detects at run time.
//! Bitwise identity therefore holds across world sizes and restarts on machines with
//! the same CPU features; a different CPU may select a different kernel (FMA or not).

use crate::fixed;

/// The sizes of a model, its task and its batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Preset {
    /// Preset name (`tiny`, `small`, `medium`).
    pub name: &'static str,
    /// Input features.
    pub d_in: usize,
    /// Hidden width.
    pub hidden: usize,
    /// Hidden-to-hidden layers (the model has `mid_layers + 2` linear layers).
    pub mid_layers: usize,
    /// Output features.
    pub d_out: usize,
    /// Hidden width of the teacher.
    pub teacher_hidden: usize,
    /// Samples per step (global batch), the same for every world size.
    pub batch: usize,
    /// Micro-chunks the global batch is cut into; rank `r` of `W` computes chunks
    /// `r, r+W, …`. Fixed, so that it is independent of the world size.
    pub chunks: usize,
    /// Adam learning rate.
    pub lr: f32,
}

impl Preset {
    /// The preset called `name`.
    pub fn named(name: &str) -> Option<Preset> {
        Some(match name {
            // ~1.9 k parameters: seconds for tests, even in debug builds.
            "tiny" => Preset {
                name: "tiny",
                d_in: 16,
                hidden: 32,
                mid_layers: 1,
                d_out: 4,
                teacher_hidden: 16,
                batch: 32,
                chunks: 8,
                lr: 1e-2,
            },
            // 25.2 M parameters (302 MB with both Adam moments).
            "small" => Preset {
                name: "small",
                d_in: 1024,
                hidden: 2048,
                mid_layers: 5,
                d_out: 1024,
                teacher_hidden: 64,
                batch: 128,
                chunks: 8,
                lr: 3e-4,
            },
            // 100.7 M parameters (1.2 GB with both Adam moments).
            "medium" => Preset {
                name: "medium",
                d_in: 2048,
                hidden: 4096,
                mid_layers: 5,
                d_out: 2048,
                teacher_hidden: 64,
                batch: 128,
                chunks: 8,
                lr: 2e-4,
            },
            _ => return None,
        })
    }

    /// Widths of the layers' inputs and outputs: `[d_in, hidden, …, hidden, d_out]`.
    pub fn dims(&self) -> Vec<usize> {
        let mut dims = vec![self.d_in];
        dims.extend(std::iter::repeat_n(self.hidden, self.mid_layers + 1));
        dims.push(self.d_out);
        dims
    }

    /// The parameter tensors, in a fixed order.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let dims = self.dims();
        let mut specs = Vec::new();
        for (i, pair) in dims.windows(2).enumerate() {
            let (fan_in, fan_out) = (pair[0], pair[1]);
            specs.push(TensorSpec {
                name: format!("layers.{i}.weight"),
                rows: fan_out,
                cols: fan_in,
                matrix: true,
            });
            specs.push(TensorSpec {
                name: format!("layers.{i}.bias"),
                rows: fan_out,
                cols: 1,
                matrix: false,
            });
        }
        specs
    }

    /// Number of parameters.
    pub fn parameters(&self) -> usize {
        self.tensors().iter().map(|t| t.rows * t.cols).sum()
    }

    /// Samples per chunk.
    pub fn chunk_size(&self) -> usize {
        self.batch / self.chunks
    }
}

/// One parameter tensor: `rows × cols` (a bias is `rows × 1`, stored with shape
/// `[rows]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Global name, as saved.
    pub name: String,
    /// Dim 0, the sharded one.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
    /// A weight matrix (shape `[rows, cols]`) rather than a bias (`[rows]`).
    pub matrix: bool,
}

impl TensorSpec {
    /// The global shape as ckpt records it.
    pub fn shape(&self) -> Vec<u64> {
        if self.matrix {
            vec![self.rows as u64, self.cols as u64]
        } else {
            vec![self.rows as u64]
        }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.rows * self.cols
    }
}

const STREAM_PARAM: u64 = 1;
const STREAM_TEACHER: u64 = 2;
const STREAM_INPUT: u64 = 3;

/// splitmix64's output function.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A hash of several words (a counter-based seed).
pub fn mix(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x6A09_E667_F3BC_C908, |h, &p| splitmix64(h ^ p))
}

/// A counter-based stream of uniform numbers.
struct Stream(u64);

impl Stream {
    /// Uniform in [-1, 1), exactly representable (24 random bits).
    fn uniform(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(1);
        let bits = splitmix64(self.0) >> 40;
        (bits as f32) * (2.0 / 16_777_216.0) - 1.0
    }
}

/// Initial values of rows `rows` of parameter tensor `index` (Kaiming-uniform weights
/// for ReLU, zero biases).
pub fn init_rows(
    seed: u64,
    index: usize,
    spec: &TensorSpec,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    if !spec.matrix {
        out.fill(0.0);
        return;
    }
    let scale = (6.0 / spec.cols as f32).sqrt();
    for (i, row) in rows.enumerate() {
        let mut s = Stream(mix(&[seed, STREAM_PARAM, index as u64, row as u64]));
        for x in &mut out[i * spec.cols..(i + 1) * spec.cols] {
            *x = s.uniform() * scale;
        }
    }
}

/// The teacher network: `y = W2 · tanh(W1 · x)`.
#[derive(Debug, Clone)]
pub struct Teacher {
    w1: Vec<f32>,
    w2: Vec<f32>,
    d_in: usize,
    hidden: usize,
    d_out: usize,
}

impl Teacher {
    /// The teacher of `seed`.
    pub fn new(seed: u64, preset: &Preset) -> Self {
        let (d_in, hidden, d_out) = (preset.d_in, preset.teacher_hidden, preset.d_out);
        let mut s = Stream(mix(&[seed, STREAM_TEACHER]));
        let a = (3.0 / d_in as f32).sqrt() * 1.5;
        let w1 = (0..hidden * d_in).map(|_| s.uniform() * a).collect();
        let b = (3.0 / hidden as f32).sqrt() * 1.5;
        let w2 = (0..d_out * hidden).map(|_| s.uniform() * b).collect();
        Self {
            w1,
            w2,
            d_in,
            hidden,
            d_out,
        }
    }

    fn label(&self, x: &[f32], y: &mut [f32]) {
        let mut h = vec![0f32; self.hidden];
        for (j, h) in h.iter_mut().enumerate() {
            let row = &self.w1[j * self.d_in..(j + 1) * self.d_in];
            *h = row.iter().zip(x).map(|(w, x)| w * x).sum::<f32>().tanh();
        }
        for (k, y) in y.iter_mut().enumerate().take(self.d_out) {
            let row = &self.w2[k * self.hidden..(k + 1) * self.hidden];
            *y = row.iter().zip(&h).map(|(w, h)| w * h).sum();
        }
    }
}

/// Inputs `[n, d_in]` and targets `[n, d_out]` of chunk `chunk` of step `step`.
pub fn chunk_data(
    seed: u64,
    step: u64,
    chunk: usize,
    preset: &Preset,
    teacher: &Teacher,
) -> (Vec<f32>, Vec<f32>) {
    let n = preset.chunk_size();
    let mut x = vec![0f32; n * preset.d_in];
    let mut y = vec![0f32; n * preset.d_out];
    let scale = 3f32.sqrt();
    for i in 0..n {
        let sample = (chunk * n + i) as u64;
        let mut s = Stream(mix(&[seed, STREAM_INPUT, step, sample]));
        let xi = &mut x[i * preset.d_in..(i + 1) * preset.d_in];
        for v in xi.iter_mut() {
            *v = s.uniform() * scale;
        }
        teacher.label(xi, &mut y[i * preset.d_out..(i + 1) * preset.d_out]);
    }
    (x, y)
}

/// `C = A·B` (β = 0) or `C += A·B` (β = 1) with explicit strides, single-threaded.
#[allow(clippy::too_many_arguments)]
fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    beta: f32,
    c: &mut [f32],
) {
    assert!(m == 0 || k == 0 || (m - 1) * rsa + (k - 1) * csa < a.len());
    assert!(k == 0 || n == 0 || (k - 1) * rsb + (n - 1) * csb < b.len());
    assert!(c.len() >= m * n);
    // SAFETY: the asserts above keep every index of A, B and C (row-major, m×n) in
    // bounds; the slices do not alias (C is the only mutable one).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// Where the gradient of each chunk goes.
pub enum GradSink<'a> {
    /// Exact fixed point: each chunk's gradient is truncated to `fixed::SCALE` and added
    /// into i64 accumulators (deterministic).
    Fixed {
        /// Accumulators, laid out as the flat parameters.
        acc: &'a mut [i64],
        /// f32 scratch of the same length for one chunk's gradient.
        scratch: &'a mut [f32],
    },
    /// f32 accumulation in the order of this rank's chunks (fast, not deterministic
    /// across world sizes once reduced).
    Float {
        /// Accumulators, laid out as the flat parameters.
        acc: &'a mut [f32],
    },
}

/// Forward and backward of one chunk on the full parameters `params` (flat, tensors
/// in [`Preset::tensors`] order at `offsets`). Adds the chunk's gradient of the
/// global-batch mean squared error to `sink` and returns the chunk's share of the loss
/// (its squared errors over `batch · d_out`).
pub fn chunk_step(
    preset: &Preset,
    params: &[f32],
    offsets: &[usize],
    x: &[f32],
    y: &[f32],
    sink: &mut GradSink<'_>,
) -> f64 {
    chunk_step_unless(preset, params, offsets, x, y, sink, &|| false).expect("never interrupted")
}

/// [`chunk_step`], given up (returning `None`, with `sink` partly updated) as soon as
/// `interrupted` says so between two layers: a recovery must not wait for a whole
/// chunk's compute before its survivors can re-form.
pub fn chunk_step_unless(
    preset: &Preset,
    params: &[f32],
    offsets: &[usize],
    x: &[f32],
    y: &[f32],
    sink: &mut GradSink<'_>,
    interrupted: &dyn Fn() -> bool,
) -> Option<f64> {
    let dims = preset.dims();
    let layers = dims.len() - 1;
    let n = preset.chunk_size();
    // Forward: acts[l] is the input of layer l ([n, dims[l]]).
    let mut acts: Vec<Vec<f32>> = Vec::with_capacity(layers + 1);
    acts.push(x.to_vec());
    for l in 0..layers {
        if interrupted() {
            return None;
        }
        let (fi, fo) = (dims[l], dims[l + 1]);
        let w = &params[offsets[2 * l]..offsets[2 * l] + fo * fi];
        let b = &params[offsets[2 * l + 1]..offsets[2 * l + 1] + fo];
        let mut z = vec![0f32; n * fo];
        // z = a · Wᵀ: A [n, fi] row-major; Wᵀ[k][j] = W[j][k].
        gemm(n, fi, fo, &acts[l], (fi, 1), w, (1, fi), 0.0, &mut z);
        for row in z.chunks_exact_mut(fo) {
            for (v, bias) in row.iter_mut().zip(b) {
                *v += bias;
            }
            if l + 1 < layers {
                for v in row.iter_mut() {
                    *v = v.max(0.0);
                }
            }
        }
        acts.push(z);
    }
    // Loss and its gradient.
    let out = &acts[layers];
    let denom = (preset.batch * preset.d_out) as f32;
    let mut loss = 0f64;
    let mut dz: Vec<f32> = out
        .iter()
        .zip(y)
        .map(|(o, t)| {
            let e = o - t;
            loss += f64::from(e) * f64::from(e);
            2.0 * e / denom
        })
        .collect();
    loss /= f64::from(denom);
    // Backward.
    for l in (0..layers).rev() {
        if interrupted() {
            return None;
        }
        let (fi, fo) = (dims[l], dims[l + 1]);
        let (ow, ob) = (offsets[2 * l], offsets[2 * l + 1]);
        let w = &params[ow..ow + fo * fi];
        let a = &acts[l];
        // dW = dzᵀ · a  ([fo, n] · [n, fi]); db = Σ rows of dz.
        let mut db = vec![0f32; fo];
        for row in dz.chunks_exact(fo) {
            for (d, g) in db.iter_mut().zip(row) {
                *d += g;
            }
        }
        match sink {
            GradSink::Fixed { acc, scratch } => {
                gemm(
                    fo,
                    n,
                    fi,
                    &dz,
                    (1, fo),
                    a,
                    (fi, 1),
                    0.0,
                    &mut scratch[ow..ow + fo * fi],
                );
                fixed::accumulate(&scratch[ow..ow + fo * fi], &mut acc[ow..ow + fo * fi]);
                fixed::accumulate(&db, &mut acc[ob..ob + fo]);
            }
            GradSink::Float { acc } => {
                gemm(
                    fo,
                    n,
                    fi,
                    &dz,
                    (1, fo),
                    a,
                    (fi, 1),
                    1.0,
                    &mut acc[ow..ow + fo * fi],
                );
                for (s, g) in acc[ob..ob + fo].iter_mut().zip(&db) {
                    *s += g;
                }
            }
        }
        if l > 0 {
            // da = dz · W ([n, fo] · [fo, fi]), masked by the ReLU of layer l-1.
            let mut da = vec![0f32; n * fi];
            gemm(n, fo, fi, &dz, (fo, 1), w, (fi, 1), 0.0, &mut da);
            for (g, act) in da.iter_mut().zip(a) {
                if *act <= 0.0 {
                    *g = 0.0;
                }
            }
            dz = da;
        }
    }
    Some(loss)
}

/// Adam hyper-parameters (besides the learning rate of the preset).
pub const BETA1: f32 = 0.9;
/// Second-moment decay.
pub const BETA2: f32 = 0.999;
/// Denominator floor.
pub const EPS: f32 = 1e-8;

/// One Adam step (`t` is the 1-based step count) on the rows this rank owns.
/// Element-wise and identical for every split of the rows.
pub fn adam(lr: f32, t: u64, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    let t = t.min(i32::MAX as u64) as i32;
    let c1 = (1.0 - f64::from(BETA1).powi(t)) as f32;
    let c2 = (1.0 - f64::from(BETA2).powi(t)) as f32;
    for (((p, m), v), g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        *m = BETA1 * *m + (1.0 - BETA1) * g;
        *v = BETA2 * *v + (1.0 - BETA2) * g * g;
        let mhat = *m / c1;
        let vhat = *v / c2;
        *p -= lr * mhat / (vhat.sqrt() + EPS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backward pass agrees with central finite differences of the loss.
    #[test]
    fn gradients_match_finite_differences() {
        let preset = Preset::named("tiny").unwrap();
        let specs = preset.tensors();
        let mut offsets = vec![0];
        for s in &specs {
            offsets.push(offsets.last().unwrap() + s.numel());
        }
        let mut params = vec![0f32; *offsets.last().unwrap()];
        for (i, s) in specs.iter().enumerate() {
            init_rows(3, i, s, 0..s.rows, &mut params[offsets[i]..offsets[i + 1]]);
            if !s.matrix {
                // Non-zero biases, so their gradients are exercised off the origin.
                for (k, b) in params[offsets[i]..offsets[i + 1]].iter_mut().enumerate() {
                    *b = (k as f32 * 0.37).sin() * 0.1;
                }
            }
        }
        let teacher = Teacher::new(3, &preset);
        let (x, y) = chunk_data(3, 0, 0, &preset, &teacher);
        let mut grad = vec![0f32; params.len()];
        chunk_step(
            &preset,
            &params,
            &offsets,
            &x,
            &y,
            &mut GradSink::Float { acc: &mut grad },
        );
        let loss_at = |p: &[f32]| {
            let mut scratch = vec![0f32; p.len()];
            chunk_step(
                &preset,
                p,
                &offsets,
                &x,
                &y,
                &mut GradSink::Float { acc: &mut scratch },
            )
        };
        let base = loss_at(&params);
        let (mut checked, mut kinks) = (0, 0);
        for i in (0..params.len()).step_by(37) {
            let h = 3e-3f32;
            let mut p = params.clone();
            p[i] += h;
            let up = loss_at(&p);
            p[i] -= 2.0 * h;
            let down = loss_at(&p);
            let (forward, backward) = ((up - base) / f64::from(h), (base - down) / f64::from(h));
            let numeric = (forward + backward) / 2.0;
            let analytic = f64::from(grad[i]);
            let scale = numeric.abs().max(analytic.abs()).max(1e-2);
            if (forward - backward).abs() > 0.1 * scale {
                kinks += 1; // a ReLU switches within ±h: no derivative to compare with
                continue;
            }
            assert!(
                (numeric - analytic).abs() / scale < 0.05,
                "parameter {i}: numeric {numeric}, analytic {analytic}"
            );
            checked += 1;
        }
        assert!(
            checked > 40 && kinks < checked / 4,
            "{checked} checked, {kinks} kinks"
        );
    }
}
