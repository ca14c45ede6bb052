//! Errors of the checkpoint library, keyed by what the caller can do.

use crate::format::FormatError;

/// A checkpoint operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The store failed; its [`ckpt_storage::ErrorKind`] says whether retrying helps.
    #[error(transparent)]
    Storage(#[from] ckpt_storage::Error),
    /// A checkpoint object is corrupt, truncated or hostile (bad JSON, checksum
    /// mismatch, names leaving the checkpoint, absurd sizes). Names the object and
    /// the byte offset. Retrying does not help; an older checkpoint may.
    #[error("corrupt checkpoint: {0}")]
    Corrupt(#[from] FormatError),
    /// No such checkpoint, step or tensor.
    #[error("{0}")]
    NotFound(String),
    /// The request does not match the checkpoint (dtype, shape, box).
    #[error("{0}")]
    Mismatch(String),
    /// An argument or setting is invalid.
    #[error("{0}")]
    Invalid(String),
    /// Waiting for something (a commit) took longer than allowed.
    #[error("{0}")]
    Timeout(String),
    /// A background save failed; the message says where.
    #[error("{0}")]
    Failed(String),
    /// This save was fenced off: a newer generation committed first, or its
    /// attempt's names were already taken (a run id reused). Nothing it wrote is
    /// referenced by any commit; retrying the same attempt cannot succeed.
    #[error("{0}")]
    Fenced(String),
    /// An overlapped save's tensor was changed before its staging copy read it (the
    /// caller broke `Checkpointer::save_overlapped`'s contract). Names the tensor. The
    /// save is abandoned.
    #[error("{0}")]
    Mutated(String),
    /// The GPU path failed: a CUDA or NCCL library is missing or too old (the message
    /// names it, the file names tried and how to fix it), no device is present, or a
    /// CUDA call failed (named with its error). Retrying does not help unless the
    /// environment changes.
    #[error("{0}")]
    Device(String),
    /// Holding this would pass the host memory budget
    /// ([`CheckpointConfig::host_memory_budget`](crate::CheckpointConfig::host_memory_budget)),
    /// even after letting go of every copy that may be dropped. The message says
    /// what is held, by kind.
    #[error("{0}")]
    OverBudget(String),
}

impl Error {
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Error::Invalid(message.into())
    }

    /// True when the checkpoint itself is damaged (as opposed to the store being
    /// unavailable or the request being wrong): an older checkpoint may still load.
    pub fn is_corruption(&self) -> bool {
        matches!(self, Error::Corrupt(_))
    }

    /// True when the save was fenced off (see [`Error::Fenced`]).
    pub fn is_fenced(&self) -> bool {
        matches!(self, Error::Fenced(_))
    }

    /// True when retrying may help (the store was unavailable or slow).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Storage(e) => e.is_retryable(),
            Error::Timeout(_) => true,
            _ => false,
        }
    }

    /// A copy with the same variant and message, for reporting one failure to several
    /// waiters (a storage error's underlying source is kept as text).
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::Storage(e) => Error::Storage(ckpt_storage::Error::new(e.kind(), e.to_string())),
            Error::Corrupt(e) => Error::Corrupt(e.clone()),
            Error::NotFound(m) => Error::NotFound(m.clone()),
            Error::Mismatch(m) => Error::Mismatch(m.clone()),
            Error::Invalid(m) => Error::Invalid(m.clone()),
            Error::Timeout(m) => Error::Timeout(m.clone()),
            Error::Failed(m) => Error::Failed(m.clone()),
            Error::Fenced(m) => Error::Fenced(m.clone()),
            Error::Mutated(m) => Error::Mutated(m.clone()),
            Error::Device(m) => Error::Device(m.clone()),
            Error::OverBudget(m) => Error::OverBudget(m.clone()),
        }
    }
}

/// Result alias of the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;
