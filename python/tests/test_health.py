"""Health through ``ckpt.torch``: a NaN, a failed ``health_check`` or replicas that
disagree mark the checkpoint unhealthy; ``latest`` and loads without a step pass over
it (warning), an explicit step still loads it; a checkpoint written before health
was recorded lists as unknown and loads. Replica agreement on an HSDP 2 x 2 mesh
(4 gloo ranks), natively and through the DCP plugin, is in ``workers.hsdp_health``."""

from __future__ import annotations

import json
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import workers
from conftest import spawn

from ckpt.torch import (
    Checkpointer,
    UnhealthyCheckpointWarning,
    UnhealthySkippedWarning,
    health,
    latest,
    list_checkpoints,
    load,
)

PREFIX, MIDDLE = b'{"crc32":"', b'","body":'


def _values(step: int) -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step,
        "b": torch.full((5,), float(step), dtype=torch.bfloat16),
        "ids": torch.arange(6) + step,
    }


def test_a_nan_marks_the_checkpoint_unhealthy_and_loads_pass_over_it(root):
    with Checkpointer(root, rank=0, world_size=1) as checkpointer:
        checkpointer.save(1, _values(1), health={"loss": torch.tensor(0.25)}).wait_committed()
        poisoned = _values(2)
        poisoned["b"][3] = float("nan")
        handle = checkpointer.save(2, poisoned, health={"loss": 0.5})
        # Rank 0 hears of it where it waits for the commit.
        with pytest.warns(UnhealthyCheckpointWarning, match='step 2 committed unhealthy.*"b"'):
            handle.wait_committed()
        seen_by_the_saver = handle.health()

    good, bad = health(root, 1), health(root, 2)
    assert seen_by_the_saver == bad
    assert good["healthy"] is True and good["reasons"] == [], good
    assert good["metrics"] == {"loss": 0.25}, good
    assert bad["healthy"] is False, bad
    assert bad["nonfinite"] == [{"tensor": "b", "elements": 1, "ranks": [0]}], bad
    assert any('"b"' in reason for reason in bad["reasons"]), bad["reasons"]
    assert health(root)["step"] == 2  # the newest, whatever its health

    newest = latest(root)
    assert newest["step"] == 1 and newest["healthy"] is True, newest
    assert [s["step"] for s in newest["skipped"]] == [2], newest
    anyway = latest(root, healthy=False)
    assert anyway["step"] == 2 and anyway["healthy"] is False, anyway
    assert anyway["reasons"] == bad["reasons"]

    into = {k: torch.zeros_like(v) for k, v in _values(0).items()}
    with pytest.warns(UnhealthySkippedWarning, match="step 2") as caught:
        extra = load(root, into)
    assert len(caught) == 1
    assert extra.step == 1 and extra.healthy is True
    assert [(s["step"], s["reasons"]) for s in extra.skipped] == [(2, bad["reasons"])]
    for name, tensor in _values(1).items():
        assert torch.equal(into[name], tensor), name

    # Asked for by step, or with healthy=False: loaded, unhealthy as it is, no warning.
    for kwargs in ({"step": 2}, {"healthy": False}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            extra = Checkpointer(root, rank=0, world_size=1).load(into, **kwargs)
        assert extra.step == 2 and extra.healthy is False and extra.skipped == []
        assert torch.isnan(into["b"][3]) and torch.equal(into["w"], poisoned["w"])


def test_metrics_and_the_health_check_decide_health(root):
    seen = []

    def check(metrics):
        seen.append(metrics)
        if 10 < metrics.get("loss", 0.0) < float("inf"):
            return f"loss spiked to {metrics['loss']}"
        return metrics["grad_norm"] < 100 if "grad_norm" in metrics else None

    with Checkpointer(root, rank=0, world_size=1, health_check=check) as checkpointer:
        tensors = _values(0)
        checkpointer.save(1, tensors, health={"loss": 1.5, "grad_norm": 2}).wait_committed()
        checkpointer.save(2, tensors, health={"loss": 11.0}).wait_committed()
        checkpointer.save(3, tensors, health={"grad_norm": torch.tensor(1e3)}).wait_committed()
        checkpointer.save(4, tensors, health={"loss": float("inf")}).wait_committed()
    assert seen == [
        {"loss": 1.5, "grad_norm": 2.0},
        {"loss": 11.0},
        {"grad_norm": 1000.0},
        {"loss": float("inf")},
    ]
    verdicts = {step: health(root, step) for step in (1, 2, 3, 4)}
    assert verdicts[1]["healthy"] is True
    assert verdicts[1]["metrics"] == {"loss": 1.5, "grad_norm": 2.0}
    assert verdicts[2]["healthy"] is False
    assert verdicts[2]["reasons"] == ["loss spiked to 11.0 (reported by rank 0)"], verdicts[2]
    assert verdicts[3]["healthy"] is False
    assert verdicts[3]["reasons"] == [
        "health_check failed (grad_norm=1000.0) (reported by rank 0)"
    ], verdicts[3]
    # A metric that is not finite is unhealthy by itself, and read back as it was.
    assert verdicts[4]["healthy"] is False and verdicts[4]["metrics"]["loss"] == float("inf")
    assert any("loss" in r for r in verdicts[4]["reasons"]), verdicts[4]
    assert latest(root)["step"] == 1
    assert [s["step"] for s in latest(root)["skipped"]] == [4, 3, 2]

    with pytest.raises(ValueError, match="replica_mismatch"):
        Checkpointer(root, rank=0, world_size=1, replica_mismatch="ignore")
    with pytest.raises(TypeError, match="number"):
        Checkpointer(root, rank=0, world_size=1).save(9, tensors, health={"loss": "low"})


def _unseal(path: Path) -> dict:
    raw = path.read_bytes()
    assert raw.startswith(PREFIX) and raw[len(PREFIX) + 8 :].startswith(MIDDLE)
    return json.loads(raw[len(PREFIX) + 8 + len(MIDDLE) : -1])


def _seal(body: dict) -> bytes:
    text = json.dumps(body, separators=(",", ":")).encode()
    return PREFIX + f"{zlib.crc32(text):08x}".encode() + MIDDLE + text + b"}"


def test_a_checkpoint_written_before_health_lists_as_unknown_and_loads(root, tmp_path):
    with Checkpointer(root, rank=0, world_size=1) as checkpointer:
        checkpointer.save(1, _values(1)).wait_committed()
        poisoned = _values(2)
        poisoned["w"][0, 0] = float("inf")
        checkpointer.save(2, poisoned).wait_committed()
        checkpointer.save(3, _values(3)).wait_committed()
    # Step 3 as a version-3 writer wrote it: no health in its manifest or its part.
    (manifest_path,) = (tmp_path / "ckpt").glob("step-00000003/*/manifest.json")
    manifest = _unseal(manifest_path)
    assert manifest["format_version"] == 4 and manifest["health"]["healthy"] is True
    for entry in manifest["ranks"]:
        part_path = manifest_path.parent / entry["part"]
        part = _unseal(part_path)
        part.pop("health", None)
        part["format_version"] = 3
        sealed = _seal(part)
        part_path.write_bytes(sealed)
        entry["part_bytes"], entry["part_crc32"] = len(sealed), zlib.crc32(sealed)
    del manifest["health"]
    manifest["format_version"] = 3
    manifest_path.write_bytes(_seal(manifest))

    unknown = health(root, 3)
    assert unknown["healthy"] is None and unknown["reasons"] == [], unknown
    assert latest(root)["step"] == 3 and latest(root)["healthy"] is None
    into = {k: torch.zeros_like(v) for k, v in _values(0).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extra = load(root, into)
    assert extra.step == 3 and extra.healthy is None and extra.skipped == []
    for name, tensor in _values(3).items():
        assert torch.equal(into[name], tensor), name
    listed = [e for e in list_checkpoints(root, health=True) if e["committed"]]
    assert [(e["step"], e["healthy"], e["resume"]) for e in listed] == [
        (1, True, False),
        (2, False, False),
        (3, None, True),
    ], listed
    assert listed[1]["reasons"] == health(root, 2)["reasons"] != [], listed


def test_replicas_on_an_hsdp_mesh_are_compared_natively_and_through_dcp(tmp_path):
    roots = {name: f"file://{tmp_path / name}" for name in ("native", "dcp")}
    spawn(workers.hsdp_health, 4, roots, str(tmp_path / "reference.pt"))


def test_the_dcp_writer_records_metrics_and_its_reader_passes_over_unhealthy_steps(root):
    import torch.distributed.checkpoint as dcp

    from ckpt.torch.dcp import StorageReader, StorageWriter

    def check(metrics):
        return metrics["loss"] < 10 or f"loss {metrics['loss']} is too high"

    writer = StorageWriter(root, step=1, health={"loss": torch.tensor(2.0)}, health_check=check)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group: one process"
        dcp.save(_values(1), storage_writer=writer)
        writer.step, writer.health = 2, {"loss": 50.0}
        dcp.save(_values(2), storage_writer=writer)
    assert health(root, 1)["healthy"] is True and health(root, 1)["metrics"] == {"loss": 2.0}
    bad = health(root, 2)
    assert bad["healthy"] is False and bad["reasons"] == [
        "loss 50.0 is too high (reported by rank 0)"
    ], bad

    into = {k: torch.zeros_like(v) for k, v in _values(0).items()}
    reader = StorageReader(root)
    with pytest.warns(UnhealthySkippedWarning, match="step 2"):
        dcp.load(into, storage_reader=reader)
    assert [s["step"] for s in reader.skipped] == [2]
    for name, tensor in _values(1).items():
        assert torch.equal(into[name], tensor), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(into, storage_reader=StorageReader(root, healthy=False))
    assert torch.equal(into["w"], _values(2)["w"])


def test_plain_tensors_are_compared_only_when_asked(root):
    """A plain tensor is taken to be the same on every rank and written by rank 0;
    it may differ on purpose (BatchNorm's statistics under DDP), so the other ranks'
    copies are compared with it only with ``compare_plain_tensors=True``."""
    held = [{"bn.running_mean": torch.zeros(4)}, {"bn.running_mean": torch.ones(4)}]
    for step, compare in ((1, False), (2, True)):
        ranks = [
            Checkpointer(
                root, rank=r, world_size=2, run_id=f"plain{step}", compare_plain_tensors=compare
            )
            for r in range(2)
        ]
        handles = [c.save(step, held[r]) for r, c in enumerate(ranks)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnhealthyCheckpointWarning)
            for handle in handles:
                handle.wait_committed()
        for c in ranks:
            c.close()
    trusted, compared = health(root, 1), health(root, 2)
    assert trusted["healthy"] is True and trusted["replicas_compared"] == 0, trusted
    assert compared["healthy"] is False, compared
    [mismatch] = compared["replica_mismatches"]
    assert (mismatch["tensor"], mismatch["written_by"], mismatch["disagree"]) == (
        "bn.running_mean",
        0,
        [1],
    ), mismatch
