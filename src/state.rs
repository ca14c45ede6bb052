//! Describing what a rank saves: its boxes of global tensors, and non-tensor state.
//!
//! A [`State`] borrows the caller's tensor memory; nothing is copied until
//! [`Checkpointer::save`](crate::Checkpointer::save) stages it.
//!
//! A rank may hold several boxes of one tensor (a `ShardedTensor` whose spec gives it
//! two shards, the pieces a resharding leaves on one rank), as long as they are
//! disjoint: the checkpoint's boxes of a tensor must tile it exactly once, and two
//! boxes of one rank that overlap are a mistake best named where it is made, when
//! the second is added, rather than by the commit's tiling check later.

use std::collections::{BTreeMap, HashMap};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::{MAX_DIMS, StateValue};
use crate::region::Region;

/// One box of a global tensor held by this rank.
#[derive(Debug, Clone)]
pub struct TensorShard<'a> {
    /// Global tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The box this rank holds.
    pub region: Region,
    /// The box's data, row-major over the box's lengths.
    pub data: &'a [u8],
    /// False for a replica that another rank writes.
    pub write: bool,
    /// True when other ranks hold the same box ([`State::add_replica`], a scalar of
    /// [`State::add_dim0_shard`]): every holder checksums its copy for the commit
    /// to compare.
    pub replicated: bool,
}

pub use crate::dtype::{Element, as_bytes, as_bytes_mut};

/// One box of a global tensor held in device memory (feature `cuda`).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone)]
pub struct DeviceShard {
    /// Global tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The box this rank holds.
    pub region: Region,
    /// The box's data, row-major over the box's lengths, on the device.
    pub buffer: crate::cuda::DeviceBuffer,
    /// False for a replica that another rank writes.
    pub write: bool,
    /// True when other ranks hold the same box, as [`TensorShard::replicated`].
    pub replicated: bool,
}

/// What a rank has added of one tensor: its dtype and shape (every box of a tensor
/// has the same) and its boxes.
#[derive(Debug, Clone)]
struct Added {
    dtype: DType,
    shape: Vec<u64>,
    regions: Vec<Region>,
}

/// Everything one rank saves at one step.
#[derive(Debug, Clone, Default)]
pub struct State<'a> {
    pub(crate) tensors: Vec<TensorShard<'a>>,
    /// The boxes added so far of every tensor (host and device), so that a new box
    /// is checked against the boxes of its own tensor only, not every box before it.
    added: HashMap<String, Added>,
    #[cfg(feature = "cuda")]
    pub(crate) device: Vec<DeviceShard>,
    pub(crate) global: BTreeMap<String, StateValue>,
    pub(crate) rank: BTreeMap<String, StateValue>,
    pub(crate) metadata: BTreeMap<String, serde_json::Value>,
    /// The caller's metrics for the checkpoint's health.
    pub(crate) metrics: BTreeMap<String, f64>,
    /// Why the caller found this state unhealthy.
    pub(crate) unhealthy: Vec<String>,
}

impl<'a> State<'a> {
    /// An empty state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds this rank's box `region` of tensor `name` (global `shape`), with its data
    /// row-major over the box. Checks that the box lies in the shape and that `data`
    /// has exactly the box's bytes. A rank may add several boxes of one tensor, of
    /// one dtype and shape and pairwise disjoint; the error of an overlapping box
    /// names both boxes.
    pub fn add(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[u64],
        region: Region,
        data: &'a [u8],
    ) -> Result<&mut Self> {
        self.push(name.into(), dtype, shape, region, data, true, false)
    }

    /// Adds this rank's even dim-0 shard (FSDP2 / ZeRO) of tensor `name`: rows
    /// `rank·n/world .. (rank+1)·n/world` (see [`Region::dim0_shard`]). A scalar is
    /// held whole by every rank and written by rank 0.
    pub fn add_dim0_shard(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[u64],
        rank: usize,
        world: usize,
        data: &'a [u8],
    ) -> Result<&mut Self> {
        let region = Region::dim0_shard(shape, rank, world);
        // A scalar cannot be split: every rank holds it, rank 0 writes it.
        let write = !shape.is_empty() || rank == 0;
        let replicated = shape.is_empty() && world > 1;
        self.push(name.into(), dtype, shape, region, data, write, replicated)
    }

    /// Adds a box that several ranks hold identical copies of (a replicated tensor,
    /// or a replica group in HSDP). Only the rank passing `writer = true` writes it;
    /// exactly one rank of the world must.
    pub fn add_replica(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[u64],
        region: Region,
        data: &'a [u8],
        writer: bool,
    ) -> Result<&mut Self> {
        self.push(name.into(), dtype, shape, region, data, writer, true)
    }

    /// Adds this rank's box `region` of tensor `name` held in device memory
    /// (feature `cuda`); `writer` as in [`State::add_replica`] (true for a box only
    /// this rank holds; false for a replica, which the save checksums for the
    /// commit to compare, as every holder of a host replica does). A save stages it
    /// by an asynchronous device-to-host copy; the buffer must not be written until
    /// the save's
    /// [`device_released`](crate::SaveHandle::device_released) event (see
    /// [`crate::cuda::device`]). Same checks as [`State::add`].
    #[cfg(feature = "cuda")]
    pub fn add_device(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[u64],
        region: Region,
        buffer: crate::cuda::DeviceBuffer,
        writer: bool,
    ) -> Result<&mut Self> {
        self.push_device(name.into(), dtype, shape, region, buffer, writer, !writer)
    }

    /// Adds a box held in device memory that several ranks hold identical copies of
    /// (feature `cuda`), as [`State::add_replica`] does for host memory: only the
    /// rank passing `writer = true` writes it, and every holder checksums its copy
    /// for the commit to compare.
    #[cfg(feature = "cuda")]
    pub fn add_device_replica(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[u64],
        region: Region,
        buffer: crate::cuda::DeviceBuffer,
        writer: bool,
    ) -> Result<&mut Self> {
        self.push_device(name.into(), dtype, shape, region, buffer, writer, true)
    }

    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    fn push_device(
        &mut self,
        name: String,
        dtype: DType,
        shape: &[u64],
        region: Region,
        buffer: crate::cuda::DeviceBuffer,
        writer: bool,
        replicated: bool,
    ) -> Result<&mut Self> {
        self.check(&name, dtype, shape, &region, buffer.len())?;
        self.record(&name, dtype, shape, &region);
        self.device.push(DeviceShard {
            name,
            dtype,
            shape: shape.to_vec(),
            region,
            buffer,
            write: writer,
            replicated,
        });
        Ok(self)
    }

    /// The device tensors added so far (feature `cuda`).
    #[cfg(feature = "cuda")]
    pub fn device_tensors(&self) -> &[DeviceShard] {
        &self.device
    }

    /// Records a checked box of `name`.
    fn record(&mut self, name: &str, dtype: DType, shape: &[u64], region: &Region) {
        match self.added.get_mut(name) {
            Some(added) => added.regions.push(region.clone()),
            None => {
                self.added.insert(
                    name.to_string(),
                    Added {
                        dtype,
                        shape: shape.to_vec(),
                        regions: vec![region.clone()],
                    },
                );
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        name: String,
        dtype: DType,
        shape: &[u64],
        region: Region,
        data: &'a [u8],
        write: bool,
        replicated: bool,
    ) -> Result<&mut Self> {
        self.check(&name, dtype, shape, &region, data.len())?;
        self.record(&name, dtype, shape, &region);
        self.tensors.push(TensorShard {
            name,
            dtype,
            shape: shape.to_vec(),
            region,
            data,
            write,
            replicated,
        });
        Ok(self)
    }

    /// The checks of every added box: a valid name, a box inside the shape, exactly
    /// the box's bytes, and, when the rank already holds boxes of the tensor, the
    /// same dtype and shape as they have and no element in common with any of them
    /// (linear in the boxes of that tensor this rank holds, which are few).
    fn check(
        &self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        region: &Region,
        len: usize,
    ) -> Result<()> {
        if name.is_empty() || name == "__metadata__" || name.len() > 1024 {
            return Err(Error::invalid(format!(
                "tensor name {name:?} is not allowed (empty, reserved or longer than 1024 bytes)"
            )));
        }
        if shape.len() > MAX_DIMS {
            return Err(Error::invalid(format!(
                "tensor {name:?} has {} dimensions, more than {MAX_DIMS}",
                shape.len()
            )));
        }
        if !region.within(shape) {
            return Err(Error::invalid(format!(
                "tensor {name:?}: box {region} lies outside shape {shape:?}"
            )));
        }
        let expected = region
            .volume()
            .and_then(|v| v.checked_mul(dtype.size() as u64))
            .ok_or_else(|| Error::invalid(format!("tensor {name:?}: box {region} is too large")))?;
        if len as u64 != expected {
            return Err(Error::invalid(format!(
                "tensor {name:?}: a {dtype} box {region} needs {expected} bytes, got {len}"
            )));
        }
        let Some(added) = self.added.get(name) else {
            return Ok(());
        };
        if added.dtype != dtype || added.shape != shape {
            return Err(Error::invalid(format!(
                "tensor {name:?}: box {region} is {dtype} of shape {shape:?}, but this rank's earlier boxes of it are {} of shape {:?}",
                added.dtype, added.shape
            )));
        }
        for held in &added.regions {
            if held == region {
                return Err(Error::invalid(format!(
                    "tensor {name:?}: box {region} was added twice"
                )));
            }
            if let Some(common) = held.intersect(region) {
                return Err(Error::invalid(format!(
                    "tensor {name:?}: box {region} overlaps box {held}, which this rank already holds, in {common}; a rank's boxes of one tensor must be disjoint"
                )));
            }
        }
        Ok(())
    }

    /// Sets global non-tensor state (identical on every rank: scheduler, step
    /// counters). Stored once, from rank 0; other ranks' copies are not written.
    pub fn set_global_json(
        &mut self,
        key: impl Into<String>,
        value: serde_json::Value,
    ) -> &mut Self {
        self.global.insert(key.into(), StateValue::Json(value));
        self
    }

    /// Sets global non-tensor state as bytes.
    pub fn set_global_bytes(&mut self, key: impl Into<String>, value: &[u8]) -> &mut Self {
        self.global.insert(key.into(), StateValue::bytes(value));
        self
    }

    /// Sets this rank's own non-tensor state (RNG stream, data-loader cursor). Every
    /// saved rank's entry stays readable after a world-size change.
    pub fn set_rank_json(&mut self, key: impl Into<String>, value: serde_json::Value) -> &mut Self {
        self.rank.insert(key.into(), StateValue::Json(value));
        self
    }

    /// Sets this rank's own non-tensor state as bytes.
    pub fn set_rank_bytes(&mut self, key: impl Into<String>, value: &[u8]) -> &mut Self {
        self.rank.insert(key.into(), StateValue::bytes(value));
        self
    }

    /// Sets user metadata, recorded in the manifest.
    pub fn set_metadata(&mut self, key: impl Into<String>, value: serde_json::Value) -> &mut Self {
        self.metadata.insert(key.into(), value);
        self
    }

    /// Records a scalar metric of this step for the checkpoint's health (`loss`,
    /// `grad_norm`, …): kept in the manifest, shown by `ckpt inspect`. A metric
    /// that is not finite makes the checkpoint unhealthy, as does a failed
    /// [`CheckpointConfig::health_check`](crate::CheckpointConfig::health_check).
    pub fn health_metric(&mut self, name: impl Into<String>, value: f64) -> &mut Self {
        self.metrics.insert(name.into(), value);
        self
    }

    /// Marks the state unhealthy for `reason` (the caller's own check failed): the
    /// checkpoint commits, but "the newest healthy checkpoint" passes over it.
    pub fn mark_unhealthy(&mut self, reason: impl Into<String>) -> &mut Self {
        self.unhealthy.push(reason.into());
        self
    }

    /// The metrics recorded so far.
    pub fn health_metrics(&self) -> &BTreeMap<String, f64> {
        &self.metrics
    }

    /// The tensors added so far.
    pub fn tensors(&self) -> &[TensorShard<'a>] {
        &self.tensors
    }

    /// Bytes this rank writes (its boxes, replicas it does not write excluded).
    pub fn bytes_to_write(&self) -> u64 {
        let host: u64 = self
            .tensors
            .iter()
            .filter(|t| t.write)
            .map(|t| t.data.len() as u64)
            .sum();
        #[cfg(feature = "cuda")]
        let host = host
            + self
                .device
                .iter()
                .filter(|t| t.write)
                .map(|t| t.buffer.len() as u64)
                .sum::<u64>();
        host
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_added_twice_is_refused_among_many_host_and_replica_boxes() {
        const BOXES: usize = 50_000;
        let data = [0u8; 4];
        let names: Vec<String> = (0..BOXES).map(|i| format!("layer.{i}.scale")).collect();
        let started = std::time::Instant::now();
        let mut state = State::new();
        for name in &names {
            state
                .add(name.as_str(), DType::F32, &[1], Region::full(&[1]), &data)
                .unwrap();
        }
        eprintln!("{BOXES} boxes added in {:?}", started.elapsed());
        for twice in [&names[0], &names[BOXES / 2], &names[BOXES - 1]] {
            let err = state
                .add_replica(
                    twice.as_str(),
                    DType::F32,
                    &[1],
                    Region::full(&[1]),
                    &data,
                    true,
                )
                .unwrap_err();
            assert!(err.to_string().contains("added twice"), "{err}");
        }
        assert_eq!(state.tensors.len(), BOXES);
    }
}
