//! The control record the chaos harness and the fault shim share: a small file that
//! both map, so the harness switches a fault on or off for every process of a run
//! at once, without signals or restarts, and reads back how often it fired.
//!
//! Included by both sides (`#[path]`), so that they cannot disagree. Words are `u32`
//! in the machine's byte order, read and written as atomics.

/// The control file's size in bytes.
pub const SIZE: usize = 64;
/// Word 0 holds this once the harness has set the file up ("CKFS").
pub const MAGIC: u32 = 0x5346_4b43;

/// Word indexes.
pub const WORD_MAGIC: usize = 0;
/// Which file calls fail with EIO: [`EIO_READ`], [`EIO_WRITE`] (bits).
pub const WORD_IO_FLAGS: usize = 1;
/// The rank (launcher label) whose file calls fail, or [`ANY`].
pub const WORD_IO_RANK: usize = 2;
/// Milliseconds every send to another node waits (0: none).
pub const WORD_NET_DELAY_MS: usize = 3;
/// The node whose processes' sends wait, or [`ANY`].
pub const WORD_NET_NODE: usize = 4;
/// File calls failed so far (the shim counts).
pub const WORD_IO_FIRED: usize = 5;
/// Sends delayed so far (the shim counts).
pub const WORD_NET_FIRED: usize = 6;

/// Reads, `pread`s, `readv`s fail.
pub const EIO_READ: u32 = 1;
/// Writes, `pwrite`s, `writev`s, `fsync`s and `fdatasync`s fail.
pub const EIO_WRITE: u32 = 2;
/// Every rank, or every node.
pub const ANY: u32 = u32::MAX;

/// The control file's path.
pub const CONTROL_ENV: &str = "CKPT_FAULT_SHIM_CONTROL";
/// The directory under which file calls can fail (the run's checkpoints).
pub const PATH_ENV: &str = "CKPT_FAULT_SHIM_PATH";
/// The node a process belongs to (set per launcher; its ranks inherit it).
pub const NODE_ENV: &str = "CKPT_FAULT_SHIM_NODE";

/// Maps the control file open as `fd`: shared, readable and writable, so that every
/// process of the run sees the same words. `None` when the mapping fails.
pub fn map(fd: std::ffi::c_int) -> Option<*mut std::ffi::c_void> {
    // SAFETY: a fresh shared mapping of SIZE bytes of an open file; the kernel
    // checks the descriptor.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    (map != libc::MAP_FAILED).then_some(map)
}
