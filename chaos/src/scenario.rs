//! Scenarios as TOML files: the job to run, the faults to inject, what to expect.
//!
//! A scenario is data, not code, so that a failure found by a seeded soak can be
//! written out and replayed as it was, and kept as a regression case.
//!
//! ```toml
//! description = "SIGKILL one of 4 ranks mid-step; the 3 survivors finish"
//! ranks = 4          # rank processes per node
//! nodes = 1
//! min_ranks = 2
//! preset = "tiny"
//! steps = 40
//! ckpt_every = 5
//! step_pause_ms = 30 # slows each step, so faults land mid-run
//!
//! [[fault]]
//! kind = "kill"      # see FaultKind: process, save-stage, network, storage, control plane
//! rank = 2           # node × ranks + local rank, as the launcher labels it
//! at_step = 12       # when rank 0 reports this step (or at_ms: after the start)
//!
//! [expect]
//! final_world = 3
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

/// One fault scenario.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// What the scenario shows, in a sentence.
    #[serde(default)]
    pub description: String,
    /// Rank processes per node (per launcher).
    pub ranks: usize,
    /// Launchers, one per simulated node.
    #[serde(default = "one")]
    pub nodes: usize,
    /// Fewest ranks the job trains with (`--min-ranks`).
    pub min_ranks: usize,
    /// Relaunches each launcher may make of its failed ranks (`--max-restarts`).
    #[serde(default)]
    pub max_restarts: usize,
    /// The trainer's model preset.
    #[serde(default = "tiny")]
    pub preset: String,
    /// Seed of the model and data.
    #[serde(default = "seven")]
    pub seed: u64,
    /// Steps to train.
    pub steps: u64,
    /// Checkpoint interval in steps.
    pub ckpt_every: u64,
    /// Snapshot interval in steps (`ckpt-train --snapshot-every`; 0: none): the
    /// memory tier. The oracle then checks that a resume from a snapshot lost at
    /// most this interval and one step.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub snapshot_every: u64,
    /// Host memory each rank's checkpointing may hold, bytes
    /// (`ckpt-train --host-memory-budget`). The oracle checks every rank's reported
    /// peak against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory_budget: Option<u64>,
    /// Pause after each step (ms), so faults can land between steps.
    #[serde(default)]
    pub step_pause_ms: u64,
    /// Heartbeat timeout (s) of the control plane: how soon a silent rank is lost.
    #[serde(default = "two")]
    pub heartbeat_timeout_secs: u64,
    /// How long the launchers and their ranks keep trying to reach the coordinator
    /// (`--rdzv-connect-timeout-secs`; default: the launcher's, 30 s). A scenario
    /// whose node comes back after the coordinator is gone waits it out, twice (the
    /// launcher, then its ranks): a shorter one checks the same ending sooner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdzv_connect_timeout_secs: Option<u64>,
    /// The control plane: the coordinator node 0's launcher hosts (`hosted`), or a
    /// standalone `ckpt coordinator` process the harness starts (`standalone`, which
    /// `kill-coordinator` faults need).
    #[serde(default)]
    pub coordinator: CoordinatorKind,
    /// Where checkpoints go: local disk (`file`), a small tmpfs (`tmpfs`, for
    /// `disk-full`), or the S3-compatible server behind the fault proxy (`s3`).
    #[serde(default)]
    pub storage: StorageKind,
    /// Size of the tmpfs (`storage = "tmpfs"`), MiB.
    #[serde(default)]
    pub disk_mib: Option<u64>,
    /// Ranks keep in-memory copies of the newest checkpoints and recover from them
    /// (the trainer's default). `false`: every recovery reads the store, so a
    /// `corrupt` fault meets the loader.
    #[serde(default = "yes")]
    pub memory_copies: bool,
    /// Data-parallel replicas of every shard (`ckpt-train --replicas`): the world is
    /// `replicas` × its shards, and every save compares the replicas' copies (`sdc`
    /// faults need 2 or more). A generation whose world it does not divide trains
    /// without replicas.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub replicas: usize,
    /// The faults, in any order; each fires once.
    #[serde(default, rename = "fault")]
    pub faults: Vec<Fault>,
    /// What the run must show besides the oracle's invariants.
    #[serde(default)]
    pub expect: Expect,
    /// The trainer is this Python script under `ckpt launch` instead of `ckpt-train`
    /// (a path relative to the repository root, or absolute), e.g.
    /// `python/examples/train_gpt.py`: it must take the example's flags (`--ckpt`,
    /// `--steps`, `--ckpt-every`, `--seed`, `--log-every`, `--batch`), run through
    /// `ckpt.elastic.run`, print the example's lines and save its data cursor as the
    /// rank state `data.cursor`. Python is `$CKPT_PYTHON`, else `python3`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<String>,
    /// The Python trainer's global batch (`--batch`; default: the example's, 24): the
    /// oracle checks that every committed step's saved cursors are step × batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<u64>,
}

/// The example's default global batch (`python/examples/train_gpt.py --batch`).
pub const DEFAULT_BATCH: u64 = 24;

fn one() -> usize {
    1
}
fn is_one(n: &usize) -> bool {
    *n == 1
}
fn is_zero(n: &u64) -> bool {
    *n == 0
}
fn two() -> u64 {
    2
}
fn yes() -> bool {
    true
}
fn seven() -> u64 {
    7
}
fn tiny() -> String {
    "tiny".into()
}

/// Where the coordinator runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CoordinatorKind {
    /// Hosted by node 0's launcher.
    #[default]
    Hosted,
    /// A `ckpt coordinator` process of its own.
    Standalone,
    /// No coordinator: a 3-member etcd cluster the harness starts (`--rdzv etcd://`),
    /// whose members `kill-etcd-member` faults kill.
    Etcd,
}

/// Where a scenario's checkpoints go.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StorageKind {
    /// A local directory.
    #[default]
    File,
    /// A tmpfs of `disk_mib` MiB mounted for the run (root only), which `disk-full`
    /// fills.
    Tmpfs,
    /// The S3-compatible test server (`CKPT_CHAOS_S3_ENDPOINT` or
    /// `CKPT_TEST_S3_ENDPOINT`), reached through the fault-injecting proxy.
    S3,
}

/// What a fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL one rank process.
    Kill,
    /// SIGSTOP one rank for `duration_ms`, then SIGCONT (a hang, a paused VM).
    Stop,
    /// SIGKILL a whole node: its launcher and every rank it started.
    KillNode,
    /// The rank reports a lost device and leaves (the trainer's failpoint).
    DeviceError,
    /// SIGKILL the standalone coordinator, and start it again on the same address
    /// after `duration_ms`.
    KillCoordinator,
    /// SIGKILL a rank at a `stage` of its first save at or after `at_step`: the rank
    /// stops at that failpoint of the save protocol (the trainer's
    /// `--fault-save-stage`, a build with `ckpt/failpoints`), and the harness kills
    /// it as soon as it says it got there.
    KillInSave,
    /// Drop every packet between a node and the rest (nodes run in network
    /// namespaces; nftables), and heal after `duration_ms`.
    Partition,
    /// The storage proxy answers the next `count` requests with HTTP `status`.
    StorageErrors,
    /// The storage proxy delays the next `count` requests by `duration_ms`.
    StorageLatency,
    /// The storage proxy resets the next `count` connections mid-body.
    StorageReset,
    /// The storage proxy swallows the next `count` multipart parts (answered 200,
    /// never stored).
    StorageLosePart,
    /// The storage proxy inverts one byte in the middle of the next `count` bodies
    /// going `how`: `"put"` (request bodies of PUTs and multipart parts) or `"get"`
    /// (response bodies of ranged GETs, the reads of data blocks and rank parts):
    /// corruption in flight.
    StorageCorrupt,
    /// Fill the tmpfs (`storage = "tmpfs"`) and free it again after `duration_ms`.
    DiskFull,
    /// Damage the newest committed checkpoint at rest: flip a bit of a data file
    /// (`how = "bit-flip"`) or cut it short (`how = "truncate"`). The oracle must find
    /// it, and a recovery must never load it.
    Corrupt,
    /// SIGKILL an etcd member (`member` 0..3) and restart it after `duration_ms`.
    KillEtcdMember,
    /// File calls on the checkpoints fail with EIO for `duration_ms`: writes
    /// (`how = "write"`, with `fsync`) or reads (`how = "read"`), in rank `rank` or,
    /// without one, in every rank (the preloaded `ckpt-fault-shim`).
    IoError,
    /// The checkpoints' file system (`storage = "tmpfs"`) is remounted read-only for
    /// `duration_ms`, then read-write again.
    ReadOnly,
    /// Every send from node `node` to another node waits `delay_ms` first, for
    /// `duration_ms` (the preloaded `ckpt-fault-shim`; nodes run in network
    /// namespaces).
    NetDelay,
    /// Node `node` loses `percent` % of its packets to and from other nodes, the
    /// control plane and the store, at random, for `duration_ms` (nftables in its
    /// namespace).
    NetLoss,
    /// Node `node` is cut off from the store (`storage = "s3"`) for `duration_ms`:
    /// every packet between it and the storage proxy is dropped, both ways.
    PartitionStore,
    /// Node `node` is cut off from etcd (`coordinator = "etcd"`) for `duration_ms`.
    PartitionEtcd,
    /// Silent data corruption: rank `rank` flips one bit of one parameter element in
    /// its memory right before the save of `at_step` (a multiple of `ckpt_every`),
    /// and flips it back once the save has its copy (the trainer's `--fault-sdc`,
    /// in the first generation). Needs `replicas` of 2 or more: the commit compares
    /// the replicas' copies, and must be judged unhealthy naming that rank.
    Sdc,
    /// Rank `rank` writes a NaN into one of its parameters right after `at_step`
    /// (the trainer's `--fault-nan`, once, in the first generation): the commit of
    /// that step (when it saves) must be judged unhealthy naming the rank, the next
    /// step must roll the world back to the newest healthy commit, and training must
    /// end bitwise equal to the failure-free run.
    Nan,
}

impl FaultKind {
    /// Whether the fault needs the nodes in network namespaces.
    pub fn needs_network(self) -> bool {
        matches!(
            self,
            FaultKind::Partition
                | FaultKind::NetDelay
                | FaultKind::NetLoss
                | FaultKind::PartitionStore
                | FaultKind::PartitionEtcd
        )
    }

    /// Whether the fault needs `ckpt-fault-shim` preloaded into the run's processes.
    pub fn needs_shim(self) -> bool {
        matches!(self, FaultKind::IoError | FaultKind::NetDelay)
    }

    /// Whether the trainer sets the fault off itself, at a step of its first
    /// generation (its failpoints), rather than the harness from outside.
    pub fn set_off_by_the_trainer(self) -> bool {
        matches!(
            self,
            FaultKind::DeviceError | FaultKind::KillInSave | FaultKind::Sdc | FaultKind::Nan
        )
    }
}

impl FaultKind {
    /// The name scenario files use.
    pub fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default()
    }
}

/// The stages of a save `kill-in-save` can stop a rank at (the failpoints of
/// `ckpt::failpoint::NAMES`). `before-commit` and `after-commit` happen on the
/// committing rank, rank 0.
pub const SAVE_STAGES: &[&str] = ckpt::failpoint::NAMES;

/// One fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// The rank hit (kill, stop, device-error), by its launcher label.
    #[serde(default)]
    pub rank: Option<usize>,
    /// The node hit (kill-node).
    #[serde(default)]
    pub node: Option<usize>,
    /// Fires when rank 0 reports this step (or a later one).
    #[serde(default)]
    pub at_step: Option<u64>,
    /// Fires this many milliseconds after the run started (instead of `at_step`).
    #[serde(default)]
    pub at_ms: Option<u64>,
    /// Fires when rank 0 reports it started the save of this step (or a later one):
    /// `step N: saving` (the Python trainer) or `saving step N` (`ckpt-train`), so
    /// that the fault lands while that save is in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_save: Option<u64>,
    /// How long the fault lasts: a stop, a partition, a full disk, a coordinator or
    /// etcd member down, a storage delay; for `kill-node`, when set, the node is
    /// started again after it (and the world can grow back).
    #[serde(default)]
    pub duration_ms: Option<u64>,
    /// The save stage (`kill-in-save`).
    #[serde(default)]
    pub stage: Option<String>,
    /// Requests hit (storage faults; default 1).
    #[serde(default)]
    pub count: Option<usize>,
    /// The HTTP status answered (`storage-errors`; default 503).
    #[serde(default)]
    pub status: Option<u16>,
    /// How a checkpoint is damaged (`corrupt`): `bit-flip` or `truncate`; which bodies
    /// `storage-corrupt` damages: `get` or `put`.
    #[serde(default)]
    pub how: Option<String>,
    /// The etcd member killed (`kill-etcd-member`), 0..3.
    #[serde(default)]
    pub member: Option<usize>,
    /// How long each send waits (`net-delay`), ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
    /// The share of packets dropped (`net-loss`), percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent: Option<u32>,
}

impl Fault {
    /// A fault of `kind` at `at_step`, every other field unset.
    pub fn at(kind: FaultKind, at_step: u64) -> Fault {
        Fault {
            kind,
            rank: None,
            node: None,
            at_step: Some(at_step),
            at_ms: None,
            at_save: None,
            duration_ms: None,
            stage: None,
            count: None,
            status: None,
            how: None,
            member: None,
            delay_ms: None,
            percent: None,
        }
    }

    /// What it hits, in words (`rank 2`, `node 1`, `storage`).
    pub fn target(&self) -> String {
        match self.kind {
            FaultKind::KillNode | FaultKind::Partition => {
                format!("node {}", self.node.unwrap_or(0))
            }
            FaultKind::NetDelay => format!(
                "node {} ({} ms a send)",
                self.node.unwrap_or(0),
                self.delay_ms.unwrap_or(0)
            ),
            FaultKind::NetLoss => format!(
                "node {} ({} % of packets)",
                self.node.unwrap_or(0),
                self.percent.unwrap_or(0)
            ),
            FaultKind::PartitionStore => format!("node {} from the store", self.node.unwrap_or(0)),
            FaultKind::PartitionEtcd => format!("node {} from etcd", self.node.unwrap_or(0)),
            FaultKind::IoError => format!(
                "{} {}s",
                self.rank
                    .map_or_else(|| "every rank's".to_owned(), |r| format!("rank {r}'s")),
                self.how.as_deref().unwrap_or("write")
            ),
            FaultKind::ReadOnly => "the checkpoints' file system".into(),
            FaultKind::KillCoordinator => "the coordinator".into(),
            FaultKind::KillEtcdMember => format!("etcd member {}", self.member.unwrap_or(0)),
            FaultKind::StorageErrors
            | FaultKind::StorageLatency
            | FaultKind::StorageReset
            | FaultKind::StorageLosePart => format!("{} storage requests", self.count.unwrap_or(1)),
            FaultKind::StorageCorrupt => format!(
                "{} storage {} bodies",
                self.count.unwrap_or(1),
                self.how.as_deref().unwrap_or("put")
            ),
            FaultKind::DiskFull => "the disk".into(),
            FaultKind::Corrupt => "the newest commit".into(),
            FaultKind::KillInSave => format!(
                "rank {} at {}",
                self.rank.unwrap_or(0),
                self.stage.as_deref().unwrap_or("?")
            ),
            FaultKind::Kill
            | FaultKind::Stop
            | FaultKind::DeviceError
            | FaultKind::Sdc
            | FaultKind::Nan => {
                format!("rank {}", self.rank.unwrap_or(0))
            }
        }
    }
}

/// What a scenario expects of its run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// The world size of the generation that finishes.
    #[serde(default)]
    pub final_world: Option<usize>,
    /// The step the first recovery resumes from.
    #[serde(default)]
    pub resumes_from: Option<u64>,
    /// Whether the first recovery resumes from an in-memory snapshot (`true`) or
    /// from the store (`false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_resume_from_snapshot: Option<bool>,
    /// Recoveries (new generations after the first) at least.
    #[serde(default)]
    pub recoveries_at_least: Option<usize>,
    /// Words the first recovery's cause must contain.
    #[serde(default)]
    pub first_cause_contains: Option<String>,
    /// The whole run (every launcher) ends within this many seconds: a liveness bound,
    /// generous, that catches processes left waiting on a timeout after the job ended.
    #[serde(default)]
    pub ends_within_secs: Option<u64>,
}

/// A scenario that cannot be run, with the reason.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// Unreadable file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Not TOML, or unknown or missing fields.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message (line and column included).
        message: String,
    },
    /// Well-formed but contradictory.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

impl Scenario {
    /// Reads and checks a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: name.clone(),
            source,
        })?;
        let scenario = Scenario::parse(&text).map_err(|message| ScenarioError::Parse {
            path: name.clone(),
            message,
        })?;
        scenario
            .validate()
            .map_err(|message| ScenarioError::Invalid {
                path: name,
                message,
            })?;
        Ok(scenario)
    }

    /// Parses TOML text (not yet validated).
    pub fn parse(text: &str) -> Result<Scenario, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// The scenario as TOML (for replay files).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a scenario serializes")
    }

    /// Every rank process the job starts.
    pub fn world(&self) -> usize {
        self.ranks * self.nodes
    }

    /// The Python trainer's global batch (the cursor advances by it every step).
    pub fn batch(&self) -> u64 {
        self.batch.unwrap_or(DEFAULT_BATCH)
    }

    /// Checks that the scenario makes sense, naming the first thing that does not.
    pub fn validate(&self) -> Result<(), String> {
        let world = self.world();
        if self.ranks == 0 || self.nodes == 0 {
            return Err("ranks and nodes must be at least 1".into());
        }
        if self.min_ranks == 0 || self.min_ranks > world {
            return Err(format!("min_ranks {} must be 1..={world}", self.min_ranks));
        }
        if self.steps == 0 || self.ckpt_every == 0 || self.ckpt_every > self.steps {
            return Err(format!(
                "steps {} and ckpt_every {} must be positive, with ckpt_every <= steps",
                self.steps, self.ckpt_every
            ));
        }
        if self.replicas == 0 || !world.is_multiple_of(self.replicas) {
            return Err(format!(
                "replicas {} must divide the world of {world} ranks",
                self.replicas
            ));
        }
        if self.storage == StorageKind::Tmpfs && self.disk_mib.unwrap_or(0) == 0 {
            return Err("storage = \"tmpfs\" needs disk_mib".into());
        }
        if self.script.is_some() {
            // What only ckpt-train has: refused rather than run without it.
            if self.step_pause_ms > 0 {
                return Err(
                    "step_pause_ms needs ckpt-train's --fault-step-pause-ms: the Python trainer (script) has no such failpoint"
                        .into(),
                );
            }
            if self.preset != "tiny" {
                return Err(format!(
                    "preset {:?} is a ckpt-train preset: the Python trainer (script) has its own model",
                    self.preset
                ));
            }
            if self.replicas > 1 {
                return Err(
                    "replicas is ckpt-train's --replicas, which the Python trainer's command line (script) does not take"
                        .into(),
                );
            }
            if !self.memory_copies {
                return Err(
                    "memory_copies = false is ckpt-train's --memory-copies=false, which the Python trainer's command line (script) does not take"
                        .into(),
                );
            }
            if self.snapshot_every > 0 || self.host_memory_budget.is_some() {
                return Err(
                    "snapshot_every and host_memory_budget are ckpt-train's --snapshot-every and --host-memory-budget, which the Python trainer's command line (script) does not take"
                        .into(),
                );
            }
            let batch = self.batch.unwrap_or(DEFAULT_BATCH);
            if batch < world as u64 {
                return Err(format!(
                    "batch {batch} leaves ranks of a world of {world} without data"
                ));
            }
        } else if self.batch.is_some() {
            return Err("batch is the Python trainer's: it needs script".into());
        }
        for (i, fault) in self.faults.iter().enumerate() {
            let at = |what: String| Err(format!("fault {} ({}): {what}", i + 1, fault.kind.name()));
            let triggers = [fault.at_step, fault.at_ms, fault.at_save];
            match triggers.iter().filter(|t| t.is_some()).count() {
                0 => return at("needs at_step, at_ms or at_save".into()),
                1 => {}
                _ => return at("one of at_step, at_ms and at_save, not several".into()),
            }
            if let Some(s) = fault.at_step
                && (s == 0 || s >= self.steps)
            {
                return at(format!("at_step {s} must be in 1..{}", self.steps));
            }
            if let Some(s) = fault.at_save
                && (s == 0 || s >= self.steps || s % self.ckpt_every != 0)
            {
                return at(format!(
                    "at_save {s} must be a step that is saved before the last: a multiple of ckpt_every {} below {}",
                    self.ckpt_every, self.steps
                ));
            }
            if fault.at_step.is_none() && fault.kind.set_off_by_the_trainer() {
                return at("is set off by the trainer at a step: needs at_step".into());
            }
            if self.script.is_some() && fault.kind.set_off_by_the_trainer() {
                return at(format!(
                    "needs the failpoints of ckpt-train ({}), which the Python trainer (script) does not have{}",
                    match fault.kind {
                        FaultKind::DeviceError => "--fault-device-error",
                        FaultKind::Sdc => "--fault-sdc",
                        FaultKind::Nan => "--fault-nan",
                        _ => "--fault-save-stage",
                    },
                    if fault.kind == FaultKind::KillInSave {
                        "; a kill fault with at_save kills a rank while a save is in flight"
                    } else {
                        ""
                    }
                ));
            }
            let once = |kind: FaultKind| self.faults.iter().filter(|f| f.kind == kind).count() == 1;
            let needs = |what: &str| at(format!("needs {what}"));
            match fault.kind {
                FaultKind::Kill | FaultKind::Stop | FaultKind::DeviceError => match fault.rank {
                    Some(r) if r < world => {}
                    other => return at(format!("rank {other:?} must be below {world}")),
                },
                FaultKind::Sdc | FaultKind::Nan => {
                    match fault.rank {
                        Some(r) if r < world => {}
                        other => return at(format!("rank {other:?} must be below {world}")),
                    }
                    if !once(fault.kind) {
                        return at("one per scenario (the trainer has one such failpoint)".into());
                    }
                    let step = fault.at_step.unwrap_or(0);
                    if fault.kind == FaultKind::Sdc {
                        if self.replicas < 2 {
                            return needs("replicas = 2 or more (the copies a commit compares)");
                        }
                        if !step.is_multiple_of(self.ckpt_every) {
                            return at(format!(
                                "at_step {step} must be a saved step: a multiple of ckpt_every {}",
                                self.ckpt_every
                            ));
                        }
                    }
                }
                FaultKind::KillInSave => {
                    match fault.rank {
                        Some(r) if r < world => {}
                        other => return at(format!("rank {other:?} must be below {world}")),
                    }
                    match fault.stage.as_deref() {
                        Some(stage) if SAVE_STAGES.contains(&stage) => {
                            if stage.contains("commit") && fault.rank != Some(0) {
                                return at(format!(
                                    "{stage} happens on the committing rank: rank 0"
                                ));
                            }
                        }
                        other => {
                            return at(format!(
                                "stage {other:?} must be one of {}",
                                SAVE_STAGES.join(", ")
                            ));
                        }
                    }
                    if !once(FaultKind::KillInSave) {
                        return at("one kill-in-save per scenario (one armed failpoint)".into());
                    }
                }
                FaultKind::KillNode | FaultKind::Partition => match fault.node {
                    Some(n) if n < self.nodes => {}
                    other => return at(format!("node {other:?} must be below {}", self.nodes)),
                },
                FaultKind::KillCoordinator if self.coordinator != CoordinatorKind::Standalone => {
                    return needs("coordinator = \"standalone\"");
                }
                FaultKind::KillEtcdMember => {
                    if self.coordinator != CoordinatorKind::Etcd {
                        return needs("coordinator = \"etcd\"");
                    }
                    if fault.member.is_none_or(|m| m >= 3) {
                        return needs("member 0, 1 or 2");
                    }
                }
                FaultKind::StorageErrors
                | FaultKind::StorageLatency
                | FaultKind::StorageReset
                | FaultKind::StorageLosePart
                | FaultKind::StorageCorrupt
                    if self.storage != StorageKind::S3 =>
                {
                    return needs("storage = \"s3\" (the proxy)");
                }
                FaultKind::StorageCorrupt
                    if !matches!(fault.how.as_deref(), Some("get" | "put")) =>
                {
                    return needs("how = \"get\" or \"put\"");
                }
                FaultKind::DiskFull if self.storage != StorageKind::Tmpfs => {
                    return needs("storage = \"tmpfs\"");
                }
                FaultKind::IoError => {
                    if self.storage == StorageKind::S3 {
                        return needs("storage on local disk (file or tmpfs)");
                    }
                    if !matches!(fault.how.as_deref(), None | Some("read" | "write")) {
                        return needs("how = \"read\" or \"write\"");
                    }
                    if let Some(r) = fault.rank.filter(|&r| r >= world) {
                        return at(format!("rank {r} must be below {world}"));
                    }
                }
                FaultKind::ReadOnly if self.storage != StorageKind::Tmpfs => {
                    return needs("storage = \"tmpfs\"");
                }
                FaultKind::NetDelay if fault.delay_ms.is_none_or(|ms| ms == 0 || ms > 10_000) => {
                    return needs("delay_ms, 1 to 10000");
                }
                FaultKind::NetLoss if fault.percent.is_none_or(|p| p == 0 || p > 100) => {
                    return needs("percent, 1 to 100");
                }
                FaultKind::PartitionStore if self.storage != StorageKind::S3 => {
                    return needs("storage = \"s3\" (the store the node is cut off)");
                }
                FaultKind::PartitionEtcd if self.coordinator != CoordinatorKind::Etcd => {
                    return needs("coordinator = \"etcd\"");
                }
                FaultKind::Corrupt => {
                    if self.storage == StorageKind::S3 {
                        return needs("storage on local disk (file or tmpfs)");
                    }
                    if !matches!(fault.how.as_deref(), Some("bit-flip" | "truncate")) {
                        return needs("how = \"bit-flip\" or \"truncate\"");
                    }
                }
                _ => {}
            }
            if fault.kind.needs_network() {
                match fault.node {
                    Some(n) if n < self.nodes => {}
                    other => return at(format!("node {other:?} must be below {}", self.nodes)),
                }
                let between_nodes = matches!(
                    fault.kind,
                    FaultKind::Partition | FaultKind::NetDelay | FaultKind::NetLoss
                );
                if between_nodes && self.nodes < 2 {
                    return needs("two nodes or more");
                }
                if self.nodes > 1 && self.coordinator == CoordinatorKind::Hosted {
                    return needs(
                        "coordinator = \"standalone\" or \"etcd\" (they listen on the host side of the nodes' bridge)",
                    );
                }
            }
            if fault.kind == FaultKind::KillNode
                && fault.duration_ms.is_some()
                && fault.node == Some(0)
                && self.coordinator == CoordinatorKind::Hosted
            {
                return at(
                    "node 0 hosts the coordinator: it cannot be started again into the same job"
                        .into(),
                );
            }
            if matches!(
                fault.kind,
                FaultKind::Stop
                    | FaultKind::KillCoordinator
                    | FaultKind::Partition
                    | FaultKind::StorageLatency
                    | FaultKind::DiskFull
                    | FaultKind::KillEtcdMember
                    | FaultKind::IoError
                    | FaultKind::ReadOnly
                    | FaultKind::NetDelay
                    | FaultKind::NetLoss
                    | FaultKind::PartitionStore
                    | FaultKind::PartitionEtcd
            ) && fault.duration_ms.is_none()
            {
                return needs("duration_ms");
            }
            if fault.kind == FaultKind::DeviceError && !once(FaultKind::DeviceError) {
                return at("one device-error per scenario (the trainer has one failpoint)".into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KILL: &str = r#"
        description = "kill"
        ranks = 4
        min_ranks = 2
        steps = 40
        ckpt_every = 5
        [[fault]]
        kind = "kill"
        rank = 2
        at_step = 12
        [expect]
        final_world = 3
    "#;

    #[test]
    fn a_scenario_parses_round_trips_and_validates() {
        let s = Scenario::parse(KILL).unwrap();
        assert_eq!(s.world(), 4);
        assert_eq!(s.faults[0].kind, FaultKind::Kill);
        assert_eq!(s.expect.final_world, Some(3));
        s.validate().unwrap();
        assert_eq!(Scenario::parse(&s.to_toml()).unwrap(), s);
    }

    #[test]
    fn bad_scenarios_are_refused_with_the_reason() {
        let unknown = KILL.replace("min_ranks", "min_rank");
        assert!(Scenario::parse(&unknown).unwrap_err().contains("min_rank"));
        for (from, to, why) in [
            ("rank = 2", "rank = 4", "below 4"),
            ("at_step = 12", "at_step = 40", "at_step 40"),
            ("kind = \"kill\"", "kind = \"stop\"", "duration_ms"),
            (
                "kind = \"kill\"",
                "kind = \"kill-coordinator\"",
                "standalone",
            ),
            ("min_ranks = 2", "min_ranks = 5", "min_ranks 5"),
            ("kind = \"kill\"", "kind = \"sdc\"", "replicas = 2 or more"),
            (
                "kind = \"kill\"",
                "kind = \"sdc\"\nat_save = 10",
                "not several",
            ),
            ("min_ranks = 2", "min_ranks = 2\nreplicas = 3", "replicas 3"),
        ] {
            let s = Scenario::parse(&KILL.replace(from, to)).unwrap();
            let e = s.validate().unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn poisons_parse_and_validate() {
        let nan = Scenario::parse(&KILL.replace("kind = \"kill\"", "kind = \"nan\"")).unwrap();
        nan.validate().unwrap();
        assert!(nan.faults[0].kind.set_off_by_the_trainer());
        assert_eq!(nan.faults[0].target(), "rank 2");
        let sdc = KILL
            .replace("min_ranks = 2", "min_ranks = 2\nreplicas = 2")
            .replace("kind = \"kill\"", "kind = \"sdc\"")
            .replace("at_step = 12", "at_step = 10");
        let sdc = Scenario::parse(&sdc).unwrap();
        sdc.validate().unwrap();
        assert_eq!(sdc.replicas, 2);
        assert_eq!(Scenario::parse(&sdc.to_toml()).unwrap(), sdc);
        // One replica is the default, and left out of replay files.
        assert!(!nan.to_toml().contains("replicas"));
        let mut unsaved = sdc.clone();
        unsaved.faults[0].at_step = Some(12);
        let e = unsaved.validate().unwrap_err();
        assert!(e.contains("a multiple of ckpt_every 5"), "{e}");
        let mut twice = nan.clone();
        twice.faults.push(Fault::at(FaultKind::Nan, 3));
        twice.faults[1].rank = Some(1);
        let e = twice.validate().unwrap_err();
        assert!(e.contains("one per scenario"), "{e}");
    }

    #[test]
    fn a_python_trainer_refuses_what_only_ckpt_train_has() {
        let python = KILL.replace(
            "min_ranks = 2",
            "min_ranks = 2\nscript = \"python/examples/train_gpt.py\"",
        );
        let s = Scenario::parse(&python).unwrap();
        s.validate().unwrap();
        assert_eq!(s.batch(), DEFAULT_BATCH);
        assert_eq!(Scenario::parse(&s.to_toml()).unwrap(), s);
        for (from, to, why) in [
            (
                "kind = \"kill\"",
                "kind = \"device-error\"",
                "--fault-device-error",
            ),
            (
                "kind = \"kill\"",
                "kind = \"kill-in-save\"\nstage = \"during-staging\"",
                "--fault-save-stage",
            ),
            (
                "ckpt_every = 5",
                "ckpt_every = 5\nstep_pause_ms = 30",
                "step_pause_ms",
            ),
            (
                "ckpt_every = 5",
                "ckpt_every = 5\nmemory_copies = false",
                "memory_copies",
            ),
            (
                "ckpt_every = 5",
                "ckpt_every = 5\npreset = \"small\"",
                "preset",
            ),
            ("ckpt_every = 5", "ckpt_every = 5\nbatch = 3", "batch 3"),
            ("at_step = 12", "at_save = 12", "at_save 12"),
            ("at_step = 12", "at_step = 12\nat_save = 10", "not several"),
        ] {
            let s = Scenario::parse(&python.replace(from, to)).unwrap();
            let e = s.validate().unwrap_err();
            assert!(e.contains(why), "{from} -> {to}: {e}");
        }
        let save = Scenario::parse(&python.replace("at_step = 12", "at_save = 10")).unwrap();
        save.validate().unwrap();
        // batch belongs to the Python trainer.
        let s =
            Scenario::parse(&KILL.replace("ckpt_every = 5", "ckpt_every = 5\nbatch = 24")).unwrap();
        assert!(s.validate().unwrap_err().contains("needs script"));
    }
}
