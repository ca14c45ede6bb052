//! A resume in which every byte of the checkpoint is read from the store once per
//! world, and the ranks pass the rest to each other over their own collective
//! ([`ckpt::load::Cooperative`] explains the library's side).
//!
//! Read rank by rank, R replicas of a shard fetch the same bytes R times, rows that
//! two new ranks share after a resharding are fetched twice, and every rank lists
//! the commit log and reads the manifest and the rank parts: the store serves the
//! world many times over what it needs, and at scale its request rate and egress,
//! not any disk, bound the resume. Here, for one proposed commit:
//!
//! 1. rank 0 alone reads the commit, judges its health and fetches its parts, and
//!    broadcasts them ([`CheckpointReader::share`]); the others open the commit from
//!    those bytes, checked as if read from the store, without a request;
//! 2. each rank plans its own rows as a load on its own would, and asks the owner of
//!    each needed block for it (one all-to-all of the requests);
//! 3. each owner reads what it was asked from the store, the union once, and the
//!    blocks travel (one all-to-all); each receiver verifies every block against the
//!    save's CRC32s before using it, and reads a block that fails from the store.
//!
//! Every step's failure is agreed on before the next collective ([`agree`]): a rank
//! whose step failed tells the others, and every rank ends the try with the same
//! outcome naming that rank and its error, rather than waiting for it in a
//! collective it will never enter. A damaged checkpoint (a block that fails its
//! CRC32 at its owner, a missing object) makes the whole world fall back to the
//! commit before it, as a rank-by-rank resume does; any other error ends the resume.
//!
//! The collective has no point-to-point operation, so the all-to-all is built from
//! all-gathers ([`all_to_all`]): each round gathers every rank's buffers for one or
//! more fixed shifts of the destination, bounded in bytes, and each rank keeps what
//! was meant for it. On the TCP ring that moves each buffer around the whole ring,
//! about twice the bytes of routing it to its destination only; the loopback and
//! datacenter networks this trainer runs on are far faster than the store, whose
//! bytes are what this saves.

use ckpt::CheckpointReader;
use ckpt::catalog::{Commit, Select};

use crate::collective::{Collective, CollectiveError};

use super::TrainError;
use super::copies::load_from_copies;
use super::resume::{Found, Resume, Tried, damages};
use super::shards::store_request;
use super::supervisor::or_cancelled;

/// The most bytes one round of [`all_to_all`] gathers (at least one shift's worth,
/// however large).
const ROUND_BYTES: usize = 64 << 20;

/// What rank 0 broadcasts about the commit it opened.
const SHARED: u64 = 0;
/// The commit's manifest judges it unhealthy; the payload says why.
const UNHEALTHY: u64 = 1;
/// Rank 0 found it damaged (or missing); the payload is the error.
const DAMAGED: u64 = 2;
/// Rank 0 could not read it (the store is down); the payload is the error.
const FAILED: u64 = 3;

/// Rank 0's look at the store.
enum Opened {
    Shared(Box<CheckpointReader>, Vec<u8>),
    Unhealthy(String),
}

/// This rank's try of the commit rank 0 proposed (`commit`, known on rank 0 only),
/// loaded together with the rest of the world. Every rank returns the same outcome
/// (but for the rows it loaded); a collective's failure, or a cancellation, is an
/// error.
pub(super) fn try_commit(
    resume: &Resume<'_>,
    commit: Option<&Commit>,
    step: u64,
    spare: &mut Vec<Vec<f32>>,
) -> Result<Tried, TrainError> {
    let Resume {
        comm,
        runtime,
        store,
        supervisor,
        ..
    } = *resume;
    let rank = comm.rank();
    let loading = |what: &str| format!("loading checkpoint step {step} ({what})");
    // 1. Rank 0 opens the commit and shares it.
    let mut header = [0u8; 16];
    let mut payload = Vec::new();
    let mut opener = None;
    if rank == 0 {
        let opened = or_cancelled(runtime, supervisor, &loading("opening"), async {
            let commit = commit.ok_or_else(|| {
                ckpt::Error::NotFound(format!("commit of step {step}, proposed but not held"))
            })?;
            let manifest = ckpt::catalog::read_commit(store, commit).await?;
            if let Some(skipped) = ckpt::catalog::passes(&manifest, Select::Healthy) {
                return Ok(Opened::Unhealthy(skipped.reasons.join("; ")));
            }
            let reader = CheckpointReader::from_manifest(store, manifest);
            let shared = reader.share().await?;
            Ok::<_, ckpt::Error>(Opened::Shared(Box::new(reader), shared))
        })?;
        let kind = match opened {
            Ok(Opened::Shared(reader, shared)) => {
                opener = Some(reader);
                payload = shared;
                SHARED
            }
            Ok(Opened::Unhealthy(why)) => {
                payload = why.into_bytes();
                UNHEALTHY
            }
            Err(e) if damages(&e) => {
                tracing::warn!(step, rank, error = %e, "checkpoint does not load here; the world falls back");
                payload = e.to_string().into_bytes();
                DAMAGED
            }
            Err(e) => {
                payload = e.to_string().into_bytes();
                FAILED
            }
        };
        header[..8].copy_from_slice(&kind.to_le_bytes());
        header[8..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    }
    comm.broadcast(0, &mut header)?;
    let kind = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
    payload.resize(len as usize, 0);
    comm.broadcast(0, &mut payload)?;
    let text = || String::from_utf8_lossy(&payload).into_owned();
    match kind {
        SHARED => {}
        UNHEALTHY => return Ok(Tried::Unhealthy(text())),
        DAMAGED => {
            return Ok(Tried::Damaged(format!(
                "rank 0 could not open it: {}",
                text()
            )));
        }
        _ => {
            return Ok(Tried::Failed(format!(
                "rank 0 could not open checkpoint step {step}: {}",
                text()
            )));
        }
    }
    let opened = match opener {
        Some(reader) => Ok(*reader),
        None => CheckpointReader::from_shared(store, &payload),
    };
    drop(payload);
    let reader = match agree(comm, "opening the commit rank 0 shared", opened)? {
        Ok(reader) => reader,
        Err(tried) => return Ok(tried),
    };

    // 2. Each rank plans its rows; in-memory copies, where the world keeps them,
    // deliver them instead.
    let generation = reader.manifest().generation;
    let (request, mut tensors) = store_request(resume.specs, resume.place, spare);
    let mut outputs: Vec<&mut [u8]> = tensors.iter_mut().map(|t| ckpt::as_bytes_mut(t)).collect();
    let (stats, from_copies) = match resume.copies {
        Some((own, table)) if reader.manifest().attempt.is_some() => {
            let got = or_cancelled(
                runtime,
                supervisor,
                &loading("from in-memory copies"),
                load_from_copies(
                    &reader,
                    &request,
                    &mut outputs,
                    own,
                    table,
                    rank,
                    supervisor,
                ),
            )?;
            match agree(comm, "loading from in-memory copies", got)? {
                Ok(got) => (got.store, Some(got)),
                Err(tried) => return Ok(tried),
            }
        }
        _ => {
            let planned = or_cancelled(runtime, supervisor, &loading("planning"), async {
                let plan = reader.plan(&request).await?;
                reader.cooperate(plan, rank, comm.world_size())
            })?;
            let mut job = match agree(comm, "planning its rows", planned)? {
                Ok(job) => job,
                Err(tried) => return Ok(tried),
            };
            // 3. The requests to each owner, what each owner reads, the blocks back.
            let asks = job.asks();
            let sizes: Vec<u64> = asks.iter().map(|a| a.len() as u64).collect();
            let asked = all_to_all(comm, &sizes, &mut |to, out| {
                out.copy_from_slice(&asks[to]);
            })?;
            let asked: Vec<&[u8]> = asked.iter().map(Vec::as_slice).collect();
            let served = or_cancelled(
                runtime,
                supervisor,
                &loading("reading its blocks from the store"),
                job.serve(&asked),
            )?;
            let sizes = match agree(comm, "reading its blocks from the store", served)? {
                Ok(sizes) => sizes,
                Err(tried) => return Ok(tried),
            };
            let unique = job.unique_bytes_served();
            let mut unsent = None;
            let received = all_to_all(comm, &sizes, &mut |to, out| {
                if let Err(e) = job.write_sent(to, out) {
                    unsent.get_or_insert(e);
                }
            })?;
            if let Err(tried) = agree(comm, "sending its blocks", unsent.map_or(Ok(()), Err))? {
                return Ok(tried);
            }
            let received: Vec<&[u8]> = received.iter().map(Vec::as_slice).collect();
            let finished = or_cancelled(
                runtime,
                supervisor,
                &loading("verifying what the peers sent"),
                job.finish(&request, &received, &mut outputs),
            )?;
            match agree(
                comm,
                "verifying and placing the blocks peers sent",
                finished,
            )? {
                Ok(mut stats) => {
                    stats.unique_bytes = unique;
                    (stats, None)
                }
                Err(tried) => return Ok(tried),
            }
        }
    };
    drop(outputs);
    // The parts are held: no request.
    let global = runtime.block_on(reader.global_state());
    let global = match agree(comm, "reading the global state", global)? {
        Ok(global) => global,
        Err(tried) => return Ok(tried),
    };
    Ok(Tried::Loaded(
        Box::new(Found {
            step: reader.step(),
            saved_world: reader.manifest().world_size,
            dir: reader.manifest().dir(),
            tensors,
            global,
            from_copies,
            stats,
        }),
        generation,
    ))
}

/// The world's verdict on one step of a cooperative load that each rank ran on its
/// own: `Ok` with this rank's result when it succeeded on every rank; otherwise the
/// same outcome on every rank, naming the ranks it failed on and the first one's
/// error: [`Tried::Failed`] when any rank failed other than by damage (the store is
/// down, a bug), [`Tried::Damaged`] when the checkpoint is damaged where some rank
/// read it.
pub(super) fn agree<T>(
    comm: &dyn Collective,
    what: &str,
    mine: Result<T, ckpt::Error>,
) -> Result<Result<T, Tried>, TrainError> {
    let world = comm.world_size();
    let (code, message) = match &mine {
        Ok(_) => (0u64, Vec::new()),
        Err(e) if damages(e) => (1, e.to_string().into_bytes()),
        Err(e) => (2, e.to_string().into_bytes()),
    };
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(&code.to_le_bytes());
    header[8..].copy_from_slice(&(message.len() as u64).to_le_bytes());
    let mut headers = vec![0u8; 16 * world];
    comm.all_gather(&header, &vec![16; world], &mut headers)?;
    let field = |rank: usize, at: usize| {
        u64::from_le_bytes(
            headers[16 * rank + at..16 * rank + at + 8]
                .try_into()
                .expect("8 bytes"),
        )
    };
    let codes: Vec<u64> = (0..world).map(|r| field(r, 0)).collect();
    if codes.iter().all(|c| *c == 0) {
        return Ok(Ok(mine.unwrap_or_else(|_| {
            unreachable!("this rank agreed it succeeded")
        })));
    }
    let lengths: Vec<usize> = (0..world).map(|r| field(r, 8) as usize).collect();
    let mut messages = vec![0u8; lengths.iter().sum()];
    comm.all_gather(&message, &lengths, &mut messages)?;
    let worst = codes.iter().copied().max().unwrap_or(0);
    let failed: Vec<usize> = (0..world).filter(|r| codes[*r] == worst).collect();
    let first = failed[0];
    let start: usize = lengths[..first].iter().sum();
    let error = String::from_utf8_lossy(&messages[start..start + lengths[first]]);
    let others = if failed.len() > 1 {
        format!(
            " (and on {} more: {})",
            failed.len() - 1,
            ranks_text(&failed[1..])
        )
    } else {
        String::new()
    };
    let text = format!("{what} failed on rank {first}{others}: {error}");
    Ok(Err(if worst == 1 {
        Tried::Damaged(text)
    } else {
        Tried::Failed(format!("cooperative load: {text}"))
    }))
}

/// Rank numbers as a short list: `1, 2, 5`, the first eight and a count after.
pub(super) fn ranks_text(ranks: &[usize]) -> String {
    let mut text = ranks
        .iter()
        .take(8)
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if ranks.len() > 8 {
        text.push_str(&format!(" and {} more", ranks.len() - 8));
    }
    text
}

/// Sends `sizes[to]` bytes to each other rank `to`, which `fill(to, buffer)` writes,
/// and returns what each rank sent this one, by rank (this rank's own entry empty).
/// Every rank calls it together; `sizes` has one entry per rank (this rank's own is
/// ignored).
///
/// Built from all-gathers (see the module docs): the table of every rank's sizes
/// first, then rounds, each gathering every rank's buffers for a run of shifts `k`
/// (rank `r` sends to `r + k`), as many shifts as fit in [`ROUND_BYTES`].
pub(super) fn all_to_all(
    comm: &dyn Collective,
    sizes: &[u64],
    fill: &mut dyn FnMut(usize, &mut [u8]),
) -> Result<Vec<Vec<u8>>, CollectiveError> {
    all_to_all_in_rounds(comm, sizes, fill, ROUND_BYTES)
}

/// [`all_to_all`], each round gathering at most `round_bytes` (or one shift).
fn all_to_all_in_rounds(
    comm: &dyn Collective,
    sizes: &[u64],
    fill: &mut dyn FnMut(usize, &mut [u8]),
    round_bytes: usize,
) -> Result<Vec<Vec<u8>>, CollectiveError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    if sizes.len() != world {
        return Err(CollectiveError::Invalid {
            op: "all_to_all",
            message: format!("{} sizes for a world of {world}", sizes.len()),
        });
    }
    let row: Vec<u8> = (0..world)
        .flat_map(|to| if to == rank { 0 } else { sizes[to] }.to_le_bytes())
        .collect();
    let mut table = vec![0u8; 8 * world * world];
    comm.all_gather(&row, &vec![8 * world; world], &mut table)?;
    let size = |from: usize, to: usize| {
        let at = 8 * (from * world + to);
        u64::from_le_bytes(table[at..at + 8].try_into().expect("8 bytes")) as usize
    };
    // What every rank sends in shift `k`.
    let shift_bytes =
        |k: usize| -> usize { (0..world).map(|from| size(from, (from + k) % world)).sum() };
    let mut received: Vec<Vec<u8>> = (0..world).map(|from| vec![0u8; size(from, rank)]).collect();
    let mut first = 1;
    while first < world {
        let mut end = first;
        let mut total = 0;
        while end < world {
            let more = shift_bytes(end);
            if end > first && total + more > round_bytes {
                break;
            }
            total += more;
            end += 1;
        }
        let shifts = first..end;
        first = end;
        if total == 0 {
            continue;
        }
        let counts: Vec<usize> = (0..world)
            .map(|from| shifts.clone().map(|k| size(from, (from + k) % world)).sum())
            .collect();
        let mut mine = vec![0u8; counts[rank]];
        let mut at = 0;
        for k in shifts.clone() {
            let to = (rank + k) % world;
            let n = size(rank, to);
            fill(to, &mut mine[at..at + n]);
            at += n;
        }
        let mut out = vec![0u8; total];
        comm.all_gather(&mine, &counts, &mut out)?;
        let mut base = 0;
        for (from, count) in counts.iter().enumerate() {
            let k = (rank + world - from) % world;
            if from != rank && shifts.contains(&k) {
                let offset: usize = (shifts.start..k)
                    .map(|j| size(from, (from + j) % world))
                    .sum();
                let n = received[from].len();
                received[from].copy_from_slice(&out[base + offset..base + offset + n]);
            }
            base += count;
        }
    }
    Ok(received)
}

#[cfg(test)]
mod tests {
    //! The exchange and the agreement on real loopback rings, one thread per rank.

    use std::net::TcpListener;
    use std::time::Duration;

    use super::*;
    use crate::collective::{TcpCollective, TcpConfig};

    /// Runs `body` on every rank of a TCP world of `world` threads; returns each
    /// rank's result, by rank.
    fn on_world<T: Send + 'static>(
        world: usize,
        body: impl Fn(&TcpCollective) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let rendezvous = listener.local_addr().unwrap();
        let config = TcpConfig {
            timeout: Duration::from_secs(20),
            ..TcpConfig::default()
        };
        let mut root = Some(listener);
        let threads: Vec<_> = (0..world)
            .map(|rank| {
                let (root, config, body) = (root.take(), config.clone(), body.clone());
                std::thread::spawn(move || {
                    let comm = match root {
                        Some(listener) => TcpCollective::bootstrap_root(listener, world, config),
                        None => TcpCollective::bootstrap(rank, world, rendezvous, config),
                    }
                    .unwrap();
                    body(&comm)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    /// The bytes rank `from` sends rank `to`: a length and contents that depend on
    /// both (some pairs send nothing).
    fn message(from: usize, to: usize) -> Vec<u8> {
        let len = (from * 7 + to * 3) % 11 * 100;
        (0..len).map(|i| (i + 31 * from + 17 * to) as u8).collect()
    }

    #[test]
    fn every_rank_receives_what_each_sent_it_in_one_round_or_many() {
        for round_bytes in [ROUND_BYTES, 1, 2500] {
            let world = 5;
            let got = on_world(world, move |comm| {
                let rank = comm.rank();
                let sizes: Vec<u64> = (0..world)
                    .map(|to| message(rank, to).len() as u64)
                    .collect();
                all_to_all_in_rounds(
                    comm,
                    &sizes,
                    &mut |to, out| out.copy_from_slice(&message(rank, to)),
                    round_bytes,
                )
                .unwrap()
            });
            for (rank, received) in got.iter().enumerate() {
                for (from, bytes) in received.iter().enumerate() {
                    let want = if from == rank {
                        Vec::new()
                    } else {
                        message(from, rank)
                    };
                    assert!(*bytes == want, "round cap {round_bytes}: {from} -> {rank}");
                }
            }
        }
    }

    #[test]
    fn a_step_failed_on_one_rank_ends_the_try_on_every_rank_naming_it() {
        // The store failing on rank 2 ends the resume; damage on rank 1 alone falls
        // back; both at once: the failure wins.
        // (rank, damaged rather than failed) for each faulty rank; the verdict.
        type Faults = &'static [(usize, bool)];
        let cases: [(Faults, bool, &str); 3] = [
            (
                &[(2, false)],
                false,
                "failed on rank 2: the disk is on fire",
            ),
            (
                &[(1, true)],
                true,
                "failed on rank 1: corrupt checkpoint: a block at byte 7",
            ),
            (
                &[(1, true), (3, false), (2, false)],
                false,
                "failed on rank 2 (and on 1 more: 3)",
            ),
        ];
        for (faults, damaged, named) in cases {
            let got = on_world(4, move |comm| {
                let rank = comm.rank();
                let mine = match faults.iter().find(|(r, _)| *r == rank) {
                    Some((_, true)) => Err(ckpt::Error::Corrupt(ckpt::format::FormatError {
                        object: "a block".into(),
                        offset: Some(7),
                        message: "bad CRC32".into(),
                    })),
                    Some((_, false)) => Err(ckpt::Error::Invalid("the disk is on fire".into())),
                    None => Ok(rank),
                };
                match agree(comm, "reading its blocks", mine).unwrap() {
                    Ok(_) => panic!("rank {rank} agreed on success"),
                    Err(Tried::Damaged(why)) => (true, why),
                    Err(Tried::Failed(why)) => (false, why),
                    Err(_) => panic!("rank {rank}: neither damaged nor failed"),
                }
            });
            for (rank, (was_damaged, why)) in got.iter().enumerate() {
                assert_eq!(*was_damaged, damaged, "rank {rank}: {why}");
                assert!(why.contains(named), "rank {rank}: {why}");
                assert_eq!(*why, got[0].1, "every rank says the same");
            }
        }
        // Success everywhere: each rank keeps its own result.
        let got = on_world(3, |comm| {
            let rank = comm.rank();
            match agree(comm, "planning", Ok::<_, ckpt::Error>(rank * 10)).unwrap() {
                Ok(v) => v,
                Err(_) => panic!("rank {rank} disagreed"),
            }
        });
        assert_eq!(got, vec![0, 10, 20]);
    }
}
