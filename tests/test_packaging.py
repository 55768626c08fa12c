"""`modeling/` exists once and is importable as `polar_vit_hf.modeling` from a normal install too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
