//! Opening a committed checkpoint and the reader's public calls: its manifest and
//! rank parts (each part fetched once and checked), the non-tensor state, `load`
//! and `load_into`; and [`load_latest`], which falls back commit by commit when the
//! newest turns out to be corrupt.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use ckpt_storage::Store;
use futures::{StreamExt, TryStreamExt};
use tracing::warn;

use super::CheckpointReader;
use super::plan::check_outputs;
use super::read::{read_again, reads_on_mismatch};
use super::request::{LoadRequest, LoadStats, Loaded, ReadConfig};
use crate::error::{Error, Result};
use crate::format::{Assignments, FormatError, MAX_PART_BYTES, Manifest, RankPart, StateValue};

impl CheckpointReader {
    /// Opens checkpoint `step`, or when `None` the newest committed one that
    /// `select` accepts (skipping corrupt manifests, and with
    /// [`Select::Healthy`](crate::catalog::Select::Healthy) unhealthy ones, with a
    /// warning each: [`CheckpointReader::skipped`] lists the unhealthy ones).
    pub async fn open_selecting(
        store: &Store,
        step: Option<u64>,
        select: crate::catalog::Select,
    ) -> Result<Self> {
        match step {
            Some(step) => Ok(Self::from_manifest(
                store,
                crate::catalog::read_manifest(store, step).await?,
            )),
            None => {
                let Some((manifest, skipped)) =
                    crate::catalog::latest_selecting(store, select).await?
                else {
                    // Say "healthy" only when something unhealthy was passed over.
                    return Err(Error::NotFound(
                        match crate::catalog::latest(store).await? {
                            Some(newest) if select == crate::catalog::Select::Healthy => {
                                format!(
                                    "no healthy checkpoint in {}: every commit is unhealthy, the newest (step {}) for: {}",
                                    store.url(),
                                    newest.step,
                                    newest.health_status().reasons().join("; ")
                                )
                            }
                            _ => format!("no committed checkpoint in {}", store.url()),
                        },
                    ));
                };
                let mut reader = Self::from_manifest(store, manifest);
                reader.skipped = skipped;
                Ok(reader)
            }
        }
    }

    /// Requests sent through this reader's store handle (and its clones) since it
    /// was opened, by kind: the listing and manifest of the opening included when
    /// the handle was opened for it (see `ckpt_storage::Store::with_own_counter`).
    pub fn store_requests(&self) -> ckpt_storage::RequestCounts {
        self.store.request_counts()
    }

    /// The unhealthy commits passed over to find this one (newest first).
    pub fn skipped(&self) -> &[crate::catalog::Skipped] {
        &self.skipped
    }

    /// Opens checkpoint `step`, or the newest committed one when `None`, healthy or
    /// not (skipping corrupt manifests with a warning).
    pub async fn open(store: &Store, step: Option<u64>) -> Result<Self> {
        let manifest = match step {
            Some(step) => crate::catalog::read_manifest(store, step).await?,
            None => crate::catalog::latest(store).await?.ok_or_else(|| {
                Error::NotFound(format!("no committed checkpoint in {}", store.url()))
            })?,
        };
        Ok(Self::from_manifest(store, manifest))
    }

    /// A reader over an already validated manifest.
    pub fn from_manifest(store: &Store, manifest: Manifest) -> Self {
        Self {
            store: store.clone(),
            manifest: Arc::new(manifest),
            parts: tokio::sync::Mutex::new(HashMap::new()),
            assignments: OnceLock::new(),
            sized: Mutex::new(Default::default()),
            config: ReadConfig::default(),
            skipped: Vec::new(),
        }
    }

    /// Replaces the read tuning.
    pub fn with_read_config(mut self, config: ReadConfig) -> Self {
        self.config = config;
        self
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The read tuning.
    pub fn read_config(&self) -> &ReadConfig {
        &self.config
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// The part of `rank`, fetched once, verified against the manifest's size and
    /// checksum, and checked to describe what the manifest says about the rank
    /// (step, file, sizes, every chunk's dtype, shape and box) before any of it is
    /// used. Its size is compared before it is read, and no more than that size is
    /// read, so a part swollen to gigabytes costs one metadata request.
    pub async fn part(&self, rank: u32) -> Result<Arc<RankPart>> {
        if let Some(part) = self.parts.lock().await.get(&rank) {
            return Ok(part.clone());
        }
        let (key, bytes) = self.fetch_part_bytes(rank).await?;
        let part = Arc::new(self.accept_part(rank, &key, &bytes)?);
        self.parts.lock().await.insert(rank, part.clone());
        Ok(part)
    }

    /// The object key of `rank`'s part.
    pub(super) fn part_key(&self, rank: u32) -> Result<String> {
        let entry = self.manifest.ranks.get(rank as usize).ok_or_else(|| {
            Error::NotFound(format!(
                "rank {rank} is not part of step {} (world size {})",
                self.manifest.step, self.manifest.world_size
            ))
        })?;
        Ok(format!("{}/{}", self.manifest.dir(), entry.part))
    }

    /// `rank`'s part as stored, checked against the manifest's size (before it is
    /// read) and CRC32; read again from a remote store when the checksum fails.
    pub(super) async fn fetch_part_bytes(&self, rank: u32) -> Result<(String, bytes::Bytes)> {
        let key = self.part_key(rank)?;
        let entry = &self.manifest.ranks[rank as usize];
        let missing = |e: ckpt_storage::Error| {
            if e.is_not_found() {
                Error::from(FormatError::new(
                    &key,
                    None,
                    "rank part is missing from a committed checkpoint",
                ))
            } else {
                Error::from(e)
            }
        };
        let size = self.store.head(&key).await.map_err(missing)?.size;
        if size > MAX_PART_BYTES || size != entry.part_bytes {
            return Err(FormatError::new(
                &key,
                Some(size.min(entry.part_bytes)),
                format!("{size} bytes, the manifest says {}", entry.part_bytes),
            )
            .into());
        }
        let mut reads = 0;
        loop {
            let bytes = self
                .store
                .get_range(&key, 0..entry.part_bytes)
                .await
                .map_err(missing)?;
            reads += 1;
            match self.check_part_bytes(rank, &key, &bytes) {
                Ok(()) => return Ok((key, bytes)),
                Err(e) if reads >= reads_on_mismatch(&self.store) => {
                    return Err(read_again(e, reads));
                }
                Err(e) => {
                    warn!(object = %key, error = %e, "a rank part failed its checksum as read from a remote store; reading it again (damaged in flight?)");
                }
            }
        }
    }

    /// Checks `bytes` against the size and CRC32 the manifest records for `rank`'s
    /// part.
    pub(super) fn check_part_bytes(&self, rank: u32, key: &str, bytes: &[u8]) -> Result<()> {
        let entry = self.manifest.ranks.get(rank as usize).ok_or_else(|| {
            Error::from(FormatError::new(
                key,
                None,
                format!("rank {rank} is not in the manifest"),
            ))
        })?;
        if bytes.len() as u64 != entry.part_bytes {
            return Err(FormatError::new(
                key,
                Some((bytes.len() as u64).min(entry.part_bytes)),
                format!(
                    "{} bytes, the manifest says {}",
                    bytes.len(),
                    entry.part_bytes
                ),
            )
            .into());
        }
        let crc = crc32fast::hash(bytes);
        if crc != entry.part_crc32 {
            return Err(FormatError::new(
                key,
                Some(0),
                format!(
                    "crc32 {crc:08x}, the manifest says {:08x}",
                    entry.part_crc32
                ),
            )
            .into());
        }
        Ok(())
    }

    /// Parses `rank`'s part (its bytes checked by [`Self::check_part_bytes`]) and
    /// checks that it describes what the manifest says about the rank.
    pub(super) fn accept_part(&self, rank: u32, key: &str, bytes: &[u8]) -> Result<RankPart> {
        let part = RankPart::parse(bytes, key)?;
        self.assignments
            .get_or_init(|| Assignments::new(&self.manifest))
            .check_part(&self.manifest, rank, &part, key)?;
        Ok(part)
    }

    /// The global non-tensor state (empty when none was saved).
    pub async fn global_state(&self) -> Result<BTreeMap<String, StateValue>> {
        match self.manifest.global_state_rank {
            Some(rank) => Ok(self
                .part(rank)
                .await?
                .global_state
                .clone()
                .unwrap_or_default()),
            None => Ok(BTreeMap::new()),
        }
    }

    /// Every saved rank's own non-tensor state, by saved rank. After a world-size
    /// change the loader decides how to map them onto its ranks.
    pub async fn rank_states(&self) -> Result<Vec<(u32, BTreeMap<String, StateValue>)>> {
        futures::stream::iter(0..self.manifest.world_size)
            .map(|rank| async move { Ok::<_, Error>((rank, self.part(rank).await?.rank_state.clone())) })
            .buffered(32)
            .try_collect()
            .await
    }

    /// Loads the boxes of `request`, verified, into buffers it allocates.
    ///
    /// The same read path as [`CheckpointReader::load_into`](crate::CheckpointReader::load_into): the data files' sizes
    /// are checked first, then one zero-filled buffer per want is allocated and
    /// loaded in place. A trainer whose parameters already exist should call
    /// `load_into` instead: a fresh buffer costs a page fault per 4 KiB page on
    /// first write, about a fifth of a cold load's time on the machines measured
    /// (`docs/BENCHMARKS.md`).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops the load between batches (reads of local files
    /// run to their end within one poll), and nothing is returned.
    pub async fn load(&self, request: &LoadRequest) -> Result<Loaded> {
        let started = Instant::now();
        let before = self.store.request_counts();
        let plan = self.plan(request).await?;
        let planned = started.elapsed();
        let mut loaded = self.execute(request, plan).await?;
        loaded.stats.timings.plan = planned;
        loaded.stats.store_requests = self.store.request_counts().since(&before);
        Ok(loaded)
    }

    /// Loads the boxes of `request`, verified, into `outputs`: one buffer per want,
    /// in request order, each exactly the want's size in bytes (row-major data of
    /// its box). This is how a trainer resumes into parameters and optimizer moments
    /// it already holds, as PyTorch's distributed checkpoint loads in place.
    ///
    /// The count and sizes of `outputs` are checked against the manifest before any
    /// I/O: a mismatch is [`Error::Invalid`] naming the tensor and both sizes.
    ///
    /// Every byte written into an output belongs to a block whose CRC32 was checked,
    /// and when the load succeeds every byte of every output has been written.
    ///
    /// # On failure
    ///
    /// When the load fails midway (a corrupt block, a storage error) or its future
    /// is dropped, the outputs are partially written: some runs hold new bytes,
    /// possibly the bytes of a block that then failed its check, and others still
    /// hold what was there before. The caller must not use them; load again (an
    /// older checkpoint, say) before training on them.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops the load; whatever it is dropped (or leaked) after,
    /// nothing writes into `outputs` any more: every write happens inside a poll of
    /// the future. On a multi-threaded runtime the reads block the polling worker
    /// through `block_in_place` (the runtime moves its other tasks away); on a
    /// current-thread runtime they block it outright.
    pub async fn load_into(
        &self,
        request: &LoadRequest,
        outputs: &mut [&mut [u8]],
    ) -> Result<LoadStats> {
        self.check_outputs_of(request, outputs)?;
        let started = Instant::now();
        let before = self.store.request_counts();
        let plan = self.plan(request).await?;
        let planned = started.elapsed();
        let mut stats = self.execute_into(request, plan, outputs).await?;
        stats.timings.plan = planned;
        stats.store_requests = self.store.request_counts().since(&before);
        Ok(stats)
    }

    /// Checks the count and sizes of `outputs` against `request`'s wants, as the
    /// manifest describes them (no I/O): the first check of a load in place.
    pub(crate) fn check_outputs_of(
        &self,
        request: &LoadRequest,
        outputs: &[&mut [u8]],
    ) -> Result<()> {
        let sizes = request
            .wants
            .iter()
            .map(|want| self.check_want(want).map(|(_, bytes)| bytes))
            .collect::<Result<Vec<u64>>>()?;
        check_outputs(request, &sizes, outputs)
    }
}

/// Loads from the newest committed checkpoint that is not judged unhealthy (see
/// [`crate::catalog::Select::Healthy`]; each one passed over is warned about); when
/// it turns out to be corrupt (a checksum mismatch, a missing or truncated file),
/// warns and tries the one before, down to the oldest. Commit records that name no commit are skipped, as every
/// command skips them (see [`crate::catalog::names_a_commit`]). `request` builds the
/// request from the manifest found.
pub async fn load_latest(
    store: &Store,
    request: impl Fn(&Manifest) -> LoadRequest,
) -> Result<(CheckpointReader, Loaded)> {
    load_latest_selecting(store, crate::catalog::Select::Healthy, request).await
}

/// [`load_latest`], accepting what `select` accepts.
pub async fn load_latest_selecting(
    store: &Store,
    select: crate::catalog::Select,
    request: impl Fn(&Manifest) -> LoadRequest,
) -> Result<(CheckpointReader, Loaded)> {
    let mut skipped = Vec::new();
    let mut walk = crate::catalog::NewestFirst::new(store).await?;
    let mut last_error = None;
    while let Some(commit) = walk.next().await? {
        let attempt = async {
            let manifest = crate::catalog::read_commit(store, &commit).await?;
            if let Some(passed) = crate::catalog::passes(&manifest, select) {
                return Ok(Err(passed));
            }
            let reader = CheckpointReader::from_manifest(store, manifest);
            let loaded = reader.load(&request(reader.manifest())).await?;
            Ok::<_, Error>(Ok((reader, loaded)))
        };
        match attempt.await {
            Ok(Ok((mut reader, loaded))) => {
                reader.skipped = skipped;
                return Ok((reader, loaded));
            }
            Ok(Err(passed)) => skipped.push(passed),
            Err(e) if e.is_corruption() => {
                warn!(step = commit.step, dir = %commit.dir, error = %e, "checkpoint is corrupt; falling back to the previous commit");
                last_error = Some(e);
            }
            Err(e @ Error::NotFound(_))
                if !crate::catalog::names_a_commit(store, &commit).await? =>
            {
                warn!(step = commit.step, dir = %commit.dir, error = %e, "skipping a commit record that names no commit");
            }
            Err(e) => return Err(e),
        }
    }
    Err(last_error.unwrap_or_else(|| {
        Error::NotFound(match skipped.first() {
            Some(newest) => format!(
                "no healthy checkpoint in {}: passed over {} unhealthy, the newest {newest}",
                store.url(),
                skipped.len()
            ),
            None => format!("no committed checkpoint in {}", store.url()),
        })
    }))
}
