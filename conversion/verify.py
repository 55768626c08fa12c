"""Verify an exported Polar-ViT folder in fresh processes, the way users will load it.

Run:  python conversion/verify.py DIR [--source SOURCE] [--tolerance 1e-5]
      python conversion/verify.py REPO_ID --source DIR [--revision R]     (a pushed repo)

1. reference logits on a fixed input batch (seeded noise plus real photographs that ship with
   scikit-image and scikit-learn) from SOURCE (any source ``export.py`` accepts) or, without it,
   from DIR loaded in this process;
2. a fresh subprocess with ``polar_vit_hf`` installed loads the target with
   ``AutoModelForImageClassification`` and ``pipeline("image-classification")``;
3. a fresh subprocess where ``polar_vit_hf`` is not importable loads the target with
   ``trust_remote_code=True`` (the shipped ``modeling/`` files) and runs the same pipeline.

Both must reproduce the reference logits within ``--tolerance`` (max absolute difference; the same
weights and the same code on the same machine give 0) and return labels of the model's
``id2label``.  Where DIR holds ``model.onnx`` (``export.py --onnx``), ONNX Runtime's logits on the same
batch must equal the reference within ``--onnx_tolerance`` relative to the largest logit.  Prints a report;
exits 1 on any mismatch.  On success it writes ``DIR/.polar_vit_verified.json`` with the SHA-256 of every
file, which ``push.py`` requires.

With a Hub repo id as the target (after ``push.py``), the subprocesses download it into an empty
cache from the endpoint in ``HF_ENDPOINT`` (token from ``HF_TOKEN`` / ``hf auth login``), the
pipeline is built from the repo id alone (task from the card's ``pipeline_tag``), and every
downloaded file must have the SHA-256 of the same file in SOURCE when SOURCE is the verified
export folder that was pushed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import torch

from polar_vit_hf.cli import UserError, add_debug_flag, command
from polar_vit_hf.deploy import ONNX_FILE

MARKER = ".polar_vit_verified.json"
REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def folder_digest(folder: Path) -> dict[str, str]:
    """SHA-256 of every file in the folder (the verification marker excluded)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def sample_images() -> list[np.ndarray]:
    """Real RGB photographs shipped with installed packages."""
    from skimage import data as skdata
    from sklearn.datasets import load_sample_images

    return [
        np.array(image)
        for image in (skdata.astronaut(), skdata.chelsea(), skdata.coffee(), *load_sample_images().images)
    ]  # writable copies


CHILD = textwrap.dedent(
    """
    import json, sys
    args = json.loads(sys.argv[1])
    remote = args["remote"]
    if remote:
        sys.modules["polar_vit_hf"] = None  # the package must not be importable here
    else:
        import polar_vit_hf  # registers the Auto classes
    import torch
    from PIL import Image
    from transformers import AutoModelForImageClassification, pipeline
    target, revision = args["target"], args["revision"]
    model = AutoModelForImageClassification.from_pretrained(target, revision=revision, trust_remote_code=remote)
    model.eval()
    batch = torch.load(args["inputs"])
    with torch.no_grad():
        logits = model(pixel_values=batch["pixel_values"]).logits
    classify = pipeline(args["task"], model=target, revision=revision, trust_remote_code=remote)
    labels = [classify(Image.fromarray(image.numpy()), top_k=1)[0]["label"] for image in batch["images"]]
    torch.save({"logits": logits, "labels": labels, "module": type(model).__module__}, args["out"])
    """
)


def run_child(
    target: str, inputs: Path, block: bool, workdir: Path, revision: str | None = None, from_hub: bool = False
) -> dict:
    """Load ``target`` (folder or repo id) in a fresh interpreter; an empty cache, offline for folders."""
    out = workdir / f"child-{'remote' if block else 'package'}.pt"
    env = {**os.environ, "HF_HOME": str(workdir / f"hf-home-{'remote' if block else 'package'}")}
    if not from_hub:
        env["HF_HUB_OFFLINE"] = "1"
    args = {
        "remote": block,
        "target": target,
        "revision": revision,
        "inputs": str(inputs),
        "out": str(out),
        "task": None if from_hub else "image-classification",
    }  # from the Hub: the card's pipeline_tag
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, env=env, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"loading {'with trust_remote_code' if block else 'with polar_vit_hf'} failed:\n{done.stderr[-3000:]}"
        )
    return torch.load(out, weights_only=False)


def is_repo_id(target: str | Path) -> bool:
    """A Hub ``namespace/name`` rather than a local folder."""
    return not Path(target).exists() and bool(REPO_ID.match(str(target)))


def check_hub_files(repo_id: str, revision: str | None, source: Path, workdir: Path) -> bool:
    """Download the repo into an empty cache and compare every file with ``source`` by SHA-256."""
    from huggingface_hub import snapshot_download

    local = Path(snapshot_download(repo_id, revision=revision, cache_dir=workdir / "snapshot"))
    remote = {name: digest for name, digest in folder_digest(local).items() if name != ".gitattributes"}
    expected = folder_digest(source)
    differ = sorted(name for name in set(remote) | set(expected) if remote.get(name) != expected.get(name))
    print(
        f"  {'files on the Hub':<32} {len(remote)} downloaded, "
        f"{'SHA-256 equal to ' + str(source) if not differ else 'DIFFER from the source: ' + str(differ[:5])}"
    )
    return not differ


def check_export_folder(folder: Path) -> None:
    """A folder ``verify`` can load: ``config.json`` and safetensors weights (single file or sharded index)."""
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder")
    if not (folder / "config.json").exists():
        raise UserError(f"{folder}: no config.json - not an exported model folder (make one with polar-vit-export)")
    if not (any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").exists()):
        raise UserError(
            f"{folder}: no model weights (model.safetensors or a sharded index) - export the checkpoint "
            f"with polar-vit-export first"
        )


def check_onnx(path: Path, pixel_values: torch.Tensor, reference: torch.Tensor, tolerance: float) -> bool:
    """ONNX Runtime's logits of ``path`` against ``reference``, relative to the largest reference logit."""
    from polar_vit_hf.deploy import onnx_logits

    name = "ONNX Runtime (model.onnx)"
    try:
        logits = torch.from_numpy(onnx_logits(path, pixel_values.float()))
    except Exception as error:  # noqa: BLE001 - any runtime failure is a failed check, reported
        print(f"  {name:<32} FAILED to run: {type(error).__name__}: {str(error)[:300]}")
        return False
    relative = float((logits - reference.float()).abs().max() / reference.abs().max().clamp_min(1e-30))
    passed = relative <= tolerance
    print(f"  {name:<32} max |logits diff| / max |logit| {relative:.2e}  {'ok' if passed else 'MISMATCH'}")
    return passed


def verify(
    target: Path | str,
    source: Path | None = None,
    tolerance: float = 1e-5,
    revision: str | None = None,
    onnx_tolerance: float = 1e-5,
) -> bool:
    """Load ``target`` (an export folder, or a pushed repo id with ``source``) both ways; see the module doc."""
    import polar_vit_hf as P
    from polar_vit_hf.conversion.export import load_source

    from_hub = is_repo_id(target)
    if from_hub and source is None:
        raise UserError(f"{target} is not a local folder; verifying a Hub repo needs --source (the exported folder)")
    folder = Path(source if from_hub else target)
    if not from_hub:
        check_export_folder(folder)
    model = (
        load_source(source, None, False).model if source else P.PolarViTForImageClassification.from_pretrained(folder)
    )
    model.eval()
    processor_from = folder if (folder / "preprocessor_config.json").exists() else str(target)
    processor = P.PolarViTImageProcessor.from_pretrained(processor_from, revision=revision)
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
        tensors = [torch.from_numpy(np.ascontiguousarray(i)) for i in images]
        torch.save({"pixel_values": pixel_values, "images": tensors}, inputs)
        where = f"{target} on {os.environ.get('HF_ENDPOINT', 'the Hub')}" if from_hub else target
        print(f"verify {where}: {len(images)} photographs + 2 noise images, tolerance {tolerance:g}")
        if from_hub:
            from huggingface_hub.errors import HfHubHTTPError

            try:
                if (folder / MARKER).exists():  # a verified export folder: what push.py uploaded
                    ok &= check_hub_files(str(target), revision, folder, workdir)
                else:
                    from huggingface_hub import HfApi

                    HfApi().model_info(str(target), revision=revision)
            except HfHubHTTPError as error:
                print(f"  {'the Hub':<32} FAILED: {str(error).splitlines()[0]} ({type(error).__name__})")
                return False
        for block, name in ((False, "polar_vit_hf installed"), (True, "trust_remote_code, no package")):
            try:
                result = run_child(str(target), inputs, block, workdir, revision, from_hub)
            except RuntimeError as error:
                print(f"  {name:<32} FAILED to load: {error}")
                ok = False
                continue
            diff = float((result["logits"] - reference).abs().max())
            labels_ok = all(label in labels for label in result["labels"])
            remote_ok = ("polar_vit_hf" not in result["module"]) == block
            passed = diff <= tolerance and labels_ok and remote_ok
            ok &= passed
            print(
                f"  {name:<32} max |logits diff| {diff:.2e}  pipeline labels {result['labels'][:3]}...  "
                f"module {result['module']}  {'ok' if passed else 'MISMATCH'}"
            )
    if not from_hub and (folder / ONNX_FILE).exists():
        ok &= check_onnx(folder / ONNX_FILE, pixel_values, reference, onnx_tolerance)
    if ok and not from_hub:
        (folder / MARKER).write_text(json.dumps({"tolerance": tolerance, "files": folder_digest(folder)}, indent=2))
        print(f"verified: wrote {folder / MARKER}")
    return ok


@command("polar-vit-verify")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_debug_flag(parser)
    parser.add_argument("target", help="an exported folder, or the repo id it was pushed to")
    parser.add_argument("--source", type=Path, help="the checkpoint (or, for a repo id, the folder) it came from")
    parser.add_argument("--revision", help="branch or commit of a Hub repo")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--onnx_tolerance", type=float, default=1e-5, help="relative, for model.onnx")
    args = parser.parse_args(argv)
    target = args.target if is_repo_id(args.target) else Path(args.target)
    if isinstance(target, Path) and not target.is_dir():
        parser.error(f"{target} is neither a folder nor a Hub repo id (namespace/name)")
    if isinstance(target, str) and args.source is None:
        parser.error(f"verifying the Hub repo {target} needs --source, the folder that was pushed")
    return 0 if verify(target, args.source, args.tolerance, args.revision, args.onnx_tolerance) else 1


if __name__ == "__main__":
    raise SystemExit(main())
