//! Storage for ckpt: one [`Store`] over local disk, S3, GCS, Azure and memory.
//!
//! Everything ckpt writes or reads goes through this crate, so the guarantees the
//! checkpoint protocol relies on are stated here once, for every backend:
//!
//! - [`Store::put`] is atomic (a reader sees the old or the new object) and, on
//!   local disk, durable when it returns: the file and its directory are fsynced.
//! - [`Store::put_if_absent`] is the commit primitive: of N concurrent creators of
//!   one key exactly one wins and the others get [`ErrorKind::AlreadyExists`].
//! - [`Store::upload`] streams large objects as multipart uploads with a bounded
//!   part size and number of parts in flight; nothing is visible before
//!   [`Upload::finish`], and an aborted upload leaves nothing behind.
//! - On S3, a write whose ETag is not the MD5 of the bytes sent did not happen: a
//!   body damaged on its way to the server is written again (a multipart upload
//!   fails and leaves nothing), so a stored object never differs from what the
//!   caller checksummed (`sent.rs` says why and what it costs).
//! - [`Store::get_ranges`] reads several ranges of one object, merging close ones
//!   into one request and fetching the rest concurrently; every backend refuses a
//!   range past the end of the object with the same error.
//! - [`Store::get_at_most`] reads a small object whose writer is not trusted: memory
//!   stays within the caller's limit whatever the object holds.
//! - On local disk no symbolic link under the root is followed: an operation whose
//!   path crosses one, or a listing that meets one, fails naming the link (see
//!   [`Store::local_path`] for why).
//! - Errors carry an [`ErrorKind`] that says what the caller can do (not found,
//!   already exists, transient, permanent, configuration) and a lowercase message
//!   naming the operation, the store URL and the key.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), ckpt_storage::Error> {
//! use ckpt_storage::{ErrorKind, Store};
//!
//! let store = Store::from_url("memory://tour")?;
//! store.put("step-1/rank-0.bin", &b"weights"[..]).await?;
//! assert_eq!(store.get_range("step-1/rank-0.bin", 0..4).await?, &b"weig"[..]);
//!
//! // The commit primitive: the second creator loses.
//! store.put_if_absent("step-1/manifest.json", &b"{}"[..]).await?;
//! let lost = store.put_if_absent("step-1/manifest.json", &b"{}"[..]).await;
//! assert_eq!(lost.unwrap_err().kind(), ErrorKind::AlreadyExists);
//!
//! let listing = store.list_dir("").await?;
//! assert_eq!(listing.prefixes, vec!["step-1".to_string()]);
//! # Ok(())
//! # }
//! ```
//!
//! Configuration: see [`StoreConfig`] for retries, timeouts, part sizes and range
//! coalescing; credentials and endpoints come from the standard `AWS_*`, `GOOGLE_*`
//! and `AZURE_*` environment variables or from [`StoreConfig::options`].
//!
//! Features: local disk and memory are always there; `aws` (`s3://`), `gcp`
//! (`gs://`) and `azure` (`az://`) each bring one cloud backend and its HTTP stack,
//! and are off by default. A URL of a backend left out fails to open, naming the
//! feature.

#![warn(missing_docs, unreachable_pub)]

mod config;
mod confined;
mod error;
mod open;
mod ranges;
mod sent;
mod store;

pub use config::{MIN_PART_SIZE, RetrySettings, StoreConfig};
pub use error::{Error, ErrorKind, Result, io_error_kind};
pub use open::Backend;
pub use store::{LOCAL_READ_PAUSES, Listing, ObjectInfo, RequestCounts, Store, Upload};
