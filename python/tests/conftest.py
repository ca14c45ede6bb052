"""Shared fixtures: the skip policy, rank processes with real torch.distributed
process groups (gloo), and the `ckpt` command line."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
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


@pytest.fixture
def s3_base(monkeypatch) -> str:
    """A fresh prefix on the loopback S3 server, as a URL; its credentials are in the
    environment, for this process and the jobs it starts."""
    endpoint = os.environ.get("CKPT_TEST_S3_ENDPOINT")
    bucket = os.environ.get("CKPT_TEST_S3_BUCKET")
    if not endpoint or not bucket:
        need("servers", "CKPT_TEST_S3_ENDPOINT and CKPT_TEST_S3_BUCKET (scripts/test starts moto)")
    for key, value in {
        "AWS_ENDPOINT": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
    }.items():
        monkeypatch.setenv(key, value)
    return f"s3://{bucket}/python-{uuid.uuid4().hex}"
