"""The precision contract (docs/benchmarks.md; paper Table 7, Appendix E.4) against an mpmath reference.

Errors are float32 results against a 60-digit evaluation on the same stored float32 inputs,
clusters of 64 points with geodesic spread 1 (``polar_vit_hf.benchmarks.mpmath_reference.make_cluster``).
"""

from __future__ import annotations

import math

import pytest

from polar_vit_hf.benchmarks.mpmath_reference import bf16_radius_limit, precision_row, weight_decay_row

# radius: (squared distance median relative error, centroid geodesic error, centring error)
TARGETS = {4.0: (1e-6, 1e-5, 1e-5), 8.0: (2e-5, 4e-4, 8e-4), 12.0: (1e-3, 2e-2, 4e-2)}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def row(request):
    return precision_row(request.param)


def test_polar_meets_the_design_targets(row):
    d_target, c_target, g_target = TARGETS[row.radius]
    assert row.sq_distance_polar <= d_target
    assert row.centroid_polar <= c_target
    assert row.centring_polar <= g_target
    # and stays within a small factor of the resolution limit of Proposition 2
    assert row.centroid_polar <= 4 * row.resolution_limit
    assert row.centring_polar <= 4 * row.resolution_limit


def test_ambient_shows_the_failures_the_paper_reports(row):
    if row.radius == 4.0:
        assert row.sq_distance_ambient > 100 * row.sq_distance_polar
    elif row.radius == 8.0:
        assert row.sq_distance_ambient > 0.3  # paper: 70 %
        assert row.centroid_ambient > 1000 * row.centroid_polar
    else:
        assert row.sq_distance_ambient >= 0.99  # the distance is gone
        # the ambient centroid lands near radius 9 whatever the input radius
        assert 8.0 <= row.centroid_radius_ambient <= 9.5
        assert row.centring_ambient > 1.0 or math.isnan(row.centring_ambient)


@pytest.mark.parametrize("radius", [8.0, 12.0, 16.0])
def test_manifold_weight_decay_step(radius):
    """Centroid of {x, o} with weights (1 - w, w), w = 1e-5: moves inward, exact to 0.1 % of the step."""
    wd = weight_decay_row(radius, decay=1e-5)
    assert wd.reference_radius < wd.radius
    assert wd.polar_radius < wd.radius
    assert wd.polar_error_of_step < 1e-3
    # ambient: no step at r = 8 (or the wrong one), and the wrong point beyond
    assert wd.ambient_error_of_step > 0.5


def test_bfloat16_storage_radius_limits():
    """Proposition 1 / 2: ambient resolves unit distances to r ~ 2.8 in bf16, polar to ~ 6.2."""
    limits = bf16_radius_limit()
    assert 2.0 <= limits["ambient"] <= 3.75
    assert 5.5 <= limits["polar"] <= 7.0
