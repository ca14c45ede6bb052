"""ckpt as a storage plugin of ``torch.distributed.checkpoint`` (DCP).

::

    import torch.distributed.checkpoint as dcp
    from ckpt.torch.dcp import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter("s3://bucket/run1"))
    dcp.async_save(state_dict, storage_writer=StorageWriter("s3://bucket/run1"))
    dcp.load(state_dict, storage_reader=StorageReader("s3://bucket/run1"))

DCP plans (which rank writes which chunk, which chunk each rank reads); ckpt stores.
A save through the writer is an ordinary ckpt save: every rank writes its chunks as
one safetensors rank file with CRC32 block checksums and a manifest part, and the
checkpoint is committed by ckpt's fenced, atomic commit (create-if-absent on every
store, S3 included: no rename). ``ckpt verify``, ``inspect`` and ``export`` work on
it, and the native API loads it. The other way round, the reader builds DCP's
``Metadata`` from ckpt's manifest, so a checkpoint saved natively loads through
``dcp.load``, resharded by DCP's planner and read by ckpt's verified reader.

The URL is the checkpoint root (many steps), as for the native API. Each save is a
new step: ``StorageWriter(url, step=N)`` (or setting ``writer.step``) names it;
otherwise it is the step after the newest commit. ``StorageReader(url, step=None)``
reads the newest commit unless told a step. A ``checkpoint_id`` given to
``dcp.save`` / ``dcp.load`` replaces the URL.

Non-tensor values are saved the way DCP saves them (``torch.save`` bytes, one rank
each), as ckpt rank state.

Replicas are compared as in the native API (``replica_mismatch=`` among the writer's
settings): DCP's planner keeps one copy of a tensor several ranks hold (a
``Replicate()`` placement, the replica dimension of an HSDP mesh, a plain tensor),
but the writer remembers each rank's own items from its local plan, before that
deduplication, and hands the ones another rank writes to ckpt as replicas it does
not write: ckpt checksums them and the commit compares every copy with the written
one. The reader loads the newest checkpoint not judged unhealthy unless told a step
(``healthy=False``: the newest whatever its health).

``dcp.async_save(sd, storage_writer=StorageWriter(url))`` with no ``async_stager``
stages through ckpt: the writer is an ``AsyncStager`` whose ``stage`` starts ckpt's
overlapped save (one copy of each rank's tensors into ckpt's staging buffer, on
ckpt's threads), and DCP's save thread then only plans and waits for the part to be
durable. Given an ``async_stager`` of DCP's, DCP copies the state first and the
writer saves that copy (two copies).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import inspect
import io
import json
import os
import secrets
import sys
import time
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _DcpReader
from torch.distributed.checkpoint.storage import StorageWriter as _DcpWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckpt import _native
from ckpt.torch import _cooperative, _state
from ckpt.torch._api import (
    DCP_MARK,
    StoreOptions,
    _judge,
    _metrics,
    _skipped,
    _url,
    _warn_skipped,
)

_SCHEMES = ("file://", "memory://", "s3://", "gs://", "az://", "azure://", "abfs://")


def _dist_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclasses.dataclass(frozen=True)
class _SaveTarget:
    """What the coordinator decides for one save and every rank's plan carries."""

    step: int
    run_id: str
    world_size: int
    # The planners' `planner_data` (DCP's Metadata.planner_data), in rank 0's plan
    # only: rank 0's part carries the manifest's metadata.
    planner_data: Any = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class _StagedSave:
    """A save `stage` started, until `write_data` waits for it: its profile (see
    ``StorageWriter.profile``) and when its copy ended and its part became durable."""

    target: _SaveTarget
    handle: _native.SaveHandle
    profile: dict[str, Any]
    marks: dict[str, float] = dataclasses.field(default_factory=dict)


class StorageWriter(_DcpWriter):
    """DCP's ``StorageWriter`` over a ckpt checkpoint root.

    ``config`` keywords are the native ``Checkpointer``'s settings (``generation``,
    ``run_id``, ``codec``, ``keep_last``, ``block_size``, ``replica_mismatch``, …);
    ``store_options`` the store's, as ``ckpt.torch.Checkpointer`` takes them.

    ``health`` (also settable as ``writer.health`` before each save: ``dcp.save``
    takes no metrics) are the metrics each save records, as
    ``Checkpointer.save(health=...)`` takes them, and ``health_check`` judges them, as
    ``Checkpointer(health_check=...)`` does.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        step: int | None = None,
        store_options: StoreOptions | None = None,
        health: dict[str, Any] | None = None,
        health_check: Any = None,
        compare_plain_tensors: bool = False,
        **config: Any,
    ):
        super().__init__()
        if health_check is not None and not callable(health_check):
            raise TypeError(f"health_check must be callable, not {type(health_check).__name__}")
        self.health = health
        self.health_check = health_check
        # Plain tensors (DCP's TENSOR items) another rank writes are compared only
        # when asked: they may differ between ranks on purpose (BatchNorm under DDP).
        self.compare_plain_tensors = compare_plain_tensors
        self.url = _url(url)
        self.step = step
        self.store_options = store_options
        self._config = config
        self._rank = 0
        self._is_coordinator = True
        self._checkpointer: _native.Checkpointer | None = None
        self._checkpointer_key: tuple | None = None
        self._handle: _native.SaveHandle | None = None
        # This rank's tensor items before DCP's planner dropped the replicas another
        # rank writes: those are still checksummed, to be compared at the commit.
        self._local_items: list = []
        self._run_id: str | None = None
        # Saves staged by `stage` (dcp.async_save) whose write_data has not run yet.
        self._staged: collections.deque[_StagedSave] = collections.deque()
        # What `stage` agreed with the other ranks once, (world size, run id), and the
        # step of its last save: later saves need no collective.
        self._agreed: tuple[int, str] | None = None
        self._last_step: int | None = None
        self._planner: _state.SavePlanner | None = None
        # The thread that completes each staging future (one, reused).
        self._stage_waiter: concurrent.futures.ThreadPoolExecutor | None = None
        # The staged save `write_data` waited for last, for `finish`'s figures.
        self._writing: _StagedSave | None = None
        self.profile: dict[str, Any] = {}
        """Where the last save staged through the writer spends its time, in seconds
        (each save fills its own dict as it goes; this is the newest's):
        its ``stage`` call as ``ckpt.torch.SaveHandle.profile`` says it, with
        ``agree_s`` (the agreement of the step and run id with the other ranks: a
        collective on a writer's first save only) and ``stage_s`` (the whole call);
        ``copy_s`` (from the call until ckpt's copy was seen done); then, as DCP's
        save thread goes on, ``dcp_plan_s`` (DCP's planning, between
        the end of staging and ``write_data``), ``wait_durable_s`` (``write_data``
        waiting for ckpt's write of this rank's part), and on the coordinator
        ``dcp_gather_s`` (DCP gathering the write results before ``finish``) and
        ``wait_committed_s`` (``finish`` waiting for ckpt's commit)."""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and _url(checkpoint_id) != self.url:
            self.url = _url(checkpoint_id)
            # Another root: its steps are agreed anew.
            self._agreed, self._last_step = None, None
        self._handle = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator
        self._rank = kwargs.get("rank", _dist_rank()[0])

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local_items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._staged:
            # dcp.async_save staged through `stage`, which fixed the target already.
            target = self._staged[0].target
        else:
            step = self.step
            if step is None:
                newest = _native.latest(self.url, self.store_options)
                step = newest["step"] + 1 if newest else 0
            target = _SaveTarget(step=step, run_id=self._own_run_id(), world_size=len(plans))
        first = dataclasses.replace(target, planner_data=_merged_planner_data(plans))
        return [
            dataclasses.replace(plan, storage_data=first if i == 0 else target)
            for i, plan in enumerate(plans)
        ]

    def _own_run_id(self) -> str:
        """This writer's run id, drawn once (on the coordinator, which hands it to
        every rank in the plan): every save through the writer reuses its
        checkpointer and so its staging buffers."""
        if self._run_id is None:
            self._run_id = (
                self._config.get("run_id") or os.environ.get("CKPT_RUN_ID") or secrets.token_hex(8)
            )
        return self._run_id

    def _native_checkpointer(self, target: _SaveTarget) -> _native.Checkpointer:
        # One checkpointer per (root, rank, world, run): its staging buffers are reused
        # by the next save through this writer.
        key = (self.url, self._rank, target.world_size, target.run_id)
        if self._checkpointer_key != key:
            config = dict(self._config, run_id=target.run_id)
            self._checkpointer = _native.Checkpointer(
                self.url, self._rank, target.world_size, config, self.store_options
            )
            self._checkpointer_key = key
        return self._checkpointer

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        target = plan.storage_data
        if not isinstance(target, _SaveTarget):
            raise _native.InvalidError(
                "the save plan carries no ckpt target: prepare_global_plan did not run"
            )
        if self._staged and self._staged[0].target == target:
            return self._write_staged(plan)
        tensors, rank_state, keep_alive, results = [], {}, [], []
        written = {item.index for item in plan.items}
        # The replicas DCP's planner gave another rank: checksummed, not written.
        replicas = []
        if self._config.get("replica_mismatch", "warn") != "off":
            replicas = [
                item
                for item in self._local_items
                if item.index not in written
                and (item.type == WriteItemType.SHARD or self.compare_plain_tensors)
            ]
        self._local_items = []
        for item in [*plan.items, *replicas]:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                payload = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                rank_state[item.index.fqn] = payload
                results.append(WriteResult(item.index, len(payload), None))
                continue
            write = item.index in written
            tensor = data.detach()
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            chunk = item.tensor_data.chunk
            keep_alive.append(tensor)
            nbytes = tensor.numel() * tensor.element_size()
            tensors.append(
                (
                    item.index.fqn,
                    _state.dtype_name(tensor.dtype, item.index.fqn),
                    [int(s) for s in item.tensor_data.size],
                    [int(o) for o in chunk.offsets],
                    [int(s) for s in chunk.sizes],
                    tensor.data_ptr(),
                    nbytes,
                    write,
                    *_state.device_of(tensor, item.index.fqn),
                )
            )
            if write:
                results.append(WriteResult(item.index, nbytes, None))
        checkpointer = self._native_checkpointer(target)
        metadata = _metadata(target.planner_data)
        metrics = _metrics(self.health)
        handle = checkpointer.save(
            target.step,
            tensors,
            rank_state,
            {},
            metadata,
            False,
            metrics,
            _judge(self.health_check, metrics),
        )
        # DCP gathers the results on the coordinator and then calls `finish`: once
        # every rank's part is durable the commit follows at once.
        handle.wait_durable()
        del keep_alive
        self._handle = handle
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_staged(self, plan: SavePlan) -> Future[list[WriteResult]]:
        """The write of a save that `stage` started: ckpt is already writing this
        rank's part (of the boxes ckpt's own rules give this rank, whatever rank
        DCP's planner picked for a replicated item); wait until it is durable."""
        save = self._staged.popleft()
        self._writing = save
        entered = time.perf_counter()
        if "staged" in save.marks:
            # DCP's planning between the end of staging and this call (its local
            # plans, their gathering, the global plan and its scatter).
            save.profile["dcp_plan_s"] = entered - save.marks["staged"]
        save.handle.wait_durable()
        save.marks["durable"] = time.perf_counter()
        save.profile["wait_durable_s"] = save.marks["durable"] - entered
        self._handle = save.handle
        results = [
            WriteResult(item.index, item.tensor_storage_size() or 0, None) for item in plan.items
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    # dcp.async_save takes a storage writer that is an AsyncStager as its stager (when
    # no other is given): the state dict is then staged by ckpt itself, the one copy
    # of the native API's overlapped save, instead of DCP's copy followed by ckpt's.
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> concurrent.futures.Future:
        """Starts ckpt's overlapped save of ``state_dict`` (every rank calls it, in
        dcp.async_save). The returned future completes once the tensors are copied;
        the write then runs in DCP's save thread (`write_data` waits for this save's
        part).

        The step and run id are agreed with the other ranks (rank 0 choosing) on
        the writer's first save only: later saves take the writer's ``step`` when it
        is set (every rank sets the same), else the step after the last one, so the
        training thread makes no collective and no store request per save."""
        started = time.perf_counter()
        rank, world = _dist_rank()
        target = self._stage_target(rank, world)
        agreed = time.perf_counter()
        self._rank = rank
        checkpointer = self._native_checkpointer(target)
        if self._planner is None or self._planner.rank != rank:
            self._planner = _state.SavePlanner(rank, self.compare_plain_tensors)
        part = self._planner.prepare(state_dict, _torch_saved)
        # Staged before DCP plans: the object paths are ckpt's flattening's, which
        # is DCP's own.
        metadata = _metadata(part.paths if rank == 0 else None)
        prepared = time.perf_counter()
        metrics = _metrics(self.health)
        handle = checkpointer.save(
            target.step,
            part.tensors,
            part.values,
            {},
            metadata,
            True,
            metrics,
            _judge(self.health_check, metrics),
        )
        registered = time.perf_counter()
        keep_alive = part.keep_alive
        save = _StagedSave(target, handle, {})
        self._staged.append(save)
        self._last_step = target.step

        def wait_staged() -> dict[str, Any]:
            try:
                handle.wait_staged()
                save.marks["staged"] = time.perf_counter()
                save.profile["copy_s"] = save.marks["staged"] - started
                return state_dict
            finally:
                keep_alive.clear()

        if self._stage_waiter is None:
            # Not a daemon: the interpreter waits for it at exit instead of ending it
            # inside the library's wait.
            self._stage_waiter = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="ckpt-staged-waiter"
            )
        save.profile.update(
            agree_s=agreed - started,
            prepare_s=prepared - agreed,
            library_s=registered - prepared,
            library_stall_s=handle.stall,
            plan_reused=part.reused,
        )
        self.profile = save.profile
        staged = self._stage_waiter.submit(wait_staged)
        save.profile["stage_s"] = time.perf_counter() - started
        return staged

    def _stage_target(self, rank: int, world: int) -> _SaveTarget:
        """The step and run id of the save `stage` starts (see `stage`)."""
        known = self.step if self.step is not None else self._last_step
        if self._agreed is not None and self._agreed[0] == world and known is not None:
            step = self.step if self.step is not None else known + 1
            return _SaveTarget(step=step, run_id=self._agreed[1], world_size=world)
        choice: list[Any] = [None]
        if rank == 0:
            step = self.step
            if step is None:
                newest = _native.latest(self.url, self.store_options)
                step = newest["step"] + 1 if newest else 0
                pending = [save.target.step for save in self._staged]
                step = max([step, *[p + 1 for p in pending]])
            choice[0] = (step, self._own_run_id())
        if world > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(choice, src=0)
        step, run_id = choice[0]
        self._run_id = run_id
        self._agreed = (world, run_id)
        return _SaveTarget(step=step, run_id=run_id, world_size=world)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        """Lets the thread that completes staging futures go (a later save starts
        another)."""
        if self._stage_waiter is not None:
            self._stage_waiter.shutdown(wait=True)
            self._stage_waiter = None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # The coordinator returns once the checkpoint is committed (ckpt's commit
        # runs on its own committer ranks, rank 0 first); DCP's metadata is not
        # stored: the reader rebuilds it from ckpt's manifest.
        entered = time.perf_counter()
        save = self._writing
        if save is not None and "durable" in save.marks:
            # DCP gathering every rank's write results and building its metadata.
            save.profile["dcp_gather_s"] = entered - save.marks["durable"]
        if self._handle is not None:
            self._handle.wait_committed()
        if save is not None:
            save.profile["wait_committed_s"] = time.perf_counter() - entered

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _looks_like_root(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url)


def _merged_planner_data(plans: list[SavePlan]) -> Any:
    """What DCP's default planner puts into ``Metadata.planner_data``: every rank's
    object paths, merged (a custom planner's data, when it is not such a mapping,
    is taken from the first plan that has some)."""
    datas = [plan.planner_data for plan in plans if plan.planner_data is not None]
    if not datas:
        return None
    if all(isinstance(d, dict) for d in datas):
        merged: dict = {}
        for data in reversed(datas):  # the lowest rank's entry wins, as in DCP's ChainMap
            merged.update(data)
        return merged
    return datas[0]


def _metadata(planner_data: Any) -> str:
    """The manifest metadata of a save through DCP: the mark, and DCP's
    ``planner_data`` (as object paths when it is the default planner's)."""
    metadata: dict[str, Any] = {DCP_MARK: True}
    if planner_data is None:
        pass
    elif _state.is_paths(planner_data):
        metadata[_state.PATHS_KEY] = planner_data
    else:
        try:
            metadata[_state.PLANNER_DATA_KEY] = _state.encode_json(planner_data, "planner_data")
        except _native.InvalidError as e:
            warnings.warn(
                f"ckpt: the DCP planner's planner_data is not stored ({e}); a load gets "
                "the object paths of ckpt's flattening instead",
                stacklevel=2,
            )
    return json.dumps(metadata)


def _torch_saved(fqn: str, value: Any) -> bytes:
    """A non-tensor value as DCP stores it: ``torch.save`` bytes."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _looks_like_root(checkpoint_id: str | os.PathLike) -> bool:
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str):
        return False
    return text.startswith(_SCHEMES) or "://" not in text


def _planner_data(metadata: dict[str, Any], state: dict[str, Any]) -> Any:
    """DCP's ``planner_data`` of a checkpoint: what the saving planner had, else the
    object path of every name (recorded at save; a name saved without one, by
    another writer or on a rank other than 0, sits at the top level)."""
    if _state.PLANNER_DATA_KEY in metadata:
        return _state.decode_json(metadata[_state.PLANNER_DATA_KEY])
    paths = _state.paths_from_metadata(metadata) or {}
    return {name: paths.get(name, (name,)) for name in state}


def _dcp_group() -> tuple[Any, int, int] | None:
    """(process group, rank in it, its size) of the ``dcp.load`` that is calling
    the reader, when it runs with collectives over more than one rank; None
    otherwise (``no_dist=True``, one rank, or a caller other than ``dcp.load``).
    DCP passes storage readers no group, so this looks for its ``_DistWrapper`` in
    the calling frames."""
    frame = inspect.currentframe()
    try:
        for _ in range(8):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            wrapper = frame.f_locals.get("distW")
            if wrapper is not None and hasattr(wrapper, "use_dist"):
                if not wrapper.use_dist:
                    return None
                group = wrapper.group
                together = _cooperative.group_world(group)
                return None if together is None else (group, *together)
        return None
    finally:
        del frame


class StorageReader(_DcpReader):
    """DCP's ``StorageReader`` over a ckpt checkpoint root: the newest commit not
    judged unhealthy (with ``healthy=False`` the newest whatever its health), or
    ``step`` whatever its health; ``store_options`` are the store's settings, as
    ``ckpt.torch.Checkpointer`` takes them. Each unhealthy commit passed over is an
    ``UnhealthySkippedWarning`` and an entry of ``skipped``.

    Under ``dcp.load`` with a process group of more than one rank (its
    ``process_group``, default the world) the load is cooperative, as
    ``ckpt.torch.load(..., cooperative=True)``: rank 0 alone lists and reads the
    metadata, every byte is read from the store by one rank and sent to the others
    over the group, verified by whoever receives it. ``cooperative=False`` makes
    every rank read for itself. The reader learns the group from ``dcp.load``'s
    own frame (DCP does not hand it to storage readers); called any other way, or
    with ``no_dist=True``, it loads on its own. A peer that dies during the
    exchange is named on stderr and in ``error`` (``dcp.load`` raises its own
    collective's failure after it). ``stats`` also holds
    ``bytes_read_from_store``, ``bytes_received_from_peers``, ``store_requests``
    and ``unique_bytes`` (the whole job's)."""

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        step: int | None = None,
        store_options: StoreOptions | None = None,
        healthy: bool = True,
        cooperative: bool = True,
    ):
        super().__init__()
        self.url = _url(url)
        self.step = step
        self.store_options = store_options
        self.healthy = healthy
        self.cooperative = cooperative
        self.error: Exception | None = None
        """The ``PeerLostError`` of a cooperative load whose peer died (``dcp.load``
        itself then raises its own collective's failure)."""
        # (group, rank in it, its size) while a cooperative dcp.load runs.
        self._together: tuple[Any, int, int] | None = None
        self.skipped: list[dict[str, Any]] = []
        self._reader: _native.Reader | None = None
        self._rank = 0
        self._values: dict[str, tuple[str, Any]] = {}
        self._dcp_written = False
        self._meta_cache: dict[str, tuple[torch.dtype, list[int]]] = {}
        self.stats: dict[str, int] = {}
        self.profile: dict[str, float] = {}
        """Where the last ``read_data`` call's time went, in seconds: ``read_data_s``
        (the whole call: the plan's items turned into the library's request, the
        library's read, the copies of converted destinations, DCP's commits of the
        tensors) and ``library_s`` (the library's read alone). What ``dcp.load``
        takes besides is DCP's own: reading the metadata, planning, collectives."""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = _url(checkpoint_id)
        self._reader = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._together = _dcp_group() if self.cooperative else None
        if self._together is not None:
            # Every rank of dcp.load's group is here: rank 0 opens for all.
            group, member, _ = self._together
            reader = _cooperative.open_shared(
                self.url, self.step, self.store_options, self.healthy, group, member
            )
            return self._open(self.step, reader)
        # No collective here (DCP may load without one): each rank opens the newest
        # commit, and the coordinator's choice travels in the plans (read_data
        # reopens at it should a commit have landed in between).
        return self._open(self.step)

    def _open(self, step: int | None, reader: _native.Reader | None = None) -> Metadata:
        """Opens checkpoint ``step`` (or the newest healthy one), unless ``reader``
        is given open, and returns DCP's view of it."""
        if reader is None:
            reader = _native.Reader(
                self.url, step, self.store_options, self.healthy and step is None
            )
        self._reader = reader
        if step is None:
            self.skipped = _skipped(reader.skipped)
            _warn_skipped(self.url, self.skipped, reader.step)
        metadata = json.loads(reader.metadata)
        self._dcp_written = bool(metadata.get(DCP_MARK))
        state: dict[str, Any] = {}
        self._meta_cache = {}
        for name, dtype, shape, chunks in reader.tensors():
            self._meta_cache[name] = (_state.torch_dtype(dtype), [int(s) for s in shape])
            state[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_state.torch_dtype(dtype)),
                size=torch.Size(shape),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                    for _, o, s in chunks
                ],
            )
        rank, _ = _dist_rank()
        self._values = {}
        # A value per name: this rank's own where the saving world had this rank,
        # else the lowest saved rank's (DCP writes each value from one rank).
        for saved_rank, values in reader.rank_states():
            for key, value in values.items():
                if key not in self._values or saved_rank == rank:
                    self._values[key] = value
        for key in self._values:
            state.setdefault(key, BytesStorageMetadata())
        return Metadata(
            state_dict_metadata=state,
            planner_data=_planner_data(metadata, state),
            storage_meta=StorageMeta(checkpoint_id=self.url),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        self._rank = kwargs.get("rank", _dist_rank()[0])

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        step = self._reader.step if self._reader is not None else None
        return [dataclasses.replace(plan, storage_data=step) for plan in plans]

    def _value_bytes(self, fqn: str) -> bytes:
        kind, payload = self._values[fqn]
        if kind == "bytes" and self._dcp_written:
            return payload  # DCP's own torch.save bytes
        return _torch_saved(fqn, _state.decode_value(kind, payload))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._reader is None:
            raise _native.InvalidError("read_data before read_metadata")
        started = time.perf_counter()
        if isinstance(plan.storage_data, int) and plan.storage_data != self._reader.step:
            self._open(plan.storage_data)
        wants, pending, keep_alive = [], [], []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(self._value_bytes(item.storage_index.fqn)))
                continue
            target = planner.resolve_tensor(item).detach()
            meta = self._tensor_meta(item.storage_index)
            offsets = [
                int(c) + int(o)
                for c, o in zip(item.storage_index.offset or (), item.storage_offsets, strict=True)
            ]
            lengths = [int(n) for n in item.lengths]
            # A cooperative load writes host memory: a GPU target is staged.
            host = self._together is not None
            direct = (
                target.is_contiguous()
                and target.dtype == meta[0]
                and not (host and target.device.type != "cpu")
            )
            into = (
                target
                if direct
                else torch.empty(lengths, dtype=meta[0], device="cpu" if host else target.device)
            )
            keep_alive.append(into)
            wants.append(
                (
                    item.storage_index.fqn,
                    _state.dtype_name(meta[0], item.storage_index.fqn),
                    meta[1],
                    offsets,
                    lengths,
                    into.data_ptr(),
                    into.numel() * into.element_size(),
                    *_state.device_of(into, item.storage_index.fqn),
                )
            )
            pending.append((item, target, into, direct))
        reading = time.perf_counter()
        if self._together is not None:
            group, member, world = self._together
            try:
                self.stats = _cooperative.load(self._reader, wants, group, member, world)
            except _cooperative.PeerLostError as e:
                # dcp.load catches this and then fails in its own collective over
                # the broken group, with the transport's words: say who died here.
                self.error = e
                print(f"ckpt.torch.dcp.StorageReader: {e}", file=sys.stderr, flush=True)
                raise
        else:
            self.stats = self._reader.load_into(wants) if wants else {}
        read = time.perf_counter()
        for item, target, into, direct in pending:
            if not direct:
                with torch.no_grad():
                    target.copy_(into)
                self.stats["bytes_copied"] = self.stats.get("bytes_copied", 0) + (
                    into.numel() * into.element_size()
                )
            planner.commit_tensor(item, target)
        del keep_alive
        self.profile = {"read_data_s": time.perf_counter() - started, "library_s": read - reading}
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _tensor_meta(self, index: MetadataIndex) -> tuple[torch.dtype, list[int]]:
        return self._meta_cache[index.fqn]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _looks_like_root(checkpoint_id)
