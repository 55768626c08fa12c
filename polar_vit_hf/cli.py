"""Console entry points of polar-vit-hf."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def _run_repo_script(relative: str) -> int:
    """Run a script that lives in the repository (benchmarks/, training/, conversion/)."""
    root = Path(__file__).resolve().parents[1]
    script = root / relative
    if not script.exists():
        raise SystemExit(f"{relative} is not available: run from a source checkout of polar-vit-hf")
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")
    return 0


def precision_main() -> int:
    """``polar-vit-precision``: the Table 7 precision benchmark."""
    return _run_repo_script("benchmarks/precision.py")


def pretrain_main() -> int:
    """``polar-vit-pretrain``: ``training/pretrain.py``."""
    return _run_repo_script("training/pretrain.py")


def finetune_main() -> int:
    """``polar-vit-finetune``: ``training/finetune.py``."""
    return _run_repo_script("training/finetune.py")


def demo_main() -> int:
    """``polar-vit-demo``: ``training/demo.py`` (the digits demo)."""
    return _run_repo_script("training/demo.py")


def export_main() -> int:
    """``polar-vit-export``: ``conversion/export.py``."""
    return _run_repo_script("conversion/export.py")


def verify_main() -> int:
    """``polar-vit-verify``: ``conversion/verify.py``."""
    return _run_repo_script("conversion/verify.py")


def push_main() -> int:
    """``polar-vit-push``: ``conversion/push.py``."""
    return _run_repo_script("conversion/push.py")
