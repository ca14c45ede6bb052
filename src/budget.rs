//! A hard bound on the host memory one rank's checkpointing holds.
//!
//! # Why
//!
//! Staging buffers, in-memory copies of saves, replicas of a peer's copies and
//! snapshots each cost a rank's share of the state in host memory, and they pile up:
//! a save staging while the previous checkpoint's copy is held, a replica pulled,
//! a snapshot taken and its predecessor not yet superseded. Host memory exhausted
//! by checkpoint staging is the failure trainers report most (an OOM kill takes the
//! whole rank, and with it the training it was there to protect), so the library
//! takes a budget ([`CheckpointConfig::host_memory_budget`](crate::CheckpointConfig::host_memory_budget))
//! and never holds more.
//!
//! # How
//!
//! One [`HostBudget`] per rank is shared by its [`Checkpointer`](crate::Checkpointer)
//! (staging buffers, counted by their mapped capacity, pinned or not) and its
//! [`Copies`](crate::copies::Copies) holder (replicas it allocates; own copies and
//! snapshots are staging buffers lent out, so they move between kinds without being
//! counted twice). Every allocation is reserved before it is made
//! (`HostBudget::try_reserve`); a reservation that does not fit asks the holders
//! that registered a `Dropper` to let go of the oldest copy they may drop (never
//! the newest committed snapshot or checkpoint before its successor commits), and
//! fails only when nothing is left to drop. The caller then does without: a replica
//! is not pulled, a snapshot is not taken (a warning says so), and a save that does
//! not fit stages and uploads its file in pieces.
//!
//! [`HostBytesHeld`] reports what is held, by kind, with the peak since the budget
//! was made; it is what the save handle, `ckpt bench` and the elastic logs print.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use serde::{Deserialize, Serialize};

/// What host memory is held for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeldKind {
    /// Staging buffers: being filled or written by a save, or idle in the pool.
    Staging,
    /// This rank's own copies of its saves (staging buffers kept after the save).
    Copy,
    /// Replicas of a peer's copies of its saves.
    Replica,
    /// This rank's own snapshots.
    Snapshot,
    /// Replicas of a peer's snapshots.
    SnapshotReplica,
}

const KINDS: usize = 5;

impl HeldKind {
    fn index(self) -> usize {
        match self {
            HeldKind::Staging => 0,
            HeldKind::Copy => 1,
            HeldKind::Replica => 2,
            HeldKind::Snapshot => 3,
            HeldKind::SnapshotReplica => 4,
        }
    }

    pub(crate) fn from_index(i: u8) -> Self {
        match i {
            1 => HeldKind::Copy,
            2 => HeldKind::Replica,
            3 => HeldKind::Snapshot,
            4 => HeldKind::SnapshotReplica,
            _ => HeldKind::Staging,
        }
    }

    pub(crate) fn as_index(self) -> u8 {
        self.index() as u8
    }
}

/// Host memory held by one rank's checkpointing, by kind, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostBytesHeld {
    /// The budget (`None`: unbounded).
    pub budget: Option<u64>,
    /// Everything held now.
    pub total: u64,
    /// The most held at once since the budget was made.
    pub peak: u64,
    /// Staging buffers (in use or idle in the pool).
    pub staging: u64,
    /// Own copies of saves.
    pub copies: u64,
    /// Replicas of peers' copies.
    pub replicas: u64,
    /// Own snapshots.
    pub snapshots: u64,
    /// Replicas of peers' snapshots.
    pub snapshot_replicas: u64,
}

impl std::fmt::Display for HostBytesHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "{:.1} MiB held (staging {:.1}, copies {:.1}, replicas {:.1}, snapshots {:.1}, snapshot replicas {:.1}; peak {:.1}",
            mib(self.total),
            mib(self.staging),
            mib(self.copies),
            mib(self.replicas),
            mib(self.snapshots),
            mib(self.snapshot_replicas),
            mib(self.peak),
        )?;
        match self.budget {
            Some(budget) => write!(f, " of a {:.1} MiB budget)", mib(budget)),
            None => f.write_str(", no budget)"),
        }
    }
}

/// A holder of copies that can let go of one to make room.
pub(crate) trait Dropper: Send + Sync + std::fmt::Debug {
    /// Lets go of the oldest copy it may drop of a step before `before`; false
    /// when there is none.
    fn drop_oldest(&self, before: u64) -> bool;
}

/// One rank's host-memory budget, shared by its checkpointer and its copies holder.
/// See the [module docs](self).
pub struct HostBudget {
    /// The bound in bytes (`u64::MAX`: none).
    limit: AtomicU64,
    held: [AtomicU64; KINDS],
    total: AtomicU64,
    peak: AtomicU64,
    droppers: Mutex<Vec<Weak<dyn Dropper>>>,
}

impl std::fmt::Debug for HostBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBudget")
            .field("held", &self.held())
            .finish()
    }
}

impl HostBudget {
    /// A budget of `limit` bytes (`None`: unbounded, only counted).
    pub fn new(limit: Option<u64>) -> Arc<Self> {
        Arc::new(Self {
            limit: AtomicU64::new(limit.unwrap_or(u64::MAX)),
            held: Default::default(),
            total: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            droppers: Mutex::new(Vec::new()),
        })
    }

    /// The bound, if any.
    pub fn limit(&self) -> Option<u64> {
        match self.limit.load(Ordering::Relaxed) {
            u64::MAX => None,
            limit => Some(limit),
        }
    }

    /// Changes the bound. A smaller one is enforced at once on what can be let go
    /// (copies the holders may drop); idle staging buffers over it are unmapped at
    /// the next save, and pinned ones with them.
    pub fn set_limit(&self, limit: Option<u64>) {
        self.limit
            .store(limit.unwrap_or(u64::MAX), Ordering::Relaxed);
        while self.total.load(Ordering::Relaxed) > self.limit.load(Ordering::Relaxed) {
            if !self.drop_one(u64::MAX) {
                break;
            }
        }
    }

    /// What is held now, by kind, and the peak.
    pub fn held(&self) -> HostBytesHeld {
        let at = |k: HeldKind| self.held[k.index()].load(Ordering::Relaxed);
        HostBytesHeld {
            budget: self.limit(),
            total: self.total.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            staging: at(HeldKind::Staging),
            copies: at(HeldKind::Copy),
            replicas: at(HeldKind::Replica),
            snapshots: at(HeldKind::Snapshot),
            snapshot_replicas: at(HeldKind::SnapshotReplica),
        }
    }

    /// Bytes that may still be reserved before the bound (`u64::MAX` unbounded).
    pub fn available(&self) -> u64 {
        self.limit
            .load(Ordering::Relaxed)
            .saturating_sub(self.total.load(Ordering::Relaxed))
    }

    /// Reserves `bytes` of `kind` if they fit, without dropping anything.
    pub(crate) fn try_reserve(&self, kind: HeldKind, bytes: u64) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut total = self.total.load(Ordering::Relaxed);
        loop {
            let Some(next) = total.checked_add(bytes).filter(|n| *n <= limit) else {
                return false;
            };
            match self
                .total
                .compare_exchange_weak(total, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.held[kind.index()].fetch_add(bytes, Ordering::Relaxed);
                    self.peak.fetch_max(next, Ordering::Relaxed);
                    return true;
                }
                Err(now) => total = now,
            }
        }
    }

    /// Reserves `bytes` of `kind` for a copy of step `step`, asking the holders to
    /// let go of their oldest droppable copies of earlier steps until they fit
    /// (a copy never pushes out one as new as itself); false when they do not fit
    /// even then.
    pub(crate) fn reserve_dropping(&self, kind: HeldKind, bytes: u64, step: u64) -> bool {
        loop {
            if self.try_reserve(kind, bytes) {
                return true;
            }
            if !self.drop_one(step) {
                return false;
            }
        }
    }

    /// Gives back `bytes` of `kind`.
    pub(crate) fn release(&self, kind: HeldKind, bytes: u64) {
        self.held[kind.index()].fetch_sub(bytes, Ordering::Relaxed);
        self.total.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Counts `bytes` held as `from` as held as `to` instead.
    pub(crate) fn transfer(&self, from: HeldKind, to: HeldKind, bytes: u64) {
        if from != to {
            self.held[from.index()].fetch_sub(bytes, Ordering::Relaxed);
            self.held[to.index()].fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// Registers a holder asked to let go of copies when a reservation does not fit.
    pub(crate) fn register(&self, dropper: Weak<dyn Dropper>) {
        let mut droppers = self.droppers.lock().unwrap_or_else(|p| p.into_inner());
        droppers.retain(|d| d.strong_count() > 0);
        droppers.push(dropper);
    }

    /// Asks the registered holders, in turn, to let go of one copy of a step
    /// before `before` (idle staging buffers count as before anything); true when
    /// one did.
    pub(crate) fn drop_one(&self, before: u64) -> bool {
        let droppers: Vec<Arc<dyn Dropper>> = self
            .droppers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        droppers.iter().any(|d| d.drop_oldest(before))
    }
}

/// Bytes reserved from a [`HostBudget`], given back when dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<HostBudget>,
    kind: HeldKind,
    bytes: u64,
}

impl Reservation {
    /// Reserves `bytes` of `kind`, dropping the holders' oldest droppable copies
    /// if needed; `None` when they do not fit.
    pub(crate) fn new(budget: &Arc<HostBudget>, kind: HeldKind, bytes: u64) -> Option<Self> {
        Self::for_step(budget, kind, bytes, u64::MAX)
    }

    /// Reserves `bytes` of `kind` without letting anything go; `None` when they do
    /// not fit.
    pub(crate) fn try_new(budget: &Arc<HostBudget>, kind: HeldKind, bytes: u64) -> Option<Self> {
        budget.try_reserve(kind, bytes).then(|| Self {
            budget: budget.clone(),
            kind,
            bytes,
        })
    }

    /// Reserves `bytes` of `kind` for a copy of step `step`, dropping the holders'
    /// oldest copies of earlier steps if needed; `None` when they do not fit.
    pub(crate) fn for_step(
        budget: &Arc<HostBudget>,
        kind: HeldKind,
        bytes: u64,
        step: u64,
    ) -> Option<Self> {
        budget.reserve_dropping(kind, bytes, step).then(|| Self {
            budget: budget.clone(),
            kind,
            bytes,
        })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.release(self.kind, self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Holder(Mutex<Vec<Reservation>>);

    impl Dropper for Holder {
        fn drop_oldest(&self, _before: u64) -> bool {
            let mut held = self.0.lock().unwrap();
            if held.is_empty() {
                return false;
            }
            held.remove(0);
            true
        }
    }

    #[test]
    fn reservations_stay_inside_the_bound_and_drop_the_oldest_copies_to_fit() {
        let budget = HostBudget::new(Some(100));
        let holder = Arc::new(Holder(Mutex::new(Vec::new())));
        let weak: Weak<dyn Dropper> = Arc::downgrade(&(holder.clone() as Arc<dyn Dropper>));
        budget.register(weak);
        for _ in 0..3 {
            let r = Reservation::new(&budget, HeldKind::Replica, 30).unwrap();
            holder.0.lock().unwrap().push(r);
        }
        assert_eq!(budget.held().replicas, 90);
        // 40 more: the oldest replica goes.
        let staging = Reservation::new(&budget, HeldKind::Staging, 40).unwrap();
        assert_eq!(holder.0.lock().unwrap().len(), 2);
        assert_eq!(budget.held().total, 100);
        budget.transfer(HeldKind::Staging, HeldKind::Snapshot, 40);
        assert_eq!((budget.held().staging, budget.held().snapshots), (0, 40));
        // Larger than the bound: everything droppable goes, and it still fails.
        assert!(Reservation::new(&budget, HeldKind::Staging, 101).is_none());
        assert!(holder.0.lock().unwrap().is_empty());
        assert_eq!(budget.held().total, 40);
        budget.transfer(HeldKind::Snapshot, HeldKind::Staging, 40);
        drop(staging);
        let held = budget.held();
        assert_eq!((held.total, held.peak, held.budget), (0, 100, Some(100)));
        // Shrinking the bound lets copies go at once.
        let r = Reservation::new(&budget, HeldKind::Copy, 50).unwrap();
        holder.0.lock().unwrap().push(r);
        budget.set_limit(Some(10));
        assert_eq!(budget.held().total, 0);
        assert_eq!(budget.available(), 10);
    }
}
