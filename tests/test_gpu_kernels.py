"""Compiled kernels of the fused layers on a CUDA device (``runtime.RuntimeOptions.gpu_kernels``).

On a GPU the fused layers can run their pure-tensor cores as inductor's Triton kernels at every size; eagerly, each
of their elementwise operations is a launch of its own (tens of thousands per training step).  These tests need a
GPU and run where ``POLAR_VIT_TEST_DEVICE=cuda`` (``benchmarks/gpu_check.sh``): a whole model's training step with
the kernels is as close to float64 as the same step run eagerly on the device (within 4x its error, or 2e-6 of the
largest entry), every kernel compiled (none fell back), another batch size compiles nothing, and the gradient-free
pass gives eager's logits.  Where the kernels' options are turned on elsewhere, the CPU tests cover the dispatch.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import polar_vit_hf as P
from polar_vit_hf.modeling import cpu_kernels
from polar_vit_hf.modeling.runtime import use_runtime_options

pytestmark = pytest.mark.skipif(
    os.environ.get("POLAR_VIT_TEST_DEVICE") != "cuda" or not torch.cuda.is_available(),
    reason="needs a CUDA device and POLAR_VIT_TEST_DEVICE=cuda",
)


def step(model: torch.nn.Module, pixels: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """One training step's loss and parameter gradients, in float64 (the gradients cleared after)."""
    loss = model(pixel_values=pixels, labels=labels).loss
    loss.backward()
    values = [loss.detach().double(), *(p.grad.double() for p in model.parameters())]
    model.zero_grad(set_to_none=True)
    return values


def worst_error(values: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    """Each value's largest absolute error against the float64 reference."""
    return [float((v - r).abs().max()) for v, r in zip(values, reference)]


@pytest.mark.parametrize("arithmetic", ["polar", "ambient"])
def test_a_models_gpu_kernels_are_as_precise_as_eager_on_the_device(arithmetic):
    cpu_kernels.clear_compiled()  # (the kernel cache is the run's: gpu_check.sh's benchmarks load what this compiles)
    torch.manual_seed(0)
    config = P.PolarViTConfig.from_preset(
        "tiny-cifar", num_labels=10, num_hidden_layers=2, drop_path_rate=0.0, arithmetic=arithmetic
    )
    model = P.PolarViTForImageClassification(config).train()
    pixels, labels = torch.randn(8, 3, 32, 32), torch.arange(8) % 10
    # float64 on the CPU (the Triton attention core computes in float32 whatever its inputs)
    reference = [t.cuda() for t in step(copy.deepcopy(model).double(), pixels.double(), labels)]
    model, pixels, labels = model.cuda(), pixels.cuda(), labels.cuda()
    with use_runtime_options(gpu_kernels=False):
        eager = step(model, pixels, labels)
    assert not cpu_kernels.compiled_functions("cuda")
    with use_runtime_options(gpu_kernels=True):
        kernels = step(model, pixels, labels)
        compiled = cpu_kernels.compiled_functions("cuda")
        assert len(compiled) >= 5
        assert all(isinstance(k, cpu_kernels.PersistentKernel) for k in compiled.values()), "a kernel fell back"
        trained = cpu_kernels.compiled_variants()
        step(model, pixels[:4], labels[:4])  # another batch size: the same variants
        assert cpu_kernels.compiled_variants() == trained
    scale = max(float(r.abs().max()) for r in reference)
    for name, k, e in zip(
        ["loss", *(n for n, _ in model.named_parameters())],
        *map(worst_error, (kernels, eager), (reference, reference)),
    ):
        assert k <= 4 * e + 2e-6 * scale, f"{name}: kernels {k:.2e} against eager {e:.2e} from float64"
    model.eval()
    with torch.no_grad():
        with use_runtime_options(gpu_kernels=True):
            logits_k = model(pixel_values=pixels).logits
        logits_e = model(pixel_values=pixels).logits
    assert torch.allclose(logits_k, logits_e, rtol=1e-5, atol=1e-6)
    cpu_kernels.clear_compiled()


@pytest.mark.parametrize("arithmetic", ["polar", "ambient"])
def test_a_compiled_model_is_one_graph_on_the_device_and_replays_as_a_cuda_graph(arithmetic):
    """``torch.compile(model, fullgraph=True)`` on the device: a training step traces as one graph (no host read,
    no break), gives eager's loss and gradients there, and ``mode="reduce-overhead"`` captures and replays the step
    as a CUDA graph."""
    torch.manual_seed(0)
    config = P.PolarViTConfig.from_preset(
        "tiny-cifar", num_labels=10, num_hidden_layers=2, drop_path_rate=0.0, arithmetic=arithmetic
    )
    model = P.PolarViTForImageClassification(config).cuda().train()
    pixels, labels = torch.randn(8, 3, 32, 32, device="cuda"), torch.arange(8, device="cuda") % 10
    eager = step(model, pixels, labels)
    torch._dynamo.reset()
    compiled = step(torch.compile(model, fullgraph=True), pixels, labels)
    scale = max(float(e.abs().max()) for e in eager)
    assert max(worst_error(compiled, eager)) <= 1e-5 * scale
    graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, capture, replay
        torch.compiler.cudagraph_mark_step_begin()
        replayed = step(graphed, pixels, labels)
    assert max(worst_error(replayed, eager)) <= 1e-5 * scale
