//! The raw baselines: one sequential file written and read the plainest way the
//! store allows (buffered and fsynced, `O_DIRECT`, or one object through the store),
//! and keeping the page cache out of both sides' reads.

use super::*;

/// Where the raw sequential write/read baseline goes.
pub(super) enum RawTarget {
    /// A file in the store's directory.
    Local(PathBuf),
    /// One object uploaded through the store.
    Remote(Store),
}

pub(super) const RAW_KEY: &str = ".ckpt-bench/raw-sequential";
pub(super) const RAW_CHUNK: usize = 8 << 20;

impl RawTarget {
    pub(super) fn new(store: &Store, _config: &BenchConfig) -> Result<Self> {
        Ok(match (store.backend(), local_root(store)) {
            (Backend::Local, Some(root)) => {
                let dir = root.join(".ckpt-bench");
                std::fs::create_dir_all(&dir).map_err(|e| io_error(&dir, e))?;
                RawTarget::Local(dir.join("raw-sequential"))
            }
            _ => RawTarget::Remote(store.clone()),
        })
    }

    pub(super) fn is_local(&self) -> bool {
        matches!(self, RawTarget::Local(_))
    }

    /// Writes `bytes` sequentially (+ fsync), returns GB/s.
    pub(super) fn write(
        &self,
        rt: &tokio::runtime::Handle,
        bytes: u64,
        direct: bool,
    ) -> Result<f64> {
        let chunk = AlignedBuf::filled(RAW_CHUNK);
        match self {
            RawTarget::Local(path) => {
                let _ = std::fs::remove_file(path);
                let mut options = std::fs::OpenOptions::new();
                options.write(true).create(true).truncate(true);
                if direct {
                    use std::os::unix::fs::OpenOptionsExt;
                    options.custom_flags(libc::O_DIRECT);
                }
                let started = Instant::now();
                let mut file = options.open(path).map_err(|e| io_error(path, e))?;
                let mut left = bytes;
                while left > 0 {
                    let n = left.min(RAW_CHUNK as u64) as usize;
                    file.write_all(&chunk.as_slice()[..n])
                        .map_err(|e| io_error(path, e))?;
                    left -= n as u64;
                }
                file.sync_all().map_err(|e| io_error(path, e))?;
                Ok(gbps(bytes, started.elapsed().as_secs_f64()))
            }
            RawTarget::Remote(store) => {
                let shared = bytes::Bytes::copy_from_slice(chunk.as_slice());
                let started = Instant::now();
                rt.block_on(async {
                    let mut upload = store.upload(RAW_KEY)?;
                    let mut left = bytes;
                    while left > 0 {
                        let n = left.min(RAW_CHUNK as u64) as usize;
                        upload.write(shared.slice(..n)).await?;
                        left -= n as u64;
                    }
                    upload.finish().await
                })?;
                Ok(gbps(bytes, started.elapsed().as_secs_f64()))
            }
        }
    }

    /// Reads the whole baseline file sequentially, returns GB/s.
    pub(super) fn read(&self, rt: &tokio::runtime::Handle, bytes: u64, warm: bool) -> Result<f64> {
        match self {
            RawTarget::Local(path) => {
                if !warm {
                    evict(path);
                }
                let mut buf = vec![0u8; RAW_CHUNK];
                let started = Instant::now();
                let mut file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
                let mut total = 0u64;
                loop {
                    let n = file.read(&mut buf).map_err(|e| io_error(path, e))?;
                    if n == 0 {
                        break;
                    }
                    total += n as u64;
                }
                std::hint::black_box(&buf);
                Ok(gbps(total.max(1), started.elapsed().as_secs_f64()))
            }
            RawTarget::Remote(store) => {
                let started = Instant::now();
                let data = rt.block_on(store.get(RAW_KEY))?;
                let total = data.len() as u64;
                debug_assert_eq!(total, bytes);
                Ok(gbps(total.max(1), started.elapsed().as_secs_f64()))
            }
        }
    }

    pub(super) fn cleanup(&self) {
        if let RawTarget::Local(path) = self {
            let _ = std::fs::remove_file(path);
            if let Some(dir) = path.parent() {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

/// A page-aligned buffer of non-zero bytes (`O_DIRECT` needs alignment).
pub(super) struct AlignedBuf {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

impl AlignedBuf {
    pub(super) fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len, 4096).expect("valid layout")
    }

    pub(super) fn filled(len: usize) -> Self {
        assert!(len > 0, "an aligned buffer holds at least one byte");
        // Zeroed, so that the slice below never covers uninitialized memory.
        // SAFETY: the layout's size is non-zero (asserted above), which is all that
        // `alloc_zeroed` requires; a null result is handled next.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout(len)) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(Self::layout(len));
        }
        // SAFETY: `ptr` is non-null, aligned, valid for `len` bytes and initialized
        // (zeroed); this is the only reference to the fresh allocation.
        let slice = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        let mut rng = SplitMix(7);
        for chunk in slice.chunks_mut(8) {
            let v = rng.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
        Self { ptr, len }
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialized bytes (zeroed, then filled, in
        // `filled`) that are freed only in `drop`, and nothing mutates them after
        // construction, so a shared borrow of `self` can lend them out.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from the global allocator in `filled` with exactly this
        // layout (`len` never changes) and is freed only here, once.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.len)) }
    }
}

/// The directory of a local store.
pub(super) fn local_root(store: &Store) -> Option<PathBuf> {
    match store.backend() {
        Backend::Local => store.url().strip_prefix("file://").map(PathBuf::from),
        _ => None,
    }
}

pub(super) fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::Failed(format!("bench: {}: {e}", path.display()))
}

/// Drops a clean (fsynced) file's pages from the page cache, so the next read comes
/// from the device. Best effort.
pub(super) fn evict(path: &Path) {
    use std::os::fd::AsRawFd;
    if let Ok(file) = std::fs::File::open(path) {
        // SAFETY: `posix_fadvise` takes no pointers; the descriptor stays open for
        // the call because `file` is alive, and the advice only drops clean cached
        // pages, never data.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
}

/// Evicts every file of step `step` of a local store (no-op elsewhere or when warm).
pub(super) fn evict_step(url: &str, step: u64, warm: bool) {
    if warm {
        return;
    }
    let Some(root) = url.strip_prefix("file://") else {
        return;
    };
    // Format v2 keeps a save's files in an attempt directory inside the step's.
    let mut dirs = vec![Path::new(root).join(step_dir(step))];
    while let Some(dir) = dirs.pop() {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(entry.path());
                } else {
                    evict(&entry.path());
                }
            }
        }
    }
}

/// Resident set size of this process, MiB.
pub(super) fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}
