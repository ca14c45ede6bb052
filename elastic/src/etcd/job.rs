//! [`EtcdJob`]: a launcher's handle on a job kept in etcd (the job's settings, the
//! generations seen as events, the end of the job, and leases for processes that
//! join as members of their own).
//!
//! Apart from the member side because this handle takes no part in the rules: it
//! publishes settings and watches the generation record (a launcher's node joins as
//! a member through an [`EtcdControlPlane`](super::EtcdControlPlane) of its own).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tracing::debug;

use super::EtcdUrl;
use super::rules::{GenState, JobConfig};
use super::store::{Core, EtcdSettings, Runtime, settings_of};
use crate::{CoordinatorConfig, ElasticError, Event, JobOver};

/// A launcher's handle on a job kept in etcd: publishes (or adopts) the job's
/// settings, reports the generations it sees as [`Event`]s, and grants and revokes
/// leases for processes it starts as members of their own.
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
        let (core, runtime) = Core::connect(url, &config.job, None, settings, None)?;
        let mine = JobConfig::from_coordinator(config);
        let deadline = Instant::now() + core.settings.connect_timeout;
        let (config, adopted) = {
            let core2 = core.clone();
            core.call(async move { settings_of(&core2, Some(&mine), deadline).await })?
        };
        runtime.spawn(core.clone().follow());
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

    /// Grants a lease for a process that joins as a member of its own (its time to
    /// live is the job's heartbeat timeout; `CKPT_ETCD_LEASE` hands it over).
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

    /// Generations formed and ended, members that left, and a shutdown, seen so far,
    /// oldest first.
    pub fn events(&self) -> Vec<Event> {
        self.core.lock().events.clone()
    }

    /// Blocks until an event (past or future) satisfies `predicate`, or `timeout`
    /// passes (as [`CoordinatorHandle::wait_for_event`](crate::CoordinatorHandle::wait_for_event)).
    pub fn wait_for_event(
        &self,
        timeout: Duration,
        mut predicate: impl FnMut(&Event) -> bool,
    ) -> Option<Event> {
        let found = self.core.wait(
            None,
            Some(Instant::now() + timeout),
            |mirror| {
                let event = mirror.events.iter().find(|e| predicate(e))?;
                Some(Ok(Some(event.clone())))
            },
            || Ok(None),
        );
        found.ok().flatten()
    }

    /// Why the job is over, once this launcher has seen it end (finished, or shut
    /// down); `None` while it may still train.
    pub fn job_over(&self) -> Option<JobOver> {
        let current = self.core.lock().current().clone();
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
