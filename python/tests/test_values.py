"""Non-tensor state comes back as it was saved: the same types, the same values.

A state dict holds more than tensors: an optimizer's ``param_groups`` (``betas`` is a
tuple), a scheduler's counters, a data loader's cursor, Python's and numpy's RNG
states (tuples, 128-bit integers). The native API keeps them as JSON, which has no
tuples, no integer keys and no integers past 64 bits in the library's parser, so
ckpt writes what JSON cannot carry as tagged objects, and refuses at save anything it
could not give back exactly.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.torch import Checkpointer, load
from ckpt.torch.dcp import StorageReader


def same(a, b) -> bool:
    """Equal values of exactly the same types, all the way down (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            same(k, j) and same(a[k], b[j]) for k, j in zip(a, b, strict=True)
        )
    return a == b


VALUES = {
    "betas": (0.9, 0.999),
    "nested_tuple": (1, ("a", None), [2.5, (True,)]),
    "int_keys": {3: "c", 1: "a", 2: {"x": (1, 2)}},
    "mixed_keys": {"b": 1, 0: 2},
    "unsorted": {"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False},
    "tagged_key": {"ckpt.type": "tuple", "items": [1]},
    "big": 2**127 + 12345,
    "negative_big": -(2**70),
    "u64_max": 2**64 - 1,
    "i64_min": -(2**63),
    "floats": [0.1, -0.0, 5e-324, 1.7976931348623157e308, 0.30000000000000004],
    "specials": [math.inf, -math.inf, math.nan],
    "empty": ((), [], "", 0),
    "blob": b"\x00\xffrng",
    "blob_in_list": [b"a", bytearray(b"b")],
    "size": torch.Size([4, 5]),
    "dtype": torch.bfloat16,
    "device": torch.device("cpu"),
    "python_rng": random.Random(7).getstate(),
    "numpy_rng": np.random.default_rng(7).bit_generator.state,
    "unicode": {"ä": 1, "z": 2, "é": [None, True]},
}


@pytest.mark.parametrize("key", sorted(VALUES))
def test_non_tensor_state_loads_with_its_types(root, key):
    # In a tuple, so that a dict is one value (a mapping of a state dict is entered,
    # as DCP enters it: its entries are leaves of their own).
    value = (VALUES[key],)
    Checkpointer(root).save(
        3, {"w": torch.arange(4.0), "v": value}, overlapped=False
    ).wait_committed()
    into = {"w": torch.zeros(4), "v": None}
    extra = load(root, into)
    assert same(into["v"], value), (into["v"], value)
    assert same(extra.mine["v"], value)


def test_global_state_and_the_optimizers_param_groups_keep_their_types(root):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    saved = {"optim": optimizer.state_dict()}
    Checkpointer(root).save(
        1, saved, global_state={"sched": {"base_lrs": [1e-3], "pair": (1, 2)}}
    ).wait_committed()
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    model(torch.randn(4, 3)).sum().backward()
    fresh.step()
    into = {"optim": fresh.state_dict()}
    extra = load(root, into)
    assert same(into["optim"]["param_groups"], saved["optim"]["param_groups"])
    assert into["optim"]["param_groups"][0]["betas"] == (0.8, 0.95)
    assert same(extra.global_state["sched"], {"base_lrs": [1e-3], "pair": (1, 2)})
    fresh.load_state_dict(into["optim"])  # torch accepts it as its own


def test_a_value_that_cannot_come_back_exactly_is_refused_naming_key_and_type(root):
    for value, type_name, where in [
        (np.float64(0.5), "numpy.float64", ""),
        ([1, {2, 3}], "set", "at [1]"),
        ((1, ("a", object())), "object", "at [1][1]"),
        (({(1, 2): "tuple key"},), "tuple", "at [0] (a dict key)"),
        (({True: 1},), "bool", "at [0] (a dict key)"),
        ((np.zeros(2),), "numpy.ndarray", "at [0]"),
        (memoryview(b"x"), "memoryview", ""),
    ]:
        with pytest.raises(ckpt.InvalidError) as refused:
            Checkpointer(root).save(1, {"state": {"value": value}})
        message = str(refused.value)
        assert "'state.value'" in message and type_name in message and where in message, message
    assert ckpt.torch.latest(root) is None, "nothing was saved"


def test_plain_json_values_stay_plain_json_in_the_checkpoint(root):
    """What JSON carries unchanged is stored as plain JSON (readable by `ckpt inspect`
    and any JSON tool); only the rest is tagged."""
    Checkpointer(root).save(
        1, {"cursor": {"epoch": 2, "name": "s"}, "pair": (1, 2)}
    ).wait_committed()
    reader = ckpt._native.Reader(root, None)
    [(_, values)] = reader.rank_states()
    assert json.loads(values["cursor.epoch"][1]) == 2
    assert json.loads(values["pair"][1]) == {"ckpt.type": "tuple", "items": [1, 2]}


def test_a_natively_saved_tuple_loads_as_a_tuple_through_dcp(root):
    Checkpointer(root).save(1, {"w": torch.ones(2), "betas": (0.9, 0.99)}).wait_committed()
    into = {"w": torch.zeros(2), "betas": None}
    dcp.load(into, storage_reader=StorageReader(root))
    assert into["betas"] == (0.9, 0.99) and type(into["betas"]) is tuple


def test_the_readme_spelling_of_the_dcp_plugin_works_after_import_ckpt_torch():
    code = (
        "import ckpt.torch\n"
        "w = ckpt.torch.dcp.StorageWriter('file:///tmp/x')\n"
        "r = ckpt.torch.dcp.StorageReader('file:///tmp/x')\n"
        "print(type(w).__module__, type(r).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ckpt.torch.dcp", "StorageReader"]
