"""How a torch state dict maps onto ckpt's boxes of global tensors.

A state dict is flattened the way DCP flattens it (keys joined by ``.``, lists that
hold tensors or mappings entered by index, tuples and other lists kept whole), so
that a tensor has the same name whether it was saved natively or through DCP, and a
checkpoint written one way loads the other way.

Each tensor leaf becomes one box of a global tensor:

- a ``DTensor`` with ``Shard(d)`` / ``Replicate()`` placements on any mesh: its
  local tensor is the box DTensor's own sharding rule gives this rank; of the ranks
  holding the same replicated box, the one at coordinate 0 of every replicated mesh
  dimension writes it;
- a plain tensor: the whole tensor, taken to be the same on every rank (as DCP takes
  it), written by rank 0. The other ranks' copies are compared with it only when
  asked (``compare_plain_tensors``): a plain tensor may differ between ranks on
  purpose (BatchNorm's running statistics under DDP, updated by each rank's own
  batch until the next forward broadcasts rank 0's), where a ``Replicate()``
  placement or an HSDP replica dimension says the copies are the same.

The box's memory is passed to the library by address: a contiguous CPU tensor is
read (save) or written (load) where it lies. A non-contiguous one costs a copy,
which is counted.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckpt._native import InvalidError

# torch dtype -> safetensors name (every one ckpt's format has).
_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
}
if hasattr(torch, "float8_e8m0fnu"):
    _DTYPES[torch.float8_e8m0fnu] = "F8_E8M0"
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, fqn: str) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in _DTYPES))
        raise InvalidError(
            f"tensor {fqn!r} has dtype {dtype}, which ckpt's format cannot hold ({names})"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise InvalidError(f"dtype {name} has no torch equivalent here") from None


def _is_terminal(value: Any) -> bool:
    """DCP's rule: a mapping is entered, a list is entered only when it holds a
    tensor or something that is entered, anything else is a leaf."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, torch.Tensor):
            return False
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
            return False
    return True


@dataclass
class Leaf:
    """One leaf of a state dict: its flattened name, value, and where it sits (so a
    load can replace a non-tensor value in place)."""

    fqn: str
    value: Any
    container: Any
    key: Any
    path: tuple  # the keys and indices that lead to it (DCP's "object path")


def leaves(state_dict: Mapping[str, Any]) -> Iterator[Leaf]:
    """The leaves of ``state_dict`` in order, named as DCP names them."""

    def visit(path: tuple, container: Any, key: Any, value: Any) -> Iterator[Leaf]:
        if isinstance(value, Mapping):
            for k, v in value.items():
                yield from visit(path + (str(k),), value, k, v)
        elif _is_terminal(value):
            yield Leaf(".".join(map(str, path)), value, container, key, path)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from visit(path + (i,), value, i, v)

    seen: set[str] = set()
    for key, value in state_dict.items():
        for leaf in visit((str(key),), state_dict, key, value):
            if leaf.fqn in seen:
                raise InvalidError(f"two entries of the state dict flatten to {leaf.fqn!r}")
            seen.add(leaf.fqn)
            yield leaf


@dataclass
class Box:
    """This rank's box of one global tensor, over memory ckpt can address."""

    fqn: str
    dtype: str
    shape: list[int]
    offsets: list[int]
    lengths: list[int]
    local: torch.Tensor  # the box's data, row-major over `lengths`
    write: bool
    # A plain tensor, taken to be the same on every rank rather than declared so.
    assumed: bool = False

    def for_save(self) -> tuple:
        """The box for the native save: where it sits, its memory, and whether this
        rank writes it."""
        *where, device, stream = self.for_load(self.local)
        return (*where, self.write, device, stream)

    def for_load(self, into: torch.Tensor) -> tuple:
        """The box for the native load, landing in ``into`` (contiguous)."""
        return (
            self.fqn,
            self.dtype,
            self.shape,
            self.offsets,
            self.lengths,
            into.data_ptr(),
            into.numel() * into.element_size(),
            *device_of(into, self.fqn),
        )


def device_of(t: torch.Tensor, fqn: str) -> tuple[int, int]:
    """Where a tensor's memory lies, for the native layer: ``(-1, 0)`` for host
    memory, ``(ordinal, stream)`` on a CUDA device, the stream being torch's current
    one there (a save's device copy waits for the work queued on it; a load's copies
    are queued after it)."""
    if t.device.type == "cpu":
        return -1, 0
    if t.device.type == "cuda":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return index, torch.cuda.current_stream(t.device).cuda_stream
    raise InvalidError(f"tensor {fqn!r} is on {t.device}; ckpt saves CPU and CUDA tensors")


def _dtensor_types():
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # a torch without DTensor
        return None
    return DTensor, Replicate, Shard, compute_local_shape_and_global_offset


_DT = _dtensor_types()


def is_dtensor(value: Any) -> bool:
    return _DT is not None and isinstance(value, _DT[0])


# Coordinates found, by (id(mesh), rank), each with its mesh (held, so that its id
# is not reused while the entry stands). Finding one is costly (torch 2.15 computes
# `mesh.mesh` from the mesh's layout: about 0.3 ms, per tensor of a save), and a
# mesh's ranks never change. Keyed by identity: meshes compare equal whatever rank
# built them (see `_coordinate`).
_COORDINATES: dict[tuple[int, int], tuple[Any, tuple[int, ...] | None]] = {}
_MAX_COORDINATES = 256


def _coordinate(mesh: Any) -> tuple[int, ...] | None:
    """This process's coordinate on ``mesh``, from its rank in the default group now.

    Not ``mesh.get_coordinate()``: a DeviceMesh keeps the coordinate of the rank that
    built it, and meshes compare equal whatever rank built them, so torch's sharding
    caches (keyed by specs that hold meshes) can hand a DTensor a mesh built in an
    earlier process group of the same process, where it had another rank (ckpt.elastic
    runs several, one per generation). A save with it claimed another rank's box."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return mesh.get_coordinate()
    rank = dist.get_rank()
    key = (id(mesh), rank)
    known = _COORDINATES.get(key)
    if known is not None and known[0] is mesh:
        return known[1]
    found = (mesh.mesh == rank).nonzero()
    coordinate = None if found.numel() == 0 else tuple(int(c) for c in found[0].tolist())
    if len(_COORDINATES) >= _MAX_COORDINATES:
        _COORDINATES.clear()
    _COORDINATES[key] = (mesh, coordinate)
    return coordinate


def _local_box(
    shape: list[int], mesh_shape: list[int], coordinate: tuple[int, ...], placements: Any
) -> tuple[list[int], list[int]]:
    """The local shape and global offsets of the shard at ``coordinate``: each
    ``Shard(d)`` placement splits dimension ``d`` of what is left of it as
    ``torch.chunk`` does (chunks of the rounded-up size, the last ones shorter or
    empty), in mesh-dimension order; ``Replicate()`` keeps it."""
    _, _, shard, _ = _DT
    offsets = [0] * len(shape)
    for i, placement in enumerate(placements):
        if not isinstance(placement, shard):
            continue
        d, parts, at = placement.dim, mesh_shape[i], coordinate[i]
        chunk = -(-shape[d] // parts)
        start = min(at * chunk, shape[d])
        offsets[d] += start
        shape[d] = max(0, min(chunk, shape[d] - start))
    return shape, offsets


def box(fqn: str, value: torch.Tensor, rank: int) -> Box | None:
    """The box of tensor ``value`` this rank holds; None when it holds none (a
    DTensor on a mesh without this rank)."""
    if is_dtensor(value):
        _, replicate, shard, _ = _DT
        mesh, placements = value.device_mesh, value.placements
        for p in placements:
            # _StridedShard (FSDP2 over TP) subclasses Shard but is not a plain split.
            if not (type(p) is shard or isinstance(p, replicate)):
                raise InvalidError(
                    f"tensor {fqn!r} has placement {p}; ckpt saves Shard(d) and Replicate()"
                )
        coordinate = _coordinate(mesh)
        if coordinate is None:
            return None
        local = value._local_tensor
        shape, offsets = _local_box(list(value.shape), list(mesh.shape), coordinate, placements)
        if tuple(local.shape) != tuple(shape):
            raise InvalidError(
                f"tensor {fqn!r}: the local tensor has shape {tuple(local.shape)}, but its "
                f"placements {placements} give this rank a box of {tuple(shape)} (padded shards "
                "are not supported)"
            )
        write = all(
            coordinate[i] == 0 for i, p in enumerate(placements) if isinstance(p, replicate)
        )
        global_shape = list(value.shape)
    else:
        local = value
        global_shape = list(value.shape)
        offsets = [0] * len(global_shape)
        shape = global_shape
        write = rank == 0
    return Box(
        fqn=fqn,
        dtype=dtype_name(value.dtype, fqn),
        shape=[int(s) for s in global_shape],
        offsets=[int(o) for o in offsets],
        lengths=[int(s) for s in shape],
        local=local,
        write=write,
        assumed=not is_dtensor(value),
    )


def _sharded_tensor_type():
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # a torch without it
        return None
    return ShardedTensor


_SHARDED_TENSOR = _sharded_tensor_type()


def boxes(fqn: str, value: torch.Tensor, rank: int) -> list[Box]:
    """Every box of tensor ``value`` this rank holds: one for a tensor or DTensor
    (none for a DTensor on a mesh without this rank), one per local shard of a
    ``ShardedTensor`` (whose spec may give a rank several pieces; each is written by
    the rank holding it)."""
    if _SHARDED_TENSOR is not None and isinstance(value, _SHARDED_TENSOR):
        shape = [int(s) for s in value.size()]
        return [
            Box(
                fqn=fqn,
                dtype=dtype_name(value.dtype, fqn),
                shape=shape,
                offsets=[int(o) for o in shard.metadata.shard_offsets],
                lengths=[int(n) for n in shard.metadata.shard_sizes],
                local=shard.tensor,
                write=True,
            )
            for shard in value.local_shards()
        ]
    b = box(fqn, value, rank)
    return [] if b is None else [b]


@dataclass
class ToSave:
    """One rank's part of a state dict, as the native save takes it."""

    tensors: Any  # the boxes (`Box.for_save` tuples), or a `_native.SavePlan` of them
    values: dict[str, str | bytes]  # non-tensor leaves, encoded
    keep_alive: list[torch.Tensor]  # the memory the boxes point at
    copied: int  # bytes copied to make non-contiguous tensors contiguous
    paths: dict[str, tuple]  # flattened name -> object path, of every leaf
    reused: bool = False  # the plan of the previous save was handed over again


def _add_boxes(out: ToSave, fqn: str, value: torch.Tensor, rank: int, compare_plain: bool) -> None:
    for b in boxes(fqn, value, rank):
        if b.assumed and not b.write and not compare_plain:
            # Another rank writes it, and nothing says the copies must agree.
            continue
        if not b.local.is_contiguous():
            b.local = b.local.contiguous()
            out.copied += b.local.numel() * b.local.element_size()
        out.keep_alive.append(b.local)
        out.tensors.append(b.for_save())


def _memory_key(value: torch.Tensor) -> tuple | None:
    """What a tensor's boxes depend on besides its name and the rank: where its
    (local) memory lies and how it is laid out, its dtype, and for a DTensor its
    global shape, placements and mesh (by identity, held by the plan). None for a
    tensor whose boxes cannot be kept: one copied to be contiguous (a new copy per
    save), a ShardedTensor."""
    if _DT is not None and isinstance(value, _DT[0]):
        local = value._local_tensor
        if not local.is_contiguous():
            return None
        mesh = value.device_mesh
        return (
            local.data_ptr(),
            local.shape,
            local.dtype,
            local.device,
            value.shape,
            value.placements,
            id(mesh),
        )
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        # A ShardedTensor, or another subclass whose boxes are not its own memory.
        return None
    if not value.is_contiguous():
        return None
    return (value.data_ptr(), value.shape, value.dtype, value.device)


class SavePlanner:
    """One rank's save plan, kept between saves of a state that keeps its structure.

    Computing a save's boxes (the DTensor sharding rules, the dtype names, the
    tuples the native layer converts) costs about 0.1 ms a tensor in Python, far
    more than the library's own registration of the save, and a training loop saves
    the same tensors, at the same addresses, every time. So each save walks the
    state dict (its non-tensor values are encoded anew, they change), checks every
    tensor against the plan of the previous save (same name, memory address, layout,
    dtype, device; for a DTensor the same global shape, placements and mesh: about a
    microsecond each), and hands the library the previous ``_native.SavePlan`` when
    nothing changed. Any difference rebuilds the plan. A tensor that must be copied
    to be contiguous (a new copy each save) or a ShardedTensor keeps no plan.
    """

    def __init__(self, rank: int, compare_plain: bool = False):
        self.rank = rank
        # Hand the library the plain tensors another rank writes, to compare.
        self.compare_plain = compare_plain
        self._key: list | None = None
        self._plan: Any = None
        self._held: list = []  # the meshes named by id in the key

    def prepare(
        self, state_dict: Mapping[str, Any], encode: Callable[[str, Any], str | bytes]
    ) -> ToSave:
        """This rank's boxes of ``state_dict``'s tensors (the kept plan when they are
        unchanged), and its other leaves encoded by ``encode`` (JSON for the native
        API, ``torch.save`` bytes for DCP's)."""
        from ckpt import _native

        values: dict[str, str | bytes] = {}
        paths: dict[str, tuple] = {}
        tensors: list[tuple[str, torch.Tensor]] = []
        key: list | None = []
        cuda: set[torch.device] = set()
        for leaf in leaves(state_dict):
            paths[leaf.fqn] = leaf.path
            value = leaf.value
            if not isinstance(value, torch.Tensor):
                values[leaf.fqn] = encode(leaf.fqn, value)
                continue
            tensors.append((leaf.fqn, value))
            if key is not None:
                memory = _memory_key(value)
                if memory is None:
                    key = None
                    continue
                key.append((leaf.fqn, memory))
                if memory[3].type == "cuda":
                    cuda.add(memory[3])
        if key is not None:
            # A DTensor's box depends on this process's place in its mesh (ckpt.elastic
            # changes it between generations); a device box carries the stream whose
            # work its copy follows.
            key.append((_default_rank(), _streams(cuda)))
        if key is not None and key == self._key:
            keep_alive = [value for _, value in tensors]
            return ToSave(self._plan, values, keep_alive, 0, paths, reused=True)
        out = ToSave([], values, [], 0, paths)
        for fqn, value in tensors:
            _add_boxes(out, fqn, value, self.rank, self.compare_plain)
        if key is None:
            self._key, self._plan, self._held = None, None, []
            return out
        self._plan = _native.SavePlan(out.tensors)
        self._key = key
        self._held = [value.device_mesh for _, value in tensors if is_dtensor(value)]
        out.tensors = self._plan
        return out


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def _streams(devices: set[torch.device]) -> tuple:
    """The current stream of each of ``devices`` (CUDA devices)."""
    return tuple(
        sorted(
            (
                d.index if d.index is not None else torch.cuda.current_device(),
                torch.cuda.current_stream(d).cuda_stream,
            )
            for d in devices
        )
    )


# Non-tensor state is stored as JSON (readable by `ckpt inspect` and any JSON tool),
# but a load must give back exactly what was saved: a tuple stays a tuple, an integer
# key stays an integer, 2**70 and NaN survive. The library keeps JSON values as
# serde_json values, whose objects sort their keys and whose integers stop at 64
# bits; so a value JSON cannot carry unchanged is written as a tagged object
# `{"ckpt.type": T, ...}`, and everything else as plain JSON. A plain object whose
# keys include the tag is itself tagged, so no saved value reads back as a tag.
_TAG = "ckpt.type"
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def _unsupported(fqn: str, where: str, value: Any) -> InvalidError:
    kind = type(value)
    name = kind.__qualname__
    if kind.__module__ != "builtins":
        name = f"{kind.__module__}.{name}"
    at = f" at {where}" if where else ""
    return InvalidError(
        f"non-tensor state {fqn!r} holds a {name}{at}, which ckpt cannot give back exactly; "
        "it keeps None, bool, int, float, str, bytes, bytearray, list, tuple, dict (str or "
        "int keys), torch.Size, torch.dtype and torch.device: convert it to one of those, "
        "or save it as a tensor"
    )


def encode_json(value: Any, fqn: str, where: str = "") -> Any:
    """``value`` as the JSON value (a Python object of JSON types) that
    :func:`decode_json` turns back into an equal value of the same types; raises
    ``InvalidError`` naming ``fqn``, the place in ``value`` and the type of what it
    could not give back exactly."""
    return _encode_json(value, fqn, where)


def _encode_json(value: Any, fqn: str, where: str) -> Any:
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if _INT_MIN <= value <= _INT_MAX else {_TAG: "int", "value": str(value)}
    if kind is float:
        if math.isfinite(value):
            return value
        return {_TAG: "float", "value": repr(value)}
    if kind is list:
        return [_encode_json(v, fqn, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind is tuple:
        items = [_encode_json(v, fqn, f"{where}[{i}]") for i, v in enumerate(value)]
        return {_TAG: "tuple", "items": items}
    if kind is dict:
        keys = list(value)
        plain = all(type(k) is str for k in keys) and _TAG not in value and keys == sorted(keys)
        if plain:
            return {k: _encode_json(v, fqn, f"{where}[{k!r}]") for k, v in value.items()}
        items = []
        for k, v in value.items():
            if type(k) not in (str, int):
                raise _unsupported(fqn, f"{where} (a dict key)", k)
            items.append([_encode_json(k, fqn, where), _encode_json(v, fqn, f"{where}[{k!r}]")])
        return {_TAG: "dict", "items": items}
    if kind is bytes or kind is bytearray:
        return {_TAG: kind.__name__, "base64": base64.b64encode(value).decode("ascii")}
    if kind is torch.Size:
        return {_TAG: "torch.Size", "items": [int(d) for d in value]}
    if kind is torch.dtype:
        return {_TAG: "torch.dtype", "name": str(value).removeprefix("torch.")}
    if kind is torch.device:
        return {_TAG: "torch.device", "name": str(value)}
    raise _unsupported(fqn, where, value)


def decode_json(value: Any) -> Any:
    """The value :func:`encode_json` encoded."""
    return _decode_json(value)


def _decode_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode_json(v) for k, v in value.items()}
    if tag == "int":
        return int(value["value"])
    if tag == "float":
        return float(value["value"])
    if tag == "tuple":
        return tuple(_decode_json(v) for v in value["items"])
    if tag == "dict":
        return {_decode_json(k): _decode_json(v) for k, v in value["items"]}
    if tag == "bytes":
        return base64.b64decode(value["base64"])
    if tag == "bytearray":
        return bytearray(base64.b64decode(value["base64"]))
    if tag == "torch.Size":
        return torch.Size(value["items"])
    if tag == "torch.dtype":
        dtype = getattr(torch, value["name"], None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidError(f"saved dtype torch.{value['name']} does not exist in this torch")
        return dtype
    if tag == "torch.device":
        return torch.device(value["name"])
    raise InvalidError(f"non-tensor state holds a value of unknown type {tag!r} (a newer ckpt?)")


# Where a flattened name sits in the state dict's object graph ("model.net1.bias" is
# ("model", "net1.bias"), not ("model", "net1", "bias")): DCP's `planner_data`, which
# its planners use to rebuild a nested state dict from the flattened names. Kept in
# the manifest's metadata under this key, as `{name: [key or index, ...]}`, for every
# checkpoint ckpt.torch writes; other readers ignore it.
PATHS_KEY = "ckpt.torch.paths"
# A DCP planner's `planner_data` that is not such a mapping (a custom planner's),
# in the tagged JSON of the non-tensor values.
PLANNER_DATA_KEY = "ckpt.torch.planner_data"
RESERVED_METADATA = (PATHS_KEY, PLANNER_DATA_KEY)


def is_paths(data: Any) -> bool:
    """Whether ``data`` is a mapping of flattened names to object paths."""
    return isinstance(data, dict) and all(
        type(k) is str and type(p) is tuple and all(type(e) is str or type(e) is int for e in p)
        for k, p in data.items()
    )


def paths_from_metadata(metadata: Mapping[str, Any]) -> dict[str, tuple] | None:
    """The object paths a manifest's metadata records, or None."""
    paths = metadata.get(PATHS_KEY)
    if not isinstance(paths, dict):
        return None
    return {k: tuple(p) for k, p in paths.items() if isinstance(p, list)}


def encode_value(fqn: str, value: Any) -> str | bytes:
    """A non-tensor leaf as ckpt stores it: bytes as they are, anything else as JSON
    that :func:`decode_value` turns back into an equal value of the same types.
    Raises ``InvalidError`` naming the key, the place and the type of a value it
    could not give back exactly (a numpy scalar, a set, an object)."""
    if type(value) is bytes:
        return value
    return json.dumps(_encode_json(value, fqn, ""), allow_nan=False)


def decode_value(kind: str, payload: Any) -> Any:
    return _decode_json(json.loads(payload)) if kind == "json" else payload
