//! One member's side of the etcd backend: its record under its lease (what it waits
//! for, what it runs), the lease's keep-alives, its queued reports, and, while it
//! leads, the task that evaluates the rules on every change and proposes what they
//! ask for.
//!
//! # One member leads
//!
//! The rules need every member's record; a member that followed them all would see
//! every other member's every write, which at N members is N² events per formation.
//! So one member at a time leads: it holds the `leader` key under its own lease
//! (created only where absent, in a transaction), follows every member's record and
//! proposes the records the rules ask for. The others follow the generation record,
//! the bootstrap keys, the leader key and their own record, and campaign when the
//! leader key goes: when the leader's lease ends (its process gone or silent) or it
//! leaves. Safety does not rest on there being one leader: every proposal is a
//! compare-and-swap of the generation record, so two members that both believe they
//! lead (for the moment a lease takes to run out) can only repeat each other's work.
//!
//! Apart from [`EtcdControlPlane`](super::EtcdControlPlane), whose blocking calls
//! use it, because this is the part that writes to etcd on the member's behalf.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp};
use tracing::{debug, info, warn};

use super::rules::{self, GenRecord, GenState, JobConfig, MemberRecord};
use super::store::{Core, io};
use crate::policy::Timers;
use crate::{Directive, ElasticError, Member, Report};

/// How often the rules are evaluated without a change (for their time windows).
pub(super) const TICK: Duration = Duration::from_millis(20);
/// The shortest time between two evaluations of the rules.
const MIN_GAP: Duration = Duration::from_millis(5);
/// Members declared lost whose absence a proposal checks, at most.
const MAX_CONDITIONS: usize = 100;

pub(super) struct Plane {
    pub(super) core: Arc<Core>,
    pub(super) me: Member,
    pub(super) config: JobConfig,
    pub(super) lease: AtomicI64,
    pub(super) lease_lost: AtomicBool,
    /// What this member last wrote about itself, whether it still needs writing,
    /// and the revision of its last write (0: none).
    pub(super) record: Mutex<(MemberRecord, bool, i64)>,
    pub(super) keeper: tokio::sync::Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
    /// Held across one write of this member's record, from taking its snapshot to
    /// etcd's answer: two writes (the heartbeat's and the rendezvous') never overlap,
    /// so an older snapshot, delayed by retries, cannot land after a newer one and
    /// undo it (a lost `wants` left a rendezvous waiting forever).
    pub(super) publishing: tokio::sync::Mutex<()>,
    pub(super) next_keepalive: Mutex<Instant>,
    /// Reports etcd did not take yet, oldest first.
    pub(super) pending: Mutex<VecDeque<(u64, Report)>>,
    /// The last directive `watch` returned, per generation.
    pub(super) delivered: Mutex<Option<(u64, Directive)>>,
    /// The generation this member declared itself hung in.
    pub(super) hung_in: AtomicU64,
}

impl Plane {
    pub(super) fn record(&self) -> MutexGuard<'_, (MemberRecord, bool, i64)> {
        self.record.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn update(&self, change: impl FnOnce(&mut MemberRecord)) {
        let mut record = self.record();
        let before = record.0.clone();
        change(&mut record.0);
        if record.0 != before {
            record.1 = true;
        }
    }

    /// Writes this member's record under its lease (a fresh own lease when the
    /// given one is gone).
    pub(super) async fn publish(&self) -> Result<(), ElasticError> {
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
    pub(super) async fn keep_alive(&self) -> Result<(), ElasticError> {
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
    pub(super) async fn apply_report(
        &self,
        generation: u64,
        report: &Report,
    ) -> Result<(), ElasticError> {
        let id = self.me.id.clone();
        let config = self.config.clone();
        self.core
            .transition(|mirror| {
                let current = mirror.current();
                // Counted by the leader (this member may not see the others).
                let waiting = current.waiting;
                rules::on_report(current, &id, generation, report, waiting, &config)
            })
            .await?;
        Ok(())
    }

    /// Writes queued reports, oldest first; stops at the first failure.
    pub(super) async fn flush(&self) -> Result<(), ElasticError> {
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

    /// This member leads: the leader key lives under its lease.
    pub(super) fn leads(&self, mirror: &super::mirror::Mirror) -> bool {
        let lease = self.lease.load(Ordering::SeqCst);
        lease != 0 && !self.lease_lost.load(Ordering::SeqCst) && mirror.leader == Some(lease)
    }

    /// Takes the lead when nobody has it, and follows every member's record while it
    /// leads.
    pub(super) async fn lead(self: Arc<Self>) {
        let mut pause = TICK;
        while !self.core.closing.load(Ordering::Relaxed) {
            let notified = self.core.notify.notified();
            let (leads, vacant) = {
                let mirror = self.core.lock();
                let ready = mirror.synced
                    && mirror.mine.is_some()
                    && !self.lease_lost.load(Ordering::SeqCst);
                (
                    ready && self.leads(&mirror),
                    ready && mirror.leader.is_none(),
                )
            };
            if leads {
                info!(member = %self.me.id, "leads the job: follows every member and applies the rules");
                let me = self.clone();
                let result = self
                    .core
                    .follow_members(move || me.leads(&me.core.lock()))
                    .await;
                if let Err(e) = result {
                    debug!(error = %e, "following the members broke");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                } else {
                    pause = TICK;
                }
                continue;
            }
            if vacant {
                match self.campaign().await {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(e) => debug!(error = %e, "campaign for the lead not written"),
                }
            }
            // A new leader key, or its deletion, arrives by the watch.
            let _ = tokio::time::timeout(Duration::from_secs(1), notified).await;
        }
    }

    /// Writes the leader key under this member's lease where there is none; true when
    /// this member won.
    async fn campaign(&self) -> Result<bool, ElasticError> {
        let lease = self.lease.load(Ordering::SeqCst);
        let key = self.core.keys.leader();
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                key.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then(vec![TxnOp::put(
                key,
                self.me.id.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let response = self
            .core
            .request_any("transaction", |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await?;
        if response.succeeded() {
            let mut mirror = self.core.lock();
            mirror.leader = Some(lease);
            drop(mirror);
            self.core.changed();
        }
        Ok(response.succeeded())
    }

    /// What a proposal of the leader rests on besides the record's revision: that it
    /// still leads (a leader that was stopped and wakes up may act on an old view
    /// before its watch tells it that its lease ran out), and that the members it
    /// declares lost have no record (a view that lags behind cannot end a
    /// generation). At most [`MAX_CONDITIONS`] of the latter: etcd caps a
    /// transaction's operations (128 by default).
    fn conditions(&self, next: &GenRecord) -> Vec<Compare> {
        let lease = self.lease.load(Ordering::SeqCst);
        let mut also = vec![Compare::lease(
            self.core.keys.leader(),
            CompareOp::Equal,
            lease,
        )];
        if let GenState::Ended { dropped, .. } = &next.state
            && dropped.len() <= MAX_CONDITIONS
        {
            also.extend(dropped.iter().map(|id| {
                Compare::create_revision(self.core.keys.member(id), CompareOp::Equal, 0)
            }));
        }
        also
    }

    /// While this member leads: evaluates the rules on every change of the member
    /// records or the generation record (at most once per [`MIN_GAP`]), and every
    /// [`TICK`] between generations (for the policy's windows), and proposes what
    /// they ask for.
    pub(super) async fn decide(self: Arc<Self>) {
        let mut timers = Timers::default();
        let mut last_try: Option<(i64, u64, Instant)> = None;
        let mut last_quiet: Option<Instant> = None;
        let mut seen = u64::MAX;
        while !self.core.closing.load(Ordering::Relaxed) {
            let notified = self.core.notify.notified();
            let proposal = {
                let mirror = self.core.lock();
                let quiet = mirror.changes == seen
                    && mirror.current.as_ref().is_some_and(|c| c.is_running());
                if !mirror.synced || !mirror.all_members || !self.leads(&mirror) {
                    // Another member leads: its windows are its own.
                    timers = Timers::default();
                    None
                } else if quiet {
                    None
                } else {
                    let current = mirror.current();
                    let next = rules::next(
                        current,
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
                    // While a generation runs only a change can ask for something;
                    // a proposal not yet written is tried again.
                    seen = if next.is_none() {
                        mirror.changes
                    } else {
                        u64::MAX
                    };
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
                    let also = self.conditions(&next);
                    match self.core.swap_if(revision, &next, also).await {
                        Ok(true) => info!(
                            generation = next.generation,
                            state = ?next.state,
                            members = next.members.len(),
                            "generation record advanced"
                        ),
                        Ok(false) => {
                            let _ = self.core.reread_generation().await;
                        }
                        Err(e @ ElasticError::Rejected(_)) => {
                            warn!(error = %e, "proposal refused")
                        }
                        Err(e) => debug!(error = %e, "proposal not written"),
                    }
                    continue;
                }
            }
            let _ = tokio::time::timeout(TICK, notified).await;
            // Many records change at once when many members ask together: one
            // evaluation for the lot.
            tokio::time::sleep(MIN_GAP).await;
        }
    }
}
