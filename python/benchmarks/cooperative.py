"""Cooperative loads on a rate-capped S3 store: stock ``dcp.load`` against ckpt's plain
and cooperative loads, with replicas.

::

    pip install s3fs                      # stock DCP's S3 path (fsspec)
    cargo build -p ckpt-chaos --release   # the rate-capping proxy
    export CKPT_TEST_S3_ENDPOINT=http://127.0.0.1:PORT CKPT_TEST_S3_BUCKET=B   # moto
    PYTHONPATH=python python python/benchmarks/cooperative.py \\
        [--rate-mib-per-s 256] [--reps 3] [--json]

It lives beside the package, not in it (as ``save_load.py`` does): it is a
measurement of ckpt, not part of what users import.

Why a cap: on loopback the S3 test server (moto) is as fast as the CPU, so reading
every byte once or once per replica would differ by memory copies. A real store is
slower than the network in front of it; ``ckpt-chaos proxy --rate-mib-per-s N``
(the chaos harness's storage proxy run alone) sits between every client and moto and
lets N MiB/s of bodies through, all connections together. It also counts every
request by kind and every body byte, so that stock DCP's traffic (s3fs) and ckpt's
(object_store) are counted the same way. Each measured load gets a proxy of its own,
so its counters are that load's.

4 rank processes (real gloo ranks, ``torch.multiprocessing``), two layouts:

- ``ddp``: every rank holds the same 512 MiB of plain fp32 tensors (64 of 2048x1024):
  4 replicas of every byte;
- ``hsdp``: FSDP2 (``fully_shard``) on ``init_device_mesh("cpu", (2, 2))``, a model
  of 64 bias-free ``Linear(1024, 2048)`` (512 MiB of parameters in all): each rank
  holds its 256 MiB shard, and each shard is held by 2 replicas.

Each layout is saved once three ways, straight to moto: ckpt's ``Checkpointer``, DCP
with ``ckpt.torch.dcp.StorageWriter``, and stock DCP with ``FsspecWriter`` (s3fs).
Then, per repetition in a rotating order, each load runs through its own capped
proxy, every rank loading into zeroed tensors:

- ``dcp``: stock ``dcp.load`` with ``FsspecReader``;
- ``plain``: ``ckpt.torch.load(url, sd)``, each rank reading for itself;
- ``coop``: ``ckpt.torch.load(url, sd, cooperative=True)``;
- ``dcp_ckpt``: ``dcp.load`` with ``ckpt.torch.dcp.StorageReader`` (cooperative under
  the process group, its default).

Figures per path (medians over repetitions, [min–max] of the wall time): the wall
time of the slowest rank; the store's body bytes and requests by kind as the proxy
counted them; for ckpt's paths also ckpt's own counters summed over ranks
(``bytes_read_from_store``, ``bytes_received_from_peers``, ``store_requests``) and
the job's ``unique_bytes``. Every load is checked bitwise against the saved values.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PATHS = ("dcp", "plain", "coop", "dcp_ckpt")
NAMES = {
    "dcp": "stock dcp.load (FsspecReader, s3fs)",
    "plain": "ckpt.torch.load",
    "coop": "ckpt.torch.load(cooperative=True)",
    "dcp_ckpt": "dcp.load + ckpt StorageReader",
}
LAYOUTS = ("ddp", "hsdp")
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}


def ckpt_options(endpoint: str) -> dict[str, Any]:
    """ckpt's store settings for the S3 server (or proxy) at ``endpoint``."""
    return {
        "aws_endpoint": endpoint,
        "aws_allow_http": True,
        "aws_region": "us-east-1",
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    }


def s3fs_options(endpoint: str) -> dict[str, Any]:
    """s3fs's settings (``FsspecWriter``/``FsspecReader`` keywords) for ``endpoint``;
    no instance cache, so a new proxy is a new client."""
    return {
        "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


class CappedProxy:
    """``ckpt-chaos proxy`` in front of the S3 server: its URL, and its counters when
    stopped (stdin closed)."""

    def __init__(self, binary: str, upstream: str, rate_mib_per_s: float):
        cap = ["--rate-mib-per-s", str(rate_mib_per_s)] if rate_mib_per_s > 0 else []
        self.proc = subprocess.Popen(
            [binary, "proxy", "--upstream", upstream, *cap],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            self.proc.kill()
            raise RuntimeError(f"ckpt-chaos proxy did not start: {line!r}")
        self.url = line.removeprefix("listening on ")

    def stop(self) -> dict[str, Any]:
        self.proc.stdin.close()
        out = self.proc.stdout.read()
        self.proc.wait(timeout=30)
        return json.loads(out.strip().splitlines()[-1])


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(minutes=30),
    )


def _gather(value: Any) -> list[Any]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def ddp_state(tensors: int, rows: int, cols: int) -> dict[str, Any]:
    """The same plain tensors on every rank (a DDP replica)."""
    g = torch.Generator().manual_seed(43)
    model = {}
    for i in range(tensors):
        t = torch.empty(rows, cols)
        t.normal_(0.0, 0.02, generator=g)
        model[f"layer{i:03d}.weight"] = t
    return {"model": model}


def hsdp_model(tensors: int, rows: int, cols: int) -> torch.nn.Module:
    """FSDP2 over a (replicate 2, shard 2) CPU mesh; every rank starts from the same
    weights, so the two replicas of each shard agree."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(43)
    model = torch.nn.Sequential(*[torch.nn.Linear(cols, rows, bias=False) for _ in range(tensors)])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    return model


def _locals(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's bytes of every tensor of ``sd`` (a DTensor's local shard)."""
    out = {}
    for name, t in sd.items():
        out[name] = t.to_local() if hasattr(t, "to_local") else t
    return out


class Layout:
    """One layout's state, its reference values and where it was saved."""

    def __init__(self, name: str, args: argparse.Namespace, root: str):
        self.name = name
        self.root = f"{root}/{name}"
        if name == "ddp":
            self.saved = ddp_state(args.tensors, args.rows, args.cols)
            self.target = {
                "model": {k: torch.zeros_like(v) for k, v in self.saved["model"].items()}
            }
            self.reference = _locals(self.saved["model"])
        else:
            model = hsdp_model(args.tensors, args.rows, args.cols)
            self.saved = {"model": model.state_dict()}
            self.target = self.saved  # loaded in place, as a resume does
            self.reference = {k: v.clone() for k, v in _locals(self.saved["model"]).items()}

    def url(self, path: str) -> str:
        return f"{self.root}/{path}"

    def zero(self) -> None:
        with torch.no_grad():
            for t in _locals(self.target["model"]).values():
                t.zero_()

    def matches(self) -> bool:
        got = _locals(self.target["model"])
        return all(torch.equal(got[k], v) for k, v in self.reference.items())

    def local_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.reference.values())


def save_all(layout: Layout, endpoint: str) -> dict[str, float]:
    """Saves the layout once per format, straight to the server; seconds per save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FsspecWriter

    from ckpt.torch import Checkpointer
    from ckpt.torch.dcp import StorageWriter

    took = {}
    opts = ckpt_options(endpoint)
    dist.barrier()
    t0 = time.perf_counter()
    with Checkpointer(layout.url("native"), store_options=opts, run_id="bench") as c:
        c.save(0, layout.saved).wait_committed()
    took["native"] = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(
        layout.saved,
        storage_writer=StorageWriter(layout.url("plugin"), store_options=opts, run_id="bench"),
    )
    took["plugin"] = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(
        layout.saved,
        storage_writer=FsspecWriter(layout.url("dcp"), **s3fs_options(endpoint)),
    )
    took["dcp"] = time.perf_counter() - t0
    dist.barrier()
    return {k: max(_gather(v)) for k, v in took.items()}


def load_once(layout: Layout, path: str, endpoint: str) -> dict[str, Any] | None:
    """One load of ``path`` through the proxy at ``endpoint``: (wall s, ckpt's stats)
    for this rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FsspecReader

    import ckpt.torch
    from ckpt.torch.dcp import StorageReader

    opts = ckpt_options(endpoint)
    stats = None
    if path == "dcp":
        dcp.load(
            layout.target, storage_reader=FsspecReader(layout.url("dcp"), **s3fs_options(endpoint))
        )
    elif path in ("plain", "coop"):
        extra = ckpt.torch.load(
            layout.url("native"), layout.target, store_options=opts, cooperative=path == "coop"
        )
        stats = dict(extra.stats)
    else:
        reader = StorageReader(layout.url("plugin"), store_options=opts)
        dcp.load(layout.target, storage_reader=reader)
        stats = dict(reader.stats)
    return stats


def measure(layout: Layout, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One capped load of ``path``: the slowest rank's wall time, the proxy's counts,
    ckpt's counters summed over ranks, whether every rank's bytes are the saved ones."""
    rank = dist.get_rank()
    proxy = CappedProxy(args.chaos, args.endpoint, args.rate_mib_per_s) if rank == 0 else None
    endpoint = _broadcast(proxy.url if proxy else None)
    layout.zero()
    dist.barrier()
    t0 = time.perf_counter()
    stats = load_once(layout, path, endpoint)
    wall = time.perf_counter() - t0
    dist.barrier()
    store = proxy.stop() if proxy else None
    ok = all(_gather(layout.matches()))
    walls = _gather(wall)
    all_stats = _gather(stats)
    figures: dict[str, Any] = {"wall_s": max(walls), "bitwise_equal": ok}
    if rank == 0:
        kinds = store["requests_by_kind"]
        figures.update(
            store_bytes=store["body_bytes_down"],
            requests=store["requests"],
            get=kinds.get("GET", 0),
            list=kinds.get("LIST", 0),
            head=kinds.get("HEAD", 0),
        )
        if all_stats[0] is not None:
            requests = [s.get("store_requests", {}) for s in all_stats]
            figures.update(
                ckpt_bytes_read_from_store=sum(
                    s.get("bytes_read_from_store", 0) for s in all_stats
                ),
                ckpt_bytes_received_from_peers=sum(
                    s.get("bytes_received_from_peers", 0) for s in all_stats
                ),
                ckpt_store_requests={
                    k: sum(r.get(k, 0) for r in requests) for k in ("LIST", "GET", "HEAD")
                },
                ckpt_unique_bytes=max(s.get("unique_bytes", 0) for s in all_stats),
            )
    return figures


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        if key == "bitwise_equal":
            out[key] = all(values)
        elif isinstance(first, dict):
            out[key] = {k: statistics.median(v[k] for v in values) for k in first}
        elif key == "wall_s":
            out[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
        else:
            out[key] = statistics.median(values)
    return out


def _run_layout(rank: int, world: int, port: int, name: str, args, root: str, out: str) -> None:
    # Stock DCP asks s3fs's streams for an fsync they do not have, and says so per file.
    warnings.filterwarnings("ignore", message="fsync not supported")
    _init(rank, world, port)
    layout = Layout(name, args, root)
    saves = save_all(layout, args.endpoint)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    for rep in range(args.reps):
        order = PATHS[rep % len(PATHS) :] + PATHS[: rep % len(PATHS)]
        for path in order:
            runs[path].append(measure(layout, path, args))
    sizes = _gather(layout.local_bytes())
    if rank == 0:
        report = {
            "layout": name,
            "local_bytes_per_rank": sizes,
            "save_s": saves,
            "paths": {p: _median(r) for p, r in runs.items()},
            "runs": runs,
        }
        Path(out).write_text(json.dumps(report))
        _remove(root + "/" + name, args.endpoint)
    dist.barrier()
    dist.destroy_process_group()


def _remove(url: str, endpoint: str) -> None:
    """Deletes the layout's objects (moto keeps them in memory)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **s3fs_options(endpoint))
    try:
        fs.rm(path, recursive=True)
    except OSError as e:
        # Best effort: the figures are written; a server without DeleteObjects
        # (s3s-fs answers it 500) keeps the objects.
        print(f"cooperative.py: could not remove {url}: {e}", file=sys.stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = f"s3://{args.bucket}/cooperative-bench-{uuid.uuid4().hex[:8]}"
    os.environ.update(CREDENTIALS)
    base = Path(tempfile.mkdtemp(prefix="ckpt-coop-bench-"))
    layouts = {}
    try:
        for name in args.layouts:
            out = base / f"{name}.json"
            mp.spawn(
                _run_layout,
                args=(args.ranks, _free_port(), name, args, root, str(out)),
                nprocs=args.ranks,
            )
            layouts[name] = json.loads(out.read_text())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "workload": {
            "ranks": args.ranks,
            "tensors": args.tensors,
            "shape": [args.rows, args.cols],
            "mib_in_all": args.tensors * args.rows * args.cols * 4 / MiB,
            "rate_mib_per_s": args.rate_mib_per_s,
            "reps": args.reps,
        },
        "layouts": layouts,
    }


def _gb(n: float) -> str:
    """Bytes as GiB."""
    return f"{n / (1 << 30):.2f}"


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"{w['ranks']} ranks, {w['mib_in_all']:.0f} MiB of fp32 parameters "
        f"({w['tensors']} x {w['shape'][0]}x{w['shape'][1]}), store capped at "
        f"{w['rate_mib_per_s']:g} MiB/s, medians of {w['reps']}",
    ]
    for name, layout in report["layouts"].items():
        paths = layout["paths"]
        unique = paths["coop"].get("ckpt_unique_bytes") or 1
        dcp_wall = paths["dcp"]["wall_s"]["median"]
        lines += [
            "",
            f"{name}: unique bytes {_gb(unique)} GiB",
            "",
            "| path | wall s [min–max] | vs stock | store GiB | requests GET / LIST / HEAD "
            "| store ÷ unique | ckpt: from store / from peers GiB | bitwise |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for path, f in paths.items():
            wall = f["wall_s"]
            ckpt_bytes = "–"
            if "ckpt_bytes_read_from_store" in f:
                from_store = _gb(f["ckpt_bytes_read_from_store"])
                ckpt_bytes = f"{from_store} / {_gb(f['ckpt_bytes_received_from_peers'])}"

            lines.append(
                f"| {NAMES[path]} | {wall['median']:.2f} [{wall['min']:.2f}–{wall['max']:.2f}] "
                f"| {dcp_wall / wall['median']:.2f}x | {_gb(f['store_bytes'])} "
                f"| {f['get']:.0f} / {f['list']:.0f} / {f['head']:.0f} "
                f"| {f['store_bytes'] / unique:.3f} | {ckpt_bytes} "
                f"| {'yes' if f['bitwise_equal'] else 'NO'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python python/benchmarks/cooperative.py", description=__doc__
    )
    parser.add_argument("--endpoint", default=os.environ.get("CKPT_TEST_S3_ENDPOINT"))
    parser.add_argument("--bucket", default=os.environ.get("CKPT_TEST_S3_BUCKET"))
    parser.add_argument(
        "--rate-mib-per-s", type=float, default=256.0, help="the store's cap (0: none)"
    )
    parser.add_argument(
        "--chaos",
        default=str(REPO / "target" / "release" / "ckpt-chaos"),
        help="the ckpt-chaos binary (its proxy subcommand caps the store)",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if not args.endpoint or not args.bucket:
        parser.error("--endpoint and --bucket (or CKPT_TEST_S3_ENDPOINT/_BUCKET) are needed")
    if args.ranks != 4 and "hsdp" in args.layouts:
        parser.error("the hsdp layout is a 2 x 2 mesh: --ranks 4")
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else render(report))


if __name__ == "__main__":
    main()
