//! The TCP backend: the collectives' conformance suite (`conformance/`), and what
//! only the host trait has: uneven shards and the typed conveniences, mismatched
//! calls detected, and a peer process SIGKILLed during an all-gather.

use std::net::TcpListener;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use ckpt_trainer::collective::{
    Collective, CollectiveError, CollectiveExt, HostDevice, TcpCollective, TcpConfig, shard_counts,
};

mod conformance;

use conformance::{Backend, value};

/// Bootstraps `world` ranks on threads and runs `body` on each; returns their results.
fn with_world<T: Send>(
    world: usize,
    config: TcpConfig,
    body: impl Fn(TcpCollective) -> T + Sync,
) -> Vec<T> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..world)
            .map(|rank| {
                let (body, config, listener) = (&body, config.clone(), listener.take());
                s.spawn(move || {
                    let comm = if rank == 0 {
                        TcpCollective::bootstrap_root(listener.unwrap(), world, config).unwrap()
                    } else {
                        TcpCollective::bootstrap(rank, world, addr, config).unwrap()
                    };
                    body(comm)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// The TCP backend in the conformance suite: ranks on threads, through the device
/// trait ([`HostDevice`]); it names the peer that stalled or went away.
struct Tcp;

impl Backend for Tcp {
    type Rank = HostDevice<TcpCollective>;

    fn available(_: usize) -> bool {
        true
    }

    fn capacity() -> usize {
        usize::MAX
    }

    fn with_world<T: Send>(
        world: usize,
        timeout: Duration,
        body: impl Fn(Self::Rank) -> T + Sync,
    ) -> Vec<T> {
        let config = TcpConfig {
            timeout,
            ..TcpConfig::default()
        };
        with_world(world, config, |comm| body(HostDevice::new(comm)))
    }

    fn timed_out(err: &CollectiveError, peer: usize) -> bool {
        matches!(err, CollectiveError::Timeout { peer: p, .. } if *p == peer)
            && err.to_string().contains(&format!("rank {peer}"))
    }

    fn lost(err: &CollectiveError, peer: usize) -> bool {
        matches!(err, CollectiveError::PeerLost { peer: p, .. } if *p == peer)
    }

    fn aborted(err: &CollectiveError, op: &str) -> bool {
        matches!(err, CollectiveError::Aborted { op: o } if *o == op)
    }
}

mod tcp {
    crate::conformance::every_check!(crate::Tcp);
}

/// The host trait's uneven shards (a rank may hold nothing), which the device trait
/// does not have, and its typed conveniences.
#[test]
fn uneven_shards_and_typed_helpers_match_a_serial_reference_for_world_sizes_one_to_five() {
    for world in 1..=5 {
        let results = with_world(world, TcpConfig::default(), move |comm| {
            let (rank, w) = (comm.rank(), comm.world_size());
            // All-gather, small and large (> 32 KiB, the threaded path).
            for rows in [3usize, 7, 50_000] {
                let counts = shard_counts(rows, w);
                let start: usize = counts[..rank].iter().sum();
                let mine: Vec<f32> = (start..start + counts[rank]).map(|i| i as f32).collect();
                let mut out = vec![-1f32; rows];
                comm.all_gather_f32(&mine, &counts, &mut out).unwrap();
                assert_eq!(out, (0..rows).map(|i| i as f32).collect::<Vec<_>>());
            }
            // Reduce-scatter of i64, exact.
            for n in [5usize, 40_000] {
                let mut data: Vec<i64> = (0..n).map(|i| value(rank, i)).collect();
                let counts = shard_counts(n, w);
                let mut out = vec![0i64; counts[rank]];
                comm.reduce_scatter_i64(&mut data, &counts, &mut out)
                    .unwrap();
                let start: usize = counts[..rank].iter().sum();
                for (k, got) in out.iter().enumerate() {
                    let want: i64 = (0..w).map(|r| value(r, start + k)).sum();
                    assert_eq!(*got, want, "world {w} rank {rank} element {}", start + k);
                }
            }
            assert_eq!(comm.broadcast_u64(0, 42 + rank as u64).unwrap(), 42);
            comm.barrier().unwrap();
            rank
        });
        assert_eq!(results, (0..world).collect::<Vec<_>>());
    }
}

#[test]
fn ranks_calling_different_operations_get_an_error_not_garbage() {
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let results = with_world(2, TcpConfig::default(), move |comm| {
        if comm.rank() == 0 {
            let result = comm.barrier();
            done_tx.send(()).unwrap();
            result
        } else {
            let mut data = [0u8; 1];
            let result = comm.broadcast(1, &mut data);
            // Stay connected until rank 0 has read what it was sent.
            done_rx.lock().unwrap().recv().unwrap();
            result
        }
    });
    // Rank 0 receives rank 1's broadcast where it expects an all-gather step.
    let err = results[0].clone().unwrap_err();
    assert!(matches!(err, CollectiveError::Invalid { .. }), "{err}");
    assert!(err.to_string().contains("disagree"), "{err}");
}

/// A real process dies during an all-gather of 4 ranks: every survivor's collective
/// fails well within its timeout, and the errors name the peers that went away.
#[test]
fn survivors_of_a_peer_killed_during_an_all_gather_fail_within_the_timeout() {
    let timeout_ms = 5000;
    let output = Command::new(env!("CARGO_BIN_EXE_ckpt-train"))
        .args([
            "launch",
            "--nproc",
            "4",
            "--grace-secs",
            "30",
            "--",
            "collective-probe",
        ])
        .args(["--size", "4194304", "--iters", "50", "--kill", "2:3"])
        .args(["--timeout-secs", &(timeout_ms as f64 / 1000.0).to_string()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success(), "{stdout}");
    assert!(
        stdout.contains("launch: rank 2 failed: signal: 9"),
        "{stdout}"
    );
    let mut failures = Vec::new();
    for line in stdout.lines() {
        let Some(rest) = line.split("probe: rank ").nth(1) else {
            continue;
        };
        if let Some((head, tail)) = rest.split_once(": failed after ") {
            let rank: usize = head.split(' ').next().unwrap().parse().unwrap();
            let ms: u64 = tail.split(' ').next().unwrap().parse().unwrap();
            failures.push((rank, ms, tail.to_string()));
        }
    }
    let ranks: Vec<usize> = failures.iter().map(|f| f.0).collect();
    assert_eq!(
        {
            let mut r = ranks.clone();
            r.sort();
            r
        },
        vec![0, 1, 3],
        "{stdout}"
    );
    for (rank, ms, message) in &failures {
        assert!(*ms < timeout_ms, "rank {rank} took {ms} ms: {message}");
        assert!(
            message.contains("lost rank") || message.contains("made no progress"),
            "{message}"
        );
    }
    assert!(
        failures.iter().any(|f| f.2.contains("lost rank 2")),
        "no survivor names rank 2: {stdout}"
    );
}
