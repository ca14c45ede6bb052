//! A private 3-member etcd cluster on loopback, for tests that kill its members (the
//! test command's shared cluster must stay whole for the other tests).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One member: its ports, data directory and process (None while stopped).
struct Member {
    name: String,
    client: u16,
    peer: u16,
    data: PathBuf,
    child: Option<Child>,
}

/// Three etcd processes forming one cluster; killed on drop.
pub struct Cluster {
    members: Vec<Member>,
    initial: String,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn bin(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: run the tests with scripts/test, which installs etcd")
    })
}

impl Cluster {
    /// Starts three members and waits until the cluster has a leader.
    pub fn start() -> Cluster {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            tempfile::tempdir_in("/dev/shm").unwrap()
        } else {
            tempfile::tempdir().unwrap()
        };
        let mut members: Vec<Member> = (0..3)
            .map(|i| Member {
                name: format!("e{i}"),
                client: free_port(),
                peer: free_port(),
                data: base.path().join(format!("e{i}")),
                child: None,
            })
            .collect();
        let initial = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Cluster {
            members: Vec::new(),
            initial,
            _dir: base,
        };
        for m in &mut members {
            m.child = Some(cluster.spawn(m));
        }
        cluster.members = members;
        for i in 0..3 {
            cluster.wait_healthy(i);
        }
        cluster
    }

    fn spawn(&self, m: &Member) -> Child {
        Command::new(bin("CKPT_TEST_ETCD_BIN"))
            .args(["--name", &m.name, "--data-dir"])
            .arg(&m.data)
            .args([
                "--listen-client-urls",
                &format!("http://127.0.0.1:{}", m.client),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{}", m.client),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", m.peer),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{}", m.peer),
                "--initial-cluster",
                &self.initial,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                "ckpt-test-private",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd starts")
    }

    /// `etcd://…/PREFIX` for `--rdzv`.
    pub fn url(&self, prefix: &str) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect();
        format!("etcd://{}/{prefix}", hosts.join(","))
    }

    /// `etcdctl endpoint status` of member `i`: (its id, the leader's id), if it
    /// answers.
    fn status(&self, i: usize) -> Option<(u64, u64)> {
        let output = Command::new(bin("CKPT_TEST_ETCDCTL_BIN"))
            .env("ETCDCTL_API", "3")
            .args([
                "--endpoints",
                &format!("127.0.0.1:{}", self.members[i].client),
                "--command-timeout=2s",
                "endpoint",
                "status",
                "-w",
                "json",
            ])
            .output()
            .ok()?;
        let json: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
        let status = &json[0]["Status"];
        Some((
            status["header"]["member_id"].as_u64()?,
            status["leader"].as_u64()?,
        ))
    }

    /// The index of the member that leads now.
    pub fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            for i in 0..3 {
                if self.members[i].child.is_none() {
                    continue;
                }
                if let Some((me, leader)) = self.status(i)
                    && me == leader
                {
                    return i;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("no etcd leader within 30 s");
    }

    /// Waits until member `i` answers with a leader (it is part of a healthy cluster).
    pub fn wait_healthy(&self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if self.status(i).is_some_and(|(_, leader)| leader != 0) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("etcd member {i} not healthy within 60 s");
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again on its data (it rejoins the cluster).
    pub fn restart(&mut self, i: usize) {
        assert!(self.members[i].child.is_none(), "member {i} still runs");
        let child = self.spawn(&self.members[i]);
        self.members[i].child = Some(child);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
