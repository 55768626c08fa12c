"""HNN++ beta-split / beta-concatenation and Hypformer's learnable positional encoding.

beta-concat and beta-split (``geometry``, polar form) are checked in float64 against the HNN++
formulas evaluated literally in the Poincare ball with mpmath (50 digits), with ``gradcheck`` at
radii 0 to 12, against the ambient twins, and as switches of whole models
(``head_merge="beta_concat"``, ``position_embedding="hypformer"``, also in ``test_model.SWITCHES``).
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from torch.autograd import gradcheck

import polar_vit_hf as P
from polar_vit_hf.modeling import ambient
from polar_vit_hf.modeling.geometry import beta_coefficient, beta_concat, beta_split, from_ambient, to_ambient

F64 = torch.float64
RADII = (0.0, 0.5, 4.0, 8.0, 12.0)
mpmath.mp.dps = 50


def unit(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(*shape, generator=gen, dtype=F64), dim=-1)


def head_radii(rmax: float, heads: int = 3, seed: int = 0) -> torch.Tensor:
    """Per-head radii in ``[0.5 rmax, rmax]`` with the first head at the origin (a zero chunk)."""
    gen = torch.Generator().manual_seed(seed + 7)
    r = rmax * (0.5 + 0.5 * torch.rand(2, heads, generator=gen, dtype=F64))
    r[0, 0] = 0.0
    return r


# --------------------------------------------------------------------------------------------
# the HNN++ formulas, literally, in the Poincare ball of curvature -c (c = 1/k), with mpmath
# --------------------------------------------------------------------------------------------
def _ball(r, u, k):
    """Poincare ball coordinates of a polar point: ``sqrt(k) tanh(r / (2 sqrt(k))) u`` (``u`` renormalised in
    50 digits: near the boundary artanh would amplify its float64 norm error)."""
    sk = mpmath.sqrt(k)
    u = [mpmath.mpf(c) for c in u]
    norm = _norm(u)
    return [sk * mpmath.tanh(mpmath.mpf(r) / (2 * sk)) * c / norm for c in u] if norm else u


def _norm(v):
    return mpmath.sqrt(mpmath.fsum(c * c for c in v))


def _log0(x, c):
    """``log_0^c(x) = artanh(sqrt(c) |x|) x / (sqrt(c) |x|)`` (Ganea et al. 2018, HNN++)."""
    n, sc = _norm(x), mpmath.sqrt(c)
    return [mpmath.mpf(0)] * len(x) if n == 0 else [mpmath.atanh(sc * n) / (sc * n) * e for e in x]


def _exp0(v, c):
    """``exp_0^c(v) = tanh(sqrt(c) |v|) v / (sqrt(c) |v|)``."""
    n, sc = _norm(v), mpmath.sqrt(c)
    return [mpmath.mpf(0)] * len(v) if n == 0 else [mpmath.tanh(sc * n) / (sc * n) * e for e in v]


def _polar(y, k):
    """Geodesic radius ``2 sqrt(k) artanh(|y| / sqrt(k))`` and direction of a ball point."""
    n = _norm(y)
    sk = mpmath.sqrt(k)
    return 2 * sk * mpmath.atanh(n / sk), [e / n for e in y] if n else None


def hnn_beta_concat(r: torch.Tensor, u: torch.Tensor, k: float):
    """``exp_0(beta_n / beta_{n_i} log_0(x_i), ...)`` (HNN++ Sec. 3.3) for one token ``r (H,)``, ``u (H, d)``."""
    c = 1 / mpmath.mpf(k)
    heads, dim = u.shape
    beta = lambda n: mpmath.beta(mpmath.mpf(n) / 2, mpmath.mpf(1) / 2)  # noqa: E731
    v = []
    for h in range(heads):
        v += [beta(heads * dim) / beta(dim) * e for e in _log0(_ball(float(r[h]), u[h].tolist(), k), c)]
    return _polar(_exp0(v, c), k)


def hnn_beta_split(r: float, u: torch.Tensor, heads: int, k: float):
    """``exp_0(beta_{n_i} / beta_n v_i)`` for the chunks ``v_i`` of ``log_0(x)`` (HNN++ Sec. 3.3)."""
    c = 1 / mpmath.mpf(k)
    dim = u.shape[-1] // heads
    beta = lambda n: mpmath.beta(mpmath.mpf(n) / 2, mpmath.mpf(1) / 2)  # noqa: E731
    v = _log0(_ball(r, u.tolist(), k), c)
    return [
        _polar(_exp0([beta(dim) / beta(heads * dim) * e for e in v[h * dim : (h + 1) * dim]], c), k)
        for h in range(heads)
    ]


def test_beta_coefficient_is_the_beta_function():
    assert beta_coefficient(1) == pytest.approx(math.pi, rel=1e-14)  # B(1/2, 1/2)
    assert beta_coefficient(2) == pytest.approx(2.0, rel=1e-14)  # B(1, 1/2)
    assert beta_coefficient(3) == pytest.approx(math.pi / 2, rel=1e-14)
    for n in (4, 16, 192):
        assert beta_coefficient(n) == pytest.approx(float(mpmath.beta(n / 2, 0.5)), rel=1e-13)


@pytest.mark.parametrize("k", [1.0, 0.7])
@pytest.mark.parametrize("rmax", RADII)
def test_beta_concat_matches_the_hnn_formulas(rmax, k):
    r, u = head_radii(rmax), unit(2, 3, 4, seed=int(rmax))
    radius, direction = beta_concat(r, u)
    for token in range(2):
        want_r, want_u = hnn_beta_concat(r[token], u[token], k)
        assert abs(float(radius[token]) - float(want_r)) <= 1e-12 * max(1.0, float(want_r))
        if want_u is None:  # every head at the origin: the origin, direction e_0
            assert rmax == 0.0 and float(direction[token, 0]) == 1.0
        else:
            assert torch.allclose(
                direction[token], torch.tensor([float(e) for e in want_u], dtype=F64), rtol=0, atol=1e-13
            )


@pytest.mark.parametrize("rmax", RADII)
def test_beta_split_matches_the_hnn_formulas_and_inverts_beta_concat(rmax):
    heads, k = 3, 1.3
    r = torch.tensor([rmax, 0.6 * rmax], dtype=F64)
    u = unit(2, 12, seed=3)
    u[1, :4] = 0.0  # an empty chunk: that head is the origin
    u[1] = torch.nn.functional.normalize(u[1], dim=-1)
    r_h, u_h = beta_split(r, u, heads)
    for token in range(2):
        for h, (want_r, want_u) in enumerate(hnn_beta_split(float(r[token]), u[token], heads, k)):
            assert abs(float(r_h[token, h]) - float(want_r)) <= 1e-12 * max(1.0, float(want_r))
            if want_u is not None:
                assert torch.allclose(u_h[token, h], torch.tensor([float(e) for e in want_u], dtype=F64), atol=1e-13)
    back_r, back_u = beta_concat(r_h, u_h)
    assert torch.allclose(back_r, r, rtol=1e-13, atol=1e-14)
    if rmax > 0:
        assert torch.allclose(back_u, u, atol=1e-13)


@pytest.mark.parametrize("rmax", RADII)
def test_beta_concat_and_split_gradcheck(rmax):
    r = (head_radii(rmax) + (0.3 if rmax == 0.0 else 0.0)).requires_grad_(True)  # |r| is a cone at all-zero
    u = unit(2, 3, 4, seed=5).requires_grad_(True)
    assert gradcheck(lambda r, u: beta_concat(r, u), (r, u))
    point_r = torch.tensor([max(rmax, 0.3), 0.5 * max(rmax, 0.3)], dtype=F64, requires_grad=True)
    point_u = unit(2, 12, seed=6).requires_grad_(True)
    assert gradcheck(lambda r, u: beta_split(r, u, 3), (point_r, point_u))


def test_beta_concat_at_the_origin_has_finite_zero_gradients():
    r = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    u = unit(2, 3, 4).requires_grad_(True)
    radius, direction = beta_concat(r, u)
    assert torch.equal(radius, torch.zeros(2)) and torch.all(direction[:, 0] == 1.0)
    g_r, g_u = torch.autograd.grad(radius.sum() + direction.sum(), (r, u))
    assert torch.isfinite(g_r).all() and torch.isfinite(g_u).all()


@pytest.mark.parametrize("rmax", [0.5, 4.0, 8.0, 12.0])
def test_ambient_beta_concat_and_split_agree_with_polar_in_float64(rmax):
    k = 0.8
    r, u = head_radii(rmax) + 0.1, unit(2, 3, 4, seed=8)
    polar_point = to_ambient(*beta_concat(r, u), k)
    ambient_point = ambient.beta_concat(to_ambient(r, u, k), k)
    assert torch.allclose(ambient_point, polar_point, rtol=1e-10, atol=1e-10 * float(polar_point.abs().max()))
    split = ambient.beta_split(polar_point, 3, k)
    back_r, back_u = from_ambient(split, k)
    assert torch.allclose(back_r, r, rtol=1e-9)
    assert torch.allclose(back_u, u, atol=1e-9)


# --------------------------------------------------------------------------------------------
# the model switches
# --------------------------------------------------------------------------------------------
def model(**overrides) -> P.PolarViTForImageClassification:
    torch.manual_seed(0)
    return P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", **overrides))


def test_beta_concat_heads_project_with_one_polar_fc_per_projection():
    attention = model(head_merge="beta_concat").polar_vit.encoder[0].attention
    n = attention.config.hidden_size
    assert attention.q_proj.weight.shape == (n, n + 1) and attention.q_proj.num_heads is None
    default = model().polar_vit.encoder[0].attention
    assert default.q_proj.num_heads == default.num_heads
    with pytest.raises(ValueError, match="head_merge"):
        P.PolarViTConfig.from_preset("demo", head_merge="concat")


def test_hypformer_encoding_is_a_fixed_weight_midpoint_with_a_lorentz_fc():
    m = model(position_embedding="hypformer")
    encoding = m.polar_vit.embeddings.position_encoding
    assert m.polar_vit.embeddings.position_embeddings is None
    assert encoding.htc_linear.weight.abs().max() <= 0.02 and not encoding.htc_linear.radius_rule
    assert not any("epsilon" in name for name, _ in m.named_parameters())  # epsilon is not learned
    # epsilon = 0: the midpoint is x itself; epsilon > 0 moves the tokens
    x = torch.randn(2, 3, 32, 32, dtype=F64)
    m = m.double()
    ops = m.polar_vit.ops
    with torch.no_grad():
        patches = m.polar_vit.embeddings(x, ops)[0]
        encoding.epsilon = 0.0
        unchanged = m.polar_vit.embeddings(x, ops)[0]
        encoding.epsilon = 1.0
    assert not torch.allclose(patches, unchanged)
    with torch.no_grad():
        raw = unchanged  # epsilon = 0: the tokens before the encoding (to rounding)
        want = ops.centroid(
            torch.stack([raw, encoding.htc_linear(raw, ops)], dim=-2),
            raw.new_tensor([1.0, 1.0]).expand(*raw.shape[:-1], 1, 2),
        ).squeeze(-2)
    assert torch.allclose(patches, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("epsilon", [-0.5, float("nan"), "1"])
def test_hypformer_epsilon_must_be_a_non_negative_number(epsilon):
    with pytest.raises(ValueError, match="hypformer_epsilon"):
        P.PolarViTConfig.from_preset("demo", position_embedding="hypformer", hypformer_epsilon=epsilon)


@pytest.mark.parametrize("overrides", [dict(head_merge="beta_concat"), dict(position_embedding="hypformer")])
def test_seed_switches_save_and_reload(tmp_path, overrides):
    m = model(**overrides).eval()
    m.save_pretrained(tmp_path)
    loaded = P.PolarViTForImageClassification.from_pretrained(tmp_path).eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(m(x).logits, loaded(x).logits)
