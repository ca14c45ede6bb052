//! The exit codes of `ckpt`, defined once for every subcommand, and how a library
//! error maps onto them (documented in docs/CLI.md; scripts and tests rely on the
//! values).

use std::process::ExitCode;

use ckpt::Error;
use ckpt::storage::ErrorKind;

use crate::output::errln;

/// Everything checked out.
pub(crate) const OK: u8 = 0;
/// A check failed: verify found a fault, diff found a difference, the store
/// misbehaved under probe, a bench or a coordinator failed.
pub(crate) const CHECK_FAILED: u8 = 1;
/// Bad usage or configuration: bad flags, URL or option, missing credentials.
pub(crate) const USAGE: u8 = 2;
/// No checkpoint, no such step, no such tensor.
pub(crate) const NOT_FOUND: u8 = 3;
/// The checkpoint is corrupt.
pub(crate) const CORRUPT: u8 = 4;
/// The store or the disk failed.
pub(crate) const STORAGE: u8 = 5;

/// The exit code for a library error.
pub(crate) fn code(error: &Error) -> u8 {
    match error {
        Error::Storage(e) => match e.kind() {
            ErrorKind::Config => USAGE,
            ErrorKind::NotFound => NOT_FOUND,
            _ => STORAGE,
        },
        Error::Corrupt(_) => CORRUPT,
        Error::NotFound(_) => NOT_FOUND,
        Error::Mismatch(_) | Error::Invalid(_) => USAGE,
        Error::Timeout(_) | Error::Failed(_) | Error::Fenced(_) | Error::Mutated(_) => STORAGE,
        Error::Device(_) | Error::OverBudget(_) => STORAGE,
    }
}

/// Prints the error as one sentence and returns its exit code.
pub(crate) fn fail(error: &Error) -> ExitCode {
    errln!("error: {error}");
    ExitCode::from(code(error))
}
