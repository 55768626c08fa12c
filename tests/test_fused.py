"""Fused polar layers (``FusedPolarOps``, ``modeling/fused_*.py``) against the reference differentiated by autograd.

Every fused ``torch.autograd.Function`` is checked with ``gradcheck`` in float64 at radii 0, 0.5, 4, 8
and 12 (aligned directions, identical tokens, zero weights included), and whole models with
``fused_ops=True`` against ``fused_ops=False`` in float64: logits and every parameter's gradient to
1e-10 relative, for every ablation switch and both CPU attention implementations.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from helpers import EDGE_CASES, SWITCHES, check, directions, make_inputs, radii
from torch.autograd import gradcheck
from torch.utils._python_dispatch import TorchDispatchMode

import polar_vit_hf as P
from polar_vit_hf.modeling import fused_ambient, fused_attention, fused_layers
from polar_vit_hf.modeling.fused_ambient import fused_ambient_boost_residual, fused_ambient_gyro_layer_norm
from polar_vit_hf.modeling.fused_attention import AttentionRows, fused_ambient_attention, fused_polar_attention
from polar_vit_hf.modeling.fused_gyro_norm import bias_step, fused_gyro_layer_norm, gyro_norm_forward, rebuild_wide
from polar_vit_hf.modeling.fused_layers import fused_boost_residual, fused_polar_fc, fused_reserved_axes_encoding
from polar_vit_hf.modeling.manifold_ops import AmbientOps, FusedAmbientOps, FusedPolarOps, PolarOps
from polar_vit_hf.modeling.modeling_polar_vit import RELATIVE_POSITION_CLASSES, BoostResidual, GyroLayerNorm, PolarFC
from polar_vit_hf.modeling.runtime import use_runtime_options
from polar_vit_hf.modeling.stable_math import (
    asinh_exp,
    asinh_sqrt_half,
    cosh_minus_one,
    distance_slope,
    exp_weights,
    kernel_acosh,
    kernel_log1p,
    pair_cosh_minus_one,
    pair_sinh,
    scaled_sinh_cosh,
    series_cutoff,
    sinh_cosh,
)

F64 = torch.float64
RADII = (0.0, 0.5, 4.0, 8.0, 12.0)


# --------------------------------------------------------------------------------------------
# scalar helpers: the exp / expm1 / log1p forms against float64 torch and mpmath-free identities
# --------------------------------------------------------------------------------------------
def test_scalar_helpers_match_torch_in_float64_and_float32():
    x = torch.cat([torch.linspace(-40.0, 40.0, 2001, dtype=F64), torch.tensor([0.0, 1e-30, -1e-12, 1e-6], dtype=F64)])
    sinh, cosh = sinh_cosh(x)
    assert torch.allclose(sinh, torch.sinh(x), rtol=4e-16, atol=0)
    assert torch.allclose(cosh, torch.cosh(x), rtol=4e-16, atol=0)
    c, sinh_x = cosh_minus_one(x)
    assert torch.allclose(c, 2.0 * torch.sinh(0.5 * x) ** 2, rtol=1e-15, atol=0)
    assert torch.allclose(sinh_x, torch.sinh(x), rtol=4e-16, atol=0)
    cc = torch.cat([torch.zeros(1, dtype=F64), torch.logspace(-30, 30, 601, dtype=F64)])
    asinh_s, root = asinh_sqrt_half(cc)
    assert torch.allclose(asinh_s, torch.asinh(torch.sqrt(cc / 2)), rtol=4e-16, atol=0)
    assert torch.allclose(root, torch.sqrt(1 + cc / 2), rtol=4e-16, atol=0)
    lv = torch.linspace(-60.0, 60.0, 1201, dtype=F64)
    exact = torch.tensor([float(mpmath.asinh(mpmath.exp(mpmath.mpf(float(v))))) for v in lv], dtype=F64)
    assert torch.allclose(asinh_exp(lv), exact, rtol=4e-16, atol=0)
    assert asinh_exp(torch.tensor(float("-inf"), dtype=F64)) == 0
    assert gradcheck(asinh_exp, (torch.tensor([-3.0, -1e-9, 0.0, 1e-9, 2.0], dtype=F64, requires_grad=True),))
    # float32: a few ulp of the float64 value (no cancellation anywhere)
    x32 = torch.linspace(-80.0, 80.0, 4001)
    sinh32, cosh32 = sinh_cosh(x32)
    assert ((sinh32.double() - torch.sinh(x32.double())).abs() <= 4 * 2**-24 * torch.sinh(x32.double()).abs()).all()
    assert ((cosh32.double() - torch.cosh(x32.double())).abs() <= 4 * 2**-24 * torch.cosh(x32.double())).all()
    c32 = torch.logspace(-30, 30, 601)
    got = asinh_sqrt_half(c32)[0].double()
    want = torch.asinh(torch.sqrt(c32.double() / 2))
    assert ((got - want).abs() <= 4 * 2**-24 * want).all()


def test_scaled_sinh_cosh_has_no_cancellation_at_small_radii():
    """``(sinh a, cosh a) e^{-top}`` (the direct concatenation's scaled terms) against mpmath on the same inputs,
    in float64 and float32, from ``a = 1e-30`` to 80 below and at ``top``, where ``e^{a - top} - e^{-a - top}``
    loses the digits of ``a``: a few ulp, plus the rounding of ``a - top`` (half an ulp of ``|a - top|``, which
    ``e^{a - top}`` turns into a relative error).  Smooth: gradcheck through ``a = 0``."""
    a = torch.cat([torch.zeros(1, dtype=F64), torch.logspace(-30, math.log10(80.0), 200, dtype=F64)])
    for dtype in (F64, torch.float32):
        eps = torch.finfo(dtype).eps
        for top in (a, a + 3.0, torch.full_like(a, 90.0)):
            x, t = a.to(dtype), top.to(dtype)
            got = [v.double() for v in scaled_sinh_cosh(x, t)]
            with mpmath.workdps(40):
                for f, value in zip((mpmath.sinh, mpmath.cosh), got):
                    want = torch.tensor(
                        [float(f(mpmath.mpf(float(xi))) * mpmath.exp(-mpmath.mpf(float(ti)))) for xi, ti in zip(x, t)],
                        dtype=F64,
                    )
                    slack = 4 * eps * (1.0 + (x.double() - t.double()).abs())
                    # (below the smallest normal number, ``e^{-top}`` underflows: an absolute bound)
                    assert ((value - want).abs() <= slack * want + torch.finfo(dtype).tiny).all(), (dtype, f)
    points = torch.tensor([-1e-3, 0.0, 1e-3, 1.5], dtype=F64, requires_grad=True)
    assert gradcheck(lambda t: scaled_sinh_cosh(t, torch.tensor(2.0, dtype=F64)), (points,))


def _pair_terms(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pair_cosh_minus_one`` and ``pair_sinh`` of radii ``a, b`` as the attention calls them: the per-radius
    exponentials' products."""
    args = (a - b, torch.exp(a) * torch.exp(-b), torch.exp(-a) * torch.exp(b))
    return pair_cosh_minus_one(*args), pair_sinh(*args)


def _radius_pairs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Radii 0, 1e-3, 0.5, 4, 8, 12, 30 and 80 against each other and against neighbours from one ulp to 20 away,
    on both sides of the series' bound 3 (``difference_series_below``)."""
    base = [0.0, 1e-3, 0.5, 4.0, 8.0, 12.0, 30.0, 80.0]
    offsets = [1e-7, 1e-4, 0.01, 0.1, 1.0, 2.9999, 3.0, 3.0001, 5.0, 20.0]
    pairs = [(x, y) for x in base for y in base]
    for x in base:
        x_t = torch.tensor(x, dtype=dtype)
        pairs += [(x, float(torch.nextafter(x_t, x_t + 1))), (x, float(torch.nextafter(x_t, x_t - 1)))]
        pairs += [(x, y) for off in offsets for y in (x + off, x - off) if 0.0 <= y < 85.0]
    a, b = torch.tensor(pairs, dtype=dtype).abs().unbind(-1)
    return a, b


def test_pair_cosh_minus_one_matches_mpmath_at_every_radius():
    """``(cosh(a - b) - 1, sinh(a - b))`` of Eq. 5 from the radii's exponentials and the half-angle series (the
    attention's per-pair form, no transcendental function per pair) against mpmath on the same inputs, radii 0 to
    80: a few ulp in float64 and float32, including the rounding of ``a - b`` where the series serve (differences
    whose ``cosh - 1`` underflows round to zero in both forms); exact zeros at ``a = b``; as accurate as
    ``cosh_minus_one`` (one ``expm1`` per pair) on the same pairs.  Smooth across the series' bound: gradcheck at
    ``|a - b|`` = 2.99, 3 and 3.01."""
    for dtype, bound in ((F64, 8 * 2.0**-53), (torch.float32, 8 * 2.0**-24)):
        a, b = _radius_pairs(dtype)
        cosh_minus, sinh_x = (v.double() for v in _pair_terms(a, b))
        old_cosh_minus, old_sinh = (v.double() for v in cosh_minus_one(a - b))
        with mpmath.workdps(40):
            diffs = [mpmath.mpf(float(x)) - mpmath.mpf(float(y)) for x, y in zip(a, b)]
            want_c = torch.tensor([float(2 * mpmath.sinh(d / 2) ** 2) for d in diffs], dtype=F64)
            want_s = torch.tensor([float(mpmath.sinh(d)) for d in diffs], dtype=F64)
        same = a == b
        assert (cosh_minus[same] == 0).all() and (sinh_x[same] == 0).all()
        normal = ~same & (want_c >= torch.finfo(dtype).tiny)  # (below it, both forms round to zero)
        for got, old, want in ((cosh_minus, old_cosh_minus, want_c), (sinh_x, old_sinh, want_s)):
            err = ((got - want).abs() / want.abs())[normal]
            old_err = ((old - want).abs() / want.abs())[normal]
            assert err.max() <= bound, (dtype, float(err.max()))
            assert err.max() <= max(1.5 * old_err.max(), 4 * torch.finfo(dtype).eps), (dtype, float(err.max()))
    x = torch.tensor([2.99, 3.0, 3.01, -3.0, 0.0], dtype=F64, requires_grad=True)
    b = torch.tensor(4.0, dtype=F64)
    assert gradcheck(lambda t: _pair_terms(b + t, b), (x,))


def test_distance_slope_matches_mpmath_across_its_series_bound():
    """``dD^2/dc = 2 asinh(s) / (s sqrt(1 + s^2))`` (``s^2 = c/2``, Eq. 5) from ``s^2`` and the attention's own
    ``asinh(s)`` and ``sqrt(1 + s^2)`` (:func:`asinh_sqrt_half`) against mpmath on the same ``c``, from 0 (the limit
    2) over the series' bound (``c`` = 1e-4, and its neighbours one ulp away) to ``1e30``: a few ulp in float64 and
    float32, eager and compiled alike; continuous across the bound."""
    cutoff = series_cutoff()
    for dtype in (F64, torch.float32):
        bound = torch.tensor(cutoff, dtype=dtype)
        near = [torch.nextafter(bound, bound + step) for step in (-1.0, 1.0)]
        c = torch.cat([torch.zeros(1, dtype=dtype), bound.view(1), *(t.view(1) for t in near)])
        c = torch.cat([c, torch.logspace(-12, 30, 421, dtype=dtype), torch.linspace(0.5e-4, 2e-4, 101, dtype=dtype)])
        asinh_s, root = asinh_sqrt_half(c)
        with mpmath.workdps(40):
            halves = [mpmath.sqrt(mpmath.mpf(float(x)) / 2) for x in c]
            want = torch.tensor(
                [float(2 * mpmath.asinh(s) / (s * mpmath.sqrt(1 + s * s))) if s else 2.0 for s in halves], dtype=F64
            )
        eager = distance_slope(0.5 * c, asinh_s, root)
        compiled = torch.compile(distance_slope, dynamic=False, fullgraph=True)(0.5 * c, asinh_s, root)
        for got in (eager, compiled):
            err = ((got.double() - want).abs() / want).max()
            assert err <= 6 * torch.finfo(dtype).eps, (dtype, float(err))
        at, below, above = eager[1:4].double()  # the slope is about 2 there: a few ulp of it
        assert (below - above).abs() <= 8 * torch.finfo(dtype).eps and (at - below).abs() <= 8 * torch.finfo(dtype).eps


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a torch built with CUDA")
def test_eager_forms_on_a_gpu_read_no_tensor_value():
    """On a GPU, the gyro norm's forward (both forms of Eq. 20, selected on the device) and the distance slope (its
    series chosen per entry) read no tensor value: each read would make the host wait for the device.  Fake CUDA
    tensors have no values, so a read raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        p = torch.empty(2, 5, 7, device="cuda")
        out, _, _ = gyro_norm_forward(p, torch.empty((), device="cuda"), torch.empty(6, device="cuda"), 1.3, 1e-6)
        c = torch.empty(3, 4, device="cuda")
        asinh_s, root = asinh_sqrt_half(c)
        slope = distance_slope(0.5 * c, asinh_s, root)
    assert out.shape == p.shape and slope.shape == c.shape


# --------------------------------------------------------------------------------------------
# attention core
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,rmax", EDGE_CASES)
def test_fused_attention_matches_float64_reference(case, rmax):
    stored = make_inputs(n_q=17, n_k=19, rmax=rmax, case=case, seed=int(rmax))
    check(stored, lambda *a: fused_polar_attention(*a))


class SubnormalResults(TorchDispatchMode):
    """Records every operator whose float32 result holds a subnormal number (``0 < |x| < tiny``); allocations
    (``empty``, ``new_empty``: memory not yet written, computed by nothing) and views of tensors are not results."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.__name__.split(".")[0] in ("empty", "new_empty", "empty_like", "empty_strided"):
            return out
        tiny = torch.finfo(torch.float32).tiny
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel():
                magnitude = t.detach().abs()
                if bool(((magnitude > 0) & (magnitude < tiny)).any()):
                    self.found.append(str(func))
        return out


def test_exp_weights_are_exact_zeros_below_the_root_of_tiny():
    x = torch.tensor([0.0, -43.0, -44.0, -88.0, -100.0, float("-inf")])
    assert torch.equal(exp_weights(x), torch.exp(x) * (x >= 0.5 * math.log(torch.finfo(torch.float32).tiny)))
    assert exp_weights(x)[1] == math.exp(-43.0) and exp_weights(x.double())[3] == math.exp(-88.0)
    with SubnormalResults() as mode:
        torch.exp(x)  # the bare exponential: subnormal weights
    assert mode.found == ["aten.exp.default"]


@pytest.mark.parametrize("ambient", [False, True])
def test_sharp_attention_computes_no_subnormal_number(ambient):
    """Far pairs of sharp attention get softmax weights below ``sqrt(tiny)`` (:func:`stable_math.exp_weights` makes
    them exact zeros): no operation of the attention core's forward or backward, the functions its compiled kernels
    run, makes a float32 subnormal number (x86 arithmetic on them is up to 100x slower)."""
    rq, uq, rk, uk, rv, uv, _ = make_inputs(batch=2, heads=2, n_q=24, n_k=24, rmax=8.0, seed=3)
    scale = torch.ones(2)  # most far pairs below 1e-19
    if ambient:
        args = [P.geometry.to_ambient(r.double(), u.double()).float() for r, u in ((rq, uq), (rk, uk), (rv, uv))]
    else:
        args = [rq, uq, rk, uk, rv, uv]
    args = [t.requires_grad_(True) for t in args]
    attention = fused_ambient_attention if ambient else fused_polar_attention
    with use_runtime_options(cpu_kernels=False), SubnormalResults() as mode:
        outputs = attention(*args, scale)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        loss = sum((t * torch.linspace(-1, 1, t.numel()).view_as(t)).sum() for t in outputs)
        torch.autograd.grad(loss, args)
    assert mode.found == []


@pytest.mark.parametrize("dim", [16, 64])
def test_fused_attention_odd_shapes_and_curvature(dim):
    check(make_inputs(n_q=23, n_k=37, dim=dim, seed=dim), lambda *a: fused_polar_attention(*a), k=0.7)


@pytest.mark.parametrize("case", ["generic", "aligned", "identical", "dominant"])
@pytest.mark.parametrize("rmax", RADII)
def test_fused_attention_gradcheck(case, rmax):
    stored = make_inputs(batch=1, heads=2, n_q=4, n_k=5, dim=4, rmax=rmax, case=case, seed=3)
    args = [t.double().requires_grad_(True) for t in stored]
    args[6] = args[6].detach().div(50.0 if case == "dominant" else 1.0).requires_grad_(True)
    if rmax == 0.0:  # values at the origin: V = 0 and the output direction is undefined; keep them off it
        args[4] = (args[4].detach() + 0.3).requires_grad_(True)
    assert gradcheck(lambda *a: fused_polar_attention(*a, 1.3), args)


def test_fused_attention_groups_and_saves_nothing_quadratic(monkeypatch):
    """Several (batch, head) groups give the same result as one; autograd keeps nothing of size N x M."""
    stored = make_inputs(batch=3, heads=2, n_q=12, n_k=12, dim=8, rmax=4.0)
    args = [t.double().requires_grad_(True) for t in stored]
    one = fused_polar_attention(*args)
    g_one = torch.autograd.grad(one[0].sum() + one[1].square().sum(), args)
    sizes = []
    with (
        use_runtime_options(attention_group_elements=2 * 2 * 12 * 12),
        torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t),
    ):
        two = fused_polar_attention(*args)  # 2 samples per group, the last one partial
    g_two = torch.autograd.grad(two[0].sum() + two[1].square().sum(), args)
    assert max(sizes) < 12 * 12 * 6  # inputs and per-row statistics only
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert all(torch.allclose(a, b, rtol=1e-13, atol=1e-15) for a, b in zip(g_one, g_two))


# budgets of score elements per block (attention_group_elements) for 3 samples x 2 heads x 12 x 12 pairs: groups of
# samples, one sample's single heads, and query rows in blocks (144 pairs per slice: 3 blocks of 4 rows at 50)
BLOCK_BUDGETS = {"samples": 2 * 2 * 12 * 12, "heads": 12 * 12, "rows": 50}


@pytest.mark.parametrize("budget", list(BLOCK_BUDGETS))
def test_attention_blocks_cover_every_row_once_within_the_budget(budget):
    """The blocks of :func:`fused_attention._blocks` hold every ``(sample, head, query row)`` exactly once, all keys,
    at most the budget's score elements where one query row fits it, and row blocks of near-equal size."""
    queries, keys = torch.empty(3, 2, 12, 1), torch.empty(3, 2, 12, 1)
    with use_runtime_options(attention_group_elements=BLOCK_BUDGETS[budget]):
        pairs, blocks = fused_attention._blocks(queries, keys)
    covered = torch.zeros(3, 2, 12, dtype=torch.int64)
    for block in blocks:
        block.region(covered, rows=True).add_(1)
        assert block.slices(keys).shape[1] == 12 and block.queries(queries).numel() * 12 <= BLOCK_BUDGETS[budget]
    assert pairs == 3 * 2 * 12 * 12 and bool((covered == 1).all())
    sizes = {block.queries(queries).shape[1] for block in blocks}
    assert sizes == ({4} if budget == "rows" else {12})
    assert len(blocks) == {"samples": 2, "heads": 6, "rows": 18}[budget]


@pytest.mark.parametrize(
    ("tokens", "heads", "per_block"),
    [
        (64, 12, (10, 12, 64)),
        (144, 12, (2, 12, 144)),
        (196, 12, (2, 12, 196)),
        (256, 12, (1, 12, 256)),
        (1024, 4, (1, 1, 1024)),
        (4096, 4, (1, 1, 256)),
    ],
)
def test_attention_blocks_of_the_automatic_size_hold_24_slices_where_they_fit(tokens, heads, per_block):
    """Without ``attention_group_elements`` a block holds ``2^19`` score elements, more up to ``2^20`` where that
    holds at least 24 ``(batch, head)`` slices (:func:`fused_attention.group_elements`): whole samples at 64 to 256
    tokens, a whole head at 1024 (not half its rows), a head's rows in blocks of 256 at 4096."""
    queries = torch.empty(16, heads, tokens, 1)
    _, blocks = fused_attention._blocks(queries, queries)
    first = blocks[0].queries(queries)
    assert (blocks[0].samples.stop - (blocks[0].samples.start or 0), *first.shape[:2]) == (
        per_block[0],
        per_block[0] * per_block[1],
        per_block[2],
    )
    assert fused_attention.group_elements(64 * 64) == 1 << 19 and fused_attention.group_elements(4096**2) == 1 << 20
    assert fused_attention.group_elements(196 * 196) == 24 * 196 * 196
    with use_runtime_options(attention_group_elements=1000):
        assert fused_attention.group_elements(196 * 196) == 1000


@pytest.mark.parametrize("budget", ["heads", "rows"])
@pytest.mark.parametrize("ambient", [False, True])
def test_fused_attention_in_blocks_of_heads_and_rows_is_the_whole_core(budget, ambient):
    """Blocks of single heads and of query rows (long sequences: memory bounded at any length) give the result of
    groups of samples; the keys' and values' gradients, summed over the row blocks, agree to rounding; gradcheck
    through row blocks, the token-major heads Function too."""
    stored = make_inputs(batch=3, heads=2, n_q=12, n_k=12, dim=8, rmax=4.0)
    if ambient:
        *points, scale = _ambient_points("generic", 4.0, batch=3, heads=2, n_q=12, n_k=12, dim=8)
        args = [t.requires_grad_(True) for t in (*points, scale)]
        attention, heads_function = fused_ambient_attention, fused_attention.fused_ambient_attention_heads
    else:
        args = [t.double().requires_grad_(True) for t in stored]
        attention, heads_function = fused_polar_attention, fused_attention.fused_polar_attention_heads

    def loss(outputs):
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return sum((t * torch.linspace(-1, 1, t.numel(), dtype=F64).view_as(t)).sum() for t in outputs)

    one = attention(*args)
    g_one = torch.autograd.grad(loss(one), args)
    with use_runtime_options(attention_group_elements=BLOCK_BUDGETS[budget]):
        two = attention(*args)
        g_two = torch.autograd.grad(loss(two), args)
    one, two = (t if isinstance(t, tuple) else (t,) for t in (one, two))
    assert all(torch.allclose(a, b, rtol=1e-14, atol=1e-15) for a, b in zip(one, two))
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(g_one, g_two))
    small = [t.detach()[:1, :, :5].clone().requires_grad_(True) for t in args[:-1]]
    small_scale = args[-1].detach().clone().requires_grad_(True)
    with use_runtime_options(attention_group_elements=2 * 5):  # 2 query rows per block, the last one alone
        assert gradcheck(lambda *a: attention(*a, 1.3), (*small, small_scale))
        points = small if ambient else [torch.cat([r.unsqueeze(-1), u], -1) for r, u in zip(small[::2], small[1::2])]
        qk = torch.cat([t.transpose(1, 2) for t in points[:2]], dim=-2).detach().requires_grad_(True)
        v = points[2].transpose(1, 2).detach().requires_grad_(True)
        assert gradcheck(lambda *a: heads_function(*a, 1.3), (qk, v, small_scale))


def test_fused_attention_reads_strided_heads_as_the_model_passes_them():
    """Heads as the model passes them (views of the stacked projection, heads transposed): the same results as
    contiguous inputs, and every group's per-row quantities are views of tensors gathered once for all groups."""
    batch, heads, tokens, dim = 3, 2, 5, 4
    stacked = make_inputs(batch=batch, heads=1, n_q=tokens * 3 * heads, n_k=1, dim=dim, rmax=4.0)
    packed = torch.cat([stacked[0].reshape(-1, 1), stacked[1].reshape(-1, dim)], dim=-1)
    packed = packed.double().view(batch, tokens, 3 * heads, dim + 1)
    q, k, v = (t.transpose(1, 2) for t in packed.split(heads, dim=-2))  # (B, H, N, d+1) strided views
    args = [q[..., 0], q[..., 1:], k[..., 0], k[..., 1:], v[..., 0], v[..., 1:], torch.tensor([0.7, 1.1], dtype=F64)]
    rows = AttentionRows(*args, 1.0)
    for group in (slice(0, 2), slice(2, 3)):
        part = rows[fused_attention.Block(group)]
        for name in ("a", "b", "beta", "sinh_a", "cosh_b", "exp_beta", "scale", "root_coef"):
            whole = getattr(rows.scalars, name)
            assert whole.is_contiguous(), name
            assert getattr(part.scalars, name).untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    strided = fused_polar_attention(*args)
    dense = fused_polar_attention(*(t.contiguous() for t in args))
    assert all(torch.equal(a, b) for a, b in zip(strided, dense))


def _token_major(stored: list[torch.Tensor], stacked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qk (B, N, 2H, d+1), v (B, N, H, d+1))`` from ``make_inputs``'s heads: contiguous tensors, or (``stacked``)
    views of one ``(B, N, 3H, d+1)`` projection output, as a layer without a position encoding passes them."""
    rq, uq, rk, uk, rv, uv = (t.double() for t in stored[:6])
    heads = [torch.cat([r.unsqueeze(-1), u], dim=-1).transpose(1, 2) for r, u in ((rq, uq), (rk, uk), (rv, uv))]
    if stacked:
        qk, v = torch.cat(heads, dim=-2).split([2 * rq.shape[1], rq.shape[1]], dim=-2)
        return qk, v
    return torch.cat(heads[:2], dim=-2).contiguous(), heads[2].contiguous()


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("case", ["generic", "aligned", "identical", "dominant"])
def test_fused_attention_heads_is_the_fused_core_in_the_layers_layout(stacked, case):
    """:class:`FusedPolarAttentionHeads` on token-major heads: the output and every gradient bit for bit those of
    :func:`fused_polar_attention` on the transposed radius and direction views (the layouts autograd assembled
    before), over groups of samples whose last one is partial, with radii up to 12."""
    stored = make_inputs(batch=3, heads=2, n_q=12, n_k=12, dim=8, rmax=12.0, case=case, seed=5)
    scale = stored[6].double().requires_grad_(True)
    qk, v = (t.detach().requires_grad_(True) for t in _token_major(stored, stacked))
    with use_runtime_options(attention_group_elements=2 * 2 * 12 * 12):  # 2 samples per group, the last partial
        out = fused_attention.fused_polar_attention_heads(qk, v, scale, 1.3)
        q, keys = qk.chunk(2, dim=-2)
        views = [t.transpose(1, 2) for t in (q, keys, v)]
        r, u = fused_polar_attention(*(part for t in views for part in (t[..., 0], t[..., 1:])), scale, 1.3)
    reference = torch.cat([r.unsqueeze(-1), u], dim=-1).transpose(1, 2)
    assert out.shape == v.shape and out.is_contiguous() and torch.equal(out, reference)
    weights = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * weights).sum(), (qk, v, scale))
    want = torch.autograd.grad((reference * weights).sum(), (qk, v, scale))
    assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))
    assert torch.allclose(got[2], want[2], rtol=1e-14, atol=0)


@pytest.mark.parametrize("rmax", RADII)
def test_fused_attention_heads_gradcheck(rmax):
    stored = make_inputs(batch=2, heads=2, n_q=4, n_k=4, dim=4, rmax=rmax, seed=7)
    if rmax == 0.0:  # values at the origin: V = 0 and the output direction is undefined; keep them off it
        stored[4] = stored[4] + 0.3
    qk, v = (t.requires_grad_(True) for t in _token_major(stored, stacked=False))
    scale = stored[6].double().requires_grad_(True)
    assert gradcheck(lambda *a: fused_attention.fused_polar_attention_heads(*a, 1.3), (qk, v, scale))


def test_attention_group_backward_returns_the_pair_terms_it_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-pair terms the group backward returns last (so that a compiled kernel stores them where it evaluates
    Eq. 5) are ``sinh(a_i - b_j)`` and ``dD^2/dc`` with ``D = 2 asinh sqrt(c / 2)``: against ``torch.sinh`` and
    autograd's derivative in float64, at radii up to 12, and the caller keeps only the gradients."""
    args = [t.double().requires_grad_() for t in make_inputs(batch=2, heads=2, n_q=5, n_k=6, dim=4, rmax=12.0)]
    calls = []
    real = fused_attention.run_maybe_compiled

    def spy(fn, like, *rest, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a pass-through
        out = real(fn, like, *rest, **kwargs)
        if fn is fused_attention._attention_group_backward:
            calls.append((rest[0], out))
        return out

    monkeypatch.setattr(fused_attention, "run_maybe_compiled", spy)
    r, u = fused_polar_attention(*args)
    grads = torch.autograd.grad(r.sum() + u.square().sum(), args)
    assert len(calls) == 1 and len(grads) == len(calls[0][1]) - fused_attention.PAIR_TERMS
    rows, out = calls[0]
    sinh_x, slope = out[-fused_attention.PAIR_TERMS :]
    row = rows.scalars
    assert torch.allclose(sinh_x, torch.sinh(row.a.unsqueeze(-1) - row.b.unsqueeze(-2)), rtol=1e-13, atol=0)
    c = (2.0 * fused_attention.scaled_distances(fused_attention.pair_chords(rows.uq, rows.uk_t), rows).s_sq).detach()
    c.requires_grad_()
    (expected,) = torch.autograd.grad((4.0 * torch.asinh(torch.sqrt(0.5 * c)).square()).sum(), c)
    assert torch.allclose(slope, expected, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------------------------
# Polar-FC
# --------------------------------------------------------------------------------------------
def _random_polar_fc(
    out_features: int, k: float, heads: int | None, activation: str | None, rule: bool
) -> tuple[PolarFC, torch.Tensor, torch.Tensor]:
    """A float64 Polar-FC ``L^6 -> L^out`` with normal weights (and radius-rule parameters), and the radii and
    directions of six input tokens at radii 0 to 12, the last two identical."""
    fc = PolarFC(6, out_features, k, num_heads=heads, activation=activation, radius_rule=rule).double()
    torch.nn.init.normal_(fc.weight)
    if rule:
        for param in fc.rule_parameters():
            torch.nn.init.normal_(param, std=0.5)
    u = directions(6, 6)
    u[-1] = u[-2]  # identical tokens
    return fc, torch.tensor([0.0, 0.5, 4.0, 8.0, 12.0, 12.0], dtype=F64), u


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("rule", [True, False])
@pytest.mark.parametrize("heads", [None, 3])
def test_fused_polar_fc_matches_reference_and_gradcheck(activation, rule, heads):
    torch.manual_seed(0)
    k = 1.3
    fc, r, u = _random_polar_fc(4, k, heads, activation, rule)
    p = PolarOps.make(r, u).requires_grad_(True)
    ref, got = fc(p, PolarOps(k)), fc(p, FusedPolarOps(k))
    assert torch.allclose(got, ref, rtol=1e-13, atol=1e-13)
    weights = torch.randn_like(ref)
    params = [p, *fc.parameters()]
    for want, have in zip(
        torch.autograd.grad((ref * weights).sum(), params), torch.autograd.grad((got * weights).sum(), params)
    ):
        assert torch.allclose(have, want, rtol=1e-10, atol=1e-12 * want.abs().max())
    rule_args = list(fc.rule_parameters()) if rule else []
    assert gradcheck(
        lambda p, w, *extra: fused_polar_fc(
            p, w, tuple(extra) if rule else None, math.sqrt(k), heads or 1, fc.activation
        ),
        [p, fc.weight, *rule_args],
    )


def test_fused_polar_fc_with_all_zero_weights_gives_the_origin_with_finite_gradients():
    fc = PolarFC(5, 3, 1.0, num_heads=2).double()
    torch.nn.init.zeros_(fc.weight)
    p = PolarOps.make(torch.tensor([0.0, 4.0], dtype=F64), directions(2, 5)).requires_grad_(True)
    out = fc(p, FusedPolarOps(1.0))
    ref = fc(p, PolarOps(1.0))
    # h = 0: ln ||h|| is clamped at ln(1e-30), so the radius is ~1e-30 and the direction e_0
    assert torch.equal(out, ref) and torch.all(out[..., 0] < 1e-29) and torch.all(out[..., 1] == 1)
    grads = torch.autograd.grad(out.sum(), [p, *fc.parameters()])
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("rule", [True, False])
def test_polar_fc_gemm_padding_changes_no_value(rule, monkeypatch):
    """The unit coordinates and the weight are zero-padded to a multiple of GEMM_ALIGN (odd widths are slow in
    MKL): the padded and unpadded products agree in float64, forward and every gradient."""
    assert fused_layers.gemm_width(193) == 200 and fused_layers.gemm_width(192) == 192
    assert fused_layers.gemm_width(385) == 392
    torch.manual_seed(2)
    fc = PolarFC(9, 6, 1.0, num_heads=2, radius_rule=rule).double()  # n + 1 = 10: padded to 16
    p = PolarOps.make(radii(7, rmax=4.0), directions(7, 9)).requires_grad_(True)
    results = []
    for align in (8, 1):
        monkeypatch.setattr(fused_layers, "GEMM_ALIGN", align)
        out = fc(p, FusedPolarOps(1.0))
        results.append(
            (
                out,
                torch.autograd.grad(
                    (out * torch.linspace(-1, 1, out.shape[-1], dtype=F64)).sum(), [p, *fc.parameters()]
                ),
            )
        )
    (padded, g_padded), (plain, g_plain) = results
    assert torch.allclose(padded, plain, rtol=1e-13, atol=1e-15)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(g_padded, g_plain))


# --------------------------------------------------------------------------------------------
# gyro layer norm
# --------------------------------------------------------------------------------------------
def _gyro_norm_case(case: str, rmax: float, bias: float, k: float, origin: bool):
    """A float64 gyro layer norm (gain 0.3, bias point ``N(0, bias)``) and 2 x 6 tokens ``(r, u)`` in 5 dimensions at
    radii up to ``rmax`` (below 0.05 at ``rmax = 0``), the first at the origin where ``origin``; for ``identical``
    every token of a sample the same (zero dispersion: the centred tokens are rounding noise or zero)."""
    torch.manual_seed(1)
    norm = GyroLayerNorm(5, k, 1e-6).double()
    with torch.no_grad():
        norm.log_gain.fill_(0.3)
        norm.bias_point.normal_(0.0, bias) if bias else None
    r = radii(2, 6, rmax=rmax) if rmax > 0 else 0.05 * torch.rand(2, 6, dtype=F64)
    r[0, 0] = 0.0 if origin else r[0, 0]
    u = directions(2, 6, 5, case=case)
    if case == "identical":
        r[:], u[:] = r[:, :1], u[:, :1]
    return norm, r, u


@pytest.mark.parametrize("case", ["generic", "aligned", "identical"])
@pytest.mark.parametrize("rmax", RADII)
@pytest.mark.parametrize("bias", [0.0, 0.3, 3.0])  # at the origin, near it (Eq. 20), beyond (Eq. 21)
def test_fused_gyro_layer_norm_matches_reference_and_gradcheck(case, rmax, bias):
    k = 1.3
    norm, r, u = _gyro_norm_case(case, rmax, bias, k, origin=rmax == 0)
    p = PolarOps.make(r, u).requires_grad_(True)
    ref, got = norm(p, PolarOps(k)), norm(p, FusedPolarOps(k))
    space = lambda q: torch.sinh(q[..., :1] / math.sqrt(k)) * q[..., 1:]  # noqa: E731 - well defined at the origin
    # to the float64 resolution limit of the inputs, sinh(r) 2^-52 (Prop. 2), amplified by the normalisation;
    # identical tokens: the centred points are that rounding noise times gain / sqrt(eps)
    resolution = math.sinh(max(rmax, 1.0) / math.sqrt(k)) * 2.0**-52
    atol = max(1e-12 * float(space(ref).abs().max()), 100 * resolution) * (1e3 if case == "identical" else 1.0)
    err = float((space(got) - space(ref)).abs().max())
    assert torch.allclose(space(got), space(ref), rtol=1e-10, atol=atol), err
    weights = torch.randn_like(ref)
    params = [p, norm.log_gain, norm.bias_point]
    grads_ref = torch.autograd.grad((ref * weights).sum(), params)
    grads = torch.autograd.grad((got * weights).sum(), params)
    assert all(torch.isfinite(g).all() for g in grads)
    if case == "identical":
        return
    for want, have in zip(grads_ref, grads):
        assert torch.allclose(have, want, rtol=1e-10, atol=1e-10 * want.abs().max())
    # finite differences need a well-conditioned map: aligned tokens at r = 12 sit 1e-5 apart, so eps = 1e-2
    # (aligned tokens at r = 12: a step of 1e-6 moves a token by 1e-6 sinh(12) ~ 0.1, farther than the tokens
    # are apart, so finite differences say nothing there; the comparison with autograd above covers it)
    if not (case == "aligned" and rmax >= 12):
        assert gradcheck(lambda p, g, b: fused_gyro_layer_norm(p, g, b, k, 1e-2), params)


def test_fused_gyro_layer_norm_saves_no_token_wide_intermediate():
    """Backward rebuilds the token-by-coordinate intermediates: besides the input and the output, autograd
    keeps only per-token or per-sample scalars (and the two parameters)."""
    torch.manual_seed(3)
    batch, tokens, width = 3, 11, 24
    p = PolarOps.make(radii(batch, tokens, rmax=4.0), directions(batch, tokens, width)).float().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_gyro_layer_norm(
            p, torch.tensor(0.2, requires_grad=True), torch.zeros(width, requires_grad=True), 1.0, 1e-5
        )
    wide = {t.data_ptr() for t in saved if t.numel() >= batch * tokens * width}
    assert wide == {p.data_ptr(), out.data_ptr()}
    # the rest: per token (B, N), per sample (B,) or (B, n) (the centroid direction), or the parameters
    assert all(t.numel() <= max(batch * tokens, batch * width) for t in saved if t.data_ptr() not in wide)


@pytest.mark.parametrize("case", ["generic", "aligned", "identical"])
@pytest.mark.parametrize("rmax", RADII)
@pytest.mark.parametrize("bias", [0.3, 3.0])  # near the origin (Eq. 20), beyond (Eq. 21)
def test_gyro_layer_norm_backward_rebuilds_the_forward_intermediates_exactly(case, rmax, bias):
    """The backward's token-wide intermediates, rebuilt from the input, the output and the saved scalars (the
    centred directions from the saved ``||z1||``), are the forward's own, bit for bit in eager float64."""
    torch.manual_seed(4)
    r = radii(2, 6, rmax=rmax) if rmax > 0 else 0.05 * torch.rand(2, 6, dtype=F64)
    r[0, 0] = 0.0  # a token at the origin
    u = directions(2, 6, 5, case=case)
    if case == "identical":  # every token at the centroid: z1 is rounding noise or zero
        r[:], u[:] = r[:, :1], u[:, :1]
    p = PolarOps.make(r, u)
    log_gain, bias_point = torch.tensor(0.3, dtype=F64), bias * torch.randn(5, dtype=F64)
    out, scalars, wide = gyro_norm_forward(p, log_gain, bias_point, 1.3, 1e-6)
    rebuilt = rebuild_wide(p, out, scalars)
    flat = lambda w: [t for t in w if isinstance(t, torch.Tensor)]  # noqa: E731 - the tensors of a record
    pairs = list(zip(flat(rebuilt[:2]) + flat(rebuilt[3:5]), flat(wide[:2]) + flat(wide[3:5])))
    pairs += [(rebuilt.centring.d, wide.centring.d), (rebuilt.centring.v_perp, wide.centring.v_perp)]
    pairs += [(rebuilt.bias_d, wide.bias_d)]  # the bias step's d = u_y - s u1 (both forms of Eq. 20 share it)
    assert len(pairs) == 7
    assert all(torch.equal(got, want) for got, want in pairs)


@pytest.mark.parametrize("rmax", [0.5, 4.0, 8.0, 12.0])
def test_bias_step_forms_meet_on_the_unit_sphere_and_match_the_gyroaddition(rmax):
    """The bias point's gyroaddition switches form at ``|X| = 1`` (Eq. 20 directly within, the polar Eq. 21 beyond):
    the two agree there to float64 rounding, and each equals the reference gyroaddition, also for tokens aligned
    with and opposite to the bias point."""
    k = 1.3
    sk = math.sqrt(k)
    torch.manual_seed(5)
    b = radii(3, 8, rmax=rmax) / sk
    u_y = directions(3, 8, 6)
    direction = torch.nn.functional.normalize(torch.randn(6, dtype=F64), dim=0)
    u_y[0, 0], u_y[0, 1] = direction, -direction

    def z(norm):
        return bias_step(norm * sk * direction, b, u_y, sk)[0]

    below, above = z(1.0 - 1e-12), z(1.0 + 1e-12)
    scale = float(torch.sinh(b).max()) + 2.0  # (a step of 2e-12 in |X| moves z by up to 2e-12 (sinh b + cosh b))
    assert float((below - above).abs().max()) <= 1e-11 * scale
    for norm in (0.0, 0.5, 1.0 - 1e-12, 1.0 + 1e-12, 3.0):
        radius = torch.full((), math.asinh(norm) * sk, dtype=F64)
        r_out, u_out = P.geometry.gyroadd(radius, direction, b * sk, u_y, k)
        space = torch.sinh(r_out / sk).unsqueeze(-1) * u_out
        assert torch.allclose(z(norm), space, rtol=1e-12, atol=1e-12 * scale)


# --------------------------------------------------------------------------------------------
# relative position encodings
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["horoshift", "boost", "rotation"])
@pytest.mark.parametrize("rmax", RADII)
def test_fused_position_encoding_matches_reference_and_gradcheck(kind, rmax):
    k = 1.3
    encoding = RELATIVE_POSITION_CLASSES[kind](3, (0.5, 4.0)).double()
    r = radii(2, 5, 3, rmax=rmax)
    u = directions(2, 5, 3, 7, case="aligned" if rmax == 8.0 else "generic")
    u[1, 1, :, :] = torch.tensor([-1.0, 1e-3, 2e-3, 1e-3, 0.0, 0.0, 1e-3], dtype=F64)  # facing away from e_0
    u[1, 2, :, :] = torch.tensor([1.0, 1e-3, 3e-3, 1e-3, 1e-3, 0.0, 0.0], dtype=F64)  # towards the ideal point
    u = torch.nn.functional.normalize(u, dim=-1)
    p = PolarOps.make(r, u).requires_grad_(True)
    ref = encoding(p, (2, 2), 1, PolarOps(k))
    got = encoding(p, (2, 2), 1, FusedPolarOps(k))
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
    if rmax > 0:  # at r = 0 the reference's intermediate safe normalisation cuts the gradient (see fused_layers.py)
        weights = torch.randn_like(ref)
        for want, have in zip(
            torch.autograd.grad((ref * weights).sum(), [p, encoding.rates]),
            torch.autograd.grad((got * weights).sum(), [p, encoding.rates]),
        ):
            assert torch.allclose(have, want, rtol=1e-10, atol=1e-10 * want.abs().max())
    t_rows, t_cols = (t.detach().requires_grad_(True) for t in encoding.offsets((2, 2), 1, F64))
    shifted = PolarOps.make(r + 0.01, u).requires_grad_(True)  # central differences need r > 0
    assert gradcheck(
        lambda p, a, b: fused_reserved_axes_encoding(p, a, b, kind, math.sqrt(k)), [shifted, t_rows, t_cols]
    )


def test_fused_position_encoding_at_the_origin_differentiates_the_composition():
    """r = 0 exactly, one move on: the fused gradient is the one-sided finite difference."""
    encoding = RELATIVE_POSITION_CLASSES["boost"](1, (0.5, 4.0)).double()
    with torch.no_grad():
        encoding.rates.fill_(0.7)
    u = directions(1, 4, 1, 6)
    p = PolarOps.make(torch.zeros(1, 4, 1, dtype=F64), u).requires_grad_(True)
    weights = torch.randn(1, 4, 1, 7, dtype=F64)
    ops = FusedPolarOps(1.0)
    (grad,) = torch.autograd.grad((encoding(p, (2, 2), 0, ops) * weights).sum(), [p])
    step = 1e-7
    moved = p.detach().clone()
    moved[:, 1:, :, 0] += step  # tokens 1..3 are moved by the encoding; token 0 stays at the origin
    finite = ((encoding(moved, (2, 2), 0, ops) - encoding(p.detach(), (2, 2), 0, ops)) * weights).sum((-1, -2))
    assert torch.allclose(grad[:, 1:, 0, 0], finite[:, 1:] / step, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# boost residual (Eq. 12)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arithmetic", ["polar", "ambient"])
@pytest.mark.parametrize("case", ["generic", "aligned"])  # aligned: f along x, and one exactly opposite
@pytest.mark.parametrize("rmax", RADII)
@pytest.mark.parametrize("drop_path", [0.0, 0.5])
def test_fused_boost_residual_matches_reference_and_gradcheck(arithmetic, case, rmax, drop_path):
    """The fused boost residual (the step per token, every vector as coefficients on ``g, u, d``) against autograd
    through the reference layer in float64, at the origin, aligned and opposite directions, with and without
    stochastic depth; and gradcheck.  Ambient coordinates: central differences resolve radii from about 0.1 (the
    direction of a shorter ``x_s`` bends within the step) up to about 4 (coordinates of size ``cosh(r / sqrt(k))``);
    their outputs agree to 1e-12 of the largest coordinate."""
    k = 1.3
    torch.manual_seed(2)
    residual = BoostResidual(P.PolarViTConfig.from_preset("demo", k=k), drop_path).double().train()
    with torch.no_grad():
        residual.alpha.fill_(0.7)
    ops, fused_ops = (PolarOps(k), FusedPolarOps(k)) if arithmetic == "polar" else (AmbientOps(k), FusedAmbientOps(k))
    u = directions(2, 5, 6, case=case)
    x = ops.make(radii(2, 5, rmax=rmax), u).requires_grad_(True)
    f_dirs = directions(2, 5, 6, seed=3)
    if case == "aligned":
        f_dirs[:] = u[0, 0]
        f_dirs[1, 2] = -f_dirs[1, 2]
    f = ops.make(radii(2, 5, rmax=3.0, seed=4), f_dirs).requires_grad_(True)
    outputs, grads = [], []
    weights = None
    for chosen in (ops, fused_ops):
        torch.manual_seed(5)  # the same stochastic-depth draw
        out = residual(x, f, chosen)
        weights = torch.randn_like(out) if weights is None else weights
        outputs.append(out.detach())
        grads.append(torch.autograd.grad((out * weights).sum(), [x, f, residual.alpha]))
    rtol, atol = (1e-13, 1e-13) if arithmetic == "polar" else (1e-12, 1e-12 * float(outputs[0].abs().max()))
    assert torch.allclose(outputs[1], outputs[0], rtol=rtol, atol=atol)
    for want, have in zip(*grads):
        assert torch.allclose(have, want, rtol=1e-10, atol=1e-10 * want.abs().max())
    strength = torch.tensor([[2.0], [0.0]], dtype=F64) if drop_path else None
    if arithmetic == "polar":
        shifted, fused = ops.make(radii(2, 5, rmax=rmax) + 0.01, u), fused_boost_residual
    else:
        shifted, fused = ops.make(radii(2, 5, rmax=min(rmax, 4.0)) + 0.1, u), fused_ambient_boost_residual
    assert gradcheck(
        lambda x, f, alpha: fused(x, f, alpha, strength, math.sqrt(k) if arithmetic == "polar" else k),
        [shifted.requires_grad_(True), f, residual.alpha],
    )


@pytest.mark.parametrize("rmax", [0.5, 4.0, 8.0, 12.0])
def test_boost_residual_gradients_in_float32_are_accurate_at_large_steps(rmax):
    """Float32 gradients of the fused boost residual against float64, relative to each gradient's largest entry,
    where ``sigma = sinhc(omega) alpha b`` is large (long radii, stochastic depth strength 2): ``dL/dsigma`` is the
    component of the direction's cotangent along ``v_perp``, which ``D ~ sigma v_perp`` nearly annihilates, and
    ``cosh(omega)`` carries it into the gradients of ``b`` and ``alpha``.  Formed as a difference of the
    projection's terms it was rounding noise (relative 1e-5 to 8e-5 from r = 4 on); from one 2x2 determinant
    (:func:`fused_layers.boost_scalar_cotangents`) it is accurate to the rounding of its inputs."""
    x, f = (torch.cat([radii(2, 9, 1, rmax=rmax, seed=s), directions(2, 9, 16, seed=s)], -1) for s in (1, 2))
    alpha, strength = torch.tensor(0.7, dtype=F64), torch.tensor([[0.0], [2.0]], dtype=F64)
    weights = torch.linspace(-1.0, 1.0, x.numel(), dtype=F64).view_as(x)

    def gradients(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        leaves = [t.to(dtype).requires_grad_(True) for t in (x, f, alpha)]
        out = fused_boost_residual(*leaves, strength.to(dtype), 1.0)
        return torch.autograd.grad((out * weights.to(dtype)).sum(), leaves)

    for name, have, want in zip(("x", "f", "alpha"), gradients(torch.float32), gradients(F64)):
        err = float((have.double() - want).abs().max() / want.abs().max())
        assert err < 2e-6, (name, err)


def test_boost_residual_saves_only_its_inputs_and_writes_per_token_combinations():
    """Saved: the two inputs and ``alpha`` (no token-wide tensor of its own).  The forward kernel function returns
    the output, then the per-token terms (:class:`fused_layers.BoostTokens`: ``sinhc(omega)`` of the perpendicular
    step, 1 where ``f`` is along ``x``, and ``tanh a`` against torch at radii up to 12); the backward's gradients are
    those of the kernel function, whose direction gradients are ``c_g g + c_u u + c_d d`` with the per-token
    coefficients it returns last."""
    x = PolarOps.make(radii(2, 5, rmax=12.0), directions(2, 5, 6)).requires_grad_(True)
    f_dirs = directions(2, 5, 6, seed=3)
    f_dirs[0, 1] = x[0, 1, 1:].detach()  # aligned: no perpendicular step
    f = PolarOps.make(radii(2, 5, rmax=3.0, seed=4), f_dirs).requires_grad_(True)
    alpha = torch.tensor(0.7, dtype=F64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_boost_residual(x, f, alpha, None, 1.0)
    assert [t.data_ptr() for t in saved] == [x.data_ptr(), f.data_ptr(), alpha.data_ptr()]
    forward = fused_layers._boost_residual_forward(x.detach(), f.detach(), alpha.detach(), None, 1.0)
    assert torch.equal(forward[0], out)
    tok = forward[1]
    omega = tok.omega_sq.sqrt()
    assert (omega[0, 1] == 0).item() and (omega[1] > 0).all()
    sinhc = torch.where(omega > 0, torch.sinh(omega) / torch.where(omega > 0, omega, 1.0), 1.0)
    assert torch.allclose(tok.sinhc, sinhc, rtol=1e-13, atol=0)
    assert torch.allclose(tok.tanh_a, torch.tanh(x[..., 0].detach()), rtol=1e-14, atol=0)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad((out * grad).sum(), [x, f, alpha])
    backward = fused_layers._boost_residual_gradients(grad, x.detach(), f.detach(), alpha.detach(), None, 1.0)
    assert len(backward) == 3 + fused_layers.BOOST_TERMS
    assert all(torch.equal(a, b) for a, b in zip(grads, backward))
    u, v = x[..., 1:].detach(), f[..., 1:].detach()
    d = fused_layers.perp_difference(u, v, torch.where((u * v).sum(-1) >= 0, 1.0, -1.0).to(F64))
    for index, wide in ((3, backward[0]), (6, backward[1])):
        coefficients = fused_layers.BoostCoefficients(*backward[index : index + 3])
        assert torch.allclose(wide[..., 1:], coefficients.combine(grad[..., 1:], u, d), rtol=0, atol=1e-15)


# --------------------------------------------------------------------------------------------
# the ambient twin's fused layers
# --------------------------------------------------------------------------------------------
def test_fused_ambient_boost_residual_saves_only_its_inputs():
    """Saved: the two inputs and ``alpha`` (no token-wide tensor of its own); the forward kernel function returns
    the output, then the per-token terms, and the backward's gradients are those of the recomputation's
    coefficients: the vectors it writes are ``c_g g + c_u u + c_d d`` with the coefficients it returns last."""
    ops = AmbientOps(1.0)
    x = ops.make(radii(2, 5, rmax=8.0), directions(2, 5, 6)).requires_grad_(True)
    f = ops.make(radii(2, 5, rmax=3.0, seed=4), directions(2, 5, 6, seed=3)).requires_grad_(True)
    alpha = torch.tensor(0.7, dtype=F64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_ambient_boost_residual(x, f, alpha, None, 1.0)
    assert [t.data_ptr() for t in saved] == [x.data_ptr(), f.data_ptr(), alpha.data_ptr()]
    forward = fused_ambient.ambient_boost_residual_forward(x.detach(), f.detach(), alpha.detach(), None, 1.0)
    assert torch.equal(forward[0], out) and isinstance(forward[1], fused_layers.BoostTokens)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad((out * grad).sum(), [x, f, alpha])
    backward = fused_ambient.ambient_boost_residual_backward(grad, x.detach(), f.detach(), alpha.detach(), None, 1.0)
    assert len(backward) == 3 + fused_layers.BOOST_TERMS
    assert all(torch.equal(a, b) for a, b in zip(grads, backward))
    parts = fused_ambient.ambient_boost_parts(x.detach(), f.detach(), alpha.detach(), None, 1.0)
    cx = fused_layers.BoostCoefficients(*backward[3:6])
    assert torch.allclose(backward[0][..., 1:], cx.combine(grad[..., 1:], parts.u, parts.d), rtol=0, atol=1e-15)


def _ambient_points(case: str, rmax: float, batch=2, heads=3, n_q=6, n_k=7, dim=4, seed=0):
    """Ambient queries, keys and values ``(B, H, N, d+1)`` in float64 from stored polar inputs (:func:`make_inputs`),
    ``scale (H,)``."""
    rq, uq, rk, uk, rv, uv, scale = (
        t.double() for t in make_inputs(batch, heads, n_q, n_k, dim, rmax=rmax, seed=seed, case=case)
    )
    return (*(P.geometry.to_ambient(r, u) for r, u in ((rq, uq), (rk, uk), (rv, uv))), scale)


@pytest.mark.parametrize("case", ["generic", "aligned", "identical", "dominant"])
@pytest.mark.parametrize("rmax", RADII)
def test_fused_ambient_attention_matches_the_reference_and_gradcheck(case, rmax):
    """:class:`FusedAmbientAttention` against autograd through :meth:`AmbientOps.attention` in float64 (queries at
    the origin, identical keys, one-hot softmax), and gradcheck.  The two evaluation orders agree to the ambient
    formulas' own float64 conditioning, ``eps cosh^2 a`` (Proposition 1: ``-<x, y>_L`` cancels terms of size
    ``cosh^2 a``), with a margin of 64."""
    q, k, v, scale = _ambient_points(case, rmax)
    k[0, 0, 1] = q[0, 0, 1]  # a key exactly on a query: the floored arcosh argument
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, scale)]
    want = AmbientOps(1.3).attention(*leaves, "eager", False)[0]
    got = FusedAmbientOps(1.3).attention(*leaves, "eager", False)[0]
    rtol = max(1e-12, 64 * torch.finfo(F64).eps * math.cosh(rmax / math.sqrt(1.3)) ** 2)
    assert ((got - want).abs() <= rtol * want.abs().max()).all()
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    grads = torch.autograd.grad((got * weights).sum(), leaves)
    grads_ref = torch.autograd.grad((want * weights).sum(), leaves)
    overall = max(float(g.abs().max()) for g in grads_ref)  # for inputs whose exact gradient is 0
    for g_got, g_want in zip(grads, grads_ref):
        assert (g_got - g_want).abs().max() <= 100 * rtol * max(float(g_want.abs().max()), 1e-6 * overall)
    small = [
        t.detach().clone().requires_grad_(True) for t in _ambient_points(case, min(rmax, 4.0), 1, 2, 3, 4, 3, seed=1)
    ]
    assert gradcheck(lambda *a: fused_ambient_attention(*a, 1.3), small)


def test_fused_ambient_attention_groups_and_saves_nothing_quadratic():
    q, k, v, scale = (
        t.requires_grad_(True) for t in _ambient_points("generic", 4.0, batch=3, heads=2, n_q=12, n_k=12)
    )
    one = fused_ambient_attention(q, k, v, scale)
    g_one = torch.autograd.grad(one.sum(), (q, k, v, scale))
    sizes = []
    with (
        use_runtime_options(attention_group_elements=2 * 2 * 12 * 12),
        torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t),
    ):
        two = fused_ambient_attention(q, k, v, scale)
    g_two = torch.autograd.grad(two.sum(), (q, k, v, scale))
    assert max(sizes) < 12 * 12 * 6 and torch.equal(one, two)
    assert all(torch.allclose(a, b, rtol=1e-13, atol=1e-15) for a, b in zip(g_one, g_two))


@pytest.mark.parametrize("rmax", [0.5, 4.0, 12.0])
def test_fused_ambient_attention_heads_is_the_fused_core_in_the_layers_layout(rmax):
    """:class:`FusedAmbientAttentionHeads` on token-major heads (views of one stacked projection): the output and
    every gradient bit for bit those of :func:`fused_ambient_attention` on the transposed views, over groups whose
    last one is partial; and gradcheck."""
    q, k, v, scale = _ambient_points("generic", rmax, batch=3, heads=2, n_q=12, n_k=12)
    stacked = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=-2).requires_grad_(True)
    qk, values = stacked.split([4, 2], dim=-2)
    scale = scale.clone().requires_grad_(True)
    with use_runtime_options(attention_group_elements=2 * 2 * 12 * 12):
        out = fused_attention.fused_ambient_attention_heads(qk, values, scale, 1.3)
        reference = fused_ambient_attention(*fused_attention.head_major(qk, values), scale, 1.3).transpose(1, 2)
    assert out.is_contiguous() and torch.equal(out, reference)
    weights = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((out * weights).sum(), (stacked, scale))
    want = torch.autograd.grad((reference * weights).sum(), (stacked, scale))
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], rtol=1e-14, atol=0)
    small = [t.transpose(1, 2) for t in _ambient_points("generic", min(rmax, 4.0), 1, 2, 3, 3, 3, seed=1)[:3]]
    args = (torch.cat(small[:2], dim=-2).requires_grad_(True), small[2].clone().requires_grad_(True))
    small_scale = torch.tensor([0.7, 1.1], dtype=F64, requires_grad=True)
    assert gradcheck(lambda *a: fused_attention.fused_ambient_attention_heads(*a, 1.3), (*args, small_scale))


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("rule", [True, False])
def test_ambient_polar_fc_is_the_polar_one_in_ambient_coordinates_and_keeps_no_intermediates(activation, rule):
    """The ambient Polar-FC writes Eq. 8's output from its log-radius (``x_s = sqrt(k) e^l u'``, ``x_0 = sqrt(k)
    hypot(e^l, 1)``): in float64 it is ``to_ambient`` of the polar Polar-FC's output at radii 0 to 12, with zero
    weights (the origin) and identical tokens; the fused one equals it with gradcheck, and keeps for backward only
    its inputs (with the GELU: nothing of the size of its output), or without the GELU the input points, its output
    and ``||h|| / ||x_s||`` per head in place of the product, which backward rebuilds from them."""
    torch.manual_seed(3)
    k = 1.3
    fc, r, u = _random_polar_fc(8, k, 2, activation, rule)
    polar = PolarOps.make(r, u)
    ambient = AmbientOps(k).make(r, u).requires_grad_(True)
    want = AmbientOps(k).make(*PolarOps(k).polar(fc(polar, PolarOps(k))))
    ref = fc(ambient, AmbientOps(k))
    assert torch.allclose(ref, want, rtol=1e-13, atol=1e-13)
    parameters = {param.untyped_storage().data_ptr() for param in fc.parameters()}
    sizes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in parameters:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = fc(ambient, FusedAmbientOps(k))
    assert torch.allclose(got, ref, rtol=1e-13, atol=1e-13)
    product, heads = 6 * fc.weight.shape[0], 6 * 2  # (tokens x heads x head width), (tokens x heads)
    if activation is None:  # its output (which the next layer keeps) and ||h|| / ||x_s|| per head, not the product
        assert sorted(set(sizes)) == sorted({ambient.numel(), ref.numel(), heads}) and product not in sizes
    else:  # the pre-activation product, as autograd's matmul keeps it
        assert max(sizes) <= max(product, ambient.numel()) < ref.numel()
    weights = torch.randn_like(ref)
    params = [ambient, *fc.parameters()]
    for want_g, have in zip(
        torch.autograd.grad((ref * weights).sum(), params), torch.autograd.grad((got * weights).sum(), params)
    ):
        assert torch.allclose(have, want_g, rtol=1e-10, atol=1e-12 * want_g.abs().max())
    away = ambient[1:4].detach().requires_grad_(True)  # radii 0.5-8 (arcosh x_0 is not smooth at the origin)
    assert gradcheck(lambda x, w: fc(x, FusedAmbientOps(k)), [away, fc.weight])
    torch.nn.init.zeros_(fc.weight)  # h = 0: finite gradients; without the radius rule, the origin
    zero = fc(ambient, FusedAmbientOps(k))
    assert torch.allclose(zero, fc(ambient, AmbientOps(k)), rtol=1e-13, atol=1e-300)
    if not rule:
        assert torch.allclose(zero[..., 0], torch.full_like(zero[..., 0], math.sqrt(k)), rtol=1e-15, atol=0)
        assert zero[..., 1:].abs().max() < 1e-29
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(zero.sum(), params))


def test_ambient_polar_fc_whose_output_underflows_to_the_origin_has_the_references_gradients():
    """An ambient Polar-FC output whose ``e^l`` underflows (``x_s = 0``, a radius bias of ``-800`` in float64) has no
    direction left to rebuild the product from: the product is rebuilt as ``0`` there, and every gradient equals the
    reference's (zero where it carries ``e^l``), finite."""
    torch.manual_seed(3)
    fc, r, u = _random_polar_fc(8, 1.3, 2, None, True)
    with torch.no_grad():
        fc.radius_bias[0] = -800.0  # the first head: l < ln(tiny)
    x = AmbientOps(1.3).make(r, u).requires_grad_(True)
    params = [x, *fc.parameters()]
    grads = []
    for ops in (AmbientOps(1.3), FusedAmbientOps(1.3)):
        out = fc(x, ops)
        assert torch.equal(out[:, 0, 1:], torch.zeros_like(out[:, 0, 1:]))  # the first head at the origin
        grads.append(
            torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)).sum(), params)
        )
    for want, got in zip(*grads):
        assert torch.isfinite(got).all() and torch.allclose(got, want, rtol=1e-10, atol=1e-12 * want.abs().max())


def test_kernel_forms_are_within_their_ulp_bounds_and_eager_is_torch(monkeypatch):
    """``kernel_log1p`` / ``kernel_acosh`` (the forms inside compiled kernels, evaluated eagerly here with the
    compiling flag forced) against mpmath at float32, and exactly torch's functions eager."""
    x = torch.cat([torch.zeros(1), torch.logspace(-30, 1.9, 300), torch.rand(300) * 10, torch.tensor([88.0, 1e30])])
    assert torch.equal(kernel_log1p(x), torch.log1p(x)) and torch.equal(kernel_acosh(1.0 + x), torch.acosh(1.0 + x))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    ulp = 2.0**-23
    for fn, exact, arg, bound in ((kernel_log1p, mpmath.log1p, x, 1.4), (kernel_acosh, mpmath.acosh, 1.0 + x, 2.0)):
        got = fn(arg).double()
        want = torch.tensor([float(exact(mpmath.mpf(float(t)))) for t in arg], dtype=F64)
        assert torch.isfinite(got).all() and got[0] == 0.0  # exact at 0 (arcosh at 1)
        rel = ((got - want).abs() / want.abs().clamp_min(1e-300))[want != 0]
        assert rel.max() <= bound * ulp, (fn.__name__, float(rel.max() / ulp))


@pytest.mark.parametrize("case", ["generic", "aligned", "identical"])
@pytest.mark.parametrize("rmax", RADII)
@pytest.mark.parametrize("bias", [0.0, 0.3, 3.0])
def test_fused_ambient_gyro_layer_norm_matches_the_reference_and_gradcheck(case, rmax, bias):
    """:class:`FusedAmbientGyroLayerNorm` (hand-derived backward) against autograd through
    :meth:`ManifoldOps.gyro_layer_norm` with :class:`AmbientOps`, in float64 on stored polar inputs at radii 0 to 12
    (a token at the origin, aligned directions, identical tokens; the bias point at the origin, near it, beyond):
    the same formulas in the same order, so the output is the reference's bit for bit and every gradient agrees to
    1e-10 or to the reference's own resolution; gradcheck where finite differences are well conditioned."""
    k = 1.3
    norm, r, u = _gyro_norm_case(case, rmax, bias, k, origin=True)
    p = AmbientOps(k).make(r, u).requires_grad_(True)
    ref, got = norm(p, AmbientOps(k)), norm(p, FusedAmbientOps(k))
    assert torch.equal(got, ref)
    weights = torch.randn_like(ref)
    params = [p, norm.log_gain, norm.bias_point]
    grads = torch.autograd.grad((got * weights).sum(), params)
    assert all(torch.isfinite(g).all() for g in grads)
    if case == "identical":  # a centred token at the origin: arcosh of its time coordinate has no derivative
        return  # (autograd's gradient is NaN there; the fused one passes none through that token's radius)
    grads_ref = torch.autograd.grad((ref * weights).sum(), params)
    # the reference's own float64 resolution: how far its gradients move when each input coordinate moves by one
    # ulp (aligned tokens at r >= 8 are 1e-5 apart in coordinates of size e^r: there the ambient formulas lose
    # digits, ~1e-7 of the gradient at r = 12, and the two evaluation orders differ within that)
    gen = torch.Generator().manual_seed(7)
    ulp = 2.0**-52 * torch.randint(-1, 2, p.shape, generator=gen, dtype=F64)
    moved = (p.detach() * (1.0 + ulp)).requires_grad_(True)
    grads_moved = torch.autograd.grad((norm(moved, AmbientOps(k)) * weights).sum(), [moved, *params[1:]])
    for want, have, other in zip(grads_ref, grads, grads_moved):
        resolution = float((other - want).abs().max())
        assert (have - want).abs().max() <= 1e-10 * float(want.abs().max()) + resolution
    if rmax <= 4.0 and case == "generic":  # beyond, a step of 1e-6 in ambient coordinates is below their rounding
        leaves = [t.detach().requires_grad_(True) for t in params]
        assert gradcheck(lambda p, g, b: fused_ambient_gyro_layer_norm(p, g, b, k, 1e-2), leaves)


def test_fused_ambient_gyro_layer_norm_saves_no_token_wide_intermediate():
    """Backward rebuilds the centred and scaled tokens: besides the input and the output, autograd keeps only
    per-token or per-sample values (the centroid among them) and the two parameters."""
    torch.manual_seed(3)
    batch, tokens, width = 3, 11, 24
    p = AmbientOps(1.0).make(radii(batch, tokens, rmax=4.0), directions(batch, tokens, width)).float()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_ambient_gyro_layer_norm(
            p.requires_grad_(True),
            torch.tensor(0.2, requires_grad=True),
            torch.zeros(width, requires_grad=True),
            1.0,
            1e-5,
        )
    wide = {t.data_ptr() for t in saved if t.numel() >= batch * tokens * width}
    assert wide == {p.data_ptr(), out.data_ptr()}
    assert all(t.numel() <= max(batch * tokens, batch * (width + 1)) for t in saved if t.data_ptr() not in wide)


@pytest.mark.parametrize("kind", ["horoshift", "boost", "rotation"])
@pytest.mark.parametrize("rmax", RADII)
def test_fused_ambient_position_encoding_moves_only_the_reserved_coordinates_as_the_reference(kind, rmax):
    """The ambient twin's position encodings run on the time and the four reserved coordinates only
    (:class:`cpu_kernels.LeadingColumnsFunction`): in float64 the output is the reference's bit for bit and the
    gradients (of the points and of the rates) agree to 1e-12, at radii 0 to 12 with aligned directions; gradcheck;
    autograd keeps only the five moved columns of the input and the moves."""
    k = 1.3
    encoding = RELATIVE_POSITION_CLASSES[kind](3, (0.5, 4.0)).double()
    u = directions(2, 5, 3, 7, case="aligned" if rmax == 8.0 else "generic")
    p = AmbientOps(k).make(radii(2, 5, 3, rmax=rmax), u).requires_grad_(True)
    ref = encoding(p, (2, 2), 1, AmbientOps(k))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        got = encoding(p, (2, 2), 1, FusedAmbientOps(k))
    assert torch.equal(got, ref)
    assert [tuple(t.shape) for t in saved if t.dim() == 4] == [(2, 5, 3, 5)]  # (B, N, H, 5) of (B, N, H, 8)
    weights = torch.randn_like(ref)
    for want, have in zip(
        torch.autograd.grad((ref * weights).sum(), [p, encoding.rates]),
        torch.autograd.grad((got * weights).sum(), [p, encoding.rates]),
    ):
        assert torch.allclose(have, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))
    if rmax <= 4.0:
        leaves = [p.detach().requires_grad_(True), encoding.rates]
        assert gradcheck(lambda q, _: encoding(q, (2, 2), 1, FusedAmbientOps(k)), leaves)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(relative_position="boost"),
        dict(relative_position="rotation"),
        dict(drop_path_rate=0.3),
        dict(linear="lorentz"),  # no radius rule: the products' strided input gradients reach the layers alone
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default",
)
def test_fused_and_reference_ambient_models_agree_in_float64(overrides):
    torch.manual_seed(0)
    config = P.PolarViTConfig.from_preset("demo", arithmetic="ambient", **overrides)
    model = P.PolarViTForImageClassification(config).double().train()
    x, y = torch.randn(3, 3, 32, 32, dtype=F64), torch.tensor([1, 7, 3])
    torch.manual_seed(1)
    fused_logits, fused_grads = _logits_and_grads(model, x, y)
    model.config.fused_ops = False
    torch.manual_seed(1)
    ref_logits, ref_grads = _logits_and_grads(model, x, y)
    assert torch.allclose(fused_logits, ref_logits, rtol=1e-10, atol=1e-12)
    assert fused_grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        assert (fused_grads[name] - want).abs().max() <= 1e-10 * float(want.abs().max()) + 1e-300, name


@pytest.mark.parametrize("shape", [(4, 193), (2, 3, 385), (1, 8)], ids=str)
def test_gemm_width_product_is_the_product_with_its_input_gradient_at_an_aligned_width(shape):
    """:class:`fused_layers.GemmWidthProduct`: the forward bit for bit ``x W^T``; the input gradient a view of an
    output of :func:`fused_layers.gemm_width` columns, equal to autograd's (float32: the same sums; float64: to
    rounding), the weight's too; gradcheck and gradgradcheck in float64; under the bf16 policy the gradients of
    :func:`fused_layers.policy_matmul`'s own graph."""
    n = shape[-1]
    gen = torch.Generator().manual_seed(0)
    for dtype, policy in ((torch.float32, None), (F64, None), (torch.float32, torch.bfloat16)):
        x = torch.randn(shape, dtype=dtype, generator=gen).requires_grad_(True)
        w = torch.randn(6, n, dtype=dtype, generator=gen).requires_grad_(True)
        out = fused_layers.gemm_width_product(x, w, policy)
        want = fused_layers.policy_matmul(x, w.t(), policy)
        assert torch.equal(out, want)
        g = torch.randn(out.shape, dtype=dtype, generator=gen)
        got = torch.autograd.grad(out, (x, w), g)
        ref = torch.autograd.grad(want, (x, w), g)
        assert got[0].stride(-2) == fused_layers.gemm_width(n)
        rtol = 1e-13 if dtype == F64 else (1e-6 if policy is None else 1e-2)
        for a, b in zip(got, ref):
            assert ((a - b).abs() <= rtol * b.abs().max()).all()
    leaves = (torch.randn(shape, dtype=F64).requires_grad_(True), torch.randn(3, n, dtype=F64).requires_grad_(True))
    assert gradcheck(lambda a, b: fused_layers.gemm_width_product(a, b, None), leaves)
    assert torch.autograd.gradgradcheck(lambda a, b: fused_layers.gemm_width_product(a, b, None), leaves)


# --------------------------------------------------------------------------------------------
# whole models
# --------------------------------------------------------------------------------------------
def _logits_and_grads(model, x, y):
    model.zero_grad()
    out = model(x, labels=y)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", ["auto", "chunked"])
@pytest.mark.parametrize("overrides", SWITCHES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_fused_and_reference_models_agree_in_float64(overrides, attention):
    torch.manual_seed(0)
    config = P.PolarViTConfig.from_preset("demo", polar_attn_implementation=attention, **overrides)
    model = P.PolarViTForImageClassification(config).double().train()
    with torch.no_grad():  # leave the anchored initialisation so every term of every layer is exercised
        for name, param in model.named_parameters():
            if name.endswith(("radius_weight", "klein_weight", "radius_bias", "bias_point", "cls_token")):
                param.normal_(0.0, 0.1)
    x, y = torch.randn(3, 3, 32, 32, dtype=F64), torch.tensor([1, 7, 3])
    fused_logits, fused_grads = _logits_and_grads(model, x, y)
    model.config.fused_ops = False
    ref_logits, ref_grads = _logits_and_grads(model, x, y)
    assert torch.allclose(fused_logits, ref_logits, rtol=1e-10, atol=1e-12)
    assert fused_grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        scale = float(want.abs().max())
        assert (fused_grads[name] - want).abs().max() <= 1e-10 * scale + 1e-300, name


def test_fused_model_keeps_float32_close_to_float64():
    torch.manual_seed(0)
    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo"))
    x = torch.randn(2, 3, 32, 32)
    fused32 = model(x).logits
    fused64 = model.double()(x.double()).logits
    assert torch.allclose(fused32.double(), fused64, atol=1e-4, rtol=1e-4)


def test_fused_ops_switch_is_validated_and_read_at_call_time():
    with pytest.raises(ValueError, match="fused_ops"):
        P.PolarViTConfig.from_preset("demo", fused_ops="yes")
    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo"))
    assert isinstance(model.polar_vit.ops, FusedPolarOps)
    model.config.fused_ops = False
    assert type(model.polar_vit.ops) is PolarOps
    model.set_arithmetic("ambient")
    model.config.fused_ops = True
    assert not isinstance(model.polar_vit.ops, FusedPolarOps)  # ambient arithmetic is never fused


# --------------------------------------------------------------------------------------------
# validation at the edge
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
def test_model_validates_once_at_the_entry_not_in_every_operation(fused, monkeypatch):
    from polar_vit_hf.modeling import geometry, validation

    calls = []
    original = validation._values_checkable

    def counting(t):  # counts the checks that really scan their inputs
        checkable = original(t)
        if checkable:
            calls.append(tuple(t.shape))
        return checkable

    monkeypatch.setattr(validation, "_values_checkable", counting)
    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", fused_ops=fused))
    x = torch.randn(2, 3, 32, 32)
    model(x, labels=torch.tensor([0, 1])).loss.backward()
    assert len(calls) <= 4, calls  # the output views only (to_ambient / polar of the last tokens and the readout)
    with pytest.raises(ValueError, match="NaN or Inf"):
        model(x.masked_fill(x > 2, float("nan")))
    calls.clear()
    geometry.to_ambient(torch.ones(3), directions(3, 4).float())  # the public functions still validate
    assert calls


@pytest.mark.parametrize("scale", [255.0, 50.0])
def test_unnormalised_pixels_fail_at_the_entry_with_the_fix(scale):
    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo"))
    raw = torch.rand(2, 3, 32, 32) * scale if scale == 255.0 else torch.randn(2, 3, 32, 32) * scale
    with pytest.raises(ValueError, match=r"unnormalised.*RMS.*PolarViTImageProcessor"):
        model(raw)
    processor = P.PolarViTImageProcessor(size={"height": 32, "width": 32})
    images = [(torch.rand(32, 32, 3) * 255).to(torch.uint8).numpy() for _ in range(2)]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    assert torch.isfinite(model(pixels).logits).all()
    assert torch.isfinite(model(torch.randn(2, 3, 32, 32) * 20).logits).all()  # large but supported radii


@pytest.mark.parametrize("spread", [1.0, 1e-3, 1e-4, 0.0])
def test_pair_chords_round_to_the_exact_float32_chord_eager_and_compiled(spread):
    """The float64 inner-product chords (float32 inputs, eager) against the exact chord of the stored inputs,
    down to nearly equal (recomputed from differences) and equal directions; the compiled kernel's
    coordinate differences within a few ulp of every chord."""
    from polar_vit_hf.modeling.cpu_kernels import kernel
    from polar_vit_hf.modeling.fused_attention import CHORD_PRODUCT_ABOVE, pair_chords

    torch.manual_seed(1)
    base = directions(1, 16).float()
    u = torch.nn.functional.normalize(base + spread * torch.randn(3, 20, 16), dim=-1)
    v = torch.nn.functional.normalize(base + spread * torch.randn(3, 24, 16), dim=-1)
    got = pair_chords(u, v.transpose(-1, -2))
    compiled = kernel(pair_chords)(u, v.transpose(-1, -2).contiguous())
    exact = 0.5 * (u.double().unsqueeze(-2) - v.double().unsqueeze(-3)).square().sum(-1)
    product = exact >= CHORD_PRODUCT_ABOVE
    # correctly rounded where the product is used; a few ulp where the differences are summed in float32
    ulp = torch.finfo(torch.float32).eps
    assert torch.all((got.double() - exact).abs()[product] <= 0.5 * ulp * exact[product] * (1 + 1e-6))
    assert torch.all((got.double() - exact).abs()[~product] <= 8 * ulp * exact[~product])
    assert torch.all((compiled.double() - exact).abs() <= 8 * ulp * exact)
    assert (spread <= 1e-4) == bool((~product).any())
    if spread == 0.0:
        assert torch.equal(got, torch.zeros_like(got)) and torch.equal(compiled, torch.zeros_like(compiled))


@pytest.mark.parametrize("transposed", [False, True])
def test_narrow_product_is_the_batched_product_eager_and_compiled(transposed):
    """``narrow_product(a, b)`` is ``a @ b`` for the attention's pair weights (contiguous, or a transposed view as
    the backward passes them) and narrow operands of the head widths: within float32's rounding of each sum of
    products (float64 reference), the shape and values of ``a @ b``, eagerly and in a compiled kernel."""
    from polar_vit_hf.modeling.cpu_kernels import kernel
    from polar_vit_hf.modeling.fused_attention import narrow_product

    torch.manual_seed(2)
    for groups, rows, width in ((6, 65, 17), (3, 64, 18), (2, 33, 34), (1, 5, 1)):
        a = torch.rand(groups, rows, rows)
        a = a.transpose(-1, -2) if transposed else a
        b = torch.randn(groups, rows, width)
        exact = a.double() @ b.double()
        bound = 4 * rows * torch.finfo(torch.float32).eps * (a.double().abs() @ b.double().abs())
        for got in (narrow_product(a, b), kernel(narrow_product)(a, b)):
            assert got.shape == (groups, rows, width)
            assert torch.all((got.double() - exact).abs() <= bound)
        assert torch.allclose(narrow_product(a.double(), b.double()), exact, rtol=1e-13, atol=1e-13)


def test_stacked_qkv_projection_equals_the_three_polar_fcs_and_respects_hooks():
    """Fused, Q/K/V run as one stacked Polar-FC; a forward hook on one of them makes each run as itself."""
    torch.manual_seed(0)
    for merge in ("direct_concat", "beta_concat"):
        model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", head_merge=merge)).double()
        attention, ops = model.polar_vit.encoder[0].attention, model.polar_vit.ops
        p = ops.make(torch.rand(2, 5, dtype=F64) * 4, directions(2, 5, 48))
        stacked = attention.project(p, ops)
        seen = []
        handle = attention.k_proj.register_forward_hook(lambda module, args, out, seen=seen: seen.append(out))
        each = attention.project(p, ops)
        handle.remove()
        keys = each[0].chunk(2, dim=-1 if merge == "beta_concat" else -2)[1]  # queries and keys side by side
        assert len(seen) == 1 and torch.equal(seen[0], keys)
        for a, b in zip(stacked, each):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("arithmetic", ["polar", "ambient"])
@pytest.mark.parametrize("rmax", (*RADII, 30.0))
def test_fused_direct_concat_matches_the_reference_and_gradcheck(rmax, arithmetic):
    """Fused, the heads' direct concatenation (Sec. 4.2) runs as a FusedDirectConcat (hand-derived backward from
    its input alone) and in ambient coordinates as a SpaceToPoint (its output only kept): the same value and
    gradients as autograd through the reference, and gradcheck in float64, with every head of a token at the
    origin, one head at the origin and a token whose heads share one direction."""
    fused_ops, reference_ops = (FusedPolarOps, PolarOps) if arithmetic == "polar" else (FusedAmbientOps, AmbientOps)
    r = radii(2, 5, 3, rmax=rmax, seed=4)
    r[0, 0] = 0.0  # every head of one token at the origin
    r[1, 0, 1] = 0.0  # one head at the origin
    u = directions(2, 5, 3, 4, seed=4)
    u[1, 2] = u[1, 2, :1]  # aligned: the heads of one token share a direction
    p = reference_ops(0.8).make(r, u)  # (B, N, H, d+1)
    weights = torch.linspace(-1.0, 1.0, 2 * 5 * 13, dtype=F64).view(2, 5, 13)
    results = []
    for ops in (fused_ops, reference_ops):
        leaf = p.clone().requires_grad_(True)
        out = ops(0.8).concat_heads(leaf)
        (grad,) = torch.autograd.grad((out * weights).sum(), leaf)
        results.append((out.detach(), grad))
    (out_f, grad_f), (out_r, grad_r) = results
    assert torch.equal(out_f, out_r)
    assert torch.allclose(grad_f, grad_r, rtol=1e-12, atol=1e-14)
    if rmax > 0 and (arithmetic == "polar" or rmax <= 12):  # (x_0 ~ e^30: beyond finite differences)
        assert gradcheck(lambda t: fused_ops(0.8).concat_heads(t), [p[1:].clone().requires_grad_(True)])
    # in polar form it keeps its input alone; in ambient coordinates its output (which the output projection keeps)
    saved: list[torch.Tensor] = []
    leaf = p.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_ops(0.8).concat_heads(leaf)
    kept = [out] if arithmetic == "ambient" else [leaf]
    assert [t.untyped_storage().data_ptr() for t in saved] == [t.untyped_storage().data_ptr() for t in kept]


@pytest.mark.parametrize("rmax", (0.0, 1e-6, 1e-4, 0.5, 4.0, 8.0, 12.0, 30.0))
def test_direct_concat_float32_against_mpmath(rmax):
    """Float32 direct concatenation against a 40-digit evaluation on the same float32 inputs:
    ``R = sqrt(k) arsinh(sqrt(sum_h sinh^2 a_h))`` to 1e-6 relative and ``U = concat_h(sinh a_h u_h) / sinh(R /
    sqrt(k))`` to 1e-6 (unit vectors), at every radius; the smallest too, where the difference of two exponentials
    lost the digits of the radius (2 % at r = 1e-6).  Its gradients within 1e-5 of float64's."""
    k = 0.8
    r = radii(3, 4, rmax=rmax, seed=7).float()
    u = directions(3, 4, 5, seed=7).float()
    p = torch.cat([r.unsqueeze(-1), u], dim=-1)
    out = FusedPolarOps(k).concat_heads(p)
    with mpmath.workdps(40):
        sk = mpmath.sqrt(mpmath.mpf(k))
        for token in range(3):
            space = [
                mpmath.sinh(mpmath.mpf(float(r[token, h])) / sk) * mpmath.mpf(float(u[token, h, i]))
                for h in range(4)
                for i in range(5)
            ]
            n = mpmath.sqrt(sum(x * x for x in space))
            want_r = float(sk * mpmath.asinh(n))
            assert abs(float(out[token, 0]) - want_r) <= 1e-6 * want_r
            want_u = [float(x / n) if n > 0 else float(i == 0) for i, x in enumerate(space)]
            assert max(abs(float(got) - want) for got, want in zip(out[token, 1:], want_u)) <= 1e-6
    weights = torch.linspace(-1.0, 1.0, 21).expand(3, 21)
    grads = []
    for t in (p, p.double()):
        leaf = t.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad((FusedPolarOps(k).concat_heads(leaf) * weights.to(t.dtype)).sum(), leaf)
        grads.append(grad.double())
    assert (grads[0] - grads[1]).abs().max() <= 1e-5 * max(1.0, float(grads[1].abs().max()))
