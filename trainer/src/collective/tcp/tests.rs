//! The job-secret check of the TCP ring, on real loopback sockets with one thread
//! per rank: a ring whose ranks share the secret works, strangers at the rendezvous
//! or at a data listener are refused and counted without stopping the ring from
//! forming, and a rank with another secret cannot join.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use ckpt_auth::{AuthError, HANDSHAKE_TIMEOUT, JobSecret};

use super::{TcpCollective, TcpConfig};
use crate::collective::{Collective, CollectiveResult};

const JOB: &str = "the secret of this training job";
const OTHER_JOB: &str = "the secret of another training job";

fn secret(text: &str) -> JobSecret {
    JobSecret::new(text, "test").unwrap()
}

fn config(secret_text: Option<&str>, connect_timeout: Duration) -> TcpConfig {
    TcpConfig {
        timeout: Duration::from_secs(20),
        connect_timeout,
        secret: secret_text.map(secret),
    }
}

/// All-reduces a vector that depends on the rank and checks the sum; returns the
/// communicator for the caller's checks.
fn all_reduce_checked(comm: TcpCollective) -> TcpCollective {
    let (rank, world) = (comm.rank() as i64, comm.world_size() as i64);
    let mut data: Vec<i64> = (0..1000).map(|i| (rank + 1) * 1_000_000 + i).collect();
    comm.all_reduce_i64(&mut data).unwrap();
    let ranks: i64 = (1..=world).map(|r| r * 1_000_000).sum();
    for (i, got) in data.iter().enumerate() {
        assert_eq!(*got, ranks + world * i as i64, "rank {rank} element {i}");
    }
    comm
}

/// Rank `rank` of a bootstrapped world on a thread of its own (rank 0 takes the
/// rendezvous listener), all-reducing once it joined.
fn spawn_rank(
    rank: usize,
    world: usize,
    rendezvous: SocketAddr,
    root: Option<TcpListener>,
    config: TcpConfig,
) -> JoinHandle<(CollectiveResult<TcpCollective>, Duration)> {
    thread::spawn(move || {
        let started = Instant::now();
        let comm = match root {
            Some(listener) => TcpCollective::bootstrap_root(listener, world, config),
            None => TcpCollective::bootstrap(rank, world, rendezvous, config),
        };
        let elapsed = started.elapsed();
        (comm.map(all_reduce_checked), elapsed)
    })
}

/// Rank `rank` of an elastic ring over `listeners`' addresses, on a thread of its own.
fn spawn_peer(
    rank: usize,
    listener: TcpListener,
    addrs: &[SocketAddr],
    config: TcpConfig,
) -> JoinHandle<(CollectiveResult<TcpCollective>, Duration)> {
    let world = addrs.len();
    let next = addrs[(rank + 1) % world];
    thread::spawn(move || {
        let started = Instant::now();
        let comm = TcpCollective::from_peers(rank, world, 7, listener, next, config, &|| false);
        let elapsed = started.elapsed();
        (comm.map(all_reduce_checked), elapsed)
    })
}

fn listeners(n: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let listeners: Vec<_> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    (listeners, addrs)
}

/// Waits until the ring closes `stream` (which it does once it counted the refusal).
fn wait_closed(mut stream: &TcpStream) {
    stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT * 3))
        .unwrap();
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                panic!("the ring did not close a stranger's connection")
            }
            // Reset: the ring closed it with the stranger's bytes unread.
            Err(_) => return,
        }
    }
}

/// A stranger that speaks another protocol: refused at its first bytes.
fn garbage_stranger(addr: SocketAddr) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    wait_closed(&stream);
}

/// A stranger that runs the handshake with another job's secret: the ring proves
/// the job's (which the stranger cannot check), then refuses it.
fn wrong_secret_stranger(addr: SocketAddr) {
    let stream = TcpStream::connect(addr).unwrap();
    let err = ckpt_auth::prove_tcp(&stream, &secret(OTHER_JOB)).unwrap_err();
    assert!(matches!(err, AuthError::ServerUnproven), "{err}");
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    wait_closed(&stream);
}

fn joined(
    handles: Vec<JoinHandle<(CollectiveResult<TcpCollective>, Duration)>>,
) -> Vec<TcpCollective> {
    handles
        .into_iter()
        .map(|h| h.join().unwrap().0.unwrap())
        .collect()
}

#[test]
fn three_ranks_with_the_job_secret_form_a_ring_and_all_reduce() {
    // Bootstrapped through rank 0's rendezvous.
    let root = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = root.local_addr().unwrap();
    let mut root = Some(root);
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            let config = config(Some(JOB), Duration::from_secs(20));
            spawn_rank(rank, 3, addr, root.take(), config)
        })
        .collect();
    for comm in joined(handles) {
        assert_eq!(comm.refused_connections(), 0, "{comm:?}");
    }
    // An elastic ring over published addresses.
    let (ls, addrs) = listeners(3);
    let handles: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| spawn_peer(rank, l, &addrs, config(Some(JOB), Duration::from_secs(20))))
        .collect();
    for comm in joined(handles) {
        assert_eq!(comm.refused_connections(), 0, "{comm:?}");
    }
}

#[test]
fn strangers_at_the_rendezvous_are_refused_and_counted_and_the_ring_still_forms() {
    let started = Instant::now();
    let root = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = root.local_addr().unwrap();
    let rank0 = spawn_rank(
        0,
        3,
        addr,
        Some(root),
        config(Some(JOB), Duration::from_secs(20)),
    );
    // First in the queue: a stranger that connects and says nothing. It must not
    // hold rank 0 for the handshake's timeout.
    let silent = TcpStream::connect(addr).unwrap();
    garbage_stranger(addr);
    wrong_secret_stranger(addr);
    let others: Vec<_> = (1..3)
        .map(|rank| {
            spawn_rank(
                rank,
                3,
                addr,
                None,
                config(Some(JOB), Duration::from_secs(20)),
            )
        })
        .collect();
    let comms = joined(std::iter::once(rank0).chain(others).collect());
    let took = started.elapsed();
    assert!(
        took < HANDSHAKE_TIMEOUT,
        "the ring took {took:?}: a silent stranger held the rendezvous"
    );
    // The silent stranger's handshake is still in progress: not counted yet.
    assert_eq!(comms[0].refused_connections(), 2);
    assert_eq!(comms[1].refused_connections(), 0);
    assert_eq!(comms[2].refused_connections(), 0);
    // Once it gives up, it is refused and counted too.
    silent.shutdown(std::net::Shutdown::Write).unwrap();
    wait_closed(&silent);
    assert_eq!(comms[0].refused_connections(), 3);
}

#[test]
fn strangers_at_a_data_listener_are_refused_and_counted_and_the_ring_still_forms() {
    let started = Instant::now();
    let (mut ls, addrs) = listeners(3);
    let l0 = ls.remove(0);
    // Ranks 1 and 2 start; rank 1 waits for its predecessor, rank 0, which is not
    // there yet (rank 2 waits for rank 0's answer to its handshake meanwhile).
    let later: Vec<_> = ls
        .into_iter()
        .zip(1..)
        .map(|(l, rank)| spawn_peer(rank, l, &addrs, config(Some(JOB), Duration::from_secs(20))))
        .collect();
    // Strangers at rank 1's data listener, where its predecessor is expected.
    let silent = TcpStream::connect(addrs[1]).unwrap();
    garbage_stranger(addrs[1]);
    wrong_secret_stranger(addrs[1]);
    let rank0 = spawn_peer(0, l0, &addrs, config(Some(JOB), Duration::from_secs(20)));
    let comms = joined(std::iter::once(rank0).chain(later).collect());
    let took = started.elapsed();
    assert!(
        took < HANDSHAKE_TIMEOUT,
        "the ring took {took:?}: a silent stranger held a data listener"
    );
    assert_eq!(comms[0].refused_connections(), 0);
    assert_eq!(comms[1].refused_connections(), 2);
    assert_eq!(comms[2].refused_connections(), 0);
    silent.shutdown(std::net::Shutdown::Write).unwrap();
    wait_closed(&silent);
    assert_eq!(comms[1].refused_connections(), 3);
}

#[test]
fn a_rank_with_another_secret_cannot_join_a_bootstrap() {
    let connect_timeout = Duration::from_millis(1500);
    let root = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = root.local_addr().unwrap();
    let rank0 = spawn_rank(0, 3, addr, Some(root), config(Some(JOB), connect_timeout));
    let rank1 = spawn_rank(1, 3, addr, None, config(Some(JOB), connect_timeout));
    let rank2 = spawn_rank(2, 3, addr, None, config(Some(OTHER_JOB), connect_timeout));

    let (result, took) = rank2.join().unwrap();
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains("job-secret handshake")
            && err.contains("rank 0")
            && err.contains(&addr.to_string()),
        "{err}"
    );
    assert!(took < connect_timeout, "{took:?}: {err}");

    // Rank 0 waited for rank 2 until its deadline, and says why it never came.
    let err = rank0.join().unwrap().0.unwrap_err().to_string();
    assert!(err.contains("only 2 of 3 ranks joined"), "{err}");
    assert!(
        err.contains("1 connection was refused for not proving the job secret"),
        "{err}"
    );
    assert!(rank1.join().unwrap().0.is_err());
}

#[test]
fn a_rank_with_another_secret_cannot_join_an_elastic_ring() {
    let connect_timeout = Duration::from_millis(1500);
    let (ls, addrs) = listeners(3);
    let handles: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let text = if rank == 2 { OTHER_JOB } else { JOB };
            spawn_peer(rank, l, &addrs, config(Some(text), connect_timeout))
        })
        .collect();
    let mut results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let all = format!("{results:?}");
    let (rank2, took) = results.pop().unwrap();
    let err = rank2.unwrap_err().to_string();
    // Its successor, rank 0, does not prove the secret it holds.
    assert!(
        err.contains("job-secret handshake")
            && err.contains("rank 0")
            && err.contains(&addrs[0].to_string()),
        "{all}"
    );
    assert!(took < connect_timeout, "{took:?}: {err}");
    // Its predecessor finds another job's process at rank 2's address (or none, once
    // rank 2 gave up).
    let err = results[1].0.as_ref().unwrap_err().to_string();
    assert!(err.contains("rank 2"), "{err}");
    // Rank 0 refused rank 2's connection, and its error says so: its accept timed out
    // waiting for rank 2, or, first, its successor (rank 1, which gave up on rank 2)
    // closed the greeting, whose error also counts the refusal once it happened.
    let err = results[0].0.as_ref().unwrap_err().to_string();
    let timed_out = err.contains("timed out waiting for a peer to connect")
        && err.contains("1 connection was refused for not proving the job secret");
    let successor_left = err.contains("with rank 1");
    assert!(timed_out || successor_left, "{err}");
}

#[test]
fn a_rank_without_the_secret_is_refused_by_a_rendezvous_that_requires_it() {
    let connect_timeout = Duration::from_millis(1500);
    let root = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = root.local_addr().unwrap();
    let rank0 = spawn_rank(0, 2, addr, Some(root), config(Some(JOB), connect_timeout));
    let rank1 = spawn_rank(1, 2, addr, None, config(None, connect_timeout));
    let (result, took) = rank1.join().unwrap();
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains("rank 0") && err.contains("job secret"),
        "{err}"
    );
    assert!(took < connect_timeout, "{took:?}: {err}");
    let err = rank0.join().unwrap().0.unwrap_err().to_string();
    assert!(
        err.contains("only 1 of 2 ranks joined")
            && err.contains("1 connection was refused for not proving the job secret"),
        "{err}"
    );
}

/// Found by the elastic trainer tests (a node lost whole right after a generation
/// formed): a rank had accepted its predecessor and was retrying a successor that
/// had died, which refuses every connection. The generation was cancelled, but only
/// a failure of the accepting side stopped the greeting: the rank stayed in the
/// bootstrap until the connect deadline (120 s in an elastic rank), long past the
/// join timeout of the next generation, which dropped it.
#[test]
fn an_aborted_bootstrap_ends_while_the_successor_refuses_connections() {
    let connect_timeout = Duration::from_secs(30);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // Where the successor listened: nothing does any more.
    let gone = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let aborted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rank1 = {
        let aborted = aborted.clone();
        thread::spawn(move || {
            let is_aborted = || aborted.load(std::sync::atomic::Ordering::SeqCst);
            TcpCollective::from_peers(
                1,
                3,
                7,
                listener,
                gone,
                config(None, connect_timeout),
                &is_aborted,
            )
        })
    };
    // The predecessor joins: the accepting side is done.
    let mut prev = TcpStream::connect(addr).unwrap();
    prev.write_all(super::MAGIC).unwrap();
    prev.write_all(&0u32.to_le_bytes()).unwrap();
    prev.write_all(&7u64.to_le_bytes()).unwrap();
    thread::sleep(Duration::from_millis(300));
    assert!(!rank1.is_finished(), "the successor is gone: no ring");
    aborted.store(true, std::sync::atomic::Ordering::SeqCst);
    let at = Instant::now();
    let result = rank1.join().unwrap();
    let took = at.elapsed();
    assert!(
        matches!(result, Err(super::CollectiveError::Aborted { .. })),
        "{:?}",
        result.err()
    );
    assert!(
        took < Duration::from_secs(5),
        "ended {took:?} after the abort"
    );
}
