//! The trainer's side of the memory tier ([`ckpt::snapshot`]): snapshots every
//! [`TrainConfig::snapshot_every`](super::TrainConfig::snapshot_every) steps, kept in
//! host memory and replicated to the ring successor, committed by a vote of the whole
//! world, and a resume from the newest committed one.
//!
//! # Why
//!
//! A store save costs the store's bandwidth, so it comes every few tens or hundreds
//! of steps, and a lost rank costs every rank the work since the last one. A
//! snapshot costs a staging copy (overlapped with the next step, as an overlapped
//! save's) and one replica's transfer on the copy servers' connections: it can be
//! taken every few steps, and a loss that the survivors' copies cover then costs at
//! most that interval and one step.
//!
//! # When
//!
//! - At step `S`'s boundary (`S` a multiple of the interval) every rank snapshots its
//!   state ([`Snapshots::take`]), the same state a save of `S` would write. In the
//!   background, as soon as its checksums are ready, the holder keeps it and asks
//!   the predecessor's copy server for a replica of its snapshot (a holder keeps a
//!   replica only of the snapshot it holds as its newest).
//! - At the next step's boundary ([`Snapshots::vote`]) every rank waits briefly for
//!   its replica, casts its [`Vote`] and the world all-gathers the votes over its own
//!   collective: every rank learns the same outcome. When all are ready, every rank
//!   notes the commit in its holder, and rank 0 records it in the control plane
//!   (the elastic agent's `commit_snapshot`), where it survives the re-formation
//!   that follows a failure. A fixed world has no control plane: the commit lives in
//!   the ranks' memory only, and a restarted job resumes from the store.
//! - The optimizer step waits for the snapshot's staging copy
//!   ([`Snapshots::wait_staged`]) before it overwrites the rows, as for a save.
//!
//! # Resuming
//!
//! [`resume`] runs before the store's commits are looked at: rank 0 reads the
//! control plane's record and proposes it when the survivors hold every rank's file
//! ([`SnapshotRecord::uncovered`]) and it is newer than the newest healthy store
//! commit; it gathers the parts ([`snapshot::share`]) and broadcasts them, as a
//! cooperative load broadcasts a commit's; every rank opens the snapshot and loads
//! its rows from the copies, resharded, every block checked. Any failure on any rank
//! is agreed on (as the cooperative load agrees), and the world resumes from the
//! store instead. The non-tensor state (step, data position, loss history) comes
//! with the snapshot exactly as with a store commit, so a deterministic run resumed
//! from a snapshot trains bitwise as one resumed from the store at that step.
//!
//! A rollback (a bad step in the same world) never resumes from a snapshot: the
//! snapshot may hold the state that went bad, and no health check judges it. Nor
//! does any later resume from the snapshot committed before the rollback (every
//! rank notes it, since any may be rank 0 later): it belongs to the timeline the
//! rollback left. The snapshot in flight at the rollback is dropped unvoted.

use std::sync::Arc;
use std::time::Duration;

use ckpt::copies::{Copies, CopyKey, FromCopies, Holding};
use ckpt::snapshot::{self, SnapshotRecord, Vote};
use ckpt::{Attempt, Checkpointer, HostBytesHeld, Snapshot, SnapshotHandle};

use crate::collective::Collective;
use crate::model::TensorSpec;

use super::cooperative::{agree, ranks_text};
use super::copies::load_from_copies;
use super::resume::Tried;
use super::shards::{Place, Shards, shards_from_store, state_of, store_request};
use super::supervisor::or_cancelled;
use super::{Context, Supervisor, TrainConfig, TrainError, say};

/// How long a rank waits at the vote for its replica of the predecessor's snapshot
/// (it was asked for a whole step earlier; on a healthy network it is there).
const REPLICA_WAIT: Duration = Duration::from_secs(5);

/// A snapshot taken at one step boundary, voted on at the next.
struct Pending {
    step: u64,
    /// `None`: this rank could not take it (over the budget, a failure); it votes
    /// against.
    taken: Option<Taken>,
}

struct Taken {
    handle: Arc<SnapshotHandle>,
    attempt: Attempt,
    /// Keeps the snapshot in the holder once it is ready; gives it back.
    kept: tokio::task::JoinHandle<Option<Snapshot>>,
    /// The predecessor's file this rank replicates (`None` in a world of one).
    replica: Option<CopyKey>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        // An overlapped snapshot reads the rank's vectors until it has staged: they
        // must not be recycled (or freed) before.
        if let Some(taken) = &self.taken {
            let _ = taken.handle.wait_staged();
        }
    }
}

/// The snapshots of one generation ([module docs](self)).
pub(super) struct Snapshots<'a> {
    ctx: Context<'a>,
    /// The copy holder and every rank's holding; `None`: no snapshots.
    copies: Option<(&'a Arc<Copies>, &'a [Holding])>,
    pending: Option<Pending>,
}

impl<'a> Snapshots<'a> {
    /// The generation's snapshots: none without an interval, a copy holder on every
    /// rank, or with replicas of shards (a snapshot has no replica comparison).
    pub(super) fn new(ctx: Context<'a>, copies: Option<(&'a Arc<Copies>, &'a [Holding])>) -> Self {
        let config = ctx.config;
        let wanted = config.snapshot_every > 0;
        if wanted && ctx.rank == 0 {
            if copies.is_none() {
                say(format_args!(
                    "snapshots off: not every rank has a copy server (or there is no store)"
                ));
            } else if ctx.place.replicas > 1 {
                say(format_args!(
                    "snapshots off: they are not taken with replicas of shards"
                ));
            }
        }
        let on = wanted && ctx.place.replicas == 1;
        Snapshots {
            ctx,
            copies: copies.filter(|_| on),
            pending: None,
        }
    }

    /// Whether a snapshot is due at `step`'s boundary.
    pub(super) fn due(&self, step: u64) -> bool {
        self.copies.is_some() && step.is_multiple_of(self.ctx.config.snapshot_every)
    }

    /// Snapshots `st` at its step (overlapped when saves are), keeps it in the holder
    /// once ready and asks for the predecessor's replica. A snapshot that cannot be
    /// taken (over the host memory budget) is logged and voted against.
    pub(super) fn take(
        &mut self,
        checkpointer: &Checkpointer,
        specs: &[TensorSpec],
        st: &Shards,
    ) -> Result<(), TrainError> {
        let Some((copies, table)) = self.copies else {
            return Ok(());
        };
        let Context {
            runtime,
            config,
            rank,
            world,
            place,
            ..
        } = self.ctx;
        let step = st.step;
        let state = state_of(config, specs, st, place)?;
        let started = if config.overlapped_staging {
            // SAFETY: as for an overlapped save (`saving::start_save`): the rows are
            // written only by the optimizer step, which waits for this snapshot's
            // staging first (`Snapshots::wait_staged`), and `Pending` waits for it
            // when dropped, before the vectors can be recycled.
            runtime.block_on(unsafe { checkpointer.snapshot_overlapped(step, &state) })
        } else {
            runtime.block_on(checkpointer.snapshot(step, &state))
        };
        let handle = match started {
            Ok(handle) => Arc::new(handle),
            Err(e) => {
                tracing::warn!(step, rank, error = %e, "snapshot not taken; this rank votes against it");
                self.pending = Some(Pending { step, taken: None });
                return Ok(());
            }
        };
        let attempt = handle.attempt().clone();
        let predecessor = (rank + world - 1) % world;
        let replica = (world > 1).then(|| CopyKey {
            dir: attempt.dir(),
            world: world as u32,
            rank: predecessor as u32,
        });
        let from = table.get(predecessor).and_then(|h| h.addr);
        let kept = {
            let (handle, copies, replica) =
                (Arc::clone(&handle), Arc::clone(copies), replica.clone());
            runtime.spawn(async move {
                match handle.ready().await {
                    Ok(snap) if copies.keep_snapshot(&snap) => {
                        // Only now: the holder keeps a replica only of the snapshot
                        // it holds as its newest.
                        if let (Some(key), Some(from)) = (replica, from) {
                            copies.replicate_snapshot(from, key);
                        }
                        Some(snap)
                    }
                    Ok(_) => None,
                    Err(e) => {
                        tracing::warn!(step, error = %e, "snapshot failed; this rank votes against it");
                        None
                    }
                }
            })
        };
        self.pending = Some(Pending {
            step,
            taken: Some(Taken {
                handle,
                attempt,
                kept,
                replica,
            }),
        });
        Ok(())
    }

    /// Waits, if it has not finished, for the staging copy of the snapshot in
    /// flight: the optimizer step is about to overwrite the rows it reads.
    pub(super) fn wait_staged(&self) -> Result<bool, TrainError> {
        let Some(taken) = self.pending.as_ref().and_then(|p| p.taken.as_ref()) else {
            return Ok(false);
        };
        taken.handle.wait_staged()?;
        Ok(true)
    }

    /// The world's vote on the snapshot taken at the previous boundary, if any: every
    /// rank joins (a rank without it votes against), every rank learns the outcome;
    /// a commit is noted in every holder and recorded (rank 0) by the supervisor.
    pub(super) fn vote(&mut self) -> Result<(), TrainError> {
        let Some(mut pending) = self.pending.take() else {
            return Ok(());
        };
        let Some((copies, _)) = self.copies else {
            return Ok(());
        };
        let Context {
            comm,
            runtime,
            config,
            supervisor,
            rank,
            world,
            ..
        } = self.ctx;
        let step = pending.step;
        let taken = pending.taken.take();
        let mut vote = Vote::against(step);
        let snap = match taken {
            Some(Taken {
                handle,
                attempt,
                kept,
                replica,
            }) => {
                let snap = or_cancelled(runtime, supervisor, "keeping a snapshot", kept)?
                    .ok()
                    .flatten();
                if replica.is_some() {
                    copies.wait_for_pulls(REPLICA_WAIT);
                }
                if let Some(snap) = &snap {
                    vote = Vote::cast(copies, snap, replica.as_ref());
                }
                // Staged long ago (the optimizer step waited); drops without a wait.
                drop(handle);
                snap.map(|_| attempt)
            }
            None => None,
        };
        if config.snapshot_vote_against == Some((step, rank)) {
            say(format_args!(
                "fault: rank {rank} votes against the snapshot of step {step}"
            ));
            vote = Vote::against(step);
        }
        let mut gathered = vec![0u8; Vote::SIZE * world];
        comm.all_gather(&vote.encode(), &vec![Vote::SIZE; world], &mut gathered)?;
        let votes: Vec<Vote> = gathered
            .chunks_exact(Vote::SIZE)
            .map(Vote::decode)
            .collect();
        match snapshot::tally(&votes, step) {
            Ok(table) => {
                let attempt = snap.expect("every rank voted ready, this one too");
                let record = SnapshotRecord::new(&attempt, world as u32, &table);
                copies.commit_snapshot(&record.dir, table);
                if rank == 0 {
                    let recorded = match supervisor.commit_snapshot(&record.to_json()) {
                        Ok(true) => "recorded in the control plane",
                        Ok(false) => "held in memory only (no control plane)",
                        Err(e) => {
                            tracing::warn!(step, error = %e, "the control plane did not record the snapshot");
                            "not recorded: the control plane refused it"
                        }
                    };
                    say(format_args!(
                        "snapshot step {step} committed ({}; {recorded})",
                        record.dir
                    ));
                }
            }
            Err(against) => {
                if rank == 0 {
                    say(format_args!(
                        "snapshot step {step} not committed: rank(s) {} did not hold it",
                        ranks_text(&against)
                    ));
                }
            }
        }
        Ok(())
    }
}

/// What the rank holds now: the budget its checkpointer and copy holder share (the
/// holder's alone before the generation's checkpointer exists); a holder and a
/// checkpointer with budgets of their own (a caller that did not share one) are
/// summed, the peak then an upper bound.
pub(super) fn host_bytes_held(
    checkpointer: Option<&Checkpointer>,
    copies: Option<&Copies>,
) -> HostBytesHeld {
    let mut held = checkpointer
        .map(Checkpointer::host_bytes_held)
        .unwrap_or_default();
    if let Some(other) = copies
        .and_then(|c| c.config().budget.as_ref())
        .filter(|b| checkpointer.is_none_or(|c| !Arc::ptr_eq(b, c.host_budget())))
        .map(|b| b.held())
    {
        // Two budgets (not shared): the whole.
        held.budget = match (held.budget, other.budget) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        held.total += other.total;
        held.peak += other.peak;
        held.staging += other.staging;
        held.copies += other.copies;
        held.replicas += other.replicas;
        held.snapshots += other.snapshots;
        held.snapshot_replicas += other.snapshot_replicas;
    }
    held
}

/// [`host_bytes_held`] as one JSON object, for log lines.
pub(super) fn held_json(held: &HostBytesHeld) -> String {
    serde_json::to_string(held).unwrap_or_default()
}

/// What rank 0 broadcasts about the snapshot it proposes.
const NONE: u64 = 0;
const SHARED: u64 = 1;
const UNSHARED: u64 = 2;

/// The resume from the newest committed snapshot, when the control plane has one
/// that the survivors cover and that is newer than the newest healthy store commit
/// ([module docs](self)). `None`: there is none, or it did not load on some rank
/// (logged); the caller resumes from the store.
#[allow(clippy::too_many_arguments)]
pub(super) fn resume(
    comm: &dyn Collective,
    runtime: &tokio::runtime::Handle,
    store: &ckpt::storage::Store,
    config: &TrainConfig,
    specs: &[TensorSpec],
    supervisor: &dyn Supervisor,
    (own, table): (&Copies, &[Holding]),
    abandoned: Option<&str>,
    place: Place,
    spare: &mut Vec<Vec<f32>>,
) -> Result<Option<(Shards, u64)>, TrainError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut header = [0u8; 16];
    let mut payload = Vec::new();
    if rank == 0 {
        match propose(runtime, store, supervisor, table, abandoned)? {
            Proposal::None => {}
            Proposal::Skipped(why) => say(format_args!("{why}; resuming from the store")),
            Proposal::Use(record) => {
                header[..8].copy_from_slice(&SHARED.to_le_bytes());
                supervisor.waiting(true);
                let shared = snapshot::share(&record, own, table, rank);
                supervisor.waiting(false);
                payload = match shared {
                    Ok(bytes) => bytes,
                    Err(e) => {
                        header[..8].copy_from_slice(&UNSHARED.to_le_bytes());
                        format!(
                            "snapshot step {} not resumed from: {e}; resuming from the store",
                            record.step
                        )
                        .into_bytes()
                    }
                };
            }
        }
        header[8..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    }
    comm.broadcast(0, &mut header)?;
    let kind = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
    if kind == NONE {
        return Ok(None);
    }
    let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
    payload.resize(len as usize, 0);
    comm.broadcast(0, &mut payload)?;
    if kind == UNSHARED {
        if rank == 0 {
            say(format_args!("{}", String::from_utf8_lossy(&payload)));
        }
        return Ok(None);
    }
    let fallback = |why: String| {
        if rank == 0 {
            say(format_args!(
                "the committed snapshot does not load ({why}); resuming from the store"
            ));
        }
        Ok(None)
    };
    let reader = match agree(
        comm,
        "opening the snapshot",
        snapshot::open_shared(&payload),
    )? {
        Ok(reader) => reader,
        Err(tried) => return fallback(reason(tried)),
    };
    drop(payload);
    let step = reader.step();
    let (request, mut tensors) = store_request(specs, place, spare);
    let mut outputs: Vec<&mut [u8]> = tensors.iter_mut().map(|t| ckpt::as_bytes_mut(t)).collect();
    let loaded = or_cancelled(
        runtime,
        supervisor,
        &format!("loading snapshot step {step} from the copies"),
        async {
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
            let global = reader.global_state().await?;
            Ok::<_, ckpt::Error>((got, global))
        },
    )?;
    drop(outputs);
    let (got, global) = match agree(comm, "loading the snapshot from the copies", loaded)? {
        Ok(loaded) => loaded,
        Err(tried) => {
            spare.extend(tensors);
            return fallback(reason(tried));
        }
    };
    let shards = shards_from_store(step, tensors, global, config, specs)?;
    if shards.losses.len() as u64 != step {
        return Err(TrainError::Invalid(format!(
            "snapshot step {step} records {} losses",
            shards.losses.len()
        )));
    }
    let manifest = reader.manifest();
    let (saved_world, generation, dir) = (manifest.world_size, manifest.generation, manifest.dir());
    let source = rebuilt_text(comm, &got)?;
    if rank == 0 {
        say(format_args!(
            "resumed from snapshot step {step} in memory (snapshot {dir}; saved by {saved_world} ranks, resharded onto {world}{source}; load: 0 bytes from the store)"
        ));
    }
    Ok(Some((shards, generation)))
}

/// Why a try agreed on as failed failed.
fn reason(tried: Tried) -> String {
    match tried {
        Tried::Damaged(why) | Tried::Failed(why) | Tried::Unhealthy(why) => why,
        Tried::Loaded(..) => "loaded".to_string(),
    }
}

/// Where the rows of a snapshot resume came from, summed over the world, in the
/// words of the store resume's line.
fn rebuilt_text(comm: &dyn Collective, got: &FromCopies) -> Result<String, TrainError> {
    let world = comm.world_size();
    let mut sums = [
        i64::from(got.all_from_memory()),
        got.own_bytes as i64,
        got.peer_bytes as i64,
    ];
    comm.all_reduce_i64(&mut sums)?;
    Ok(format!(
        "; rows rebuilt from memory on {} of {world} ranks ({:.1} MB own, {:.1} MB from peers)",
        sums[0],
        sums[1] as f64 / 1e6,
        sums[2] as f64 / 1e6
    ))
}

/// Rank 0's look at the control plane's record.
enum Proposal {
    /// No snapshot was ever committed (or there is no control plane).
    None,
    /// One was, but it is not usable: why.
    Skipped(String),
    Use(SnapshotRecord),
}

fn propose(
    runtime: &tokio::runtime::Handle,
    store: &ckpt::storage::Store,
    supervisor: &dyn Supervisor,
    table: &[Holding],
    abandoned: Option<&str>,
) -> Result<Proposal, TrainError> {
    let text = match supervisor.committed_snapshot() {
        Ok(Some(text)) => text,
        Ok(None) => return Ok(Proposal::None),
        Err(e) => {
            return Ok(Proposal::Skipped(format!(
                "the control plane's snapshot record could not be read ({e})"
            )));
        }
    };
    let record = match SnapshotRecord::parse(&text) {
        Ok(record) => record,
        Err(e) => {
            return Ok(Proposal::Skipped(format!(
                "the control plane's snapshot record is not usable ({e})"
            )));
        }
    };
    let step = record.step;
    if abandoned == Some(record.dir.as_str()) {
        return Ok(Proposal::Skipped(format!(
            "snapshot step {step} not resumed from: it was committed before a rollback, on the timeline the rollback left"
        )));
    }
    let uncovered = record.uncovered(table);
    if !uncovered.is_empty() {
        let ranks: Vec<usize> = uncovered.iter().map(|r| *r as usize).collect();
        return Ok(Proposal::Skipped(format!(
            "snapshot step {step} not resumed from: no survivor holds the file of rank(s) {} of its {} ranks",
            ranks_text(&ranks),
            record.world
        )));
    }
    let newest = or_cancelled(
        runtime,
        supervisor,
        "finding the newest commit",
        ckpt::catalog::latest_selecting(store, ckpt::catalog::Select::Healthy),
    )?;
    match newest {
        Ok(Some((manifest, _))) if manifest.step >= step => Ok(Proposal::Skipped(format!(
            "snapshot step {step} not resumed from: the store's commit of step {} is as new",
            manifest.step
        ))),
        Ok(_) => Ok(Proposal::Use(record)),
        Err(e) => Ok(Proposal::Skipped(format!(
            "snapshot step {step} not resumed from: the store's newest commit could not be read ({e})"
        ))),
    }
}
