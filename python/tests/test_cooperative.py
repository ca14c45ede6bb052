"""Cooperative loads (``ckpt.torch.load(..., cooperative=True)`` and ``dcp.load``
through ``StorageReader`` under a process group): every byte read from the store
once per job, one listing, every block a peer sends verified by its receiver.

Real gloo process groups: 4 DDP replicas, an HSDP 2 x 2 mesh and a 4 -> 3 resharded
load each come back bitwise with the job's store bytes equal to the unique bytes; a
corrupted block from a peer is caught and read from the store; a peer that dies
mid-exchange fails the load naming it. Each case natively and through DCP."""

from __future__ import annotations

from pathlib import Path

import coop_workers
import pytest
import torch.multiprocessing as mp
from conftest import free_port, spawn


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[dict[str, str], dict[str, str]]:
    """The checkpoints every test here loads, saved once by 4 ranks."""
    base = tmp_path_factory.mktemp("cooperative")
    names = ("ddp", "ddp-dcp", "hsdp", "hsdp-dcp", "fsdp", "fsdp-dcp")
    roots = {name: f"file://{base / name}" for name in names}
    references = {name: str(base / f"{name}.pt") for name in ("ddp", "hsdp", "fsdp")}
    spawn(coop_workers.replicas_and_hsdp, 4, roots, references)
    return roots, references


def test_replicas_and_hsdp_read_each_byte_once_and_load_bitwise(saved):
    # The loads and their checks ran in the fixture's four ranks; it fails if any
    # rank's assertion did. Here: every checkpoint it loaded exists.
    roots, references = saved
    for name in references:
        assert Path(references[name]).is_file(), name


def _run_until_a_peer_dies(worker, world: int, args: tuple, outcome: str) -> None:
    """Runs ``worker`` on ``world`` ranks, in which rank 2 dies mid-exchange (exit
    17) and the others name it in ``outcome``.RANK and exit 0."""
    context = mp.spawn(worker, args=(world, free_port(), *args), nprocs=world, join=False)
    for process in context.processes:
        process.join(timeout=180)
    codes = [p.exitcode for p in context.processes]
    for process in context.processes:
        if process.is_alive():
            process.kill()
    assert codes == [0, 0, 17], codes
    for rank in (0, 1):
        seen = Path(f"{outcome}.{rank}").read_text()
        assert "PeerLostError rank=2" in seen and "rank 2 died" in seen, (rank, seen)


def test_a_resharded_load_a_corrupted_peer_block_and_a_dead_peer(saved, tmp_path):
    roots, references = saved
    outcome = str(tmp_path / "outcome")
    _run_until_a_peer_dies(coop_workers.resharded, 3, (roots, references, outcome), outcome)
    for rank in (0, 1):
        assert Path(f"{outcome}.{rank}").read_text().startswith("PeerLostError"), rank


def test_a_peer_that_dies_mid_exchange_of_dcp_load_is_named(saved, tmp_path):
    roots, _ = saved
    outcome = str(tmp_path / "outcome")
    _run_until_a_peer_dies(coop_workers.dead_peer, 3, (roots, outcome), outcome)


def test_without_a_process_group_a_cooperative_load_is_the_plain_one(root):
    import torch

    from ckpt.torch import Checkpointer, load

    values = {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6)}
    with Checkpointer(root, rank=0, world_size=1) as checkpointer:
        checkpointer.save(1, values).wait_committed()
    into = {"w": torch.zeros(4, 6)}
    stats = load(root, into, cooperative=True).stats
    assert torch.equal(into["w"], values["w"])
    assert stats["bytes_received_from_peers"] == 0
    assert stats["bytes_read_from_store"] == stats["unique_bytes"] > 0
    assert stats["store_requests"]["LIST"] >= 1
