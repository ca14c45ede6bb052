"""One generation's process group: formed on a store of its own, abortable while it
forms, torn down when the generation ends.

Rank 0 serves a fresh TCPStore and publishes it in the generation's key-value space,
so that a rank of another generation cannot join the group.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ckpt.elastic import _sockets, _torch_workarounds


class _Forming:
    """Makes the formation of generation ``generation``'s process group abortable.
    Its waits (the store's barrier, gloo's exchange of addresses) are blocking calls
    with the group's timeout, minutes: a peer that never arrives (dropped, or still
    stuck in the previous generation) would keep this rank there long after the
    control plane ended the generation. Once the agent aborts it, a thread shuts
    down the store's connections (again as new ones appear) until the formation
    ends, which makes every such wait fail at once."""

    def __init__(self, agent: Any, generation: int):
        self.agent, self.generation = agent, generation
        self.port: int | None = None
        self.done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self.done.is_set():
            if self.agent.wait_abort(self.generation, 0.2):
                break
        else:
            return
        while not self.done.is_set():
            if self.port is not None:
                _sockets.shut_down_store_connections(self.port)
            self.done.wait(0.1)


def device_kwargs(backend: str) -> dict[str, Any]:
    """On NCCL, this rank's GPU (``LOCAL_RANK``) is the current device and the group's."""
    if backend != "nccl":
        return {}
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return {"device_id": torch.device("cuda", local)}


def form_group(
    agent: Any, a: Mapping[str, Any], backend: str, timeout: timedelta
) -> list[tuple[int, int]]:
    """A process group for generation ``a``: rank 0 serves a fresh TCPStore on a
    free port and publishes it in the generation's key-value space. Returns the
    sockets the group opened (the abort shuts them down). An abort of the
    generation while it forms makes it raise (``_Forming``)."""
    forming = _Forming(agent, a["generation"])
    try:
        return _form_group_watched(agent, a, backend, timeout, forming)
    finally:
        forming.done.set()


def _form_group_watched(
    agent: Any, a: Mapping[str, Any], backend: str, timeout: timedelta, forming: _Forming
) -> list[tuple[int, int]]:
    import torch
    import torch.distributed as dist

    rank, world, generation = a["rank"], a["world_size"], a["generation"]
    host = agent.member()["host"]
    _torch_workarounds.forget_meshes()
    before = _sockets.sockets()
    if rank == 0:
        store = dist.TCPStore(
            host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        forming.port = store.port
        agent.kv_set("torch/store", f"{host}:{store.port}")
    else:
        where = agent.kv_get("torch/store", timeout.total_seconds())
        store_host, port = where.rsplit(":", 1)
        forming.port = int(port)
        store = dist.TCPStore(store_host, int(port), world, is_master=False, timeout=timeout)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR=host if rank == 0 else where.rsplit(":", 1)[0],
        MASTER_PORT=str(store.port),
    )
    kwargs = device_kwargs(backend)
    _torch_workarounds.reset_group_names()
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"ckpt-g{generation}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        **kwargs,
    )
    # The first collective connects every pair (gloo connects lazily on some paths).
    probe = torch.zeros(1, device="cuda" if backend == "nccl" else "cpu")
    dist.all_reduce(probe)
    return _sockets.group_sockets(before, store.port)


def teardown(agent: Any, generation: int, aborted: bool, backend: str) -> None:
    """Destroys the generation's process group; the sockets' guard goes first, so the
    abort never touches descriptors the destruction frees."""
    import torch.distributed as dist

    agent.guard_sockets(generation, [])
    if not dist.is_initialized():
        return
    if aborted and backend == "nccl":
        _torch_workarounds.abort_process_group()
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (a broken group is being thrown away)
        pass
