//! The GPU path (feature `cuda`): probing the CUDA libraries, device tensors in a
//! [`State`](crate::State), their staging through pinned host memory, and loading
//! into device memory.
//!
//! Everything CUDA goes through cudarc's driver API, loaded at run time
//! (`dynamic-loading`): the crate builds, and its CPU tests run, on machines without
//! CUDA, and a process without a GPU gets a clear
//! [`Error::Device`](crate::Error::Device) rather than cudarc's panic, because every
//! entry point ([`device::context`]) first runs the [`probe`].
//!
//! The CUDA version feature is `cuda-12080`: the driver API is backward compatible,
//! so bindings for CUDA 12.8 run on 12.8+ and CUDA 13 drivers alike, whereas 13.x
//! bindings would ask older drivers for entry points they lack (docs/GPU.md).

pub mod device;
pub mod probe;

pub use device::{DeviceBuffer, DeviceLoader, context};
