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


def test_ckpt_elastic_imports_where_torch_cannot_be_imported():
    """torch is an optional extra: ``import ckpt.elastic`` (and every public name)
    works where ``import torch`` fails; torch is imported when ``run`` needs it."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # `import torch` raises ImportError\n"
        "import ckpt.elastic\n"
        "from ckpt.elastic import (EXIT_STOPPED, EXIT_WEDGED, Context, WorldChanged, run,\n"
        "    LEAVING_AFTER_ABORT, STUCK_AFTER_ABORT, WEDGED_AFTER_ABORT)\n"
        "assert sys.modules['torch'] is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.')))\n"
        "try:\n"
        "    import torch\n"
        "except ImportError:\n"
        "    print('torch blocked')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "torch blocked"], out.stdout + out.stderr
