//! The TCP backend against a serial reference, and its failure behaviour: timeouts,
//! abort from another thread, mismatched calls, and a peer process killed during an
//! all-gather.

use std::net::TcpListener;
use std::process::Command;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ckpt_trainer::collective::{
    Collective, CollectiveError, CollectiveExt, TcpCollective, TcpConfig, shard_counts,
};

/// Bootstraps `world` ranks on threads and runs `body` on each; returns their results.
fn with_world<T: Send + 'static>(
    world: usize,
    config: TcpConfig,
    body: impl Fn(TcpCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let body = Arc::new(body);
    let mut threads = Vec::new();
    let mut listener = Some(listener);
    for rank in 0..world {
        let body = body.clone();
        let config = config.clone();
        let listener = listener.take();
        threads.push(std::thread::spawn(move || {
            let comm = if rank == 0 {
                TcpCollective::bootstrap_root(listener.unwrap(), world, config).unwrap()
            } else {
                TcpCollective::bootstrap(rank, world, addr, config).unwrap()
            };
            body(comm)
        }));
    }
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn value(rank: usize, i: usize) -> i64 {
    ((rank as i64 + 1) * 1_000_003 + i as i64 * 7) * if i.is_multiple_of(2) { 1 } else { -1 }
}

#[test]
fn every_operation_matches_a_serial_reference_for_world_sizes_one_to_five() {
    for world in 1..=5 {
        let results = with_world(world, TcpConfig::default(), move |comm| {
            let (rank, w) = (comm.rank(), comm.world_size());
            // All-gather, uneven (a rank may hold nothing), small and large (> 32 KiB,
            // the threaded path).
            for rows in [3usize, 7, 50_000] {
                let counts = shard_counts(rows, w);
                let start: usize = counts[..rank].iter().sum();
                let mine: Vec<f32> = (start..start + counts[rank]).map(|i| i as f32).collect();
                let mut out = vec![-1f32; rows];
                comm.all_gather_f32(&mine, &counts, &mut out).unwrap();
                assert_eq!(out, (0..rows).map(|i| i as f32).collect::<Vec<_>>());
            }
            // Reduce-scatter of i64, uneven, exact.
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
            // All-reduce of i64 and of f32 (integer-valued, so exact too).
            let mut ints: Vec<i64> = (0..10_001).map(|i| value(rank, i)).collect();
            comm.all_reduce_i64(&mut ints).unwrap();
            for (i, got) in ints.iter().enumerate() {
                assert_eq!(*got, (0..w).map(|r| value(r, i)).sum::<i64>());
            }
            let mut floats: Vec<f32> = (0..9_999).map(|i| (i % 13 + rank) as f32).collect();
            comm.all_reduce_f32(&mut floats).unwrap();
            for (i, got) in floats.iter().enumerate() {
                let want: usize = (0..w).map(|r| i % 13 + r).sum();
                assert_eq!(*got, want as f32);
            }
            // Broadcast from the last rank, more than one 1 MiB piece.
            let root = w - 1;
            let mut data = if rank == root {
                (0..3_000_000u32).map(|i| (i % 251) as u8).collect()
            } else {
                vec![0u8; 3_000_000]
            };
            comm.broadcast(root, &mut data).unwrap();
            assert!(data.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
            assert_eq!(comm.broadcast_u64(0, 42 + rank as u64).unwrap(), 42);
            comm.barrier().unwrap();
            rank
        });
        assert_eq!(results, (0..world).collect::<Vec<_>>());
    }
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let config = TcpConfig {
        timeout: Duration::from_millis(300),
        ..TcpConfig::default()
    };
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let results = with_world(2, config, move |comm| {
        if comm.rank() == 1 {
            // Silent until rank 0 has given up.
            done_rx.lock().unwrap().recv().unwrap();
            return None;
        }
        let started = Instant::now();
        let err = comm.barrier().unwrap_err();
        let elapsed = started.elapsed();
        done_tx.send(()).unwrap();
        Some((err, elapsed))
    });
    let (err, elapsed) = results[0].clone().unwrap();
    assert!(
        matches!(err, CollectiveError::Timeout { peer: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("rank 1"), "{err}");
    assert!(
        elapsed >= Duration::from_millis(250) && elapsed < Duration::from_secs(5),
        "{elapsed:?}"
    );
}

#[test]
fn abort_from_another_thread_wakes_a_blocked_operation_and_poisons_the_communicator() {
    let config = TcpConfig {
        timeout: Duration::from_secs(60),
        ..TcpConfig::default()
    };
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let results = with_world(2, config, move |comm| {
        if comm.rank() == 1 {
            done_rx.lock().unwrap().recv().unwrap();
            // Rank 0 aborted: its sockets are shut, so this rank loses it at once.
            let started = Instant::now();
            let err = comm.barrier().unwrap_err();
            return (err, started.elapsed());
        }
        let comm = Arc::new(comm);
        let aborter = {
            let comm = comm.clone();
            std::thread::spawn(move || {
                // The outcome is the same whether abort lands before or during the
                // barrier: Aborted, at once.
                std::thread::sleep(Duration::from_millis(100));
                comm.abort();
                Instant::now()
            })
        };
        let err = comm
            .all_gather(
                &[0u8; 1 << 20],
                &[1 << 20, 1 << 20],
                &mut vec![0u8; 2 << 20],
            )
            .unwrap_err();
        let woke = Instant::now();
        let aborted_at = aborter.join().unwrap();
        assert!(
            matches!(err, CollectiveError::Aborted { op: "all_gather" }),
            "{err}"
        );
        assert!(woke.saturating_duration_since(aborted_at) < Duration::from_secs(2));
        // Poisoned: later calls fail at once.
        let started = Instant::now();
        let again = comm.barrier().unwrap_err();
        assert!(matches!(again, CollectiveError::Aborted { .. }), "{again}");
        done_tx.send(()).unwrap();
        (err, started.elapsed())
    });
    let (err, elapsed) = &results[1];
    assert!(
        matches!(err, CollectiveError::PeerLost { peer: 0, .. }),
        "{err}"
    );
    assert!(*elapsed < Duration::from_secs(5), "{elapsed:?}");
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
