//! The job's committed snapshot record in etcd: one key, `snapshot`, beside the
//! job's settings and not under any generation, so that it outlives the generation
//! that wrote it (the bootstrap keys under `g/N/` are deleted two generations
//! later; this one never is).
//!
//! # The fence
//!
//! A commit is one transaction that writes the key only if the generation record
//! is still at the revision this member read it at, and that record says the
//! committing generation runs with this member in it. A member of an older
//! generation (hung, partitioned, slow) therefore cannot write the record, however
//! late its commit reaches etcd: the record it would have to compare against has
//! moved on. The transaction also compares the snapshot key's own revision, so that
//! two commits of one generation cannot interleave with the check that a newer
//! generation's record is never replaced.
//!
//! Nobody watches the key (it sorts outside the range members watch): it is read
//! when asked for, once per re-formation, not on every commit.

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::mirror::MAX_VALUE;
use super::store::Core;
use crate::{ElasticError, snapshot_not_running, snapshot_superseded};

/// Attempts at a commit whose comparison keeps failing (the generation record or
/// the snapshot key changed between the read and the write) before giving up.
const ATTEMPTS: usize = 16;

/// The value of the `snapshot` key.
#[derive(Debug, Serialize, Deserialize)]
struct Stored {
    /// The generation that committed it.
    generation: u64,
    /// What the member committed.
    record: String,
}

impl Core {
    /// Writes `record` as the job's committed snapshot for `generation`, fenced by
    /// the generation record (see the module docs). `member`: who commits; it must
    /// be in `generation`.
    pub(super) async fn commit_snapshot(
        &self,
        member: &str,
        generation: u64,
        record: String,
    ) -> Result<(), ElasticError> {
        let gen_key = self.keys.generation();
        let key = self.keys.snapshot();
        let value = serde_json::to_vec(&Stored { generation, record }).map_err(|e| {
            ElasticError::Rejected(format!("cannot encode the snapshot record: {e}"))
        })?;
        for _ in 0..ATTEMPTS {
            let gen_revision = {
                let mirror = self.lock();
                let current = mirror.current();
                if current.generation != generation || !current.is_running() {
                    let running = current.is_running().then_some(current.generation);
                    return Err(snapshot_not_running(generation, running));
                }
                if current.assignment(member).is_none() {
                    return Err(ElasticError::Rejected(format!(
                        "member {member:?} is not in generation {generation}; its snapshot record is not committed"
                    )));
                }
                mirror.gen_revision
            };
            let (stored, snapshot_revision) = self.read_snapshot().await?;
            if let Some(newer) = stored.filter(|s| s.generation > generation) {
                return Err(snapshot_superseded(generation, newer.generation));
            }
            let snapshot_unchanged = if snapshot_revision == 0 {
                Compare::create_revision(key.clone(), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(key.clone(), CompareOp::Equal, snapshot_revision)
            };
            let txn = Txn::new()
                .when(vec![
                    Compare::mod_revision(gen_key.clone(), CompareOp::Equal, gen_revision),
                    snapshot_unchanged,
                ])
                .and_then(vec![TxnOp::put(key.clone(), value.clone(), None)]);
            let response = self
                .request_any("transaction", |mut client| {
                    let txn = txn.clone();
                    async move { client.txn(txn).await }
                })
                .await?;
            if response.succeeded() {
                return Ok(());
            }
            // The generation record moved (a report, a re-formation) or another
            // commit landed: look again.
            self.reread_generation().await?;
        }
        Err(ElasticError::Io(format!(
            "the generation record or the snapshot record kept changing under {ATTEMPTS} attempts to commit generation {generation}'s snapshot record"
        )))
    }

    /// The job's newest committed snapshot record, if any.
    pub(super) async fn committed_snapshot(&self) -> Result<Option<String>, ElasticError> {
        Ok(self.read_snapshot().await?.0.map(|stored| stored.record))
    }

    /// The snapshot key's value and its revision (0: absent). A value that is not
    /// a record (garbage, or too large) reads as none, with a warning: a reader
    /// then restores from the store, and the next commit replaces it.
    async fn read_snapshot(&self) -> Result<(Option<Stored>, i64), ElasticError> {
        let key = self.keys.snapshot();
        let response = self
            .request_any("read", |mut client| {
                let key = key.clone();
                async move { client.get(key, None).await }
            })
            .await?;
        let Some(kv) = response.kvs().first() else {
            return Ok((None, 0));
        };
        let stored = if kv.value().len() > MAX_VALUE {
            warn!(
                key,
                bytes = kv.value().len(),
                "oversized snapshot record in etcd; ignored"
            );
            None
        } else {
            match serde_json::from_slice::<Stored>(kv.value()) {
                Ok(stored) => Some(stored),
                Err(e) => {
                    warn!(key, error = %e, "unreadable snapshot record in etcd; ignored");
                    None
                }
            }
        };
        Ok((stored, kv.mod_revision()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use crate::{
        Cancel, ControlPlane, CoordinatorConfig, ElasticError, EtcdControlPlane, EtcdJob,
        EtcdSettings, EtcdUrl, Member, Report,
    };

    /// The transaction, not only the member's own view, is the fence: a member whose
    /// mirror still shows its generation running (cut off from the watch, or slow to
    /// read it) is refused by etcd once the generation record moved on.
    #[test]
    fn a_member_whose_view_is_behind_cannot_commit_for_a_generation_etcd_has_ended() {
        if !ckpt_testkit::has(ckpt_testkit::Capability::Etcd) {
            return;
        }
        let url = EtcdUrl::parse(&ckpt_testkit::env("CKPT_TEST_ETCD")).unwrap();
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let job = format!("snapshot-fence-{}-{}", std::process::id(), nanos.as_nanos());
        let mut config = CoordinatorConfig::new(job.clone(), 1, 1);
        config.timeouts.last_call = Duration::from_millis(100);
        config.timeouts.heartbeat_timeout = Duration::from_secs(2);
        let _launcher = EtcdJob::connect(&url, &config, EtcdSettings::default()).unwrap();
        let member = Member::new(job, "m0", "127.0.0.1", "n0");
        let plane = EtcdControlPlane::connect(&url, member, None, EtcdSettings::default()).unwrap();
        let g1 = plane.rendezvous(0, &Cancel::new()).unwrap().generation;
        plane.commit_snapshot(g1, "step 10").unwrap();
        let behind = {
            let mirror = plane.core().lock();
            (mirror.current.clone(), mirror.gen_revision)
        };
        let failed = Report::CollectiveFailed {
            peer: None,
            reason: "test".into(),
        };
        plane.report(g1, &failed).unwrap();
        let g2 = plane.rendezvous(g1, &Cancel::new()).unwrap().generation;
        assert!(g2 > g1);
        // The member's view goes back to generation g1 running.
        {
            let mut mirror = plane.core().lock();
            (mirror.current, mirror.gen_revision) = behind;
        }
        let requests = plane.requests();
        let stale = plane.commit_snapshot(g1, "step 11 (stale)");
        let expected = format!("generation {g1} is not running (generation {g2} is running)");
        assert!(
            matches!(&stale, Err(ElasticError::Rejected(why)) if why.starts_with(&expected)),
            "{stale:?}"
        );
        // It was etcd that refused: the snapshot read, the transaction that lost
        // its comparison, and the re-read of the generation record went out.
        assert!(
            plane.requests() >= requests + 3,
            "refused before asking etcd: the member's view was not behind"
        );
        assert_eq!(
            plane.committed_snapshot().unwrap().as_deref(),
            Some("step 10")
        );
    }
}
