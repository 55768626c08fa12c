"""Polar attention implementations against the float64 eager reference (Triton via TRITON_INTERPRET=1).

Tolerances (float32 implementations vs float64 eager on the same stored float32 inputs):
forward geodesic error <= 2e-5 + 8 x the resolution limit ``sinh(r) 2^-24`` of the output point
+ the softmax's own conditioning ``4 eps max|score| diam(values)`` (a score of size ``s`` is only
known to ``eps |s|`` in float32, which moves the weights and so the centroid); gradients
element-wise within 2e-4 of the largest gradient entry of that input (plus 1e-5 of the
largest entry overall, for inputs whose exact gradient vanishes, e.g. identical keys), or within
4x the error of float32 eager autograd on the same inputs, whichever is larger; the gradient of
``scale`` sums all ``N x M`` pairs and gets 1e-4 of the largest entry overall (times
``cosh(max value radius) / 100`` beyond radius 5, the rounding of the softmax row constant
``sum_j p g_p``, which like FlashAttention's ``rowsum(dO o O)`` is formed analytically).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import EDGE_CASES, check, make_inputs
from torch.autograd import gradcheck

import polar_vit_hf as P
from polar_vit_hf.modeling.attention import (
    chunked_polar_attention,
    eager_polar_attention,
    polar_attention,
    select_implementation,
)
from polar_vit_hf.modeling.runtime import runtime_options
from polar_vit_hf.modeling.triton_attention import TRITON_AVAILABLE, triton_polar_attention

F64 = torch.float64
needs_triton = pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed")


# --------------------------------------------------------------------------------------------
# chunked (plain torch)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [16, 32, 64])
@pytest.mark.parametrize("n_q,n_k,block", [(24, 24, 8), (23, 37, 8), (5, 64, 64)])
def test_chunked_matches_float64(dim, n_q, n_k, block):
    stored = make_inputs(n_q=n_q, n_k=n_k, dim=dim, seed=dim + n_k)
    check(stored, lambda *a: chunked_polar_attention(*a, block=block), k=0.7)


@pytest.mark.parametrize("case,rmax", EDGE_CASES)
def test_chunked_edge_cases_and_radii(case, rmax):
    stored = make_inputs(n_q=17, n_k=19, rmax=rmax, case=case, seed=int(rmax))
    check(stored, lambda *a: chunked_polar_attention(*a, block=8))


def test_chunked_float64_is_exact_and_passes_gradcheck():
    stored = make_inputs(batch=1, heads=2, n_q=5, n_k=7, dim=4, seed=3)
    args = [t.double().requires_grad_(True) for t in stored]
    r1, u1 = chunked_polar_attention(*args[:6], args[6], 1.2, block=3)
    r2, u2, _ = eager_polar_attention(*args[:6], args[6], 1.2)
    assert torch.allclose(r1, r2, atol=1e-13) and torch.allclose(u1, u2, atol=1e-13)
    assert gradcheck(lambda *a: chunked_polar_attention(*a, 1.2, block=3), args)


def test_chunked_never_builds_an_n_n_d_tensor():
    n, dim, block = 96, 16, 16
    stored = make_inputs(batch=1, heads=1, n_q=n, n_k=n, dim=dim)
    inputs = [t.requires_grad_(True) for t in stored]
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        r, u = chunked_polar_attention(*inputs[:6], inputs[6], 1.0, block=block)
    assert max(sizes) < n * n  # only inputs and row statistics are saved, nothing of size N x N
    (r.sum() + u.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in inputs)


# --------------------------------------------------------------------------------------------
# triton (interpreted on the CPU in this suite)
# --------------------------------------------------------------------------------------------
TEST_DEVICE = torch.device(os.environ.get("POLAR_VIT_TEST_DEVICE", "cpu"))


def on_test_device(fn):
    """Run ``fn`` on copies of its tensor arguments on ``POLAR_VIT_TEST_DEVICE`` (the CPU and Triton's
    interpreter by default, ``cuda`` in ``benchmarks/gpu_check.sh``); CPU results, differentiable."""

    def run(*args):
        moved = [a.to(TEST_DEVICE) if torch.is_tensor(a) else a for a in args]
        return tuple(t.cpu() for t in fn(*moved))

    return run


@needs_triton
@pytest.mark.parametrize("dim", [16, 32, 64])
@pytest.mark.parametrize("n_q,n_k", [(32, 32), (37, 21)])
def test_triton_matches_float64(dim, n_q, n_k):
    stored = make_inputs(batch=2, heads=2, n_q=n_q, n_k=n_k, dim=dim, seed=dim + n_q)
    check(stored, on_test_device(lambda *a: triton_polar_attention(*a, block_m=32, block_n=32)), k=0.8)


@needs_triton
@pytest.mark.parametrize(
    "case,rmax", [("dominant", 4.0), ("identical", 8.0), ("aligned", 12.0), ("generic", 0.0), ("generic", 12.0)]
)
def test_triton_edge_cases_and_radii(case, rmax):
    stored = make_inputs(batch=1, heads=2, n_q=19, n_k=23, dim=16, rmax=rmax, case=case, seed=7)
    check(stored, on_test_device(lambda *a: triton_polar_attention(*a, block_m=32, block_n=16)))


@needs_triton
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_triton_default_launch_configuration(dim):
    """The per-head-width default blocks (``launch_config``), sequence lengths that are not multiples;
    at 128 the key and value gradients are two launches (``kv_parts``)."""
    stored = make_inputs(batch=1, heads=1, n_q=17, n_k=35, dim=dim, rmax=8.0, seed=dim)
    check(stored, on_test_device(lambda *a: triton_polar_attention(*a)))


@needs_triton
def test_triton_block_sizes_are_checked():
    from polar_vit_hf.modeling.triton_attention import launch_config

    with pytest.raises(ValueError, match="block_m=8"):
        launch_config("fwd", 16, block_m=8)
    with pytest.raises(ValueError, match="block_n=48"):
        launch_config("bwd_kv", 16, block_n=48)
    assert launch_config("bwd_q", 200)["BLOCK_M"] >= 16  # wider than the table: its widest entry


# --------------------------------------------------------------------------------------------
# dispatch and the whole model
# --------------------------------------------------------------------------------------------
def test_select_implementation():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_implementation("auto", True, cuda, 4096) == "eager"
    assert select_implementation("auto", False, cpu, runtime_options().chunked_min_tokens) == "chunked"
    assert select_implementation("auto", False, cpu, 64, "fused") == "fused"
    assert select_implementation("auto", False, cpu, 4 * runtime_options().chunked_min_tokens, "fused") == "fused"
    assert select_implementation("auto", False, cpu, 64) == "eager"
    assert select_implementation("chunked", False, cpu, 64) == "chunked"
    assert select_implementation("chunked", True, cpu, 64) == "eager"
    if TRITON_AVAILABLE:
        assert select_implementation("auto", False, cuda, 64) == "triton"


def test_polar_attention_argument_errors():
    stored = make_inputs(n_q=4, n_k=4, dim=4)
    with pytest.raises(ValueError, match="impl"):
        polar_attention(*stored[:6], stored[6], impl="flash")
    with pytest.raises(ValueError, match="probabilities"):
        polar_attention(*stored[:6], stored[6], impl="chunked", return_probs=True)
    with pytest.raises(ValueError, match="scale"):
        polar_attention(*stored[:6], torch.ones(3))
    with pytest.raises(ValueError, match="same"):
        polar_attention(*stored[:4], stored[4][..., :2], stored[5][..., :2, :], stored[6])
    r, u, probs = polar_attention(*stored[:6], stored[6], impl="eager", return_probs=True)
    assert probs.shape == (2, 2, 4, 4)


@pytest.mark.parametrize("impl", ["chunked", pytest.param("triton", marks=needs_triton)])
def test_model_gives_the_same_logits_and_gradients_with_every_implementation(impl):
    torch.manual_seed(0)
    config = P.PolarViTConfig.from_preset("demo", hidden_size=64, num_attention_heads=4, intermediate_size=64)
    model = P.PolarViTForImageClassification(config)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    out = model(x, labels=y)
    out.loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.config.polar_attn_implementation = impl
    device = TEST_DEVICE if impl == "triton" else torch.device("cpu")
    model.to(device)
    other = model(x.to(device), labels=y.to(device))
    other.loss.backward()
    assert torch.allclose(other.logits.cpu(), out.logits, atol=1e-5, rtol=1e-4)
    overall = max(float(g.abs().max()) for g in expected.values())
    for name, param in model.named_parameters():
        tol = 1e-3 * expected[name].abs().max() + 1e-6 * overall
        assert (param.grad.cpu() - expected[name]).abs().max() <= tol, name


@needs_triton
def test_triton_attention_is_one_pair_of_operators_in_a_compiled_graph():
    """The Triton attention reaches ``torch.compile`` as its registered operators (``triton_op``, with fake
    implementations and ``register_autograd``): no graph break, the forward and backward operators in the graph,
    and the gradients of the eager call."""
    stored = make_inputs(batch=1, heads=2, n_q=19, n_k=23, dim=16, rmax=4.0, seed=3)
    weights = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(0))

    def loss(*args):
        r, u = triton_polar_attention(*args, 0.8, block_m=32, block_n=16)
        return (r * r).sum() + (u * weights.to(u.device)).sum()

    def gradients(fn):
        inputs = [t.float().to(TEST_DEVICE).requires_grad_(True) for t in stored]
        return torch.autograd.grad(fn(*inputs), inputs)

    eager = gradients(loss)
    seen = []

    def backend(graph, example_inputs):
        seen.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    torch._dynamo.reset()
    inputs = [t.float().to(TEST_DEVICE) for t in stored]
    assert torch._dynamo.explain(loss)(*inputs).graph_break_count == 0
    torch._dynamo.reset()
    compiled = gradients(torch.compile(loss, backend=backend, fullgraph=True))
    assert sum("triton_polar_attention" in name for name in seen) == 1
    for have, want in zip(compiled, eager):
        assert torch.equal(have, want)


@needs_triton
def test_triton_attention_refuses_a_second_derivative_with_the_fused_layers_message():
    """The kernels' backward is first order: differentiating a gradient (``create_graph=True``) is refused with the
    message the fused layers give, not silently wrong."""
    from polar_vit_hf.modeling.cpu_kernels import DOUBLE_BACKWARD_MESSAGE

    stored = make_inputs(batch=1, heads=1, n_q=5, n_k=7, dim=16)
    inputs = [t.float().to(TEST_DEVICE).requires_grad_(True) for t in stored]
    r, u = triton_polar_attention(*inputs, 1.0)
    (grad_rq,) = torch.autograd.grad(r.sum() + u.sum(), inputs[:1], create_graph=True)
    with pytest.raises(RuntimeError) as raised:
        grad_rq.sum().backward()
    assert DOUBLE_BACKWARD_MESSAGE in str(raised.value)
