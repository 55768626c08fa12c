"""Verify an exported Polar-ViT folder in fresh processes, the way users will load it.

Run:  python conversion/verify.py DIR [--source SOURCE] [--tolerance 1e-5]

1. reference logits on a fixed input batch (seeded noise plus real photographs that ship with
   scikit-image and scikit-learn) from SOURCE (any source ``export.py`` accepts) or, without it,
   from DIR loaded in this process;
2. a fresh subprocess with ``polar_vit_hf`` installed loads DIR with
   ``AutoModelForImageClassification`` and ``pipeline("image-classification")``;
3. a fresh subprocess where ``polar_vit_hf`` is not importable loads DIR with
   ``trust_remote_code=True`` (the shipped ``modeling/`` files) and runs the same pipeline.

Both must reproduce the reference logits within ``--tolerance`` (max absolute difference; the same
weights and the same code on the same machine give 0) and return labels of the model's
``id2label``.  Prints a report; exits 1 on any mismatch.  On success it writes
``DIR/.polar_vit_verified.json`` with the SHA-256 of every file, which ``push.py`` requires.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
MARKER = ".polar_vit_verified.json"


def folder_digest(folder: Path) -> dict[str, str]:
    """SHA-256 of every file in the folder (the verification marker excluded)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER}


def sample_images() -> list[np.ndarray]:
    """Real RGB photographs shipped with installed packages."""
    from skimage import data as skdata
    from sklearn.datasets import load_sample_images

    return [skdata.astronaut(), skdata.chelsea(), skdata.coffee(), *load_sample_images().images]


CHILD = textwrap.dedent(
    """
    import json, sys
    if {block}:
        sys.modules["polar_vit_hf"] = None  # the package must not be importable here
    else:
        import polar_vit_hf  # registers the Auto classes
    import numpy as np, torch
    from PIL import Image
    from transformers import AutoModelForImageClassification, pipeline
    folder, inputs, out = {folder!r}, {inputs!r}, {out!r}
    remote = {block}
    model = AutoModelForImageClassification.from_pretrained(folder, trust_remote_code=remote).eval()
    batch = torch.load(inputs)
    with torch.no_grad():
        logits = model(pixel_values=batch["pixel_values"]).logits
    classify = pipeline("image-classification", model=folder, trust_remote_code=remote)
    labels = [classify(Image.fromarray(image.numpy()), top_k=1)[0]["label"] for image in batch["images"]]
    torch.save({{"logits": logits, "labels": labels, "module": type(model).__module__}}, out)
    """
)


def run_child(folder: Path, inputs: Path, block: bool, workdir: Path) -> dict:
    out = workdir / f"child-{'remote' if block else 'package'}.pt"
    env = {**os.environ, "HF_HOME": str(workdir / "hf-home"), "HF_HUB_OFFLINE": "1"}
    script = CHILD.format(block=block, folder=str(folder), inputs=str(inputs), out=str(out))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"loading {'with trust_remote_code' if block else 'with polar_vit_hf'} failed:\n"
                           f"{done.stderr[-3000:]}")
    return torch.load(out, weights_only=False)


def verify(folder: Path, source: Path | None = None, tolerance: float = 1e-5) -> bool:
    sys.path.insert(0, str(ROOT / "conversion"))
    import polar_vit_hf as P
    from export import load_source

    model = (load_source(source, None, False)[0] if source else P.PolarViTForImageClassification.from_pretrained(folder))
    model.eval()
    processor = P.PolarViTImageProcessor.from_pretrained(folder)
    images = sample_images()
    real = processor(images=images, return_tensors="pt")["pixel_values"]
    noise = torch.randn(2, *real.shape[1:], generator=torch.Generator().manual_seed(0))
    pixel_values = torch.cat([real, noise])
    with torch.no_grad():
        reference = model(pixel_values=pixel_values).logits
    labels = set(model.config.id2label.values())
    ok = True
    with tempfile.TemporaryDirectory(prefix="polar-vit-verify-") as tmp:
        workdir = Path(tmp)
        inputs = workdir / "inputs.pt"
        torch.save({"pixel_values": pixel_values, "images": [torch.from_numpy(np.ascontiguousarray(i)) for i in images]},
                   inputs)
        print(f"verify {folder}: {len(images)} photographs + 2 noise images, tolerance {tolerance:g}")
        for block, name in ((False, "polar_vit_hf installed"), (True, "trust_remote_code, no package")):
            try:
                result = run_child(folder, inputs, block, workdir)
            except RuntimeError as error:
                print(f"  {name:<32} FAILED to load: {error}")
                ok = False
                continue
            diff = float((result["logits"] - reference).abs().max())
            labels_ok = all(label in labels for label in result["labels"])
            remote_ok = ("polar_vit_hf" not in result["module"]) == block
            passed = diff <= tolerance and labels_ok and remote_ok
            ok &= passed
            print(f"  {name:<32} max |logits diff| {diff:.2e}  pipeline labels {result['labels'][:3]}...  "
                  f"module {result['module']}  {'ok' if passed else 'MISMATCH'}")
    if ok:
        (folder / MARKER).write_text(json.dumps({"tolerance": tolerance, "files": folder_digest(folder)}, indent=2))
        print(f"verified: wrote {folder / MARKER}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--source", type=Path, help="the checkpoint the folder was exported from")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args(argv)
    return 0 if verify(args.folder, args.source, args.tolerance) else 1


if __name__ == "__main__":
    raise SystemExit(main())
