//! [`Store`]: the operations ckpt needs, with one set of guarantees on every backend.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::SystemTime;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
use object_store::client::HttpErrorKind;
use object_store::path::Path;
use object_store::{
    GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    WriteMultipart,
};

use crate::config::StoreConfig;
use crate::error::{Error, ErrorKind, Result};
use crate::open::{Backend, lowercase_first, open};
use crate::ranges::coalesce;
use crate::sent;

/// What a store knows about one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Key relative to the store's root.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// When the object was last written.
    pub last_modified: SystemTime,
    /// The backend's version tag, where it has one.
    pub e_tag: Option<String>,
}

/// One level of a listing with a delimiter: objects directly under the prefix and
/// the "directories" below it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// Objects whose key has no further `/` after the prefix, sorted by key.
    pub objects: Vec<ObjectInfo>,
    /// Distinct next-level prefixes (without a trailing `/`), sorted.
    pub prefixes: Vec<String>,
}

/// A handle on a checkpoint root: a directory, bucket prefix or container prefix.
///
/// Cheap to clone; clones share connections. Keys are `/`-separated names relative to
/// the root, without empty, `.` or `..` segments.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    backend: Backend,
    url: Arc<str>,
    config: Arc<StoreConfig>,
    /// Operations issued through this handle and its clones, by kind (see
    /// [`Store::requests`]).
    requests: Arc<RequestCounters>,
    /// Writes are checked against the ETag the server answers (S3, until a read-back
    /// shows that this bucket's ETags are not MD5s; see `sent.rs`).
    check_e_tags: Arc<AtomicBool>,
}

/// Requests sent, by kind (see [`Store::request_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestCounts {
    /// Listings (each page counts once).
    pub list: u64,
    /// Reads: whole objects and ranges (a coalesced range counting once).
    pub get: u64,
    /// Metadata requests (size, existence).
    pub head: u64,
    /// Writes: single puts, and a multipart upload's parts and completion.
    pub put: u64,
    /// Deletes.
    pub delete: u64,
}

impl RequestCounts {
    /// Every request.
    pub fn total(&self) -> u64 {
        self.list + self.get + self.head + self.put + self.delete
    }

    /// The requests of `self` since `before` (counts of the same handle).
    pub fn since(&self, before: &RequestCounts) -> RequestCounts {
        RequestCounts {
            list: self.list.saturating_sub(before.list),
            get: self.get.saturating_sub(before.get),
            head: self.head.saturating_sub(before.head),
            put: self.put.saturating_sub(before.put),
            delete: self.delete.saturating_sub(before.delete),
        }
    }
}

#[derive(Debug, Default)]
struct RequestCounters {
    list: AtomicU64,
    get: AtomicU64,
    head: AtomicU64,
    put: AtomicU64,
    delete: AtomicU64,
}

#[derive(Clone, Copy)]
enum Kind {
    List,
    Get,
    Head,
    Put,
    Delete,
}

/// What a write left at its key, as far as its ETag tells.
enum Stored {
    /// The bytes sent, or nothing to tell otherwise.
    Same,
    /// Other bytes: why, naming the first differing offset.
    Differs(String),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("url", &self.url).finish()
    }
}

impl Store {
    /// Opens the store at `url` with default settings. See [`Store::open`].
    pub fn from_url(url: &str) -> Result<Self> {
        Self::open(url, StoreConfig::default())
    }

    /// Opens the store at `url`:
    ///
    /// - `file:///abs/dir`, `file://rel/dir` or a plain path: a local directory,
    ///   created by the first write (opening has no side effect); relative paths are resolved against the current directory;
    /// - `s3://bucket/prefix`, `gs://bucket/prefix`, `az://container/prefix`;
    /// - `memory://name`: process memory, shared by every handle with the same name.
    ///
    /// Opening does no I/O on remote stores: an unreachable endpoint or rejected
    /// credentials show up on the first operation.
    pub fn open(url: &str, config: StoreConfig) -> Result<Self> {
        let opened = open(url, &config)?;
        Ok(Self {
            inner: opened.inner,
            backend: opened.backend,
            url: opened.url.into(),
            config: Arc::new(config),
            requests: Arc::default(),
            check_e_tags: Arc::new(AtomicBool::new(opened.backend == Backend::S3)),
        })
    }

    /// Operations this handle (and its clones) sent to the store: one per request for
    /// every call, a ranged read counting once per coalesced range, and a streaming
    /// upload once per part plus its completion. Retries inside the client are not
    /// counted. For measuring how many requests a protocol costs.
    pub fn requests(&self) -> u64 {
        self.request_counts().total()
    }

    /// [`Store::requests`] by kind: LIST, GET (whole and ranged), HEAD, PUT (a
    /// multipart upload's parts and completion included) and DELETE.
    pub fn request_counts(&self) -> RequestCounts {
        let c = &self.requests;
        RequestCounts {
            list: c.list.load(Ordering::Relaxed),
            get: c.get.load(Ordering::Relaxed),
            head: c.head.load(Ordering::Relaxed),
            put: c.put.load(Ordering::Relaxed),
            delete: c.delete.load(Ordering::Relaxed),
        }
    }

    /// A clone that shares connections but counts its requests on its own (to count
    /// one simulated rank's requests among many).
    pub fn with_own_counter(&self) -> Store {
        Store {
            requests: Arc::default(),
            ..self.clone()
        }
    }

    fn count(&self, kind: Kind, n: u64) {
        let c = &self.requests;
        match kind {
            Kind::List => &c.list,
            Kind::Get => &c.get,
            Kind::Head => &c.head,
            Kind::Put => &c.put,
            Kind::Delete => &c.delete,
        }
        .fetch_add(n, Ordering::Relaxed);
    }

    /// The canonical URL of the store's root.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The kind of backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The directory of a local store (`None` for other backends), for callers that
    /// write large files themselves with I/O object_store does not offer (direct
    /// I/O). They must keep this crate's guarantees: atomic, durable, and invisible
    /// until complete (write beside the key with a `#` suffix, then rename).
    pub fn local_root(&self) -> Option<std::path::PathBuf> {
        match self.backend {
            Backend::Local => self
                .url
                .strip_prefix("file://")
                .map(std::path::PathBuf::from),
            _ => None,
        }
    }

    /// The file of `key` on a local store (`None` for other backends), for callers
    /// that read or write it with I/O object_store does not offer (direct I/O).
    ///
    /// No symbolic link under a local root is followed, by this or by any other
    /// operation: a checkpoint root is untrusted input and ckpt writes no links, so
    /// one found there could only lead a read, or a deletion, outside the checkpoint
    /// (or onto another checkpoint's objects). A key whose path crosses a link is
    /// refused with an error naming the link and its target.
    pub fn local_path(&self, key: &str) -> Result<Option<std::path::PathBuf>> {
        let Some(root) = self.local_root() else {
            return Ok(None);
        };
        self.path("open", key)?;
        match crate::confined::link_on_path(&root, key) {
            Some(link) => Err(Error::with_source(
                ErrorKind::Permanent,
                format!("open {}/{key}: {link}", self.url),
                link,
            )),
            None => Ok(Some(root.join(key))),
        }
    }

    /// The settings the store was opened with.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Writes the whole object at `key`, replacing any previous version.
    ///
    /// Atomic: readers see the old object or the new one, never a part. On local
    /// disk the file and its directory are fsynced before this returns (unless
    /// `fsync` is off).
    ///
    /// On S3 a write whose ETag shows other bytes stored than those sent (a body
    /// damaged in flight) is made again, up to 3 times, then fails as
    /// [`ErrorKind::Transient`].
    pub async fn put(&self, key: &str, data: impl Into<Bytes>) -> Result<()> {
        let path = self.path("put", key)?;
        let sent = [data.into()];
        let mut why = String::new();
        for _ in 0..sent::ATTEMPTS {
            self.count(Kind::Put, 1);
            let result = self
                .inner
                .put(&path, sent.iter().cloned().collect())
                .await
                .map_err(|e| self.error("put", key, e))?;
            match self.stored("put", key, &path, &sent, result.e_tag).await? {
                Stored::Same => return Ok(()),
                Stored::Differs(what) => why = what,
            }
        }
        Err(self.kept_differing("put", key, &why))
    }

    /// Whether the object a write just left at `path` holds `sent`, as its ETag
    /// (`e_tag`, as the server answered) tells; see `sent.rs`. A difference is
    /// settled by reading the object back: equal bytes mean this bucket's ETags are
    /// not MD5s, and the store stops comparing them.
    async fn stored(
        &self,
        op: &str,
        key: &str,
        path: &Path,
        sent: &[Bytes],
        e_tag: Option<String>,
    ) -> Result<Stored> {
        if !self.check_e_tags.load(Ordering::Relaxed) {
            return Ok(Stored::Same);
        }
        let Some(e_tag) = e_tag else {
            return Ok(Stored::Same);
        };
        let md5 = sent::hex(&sent::md5_of(sent));
        if sent::bare(&e_tag) == md5 {
            return Ok(Stored::Same);
        }
        let stored = self
            .inner
            .get(path)
            .await
            .map_err(|e| self.error(op, key, e))?
            .bytes()
            .await
            .map_err(|e| self.error(op, key, e))?;
        match sent::first_difference(sent, &stored) {
            None => {
                self.e_tags_are_not_md5s(&e_tag);
                Ok(Stored::Same)
            }
            Some(at) => {
                tracing::warn!(store = %self.url, key, offset = at, e_tag = %e_tag, md5 = %md5, "the server stored other bytes than those sent (damaged in flight?); writing again");
                Ok(Stored::Differs(format!(
                    "the server stored other bytes than those sent, from byte {at} on (etag {}, md5 of the body {md5})",
                    sent::bare(&e_tag)
                )))
            }
        }
    }

    fn e_tags_are_not_md5s(&self, e_tag: &str) {
        if self.check_e_tags.swap(false, Ordering::Relaxed) {
            tracing::warn!(store = %self.url, e_tag, "this bucket's etags are not md5s of the bytes (sse-kms?): writes are no longer checked against them");
        }
    }

    fn kept_differing(&self, op: &str, key: &str, why: &str) -> Error {
        Error::new(
            ErrorKind::Transient,
            format!(
                "{op} {}/{key}: {why}; the same after {} writes",
                self.url,
                sent::ATTEMPTS
            ),
        )
    }

    /// Writes the object at `key` only if no object is there: the commit primitive.
    ///
    /// Of any number of concurrent callers for one key exactly one succeeds; the others
    /// get [`ErrorKind::AlreadyExists`]. Atomic and, on local disk, durable as
    /// [`Store::put`]. Backends: S3 conditional put (`If-None-Match: *`), GCS
    /// `ifGenerationMatch=0`, Azure `If-None-Match: *`, local disk a hard link of a
    /// fully written temporary file, memory a lock.
    ///
    /// On S3 a create whose ETag shows other bytes stored than those sent (a body
    /// damaged in flight) is undone (the object deleted: the create won, so it is
    /// this caller's) and made again, up to 3 times, then fails as
    /// [`ErrorKind::Transient`] with nothing left at `key`. A reader may meet the
    /// damaged object in between: every object ckpt creates carries its own
    /// checksum.
    pub async fn put_if_absent(&self, key: &str, data: impl Into<Bytes>) -> Result<()> {
        let path = self.path("create", key)?;
        let sent = [data.into()];
        let mut why = String::new();
        for _ in 0..sent::ATTEMPTS {
            self.count(Kind::Put, 1);
            let options = PutOptions::from(PutMode::Create);
            let result = self
                .inner
                .put_opts(&path, sent.iter().cloned().collect(), options)
                .await
                .map_err(|e| self.error("create", key, e))?;
            match self
                .stored("create", key, &path, &sent, result.e_tag)
                .await?
            {
                Stored::Same => return Ok(()),
                Stored::Differs(what) => why = what,
            }
            self.count(Kind::Delete, 1);
            self.inner
                .delete(&path)
                .await
                .map_err(|e| self.error("create", key, e))?;
        }
        Err(self.kept_differing("create", key, &why))
    }

    /// Starts a streaming upload of a large object at `key`.
    ///
    /// Bytes written are cut into parts of `part_size`, uploaded with at most
    /// `part_concurrency` parts in flight. Nothing is visible at `key` until
    /// [`Upload::finish`] returns; [`Upload::abort`] (or dropping the upload) leaves
    /// no object behind. An object smaller than one part is written with a single put.
    pub fn upload(&self, key: &str) -> Result<Upload> {
        let path = self.path("upload", key)?;
        Ok(Upload {
            store: self.clone(),
            key: key.to_string(),
            path,
            pending: Vec::new(),
            writer: None,
            written: 0,
            digests: self
                .check_e_tags
                .load(Ordering::Relaxed)
                .then(|| sent::PartDigests::new(self.config.part_size)),
        })
    }

    /// Reads the whole object at `key`.
    pub async fn get(&self, key: &str) -> Result<Bytes> {
        let path = self.path("get", key)?;
        self.reading("get", key, || async {
            let result = self.get_whole(key, &path).await?;
            result.bytes().await.map_err(|e| self.error("get", key, e))
        })
        .await
    }

    /// One request for the whole object at `key` (`path`): its size, and its body
    /// still to be read.
    async fn get_whole(&self, key: &str, path: &Path) -> Result<object_store::GetResult> {
        self.count(Kind::Get, 1);
        self.inner
            .get(path)
            .await
            .map_err(|e| self.error("get", key, e))
    }

    /// Reads the whole object at `key` when it holds at most `limit` bytes, in one
    /// request.
    ///
    /// For small objects that anyone could have written (the hints at a checkpoint's
    /// root): memory stays within `limit` whatever the object holds. A larger object
    /// gives an [`ErrorKind::Permanent`] error naming its size and the limit, and its
    /// body is not read (the size comes with the answer, before the body); a body
    /// that runs past `limit` whatever the size said is cut off with the same error.
    pub async fn get_at_most(&self, key: &str, limit: u64) -> Result<Bytes> {
        let path = self.path("get", key)?;
        let too_large = |size: String| {
            Error::new(
                ErrorKind::Permanent,
                format!(
                    "get {}/{key}: the object holds {size} bytes, over the {limit}-byte limit of this read",
                    self.url
                ),
            )
        };
        self.reading("get", key, || async {
            let result = self.get_whole(key, &path).await?;
            if result.meta.size > limit {
                return Err(too_large(result.meta.size.to_string()));
            }
            let mut body = result.into_stream();
            let mut read = Vec::new();
            while let Some(chunk) = body
                .try_next()
                .await
                .map_err(|e| self.error("get", key, e))?
            {
                if (read.len() + chunk.len()) as u64 > limit {
                    return Err(too_large(format!("more than {limit}")));
                }
                read.extend_from_slice(&chunk);
            }
            Ok(Bytes::from(read))
        })
        .await
    }

    /// Runs the read `attempt`, and again after a pause while it fails with a
    /// transient error from a local file system (EIO from a failing device, a stale
    /// network file system handle): object_store retries the remote backends itself,
    /// a local one not at all, and a read that a moment's wait would have let
    /// through must not cost a recovery its checkpoint.
    async fn reading<T, F, Fut>(&self, op: &str, key: &str, mut attempt: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut pauses = LOCAL_READ_PAUSES.iter();
        loop {
            match attempt().await {
                Err(e) if e.is_retryable() && self.backend == Backend::Local => {
                    let Some(pause) = pauses.next() else {
                        return Err(Error::new(
                            ErrorKind::Transient,
                            format!("{e} (read {} times)", LOCAL_READ_PAUSES.len() + 1),
                        ));
                    };
                    tracing::warn!(store = %self.url, op, key, error = %e, "a read of local storage failed; reading again in {} ms", pause.as_millis());
                    tokio::time::sleep(*pause).await;
                }
                other => return other,
            }
        }
    }

    /// Reads bytes `range` of the object at `key`.
    ///
    /// The whole range must lie inside the object: a range that ends past the end
    /// gives an [`ErrorKind::Permanent`] error naming the object's size, on every
    /// backend (some would silently truncate). An empty range reads nothing.
    pub async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        let path = self.path("get_range", key)?;
        self.reading("get_range", key, || {
            self.read_range(key, &path, range.clone())
        })
        .await
    }

    /// Reads several ranges of one object, returned in the order asked.
    ///
    /// Ranges closer than `coalesce_gap` are fetched as one request (up to
    /// `max_coalesced_bytes`), and up to `range_concurrency` requests run at once.
    /// Every range must lie inside the object, as for [`Store::get_range`].
    pub async fn get_ranges(&self, key: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        let path = self.path("get_ranges", key)?;
        for r in ranges {
            check_range(key, &self.url, r)?;
        }
        let wanted: Vec<usize> = (0..ranges.len())
            .filter(|&i| !ranges[i].is_empty())
            .collect();
        let nonempty: Vec<Range<u64>> = wanted.iter().map(|&i| ranges[i].clone()).collect();
        let fetches = coalesce(
            &nonempty,
            self.config.coalesce_gap,
            self.config.max_coalesced_bytes,
        );
        let mut out = vec![Bytes::new(); ranges.len()];
        let mut fetched = futures::stream::iter(fetches.into_iter().map(|fetch| {
            let path = &path;
            async move {
                let data = self
                    .reading("get_ranges", key, || {
                        self.read_range(key, path, fetch.range.clone())
                    })
                    .await?;
                Ok::<_, Error>((fetch, data))
            }
        }))
        .buffer_unordered(self.config.range_concurrency);
        while let Some((fetch, data)) = fetched.try_next().await? {
            for member in fetch.members {
                let r = &nonempty[member];
                let start = (r.start - fetch.range.start) as usize;
                let end = (r.end - fetch.range.start) as usize;
                out[wanted[member]] = data.slice(start..end);
            }
        }
        Ok(out)
    }

    /// Size and version of the object at `key`.
    pub async fn head(&self, key: &str) -> Result<ObjectInfo> {
        let path = self.path("head", key)?;
        self.reading("head", key, || async {
            self.count(Kind::Head, 1);
            let meta = self
                .inner
                .head(&path)
                .await
                .map_err(|e| self.error("head", key, e))?;
            Ok(info(meta))
        })
        .await
    }

    /// Every object whose key lies under `prefix` (a directory-like prefix: `a/b`
    /// lists `a/b/...`, not `a/bc`; `""` lists everything), sorted by key.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let path = self.prefix_path("list", prefix)?;
        self.reading("list", prefix, || async {
            self.count(Kind::List, 1);
            let mut objects: Vec<ObjectInfo> = self
                .inner
                .list(path.as_ref())
                .map_ok(info)
                .try_collect()
                .await
                .map_err(|e| self.error("list", prefix, e))?;
            objects.sort_by(|a, b| a.key.cmp(&b.key));
            Ok(objects)
        })
        .await
    }

    /// Objects under `prefix` whose keys sort strictly after `after` (a full key),
    /// sorted by key. On S3 and GCS the store skips the earlier keys itself, so
    /// reading the tail of a long, ordered series of keys (a log) costs one request,
    /// not a listing of the whole series.
    pub async fn list_after(&self, prefix: &str, after: &str) -> Result<Vec<ObjectInfo>> {
        let path = self.prefix_path("list", prefix)?;
        let offset = self.path("list", after)?;
        self.reading("list", prefix, || async {
            self.count(Kind::List, 1);
            let mut objects: Vec<ObjectInfo> = self
                .inner
                .list_with_offset(path.as_ref(), &offset)
                .map_ok(info)
                .try_collect()
                .await
                .map_err(|e| self.error("list", prefix, e))?;
            objects.retain(|o| o.key.as_str() > after);
            objects.sort_by(|a, b| a.key.cmp(&b.key));
            Ok(objects)
        })
        .await
    }

    /// Objects under `prefix` whose keys sort strictly after `after` and no later
    /// than `until` (full keys), sorted by key. On S3, GCS and Azure, whose listings
    /// come in key order, the store starts at `after` and stops requesting pages once
    /// it has passed `until`: one range of a long series of keys costs the pages of
    /// that range, not a listing of the whole series.
    pub async fn list_between(
        &self,
        prefix: &str,
        after: &str,
        until: &str,
    ) -> Result<Vec<ObjectInfo>> {
        let path = self.prefix_path("list", prefix)?;
        let offset = self.path("list", after)?;
        let ordered = matches!(self.backend(), Backend::S3 | Backend::Gcs | Backend::Azure);
        self.reading("list", prefix, || async {
            self.count(Kind::List, 1);
            let mut listing = self.inner.list_with_offset(path.as_ref(), &offset);
            let mut objects = Vec::new();
            while let Some(meta) = listing.next().await {
                let object = info(meta.map_err(|e| self.error("list", prefix, e))?);
                if object.key.as_str() > until {
                    if ordered {
                        break;
                    }
                } else if object.key.as_str() > after {
                    objects.push(object);
                }
            }
            objects.sort_by(|a, b| a.key.cmp(&b.key));
            Ok(objects)
        })
        .await
    }

    /// One level of the tree under `prefix`: objects directly in it and the
    /// prefixes one level down (like `ls` of a directory).
    pub async fn list_dir(&self, prefix: &str) -> Result<Listing> {
        let path = self.prefix_path("list", prefix)?;
        let result = self
            .reading("list", prefix, || async {
                self.count(Kind::List, 1);
                self.inner
                    .list_with_delimiter(path.as_ref())
                    .await
                    .map_err(|e| self.error("list", prefix, e))
            })
            .await?;
        let mut objects: Vec<ObjectInfo> = result.objects.into_iter().map(info).collect();
        objects.sort_by(|a, b| a.key.cmp(&b.key));
        let mut prefixes: Vec<String> = result
            .common_prefixes
            .into_iter()
            .map(|p| p.to_string())
            .collect();
        prefixes.sort();
        Ok(Listing { objects, prefixes })
    }

    /// Deletes the object at `key`. Deleting a missing object succeeds, on every
    /// backend, so that cleanup can be retried.
    pub async fn delete(&self, key: &str) -> Result<()> {
        self.count(Kind::Delete, 1);
        let path = self.path("delete", key)?;
        match self.inner.delete(&path).await {
            Ok(()) => Ok(()),
            Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error("delete", key, e)),
        }
    }

    /// Deletes every object under `prefix` (directory-like, as in [`Store::list`])
    /// and returns how many were deleted. Not atomic: a failure part-way leaves the
    /// rest in place, and running it again finishes the job.
    pub async fn delete_prefix(&self, prefix: &str) -> Result<usize> {
        if prefix.trim_matches('/').is_empty() {
            return Err(Error::config(format!(
                "delete_prefix on {} needs a non-empty prefix; refusing to delete the whole store",
                self.url
            )));
        }
        let objects = self.list(prefix).await?;
        let locations = futures::stream::iter(
            objects
                .iter()
                .map(|o| Ok(Path::from(o.key.as_str())))
                .collect::<Vec<_>>(),
        )
        .boxed();
        let mut deleted = 0;
        let mut results = self.inner.delete_stream(locations);
        while let Some(result) = results.next().await {
            match result {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => deleted += 1,
                Err(e) => return Err(self.error("delete", prefix, e)),
            }
        }
        drop(results);
        if self.backend == Backend::Local {
            self.remove_local_leftovers(prefix).await?;
        }
        Ok(deleted)
    }

    /// Staging files that crashed local writes left under `prefix` (`KEY#…`; listings
    /// hide some of them, and none is an object anyone wrote on purpose). Empty on other
    /// backends, where an unfinished upload never becomes an object. Keys are relative to the root, as
    /// listings' are; [`Store::delete_leftover`] removes one.
    pub async fn staging_leftovers(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let Some(root) = self.local_root() else {
            return Ok(Vec::new());
        };
        let start = root.join(prefix.trim_matches('/'));
        let found = tokio::task::spawn_blocking(move || {
            let mut found = Vec::new();
            let mut pending = vec![start];
            while let Some(dir) = pending.pop() {
                let Ok(entries) = std::fs::read_dir(&dir) else {
                    continue;
                };
                for entry in entries.flatten() {
                    let Ok(meta) = entry.metadata() else { continue };
                    let path = entry.path();
                    if meta.is_dir() {
                        pending.push(path);
                    } else if entry.file_name().to_string_lossy().contains('#')
                        && let Ok(relative) = path.strip_prefix(&root)
                    {
                        found.push(ObjectInfo {
                            key: relative.to_string_lossy().into_owned(),
                            size: meta.len(),
                            last_modified: meta
                                .modified()
                                .unwrap_or(std::time::SystemTime::UNIX_EPOCH),
                            e_tag: None,
                        });
                    }
                }
            }
            found
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Permanent, format!("leftover scan failed: {e}")))?;
        Ok(found)
    }

    /// Removes one staging leftover found by [`Store::staging_leftovers`].
    pub async fn delete_leftover(&self, key: &str) -> Result<()> {
        if self.local_root().is_none() {
            return Ok(());
        }
        if !key.contains('#') || key.split('/').any(|s| s == ".." || s.is_empty()) {
            return Err(Error::config(format!(
                "{key:?} is not a staging leftover of {}",
                self.url
            )));
        }
        let Some(path) = self.local_path(key)? else {
            return Ok(());
        };
        match tokio::fs::remove_file(path).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::with_source(
                ErrorKind::Permanent,
                format!("delete {}/{key}: {e}", self.url),
                e,
            )),
            _ => Ok(()),
        }
    }

    /// On local disk an upload cut short by a crash leaves its staging file
    /// (`KEY#N`, invisible to listings) and directories behind; removing the prefix's
    /// directory takes them too.
    async fn remove_local_leftovers(&self, prefix: &str) -> Result<()> {
        let Some(dir) = self.local_path(prefix.trim_matches('/'))? else {
            return Ok(());
        };
        let result = tokio::task::spawn_blocking(move || {
            // Only a directory: a file named like the prefix is an object, not ours.
            if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
                return Ok(());
            }
            match std::fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        })
        .await;
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::with_source(
                ErrorKind::Permanent,
                format!(
                    "delete {}/{prefix}: cannot remove leftover files: {e}",
                    self.url
                ),
                e,
            )),
            Err(e) => Err(Error::new(
                ErrorKind::Permanent,
                format!("delete {}/{prefix}: cleanup task failed: {e}", self.url),
            )),
        }
    }

    async fn read_range(&self, key: &str, path: &Path, range: Range<u64>) -> Result<Bytes> {
        check_range(key, &self.url, &range)?;
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        self.count(Kind::Get, 1);
        let options = GetOptions {
            range: Some(GetRange::Bounded(range.clone())),
            ..GetOptions::default()
        };
        let attempt = async {
            let result = self.inner.get_opts(path, options).await?;
            result.bytes().await
        };
        match attempt.await {
            Ok(data) if data.len() as u64 == range.end - range.start => Ok(data),
            Ok(data) => Err(Error::new(
                ErrorKind::Permanent,
                format!(
                    "read {}/{key}: range {}..{} ends past the end of the object ({} bytes available from offset {})",
                    self.url,
                    range.start,
                    range.end,
                    data.len(),
                    range.start
                ),
            )),
            Err(e) => {
                let error = self.error("read", key, e);
                if matches!(error.kind(), ErrorKind::NotFound | ErrorKind::Transient) {
                    return Err(error);
                }
                // Backends disagree on how they refuse a range past the end (416,
                // an io error, a truncated body): one head turns all into one message.
                match self.inner.head(path).await {
                    Ok(meta) if range.end > meta.size => Err(Error::with_source(
                        ErrorKind::Permanent,
                        format!(
                            "read {}/{key}: range {}..{} ends past the end of the object ({} bytes)",
                            self.url, range.start, range.end, meta.size
                        ),
                        error,
                    )),
                    _ => Err(error),
                }
            }
        }
    }

    fn path(&self, op: &str, key: &str) -> Result<Path> {
        if key.is_empty() {
            return Err(Error::config(format!("{op} on {}: empty key", self.url)));
        }
        parse_key(op, &self.url, key)
    }

    fn prefix_path(&self, op: &str, prefix: &str) -> Result<Option<Path>> {
        let prefix = prefix.trim_matches('/');
        if prefix.is_empty() {
            return Ok(None);
        }
        parse_key(op, &self.url, prefix).map(Some)
    }

    pub(crate) fn error(&self, op: &str, key: &str, e: object_store::Error) -> Error {
        map_error(op, &self.url, key, e)
    }
}

/// The pauses before each new read of local storage after a transient error: seven
/// reads over about 3 s, then the error stands (and the caller decides: a recovery
/// tries again in a new generation, a save counts a failure).
pub const LOCAL_READ_PAUSES: [std::time::Duration; 6] = [
    std::time::Duration::from_millis(50),
    std::time::Duration::from_millis(100),
    std::time::Duration::from_millis(200),
    std::time::Duration::from_millis(400),
    std::time::Duration::from_millis(800),
    std::time::Duration::from_millis(1600),
];

fn parse_key(op: &str, url: &str, key: &str) -> Result<Path> {
    let bad = |why: &str| Error::config(format!("{op} on {url}: invalid key {key:?}: {why}"));
    if key.starts_with('/') || key.ends_with('/') {
        return Err(bad("keys are relative and do not end with '/'"));
    }
    for segment in key.split('/') {
        match segment {
            "" => return Err(bad("empty path segment")),
            "." | ".." => return Err(bad("'.' and '..' segments are not allowed")),
            _ => {}
        }
    }
    Path::parse(key).map_err(|e| bad(&e.to_string()))
}

fn check_range(key: &str, url: &str, range: &Range<u64>) -> Result<()> {
    if range.start > range.end {
        return Err(Error::new(
            ErrorKind::Permanent,
            format!(
                "read {url}/{key}: range {}..{} starts after it ends",
                range.start, range.end
            ),
        ));
    }
    Ok(())
}

fn info(meta: ObjectMeta) -> ObjectInfo {
    ObjectInfo {
        key: meta.location.to_string(),
        size: meta.size,
        last_modified: meta.last_modified.into(),
        e_tag: meta.e_tag,
    }
}

/// Maps an object_store error onto what the caller can do, with a message that names
/// the operation, the store and the key.
pub(crate) fn map_error(op: &str, url: &str, key: &str, e: object_store::Error) -> Error {
    use object_store::Error as E;
    let (kind, reason) = match &e {
        E::NotFound { .. } => (ErrorKind::NotFound, "not found".to_string()),
        E::AlreadyExists { .. } => (ErrorKind::AlreadyExists, "already exists".to_string()),
        E::Precondition { .. } if op == "create" => {
            (ErrorKind::AlreadyExists, "already exists".to_string())
        }
        E::NotSupported { .. } | E::NotImplemented { .. } => (
            ErrorKind::Config,
            format!(
                "not supported by this backend: {}",
                lowercase_first(&e.to_string())
            ),
        ),
        E::PermissionDenied { .. } => (ErrorKind::Config, "permission denied".to_string()),
        E::Unauthenticated { .. } => (
            ErrorKind::Config,
            "credentials missing or rejected".to_string(),
        ),
        E::UnknownConfigurationKey { .. } | E::InvalidPath { .. } => {
            (ErrorKind::Config, lowercase_first(&e.to_string()))
        }
        _ => classify_generic(&e),
    };
    Error::with_source(kind, format!("{op} {url}/{key}: {reason}"), e)
}

fn classify_generic(e: &object_store::Error) -> (ErrorKind, String) {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(link) = err.downcast_ref::<crate::confined::LinkRefused>() {
            return (ErrorKind::Permanent, link.to_string());
        }
        // object_store keeps its retry error private; its message carries the status.
        if let Some(code) = status_in_message(&err.to_string()) {
            let kind = if code == 429 || code == 408 || code >= 500 {
                ErrorKind::Transient
            } else if code == 401 || code == 403 {
                ErrorKind::Config
            } else {
                ErrorKind::Permanent
            };
            return (kind, format!("server answered status {code}"));
        }
        #[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
        if let Some(http) = err.downcast_ref::<object_store::client::HttpError>() {
            let kind = match http.kind() {
                HttpErrorKind::Connect
                | HttpErrorKind::Request
                | HttpErrorKind::Timeout
                | HttpErrorKind::Interrupted => ErrorKind::Transient,
                _ => ErrorKind::Permanent,
            };
            let what = match http.kind() {
                HttpErrorKind::Connect => "endpoint unreachable",
                HttpErrorKind::Timeout => "request timed out",
                HttpErrorKind::Interrupted | HttpErrorKind::Request => "connection failed",
                HttpErrorKind::Decode => "malformed response",
                _ => "http error",
            };
            return (kind, format!("{what} ({})", innermost(err)));
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return (crate::error::io_error_kind(io), io.to_string());
        }
        source = err.source();
    }
    (ErrorKind::Permanent, lowercase_first(&e.to_string()))
}

/// The HTTP status in an object_store retry error's message
/// ("... status code: 503 Service Unavailable ...").
fn status_in_message(message: &str) -> Option<u16> {
    let rest = &message[message.find("status code: ")? + "status code: ".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    match digits.len() {
        3 => digits.parse().ok(),
        _ => None,
    }
}

#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
fn innermost(err: &(dyn std::error::Error + 'static)) -> String {
    let mut last = err;
    while let Some(next) = last.source() {
        last = next;
    }
    lowercase_first(&last.to_string())
}

/// A streaming upload of one object; see [`Store::upload`].
///
/// # Cancel safety
///
/// Dropping an `Upload` (or a future of it) before [`Upload::finish`] returns leaves
/// nothing visible at the key. Parts already sent stay on S3-like services as an
/// incomplete multipart upload until [`Upload::abort`] or the bucket's lifecycle
/// rule removes them; Azure discards uncommitted blocks on its own, and local disk
/// leaves a staging file that a later `abort` cannot find (it lives beside the key
/// with a `#` suffix).
pub struct Upload {
    store: Store,
    key: String,
    path: Path,
    /// Bytes held back until they fill a part: small objects never start a multipart
    /// upload.
    pending: Vec<Bytes>,
    writer: Option<WriteMultipart>,
    /// Bytes written so far (to count the requests of the upload).
    written: u64,
    /// The MD5 of each part, to check the ETag of a multipart upload (S3).
    digests: Option<sent::PartDigests>,
}

impl std::fmt::Debug for Upload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upload")
            .field("store", &self.store.url)
            .field("key", &self.key)
            .finish()
    }
}

impl Upload {
    /// Appends `data`. Waits while `part_concurrency` parts are already in flight, so
    /// memory stays bounded whatever the object's size.
    pub async fn write(&mut self, data: impl Into<Bytes>) -> Result<()> {
        let data = data.into();
        let config = &self.store.config;
        self.written += data.len() as u64;
        if let Some(digests) = self.digests.as_mut() {
            digests.update(&data);
        }
        if self.writer.is_none() {
            self.pending.push(data);
            let held: usize = self.pending.iter().map(Bytes::len).sum();
            if held < config.part_size {
                return Ok(());
            }
            let upload = self
                .store
                .inner
                .put_multipart(&self.path)
                .await
                .map_err(|e| self.store.error("upload", &self.key, e))?;
            let mut writer = WriteMultipart::new_with_chunk_size(upload, config.part_size);
            for chunk in self.pending.drain(..) {
                writer.put(chunk);
            }
            self.writer = Some(writer);
        } else if let Some(writer) = self.writer.as_mut() {
            writer.put(data);
        }
        let concurrency = config.part_concurrency;
        if let Some(writer) = self.writer.as_mut() {
            writer
                .wait_for_capacity(concurrency)
                .await
                .map_err(|e| map_error("upload", &self.store.url, &self.key, e))?;
        }
        Ok(())
    }

    /// Completes the upload: the object becomes visible at once, whole.
    pub async fn finish(mut self) -> Result<()> {
        let parts = self
            .written
            .div_ceil(self.store.config.part_size as u64)
            .max(1);
        match self.writer.take() {
            // Start, every part, completion.
            Some(writer) => {
                self.store.count(Kind::Put, parts + 2);
                let result = writer
                    .finish()
                    .await
                    .map_err(|e| self.store.error("upload", &self.key, e))?;
                match self.digests.take() {
                    Some(digests) => {
                        check_parts(
                            &self.store,
                            &self.key,
                            &self.path,
                            self.written,
                            digests,
                            result.e_tag,
                        )
                        .await
                    }
                    None => Ok(()),
                }
            }
            None => {
                let sent = std::mem::take(&mut self.pending);
                let mut why = String::new();
                for _ in 0..sent::ATTEMPTS {
                    self.store.count(Kind::Put, 1);
                    let result = self
                        .store
                        .inner
                        .put(&self.path, sent.iter().cloned().collect::<PutPayload>())
                        .await
                        .map_err(|e| self.store.error("upload", &self.key, e))?;
                    let stored = self
                        .store
                        .stored("upload", &self.key, &self.path, &sent, result.e_tag)
                        .await?;
                    match stored {
                        Stored::Same => return Ok(()),
                        Stored::Differs(what) => why = what,
                    }
                }
                Err(self.store.kept_differing("upload", &self.key, &why))
            }
        }
    }

    /// Abandons the upload and asks the backend to discard the parts already sent.
    /// Nothing becomes visible at the key.
    pub async fn abort(mut self) -> Result<()> {
        match self.writer.take() {
            Some(writer) => writer
                .abort()
                .await
                .map_err(|e| self.store.error("abort upload", &self.key, e)),
            None => Ok(()),
        }
    }
}

/// Checks a completed multipart upload's ETag against the MD5s of the parts
/// sent. A difference is settled part by part by reading the object back: a
/// part stored with other bytes deletes the object and fails the upload as
/// [`ErrorKind::Transient`], naming the part and its offset (the parts are gone:
/// the caller uploads again).
async fn check_parts(
    store: &Store,
    key: &str,
    path: &Path,
    written: u64,
    digests: sent::PartDigests,
    e_tag: Option<String>,
) -> Result<()> {
    let Some(e_tag) = e_tag.filter(|_| store.check_e_tags.load(Ordering::Relaxed)) else {
        return Ok(());
    };
    let part_size = digests.part_size() as u64;
    let parts = digests.finish();
    let expected = sent::expected_e_tag(&parts, true);
    if sent::bare(&e_tag) == expected {
        return Ok(());
    }
    let mut start = 0u64;
    for (index, digest) in parts.iter().enumerate() {
        let end = (start + part_size).min(written);
        let stored = store.read_range(key, path, start..end).await?;
        if sent::md5_of(&[stored]) != *digest {
            tracing::warn!(store = %store.url, key = %key, part = index + 1, offset = start, "the server stored other bytes than those sent (damaged in flight?); the upload is deleted");
            store.count(Kind::Delete, 1);
            store
                .inner
                .delete(path)
                .await
                .map_err(|e| store.error("upload", key, e))?;
            return Err(Error::new(
                ErrorKind::Transient,
                format!(
                    "upload {}/{}: the server stored other bytes than those sent in part {} (bytes {start}..{end}; etag {}, expected {expected}); the object was deleted, upload it again",
                    store.url,
                    key,
                    index + 1,
                    sent::bare(&e_tag)
                ),
            )
            .damaged_in_flight());
        }
        start = end;
    }
    store.e_tags_are_not_md5s(&e_tag);
    Ok(())
}
