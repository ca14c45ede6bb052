//! One coordinator serving thousands of connections without a thread each.
//!
//! A file of its own, with one test, so that no other test's threads come and go
//! in this process while it counts its threads.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

mod common;

use ckpt_elastic::protocol::{self, ClientMessage, ServerMessage};
use ckpt_elastic::{Coordinator, CoordinatorConfig, CoordinatorHandle, Directive, Progress};

const JOB: &str = "elastic-scale-test";
/// Members connected at once: each is a connection of its own.
const MEMBERS: usize = 3_000;
/// Bound on waits for something that must happen.
const PATIENCE: Duration = Duration::from_secs(20);

/// Threads of this process now.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("read /proc/self/task")
        .count()
}

/// This process's resident memory in KiB, for the log.
fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Raises this process's soft limit on open files to its hard limit; the limit
/// after, or `None` if it cannot be read.
fn raise_file_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the call's duration.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return None;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit, only read by the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.rlim_cur = limit.rlim_max;
        }
    }
    Some(limit.rlim_cur)
}

fn send_all(stream: &mut TcpStream, messages: &[ClientMessage]) {
    let mut lines = String::new();
    for message in messages {
        lines.push_str(&protocol::encode(message).unwrap());
    }
    stream
        .write_all(lines.as_bytes())
        .expect("write to the coordinator");
}

fn heartbeat(generation: u64) -> ClientMessage {
    ClientMessage::Heartbeat {
        generation,
        progress: Progress::default(),
    }
}

/// Connects member `i`, who was in generation 1 (which the coordinator never
/// formed), says hello and heartbeats; the first heartbeat is for no generation
/// (waiting), the second for generation 1, which is stale.
fn connect(addr: SocketAddr, i: usize) -> BufReader<TcpStream> {
    let mut stream = TcpStream::connect(addr).expect("connect to the coordinator");
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let hello = ClientMessage::Hello {
        version: protocol::VERSION,
        member: common::member(JOB, i),
        seen: 1,
        checkpoint_generation: 0,
        claim: None,
    };
    send_all(&mut stream, &[hello, heartbeat(0), heartbeat(1)]);
    BufReader::new(stream)
}

/// The next message; `None` when none came within the read timeout.
fn next(member: &mut BufReader<TcpStream>, line: &mut String) -> Option<ServerMessage> {
    match member.read_line(line) {
        Ok(0) => panic!("the coordinator closed a member's connection"),
        Ok(_) => {
            let message = protocol::decode(line.trim_end().as_bytes()).unwrap();
            line.clear();
            Some(message)
        }
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => None,
        Err(e) => panic!("reading from the coordinator: {e}"),
    }
}

fn is_stale(message: &ServerMessage) -> bool {
    matches!(
        message,
        ServerMessage::Directive {
            directive: Directive::Stale { .. }
        }
    )
}

/// Connects member 0 and waits until the coordinator has settled: until then it
/// takes a stale heartbeat for news of a generation it missed, and says nothing.
fn settled(addr: SocketAddr) -> BufReader<TcpStream> {
    let mut probe = connect(addr, 0);
    probe
        .get_ref()
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let deadline = Instant::now() + PATIENCE;
    let mut line = String::new();
    loop {
        assert!(Instant::now() < deadline, "the coordinator never settled");
        match next(&mut probe, &mut line) {
            Some(message) if is_stale(&message) => break,
            Some(_) => {}
            None => send_all(probe.get_mut(), &[heartbeat(1)]),
        }
    }
    probe.get_ref().set_read_timeout(Some(PATIENCE)).unwrap();
    probe
}

fn start() -> CoordinatorHandle {
    // Nobody asks for a generation: none forms.
    let mut config = CoordinatorConfig::new(JOB, 1, MEMBERS);
    config.settle = Duration::ZERO;
    Coordinator::bind("127.0.0.1:0".parse().unwrap(), config)
        .expect("bind a coordinator")
        .spawn()
}

#[test]
fn three_thousand_members_are_served_without_a_thread_each() {
    // Both ends of every connection live in this process.
    let need = 2 * MEMBERS as u64 + 256;
    match raise_file_limit() {
        Some(limit) if limit >= need => {}
        limit => {
            eprintln!(
                "SKIPPED three_thousand_members_are_served_without_a_thread_each: \
                 it needs {need} open files and the hard limit allows {limit:?}"
            );
            return;
        }
    }
    let coordinator = start();
    let addr = coordinator.local_addr();
    let threads_before = threads();
    let resident_before = resident_kib();

    let started = Instant::now();
    let mut members = vec![settled(addr)];
    members.extend((1..MEMBERS).map(|i| connect(addr, i)));
    // Each member is welcomed and told its generation is stale: its hello and both
    // heartbeats were read and answered, in order.
    let mut line = String::new();
    for (i, member) in members.iter_mut().enumerate().skip(1) {
        let welcome = next(member, &mut line).expect("a welcome");
        assert!(
            matches!(welcome, ServerMessage::Welcome { .. }),
            "member {i} got {welcome:?}"
        );
        let stale = next(member, &mut line).expect("a stale directive");
        assert!(is_stale(&stale), "member {i} got {stale:?}");
    }
    let served = started.elapsed();
    assert_eq!(coordinator.members(), MEMBERS);

    assert!(coordinator.job_over().is_none());

    let threads_after = threads();
    let resident_after = resident_kib();
    eprintln!(
        "{MEMBERS} members served in {served:?}; threads {threads_before} -> {threads_after}; \
         resident memory (both ends of every connection) {resident_before} KiB -> \
         {resident_after} KiB"
    );
    assert_eq!(
        threads_after, threads_before,
        "the coordinator started threads for its connections"
    );

    let stopping = Instant::now();
    coordinator.stop();
    coordinator.join().expect("the coordinator ends cleanly");
    let stopped = stopping.elapsed();
    assert!(
        stopped < Duration::from_secs(2),
        "stopping took {stopped:?}"
    );
    for (i, member) in members.iter_mut().enumerate() {
        let mut rest = Vec::new();
        // A reset (lines of ours the coordinator had not read yet) is a close too.
        let closed = match member.read_to_end(&mut rest) {
            Ok(_) => rest.is_empty(),
            Err(e) => e.kind() == ErrorKind::ConnectionReset,
        };
        assert!(closed, "member {i}'s connection is still open after stop");
    }
}
