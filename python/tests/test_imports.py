"""``import ckpt``, ``import ckpt.torch`` and ``import ckpt.integrations`` import no
training framework: the integrations are optional extras, each imported only when
its own module is."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "torchtitan")


def test_the_package_imports_no_framework():
    code = (
        "import sys, ckpt, ckpt.torch, ckpt.integrations\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
