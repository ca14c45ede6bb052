//! The connection to etcd that an [`EtcdControlPlane`](super::EtcdControlPlane) and an
//! [`EtcdJob`](super::EtcdJob) share: the client and its runtime, bounded and
//! retried requests, the watches that keep the [`Mirror`] in step (a read at
//! revision R, then a watch from R + 1, again after every break), the
//! compare-and-swap of the generation record, and the job's published settings.
//!
//! What is watched is bounded per member, not per job: a member watches the
//! generation record, the bootstrap keys, the leader key and its own record; a
//! launcher the generation record alone; only the leader watches every member's
//! record ([`Core::follow_members`]).
//!
//! Calls run on a small runtime of their own (or, for many members in one process
//! as the scale bench simulates them, on one runtime the caller shares) and are
//! each bounded by [`EtcdSettings::request_timeout`].

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, EventType, GetOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions, WatchResponse,
};
use tracing::{debug, warn};

use super::EtcdUrl;
use super::member::TICK;
use super::mirror::{Keys, MAX_RECORD, Mirror, apply_kv};
use super::rules::{GenRecord, JobConfig};
use super::security::{EtcdTls, EtcdUser, protocol_mismatch, refusal, tls_options};
use crate::cancel::{Waker, wait_on};
use crate::{Cancel, ElasticError};

/// How the backend talks to etcd. [`EtcdSettings::from_env`] is the default with
/// TLS and the user from the environment (`CKPT_ETCD_CACERT`…), what every process
/// that talks to etcd should use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdSettings {
    /// How long connecting waits for etcd and the job's settings (30 s).
    pub connect_timeout: Duration,
    /// Bound on one request (3 s): longer than an etcd leader election.
    pub request_timeout: Duration,
    /// TLS to etcd (`None`: plaintext).
    pub tls: Option<EtcdTls>,
    /// The etcd user requests are made as (`None`: none, for a cluster without auth).
    pub user: Option<EtcdUser>,
}

impl Default for EtcdSettings {
    fn default() -> Self {
        EtcdSettings {
            connect_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(3),
            tls: None,
            user: None,
        }
    }
}

/// What an [`EtcdControlPlane`](super::EtcdControlPlane) and an
/// [`EtcdJob`](super::EtcdJob) share: the client, its runtime, the mirror.
pub(super) struct Core {
    pub(super) handle: tokio::runtime::Handle,
    pub(super) client: Client,
    /// The endpoints, `HOST:PORT`.
    pub(super) hosts: Vec<String>,
    pub(super) keys: Keys,
    /// The member whose own record this client watches; `None`: a launcher's
    /// client, which watches the generation record alone.
    pub(super) me: Option<String>,
    pub(super) settings: EtcdSettings,
    pub(super) mirror: Mutex<Mirror>,
    pub(super) changed: Condvar,
    /// Wakes the rules task on a change.
    pub(super) notify: tokio::sync::Notify,
    pub(super) closing: AtomicBool,
    /// Requests sent to etcd (watch and keep-alive messages included).
    pub(super) requests: AtomicU64,
}

/// The request did not reach a serving member: the endpoint refused the connection
/// or answered `Unavailable` (gRPC code 14) — but not a TLS handshake that failed,
/// which another endpoint would fail the same way ([`refusal`]).
pub(super) fn unreachable_endpoint(e: &etcd_client::Error, settings: &EtcdSettings) -> bool {
    if refusal(e, settings).is_some() {
        return false;
    }
    match e {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(status) => i32::from(status.code()) == 14,
        _ => false,
    }
}

pub(super) fn io(what: &str, e: impl std::fmt::Display) -> ElasticError {
    ElasticError::Io(format!("etcd {what}: {e}"))
}

/// An error of etcd's client: [`ElasticError::Rejected`] when TLS or etcd refused
/// (retrying cannot help: see [`refusal`]), [`ElasticError::Io`] otherwise.
pub(super) fn failed(what: &str, e: &etcd_client::Error, settings: &EtcdSettings) -> ElasticError {
    match refusal(e, settings) {
        Some(why) => ElasticError::Rejected(format!("etcd {what}: {why}")),
        None => io(what, e),
    }
}

impl Core {
    /// Connects on `shared`, or on a runtime of its own when `None`; the
    /// [`Runtime`] returned runs the client's tasks and must outlive the core's use
    /// (its owner's drop ends them).
    pub(super) fn connect(
        url: &EtcdUrl,
        job: &str,
        me: Option<&str>,
        settings: EtcdSettings,
        shared: Option<&tokio::runtime::Handle>,
    ) -> Result<(Arc<Core>, Runtime), ElasticError> {
        let root = url.root(job).map_err(ElasticError::Rejected)?;
        let runtime = match shared {
            Some(handle) => Runtime::shared(handle.clone()),
            None => Runtime::own(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("ckpt-etcd")
                    .enable_all()
                    .build()
                    .map_err(|e| io("runtime", e))?,
            ),
        };
        let mut options = ConnectOptions::new()
            .with_connect_timeout(settings.request_timeout)
            .with_timeout(settings.request_timeout)
            // HTTP/2 pings find a dead connection; etcd closes connections that
            // ping more often than every 5 s (--grpc-keepalive-min-time).
            .with_keep_alive(Duration::from_secs(10), settings.request_timeout)
            .with_require_leader(true);
        let mut endpoints = url.endpoints.clone();
        if let Some(tls) = &settings.tls {
            options = options.with_tls(tls_options(tls)?);
            for endpoint in &mut endpoints {
                *endpoint = endpoint.replacen("http://", "https://", 1);
            }
        }
        if let Some(user) = &settings.user {
            if settings.tls.is_none() {
                warn!(user = %user.name, "the etcd password goes to etcd unencrypted: set CKPT_ETCD_CACERT to use TLS");
            }
            // Tokens expire (etcd's --auth-token-ttl, or a JWT's own): the client
            // authenticates again when etcd says a token is no longer valid.
            options = options
                .with_user(user.name.clone(), user.password())
                .with_auto_token_refresh(true);
        }
        let hosts: Vec<String> = url
            .endpoints
            .iter()
            .map(|e| e.trim_start_matches("http://").to_owned())
            .collect();
        let what = format!("connect to {url}");
        let (checked, probed) = (settings.clone(), hosts.clone());
        let client = block(&runtime.handle, async move {
            // With a user, connecting authenticates (one request), which is retried
            // while etcd does not answer; without one, nothing is sent yet, and the
            // first request (`settings_of`) finds out whether etcd accepts this client.
            let deadline = tokio::time::Instant::now() + checked.connect_timeout;
            let mut asked_tls = false;
            loop {
                let e = match Client::connect(&endpoints, Some(options.clone())).await {
                    Ok(client) => return Ok(client),
                    Err(e) => failed(&what, &e, &checked),
                };
                let ElasticError::Io(_) = e else {
                    return Err(e);
                };
                if !std::mem::replace(&mut asked_tls, true)
                    && let Some(refused) = protocol_mismatch(&probed, &checked, &e).await
                {
                    return Err(refused);
                }
                if tokio::time::Instant::now() + Duration::from_millis(100) >= deadline {
                    return Err(e);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })?;
        let core = Arc::new(Core {
            handle: runtime.handle.clone(),
            client,
            hosts,
            keys: Keys { root },
            me: me.map(str::to_owned),
            settings,
            mirror: Mutex::new(Mirror::default()),
            changed: Condvar::new(),
            notify: tokio::sync::Notify::new(),
            closing: AtomicBool::new(false),
            requests: AtomicU64::new(0),
        });
        Ok((core, runtime))
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Mirror> {
        self.mirror.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn changed(&self) {
        self.changed.notify_all();
        self.notify.notify_waiters();
    }

    /// Runs `future` on the runtime and waits for it.
    pub(super) fn call<T: Send + 'static>(
        &self,
        future: impl Future<Output = Result<T, ElasticError>> + Send + 'static,
    ) -> Result<T, ElasticError> {
        block(&self.handle, future)
    }

    /// One request, counted and bounded.
    pub(super) async fn request<T>(
        &self,
        what: &str,
        future: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, ElasticError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        match tokio::time::timeout(self.settings.request_timeout, future).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(failed(what, &e, &self.settings)),
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
    pub(super) async fn request_any<T, F, Fut>(
        &self,
        what: &str,
        mut make: F,
    ) -> Result<T, ElasticError>
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
                Ok(Err(e)) if unreachable_endpoint(&e, &self.settings) => e.to_string(),
                Ok(Err(e)) => return Err(failed(what, &e, &self.settings)),
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

    /// What this client watches, as (key, range end) pairs ("": that key alone).
    fn watched(&self) -> Vec<(String, String)> {
        match &self.me {
            Some(id) => {
                let (start, end) = self.keys.shared_range();
                vec![(start, end), (self.keys.member(id), String::new())]
            }
            None => vec![(self.keys.generation(), String::new())],
        }
    }

    /// Reads every key this client watches (in one transaction: one revision) and
    /// replaces the mirror's copy of them; returns the revision.
    pub(super) async fn resync(&self) -> Result<i64, ElasticError> {
        let reads: Vec<TxnOp> = self
            .watched()
            .into_iter()
            .map(|(key, end)| {
                let options = (!end.is_empty()).then(|| GetOptions::new().with_range(end));
                TxnOp::get(key, options)
            })
            .collect();
        let txn = Txn::new().and_then(reads);
        let response = self
            .request_any("read", |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await?;
        let revision = response.header().map(|h| h.revision()).unwrap_or(0);
        let mut mirror = self.lock();
        // The leader's copy of the member records, the events and the history are
        // not this watch's: they stay.
        let kept = Mirror {
            events: std::mem::take(&mut mirror.events),
            history: std::mem::take(&mut mirror.history),
            members: std::mem::take(&mut mirror.members),
            all_members: mirror.all_members,
            // Keep the generation's transitions continuous for the events.
            current: mirror.current.take(),
            gen_revision: mirror.gen_revision,
            ..Mirror::default()
        };
        *mirror = kept;
        for op in response.op_responses() {
            if let TxnOpResponse::Get(get) = op {
                for kv in get.kvs() {
                    apply_kv(&mut mirror, &self.keys, kv, false);
                }
            }
        }
        mirror.revision = revision;
        drop(mirror);
        self.changed();
        Ok(revision)
    }

    /// Keeps the mirror in step: a full read, then a watch from the next revision;
    /// again, with backoff, after every break.
    pub(super) async fn follow(self: Arc<Self>) {
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

    pub(super) async fn follow_once(&self) -> Result<(), ElasticError> {
        let revision = self.resync().await?;
        let mut client = self.client.clone();
        let options = |end: &str| {
            let options = WatchOptions::new().with_start_revision(revision + 1);
            if end.is_empty() {
                options
            } else {
                options.with_range(end)
            }
        };
        let mut watched = self.watched().into_iter();
        let (key, end) = watched.next().expect("a client watches something");
        let mut stream = self
            .request("watch", client.watch(key, Some(options(&end))))
            .await?;
        for (key, end) in watched {
            self.request("watch", stream.watch(key, Some(options(&end))))
                .await?;
        }
        {
            let mut mirror = self.lock();
            mirror.synced = true;
        }
        self.changed();
        debug!(revision, "etcd watch established");
        loop {
            let response = watch_response(stream.message().await)?;
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

    /// While `leads()` holds: reads every member record into the mirror (`members`,
    /// then `all_members`), and keeps them in step with a watch. Returns when
    /// `leads()` turns false (checked at least every [`TICK`]) or the watch breaks;
    /// either way the mirror's copy is dropped.
    pub(super) async fn follow_members(
        &self,
        leads: impl Fn() -> bool,
    ) -> Result<(), ElasticError> {
        let result = self.follow_members_once(&leads).await;
        {
            let mut mirror = self.lock();
            mirror.members.clear();
            mirror.all_members = false;
        }
        self.changed();
        result
    }

    async fn follow_members_once(&self, leads: &impl Fn() -> bool) -> Result<(), ElasticError> {
        let prefix = self.keys.members();
        let response = self
            .request_any("read", |mut client| {
                let prefix = prefix.clone();
                async move {
                    client
                        .get(prefix, Some(GetOptions::new().with_prefix()))
                        .await
                }
            })
            .await?;
        let revision = response.header().map(|h| h.revision()).unwrap_or(0);
        let mut client = self.client.clone();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut stream = self
            .request("watch", client.watch(prefix, Some(options)))
            .await?;
        {
            let mut mirror = self.lock();
            mirror.members.clear();
            for kv in response.kvs() {
                mirror.apply_member(&self.keys, kv, false);
            }
            mirror.all_members = true;
        }
        self.changed();
        debug!(
            revision,
            members = response.kvs().len(),
            "leading: following every member's record"
        );
        while leads() && !self.closing.load(Ordering::Relaxed) {
            // `message` is cancel safe: a timeout loses nothing.
            let Ok(message) = tokio::time::timeout(TICK * 10, stream.message()).await else {
                continue;
            };
            let response = watch_response(message)?;
            let mut mirror = self.lock();
            for event in response.events() {
                if let Some(kv) = event.kv() {
                    mirror.apply_member(&self.keys, kv, event.event_type() == EventType::Delete);
                }
            }
            drop(mirror);
            self.changed();
        }
        Ok(())
    }

    /// Waits on the mirror until `done` gives a result, `cancel` fires or
    /// `deadline` passes (then `on_timeout`).
    pub(super) fn wait<T>(
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
    pub(super) async fn swap(&self, revision: i64, next: &GenRecord) -> Result<bool, ElasticError> {
        self.swap_if(revision, next, Vec::new()).await
    }

    /// [`Core::swap`], on the further conditions `also`.
    pub(super) async fn swap_if(
        &self,
        revision: i64,
        next: &GenRecord,
        also: Vec<Compare>,
    ) -> Result<bool, ElasticError> {
        let key = self.keys.generation();
        let compare = if revision == 0 {
            Compare::create_revision(key.clone(), CompareOp::Equal, 0)
        } else {
            Compare::mod_revision(key.clone(), CompareOp::Equal, revision)
        };
        let mut compares = vec![compare];
        compares.extend(also);
        let value = serde_json::to_vec(next).map_err(|e| io("encode", e))?;
        if value.len() > MAX_RECORD {
            return Err(ElasticError::Rejected(format!(
                "generation record {} of {} members is {} bytes, over the {MAX_RECORD} this backend writes (etcd's default request limit is 1.5 MiB): use shorter member ids or fewer, larger members",
                next.generation,
                next.members.len(),
                value.len()
            )));
        }
        let mut ops = vec![TxnOp::put(key, value, None)];
        if next.generation >= 2 {
            ops.push(TxnOp::delete(
                self.keys.kv_of(0),
                Some(DeleteOptions::new().with_range(self.keys.kv_of(next.generation - 1))),
            ));
        }
        let txn = Txn::new().when(compares).and_then(ops);
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
    pub(super) async fn reread_generation(&self) -> Result<(), ElasticError> {
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
    pub(super) async fn transition(
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

/// A watch stream's next message, or why the stream is over.
fn watch_response(
    message: Result<Option<WatchResponse>, etcd_client::Error>,
) -> Result<WatchResponse, ElasticError> {
    let Some(response) = message.map_err(|e| io("watch", e))? else {
        return Err(io("watch", "stream ended"));
    };
    if response.canceled() {
        return Err(io(
            "watch",
            format!("cancelled: {}", response.cancel_reason()),
        ));
    }
    Ok(response)
}

/// Runs `future` on `handle` and waits for its result, from any thread that is not
/// one of the runtime's own (also from inside another runtime).
pub(super) fn block<T: Send + 'static>(
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

/// Where a client's tasks run, ended when its owner is dropped: a runtime of its
/// own is shut down; on a shared one, the tasks it started are aborted (which drops
/// the client they hold, and with it the client's connections).
pub(super) struct Runtime {
    pub(super) handle: tokio::runtime::Handle,
    own: Option<tokio::runtime::Runtime>,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl Runtime {
    fn own(runtime: tokio::runtime::Runtime) -> Runtime {
        Runtime {
            handle: runtime.handle().clone(),
            own: Some(runtime),
            tasks: Mutex::new(Vec::new()),
        }
    }

    fn shared(handle: tokio::runtime::Handle) -> Runtime {
        Runtime {
            handle,
            own: None,
            tasks: Mutex::new(Vec::new()),
        }
    }

    /// Starts a task that lives as long as this runtime's owner.
    pub(super) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let task = self.handle.spawn(task);
        self.tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(task.abort_handle());
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        for task in self
            .tasks
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
        {
            task.abort();
        }
        if let Some(runtime) = self.own.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Relaxed);
    }
}

/// Reads the job's settings, publishing `publish` first when none exist. Returns
/// them and whether they were someone else's (different from `publish`).
pub(super) async fn settings_of(
    core: &Core,
    publish: Option<&JobConfig>,
    deadline: Instant,
) -> Result<(JobConfig, bool), ElasticError> {
    let key = core.keys.config();
    let mut last_error = None;
    let mut asked_tls = false;
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
            Err(e @ ElasticError::Io(_)) if !std::mem::replace(&mut asked_tls, true) => {
                if let Some(refused) = protocol_mismatch(&core.hosts, &core.settings, &e).await {
                    return Err(refused);
                }
                last_error = Some(e.to_string());
            }
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
