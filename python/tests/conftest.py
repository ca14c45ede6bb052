"""Shared fixtures: the skip policy, rank processes with real torch.distributed
process groups (gloo), and the `ckpt` command line."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]


def required(capability: str) -> bool:
    """Whether CKPT_REQUIRE names `capability` (scripts/test sets it): then a missing
    prerequisite fails the test instead of skipping it."""
    names = [n.strip() for n in os.environ.get("CKPT_REQUIRE", "").split(",")]
    return capability in names or "all" in names


def need(capability: str, missing: str) -> None:
    """Skips loudly, or fails when the capability is required."""
    message = f"SKIPPED: needs {capability}: {missing}"
    if required(capability):
        pytest.fail(f"{message} (required by CKPT_REQUIRE)")
    print(message, file=sys.stderr)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, *args) -> None:
    """Runs `fn(rank, world, port, *args)` in `world` fresh processes (spawned, so
    each imports torch itself) that form a gloo process group; fails if any fails."""
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


@pytest.fixture
def root(tmp_path: Path) -> str:
    """A checkpoint root on local disk, as a file:// URL."""
    return f"file://{tmp_path / 'ckpt'}"


def ckpt_cli() -> str | None:
    """The `ckpt` binary: $CKPT_BIN, else the workspace's debug or release build."""
    for candidate in (
        os.environ.get("CKPT_BIN"),
        REPO / "target" / "debug" / "ckpt",
        REPO / "target" / "release" / "ckpt",
        shutil.which("ckpt"),
    ):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def run_cli(*args: str) -> subprocess.CompletedProcess:
    binary = ckpt_cli()
    if binary is None:
        need("ckpt-cli", "no ckpt binary (set CKPT_BIN or cargo build -p ckpt-cli)")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)
