//! The training loop's side of in-memory copies ([`ckpt::copies`]).
//!
//! The library keeps the copies (each save's staged file, shared with the save, and a
//! replica of the ring predecessor's), serves them and loads from them; this module
//! says when, in the trainer's terms: which ranks hold copies at the start of a
//! generation ([`holdings`]), each save kept as this rank's copy with a replica of its
//! predecessor's pulled ([`keep_copy`]), and a resume that loads this rank's rows from
//! the copies, the store filling in what they cannot deliver ([`load_from_copies`]).

use ckpt::copies::{Copies, CopyKey, FallbackReason, FromCopies, Holding, RankCopy, Sources};
use ckpt::{CheckpointReader, LoadRequest, SaveHandle};

use crate::collective::Collective;

use super::{Supervisor, TrainError, say};

/// Every rank's holding of in-memory copies, by rank.
pub(super) fn holdings(comm: &dyn Collective, copies: &Copies) -> Result<Vec<Holding>, TrainError> {
    let world = comm.world_size();
    let mut table = vec![0u8; Holding::SIZE * world];
    comm.all_gather(
        &copies.holding().encode(),
        &vec![Holding::SIZE; world],
        &mut table,
    )?;
    Ok(table
        .chunks_exact(Holding::SIZE)
        .map(Holding::decode)
        .collect())
}

/// Keeps the save `handle` follows as this rank's copy (the file it stages, shared
/// with it), and pulls a replica of its ring predecessor's copy in the background.
/// `rot` (a test's fault) keeps instead a copy of the staged file with one bit
/// flipped, once staged.
pub(super) fn keep_copy(
    runtime: &tokio::runtime::Handle,
    copies: &Copies,
    table: &[Holding],
    handle: &SaveHandle,
    rank: usize,
    world: usize,
    rot: bool,
) -> Result<(), TrainError> {
    if rot {
        let staged = runtime.block_on(handle.staged_copy())?;
        let mut bytes = staged.bytes().to_vec();
        if let Some(last) = bytes.last_mut() {
            *last ^= 1;
        }
        copies.keep_copy(RankCopy::new(staged.key().clone(), bytes));
        say(format_args!(
            "fault: rank {rank} flipped a bit of its in-memory copy of step {}",
            handle.step()
        ));
    } else {
        copies.keep(handle)?;
    }
    if world < 2 {
        return Ok(());
    }
    let predecessor = (rank + world - 1) % world;
    if let Some(from) = table.get(predecessor).and_then(|h| h.addr) {
        let key = CopyKey {
            dir: handle.attempt().dir(),
            world: world as u32,
            rank: predecessor as u32,
        };
        copies.replicate(from, key);
    }
    Ok(())
}

/// Loads this rank's boxes of the commit `reader` opened into `outputs` from the
/// copies `table` lists, verified, and from the store what they do not deliver;
/// every copy that failed is logged (a copy that differs from the save as a
/// warning).
pub(super) async fn load_from_copies(
    reader: &CheckpointReader,
    request: &LoadRequest,
    outputs: &mut [&mut [u8]],
    own: &Copies,
    table: &[Holding],
    rank: usize,
    supervisor: &dyn Supervisor,
) -> Result<FromCopies, ckpt::Error> {
    let cancelled = || supervisor.is_cancelled();
    let sources = Sources {
        own,
        table,
        rank,
        cancelled: Some(&cancelled),
    };
    let got = ckpt::copies::load_into(reader, request, outputs, &sources).await?;
    let step = reader.step();
    for fallback in &got.fallbacks {
        match &fallback.reason {
            FallbackReason::Mismatch(_) => {
                tracing::warn!(step, rank, error = %fallback, "an in-memory copy differs from what was saved; reading another copy or the store")
            }
            FallbackReason::NotHeld | FallbackReason::Unavailable(_) => {
                tracing::info!(step, rank, error = %fallback, "not rebuilt from this copy; reading another copy or the store")
            }
        }
    }
    Ok(got)
}
