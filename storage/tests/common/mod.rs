//! Test fixtures: a fresh, empty store on each backend.
//!
//! The remote backends are real servers that `scripts/test` starts on loopback and
//! announces through `CKPT_TEST_*` variables. Without them a test of those backends
//! follows the one skip policy of `ckpt_testkit::has`: SKIPPED, or a failure when
//! `CKPT_REQUIRE` names the servers (as `scripts/test` does). Fixtures that are not
//! about one backend come from ckpt-testkit.

#![allow(dead_code, unreachable_pub, unused_imports)]

use ckpt_storage::{Store, StoreConfig};
pub use ckpt_testkit::{Capability, env, has, s3_config, test_config, unique};

/// The well-known development account of Azurite (documented, not a secret).
pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
pub const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

pub fn s3_store(name: &str, base: StoreConfig) -> Store {
    let endpoint = env("CKPT_TEST_S3_ENDPOINT");
    let bucket = env("CKPT_TEST_S3_BUCKET");
    Store::open(
        &format!("s3://{bucket}/{}", unique(name)),
        s3_config(&endpoint, base),
    )
    .expect("open s3 store")
}

pub fn gcs_store(name: &str, base: StoreConfig) -> Store {
    let endpoint = env("CKPT_TEST_GCS_ENDPOINT");
    let bucket = env("CKPT_TEST_GCS_BUCKET");
    // A service-account key with `disable_oauth`: every request goes to the emulator
    // unsigned. (`google_skip_signature` alone still fetches a token for deletes from
    // the metadata server, which is not on loopback.)
    let key = format!(
        r#"{{"gcs_base_url":"{endpoint}","disable_oauth":true,"client_email":"","private_key":"","private_key_id":""}}"#
    );
    let config = base.with_option("google_service_account_key", key);
    Store::open(&format!("gs://{bucket}/{}", unique(name)), config).expect("open gcs store")
}

pub fn azure_store(name: &str, base: StoreConfig) -> Store {
    let endpoint = env("CKPT_TEST_AZURE_ENDPOINT");
    let container = env("CKPT_TEST_AZURE_CONTAINER");
    let config = base
        .with_option("azure_storage_account_name", AZURITE_ACCOUNT)
        .with_option("azure_storage_account_key", AZURITE_KEY)
        .with_option(
            "azure_storage_endpoint",
            format!("{endpoint}/{AZURITE_ACCOUNT}"),
        )
        .with_option("azure_allow_http", "true");
    Store::open(&format!("az://{container}/{}", unique(name)), config).expect("open azure store")
}

pub fn memory_store(name: &str, base: StoreConfig) -> Store {
    Store::open(&format!("memory://{}", unique(name)), base).expect("open memory store")
}

/// A local store in a fresh temporary directory (kept alive by the returned guard).
pub fn local_store(name: &str, base: StoreConfig) -> (Store, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix(&format!("ckpt-{name}-"))
        .tempdir()
        .expect("temp dir");
    let store =
        Store::open(&format!("file://{}", dir.path().display()), base).expect("open local store");
    (store, dir)
}

/// The GCS emulator accepts writes only through its JSON API (object_store writes
/// through the XML API, which it lacks), so GCS tests seed objects this way.
pub async fn gcs_seed(store: &Store, key: &str, data: &[u8]) {
    let endpoint = env("CKPT_TEST_GCS_ENDPOINT");
    let bucket = env("CKPT_TEST_GCS_BUCKET");
    let prefix = store
        .url()
        .strip_prefix(&format!("gs://{bucket}/"))
        .expect("gcs test store url");
    let name = format!("{prefix}/{key}");
    let url = url::Url::parse_with_params(
        &format!("{endpoint}/upload/storage/v1/b/{bucket}/o"),
        &[("uploadType", "media"), ("name", name.as_str())],
    )
    .expect("seed url");
    let response = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/octet-stream")
        .body(data.to_vec())
        .send()
        .await
        .expect("seed gcs object");
    assert!(
        response.status().is_success(),
        "seeding gs://{bucket}/{name} failed: {}",
        response.status()
    );
}

/// Deterministic pseudo-random bytes (xorshift), so a mismatch is reproducible.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}
