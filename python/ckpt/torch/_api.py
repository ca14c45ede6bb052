"""The native torch API: ``Checkpointer``, ``SaveHandle``, ``load``, ``latest``,
``health``, ``list_checkpoints``.

Shaped like the Rust API. A save blocks the caller only while the rank's tensors
are copied into the library's staging buffer (``overlapped=False``), or not even for
that (``overlapped=True``, the default: the copy runs on the library's threads while
the caller computes, and ``SaveHandle.wait_staged()`` says when the tensors may
change again — call it before the optimizer step). Checksumming, upload and the
commit run in the background; ``wait_committed()`` says when the whole checkpoint
exists for readers.

What each path copies (bytes of tensor data; see docs/PYTHON.md):

- save: one copy of this rank's boxes into a staging buffer (the library's own;
  nothing in Python), plus one more for each non-contiguous tensor;
- load from local disk, uncompressed: none — positioned reads land in the
  destination tensors, verified there;
- load from an object store, or compressed: one copy out of the fetched (or
  decompressed) block into the destination.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt import _native
from ckpt.torch import _cooperative, _state

# What a checkpoint written through DCP says in its manifest's metadata: its
# non-tensor values are torch-pickled bytes (DCP's way), not JSON.
DCP_MARK = "ckpt.torch.dcp"

#: Settings of the store a URL opens (``store_options=``): ckpt's own keys
#: (``retries``, ``retry_timeout``, ``request_timeout``, ``part_size``, ``fsync``, …;
#: durations in seconds) and any other key as object_store names it
#: (``aws_endpoint``, …), as the ``ckpt`` command's ``-o KEY=VALUE`` takes them.
StoreOptions = dict[str, str | int | float | bool]


def _url(url: str | os.PathLike) -> str:
    return os.fspath(url)


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    return rank, world_size


class SaveHandle:
    """Follows one rank's save. Holds the saved tensors until they are staged."""

    def __init__(
        self,
        native: _native.SaveHandle,
        keep_alive: list | None,
        bytes_copied: int,
        profile: dict[str, Any] | None = None,
        url: str | None = None,
        store_options: StoreOptions | None = None,
        warn_unhealthy: bool = False,
    ):
        self._native = native
        self._keep_alive = keep_alive
        self._url = url
        self._store_options = store_options
        # Rank 0 reads the verdict of its commit and warns when it is unhealthy.
        self._warn_unhealthy = warn_unhealthy
        # Tensor bytes copied besides the staging copy (non-contiguous tensors).
        self.bytes_copied = bytes_copied
        self.profile: dict[str, Any] = profile or {}
        """Where the stall went, in seconds: ``prepare_s`` (walking the state dict,
        encoding its non-tensor values, checking the tensors against the kept save
        plan, or building a new one), ``library_s`` (the native call: the library's
        registration, ``library_stall_s`` of it by its own clock), and
        ``plan_reused`` (whether the previous save's plan was reused)."""

    @property
    def step(self) -> int:
        return self._native.step

    @property
    def stall(self) -> float:
        """Seconds the caller was blocked by ``save``."""
        return self._native.stall

    def wait_staged(self) -> float:
        """Waits until the tensors are copied (they may be written again after this);
        returns the seconds the copy took."""
        secs = self._native.wait_staged()
        self._keep_alive = None
        return secs

    def is_staged(self) -> bool:
        return self._native.is_staged()

    def wait_durable(self) -> None:
        """Waits until this rank's part is durable in the store."""
        self._native.wait_durable()
        self._keep_alive = None

    def wait_committed(self) -> None:
        """Waits until the checkpoint is committed; raises if the save failed. On
        rank 0, a checkpoint the commit judged unhealthy (replicas that disagree, a
        non-finite value or metric, a failed ``health_check``) is reported with an
        :class:`UnhealthyCheckpointWarning` naming the reasons (one manifest read)."""
        self._native.wait_committed()
        self._keep_alive = None
        if self._warn_unhealthy and self._url is not None:
            self._warn_unhealthy = False
            verdict = health(self._url, self.step, store_options=self._store_options)
            if verdict.get("healthy") is False:
                warnings.warn(
                    UnhealthyCheckpointWarning(
                        f"step {self.step} committed unhealthy: "
                        + "; ".join(verdict.get("reasons") or [])
                    ),
                    stacklevel=2,
                )

    def health(self) -> dict[str, Any]:
        """Waits until the checkpoint is committed (raises if the save failed, as
        ``wait_committed``), then returns its health as :func:`health` reads it: one
        manifest read. The commit judged it; this says what it found."""
        if self._url is None:
            raise _native.InvalidError("this save handle does not know its checkpoint's URL")
        self._native.wait_committed()
        self._keep_alive = None
        return health(self._url, self.step, store_options=self._store_options)

    def done(self) -> bool:
        """True once the checkpoint is committed, False while the save runs; raises if
        it failed."""
        finished = self._native.done()
        if finished:
            self._keep_alive = None
        return finished

    def __del__(self):
        # Dropping the native handle waits for the copy: release it before the
        # tensors it reads.
        self._native = None
        self._keep_alive = None


class SnapshotHandle:
    """Follows one rank's snapshot (:meth:`Checkpointer.snapshot`). Holds the
    snapshotted tensors until they are staged."""

    def __init__(self, native: _native.SnapshotHandle, keep_alive: list | None):
        self._native = native
        self._keep_alive = keep_alive

    @property
    def step(self) -> int:
        return self._native.step

    @property
    def stall(self) -> float:
        """Seconds the caller was blocked by ``snapshot``."""
        return self._native.stall

    def wait_staged(self) -> float:
        """Waits until the tensors are copied (they may be written again after this);
        returns the seconds the copy took."""
        secs = self._native.wait_staged()
        self._keep_alive = None
        return secs

    def wait_ready(self) -> _native.Snapshot:
        """Waits until the snapshot is staged and checksummed; returns it (``step``,
        ``dir``, ``part_crc32``, ``nbytes``), what ``ckpt.elastic`` keeps, replicates
        and votes on."""
        snapshot = self._native.wait_ready()
        self._keep_alive = None
        return snapshot

    def host_bytes_held(self) -> dict[str, Any]:
        """Host memory held by this rank's checkpointing now, by kind (see
        :meth:`Checkpointer.host_bytes_held`)."""
        return self._native.host_bytes_held()

    def __del__(self):
        # Dropping the native handle waits for the copy: release it before the
        # tensors it reads.
        self._native = None
        self._keep_alive = None


@dataclass
class ExtraState:
    """What a load returns besides the tensors: the step and the non-tensor state.

    ``ranks[r]`` is saved rank ``r``'s non-tensor state (flattened names, as saved),
    whatever the world size now; ``mine`` is the entry of the rank with this rank's
    number when the saving world had one (those values were also put back into the
    state dict in place), else empty.
    """

    step: int
    world_size: int
    generation: int
    ranks: list[dict[str, Any]] = field(default_factory=list)
    mine: dict[str, Any] = field(default_factory=dict)
    global_state: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    """The unhealthy checkpoints a load without a step passed over to find this one,
    newest first: ``{"step", "dir", "reasons"}`` each (empty when it loaded the
    newest, or an explicit step)."""
    healthy: bool | None = None
    """The loaded checkpoint's health: True, False (only when its step was asked
    for), or None when unknown (written before health was recorded)."""


def _decoder(metadata: Mapping[str, Any]):
    """Values of a DCP-written checkpoint are torch-pickled; the native API's are JSON
    or bytes."""
    if metadata.get(DCP_MARK):
        import io

        def decode(kind: str, payload: Any) -> Any:
            if kind == "bytes":
                return torch.load(io.BytesIO(payload), weights_only=True)
            return _state.decode_value(kind, payload)

        return decode
    return _state.decode_value


def _shared_run_id(world_size: int) -> str | None:
    """A fresh run id that every rank of the process group agrees on (rank 0 draws
    it), so that a restarted job never reuses its predecessor's object names; None
    outside an initialised group (the library then draws one for a world of one)."""
    import secrets

    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != world_size:
        return None
    choice = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


class Checkpointer:
    """One rank's checkpointer over ``url`` (``file://``, a local path, ``s3://``,
    ``gs://``, ``az://``, ``memory://``).

    ``rank`` and ``world_size`` default to ``torch.distributed``'s when it is
    initialised (else 0 of 1). ``config`` keywords are the library's settings:
    ``generation``, ``run_id``, ``block_size``, ``codec`` (``"none"``, ``"zstd"``,
    ``"zstd:LEVEL"``), ``max_in_flight``, ``keep_last``, ``commit_timeout``,
    ``commit_takeover``, ``retention_grace`` (seconds), ``direct_io``,
    ``copy_threads``, ``check_staging``. ``host_memory_budget`` (bytes) bounds the host
    memory this rank's checkpointing holds (staging buffers, in-memory copies,
    replicas, snapshots): a snapshot that does not fit is not taken
    (``OverBudgetError``), a save that does not fit stages its file in pieces;
    :meth:`host_bytes_held` says what is held. ``store_options`` are the store's settings
    (see docs/PYTHON.md; a key or value the store refuses raises ``ValueError``).
    Every rank of a world must use the same
    ``run_id``, different for every run that saves under the same URL with the same
    generation: by default the ``CKPT_RUN_ID`` variable, else one drawn by rank 0 and
    broadcast (a collective: every rank constructs its checkpointer), else (a world
    of several ranks without a process group) ``"0"``.

    Health: ``replica_mismatch`` says what a save does when the ranks holding the
    same replicated box (a ``Replicate()`` placement, an HSDP replica dimension; a
    plain tensor every rank has only with ``compare_plain_tensors=True``, since a
    plain tensor may differ between ranks on purpose, as BatchNorm's statistics do
    under DDP) hold different bytes: ``"warn"`` (the default:
    commit it marked unhealthy), ``"fail"`` (refuse the commit: ``wait_committed``
    raises and the previous checkpoint stays the newest) or ``"off"`` (do not
    compare). ``health_check`` is called at each save with its metrics (the
    ``health=`` dict, floats) and returns True or None when the state is healthy,
    False or a string (the reason) when it is not: the checkpoint then commits
    marked unhealthy, and loads without a step pass over it.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        store_options: StoreOptions | None = None,
        replica_mismatch: str = "warn",
        health_check: Callable[[dict[str, float]], bool | str | None] | None = None,
        compare_plain_tensors: bool = False,
        host_memory_budget: int | None = None,
        _budget_of: Any = None,
        **config: Any,
    ):
        if host_memory_budget is not None:
            config["host_memory_budget"] = int(host_memory_budget)
        if replica_mismatch not in REPLICA_POLICIES:
            raise ValueError(
                f"replica_mismatch must be one of {', '.join(map(repr, REPLICA_POLICIES))}, "
                f"not {replica_mismatch!r}"
            )
        if health_check is not None and not callable(health_check):
            raise TypeError(f"health_check must be callable, not {type(health_check).__name__}")
        config["replica_mismatch"] = replica_mismatch
        self.replica_mismatch = replica_mismatch
        self.health_check = health_check
        self.url = _url(url)
        self.store_options = store_options
        self.rank, self.world_size = _world(rank, world_size)
        if "run_id" not in config and not os.environ.get("CKPT_RUN_ID"):
            run_id = _shared_run_id(self.world_size)
            if run_id is not None:
                config["run_id"] = run_id
        # `_budget_of` (ckpt.elastic): the in-memory copies holder whose host-memory
        # budget this checkpointer's staging and snapshots count in.
        self._native = _native.Checkpointer(
            self.url, self.rank, self.world_size, config, store_options, _budget_of
        )
        self.compare_plain_tensors = compare_plain_tensors
        self._planner = _state.SavePlanner(self.rank, compare_plain_tensors)

    def save(
        self,
        step: int,
        state_dict: Mapping[str, Any],
        *,
        overlapped: bool = True,
        global_state: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        health: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Saves this rank's part of ``state_dict`` as checkpoint ``step``.

        Tensors and DTensors are saved as boxes of global tensors; every other leaf
        is this rank's non-tensor state (JSON-able values, or bytes), readable by
        every rank of a later world. ``global_state`` is state every rank has the
        same (written once); ``metadata`` goes into the manifest.

        ``health`` are scalar metrics of the state (``{"loss": ..., "grad_norm":
        ...}``: numbers, or one-element tensors), recorded in the checkpoint's
        health; one that is NaN or infinite makes the checkpoint unhealthy, and so
        does the checkpointer's ``health_check`` saying so. The manifest keeps the
        metrics of rank 0 (of the lowest rank that gave any).

        With ``overlapped`` (the default) this returns before the tensors are
        copied: do not write them until ``wait_staged()`` returns.
        """
        started = time.perf_counter()
        metrics = _metrics(health)
        unhealthy = _judge(self.health_check, metrics)
        part = self._planner.prepare(state_dict, _state.encode_value)
        global_values = {k: _state.encode_value(k, v) for k, v in (global_state or {}).items()}
        meta = dict(metadata or {})
        for key in _state.RESERVED_METADATA:
            if key in meta:
                raise _native.InvalidError(f"metadata key {key!r} is reserved for ckpt.torch")
        if self.rank == 0:
            # The manifest keeps rank 0's metadata: where each name sits in the state
            # dict, for DCP's planners (dcp.load into an empty dict, partial loads).
            meta[_state.PATHS_KEY] = part.paths
        metadata_json = json.dumps(meta)
        prepared = time.perf_counter()
        native = self._native.save(
            step,
            part.tensors,
            part.values,
            global_values,
            metadata_json,
            overlapped,
            metrics,
            unhealthy,
        )
        registered = time.perf_counter()
        if not overlapped and any(t.device.type != "cpu" for t in part.keep_alive):
            # Device tensors are copied by the device: done once their event is.
            native.wait_staged()
        profile = {
            "prepare_s": prepared - started,
            "library_s": registered - prepared,
            "library_stall_s": native.stall,
            "plan_reused": part.reused,
        }
        return SaveHandle(
            native,
            part.keep_alive if overlapped else None,
            part.copied,
            profile,
            self.url,
            self.store_options,
            warn_unhealthy=self.rank == 0,
        )

    def snapshot(
        self,
        step: int,
        state_dict: Mapping[str, Any],
        *,
        overlapped: bool = True,
        global_state: Mapping[str, Any] | None = None,
    ) -> SnapshotHandle:
        """Snapshots this rank's part of ``state_dict`` at ``step`` into host memory:
        staged exactly as :meth:`save` stages (the same overlapped copy, so the same
        stall), checksummed in the background, written to no store. ``ckpt.elastic``
        keeps it, replicates it to the ring successor and commits it in the control
        plane (``ctx.snapshot``); on its own it is this rank's copy in memory.

        Raises ``OverBudgetError`` when it does not fit ``host_memory_budget`` even
        after the oldest droppable copies are let go: the snapshot is not taken.
        With ``overlapped`` (the default) this returns before the tensors are
        copied: do not write them until ``wait_staged()`` returns. Host tensors
        only."""
        part = self._planner.prepare(state_dict, _state.encode_value)
        global_values = {k: _state.encode_value(k, v) for k, v in (global_state or {}).items()}
        meta: dict[str, Any] = {}
        if self.rank == 0:
            meta[_state.PATHS_KEY] = part.paths
        native = self._native.snapshot(
            step, part.tensors, part.values, global_values, json.dumps(meta), overlapped
        )
        return SnapshotHandle(native, part.keep_alive if overlapped else None)

    def host_bytes_held(self) -> dict[str, Any]:
        """Host memory held by this rank's checkpointing now, in bytes by kind:
        ``budget`` (None: unbounded), ``total``, ``peak`` (the most at once since the
        checkpointer was made), ``staging``, ``copies``, ``replicas``, ``snapshots``,
        ``snapshot_replicas``; and ``summary``, one line of it."""
        return self._native.host_bytes_held()

    def load(
        self,
        state_dict: Mapping[str, Any],
        *,
        step: int | None = None,
        healthy: bool = True,
        cooperative: bool = False,
        group: Any = None,
    ) -> ExtraState:
        """Loads checkpoint ``step`` (default: the newest committed one that is not
        unhealthy, agreed by every rank when ``torch.distributed`` is initialised)
        into ``state_dict`` in place; with ``cooperative=True`` every rank of
        ``group`` loads together, each byte read from the store once; see
        :func:`load`."""
        return load(
            self.url,
            state_dict,
            step=step,
            rank=self.rank,
            store_options=self.store_options,
            healthy=healthy,
            cooperative=cooperative,
            group=group,
        )

    def close(self) -> None:
        """Waits for every save's background work (commit, retention), then refuses
        further saves. Call it before the process exits."""
        self._native.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


REPLICA_POLICIES = ("warn", "fail", "off")


def _metrics(health: Mapping[str, Any] | None) -> dict[str, float]:
    """A save's ``health=`` metrics as floats (a one-element tensor by ``.item()``)."""
    out: dict[str, float] = {}
    for name, value in (health or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"health metric names are strings, not {type(name).__name__}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"health metric {name!r} is a tensor of {value.numel()} elements, not a scalar"
                )
            value = value.detach().item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise TypeError(
                    f"health metric {name!r} must be a number, not {type(value).__name__}"
                ) from None
        out[name] = float(value)
    return out


def _judge(
    check: Callable[[dict[str, float]], bool | str | None] | None, metrics: dict[str, float]
) -> list[str]:
    """The reasons the caller's ``health_check`` finds the state unhealthy: none when
    it returns True or None, its text when it returns a string, a line naming the
    metrics when it returns False."""
    if check is None:
        return []
    verdict = check(dict(metrics))
    if verdict is None or verdict is True:
        return []
    if verdict is False:
        shown = ", ".join(f"{k}={v!r}" for k, v in metrics.items()) or "no metrics"
        return [f"health_check failed ({shown})"]
    if isinstance(verdict, str):
        return [verdict or "health_check failed"]
    raise TypeError(
        f"health_check returned a {type(verdict).__name__}; it returns True or None "
        "(healthy), False or a reason (unhealthy)"
    )


def _skipped(native: list[tuple[int, str, list[str]]]) -> list[dict[str, Any]]:
    return [{"step": step, "dir": d, "reasons": list(reasons)} for step, d, reasons in native]


def _warn_skipped(url: str, skipped: list[dict[str, Any]], chosen: int) -> None:
    for entry in skipped:
        warnings.warn(
            f"ckpt: passing over unhealthy checkpoint step {entry['step']} in {url} "
            f"({'; '.join(entry['reasons']) or 'no reason recorded'}); loading step {chosen}",
            UnhealthySkippedWarning,
            stacklevel=3,
        )


def _not_found(message: str) -> _native.NotFoundError:
    """A ``NotFoundError`` with the attributes the library's errors carry."""
    error = _native.NotFoundError(message)
    error.kind, error.transient = "not_found", False
    return error


class UnhealthySkippedWarning(UserWarning):
    """A load without a step passed over a checkpoint judged unhealthy."""


class UnhealthyCheckpointWarning(UserWarning):
    """A save committed a checkpoint judged unhealthy (rank 0 says so at
    ``wait_committed``)."""


def _agreed_step(
    url: str, step: int | None, store_options: StoreOptions | None, healthy: bool
) -> tuple[int | None, list[dict[str, Any]]]:
    """Every rank of an initialised process group loads the same step: rank 0
    chooses the newest commit (the newest not judged unhealthy, with ``healthy``)
    and broadcasts it with the unhealthy ones it passed over."""
    import torch.distributed as dist

    if step is not None or not (dist.is_available() and dist.is_initialized()):
        return step, []
    if dist.get_world_size() == 1:
        return step, []
    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            newest = _native.latest(url, store_options, healthy)
            if newest is not None:
                choice[0] = ("ok", (newest["step"], _skipped(newest["skipped"])))
            elif healthy and _native.latest(url, store_options) is not None:
                choice[0] = (
                    "none",
                    f"no committed healthy checkpoint in {url} (every one is unhealthy)",
                )
            else:
                choice[0] = ("none", f"no committed checkpoint in {url}")
        except _native.CkptError as e:
            choice[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(choice, src=0)
    status, value = choice[0]
    if status == "error":
        raise _native.CkptError(f"rank 0 could not choose the checkpoint to load: {value}")
    if status == "none":
        raise _not_found(value)
    return value


def load(
    url: str | os.PathLike,
    state_dict: Mapping[str, Any],
    *,
    step: int | None = None,
    rank: int | None = None,
    copies: Any = None,
    store_options: StoreOptions | None = None,
    healthy: bool = True,
    cooperative: bool = False,
    group: Any = None,
) -> ExtraState:
    """Loads checkpoint ``step`` under ``url`` (default: the newest committed one
    that is not judged unhealthy) into ``state_dict`` in place, resharded from
    whatever world saved it.

    Without a ``step`` and with ``healthy`` (the default), checkpoints judged
    unhealthy (a NaN, replicas that disagreed, a failed ``health_check``) are
    passed over: each one is a ``UnhealthySkippedWarning`` (``warnings.warn``) and
    an entry of ``ExtraState.skipped``; a checkpoint of unknown health (written
    before health was recorded) is taken. ``healthy=False`` loads the newest
    whatever its health; an explicit ``step`` is loaded whatever its health.

    Every tensor and DTensor of ``state_dict`` receives its box (this rank's shard
    of a DTensor, the whole of a plain tensor), read and verified block by block;
    the dtype and global shape must match the checkpoint's. Non-tensor leaves get
    the values saved by the rank with this rank's number, when there was one. The
    returned :class:`ExtraState` has every saved rank's non-tensor state.

    A corrupt block raises ``CorruptionError`` naming the object and offset; the
    tensors are then partly written and must be loaded again before use.
    ``store_options``: the store's settings, as for :class:`Checkpointer`.

    With ``cooperative=True`` and an initialised process group (``group``, default
    the world) of more than one rank, every rank of the group must call ``load``
    together: the job lists and reads the metadata once (rank 0), every byte it
    needs is read from the store by one rank, and the ranks send each other the rest
    over the group, each block checked against the save's CRC32 by the rank that
    receives it (one that fails is read from the store instead). A peer that dies
    during the exchange raises ``PeerLostError`` naming it. Without a process
    group the load is the plain one.

    ``ExtraState.stats`` counts the load: ``bytes_read_from_store`` (this rank's
    data bytes, as stored), ``bytes_received_from_peers``, ``store_requests``
    (``{"LIST", "GET", "HEAD"}`` this rank sent, the opening included),
    ``unique_bytes`` (the stored bytes the whole job needed, counted once; without
    cooperation, this rank's own), ``peer_blocks_rejected`` and the byte counters.
    """
    url = _url(url)
    rank, _ = _world(rank, None)
    together = _cooperative.group_world(group) if cooperative and copies is None else None
    if together is not None:
        return _load_cooperatively(
            url, state_dict, step, store_options, healthy, group, rank, together
        )
    agreed, skipped = _agreed_step(url, step, store_options, healthy)
    try:
        reader = _native.Reader(url, agreed, store_options, healthy and agreed is None)
    except _native.NotFoundError:
        if agreed is None and healthy and _native.latest(url, store_options) is None:
            # Nothing committed at all: say so, not "no healthy one".
            raise _not_found(f"no committed checkpoint in {url}") from None
        raise
    if agreed is None:
        skipped = _skipped(reader.skipped)
    _warn_skipped(url, skipped, reader.step)
    wants, fixups, keep_alive = _wants(state_dict, rank, host_only=False)
    if copies is None:
        stats = reader.load_into(wants)
    else:
        # (holder, table of every rank's holding): ckpt.elastic's in-memory copies.
        holder, table = copies
        stats = reader.load_into(wants, holder, table, rank)
    _apply_fixups(fixups, stats)
    del keep_alive
    return _extra_state(reader, state_dict, rank, stats, skipped)


def load_reader(
    reader: _native.Reader,
    state_dict: Mapping[str, Any],
    rank: int,
    copies: tuple[Any, list[bytes]] | None = None,
) -> ExtraState:
    """Loads what ``reader`` opened (a snapshot shared by ``ckpt.elastic``:
    ``Reader.from_snapshot``) into ``state_dict`` in place, as :func:`load` does,
    with ``copies`` ``(holder, table of holdings)`` the in-memory copies its files
    are read from."""
    wants, fixups, keep_alive = _wants(state_dict, rank, host_only=False)
    if copies is None:
        stats = reader.load_into(wants)
    else:
        holder, table = copies
        stats = reader.load_into(wants, holder, table, rank)
    _apply_fixups(fixups, stats)
    del keep_alive
    return _extra_state(reader, state_dict, rank, stats, [])


def _wants(
    state_dict: Mapping[str, Any], rank: int, host_only: bool
) -> tuple[list[tuple], list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """The library's wants for every tensor box of ``state_dict`` this rank holds:
    its own memory where that is contiguous (and, with ``host_only``, on the CPU),
    else a temporary to copy from afterwards (the fixups)."""
    wants, fixups, keep_alive = [], [], []
    for leaf in _state.leaves(state_dict):
        if not isinstance(leaf.value, torch.Tensor):
            continue
        for b in _state.boxes(leaf.fqn, leaf.value, rank):
            if b.local.numel() == 0:
                continue
            into = b.local
            on_host = into.device.type == "cpu"
            if not into.is_contiguous() or (host_only and not on_host):
                into = torch.empty(
                    b.lengths,
                    dtype=b.local.dtype,
                    device="cpu" if host_only else b.local.device,
                    pin_memory=host_only and not on_host and torch.cuda.is_available(),
                )
                fixups.append((b.local, into))
            keep_alive.append(into)
            wants.append(b.for_load(into))
    return wants, fixups, keep_alive


def _apply_fixups(fixups: list[tuple[torch.Tensor, torch.Tensor]], stats: dict[str, Any]) -> None:
    with torch.no_grad():
        for dest, loaded in fixups:
            dest.copy_(loaded)
            stats["bytes_copied"] += loaded.numel() * loaded.element_size()


def _load_cooperatively(
    url: str,
    state_dict: Mapping[str, Any],
    step: int | None,
    store_options: StoreOptions | None,
    healthy: bool,
    group: Any,
    rank: int,
    together: tuple[int, int],
) -> ExtraState:
    """:func:`load` with ``cooperative=True`` over ``group`` (``rank``: this
    process's global rank, which places its boxes; ``together``: its rank in the
    group and the group's size): see there."""
    member, world = together
    reader = _cooperative.open_shared(url, step, store_options, healthy, group, member)
    skipped = _skipped(reader.skipped) if step is None else []
    _warn_skipped(url, skipped, reader.step)
    wants, fixups, keep_alive = _wants(state_dict, rank, host_only=True)
    stats = _cooperative.load(reader, wants, group, member, world)
    _apply_fixups(fixups, stats)
    del keep_alive
    return _extra_state(reader, state_dict, rank, stats, skipped)


def _extra_state(
    reader: _native.Reader,
    state_dict: Mapping[str, Any],
    rank: int,
    stats: dict[str, Any],
    skipped: list[dict[str, Any]],
) -> ExtraState:
    """The non-tensor state of ``reader``'s checkpoint put into ``state_dict`` (this
    rank's values), and everything a load returns."""
    metadata = json.loads(reader.metadata)
    decode = _decoder(metadata)
    for key in _state.RESERVED_METADATA:
        metadata.pop(key, None)
    ranks: list[dict[str, Any]] = []
    for saved_rank, values in reader.rank_states():
        while len(ranks) < saved_rank:
            ranks.append({})
        ranks.append({k: decode(kind, v) for k, (kind, v) in values.items()})
    mine = ranks[rank] if rank < len(ranks) else {}
    for leaf in _state.leaves(state_dict):
        if not isinstance(leaf.value, torch.Tensor) and leaf.fqn in mine:
            leaf.container[leaf.key] = mine[leaf.fqn]
    global_state = {k: decode(kind, v) for k, (kind, v) in reader.global_state().items()}
    return ExtraState(
        step=reader.step,
        world_size=reader.world_size,
        generation=reader.generation,
        ranks=ranks,
        mine=mine,
        global_state=global_state,
        metadata=metadata,
        stats=stats,
        skipped=skipped,
        healthy=_health_dict(reader.health)["healthy"],
    )


def latest(
    url: str | os.PathLike,
    *,
    healthy: bool = True,
    store_options: StoreOptions | None = None,
) -> dict[str, Any] | None:
    """The newest committed checkpoint under ``url`` that is not judged unhealthy
    (healthy, or of unknown health: written before health was recorded), or with
    ``healthy=False`` the newest whatever its health; None when there is none.

    A dict: ``step``, ``generation``, ``world_size``, ``tensors``,
    ``created_unix_ms``, ``healthy`` (True, False, or None when unknown),
    ``reasons`` (why it is unhealthy), and ``skipped``: the unhealthy commits passed
    over, newest first, as ``{"step", "dir", "reasons"}``."""
    found = _native.latest(_url(url), store_options, healthy)
    if found is not None:
        found["skipped"] = _skipped(found["skipped"])
    return found


def _metric(value: Any) -> float:
    # The manifest writes a metric that is not finite as "NaN", "inf" or "-inf".
    return float(value)


def _health_dict(text: str | None) -> dict[str, Any]:
    if text is None:
        return {
            "healthy": None,
            "reasons": [],
            "nonfinite": [],
            "replica_mismatches": [],
            "replicas_compared": 0,
            "metrics": {},
        }
    raw = json.loads(text)
    return {
        "healthy": bool(raw["healthy"]),
        "reasons": list(raw.get("reasons", [])),
        "nonfinite": list(raw.get("nonfinite", [])),
        "replica_mismatches": list(raw.get("replica_mismatches", [])),
        "replicas_compared": int(raw.get("replicas_compared", 0)),
        "metrics": {k: _metric(v) for k, v in raw.get("metrics", {}).items()},
    }


def health(
    url: str | os.PathLike,
    step: int | None = None,
    *,
    store_options: StoreOptions | None = None,
) -> dict[str, Any]:
    """The health recorded for checkpoint ``step`` under ``url`` (default: the
    newest commit, whatever its health), as the manifest has it:

    - ``healthy``: True, False, or None when unknown (written before health was
      recorded; loads and ``latest`` accept it);
    - ``reasons``: why it is unhealthy, one line each;
    - ``nonfinite``: ``{"tensor", "elements", "ranks"}`` per float tensor with NaN
      or infinite elements;
    - ``replica_mismatches``: ``{"tensor", "offsets", "lengths", "blocks",
      "written_by", "agree", "disagree"}`` per replicated box whose holders
      disagreed (``blocks``: the first differing ``block_size`` slices of the box,
      ``disagree``: the ranks whose copy differs from the one ``written_by`` wrote);
    - ``replicas_compared``: replicated boxes compared;
    - ``metrics``: the caller's ``health=`` metrics (floats; NaN and infinities kept);

    and ``step``."""
    reader = _native.Reader(_url(url), step, store_options)
    out = _health_dict(reader.health)
    out["step"] = reader.step
    return out


def list_checkpoints(
    url: str | os.PathLike,
    *,
    health: bool = False,
    store_options: StoreOptions | None = None,
) -> list[dict[str, Any]]:
    """Every checkpoint under ``url``, commits first in commit order (``step``,
    ``dir``, ``status``, ``committed``, ``generation``, ``ranks_present``, ``bytes``).

    With ``health`` (one manifest read per commit, as ``ckpt ls``), each entry also
    has ``healthy`` (True, False, or None when unknown or not a valid commit),
    ``reasons`` and ``resume`` (True for the checkpoint a load without a step takes).
    """
    url = _url(url)
    entries = _native.list(url, store_options)
    if health:
        listed = {e["dir"]: e for e in json.loads(_native.ls_json(url, store_options))}
        for entry in entries:
            found = listed.get(entry["dir"], {})
            entry["healthy"] = found.get("healthy")
            entry["reasons"] = found.get("health_reasons", [])
            entry["resume"] = bool(found.get("resume", False))
    return entries
