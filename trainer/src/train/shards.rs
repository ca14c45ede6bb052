//! One rank's training state and its saved form, both directions in one place.
//!
//! What a checkpoint holds is a contract with every later run, at any world size:
//! each parameter and both Adam moments as dim-0 shards named `PREFIX/NAME`, and as
//! global state the step, the data position, the generator description, the loss
//! history and the settings a resume must match. Writing that layout ([`state_of`])
//! and reading it back ([`store_request`], [`shards_from_store`]) sit side by side so
//! that they cannot drift apart.

use std::collections::BTreeMap;

use ckpt::{DType, LoadRequest, State, as_bytes};
use serde_json::json;

use crate::collective::shard_range;
use crate::model::{self, TensorSpec};

use super::checkpointing::huge_zeros;
use super::{TrainConfig, TrainError};

/// One rank's training state: its dim-0 shards of parameters and moments.
pub(super) struct Shards {
    pub(super) params: Vec<Vec<f32>>,
    pub(super) m: Vec<Vec<f32>>,
    pub(super) v: Vec<Vec<f32>>,
    pub(super) step: u64,
    pub(super) losses: Vec<f64>,
    /// The global norm of the last step's summed gradient, when it was measured (at
    /// the steps that save): a health metric, not saved state.
    pub(super) grad_norm: Option<f64>,
}

/// What a model tensor's parameters and Adam moments are saved as: `PREFIX/NAME`, in
/// the order a rank's state lists them.
pub(super) const SAVED_AS: [&str; 3] = ["param", "adam_m", "adam_v"];

/// The shard a rank holds and its replica group: a world of `replicas × shards`
/// ranks, rank `r` holding shard `r % shards` in replica group `r / shards`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    pub(super) shard: usize,
    pub(super) shards: usize,
    pub(super) replica: usize,
    pub(super) replicas: usize,
}

impl Place {
    /// `rank`'s place in `world` with `replicas` wanted: none (1) when `replicas` does
    /// not divide the world.
    pub(super) fn of(rank: usize, world: usize, replicas: usize) -> Self {
        let replicas = if replicas > 1 && world.is_multiple_of(replicas) {
            replicas
        } else {
            1
        };
        let shards = world / replicas;
        Place {
            shard: rank % shards,
            shards,
            replica: rank / shards,
            replicas,
        }
    }

    /// Whether this rank writes its boxes (replica group 0), rather than only
    /// checksumming them for the commit to compare.
    pub(super) fn writes(&self) -> bool {
        self.replica == 0
    }
}

/// The rows of `spec` that the ranks at `place` own.
pub(super) fn owned_rows(spec: &TensorSpec, place: Place) -> std::ops::Range<usize> {
    shard_range(spec.rows, place.shard, place.shards)
}

/// The settings a checkpoint records and a resume must match.
fn trainer_state(config: &TrainConfig) -> serde_json::Value {
    let p = &config.preset;
    json!({
        "preset": p.name,
        "seed": config.seed,
        "global_batch": p.batch,
        "chunks": p.chunks,
        "parameters": p.parameters(),
    })
}

/// The state at step 0: this rank's rows of the seeded initial parameters, zero
/// moments.
pub(super) fn init(config: &TrainConfig, specs: &[TensorSpec], place: Place) -> Shards {
    let mut params = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let rows = owned_rows(spec, place);
        let mut p = vec![0f32; rows.len() * spec.cols];
        model::init_rows(config.seed, i, spec, rows, &mut p);
        params.push(p);
    }
    let zeros: Vec<Vec<f32>> = params.iter().map(|p| vec![0f32; p.len()]).collect();
    Shards {
        params,
        m: zeros.clone(),
        v: zeros,
        step: 0,
        losses: Vec::new(),
        grad_norm: None,
    }
}

/// What a rank saves: its rows of every parameter and both Adam moments, and the
/// trainer's global state, with the loss of the step saved (and its gradient's norm,
/// when measured) as health metrics. With
/// replicas, every holder of a shard adds it as a replica, replica group 0 the
/// writer, so that the commit compares the copies.
pub(super) fn state_of<'a>(
    config: &TrainConfig,
    specs: &[TensorSpec],
    st: &'a Shards,
    place: Place,
) -> Result<State<'a>, TrainError> {
    let mut state = State::new();
    for (i, spec) in specs.iter().enumerate() {
        let shape = spec.shape();
        for (prefix, data) in SAVED_AS
            .into_iter()
            .zip([&st.params[i], &st.m[i], &st.v[i]])
        {
            let name = format!("{prefix}/{}", spec.name);
            if place.replicas > 1 {
                let region = ckpt::Region::dim0_shard(&shape, place.shard, place.shards);
                state.add_replica(
                    name,
                    DType::F32,
                    &shape,
                    region,
                    as_bytes(data),
                    place.writes(),
                )?;
            } else {
                state.add_dim0_shard(
                    name,
                    DType::F32,
                    &shape,
                    place.shard,
                    place.shards,
                    as_bytes(data),
                )?;
            }
        }
    }
    if let Some(loss) = st.losses.last() {
        state.health_metric("loss", *loss);
    }
    if let Some(norm) = st.grad_norm {
        state.health_metric("grad_norm", norm);
    }
    let batch = config.preset.batch as u64;
    state.set_global_json("step", json!(st.step));
    state.set_global_json("trainer", trainer_state(config));
    state.set_global_json(
        "data_position",
        json!({ "next_step": st.step, "samples_consumed": st.step * batch }),
    );
    state.set_global_json(
        "rng",
        json!({
            "algorithm": "counter-based splitmix64 of (seed, stream, step, sample)",
            "seed": config.seed,
            "note": "no generator state: step N's data is a function of (seed, N)",
        }),
    );
    state.set_global_json("loss_history", json!(st.losses));
    state.set_global_json(
        "optimizer",
        json!({ "kind": "adam", "lr": config.preset.lr, "beta1": model::BETA1, "beta2": model::BETA2, "eps": model::EPS, "t": st.step }),
    );
    Ok(state)
}

/// Checks a checkpoint loaded from the store against this run and turns it into
/// this rank's shards.
pub(super) fn shards_from_store(
    step: u64,
    tensors: Vec<Vec<f32>>,
    global: BTreeMap<String, ckpt::format::StateValue>,
    config: &TrainConfig,
    specs: &[TensorSpec],
) -> Result<Shards, TrainError> {
    let expect = trainer_state(config);
    let saved = global.get("trainer").and_then(|v| v.as_json()).cloned();
    for key in ["preset", "seed", "global_batch", "chunks"] {
        let saved = saved.as_ref().and_then(|s| s.get(key));
        if saved != expect.get(key) {
            return Err(TrainError::Invalid(format!(
                "checkpoint step {step} was written with {key} = {}, this run has {key} = {}",
                saved.map_or("nothing".to_string(), |v| v.to_string()),
                expect[key]
            )));
        }
    }
    let saved_step = global
        .get("step")
        .and_then(|v| v.as_json())
        .and_then(|v| v.as_u64());
    if saved_step != Some(step) {
        return Err(TrainError::Invalid(format!(
            "checkpoint step {step} records step {saved_step:?} in its global state"
        )));
    }
    let losses: Vec<f64> = global
        .get("loss_history")
        .and_then(|v| v.as_json())
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .ok_or_else(|| {
            TrainError::Invalid(format!("checkpoint step {step} has no loss_history"))
        })?;
    let mut tensors = tensors.into_iter();
    let mut shards = Shards {
        params: Vec::new(),
        m: Vec::new(),
        v: Vec::new(),
        step,
        losses,
        grad_norm: None,
    };
    for _ in specs {
        let mut next = || tensors.next().expect("three tensors per spec");
        shards.params.push(next());
        shards.m.push(next());
        shards.v.push(next());
    }
    Ok(shards)
}

/// The load of this rank's rows of every parameter and both moments (dtype and shape
/// checked), and its destinations: the `spare` vectors, sized anew (after a change of
/// world their sizes differ, but their memory is already faulted in, which makes the
/// load several times faster to write than fresh pages), or new ones backed by huge
/// pages.
pub(super) fn store_request(
    specs: &[TensorSpec],
    place: Place,
    spare: &mut Vec<Vec<f32>>,
) -> (LoadRequest, Vec<Vec<f32>>) {
    let mut request = LoadRequest::new();
    let mut tensors = Vec::with_capacity(specs.len() * 3);
    let mut spare = std::mem::take(spare).into_iter();
    for spec in specs {
        let shape = spec.shape();
        let n = owned_rows(spec, place).len() * spec.cols;
        for prefix in SAVED_AS {
            request = request.expect(
                format!("{prefix}/{}", spec.name),
                DType::F32,
                &shape,
                ckpt::Region::dim0_shard(&shape, place.shard, place.shards),
            );
            tensors.push(match spare.next() {
                Some(mut v) if v.capacity() > 0 => {
                    v.clear();
                    v.reserve_exact(n);
                    v.resize(n, 0f32);
                    v
                }
                _ => huge_zeros(n),
            });
        }
    }
    (request, tensors)
}
