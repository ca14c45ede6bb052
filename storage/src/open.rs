//! Turning a URL into an object_store backend.
//!
//! Each cloud builder starts `from_env()`, so the standard `AWS_*`, `GOOGLE_*` and
//! `AZURE_*` variables apply, then takes the bucket from the URL, the timeouts and
//! retry policy from [`StoreConfig`], and the caller's explicit options last (they
//! win). The prefix part of the URL becomes the store's root.

use std::collections::HashMap;
use std::path::{Path as FsPath, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use object_store::ObjectStore;
#[cfg(feature = "aws")]
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
#[cfg(feature = "azure")]
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
#[cfg(feature = "gcp")]
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::prefix::PrefixStore;
#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
use object_store::{BackoffConfig, RetryConfig};
use url::Url;

use crate::config::StoreConfig;
use crate::error::{Error, Result};

/// Which kind of storage a [`Store`](crate::Store) talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// A directory on local disk (`file://`).
    Local,
    /// Amazon S3 or an S3-compatible service (`s3://`).
    S3,
    /// Google Cloud Storage (`gs://`).
    Gcs,
    /// Azure Blob Storage (`az://`).
    Azure,
    /// Process memory (`memory://`), for tests and examples.
    Memory,
}

impl Backend {
    /// The URL scheme of this backend.
    pub fn scheme(self) -> &'static str {
        match self {
            Backend::Local => "file",
            Backend::S3 => "s3",
            Backend::Gcs => "gs",
            Backend::Azure => "az",
            Backend::Memory => "memory",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.scheme())
    }
}

/// A backend ready to use: the object store, rooted at the URL's prefix.
pub(crate) struct Opened {
    pub(crate) inner: Arc<dyn ObjectStore>,
    pub(crate) backend: Backend,
    /// The URL in canonical form (absolute path for local disk).
    pub(crate) url: String,
}

pub(crate) fn open(url: &str, config: &StoreConfig) -> Result<Opened> {
    config.validate()?;
    let url = url.trim();
    if url.is_empty() {
        return Err(Error::config("store url is empty"));
    }
    // Plain paths and `file://` URLs (relative ones too) are local directories.
    if let Some(path) = url.strip_prefix("file://") {
        return open_local(path, url, config);
    }
    if !url.contains("://") {
        return open_local(url, url, config);
    }

    let parsed = Url::parse(url)
        .map_err(|e| Error::config(format!("cannot parse store url {url:?}: {e}")))?;
    let bucket = parsed.host_str().unwrap_or("").to_string();
    let prefix = parsed.path().trim_matches('/').to_string();
    let root = parse_prefix(&prefix, url)?;

    match parsed.scheme() {
        "memory" => {
            ensure_no_options(config, url)?;
            let inner: Arc<dyn ObjectStore> = memory_store(&bucket);
            Ok(Opened {
                inner: rooted(inner, root),
                backend: Backend::Memory,
                url: url.to_string(),
            })
        }
        #[cfg(feature = "aws")]
        "s3" => {
            require_bucket(&bucket, "bucket", url)?;
            let mut builder = AmazonS3Builder::from_env()
                .with_bucket_name(&bucket)
                .with_retry(retry_config(config));
            for (key, value) in client_options(config).chain(user_options(config)) {
                let key: AmazonS3ConfigKey = key.parse().map_err(|_| unknown_option(&key, url))?;
                builder = builder.with_config(key, value);
            }
            let inner = builder.build().map_err(|e| build_error(url, e))?;
            Ok(remote(Arc::new(inner), root, Backend::S3, url))
        }
        #[cfg(feature = "gcp")]
        "gs" => {
            require_bucket(&bucket, "bucket", url)?;
            let mut builder = GoogleCloudStorageBuilder::from_env()
                .with_bucket_name(&bucket)
                .with_retry(retry_config(config));
            for (key, value) in client_options(config).chain(user_options(config)) {
                let key: GoogleConfigKey = key.parse().map_err(|_| unknown_option(&key, url))?;
                builder = builder.with_config(key, value);
            }
            let inner = builder.build().map_err(|e| build_error(url, e))?;
            Ok(remote(Arc::new(inner), root, Backend::Gcs, url))
        }
        #[cfg(feature = "azure")]
        "az" | "azure" => {
            require_bucket(&bucket, "container", url)?;
            let mut builder = MicrosoftAzureBuilder::from_env()
                .with_container_name(&bucket)
                .with_retry(retry_config(config));
            for (key, value) in client_options(config).chain(user_options(config)) {
                let key: AzureConfigKey = key.parse().map_err(|_| unknown_option(&key, url))?;
                builder = builder.with_config(key, value);
            }
            let inner = builder.build().map_err(|e| build_error(url, e))?;
            Ok(remote(Arc::new(inner), root, Backend::Azure, url))
        }
        // Known, but left out of this build (the arms above take those it has).
        #[allow(unreachable_patterns)]
        scheme @ ("s3" | "gs" | "az" | "azure") => Err(left_out(scheme, url)),
        other => Err(Error::config(format!(
            "unknown scheme {other:?} in store url {url:?}: expected file://, s3://, gs://, az:// or memory://"
        ))),
    }
}

/// The error for a URL of a cloud backend this build leaves out.
fn left_out(scheme: &str, url: &str) -> Error {
    let (backend, feature) = match scheme {
        "s3" => ("S3", "aws"),
        "gs" => ("Google Cloud Storage", "gcp"),
        _ => ("Azure Blob Storage", "azure"),
    };
    Error::config(format!(
        "store url {url:?} needs {backend}, which this build leaves out: build with the `{feature}` feature (of ckpt-storage, or of ckpt)"
    ))
}

fn open_local(path: &str, original: &str, config: &StoreConfig) -> Result<Opened> {
    ensure_no_options(config, original)?;
    if path.is_empty() {
        return Err(Error::config(format!(
            "store url {original:?} names no directory"
        )));
    }
    let mut dir = PathBuf::from(path);
    if dir.is_relative() {
        let cwd = std::env::current_dir().map_err(|e| {
            Error::with_source(
                crate::ErrorKind::Config,
                format!("cannot resolve relative store url {original:?}: {e}"),
                e,
            )
        })?;
        dir = cwd.join(dir);
    }
    // Opening has no side effect: the directory is created by the first write. The
    // store is rooted at the deepest directory that exists, and the rest of the path
    // becomes a prefix.
    // One look per path (not `is_dir` then `exists`): another rank's first write may
    // create the directory between two looks, and a directory is never a file.
    let mut base = dir.clone();
    let mut missing: Vec<String> = Vec::new();
    loop {
        match std::fs::metadata(&base) {
            Ok(meta) if meta.is_dir() => break,
            Ok(_) => {
                return Err(Error::config(format!(
                    "store url {original:?}: {} is a file, not a directory",
                    base.display()
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(local_dir_error(&base, e)),
        }
        let name = match base.file_name() {
            Some(name) => name.to_string_lossy().into_owned(),
            None => return Err(local_dir_error(&dir, std::io::ErrorKind::NotFound.into())),
        };
        missing.push(name);
        base = match base.parent() {
            Some(parent) => parent.to_path_buf(),
            None => return Err(local_dir_error(&dir, std::io::ErrorKind::NotFound.into())),
        };
    }
    missing.reverse();
    if missing.iter().any(|m| m == ".." || m == ".") {
        return Err(Error::config(format!(
            "store url {original:?}: '.' or '..' below a directory that does not exist"
        )));
    }
    let base = base.canonicalize().map_err(|e| local_dir_error(&base, e))?;
    let inner = LocalFileSystem::new_with_prefix(&base)
        .map_err(|e| {
            Error::with_source(
                crate::ErrorKind::Config,
                format!("cannot open directory {}: {e}", base.display()),
                e,
            )
        })?
        .with_fsync(config.fsync);
    let inner = crate::confined::Confined::new(inner, base.clone());
    let mut canonical = base.clone();
    canonical.extend(&missing);
    let root = if missing.is_empty() {
        None
    } else {
        parse_prefix(&missing.join("/"), original)?
    };
    Ok(Opened {
        inner: rooted(Arc::new(inner), root),
        backend: Backend::Local,
        url: format!("file://{}", canonical.display()),
    })
}

fn local_dir_error(dir: &FsPath, e: std::io::Error) -> Error {
    Error::with_source(
        crate::ErrorKind::Config,
        format!("cannot create or open directory {}: {e}", dir.display()),
        e,
    )
}

/// `memory://NAME` is one store per name for the whole process, so that several
/// handles (several ranks in one test process) see the same objects.
fn memory_store(name: &str) -> Arc<dyn ObjectStore> {
    static STORES: OnceLock<Mutex<HashMap<String, Arc<InMemory>>>> = OnceLock::new();
    let stores = STORES.get_or_init(Default::default);
    let mut stores = stores
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    stores
        .entry(name.to_string())
        .or_insert_with(|| Arc::new(InMemory::new()))
        .clone()
}

fn parse_prefix(prefix: &str, url: &str) -> Result<Option<Path>> {
    if prefix.is_empty() {
        return Ok(None);
    }
    Path::parse(prefix).map(Some).map_err(|e| {
        Error::config(format!(
            "invalid prefix {prefix:?} in store url {url:?}: {e}"
        ))
    })
}

fn rooted(inner: Arc<dyn ObjectStore>, root: Option<Path>) -> Arc<dyn ObjectStore> {
    match root {
        Some(root) => Arc::new(PrefixStore::new(inner, root)),
        None => inner,
    }
}

#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
fn remote(inner: Arc<dyn ObjectStore>, root: Option<Path>, backend: Backend, url: &str) -> Opened {
    Opened {
        inner: rooted(inner, root),
        backend,
        url: url.trim_end_matches('/').to_string(),
    }
}

#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
fn require_bucket(bucket: &str, what: &str, url: &str) -> Result<()> {
    if bucket.is_empty() {
        return Err(Error::config(format!("store url {url:?} names no {what}")));
    }
    Ok(())
}

fn ensure_no_options(config: &StoreConfig, url: &str) -> Result<()> {
    match config.options.first() {
        Some((key, _)) => Err(Error::config(format!(
            "option {key:?} does not apply to store url {url:?}: local and memory stores take no backend options"
        ))),
        None => Ok(()),
    }
}

#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
fn retry_config(config: &StoreConfig) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: config.retry.init_backoff,
            max_backoff: config.retry.max_backoff,
            base: config.retry.backoff_base,
        },
        max_retries: config.retry.max_retries,
        retry_timeout: config.retry.retry_timeout,
    }
}

#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
/// Timeouts go through the builders' string options rather than `ClientOptions`:
/// replacing the client options would drop what `from_env` read (`*_ALLOW_HTTP`).
fn client_options(config: &StoreConfig) -> impl Iterator<Item = (String, String)> {
    [
        (
            "timeout".to_string(),
            format!("{}ms", config.request_timeout.as_millis()),
        ),
        (
            "connect_timeout".to_string(),
            format!("{}ms", config.connect_timeout.as_millis()),
        ),
    ]
    .into_iter()
}

#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
fn user_options(config: &StoreConfig) -> impl Iterator<Item = (String, String)> + '_ {
    config.options.iter().cloned()
}

#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
fn unknown_option(key: &str, url: &str) -> Error {
    Error::config(format!("unknown option {key:?} for store url {url:?}"))
}

#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
fn build_error(url: &str, e: object_store::Error) -> Error {
    let reason = lowercase_first(&e.to_string());
    Error::with_source(
        crate::ErrorKind::Config,
        format!("cannot configure store {url}: {reason}"),
        e,
    )
}

pub(crate) fn lowercase_first(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cloud_url_this_build_leaves_out_names_the_feature_that_brings_it() {
        for (url, backend, feature) in [
            ("s3://b/p", "S3", "`aws`"),
            ("gs://b", "Google Cloud Storage", "`gcp`"),
            ("az://c/p", "Azure Blob Storage", "`azure`"),
        ] {
            let scheme = url.split("://").next().unwrap();
            let message = left_out(scheme, url).to_string();
            assert!(
                message.contains(url) && message.contains(backend) && message.contains(feature),
                "{message}"
            );
        }
    }
}
