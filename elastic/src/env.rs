//! What a rank process started by an elastic launcher finds in its environment, and
//! the control plane it joins with it.
//!
//! The launcher (`ckpt launch`, `ckpt-train launch`) tells each rank where the control
//! plane is (`CKPT_RDZV`), which job it belongs to (`CKPT_JOB_ID`), its member id
//! (`CKPT_MEMBER_ID`) and its node (`CKPT_NODE_ID`); `CKPT_RDZV` is the launcher's
//! own address, since the launcher stands for its node's ranks in the control plane.
//! A rank started by hand on etcd (`CKPT_RDZV=etcd://…`) is a member of its own, under
//! a lease of its own or one named by `CKPT_ETCD_LEASE`, with etcd's TLS and user
//! from `CKPT_ETCD_CACERT`… (`EtcdSettings::from_env`
//! with the `etcd` feature).
//! Every kind of rank reads them here — the reference trainer and a Python script
//! through the binding alike — so that the two cannot drift apart.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;

use super::{ControlPlane, EtcdUrl, Member, TcpControlPlane, TcpSettings};

/// The variable naming the control plane: `tcp://HOST:PORT` (or `HOST:PORT`), or
/// `etcd://HOST:PORT[,HOST:PORT…]/PREFIX`.
pub const RDZV: &str = "CKPT_RDZV";

/// The variable holding how long a rank keeps trying to reach its coordinator, in
/// seconds (default 30, [`TcpSettings::default`]): the launcher's
/// `--rdzv-connect-timeout-secs`.
pub const RDZV_CONNECT_TIMEOUT: &str = "CKPT_RDZV_CONNECT_TIMEOUT_SECS";

/// Where the control plane is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rdzv {
    /// A coordinator (`tcp://HOST:PORT`).
    Tcp(SocketAddr),
    /// An etcd cluster: no coordinator.
    Etcd(EtcdUrl),
}

impl Rdzv {
    /// Parses `tcp://HOST:PORT`, `HOST:PORT` or `etcd://HOST:PORT[,…]/PREFIX`; the
    /// error names the text.
    pub fn parse(text: &str) -> Result<Rdzv, String> {
        if text.starts_with("etcd://") {
            return EtcdUrl::parse(text).map(Rdzv::Etcd);
        }
        resolve(text).map(Rdzv::Tcp)
    }

    /// An address of the control plane, to learn which local address reaches it.
    pub fn toward(&self) -> Result<SocketAddr, String> {
        match self {
            Rdzv::Tcp(addr) => Ok(*addr),
            Rdzv::Etcd(url) => resolve(url.first_host()),
        }
    }
}

impl std::fmt::Display for Rdzv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rdzv::Tcp(addr) => write!(f, "tcp://{addr}"),
            Rdzv::Etcd(url) => write!(f, "{url}"),
        }
    }
}

fn resolve(text: &str) -> Result<SocketAddr, String> {
    let hostport = text.strip_prefix("tcp://").unwrap_or(text);
    std::net::ToSocketAddrs::to_socket_addrs(hostport)
        .map_err(|e| format!("{text:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("{text:?} resolves to no address"))
}

/// The address this host reaches `target` from (the source address the kernel picks),
/// which is where a rank's listeners (ring, copies, a process group's store) must be
/// reachable by its peers.
pub fn local_ip_towards(target: SocketAddr) -> std::io::Result<IpAddr> {
    let unspecified: IpAddr = if target.is_ipv4() {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let probe = UdpSocket::bind((unspecified, 0))?;
    probe.connect(target)?;
    Ok(probe.local_addr()?.ip())
}

/// A rank's elastic environment, as its launcher set it.
#[derive(Debug, Clone)]
pub struct RankEnv {
    /// The control plane.
    pub rdzv: Rdzv,
    /// Who this rank is; `host` is the local address that reaches the control plane.
    pub member: Member,
    /// The etcd lease the launcher granted this rank, if any.
    pub etcd_lease: Option<i64>,
    /// The job's secret (`CKPT_JOB_SECRET` or `CKPT_JOB_SECRET_FILE`), proved to the
    /// launcher's agent or the coordinator.
    pub secret: Option<ckpt_auth::JobSecret>,
    /// How long joining a coordinator keeps trying ([`RDZV_CONNECT_TIMEOUT`]; `None`:
    /// the default of [`TcpSettings`]).
    pub connect_timeout: Option<std::time::Duration>,
}

impl RankEnv {
    /// Reads the environment: `Ok(None)` when `CKPT_RDZV` is unset or empty (the rank
    /// was not started by an elastic launcher), an error naming the variable when a
    /// value is malformed or the control plane is unreachable from any local address.
    pub fn from_env() -> Result<Option<RankEnv>, String> {
        let env = |key: &str| std::env::var(key).ok().filter(|v| !v.is_empty());
        let Some(text) = env(RDZV) else {
            return Ok(None);
        };
        let rdzv = Rdzv::parse(&text).map_err(|e| format!("{RDZV}: {e}"))?;
        let toward = rdzv.toward().map_err(|e| format!("{RDZV}: {e}"))?;
        let ip =
            local_ip_towards(toward).map_err(|e| format!("{RDZV}: no route to {toward}: {e}"))?;
        let etcd_lease = match env("CKPT_ETCD_LEASE") {
            None => None,
            Some(lease) => Some(
                lease
                    .parse()
                    .map_err(|_| format!("CKPT_ETCD_LEASE={lease:?} is not a lease id"))?,
            ),
        };
        let secret = ckpt_auth::JobSecret::from_env().map_err(|e| e.to_string())?;
        let connect_timeout = match env(RDZV_CONNECT_TIMEOUT) {
            None => None,
            Some(text) => Some(std::time::Duration::from_secs_f64(
                crate::timeouts::parse_seconds(&text)
                    .map_err(|e| format!("{RDZV_CONNECT_TIMEOUT}: {e}"))?,
            )),
        };
        Ok(Some(RankEnv {
            member: Member {
                job: env("CKPT_JOB_ID").unwrap_or_else(|| "default".into()),
                id: env("CKPT_MEMBER_ID").unwrap_or_else(|| format!("{ip}-{}", std::process::id())),
                host: ip.to_string(),
                node: env("CKPT_NODE_ID").unwrap_or_else(|| ip.to_string()),
                ranks: 1,
            },
            rdzv,
            etcd_lease,
            secret,
            connect_timeout,
        }))
    }

    /// The local address the control plane is reached from.
    pub fn ip(&self) -> IpAddr {
        self.member
            .host
            .parse()
            .unwrap_or(std::net::Ipv4Addr::LOCALHOST.into())
    }

    /// Joins the control plane (connects; does not rendezvous). The error names the
    /// member and the control plane. On etcd, TLS and the user come from the
    /// environment (`CKPT_ETCD_CACERT`…).
    pub fn connect(&self) -> Result<Arc<dyn ControlPlane>, String> {
        let who = &self.member.id;
        match &self.rdzv {
            Rdzv::Tcp(addr) => {
                let defaults = TcpSettings::default();
                let settings = TcpSettings {
                    secret: self.secret.clone(),
                    connect_timeout: self.connect_timeout.unwrap_or(defaults.connect_timeout),
                    ..defaults
                };
                TcpControlPlane::connect(*addr, self.member.clone(), settings)
                    .map(|p| Arc::new(p) as Arc<dyn ControlPlane>)
                    .map_err(|e| format!("member {who}: coordinator {addr}: {e}"))
            }
            #[cfg(feature = "etcd")]
            Rdzv::Etcd(url) => {
                let settings = super::EtcdSettings::from_env()
                    .map_err(|e| format!("member {who}: {url}: {e}"))?;
                super::EtcdControlPlane::connect(
                    url,
                    self.member.clone(),
                    self.etcd_lease,
                    settings,
                )
                .map(|p| Arc::new(p) as Arc<dyn ControlPlane>)
                .map_err(|e| format!("member {who}: {url}: {e}"))
            }
            #[cfg(not(feature = "etcd"))]
            Rdzv::Etcd(url) => Err(format!(
                "member {who}: {url}: this program was built without the etcd backend (the `etcd` feature)"
            )),
        }
    }
}

/// The run id of a generation's save attempts: the job's name (reduced to the
/// characters a run id allows, and to `max_len` with the suffix) and the control-plane
/// generation, so that no two generations of a job share an attempt directory even
/// when they save the same step with the same checkpoint generation.
pub fn run_id(job: &str, generation: u64, max_len: usize) -> String {
    let suffix = format!("-e{generation}");
    let keep = max_len.saturating_sub(suffix.len());
    let mut id: String = job
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(keep)
        .collect();
    if id.is_empty() {
        id.push_str("job");
    }
    id + &suffix
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdzv_parses_both_backends_and_names_bad_text() {
        assert_eq!(
            Rdzv::parse("tcp://127.0.0.1:29400").unwrap(),
            Rdzv::Tcp("127.0.0.1:29400".parse().unwrap())
        );
        assert_eq!(
            Rdzv::parse("127.0.0.1:1").unwrap(),
            Rdzv::Tcp("127.0.0.1:1".parse().unwrap())
        );
        let etcd = Rdzv::parse("etcd://127.0.0.1:2379,127.0.0.1:2381/ckpt").unwrap();
        assert!(matches!(etcd, Rdzv::Etcd(_)));
        assert_eq!(etcd.toward().unwrap(), "127.0.0.1:2379".parse().unwrap());
        let err = Rdzv::parse("tcp://nowhere").unwrap_err();
        assert!(err.contains("nowhere"), "{err}");
    }

    #[test]
    fn run_ids_keep_the_generation_and_the_limit() {
        assert_eq!(run_id("run1", 7, 64), "run1-e7");
        assert_eq!(run_id("a b/c", 2, 64), "a_b_c-e2");
        assert_eq!(run_id("", 3, 64), "job-e3");
        let long = run_id(&"x".repeat(100), 12, 20);
        assert_eq!(long.len(), 20);
        assert!(long.ends_with("-e12"));
    }
}
