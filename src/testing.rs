//! The commit protocol's internals, for benchmarks and tests outside the crate that
//! build checkpoints without saving them: `ckpt bench --commit-scale` writes a
//! thousand ranks' parts and a long commit log directly, and the CLI's hostile-input
//! tests forge commit records. Behind the `testing` feature; not a stable API (the
//! names may change in any release), and no training path needs it.

pub use crate::commit::build_manifest;
pub use crate::commits::{Appended, CommitRecord, LoggedCommit, append, newest, record_key};
pub use crate::writer::{PlannedBox, RankFileWriter};
