//! `ckpt-fault-shim`: a library the chaos harness preloads (`LD_PRELOAD`) into a
//! run's launchers and ranks to inject faults that no signal and no proxy can:
//!
//! * **I/O errors on the checkpoint files**: `read`, `pread`, `readv`, `preadv` fail
//!   with EIO, or `write`, `pwrite`, `writev`, `pwritev`, `fsync`, `fdatasync` do, on files under the
//!   run's checkpoint directory, in one rank or in all. This is what a failing disk
//!   or a flaky network file system shows a process; a full disk (ENOSPC) and a
//!   read-only file system (EROFS) the harness makes for real on a tmpfs.
//! * **Latency between nodes**: every send from a process of the chosen node to an
//!   address off its node waits a while first. The kernels this runs on have no
//!   `netem`; packet loss the harness makes with nftables, but a delay needs the
//!   sender's help.
//!
//! # How it is driven
//!
//! The harness creates a small control file (`layout`), names it in
//! `CKPT_FAULT_SHIM_CONTROL`, and names the checkpoint directory in
//! `CKPT_FAULT_SHIM_PATH` and the node in `CKPT_FAULT_SHIM_NODE`. Every process maps
//! the file on its first intercepted call, so the harness switches a fault on for a
//! whole run by writing one word, and reads back how often each fault fired. A
//! process's rank is its launcher label, `GROUP_RANK × LOCAL_WORLD_SIZE +
//! LOCAL_RANK` (torchrun's variables, which `ckpt launch` sets).
//!
//! # Why it is built this way
//!
//! * **Interposition, not a FUSE file system**: nothing to mount, no daemon, and the
//!   fault lands in exactly one process when asked. Only calls through the dynamic
//!   symbol table are seen: glibc's internal calls (`fread` reading a file) are
//!   not, nor raw `syscall`s. The library reads and writes checkpoints through
//!   `read`/`pread64`/`write`/`pwrite64`, which are.
//! * **Which descriptor is what** is found once per descriptor (`fstat`, then the
//!   `/proc/self/fd` link of a file or the peer address of a socket) and cached
//!   until `close`. While no fault is on, an intercepted call costs two atomic loads.
//! * **Nothing that is intercepted is called while the shim sets itself up**, so the
//!   one-time setup cannot wait on itself.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicU32, Ordering::Relaxed};

pub mod layout;

use layout::*;

/// The next definition of libc function `$name`, of type `$ty`.
macro_rules! real {
    ($name:literal: $ty:ty) => {{
        static PTR: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
        let mut p = PTR.load(Relaxed);
        if p.is_null() {
            // SAFETY: a NUL-terminated symbol name; RTLD_NEXT is the definition
            // after this library's, libc's.
            p = unsafe { libc::dlsym(libc::RTLD_NEXT, concat!($name, "\0").as_ptr().cast()) };
            if p.is_null() {
                // SAFETY: no state to keep; the process cannot go on without it.
                unsafe { libc::abort() };
            }
            PTR.store(p, Relaxed);
        }
        // SAFETY: `p` is libc's function of this signature.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
    }};
}

/// What the shim knows about its process.
struct Shim {
    control: Option<&'static [AtomicU32; SIZE / 4]>,
    /// The checkpoint directory, as `/proc/self/fd` links show it.
    prefix: Vec<u8>,
    rank: Option<u32>,
    node: Option<u32>,
}

static SHIM: OnceLock<Shim> = OnceLock::new();

fn shim() -> &'static Shim {
    SHIM.get_or_init(|| {
        let number = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u32>().ok())
        };
        let rank = match (
            number("GROUP_RANK"),
            number("LOCAL_WORLD_SIZE"),
            number("LOCAL_RANK"),
        ) {
            (Some(node), Some(size), Some(local)) => {
                node.checked_mul(size).and_then(|n| n.checked_add(local))
            }
            _ => None,
        };
        let prefix = std::env::var_os(PATH_ENV)
            .map(|p| {
                let mut bytes = std::os::unix::ffi::OsStrExt::as_bytes(p.as_os_str()).to_vec();
                while bytes.len() > 1 && bytes.ends_with(b"/") {
                    bytes.pop();
                }
                bytes
            })
            .unwrap_or_default();
        Shim {
            control: std::env::var_os(CONTROL_ENV).and_then(|path| map_control(&path)),
            prefix,
            rank,
            node: number(NODE_ENV).or_else(|| number("GROUP_RANK")),
        }
    })
}

/// Maps the control file, if it is there and set up.
fn map_control(path: &std::ffi::OsStr) -> Option<&'static [AtomicU32; SIZE / 4]> {
    let path = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path)).ok()?;
    // SAFETY: a NUL-terminated path; `open` is not intercepted.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    let map = layout::map(fd);
    let close = real!("close": unsafe extern "C" fn(c_int) -> c_int);
    // SAFETY: our own descriptor; the mapping outlives it.
    unsafe { close(fd) };
    let map = map?;
    // SAFETY: SIZE bytes, page-aligned, shared and never unmapped: valid as atomics
    // for the life of the process.
    let words = unsafe { &*(map as *const [AtomicU32; SIZE / 4]) };
    (words[WORD_MAGIC].load(Relaxed) == MAGIC).then_some(words)
}

const UNKNOWN: u8 = 0;
/// A regular file under the checkpoint directory.
const CHECKPOINT_FILE: u8 = 1;
/// A socket connected to another node.
const OFF_NODE: u8 = 2;
const OTHER: u8 = 3;

/// Descriptors below this have their class cached.
const CACHED: usize = 1 << 16;
static CLASS: [AtomicU8; CACHED] = [const { AtomicU8::new(UNKNOWN) }; CACHED];

fn class(shim: &Shim, fd: c_int) -> u8 {
    let Ok(index) = usize::try_from(fd) else {
        return OTHER;
    };
    let slot = CLASS.get(index);
    if let Some(class) = slot.map(|s| s.load(Relaxed)).filter(|&c| c != UNKNOWN) {
        return class;
    }
    let (class, settled) = classify(shim, fd);
    if settled && let Some(slot) = slot {
        slot.store(class, Relaxed);
    }
    class
}

/// What `fd` is, and whether that can change before it is closed (a socket not yet
/// connected can).
fn classify(shim: &Shim, fd: c_int) -> (u8, bool) {
    // SAFETY: an all-zero `stat` is valid; `fstat` fills it.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a `stat`.
    if unsafe { libc::fstat(fd, &mut stat) } != 0 {
        return (OTHER, false);
    }
    match stat.st_mode & libc::S_IFMT {
        libc::S_IFREG if under(&shim.prefix, fd) => (CHECKPOINT_FILE, true),
        libc::S_IFSOCK => off_node(fd),
        _ => (OTHER, true),
    }
}

/// Whether the file open as `fd` is under `prefix`.
fn under(prefix: &[u8], fd: c_int) -> bool {
    if prefix.is_empty() {
        return false;
    }
    let link = format!("/proc/self/fd/{fd}\0");
    let mut target = [0u8; 4096];
    // SAFETY: a NUL-terminated path and a buffer of the length given.
    let n = unsafe {
        libc::readlink(
            link.as_ptr().cast(),
            target.as_mut_ptr().cast(),
            target.len(),
        )
    };
    let Ok(n) = usize::try_from(n) else {
        return false;
    };
    let target = &target[..n];
    target.starts_with(prefix) && matches!(target.get(prefix.len()), None | Some(b'/'))
}

/// Whether socket `fd` is connected to another node: an IP peer that is neither
/// loopback nor this node's own address.
fn off_node(fd: c_int) -> (u8, bool) {
    let address = |peer: bool| {
        // SAFETY: an all-zero `sockaddr_storage` is valid.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        let pointer = (&raw mut storage).cast::<libc::sockaddr>();
        // SAFETY: a buffer and its length.
        let status = unsafe {
            if peer {
                libc::getpeername(fd, pointer, &mut len)
            } else {
                libc::getsockname(fd, pointer, &mut len)
            }
        };
        (status == 0).then(|| ip_of(&storage)).flatten()
    };
    let Some(peer) = address(true) else {
        // Not connected (yet), or not IP.
        return (OTHER, false);
    };
    let local = address(false);
    let off = !peer.is_loopback() && Some(peer) != local;
    (if off { OFF_NODE } else { OTHER }, true)
}

fn ip_of(storage: &libc::sockaddr_storage) -> Option<std::net::IpAddr> {
    match c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says this is a `sockaddr_in`.
            let v4 = unsafe { &*(storage as *const _ as *const libc::sockaddr_in) };
            Some(std::net::Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr)).into())
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this is a `sockaddr_in6`.
            let v6 = unsafe { &*(storage as *const _ as *const libc::sockaddr_in6) };
            let ip = std::net::Ipv6Addr::from(v6.sin6_addr.s6_addr);
            Some(ip.to_ipv4_mapped().map_or(ip.into(), Into::into))
        }
        _ => None,
    }
}

/// Whether a call of kind `bit` (EIO_READ, EIO_WRITE) on `fd` fails now; sends to
/// another node wait first when the delay is on.
fn fault(fd: c_int, bit: u32) -> bool {
    let shim = shim();
    let Some(control) = shim.control else {
        return false;
    };
    let io = control[WORD_IO_FLAGS].load(Relaxed) & bit != 0;
    let delay = if bit == EIO_WRITE {
        control[WORD_NET_DELAY_MS].load(Relaxed)
    } else {
        0
    };
    if !io && delay == 0 {
        return false;
    }
    let chosen = |word: usize, who: Option<u32>| {
        let target = control[word].load(Relaxed);
        target == ANY || Some(target) == who
    };
    match class(shim, fd) {
        CHECKPOINT_FILE if io && chosen(WORD_IO_RANK, shim.rank) => {
            control[WORD_IO_FIRED].fetch_add(1, Relaxed);
            // SAFETY: this thread's errno.
            unsafe { *libc::__errno_location() = libc::EIO };
            true
        }
        OFF_NODE if delay > 0 && chosen(WORD_NET_NODE, shim.node) => {
            control[WORD_NET_FIRED].fetch_add(1, Relaxed);
            std::thread::sleep(std::time::Duration::from_millis(u64::from(delay)));
            false
        }
        _ => false,
    }
}

/// `read(2)`, failing with EIO on a checkpoint file while asked.
///
/// # Safety
/// As `read(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, count: usize) -> isize {
    if fault(fd, EIO_READ) {
        return -1;
    }
    let real = real!("read": unsafe extern "C" fn(c_int, *mut c_void, usize) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, buf, count) }
}

/// `pread64(2)`, failing with EIO on a checkpoint file while asked.
///
/// # Safety
/// As `pread64(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pread64(fd: c_int, buf: *mut c_void, count: usize, offset: i64) -> isize {
    if fault(fd, EIO_READ) {
        return -1;
    }
    let real = real!("pread64": unsafe extern "C" fn(c_int, *mut c_void, usize, i64) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, buf, count, offset) }
}

/// `pread(2)` (the same call as `pread64` on 64-bit Linux).
///
/// # Safety
/// As `pread(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pread(fd: c_int, buf: *mut c_void, count: usize, offset: i64) -> isize {
    // SAFETY: the caller's arguments, as given.
    unsafe { pread64(fd, buf, count, offset) }
}

/// `readv(2)`, failing with EIO on a checkpoint file while asked.
///
/// # Safety
/// As `readv(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const libc::iovec, count: c_int) -> isize {
    if fault(fd, EIO_READ) {
        return -1;
    }
    let real = real!("readv": unsafe extern "C" fn(c_int, *const libc::iovec, c_int) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, iov, count) }
}

/// `preadv(2)`, failing with EIO on a checkpoint file while asked (the library
/// reads local data files with it).
///
/// # Safety
/// As `preadv(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn preadv(
    fd: c_int,
    iov: *const libc::iovec,
    count: c_int,
    offset: i64,
) -> isize {
    if fault(fd, EIO_READ) {
        return -1;
    }
    let real =
        real!("preadv": unsafe extern "C" fn(c_int, *const libc::iovec, c_int, i64) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, iov, count, offset) }
}

/// `preadv64(2)` (the same call as `preadv` on 64-bit Linux).
///
/// # Safety
/// As `preadv64(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn preadv64(
    fd: c_int,
    iov: *const libc::iovec,
    count: c_int,
    offset: i64,
) -> isize {
    // SAFETY: the caller's arguments, as given.
    unsafe { preadv(fd, iov, count, offset) }
}

/// `pwritev(2)`, failing with EIO on a checkpoint file while asked.
///
/// # Safety
/// As `pwritev(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pwritev(
    fd: c_int,
    iov: *const libc::iovec,
    count: c_int,
    offset: i64,
) -> isize {
    if fault(fd, EIO_WRITE) {
        return -1;
    }
    let real =
        real!("pwritev": unsafe extern "C" fn(c_int, *const libc::iovec, c_int, i64) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, iov, count, offset) }
}

/// `pwritev64(2)` (the same call as `pwritev` on 64-bit Linux).
///
/// # Safety
/// As `pwritev64(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pwritev64(
    fd: c_int,
    iov: *const libc::iovec,
    count: c_int,
    offset: i64,
) -> isize {
    // SAFETY: the caller's arguments, as given.
    unsafe { pwritev(fd, iov, count, offset) }
}

/// `write(2)`: fails with EIO on a checkpoint file, or waits before a send to
/// another node, while asked.
///
/// # Safety
/// As `write(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, count: usize) -> isize {
    if fault(fd, EIO_WRITE) {
        return -1;
    }
    let real = real!("write": unsafe extern "C" fn(c_int, *const c_void, usize) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, buf, count) }
}

/// `pwrite64(2)`, failing with EIO on a checkpoint file while asked.
///
/// # Safety
/// As `pwrite64(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pwrite64(
    fd: c_int,
    buf: *const c_void,
    count: usize,
    offset: i64,
) -> isize {
    if fault(fd, EIO_WRITE) {
        return -1;
    }
    let real = real!("pwrite64": unsafe extern "C" fn(c_int, *const c_void, usize, i64) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, buf, count, offset) }
}

/// `pwrite(2)` (the same call as `pwrite64` on 64-bit Linux).
///
/// # Safety
/// As `pwrite(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pwrite(fd: c_int, buf: *const c_void, count: usize, offset: i64) -> isize {
    // SAFETY: the caller's arguments, as given.
    unsafe { pwrite64(fd, buf, count, offset) }
}

/// `writev(2)`: as [`write`](fn@write).
///
/// # Safety
/// As `writev(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, count: c_int) -> isize {
    if fault(fd, EIO_WRITE) {
        return -1;
    }
    let real = real!("writev": unsafe extern "C" fn(c_int, *const libc::iovec, c_int) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, iov, count) }
}

/// `fsync(2)`, failing with EIO on a checkpoint file while writes do.
///
/// # Safety
/// As `fsync(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    if fault(fd, EIO_WRITE) {
        return -1;
    }
    let real = real!("fsync": unsafe extern "C" fn(c_int) -> c_int);
    // SAFETY: the caller's argument, as given.
    unsafe { real(fd) }
}

/// `fdatasync(2)`: as [`fsync`].
///
/// # Safety
/// As `fdatasync(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    if fault(fd, EIO_WRITE) {
        return -1;
    }
    let real = real!("fdatasync": unsafe extern "C" fn(c_int) -> c_int);
    // SAFETY: the caller's argument, as given.
    unsafe { real(fd) }
}

/// `send(2)`, waiting first when it goes to another node and the delay is on.
///
/// # Safety
/// As `send(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, count: usize, flags: c_int) -> isize {
    fault(fd, EIO_WRITE);
    let real = real!("send": unsafe extern "C" fn(c_int, *const c_void, usize, c_int) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, buf, count, flags) }
}

/// `sendto(2)`: as [`send`].
///
/// # Safety
/// As `sendto(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    count: usize,
    flags: c_int,
    to: *const libc::sockaddr,
    len: libc::socklen_t,
) -> isize {
    fault(fd, EIO_WRITE);
    let real = real!("sendto": unsafe extern "C" fn(
        c_int,
        *const c_void,
        usize,
        c_int,
        *const libc::sockaddr,
        libc::socklen_t,
    ) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, buf, count, flags, to, len) }
}

/// `sendmsg(2)`: as [`send`].
///
/// # Safety
/// As `sendmsg(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendmsg(fd: c_int, message: *const libc::msghdr, flags: c_int) -> isize {
    fault(fd, EIO_WRITE);
    let real = real!("sendmsg": unsafe extern "C" fn(c_int, *const libc::msghdr, c_int) -> isize);
    // SAFETY: the caller's arguments, as given.
    unsafe { real(fd, message, flags) }
}

/// `close(2)`; forgets what the descriptor was.
///
/// # Safety
/// As `close(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let real = real!("close": unsafe extern "C" fn(c_int) -> c_int);
    // SAFETY: the caller's argument, as given.
    let status = unsafe { real(fd) };
    // After the close: a descriptor reused at once is classified again, never
    // taken for the one closed.
    if let Some(slot) = usize::try_from(fd).ok().and_then(|i| CLASS.get(i)) {
        slot.store(UNKNOWN, Relaxed);
    }
    status
}
