//! [`EtcdControlPlane`]: the [`ControlPlane`] on etcd, one per member process. Its
//! blocking calls wait on the mirror; its writes go through the member's record
//! and the rules.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::EtcdUrl;
use super::member::Plane;
use super::mirror::{MAX_VALUE, Mirror};
use super::rules::{self, GenState, JobConfig, MemberRecord};
use super::store::{Core, EtcdSettings, Runtime, settings_of};
use crate::policy::ends_membership;
use crate::{
    Assignment, Cancel, ControlPlane, Directive, ElasticError, MAX_RANKS_PER_MEMBER, Member,
    Progress, Report, check_snapshot_record,
};

/// The [`ControlPlane`] on etcd: one per member process.
pub struct EtcdControlPlane {
    inner: Arc<Plane>,
    _runtime: Runtime,
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
        Self::connect_on(None, url, member, lease, settings)
    }

    /// [`connect`](Self::connect), with the client's tasks on `runtime` instead of a
    /// runtime of its own: for many members in one process (the scale bench runs
    /// thousands). `runtime` must have time and I/O enabled and outlive the plane;
    /// the plane's blocking calls must not be made from its worker threads.
    pub fn connect_in(
        runtime: &tokio::runtime::Handle,
        url: &EtcdUrl,
        member: Member,
        lease: Option<i64>,
        settings: EtcdSettings,
    ) -> Result<EtcdControlPlane, ElasticError> {
        Self::connect_on(Some(runtime), url, member, lease, settings)
    }

    fn connect_on(
        shared: Option<&tokio::runtime::Handle>,
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
        if member.ranks == 0 || member.ranks > MAX_RANKS_PER_MEMBER {
            return Err(ElasticError::Rejected(format!(
                "member {:?} holds {} ranks; a member holds 1 to {MAX_RANKS_PER_MEMBER}",
                member.id, member.ranks
            )));
        }
        let (core, runtime) = Core::connect(url, &member.job, Some(&member.id), settings, shared)?;
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
        runtime.spawn(core.clone().follow());
        runtime.spawn(plane.clone().lead());
        runtime.spawn(plane.clone().decide());
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

    /// The connection this member's calls go through (for tests that set up what
    /// its mirror says).
    #[cfg(test)]
    pub(super) fn core(&self) -> &Arc<Core> {
        &self.inner.core
    }

    /// Retries `write` (cancel-aware, with backoff) until it succeeds.
    pub(super) fn until_written(
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

    pub(super) fn lost(&self, mirror: &Mirror) -> bool {
        if self.inner.lease_lost.load(Ordering::SeqCst) {
            return true;
        }
        let written_at = self.inner.record().2;
        mirror.synced && written_at > 0 && mirror.revision >= written_at && mirror.mine.is_none()
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

pub(super) fn boxed<'a>(
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
                            .then(|| rules::on_leave_running(current, &id, &plane.config))
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
            && self.inner.config.policy().hung(progress)
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
                            .then(|| rules::on_hung(current, &id, idle))
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
                    mirror.current(),
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
        if ends_membership(report) {
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

    fn commit_snapshot(&self, generation: u64, record: &str) -> Result<(), ElasticError> {
        check_snapshot_record(record)?;
        let plane = self.inner.clone();
        let record = record.to_owned();
        self.inner.core.call(async move {
            plane
                .core
                .commit_snapshot(&plane.me.id, generation, record)
                .await
        })
    }

    fn committed_snapshot(&self) -> Result<Option<String>, ElasticError> {
        let core = self.inner.core.clone();
        self.inner
            .core
            .call(async move { core.committed_snapshot().await })
    }

    fn hold(&self, ranks: usize) -> Result<(), ElasticError> {
        if ranks == 0 || ranks > MAX_RANKS_PER_MEMBER {
            return Err(ElasticError::Rejected(format!(
                "a member holds 1 to {MAX_RANKS_PER_MEMBER} ranks, not {ranks}"
            )));
        }
        self.inner.update(|r| r.member.ranks = ranks);
        let plane = self.inner.clone();
        match self.inner.core.call(async move { plane.publish().await }) {
            // The record stays marked unwritten: the next heartbeat writes it.
            Err(ElasticError::Io(e)) => {
                debug!(error = %e, ranks, "the ranks this member holds are not written yet");
                Ok(())
            }
            other => other,
        }
    }

    fn kv_all(
        &self,
        generation: u64,
        known: usize,
        timeout: Duration,
    ) -> Result<Vec<(String, String)>, ElasticError> {
        self.inner.core.wait(
            None,
            Some(Instant::now() + timeout),
            |mirror| {
                if mirror.kv_count.get(&generation).is_some_and(|&n| n > known) {
                    return Some(Ok(mirror.kv_of(generation)));
                }
                let current = mirror.current();
                if let GenState::Shutdown { reason } = &current.state {
                    return Some(Err(ElasticError::Shutdown(reason.clone())));
                }
                (current.generation > generation
                    || current.generation == generation && !current.is_running())
                .then(|| Err(ElasticError::generation_over(generation, "*")))
            },
            || Ok(Vec::new()),
        )
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
