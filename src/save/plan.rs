//! Laying a rank's data file out before anything is copied: the safetensors header,
//! the order of the boxes, the sources to copy from, and the check that a tensor did
//! not change while an overlapped save was copying it.

use super::{Checkpointer, ShadowBox};
use crate::error::{Error, Result};
use crate::format::Chunk;
use crate::format::ReplicaPolicy;
use crate::health::ScanChunk;
use crate::rank_file::{PlannedBox, rank_file_header};
use crate::staging::{Source, StagingBuffer, copy_sources};

impl Checkpointer {
    /// Lays the rank's data file out: its header, and the tensors that follow it.
    /// Fails when two of its safetensors entries would get one name.
    pub(super) fn plan(&self, step: u64, state: &crate::State<'_>) -> Result<StagePlan> {
        let written: Vec<_> = state.tensors.iter().filter(|t| t.write).collect();
        // Replicas another rank writes are staged after the file, only to be
        // checksummed for the commit to compare (unless comparing is off).
        let compare = self.config.replica_mismatch != ReplicaPolicy::Off;
        let shadowed: Vec<_> = state
            .tensors
            .iter()
            .filter(|t| !t.write && compare)
            .collect();
        #[allow(unused_mut)]
        let mut planned: Vec<PlannedBox> = written
            .iter()
            .map(|t| PlannedBox {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                region: t.region.clone(),
            })
            .collect();
        // Device tensors follow the host tensors in the file.
        #[cfg(feature = "cuda")]
        let device_written: Vec<_> = state.device.iter().filter(|t| t.write).collect();
        #[cfg(feature = "cuda")]
        planned.extend(device_written.iter().map(|t| PlannedBox {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            region: t.region.clone(),
        }));
        let header = rank_file_header(
            step,
            self.config.rank as u32,
            self.config.world_size as u32,
            &planned,
        )?;
        let mut at = header.len() as u64;
        let mut chunks: Vec<Chunk> = Vec::with_capacity(planned.len());
        let mut scan: Vec<ScanChunk> = Vec::with_capacity(planned.len());
        let mut place = |name: &str,
                         dtype: crate::DType,
                         shape: &[u64],
                         region: &crate::Region,
                         len: usize,
                         replicated: bool| {
            let begin = at;
            at += len as u64;
            chunks.push(Chunk {
                tensor: name.to_string(),
                dtype,
                shape: shape.to_vec(),
                offsets: region.offsets.clone(),
                lengths: region.lengths.clone(),
                bytes: [begin, at],
            });
            scan.push(ScanChunk::new(
                begin as usize,
                at as usize,
                dtype,
                replicated && compare,
            ));
            begin as usize
        };
        for t in &written {
            place(
                &t.name,
                t.dtype,
                &t.shape,
                &t.region,
                t.data.len(),
                t.replicated,
            );
        }
        #[cfg(feature = "cuda")]
        let mut device = Vec::new();
        #[cfg(feature = "cuda")]
        for t in &device_written {
            let begin = place(
                &t.name,
                t.dtype,
                &t.shape,
                &t.region,
                t.buffer.len(),
                t.replicated,
            );
            device.push((t.buffer.clone(), begin));
        }
        let file_len = at as usize;
        // Host replicas are hashed from the caller's memory while it is staged (no
        // copy: `hash_replicas`); device ones are copied after the file and hashed
        // with it.
        #[allow(unused_mut)]
        let mut shadow: Vec<ShadowBox> = shadowed
            .iter()
            .map(|t| ShadowBox::new(&t.name, t.dtype, &t.region, 0..0))
            .collect();
        #[allow(unused_mut)]
        let mut beyond = 0usize;
        #[cfg(feature = "cuda")]
        for t in state.device.iter().filter(|t| !t.write && compare) {
            let len = t.buffer.len();
            shadow.push(ShadowBox::new(
                &t.name,
                t.dtype,
                &t.region,
                beyond..beyond + len,
            ));
            device.push((t.buffer.clone(), file_len + beyond));
            beyond += len;
        }
        Ok(StagePlan {
            total: file_len + beyond,
            file_len,
            chunks,
            scan,
            shadow,
            replica_sources: shadowed.iter().map(|t| Source::new(t.data)).collect(),
            sources: written.iter().map(|t| Source::new(t.data)).collect(),
            names: written.iter().map(|t| t.name.clone()).collect(),
            header,
            #[cfg(feature = "cuda")]
            device,
        })
    }
}

/// A rank's data file, laid out.
pub(super) struct StagePlan {
    /// The safetensors header.
    pub(super) header: Vec<u8>,
    /// The written tensors' bytes, in file order.
    pub(super) sources: Vec<Source>,
    /// The host replicas another rank writes, the first entries of `shadow`, in
    /// order: hashed in slices during staging, not copied.
    pub(super) replica_sources: Vec<Source>,
    /// Their names.
    pub(super) names: Vec<String>,
    /// Header plus data, plus the device replicas staged after the file.
    pub(super) total: usize,
    /// Header plus data: the file.
    pub(super) file_len: usize,
    /// The manifest's records of the written tensors (file offsets).
    pub(super) chunks: Vec<Chunk>,
    /// The same, as the health scan needs them.
    pub(super) scan: Vec<ScanChunk>,
    /// The replicas this rank holds but does not write.
    pub(super) shadow: Vec<ShadowBox>,
    /// The written device tensors and their offsets in the file, after the host ones.
    #[cfg(feature = "cuda")]
    pub(super) device: Vec<(crate::cuda::DeviceBuffer, usize)>,
}

/// The staging buffer, filled or being filled, and the slice CRCs of the host
/// replicas hashed meanwhile.
pub(super) enum Filled {
    /// A blocking save's, filled.
    Ready(StagingBuffer, Vec<Vec<u32>>),
    /// An overlapped save's: the staging thread hands it over when the copy ends.
    Copying(tokio::sync::oneshot::Receiver<(StagingBuffer, Result<()>, Vec<Vec<u32>>)>),
}

/// The slice CRCs (`block`-byte slices) of every replica in `sources`, on
/// `threads` threads: replicas another rank writes are checksummed straight from
/// the caller's memory while the save stages its own file, never copied (a hash
/// reads at several times the speed a copy writes, so the stall of a rank that
/// holds only replicas stays below a writer's).
///
/// # Safety
/// Every source must stay allocated and unwritten until this returns.
pub(super) unsafe fn hash_replicas(
    sources: &[Source],
    block: usize,
    threads: usize,
) -> Vec<Vec<u32>> {
    let units: Vec<(usize, usize)> = sources
        .iter()
        .enumerate()
        .flat_map(|(i, s)| (0..s.len()).step_by(block).map(move |at| (i, at)))
        .collect();
    let hash = |&(i, at): &(usize, usize)| {
        // SAFETY: forwarded from the caller.
        let bytes = unsafe { sources[i].bytes() };
        crc32fast::hash(&bytes[at..(at + block).min(bytes.len())])
    };
    let per = units.len().div_ceil(threads.max(1)).max(1);
    let crcs: Vec<u32> = if threads <= 1 || units.len() < 2 {
        units.iter().map(hash).collect()
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> = units
                .chunks(per)
                .map(|group| scope.spawn(move || group.iter().map(hash).collect::<Vec<u32>>()))
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("a replica hashing thread panicked"))
                .collect()
        })
    };
    let mut crcs = crcs.into_iter();
    sources
        .iter()
        .map(|s| crcs.by_ref().take(s.len().div_ceil(block)).collect())
        .collect()
}

/// Writes `header` then `sources` into `buffer` (`total` bytes in all), copying on
/// `threads` threads. The `during-staging` failpoint sits after the first tensor.
///
/// # Safety
/// Every source must stay allocated and unwritten until this returns.
pub(super) unsafe fn fill(
    buffer: &mut StagingBuffer,
    header: &[u8],
    sources: &[Source],
    total: usize,
    threads: usize,
) {
    let out = buffer.fill(total);
    let (head, mut data) = out.split_at_mut(header.len());
    head.copy_from_slice(header);
    // The first tensor, then the failpoint (with two tensors or more), then the rest.
    let split = sources.len().min(1);
    for (i, group) in [&sources[..split], &sources[split..]]
        .into_iter()
        .enumerate()
    {
        if i == 1 && !group.is_empty() {
            crate::failpoint::hit("during-staging");
        }
        let n: usize = group.iter().map(Source::len).sum();
        let (now, rest) = data.split_at_mut(n);
        // SAFETY: forwarded from the caller.
        unsafe { copy_sources(now, group, threads) };
        data = rest;
    }
}

/// Compares each staged tensor's CRC32 with the one taken when the save was
/// registered: a difference means the caller changed the tensor before the copy read
/// it, so the staged file mixes two states. The error names the first such tensor.
pub(super) fn check_staged(
    buffer: &StagingBuffer,
    header_len: usize,
    sources: &[Source],
    names: &[String],
    expected: &[u32],
    step: u64,
) -> Result<()> {
    let mut at = header_len;
    for ((source, name), &before) in sources.iter().zip(names).zip(expected) {
        let staged = crc32fast::hash(&buffer[at..at + source.len()]);
        at += source.len();
        if staged != before {
            let e = Error::Mutated(format!(
                "tensor {name:?} changed while step {step} was being staged (crc32 \
                 {before:08x} when save_overlapped was called, {staged:08x} copied): it \
                 was written before SaveHandle::staged() returned; this save is abandoned"
            ));
            tracing::error!(step, tensor = %name, "{e}");
            return Err(e);
        }
    }
    Ok(())
}
