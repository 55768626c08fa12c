"""Packaging: `modeling/`, `training/`, `conversion/` and `benchmarks/` exist once and install as
`polar_vit_hf.*`; a wheel works without the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_the_single_modeling_folder():
    import polar_vit_hf.modeling as modeling
    from polar_vit_hf import geometry

    assert Path(modeling.__file__).resolve().parent == ROOT / "modeling"
    assert geometry.centroid is modeling.geometry.centroid
    assert geometry.ambient.centroid is modeling.ambient.centroid


def test_normal_install_contains_modeling_as_subpackage(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        check=True, cwd=tmp_path,
    )
    installed = target / "polar_vit_hf" / "modeling" / "geometry.py"
    assert installed.read_bytes() == (ROOT / "modeling" / "geometry.py").read_bytes()
    code = (
        "import polar_vit_hf, polar_vit_hf.modeling as m, polar_vit_hf.geometry.ambient as a;"
        "print(m.__file__); print(polar_vit_hf.geometry.sq_distance is m.geometry.sq_distance)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True).stdout.split()
    assert out[0].startswith(str(target))
    assert out[1] == "True"


CONSOLE_SCRIPTS = ("polar-vit-pretrain", "polar-vit-finetune", "polar-vit-demo", "polar-vit-export", "polar-vit-verify",
                   "polar-vit-push", "polar-vit-precision")


def _fresh_venv_with_wheel(tmp_path: Path) -> Path:
    """Build the wheel, install it into a new virtual environment; returns that environment's ``bin``.

    The new environment finds its dependencies in this one's site-packages (one ``.pth`` line: an
    added directory's own ``.pth`` files are not processed, so the editable install of the source
    tree stays out), and nothing runs from the source tree.
    """
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(wheels), str(ROOT)], check=True, cwd=tmp_path)
    wheel = next(wheels.glob("polar_vit_hf-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    outer = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site / "dependencies.pth").write_text("\n".join(outer) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--no-deps", "--no-index", str(wheel)], check=True, cwd=tmp_path)
    return venv / "bin"


@pytest.mark.slow
def test_wheel_installed_without_the_source_tree_runs_every_console_script(tmp_path):
    bin_dir = _fresh_venv_with_wheel(tmp_path)
    work = tmp_path / "work"  # no source tree here or on the path
    work.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH",)}
    env.update(OMP_NUM_THREADS="1")

    def run(*command: str) -> str:
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}: {done.stderr[-3000:]}"
        return done.stdout

    located = run(str(bin_dir / "python"), "-c", "import polar_vit_hf, polar_vit_hf.training.pretrain as p;"
                  "print(polar_vit_hf.__file__); print(p.RECIPES)").split()
    assert all(str(tmp_path / "venv") in path and str(ROOT) not in path for path in located)
    for script in CONSOLE_SCRIPTS:
        assert "usage:" in run(str(bin_dir / script), "--help")
    code = """
import sys, torch, polar_vit_hf as P
from polar_vit_hf.model_card import render_model_card
torch.manual_seed(0)
config = P.PolarViTConfig(image_size=16, patch_size=8, num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                          intermediate_size=16, num_labels=3)
model = P.PolarViTForImageClassification(config)
model.save_pretrained(sys.argv[1])
print(render_model_card(model, "user/tiny", [], "a test run").content[:4000])
"""
    card = run(str(bin_dir / "python"), "-c", code, str(work / "tiny"))
    assert "library_name: transformers" in card and "pipeline_tag: image-classification" in card
    assert "user/tiny" in card
    run(str(bin_dir / "polar-vit-export"), str(work / "tiny"), str(work / "exported"), "--repo_id", "user/tiny")
    assert (work / "exported" / "README.md").exists() and (work / "exported" / "modeling_polar_vit.py").exists()
    assert "verified" in run(str(bin_dir / "polar-vit-verify"), str(work / "exported"), "--source", str(work / "tiny"))


def test_no_sys_path_manipulation_anywhere():
    sources = [p for folder in ("polar_vit_hf", "modeling", "training", "conversion", "benchmarks", "model_cards", "tests")
               for p in (ROOT / folder).rglob("*.py")]
    offenders = [str(p.relative_to(ROOT)) for p in sources if "sys.path." + "insert" in p.read_text()
                 or "sys.path." + "append" in p.read_text()]
    assert not offenders
