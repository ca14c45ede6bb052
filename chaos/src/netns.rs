//! Simulated multi-node networks on one Linux machine, for chaos tests.
//!
//! A [`Network`] is a set of *nodes*. Each node is a network namespace with its
//! own loopback and one veth interface (`eth0` inside the node); the other end
//! of every veth is enslaved to one bridge in the root namespace. The bridge has
//! an address of its own ([`Network::host_ip`]) so a process running normally
//! in the root namespace (e.g. a coordinator) is reachable from every node, and
//! the root namespace reaches every node through the bridge's connected route.
//!
//! ```text
//!   root namespace:   coordinator ── bridge (x.y.z.1) ──┬── veth ── node 0: eth0 (x.y.z.2), lo
//!                                                       └── veth ── node 1: eth0 (x.y.z.3), lo
//! ```
//!
//! # Why it is built this way
//!
//! * **Namespaces instead of containers or VMs**: they are in the kernel, cost
//!   milliseconds to create, and child processes inherit them, so starting a
//!   node's launcher with [`Network::command`] puts the whole process tree
//!   (all ranks of that node) on that node.
//! * **Partitions are nftables rules inside the node's own namespace**: a table
//!   with an `input` and an `output` base chain (policy accept) that drops every
//!   packet whose interface is not `lo`. Nothing is installed in the root
//!   namespace, so the machine's own firewall is neither read nor changed, and
//!   the rules vanish with the namespace. Loopback stays open because ranks on
//!   one node talk to each other over it (traffic a node sends to its *own*
//!   `eth0` address also goes over `lo`, so it keeps working too). Packets are
//!   silently *dropped* (never rejected), in both directions, which is what a
//!   real partition looks like: established TCP connections stall and
//!   retransmit instead of being reset, and they resume after [`Network::heal`]
//!   (which deletes the table, atomically, in one nft transaction).
//!   The same table can instead cut a node off chosen servers only
//!   ([`Network::cut_off`]: the store, etcd) or drop a share of its packets at
//!   random ([`Network::lose`], nftables' `numgen random`). The kernels this runs
//!   on have no `netem`, so a delay needs the sender's help: the chaos shim
//!   (`crate::shim`) holds each send to another node.
//! * **Local senders inside a partitioned node** get their packets dropped by
//!   the `output` hook, which the kernel reports to the sending socket as
//!   `EPERM`. TCP hides that (data is queued, retransmissions silently fail,
//!   `connect` keeps retrying the SYN until its timeout), so TCP users see a
//!   stall; a UDP `send` or an ICMP ping from inside the partitioned node fails
//!   immediately with "Operation not permitted" instead.
//! * **Names** are `ckc` + creator pid (hex) + `g` + a per-process slot (hex) +
//!   a kind letter: `s` for the bridge, `v<node>` for a node's veth (root end),
//!   `n<node>` for a node's namespace; e.g. `ckc1f2ag3v1`. With pids below
//!   2^22 (the kernel's `PID_MAX_LIMIT`), at most 256 slots and at most 253
//!   nodes this always fits Linux's 15-character interface-name limit. The
//!   node end of each veth is created directly inside the namespace as
//!   `eth0`, so it never occupies a name in the root namespace. Embedding the
//!   pid lets [`remove_stale`] recognise leftovers of a creator that is gone
//!   (a harness killed with SIGKILL cannot run `Drop`): `/proc/<pid>` is
//!   missing. Leftovers carrying *this* process's pid but a slot this process
//!   does not use (the pid was recycled) are stale as well.
//! * **Subnets** are /24s in private ranges (10/8 first, then 172.16/12 and
//!   192.168/16). The starting point is a hash of pid and slot, and every /24
//!   that overlaps an address or route already present in the root namespace
//!   (`ip -4 addr`, `ip -4 route show table all`) is skipped; since every live
//!   `Network` of every process has its bridge address in the root namespace,
//!   this also avoids concurrently existing `Network`s.
//! * **Bridge and sysctls**: the bridge only switches frames, so root↔node
//!   traffic is local delivery and node↔node traffic is bridged; neither needs
//!   `net.ipv4.ip_forward`, and nothing global is changed. One caveat: when the
//!   `br_netfilter` module is loaded and `net.bridge.bridge-nf-call-iptables`
//!   is 1 (the case on the machine this was written on, and wherever Docker
//!   runs), bridged IPv4 frames also traverse the root namespace's
//!   `forward` hook, so a root-namespace firewall whose FORWARD policy is DROP
//!   (Docker installs one) breaks node↔node traffic while root↔node still
//!   works. The per-bridge `nf_call_iptables` option cannot switch that off
//!   (the kernel ORs it with the global sysctl). On such a machine, either set
//!   that sysctl to 0 or accept forwarding on the `ckc*s` bridges.
//!
//! # Processes
//!
//! [`Network::command`] runs `ip netns exec <namespace> <program>`. `ip`
//! enters the namespace (and a private mount namespace, to mount a matching
//! `/sys`) and then **execs** the program without forking, so the pid of the
//! spawned [`std::process::Child`] is the program's pid: SIGKILL/SIGSTOP sent to
//! `child.id()` reach the program itself (before the exec, a few milliseconds
//! after spawning, they reach `ip`, with the same effect). If the program does
//! not exist, spawning still succeeds and the child exits with status 255.
//!
//! Dropping a [`Network`] deletes the root-side veths (which cuts every node
//! off at once), the namespaces and the bridge. A namespace that still has
//! processes in it lives on, anonymous and disconnected, until they exit; kill
//! node processes before dropping the network.
//!
//! Everything needs root (precisely: `CAP_NET_ADMIN` and `CAP_SYS_ADMIN`),
//! `ip` from iproute2 and `nft` from nftables (Debian packages `iproute2` and
//! `nftables`).

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

/// Prefix of every namespace and interface name this module creates.
const PREFIX: &str = "ckc";
/// Name of the nftables table (`inet` family) that implements a partition.
const PARTITION_TABLE: &str = "ckc_partition";
/// A /24 has 254 host addresses; one is the bridge's.
const MAX_NODES: usize = 253;
/// Slots are one or two hex digits in names.
const SLOTS: u32 = 256;
/// Largest pid the kernel can hand out (`PID_MAX_LIMIT` = 2^22): six hex digits.
const PID_LIMIT: u32 = 1 << 22;

/// Slots used by live `Network`s owned by this process.
static LIVE_SLOTS: Mutex<Vec<u8>> = Mutex::new(Vec::new());
/// Where the next slot search starts, to avoid reusing a slot just freed.
static NEXT_SLOT: AtomicU32 = AtomicU32::new(0);

/// What a name created by this module denotes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The bridge in the root namespace.
    Bridge,
    /// The root-namespace end of node `n`'s veth pair.
    Veth(usize),
    /// Node `n`'s network namespace.
    Netns(usize),
}

/// The owner of a group of names: creator pid and per-process slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Owner {
    pid: u32,
    slot: u8,
}

impl Owner {
    fn name(self, kind: Kind) -> String {
        let base = format!("{PREFIX}{:x}g{:x}", self.pid, self.slot);
        match kind {
            Kind::Bridge => format!("{base}s"),
            Kind::Veth(n) => format!("{base}v{n:x}"),
            Kind::Netns(n) => format!("{base}n{n:x}"),
        }
    }
}

/// Parses a name made by [`Owner::name`]; `None` for anything else.
fn parse_name(name: &str) -> Option<(Owner, Kind)> {
    fn hex(s: &str, max_len: usize) -> Option<u32> {
        let ok = !s.is_empty()
            && s.len() <= max_len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if ok {
            u32::from_str_radix(s, 16).ok()
        } else {
            None
        }
    }
    let rest = name.strip_prefix(PREFIX)?;
    let (pid, rest) = rest.split_once('g')?;
    let pid = hex(pid, 6)?;
    let kind_at = rest.find(['s', 'v', 'n'])?;
    let slot = hex(&rest[..kind_at], 2)?;
    let node = &rest[kind_at + 1..];
    let kind = match rest.as_bytes()[kind_at] {
        b's' if node.is_empty() => Kind::Bridge,
        b'v' => Kind::Veth(hex(node, 2)? as usize),
        b'n' => Kind::Netns(hex(node, 2)? as usize),
        _ => return None,
    };
    let owner = Owner {
        pid,
        slot: u8::try_from(slot).ok()?,
    };
    Some((owner, kind))
}

/// A set of network namespaces ("nodes") joined by a bridge in the root
/// namespace. See the [module documentation](self).
///
/// Dropping it tears everything down (veths, namespaces, bridge), ignoring
/// errors.
#[derive(Debug)]
pub struct Network {
    owner: Owner,
    /// Whether `owner.slot` is registered in [`LIVE_SLOTS`].
    registered: bool,
    ip: PathBuf,
    nft: PathBuf,
    /// First three octets of the /24.
    subnet: [u8; 3],
    bridge: Option<String>,
    veths: Vec<String>,
    namespaces: Vec<String>,
}

impl Network {
    /// Creates `nodes` namespaces joined by a bridge.
    ///
    /// `Err(reason)` says exactly what is missing or forbidden (not root, `ip`
    /// or `nft` not found, namespace creation refused, nftables unusable...),
    /// so that a test can skip loudly with it. Anything created before a
    /// failure is removed again.
    pub fn create(nodes: usize) -> Result<Network, String> {
        Self::create_as(nodes, std::process::id())
    }

    /// [`Network::create`] with names carrying `pid` instead of this
    /// process's pid (tests use a dead pid to fabricate stale leftovers).
    fn create_as(nodes: usize, pid: u32) -> Result<Network, String> {
        if nodes == 0 || nodes > MAX_NODES {
            return Err(format!(
                "a network needs between 1 and {MAX_NODES} nodes, not {nodes}"
            ));
        }
        if pid >= PID_LIMIT {
            return Err(format!("pid {pid} does not fit in interface names"));
        }
        check_privileges()?;
        let ip = find_program("ip").ok_or(
            "`ip` not found in PATH or /usr/sbin, /sbin (install the Debian package iproute2)",
        )?;
        run(Command::new(&ip).arg("-V"))
            .map_err(|e| format!("`ip` is present but does not run: {e}"))?;
        let nft = find_program("nft").ok_or(
            "`nft` not found in PATH or /usr/sbin, /sbin (install the Debian package nftables)",
        )?;
        run(Command::new(&nft).arg("--version"))
            .map_err(|e| format!("`nft` is present but does not run: {e}"))?;

        let (owner, registered) = claim_slot(&ip, pid)?;
        let mut network = Network {
            owner,
            registered,
            ip,
            nft,
            subnet: [0; 3],
            bridge: None,
            veths: Vec::new(),
            namespaces: Vec::new(),
        };
        // From here on, dropping `network` undoes whatever was created.
        network.subnet = choose_subnet(&network.ip, owner)?;
        network.build(nodes)?;
        Ok(network)
    }

    fn build(&mut self, nodes: usize) -> Result<(), String> {
        let bridge = self.owner.name(Kind::Bridge);
        self.ip(&["link", "add", "name", &bridge, "type", "bridge"])
            .map_err(|e| format!("cannot create a bridge: {e}"))?;
        self.bridge = Some(bridge.clone());
        let host_cidr = format!("{}/24", self.host_ip());
        self.ip(&["addr", "add", &host_cidr, "dev", &bridge])?;
        self.ip(&["link", "set", "dev", &bridge, "up"])?;

        for node in 0..nodes {
            let ns = self.owner.name(Kind::Netns(node));
            self.ip(&["netns", "add", &ns])
                .map_err(|e| format!("namespace creation refused: {e}"))?;
            self.namespaces.push(ns.clone());
            let veth = self.owner.name(Kind::Veth(node));
            self.ip(&[
                "link", "add", "name", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])
            .map_err(|e| format!("cannot create a veth pair: {e}"))?;
            self.veths.push(veth.clone());
            self.ip(&["link", "set", "dev", &veth, "master", &bridge, "up"])?;
            let node_cidr = format!("{}/24", self.node_ip(node));
            self.ip(&["-n", &ns, "link", "set", "dev", "lo", "up"])?;
            self.ip(&["-n", &ns, "addr", "add", &node_cidr, "dev", "eth0"])?;
            self.ip(&["-n", &ns, "link", "set", "dev", "eth0", "up"])?;
        }

        // Fail now, not at the first partition, if nftables cannot work here.
        let probe =
            format!("add table inet {PARTITION_TABLE}\ndelete table inet {PARTITION_TABLE}\n");
        self.nft_script(0, &probe)
            .map_err(|e| format!("nftables unusable in a namespace: {e}"))
    }

    /// Address of the root namespace on the bridge, where a coordinator
    /// running in the root namespace can listen.
    pub fn host_ip(&self) -> IpAddr {
        let [a, b, c] = self.subnet;
        IpAddr::V4(Ipv4Addr::new(a, b, c, 1))
    }

    /// Address of node `node` (on its `eth0`) inside its namespace.
    ///
    /// # Panics
    /// If `node` is not below the number of nodes.
    pub fn node_ip(&self, node: usize) -> IpAddr {
        assert!(node < self.namespaces.len(), "no node {node}");
        let [a, b, c] = self.subnet;
        IpAddr::V4(Ipv4Addr::new(a, b, c, node as u8 + 2))
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.namespaces.len()
    }

    /// Name of node `node`'s network namespace (as `ip netns` knows it).
    ///
    /// # Panics
    /// If `node` is not below the number of nodes.
    pub fn namespace(&self, node: usize) -> &str {
        &self.namespaces[node]
    }

    /// A [`Command`] that runs `program` inside node `node`'s namespace, as
    /// `ip netns exec <namespace> <program>`; add arguments, environment,
    /// stdio as usual. `ip` execs `program` without forking, so the spawned
    /// child's pid *is* the program's pid (see the module documentation), and
    /// every process it starts stays in the namespace.
    ///
    /// # Panics
    /// If `node` is not below the number of nodes.
    pub fn command(&self, node: usize, program: impl AsRef<OsStr>) -> Command {
        let mut command = Command::new(&self.ip);
        command
            .args(["netns", "exec", &self.namespaces[node]])
            .arg(program);
        command
    }

    /// Drops every packet between node `node` and the rest (both directions,
    /// established connections included), except loopback traffic inside the
    /// node. Idempotent.
    pub fn partition(&self, node: usize) -> Result<(), String> {
        // Adding then deleting the table first makes the script idempotent
        // (no duplicated rules); nft applies the whole script atomically.
        self.replace_rules(node, " iifname != \"lo\" drop;", " oifname != \"lo\" drop;")
            .map_err(|e| format!("cannot partition node {node}: {e}"))
    }

    /// Drops every packet between node `node` and the servers at `peers` (addresses
    /// on the host side of the bridge: the storage proxy, etcd), both ways; the node
    /// keeps reaching the other nodes and everything else. Replaces any other fault
    /// of the node; [`Network::heal`] undoes it.
    pub fn cut_off(&self, node: usize, peers: &[SocketAddr]) -> Result<(), String> {
        let mut input = String::new();
        let mut output = String::new();
        for peer in peers {
            let family = if peer.is_ipv4() { "ip" } else { "ip6" };
            let (ip, port) = (peer.ip(), peer.port());
            input.push_str(&format!(" {family} saddr {ip} tcp sport {port} drop;"));
            output.push_str(&format!(" {family} daddr {ip} tcp dport {port} drop;"));
        }
        self.replace_rules(node, &input, &output)
            .map_err(|e| format!("cannot cut node {node} off {peers:?}: {e}"))
    }

    /// Drops `percent` % of the packets between node `node` and anything off the
    /// node, at random, each way. Replaces any other fault of the node;
    /// [`Network::heal`] undoes it.
    pub fn lose(&self, node: usize, percent: u32) -> Result<(), String> {
        let percent = percent.min(100);
        let input = format!(" iifname != \"lo\" numgen random mod 100 < {percent} drop;");
        let output = format!(" oifname != \"lo\" numgen random mod 100 < {percent} drop;");
        self.replace_rules(node, &input, &output)
            .map_err(|e| format!("cannot make node {node} lose packets: {e}"))
    }

    /// Installs the node's fault table with these `input` and `output` rules, in
    /// place of any before (idempotent, atomic).
    fn replace_rules(&self, node: usize, input: &str, output: &str) -> Result<(), String> {
        let script = format!(
            "add table inet {t}\n\
             delete table inet {t}\n\
             table inet {t} {{\n\
             \tchain input {{ type filter hook input priority -300; policy accept;{input} }}\n\
             \tchain output {{ type filter hook output priority -300; policy accept;{output} }}\n\
             }}\n",
            t = PARTITION_TABLE
        );
        self.nft_script(node, &script)
    }

    /// Undoes [`Network::partition`] (and [`Network::cut_off`], [`Network::lose`]).
    /// Idempotent.
    ///
    /// Stalled TCP connections resume at their next retransmission; with
    /// TCP's exponential backoff that can be up to about as long again as the
    /// partition lasted (and a connection whose retransmissions ran out, after
    /// roughly 15 minutes by default, has failed with `ETIMEDOUT`).
    pub fn heal(&self, node: usize) -> Result<(), String> {
        let script =
            format!("add table inet {PARTITION_TABLE}\ndelete table inet {PARTITION_TABLE}\n");
        self.nft_script(node, &script)
            .map_err(|e| format!("cannot heal node {node}: {e}"))
    }

    /// Every namespace and root-namespace link name this network created.
    #[cfg(test)]
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.namespaces.clone();
        names.extend(self.veths.iter().cloned());
        names.extend(self.bridge.iter().cloned());
        names
    }

    fn ip(&self, args: &[&str]) -> Result<String, String> {
        run(Command::new(&self.ip).args(args))
    }

    /// Runs an nft script inside node `node`'s namespace.
    fn nft_script(&self, node: usize, script: &str) -> Result<(), String> {
        let ns = self
            .namespaces
            .get(node)
            .ok_or_else(|| format!("no node {node} (there are {})", self.namespaces.len()))?;
        let mut command = Command::new(&self.ip);
        command
            .args(["netns", "exec", ns])
            .arg(&self.nft)
            .args(["-f", "-"]);
        run_with_stdin(&mut command, script).map(drop)
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Root-side veths first: deleting one end deletes the pair, which cuts
        // the node off even if a process keeps its namespace alive.
        for veth in &self.veths {
            let _ = self.ip(&["link", "del", "dev", veth]);
        }
        for ns in &self.namespaces {
            let _ = self.ip(&["netns", "del", ns]);
        }
        if let Some(bridge) = &self.bridge {
            let _ = self.ip(&["link", "del", "dev", bridge]);
        }
        if self.registered {
            let mut live = LIVE_SLOTS.lock().unwrap_or_else(|e| e.into_inner());
            live.retain(|&s| s != self.owner.slot);
        }
    }
}

/// Removes namespaces and links (bridges, veths) whose names this module made
/// and whose creating process is gone: `/proc/<pid>` does not exist, or the pid
/// is this process's but no live [`Network`] of this process uses the name (the
/// pid was recycled from a dead creator). Call it before creating networks, to
/// clean up after harness runs killed with SIGKILL. Errors are ignored; does
/// nothing without `ip` or privileges.
///
/// Processes still running inside a stale namespace are not killed: the
/// namespace loses its name and its veth, and disappears when they exit.
pub fn remove_stale() {
    let Some(ip) = find_program("ip") else {
        return;
    };
    let me = std::process::id();
    // Held throughout: a `Network` of this process registers its slot before
    // creating any name and unregisters it after deleting them, so no name of
    // a live `Network` can be mistaken for a leftover.
    let live = LIVE_SLOTS.lock().unwrap_or_else(|e| e.into_inner());
    let stale = |owner: Owner| {
        if owner.pid == me {
            !live.contains(&owner.slot)
        } else {
            !Path::new(&format!("/proc/{}", owner.pid)).exists()
        }
    };
    let mut links = existing_links(&ip);
    // Veths before bridges, as in `Drop`.
    links.sort_by_key(|name| matches!(parse_name(name), Some((_, Kind::Bridge))));
    for name in links {
        let is_stale = matches!(
            parse_name(&name),
            Some((owner, Kind::Veth(_) | Kind::Bridge)) if stale(owner)
        );
        if is_stale {
            let _ = run(Command::new(&ip).args(["link", "del", "dev", &name]));
        }
    }
    for name in existing_namespaces(&ip) {
        if matches!(parse_name(&name), Some((owner, Kind::Netns(_))) if stale(owner)) {
            let _ = run(Command::new(&ip).args(["netns", "del", &name]));
        }
    }
}

/// Picks a slot for `pid` whose names do not exist yet, registering it when
/// `pid` is this process's. Returns the owner and whether it was registered.
fn claim_slot(ip: &Path, pid: u32) -> Result<(Owner, bool), String> {
    let mine = pid == std::process::id();
    let mut taken: HashSet<Owner> = existing_links(ip)
        .iter()
        .chain(existing_namespaces(ip).iter())
        .filter_map(|name| parse_name(name))
        .map(|(owner, _)| owner)
        .collect();
    let mut live = LIVE_SLOTS.lock().unwrap_or_else(|e| e.into_inner());
    if mine {
        taken.extend(live.iter().map(|&slot| Owner { pid, slot }));
    }
    let start = NEXT_SLOT.fetch_add(1, Ordering::Relaxed);
    for i in 0..SLOTS {
        let owner = Owner {
            pid,
            slot: ((start + i) % SLOTS) as u8,
        };
        if !taken.contains(&owner) {
            if mine {
                live.push(owner.slot);
            }
            return Ok((owner, mine));
        }
    }
    Err(format!(
        "all {SLOTS} name slots of pid {pid} are in use (leftovers? see remove_stale)"
    ))
}

/// Picks a private /24 that overlaps no address or route of the root namespace.
fn choose_subnet(ip: &Path, owner: Owner) -> Result<[u8; 3], String> {
    let mut used = Vec::new();
    let addrs = run(Command::new(ip).args(["-4", "-o", "addr", "show"]))?;
    for line in addrs.lines() {
        let mut words = line.split_whitespace();
        if words.any(|w| w == "inet") {
            used.extend(words.next().and_then(parse_prefix));
        }
    }
    let routes = run(Command::new(ip).args(["-4", "route", "show", "table", "all"]))?;
    for line in routes.lines() {
        let mut words = line.split_whitespace();
        let mut first = words.next().unwrap_or("");
        const TYPES: [&str; 10] = [
            "unicast",
            "local",
            "broadcast",
            "multicast",
            "anycast",
            "unreachable",
            "blackhole",
            "prohibit",
            "throw",
            "nat",
        ];
        if TYPES.contains(&first) {
            first = words.next().unwrap_or("");
        }
        used.extend(parse_prefix(first));
    }

    // Candidates: 10.0.0.0/8, then 172.16.0.0/12, then 192.168.0.0/16, as /24s.
    let candidate = |i: u32| -> [u8; 3] {
        match i {
            0..=65535 => [10, (i >> 8) as u8, i as u8],
            65536..=69631 => {
                let j = i - 65536;
                [172, 16 + (j >> 8) as u8, j as u8]
            }
            _ => [192, 168, (i - 69632) as u8],
        }
    };
    const CANDIDATES: u32 = 65536 + 4096 + 256;
    let start = (mix((u64::from(owner.pid) << 8) | u64::from(owner.slot)) % 65536) as u32;
    for i in 0..CANDIDATES {
        let net = candidate((start + i) % CANDIDATES);
        let base = u32::from_be_bytes([net[0], net[1], net[2], 0]);
        let overlaps = used.iter().any(|&(addr, len): &(u32, u32)| {
            let common = len.min(24);
            let mask = if common == 0 {
                0
            } else {
                u32::MAX << (32 - common)
            };
            addr & mask == base & mask
        });
        if !overlaps {
            return Ok(net);
        }
    }
    Err("no free private /24 subnet left in the root namespace".to_string())
}

/// `a.b.c.d` or `a.b.c.d/len` as (address, prefix length).
fn parse_prefix(word: &str) -> Option<(u32, u32)> {
    let (addr, len) = match word.split_once('/') {
        Some((addr, len)) => (addr, len.parse().ok().filter(|&l| l <= 32)?),
        None => (word, 32),
    };
    let addr: Ipv4Addr = addr.parse().ok()?;
    Some((u32::from(addr), len))
}

/// SplitMix64 finaliser: spreads pids and slots over the candidate subnets.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Names of all links in the root namespace (without `@peer` suffixes).
fn existing_links(ip: &Path) -> Vec<String> {
    let out = run(Command::new(ip).args(["-o", "link", "show"])).unwrap_or_default();
    out.lines()
        .filter_map(|line| {
            let name = line.split(": ").nth(1)?;
            Some(name.split('@').next()?.to_string())
        })
        .collect()
}

/// Names of all named network namespaces.
fn existing_namespaces(ip: &Path) -> Vec<String> {
    let out = run(Command::new(ip).args(["netns", "list"])).unwrap_or_default();
    out.lines()
        .filter_map(|line| line.split_whitespace().next().map(str::to_string))
        .collect()
}

/// Errs unless this process has CAP_NET_ADMIN and CAP_SYS_ADMIN.
fn check_privileges() -> Result<(), String> {
    const CAP_NET_ADMIN: u32 = 12;
    const CAP_SYS_ADMIN: u32 = 21;
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("cannot read /proc/self/status ({e}); is this Linux?"))?;
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(str::trim)
            .unwrap_or("?")
            .to_string()
    };
    let cap_eff = field("CapEff:");
    let caps = u64::from_str_radix(&cap_eff, 16).unwrap_or(0);
    let has = |cap: u32| caps & (1 << cap) != 0;
    if has(CAP_NET_ADMIN) && has(CAP_SYS_ADMIN) {
        return Ok(());
    }
    let euid = field("Uid:")
        .split_whitespace()
        .nth(1)
        .unwrap_or("?")
        .to_string();
    Err(format!(
        "not root: network namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN \
         (effective uid {euid}, CapEff {cap_eff})"
    ))
}

/// Finds an executable in PATH, then in the sbin/bin directories that a
/// non-root PATH often lacks.
fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let fallback = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(OsString::from);
    std::env::split_paths(&path)
        .chain(fallback.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Runs `command`, returning its stdout, or an error quoting it and its stderr.
fn run(command: &mut Command) -> Result<String, String> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `{}`: {e}", describe(command)))?;
    check(command, output)
}

/// Like [`run`], with `input` on the command's stdin.
fn run_with_stdin(command: &mut Command, input: &str) -> Result<String, String> {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run `{}`: {e}", describe(command)))?;
    if let Some(mut stdin) = child.stdin.take() {
        // A write error shows up as the command's failure below.
        let _ = stdin.write_all(input.as_bytes());
    }
    let output = child
        .wait_with_output()
        .map_err(|e| format!("cannot wait for `{}`: {e}", describe(command)))?;
    check(command, output)
}

fn check(command: &Command, output: std::process::Output) -> Result<String, String> {
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "`{}` failed ({}): {}",
            describe(command),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

fn describe(command: &Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, ErrorKind, Read};
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::os::unix::fs::MetadataExt;
    use std::process::Child;
    use std::time::{Duration, Instant};

    /// Name of the test that doubles as the helper process's entry point.
    const HELPER: &str = "netns_child_helper_entry";
    const PORT: u16 = 7000;

    /// `Network::create`, or a loud skip.
    fn network_or_skip(nodes: usize) -> Option<Network> {
        match Network::create(nodes) {
            Ok(n) => Some(n),
            Err(reason) => {
                ckpt_testkit::has_probed(ckpt_testkit::Capability::Netns, Some(reason));
                None
            }
        }
    }

    /// Entry point of the helper processes the tests start inside nodes (this
    /// test binary again, filtered to this test). A plain test run, without
    /// `CKC_NETNS_HELPER`, does nothing.
    ///
    /// * `server`: listens on 0.0.0.0:PORT, echoes every connection, prints
    ///   READY (after libtest's "test ... " prefix); exits after 120 s in case the test forgets it.
    /// * `client`: connects to `CKC_NETNS_ADDR` with a 1 s timeout, sends a
    ///   line and expects it back within 1 s; exit 0 on success, 10 if the
    ///   connection fails, 11 if the exchange fails.
    #[test]
    fn netns_child_helper_entry() {
        let Ok(role) = std::env::var("CKC_NETNS_HELPER") else {
            return;
        };
        let code = match role.as_str() {
            "server" => {
                let listener = TcpListener::bind(("0.0.0.0", PORT)).expect("bind");
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_secs(120));
                    std::process::exit(0);
                });
                let mut stdout = std::io::stdout();
                let _ = writeln!(stdout, "READY");
                let _ = stdout.flush();
                for stream in listener.incoming().flatten() {
                    std::thread::spawn(move || echo(stream));
                }
                0
            }
            "client" => {
                let addr: SocketAddr = std::env::var("CKC_NETNS_ADDR").unwrap().parse().unwrap();
                match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                    Err(e) => {
                        eprintln!("client: connect to {addr}: {e}");
                        10
                    }
                    Ok(mut s) => match exchange(&mut s, b"ping\n", Duration::from_secs(1)) {
                        Ok(()) => 0,
                        Err(e) => {
                            eprintln!("client: exchange with {addr}: {e}");
                            11
                        }
                    },
                }
            }
            other => panic!("unknown helper role {other}"),
        };
        std::process::exit(code);
    }

    fn echo(mut stream: TcpStream) {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if stream.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
    }

    /// Writes `msg` and reads it back within `timeout`.
    fn exchange(s: &mut TcpStream, msg: &[u8], timeout: Duration) -> std::io::Result<()> {
        s.write_all(msg)?;
        read_back(s, msg, timeout)
    }

    fn read_back(s: &mut TcpStream, msg: &[u8], timeout: Duration) -> std::io::Result<()> {
        s.set_read_timeout(Some(timeout))?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got)?;
        if got != msg {
            return Err(std::io::Error::other(format!("echo mismatch: {got:?}")));
        }
        Ok(())
    }

    /// Kills and reaps a child when the test ends, even by panic.
    struct Reaped(Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn helper(network: &Network, node: usize, role: &str, addr: Option<SocketAddr>) -> Command {
        let mut c = network.command(node, std::env::current_exe().unwrap());
        c.args([HELPER, "--nocapture", "--test-threads=1"])
            .env("CKC_NETNS_HELPER", role);
        if let Some(addr) = addr {
            c.env("CKC_NETNS_ADDR", addr.to_string());
        }
        c
    }

    fn start_server(network: &Network, node: usize) -> Reaped {
        let mut child = helper(network, node, "server", None)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let child = Reaped(child);
        for line in BufReader::new(stdout).lines() {
            if line.unwrap().trim_end().ends_with("READY") {
                return child;
            }
        }
        panic!("server in node {node} exited before READY");
    }

    /// Runs the client helper in `node` against `addr`; its exit code.
    fn client(network: &Network, node: usize, addr: SocketAddr) -> i32 {
        let started = Instant::now();
        let status = helper(network, node, "client", Some(addr))
            .stdout(Stdio::null())
            .status()
            .unwrap();
        eprintln!(
            "client node {node} -> {addr}: {status} after {:?}",
            started.elapsed()
        );
        status.code().unwrap_or(-1)
    }

    fn root_connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
        TcpStream::connect_timeout(&addr, Duration::from_secs(1))
    }

    fn sock(ip: IpAddr, port: u16) -> SocketAddr {
        SocketAddr::new(ip, port)
    }

    #[test]
    fn reachability_partition_and_heal() {
        let Some(net) = network_or_skip(2) else {
            return;
        };
        let _server = start_server(&net, 0);
        let node0 = sock(net.node_ip(0), PORT);

        // An echo server in the root namespace, on the bridge address.
        let host_listener = TcpListener::bind((net.host_ip(), 0)).unwrap();
        let host = host_listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in host_listener.incoming().flatten() {
                std::thread::spawn(move || echo(stream));
            }
        });

        // 1. Everything reaches everything.
        assert_eq!(client(&net, 1, node0), 0, "node 1 -> node 0");
        exchange(
            &mut root_connect(node0).unwrap(),
            b"hi\n",
            Duration::from_secs(2),
        )
        .unwrap();
        assert_eq!(client(&net, 0, host), 0, "node 0 -> host");
        assert_eq!(client(&net, 1, host), 0, "node 1 -> host");

        let mut established = root_connect(node0).unwrap();
        exchange(&mut established, b"before\n", Duration::from_secs(2)).unwrap();

        // 2. Partition node 0 (twice: idempotent, one table, two rules).
        net.partition(0).unwrap();
        net.partition(0).unwrap();
        let ruleset =
            run(net
                .command(0, &net.nft)
                .args(["list", "table", "inet", PARTITION_TABLE]))
            .unwrap();
        assert_eq!(ruleset.matches("drop").count(), 2, "{ruleset}");

        assert_ne!(client(&net, 1, node0), 0, "node 1 -> partitioned node 0");
        let err = root_connect(node0).expect_err("root -> partitioned node 0");
        assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
        assert_ne!(client(&net, 0, host), 0, "partitioned node 0 -> host");
        // Loopback inside node 0 keeps working, via its own address too.
        assert_eq!(client(&net, 0, node0), 0, "node 0 -> own address");
        assert_eq!(client(&net, 0, sock([127, 0, 0, 1].into(), PORT)), 0);
        // Other nodes are unaffected.
        assert_eq!(client(&net, 1, host), 0, "node 1 -> host");

        // 3. The established connection stalls instead of failing.
        established.write_all(b"during\n").unwrap();
        established
            .set_read_timeout(Some(Duration::from_secs(1)))
            .unwrap();
        let mut buf = [0u8; 16];
        let err = established.read(&mut buf).expect_err("stalled read");
        assert!(
            matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{err}"
        );

        // Heal (twice: idempotent); the queued data is retransmitted.
        net.heal(0).unwrap();
        net.heal(0).unwrap();
        let healed = Instant::now();
        read_back(&mut established, b"during\n", Duration::from_secs(30)).unwrap();
        eprintln!(
            "stalled connection resumed {:?} after heal",
            healed.elapsed()
        );
        exchange(&mut established, b"after\n", Duration::from_secs(2)).unwrap();
        assert_eq!(client(&net, 1, node0), 0, "node 1 -> healed node 0");
        assert_eq!(client(&net, 0, host), 0, "healed node 0 -> host");
        exchange(
            &mut root_connect(node0).unwrap(),
            b"hi\n",
            Duration::from_secs(2),
        )
        .unwrap();
    }

    /// Names (namespaces and root-namespace links) that currently exist.
    fn existing(net_ip: &Path) -> Vec<String> {
        let mut names = existing_links(net_ip);
        names.extend(existing_namespaces(net_ip));
        names
    }

    #[test]
    fn drop_removes_namespaces_and_links() {
        let Some(net) = network_or_skip(3) else {
            return;
        };
        let ip = net.ip.clone();
        let names = net.names();
        assert_eq!(names.len(), 7, "{names:?}");
        let before = existing(&ip);
        for name in &names {
            assert!(before.contains(name), "{name} missing before drop");
        }
        drop(net);
        let after = existing(&ip);
        for name in &names {
            assert!(!after.contains(name), "{name} still exists after drop");
        }
    }

    #[test]
    fn remove_stale_removes_dead_owners_only() {
        let Some(live) = network_or_skip(1) else {
            return;
        };
        // A pid that is certainly dead: a child that has exited and was reaped.
        let mut child = Command::new("true").spawn().unwrap();
        let dead_pid = child.id();
        child.wait().unwrap();
        assert!(!Path::new(&format!("/proc/{dead_pid}")).exists());

        let stale = Network::create_as(2, dead_pid).unwrap();
        let stale_names = stale.names();
        // What a SIGKILLed harness leaves behind: no Drop.
        std::mem::forget(stale);
        let ip = live.ip.clone();
        let before = existing(&ip);
        for name in &stale_names {
            assert!(before.contains(name), "{name} missing before remove_stale");
        }

        remove_stale();
        let after = existing(&ip);
        for name in &stale_names {
            assert!(!after.contains(name), "{name} survived remove_stale");
        }
        for name in live.names() {
            assert!(after.contains(&name), "remove_stale removed live {name}");
        }
    }

    #[test]
    fn command_pid_is_the_program_pid() {
        let Some(net) = network_or_skip(1) else {
            return;
        };
        let mut child = Reaped(net.command(0, "sleep").arg("30").spawn().unwrap());
        let pid = child.0.id();
        // Until `ip` has exec'd, /proc/PID/comm still says "ip".
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut comm = String::new();
        while Instant::now() < deadline {
            comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap();
            if comm.trim() == "sleep" {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(comm.trim(), "sleep", "pid {pid} is not the program");
        // Its parent is this test process: no intermediate process.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let ppid: u32 = stat
            .rsplit(") ")
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(ppid, std::process::id());
        // It runs in node 0's namespace.
        let ns = std::fs::metadata(format!("/proc/{pid}/ns/net")).unwrap();
        let named = std::fs::metadata(format!("/run/netns/{}", net.namespace(0))).unwrap();
        assert_eq!((ns.dev(), ns.ino()), (named.dev(), named.ino()));
        // And signals to child.id() reach it.
        child.0.kill().unwrap();
        let status = child.0.wait().unwrap();
        assert!(!status.success());
    }

    #[test]
    fn names_fit_and_parse() {
        let worst = Owner {
            pid: PID_LIMIT - 1,
            slot: 255,
        };
        for kind in [
            Kind::Bridge,
            Kind::Veth(MAX_NODES - 1),
            Kind::Netns(MAX_NODES - 1),
        ] {
            let name = worst.name(kind);
            assert!(name.len() <= 15, "{name} too long");
            assert_eq!(parse_name(&name), Some((worst, kind)));
        }
        let o = Owner {
            pid: 0x1b,
            slot: 0xa,
        };
        for kind in [Kind::Bridge, Kind::Veth(0), Kind::Netns(17)] {
            assert_eq!(parse_name(&o.name(kind)), Some((o, kind)));
        }
        for bad in [
            "ckc",
            "ckc12g3",
            "ckc12g3x",
            "ckc12g3s1",
            "ckcg3s",
            "ckc12g123s",
            "eth0",
            "ckc1234567g0s",
            "ckc12G3s",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn create_rejects_bad_node_counts() {
        assert!(Network::create(0).is_err());
        assert!(Network::create(MAX_NODES + 1).is_err());
    }

    #[test]
    fn prefixes_parse() {
        assert_eq!(parse_prefix("10.1.2.3/24"), Some((0x0a01_0203, 24)));
        assert_eq!(parse_prefix("127.0.0.1"), Some((0x7f00_0001, 32)));
        assert_eq!(parse_prefix("default"), None);
        assert_eq!(parse_prefix("1.2.3.4/33"), None);
    }
}
