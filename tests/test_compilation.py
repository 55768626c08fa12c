"""Compiling for training (``training/compilation.py``): the flag, the regions, one graph for every layer, a compile
cache kept with the run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import polar_vit_hf as P
from polar_vit_hf.baselines import euclidean_vit
from polar_vit_hf.training import compilation, finetune, pretrain


def demo_model(layers: int = 2) -> P.PolarViTForImageClassification:
    torch.manual_seed(0)
    return P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", num_hidden_layers=layers))


def test_the_flag_compiles_on_a_gpu_by_default_and_on_request():
    for parse, required in (
        (pretrain.parse_args, ["--output_dir", "x"]),
        (finetune.parse_args, ["--model", "x", "--dataset", "x", "--output_dir", "x"]),
    ):
        assert parse(required).compile is None
        assert parse([*required, "--compile"]).compile is True
        assert parse([*required, "--no-compile"]).compile is False
    assert compilation.compile_wanted(None, torch.device("cuda"))
    assert not compilation.compile_wanted(None, torch.device("cpu"))
    assert compilation.compile_wanted(True, torch.device("cpu"))
    assert not compilation.compile_wanted(False, torch.device("cuda"))


def test_the_regions_are_the_repeated_blocks_transformers_names():
    model = demo_model(3)
    regions = compilation.compiled_regions(model)
    assert regions == [model.polar_vit.embeddings, *model.polar_vit.encoder]
    vit = euclidean_vit(P.PolarViTConfig.from_preset("demo", num_hidden_layers=2))
    assert [type(r).__name__ for r in compilation.compiled_regions(vit)] == ["ViTEmbeddings", "ViTLayer", "ViTLayer"]


def test_the_layers_share_one_compiled_graph_and_a_new_batch_size_recompiles_once(traced_kernels):
    """Regional compilation: the encoder's layers share the graph compiled for the first (no compile per layer), the
    fused layers are operators in it (no graph break), and a second batch size compiles each region once more
    (dynamic shapes), a third not at all; the compiled step gives eager's gradients."""
    traced_kernels(True)
    compiles: list[int] = []

    def backend(gm, example_inputs):
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    model = demo_model(3).train()
    x, labels = torch.randn(5, 3, 32, 32), torch.arange(5)
    model(pixel_values=x[:2], labels=labels[:2]).loss.backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    regions = compilation.compile_regions(model, log=lambda _: None, backend=backend, fullgraph=True)
    assert regions == 4
    model(pixel_values=x[:2], labels=labels[:2]).loss.backward()
    assert len(compiles) == 2  # the embeddings, one layer: the other two layers reuse its graph
    for got, want in zip((p.grad for p in model.parameters()), eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    model(pixel_values=x[:3], labels=labels[:3]).loss.backward()
    assert len(compiles) == 4  # a new batch size: each region once more, with a dynamic batch
    model(pixel_values=x, labels=labels).loss.backward()
    assert len(compiles) == 4


@pytest.mark.slow
def test_pretrain_compiles_the_regions_and_keeps_the_compile_cache_with_the_run(tmp_path):
    """``--compile`` on the CPU (the transformers ViT, quick to compile): the regions compile at the first step,
    the run keeps the compile's artifacts for a resumed run, which loads them; the saved model has the plain
    model's parameter names."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "polar_vit_hf.training.pretrain", "--output_dir", str(tmp_path), "--arch"]
    command += ["euclidean", "--compile", "--save_steps", "1", "--batch_size", "8", "--no_progress"]
    command += ["--num_workers", "0"]
    done = subprocess.run([*command, "--max_steps", "2"], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "compile: 3 regions (ViTEmbeddings, ViTLayer)" in done.stdout, done.stdout
    assert "compile: first step done in" in done.stdout
    assert (tmp_path / compilation.CACHE_FILE).stat().st_size > 0
    names = set(load_file(tmp_path / "model" / "model.safetensors"))
    assert not any("_orig_mod" in name for name in names) and "vit.encoder.layer.0.output.dense.weight" in names
    resumed = subprocess.run(
        [*command, "--max_steps", "3", "--resume", "latest"], capture_output=True, text=True, env=env, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "compile: loaded the compile cache" in resumed.stdout
