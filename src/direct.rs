//! Writing a rank's data file to local disk with direct I/O.
//!
//! Through the page cache, a file costs one extra copy per byte and the kernel's
//! write-back; on the disks this was measured on, buffered writes plus fsync reach
//! half the bandwidth of `O_DIRECT`. The staging buffer is page-aligned, so it can be
//! written straight to the device: whole 4 KiB pages with `O_DIRECT`, the short tail
//! through the page cache, then one fsync. File systems that refuse `O_DIRECT`
//! (tmpfs) get plain buffered writes.
//!
//! Guarantees are those of the store's `put`: the file is written beside its name
//! (`NAME#direct`, a suffix listings ignore), fsynced, renamed into place, and the
//! directory fsynced, so readers see nothing or the whole file, and a crash leaves at
//! most a hidden temporary that deleting the step directory removes.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// Alignment of buffers written with direct I/O (and so of staging buffers): the
/// page size and the largest logical block size direct I/O needs.
pub(crate) const ALIGN: usize = 4096;

/// Bytes per write call.
const CHUNK: usize = 8 << 20;

/// Writes `data` (starting on an [`ALIGN`] boundary in memory) to `path` durably.
/// `progress` runs after the first chunk is written (a failpoint seam).
pub(crate) fn write_file(
    path: &Path,
    data: &[u8],
    fsync: bool,
    progress: impl Fn(),
) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "a data file needs a directory")
    })?;
    let created = !dir.exists();
    std::fs::create_dir_all(dir)?;
    if created && fsync {
        // The new step directory's entry must survive a crash too.
        if let Some(parent) = dir.parent() {
            File::open(parent)?.sync_all()?;
        }
    }
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "a data file needs a name"))?;
    let tmp = dir.join(format!("{}#direct", name.to_string_lossy()));

    let aligned = (data.as_ptr() as usize).is_multiple_of(ALIGN);
    let direct_len = if aligned {
        data.len() / ALIGN * ALIGN
    } else {
        0
    };
    let mut written = 0usize;
    let mut announced = false;
    if direct_len > 0 {
        match OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&tmp)
        {
            Ok(file) => {
                while written < direct_len {
                    let end = (written + CHUNK).min(direct_len);
                    match file.write_all_at(&data[written..end], written as u64) {
                        Ok(()) => written = end,
                        // Refused by the file system: the rest goes buffered.
                        Err(e) if e.raw_os_error() == Some(libc::EINVAL) && written == 0 => break,
                        Err(e) => return Err(e),
                    }
                    if !announced {
                        announced = true;
                        progress();
                    }
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(written == 0)
        .open(&tmp)?;
    let mut offset = written;
    while offset < data.len() {
        let end = (offset + CHUNK).min(data.len());
        file.write_all_at(&data[offset..end], offset as u64)?;
        offset = end;
        if !announced {
            announced = true;
            progress();
        }
    }
    file.set_len(data.len() as u64)?;
    if fsync {
        file.sync_all()?;
    }
    drop(file);
    std::fs::rename(&tmp, path)?;
    if fsync {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staging::StagingBuffer;

    #[test]
    fn files_of_any_length_are_written_whole_and_the_temporary_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        for len in [0usize, 1, 4095, 4096, 4097, 3 * CHUNK + 123] {
            let mut buffer = StagingBuffer::new();
            buffer.reset(len).unwrap();
            let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            buffer.fill(len).copy_from_slice(&data);
            let path = dir.path().join(format!("step/rank-{len}.safetensors"));
            let calls = std::cell::Cell::new(0);
            write_file(&path, &buffer, true, || calls.set(calls.get() + 1)).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), data, "length {len}");
            assert_eq!(calls.get(), usize::from(len > 0), "length {len}");
        }
        let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("step"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains('#')
            })
            .collect();
        assert!(leftovers.is_empty());
    }

    #[test]
    fn an_existing_file_is_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![9u8; 100_000]).unwrap();
        let mut buffer = StagingBuffer::new();
        buffer.reset(10).unwrap();
        buffer.fill(10).copy_from_slice(b"0123456789");
        write_file(&path, &buffer, false, || {}).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"0123456789");
    }
}
