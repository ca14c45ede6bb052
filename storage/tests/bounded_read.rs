//! A bounded read of a huge object stays small: `get_at_most` refuses a 2 GiB object
//! without reading it. Alone in its binary, so that no other test moves the peak
//! resident set it measures.

use ckpt_storage::{ErrorKind, Store};

/// Peak resident set of this process so far, from /proc/self/status.
fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM in /proc/self/status");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmHWM value in kB");
    kib * 1024
}

#[tokio::test(flavor = "current_thread")]
async fn a_bounded_read_of_a_2_gib_object_reads_none_of_it() {
    let dir = tempfile::tempdir().unwrap();
    // Sparse: the file costs no disk, but a whole read would cost 2 GiB of memory.
    let file = std::fs::File::create(dir.path().join("hint")).unwrap();
    file.set_len(2 << 30).unwrap();
    let store = Store::from_url(&format!("file://{}", dir.path().display())).unwrap();
    let before = peak_rss_bytes();
    let err = store.get_at_most("hint", 64).await.unwrap_err();
    let grown = peak_rss_bytes().saturating_sub(before);
    assert_eq!(err.kind(), ErrorKind::Permanent, "{err}");
    assert!(err.to_string().contains("2147483648 bytes"), "{err}");
    assert!(
        grown < 64 << 20,
        "the peak resident set grew by {grown} bytes for a read bounded to 64"
    );
}
