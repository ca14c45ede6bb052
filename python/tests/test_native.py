"""The native torch API in one process: dtypes, nesting, non-tensor state, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli

import ckpt
from ckpt.torch import Checkpointer, latest, list_checkpoints, load
from ckpt.torch._state import _DTYPES


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of any dtype (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_every_dtype_round_trips_bitwise(root):
    state = {
        str(dtype).removeprefix("torch."): random_tensor(dtype, (7, 5), i)
        for i, dtype in enumerate(_DTYPES)
    }
    with Checkpointer(root) as c:
        c.save(1, state).wait_committed()
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    # Random float bits hold NaNs and infinities: the commit is unhealthy, so it
    # is loaded by its step, as a load that asks for it.
    extra = load(root, into, step=1)
    assert extra.step == 1
    for name, tensor in state.items():
        assert torch.equal(bits(into[name]), bits(tensor)), name
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2"} <= set(state)


def test_nested_dicts_lists_scalars_and_non_tensor_state_round_trip(root):
    state = {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)},
        "layers": [torch.ones(2), {"b": torch.full((3,), 7, dtype=torch.int64)}],
        "step": torch.tensor(5.0),
        "empty": torch.empty(0, 3),
        "cursor": {"epoch": 2, "sample": 4096, "name": "shard-3"},
        "lr": 0.25,
        "betas": [0.9, 0.999],
        "blob": b"\x00\x01rng",
    }
    c = Checkpointer(root)
    handle = c.save(10, state, overlapped=False)
    assert handle.is_staged()
    handle.wait_committed()
    assert handle.done()
    c.close()

    into = {
        "model": {"w": torch.zeros(3, 4)},
        "layers": [torch.zeros(2), {"b": torch.zeros(3, dtype=torch.int64)}],
        "step": torch.tensor(0.0),
        "empty": torch.empty(0, 3),
        "cursor": {"epoch": 0, "sample": 0, "name": ""},
        "lr": 0.0,
        "betas": [0.0, 0.0],
        "blob": b"",
    }
    extra = load(root, into)
    assert torch.equal(into["model"]["w"], state["model"]["w"])
    assert torch.equal(into["layers"][0], state["layers"][0])
    assert torch.equal(into["layers"][1]["b"], state["layers"][1]["b"])
    assert into["step"].item() == 5.0
    assert into["cursor"] == {"epoch": 2, "sample": 4096, "name": "shard-3"}
    assert into["lr"] == 0.25 and into["betas"] == [0.9, 0.999] and into["blob"] == b"\x00\x01rng"
    assert extra.world_size == 1 and extra.ranks[0]["cursor.sample"] == 4096


def test_an_overlapped_save_keeps_the_tensors_until_staged_and_reads_them_in_place(root):
    w = torch.randn(256, 256)
    expected = w.clone()
    c = Checkpointer(root)
    handle = c.save(3, {"w": w})
    handle.wait_staged()
    w.add_(1.0)  # the optimizer step, after staging
    handle.wait_committed()
    c.close()
    into = {"w": torch.zeros(256, 256)}
    load(root, into)
    assert torch.equal(into["w"], expected)


def test_a_save_of_the_same_tensors_reuses_the_plan_and_takes_their_new_values(root):
    """What a training loop saves: the same tensors, changed in place, and non-tensor
    state that changes. The second save reuses the first one's plan and still saves
    what the tensors and values hold now."""
    model = {"w": torch.randn(64, 32), "b": torch.randn(32), "step": 1}
    with Checkpointer(root) as c:
        first = c.save(1, {"model": model})
        first.wait_committed()
        model["w"].mul_(2.0)
        model["b"].add_(1.0)
        model["step"] = 2
        second = c.save(2, {"model": model})
        second.wait_committed()
    assert first.profile["plan_reused"] is False, first.profile
    assert second.profile["plan_reused"] is True, second.profile
    assert {"prepare_s", "library_s", "library_stall_s"} <= set(second.profile)
    into = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32), "step": 0}}
    load(root, into, step=2)
    assert torch.equal(into["model"]["w"], model["w"])
    assert torch.equal(into["model"]["b"], model["b"])
    assert into["model"]["step"] == 2


@pytest.mark.parametrize(
    "change",
    ["a tensor replaced", "a tensor added", "a tensor reshaped", "a dtype changed", "renamed"],
)
def test_a_state_that_changed_gets_a_new_plan(root, change):
    state = {"w": torch.randn(16, 8), "b": torch.randn(8)}
    with Checkpointer(root) as c:
        c.save(1, state).wait_committed()
        if change == "a tensor replaced":
            state["w"] = torch.randn(16, 8)  # another allocation, the same shape
        elif change == "a tensor added":
            state["c"] = torch.randn(3)
        elif change == "a tensor reshaped":
            state["w"] = state["w"].view(8, 16)  # the same memory, another shape
        elif change == "a dtype changed":
            state["b"] = state["b"].view(torch.int32)  # the same memory and size
        else:
            state = {"v": state["w"], "b": state["b"]}
        handle = c.save(2, state)
        handle.wait_committed()
    assert handle.profile["plan_reused"] is False, (change, handle.profile)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    load(root, into, step=2)
    for name, tensor in state.items():
        assert torch.equal(bits(into[name]), bits(tensor)), (change, name)


def test_a_non_contiguous_tensor_is_copied_at_every_save_and_keeps_no_plan(root):
    w = torch.randn(6, 8)
    with Checkpointer(root) as c:
        for step in (1, 2):
            w.add_(1.0)
            handle = c.save(step, {"wt": w.t()})
            handle.wait_committed()
            assert handle.profile["plan_reused"] is False, handle.profile
            assert handle.bytes_copied == w.numel() * 4
    into = {"wt": torch.zeros(8, 6)}
    load(root, into, step=2)
    assert torch.equal(into["wt"], w.t())


def test_a_non_contiguous_destination_is_loaded_through_a_counted_copy(root):
    w = torch.randn(8, 6)
    with Checkpointer(root) as c:
        c.save(1, {"w": w}, overlapped=False).wait_committed()
    dest = torch.zeros(6, 8).t()  # a transposed view: not contiguous
    extra = load(root, {"w": dest})
    assert torch.equal(dest, w)
    assert extra.stats["bytes_copied"] >= w.numel() * 4


def test_a_load_from_local_disk_copies_no_tensor_bytes(root):
    w = torch.randn(1024, 1024)
    with Checkpointer(root) as c:
        c.save(1, {"w": w}, overlapped=False).wait_committed()
    into = {"w": torch.empty(1024, 1024)}
    extra = load(root, into)
    assert torch.equal(into["w"], w)
    assert extra.stats["bytes_requested"] == w.numel() * 4
    assert extra.stats["bytes_copied"] == 0


def test_latest_and_list_name_the_commits(root):
    assert latest(root) is None
    with Checkpointer(root) as c:
        for step in (5, 10):
            c.save(step, {"w": torch.ones(4) * step}).wait_committed()
    assert latest(root)["step"] == 10
    listed = list_checkpoints(root)
    assert [e["step"] for e in listed if e["committed"]] == [5, 10]
    into = {"w": torch.zeros(4)}
    assert load(root, into, step=5).step == 5 and into["w"][0].item() == 5.0


def test_the_old_name_list_still_lists_but_warns_that_it_is_deprecated(root):
    import ckpt.torch

    with Checkpointer(root) as c:
        c.save(5, {"w": torch.ones(4)}).wait_committed()
    with pytest.warns(DeprecationWarning, match="list_checkpoints"):
        old = ckpt.torch.list
    assert old is list_checkpoints and old(root) == list_checkpoints(root)
    with pytest.warns(DeprecationWarning, match="list_checkpoints"):
        from ckpt.torch import list as imported
    assert imported is list_checkpoints
    assert "list" not in ckpt.torch.__all__  # a star import shadows no builtin


def test_errors_are_exceptions_with_the_library_kind(root, tmp_path):
    with pytest.raises(ckpt.NotFoundError) as missing:
        load(root, {"w": torch.zeros(1)})
    assert missing.value.kind == "not_found" and "no committed checkpoint" in str(missing.value)
    with Checkpointer(root) as c:
        c.save(1, {"w": torch.zeros(4)}).wait_committed()
    with pytest.raises(ckpt.MismatchError) as shape:
        load(root, {"w": torch.zeros(5)})
    assert "shape" in str(shape.value)
    with pytest.raises(ckpt.InvalidError):
        Checkpointer(root, no_such_setting=1)
    with pytest.raises(ckpt.InvalidError) as not_json:
        Checkpointer(tmp_path / "other").save(1, {"obj": object()})
    assert "'obj'" in str(not_json.value)
    with pytest.raises(ckpt.InvalidError) as complex_dtype:
        Checkpointer(tmp_path / "other").save(1, {"c": torch.zeros(2, dtype=torch.complex64)})
    assert "complex64" in str(complex_dtype.value)
    assert issubclass(ckpt.CorruptionError, ckpt.CkptError)


def test_a_flipped_byte_in_a_rank_file_makes_load_raise_naming_the_object(root, tmp_path):
    w = torch.randn(512, 512)
    with Checkpointer(root) as c:
        c.save(1, {"w": w}, overlapped=False).wait_committed()
    files = sorted(Path(tmp_path / "ckpt").rglob("*.safetensors"))
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0x40
    files[0].write_bytes(bytes(data))
    with pytest.raises(ckpt.CorruptionError) as corrupt:
        load(root, {"w": torch.zeros(512, 512)})
    message = str(corrupt.value)
    assert corrupt.value.kind == "corrupt"
    assert files[0].name in message and "at byte" in message, message


def test_the_ckpt_command_verifies_what_python_wrote(root):
    with Checkpointer(root) as c:
        c.save(7, {"w": torch.randn(64, 64), "cursor": 3}).wait_committed()
    verified = run_cli("verify", root)
    assert verified.returncode == 0, verified.stdout + verified.stderr
