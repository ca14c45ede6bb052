//! The resume of a generation: one decision for the whole world.
//!
//! Each rank reads only its own rows, so a checkpoint damaged where some ranks read
//! it and not others would, decided rank by rank, resume the world from different
//! steps. Here rank 0 proposes the commits newest first, every rank tries the
//! proposal (from in-memory copies where it can, from the store otherwise), and one
//! all-reduce of the votes accepts it for all or moves every rank to the commit
//! before it. A commit whose manifest judges it unhealthy (non-finite values,
//! replicas that disagreed, a failed check) is passed over the same way, with a line
//! naming its step and reasons: a resume loads the newest *healthy* commit.

use std::collections::BTreeMap;

use ckpt::catalog::{Select, Skipped};
use ckpt::storage::Store;

use ckpt::copies::{Copies, FromCopies, Holding};

use crate::collective::{Collective, CollectiveExt};
use crate::model::TensorSpec;

use super::copies::load_from_copies;
use super::shards::{Place, Shards, shards_from_store, store_request};
use super::supervisor::{or_cancelled, unless_cancelled};
use super::{Supervisor, TrainConfig, TrainError, say};

/// What a rank reports after trying to load the proposed checkpoint.
const LOADED: i64 = 1;
/// The checkpoint is damaged where this rank reads it (or has no manifest).
const DAMAGED: i64 = 0;
/// The checkpoint's manifest judges it unhealthy: no rank resumes from it.
const UNHEALTHY: i64 = 2;

/// Loads the newest committed checkpoint that **every** rank can load, resharded onto
/// this world, or `None` when the store holds none.
///
/// One decision for the whole world: rank 0 proposes the commits newest first (in
/// commit order); every rank loads its boxes of the proposal; an all-reduce says
/// whether all succeeded. A checkpoint damaged only where some ranks read it is
/// skipped by all of them, so no rank resumes from a step the others refused.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub(super) fn load(
    comm: &dyn Collective,
    runtime: &tokio::runtime::Handle,
    store: &Store,
    config: &TrainConfig,
    specs: &[TensorSpec],
    supervisor: &dyn Supervisor,
    copies: Option<(&Copies, &[Holding])>,
    place: Place,
    mut spare: Vec<Vec<f32>>,
) -> Result<Option<(Shards, u64)>, TrainError> {
    const NONE: u64 = u64::MAX;
    let (rank, world) = (comm.rank(), comm.world_size());
    // Rank 0 walks the commits newest first, reading older history only if needed.
    let mut walk = if rank == 0 {
        Some(unless_cancelled(
            runtime,
            supervisor,
            "finding the newest commit",
            ckpt::catalog::NewestFirst::new(store),
        )?)
    } else {
        None
    };
    let mut known: Vec<ckpt::Commit> = Vec::new();
    let (found, generation, committed_dir) = loop {
        let proposal = match walk.as_mut() {
            Some(walk) => unless_cancelled(
                runtime,
                supervisor,
                "finding the newest commit",
                walk.next(),
            )?,
            None => None,
        };
        let proposal = proposal.as_ref();
        let seq = comm.broadcast_u64(0, proposal.map_or(NONE, |c| c.seq.unwrap_or(NONE - 1)))?;
        let step = comm.broadcast_u64(0, proposal.map_or(NONE, |c| c.step))?;
        if seq == NONE {
            return Ok(None);
        }
        let matches = |c: &ckpt::Commit| match c.seq {
            Some(s) => s == seq,
            None => seq == NONE - 1 && c.step == step,
        };
        let commit = match proposal {
            Some(c) => Some(c.clone()),
            None => {
                if !known.iter().any(matches) {
                    known = unless_cancelled(
                        runtime,
                        supervisor,
                        "listing the commits",
                        ckpt::catalog::commits(store),
                    )?;
                }
                known.iter().find(|c| matches(c)).cloned()
            }
        };
        let dir = commit.as_ref().map(|c| c.dir.clone());
        let attempt = match commit {
            Some(commit) => or_cancelled(runtime, supervisor, "loading", async {
                let manifest = ckpt::catalog::read_commit(store, &commit).await?;
                // An unhealthy commit (non-finite values, replicas that disagreed, a
                // failed check) is never resumed from: every rank reads the same
                // manifest, so every rank passes over it.
                if let Some(skipped) = ckpt::catalog::passes(&manifest, Select::Healthy) {
                    return Ok(Attempted::Unhealthy(skipped));
                }
                let generation = manifest.generation;
                let reader = ckpt::CheckpointReader::from_manifest(store, manifest);
                // In place: into the vectors the last generation left (pages this
                // process has touched fill faster), or new ones.
                let (request, mut tensors) = store_request(specs, place, &mut spare);
                let mut outputs: Vec<&mut [u8]> =
                    tensors.iter_mut().map(|t| ckpt::as_bytes_mut(t)).collect();
                // From the copies where the world keeps them; only a
                // generation-stamped attempt names one commit exactly.
                let from_copies = match copies {
                    Some((own, table)) if commit.attempt().is_some() => Some(
                        load_from_copies(
                            &reader,
                            &request,
                            &mut outputs,
                            own,
                            table,
                            rank,
                            supervisor,
                        )
                        .await?,
                    ),
                    _ => {
                        reader.load_into(&request, &mut outputs).await?;
                        None
                    }
                };
                let global = reader.global_state().await?;
                Ok::<_, ckpt::Error>(Attempted::Loaded(
                    Found {
                        step: reader.step(),
                        saved_world: reader.manifest().world_size,
                        tensors,
                        global,
                        from_copies,
                    },
                    generation,
                ))
            })?,
            None => Err(ckpt::Error::NotFound(format!(
                "rank {rank} cannot find commit {seq} (step {step}) that rank 0 proposed"
            ))),
        };
        let (vote, fatal) = match &attempt {
            Ok(Attempted::Loaded(..)) => (LOADED, None),
            Ok(Attempted::Unhealthy(_)) => (UNHEALTHY, None),
            Err(e) if e.is_corruption() || matches!(e, ckpt::Error::NotFound(_)) => {
                tracing::warn!(step, rank, error = %e, "checkpoint does not load here; the world falls back");
                (DAMAGED, None)
            }
            // Anything else (the store is down) ends the resume for every rank.
            Err(e) => (-(world as i64) - 1, Some(e.to_string())),
        };
        let mut votes = [
            i64::from(vote == LOADED),
            i64::from(vote == UNHEALTHY),
            vote.min(0),
        ];
        comm.all_reduce_i64(&mut votes)?;
        if votes[2] < 0 {
            return Err(TrainError::Invalid(fatal.unwrap_or_else(|| {
                format!("another rank could not read checkpoint step {step}; resume abandoned")
            })));
        }
        if votes[0] == world as i64 {
            let Ok(Attempted::Loaded(found, generation)) = attempt else {
                unreachable!("every rank loaded");
            };
            break (found, generation, dir);
        }
        if votes[1] > 0 {
            if rank == 0 {
                let why = match &attempt {
                    Ok(Attempted::Unhealthy(skipped)) => skipped.reasons.join("; "),
                    _ => "judged unhealthy on another rank".to_string(),
                };
                say(format_args!(
                    "skipped unhealthy checkpoint step {step}: {why}; trying the commit before it"
                ));
            }
            continue;
        }
        if rank == 0 {
            say(format_args!(
                "checkpoint step {step} does not load on {} of {world} ranks; falling back to the commit before it",
                world as i64 - votes[0]
            ));
        }
    };
    let Found {
        step,
        saved_world,
        tensors,
        global,
        from_copies,
    } = found;
    // Ranks whose every byte came from memory, bytes from own copies, from peers'
    // and from the store.
    let rebuilt = from_copies.as_ref().map_or([0; 4], |got| {
        [
            i64::from(got.all_from_memory()),
            got.own_bytes as i64,
            got.peer_bytes as i64,
            got.store.bytes_read as i64,
        ]
    });
    let shards = shards_from_store(step, tensors, global, config, specs)?;
    if shards.losses.len() as u64 != step {
        return Err(TrainError::Invalid(format!(
            "checkpoint step {step} records {} losses",
            shards.losses.len()
        )));
    }
    // Where the rows came from, summed over the world, for the resume line.
    let mut source = String::new();
    if let Some((own, _)) = copies {
        let mut rebuilt = rebuilt;
        comm.all_reduce_i64(&mut rebuilt)?;
        let from_store = if rebuilt[3] > 0 {
            format!(", {:.1} MB from the store", rebuilt[3] as f64 / 1e6)
        } else {
            String::new()
        };
        source = format!(
            "; rows rebuilt from memory on {} of {world} ranks ({:.1} MB own, {:.1} MB from peers{from_store})",
            rebuilt[0],
            rebuilt[1] as f64 / 1e6,
            rebuilt[2] as f64 / 1e6
        );
        if rebuilt[0] < world as i64 {
            source.push_str(", read from the store on the others");
        }
        if let Some(dir) = &committed_dir {
            own.confirm(dir);
        }
    }
    if rank == 0 {
        say(format_args!(
            "resumed from step {step} of {} (commit {}; saved by {saved_world} ranks, resharded onto {world}{source})",
            store.url(),
            committed_dir.as_deref().unwrap_or("?")
        ));
    }
    Ok(Some((shards, generation)))
}

/// What a rank's try of a proposed commit gave.
enum Attempted {
    /// Its rows and global state, and the commit's generation.
    Loaded(Found, u64),
    /// Nothing: the commit is unhealthy.
    Unhealthy(Skipped),
}

/// What a rank loaded.
struct Found {
    step: u64,
    saved_world: u32,
    /// Parameters, first and second moments of each spec in turn.
    tensors: Vec<Vec<f32>>,
    /// The non-tensor state, from the store (its checksum covers it).
    global: BTreeMap<String, ckpt::format::StateValue>,
    /// Where the rows came from, when the world keeps in-memory copies.
    from_copies: Option<FromCopies>,
}
