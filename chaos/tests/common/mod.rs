//! What the tests against the S3-compatible test server share: its address, and
//! stores on a prefix of their own reached at an endpoint (the server's, or a fault
//! proxy's in front of it).

use std::time::Duration;

use ckpt::storage::{RetrySettings, Store, StoreConfig};

/// The server and bucket the test command started (`CKPT_TEST_S3_ENDPOINT`,
/// `CKPT_TEST_S3_BUCKET`); `None` without them, as ckpt-testkit's skip policy says.
pub(crate) fn server() -> Option<(String, String)> {
    if !ckpt_testkit::has(ckpt_testkit::Capability::Servers) {
        return None;
    }
    Some((
        ckpt_testkit::env("CKPT_TEST_S3_ENDPOINT"),
        ckpt_testkit::env("CKPT_TEST_S3_BUCKET"),
    ))
}

/// A prefix no other run uses.
pub(crate) fn unique_prefix(name: &str) -> String {
    ckpt_testkit::unique(&format!("chaos-{name}"))
}

/// Settings for the server reached at `endpoint`, giving up on a request after
/// `max_retries` retries, fast.
pub(crate) fn config_at(endpoint: &str, max_retries: usize) -> StoreConfig {
    let config = StoreConfig {
        retry: RetrySettings {
            max_retries,
            init_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(100),
            ..RetrySettings::default()
        },
        ..StoreConfig::default()
    };
    ckpt_testkit::s3_config(endpoint, config)
}

/// The steps committed in `store`, in commit order.
pub(crate) async fn committed_steps(store: &Store) -> Vec<u64> {
    ckpt::catalog::commits(store)
        .await
        .unwrap()
        .iter()
        .map(|c| c.step)
        .collect()
}
