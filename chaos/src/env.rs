//! What a scenario runs in: its checkpoint store, its control plane, its network.
//!
//! Each is a real part set up for the run and torn down after it: a directory or a
//! tmpfs mounted for the run, or a prefix of the S3-compatible test server reached
//! through the fault-injecting [`StorageProxy`]; a private etcd cluster; network
//! namespaces joined by a bridge. When the machine cannot provide one (not root, no
//! S3 server configured, etcd not installed), the scenario is skipped with that
//! reason, loudly, instead of being run without the fault it is about.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ckpt::storage::{Store, StoreConfig};

use crate::etcd::{Cluster, find_etcd};
use crate::netns::Network;
use crate::scenario::{CoordinatorKind, Scenario, StorageKind};
use crate::shim::FaultShim;
use crate::storage_proxy::StorageProxy;

/// Why a scenario cannot run here, or what broke while setting it up.
#[derive(Debug)]
pub enum Unavailable {
    /// The machine lacks something the scenario needs; the scenario is skipped.
    Skip(String),
    /// Setting up failed.
    Error(String),
}

/// The S3-compatible server chaos runs use: `CKPT_CHAOS_S3_ENDPOINT` and
/// `CKPT_CHAOS_S3_BUCKET`, else the test command's `CKPT_TEST_S3_ENDPOINT` and
/// `CKPT_TEST_S3_BUCKET`.
pub fn s3_server() -> Option<(String, String)> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let endpoint = var("CKPT_CHAOS_S3_ENDPOINT").or_else(|| var("CKPT_TEST_S3_ENDPOINT"))?;
    let bucket = var("CKPT_CHAOS_S3_BUCKET")
        .or_else(|| var("CKPT_TEST_S3_BUCKET"))
        .unwrap_or_else(|| "ckpt-test".into());
    Some((endpoint, bucket))
}

/// The prepared surroundings of one run; dropping it tears them down.
pub struct Environment {
    /// Checkpoint URL the trainer writes.
    pub url: String,
    /// The local directory behind `url` (file and tmpfs storage).
    pub local_dir: Option<PathBuf>,
    /// Options of the harness's own store handle (the oracle reads the server
    /// directly, not through the proxy).
    store_options: Vec<(String, String)>,
    /// Environment of every launcher (and so of every rank).
    pub launcher_env: Vec<(String, String)>,
    /// The fault-injecting proxy in front of S3.
    pub proxy: Option<StorageProxy>,
    /// The private etcd cluster.
    pub etcd: Option<Cluster>,
    /// The network namespaces, one per node.
    pub network: Option<Network>,
    /// The fault shim preloaded into every launcher and rank (`io-error`,
    /// `net-delay`).
    pub shim: Option<FaultShim>,
    mount: Option<PathBuf>,
}

impl Environment {
    /// Sets up what `scenario` needs, with its local files under `scratch`.
    pub fn prepare(scenario: &Scenario, scratch: &Path) -> Result<Environment, Unavailable> {
        let _ = std::fs::remove_dir_all(scratch);
        std::fs::create_dir_all(scratch)
            .map_err(|e| Unavailable::Error(format!("{}: {e}", scratch.display())))?;
        // Every run's processes prove a secret of the run's own, as a job's would
        // on a shared cluster: launchers, the coordinator and the ranks.
        let secret =
            ckpt_auth::JobSecret::generate_text().map_err(|e| Unavailable::Error(e.to_string()))?;
        let mut env = Environment {
            url: String::new(),
            local_dir: None,
            store_options: Vec::new(),
            launcher_env: vec![(ckpt_auth::SECRET_ENV.to_owned(), secret)],
            proxy: None,
            etcd: None,
            network: None,
            shim: None,
            mount: None,
        };
        // First the nodes' network, so that the servers the nodes reach (the
        // storage proxy, etcd) listen where its namespaces can reach them.
        if scenario.faults.iter().any(|f| f.kind.needs_network()) {
            crate::netns::remove_stale();
            env.network = Some(Network::create(scenario.nodes).map_err(Unavailable::Skip)?);
        }
        let servers_ip = env
            .network
            .as_ref()
            .map_or(IpAddr::from([127, 0, 0, 1]), Network::host_ip);
        let dir = scratch.join("checkpoints");
        match scenario.storage {
            StorageKind::File => {
                env.url = format!("file://{}", dir.display());
                env.local_dir = Some(dir);
            }
            StorageKind::Tmpfs => {
                std::fs::create_dir_all(&dir)
                    .map_err(|e| Unavailable::Error(format!("{}: {e}", dir.display())))?;
                let size = format!("size={}m", scenario.disk_mib.unwrap_or(16));
                let output = Command::new("mount")
                    .args(["-t", "tmpfs", "-o", &size, "ckpt-chaos"])
                    .arg(&dir)
                    .output()
                    .map_err(|e| Unavailable::Skip(format!("mount: {e}")))?;
                if !output.status.success() {
                    return Err(Unavailable::Skip(format!(
                        "cannot mount a tmpfs for the full-disk fault (needs root): {}",
                        String::from_utf8_lossy(&output.stderr).trim()
                    )));
                }
                env.mount = Some(dir.clone());
                env.url = format!("file://{}", dir.display());
                env.local_dir = Some(dir);
            }
            StorageKind::S3 => {
                let (endpoint, bucket) = s3_server().ok_or_else(|| {
                    Unavailable::Skip(
                        "no S3-compatible server: set CKPT_CHAOS_S3_ENDPOINT (or run under scripts/test)"
                            .into(),
                    )
                })?;
                let proxy = StorageProxy::start_on(&endpoint, servers_ip)
                    .map_err(|e| Unavailable::Error(format!("starting the storage proxy: {e}")))?;
                env.url = format!(
                    "s3://{bucket}/chaos-{}-{}",
                    std::process::id(),
                    crate::run::unix_ms()
                );
                for (key, value) in [
                    ("aws_allow_http", "true"),
                    ("aws_region", "us-east-1"),
                    ("aws_access_key_id", "test"),
                    ("aws_secret_access_key", "test"),
                ] {
                    env.store_options.push((key.into(), value.into()));
                    env.launcher_env
                        .push((key.to_ascii_uppercase(), value.into()));
                }
                env.store_options
                    .push(("aws_endpoint".into(), endpoint.clone()));
                env.launcher_env
                    .push(("AWS_ENDPOINT".into(), proxy.endpoint()));
                env.proxy = Some(proxy);
            }
        }
        if scenario.coordinator == CoordinatorKind::Etcd {
            let bin = find_etcd().map_err(Unavailable::Skip)?;
            env.etcd = Some(Cluster::start_on(&bin, servers_ip).map_err(Unavailable::Error)?);
        }
        if scenario.faults.iter().any(|f| f.kind.needs_shim()) {
            let library = crate::shim::find_library().map_err(Unavailable::Skip)?;
            let checkpoints = env
                .local_dir
                .clone()
                .unwrap_or_else(|| scratch.to_path_buf());
            std::fs::create_dir_all(&checkpoints)
                .map_err(|e| Unavailable::Error(format!("{}: {e}", checkpoints.display())))?;
            let shim = FaultShim::create(library, &scratch.join("fault-shim"), &checkpoints)
                .map_err(|e| Unavailable::Error(format!("the fault shim's control file: {e}")))?;
            env.shim = Some(shim);
        }
        Ok(env)
    }

    /// Remounts the run's tmpfs read-only (`true`) or read-write again. A tmpfs
    /// with a file open for writing refuses to become read-only (EBUSY): the
    /// remount is tried again until `patience` has passed, as an operator's would.
    pub fn remount(&self, read_only: bool, patience: Duration) -> Result<(), String> {
        let dir = self
            .mount
            .as_ref()
            .ok_or("no tmpfs to remount (storage = \"tmpfs\")")?;
        let mode = if read_only {
            "remount,ro"
        } else {
            "remount,rw"
        };
        let deadline = Instant::now() + patience;
        loop {
            let output = Command::new("mount")
                .args(["-o", mode])
                .arg(dir)
                .output()
                .map_err(|e| format!("mount: {e}"))?;
            if output.status.success() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "mount -o {mode} {}: {}",
                    dir.display(),
                    String::from_utf8_lossy(&output.stderr).trim()
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The harness's own handle on the run's checkpoints.
    pub fn store(&self) -> Result<Store, String> {
        let config = self
            .store_options
            .iter()
            .fold(StoreConfig::default(), |c, (k, v)| c.with_option(k, v));
        Store::open(&self.url, config).map_err(|e| format!("{}: {e}", self.url))
    }
}

impl Drop for Environment {
    fn drop(&mut self) {
        if let Some(dir) = self.mount.take() {
            let _ = Command::new("umount").arg("-l").arg(&dir).status();
        }
    }
}
