//! `ckpt gc`: retention for a checkpoint root, safe for readers.
//!
//! The same rule as the retention a save applies with `keep_last`: see
//! [`crate::retention`] (commit order, never step order; the newest valid commit is
//! never removed, nor the newest one a resume would load, healthy or of unknown
//! health, whatever `keep` says; superseded commits and dead saves go only after a
//! grace period, so that a reader never loses a checkpoint mid-read). `gc` also removes staging
//! leftovers of crashed local writes.

use std::time::Duration;

use ckpt_storage::Store;

use crate::error::Result;
use crate::retention::Policy;
pub use crate::retention::{Held, Plan as GcPlan, Removal};

/// Decides what to remove (nothing is deleted).
pub async fn plan(store: &Store, keep: usize, grace: Duration) -> Result<GcPlan> {
    crate::retention::plan(
        store,
        Policy {
            keep: keep.max(1),
            grace,
        },
    )
    .await
}

/// Removes what `plan` decided, manifest first. Calls `progress` after each removal.
pub async fn apply(
    store: &Store,
    plan: &GcPlan,
    progress: &(dyn Fn(&Removal) + Sync),
) -> Result<()> {
    crate::retention::apply(store, plan, progress).await
}
