//! Local disk confined to its root: no symbolic link under the root is followed, for
//! reading, listing, writing or deleting.
//!
//! object_store's `LocalFileSystem` follows links everywhere: a get reads the file a
//! link points at, a listing walks into linked directories (and, through a link to an
//! ancestor, walks the directories above the root until its loop check stops it),
//! and a delete of a key below a linked directory removes the file outside. A
//! checkpoint root is untrusted input, and ckpt never writes a link, so every link
//! under it was put there by someone else. This wrapper refuses them all, with an
//! error naming the link and its target, rather than only those whose target lies
//! outside the root: a link that stays inside still makes two keys name one file
//! (removing an old checkpoint would delete a kept one's objects through it), and a
//! link to an ancestor inside the root still loops.
//!
//! It sits here, around `LocalFileSystem`, because every reader and deleter of ckpt
//! (loads, the tools, retention and `ckpt gc`) goes through [`crate::Store`]; code
//! that opens local files itself asks [`crate::Store::local_path`], which applies the
//! same check. The root itself may be reached through links: it is resolved when the
//! store is opened, and only what lies below it is checked. Checking costs one
//! `lstat` per path segment of a key (a few per operation) and, for listings, a walk
//! of the listed directories that reads their entries' types without `stat`.
//!
//! A link created between the check and the operation is not caught: the check
//! defends against hostile checkpoints, not against a concurrent attacker with write
//! access to the root.

use std::fmt;
use std::ops::Range;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result,
};

/// A symbolic link met under a local root: the error every refused operation
/// carries, found by [`crate::store`]'s error mapping to name the link.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} is a symbolic link (to {}): ckpt follows no link under a local root, so that nothing outside the checkpoint is read or deleted",
    path.display(),
    target.display()
)]
pub(crate) struct LinkRefused {
    path: PathBuf,
    target: PathBuf,
}

impl LinkRefused {
    fn at(path: PathBuf) -> Self {
        let target = std::fs::read_link(&path).unwrap_or_default();
        Self { path, target }
    }

    fn into_error(self) -> object_store::Error {
        object_store::Error::Generic {
            store: "LocalFileSystem",
            source: Box::new(self),
        }
    }
}

/// The first symbolic link on the way from `root` down to `relative` (itself
/// included); `None` when there is none, or when the path stops existing first.
pub(crate) fn link_on_path(root: &FsPath, relative: &str) -> Option<LinkRefused> {
    let mut path = root.to_path_buf();
    for segment in relative.split('/').filter(|s| !s.is_empty()) {
        path.push(segment);
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_symlink() => return Some(LinkRefused::at(path)),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    None
}

/// The first symbolic link on the way to `relative` or anywhere below it (`depth`
/// levels of directories: 1 for one level, `usize::MAX` for all).
fn link_in_tree(root: &FsPath, relative: &str, depth: usize) -> Option<LinkRefused> {
    if let Some(link) = link_on_path(root, relative) {
        return Some(link);
    }
    let mut pending = vec![(root.join(relative), depth)];
    while let Some((dir, depth)) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_symlink() {
                return Some(LinkRefused::at(entry.path()));
            }
            if kind.is_dir() && depth > 1 {
                pending.push((entry.path(), depth - 1));
            }
        }
    }
    None
}

/// `LocalFileSystem` with every path checked for symbolic links first.
#[derive(Debug)]
pub(crate) struct Confined {
    inner: Arc<LocalFileSystem>,
    root: PathBuf,
}

impl Confined {
    /// Wraps `inner`, whose root is the resolved directory `root`.
    pub(crate) fn new(inner: LocalFileSystem, root: PathBuf) -> Self {
        Self {
            inner: Arc::new(inner),
            root,
        }
    }

    fn check(&self, location: &Path) -> Result<()> {
        match link_on_path(&self.root, location.as_ref()) {
            Some(link) => Err(link.into_error()),
            None => Ok(()),
        }
    }

    async fn check_tree(&self, prefix: Option<&Path>, depth: usize) -> Result<()> {
        let root = self.root.clone();
        let relative = prefix.map(|p| p.to_string()).unwrap_or_default();
        let found = tokio::task::spawn_blocking(move || link_in_tree(&root, &relative, depth))
            .await
            .map_err(|e| object_store::Error::Generic {
                store: "LocalFileSystem",
                source: Box::new(e),
            })?;
        match found {
            Some(link) => Err(link.into_error()),
            None => Ok(()),
        }
    }

    /// A listing that first walks the tree below `prefix` for links, and fails
    /// with the first one instead of following it.
    fn checked_list(
        &self,
        prefix: Option<&Path>,
        offset: Option<&Path>,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        let store = Confined {
            inner: self.inner.clone(),
            root: self.root.clone(),
        };
        let prefix = prefix.cloned();
        let offset = offset.cloned();
        futures::stream::once(async move {
            store.check_tree(prefix.as_ref(), usize::MAX).await?;
            Ok(match &offset {
                Some(offset) => store.inner.list_with_offset(prefix.as_ref(), offset),
                None => store.inner.list(prefix.as_ref()),
            })
        })
        .map(
            |listing: Result<BoxStream<'static, Result<ObjectMeta>>>| match listing {
                Ok(listing) => listing,
                Err(e) => futures::stream::once(async move { Err(e) }).boxed(),
            },
        )
        .flatten()
        .boxed()
    }
}

impl fmt::Display for Confined {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Confined({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for Confined {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.check(location)?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.check(location)?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.check(location)?;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.check(location)?;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let root = self.root.clone();
        let checked = locations
            .map(move |location| {
                let location = location?;
                match link_on_path(&root, location.as_ref()) {
                    Some(link) => Err(link.into_error()),
                    None => Ok(location),
                }
            })
            .boxed();
        self.inner.delete_stream(checked)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.checked_list(prefix, None)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        self.checked_list(prefix, Some(offset))
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.check_tree(prefix, 1).await?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.check(from)?;
        self.check(to)?;
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        self.check(from)?;
        self.check(to)?;
        self.inner.rename_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_anywhere_on_the_path_is_named_with_its_target() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("a")).unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("a/b")).unwrap();
        let found = link_on_path(root.path(), "a/b/c.json").expect("the link");
        assert_eq!(found.path, root.path().join("a/b"));
        assert_eq!(found.target, outside.path());
        assert!(link_on_path(root.path(), "a/missing/c.json").is_none());
        assert!(link_in_tree(root.path(), "", usize::MAX).is_some());
        assert!(link_in_tree(root.path(), "", 1).is_none(), "one level only");
    }
}
