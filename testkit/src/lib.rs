//! Shared fixtures of the end-to-end tests: stores, deterministic tensors, saving a
//! whole world in one process, reading tensors back, child processes ([`child`]), a
//! private etcd cluster ([`etcd`]).
//!
//! The S3 store is the loopback server that `scripts/test` starts and announces
//! through `CKPT_TEST_S3_*` variables; a missing variable fails the test with a
//! message pointing at `scripts/test` (nothing is skipped silently).

#![allow(dead_code, unreachable_pub, missing_docs)]

pub mod child;
pub mod etcd;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ckpt::storage::{RetrySettings, Store, StoreConfig};
use ckpt::{
    CheckpointConfig, CheckpointReader, Checkpointer, DType, LoadRequest, Region, State, as_bytes,
};

/// A prefix no other test (in this or a concurrent run) uses.
pub fn unique(name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{name}-{}-{nanos}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Store settings of the tests: 5 MiB parts (so a few MiB of tensors already make a
/// multipart upload) and quick retries.
pub fn test_config() -> StoreConfig {
    StoreConfig {
        retry: RetrySettings {
            max_retries: 3,
            retry_timeout: Duration::from_secs(20),
            init_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(200),
            backoff_base: 2.0,
        },
        part_size: ckpt::storage::MIN_PART_SIZE,
        ..StoreConfig::default()
    }
}

/// A local store in a fresh temporary directory (kept alive by the returned guard).
pub fn local_store(name: &str) -> (Store, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix(&format!("ckpt-{name}-"))
        .tempdir()
        .expect("temp dir");
    (open_local(dir.path()), dir)
}

/// The `file://` store rooted at `dir`.
pub fn open_local(dir: &std::path::Path) -> Store {
    Store::open(&format!("file://{}", dir.display()), test_config()).expect("open local store")
}

/// What a tier of tests needs beyond `cargo test` itself. One policy for all of them
/// ([`has`]): without the capability a test says `SKIPPED` and passes — unless the
/// `CKPT_REQUIRE` variable names it (a comma-separated list, or `all`), and then the
/// test fails. `scripts/test` starts what it can and requires it, so in CI nothing
/// that should run is skipped unnoticed; a plain `cargo test` runs the hermetic tiers
/// (memory and local stores, pure logic) and skips the others loudly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// The loopback object-store servers (S3, GCS and Azure emulators).
    Servers,
    /// A loopback etcd cluster.
    Etcd,
    /// A Python with the safetensors and numpy packages (cross-checks of exports).
    Python,
    /// Network namespaces (root, iproute2, nftables) for partitions.
    Netns,
    /// A CUDA device with its driver (and NCCL where a test says so).
    Gpu,
    /// Root, for what only root may do (mount a small file system to fill it).
    Root,
}

impl Capability {
    /// Its name in `CKPT_REQUIRE`.
    pub fn name(self) -> &'static str {
        match self {
            Capability::Servers => "servers",
            Capability::Etcd => "etcd",
            Capability::Python => "python",
            Capability::Netns => "netns",
            Capability::Gpu => "gpu",
            Capability::Root => "root",
        }
    }

    /// What is missing when it is absent, as far as the environment tells: the
    /// variables `scripts/test` sets. `None` for the capabilities a caller probes
    /// itself ([`has_probed`]).
    fn missing_from_env(self) -> Option<String> {
        let vars: &[&str] = match self {
            Capability::Servers => &[
                "CKPT_TEST_S3_ENDPOINT",
                "CKPT_TEST_S3_BUCKET",
                "CKPT_TEST_GCS_ENDPOINT",
                "CKPT_TEST_AZURE_ENDPOINT",
            ],
            Capability::Etcd => &["CKPT_TEST_ETCD"],
            Capability::Python => &["CKPT_TEST_PYTHON"],
            Capability::Netns | Capability::Gpu | Capability::Root => &[],
        };
        let unset: Vec<&str> = vars
            .iter()
            .copied()
            .filter(|v| std::env::var(v).map_or(true, |value| value.is_empty()))
            .collect();
        (!unset.is_empty()).then(|| {
            format!(
                "{} not set (run `scripts/test`, or source the output of `scripts/test --env`)",
                unset.join(", ")
            )
        })
    }

    /// True when `CKPT_REQUIRE` names it (or says `all`).
    pub fn required(self) -> bool {
        std::env::var("CKPT_REQUIRE").is_ok_and(|list| {
            list.split(',')
                .map(str::trim)
                .any(|item| item == "all" || item == self.name())
        })
    }
}

/// Whether the calling test may use `capability`, judged from the variables
/// `scripts/test` sets (servers, etcd, python); see [`Capability`] for the policy.
/// A test that gets `false` returns at once.
pub fn has(capability: Capability) -> bool {
    has_probed(capability, capability.missing_from_env())
}

/// [`has`] for a capability the caller probed itself: `missing` says what is absent
/// (`None`: it is there).
pub fn has_probed(capability: Capability, missing: Option<String>) -> bool {
    let Some(missing) = missing else {
        return true;
    };
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("this test");
    if capability.required() {
        panic!(
            "{test} needs {} (required by CKPT_REQUIRE): {missing}",
            capability.name()
        );
    }
    eprintln!("SKIPPED: {test} needs {}: {missing}", capability.name());
    false
}

/// A variable set by `scripts/test`; the caller checked [`has`] first.
pub fn env(name: &str) -> String {
    match std::env::var(name) {
        Ok(value) if !value.is_empty() => value,
        _ => panic!("{name} is not set (check `has` for its capability first)"),
    }
}

/// Options that point the S3 builder at the loopback server at `endpoint`.
pub fn s3_config(endpoint: &str, base: StoreConfig) -> StoreConfig {
    base.with_option("aws_endpoint", endpoint)
        .with_option("aws_allow_http", "true")
        .with_option("aws_region", "us-east-1")
        .with_option("aws_access_key_id", "test")
        .with_option("aws_secret_access_key", "test")
}

/// A fresh prefix in the loopback S3 server's bucket, reached at `endpoint`.
pub fn s3_store_at(name: &str, endpoint: &str, base: StoreConfig) -> Store {
    let bucket = env("CKPT_TEST_S3_BUCKET");
    Store::open(
        &format!("s3://{bucket}/{}", unique(name)),
        s3_config(endpoint, base),
    )
    .expect("open s3 store")
}

/// A fresh prefix in the loopback S3 server's bucket.
pub fn s3_store(name: &str) -> Store {
    s3_store_at(name, &env("CKPT_TEST_S3_ENDPOINT"), test_config())
}

/// Deterministic floats, different for every seed (exact in f32: small integers
/// plus a seed-dependent fraction of a power of two).
pub fn floats(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as u32 as f32) / 1024.0 - 8192.0
        })
        .collect()
}

/// Little-endian bytes back into floats.
pub fn to_f32(bytes: &[u8]) -> Vec<f32> {
    assert_eq!(bytes.len() % 4, 0, "{} bytes are not f32s", bytes.len());
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Rows `start..start + rows` of a row-major matrix with `cols` columns.
pub fn rows_of(data: &[f32], cols: usize, start: usize, rows: usize) -> &[f32] {
    &data[start * cols..(start + rows) * cols]
}

/// Columns `start..start + width` of a row-major matrix with `cols` columns, as a
/// row-major box.
pub fn columns_of(data: &[f32], cols: usize, start: usize, width: usize) -> Vec<f32> {
    data.chunks_exact(cols)
        .flat_map(|row| row[start..start + width].iter().copied())
        .collect()
}

/// One global f32 tensor, split on dim 0 over the world when saved.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(name: &str, shape: &[u64], seed: u64) -> Self {
        let len = shape.iter().product::<u64>() as usize;
        Self {
            name: name.to_string(),
            shape: shape.to_vec(),
            data: floats(len, seed),
        }
    }

    /// Elements per row (product of every dimension but the first).
    pub fn row_len(&self) -> usize {
        self.shape[1..].iter().product::<u64>() as usize
    }

    /// Rank `rank`'s even dim-0 shard of `world`.
    pub fn shard(&self, rank: usize, world: usize) -> &[f32] {
        let region = Region::dim0_shard(&self.shape, rank, world);
        rows_of(
            &self.data,
            self.row_len(),
            region.offsets[0] as usize,
            region.lengths[0] as usize,
        )
    }
}

/// The tensors of "step `step`" of a small model: every step has other values.
pub fn model(step: u64, rows: u64) -> Vec<Tensor> {
    vec![
        Tensor::new("layers.0.weight", &[rows, 256], step * 10 + 1),
        Tensor::new("layers.0.bias", &[rows], step * 10 + 2),
        Tensor::new("embed", &[rows / 2 + 3, 16], step * 10 + 3),
    ]
}

/// Rank `rank`'s state: its dim-0 shard of every tensor, plus its own and the global
/// non-tensor state.
pub fn dim0_state(tensors: &[Tensor], step: u64, rank: usize, world: usize) -> State<'_> {
    let mut state = State::new();
    for t in tensors {
        state
            .add_dim0_shard(
                t.name.clone(),
                DType::F32,
                &t.shape,
                rank,
                world,
                as_bytes(t.shard(rank, world)),
            )
            .expect("add shard");
    }
    state.set_rank_json("cursor", serde_json::json!({ "step": step, "rank": rank }));
    state.set_global_json("step", serde_json::json!(step));
    state
}

/// Every rank of `world` saves its dim-0 shards of `tensors` at `step` in this
/// process; returns once the checkpoint is committed.
pub async fn save_world(
    store: &Store,
    step: u64,
    world: usize,
    tensors: &[Tensor],
    configure: impl Fn(&mut CheckpointConfig),
) {
    let mut handles = Vec::new();
    let mut checkpointers = Vec::new();
    for rank in 0..world {
        let mut config = CheckpointConfig::new(rank, world);
        config.run_id = TEST_RUN.to_string();
        configure(&mut config);
        checkpointers.push(Checkpointer::new(store.clone(), config).expect("checkpointer"));
    }
    for (rank, checkpointer) in checkpointers.iter().enumerate() {
        let state = dim0_state(tensors, step, rank, world);
        let outcome = checkpointer.save(step, &state).await.expect("save");
        handles.push(outcome);
    }
    for handle in &handles {
        handle.committed().await.expect("committed");
    }
}

/// Loads every tensor of `reader` whole and checks it against `expected`, element for
/// element.
pub async fn assert_loads(reader: &CheckpointReader, expected: &[Tensor]) {
    let manifest = reader.manifest();
    assert_eq!(
        manifest.tensors.len(),
        expected.len(),
        "tensors of step {}",
        manifest.step
    );
    let loaded = reader
        .load(&LoadRequest::everything(manifest))
        .await
        .expect("load");
    assert_same(&loaded.tensors, expected);
}

/// Whole loaded tensors equal the expected ones, element for element.
pub fn assert_same(loaded: &[ckpt::LoadedTensor], expected: &[Tensor]) {
    for t in expected {
        let got = loaded
            .iter()
            .find(|l| l.name == t.name)
            .unwrap_or_else(|| panic!("{} was not loaded", t.name));
        assert_eq!(got.shape, t.shape, "shape of {}", t.name);
        assert_eq!(got.region, Region::full(&t.shape), "box of {}", t.name);
        let values = to_f32(&got.data);
        assert_eq!(values.len(), t.data.len(), "elements of {}", t.name);
        if let Some(i) = values.iter().zip(&t.data).position(|(a, b)| a != b) {
            panic!(
                "{}: element {i} is {}, saved {}",
                t.name, values[i], t.data[i]
            );
        }
    }
}

/// Waits, up to `limit`, until `check` holds. Only for effects that no API reports
/// (retention runs after [`ckpt::SaveHandle::committed`] returns, and nothing
/// reports its end).
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// (step, committed) of every step directory, oldest first.
pub async fn steps(store: &Store) -> Vec<(u64, bool)> {
    ckpt::list_checkpoints(store)
        .await
        .expect("list checkpoints")
        .into_iter()
        .map(|c| (c.step, c.committed))
        .collect()
}

/// The run id of [`save_world`]'s saves (generation 0): their objects lie in
/// [`step_dir`]`(step)`.
pub const TEST_RUN: &str = "0";

/// The directory of step `step` as [`save_world`] writes it (format v2: the save
/// attempt's directory inside the step's).
pub fn step_dir(step: u64) -> String {
    ckpt::Attempt::new(step, 0, TEST_RUN).unwrap().dir()
}

/// The name of rank `rank`'s data file of step `step` under the local root `root`
/// (format v2 data file names carry a per-save nonce, so it is looked up).
pub fn rank_file_name_in(root: &std::path::Path, step: u64, rank: u32) -> String {
    let prefix = format!("rank-{rank:05}-");
    std::fs::read_dir(root.join(step_dir(step)))
        .expect("the step's attempt directory")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with(&prefix) && n.contains(".safetensors") && !n.contains('#'))
        .unwrap_or_else(|| panic!("no data file of rank {rank} in step {step}"))
}

/// The `ckpt` command line of this workspace (crate `ckpt-cli`), built now if needed.
/// Only that crate's own tests get its path from cargo; the others (the control
/// plane's, the trainer's) build it here, which is a no-op when it is fresh and makes
/// sure it is not a stale copy. Panics, and so fails the test, when it cannot be built.
///
/// `$CKPT_BIN`, when set, is used as it is (the Python tests read the same variable):
/// `scripts/test` points it at the binary its test build just made. Why not build
/// here regardless: a workspace test build unifies features (dev-dependencies',
/// `--features`) that a `cargo build -p ckpt-cli` does not, so that build is a second
/// compile of the CLI and the library under it (about a minute on 2 cores, inside a
/// test's time) and it replaces the binary the test build left in the target folder.
pub fn ckpt_cli() -> PathBuf {
    if let Some(given) = std::env::var_os("CKPT_BIN").filter(|v| !v.is_empty()) {
        let given = PathBuf::from(given);
        assert!(
            given.is_file(),
            "CKPT_BIN={} is not a file",
            given.display()
        );
        return given;
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    // The profile this test was built with, from `<target>/<profile dir>/deps/<exe>`.
    let exe = std::env::current_exe().unwrap();
    let profile = match exe
        .parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .and_then(|name| name.to_str())
    {
        Some("debug") | None => "dev".to_string(),
        Some(other) => other.to_string(),
    };
    let output = Command::new(&cargo)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--quiet", "-p", "ckpt-cli", "--bin", "ckpt"])
        .args(["--profile", &profile, "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cargo:?} to build the ckpt binary: {e}"));
    assert!(
        output.status.success(),
        "building the ckpt binary failed ({})",
        output.status
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let executable = stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["reason"] == "compiler-artifact")
        .filter(|message| message["target"]["name"] == "ckpt")
        .find_map(|message| message["executable"].as_str().map(PathBuf::from));
    let executable = executable
        .unwrap_or_else(|| panic!("cargo built no ckpt executable; its messages:\n{stdout}"));
    assert!(executable.is_file(), "{} is missing", executable.display());
    executable
}
