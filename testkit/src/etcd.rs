//! A private 3-member etcd cluster, for whatever kills etcd members: the trainer's
//! tests that do, and the chaos harness's scenarios on the etcd backend
//! (`coordinator = "etcd"`), whose `kill-etcd-member` faults kill members and start
//! them again (`ckpt_chaos::etcd` is this module).
//!
//! Private because the faults hurt it: a cluster shared with other jobs would carry
//! one run's damage into the next. Data lives on tmpfs where there is one (etcd syncs
//! every write, and a run measures the protocol, not the disk).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Capability, has_probed};

/// One member: its ports, data directory and process (`None` while killed).
struct Member {
    name: String,
    client: u16,
    peer: u16,
    data: PathBuf,
    child: Option<Child>,
}

/// Three etcd processes forming one cluster; killed and removed on drop.
pub struct Cluster {
    bin: PathBuf,
    /// Where every member listens.
    ip: IpAddr,
    members: Vec<Member>,
    initial: String,
    dir: PathBuf,
}

/// The `etcd` program: `CKPT_TEST_ETCD_BIN`, else `etcd` on the `PATH`.
pub fn find_etcd() -> Result<PathBuf, String> {
    if let Some(bin) = std::env::var_os("CKPT_TEST_ETCD_BIN") {
        return Ok(bin.into());
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("etcd"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "etcd is not installed (Debian: etcd-server; or set CKPT_TEST_ETCD_BIN)".to_string()
        })
}

/// A cluster for a test, under the tests' skip policy ([`crate::has`]): `None`, after
/// a `SKIPPED` line, when there is no `etcd` program (a failure instead when
/// `CKPT_REQUIRE` names etcd); a cluster that does not start fails the test.
pub fn private_cluster() -> Option<Cluster> {
    let bin = find_etcd();
    if !has_probed(Capability::Etcd, bin.as_ref().err().cloned()) {
        return None;
    }
    let bin = bin.expect("probed above");
    Some(Cluster::start(&bin).unwrap_or_else(|e| panic!("a private etcd cluster: {e}")))
}

fn free_port(ip: IpAddr) -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind((ip, 0))?.local_addr()?.port())
}

impl Cluster {
    /// Starts three members on loopback and waits until each answers its health
    /// check.
    pub fn start(bin: &Path) -> Result<Cluster, String> {
        Cluster::start_on(bin, IpAddr::from([127, 0, 0, 1]))
    }

    /// Starts three members listening on `ip` (the host side of the nodes' bridge,
    /// when nodes run in network namespaces) and waits until each answers.
    pub fn start_on(bin: &Path, ip: IpAddr) -> Result<Cluster, String> {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(crate::unique("ckpt-etcd"));
        let mut members = Vec::new();
        for i in 0..3 {
            members.push(Member {
                name: format!("e{i}"),
                client: free_port(ip).map_err(|e| e.to_string())?,
                peer: free_port(ip).map_err(|e| e.to_string())?,
                data: dir.join(format!("e{i}")),
                child: None,
            });
        }
        let initial = members
            .iter()
            .map(|m| format!("{}=http://{ip}:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Cluster {
            bin: bin.to_path_buf(),
            ip,
            members: Vec::new(),
            initial,
            dir,
        };
        for m in &mut members {
            m.child = Some(cluster.spawn(m, "new")?);
        }
        cluster.members = members;
        for i in 0..3 {
            cluster.wait_healthy(i)?;
        }
        Ok(cluster)
    }

    fn spawn(&self, m: &Member, state: &str) -> Result<Child, String> {
        let client = format!("http://{}:{}", self.ip, m.client);
        let peer = format!("http://{}:{}", self.ip, m.peer);
        Command::new(&self.bin)
            .args(["--name", &m.name, "--data-dir"])
            .arg(&m.data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", "ckpt-chaos"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{}: {e}", self.bin.display()))
    }

    /// Waits (60 s at most) until member `i` answers with a leader: it is part of a
    /// cluster that has a quorum.
    pub fn wait_healthy(&self, i: usize) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if self.status(i).is_some_and(|(_, leader)| leader != 0) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "etcd member {i} at {} not healthy within 60 s",
            self.client(i)
        ))
    }

    /// Member `i`'s id and its leader's id (0: none), if it answers.
    fn status(&self, i: usize) -> Option<(u64, u64)> {
        let answer = post(&self.client(i).to_string(), "/v3/maintenance/status", "{}")?;
        let json: serde_json::Value = serde_json::from_str(&answer).ok()?;
        // The JSON gateway writes 64-bit integers as strings.
        let id = |v: &serde_json::Value| v.as_str().and_then(|s| s.parse::<u64>().ok());
        Some((
            id(&json["header"]["member_id"])?,
            id(&json["leader"]).unwrap_or(0),
        ))
    }

    /// The index of the member that leads now (30 s at most to find one).
    pub fn leader(&self) -> Result<usize, String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            for i in 0..self.members.len() {
                if self.members[i].child.is_none() {
                    continue;
                }
                if let Some((me, leader)) = self.status(i)
                    && me == leader
                {
                    return Ok(i);
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err("no etcd leader within 30 s".into())
    }

    /// `etcd://…/PREFIX` for `--rdzv`.
    pub fn url(&self, prefix: &str) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| SocketAddr::new(self.ip, m.client).to_string())
            .collect();
        format!("etcd://{}/{prefix}", hosts.join(","))
    }

    /// Member `i`'s client address.
    pub fn client(&self, i: usize) -> SocketAddr {
        SocketAddr::new(self.ip, self.members[i].client)
    }

    /// Every member's client address (what a node cut off from etcd loses).
    pub fn clients(&self) -> Vec<SocketAddr> {
        (0..self.members.len()).map(|i| self.client(i)).collect()
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again on its data (it rejoins the cluster as it was); a
    /// member that runs is left alone.
    pub fn restart(&mut self, i: usize) -> Result<(), String> {
        if self.members[i].child.is_none() {
            let child = self.spawn(&self.members[i], "existing")?;
            self.members[i].child = Some(child);
        }
        Ok(())
    }
}

/// The body of etcd's answer to `POST path` with a JSON `body` (its HTTP gateway),
/// if it answers within 2 s.
fn post(addr: &str, path: &str, body: &str) -> Option<String> {
    use std::io::{Read, Write};
    let socket = addr.parse().ok()?;
    let mut stream = std::net::TcpStream::connect_timeout(&socket, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let (head, body) = answer.split_once("\r\n\r\n")?;
    // The JSON object, whether the body came whole or in chunks.
    let json = body.get(body.find('{')?..=body.rfind('}')?)?;
    head.starts_with("HTTP/1.1 200").then(|| json.to_string())
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
