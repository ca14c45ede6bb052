//! The etcd control plane against the test command's 3-member etcd cluster
//! (`CKPT_TEST_ETCD`): concurrent proposals converge on one generation, a member
//! whose lease goes ends the generation for the others, bootstrap keys are scoped to
//! their generation, the snapshot record is one key of the job outside every
//! generation, and garbage in the job's keys is ignored, not obeyed.

#![cfg(feature = "etcd")]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

mod common;

use ckpt_testkit::{Capability, has};

use ckpt_elastic::{
    Cancel, ControlPlane, CoordinatorConfig, Directive, ElasticError, EtcdControlPlane, EtcdJob,
    EtcdSettings, EtcdUrl,
};
use common::{member, unique_job};

fn url() -> EtcdUrl {
    // The tests check `has(Capability::Etcd)` first.
    EtcdUrl::parse(&ckpt_testkit::env("CKPT_TEST_ETCD")).unwrap()
}

/// Publishes the job's settings and connects `n` members.
fn start(name: &str, n: usize, min: usize) -> (EtcdJob, Vec<Arc<EtcdControlPlane>>, String) {
    start_with(name, n, min, Duration::from_secs(2))
}

fn start_with(
    name: &str,
    n: usize,
    min: usize,
    heartbeat_timeout: Duration,
) -> (EtcdJob, Vec<Arc<EtcdControlPlane>>, String) {
    let job = unique_job(name);
    let mut config = CoordinatorConfig::new(job.clone(), min, n);
    config.timeouts.heartbeat_timeout = heartbeat_timeout;
    let launcher = EtcdJob::connect(&url(), &config, EtcdSettings::default()).unwrap();
    let planes = (0..n)
        .map(|i| {
            Arc::new(
                EtcdControlPlane::connect(&url(), member(&job, i), None, EtcdSettings::default())
                    .unwrap(),
            )
        })
        .collect();
    (launcher, planes, job)
}

/// Waits (20 s at most) for `plane`'s directive about `generation`, which must be a
/// restart.
fn await_restart(plane: &EtcdControlPlane, generation: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(
            Instant::now() < deadline,
            "no restart of generation {generation}"
        );
        if let Some(d) = plane.watch(generation, Duration::from_millis(200)).unwrap() {
            assert!(matches!(d, Directive::Restart { .. }), "{d:?}");
            return;
        }
    }
}

/// Every plane rendezvous at once (after `after`); returns the assignments.
fn rendezvous_all(planes: &[Arc<EtcdControlPlane>], after: u64) -> Vec<ckpt_elastic::Assignment> {
    let threads: Vec<_> = planes
        .iter()
        .map(|p| {
            let p = p.clone();
            std::thread::spawn(move || p.rendezvous(after, &Cancel::new()).unwrap())
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn concurrent_members_converge_on_one_generation_and_its_keys() {
    if !has(Capability::Etcd) {
        return;
    }
    let (launcher, planes, _) = start("converge", 4, 4);
    let assignments = rendezvous_all(&planes, 0);
    for (i, a) in assignments.iter().enumerate() {
        assert_eq!(a.generation, assignments[0].generation);
        assert_eq!(
            (a.members, a.roster),
            (assignments[0].members, assignments[0].roster),
            "one world for all"
        );
        assert_eq!(a.rank, i, "m{i} holds rank {i}: nodes n0, n0, n1, n1");
    }
    assert_eq!(assignments[0].world_size, 4);
    let g = assignments[0].generation;
    planes[0].kv_set(g, "addr", "127.0.0.1:1234").unwrap();
    let got = planes[3]
        .kv_get(g, "addr", &Cancel::new(), Duration::from_secs(10))
        .unwrap();
    assert_eq!(got, "127.0.0.1:1234");
    // Keys of another generation are refused, not mixed in.
    assert!(matches!(
        planes[1].kv_set(g + 1, "addr", "x"),
        Err(ElasticError::Rejected(_))
    ));
    // The launcher follows the job on a watch of its own, which may lag the members'.
    let formed = launcher.wait_for_event(
        Duration::from_secs(10),
        |e| matches!(e, ckpt_elastic::Event::Formed { generation, .. } if *generation == g),
    );
    assert!(formed.is_some(), "the launcher sees the generation form");
}

#[test]
fn a_member_that_leaves_ends_the_generation_and_the_others_form_the_next() {
    if !has(Capability::Etcd) {
        return;
    }
    let (_launcher, mut planes, _) = start("leave", 3, 2);
    let first = rendezvous_all(&planes, 0)[0].generation;
    // Dropping a plane revokes its lease, as the launcher does when a rank dies.
    drop(planes.pop());
    let deadline = Instant::now() + Duration::from_secs(20);
    let directive = loop {
        if let Some(d) = planes[0].watch(first, Duration::from_millis(200)).unwrap() {
            break d;
        }
        assert!(
            Instant::now() < deadline,
            "no directive after a member left"
        );
    };
    assert!(
        matches!(&directive, Directive::Restart { generation, cause } if *generation == first && cause.contains("m2")),
        "{directive:?}"
    );
    let next = rendezvous_all(&planes, first);
    assert!(next[0].generation > first);
    assert_eq!(next[0].world_size, 2);
    // The bootstrap keys of the ended generation are answered as over.
    assert!(matches!(
        planes[0].kv_get(first, "nothing", &Cancel::new(), Duration::from_secs(5)),
        Err(ElasticError::Rejected(_))
    ));
}

#[test]
fn garbage_in_the_jobs_keys_is_ignored_and_a_settingsless_job_is_refused() {
    if !has(Capability::Etcd) {
        return;
    }
    let (_launcher, planes, name) = start("garbage", 2, 2);
    let first = rendezvous_all(&planes, 0)[0].generation;
    let url = url();
    // A stranger writes nonsense over the generation record and a member key.
    for (key, value) in [("generation", "{not json"), ("members/m9", "[1,2,3]")] {
        etcdctl_put(&name, key, value);
    }
    // Neither is obeyed: no directive, the generation stays.
    assert_eq!(
        planes[0].watch(first, Duration::from_millis(500)).unwrap(),
        None
    );
    // And the job can still advance: the next record replaces the garbage.
    let next = rendezvous_all(&planes, first);
    assert!(next[0].generation > first, "{next:?}");
    assert_eq!(next[0].members, next[1].members);
    // A member of a job nobody configured gets a clear error, not a hang.
    let settings = EtcdSettings {
        connect_timeout: Duration::from_millis(500),
        ..EtcdSettings::default()
    };
    let lonely = EtcdControlPlane::connect(&url, member(&unique_job("lonely"), 0), None, settings);
    match lonely {
        Err(ElasticError::Rejected(e)) => assert!(e.contains("ckpt-train launch"), "{e}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("connected to a job without settings"),
    }
}

#[test]
fn an_idle_member_keeps_its_watch_and_sends_only_keep_alives() {
    if !has(Capability::Etcd) {
        return;
    }
    // The default heartbeat timeout (5 s): a keep-alive every 5/3 s.
    let (launcher, planes, _) = start_with("idle", 2, 2, Duration::from_secs(5));
    let generation = rendezvous_all(&planes, 0)[0].generation;
    let progress = ckpt_elastic::Progress::default();
    let (before, launcher_before) = (planes[0].requests(), launcher.requests());
    // Long enough for connection-level trouble to show (etcd closes connections that
    // ping more often than every 5 s): no re-read, no new watch, keep-alives only.
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(15) {
        for plane in &planes {
            plane.heartbeat(generation, &progress).unwrap();
        }
        assert_eq!(
            planes[0]
                .watch(generation, Duration::from_millis(500))
                .unwrap(),
            None
        );
    }
    let sent = planes[0].requests() - before;
    // A keep-alive is a request and its answer, every 5/3 s.
    let most = 2 * (15 * 3 / 5 + 1);
    assert!(
        sent <= most,
        "{sent} requests in 15 s of steady state; expected at most {most} keep-alive messages"
    );
    assert_eq!(
        launcher.requests(),
        launcher_before,
        "a launcher only watches: its watch must not break and be set up again"
    );
}

#[test]
fn hundreds_of_node_members_form_one_generation_and_survive_a_lost_node() {
    if !has(Capability::Etcd) {
        return;
    }
    // Nodes of 8 ranks each (members holding 8 ranks): as many as
    // CKPT_TEST_ETCD_NODES says, 128 (1,024 ranks) by default.
    let nodes: usize = std::env::var("CKPT_TEST_ETCD_NODES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(128);
    let job = unique_job("nodes");
    let mut config = CoordinatorConfig::new(job.clone(), 8, 8 * nodes);
    // A time to live of 5 s: one thread heartbeats for every member, and may be slow
    // on a busy machine.
    config.timeouts.heartbeat_timeout = Duration::from_secs(5);
    config.timeouts.join_timeout = Duration::from_secs(10);
    let launcher = EtcdJob::connect(&url(), &config, EtcdSettings::default()).unwrap();
    // Every connected member heartbeats (its node agent would), which keeps its lease.
    let beating: Arc<Mutex<Vec<Weak<EtcdControlPlane>>>> = Arc::default();
    let generation = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let heart = {
        let (beating, generation, stop) = (beating.clone(), generation.clone(), stop.clone());
        std::thread::spawn(move || {
            let progress = ckpt_elastic::Progress::default();
            while !stop.load(Ordering::SeqCst) {
                let planes: Vec<_> = beating.lock().unwrap().clone();
                for plane in planes.iter().filter_map(Weak::upgrade) {
                    let _ = plane.heartbeat(generation.load(Ordering::SeqCst), &progress);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let started = Instant::now();
    let mut planes: Vec<Arc<EtcdControlPlane>> = (0..nodes)
        .map(|i| {
            let node = ckpt_elastic::Member {
                ranks: 8,
                ..member(&job, i)
            };
            let plane = Arc::new(
                EtcdControlPlane::connect(&url(), node, None, EtcdSettings::default()).unwrap(),
            );
            beating.lock().unwrap().push(Arc::downgrade(&plane));
            plane
        })
        .collect();
    let connected = started.elapsed();
    let requests =
        |planes: &[Arc<EtcdControlPlane>]| -> u64 { planes.iter().map(|p| p.requests()).sum() };
    let before = requests(&planes);
    let asked = Instant::now();
    let first = rendezvous_all(&planes, 0);
    let formed = asked.elapsed();
    let g1 = first[0].generation;
    generation.store(g1, Ordering::SeqCst);
    assert!(first.iter().all(|a| a.generation == g1
        && a.world_size == 8 * nodes
        && a.members == nodes
        && a.ranks == 8));
    let mut blocks: Vec<usize> = first.iter().map(|a| a.rank).collect();
    blocks.sort_unstable();
    assert_eq!(blocks, (0..nodes).map(|i| 8 * i).collect::<Vec<_>>());
    let formation_requests = requests(&planes) - before;
    // Steady state: a few seconds of heartbeats send keep-alives only (a request and
    // its answer, every third of the 5 s time to live).
    let before = requests(&planes);
    std::thread::sleep(Duration::from_secs(3));
    let steady = requests(&planes) - before;
    let most = nodes as u64 * 2 * (3 * 3 / 5 + 2);
    assert!(steady <= most, "{steady} requests in 3 s, more than {most}");
    // A node is lost (its launcher exits: its lease is revoked): every survivor is
    // told to restart, and the survivors form the next generation.
    let lost = Instant::now();
    drop(planes.pop());
    std::thread::scope(|scope| {
        for plane in &planes {
            scope.spawn(move || await_restart(plane, g1));
        }
    });
    let told = lost.elapsed();
    let next = rendezvous_all(&planes, g1);
    let reformed = lost.elapsed();
    assert!(
        next.iter()
            .all(|a| a.generation > g1 && a.members == nodes - 1)
    );
    eprintln!(
        "{nodes} members of 8 ranks: connected in {connected:?}; formed {formed:?} after all \
         asked ({formation_requests} requests); steady state: {steady} requests in 3 s; a lost \
         node: every survivor told in {told:?}, the next generation formed {reformed:?} after \
         the loss"
    );
    stop.store(true, Ordering::SeqCst);
    heart.join().unwrap();
    drop(launcher);
}

/// Members connected on one runtime the caller shares (as the scale bench runs
/// thousands): they form a generation like members with runtimes of their own, and
/// a member dropped ends every task it started there, so that a dropped node's
/// client stops following the job rather than living on in the process.
#[test]
fn members_on_a_shared_runtime_form_and_leave_no_task_behind() {
    if !has(Capability::Etcd) {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let alive = || runtime.metrics().num_alive_tasks();
    let idle = alive();
    let job = unique_job("shared");
    let config = CoordinatorConfig::new(job.clone(), 2, 3);
    let launcher = EtcdJob::connect(&url(), &config, EtcdSettings::default()).unwrap();
    let mut planes: Vec<Arc<EtcdControlPlane>> = (0..3)
        .map(|i| {
            Arc::new(
                EtcdControlPlane::connect_in(
                    runtime.handle(),
                    &url(),
                    member(&job, i),
                    None,
                    EtcdSettings::default(),
                )
                .unwrap(),
            )
        })
        .collect();
    let first = rendezvous_all(&planes, 0);
    assert!(
        first
            .iter()
            .all(|a| a.generation == first[0].generation && a.members == 3)
    );
    let g1 = first[0].generation;
    let with_three = alive();
    assert!(
        with_three > idle,
        "the members' tasks run on the shared runtime"
    );
    drop(planes.pop());
    for plane in &planes {
        await_restart(plane, g1);
    }
    let next = rendezvous_all(&planes, g1);
    assert!(next.iter().all(|a| a.generation > g1 && a.members == 2));
    // Aborted tasks (and the client's connection tasks they held) end soon after,
    // not at once: no event says when, so the count is read until a deadline.
    let gone = |limit: usize| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive() > limit {
            assert!(
                Instant::now() < deadline,
                "{} tasks alive, expected at most {limit}",
                alive()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    gone(with_three - 3);
    drop(planes);
    gone(idle);
    drop(launcher);
}

/// Writes `value` at `key` under the job's root with etcdctl, as a stranger would.
fn etcdctl_put(job: &str, key: &str, value: &str) {
    let url = url();
    let etcdctl = std::env::var("CKPT_TEST_ETCDCTL_BIN").expect("set by scripts/test");
    let status = std::process::Command::new(&etcdctl)
        .env("ETCDCTL_API", "3")
        .args([
            "--endpoints",
            &url.endpoints.join(","),
            "put",
            &format!("{}{key}", url.root(job).unwrap()),
            value,
        ])
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
}

/// The value at `key` under the job's root, read with etcdctl.
fn etcdctl_get(job: &str, key: &str) -> String {
    let url = url();
    let etcdctl = std::env::var("CKPT_TEST_ETCDCTL_BIN").expect("set by scripts/test");
    let output = std::process::Command::new(&etcdctl)
        .env("ETCDCTL_API", "3")
        .args([
            "--endpoints",
            &url.endpoints.join(","),
            "get",
            "--print-value-only",
            &format!("{}{key}", url.root(job).unwrap()),
        ])
        .output()
        .unwrap();
    assert!(output.status.success());
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn the_snapshot_record_is_one_job_key_that_names_its_generation_and_garbage_in_it_reads_as_none() {
    if !has(Capability::Etcd) {
        return;
    }
    let (_launcher, planes, job) = start("snapshot", 2, 2);
    let g1 = rendezvous_all(&planes, 0)[0].generation;
    planes[0].commit_snapshot(g1, "step 10").unwrap();
    let stored: serde_json::Value = serde_json::from_str(etcdctl_get(&job, "snapshot").trim())
        .expect("one JSON value at the job's snapshot key");
    assert_eq!(
        stored,
        serde_json::json!({"generation": g1, "record": "step 10"})
    );
    // A stranger's nonsense is not obeyed: it reads as none, and the next commit
    // replaces it.
    etcdctl_put(&job, "snapshot", "{not json");
    assert_eq!(planes[1].committed_snapshot().unwrap(), None);
    planes[1].commit_snapshot(g1, "step 20").unwrap();
    assert_eq!(
        planes[0].committed_snapshot().unwrap().as_deref(),
        Some("step 20")
    );
}
