//! ckpt-trainer: a reference trainer that uses ckpt the way a real trainer does.
//!
//! It exists to prove, across real processes, that what ckpt saves resumes exactly:
//! in deterministic mode the trained weights are bitwise identical for a given seed
//! and global batch whatever the world size and whatever history of kills, stops and
//! resumes happened, so a plain `ckpt diff` against an uninterrupted run is the
//! oracle of every recovery test.
//!
//! The parts, each in its module:
//! - [`collective`]: the [`Collective`](collective::Collective) trait (all-gather,
//!   reduce-scatter, all-reduce, broadcast, barrier, abort) and its TCP ring backend,
//!   with timeouts and an `abort` that wakes blocked operations from another thread;
//! - [`model`]: presets, the MLP, the seeded synthetic task, the GEMM and Adam;
//! - [`fixed`]: exact fixed-point gradient sums, the source of determinism;
//! - [`train`]: one *generation* of FSDP2-style training on a fixed world, with
//!   async checkpoints and resharding resume through ckpt's public API;
//! - [`elastic`](mod@elastic): one rank of an elastic job, driven by ckpt's control
//!   plane through as many generations (world sizes) as failures require, recovering
//!   from the survivors' in-memory copies (`ckpt::copies`) where it can;
//! - [`bench`](mod@bench): collective bandwidth against raw loopback TCP; with feature
//!   `cuda`, `nccl_bench`: the time to build, abort and rebuild an NCCL communicator.
//!
//! `ckpt-train launch` starts its ranks through the shared launcher (crate
//! `ckpt-launch`, also `ckpt launch`). Run `ckpt-train --help` for the command line; `trainer/README.md` has the
//! semantics of the saved state, the modes and what each costs.

pub mod bench;
pub mod collective;
pub mod elastic;
pub mod fixed;
pub mod model;
#[cfg(feature = "cuda")]
pub mod nccl_bench;
pub mod train;
