//! The launcher's flags, shared by `ckpt launch` and `ckpt-train launch` so that the
//! two commands take the same options with the same meaning and checks.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ckpt_elastic::timeouts::parse_seconds;
use ckpt_elastic::{CoordinatorConfig, Rdzv, TcpSettings, Timeouts};

use super::{ElasticLaunch, LaunchConfig};

/// What every rank runs, and what the launcher may assume about it.
#[derive(Debug, Clone)]
pub struct Program {
    /// The program (found on `PATH` when it has no slash).
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Hand rank 0 of a fixed world the rendezvous listener (a program that knows
    /// `CKPT_RENDEZVOUS_FD`).
    pub hand_over_listener: bool,
    /// The default of `--last-call-ms`: how long ranks take to reach the rendezvous.
    pub last_call: Duration,
}

/// How a launcher starts its ranks and, with any elastic flag, keeps a job going
/// without the ranks it loses.
#[derive(clap::Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Rank processes to start on this node.
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
    /// Rendezvous address of a fixed world (MASTER_ADDR); also where a hosted
    /// coordinator listens.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: IpAddr,
    /// Rendezvous port (MASTER_PORT; default: a free one).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Seconds between SIGTERM and SIGKILL of the other ranks after one fails; in
    /// elastic mode also how long a rank may run on after the job is over.
    #[arg(long, default_value_t = 10.0, value_parser = parse_grace)]
    pub grace_secs: f64,
    /// Elastic: keep training while at least this many ranks (all nodes together)
    /// remain. Without it a lost rank stops the job (after its restarts, if any).
    #[arg(long)]
    pub min_ranks: Option<usize>,
    /// Elastic: at most this many ranks in a generation (default: nproc × the most
    /// nodes).
    #[arg(long)]
    pub max_ranks: Option<usize>,
    /// Elastic: relaunch this node's failed ranks up to K times in all; a relaunched
    /// rank joins as a waiting member and the world grows at the next checkpoint.
    #[arg(long)]
    pub max_restarts: Option<usize>,
    /// Elastic: MIN:MAX nodes (or N), each running its own launcher with --nproc ranks.
    #[arg(long)]
    pub nnodes: Option<String>,
    /// Elastic: the control plane to join: a coordinator, tcp://HOST:PORT (a `ckpt
    /// coordinator`, or the launcher started with --host-rdzv), or an etcd cluster,
    /// etcd://HOST:PORT[,HOST:PORT…]/PREFIX (no coordinator; built with the `etcd`
    /// feature). Default: this launcher hosts a coordinator.
    #[arg(long)]
    pub rdzv: Option<String>,
    /// Elastic: host the coordinator at the --rdzv address (one node does, e.g. node 0).
    #[arg(long)]
    pub host_rdzv: bool,
    /// Elastic: this node's id, 0..MAX nodes (e.g. $SLURM_NODEID).
    #[arg(long, default_value_t = 0)]
    pub node_id: usize,
    /// Elastic: the job id every node and the coordinator share (default: random on
    /// one node; required with --rdzv).
    #[arg(long)]
    pub job_id: Option<String>,
    /// Elastic (hosted coordinator): a rank that sends no heartbeat for this long is
    /// lost (a stopped process, a partitioned node).
    #[arg(long, default_value_t = Timeouts::DEFAULT.heartbeat_timeout.as_secs_f64(), value_parser = parse_seconds)]
    pub heartbeat_timeout_secs: f64,
    /// Elastic (hosted coordinator): a rank whose training loop makes no progress for
    /// this long outside a collective is hung.
    #[arg(long, default_value_t = Timeouts::DEFAULT.progress_timeout.as_secs_f64(), value_parser = parse_seconds)]
    pub progress_timeout_secs: f64,
    /// Elastic (hosted coordinator): once --min-ranks ranks wait, how long to wait for
    /// the rest before the first generation forms without them (they join at the
    /// next checkpoint). Default: 30000 for `ckpt launch` (a Python rank takes
    /// seconds to import torch), 300 for `ckpt-train launch`.
    #[arg(long, value_name = "MS")]
    pub last_call_ms: Option<u64>,
    /// Elastic (a coordinator): how long this launcher, and each of its ranks, keep
    /// trying to reach the coordinator before giving up (a coordinator restarting on
    /// its address is waited for; a node started after the job and its coordinator
    /// ended learns it only then).
    #[arg(long, default_value_t = TcpSettings::default().connect_timeout.as_secs_f64(), value_parser = parse_seconds)]
    pub rdzv_connect_timeout_secs: f64,
}

impl LaunchArgs {
    /// The launch of `program args…` these flags describe. The error is a usage
    /// error, naming the flag.
    pub fn config(&self, program: Program) -> Result<LaunchConfig, String> {
        if self.nproc == 0 {
            return Err("--nproc must be at least 1".into());
        }
        Ok(LaunchConfig {
            nproc: self.nproc,
            master_addr: self.master_addr,
            master_port: self.master_port,
            grace: Duration::from_secs_f64(self.grace_secs),
            elastic: self.elastic(program.last_call)?,
            program: program.program,
            args: program.args,
            hand_over_listener: program.hand_over_listener,
        })
    }

    /// The elastic settings, when any elastic flag is given.
    fn elastic(&self, default_last_call: Duration) -> Result<Option<ElasticLaunch>, String> {
        if self.min_ranks.is_none()
            && self.max_ranks.is_none()
            && self.max_restarts.is_none()
            && self.nnodes.is_none()
            && self.rdzv.is_none()
        {
            return Ok(None);
        }
        let (min_nodes, max_nodes) = match self.nnodes.as_deref() {
            None => (1, 1),
            Some(text) => {
                let bad = || format!("--nnodes {text:?} is not N or MIN:MAX");
                let (a, b) = text.split_once(':').unwrap_or((text, text));
                let min: usize = a.parse().map_err(|_| bad())?;
                let max: usize = b.parse().map_err(|_| bad())?;
                if min == 0 || min > max {
                    return Err(bad());
                }
                (min, max)
            }
        };
        if self.node_id >= max_nodes {
            return Err(format!(
                "--node-id {} is not below the most nodes ({max_nodes})",
                self.node_id
            ));
        }
        let max_ranks = self.max_ranks.unwrap_or(self.nproc * max_nodes);
        let min_ranks = self.min_ranks.unwrap_or(self.nproc * min_nodes);
        if min_ranks == 0 || min_ranks > max_ranks {
            return Err(format!(
                "--min-ranks {min_ranks} must be between 1 and the most ranks ({max_ranks})"
            ));
        }
        let rdzv = self
            .rdzv
            .as_deref()
            .map(|text| Rdzv::parse(text).map_err(|e| format!("--rdzv {e}")))
            .transpose()?;
        if matches!(rdzv, Some(Rdzv::Etcd(_))) && !cfg!(feature = "etcd") {
            return Err(format!(
                "--rdzv {}: this launcher was built without the etcd backend (the `etcd` feature)",
                self.rdzv.as_deref().unwrap_or_default()
            ));
        }
        let (rdzv, etcd) = match rdzv {
            Some(Rdzv::Etcd(_)) if self.host_rdzv => {
                return Err(
                    "--host-rdzv hosts a coordinator; with etcd:// there is none to host".into(),
                );
            }
            Some(Rdzv::Etcd(url)) => (None, Some(url)),
            Some(Rdzv::Tcp(addr)) => (Some(addr), None),
            None => (None, None),
        };
        let job = match &self.job_id {
            Some(job) => job.clone(),
            None if rdzv.is_none() && etcd.is_none() => {
                format!("job-{}", crate::fresh_id().map_err(|e| e.to_string())?)
            }
            None => return Err("--rdzv needs --job-id (the same on every node)".into()),
        };
        let mut coordinator = CoordinatorConfig::new(job.clone(), min_ranks, max_ranks);
        if (rdzv.is_none() && etcd.is_none()) || self.host_rdzv {
            // A coordinator this launcher starts for its job has no running generation
            // to wait for.
            coordinator.settle = Duration::ZERO;
        }
        coordinator.timeouts.heartbeat_timeout =
            Duration::from_secs_f64(self.heartbeat_timeout_secs);
        coordinator.timeouts.progress_timeout = Duration::from_secs_f64(self.progress_timeout_secs);
        coordinator.timeouts.last_call = self
            .last_call_ms
            .map_or(default_last_call, Duration::from_millis);
        coordinator.validate()?;
        // Hosting at the --rdzv address: bind it here (this launcher is the coordinator's
        // home) and let the ranks join it like any other node's.
        let (rdzv, host_at): (Option<SocketAddr>, Option<SocketAddr>) = match (rdzv, self.host_rdzv)
        {
            (Some(addr), true) => (None, Some(addr)),
            (rdzv, _) => (rdzv, None),
        };
        Ok(Some(ElasticLaunch {
            job,
            node_id: self.node_id,
            rdzv,
            etcd,
            host_at,
            min_ranks,
            max_ranks,
            shrink: self.min_ranks.is_some(),
            max_restarts: self.max_restarts.unwrap_or(0),
            coordinator,
            connect_timeout: Duration::from_secs_f64(self.rdzv_connect_timeout_secs),
        }))
    }
}

/// `--grace-secs`: a number of seconds, 0 (no grace) included; anything
/// `Duration::from_secs_f64` would refuse is a usage error here instead.
pub fn parse_grace(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value.is_finite() && (0.0..=1e9).contains(&value) => Ok(value),
        Ok(_) => Err(format!("{text} is not between 0 and 1e9 seconds")),
        Err(_) => Err(format!("{text:?} is not a number of seconds")),
    }
}
