"""``benchmarks/launches.py``: what a training step launches, counted on the CPU (operator calls, host
synchronisations, graph breaks)."""

from __future__ import annotations

import csv

import pytest
import torch

from polar_vit_hf.benchmarks import launches

pytestmark = pytest.mark.slow  # builds and steps models, traces a step


def test_the_counter_counts_launching_operators_and_host_synchronisations_only():
    a, b = torch.ones(4), torch.arange(4.0)
    with launches.OperatorCounter() as counter:
        c = (a + b).view(2, 2)  # one launch; the view launches nothing
        torch.empty(3)  # an allocation launches nothing
        if bool(c.sum() > 0):  # one launch (the sum), one comparison, one host synchronisation
            c.mul_(2.0)
    assert (counter.operators, counter.syncs) == (4, 1)


def test_the_benchmark_writes_per_layer_counts_from_two_depths_its_csv_and_plot(tmp_path, capsys):
    code = launches.main(["--preset", "demo", "--batch", "2", "--kernels", "off", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "per layer" in out and "graph breaks of the forward and loss" in out
    rows = list(csv.DictReader(open(tmp_path / "launches.csv")))
    assert [(row["model"], row["setting"]) for row in rows] == [
        ("euclidean", "eager"),
        ("polar", "eager, CPU kernels off"),
    ]
    vit, polar = ({key: int(value) for key, value in row.items() if key not in ("model", "setting")} for row in rows)
    one, two = (launches.count_in_process("eager", "euclidean", False, "demo", n, 2) for n in (1, 2))
    assert vit["per_layer"] == two.operators - one.operators > 0  # each depth in a fresh process
    assert vit["step"] == one.operators == vit["outside"] + vit["per_layer"]
    assert polar["per_layer"] > vit["per_layer"]  # the fused layers' eager form: many small operations
    assert polar["graph_breaks"] == 0  # the kernels off: one graph
    assert (tmp_path / "launches.png").stat().st_size > 0


def test_the_compiled_step_is_counted_in_inductors_generated_code():
    """``--compiled``: the model compiled in place, the kernel calls of its forward and backward graphs."""
    step = launches.training_step("euclidean", "demo", 1, 2)
    kernels = launches.compiled_kernels(step).operators
    eager = launches.eager_counts(launches.training_step("euclidean", "demo", 1, 2)).operators
    assert 0 < kernels < eager  # inductor fuses the elementwise work of the ViT's step
