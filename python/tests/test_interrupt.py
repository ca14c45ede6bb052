"""Blocking calls release the GIL and give way to Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ckpt import _native
from ckpt.torch import Checkpointer

# Promptness and GIL release are timed: nothing runs beside them (scripts/test
# runs the `serial` files one test at a time).
pytestmark = pytest.mark.serial

WAIT_FOREVER = textwrap.dedent(
    """
    import sys, torch
    from ckpt.torch import Checkpointer, latest
    url = sys.argv[1]
    # Rank 0 of 2: rank 1 never saves, so the commit never comes.
    c = Checkpointer(url, rank=0, world_size=2, commit_timeout=600)
    handle = c.save(1, {"w": torch.ones(1000, 100)})
    handle.wait_durable()
    try:
        print("waiting", flush=True)  # inside: a Ctrl-C from here on is caught below
        handle.wait_committed()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    # The process goes on normally after the interrupted wait.
    print("latest", latest(url), flush=True)
    """
)


def test_ctrl_c_during_a_blocking_wait_raises_keyboard_interrupt_promptly(root):
    p = subprocess.Popen(
        [sys.executable, "-c", WAIT_FOREVER, root],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "waiting"
    sent = time.monotonic()
    p.send_signal(signal.SIGINT)
    assert p.stdout.readline().strip() == "interrupted"
    assert time.monotonic() - sent < 5
    # Read on through the same buffered pipe (communicate() would read past what
    # readline() has buffered already).
    assert p.wait(timeout=60) == 0, p.stderr.read()
    assert p.stdout.read().strip() == "latest None"


def test_the_gil_is_released_while_a_load_reads(root):
    w = torch.randn(256 << 20 >> 2)  # 256 MiB
    with Checkpointer(root) as c:
        c.save(1, {"w": w}, overlapped=False).wait_committed()
    into = torch.empty_like(w)
    reader = _native.Reader(root)
    want = ("w", "F32", [w.numel()], [0], [w.numel()], into.data_ptr(), w.numel() * 4, -1, 0)
    counter = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counter[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    time.sleep(0.05)
    # Nothing but the native call between the two reads of the counter: had it held
    # the GIL, the other thread could not have counted meanwhile.
    before = counter[0]
    reader.load_into([want])
    during = counter[0] - before
    stop.set()
    thread.join()
    assert torch.equal(into, w)
    assert during > 1000, during
