//! The harness's side of `ckpt-fault-shim` (chaos/shim), the library preloaded into
//! a run's launchers and ranks for the faults only a process itself can show: EIO on
//! its checkpoint files, and sends to other nodes that wait.
//!
//! A [`FaultShim`] owns the run's control file, mapped here as in every process of
//! the run: switching a fault on is one atomic store, seen by all of them at their
//! next call, and the shim's counters say whether it ever fired.

use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// The control record's layout, shared with the shim.
#[path = "../shim/src/layout.rs"]
pub mod layout;

use layout::{
    ANY, CONTROL_ENV, MAGIC, NODE_ENV, PATH_ENV, SIZE, WORD_IO_FIRED, WORD_IO_FLAGS, WORD_IO_RANK,
    WORD_MAGIC, WORD_NET_DELAY_MS, WORD_NET_FIRED, WORD_NET_NODE,
};

/// The shim's file name in a build directory.
pub const LIBRARY: &str = "libckpt_fault_shim.so";

/// Where the shim is: `CKPT_FAULT_SHIM`, else next to this executable or in the
/// build directory above it (a test binary runs from `target/<profile>/deps`).
pub fn find_library() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("CKPT_FAULT_SHIM") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    exe.ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join(LIBRARY))
        .find(|path| path.exists())
        .ok_or_else(|| {
            format!(
                "{LIBRARY} not found next to {} (cargo build -p ckpt-fault-shim), nor on CKPT_FAULT_SHIM",
                exe.display()
            )
        })
}

/// A run's control file, mapped.
pub struct FaultShim {
    library: PathBuf,
    control: PathBuf,
    checkpoints: PathBuf,
    words: &'static [AtomicU32; SIZE / 4],
    map: *mut libc::c_void,
}

// SAFETY: the mapping is only read and written through atomics.
unsafe impl Send for FaultShim {}
// SAFETY: as above.
unsafe impl Sync for FaultShim {}

impl FaultShim {
    /// Creates the control file `control` (every fault off), for processes whose
    /// checkpoints are under `checkpoints`.
    pub fn create(library: PathBuf, control: &Path, checkpoints: &Path) -> io::Result<FaultShim> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(control)?;
        file.set_len(SIZE as u64)?;
        let map = layout::map(std::os::fd::AsRawFd::as_raw_fd(&file))
            .ok_or_else(io::Error::last_os_error)?;
        // SAFETY: SIZE bytes, page-aligned, valid until `drop` unmaps them, which
        // happens only once nothing borrows `words` (it is private).
        let words = unsafe { &*(map as *const [AtomicU32; SIZE / 4]) };
        for (i, word) in words.iter().enumerate() {
            let off = [WORD_IO_RANK, WORD_NET_NODE].contains(&i);
            word.store(if off { ANY } else { 0 }, Ordering::SeqCst);
        }
        words[WORD_MAGIC].store(MAGIC, Ordering::SeqCst);
        // /proc/self/fd shows the real path: a checkpoint directory reached through a
        // symbolic link must be named as it resolves.
        let checkpoints = std::fs::canonicalize(checkpoints)?;
        Ok(FaultShim {
            library,
            control: control.to_path_buf(),
            checkpoints,
            words,
            map,
        })
    }

    /// The environment of a launcher of node `node` (its ranks inherit it).
    pub fn env(&self, node: usize) -> Vec<(String, String)> {
        let preload = match std::env::var("LD_PRELOAD") {
            Ok(other) if !other.is_empty() => format!("{}:{other}", self.library.display()),
            _ => self.library.display().to_string(),
        };
        vec![
            ("LD_PRELOAD".into(), preload),
            (CONTROL_ENV.into(), self.control.display().to_string()),
            (PATH_ENV.into(), self.checkpoints.display().to_string()),
            (NODE_ENV.into(), node.to_string()),
        ]
    }

    /// From now on, file calls of kinds `flags` ([`layout::EIO_READ`],
    /// [`layout::EIO_WRITE`]) on checkpoint files fail with EIO in rank `rank`
    /// (`None`: every rank); `0` ends it.
    pub fn fail_io(&self, flags: u32, rank: Option<usize>) {
        let rank = rank.and_then(|r| u32::try_from(r).ok()).unwrap_or(ANY);
        self.words[WORD_IO_RANK].store(rank, Ordering::SeqCst);
        self.words[WORD_IO_FLAGS].store(flags, Ordering::SeqCst);
    }

    /// From now on, every send from a process of node `node` to another node waits
    /// `ms` first; `0` ends it.
    pub fn delay_sends(&self, ms: u32, node: Option<usize>) {
        let node = node.and_then(|n| u32::try_from(n).ok()).unwrap_or(ANY);
        self.words[WORD_NET_NODE].store(node, Ordering::SeqCst);
        self.words[WORD_NET_DELAY_MS].store(ms, Ordering::SeqCst);
    }

    /// File calls failed so far.
    pub fn io_fired(&self) -> u32 {
        self.words[WORD_IO_FIRED].load(Ordering::SeqCst)
    }

    /// Sends delayed so far.
    pub fn sends_delayed(&self) -> u32 {
        self.words[WORD_NET_FIRED].load(Ordering::SeqCst)
    }
}

impl Drop for FaultShim {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `create`, no longer borrowed.
        unsafe { libc::munmap(self.map, SIZE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// The shim in a real process: writes under the checkpoint directory fail with
    /// EIO while asked, and nowhere else; reads likewise; and the counter says so.
    #[test]
    fn a_preloaded_process_sees_eio_on_checkpoint_files_only_while_asked() {
        let library = match find_library() {
            Ok(library) => library,
            Err(e) if std::env::var_os("CI").is_none() => {
                eprintln!("SKIPPED: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let dir = tempfile::tempdir().unwrap();
        let checkpoints = dir.path().join("checkpoints");
        std::fs::create_dir_all(&checkpoints).unwrap();
        std::fs::write(checkpoints.join("old"), b"old").unwrap();
        let shim = FaultShim::create(library, &dir.path().join("control"), &checkpoints).unwrap();
        let dd = |of: &Path| {
            let mut command = Command::new("dd");
            command
                .args(["if=/dev/zero", "bs=512", "count=1", "status=none"])
                .arg(format!("of={}", of.display()))
                .envs(shim.env(0));
            command.output().unwrap()
        };
        let cat = |path: &Path| {
            let mut command = Command::new("cat");
            command.arg(path).envs(shim.env(0));
            command.output().unwrap()
        };
        assert!(dd(&checkpoints.join("a")).status.success());
        shim.fail_io(layout::EIO_WRITE, None);
        let failed = dd(&checkpoints.join("b"));
        assert!(!failed.status.success());
        assert!(
            String::from_utf8_lossy(&failed.stderr).contains("Input/output error"),
            "{failed:?}"
        );
        assert!(dd(&dir.path().join("elsewhere")).status.success());
        assert!(
            cat(&checkpoints.join("old")).status.success(),
            "reads go on"
        );
        let written = shim.io_fired();
        assert!(written >= 1, "{written}");
        shim.fail_io(layout::EIO_READ, Some(3));
        assert!(
            cat(&checkpoints.join("old")).status.success(),
            "this process is no rank"
        );
        shim.fail_io(layout::EIO_READ, None);
        let failed = cat(&checkpoints.join("old"));
        assert!(!failed.status.success(), "{failed:?}");
        shim.fail_io(0, None);
        assert!(dd(&checkpoints.join("c")).status.success());
        assert!(shim.io_fired() > written);
    }
}
