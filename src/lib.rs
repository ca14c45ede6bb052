//! ckpt: fault-tolerant sharded checkpointing for distributed training.
//!
//! This crate will hold the checkpoint format, the save pipeline, the load and
//! reshard planner and the commit protocol. Its storage layer is
//! [`ckpt_storage`], re-exported here as [`storage`].

pub use ckpt_storage as storage;

pub mod probe;

/// The README's examples, compiled as doctests so they cannot go stale.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
