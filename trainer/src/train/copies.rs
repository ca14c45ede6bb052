//! The training loop's side of in-memory copies ([`crate::memory`]).
//!
//! `memory` knows copies, replicas and their checks, not the trainer's state; this
//! module is the translation in both directions: which ranks hold copies at the
//! start of a generation ([`holdings`]), each save kept as a copy of this rank's
//! rows with a replica of its ring predecessor's ([`keep_copy`]), and a resume that
//! rebuilds this rank's rows from the copies instead of the store ([`from_memory`]).

use crate::collective::Collective;
use crate::memory::{self, Holding, Memory};
use crate::model::TensorSpec;

use super::resume::Found;
use super::shards::{SAVED_AS, Shards, owned_rows};
use super::{Supervisor, TrainError, say};

/// Every rank's holding of in-memory copies (see [`memory`]), by rank.
pub(super) fn holdings(comm: &dyn Collective, memory: &Memory) -> Result<Vec<Holding>, TrainError> {
    let world = comm.world_size();
    let mut table = vec![0u8; Holding::SIZE * world];
    comm.all_gather(
        &memory.holding().encode(),
        &vec![Holding::SIZE; world],
        &mut table,
    )?;
    Ok(table
        .chunks_exact(Holding::SIZE)
        .map(Holding::decode)
        .collect())
}

/// Keeps this rank's rows of the save `handle` started as an in-memory copy, and
/// pulls a replica of its ring predecessor's copy in the background. `rot` (a test's
/// fault) flips one bit of the copy.
#[allow(clippy::too_many_arguments)]
pub(super) fn keep_copy(
    memory: &Memory,
    table: &[Holding],
    handle: &ckpt::SaveHandle,
    specs: &[TensorSpec],
    st: &Shards,
    rank: usize,
    world: usize,
    rot: bool,
) {
    let dir = handle.attempt().dir();
    let mut tensors = Vec::with_capacity(specs.len() * memory::KINDS);
    for i in 0..specs.len() {
        tensors.extend([
            memory.copy_of(&st.params[i]),
            memory.copy_of(&st.m[i]),
            memory.copy_of(&st.v[i]),
        ]);
    }
    if let Some(x) = tensors
        .iter_mut()
        .find_map(|t| t.first_mut())
        .filter(|_| rot)
    {
        *x = f32::from_bits(x.to_bits() ^ 1);
        say(format_args!(
            "fault: rank {rank} flipped a bit of its in-memory copy of step {}",
            st.step
        ));
    }
    let key = memory::Key {
        dir: dir.clone(),
        world,
        rank,
    };
    memory.keep_own(memory::RankCopy::new(key, tensors));
    if world < 2 {
        return;
    }
    let predecessor = (rank + world - 1) % world;
    if let Some(from) = table.get(predecessor).and_then(|h| h.addr) {
        let lens = specs
            .iter()
            .flat_map(|s| {
                let n = owned_rows(s, predecessor, world).len() * s.cols;
                [n; memory::KINDS]
            })
            .collect();
        let key = memory::Key {
            dir,
            world,
            rank: predecessor,
        };
        memory.replicate(from, key, lens);
    }
}

/// This rank's rows of `commit` rebuilt from the in-memory copies `table` lists (into
/// the `spare` vectors where there are some), every row checked against the block
/// CRC32s of the commit's rank parts, with the non-tensor state read from the store;
/// or `None` (the store is read instead) when the copies do not cover the rows, a
/// peer fails, or a copy does not match what was saved (logged as a warning).
#[allow(clippy::too_many_arguments)]
pub(super) fn from_memory(
    memory: &Memory,
    table: &[Holding],
    runtime: &tokio::runtime::Handle,
    store: &ckpt::storage::Store,
    commit: &ckpt::Commit,
    rank: usize,
    world: usize,
    specs: &[TensorSpec],
    supervisor: &dyn Supervisor,
    spare: Vec<Vec<f32>>,
) -> Option<(Found, u64)> {
    // Only a generation-stamped attempt names one commit exactly.
    let attempt = commit.attempt()?;
    let shapes: Vec<memory::Shape> = specs
        .iter()
        .map(|s| memory::Shape {
            rows: s.rows,
            cols: s.cols,
        })
        .collect();
    let names: Vec<String> = specs
        .iter()
        .flat_map(|s| SAVED_AS.map(|prefix| format!("{prefix}/{}", s.name)))
        .collect();
    supervisor.waiting(true);
    let rebuilt = (|| {
        let manifest = runtime
            .block_on(ckpt::catalog::read_commit(store, commit))
            .map_err(|e| memory::AssembleError::Unavailable(e.to_string()))?;
        let reader = ckpt::CheckpointReader::from_manifest(store, manifest);
        let part = |r: usize| {
            runtime
                .block_on(reader.part(r as u32))
                .map_err(|e| e.to_string())
        };
        let saved = memory::Saved {
            names: &names,
            part: &part,
        };
        let assembled = memory::assemble(
            memory,
            table,
            rank,
            world,
            &commit.dir,
            &shapes,
            &saved,
            spare,
            &|| supervisor.is_cancelled(),
        )?;
        let global = runtime
            .block_on(reader.global_state())
            .map_err(|e| memory::AssembleError::Unavailable(e.to_string()))?;
        Ok::<_, memory::AssembleError>((assembled, global))
    })();
    supervisor.waiting(false);
    match rebuilt {
        Ok((assembled, global)) => Some((
            Found::Memory {
                step: commit.step,
                assembled,
                global,
            },
            attempt.generation,
        )),
        Err(memory::AssembleError::Mismatch(e)) => {
            tracing::warn!(step = commit.step, rank, error = %e, "an in-memory copy differs from what was saved; reading the store");
            None
        }
        Err(memory::AssembleError::Unavailable(e)) => {
            tracing::info!(step = commit.step, rank, error = %e, "not rebuilt from memory; reading the store");
            None
        }
    }
}
