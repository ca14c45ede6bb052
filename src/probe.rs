//! A quick check that a store URL supports everything ckpt needs.
//!
//! Before a week-long run it is worth knowing that the bucket is reachable, the
//! credentials allow writes and deletes, and the backend honours create-if-absent
//! (the commit primitive). [`probe`] exercises each operation once under a scratch
//! prefix, removes what it wrote, and reports per step.

use std::time::Instant;

use bytes::Bytes;
use ckpt_storage::{ErrorKind, Store};
use serde::Serialize;

/// Scratch prefix the probe writes under (removed afterwards).
pub const PROBE_PREFIX: &str = ".ckpt-probe";

/// Outcome of one probe step.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeStep {
    /// What was checked.
    pub step: &'static str,
    /// True when the store behaved as ckpt requires.
    pub ok: bool,
    /// Wall time of the step in milliseconds.
    pub ms: f64,
    /// Why the step failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Outcome of a whole probe.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// The store's canonical URL.
    pub url: String,
    /// The steps, in the order run.
    pub steps: Vec<ProbeStep>,
}

impl ProbeReport {
    /// True when every step passed.
    pub fn ok(&self) -> bool {
        self.steps.iter().all(|s| s.ok)
    }
}

/// Runs every check against `store`. Stops at the first failure, since later steps
/// depend on earlier ones, but always tries to clean up.
pub async fn probe(store: &Store) -> ProbeReport {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir = format!("{PROBE_PREFIX}/{}-{nanos}", std::process::id());
    let small = format!("{dir}/small");
    let large = format!("{dir}/large");
    let commit = format!("{dir}/commit");
    let payload = Bytes::from_static(b"ckpt probe payload");
    let large_len = store.config().part_size + 1;

    let mut report = ProbeReport {
        url: store.url().to_string(),
        steps: Vec::new(),
    };
    let steps: [(&'static str, StepFn<'_>); 6] = [
        (
            "put",
            Box::pin(async { store.put(&small, payload.clone()).await }),
        ),
        (
            "ranged read",
            Box::pin(async {
                let got = store.get_ranges(&small, &[0..4, 5..10]).await?;
                if got[0] == payload[0..4] && got[1] == payload[5..10] {
                    Ok(())
                } else {
                    Err(ckpt_storage::Error::new(
                        ErrorKind::Permanent,
                        format!("ranged read of {small} returned other bytes than written"),
                    ))
                }
            }),
        ),
        (
            "multipart upload",
            Box::pin(async {
                let mut upload = store.upload(&large)?;
                upload.write(vec![7u8; large_len]).await?;
                upload.finish().await?;
                let size = store.head(&large).await?.size;
                if size == large_len as u64 {
                    Ok(())
                } else {
                    Err(ckpt_storage::Error::new(
                        ErrorKind::Permanent,
                        format!("{large} has {size} bytes after upload, expected {large_len}"),
                    ))
                }
            }),
        ),
        (
            "create-if-absent",
            Box::pin(async {
                store.put_if_absent(&commit, payload.clone()).await?;
                match store.put_if_absent(&commit, payload.clone()).await {
                    Err(e) if e.is_already_exists() => Ok(()),
                    Err(e) => Err(e),
                    Ok(()) => Err(ckpt_storage::Error::new(
                        ErrorKind::Config,
                        format!(
                            "a second create of {commit} succeeded: this backend does not honour create-if-absent, so concurrent commits are unsafe"
                        ),
                    )),
                }
            }),
        ),
        (
            "list",
            Box::pin(async {
                let listed = store.list(&dir).await?;
                if listed.len() == 3 {
                    Ok(())
                } else {
                    Err(ckpt_storage::Error::new(
                        ErrorKind::Permanent,
                        format!("listing {dir} found {} objects, expected 3", listed.len()),
                    ))
                }
            }),
        ),
        (
            "delete",
            Box::pin(async { store.delete_prefix(&dir).await.map(|_| ()) }),
        ),
    ];
    let mut failed = false;
    for (name, step) in steps {
        if failed {
            break;
        }
        let start = Instant::now();
        let result = step.await;
        failed = result.is_err();
        report.steps.push(ProbeStep {
            step: name,
            ok: result.is_ok(),
            ms: start.elapsed().as_secs_f64() * 1e3,
            error: result.err().map(|e| e.to_string()),
        });
    }
    if failed {
        let _ = store.delete_prefix(&dir).await;
    }
    report
}

type StepFn<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<(), ckpt_storage::Error>> + Send + 'a>,
>;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn probe_passes_on_memory_and_leaves_nothing() {
        let store = Store::from_url("memory://probe-test").unwrap();
        let report = probe(&store).await;
        assert!(report.ok(), "{report:?}");
        assert_eq!(report.steps.len(), 6);
        assert!(store.list("").await.unwrap().is_empty());
    }
}
