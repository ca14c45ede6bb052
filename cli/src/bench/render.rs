//! The human report: a table per workload figure with its baseline beside it.

use super::*;

/// The table rows of the core figures; `direct` is the raw `O_DIRECT` write and the
/// committed save's ratio to it, when measured.
pub(super) fn core_rows(
    s: &mut String,
    f: &CoreFigures,
    reshard_ranks: usize,
    direct: Option<(f64, f64)>,
) {
    use std::fmt::Write as _;
    let mut row = |name: &str, a: String, b: String, ratio: Option<f64>| {
        let ratio = ratio.map_or(String::new(), |r| format!("{r:.2}"));
        let _ = writeln!(s, "{name:<34} {a:>12} {b:>12} {ratio:>9}");
    };
    let ms = |v: f64| format!("{v:.1} ms");
    row(
        "stall per rank (worst) vs memcpy",
        ms(f.stall_ms),
        ms(f.memcpy_ms),
        Some(f.stall_ratio),
    );
    row(
        "overlapped stall vs memcpy",
        format!("{:.2} ms", f.overlap_stall_ms),
        ms(f.memcpy_ms),
        Some(f.overlap_ratio),
    );
    row(
        "  overlapped copy done after",
        ms(f.overlap_staged_ms),
        String::new(),
        None,
    );
    row(
        "first save's stall vs stall",
        ms(f.cold_stall_ms),
        ms(f.stall_ms),
        Some(f.cold_ratio),
    );
    row(
        "  staging warm-up (before it)",
        ms(f.warm_up_ms),
        String::new(),
        None,
    );
    let gbs = |v: f64| format!("{v:.2} GB/s");
    row(
        "save until committed vs raw write",
        gbs(f.write_gbps),
        gbs(f.raw_write_gbps),
        Some(f.write_ratio),
    );
    if let Some((raw, ratio)) = direct {
        row(
            "  vs raw O_DIRECT write",
            String::new(),
            gbs(raw),
            Some(ratio),
        );
    }
    row(
        "  time until committed",
        format!("{:.0} ms", f.commit_ms),
        String::new(),
        None,
    );
    row(
        "load, same world vs raw read",
        gbs(f.read_gbps),
        gbs(f.raw_read_gbps),
        Some(f.read_ratio),
    );
    row(
        &format!("load onto {reshard_ranks} ranks vs same world"),
        format!("{:.0} ms", f.reshard_load_ms),
        format!("{:.0} ms", f.load_ms),
        Some(f.reshard_ratio),
    );
}

/// The report as an aligned table.
pub(crate) fn render(r: &BenchReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let c = &r.config;
    let _ = writeln!(s, "ckpt bench on {}", r.url);
    if let Some(replicas) = &r.replicas {
        render_replicas(&mut s, replicas);
        return s;
    }
    if !c.metadata_only {
        let _ = writeln!(
            s,
            "workload: {} ranks, {} fp32 tensors of {}x{} sharded on dim 0 ({:.1} MiB per rank, {:.2} GiB total), {} reps, median; reads {}",
            c.ranks,
            c.tensors,
            c.rows,
            c.cols,
            r.bytes_per_rank as f64 / (1 << 20) as f64,
            r.total_bytes as f64 / (1u64 << 30) as f64,
            c.reps,
            if r.cold_reads {
                "cold (page cache emptied)"
            } else {
                "warm"
            }
        );
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<34} {:>12} {:>12} {:>9}",
            "measure", "ckpt", "baseline", "ratio"
        );
        if c.threads {
            let _ = writeln!(s, "ranks as threads of one process:");
            let direct = r.raw_write_direct_gbps.zip(r.write_ratio_direct);
            core_rows(&mut s, &r.core, c.reshard_ranks, direct);
            let _ = writeln!(
                s,
                "{:<34} {:>12}",
                "  reshard bytes read / requested",
                format!("{:.4}", r.reshard_read_amplification)
            );
            let _ = writeln!(
                s,
                "{:<34} {:>12} {:>12} {:>9.2}",
                "  allocating load vs in place",
                format!("{:.0} ms", r.load_alloc_ms),
                format!("{:.0} ms", r.core.load_ms),
                r.load_alloc_ms / r.core.load_ms.max(1e-9),
            );
            for (name, ckpt, dcp) in [
                (
                    "load, same world vs DCP's reads",
                    r.core.load_ms,
                    r.dcp_load_ms,
                ),
                (
                    "load resharded vs DCP's reads",
                    r.core.reshard_load_ms,
                    r.dcp_reshard_load_ms,
                ),
            ] {
                if let Some(dcp) = dcp {
                    let _ = writeln!(
                        s,
                        "{name:<34} {:>12} {:>12} {:>9.2}",
                        format!("{ckpt:.0} ms"),
                        format!("{dcp:.0} ms"),
                        ckpt / dcp.max(1e-9),
                    );
                }
            }
            let _ = writeln!(s);
            let _ = writeln!(
                s,
                "{:<11} {:>8} {:>7} {:>8} {:>8} {:>8} {:>8} {:>7} {:>9} {:>9}",
                "load (ms)",
                "wall",
                "plan",
                "read",
                "read cpu",
                "io wait",
                "verify",
                "copy",
                "copied MiB",
                "faults"
            );
            let b = &r.load_breakdown;
            for (name, b) in [
                ("in place", &b.same_size),
                ("resharded", &b.resharded),
                ("allocating", &b.allocating),
            ] {
                let _ = writeln!(
                    s,
                    "{:<11} {:>8.0} {:>7.1} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>7.0} {:>10.1} {:>9.0}",
                    name,
                    b.wall_ms,
                    b.plan_ms,
                    b.read_ms,
                    b.read_cpu_ms,
                    b.io_wait_ms,
                    b.verify_ms,
                    b.copy_ms,
                    b.bytes_copied / (1 << 20) as f64,
                    b.minor_faults
                );
            }
            let _ = writeln!(
                s,
                "  read, read cpu, verify and copy are summed over ranks and reading threads; in-place buffers took {:.0} ms to allocate and touch beforehand",
                b.same_size.prefault_ms
            );
        }
        if !r.zstd.is_empty() {
            let _ = writeln!(s);
            let _ = writeln!(
                s,
                "{:<16} {:>14} {:>7} {:>11} {:>11}",
                "codec", "stored", "ratio", "save GB/s", "load GB/s"
            );
            let _ = writeln!(
                s,
                "{:<16} {:>14} {:>7.3} {:>11.2} {:>11.2}",
                "none", r.file_bytes, 1.0, r.core.write_gbps, r.core.read_gbps
            );
            for z in &r.zstd {
                let _ = writeln!(
                    s,
                    "{:<16} {:>14} {:>7.3} {:>11.2} {:>11.2}",
                    format!("{}-{}", z.codec, z.level),
                    z.stored_bytes,
                    z.ratio,
                    z.save_gbps,
                    z.load_gbps
                );
            }
        }
        if !r.codec_samples.is_empty() {
            let _ = writeln!(s);
            let _ = writeln!(
                s,
                "{:<6} {:>8} {:>7} {:>16} {:>18}",
                "data", "shuffle", "ratio", "compress GB/s/c", "decompress GB/s/c"
            );
            for z in &r.codec_samples {
                let _ = writeln!(
                    s,
                    "{:<6} {:>8} {:>7.3} {:>16.3} {:>18.3}",
                    z.data, z.shuffle, z.ratio, z.compress_gbps, z.decompress_gbps
                );
            }
        }
        if let Some(p) = &r.processes {
            if c.threads {
                let _ = writeln!(s);
            }
            let _ = writeln!(s, "one process per rank ({} processes):", p.ranks);
            core_rows(&mut s, &p.core, c.reshard_ranks, None);
        }
        if let Some(rss) = &r.rss {
            let _ = writeln!(s);
            let _ = writeln!(
                s,
                "rss over {} saves: first {:.0} MiB, last {:.0} MiB, growth after the first {:+.1} MiB",
                rss.rss_mib.len(),
                rss.rss_mib.first().copied().unwrap_or(0.0),
                rss.rss_mib.last().copied().unwrap_or(0.0),
                rss.growth_after_first_mib
            );
        }
    }
    if let Some(c) = &r.commit_scale {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "commit scale: {} ranks ({}): last part written at {:.0} ms, committed {:.0} ms after it, all ranks done at {:.0} ms; manifest {:.1} KiB",
            c.ranks,
            c.simulation,
            c.last_part_ms,
            c.commit_after_last_part_ms,
            c.commit_ms,
            c.manifest_bytes as f64 / 1024.0
        );
        let _ = writeln!(
            s,
            "  requests per rank: mean {:.2}, waiting rank max {}, committer max {} ({} after the last part), total {}",
            c.requests_per_rank,
            c.waiter_requests_max,
            c.committer_requests_max,
            c.committer_requests_after_last_part,
            c.requests_total
        );
    }
    if let Some(m) = &r.metadata {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "metadata: {} tensors x {} ranks ({} chunks): manifest {:.1} KiB, one part {:.1} KiB, build {:.0} ms",
            m.tensors,
            m.ranks,
            m.chunks,
            m.manifest_bytes as f64 / 1024.0,
            m.part_bytes as f64 / 1024.0,
            m.build_ms
        );
        let _ = writeln!(
            s,
            "  open (read + parse) {:.1} ms; plan one rank {:.1} ms reading {:.2} MiB; onto {} ranks {:.1} ms reading {:.2} MiB",
            m.open_ms,
            m.plan_ms,
            m.plan_bytes_read as f64 / (1 << 20) as f64,
            m.reshard_ranks,
            m.reshard_plan_ms,
            m.reshard_plan_bytes_read as f64 / (1 << 20) as f64
        );
    }
    if !r.cooperative_scale.is_empty() {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "cooperative scale (store requests of the whole job; plan per rank, median/max):"
        );
        let _ = writeln!(
            s,
            "{:>6} {:<8} {:>6} | {:>5} {:>9} {:>9} {:>10} {:>13} | {:>5} {:>7} {:>7} {:>10} {:>13} | {:>10}",
            "ranks",
            "layout",
            "saved",
            "LIST",
            "GET",
            "HEAD",
            "data GiB",
            "plan ms",
            "LIST",
            "GET",
            "HEAD",
            "data GiB",
            "plan ms",
            "unique GiB"
        );
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        for c in &r.cooperative_scale {
            let (p, q) = (&c.plain, &c.cooperative);
            let _ = writeln!(
                s,
                "{:>6} {:<8} {:>6} | {:>5} {:>9} {:>9} {:>10.1} {:>6.2}/{:<6.2} | {:>5} {:>7} {:>7} {:>10.1} {:>6.2}/{:<6.2} | {:>10.1}",
                c.ranks,
                c.layout.name(),
                c.saved_ranks,
                p.store_requests.list,
                p.store_requests.get,
                p.store_requests.head,
                gib(p.data_bytes),
                p.plan_ms_median,
                p.plan_ms_max,
                q.store_requests.list,
                q.store_requests.get,
                q.store_requests.head,
                gib(q.data_bytes),
                q.plan_ms_median,
                q.plan_ms_max,
                gib(c.unique_bytes)
            );
            let _ = writeln!(
                s,
                "{:>23} open {} LIST {} GET {} HEAD; rank 0 open + share {:.0} ms ({:.1} MiB shared), open from shared {:.0} ms, {} peer requests",
                "",
                c.open_requests.list,
                c.open_requests.get,
                c.open_requests.head,
                c.share_ms,
                c.shared_bytes as f64 / (1 << 20) as f64,
                c.open_shared_ms,
                c.peer_messages
            );
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "{:<36} {:>10} {:>10}  met", "target", "value", "bound");
    for t in &r.targets {
        let _ = writeln!(
            s,
            "{:<36} {:>10.3} {:>2} {:>7.2}  {}",
            t.name,
            t.value,
            t.relation,
            t.bound,
            if t.met { "yes" } else { "NO" }
        );
    }
    s
}

/// The replica agreement bench: each figure with and without agreement.
fn render_replicas(s: &mut String, r: &super::replicas::ReplicasReport) {
    use std::fmt::Write as _;
    let f = |key: &str| r.figures.get(key).copied().unwrap_or(f64::NAN);
    let _ = writeln!(
        s,
        "replica agreement: {} rank processes, {} shards x {} replicas, {:.0} MiB per rank, medians",
        r.ranks,
        r.ranks / r.replicas.max(1),
        r.replicas,
        r.bytes_per_rank as f64 / (1 << 20) as f64
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<28} {:>12} {:>12} {:>9}",
        "measure", "agreement", "off", "ratio"
    );
    for (name, key) in [
        ("stall (worst rank), ms", "stall"),
        ("time to durable, ms", "durable"),
        ("time to commit, ms", "commit"),
        ("overlapped: stall, ms", "overlap_stall"),
        ("overlapped: staged (copy), ms", "overlap_staged"),
        ("overlapped: time to durable, ms", "overlap_durable"),
        ("overlapped: time to commit, ms", "overlap_commit"),
    ] {
        let (with, without) = (f(&format!("{key}_ms")), f(&format!("{key}_off_ms")));
        let _ = writeln!(
            s,
            "{name:<32} {with:>12.1} {without:>12.1} {:>9.3}",
            with / without
        );
    }
    let _ = writeln!(
        s,
        "replicated boxes compared per save: {:.0}",
        f("replicas_compared")
    );
    let _ = writeln!(s);
    let _ = writeln!(s, "one core, GB/s:");
    for (name, key) in [
        ("block CRC32s", "crc_gbps_per_core"),
        ("save scan (CRCs + finite check)", "scan_gbps_per_core"),
        ("scan of a replicated box", "replica_scan_gbps_per_core"),
    ] {
        let _ = writeln!(s, "  {name:<34} {:>8.2}", f(key));
    }
}
