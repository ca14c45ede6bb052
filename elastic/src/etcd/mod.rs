//! The etcd backend of the control plane: no coordinator process, as available as
//! the etcd cluster.
//!
//! # Why
//!
//! The built-in [`Coordinator`](super::Coordinator) is one process. Large jobs
//! already run a consensus store; with `--rdzv etcd://H:P[,H:P…]/PREFIX` the agents
//! keep the job's state there and decide among themselves, so that no node is
//! special and losing any one of them (or a minority of etcd members) loses nothing.
//!
//! # Keys (under `/PREFIX/JOB/`)
//!
//! | key | value | lifetime |
//! |---|---|---|
//! | `config` | the job's settings ([`JobConfig`](rules::JobConfig)): the first launcher's | kept |
//! | `members/ID` | a member's record: who, how many ranks it holds, what it waits for, what it runs | its lease |
//! | `leader` | the id of the member that applies the rules | its lease |
//! | `generation` | the one generation record: members and their rank counts, floor, state | advanced by transactions |
//! | `g/N/KEY` | generation N's bootstrap keys (collectives' addresses) | deleted two generations later |
//! | `snapshot` | the job's committed snapshot record and the generation that wrote it (written only by a member of the running generation, in a transaction on `generation`'s revision) | replaced by each commit, kept |
//!
//! A member is a node: its launcher joins as one member holding the node's ranks and
//! serves them itself ([`crate::NodeAgent`]), so a node has one lease and one record.
//! A rank started without a launcher is a member of its own.
//!
//! # How a generation advances
//!
//! One member leads (the one whose lease holds the `leader` key): it follows every
//! member's record and evaluates the rules ([`rules`]) on every change: a member
//! whose record is gone ends the running generation; once the survivors (and any
//! newcomers) wait, the next one forms. It writes the resulting record with a
//! transaction that compares the record's revision, so whatever the timing, exactly
//! one proposal per revision wins and no two survivors can form two different
//! worlds. The other members watch only the generation record, the bootstrap keys,
//! the `leader` key and their own record, and write only their own record, their
//! reports (transitions of the generation record), their keys and the snapshot
//! record; when the leader's
//! lease ends they campaign for the key, and the one that gets it takes over. So the
//! events etcd sends per formation grow with the members, not with their square.
//!
//! # Liveness
//!
//! A member's record lives under a lease whose time to live is the heartbeat timeout,
//! kept alive from the agent's heartbeats (a keep-alive every third of the time to
//! live): a process that stops, or a node that vanishes, loses its record when the
//! lease runs out, and a process that exits revokes its lease at once. A node's
//! launcher sees its own ranks crash or hang and reports them (the generation
//! restarts; the node comes back holding the ranks it has left). A training thread
//! stuck outside a collective is found by its own agent (which sees its idle time)
//! and declared lost in the record.
//!
//! # What etcd being down means
//!
//! Nothing, while nothing fails: training does not touch etcd between generations.
//! Leases do not expire without an etcd leader. Reports that cannot be written are
//! queued and written when etcd answers again; until then no generation can change.

pub mod rules;

// The client side, in the order it is built up: what a client knows of the job's
// keys, the connection that keeps it in step, a launcher's handle, a member's
// writes, and the `ControlPlane` over them.
#[cfg(feature = "etcd")]
mod job;
#[cfg(feature = "etcd")]
mod member;
#[cfg(feature = "etcd")]
mod mirror;
#[cfg(feature = "etcd")]
mod plane;
#[cfg(feature = "etcd")]
pub mod security;
#[cfg(feature = "etcd")]
mod snapshot;
#[cfg(feature = "etcd")]
mod store;

#[cfg(feature = "etcd")]
pub use job::EtcdJob;
#[cfg(feature = "etcd")]
pub use plane::EtcdControlPlane;
#[cfg(feature = "etcd")]
pub use security::{EtcdTls, EtcdUser};
#[cfg(feature = "etcd")]
pub use store::EtcdSettings;

/// Where the etcd cluster is and under which prefix jobs keep their keys: the
/// `etcd://HOST:PORT[,HOST:PORT…]/PREFIX` of `--rdzv`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdUrl {
    /// Client endpoints, `http://HOST:PORT`.
    pub endpoints: Vec<String>,
    /// Key prefix without surrounding slashes (may contain inner ones).
    pub prefix: String,
}

impl EtcdUrl {
    /// Parses `etcd://HOST:PORT[,HOST:PORT…][/PREFIX]` (prefix `ckpt` when absent).
    pub fn parse(text: &str) -> Result<EtcdUrl, String> {
        let rest = text.strip_prefix("etcd://").ok_or_else(|| {
            format!("{text:?} is not an etcd://HOST:PORT[,HOST:PORT…]/PREFIX URL")
        })?;
        let (hosts, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        let prefix = if prefix.is_empty() { "ckpt" } else { prefix };
        if prefix
            .split('/')
            .any(|part| part.is_empty() || part == "." || part == "..")
        {
            return Err(format!(
                "{text:?}: the prefix {prefix:?} has an empty, . or .. part"
            ));
        }
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let Some((name, port)) = host.rsplit_once(':') else {
                return Err(format!("{text:?}: endpoint {host:?} is not HOST:PORT"));
            };
            if name.is_empty() || port.parse::<u16>().is_err() {
                return Err(format!("{text:?}: endpoint {host:?} is not HOST:PORT"));
            }
            endpoints.push(format!("http://{host}"));
        }
        Ok(EtcdUrl {
            endpoints,
            prefix: prefix.to_owned(),
        })
    }

    /// The first endpoint's `HOST:PORT` (to find this host's outgoing address).
    pub fn first_host(&self) -> &str {
        self.endpoints[0].trim_start_matches("http://")
    }

    /// Where `job` keeps its keys: `/PREFIX/JOB/`. The job id must be a plain name.
    pub fn root(&self, job: &str) -> Result<String, String> {
        if job.is_empty()
            || job.len() > 128
            || !job
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            || job.starts_with('.')
        {
            return Err(format!(
                "job id {job:?}: use 1 to 128 letters, digits, '-', '_' or '.' (not first)"
            ));
        }
        Ok(format!("/{}/{job}/", self.prefix))
    }
}

impl std::fmt::Display for EtcdUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hosts: Vec<&str> = self
            .endpoints
            .iter()
            .map(|e| e.trim_start_matches("http://"))
            .collect();
        write!(f, "etcd://{}/{}", hosts.join(","), self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_with_several_endpoints_and_a_prefix() {
        let url = EtcdUrl::parse("etcd://127.0.0.1:2379,10.0.0.2:2379/team/ckpt/").unwrap();
        assert_eq!(
            url.endpoints,
            ["http://127.0.0.1:2379", "http://10.0.0.2:2379"]
        );
        assert_eq!(url.prefix, "team/ckpt");
        assert_eq!(url.root("job-1").unwrap(), "/team/ckpt/job-1/");
        assert_eq!(
            url.to_string(),
            "etcd://127.0.0.1:2379,10.0.0.2:2379/team/ckpt"
        );
        assert_eq!(EtcdUrl::parse("etcd://h:1").unwrap().prefix, "ckpt");
        for bad in [
            "tcp://h:1",
            "etcd://h/p",
            "etcd://h:x/p",
            "etcd://:1/p",
            "etcd://h:1/a/../b",
        ] {
            assert!(EtcdUrl::parse(bad).is_err(), "{bad}");
        }
        for bad in ["", "a/b", "..", ".x", "a b"] {
            assert!(url.root(bad).is_err(), "{bad:?}");
        }
    }
}
