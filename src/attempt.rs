//! Save attempts: the unit that format v2 fences.
//!
//! Version 1 named a checkpoint's objects after its step alone, so two saves of the
//! same step (a run that resumed from an older checkpoint and reached that step again,
//! a late writer of a world that has since been re-formed) wrote the same names: the
//! second one met the first one's parts, or overwrote bytes that a committed manifest
//! vouched for. Version 2 gives every save attempt a directory of its own,
//!
//! ```text
//! step-00000040/g00000003-7f3a2c9e/
//! ```
//!
//! named by the step, the generation of the world that saves and the run id that all
//! ranks of that world share. Every object of the attempt lives inside it; parts and
//! the manifest are written create-if-absent, and data files carry a per-save nonce, so
//! no object name is ever written twice, even when a run id is reused by mistake.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
pub use crate::format::names::MAX_RUN_ID_LEN;
use crate::format::names::is_run_id;
use crate::format::step_dir;

/// One save attempt of one step by one world.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Attempt {
    /// The step saved.
    pub step: u64,
    /// The generation of the world that saves (fencing compares these).
    pub generation: u64,
    /// The run id shared by every rank of that world.
    pub run: String,
}

impl Attempt {
    /// An attempt; fails when `run` is not a valid run id (see [`check_run_id`]).
    pub fn new(step: u64, generation: u64, run: impl Into<String>) -> Result<Self> {
        let run = run.into();
        check_run_id(&run)?;
        Ok(Self {
            step,
            generation,
            run,
        })
    }

    /// The attempt's directory name inside its step directory: `g00000003-RUN`.
    pub fn name(&self) -> String {
        format!("g{:08}-{}", self.generation, self.run)
    }

    /// The attempt's directory under the root: `step-00000040/g00000003-RUN`.
    pub fn dir(&self) -> String {
        format!("{}/{}", step_dir(self.step), self.name())
    }

    /// The attempt named `name` inside the directory of `step`, if `name` is one.
    pub fn parse(step: u64, name: &str) -> Option<Self> {
        let rest = name.strip_prefix('g')?;
        let (generation, run) = rest.split_once('-')?;
        if generation.len() < 8 || !generation.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let generation = generation.parse().ok()?;
        Self::new(step, generation, run).ok()
    }
}

/// A run id is 1 to [`MAX_RUN_ID_LEN`] ASCII letters, digits, `_` or `-`: safe in an
/// object name on every store.
pub fn check_run_id(run: &str) -> Result<()> {
    if is_run_id(run) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "run id {run:?} must be 1 to {MAX_RUN_ID_LEN} ASCII letters, digits, '_' or '-'"
        )))
    }
}

/// A rank's data file inside an attempt: `rank-00003-NONCE.safetensors` (or
/// `.safetensors.zst`). The nonce makes the name unique to this save even if the
/// attempt's name is reused, so a data file that a manifest references is never
/// overwritten.
pub fn data_file_name(rank: u32, compressed: bool, nonce: &str) -> String {
    let ext = if compressed {
        "safetensors.zst"
    } else {
        "safetensors"
    };
    format!("rank-{rank:05}-{nonce}.{ext}")
}

/// 16 hex digits that differ from call to call and process to process.
pub fn nonce() -> String {
    format!("{:016x}", random_u64())
}

/// A fresh random run id (for a single-rank world, where nobody else must agree).
pub fn random_run_id() -> String {
    format!("{:016x}", random_u64())
}

/// A run id: the name every rank of one world shares for its saves, and that differs
/// between runs and restarts (see [`CheckpointConfig::run_id`](crate::CheckpointConfig::run_id)).
/// Launchers and trainers make one here rather than restating its syntax.
///
/// ```
/// let id = ckpt::RunId::generate();
/// assert_eq!(ckpt::RunId::new(id.as_str()).unwrap(), id);
/// assert!(ckpt::RunId::new("a/b").is_err());
/// assert_eq!(ckpt::RunId::MAX_LEN, 48);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RunId(String);

impl RunId {
    /// Longest run id accepted ([`MAX_RUN_ID_LEN`]).
    pub const MAX_LEN: usize = MAX_RUN_ID_LEN;

    /// `run` as a run id; [`Error::Invalid`] unless it is 1 to [`RunId::MAX_LEN`] ASCII
    /// letters, digits, `_` or `-`.
    pub fn new(run: impl Into<String>) -> Result<Self> {
        let run = run.into();
        check_run_id(&run)?;
        Ok(Self(run))
    }

    /// A fresh random run id (16 hex digits), for a world where nobody else must agree
    /// on it, or for a launcher to hand to all its ranks.
    pub fn generate() -> Self {
        Self(random_run_id())
    }

    /// Whether `run` is a valid run id, without building one.
    pub fn is_valid(run: &str) -> bool {
        is_run_id(run)
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<RunId> for String {
    fn from(id: RunId) -> Self {
        id.0
    }
}

/// Random enough for names: std's per-process random hash keys, mixed with a
/// counter, the time and the process id.
fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u32(std::process::id());
    if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(now.as_nanos());
    }
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let attempt = Attempt::new(40, 3, "job-7").unwrap();
        assert_eq!(attempt.dir(), "step-00000040/g00000003-job-7");
        assert_eq!(Attempt::parse(40, &attempt.name()), Some(attempt));
        assert_eq!(Attempt::parse(40, "rank-00000.json"), None);
        assert_eq!(Attempt::parse(40, "g12-x"), None);
        assert_eq!(Attempt::parse(40, "g00000001-a/b"), None);
    }

    #[test]
    fn run_ids_are_plain_names() {
        for bad in ["", "..", "a/b", "a b", &"x".repeat(MAX_RUN_ID_LEN + 1)] {
            assert!(check_run_id(bad).is_err(), "{bad:?} accepted");
        }
        check_run_id("Run_2026-11-23").unwrap();
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(nonce(), nonce());
        assert_eq!(data_file_name(3, false, "ab"), "rank-00003-ab.safetensors");
    }
}
