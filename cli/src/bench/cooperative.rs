//! A cooperative resume at scale, simulated: how many requests reach the store when N
//! ranks load a synthetic checkpoint each on their own, and when they load it
//! together (one rank lists and shares the metadata, each byte read by one owner).
//!
//! The checkpoint is the metadata-scale one (parts and manifest in a private memory
//! store, no data files), so the data reads are counted, not made: the batches a
//! plain load of a rank's plan would send (its plan read by itself, as a one-rank
//! cooperative load: the same batching as the reader's) and each owner's
//! [`Cooperative::planned_reads`] for the union of what it was asked. Everything
//! else is run: every plain plan on a store handle of its own that counts its
//! requests, rank 0's `open` and `share` on another, and every rank's `plan`,
//! `cooperate` and `asks` on the reader the others open from rank 0's bytes.
//!
//! Ranks that want the same boxes (the replicas of a shard) make the same plan and
//! the same requests, so each set of them is planned once, by its first rank, and
//! counted as many times as it has ranks: at 16,384 DDP ranks the asks are 16,384²
//! entries, which the simulation need not hold to count what the owners read.

use std::ops::AddAssign;

use ckpt::load::Cooperative;
use ckpt::storage::RequestCounts;

use super::*;

/// How the checkpoint was saved and what each loading rank asks of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Layout {
    /// As many saving ranks as loading ranks, each loading its own dim-0 shard.
    Fsdp,
    /// `replicas` replicas of `ranks / replicas` shards: replica 0 saved, loading
    /// rank `r` wants shard `r % shards`.
    Hsdp,
    /// One saving rank (the replica that writes under DDP); every loading rank
    /// wants the whole model.
    Ddp,
}

impl Layout {
    /// Its name in the JSON report.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Fsdp => "fsdp",
            Self::Hsdp => "hsdp",
            Self::Ddp => "ddp",
        }
    }
}

/// Store requests by kind, as the JSON reports spell them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Requests {
    #[serde(rename = "LIST")]
    pub list: u64,
    #[serde(rename = "GET")]
    pub get: u64,
    #[serde(rename = "HEAD")]
    pub head: u64,
}

impl From<RequestCounts> for Requests {
    fn from(c: RequestCounts) -> Self {
        Self {
            list: c.list,
            get: c.get,
            head: c.head,
        }
    }
}

impl AddAssign for Requests {
    fn add_assign(&mut self, other: Self) {
        self.list += other.list;
        self.get += other.get;
        self.head += other.head;
    }
}

impl Requests {
    fn times(self, n: u64) -> Self {
        Self {
            list: self.list * n,
            get: self.get * n,
            head: self.head * n,
        }
    }
}

/// A load's store counters, summed over its ranks (the keys of a load in the JSON
/// report).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(crate) struct LoadCounters {
    /// Bytes of data files read from the store (as stored).
    pub bytes_read_from_store: u64,
    /// Bytes received from other ranks.
    pub bytes_received_from_peers: u64,
    /// Requests sent to the store, by kind, opening the checkpoint included.
    pub store_requests: Requests,
    /// The checkpoint's bytes needed, as the ranks report them.
    pub unique_bytes: u64,
}

impl AddAssign for LoadCounters {
    fn add_assign(&mut self, other: Self) {
        self.bytes_read_from_store += other.bytes_read_from_store;
        self.bytes_received_from_peers += other.bytes_received_from_peers;
        self.store_requests += other.store_requests;
        self.unique_bytes += other.unique_bytes;
    }
}

/// What one way of loading sends to the store, summed over the job.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct JobLoad {
    /// Requests by kind, every rank's summed.
    pub store_requests: Requests,
    /// Bytes of data files read from the store (as stored).
    pub data_bytes: u64,
    /// Bytes of the manifest and rank parts read from the store.
    pub metadata_bytes: u64,
    /// Time of one rank's planning, ms: median over the ranks timed.
    pub plan_ms_median: f64,
    /// The same, the slowest rank timed.
    pub plan_ms_max: f64,
}

/// One cooperative-scale run: a layout at a number of loading ranks.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CoopScaleReport {
    /// Loading ranks (simulated).
    pub ranks: usize,
    /// The checkpoint's layout.
    pub layout: Layout,
    /// Replicas of every shard (1 under FSDP, `ranks` under DDP).
    pub replicas: usize,
    /// Saving ranks: data files and rank parts.
    pub saved_ranks: usize,
    /// Tensors.
    pub tensors: usize,
    /// Bytes of `manifest.json`.
    pub manifest_bytes: u64,
    /// Requests of opening the checkpoint (the commit log and the manifest), once.
    pub open_requests: Requests,
    /// Bytes of every rank part.
    pub parts_bytes: u64,
    /// Every rank opening and planning on its own (plan: `open` + `plan`).
    pub plain: JobLoad,
    /// Together (plan: `plan` + `cooperate` + `asks`, on the reader opened from
    /// rank 0's shared bytes; `open_shared_ms` and rank 0's `share_ms` on top).
    pub cooperative: JobLoad,
    /// Stored bytes of the blocks the job needs, each counted once (the owners'
    /// unions, summed).
    pub unique_bytes: u64,
    /// Bytes rank 0 shares with the others (manifest and every part).
    pub shared_bytes: u64,
    /// Rank 0's `open` and `share`, ms.
    pub share_ms: f64,
    /// Opening the checkpoint from the shared bytes (every other rank, once), ms.
    pub open_shared_ms: f64,
    /// Entries of the all-to-all's requests: (asking rank, owner) pairs with
    /// something asked.
    pub peer_messages: u64,
    /// Ranks whose planning was timed (the first rank of each set of replicas, up to
    /// a sample spread over them).
    pub ranks_timed: usize,
    /// The whole simulation, s.
    pub simulated_s: f64,
}

/// Loading ranks whose plans are timed at most (their counts are all taken).
const TIMED_RANKS: usize = 256;

/// The layouts `ckpt bench --coop-ranks` runs: FSDP, HSDP with `replicas`
/// replicas (when they divide the ranks and are above 1), DDP.
pub(super) fn layouts(ranks: usize, replicas: usize) -> Vec<(Layout, usize)> {
    let mut out = vec![(Layout::Fsdp, 1)];
    if replicas > 1 && replicas < ranks && ranks.is_multiple_of(replicas) {
        out.push((Layout::Hsdp, replicas));
    }
    out.push((Layout::Ddp, ranks));
    out
}

/// Simulates `ranks` ranks loading a synthetic checkpoint of `tensors` tensors in
/// `layout` with `replicas` replicas of every shard, plainly and cooperatively, and
/// counts what each sends to the store.
pub(super) async fn coop_scale(
    ranks: usize,
    layout: Layout,
    replicas: usize,
    tensors: usize,
    block: u64,
    progress: &dyn Fn(&str),
) -> Result<CoopScaleReport> {
    let started = Instant::now();
    let (saved_ranks, replicas) = match layout {
        Layout::Fsdp => (ranks, 1),
        Layout::Hsdp => (ranks / replicas.max(1), replicas.max(1)),
        Layout::Ddp => (1, ranks),
    };
    if ranks == 0 || saved_ranks * replicas != ranks {
        return Err(invalid(format!(
            "cooperative scale: {replicas} replicas do not divide {ranks} ranks"
        )));
    }
    let label = format!("{ranks} ranks, {}", layout.name());
    progress(&format!(
        "cooperative scale: {label}: writing {saved_ranks} parts of {tensors} tensors"
    ));
    let store = private_memory_store("coop")?;
    let synthetic = write_synthetic(&store, tensors, saved_ranks, block).await?;
    // The shard a loading rank wants is its set of replicas; the first rank of each
    // set (shard s: rank s) plans for all of them.
    let shards = saved_ranks;
    let request_of = |manifest: &ckpt::format::Manifest, shard: usize| match layout {
        Layout::Ddp => LoadRequest::everything(manifest),
        _ => LoadRequest::dim0_shards(manifest, shard, shards),
    };
    let every = shards.div_ceil(TIMED_RANKS).max(1);
    let timed = |shard: usize| shard.is_multiple_of(every);

    // What opening the checkpoint costs a rank (the same on every rank).
    let opener = store.with_own_counter();
    let t = Instant::now();
    let reader = CheckpointReader::open(&opener, Some(synthetic.step)).await?;
    let mut open_ms = vec![ms(t.elapsed())];
    let open_requests = Requests::from(opener.request_counts());
    for _ in 0..2 {
        let t = Instant::now();
        CheckpointReader::open(&store, Some(synthetic.step)).await?;
        open_ms.push(ms(t.elapsed()));
    }
    let open_ms = median(&open_ms);
    let manifest = reader.manifest().clone();
    drop(reader);

    // Rank 0 of the cooperative load: open and share, on a handle of its own.
    progress(&format!(
        "cooperative scale: {label}: rank 0 opens and shares"
    ));
    let sharer = store.with_own_counter();
    let t = Instant::now();
    let shared = CheckpointReader::open(&sharer, Some(synthetic.step))
        .await?
        .share()
        .await?;
    let share_ms = ms(t.elapsed());
    let share_requests = Requests::from(sharer.request_counts());
    let t = Instant::now();
    let together = CheckpointReader::from_shared(&store, &shared)?;
    let open_shared_ms = ms(t.elapsed());
    let parts_bytes: u64 = manifest.ranks.iter().map(|r| r.part_bytes).sum();

    // Plain: every rank lists, reads the manifest, fetches the parts its boxes
    // touch and reads its blocks.
    progress(&format!("cooperative scale: {label}: plain loads"));
    let mut plain = JobLoad {
        store_requests: open_requests.times(ranks as u64),
        metadata_bytes: synthetic.manifest_bytes * ranks as u64,
        ..JobLoad::default()
    };
    let mut plain_ms = Vec::new();
    for shard in 0..shards {
        let own = store.with_own_counter();
        let alone = CheckpointReader::from_manifest(&own, manifest.clone());
        let t = Instant::now();
        let plan = alone.plan(&request_of(&manifest, shard)).await?;
        if timed(shard) {
            plain_ms.push(open_ms + ms(t.elapsed()));
        }
        let metadata = plan.parts_read() as u64 * parts_bytes / saved_ranks as u64;
        // The plan's data reads: its own blocks, batched as the reader batches them.
        let (gets, bytes) = together
            .cooperate(plan, 0, 1)?
            .planned_reads(&[&[]])
            .map_err(|e| named(e, shard))?;
        let mut requests = Requests::from(own.request_counts());
        requests.get += gets;
        let n = replicas as u64;
        plain.store_requests += requests.times(n);
        plain.metadata_bytes += metadata * n;
        plain.data_bytes += bytes * n;
    }
    plain.plan_ms_median = median(&plain_ms);
    plain.plan_ms_max = max(&plain_ms);

    // Cooperative: every set's plan, cooperate and asks; what each owner is asked.
    progress(&format!(
        "cooperative scale: {label}: cooperative plans and asks"
    ));
    let mut asked_of: Vec<Vec<(u32, Vec<u8>)>> = vec![Vec::new(); ranks];
    let mut coop_ms = Vec::new();
    let mut peer_messages = 0u64;
    for shard in 0..shards {
        let t = Instant::now();
        let plan = together.plan(&request_of(&manifest, shard)).await?;
        let coop = together.cooperate(plan, shard, ranks)?;
        let asks = coop.asks();
        if timed(shard) {
            coop_ms.push(ms(t.elapsed()));
        }
        drop(coop);
        let mut asked_of_shard = 0u64;
        for (owner, ask) in asks.into_iter().enumerate() {
            if !ask.is_empty() {
                asked_of_shard += 1;
                asked_of[owner].push((shard as u32, ask));
            }
        }
        // Every replica asks the same owners (none asks itself: a pair or so less).
        peer_messages += asked_of_shard * replicas as u64;
    }
    progress(&format!("cooperative scale: {label}: the owners' reads"));
    let mut cooperative = JobLoad {
        store_requests: share_requests,
        metadata_bytes: synthetic.manifest_bytes + parts_bytes,
        plan_ms_median: median(&coop_ms),
        plan_ms_max: max(&coop_ms),
        ..JobLoad::default()
    };
    let empty: &[u8] = &[];
    let mut asked: Vec<&[u8]> = vec![empty; ranks];
    for (owner, asks) in asked_of.iter().enumerate() {
        let plan = together
            .plan(&request_of(&manifest, owner % shards))
            .await?;
        let coop: Cooperative = together.cooperate(plan, owner, ranks)?;
        for (from, ask) in asks {
            // An owner's own set needs no message: its own needs stand for it.
            if *from as usize != owner {
                asked[*from as usize] = ask;
            }
        }
        let (gets, bytes) = coop.planned_reads(&asked).map_err(|e| named(e, owner))?;
        for (from, _) in asks {
            asked[*from as usize] = empty;
        }
        cooperative.store_requests.get += gets;
        cooperative.data_bytes += bytes;
    }
    let unique_bytes = cooperative.data_bytes;
    store.delete_prefix(&synthetic.dir).await?;
    Ok(CoopScaleReport {
        ranks,
        layout,
        replicas,
        saved_ranks,
        tensors,
        manifest_bytes: synthetic.manifest_bytes,
        open_requests,
        parts_bytes,
        plain,
        cooperative,
        unique_bytes,
        shared_bytes: shared.len() as u64,
        share_ms,
        open_shared_ms,
        peer_messages,
        ranks_timed: coop_ms.len(),
        simulated_s: started.elapsed().as_secs_f64(),
    })
}

/// `e`, naming the simulated rank it happened on.
fn named(e: Error, rank: usize) -> Error {
    Error::Failed(format!("cooperative scale: simulated rank {rank}: {e}"))
}
