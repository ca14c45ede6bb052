"""Cooperative loads over a ``torch.distributed`` process group: the job reads each
byte of a checkpoint from the store once, and the ranks pass the rest to each other.

With data-parallel replicas (DDP, HSDP, FSDP's replica groups) R ranks want the same
bytes; read independently, the store serves them R times and every rank lists the
commit log and reads the metadata. The library (``ckpt::load::Cooperative``) decides
which rank reads which blocks and verifies whatever a peer sends against the save's
CRC32s; this module carries its requests and buffers over the caller's process group
(gloo on CPUs, NCCL on GPUs):

1. rank 0 opens the checkpoint (the one listing and the manifest) and fetches every
   rank part, then broadcasts them; the others open the same checkpoint from those
   bytes, checked as if read from the store, with no request of their own;
2. every rank plans its own boxes, and one all-to-all tells each owner which blocks
   it is asked for;
3. each owner reads the union of what it was asked from the store, once, and sends
   each asking rank one buffer (point to point, so that a peer that dies is named);
4. every rank checks each received block's CRC32 (a block that fails is read from the
   store instead) and scatters the bytes into its tensors.

Between the steps the ranks agree on failures (one small all-reduce), so a rank whose
store read fails makes every rank's load fail naming it, instead of leaving the
others waiting for bytes that never come.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ckpt import _native


class PeerLostError(_native.CkptError):
    """A peer of a cooperative load died or stopped answering during the exchange.
    ``rank`` is its rank in the load's process group (None when the transport does
    not say which). The process group is no longer usable; re-form it (the elastic
    resume does) and load again."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def group_world(group: Any) -> tuple[int, int] | None:
    """(rank, world size) in ``group`` (the default group when None) when
    ``torch.distributed`` is initialised with more than one rank there, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size(group)
    if world < 2:
        return None
    return dist.get_rank(group), world


def _device(group: Any) -> torch.device:
    """Where the group's collectives take their tensors: the current GPU under
    NCCL, the CPU otherwise."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _agree(group: Any, rank: int, world: int, what: str, work) -> Any:
    """Runs ``work`` on every rank, then agrees (one all-reduce) on whether it failed
    anywhere: the failing rank raises its own error, the others an error naming it."""
    import torch.distributed as dist

    failed = torch.zeros(world, dtype=torch.int32, device=_device(group))
    result, error = None, None
    try:
        result = work()
    except _native.CkptError as e:
        error = e
        failed[rank] = 1
    dist.all_reduce(failed, group=group)
    if error is not None:
        raise error
    ranks = [r for r, f in enumerate(failed.tolist()) if f]
    if ranks:
        raise _native.CkptError(
            f"cooperative load: rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))} failed while {what} (its error says why)"
        )
    return result


def open_shared(
    url: str,
    step: int | None,
    store_options: Any,
    healthy: bool,
    group: Any,
    rank: int,
) -> _native.Reader:
    """Rank 0 opens checkpoint ``step`` (or the newest one ``healthy`` accepts) and
    broadcasts it with every rank part; every rank returns a reader over it. Only
    rank 0 sends requests to the store."""
    import torch.distributed as dist

    payload: list[Any] = [None]
    if rank == 0:
        try:
            reader = _native.Reader(url, step, store_options, healthy and step is None)
            payload[0] = ("ok", reader.share())
        except _native.NotFoundError as e:
            message = str(e)
            if step is None and healthy and _native.latest(url, store_options) is None:
                message = f"no committed checkpoint in {url}"
            payload[0] = ("not-found", message)
        except _native.CkptError as e:
            payload[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(payload, src=_global(group, 0), group=group)
    status, value = payload[0]
    if status == "not-found":
        error = _native.NotFoundError(value)
        error.add_note("(rank 0 looked for it on behalf of every rank)")
        raise error
    if status == "error":
        raise _native.CkptError(f"rank 0 could not open the checkpoint to load: {value}")
    if rank == 0:
        return reader
    return _native.Reader.from_shared(url, value, store_options)


def _all_to_all_bytes(parts: list[bytes], group: Any) -> list[bytes]:
    """Sends ``parts[r]`` to rank ``r`` and returns what each rank sent this one: one
    all-to-all of the sizes, one of the bytes."""
    import torch.distributed as dist

    device = _device(group)
    world = len(parts)
    sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64, device=device)
    incoming = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(incoming, sizes, group=group)
    incoming_sizes = incoming.tolist()
    joined = b"".join(parts)
    send = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else None
    send = (send if send is not None else torch.empty(0, dtype=torch.uint8)).to(device)
    receive = torch.empty(sum(incoming_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        receive,
        send,
        output_split_sizes=incoming_sizes,
        input_split_sizes=[len(p) for p in parts],
        group=group,
    )
    data = receive.cpu().numpy().tobytes()
    out, at = [], 0
    for n in incoming_sizes:
        out.append(data[at : at + n])
        at += n
    return out


def _exchange(
    sending: dict[int, torch.Tensor],
    receiving: dict[int, torch.Tensor],
    group: Any,
    rank: int,
) -> None:
    """One message to and from each peer that has bytes for the other, all posted at
    once; a peer whose transfer fails (it died, its connection broke) is named."""
    import torch.distributed as dist

    if os.environ.get("CKPT_TEST_COOPERATIVE_EXIT") == str(rank):
        # Test hook: this rank dies between serving and sending, as a lost node would.
        os._exit(17)
    device = _device(group)
    ops, peers = [], []
    for peer, tensor in sorted(receiving.items()):
        ops.append(dist.P2POp(dist.irecv, tensor, _global(group, peer), group))
        peers.append(peer)
    for peer, tensor in sorted(sending.items()):
        ops.append(dist.P2POp(dist.isend, tensor.to(device), _global(group, peer), group))
        peers.append(peer)
    if not ops:
        return
    works = dist.batch_isend_irecv(ops)
    if len(works) != len(ops):
        # Coalesced into one (NCCL): the transport does not say which peer failed.
        try:
            for work in works:
                work.wait()
        except Exception as e:  # noqa: BLE001 - torch raises several types here
            raise PeerLostError(f"cooperative load: the exchange with the peers failed: {e}") from e
        return
    for peer, work, op in zip(peers, works, ops, strict=True):
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError, NCCL DistBackendError
            direction = "receiving from" if op.op is dist.irecv else "sending to"
            raise PeerLostError(
                f"cooperative load: {direction} rank {peer} failed — rank {peer} died or "
                f"stopped answering during the exchange ({e})",
                rank=peer,
            ) from e


def load(
    reader: _native.Reader, wants: list[tuple], group: Any, rank: int, world: int
) -> dict[str, Any]:
    """Loads ``wants`` (host memory, as ``Reader.load_into`` takes them) by every rank
    of ``group`` together; returns this rank's counters, with ``unique_bytes`` the
    whole job's."""
    import torch.distributed as dist

    coop = _agree(group, rank, world, "planning", lambda: reader.cooperate(wants, rank, world))
    asked = _all_to_all_bytes(list(coop.asks()), group)
    sizes = _agree(group, rank, world, "reading from the store", lambda: coop.serve(asked))
    sending: dict[int, torch.Tensor] = {}
    for peer, n in enumerate(sizes):
        if n:
            buffer = torch.empty(n, dtype=torch.uint8)
            coop.write_sent(peer, buffer.data_ptr(), n)
            if os.environ.get("CKPT_TEST_COOPERATIVE_CORRUPT") == f"{rank}->{peer}":
                buffer[n // 2] ^= 0x10  # test hook: a peer that sends wrong bytes
            sending[peer] = buffer
    device = _device(group)
    receiving = {
        peer: torch.empty(n, dtype=torch.uint8, device=device)
        for peer, n in enumerate(coop.expected())
        if n
    }
    _exchange(sending, receiving, group, rank)
    del sending
    received = {peer: t.cpu() for peer, t in receiving.items()}
    unique = torch.tensor([coop.unique_bytes_served], dtype=torch.int64, device=device)
    stats = _agree(
        group,
        rank,
        world,
        "verifying what the peers sent",
        lambda: coop.finish(
            [
                (received[p].data_ptr(), received[p].numel()) if p in received else (0, 0)
                for p in range(world)
            ]
        ),
    )
    dist.all_reduce(unique, group=group)
    stats["unique_bytes"] = int(unique.item())
    stats["store_requests"] = reader.store_requests
    return stats
