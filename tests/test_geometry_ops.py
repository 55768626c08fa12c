"""Polar geometry: agreement with the ambient twins, gradients, edge cases and input errors."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import near, random_points, unit
from torch.autograd import gradcheck

from polar_vit_hf import geometry as G
from polar_vit_hf.geometry import ambient as A

F64 = torch.float64
KS = [1.0, 0.37, 2.5]


def geodesic(r1, u1, r2, u2, k):
    return G.distance(r1, u1, r2, u2, k)


def from_amb(x, k):
    return G.from_ambient(x, k)


# --------------------------------------------------------------------------------------------
# float64: every polar op agrees with its ambient twin to 1e-10 at r <= 6
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", KS)
class TestAgreesWithAmbientFloat64:
    """Radii up to 6 in units of sqrt(k) (the rescaled radius ``a <= 6``)."""

    @pytest.fixture(autouse=True)
    def _points(self, k):
        gen = torch.Generator().manual_seed(1)
        rmax = 6.0 * min(1.0, math.sqrt(k))
        self.r1, self.u1 = random_points(64, dim=10, rmax=rmax, generator=gen)
        self.r2, self.u2 = random_points(64, dim=10, rmax=rmax, generator=gen)

    def amb(self, k):
        return G.to_ambient(self.r1, self.u1, k), G.to_ambient(self.r2, self.u2, k)

    def test_coordinates_round_trip(self, k):
        x, _ = self.amb(k)
        assert torch.allclose(A.inner(x, x), torch.full_like(self.r1, -k), rtol=0, atol=1e-9)
        r, u = G.from_ambient(x, k)
        assert torch.allclose(r, self.r1, atol=1e-12)
        assert torch.allclose(u, self.u1, atol=1e-12)

    def test_sq_distance(self, k):
        x, y = self.amb(k)
        ref = A.sq_distance(x, y, k)
        assert torch.allclose(G.sq_distance(self.r1, self.u1, self.r2, self.u2, k), ref, rtol=1e-10, atol=1e-10)
        pair = G.pairwise_sq_distance(self.r1, self.u1, self.r2, self.u2, k)
        assert torch.allclose(pair, A.pairwise_sq_distance(x, y, k), rtol=1e-10, atol=1e-10)
        assert torch.allclose(G.distance(self.r1, self.u1, self.r2, self.u2, k), A.distance(x, y, k), rtol=1e-10)
        # the keys' time coordinates given apart (the fused kernels' contiguous copy): the same values, bit for bit
        inner = A.pairwise_minus_inner(x, y)
        assert torch.equal(A.pairwise_minus_inner(x, y, y[..., 0].contiguous()), inner)
        assert -inner[..., 0, 1] == pytest.approx(A.inner(x[..., 0, :], y[..., 1, :]).item(), rel=1e-12)

    def test_centroid(self, k):
        x, _ = self.amb(k)
        w = torch.rand(5, 64, dtype=F64)
        r, u = G.centroid(self.r1, self.u1, w, k)
        rx, ux = from_amb(A.centroid(x, w, k), k)
        assert geodesic(r, u, rx, ux, k).max() < 1e-10

    def test_gyroadd_and_centring(self, k):
        x, y = self.amb(k)
        r, u = G.gyroadd(self.r1, self.u1, self.r2, self.u2, k)
        rx, ux = from_amb(A.gyroadd(x, y, k), k)
        assert geodesic(r, u, rx, ux, k).max() < 1e-10
        r, u = G.gyrocenter(self.r1, self.u1, self.r2, self.u2, k)
        rx, ux = from_amb(A.gyroadd(G.to_ambient(*G.gyroneg(self.r1, self.u1), k), y, k), k)
        assert geodesic(r, u, rx, ux, k).max() < 1e-10

    def test_tangent_ops(self, k):
        x, y = self.amb(k)
        xi_r, xi_perp = G.logmap(self.r1, self.u1, self.r2, self.u2, k)
        xi = A.tangent_from_polar(self.r1, self.u1, xi_r, xi_perp, k)
        ref = A.logmap(x, y, k)
        scale = 1.0 + ref.abs().amax(-1)
        assert ((xi - ref).abs().amax(-1) / scale).max() < 1e-10
        # Eq. 14: the frame inner product equals the Lorentzian one
        assert torch.allclose(G.tangent_inner(xi_r, xi_perp, xi_r, xi_perp), A.inner(xi, xi), rtol=1e-9)
        # exp (outward and inward steps of length <= 2) against the ambient exponential map
        gen = torch.Generator().manual_seed(7)
        xi_r = 2.0 * torch.rand(64, dtype=F64, generator=gen) - 1.0
        xi_perp = torch.randn(64, 10, dtype=F64, generator=gen)
        xi_perp = xi_perp - (xi_perp * self.u1).sum(-1, keepdim=True) * self.u1
        xi_perp = xi_perp * (torch.rand(64, 1, dtype=F64, generator=gen) / xi_perp.norm(dim=-1, keepdim=True))
        xi = A.tangent_from_polar(self.r1, self.u1, xi_r, xi_perp, k)
        for sign in (1.0, -1.0):
            r, u = G.expmap(self.r1, self.u1, sign * xi_r, xi_perp, k)
            tangent = A.tangent_from_polar(self.r1, self.u1, sign * xi_r, xi_perp, k)
            rx, ux = from_amb(A.expmap(x, tangent, k), k)
            assert geodesic(r, u, rx, ux, k).max() < 1e-10
        # transport
        z_r, z_perp = G.transport(self.r1, self.u1, self.r2, self.u2, xi_r, xi_perp, k)
        z = A.tangent_from_polar(self.r2, self.u2, z_r, z_perp, k)
        ref = A.transport(x, y, xi, k)
        assert ((z - ref).abs().amax(-1) / (1.0 + ref.abs().amax(-1))).max() < 1e-10
        # gradient projection, Eq. 15, with a non-zero time gradient too
        g = torch.randn(64, 11, dtype=F64)
        p_r, p_perp = G.project_grad(self.r1, self.u1, g[:, 0], g[:, 1:], k)
        ref = A.project_grad(x, g, k)
        got = A.tangent_from_polar(self.r1, self.u1, p_r, p_perp, k)
        assert ((got - ref).abs().amax(-1) / (1.0 + ref.abs().amax(-1))).max() < 1e-10

    def test_horoshift(self, k):
        x, _ = self.amb(k)
        t = torch.linspace(-2.0, 2.0, 64, dtype=F64)
        assert torch.allclose(G.busemann_nu(self.r1, self.u1, 3, k), A.busemann_nu(x, 3), rtol=1e-10)
        r, u = G.horoshift(self.r1, self.u1, t, 3, 7, k)
        rx, ux = from_amb(A.horoshift(x, t, 3, 7, k), k)
        assert geodesic(r, u, rx, ux, k).max() < 1e-10

    def test_boost(self, k):
        x, _ = self.amb(k)
        t = torch.linspace(-2.0, 2.0, 64, dtype=F64)
        r, u = G.boost(self.r1, self.u1, t, 4, k)
        rx, ux = from_amb(A.boost(x, t, 4, k), k)
        assert geodesic(r, u, rx, ux, k).max() < 1e-10
        assert (r - self.r1).abs().max() > 0.1  # the boost moved the points

    def test_rotate(self, k):
        x, _ = self.amb(k)
        t = torch.linspace(-3.0, 3.0, 64, dtype=F64)
        r, u = G.rotate(self.r1, self.u1, t, 2, 5)
        rx, ux = from_amb(A.rotate(x, t, 2, 5), k)
        assert geodesic(r, u, rx, ux, k).max() < 1e-10
        assert torch.allclose(r, self.r1, rtol=0, atol=0)  # a rotation keeps the radius exactly
        assert (u - self.u1).abs().max() > 0.1

    def test_direct_concat(self, k):
        heads = 4
        r = self.r1.reshape(16, heads)
        u = self.u1.reshape(16, heads, 10)
        rc, uc = G.direct_concat(r, u, k)
        rx, ux = from_amb(A.direct_concat(G.to_ambient(r, u, k), k), k)
        assert geodesic(rc, uc, rx, ux, k).max() < 1e-10
        assert rc.shape == (16,) and uc.shape == (16, heads * 10)
        # the space parts are concatenated: sinh a u = concat_h(sinh a_h u_h)
        assert torch.allclose(G.space(rc, uc, k), G.space(r, u, k).flatten(-2), rtol=1e-10, atol=1e-10)

    def test_gyroadd_space(self, k):
        x, y = self.amb(k)
        bias = A.from_space(x[..., 1:], k)[..., 1:]  # space coordinates of a bias point
        r, u = G.gyroadd_space(bias, self.r2, self.u2, k)
        rx, ux = from_amb(A.gyroadd(A.from_space(bias, k), y, k), k)
        assert geodesic(r, u, rx, ux, k).max() < 1e-10
        r0, u0 = G.gyroadd_space(torch.zeros_like(bias), self.r2, self.u2, k)  # the origin is the identity
        assert geodesic(r0, u0, self.r2, self.u2, k).max() < 1e-10


# --------------------------------------------------------------------------------------------
# identities and properties
# --------------------------------------------------------------------------------------------
def test_exp_log_round_trip_and_transport_isometry():
    gen = torch.Generator().manual_seed(2)
    r1, u1 = random_points(50, dim=6, rmax=10.0, generator=gen)
    r2, u2 = random_points(50, dim=6, rmax=10.0, generator=gen)
    xi_r, xi_perp = G.logmap(r1, u1, r2, u2)
    r, u = G.expmap(r1, u1, xi_r, xi_perp)
    assert G.distance(r, u, r2, u2).max() < 1e-8
    # |log_x y| = d(x, y)
    assert torch.allclose(G.tangent_inner(xi_r, xi_perp, xi_r, xi_perp).sqrt(), G.distance(r1, u1, r2, u2), rtol=1e-9)
    # transport preserves the norm
    z_r, z_perp = G.transport(r1, u1, r2, u2, xi_r, xi_perp)
    assert torch.allclose(
        G.tangent_inner(z_r, z_perp, z_r, z_perp), G.tangent_inner(xi_r, xi_perp, xi_r, xi_perp), rtol=1e-8
    )


def test_gyro_left_cancellation():
    gen = torch.Generator().manual_seed(3)
    r1, u1 = random_points(40, dim=5, rmax=6.0, generator=gen)
    r2, u2 = random_points(40, dim=5, rmax=6.0, generator=gen)
    r, u = G.gyroadd(r1, u1, r2, u2)
    back_r, back_u = G.gyroadd(*G.gyroneg(r1, u1), r, u)
    assert G.distance(back_r, back_u, r2, u2).max() < 1e-9
    # the centring of a point by itself is the origin
    r0, _ = G.gyrocenter(r1, u1, r1, u1)
    assert r0.abs().max() < 1e-9


def test_centroid_weight_scale_invariance_and_single_point():
    r, u = random_points(7, dim=4, rmax=9.0)
    w = torch.rand(3, 7, dtype=F64)
    r1, u1 = G.centroid(r, u, w)
    r2, u2 = G.centroid(r, u, 1e3 * w)
    assert G.distance(r1, u1, r2, u2).max() < 1e-9
    one_hot = torch.eye(7, dtype=F64)
    rc, uc = G.centroid(r, u, one_hot)
    assert G.distance(rc, uc, r, u).max() < 1e-9


def test_centroid_zero_weight_rows_give_origin_with_finite_gradients():
    r, u = random_points(6, dim=4, rmax=5.0)
    r.requires_grad_(True)
    u.requires_grad_(True)
    w = torch.rand(4, 6, dtype=F64)
    w[1] = 0.0
    w[3] = 0.0
    w.requires_grad_(True)
    r_mu, u_mu = G.centroid(r, u, w)
    assert r_mu[1] == 0 and r_mu[3] == 0
    assert torch.isfinite(u_mu).all()
    (r_mu.sum() + u_mu.sum()).backward()
    for t in (r, u, w):
        assert torch.isfinite(t.grad).all()
    assert (w.grad[1] == 0).all() and (w.grad[3] == 0).all()


def test_centroid_of_points_all_at_origin():
    r = torch.zeros(5, dtype=F64, requires_grad=True)
    u = unit(torch.randn(5, 3, dtype=F64))
    r_mu, u_mu = G.centroid(r, u, torch.ones(2, 5, dtype=F64))
    assert (r_mu == 0).all() and torch.isfinite(u_mu).all()
    r_mu.sum().backward()
    assert torch.isfinite(r.grad).all()


def test_distance_edge_cases():
    r, u = random_points(10, dim=3, rmax=12.0)
    # identical points: zero distance, finite (zero) gradient
    rr = r.clone().requires_grad_(True)
    d2 = G.sq_distance(rr, u, rr, u)
    assert (d2 == 0).all()
    d2.sum().backward()
    assert torch.isfinite(rr.grad).all()
    d = G.distance(rr, u, rr, u)
    assert (d == 0).all()
    # same direction: |r1 - r2|; through the origin: r1 + r2
    r2 = torch.rand(10, dtype=F64) * 12
    assert torch.allclose(G.distance(r, u, r2, u), (r - r2).abs(), atol=1e-9)
    assert torch.allclose(G.distance(r, u, r2, -u), r + r2, rtol=1e-12)
    # the origin: distance is the radius whatever the direction
    other = unit(torch.randn(10, 3, dtype=F64))
    assert torch.allclose(G.distance(torch.zeros_like(r), other, r, u), r, rtol=1e-12)


def test_asinh_exp_is_accurate_everywhere():
    ell = torch.tensor([-300.0, -40.0, -1.0, 0.0, 1e-9, 1.0, 20.0, 80.0, 500.0], dtype=F64)
    ref = [math.asinh(math.exp(v)) if v < 700 else v + math.log(2.0) for v in ell.tolist()]
    assert torch.allclose(G.asinh_exp(ell), torch.tensor(ref, dtype=F64), rtol=1e-14, atol=0)
    out32 = G.asinh_exp(torch.tensor([200.0], requires_grad=True))
    assert torch.isfinite(out32).all()


# --------------------------------------------------------------------------------------------
# horospherical shift (Eq. 10, 11, Appendix C)
# --------------------------------------------------------------------------------------------
class TestHoroshift:
    def setup_method(self):
        gen = torch.Generator().manual_seed(4)
        self.r, self.u = random_points(32, dim=6, rmax=7.0, generator=gen)
        self.r2, self.u2 = random_points(32, dim=6, rmax=7.0, generator=gen)

    def test_isometry_and_busemann_invariance(self):
        for t in (0.3, -1.7, 5.0):
            ra, ua = G.horoshift(self.r, self.u, t, 0, 1)
            rb, ub = G.horoshift(self.r2, self.u2, t, 0, 1)
            assert torch.allclose(G.distance(ra, ua, rb, ub), G.distance(self.r, self.u, self.r2, self.u2), rtol=1e-9)
            assert torch.allclose(G.busemann_nu(ra, ua, 0), G.busemann_nu(self.r, self.u, 0), rtol=1e-10)

    @pytest.mark.parametrize("k", KS)
    def test_distance_law_eq_11(self, k):
        t = torch.linspace(0.0, 50.0, 32, dtype=F64)
        rs, us = G.horoshift(self.r, self.u, t, 2, 4, k)
        nu = G.busemann_nu(self.r, self.u, 2, k)
        expected = 2.0 * math.sqrt(k) * torch.asinh(t * nu / (2.0 * math.sqrt(k)))
        assert torch.allclose(G.distance(self.r, self.u, rs, us, k), expected, rtol=1e-9, atol=1e-12)
        # at the origin nu = sqrt(k)
        origin_nu = G.busemann_nu(torch.zeros(1, dtype=F64), self.u[:1], 2, k)
        assert torch.allclose(origin_nu, torch.full_like(origin_nu, math.sqrt(k)))

    def test_group_and_relative_property(self):
        ra, ua = G.horoshift(*G.horoshift(self.r, self.u, 0.4, 1, 3), 1.1, 1, 3)
        rb, ub = G.horoshift(self.r, self.u, 1.5, 1, 3)
        assert G.distance(ra, ua, rb, ub).max() < 1e-9
        # d(Phi(m) q, Phi(m') kappa) = d(q, Phi(m' - m) kappa) along one axis
        for m, m2 in ((0.0, 2.0), (1.0, 3.0), (-2.5, 0.5), (3.0, -1.0)):
            lhs = G.distance(*G.horoshift(self.r, self.u, m, 1, 3), *G.horoshift(self.r2, self.u2, m2, 1, 3))
            rhs = G.distance(self.r, self.u, *G.horoshift(self.r2, self.u2, m2 - m, 1, 3))
            assert torch.allclose(lhs, rhs, rtol=1e-9)

    @pytest.mark.parametrize("radius", [12.0, 16.0])
    def test_float32_stays_accurate_at_large_radius(self, radius):
        gen = torch.Generator().manual_seed(5)
        u = unit(torch.randn(64, 6, dtype=F64, generator=gen))
        u[:16] = near(torch.eye(6, dtype=F64)[0].expand(16, 6), 1e-3, gen)  # near the ideal point
        r = torch.full((64,), radius, dtype=F64)
        t = torch.linspace(0.05, 3.0, 64, dtype=F64)
        # float32 against float64 on the same stored float32 inputs: within Proposition 2's bound
        r32, u32 = r.float(), u.float()
        ref_r, ref_u = G.horoshift(r32.double(), u32.double(), t, 0, 1)
        got_r, got_u = G.horoshift(r32, u32, t.float(), 0, 1)
        err = G.distance(got_r.double(), got_u.double(), ref_r, ref_u)
        limit = torch.sinh(torch.maximum(ref_r, r)) * 2.0**-24
        assert (err <= 8 * limit + 1e-5).all()
        # the distance law (Eq. 11) measured in float32: polar keeps it, ambient loses it
        nu = G.busemann_nu(r32.double(), u32.double(), 0)
        law = 2.0 * torch.asinh(t * nu / 2.0)
        polar_d = G.distance(r32, u32, got_r, got_u).double()
        assert ((polar_d - law).abs() <= 8 * limit + 1e-5).all()
        x32 = G.to_ambient(r32.double(), u32.double()).float()
        amb_d = A.distance(x32, A.horoshift(x32, t.float(), 0, 1)).double()
        assert (amb_d - law)[:16].abs().max() > 1.0  # near the ideal point ambient is off by > 1


# --------------------------------------------------------------------------------------------
# gradients (float64 gradcheck, including r = 0 and aligned directions)
# --------------------------------------------------------------------------------------------
def _leaf(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _points_for_grad(n: int, dim: int, with_origin: bool, aligned: bool, seed: int, rmax: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    r, u = random_points(n, dim=dim, rmax=rmax, generator=gen)
    r = r + 0.2
    if with_origin:
        r[0] = 0.0
    if aligned:
        u = u[:1].expand_as(u).clone()
    return r, u


CASES = [
    pytest.param(False, False, id="generic"),
    pytest.param(True, False, id="origin"),
    pytest.param(False, True, id="aligned"),
]


@pytest.mark.parametrize("with_origin,aligned", CASES)
def test_gradcheck_distances(with_origin, aligned):
    r1, u1 = _points_for_grad(4, 3, with_origin, aligned, 10)
    r2, u2 = _points_for_grad(4, 3, False, aligned, 11)
    args = _leaf(r1, u1, r2, u2)
    assert gradcheck(lambda *a: G.sq_distance(*a, k=1.3), args)
    assert gradcheck(lambda *a: G.pairwise_sq_distance(*a, k=0.7), args)
    if not aligned:
        assert gradcheck(lambda *a: G.distance(*a, k=1.3), args)
    assert gradcheck(lambda a, b: G.pairwise_chord(a, b), _leaf(u1, u2))


@pytest.mark.parametrize("with_origin,aligned", CASES)
def test_gradcheck_centroid(with_origin, aligned):
    r, u = _points_for_grad(5, 3, with_origin, aligned, 12)
    w = torch.rand(3, 5, dtype=F64) + 0.1
    assert gradcheck(lambda *a: G.centroid(*a, k=1.7), _leaf(r, u, w))
    # large radius too (float64 is exact there)
    assert gradcheck(lambda *a: G.centroid(*a), _leaf(r + 9.0, u, w))


@pytest.mark.parametrize("with_origin,aligned", CASES)
def test_gradcheck_gyro(with_origin, aligned):
    r1, u1 = _points_for_grad(4, 3, with_origin, aligned, 13)
    r2, u2 = _points_for_grad(4, 3, False, aligned, 14)
    assert gradcheck(lambda *a: G.gyroadd(*a, k=0.8), _leaf(r1, u1, r2, u2))
    assert gradcheck(lambda *a: G.gyrocenter(*a, k=0.8), _leaf(r1, u1, r2, u2))


@pytest.mark.parametrize("with_origin,aligned", CASES)
def test_gradcheck_tangent_ops(with_origin, aligned):
    r1, u1 = _points_for_grad(4, 3, with_origin, aligned, 15)
    r2, u2 = _points_for_grad(4, 3, False, aligned, 16)
    xi_r = torch.randn(4, dtype=F64)
    xi_perp = torch.randn(4, 3, dtype=F64)
    xi_perp = xi_perp - (xi_perp * u1).sum(-1, keepdim=True) * u1
    assert gradcheck(lambda *a: G.logmap(*a, k=1.1), _leaf(r1, u1, r2, u2))
    assert gradcheck(lambda *a: G.expmap(*a, k=1.1), _leaf(r1, u1, xi_r, xi_perp))
    assert gradcheck(lambda *a: G.expmap(*a, k=1.1), _leaf(r1, u1, -xi_r.abs(), xi_perp))
    assert gradcheck(lambda *a: G.transport(*a, k=1.1), _leaf(r1, u1, r2, u2, xi_r, xi_perp))
    assert gradcheck(lambda *a: G.project_grad(*a, k=1.1), _leaf(r1, u1, xi_r, xi_perp))
    assert gradcheck(G.tangent_inner, _leaf(xi_r, xi_perp, xi_r.flip(0), xi_perp.flip(0)))
    assert gradcheck(lambda *a: G.to_ambient(*a, k=1.1), _leaf(r1, u1))
    if not with_origin:
        assert gradcheck(lambda x: G.from_ambient(x, k=1.1), _leaf(G.to_ambient(r1, u1, 1.1)))


def test_gradcheck_expmap_at_zero_step_is_finite():
    r, u = _points_for_grad(3, 3, False, False, 17)  # r > 0: at the origin r -> |r| has a kink
    zero_r, zero_perp = torch.zeros(3, dtype=F64), torch.zeros(3, 3, dtype=F64)
    assert gradcheck(lambda *a: G.expmap(*a), _leaf(r, u, zero_r, zero_perp))


@pytest.mark.parametrize("with_origin,aligned", CASES)
def test_gradcheck_horoshift(with_origin, aligned):
    r, u = _points_for_grad(4, 4, with_origin, aligned, 18)
    t = torch.randn(4, dtype=F64)
    assert gradcheck(lambda *a: G.horoshift(*a, 1, 2, k=0.9), _leaf(r, u, t))
    assert gradcheck(lambda *a: G.busemann_nu(*a, 1, k=0.9), _leaf(r, u))


def test_gradcheck_asinh_exp():
    ell = torch.tensor([-30.0, -1.0, -1e-3, 1e-3, 2.0, 40.0], dtype=F64)
    assert gradcheck(G.asinh_exp, _leaf(ell))


def test_pairwise_backward_saves_no_n_m_d_tensor():
    """Eq. 25: the backward of the pairwise distance keeps nothing of size Nq * Nk * n."""
    nq, nk, dim = 24, 20, 32
    rq, uq = random_points(2, nq, dim=dim)
    rk, uk = random_points(2, nk, dim=dim)
    leaves = _leaf(rq, uq, rk, uk)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        d2 = G.pairwise_sq_distance(*leaves)
    assert max(sizes) < nq * nk * dim
    d2.square().sum().backward()
    ref = [t.detach().clone().requires_grad_(True) for t in (rq, uq, rk, uk)]
    chord = 0.5 * (ref[1][:, :, None] - ref[3][:, None]).square().sum(-1)
    a, b = ref[0][..., :, None], ref[2][..., None, :]
    c = 2 * torch.sinh((a - b) / 2) ** 2 + torch.sinh(a) * torch.sinh(b) * chord
    (torch.acosh(1 + c) ** 2).square().sum().backward()
    for got, want in zip(leaves, ref):
        assert torch.allclose(got.grad, want.grad, rtol=1e-9, atol=1e-9)


def test_pairwise_chord_closed_form_gradient_is_accurate_for_clustered_directions():
    """Centring on the mean key direction keeps the float32 gradient accurate (Appendix D.1)."""
    gen = torch.Generator().manual_seed(6)
    base = unit(torch.randn(16, dtype=F64, generator=gen))
    uq = near(base.expand(8, 16), 1e-6, gen) + 0.0
    uk = near(base.expand(12, 16), 1e-6, gen) + 0.0
    g = torch.randn(8, 12, dtype=F64, generator=gen)
    u32 = [uq.float().requires_grad_(True), uk.float().requires_grad_(True)]
    G.pairwise_chord(*u32).mul(g.float()).sum().backward()
    u64 = [u32[0].detach().double().requires_grad_(True), u32[1].detach().double().requires_grad_(True)]
    (0.5 * (u64[0][:, None] - u64[1][None]).square().sum(-1)).mul(g).sum().backward()
    for got, want in zip(u32, u64):
        rel = (got.grad.double() - want.grad).norm() / want.grad.norm()
        assert rel < 1e-5


# --------------------------------------------------------------------------------------------
# bad input gets a clear error
# --------------------------------------------------------------------------------------------
class TestInputErrors:
    def setup_method(self):
        self.r, self.u = random_points(4, dim=3)

    @pytest.mark.parametrize("k", [0.0, -1.0, float("nan"), float("inf")])
    def test_bad_curvature(self, k):
        with pytest.raises(ValueError, match="k must be"):
            G.sq_distance(self.r, self.u, self.r, self.u, k=k)
        with pytest.raises(ValueError, match="k must be"):
            G.centroid(self.r, self.u, torch.ones(1, 4, dtype=F64), k=torch.tensor(k))

    def test_shape_mismatch(self):
        with pytest.raises(ValueError, match="shape mismatch"):
            G.sq_distance(self.r[:3], self.u, self.r, self.u)
        with pytest.raises(ValueError, match="different dimensions"):
            G.sq_distance(self.r, self.u, self.r, torch.ones(4, 5, dtype=F64))
        with pytest.raises(ValueError, match="weights"):
            G.centroid(self.r, self.u, torch.ones(2, 5, dtype=F64))
        with pytest.raises(ValueError, match="ideal_axis"):
            G.horoshift(self.r, self.u, 1.0, 3, 1)
        with pytest.raises(ValueError, match="different space axes"):
            G.horoshift(self.r, self.u, 1.0, 1, 1)
        with pytest.raises(ValueError, match="ambient"):
            G.from_ambient(torch.ones(3, 1))

    def test_non_finite_values(self):
        bad = self.r.clone()
        bad[1] = float("nan")
        with pytest.raises(ValueError, match="NaN or Inf"):
            G.sq_distance(bad, self.u, self.r, self.u)
        w = torch.ones(1, 4, dtype=F64)
        w[0, 2] = float("inf")
        with pytest.raises(ValueError, match="weights contains NaN or Inf"):
            G.centroid(self.r, self.u, w)
        with G.input_checks(False):
            assert torch.isnan(G.sq_distance(bad, self.u, self.r, self.u)).any()
