//! Errors keyed by what the caller can do about them.
//!
//! object_store reports failures in many shapes (a status code buried in a retry
//! error, an io error from the local file system, a builder error). Callers of ckpt
//! only need to decide one thing: give up, try again later, treat the object as
//! missing, or accept that someone else won a race. [`ErrorKind`] is that decision;
//! the message keeps the detail (operation, store URL, key, reason).

use std::fmt;

/// What the caller can do about a storage error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The object (or the root) does not exist. Retrying does not help; the caller
    /// decides whether absence is an error.
    NotFound,
    /// A create-if-absent put lost: the object was already there. Retrying never
    /// helps; for the commit protocol this means another writer committed first.
    AlreadyExists,
    /// The store could not be reached or answered with a temporary failure (5xx,
    /// throttling, connection reset, timeout) after the configured retries.
    /// Retrying later may help.
    Transient,
    /// The request was understood and refused, or the data is not what was asked
    /// for (a range past the end of an object, a full disk). Retrying does not help.
    Permanent,
    /// The store cannot be used as configured: bad URL, unknown scheme or option,
    /// missing or rejected credentials, an operation the backend does not support.
    /// Retrying does not help until the configuration changes.
    Config,
}

impl ErrorKind {
    fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::AlreadyExists => "already exists",
            ErrorKind::Transient => "transient",
            ErrorKind::Permanent => "permanent",
            ErrorKind::Config => "configuration",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an I/O error from a file system means to the caller: a failing device or a
/// network file system's hiccup (EIO, a stale handle, a timeout, a reset or aborted
/// connection, an interrupted or would-block call) may pass, so it is
/// [`ErrorKind::Transient`]; a refusal of access is [`ErrorKind::Config`];
/// everything else (a full or read-only disk, a missing directory) is
/// [`ErrorKind::Permanent`] for the call that met it.
pub fn io_error_kind(e: &std::io::Error) -> ErrorKind {
    use std::io::ErrorKind as Io;
    /// EIO on every Unix (std has no kind for it).
    const EIO: i32 = 5;
    match e.kind() {
        Io::Interrupted
        | Io::TimedOut
        | Io::WouldBlock
        | Io::ConnectionReset
        | Io::ConnectionAborted
        | Io::StaleNetworkFileHandle => ErrorKind::Transient,
        Io::PermissionDenied => ErrorKind::Config,
        _ if e.raw_os_error() == Some(EIO) => ErrorKind::Transient,
        _ => ErrorKind::Permanent,
    }
}

/// A storage error: its [`ErrorKind`] and a one-sentence, lowercase message naming
/// the operation, the store URL and the key.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    kind: ErrorKind,
    message: String,
    /// The server stored other bytes than those sent and the object was deleted:
    /// sending the same bytes again is the remedy.
    damaged_in_flight: bool,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Error {
    /// An error of `kind` with `message` and no underlying cause.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            damaged_in_flight: false,
            source: None,
        }
    }

    /// An error of `kind` with `message`, keeping `source` for `Error::source`.
    pub fn with_source(
        kind: ErrorKind,
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            kind,
            message: message.into(),
            damaged_in_flight: false,
            source: Some(source.into()),
        }
    }

    /// A configuration error: the store cannot be used as configured.
    pub fn config(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, message)
    }

    /// What the caller can do about this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// True when trying again later may succeed ([`ErrorKind::Transient`]).
    pub fn is_retryable(&self) -> bool {
        self.kind == ErrorKind::Transient
    }

    /// True when an upload failed because the server stored other bytes than those
    /// sent (a part damaged in flight; see the ETag check of writes to S3) and
    /// deleted what it stored: an upload of the same bytes again is the remedy, for
    /// a caller that still holds them. Always [`ErrorKind::Transient`].
    pub fn is_damaged_in_flight(&self) -> bool {
        self.damaged_in_flight
    }

    /// Marks a transient error as [`Error::is_damaged_in_flight`].
    pub(crate) fn damaged_in_flight(mut self) -> Self {
        debug_assert_eq!(self.kind, ErrorKind::Transient);
        self.damaged_in_flight = true;
        self
    }

    /// True for [`ErrorKind::NotFound`].
    pub fn is_not_found(&self) -> bool {
        self.kind == ErrorKind::NotFound
    }

    /// True for [`ErrorKind::AlreadyExists`].
    pub fn is_already_exists(&self) -> bool {
        self.kind == ErrorKind::AlreadyExists
    }
}

/// Result alias for storage operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_that_may_pass_are_transient_and_the_others_are_not() {
        let os = std::io::Error::from_raw_os_error;
        // EIO, ESTALE, ETIMEDOUT, ECONNRESET, EAGAIN: a device or a network file
        // system that may answer the next read.
        for errno in [5, 116, 110, 104, 11] {
            assert_eq!(io_error_kind(&os(errno)), ErrorKind::Transient, "{errno}");
        }
        // EACCES: a configuration to fix. ENOSPC, EROFS, ENOENT: not for a retry of
        // the same call.
        assert_eq!(io_error_kind(&os(13)), ErrorKind::Config);
        for errno in [28, 30, 2] {
            assert_eq!(io_error_kind(&os(errno)), ErrorKind::Permanent, "{errno}");
        }
    }
}
