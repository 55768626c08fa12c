"""Console entry points of polar-vit-hf: each runs a script of the source checkout."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Callable


def _run_repo_script(relative: str) -> int:
    """Run a script that lives in the repository (benchmarks/, training/, conversion/)."""
    script = Path(__file__).resolve().parents[1] / relative
    if not script.exists():
        raise SystemExit(f"{relative} is not available: run from a source checkout of polar-vit-hf")
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _entry(relative: str) -> Callable[[], int]:
    def run() -> int:
        return _run_repo_script(relative)

    run.__doc__ = f"Run ``{relative}``."
    return run


precision_main = _entry("benchmarks/precision.py")  # polar-vit-precision
pretrain_main = _entry("training/pretrain.py")  # polar-vit-pretrain
finetune_main = _entry("training/finetune.py")  # polar-vit-finetune
demo_main = _entry("training/demo.py")  # polar-vit-demo
export_main = _entry("conversion/export.py")  # polar-vit-export
verify_main = _entry("conversion/verify.py")  # polar-vit-verify
push_main = _entry("conversion/push.py")  # polar-vit-push
