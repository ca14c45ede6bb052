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
//!
//! A world of more than one rank loads cooperatively (module `cooperative`; off with
//! [`TrainConfig::cooperative_load`] false): rank 0 alone looks at the store for the
//! commit and shares it, and every byte of the checkpoint is read from the store once
//! for the world. The resume line gives the load's figures, summed over the ranks:
//! bytes from the store, the unique bytes the world needed, bytes passed between
//! ranks, and the store's requests by kind (the whole resume's, fallbacks included).

use std::collections::BTreeMap;

use ckpt::catalog::Select;
use ckpt::load::LoadStats;
use ckpt::storage::Store;

use ckpt::copies::{Copies, FromCopies, Holding};

use crate::collective::{Collective, CollectiveExt};
use crate::model::TensorSpec;

use super::cooperative::{self, ranks_text};
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

/// What a resume reads and writes with, the same for every commit it tries.
#[derive(Clone, Copy)]
pub(super) struct Resume<'a> {
    pub(super) comm: &'a dyn Collective,
    pub(super) runtime: &'a tokio::runtime::Handle,
    /// The store, with a request counter of the resume's own.
    pub(super) store: &'a Store,
    pub(super) supervisor: &'a dyn Supervisor,
    pub(super) specs: &'a [TensorSpec],
    pub(super) place: Place,
    pub(super) copies: Option<(&'a Copies, &'a [Holding])>,
}

/// Loads the newest committed checkpoint that **every** rank can load, resharded onto
/// this world, or `None` when the store holds none.
///
/// One decision for the whole world: rank 0 proposes the commits newest first (in
/// commit order); every rank loads its boxes of the proposal (together, when
/// cooperative); an all-reduce says whether all succeeded. A checkpoint damaged only
/// where some ranks read it is skipped by all of them, so no rank resumes from a step
/// the others refused.
#[allow(clippy::too_many_arguments)]
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
    // The resume's own count of requests, apart from a save still in flight.
    let store = &store.with_own_counter();
    let resume = Resume {
        comm,
        runtime,
        store,
        supervisor,
        specs,
        place,
        copies,
    };
    let together = config.cooperative_load && world > 1;
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
    let (found, generation) = loop {
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
        let tried = if together {
            cooperative::try_commit(&resume, proposal, step, &mut spare)?
        } else {
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
            match commit {
                Some(commit) => try_alone(&resume, &commit, &mut spare)?,
                None => Tried::Damaged(format!(
                    "rank {rank} cannot find commit {seq} (step {step}) that rank 0 proposed"
                )),
            }
        };
        let vote = match &tried {
            Tried::Loaded(..) => LOADED,
            Tried::Unhealthy(_) => UNHEALTHY,
            Tried::Damaged(_) => DAMAGED,
            // Anything else (the store is down) ends the resume for every rank.
            Tried::Failed(_) => -(world as i64) - 1,
        };
        let mut votes = [
            i64::from(vote == LOADED),
            i64::from(vote == UNHEALTHY),
            vote.min(0),
        ];
        comm.all_reduce_i64(&mut votes)?;
        if votes[2] < 0 {
            return Err(TrainError::Invalid(match tried {
                Tried::Failed(why) => why,
                _ => {
                    format!("another rank could not read checkpoint step {step}; resume abandoned")
                }
            }));
        }
        if votes[0] == world as i64 {
            let Tried::Loaded(found, generation) = tried else {
                unreachable!("every rank loaded");
            };
            break (found, generation);
        }
        if votes[1] > 0 {
            if rank == 0 {
                let why = match &tried {
                    Tried::Unhealthy(why) => why.clone(),
                    _ => "judged unhealthy on another rank".to_string(),
                };
                say(format_args!(
                    "skipped unhealthy checkpoint step {step}: {why}; trying the commit before it"
                ));
            }
            continue;
        }
        if rank == 0 {
            // Loaded together, every rank knows why; alone, each rank logged its own.
            match &tried {
                Tried::Damaged(why) if together => say(format_args!(
                    "checkpoint step {step} does not load ({why}); falling back to the commit before it"
                )),
                _ => say(format_args!(
                    "checkpoint step {step} does not load on {} of {world} ranks; falling back to the commit before it",
                    world as i64 - votes[0]
                )),
            }
        }
    };
    let Found {
        step,
        saved_world,
        dir,
        tensors,
        global,
        from_copies,
        stats,
    } = *found;
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
        own.confirm(&dir);
    }
    let figures = load_figures(comm, together, &stats, store.request_counts())?;
    if rank == 0 {
        say(format_args!(
            "resumed from step {step} of {} (commit {dir}; saved by {saved_world} ranks, resharded onto {world}{source}; {figures})",
            store.url(),
        ));
    }
    tracing::debug!(
        rank,
        step,
        bytes_read_from_store = stats.bytes_read_from_store,
        bytes_received_from_peers = stats.bytes_received_from_peers,
        unique_bytes_served = stats.unique_bytes,
        requests = ?store.request_counts(),
        "this rank's load"
    );
    Ok(Some((shards, generation)))
}

/// The load's figures summed over the world, for the resume line: the bytes read
/// from the store, (loaded together) the unique bytes the world needed and the bytes
/// passed between ranks, and the store's requests by kind with the ranks that
/// listed.
fn load_figures(
    comm: &dyn Collective,
    together: bool,
    stats: &LoadStats,
    requests: ckpt::storage::RequestCounts,
) -> Result<String, TrainError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut sums = vec![0i64; 7 + world];
    sums[..7].copy_from_slice(&[
        stats.bytes_read_from_store as i64,
        stats.unique_bytes as i64,
        stats.bytes_received_from_peers as i64,
        stats.peer_blocks_rejected as i64,
        requests.list as i64,
        requests.get as i64,
        requests.head as i64,
    ]);
    sums[7 + rank] = requests.list as i64;
    comm.all_reduce_i64(&mut sums)?;
    let listed: Vec<usize> = (0..world).filter(|r| sums[7 + r] > 0).collect();
    let listed = match listed.as_slice() {
        [] => "none".to_string(),
        [only] => format!("rank {only} only"),
        many => format!("ranks {}", ranks_text(many)),
    };
    let bytes = if together {
        let rejected = if sums[3] > 0 {
            format!(", {} blocks from peers rejected and read again", sums[3])
        } else {
            String::new()
        };
        format!(
            "cooperative load: {} bytes from the store ({} unique), {} bytes from peers{rejected}",
            sums[0], sums[1], sums[2]
        )
    } else {
        format!("load: {} bytes from the store", sums[0])
    };
    Ok(format!(
        "{bytes}; store requests {} LIST (by {listed}), {} GET, {} HEAD",
        sums[4], sums[5], sums[6]
    ))
}

/// Whether `e` says the checkpoint is damaged (or gone) where this rank reads it:
/// the world then falls back to the commit before it. Any other error (the store is
/// down) ends the resume.
pub(super) fn damages(e: &ckpt::Error) -> bool {
    e.is_corruption() || matches!(e, ckpt::Error::NotFound(_))
}

/// This rank's try of `commit`, on its own: it reads the manifest, and loads its
/// rows from in-memory copies where the world keeps them, from the store otherwise.
fn try_alone(
    resume: &Resume<'_>,
    commit: &ckpt::Commit,
    spare: &mut Vec<Vec<f32>>,
) -> Result<Tried, TrainError> {
    let Resume {
        runtime,
        store,
        supervisor,
        specs,
        place,
        copies,
        ..
    } = *resume;
    let rank = resume.comm.rank();
    let attempt = or_cancelled(runtime, supervisor, "loading", async {
        let manifest = ckpt::catalog::read_commit(store, commit).await?;
        // An unhealthy commit (non-finite values, replicas that disagreed, a
        // failed check) is never resumed from: every rank reads the same
        // manifest, so every rank passes over it.
        if let Some(skipped) = ckpt::catalog::passes(&manifest, Select::Healthy) {
            return Ok(Tried::Unhealthy(skipped.reasons.join("; ")));
        }
        let generation = manifest.generation;
        let reader = ckpt::CheckpointReader::from_manifest(store, manifest);
        // In place: into the vectors the last generation left (pages this
        // process has touched fill faster), or new ones.
        let (request, mut tensors) = store_request(specs, place, spare);
        let mut outputs: Vec<&mut [u8]> =
            tensors.iter_mut().map(|t| ckpt::as_bytes_mut(t)).collect();
        // From the copies where the world keeps them; only a
        // generation-stamped attempt names one commit exactly.
        let (stats, from_copies) = match copies {
            Some((own, table)) if commit.attempt().is_some() => {
                let got = load_from_copies(
                    &reader,
                    &request,
                    &mut outputs,
                    own,
                    table,
                    rank,
                    supervisor,
                )
                .await?;
                (got.store, Some(got))
            }
            _ => (reader.load_into(&request, &mut outputs).await?, None),
        };
        drop(outputs);
        let global = reader.global_state().await?;
        Ok::<_, ckpt::Error>(Tried::Loaded(
            Box::new(Found {
                step: reader.step(),
                saved_world: reader.manifest().world_size,
                dir: commit.dir.clone(),
                tensors,
                global,
                from_copies,
                stats,
            }),
            generation,
        ))
    })?;
    Ok(match attempt {
        Ok(tried) => tried,
        Err(e) if damages(&e) => {
            let step = commit.step;
            tracing::warn!(step, rank, error = %e, "checkpoint does not load here; the world falls back");
            Tried::Damaged(e.to_string())
        }
        Err(e) => Tried::Failed(e.to_string()),
    })
}

/// What a rank's try of a proposed commit gave.
pub(super) enum Tried {
    /// Its rows and global state, and the commit's generation.
    Loaded(Box<Found>, u64),
    /// Nothing: the commit is unhealthy, for this reason.
    Unhealthy(String),
    /// Nothing: the checkpoint is damaged (or missing) where this rank (or, loaded
    /// together, some rank) reads it; the world falls back to the commit before it.
    Damaged(String),
    /// Nothing: an error that ends the resume (the store is down).
    Failed(String),
}

/// What a rank loaded.
pub(super) struct Found {
    pub(super) step: u64,
    pub(super) saved_world: u32,
    /// The commit's directory.
    pub(super) dir: String,
    /// Parameters, first and second moments of each spec in turn.
    pub(super) tensors: Vec<Vec<f32>>,
    /// The non-tensor state, from the store (its checksum covers it).
    pub(super) global: BTreeMap<String, ckpt::format::StateValue>,
    /// Where the rows came from, when the world keeps in-memory copies.
    pub(super) from_copies: Option<FromCopies>,
    /// This rank's load (the store's share of it, from copies).
    pub(super) stats: LoadStats,
}
