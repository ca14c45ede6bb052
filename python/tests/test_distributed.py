"""FSDP2 + AdamW on 4 real rank processes (gloo), loaded on 3 and on 2: natively and
through DCP with ckpt's plugin, every way round, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import workers
from conftest import run_cli, spawn


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[dict[str, str], str]:
    base: Path = tmp_path_factory.mktemp("fsdp")
    roots = {name: f"file://{base / name}" for name in ("native", "dcp", "async", "staged")}
    reference = str(base / "reference.pt")
    spawn(workers.save_world, 4, roots, reference)
    return roots, reference


@pytest.mark.parametrize("world", [3, 2])
def test_fsdp2_and_adamw_saved_on_4_ranks_load_bitwise_on_fewer(saved, world):
    roots, reference = saved
    spawn(workers.load_world, world, roots, reference)


def test_the_ckpt_command_verifies_what_dcp_and_the_native_api_wrote(saved):
    roots, _ = saved
    for name, root in roots.items():
        verified = run_cli("verify", root)
        assert verified.returncode == 0, f"{name}: {verified.stdout}{verified.stderr}"
        listed = run_cli("ls", root)
        assert "100" in listed.stdout or name in ("async", "staged"), listed.stdout


def test_a_restarted_job_saving_the_same_step_again_commits_under_a_new_run_id(root):
    spawn(workers.save_twice, 2, root)


def test_replicated_and_2d_sharded_dtensors_on_a_2x2_mesh_load_split_another_way(tmp_path):
    root, reference = f"file://{tmp_path / 'ckpt'}", str(tmp_path / "reference.pt")
    spawn(workers.save_2d, 4, root, reference)
    spawn(workers.load_2d, 2, root, reference)
