//! The etcd client side: [`EtcdControlPlane`] (one per rank) and [`EtcdJob`] (a
//! launcher's handle: the job's settings, the ranks' leases, the generations seen).
//!
//! Both mirror the job's keys through one watch (a full read at revision R, then a
//! watch from R + 1, again after every break), so that every blocking call waits on
//! local state with a condition variable and etcd sees no polling. Calls run on a
//! small runtime of their own and are each bounded by
//! [`EtcdSettings::request_timeout`].

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, EventType, GetOptions, KeyValue,
    LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp, WatchOptions,
};
use tracing::{debug, info, warn};

use super::EtcdUrl;
use super::rules::{self, GenRecord, GenState, JobConfig, Live, MemberRecord, Timers};
use crate::cancel::{Waker, wait_on};
use crate::{
    Assignment, Cancel, ControlPlane, CoordinatorConfig, Directive, ElasticError, Event, JobOver,
    Member, Progress, Report,
};

/// Generation records remembered per generation number (for late directives).
const MAX_HISTORY: usize = 8;
/// Bootstrap keys mirrored at most (newest generations win).
const MAX_KEYS: usize = 4096;
/// A key or value longer than this is refused (they are addresses and small JSON).
const MAX_VALUE: usize = 64 * 1024;
/// How often the rules are evaluated without a change (for their time windows).
const TICK: Duration = Duration::from_millis(20);
/// Events kept for [`EtcdJob::events`].
const MAX_EVENTS: usize = 4096;

/// How the backend talks to etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdSettings {
    /// How long connecting waits for etcd and the job's settings (30 s).
    pub connect_timeout: Duration,
    /// Bound on one request (3 s): longer than an etcd leader election.
    pub request_timeout: Duration,
}

impl Default for EtcdSettings {
    fn default() -> Self {
        EtcdSettings {
            connect_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(3),
        }
    }
}

/// The job's key names.
#[derive(Debug, Clone)]
struct Keys {
    root: String,
}

impl Keys {
    fn config(&self) -> String {
        format!("{}config", self.root)
    }
    fn generation(&self) -> String {
        format!("{}generation", self.root)
    }
    fn member(&self, id: &str) -> String {
        format!("{}members/{id}", self.root)
    }
    fn kv_of(&self, generation: u64) -> String {
        format!("{}g/{generation:020}/", self.root)
    }
}

/// What this process knows of the job's keys.
#[derive(Default)]
struct Mirror {
    /// Revision up to which events were applied.
    revision: i64,
    /// A watch runs (else the mirror may be behind).
    synced: bool,
    current: Option<GenRecord>,
    gen_revision: i64,
    history: BTreeMap<u64, GenRecord>,
    members: BTreeMap<String, Live>,
    kv: BTreeMap<(u64, String), String>,
    config: Option<JobConfig>,
    events: Vec<Event>,
    /// Bumped on every change (the rules task's wake-up).
    changes: u64,
}

impl Mirror {
    fn current(&self) -> GenRecord {
        self.current.clone().unwrap_or_else(GenRecord::none)
    }

    fn set_gen(&mut self, record: GenRecord, revision: i64) {
        if revision <= self.gen_revision {
            return;
        }
        let previous = self.current();
        let at = SystemTime::now();
        match &record.state {
            GenState::Running { .. }
                if record.generation != previous.generation || !previous.is_running() =>
            {
                self.push(Event::Formed {
                    generation: record.generation,
                    members: record.members.iter().map(|m| m.id.clone()).collect(),
                    cause: record.cause.clone(),
                    adopted: false,
                    at,
                });
            }
            GenState::Ended { cause, .. }
                if previous.is_running() || previous.generation != record.generation =>
            {
                self.push(Event::Ended {
                    generation: record.generation,
                    cause: cause.clone(),
                    at,
                });
            }
            GenState::Shutdown { reason }
                if !matches!(previous.state, GenState::Shutdown { .. }) =>
            {
                self.push(Event::Shutdown {
                    reason: reason.clone(),
                    at,
                });
            }
            _ => {}
        }
        self.history.insert(record.generation, record.clone());
        while self.history.len() > MAX_HISTORY {
            self.history.pop_first();
        }
        self.current = Some(record);
        self.gen_revision = revision;
    }

    fn push(&mut self, event: Event) {
        if self.events.len() >= MAX_EVENTS {
            self.events.remove(0);
        }
        self.events.push(event);
    }

    /// Folds one key's new value (`None`: deleted) into the mirror.
    fn apply(&mut self, keys: &Keys, key: &str, value: Option<&[u8]>, revision: i64) {
        self.changes += 1;
        let Some(name) = key.strip_prefix(&keys.root) else {
            return;
        };
        let parse = |what: &str| -> Option<serde_json::Value> {
            let value = value?;
            match serde_json::from_slice(value) {
                Ok(v) => Some(v),
                Err(e) => {
                    warn!(key, error = %e, "unreadable {what} in etcd; ignored");
                    None
                }
            }
        };
        if name == "generation" {
            if let Some(v) = parse("generation record") {
                match serde_json::from_value::<GenRecord>(v) {
                    Ok(record) => self.set_gen(record, revision),
                    Err(e) => {
                        warn!(key, error = %e, "unreadable generation record; ignored");
                        self.gen_revision = self.gen_revision.max(revision);
                    }
                }
            } else if value.is_some() {
                // Not obeyed, but its revision is taken, so that the next proposal
                // replaces it instead of failing its comparison forever.
                self.gen_revision = self.gen_revision.max(revision);
            }
        } else if name == "config" {
            if let Some(v) = parse("job settings") {
                self.config = serde_json::from_value(v).ok();
            }
        } else if let Some(id) = name.strip_prefix("members/") {
            match value {
                None => {
                    self.members.remove(id);
                }
                Some(_) => {
                    let record = parse("member record")
                        .and_then(|v| serde_json::from_value::<MemberRecord>(v).ok());
                    match record {
                        Some(record) if record.member.id == id => {
                            self.members
                                .insert(id.to_owned(), Live { record, revision });
                        }
                        _ => warn!(key, "member record that does not name its key; ignored"),
                    }
                }
            }
        } else if let Some(rest) = name.strip_prefix("g/")
            && let Some((generation, kv_key)) = rest.split_once('/')
            && let Ok(generation) = generation.parse::<u64>()
        {
            let entry = (generation, kv_key.to_owned());
            match value.map(|v| String::from_utf8_lossy(v).into_owned()) {
                Some(v) => {
                    self.kv.insert(entry, v);
                    while self.kv.len() > MAX_KEYS {
                        self.kv.pop_first();
                    }
                }
                None => {
                    self.kv.remove(&entry);
                }
            }
        }
    }
}

/// What an [`EtcdControlPlane`] and an [`EtcdJob`] share: the client, its runtime,
/// the mirror.
struct Core {
    handle: tokio::runtime::Handle,
    client: Client,
    keys: Keys,
    settings: EtcdSettings,
    mirror: Mutex<Mirror>,
    changed: Condvar,
    /// Wakes the rules task on a change.
    notify: tokio::sync::Notify,
    closing: AtomicBool,
    /// Requests sent to etcd (watch and keep-alive messages included).
    requests: AtomicU64,
}

/// The request did not reach a serving member: the endpoint refused the connection
/// or answered `Unavailable` (gRPC code 14).
fn unreachable_endpoint(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(status) => i32::from(status.code()) == 14,
        _ => false,
    }
}

fn io(what: &str, e: impl std::fmt::Display) -> ElasticError {
    ElasticError::Io(format!("etcd {what}: {e}"))
}

impl Core {
    /// Connects; the runtime returned runs the client and must outlive the core's
    /// use (its owner shuts it down on drop, which ends the background tasks).
    fn connect(
        url: &EtcdUrl,
        job: &str,
        settings: EtcdSettings,
    ) -> Result<(Arc<Core>, Runtime), ElasticError> {
        let root = url.root(job).map_err(ElasticError::Rejected)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ckpt-etcd")
            .enable_all()
            .build()
            .map_err(|e| io("runtime", e))?;
        let options = ConnectOptions::new()
            .with_connect_timeout(settings.request_timeout)
            .with_timeout(settings.request_timeout)
            // HTTP/2 pings find a dead connection; etcd closes connections that
            // ping more often than every 5 s (--grpc-keepalive-min-time).
            .with_keep_alive(Duration::from_secs(10), settings.request_timeout)
            .with_require_leader(true);
        let endpoints = url.endpoints.clone();
        let what = format!("connect to {url}");
        let client = block(runtime.handle(), async move {
            Client::connect(endpoints, Some(options))
                .await
                .map_err(|e| io(&what, e))
        })?;
        let core = Arc::new(Core {
            handle: runtime.handle().clone(),
            client,
            keys: Keys { root },
            settings,
            mirror: Mutex::new(Mirror::default()),
            changed: Condvar::new(),
            notify: tokio::sync::Notify::new(),
            closing: AtomicBool::new(false),
            requests: AtomicU64::new(0),
        });
        Ok((core, Runtime(Some(runtime))))
    }

    fn lock(&self) -> MutexGuard<'_, Mirror> {
        self.mirror.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn changed(&self) {
        self.changed.notify_all();
        self.notify.notify_waiters();
    }

    /// Runs `future` on the runtime and waits for it.
    fn call<T: Send + 'static>(
        &self,
        future: impl Future<Output = Result<T, ElasticError>> + Send + 'static,
    ) -> Result<T, ElasticError> {
        block(&self.handle, future)
    }

    /// One request, counted and bounded.
    async fn request<T>(
        &self,
        what: &str,
        future: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, ElasticError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        match tokio::time::timeout(self.settings.request_timeout, future).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(io(what, e)),
            Err(_) => Err(io(
                what,
                format!(
                    "no answer within {} ms",
                    self.settings.request_timeout.as_millis()
                ),
            )),
        }
    }

    /// One request, retried on another endpoint while the one it reached is down.
    ///
    /// The client balances requests over every endpoint of the URL but keeps a dead
    /// member's endpoint in its rotation, so a request can land on a member that is
    /// down (connection refused, `Unavailable`) while the other two serve a quorum.
    /// Such a request never reached etcd: it is sent again, within the request
    /// timeout. Every request retried here is safe to repeat: reads, puts of the
    /// same value, and transactions guarded by a comparison (a repeat of one that
    /// took effect fails its comparison, which callers treat as a lost race).
    async fn request_any<T, F, Fut>(&self, what: &str, mut make: F) -> Result<T, ElasticError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let started = tokio::time::Instant::now();
        let deadline = started + self.settings.request_timeout;
        // A request routed to a member that just died can also hang rather than
        // fail (its connection is not known dead yet): each attempt gets a third of
        // the budget, so that two more can go elsewhere.
        let attempt_limit = (self.settings.request_timeout / 3).max(Duration::from_millis(300));
        let mut pause = Duration::from_millis(20);
        loop {
            self.requests.fetch_add(1, Ordering::Relaxed);
            let limit = deadline.min(tokio::time::Instant::now() + attempt_limit);
            let error = match tokio::time::timeout_at(limit, make(self.client.clone())).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) if unreachable_endpoint(&e) => e.to_string(),
                Ok(Err(e)) => return Err(io(what, e)),
                Err(_) => format!(
                    "no answer within {} ms",
                    limit.duration_since(started).as_millis()
                ),
            };
            if tokio::time::Instant::now() + pause >= deadline {
                return Err(io(what, error));
            }
            debug!(error = %error, "etcd {what}: no answer from the endpoint reached; trying again");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// Reads every key of the job and replaces the mirror; returns the revision.
    async fn resync(&self) -> Result<i64, ElasticError> {
        let root = self.keys.root.clone();
        let response = self
            .request_any("read", |mut client| {
                let root = root.clone();
                async move {
                    client
                        .get(root, Some(GetOptions::new().with_prefix()))
                        .await
                }
            })
            .await?;
        let revision = response.header().map(|h| h.revision()).unwrap_or(0);
        let mut mirror = self.lock();
        let events = std::mem::take(&mut mirror.events);
        let gen_before = (mirror.current.clone(), ());
        let history = std::mem::take(&mut mirror.history);
        *mirror = Mirror {
            events,
            history,
            ..Mirror::default()
        };
        // Keep the generation's transitions continuous for the events.
        if let (Some(current), _) = gen_before {
            mirror.current = Some(current);
        }
        for kv in response.kvs() {
            apply_kv(&mut mirror, &self.keys, kv, false);
        }
        mirror.revision = revision;
        drop(mirror);
        self.changed();
        Ok(revision)
    }

    /// Keeps the mirror in step: a full read, then a watch from the next revision;
    /// again, with backoff, after every break.
    async fn follow(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(50);
        let mut failing = false;
        while !self.closing.load(Ordering::Relaxed) {
            let started = Instant::now();
            let result = self.follow_once().await;
            if started.elapsed() > Duration::from_secs(5) {
                // It worked for a while: a new break is news, and retried quickly.
                failing = false;
                backoff = Duration::from_millis(50);
            }
            if let Err(e) = result {
                if !failing {
                    warn!(error = %e, "etcd watch broken; re-reading and watching again");
                }
                failing = true;
            }
            {
                let mut mirror = self.lock();
                mirror.synced = false;
            }
            self.changed();
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    async fn follow_once(&self) -> Result<(), ElasticError> {
        let revision = self.resync().await?;
        let mut client = self.client.clone();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut stream = self
            .request("watch", client.watch(self.keys.root.clone(), Some(options)))
            .await?;
        {
            let mut mirror = self.lock();
            mirror.synced = true;
        }
        self.changed();
        debug!(revision, "etcd watch established");
        loop {
            let message = stream.message().await.map_err(|e| io("watch", e))?;
            let Some(response) = message else {
                return Err(io("watch", "stream ended"));
            };
            if response.canceled() {
                return Err(io(
                    "watch",
                    format!("cancelled: {}", response.cancel_reason()),
                ));
            }
            let mut mirror = self.lock();
            for event in response.events() {
                if let Some(kv) = event.kv() {
                    apply_kv(
                        &mut mirror,
                        &self.keys,
                        kv,
                        event.event_type() == EventType::Delete,
                    );
                }
            }
            if let Some(header) = response.header() {
                mirror.revision = mirror.revision.max(header.revision());
            }
            drop(mirror);
            self.changed();
        }
    }

    /// Waits on the mirror until `done` gives a result, `cancel` fires or
    /// `deadline` passes (then `on_timeout`).
    fn wait<T>(
        self: &Arc<Self>,
        cancel: Option<&Cancel>,
        deadline: Option<Instant>,
        mut done: impl FnMut(&Mirror) -> Option<Result<T, ElasticError>>,
        on_timeout: impl FnOnce() -> Result<T, ElasticError>,
    ) -> Result<T, ElasticError> {
        let cancel = cancel.map(|cancel| {
            let core = self.clone();
            let wake: Waker = Box::new(move || {
                let _lock = core.lock();
                core.changed.notify_all();
            });
            (cancel, wake)
        });
        wait_on(
            &self.mirror,
            &self.changed,
            cancel,
            deadline,
            Duration::from_millis(500),
            |mirror, _| done(mirror),
            on_timeout,
        )
    }

    /// Writes `next` as the generation record if the record is still at `revision`
    /// (0: absent). Also deletes the bootstrap keys of generations before the
    /// previous one. Returns whether this write won.
    async fn swap(&self, revision: i64, next: &GenRecord) -> Result<bool, ElasticError> {
        let key = self.keys.generation();
        let compare = if revision == 0 {
            Compare::create_revision(key.clone(), CompareOp::Equal, 0)
        } else {
            Compare::mod_revision(key.clone(), CompareOp::Equal, revision)
        };
        let value = serde_json::to_vec(next).map_err(|e| io("encode", e))?;
        let mut ops = vec![TxnOp::put(key, value, None)];
        if next.generation >= 2 {
            ops.push(TxnOp::delete(
                self.keys.kv_of(0),
                Some(DeleteOptions::new().with_range(self.keys.kv_of(next.generation - 1))),
            ));
        }
        let txn = Txn::new().when(vec![compare]).and_then(ops);
        let response = self
            .request_any("transaction", |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await?;
        if response.succeeded() {
            let at = response.header().map(|h| h.revision()).unwrap_or(0);
            let mut mirror = self.lock();
            mirror.set_gen(next.clone(), at);
            mirror.changes += 1;
            drop(mirror);
            self.changed();
        }
        Ok(response.succeeded())
    }

    /// Re-reads the generation record alone (after a lost comparison).
    async fn reread_generation(&self) -> Result<(), ElasticError> {
        let key = self.keys.generation();
        let response = self
            .request_any("read", |mut client| {
                let key = key.clone();
                async move { client.get(key, None).await }
            })
            .await?;
        let mut mirror = self.lock();
        for kv in response.kvs() {
            apply_kv(&mut mirror, &self.keys, kv, false);
        }
        Ok(())
    }

    /// Applies `change` to the newest generation record until a write wins or
    /// `change` has nothing to do; true when this call changed the record.
    async fn transition(
        &self,
        change: impl Fn(&Mirror) -> Option<GenRecord>,
    ) -> Result<bool, ElasticError> {
        for _ in 0..16 {
            let (next, revision) = {
                let mirror = self.lock();
                (change(&mirror), mirror.gen_revision)
            };
            let Some(next) = next else {
                return Ok(false);
            };
            if self.swap(revision, &next).await? {
                return Ok(true);
            }
            self.reread_generation().await?;
        }
        Err(ElasticError::Io(
            "the generation record kept changing under 16 attempts".into(),
        ))
    }
}

/// Runs `future` on `handle` and waits for its result, from any thread that is not
/// one of the runtime's own (also from inside another runtime).
fn block<T: Send + 'static>(
    handle: &tokio::runtime::Handle,
    future: impl Future<Output = Result<T, ElasticError>> + Send + 'static,
) -> Result<T, ElasticError> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let _ = tx.send(future.await);
    });
    rx.recv()
        .unwrap_or_else(|_| Err(ElasticError::Io("the etcd client is shutting down".into())))
}

/// The client's runtime: shut down (ending the background tasks) when its owner is
/// dropped.
struct Runtime(Option<tokio::runtime::Runtime>);

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

fn apply_kv(mirror: &mut Mirror, keys: &Keys, kv: &KeyValue, deleted: bool) {
    let Ok(key) = kv.key_str() else {
        return;
    };
    if kv.value().len() > MAX_VALUE {
        warn!(
            key,
            bytes = kv.value().len(),
            "oversized value in etcd; ignored"
        );
        return;
    }
    let value = (!deleted).then(|| kv.value());
    mirror.apply(keys, key, value, kv.mod_revision());
}

impl Drop for Core {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Relaxed);
    }
}

/// Reads the job's settings, publishing `publish` first when none exist. Returns
/// them and whether they were someone else's (different from `publish`).
async fn settings_of(
    core: &Core,
    publish: Option<&JobConfig>,
    deadline: Instant,
) -> Result<(JobConfig, bool), ElasticError> {
    let key = core.keys.config();
    let mut last_error = None;
    while Instant::now() < deadline {
        let attempt = async {
            if let Some(config) = publish {
                let value = serde_json::to_vec(config).map_err(|e| io("encode", e))?;
                let txn = Txn::new()
                    .when(vec![Compare::create_revision(
                        key.clone(),
                        CompareOp::Equal,
                        0,
                    )])
                    .and_then(vec![TxnOp::put(key.clone(), value, None)]);
                if core
                    .request_any("transaction", |mut client| {
                        let txn = txn.clone();
                        async move { client.txn(txn).await }
                    })
                    .await?
                    .succeeded()
                {
                    return Ok(Some((config.clone(), false)));
                }
            }
            let response = core
                .request_any("read", |mut client| {
                    let key = key.clone();
                    async move { client.get(key, None).await }
                })
                .await?;
            match response.kvs().first() {
                None => Ok(None),
                Some(kv) => {
                    let theirs: JobConfig = serde_json::from_slice(kv.value()).map_err(|e| {
                        ElasticError::Rejected(format!(
                            "the job settings at {key} are unreadable: {e}"
                        ))
                    })?;
                    theirs.validate().map_err(|e| {
                        ElasticError::Rejected(format!("the job settings at {key}: {e}"))
                    })?;
                    let differ = publish.is_some_and(|mine| *mine != theirs);
                    Ok(Some((theirs, differ)))
                }
            }
        };
        match attempt.await {
            Ok(Some(found)) => return Ok(found),
            Ok(None) => last_error = Some(format!("no job settings at {key}")),
            Err(ElasticError::Io(e)) => last_error = Some(e),
            Err(e) => return Err(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(match publish {
        None => ElasticError::Rejected(format!(
            "{}; start the ranks with `ckpt-train launch --rdzv etcd://…`, which publishes them",
            last_error.unwrap_or_default()
        )),
        Some(_) => ElasticError::Io(last_error.unwrap_or_default()),
    })
}

/// A launcher's handle on a job kept in etcd: publishes (or adopts) the job's
/// settings, grants and revokes its ranks' leases, and reports the generations it
/// sees as [`Event`]s.
pub struct EtcdJob {
    core: Arc<Core>,
    _runtime: Runtime,
    config: JobConfig,
    adopted: bool,
}

impl EtcdJob {
    /// Connects and publishes `config` as the job's settings unless a launcher
    /// already did (then its settings are used: see [`EtcdJob::adopted`]).
    pub fn connect(
        url: &EtcdUrl,
        config: &CoordinatorConfig,
        settings: EtcdSettings,
    ) -> Result<EtcdJob, ElasticError> {
        config.validate().map_err(ElasticError::Rejected)?;
        let (core, runtime) = Core::connect(url, &config.job, settings)?;
        let mine = JobConfig::from_coordinator(config);
        let deadline = Instant::now() + core.settings.connect_timeout;
        let (config, adopted) = {
            let core2 = core.clone();
            core.call(async move { settings_of(&core2, Some(&mine), deadline).await })?
        };
        core.handle.spawn(core.clone().follow());
        Ok(EtcdJob {
            core,
            _runtime: runtime,
            config,
            adopted,
        })
    }

    /// The job's settings (this launcher's, or the first launcher's).
    pub fn config(&self) -> &JobConfig {
        &self.config
    }

    /// True when another launcher published different settings first: this
    /// launcher's ranks follow those.
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// Grants a lease for one rank process (its time to live is the job's heartbeat
    /// timeout).
    pub fn grant_lease(&self) -> Result<i64, ElasticError> {
        let core = self.core.clone();
        let ttl = self.config.lease_ttl_secs();
        self.core.call(async move {
            Ok(core
                .request_any("lease grant", |mut client| async move {
                    client.lease_grant(ttl, None).await
                })
                .await?
                .id())
        })
    }

    /// Revokes `lease` in the background, retrying until etcd answers (a lease
    /// outlives an etcd outage): the rank's record disappears at once, which ends
    /// its generation.
    pub fn revoke_soon(&self, lease: i64) {
        let core = self.core.clone();
        self.core.handle.spawn(async move {
            let mut backoff = Duration::from_millis(20);
            loop {
                let mut client = core.client.clone();
                match core
                    .request("lease revoke", client.lease_revoke(lease))
                    .await
                {
                    Ok(_) => return,
                    Err(e) if e.to_string().contains("not found") => return,
                    Err(e) => debug!(lease, error = %e, "lease revoke failed; retrying"),
                }
                if core.closing.load(Ordering::Relaxed) {
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        });
    }

    /// Generations formed and ended (and a shutdown) seen so far, oldest first.
    pub fn events(&self) -> Vec<Event> {
        self.core.lock().events.clone()
    }

    /// Why the job is over, once this launcher has seen it end (finished, or shut
    /// down); `None` while it may still train.
    pub fn job_over(&self) -> Option<JobOver> {
        let current = self.core.lock().current();
        match (&current.finished, &current.state) {
            (Some(reason), _) => Some(JobOver::Finished(reason.clone())),
            (None, GenState::Shutdown { reason }) => Some(JobOver::ShutDown(reason.clone())),
            _ => None,
        }
    }

    /// Requests sent to etcd so far.
    pub fn requests(&self) -> u64 {
        self.core.requests.load(Ordering::Relaxed)
    }
}

impl Drop for EtcdJob {
    fn drop(&mut self) {
        self.core.closing.store(true, Ordering::Relaxed);
    }
}

/// The [`ControlPlane`] on etcd: one per member process.
pub struct EtcdControlPlane {
    inner: Arc<Plane>,
    _runtime: Runtime,
}

struct Plane {
    core: Arc<Core>,
    me: Member,
    config: JobConfig,
    lease: AtomicI64,
    lease_lost: AtomicBool,
    /// What this member last wrote about itself, whether it still needs writing,
    /// and the revision of its last write (0: none).
    record: Mutex<(MemberRecord, bool, i64)>,
    keeper: tokio::sync::Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
    /// Held across one write of this member's record, from taking its snapshot to
    /// etcd's answer: two writes (the heartbeat's and the rendezvous') never overlap,
    /// so an older snapshot, delayed by retries, cannot land after a newer one and
    /// undo it (a lost `wants` left a rendezvous waiting forever).
    publishing: tokio::sync::Mutex<()>,
    next_keepalive: Mutex<Instant>,
    /// Reports etcd did not take yet, oldest first.
    pending: Mutex<VecDeque<(u64, Report)>>,
    /// The last directive `watch` returned, per generation.
    delivered: Mutex<Option<(u64, Directive)>>,
    /// The generation this member declared itself hung in.
    hung_in: AtomicU64,
}

impl Plane {
    fn record(&self) -> MutexGuard<'_, (MemberRecord, bool, i64)> {
        self.record.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn update(&self, change: impl FnOnce(&mut MemberRecord)) {
        let mut record = self.record();
        let before = record.0.clone();
        change(&mut record.0);
        if record.0 != before {
            record.1 = true;
        }
    }

    /// Writes this member's record under its lease (a fresh own lease when the
    /// given one is gone).
    async fn publish(&self) -> Result<(), ElasticError> {
        let _one_at_a_time = self.publishing.lock().await;
        let (record, _, _) = self.record().clone();
        let value = serde_json::to_vec(&record).map_err(|e| io("encode", e))?;
        let key = self.core.keys.member(&self.me.id);
        if self.lease_lost.load(Ordering::SeqCst) {
            let ttl = self.config.lease_ttl_secs();
            let lease = self
                .core
                .request_any("lease grant", |mut client| async move {
                    client.lease_grant(ttl, None).await
                })
                .await?
                .id();
            info!(member = %self.me.id, lease, "lease lost; registering again under a new one");
            self.lease.store(lease, Ordering::SeqCst);
            *self.keeper.lock().await = None;
            self.lease_lost.store(false, Ordering::SeqCst);
        }
        let lease = self.lease.load(Ordering::SeqCst);
        let put = self.core.request_any("put", |mut client| {
            let (key, value) = (key.clone(), value.clone());
            async move {
                client
                    .put(key, value, Some(PutOptions::new().with_lease(lease)))
                    .await
            }
        });
        match put.await {
            Ok(response) => {
                let revision = response.header().map(|h| h.revision()).unwrap_or(0);
                let mut mine = self.record();
                if mine.0 == record {
                    mine.1 = false;
                }
                mine.2 = revision;
                Ok(())
            }
            Err(e) => {
                if e.to_string().contains("lease not found") {
                    self.lease_lost.store(true, Ordering::SeqCst);
                    self.core.changed();
                }
                Err(e)
            }
        }
    }

    /// Sends one keep-alive when one is due; marks the lease lost when etcd says it
    /// expired.
    async fn keep_alive(&self) -> Result<(), ElasticError> {
        {
            let mut next = self
                .next_keepalive
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            if now < *next {
                return Ok(());
            }
            let every = Duration::from_secs(self.config.lease_ttl_secs() as u64) / 3;
            *next = now + every.max(Duration::from_millis(200));
        }
        if self.lease_lost.load(Ordering::SeqCst) {
            return Ok(());
        }
        let lease = self.lease.load(Ordering::SeqCst);
        let mut keeper = self.keeper.lock().await;
        if keeper.is_none() {
            let mut client = self.core.client.clone();
            *keeper = Some(
                self.core
                    .request("keep-alive", client.lease_keep_alive(lease))
                    .await?,
            );
        }
        let (sender, stream) = keeper.as_mut().expect("set above");
        let result = async {
            self.core.request("keep-alive", sender.keep_alive()).await?;
            self.core.request("keep-alive", stream.message()).await
        }
        .await;
        match result {
            Ok(Some(response)) if response.ttl() <= 0 => {
                warn!(member = %self.me.id, lease, "lease expired (this process was silent for the heartbeat timeout)");
                self.lease_lost.store(true, Ordering::SeqCst);
                *keeper = None;
                self.core.changed();
                Ok(())
            }
            Ok(Some(_)) => Ok(()),
            Ok(None) => {
                *keeper = None;
                Err(io("keep-alive", "stream ended"))
            }
            Err(e) => {
                *keeper = None;
                *self
                    .next_keepalive
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Instant::now();
                Err(e)
            }
        }
    }

    /// Folds `report` into the generation record.
    async fn apply_report(&self, generation: u64, report: &Report) -> Result<(), ElasticError> {
        let id = self.me.id.clone();
        let config = self.config.clone();
        self.core
            .transition(|mirror| {
                let current = mirror.current();
                let waiting = mirror
                    .members
                    .values()
                    .filter(|l| {
                        l.record.wants.is_some() && current.rank_of(&l.record.member.id).is_none()
                    })
                    .count();
                rules::on_report(&current, &id, generation, report, waiting, &config)
            })
            .await?;
        Ok(())
    }

    /// Writes queued reports, oldest first; stops at the first failure.
    async fn flush(&self) -> Result<(), ElasticError> {
        loop {
            let first = self
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .front()
                .cloned();
            let Some((generation, report)) = first else {
                return Ok(());
            };
            self.apply_report(generation, &report).await?;
            self.pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop_front();
        }
    }

    /// Evaluates the rules on every change and proposes what they ask for.
    async fn decide(self: Arc<Self>) {
        let mut timers = Timers::default();
        let mut last_try: Option<(i64, u64, Instant)> = None;
        let mut last_quiet: Option<Instant> = None;
        while !self.core.closing.load(Ordering::Relaxed) {
            let notified = self.core.notify.notified();
            let proposal = {
                let mirror = self.core.lock();
                let me_live = mirror.members.contains_key(&self.me.id);
                if !mirror.synced || !me_live {
                    None
                } else {
                    let current = mirror.current();
                    let next = rules::next(
                        &current,
                        &mirror.members,
                        &self.config,
                        &mut timers,
                        Instant::now(),
                    );
                    if next.is_none()
                        && !current.is_running()
                        && last_quiet
                            .is_none_or(|at: Instant| at.elapsed() > Duration::from_secs(1))
                    {
                        last_quiet = Some(Instant::now());
                        debug!(
                            generation = current.generation,
                            state = ?current.state,
                            revision = mirror.revision,
                            live = ?mirror.members.iter().map(|(id, l)| (id.clone(), l.record.wants)).collect::<Vec<_>>(),
                            "between generations; nothing to propose yet"
                        );
                    }
                    next.map(|next| (next, mirror.gen_revision))
                }
            };
            if let Some((next, revision)) = proposal {
                let again = last_try.is_some_and(|(r, g, at)| {
                    r == revision
                        && g == next.generation
                        && at.elapsed() < Duration::from_millis(200)
                });
                if !again {
                    last_try = Some((revision, next.generation, Instant::now()));
                    match self.core.swap(revision, &next).await {
                        Ok(true) => info!(
                            generation = next.generation,
                            state = ?next.state,
                            members = next.members.len(),
                            "generation record advanced"
                        ),
                        Ok(false) => {
                            let _ = self.core.reread_generation().await;
                        }
                        Err(e) => debug!(error = %e, "proposal not written"),
                    }
                    continue;
                }
            }
            let _ = tokio::time::timeout(TICK, notified).await;
        }
    }
}

impl EtcdControlPlane {
    /// Joins the job in etcd at `url` as `member`: reads the job's settings (which a
    /// launcher publishes), registers under `lease` (a launcher's, which it revokes
    /// when this process exits) or a lease of its own, and starts following the job.
    pub fn connect(
        url: &EtcdUrl,
        member: Member,
        lease: Option<i64>,
        settings: EtcdSettings,
    ) -> Result<EtcdControlPlane, ElasticError> {
        if member.id.is_empty() || member.id.contains('/') || member.id.len() > 256 {
            return Err(ElasticError::Rejected(format!(
                "member id {:?} must be 1 to 256 characters without '/'",
                member.id
            )));
        }
        let (core, runtime) = Core::connect(url, &member.job, settings)?;
        let deadline = Instant::now() + core.settings.connect_timeout;
        let (config, _) = {
            let core2 = core.clone();
            core.call(async move { settings_of(&core2, None, deadline).await })?
        };
        let plane = Arc::new(Plane {
            core: core.clone(),
            me: member.clone(),
            config,
            lease: AtomicI64::new(lease.unwrap_or(0)),
            lease_lost: AtomicBool::new(lease.is_none()),
            record: Mutex::new((
                MemberRecord {
                    member,
                    wants: None,
                    generation: 0,
                    checkpoint_generation: 0,
                },
                true,
                0,
            )),
            keeper: tokio::sync::Mutex::new(None),
            publishing: tokio::sync::Mutex::new(()),
            next_keepalive: Mutex::new(Instant::now()),
            pending: Mutex::new(VecDeque::new()),
            delivered: Mutex::new(None),
            hung_in: AtomicU64::new(0),
        });
        {
            let plane2 = plane.clone();
            core.call(async move {
                match plane2.publish().await {
                    Err(e) if !plane2.lease_lost.load(Ordering::SeqCst) => Err(e),
                    // The launcher's lease is gone (or never was): one of our own.
                    Err(_) => plane2.publish().await,
                    Ok(()) => Ok(()),
                }
            })?;
        }
        core.handle.spawn(core.clone().follow());
        core.handle.spawn(plane.clone().decide());
        core.wait(
            None,
            Some(deadline),
            |mirror| mirror.synced.then_some(Ok(())),
            || {
                Err(ElasticError::Io(format!(
                    "no watch on {url} within the connect timeout"
                )))
            },
        )?;
        Ok(EtcdControlPlane {
            inner: plane,
            _runtime: runtime,
        })
    }

    /// The job's settings this member follows.
    pub fn config(&self) -> &JobConfig {
        &self.inner.config
    }

    /// Requests sent to etcd so far (for the request-rate figure).
    pub fn requests(&self) -> u64 {
        self.inner.core.requests.load(Ordering::Relaxed)
    }

    /// Retries `write` (cancel-aware, with backoff) until it succeeds.
    fn until_written(
        &self,
        cancel: &Cancel,
        what: &str,
        write: impl Fn(
            Arc<Plane>,
        )
            -> std::pin::Pin<Box<dyn Future<Output = Result<(), ElasticError>> + Send>>,
    ) -> Result<(), ElasticError> {
        let mut backoff = Duration::from_millis(20);
        let mut warned = false;
        loop {
            match self.inner.core.call(write(self.inner.clone())) {
                Ok(()) => return Ok(()),
                Err(ElasticError::Io(e)) => {
                    if !warned {
                        warn!(member = %self.inner.me.id, error = %e, "{what}: etcd unreachable; retrying");
                        warned = true;
                    }
                }
                Err(e) => return Err(e),
            }
            if cancel.wait_timeout(backoff) {
                return Err(ElasticError::Cancelled);
            }
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    fn lost(&self, mirror: &Mirror) -> bool {
        if self.inner.lease_lost.load(Ordering::SeqCst) {
            return true;
        }
        let written_at = self.inner.record().2;
        mirror.synced
            && written_at > 0
            && mirror.revision >= written_at
            && !mirror.members.contains_key(&self.inner.me.id)
    }
}

impl Drop for EtcdControlPlane {
    fn drop(&mut self) {
        let core = self.inner.core.clone();
        core.closing.store(true, Ordering::Relaxed);
        let lease = self.inner.lease.load(Ordering::SeqCst);
        if lease != 0 {
            // Leaving: the record goes at once rather than after the time to live.
            let core2 = core.clone();
            let _ = core.call(async move {
                let mut client = core2.client.clone();
                core2
                    .request("lease revoke", client.lease_revoke(lease))
                    .await
            });
        }
    }
}

fn boxed<'a>(
    future: impl Future<Output = Result<(), ElasticError>> + Send + 'a,
) -> std::pin::Pin<Box<dyn Future<Output = Result<(), ElasticError>> + Send + 'a>> {
    Box::pin(future)
}

impl ControlPlane for EtcdControlPlane {
    fn rendezvous(&self, after: u64, cancel: &Cancel) -> Result<Assignment, ElasticError> {
        let id = self.inner.me.id.clone();
        self.until_written(cancel, "queued reports", |plane| {
            boxed(async move { plane.flush().await })
        })?;
        // Asked again while in a newer generation: answer again.
        let current = self.inner.core.lock().current().assignment(&id);
        if let Some(a) = current.filter(|a| a.generation > after) {
            return Ok(a);
        }
        // A running member asking for a new generation ends the running one.
        self.until_written(cancel, "leaving the generation", |plane| {
            let id = plane.me.id.clone();
            boxed(async move {
                plane
                    .core
                    .transition(|mirror| {
                        let current = mirror.current();
                        (current.generation <= after)
                            .then(|| rules::on_leave_running(&current, &id))
                            .flatten()
                    })
                    .await
                    .map(|_| ())
            })
        })?;
        self.inner.update(|r| r.wants = Some(after));
        self.until_written(cancel, "rendezvous", |plane| {
            boxed(async move { plane.publish().await })
        })?;
        let assignment = self.inner.core.wait(
            Some(cancel),
            None,
            |mirror| {
                let current = mirror.current();
                if let GenState::Shutdown { reason } = &current.state {
                    return Some(Err(ElasticError::Shutdown(reason.clone())));
                }
                let assigned = current.assignment(&id).filter(|a| a.generation > after);
                if assigned.is_none()
                    && let Some(reason) = &current.finished
                {
                    return Some(Err(ElasticError::Shutdown(reason.clone())));
                }
                assigned.map(Ok)
            },
            || Err(ElasticError::Timeout("rendezvous".into())),
        )?;
        self.inner.update(|r| {
            r.wants = None;
            r.generation = assignment.generation;
        });
        let plane = self.inner.clone();
        if let Err(e) = self.inner.core.call(async move { plane.publish().await }) {
            // The next heartbeat writes it.
            debug!(error = %e, "member record not updated yet");
        }
        Ok(assignment)
    }

    fn heartbeat(&self, generation: u64, progress: &Progress) -> Result<(), ElasticError> {
        self.inner.update(|r| {
            r.checkpoint_generation = r.checkpoint_generation.max(progress.checkpoint_generation)
        });
        let hung = generation > 0
            && !progress.in_collective
            && progress.idle_ms > self.inner.config.progress_timeout_ms
            && self.inner.hung_in.swap(generation, Ordering::SeqCst) != generation;
        let plane = self.inner.clone();
        let idle = progress.idle_ms;
        self.inner.core.call(async move {
            if hung {
                warn!(member = %plane.me.id, generation, idle_ms = idle, "training thread hung outside a collective; leaving the generation");
                let id = plane.me.id.clone();
                plane
                    .core
                    .transition(|mirror| {
                        let current = mirror.current();
                        (current.generation == generation)
                            .then(|| rules::on_hung(&current, &id, idle))
                            .flatten()
                    })
                    .await?;
            }
            let _ = plane.flush().await;
            if plane.lease_lost.load(Ordering::SeqCst) {
                // Lost its membership: the watch says stale; only a new rendezvous
                // registers again.
                return Ok(());
            }
            if plane.record().1 {
                plane.publish().await?;
            }
            plane.keep_alive().await
        })
    }

    fn watch(&self, generation: u64, timeout: Duration) -> Result<Option<Directive>, ElasticError> {
        let id = self.inner.me.id.clone();
        self.inner.core.wait(
            None,
            Some(Instant::now() + timeout),
            |mirror| {
                let waiting = self.inner.record().0.wants.is_some();
                let directive = rules::directive(
                    &id,
                    generation,
                    mirror.history.get(&generation),
                    &mirror.current(),
                    waiting,
                    generation > 0 && self.lost(mirror),
                )?;
                let mut delivered = self
                    .inner
                    .delivered
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if delivered.as_ref() == Some(&(generation, directive.clone())) {
                    return None;
                }
                *delivered = Some((generation, directive.clone()));
                Some(Ok(Some(directive)))
            },
            || Ok(None),
        )
    }

    fn report(&self, generation: u64, report: &Report) -> Result<(), ElasticError> {
        if matches!(report, Report::Fatal { .. } | Report::Leaving { .. }) {
            self.inner.update(|r| r.wants = None);
        }
        self.inner
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back((generation, report.clone()));
        let plane = self.inner.clone();
        self.inner
            .core
            .call(async move { plane.flush().await })
            .map_err(|e| match e {
                ElasticError::Io(e) => ElasticError::Io(format!(
                    "{e} (the report is queued and written when etcd answers)"
                )),
                e => e,
            })
    }

    fn kv_set(&self, generation: u64, key: &str, value: &str) -> Result<(), ElasticError> {
        if key.is_empty() || key.len() > 1024 || value.len() > MAX_VALUE {
            return Err(ElasticError::Rejected(format!(
                "key {key:?} ({} bytes) or its value ({} bytes) is empty or too long",
                key.len(),
                value.len()
            )));
        }
        {
            let mirror = self.inner.core.lock();
            let current = mirror.current();
            if current.generation != generation || !current.is_running() {
                return Err(ElasticError::Rejected(format!(
                    "generation {generation} is not running (the job is at {}); key {key:?} not set",
                    current.generation
                )));
            }
        }
        let core = self.inner.core.clone();
        let full = format!("{}{key}", core.keys.kv_of(generation));
        let value = value.to_owned();
        self.inner.core.call(async move {
            core.request_any("put", |mut client| {
                let (full, value) = (full.clone(), value.clone());
                async move { client.put(full, value, None).await }
            })
            .await
            .map(|_| ())
        })
    }

    fn kv_get(
        &self,
        generation: u64,
        key: &str,
        cancel: &Cancel,
        timeout: Duration,
    ) -> Result<String, ElasticError> {
        let entry = (generation, key.to_owned());
        self.inner.core.wait(
            Some(cancel),
            Some(Instant::now() + timeout),
            |mirror| {
                if let Some(value) = mirror.kv.get(&entry) {
                    return Some(Ok(value.clone()));
                }
                let current = mirror.current();
                if let GenState::Shutdown { reason } = &current.state {
                    return Some(Err(ElasticError::Shutdown(reason.clone())));
                }
                (current.generation > generation
                    || current.generation == generation && !current.is_running())
                .then(|| Err(ElasticError::generation_over(generation, key)))
            },
            || Err(ElasticError::key_timeout(generation, key, timeout)),
        )
    }
}
