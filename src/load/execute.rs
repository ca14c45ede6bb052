//! Executing a plan: the files of a load read concurrently (local files on scoped
//! threads, remote ones as ranged requests), each writing its runs straight into the
//! outputs, within the poll of the load's future so nothing outlives the borrow.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ckpt_storage::ErrorKind;
use futures::{StreamExt, TryStreamExt};

use super::CheckpointReader;
use super::memory::zeroed;
use super::plan::{check_outputs, check_plan};
use super::read::FileRead;
use super::request::{LoadPlan, LoadRequest, LoadStats, Loaded, LoadedTensor};
use super::scatter::{Outputs, Tally};
use crate::blocks::BlockMap;
use crate::error::{Error, Result};
use crate::format::{Codec, FormatError};

impl CheckpointReader {
    /// Reads, verifies and scatters what `plan` (made by [`CheckpointReader::plan`](crate::CheckpointReader::plan)
    /// for the same `request`) names, into buffers it allocates. See
    /// [`CheckpointReader::load`](crate::CheckpointReader::load).
    pub async fn execute(&self, request: &LoadRequest, plan: LoadPlan) -> Result<Loaded> {
        check_plan(request, &plan)?;
        // Sizes claimed by the manifest and parts are checked against the objects
        // before anything is allocated, and allocation failure is an error: a hostile
        // checkpoint whose documents vouch for each other cannot abort the process.
        self.check_stored_sizes(&plan).await?;
        let mut buffers: Vec<Vec<u8>> = request
            .wants
            .iter()
            .zip(&plan.sizes)
            .map(|(want, &n)| zeroed(n, &want.name))
            .collect::<Result<_>>()?;
        let mut outputs: Vec<&mut [u8]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
        let stats = self.read_plan(plan, &mut outputs).await?;
        let tensors = request
            .wants
            .iter()
            .zip(buffers)
            .map(|(want, data)| {
                let tensor = self.manifest.tensor(&want.name).ok_or_else(|| {
                    Error::invalid(format!(
                        "tensor {:?} is not in the checkpoint the plan was made for",
                        want.name
                    ))
                })?;
                Ok(LoadedTensor {
                    name: want.name.clone(),
                    dtype: tensor.dtype,
                    shape: tensor.shape.clone(),
                    region: want.region.clone(),
                    data,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Loaded { tensors, stats })
    }

    /// Reads, verifies and scatters what `plan` (made by [`CheckpointReader::plan`](crate::CheckpointReader::plan)
    /// for the same `request`) names, into `outputs`. See
    /// [`CheckpointReader::load_into`](crate::CheckpointReader::load_into) for what `outputs` must be and hold after an
    /// error.
    pub async fn execute_into(
        &self,
        request: &LoadRequest,
        plan: LoadPlan,
        outputs: &mut [&mut [u8]],
    ) -> Result<LoadStats> {
        check_plan(request, &plan)?;
        check_outputs(request, &plan.sizes, outputs)?;
        self.check_stored_sizes(&plan).await?;
        self.read_plan(plan, outputs).await
    }

    /// Compares each data file's stored size with what its part records (once per
    /// file and reader: tools load a checkpoint in many slabs).
    pub(crate) async fn check_stored_sizes(&self, plan: &LoadPlan) -> Result<()> {
        let claimed: Vec<(String, u64)> = {
            let sized = self.sized.lock().unwrap_or_else(|p| p.into_inner());
            plan.files
                .iter()
                .filter(|(object, _, _)| !sized.contains(object))
                .map(|(object, part, _)| (object.clone(), part.file.stored_bytes))
                .collect()
        };
        futures::stream::iter(claimed)
            .map(|(object, stored)| async move {
                let info = self.store.head(&object).await.map_err(|e| match e.kind() {
                    ErrorKind::NotFound => Error::from(FormatError::new(
                        &object,
                        None,
                        "data file is missing from a committed checkpoint",
                    )),
                    _ => Error::from(e),
                })?;
                if info.size != stored {
                    return Err(Error::from(FormatError::new(
                        &object,
                        Some(info.size.min(stored)),
                        format!(
                            "{}{} bytes stored, its part records {stored}",
                            if info.size < stored {
                                "truncated: "
                            } else {
                                ""
                            },
                            info.size
                        ),
                    )));
                }
                Ok::<String, Error>(object)
            })
            .buffer_unordered(32)
            .try_collect::<Vec<String>>()
            .await?
            .into_iter()
            .for_each(|object| {
                self.sized
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(object);
            });
        Ok(())
    }

    /// Reads every file of `plan` into `outputs` (checked to match the plan).
    ///
    /// Every write into `outputs` happens inside a poll of this future (see
    /// [`in_this_poll`]): plain local files are read by scoped threads that are all
    /// joined before the poll returns, and fetched batches are verified and copied in
    /// the poll that received them. So no thread can write into the outputs once
    /// the future is dropped, or even leaked with `mem::forget`, and the borrow of
    /// `outputs` ends.
    pub(crate) async fn read_plan(
        &self,
        plan: LoadPlan,
        outputs: &mut [&mut [u8]],
    ) -> Result<LoadStats> {
        let LoadPlan {
            files, mut stats, ..
        } = plan;
        let dest = Arc::new(Outputs::new(outputs));
        let (mut local, mut remote) = (Vec::new(), Vec::new());
        for (object, part, runs) in files {
            let path = match part.codec {
                Codec::None => self.store.local_path(&object)?,
                _ => None,
            };
            let file = FileRead {
                object: Arc::from(object.as_str()),
                map: Arc::new(BlockMap::new(&part)),
                part,
                runs,
                dest: dest.clone(),
            };
            match path {
                Some(path) => local.push((file, path)),
                None => remote.push(file),
            }
        }
        let mut tallies = Vec::new();
        if !local.is_empty() {
            let config = &self.config;
            tallies.extend(in_this_poll(|| {
                on_threads(local, config.file_concurrency, |(file, path)| {
                    file.read_local(&path, config)
                })
            })?);
        }
        let dest = &dest;
        let remote: Vec<Tally> = futures::stream::iter(remote)
            .map(|file| async move {
                let _ = dest;
                file.read_store(&self.store, &self.config).await
            })
            .buffer_unordered(self.config.file_concurrency.max(1))
            .try_collect()
            .await?;
        tallies.extend(remote);
        for tally in tallies {
            stats.bytes_read += tally.read;
            stats.bytes_verified += tally.verified;
            stats.bytes_copied += tally.copied;
            stats.timings.add(&tally.timings);
        }
        // On its own a load reads exactly the blocks it needs, once.
        stats.bytes_read_from_store = stats.bytes_read;
        stats.unique_bytes = stats.bytes_read;
        Ok(stats)
    }
}

/// Runs `work`, which writes into a load's outputs, to its end within the current
/// poll: through `block_in_place` on a multi-threaded runtime (the runtime moves its
/// other tasks off this worker meanwhile), inline elsewhere.
pub(crate) fn in_this_poll<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// Runs `work` on every item, on at most `threads` scoped threads taking items in
/// order, and returns the results in item order; after a failure no new item starts.
/// Every thread is joined before this returns.
pub(crate) fn on_threads<I: Send, T: Send>(
    items: Vec<I>,
    threads: usize,
    work: impl Fn(I) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let count = items.len();
    let queue = Mutex::new(items.into_iter().enumerate());
    let failed = AtomicBool::new(false);
    let results: Mutex<Vec<(usize, Result<T>)>> = Mutex::new(Vec::with_capacity(count));
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, count.max(1)) {
            scope.spawn(|| {
                loop {
                    if failed.load(Ordering::Acquire) {
                        return;
                    }
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                    let Some((i, item)) = next else { return };
                    let result = work(item);
                    if result.is_err() {
                        failed.store(true, Ordering::Release);
                    }
                    results
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((i, result));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}
