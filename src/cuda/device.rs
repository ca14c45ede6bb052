//! Device tensors: describing them, staging them into pinned host memory, and
//! loading into them.
//!
//! # Saving
//!
//! A rank adds a box held in device memory with
//! [`State::add_device`](crate::State::add_device). [`Checkpointer::save`](crate::Checkpointer::save)
//! then lays the data file out as for host tensors, in a staging buffer of
//! page-locked host memory (`cuMemHostAlloc`, from the checkpointer's reusable pool,
//! allocated once and kept), and *enqueues* one device-to-host copy per device box
//! on a side stream of its own: each copy first waits (on the GPU, `cuStreamWaitEvent`)
//! for the work already enqueued on the tensor's stream, so it copies the values that
//! work leaves behind. `save` returns once the copies are enqueued; it does not wait
//! for them. The background task waits for them before it checksums and uploads.
//!
//! **When the caller may overwrite a device tensor**: once the save's
//! [`SaveHandle::device_released`](crate::SaveHandle::device_released) event has
//! completed. A trainer makes the stream of its optimizer step wait for it
//! (`stream.wait(event)`, no host stall) before the step that writes the saved
//! parameters and moments; a host thread may block on it instead
//! ([`SaveHandle::wait_device_released`](crate::SaveHandle::wait_device_released)).
//! Work enqueued on a tensor's stream *after* `save` returned is not ordered before
//! the copy: it must not write the tensor until the event. Memory must stay
//! allocated until then too.
//!
//! # Loading
//!
//! [`DeviceLoader::load_into`] reads the requested boxes, verified, into pinned host
//! buffers it keeps across loads, then copies them to the device buffers
//! (host-to-device, on the loader's stream) and waits for those copies: when it
//! returns, the device buffers hold the checkpoint's bytes.
//!
//! The format does not change: a box saved from a device is the same bytes in the
//! same file as the same box saved from host memory.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};

use crate::error::{Error, Result};
use crate::load::{CheckpointReader, LoadRequest, LoadStats};

fn cuda_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Device(format!("{what}: {e}"))
}

/// A CUDA context, after the [`probe`](super::probe) found the driver: the device
/// `ordinal`'s primary context (the one PyTorch and the runtime API use).
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let count = super::probe::device_count()?;
    if ordinal >= count {
        return Err(Error::Device(format!(
            "device {ordinal} does not exist: the driver reports {count} device(s)"
        )));
    }
    CudaContext::new(ordinal)
        .map_err(|e| cuda_err(&format!("creating a context on device {ordinal}"), e))
}

/// A box of a tensor in device memory, as a save reads it or a load writes it:
/// a device pointer, a length in bytes, the stream whose work produces (or consumes)
/// it, and the context it belongs to.
#[derive(Debug, Clone)]
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
}

// SAFETY: a device address, a length and a stream handle: plain values that any
// thread may use with the (thread-safe) driver API; the memory they name is governed
// by `DeviceBuffer::from_raw`'s contract, not by which thread holds the value.
unsafe impl Send for DeviceBuffer {}
// SAFETY: as above; nothing is mutated through `&DeviceBuffer`.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Describes `len` bytes of device memory at `ptr` in `ctx`, produced and
    /// consumed by work on `stream` (a `CUstream` of `ctx`; NULL for the legacy
    /// default stream).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be device memory of `ctx` and `stream` a live stream of
    /// `ctx`. For a save: the memory stays allocated and is not written until the
    /// save's [`device_released`](crate::SaveHandle::device_released) event has
    /// completed (see the module docs). For a load: it stays allocated, and nothing
    /// else reads or writes it, until the load returns.
    pub unsafe fn from_raw(
        ctx: &Arc<CudaContext>,
        ptr: sys::CUdeviceptr,
        len: usize,
        stream: sys::CUstream,
    ) -> Self {
        Self {
            ctx: ctx.clone(),
            ptr,
            len,
            stream,
        }
    }

    /// Describes a cudarc slice, produced by work on `stream`.
    ///
    /// # Safety
    /// As [`DeviceBuffer::from_raw`]: `slice` must not be dropped or written until the
    /// save's `device_released` event has completed (or the load returned).
    pub unsafe fn from_slice<T>(slice: &cudarc::driver::CudaSlice<T>, stream: &CudaStream) -> Self {
        use cudarc::driver::DevicePtr;
        let (ptr, _sync) = slice.device_ptr(stream);
        Self {
            ctx: slice.context().clone(),
            ptr,
            len: slice.num_bytes(),
            stream: stream.cu_stream(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, aligned to `align` bytes, zeroed
/// when allocated (so every byte is initialized from the start).
pub(crate) struct PinnedAlloc {
    ctx: Arc<CudaContext>,
    base: *mut std::ffi::c_void,
    ptr: *mut u8,
    cap: usize,
}

// SAFETY: owned page-locked memory, like a Vec<u8>; freeing binds the context on
// whichever thread drops it.
unsafe impl Send for PinnedAlloc {}
// SAFETY: `&PinnedAlloc` gives only the pointer; writers go through `&mut` owners.
unsafe impl Sync for PinnedAlloc {}

impl PinnedAlloc {
    /// Allocates at least `cap` bytes aligned to `align` (a power of two).
    pub(crate) fn new(ctx: &Arc<CudaContext>, cap: usize, align: usize) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("binding the CUDA context", e))?;
        let bytes = cap
            .checked_add(align)
            .ok_or_else(|| Error::invalid(format!("pinned buffer of {cap} bytes is too large")))?;
        // SAFETY: the context is current on this thread; flags 0 = plain page-locked
        // memory (not write-combined: the host reads it back to checksum and upload).
        let base = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }
            .map_err(|e| cuda_err(&format!("cuMemHostAlloc of {bytes} bytes"), e))?;
        let offset = (base as usize).next_multiple_of(align) - base as usize;
        // SAFETY: `offset < align` and the allocation holds `cap + align` bytes, so
        // `ptr .. ptr + cap` lies inside it.
        let ptr = unsafe { base.cast::<u8>().add(offset) };
        // SAFETY: `ptr .. ptr + cap` is freshly allocated, writable host memory.
        unsafe { std::ptr::write_bytes(ptr, 0, cap) };
        Ok(Self {
            ctx: ctx.clone(),
            base,
            ptr,
            cap,
        })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `base` came from cuMemHostAlloc and is freed once; whoever enqueued
        // copies into it waited for them before giving the memory back.
        if let Err(e) = unsafe { cudarc::driver::result::free_host(self.base) } {
            tracing::warn!(error = %e, "cuMemFreeHost failed");
        }
    }
}

/// The device-to-host copies of one save, enqueued.
#[derive(Debug)]
pub(crate) struct DeviceCopies {
    /// Recorded on the side stream after the last copy.
    pub(crate) released: Arc<CudaEvent>,
}

/// The checkpointer's side stream for device-to-host copies, per context.
#[derive(Debug, Default)]
pub(crate) struct SideStreams {
    streams: Vec<Arc<CudaStream>>,
}

impl SideStreams {
    fn for_context(&mut self, ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>> {
        if let Some(s) = self.streams.iter().find(|s| s.context() == ctx) {
            return Ok(s.clone());
        }
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating the staging stream", e))?;
        self.streams.push(stream.clone());
        Ok(stream)
    }

    /// Enqueues a copy of each `(buffer, offset)` into `dst + offset`, after the work
    /// already enqueued on the buffer's stream, and records the release event.
    /// On an error, waits for whatever was enqueued before returning it, so that no
    /// copy is left writing into `dst`.
    ///
    /// # Safety
    /// `dst .. dst + dst_len` is page-locked host memory that stays allocated and is
    /// not read until the returned event completes; each buffer obeys
    /// [`DeviceBuffer::from_raw`]'s contract.
    pub(crate) unsafe fn enqueue(
        &mut self,
        dst: *mut u8,
        dst_len: usize,
        copies: &[(DeviceBuffer, usize)],
    ) -> Result<DeviceCopies> {
        let ctx = copies[0].0.ctx.clone();
        if let Some((other, _)) = copies.iter().find(|(b, _)| b.ctx != ctx) {
            return Err(Error::invalid(format!(
                "device tensors of one save must share one CUDA context (devices {} and {})",
                ctx.ordinal(),
                other.ctx.ordinal()
            )));
        }
        if let Some((b, offset)) = copies
            .iter()
            .find(|(b, offset)| offset.checked_add(b.len).is_none_or(|end| end > dst_len))
        {
            return Err(Error::invalid(format!(
                "a device box of {} bytes at offset {offset} overflows the {dst_len}-byte staging buffer",
                b.len
            )));
        }
        let side = self.for_context(&ctx)?;
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("binding the CUDA context", e))?;
        let result = (|| -> Result<DeviceCopies> {
            let mut waited: Vec<sys::CUstream> = Vec::new();
            for (buffer, offset) in copies {
                if !waited.contains(&buffer.stream) {
                    // The copy must see what the producer's enqueued work leaves.
                    let ready = ctx
                        .new_event(None)
                        .map_err(|e| cuda_err("cuEventCreate", e))?;
                    // SAFETY: a live event of `ctx` and the caller's live stream.
                    unsafe {
                        cudarc::driver::result::event::record(ready.cu_event(), buffer.stream)
                    }
                    .map_err(|e| cuda_err("cuEventRecord on the tensor's stream", e))?;
                    side.wait(&ready)
                        .map_err(|e| cuda_err("cuStreamWaitEvent", e))?;
                    waited.push(buffer.stream);
                }
                // SAFETY: `offset + len <= dst_len` (checked above), the destination is
                // page-locked memory the caller keeps, the source is device memory the
                // caller keeps unwritten (from_raw's contract).
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(
                        dst.add(*offset).cast(),
                        buffer.ptr,
                        buffer.len,
                        side.cu_stream(),
                    )
                }
                .result()
                .map_err(|e| cuda_err(&format!("cuMemcpyDtoHAsync of {} bytes", buffer.len), e))?;
            }
            let released = side
                .record_event(None)
                .map_err(|e| cuda_err("cuEventRecord on the staging stream", e))?;
            Ok(DeviceCopies {
                released: Arc::new(released),
            })
        })();
        if result.is_err() {
            let _ = side.synchronize();
        }
        result
    }
}

/// Loads checkpoint boxes into device memory through reusable pinned buffers.
#[derive(Debug)]
pub struct DeviceLoader {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pinned: Vec<PinnedAlloc>,
}

impl std::fmt::Debug for PinnedAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedAlloc")
            .field("cap", &self.cap)
            .finish()
    }
}

impl DeviceLoader {
    /// A loader for device buffers of `ctx`, with a stream of its own.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating the load stream", e))?;
        Ok(Self {
            ctx: ctx.clone(),
            stream,
            pinned: Vec::new(),
        })
    }

    /// Loads the boxes of `request`, verified, into `targets` (one device buffer per
    /// want, in request order, each exactly the want's size), as
    /// [`CheckpointReader::load_into`] does into host memory. The copies to the
    /// device wait for the work already enqueued on each target's stream; when this
    /// returns they are complete and the targets hold the checkpoint's bytes.
    pub async fn load_into(
        &mut self,
        reader: &CheckpointReader,
        request: &LoadRequest,
        targets: &[DeviceBuffer],
    ) -> Result<LoadStats> {
        if let Some(t) = targets.iter().find(|t| t.ctx != self.ctx) {
            return Err(Error::invalid(format!(
                "a target on device {} given to a loader of device {}",
                t.ctx.ordinal(),
                self.ctx.ordinal()
            )));
        }
        while self.pinned.len() < targets.len() {
            self.pinned.push(PinnedAlloc::new(&self.ctx, 0, 4096)?);
        }
        for (pinned, target) in self.pinned.iter_mut().zip(targets) {
            if pinned.capacity() < target.len {
                *pinned = PinnedAlloc::new(&self.ctx, target.len, 4096)?;
            }
        }
        let stats = {
            let mut outputs: Vec<&mut [u8]> = self
                .pinned
                .iter_mut()
                .zip(targets)
                // SAFETY: each pinned allocation holds at least `target.len`
                // initialized bytes (zeroed when allocated) and is borrowed mutably,
                // once, for the duration of the load.
                .map(|(p, t)| unsafe { std::slice::from_raw_parts_mut(p.ptr(), t.len) })
                .collect();
            reader.load_into(request, &mut outputs).await?
        };
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the CUDA context", e))?;
        let mut waited: Vec<sys::CUstream> = Vec::new();
        let result = (|| -> Result<()> {
            for (pinned, target) in self.pinned.iter().zip(targets) {
                if !waited.contains(&target.stream) {
                    let ready = self
                        .ctx
                        .new_event(None)
                        .map_err(|e| cuda_err("cuEventCreate", e))?;
                    // SAFETY: a live event and the caller's live stream.
                    unsafe {
                        cudarc::driver::result::event::record(ready.cu_event(), target.stream)
                    }
                    .map_err(|e| cuda_err("cuEventRecord on the target's stream", e))?;
                    self.stream
                        .wait(&ready)
                        .map_err(|e| cuda_err("cuStreamWaitEvent", e))?;
                    waited.push(target.stream);
                }
                // SAFETY: the pinned buffer holds `target.len` bytes and is not touched
                // until the stream is synchronized below; the target is device memory
                // the caller keeps (from_raw's contract).
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        target.ptr,
                        pinned.ptr().cast_const().cast(),
                        target.len,
                        self.stream.cu_stream(),
                    )
                }
                .result()
                .map_err(|e| cuda_err(&format!("cuMemcpyHtoDAsync of {} bytes", target.len), e))?;
            }
            Ok(())
        })();
        // Whatever was enqueued must finish before the pinned buffers are reused.
        let synced = self
            .stream
            .synchronize()
            .map_err(|e| cuda_err("synchronizing the load stream", e));
        result?;
        synced?;
        Ok(stats)
    }
}
