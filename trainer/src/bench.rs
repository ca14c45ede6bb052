//! Collective bandwidth against raw loopback TCP, measured in the same run.
//!
//! Rank 0 first measures one TCP stream over loopback inside its own process (a
//! writer thread and a reader thread, 1 MiB writes) while the other ranks wait in a
//! barrier; then every rank runs timed f32 all-reduces and all-gathers of the same
//! size. Bus bandwidth follows NCCL's convention, so the figures compare with the
//! link speed whatever the world size: all-reduce `busbw = algbw · 2(W-1)/W`,
//! all-gather `busbw = algbw · (W-1)/W`, where `algbw = bytes / time`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::collective::{Collective, CollectiveError, CollectiveExt, shard_counts};

/// Results of one run (rank 0's view).
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    /// World size.
    pub world_size: usize,
    /// Bytes per rank per operation.
    pub bytes: usize,
    /// Timed iterations.
    pub iters: usize,
    /// One loopback TCP stream, GB/s.
    pub raw_tcp_gbps: f64,
    /// All-reduce (f32 sum) algorithm bandwidth, GB/s.
    pub all_reduce_algbw_gbps: f64,
    /// All-reduce bus bandwidth, GB/s.
    pub all_reduce_busbw_gbps: f64,
    /// All-gather algorithm bandwidth (bytes of the gathered buffer / time), GB/s.
    pub all_gather_algbw_gbps: f64,
    /// All-gather bus bandwidth, GB/s.
    pub all_gather_busbw_gbps: f64,
}

/// Throughput of one loopback TCP stream moving `bytes` (GB/s).
pub fn raw_loopback(bytes: usize) -> std::io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let block = vec![7u8; 1 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(block.len());
            s.write_all(&block[..n])?;
            left -= n;
        }
        Ok(())
    });
    let (mut r, _) = listener.accept()?;
    let mut buf = vec![0u8; 1 << 20];
    let started = Instant::now();
    let mut got = 0;
    while got < bytes {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        got += n;
    }
    let elapsed = started.elapsed();
    writer
        .join()
        .map_err(|_| std::io::Error::other("writer panicked"))??;
    Ok(got as f64 / elapsed.as_secs_f64() / 1e9)
}

/// Runs the benchmark on `comm`; every rank must call it with the same arguments.
pub fn run(
    comm: &dyn Collective,
    bytes: usize,
    iters: usize,
) -> Result<BenchReport, CollectiveError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut raw = 0.0;
    if rank == 0 {
        raw = raw_loopback(bytes.max(1 << 20) * 8).map_err(|e| CollectiveError::Io {
            op: "raw_loopback",
            peer: None,
            message: e.to_string(),
        })?;
    }
    comm.barrier()?;
    let elems = bytes / 4;
    let mut data: Vec<f32> = (0..elems).map(|i| (i % 97) as f32).collect();
    comm.all_reduce_f32(&mut data)?; // warm-up
    comm.barrier()?;
    let started = Instant::now();
    for _ in 0..iters {
        comm.all_reduce_f32(&mut data)?;
    }
    comm.barrier()?;
    let all_reduce = started.elapsed();

    let counts = shard_counts(elems, world);
    let mine = vec![1f32; counts[rank]];
    let mut out = vec![0f32; elems];
    comm.all_gather_f32(&mine, &counts, &mut out)?;
    comm.barrier()?;
    let started = Instant::now();
    for _ in 0..iters {
        comm.all_gather_f32(&mine, &counts, &mut out)?;
    }
    comm.barrier()?;
    let all_gather = started.elapsed();

    let w = world as f64;
    let per = |d: Duration| (elems * 4) as f64 / (d.as_secs_f64() / iters as f64) / 1e9;
    let ar = per(all_reduce);
    let ag = per(all_gather);
    Ok(BenchReport {
        world_size: world,
        bytes: elems * 4,
        iters,
        raw_tcp_gbps: raw,
        all_reduce_algbw_gbps: ar,
        all_reduce_busbw_gbps: ar * 2.0 * (w - 1.0) / w,
        all_gather_algbw_gbps: ag,
        all_gather_busbw_gbps: ag * (w - 1.0) / w,
    })
}

/// A peer-failure probe for tests: every rank loops all-gathers of `bytes` each;
/// rank `kill_rank` SIGKILLs itself while entering iteration `kill_at`. Survivors
/// print how long their failing operation took and the error, and return it.
pub fn probe(
    comm: &dyn Collective,
    bytes: usize,
    iters: usize,
    kill: Option<(usize, usize)>,
) -> Result<(), CollectiveError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mine = vec![rank as u8; bytes];
    let mut out = vec![0u8; bytes * world];
    for i in 0..iters {
        if let Some((who, at)) = kill
            && who == rank
            && at == i
        {
            // Die while the peers are (or are about to be) inside this all-gather.
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(2));
                // SAFETY: getpid and kill take no pointers and cannot violate memory
                // safety; the signal goes to this very process, whose death is the
                // point of this probe.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            });
        }
        let started = Instant::now();
        if let Err(e) = comm.all_gather(&mine, &vec![bytes; world], &mut out) {
            println!(
                "probe: rank {rank} iteration {i}: failed after {} ms: {e} (peer {:?})",
                started.elapsed().as_millis(),
                e.peer()
            );
            return Err(e);
        }
        println!("probe: rank {rank} iteration {i} ok");
    }
    Ok(())
}
