"""Packaging: `modeling/`, `training/`, `conversion/` and `benchmarks/` exist once and install as
`polar_vit_hf.*`; a wheel works without the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_the_single_modeling_folder():
    import polar_vit_hf.modeling as modeling
    from polar_vit_hf import geometry

    assert Path(modeling.__file__).resolve().parent == ROOT / "modeling"
    assert geometry.centroid is modeling.geometry.centroid
    assert geometry.ambient.centroid is modeling.ambient.centroid


CONSOLE_SCRIPTS = (
    "polar-vit-pretrain",
    "polar-vit-finetune",
    "polar-vit-demo",
    "polar-vit-export",
    "polar-vit-verify",
    "polar-vit-push",
    "polar-vit-precision",
    "polar-vit-fetch-data",
)


def _fresh_venv_with_wheel(tmp_path: Path) -> Path:
    """Build the wheel, install it into a new virtual environment; returns that environment's ``bin``.

    The new environment finds its dependencies in this one's site-packages (one ``.pth`` line: an
    added directory's own ``.pth`` files are not processed, so the editable install of the source
    tree stays out), and nothing runs from the source tree.
    """
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    wheel = next(wheels.glob("polar_vit_hf-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    outer = sysconfig.get_paths()["purelib"]  # this environment's site-packages
    (site / "dependencies.pth").write_text(outer + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        cwd=tmp_path,
    )
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

    located = run(
        str(bin_dir / "python"),
        "-c",
        "import polar_vit_hf, polar_vit_hf.training.pretrain as p;"
        "print(polar_vit_hf.__file__); print(p.RECIPES);"
        "print(polar_vit_hf.modeling.geometry.__file__)",
    ).split()
    assert all(str(tmp_path / "venv") in path and str(ROOT) not in path for path in located)
    assert Path(located[2]).read_bytes() == (ROOT / "modeling" / "geometry.py").read_bytes()  # the one modeling/
    helps = {
        script: subprocess.Popen(
            [str(bin_dir / script), "--help"],
            cwd=work,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for script in CONSOLE_SCRIPTS
    }
    for script, process in helps.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0 and "usage:" in out, f"{script} --help: {err[-2000:]}"
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


def test_no_import_path_manipulation_anywhere():
    folders = ("polar_vit_hf", "modeling", "training", "conversion", "benchmarks", "model_cards", "tests")
    sources = [p for folder in folders for p in (ROOT / folder).rglob("*.py")]
    needle = "sys" + ".path"  # spelled in two parts so this file does not match itself
    offenders = [str(p.relative_to(ROOT)) for p in sources if needle in p.read_text()]
    assert not offenders
