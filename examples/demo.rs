//! Writes demo checkpoints, the way a data-parallel trainer would: `--world-size`
//! ranks (tasks here, processes in a real job) each save their dim-0 shard of a small
//! transformer-shaped model every step, asynchronously, keeping the newest few.
//!
//! ```text
//! cargo run --release --example demo -- file://./runs/demo --world-size 4 --steps 3
//! ckpt ls file://./runs/demo
//! ```

use std::time::Instant;

use ckpt::storage::Store;
use ckpt::{CheckpointConfig, Checkpointer, DType, State, as_bytes};

struct Args {
    url: String,
    world: usize,
    steps: u64,
    layers: usize,
    hidden: u64,
    keep: usize,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        url: String::new(),
        world: 4,
        steps: 3,
        layers: 4,
        hidden: 512,
        keep: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--world-size" => {
                args.world = value("--world-size")?
                    .parse()
                    .map_err(|e| format!("--world-size: {e}"))?
            }
            "--steps" => {
                args.steps = value("--steps")?
                    .parse()
                    .map_err(|e| format!("--steps: {e}"))?
            }
            "--layers" => {
                args.layers = value("--layers")?
                    .parse()
                    .map_err(|e| format!("--layers: {e}"))?
            }
            "--hidden" => {
                args.hidden = value("--hidden")?
                    .parse()
                    .map_err(|e| format!("--hidden: {e}"))?
            }
            "--keep" => {
                args.keep = value("--keep")?
                    .parse()
                    .map_err(|e| format!("--keep: {e}"))?
            }
            "-h" | "--help" => {
                return Err("usage: demo URL [--world-size N] [--steps N] [--layers N] [--hidden N] [--keep K]".into());
            }
            url if args.url.is_empty() && !url.starts_with('-') => args.url = url.to_string(),
            other => return Err(format!("unexpected argument {other:?}")),
        }
    }
    if args.url.is_empty() {
        return Err(
            "usage: demo URL [--world-size N] [--steps N] [--layers N] [--hidden N] [--keep K]"
                .into(),
        );
    }
    Ok(args)
}

/// The model's tensors: (name, shape).
fn model(layers: usize, hidden: u64) -> Vec<(String, Vec<u64>)> {
    let mut tensors = vec![("embed.weight".to_string(), vec![4 * hidden, hidden])];
    for l in 0..layers {
        tensors.push((
            format!("layers.{l}.attn.qkv.weight"),
            vec![3 * hidden, hidden],
        ));
        tensors.push((format!("layers.{l}.attn.out.weight"), vec![hidden, hidden]));
        tensors.push((
            format!("layers.{l}.mlp.up.weight"),
            vec![4 * hidden, hidden],
        ));
        tensors.push((
            format!("layers.{l}.mlp.down.weight"),
            vec![hidden, 4 * hidden],
        ));
        tensors.push((format!("layers.{l}.norm.weight"), vec![hidden]));
    }
    tensors
}

/// Deterministic values for `rank`'s shard of tensor `t` at `step`.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04
        })
        .collect()
}

#[tokio::main]
async fn main() {
    let args = match parse() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(args).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), ckpt::Error> {
    let store = Store::from_url(&args.url)?;
    let tensors = model(args.layers, args.hidden);
    let mut ranks = Vec::new();
    for rank in 0..args.world {
        let mut config = CheckpointConfig::new(rank, args.world);
        config.keep_last = Some(args.keep);
        let checkpointer = Checkpointer::new(store.clone(), config)?;
        // Each rank owns its shard of every parameter (as FSDP would).
        let shards: Vec<Vec<f32>> = tensors
            .iter()
            .enumerate()
            .map(|(t, (_, shape))| {
                let region = ckpt::Region::dim0_shard(shape, rank, args.world);
                values(
                    region.volume().unwrap_or(0) as usize,
                    (t * 131 + rank) as u64,
                )
            })
            .collect();
        ranks.push((checkpointer, shards));
    }
    let start_step = ckpt::latest(&store).await?.map_or(0, |m| m.step);
    for step in start_step + 1..=start_step + args.steps {
        let started = Instant::now();
        let mut handles = Vec::new();
        for (rank, (checkpointer, shards)) in ranks.iter_mut().enumerate() {
            // "Training": the weights move a little every step.
            for shard in shards.iter_mut() {
                for v in shard.iter_mut() {
                    *v *= 0.999;
                }
            }
            let mut state = State::new();
            for ((name, shape), shard) in tensors.iter().zip(shards.iter()) {
                state.add_dim0_shard(
                    name.clone(),
                    DType::F32,
                    shape,
                    rank,
                    args.world,
                    as_bytes(shard),
                )?;
            }
            state.set_global_json(
                "optimizer",
                serde_json::json!({"lr": 3e-4, "betas": [0.9, 0.95]}),
            );
            state.set_rank_json(
                "data",
                serde_json::json!({"sample": step * 1024 + rank as u64 * 256}),
            );
            state.set_metadata(
                "model",
                serde_json::json!(format!("demo-{}x{}", args.layers, args.hidden)),
            );
            handles.push(checkpointer.save(step, &state).await?);
        }
        let stall = started.elapsed();
        for handle in &handles {
            handle.committed().await?;
        }
        println!(
            "step {step}: staged in {:.1} ms, committed after {:.1} ms",
            stall.as_secs_f64() * 1e3,
            started.elapsed().as_secs_f64() * 1e3
        );
    }
    println!("checkpoints in {}", store.url());
    Ok(())
}
