"""Property-based checks (hypothesis) of the polar geometry in float64."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from polar_vit_hf import geometry as G
from polar_vit_hf.geometry import ambient as A

F64 = torch.float64
radius = st.floats(min_value=0.0, max_value=14.0, allow_nan=False)
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def point(r: float, seed: int, dim: int = 5):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(dim, dtype=F64, generator=gen)
    return torch.tensor(r, dtype=F64), u / u.norm()


@settings(max_examples=60, deadline=None)
@given(radius, radius, radius, seeds)
def test_distance_is_a_metric(ra, rb, rc, seed):
    a, b, c = point(ra, seed), point(rb, seed + 1), point(rc, seed + 2)
    dab, dbc, dac = G.distance(*a, *b), G.distance(*b, *c), G.distance(*a, *c)
    assert torch.isclose(dab, G.distance(*b, *a), rtol=1e-12, atol=1e-12)
    assert dac <= dab + dbc + 1e-9 * (1 + dab + dbc)
    assert torch.isclose(G.sq_distance(*a, *b), dab.square(), rtol=1e-9, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(radius, radius, seeds)
def test_gyroaddition_is_an_isometry(ra, rb, seed):
    """Left gyrotranslation x (+) . preserves distances."""
    x, y, z = point(ra, seed), point(rb, seed + 1), point(3.0, seed + 2)
    y2 = G.gyroadd(*x, *y)
    z2 = G.gyroadd(*x, *z)
    d0 = G.distance(*y, *z)
    assert torch.isclose(G.distance(*y2, *z2), d0, rtol=1e-8, atol=1e-8)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=2, max_size=6), seeds)
def test_centroid_is_the_normalised_weighted_sum(radii, seed):
    """At moderate radius the polar centroid equals Eq. 4 evaluated in float64."""
    gen = torch.Generator().manual_seed(seed)
    m = len(radii)
    r = torch.tensor(radii, dtype=F64) * 0.6
    u = torch.randn(m, 4, dtype=F64, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    w = torch.rand(2, m, dtype=F64, generator=gen) + 1e-3
    r_mu, u_mu = G.centroid(r, u, w)
    rx, ux = G.from_ambient(A.centroid(G.to_ambient(r, u), w))
    assert (G.distance(r_mu, u_mu, rx, ux) < 1e-8).all()


@settings(max_examples=40, deadline=None)
@given(radius, st.floats(-3.0, 3.0), st.floats(-3.0, 3.0), seeds)
def test_horoshift_relative_property(r0, m, m2, seed):
    q, kappa = point(min(r0, 8.0), seed), point(2.0, seed + 1)
    lhs = G.distance(*G.horoshift(*q, m, 0, 1), *G.horoshift(*kappa, m2, 0, 1))
    rhs = G.distance(*q, *G.horoshift(*kappa, m2 - m, 0, 1))
    assert torch.isclose(lhs, rhs, rtol=1e-8, atol=1e-8)
