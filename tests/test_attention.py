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
@pytest.mark.parametrize("chords", ["gram", "difference"])
@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("case", ["dominant", "aligned"])
@pytest.mark.parametrize("rmax", [0.0, 4.0, 8.0, 12.0])
def test_triton_chord_designs_match_float64(chords, dim, case, rmax):
    """Both exact chord designs (the float64 Gram product, the coordinate differences) on rows dominated by one key
    and on aligned directions, at radii 0 to 12."""
    stored = make_inputs(batch=1, heads=2, n_q=19, n_k=23, dim=dim, rmax=rmax, case=case, seed=dim + int(rmax))
    check(stored, on_test_device(lambda *a: triton_polar_attention(*a, block_m=16, block_n=16, chords=chords)))


HALF_CASES = [
    *(
        (torch.bfloat16, chords, dim, case, rmax)
        for chords in ("gram", "difference")
        for dim in (16, 64)
        for case in ("dominant", "aligned")
        for rmax in (0.0, 4.0, 8.0, 12.0)
    ),
    *((torch.float16, chords, 16, "generic", 8.0) for chords in ("gram", "difference")),
]


@needs_triton
@pytest.mark.parametrize("dtype,chords,dim,case,rmax", HALF_CASES)
def test_triton_half_inputs_are_the_float32_kernels_rounded_once(dtype, chords, dim, case, rmax):
    """The precision policy: half-precision inputs take the float32 kernels on their exact float32 values; the
    output and the gradients are those of float32 inputs (checked against float64 above), each rounded once to
    the input dtype: bfloat16 over the chord designs' matrix of cases, float16 on generic inputs."""
    inputs = make_inputs(batch=1, heads=2, n_q=19, n_k=23, dim=dim, rmax=rmax, case=case, seed=dim + int(rmax))
    stored = [t.to(dtype) for t in inputs]
    gen = torch.Generator().manual_seed(1)
    # upstream gradients the half dtype represents exactly, so that both runs receive the same ones
    w_r, w_u = (torch.randn(*shape, generator=gen).to(dtype).float() for shape in ((1, 2, 19), (1, 2, 19, dim)))

    def run(inputs):
        leaves = [t.to(TEST_DEVICE).requires_grad_(True) for t in inputs]
        r, u = triton_polar_attention(*leaves, 0.9, block_m=16, block_n=16, chords=chords)
        loss = (r.float() * w_r.to(r.device)).sum() + (u.float() * w_u.to(u.device)).sum()
        grads = torch.autograd.grad(loss, leaves)
        return [t.cpu() for t in (r, u, *grads)]

    half, single = run(stored), run([t.float() for t in stored])
    for got, want in zip(half, single):
        assert got.dtype == dtype
        assert torch.equal(got, want.to(dtype))


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from polar_vit_hf.modeling import triton_kernels as K

    @triton.jit
    def _distance_terms(C, A, B, OUT, N: tl.constexpr):
        """The kernels' per-pair distance terms of ``N`` values of ``c`` and ``N`` radius pairs."""
        i = tl.arange(0, N)
        c = tl.load(C + i)
        ell, q, inv_q = K._acosh1p(c)
        a, b = tl.load(A + i), tl.load(B + i)
        gap = K._half_gap(a, tl.exp(0.5 * a), tl.exp(-0.5 * a), b, tl.exp(0.5 * b), tl.exp(-0.5 * b))
        diagonal = i[:, None] == i[None, :]
        sinh_y = tl.sum(tl.where(diagonal, gap[0], 0.0), axis=1)
        cosh_y = tl.sum(tl.where(diagonal, gap[1], 0.0), axis=1)
        tl.store(OUT + i, ell)
        tl.store(OUT + N + i, q)
        tl.store(OUT + 2 * N + i, inv_q)
        tl.store(OUT + 3 * N + i, K._log1p(c))
        tl.store(OUT + 4 * N + i, sinh_y)
        tl.store(OUT + 5 * N + i, cosh_y)


if TRITON_AVAILABLE:

    @triton.jit
    def _tile_chords(X, HX, Y, HY, OUT, M: tl.constexpr, N: tl.constexpr, D: tl.constexpr, GRAM: tl.constexpr):
        """The kernels' chords of ``M`` rows of ``X`` against ``N`` rows of ``Y``."""
        offs_m, offs_n = tl.arange(0, M), tl.arange(0, N)
        chord = K._chords(X, offs_m, offs_m < M, HX, Y, offs_n, offs_n < N, HY, D, D, GRAM)
        tl.store(OUT + offs_m[:, None] * N + offs_n[None, :], chord)


@needs_triton
@pytest.mark.parametrize("chords", ["gram", "difference"])
def test_triton_chords_are_the_float32_rounding_of_the_exact_chord(chords):
    """Both chord designs against the exact chord of the stored float32 directions (float64), for pairs from equal
    to opposite: directions at angles 1e-7 ... 3 from each other (chords 5e-15 ... 2), within 4 float32 ulp; the
    Gram design's tiles with chords below ``CHORD_PRODUCT_ABOVE`` take the differences for those."""
    from polar_vit_hf.modeling.triton_attention import _half_sq_norms

    gen = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(16, 64, generator=gen, dtype=F64), dim=-1)
    angles = torch.logspace(-7, 0.5, 16, dtype=F64)
    noise = torch.nn.functional.normalize(torch.randn(16, 64, generator=gen, dtype=F64), dim=-1)
    y = torch.nn.functional.normalize(x + angles[:, None] * noise, dim=-1)
    x32, y32 = x.float().contiguous(), y.float().contiguous()
    out = torch.empty(16, 16)
    _tile_chords[(1,)](
        x32, _half_sq_norms(x32), y32, _half_sq_norms(y32), out, M=16, N=16, D=64, GRAM=chords == "gram"
    )
    exact = 0.5 * torch.cdist(x32.double(), y32.double(), compute_mode="donot_use_mm_for_euclid_dist") ** 2
    relative = (out.double() - exact).abs() / exact
    assert float(exact.min()) < 1e-13 and float(relative.max()) <= 4 * 2.0**-24, float(relative.max())


@needs_triton
def test_triton_distance_terms_match_float64_from_zero_to_overflow():
    """The kernels' per-pair terms against float64: ``acosh(1 + c)``, ``sqrt(c (2 + c))`` and its inverse for ``c``
    from 0 and subnormal to 1e37 (radii far beyond 12), ``log1p`` across its Kahan correction's range, and the
    radii's half-gap ``sinh``/``cosh`` on both sides of the series cut-off; each within a few float32 ulp."""
    n = 64
    c = torch.tensor(
        [0.0, 1e-45, 1e-38, 1e-30, 1e-20, 1e-12, 1e-7, 3e-4, 0.01, 0.5, 0.99, 1.0, 1.5, 3.0, 10.0]
        + [10.0**k for k in range(2, 38, 2)]
        + [2.0**50, 2.0**50 * 1.5],
        dtype=torch.float32,
    )
    c = torch.cat([c, torch.rand(n - len(c), generator=torch.Generator().manual_seed(0)) * 2.0])
    radii = torch.tensor([0.0, 0.3, 1.0, 2.9, 3.0, 3.1, 4.0, 8.0, 12.0, 20.0], dtype=torch.float32)
    a = radii.repeat(n // len(radii) + 1)[:n]
    b = torch.flip(radii, [0]).repeat(n // len(radii) + 1)[:n] + torch.linspace(0.0, 0.01, n)
    out = torch.empty(6, n)
    _distance_terms[(1,)](c, a, b, out, N=n)
    c64, y = c.double(), 0.5 * (a.double() - b.double())
    want = [
        torch.log1p(c64 + torch.sqrt(c64 * (2.0 + c64))),  # acosh(1 + c), exact near c = 0
        torch.sqrt(c64 * (2.0 + c64)),
        1.0 / torch.sqrt(c64 * (2.0 + c64)),
        torch.log1p(c64),
        torch.sinh(y),
        torch.cosh(y),
    ]
    eps = 2.0**-24
    for name, got, expected in zip(("acosh", "q", "1/q", "log1p", "sinh y", "cosh y"), out.double(), want):
        finite = torch.isfinite(expected) & (expected.abs() < 3e38)
        relative = ((got - expected).abs() / expected.abs().clamp_min(1e-300))[finite]
        assert float(relative.max()) <= 8 * eps, (name, float(relative.max()))
    assert out[0, 0] == 0.0 and out[1, 0] == 0.0 and torch.isinf(out[2, 0])  # c = 0: the origin's pair


def _split(x, parts, bits):
    """``x`` (float32) as ``parts`` numbers of ``bits`` significant bits (round to nearest) that sum to it."""
    import numpy as np

    drop = 24 - bits
    out, rest = [], x.astype(np.float32)
    for _ in range(parts):
        raw = rest.view(np.uint32)
        head = ((raw + np.uint32(1 << (drop - 1))) & np.uint32((0xFFFFFFFF >> drop) << drop)).view(np.float32)
        out.append(head)
        rest = (rest - head).astype(np.float32)
    return out


def _tensor_core_products(monkeypatch):
    """The interpreter's ``tl.dot`` rounded as the tensor cores round it, and the kernels asking for the GPUs'
    precisions: BF16x6 (each float32 operand split into three bfloat16 parts, the six partial products of order
    <= 2 summed in float32, smallest first) and TF32x3 (TF32 high and low parts, three products, summed largest
    first: the less favourable order)."""
    import functools

    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    from polar_vit_hf.modeling import triton_attention as T

    plain = interpreter.InterpreterBuilder.create_dot
    schemes = {
        ir.INPUT_PRECISION.BF16x6: (3, 8, [(2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0)]),
        ir.INPUT_PRECISION.TF32x3: (2, 11, [(0, 0), (0, 1), (1, 0)]),
    }

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision not in schemes or a.data.dtype != np.float32:
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        parts, bits, order = schemes[input_precision]
        a_parts, b_parts = _split(a.data, parts, bits), _split(b.data, parts, bits)
        out = np.zeros_like(d.data, dtype=np.float32)
        for i, j in order:  # (part of a, part of b)
            out = (out + np.matmul(a_parts[i], b_parts[j])).astype(np.float32)
        return interpreter.TensorHandle((out + d.data).astype(np.float32), d.dtype.scalar)

    allowed = ("tf32", "tf32x3", "ieee", "bf16x6")
    options = functools.partial(interpreter.InterpreterOptions, allowed_dot_input_precisions=allowed)
    monkeypatch.setattr(interpreter.interpreter_builder, "options", options())
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(T, "dot_precisions", lambda device: T.DotPrecisions("bf16x6", "tf32x3"))


PRODUCT_CASES = [("generic", 12.0), ("aligned", 12.0), ("dominant", 4.0), ("identical", 8.0)]


@needs_triton
@pytest.mark.parametrize("case,rmax", PRODUCT_CASES)
def test_triton_tensor_core_products_hold_the_float64_tolerances(monkeypatch, case, rmax):
    """The kernels' products are ``tl.dot`` on the tensor cores of a GPU (BF16x6 for the values, TF32x3 for the
    chord gradients), which the interpreter computes in float32: rounded here as the tensor cores round them,
    every float64 check still passes."""
    _tensor_core_products(monkeypatch)
    stored = make_inputs(batch=1, heads=2, n_q=19, n_k=23, dim=16, rmax=rmax, case=case, seed=5)
    check(stored, lambda *a: triton_polar_attention(*a, block_m=16, block_n=16, chords="gram"))


@needs_triton
def test_chord_design_and_product_precision_follow_the_device(monkeypatch):
    """FP64 tensor cores (A100, H100, H200, B200) take the Gram chords, other GPUs the differences; BF16x6 products
    from sm_80 on, IEEE float32 before; an unknown design is refused by name."""
    from polar_vit_hf.modeling import triton_attention as T

    cuda = torch.device("cuda", 0)
    for capability, chords, dot in [
        ((9, 0), "gram", ("bf16x6", "tf32x3")),
        ((8, 0), "gram", ("bf16x6", "tf32x3")),
        ((10, 0), "gram", ("bf16x6", "tf32x3")),
        ((8, 6), "difference", ("bf16x6", "tf32x3")),
        ((8, 9), "difference", ("bf16x6", "tf32x3")),
        ((12, 0), "difference", ("bf16x6", "tf32x3")),
        ((7, 5), "difference", ("ieee", "ieee")),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert (T.default_chords(cuda), T.dot_precisions(cuda)) == (chords, dot), capability
    assert T.default_chords(torch.device("cpu")) == "gram"
    stored = make_inputs(batch=1, heads=1, n_q=4, n_k=4, dim=16)
    with pytest.raises(ValueError, match="chords='exact'"):
        triton_polar_attention(*stored, chords="exact")


@needs_triton
def test_triton_autotuning_runs_over_the_launch_table_and_restores_the_row_constant():
    """On CUDA a launch without user blocks autotunes over its ``LAUNCH_CONFIGS`` list, keyed by the lengths and the
    compile-time constants; ``bwd_dq``, which writes the corrected softmax row constant over the analytic one it
    reads, has it restored between timed launches (outputs independent of the autotuner's cache)."""
    from polar_vit_hf.modeling import triton_attention as T

    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        tuned = T._autotuned(kernel, "gram", 64)
        configs = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in tuned.configs]
        assert configs == T.configurations(kernel, 64, "gram")
        assert {"n_q", "n_k", "D", "DOT"} <= set(tuned.keys)
        assert list(tuned.restore_value or []) == (["ROWDOT"] if kernel == "bwd_dq" else [])


@needs_triton
def test_triton_block_sizes_are_checked():
    from polar_vit_hf.modeling.triton_attention import launch_config

    with pytest.raises(ValueError, match="block_m=8"):
        launch_config("fwd", 16, block_m=8)
    with pytest.raises(ValueError, match="block_n=48"):
        launch_config("bwd_dkdv", 16, block_n=48)
    assert launch_config("bwd_dq", 200)["BLOCK_M"] >= 16  # wider than the table: its widest entry


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
