"""The demo preset learns scikit-learn's digits with the loop behind ``make demo``.

``training/demo.py`` trains through ``training/pretrain.py`` with the ``digits-demo`` recipe (200
seeded steps, batch 32, AdamW lr 5e-3, cosine); this test runs that very code path.
"""

from __future__ import annotations

import pytest

from polar_vit_hf.training.demo import run_digits

STEPS = 200


@pytest.mark.slow
def test_demo_preset_reaches_90_percent_on_held_out_digits(tmp_path):
    rows = run_digits("polar", tmp_path / "polar", STEPS, ["--no_progress"])
    losses = [float(row["loss"]) for row in rows]
    assert len(losses) == STEPS
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20
    assert float(rows[-1]["eval_accuracy"]) >= 0.90
    assert (tmp_path / "polar" / "model" / "model.safetensors").exists()
