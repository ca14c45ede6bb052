"""``store_options={...}``: the store's settings from Python, through the same
``StoreConfig::set`` as the ``ckpt`` command's ``-o KEY=VALUE``, on every entry point
that opens a store; a key or value the store refuses is a ``ValueError`` naming it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import free_port

import ckpt
from ckpt.torch import Checkpointer, latest, list_checkpoints, load
from ckpt.torch.dcp import StorageReader, StorageWriter


def test_a_local_store_opened_with_options_saves_lists_and_loads(root):
    options = {"fsync": False, "retries": 0, "request_timeout": 2.5}
    state = {"w": torch.randn(40, 8), "cursor": 3}
    with Checkpointer(root, store_options=options) as c:
        c.save(1, state).wait_committed()
        into = {"w": torch.zeros(40, 8), "cursor": 0}
        assert c.load(into).step == 1 and torch.equal(into["w"], state["w"])
    assert latest(root, store_options=options)["step"] == 1
    assert [e["step"] for e in list_checkpoints(root, store_options=options)] == [1]
    into = {"w": torch.zeros(40, 8), "cursor": 0}
    assert load(root, into, store_options=options).step == 1 and into["cursor"] == 3


def test_the_dcp_plugin_takes_store_options(root):
    options = {"fsync": False}
    state = {"model": {"w": torch.randn(16, 4)}, "epoch": 2}
    dcp.save(state, storage_writer=StorageWriter(root, store_options=options))
    into = {"model": {"w": torch.zeros(16, 4)}, "epoch": 0}
    dcp.load(into, storage_reader=StorageReader(root, store_options=options))
    assert torch.equal(into["model"]["w"], state["model"]["w"]) and into["epoch"] == 2


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"retries": "many"}, "retries"),
        ({"retry_timeout": "soon"}, "retry_timeout"),
        ({"fsync": "perhaps"}, "fsync"),
        ({"retries": [1]}, "retries"),
        ({"part_size": 1}, "part_size"),
        # A backend option on local disk, which takes none.
        ({"aws_endpoint": "http://127.0.0.1:9"}, "aws_endpoint"),
    ],
)
def test_a_bad_store_option_raises_value_error_naming_its_key(root, options, named):
    for opens in (
        lambda: Checkpointer(root, store_options=options),
        lambda: latest(root, store_options=options),
        lambda: list_checkpoints(root, store_options=options),
        lambda: load(root, {}, store_options=options),
    ):
        with pytest.raises(ValueError, match=named):
            opens()


def test_an_unknown_key_on_s3_raises_value_error_naming_it():
    with pytest.raises(ValueError, match="no_such_option"):
        latest("s3://bucket/run", store_options={"no_such_option": 1})


def test_a_bad_url_keeps_its_library_error_with_options():
    with pytest.raises(ckpt.StorageError, match="unknown scheme"):
        latest("nope://x", store_options={"retries": 1})


def test_retries_0_fails_at_once_on_an_endpoint_that_refuses(monkeypatch):
    for key in ("AWS_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    options = {
        "aws_endpoint": f"http://127.0.0.1:{free_port()}",
        "aws_allow_http": True,
        "retries": 0,
        "connect_timeout": 1,
    }
    started = time.monotonic()
    with pytest.raises(ckpt.StorageError):
        latest("s3://bucket/run", store_options=options)
    # Refused at once (milliseconds); the default policy backs off between its
    # retries, which takes seconds here.
    assert time.monotonic() - started < 1.5


def test_s3_on_the_loopback_server_with_its_endpoint_given_as_a_store_option(s3_base, monkeypatch):
    options = {
        "aws_endpoint": os.environ["AWS_ENDPOINT"],
        "aws_allow_http": True,
        "retries": 0,
    }
    # Only the options say where the server is.
    monkeypatch.delenv("AWS_ENDPOINT")
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    state = {"w": torch.randn(64, 16), "cursor": 5}
    with Checkpointer(s3_base, store_options=options) as c:
        c.save(3, state).wait_committed()
    assert latest(s3_base, store_options=options)["step"] == 3
    assert [e["step"] for e in list_checkpoints(s3_base, store_options=options)] == [3]
    into = {"w": torch.zeros(64, 16), "cursor": 0}
    assert load(s3_base, into, store_options=options).step == 3
    assert torch.equal(into["w"], state["w"]) and into["cursor"] == 5
    dcp.save(
        {"model": {"w": state["w"]}},
        storage_writer=StorageWriter(s3_base, step=4, store_options=options),
    )
    into = {"model": {"w": torch.zeros(64, 16)}}
    dcp.load(into, storage_reader=StorageReader(s3_base, store_options=options))
    assert torch.equal(into["model"]["w"], state["w"])


_ELASTIC = """
import sys
import torch
import ckpt.elastic

url = sys.argv[1]
options = {"fsync": False, "retries": 0}

def train(ctx):
    assert ctx.resume(url, {"w": torch.zeros(4)}, store_options=options) is None
    ckpt = ctx.checkpointer(url, store_options=options)
    ckpt.save(7, {"w": torch.ones(4)}).wait_committed()
    ckpt.close()
    into = {"w": torch.zeros(4)}
    print("resumed", ctx.resume(url, into, store_options=options).step, into["w"].sum().item())

ckpt.elastic.run(train, backend="gloo")
"""


def test_the_elastic_context_takes_store_options(root):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_RDZV")}
    done = subprocess.run(
        [sys.executable, "-c", _ELASTIC, root],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "resumed 7 4.0" in done.stdout, done.stdout
