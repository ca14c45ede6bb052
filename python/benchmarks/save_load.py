"""Workload W1 through three paths in one run: ckpt's native API, DCP with ckpt's
storage plugin, and stock DCP.

::

    python python/benchmarks/save_load.py [--url URL] [--reps N] [--json]

It lives beside the package, not in it (as ``frameworks.py`` and ``recovery.py``
do): it is a measurement of ckpt, not part of what users import.

W1 (as ``ckpt bench``): 4 rank processes, each holding its dim-0 shard of 64 fp32
tensors of 8192x1024 (512 MiB per rank, 2 GiB in all) as DTensors, saved, loaded on
the same 4 ranks, and loaded resharded on 3. Every rank is a real process in a gloo
process group. After one untimed save per path (a path's first save allocates its
staging memory, once per job), per repetition the three paths run one after the
other, in a rotating order, so that the machine's drift hits each alike; loads read cold (the
checkpoint's files are dropped from the page cache first). Medians with [min–max].

Stock DCP runs as its fastest documented mode: ``dcp.async_save`` with one reused
``DefaultStager`` (``use_async_staging=True``) and ``FileSystemWriter``; ``dcp.load``
in place. It needs a local directory, so with a remote ``--url`` only the two ckpt
paths run. The plugin runs ``dcp.async_save`` in its own best mode: the writer
stages (ckpt's overlapped save), DCP plans and waits.

Figures, per path (each the slowest rank's, median over repetitions):

- ``stall_s``: how long the save call blocked the training loop;
- ``staged_s``: until the state was copied (the tensors may change again);
- ``durable_s``: until the checkpoint was committed (durable, visible to readers);
- ``load_s``, ``reshard_load_s``: a cold load in place on 4 ranks, and on 3;
- ``peak_rss_mib``: the peak resident set of the largest rank when the path runs alone
  in fresh processes (a warm-up save, a save, a load), beside ``state_rss_mib``, the
  same processes with the state alone;
- ``copied_mib``: tensor bytes copied per rank on save and on load, where counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PATHS = ("native", "plugin", "dcp")
MiB = 1 << 20


def drop_cache(root: Path) -> None:
    """Drops the files under ``root`` from the page cache (after writing back)."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def w1_state(world: int, tensors: int, rows: int, cols: int, seed: int) -> dict[str, Any]:
    """This rank's dim-0 shards of the W1 tensors, as DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rank = dist.get_rank()
    per = -(-rows // world)  # torch.chunk's split, as DTensor's Shard(0)
    lo, hi = min(rank * per, rows), min((rank + 1) * per, rows)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    state = {}
    for i in range(tensors):
        local = torch.empty(hi - lo, cols)
        local.normal_(0.0, 0.02, generator=g)
        state[f"layer{i:03d}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(rows, cols), stride=(cols, 1)
        )
    return {"model": state}


def _slowest(value: float) -> float:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return max(out)


def _largest(value: int) -> int:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return max(out)


class Paths:
    """The three ways to save and load, with what each keeps between repetitions."""

    def __init__(self, base: Path, url: str | None, args: argparse.Namespace):
        self.base = base
        self.remote = url is not None and not url.startswith("file://")
        self.native_url = url.rstrip("/") + "/native" if url else f"file://{base / 'native'}"
        self.plugin_url = url.rstrip("/") + "/plugin" if url else f"file://{base / 'plugin'}"
        self.dcp_dir = base / "dcp"
        self.args = args
        self._native = None
        self._writer = None
        self._stager = None
        self._group = None

    def local_root(self, path: str) -> Path | None:
        if path == "dcp":
            return self.dcp_dir
        url = self.native_url if path == "native" else self.plugin_url
        return Path(url.removeprefix("file://")) if url.startswith("file://") else None

    def stager(self):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            self._stager = DefaultStager(StagingOptions(False, False, True, False))
            self._group = dist.new_group(backend="gloo")
        return self._stager

    def save(self, path: str, step: int, sd: dict[str, Any]) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        from ckpt.torch import Checkpointer
        from ckpt.torch.dcp import StorageWriter

        dist.barrier()
        copied_after = None
        t0 = time.perf_counter()
        if path == "native":
            if self._native is None:
                self._native = Checkpointer(
                    self.native_url, keep_last=1, retention_grace=0, run_id="bench"
                )
            handle = self._native.save(step, sd)
            stall = time.perf_counter() - t0
            profile = dict(handle.profile)
            handle.wait_staged()
            staged = time.perf_counter() - t0
            handle.wait_committed()
            copied = (sd_bytes(sd) + handle.bytes_copied) / MiB
        else:
            if path == "plugin":
                # One writer for every save, as a trainer keeps it: its checkpointer's
                # staging buffers are reused.
                if self._writer is None:
                    self._writer = StorageWriter(
                        self.plugin_url, keep_last=1, retention_grace=0, run_id="bench"
                    )
                self._writer.step = step
                # The plugin's own staging (the writer is DCP's stager): its best mode.
                response = dcp.async_save(
                    sd, storage_writer=self._writer, process_group=self._group_for_async()
                )
                profile = dict(self._writer.profile)
            else:
                target = self.dcp_dir / f"step-{step}"
                response = dcp.async_save(
                    sd,
                    checkpoint_id=str(target),
                    process_group=self._group_for_async(),
                    async_stager=self.stager(),
                )
                profile = {}
            stall = time.perf_counter() - t0
            response.staging_completion.result()
            staged = time.perf_counter() - t0
            if path == "plugin":
                copied_after = self._writer.profile.get("copy_s")
            response.upload_completion.result()
            # Either path copies the state once: DCP's stager, or ckpt's staging.
            copied = sd_bytes(sd) / MiB
        durable = time.perf_counter() - t0
        dist.barrier()
        if path == "dcp" and dist.get_rank() == 0:
            for old in self.dcp_dir.glob("step-*"):
                if old.name != f"step-{step}":
                    shutil.rmtree(old, ignore_errors=True)
        figures = {
            "stall_s": _slowest(stall),
            "staged_s": _slowest(staged),
            "durable_s": _slowest(durable),
            "save_copied_mib": copied,
        }
        if self.args.profile:
            figures.update(_stall_profile(path, stall, profile))
            if path == "plugin":
                figures.update(_durable_profile(self._writer.profile))
                figures["staged_copy_s"] = _slowest(copied_after or 0.0)
        return figures

    def _group_for_async(self):
        self.stager()
        return self._group

    def load(self, path: str, step: int, sd: dict[str, Any]) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        from ckpt.torch import load
        from ckpt.torch.dcp import StorageReader

        root = self.local_root(path)
        if dist.get_rank() == 0 and root is not None:
            drop_cache(root)
        dist.barrier()
        t0 = time.perf_counter()
        copied, reader = None, None
        if path == "native":
            extra = load(self.native_url, sd, step=step)
            copied = extra.stats.get("bytes_copied", 0) / MiB
        elif path == "plugin":
            reader = StorageReader(self.plugin_url, step=step)
            dcp.load(sd, storage_reader=reader)
            copied = reader.stats.get("bytes_copied", 0) / MiB
        else:
            dcp.load(sd, checkpoint_id=str(self.dcp_dir / f"step-{step}"))
        elapsed = time.perf_counter() - t0
        figures = {"load_s": _slowest(elapsed), "load_copied_mib": copied}
        if self.args.profile and reader is not None:
            # The slowest rank's split: the plugin's read_data, and DCP's own around it.
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (elapsed, reader.profile.get("read_data_s", 0.0)))
            slowest, own = max(everyone)
            figures["load_read_data_s"] = own
            figures["load_dcp_own_s"] = slowest - own
        return figures

    def close(self) -> None:
        if self._native is not None:
            self._native.close()
        if self._stager is not None:
            self._stager.close()


def _stall_profile(path: str, stall: float, profile: dict[str, Any]) -> dict[str, float]:
    """Where the slowest rank's stall went (``--profile``): the figures of the rank
    whose stall was longest. The native API: preparing the save (walking the state
    dict, checking the kept plan), the library's call, and the rest (the handle).
    The plugin: its ``stage`` (agreeing the step, preparing, the library's call)
    and what DCP's ``async_save`` does around it (its own work and threads)."""
    if path == "dcp":
        return {}
    parts = {
        "prepare": profile.get("prepare_s", 0.0),
        "library": profile.get("library_s", 0.0),
        "library_own": profile.get("library_stall_s", 0.0),
    }
    if path == "native":
        parts["other"] = stall - parts["prepare"] - parts["library"]
    else:
        parts["agree"] = profile.get("agree_s", 0.0)
        parts["dcp_own"] = stall - profile.get("stage_s", 0.0)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (stall, parts))
    _, slowest = max(everyone, key=lambda e: e[0])
    return {f"stall_{name}_s": value for name, value in slowest.items()}


def _durable_profile(profile: dict[str, Any]) -> dict[str, float]:
    """Where the plugin's time until durable went after staging, as the coordinator
    (rank 0, which also runs ``finish``) saw it: DCP's planning, the wait for
    ckpt's write, DCP's gathering of the results, the wait for ckpt's commit."""
    keys = {
        "dcp_plan_s": "durable_dcp_plan_s",
        "wait_durable_s": "durable_wait_write_s",
        "dcp_gather_s": "durable_dcp_gather_s",
        "wait_committed_s": "durable_wait_commit_s",
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {new: profile.get(old, 0.0) for old, new in keys.items()})
    return everyone[0]


def _raw_read(root: Path, step: int) -> float:
    """The floor of a same-world load from this disk (``--profile``): every rank reads
    its own data file of checkpoint ``step`` cold, front to back in 16 MiB reads into
    one buffer, at once; no parsing, no checksums, nothing placed. The slowest
    rank's seconds."""
    rank = dist.get_rank()
    (file,) = root.glob(f"step-{step:08d}/*/rank-{rank:05d}-*.safetensors")
    if rank == 0:
        drop_cache(root)
    dist.barrier()
    buffer = bytearray(16 * MiB)
    view = memoryview(buffer)
    t0 = time.perf_counter()
    with open(file, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return _slowest(time.perf_counter() - t0)


def _stalls_alone(root: Path, sd: dict[str, Any], reps: int) -> list[float]:
    """The native save's stall where no other rank copies or writes meanwhile
    (``--profile``): the ranks save in turn, each waiting until its part is durable
    before the next rank's save. The slowest rank's stall, per repetition (after an
    untimed first save, as for the timed figures)."""
    from ckpt.torch import Checkpointer

    stalls = []
    checkpointer = Checkpointer(
        f"file://{root}", keep_last=1, retention_grace=0, run_id="bench-alone"
    )
    for step in range(reps + 1):
        mine, handle = 0.0, None
        for turn in range(dist.get_world_size()):
            dist.barrier()
            if turn == dist.get_rank():
                t0 = time.perf_counter()
                handle = checkpointer.save(step, sd)
                mine = time.perf_counter() - t0
                handle.wait_durable()
        handle.wait_committed()
        slowest = _slowest(mine)
        if step > 0:
            stalls.append(slowest)
    checkpointer.close()
    return stalls


def _memcpy(sd: dict[str, Any]) -> float:
    """Seconds every rank takes to copy its shard once (all ranks at once, as their
    saves stage), into memory faulted in beforehand: the staging copy's floor."""
    from ckpt.torch._state import leaves

    local = [
        (v.to_local() if hasattr(v, "to_local") else v).reshape(-1).view(torch.uint8)
        for v in (leaf.value for leaf in leaves(sd))
        if isinstance(v, torch.Tensor)
    ]
    flat = torch.empty(sum(t.numel() for t in local), dtype=torch.uint8)
    flat.fill_(0)
    dist.barrier()
    t0 = time.perf_counter()
    at = 0
    for t in local:
        flat[at : at + t.numel()].copy_(t)
        at += t.numel()
    return _slowest(time.perf_counter() - t0)


def sd_bytes(sd: dict[str, Any]) -> int:
    from ckpt.torch._state import leaves

    total = 0
    for leaf in leaves(sd):
        if isinstance(leaf.value, torch.Tensor):
            t = leaf.value.to_local() if hasattr(leaf.value, "to_local") else leaf.value
            total += t.numel() * t.element_size()
    return total


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(minutes=30),
    )


def _save_and_load(rank: int, world: int, port: int, args, base: str, out: str) -> None:
    """The 4-rank half: per repetition, every path saves and loads cold."""
    _init(rank, world, port)
    paths = Paths(Path(base), args.url, args)
    sd = w1_state(world, args.tensors, args.rows, args.cols, seed=1)
    active = [p for p in PATHS if p != "dcp" or not paths.remote]
    results: dict[str, list[dict[str, float]]] = {p: [] for p in active}
    # One untimed save and load per path first: every path allocates its staging
    # memory on its first save (ckpt's buffers, DCP's stager), which a training job
    # pays once; and the first loads after the warm-up saves' burst of writes (6 GiB
    # within seconds) read from a disk still writing them back (2.2-2.6 s against
    # 0.8 s later, for every path), which says nothing about any path.
    for path in active:
        paths.save(path, 0, sd)
    for path in active:
        paths.load(path, 0, sd)
    for rep in range(args.reps):
        order = active[rep % len(active) :] + active[: rep % len(active)]
        for path in order:
            step = rep + 1
            figures = paths.save(path, step, sd)
            figures.update(paths.load(path, step, sd))
            root = paths.local_root(path)
            if args.profile and path == "native" and root is not None:
                figures["raw_read_s"] = _raw_read(root, step)
            results[path].append(figures)
    paths.close()
    alone = _stalls_alone(Path(base) / "alone", sd, args.reps) if args.profile else []
    memcpy = [_memcpy(sd) for _ in range(args.reps)]
    del sd
    small: dict[str, list[dict[str, float]]] = {p: [] for p in active}
    if args.small_tensors:
        # Many small tensors (an optimizer state of many parameters): the per-tensor
        # cost of each path, not the bytes, sets its figures.
        small_paths = Paths(Path(base) / "small", _under(args.url, "small"), args)
        state = w1_state(world, args.small_tensors, args.small_rows, args.small_cols, seed=4)
        for path in active:
            small_paths.save(path, 0, state)
        for rep in range(args.reps):
            order = active[rep % len(active) :] + active[: rep % len(active)]
            for path in order:
                figures = small_paths.save(path, rep + 1, state)
                figures.update(small_paths.load(path, rep + 1, state))
                small[path].append(figures)
        small_paths.close()
    if rank == 0:
        Path(out).write_text(
            json.dumps({"w1": results, "memcpy": memcpy, "small": small, "alone": alone})
        )
    _leave()


def _under(url: str | None, name: str) -> str | None:
    return None if url is None else url.rstrip("/") + "/" + name


def _reshard(rank: int, world: int, port: int, args, base: str, out: str) -> None:
    """The 3-rank half: the last step of each path, loaded cold, resharded."""
    _init(rank, world, port)
    paths = Paths(Path(base), args.url, args)
    sd = w1_state(world, args.tensors, args.rows, args.cols, seed=2)
    active = [p for p in PATHS if p != "dcp" or not paths.remote]
    results: dict[str, list[dict[str, float]]] = {p: [] for p in active}
    for rep in range(args.reps):
        order = active[rep % len(active) :] + active[: rep % len(active)]
        for path in order:
            figures = paths.load(path, args.reps, sd)
            results[path].append(
                {
                    "reshard_load_s": figures["load_s"],
                    "reshard_copied_mib": figures["load_copied_mib"],
                }
            )
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    _leave()


def _peak_rss(rank: int, world: int, port: int, args, base: str, out: str, path: str) -> None:
    """One path alone in fresh processes: its warm-up save, a save and a load, then
    the process's peak resident set (the kernel's high-water mark), largest rank."""
    import resource

    _init(rank, world, port)
    paths = Paths(Path(base), args.url, args)
    sd = w1_state(world, args.tensors, args.rows, args.cols, seed=3)
    state_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    paths.save(path, 1, sd)
    paths.save(path, 2, sd)
    paths.load(path, 2, sd)
    paths.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    figures = {"peak_rss_mib": _largest(peak) / MiB, "state_rss_mib": _largest(state_rss) / MiB}
    if rank == 0:
        Path(out).write_text(json.dumps(figures))
    _leave()


def _leave() -> None:
    """Ends a rank process without the interpreter's teardown. torch 2.15's gloo
    worker thread can release a finished collective's tensors while the interpreter
    finalizes, which aborts the process (std::terminate from the thread's forced
    unwind, seen in about one run in ten of this bench): the figures are written by
    now, and an abort at exit would fail the whole run."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize(samples: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples if s[key] is not None]
        if not values:
            out[key] = None
            continue
        out[key] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="ckpt-torch-bench-", dir=args.dir))
    try:
        first, second = base / "save.json", base / "reshard.json"
        mp.spawn(
            _save_and_load,
            args=(args.ranks, _free_port(), args, str(base), str(first)),
            nprocs=args.ranks,
        )
        mp.spawn(
            _reshard,
            args=(args.reshard, _free_port(), args, str(base), str(second)),
            nprocs=args.reshard,
        )
        first_half, resharded = json.loads(first.read_text()), json.loads(second.read_text())
        saved = first_half["w1"]
        rss = {}
        for path in saved:
            out = base / f"rss-{path}.json"
            mp.spawn(
                _peak_rss,
                args=(args.ranks, _free_port(), args, str(base / f"rss-{path}"), str(out), path),
                nprocs=args.ranks,
            )
            rss[path] = json.loads(out.read_text())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    per_rank = args.tensors * (-(-args.rows // args.ranks)) * args.cols * 4
    report: dict[str, Any] = {
        "workload": {
            "ranks": args.ranks,
            "reshard_ranks": args.reshard,
            "tensors": args.tensors,
            "shape": [args.rows, args.cols],
            "dtype": "float32",
            "mib_per_rank": per_rank / MiB,
            "reps": args.reps,
            "url": args.url or "file:// (a temporary directory)",
            "torch": torch.__version__,
        },
        "memcpy_s": summarize([{"memcpy_s": s} for s in first_half["memcpy"]])["memcpy_s"],
        "stall_alone_s": (
            summarize([{"s": s} for s in first_half["alone"]])["s"] if first_half["alone"] else None
        ),
        "paths": {},
    }
    for path, samples in saved.items():
        merged = [{**a, **b} for a, b in zip(samples, resharded[path], strict=True)]
        report["paths"][path] = summarize(merged)
        report["paths"][path].update(rss[path])
    if args.small_tensors:
        report["small"] = {
            "workload": {
                "tensors": args.small_tensors,
                "shape": [args.small_rows, args.small_cols],
                "dtype": "float32",
                "mib_per_rank": args.small_tensors
                * (-(-args.small_rows // args.ranks))
                * args.small_cols
                * 4
                / MiB,
            },
            "paths": {path: summarize(samples) for path, samples in first_half["small"].items()},
        }
    return report


def _fmt(figure: dict[str, float] | float | None, unit: str = "s") -> str:
    if figure is None:
        return "not counted"
    if not isinstance(figure, dict):
        return f"{figure:.0f} MiB"
    if unit == "s":
        return f"{figure['median']:.3f} s [{figure['min']:.3f}–{figure['max']:.3f}]"
    return f"{figure['median']:.0f} MiB [{figure['min']:.0f}–{figure['max']:.0f}]"


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"W1: {w['ranks']} ranks x {w['mib_per_rank']:.0f} MiB ({w['tensors']} fp32 tensors "
        f"{w['shape'][0]}x{w['shape'][1]}, dim-0 shards), reshard onto {w['reshard_ranks']}; "
        f"{w['reps']} reps, medians [min–max]; torch {w['torch']}; {w['url']}",
        "",
    ]
    rows = [
        ("stall per save", "stall_s", "s"),
        ("time to staged", "staged_s", "s"),
        ("save until durable", "durable_s", "s"),
        ("load, same world (cold)", "load_s", "s"),
        ("load, resharded (cold)", "reshard_load_s", "s"),
        ("peak RSS per rank (alone: 2 saves, a load)", "peak_rss_mib", "MiB"),
        ("RSS per rank, the state alone", "state_rss_mib", "MiB"),
        ("copied per rank: save", "save_copied_mib", "MiB"),
        ("copied per rank: load", "load_copied_mib", "MiB"),
        ("copied per rank: resharded load", "reshard_copied_mib", "MiB"),
    ]
    profile_rows = [
        ("load floor: raw reads of the same files", "raw_read_s", "s"),
        ("stall: preparing the save", "stall_prepare_s", "s"),
        ("stall: the library's call", "stall_library_s", "s"),
        ("  of it the library's own registration", "stall_library_own_s", "s"),
        ("stall: the rest of the native call", "stall_other_s", "s"),
        ("stall: agreeing the step (plugin)", "stall_agree_s", "s"),
        ("stall: DCP's own, around the plugin", "stall_dcp_own_s", "s"),
        ("staged: ckpt's copy done (plugin)", "staged_copy_s", "s"),
        ("load: the plugin's read_data", "load_read_data_s", "s"),
        ("load: DCP's own, around read_data", "load_dcp_own_s", "s"),
        ("durable: DCP's planning (plugin)", "durable_dcp_plan_s", "s"),
        ("durable: waiting for ckpt's write", "durable_wait_write_s", "s"),
        ("durable: DCP gathering the results", "durable_dcp_gather_s", "s"),
        ("durable: waiting for ckpt's commit", "durable_wait_commit_s", "s"),
    ]
    rows += profile_rows
    lines += _table(report["paths"], rows)
    memcpy = report.get("memcpy_s")
    if memcpy:
        lines.append(f"memcpy of a rank's shard (every rank at once): {_fmt(memcpy)}")
    alone = report.get("stall_alone_s")
    if alone:
        lines.append(f"ckpt.torch's stall, each rank saving alone: {_fmt(alone)}")
    small = report.get("small")
    if small:
        w = small["workload"]
        lines += [
            "",
            f"Small tensors: {w['tensors']} fp32 tensors {w['shape'][0]}x{w['shape'][1]} "
            f"({w['mib_per_rank']:.0f} MiB per rank, dim-0 shards)",
            "",
        ]
        lines += _table(small["paths"], rows)
    return "\n".join(lines)


def _table(paths: dict[str, Any], rows: list[tuple[str, str, str]]) -> list[str]:
    """The rows that some path has a figure for, a column per path."""
    rows = [row for row in rows if any(row[1] in figures for figures in paths.values())]
    names = {"native": "ckpt.torch", "plugin": "DCP + ckpt plugin", "dcp": "stock DCP"}
    width = 44
    lines = ["".ljust(width) + "".join(names[p].ljust(30) for p in paths)]
    for label, key, unit in rows:
        cells = [_fmt(paths[p].get(key), unit).ljust(30) for p in paths]
        lines.append(label.ljust(width) + "".join(cells))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python python/benchmarks/save_load.py", description=__doc__
    )
    parser.add_argument("--url", help="checkpoint root for the ckpt paths (default: a temp dir)")
    parser.add_argument("--dir", help="where temporary checkpoints go (default: $TMPDIR)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reshard", type=int, default=3, help="ranks of the resharded load")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument(
        "--small-tensors",
        type=int,
        default=2000,
        help="tensors of the small-tensor state (0: not run)",
    )
    parser.add_argument("--small-rows", type=int, default=256)
    parser.add_argument("--small-cols", type=int, default=64)
    parser.add_argument(
        "--profile", action="store_true", help="also print where each path's stall goes"
    )
    args = parser.parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else render(report))


if __name__ == "__main__":
    main()
