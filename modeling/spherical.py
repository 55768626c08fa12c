r"""Spherical inputs: the icosphere, its lifted triangular patches and SO(3)-RoPE (Libner et al., SO(3)-RoPE).

Tokenisation (SO(3)-RoPE Sec. 3): a signal is sampled on the vertices of an icosphere of level ``s`` (the
icosahedron subdivided ``s`` times, ``10 * 4^s + 2`` vertices).  The faces of level ``p <= s`` are the
patches (``M = 20 * 4^p``); each holds the ``(n+1)(n+2)/2`` vertices of its own subdivision, ``n = 2^(s-p)``,
addressed by integer barycentric coordinates ``(a, b, c)``, ``a + b + c = n``.  Every patch is read in its three
orientations (the cyclic orders of its corners), giving ``3M`` tokens: the lifting convolution of Def. 4 whose
triangular kernel lands exactly on each patch in each orientation, without interpolation.  Token ``t = 3m + o``
has the pose ``R_t in SO(3)`` whose columns are the tangent direction towards the orientation's first corner,
the completing tangent direction and the patch centre.  A rotation ``G`` of the icosahedral group (60
elements) permutes the vertices and the tokens exactly, and ``R_{G t} = G R_t``.

SO(3)-RoPE (Eq. 1-3, 6): ``pi(R) = diag(D^0(R), ..., D^L(R))``, real Wigner-D blocks (from ``e3nn``), as
many as fit in a head of width ``d`` (``(L+1)^2 <= d``; the remaining axes are left unrotated).  Queries and
keys are multiplied by ``pi(R_t)``; since ``pi(U)^T pi(V) = pi(U^{-1} V)`` the attention score depends only on
relative poses.  In Polar-ViT ``pi`` acts on each head's unit direction (an isometry of the hyperboloid that
fixes the origin), so ``d(pi(U) q, pi(V) k) = d(q, pi(U^{-1} V) k)``.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

GOLDEN_RATIO = (1 + math.sqrt(5)) / 2


@cache
def _icosahedron_arrays() -> tuple[np.ndarray, np.ndarray]:
    """:func:`icosahedron` as NumPy arrays: built once, without torch (so also where torch traces a program)."""
    phi = GOLDEN_RATIO
    vertices = np.array(
        [
            (-1, phi, 0),
            (1, phi, 0),
            (-1, -phi, 0),
            (1, -phi, 0),
            (0, -1, phi),
            (0, 1, phi),
            (0, -1, -phi),
            (0, 1, -phi),
            (phi, 0, -1),
            (phi, 0, 1),
            (-phi, 0, -1),
            (-phi, 0, 1),
        ],
        dtype=np.float64,
    )
    vertices = vertices / np.linalg.norm(vertices, axis=-1, keepdims=True)
    faces = np.array(
        [
            (0, 11, 5),
            (0, 5, 1),
            (0, 1, 7),
            (0, 7, 10),
            (0, 10, 11),
            (1, 5, 9),
            (5, 11, 4),
            (11, 10, 2),
            (10, 7, 6),
            (7, 1, 8),
            (3, 9, 4),
            (3, 4, 2),
            (3, 2, 6),
            (3, 6, 8),
            (3, 8, 9),
            (4, 9, 5),
            (2, 4, 11),
            (6, 2, 10),
            (8, 6, 7),
            (9, 8, 1),
        ]
    )
    a, b, c = (vertices[faces[:, i]] for i in range(3))
    clockwise = (np.cross(b - a, c - a) * (a + b + c)).sum(-1) < 0
    faces[clockwise] = faces[clockwise][:, [0, 2, 1]]
    return vertices, faces


def icosahedron() -> tuple[Tensor, Tensor]:
    """The 12 unit vertices ``(12, 3)`` (float64) and 20 faces ``(20, 3)``, counter-clockwise seen from outside."""
    vertices, faces = _icosahedron_arrays()
    return torch.tensor(vertices), torch.tensor(faces)


class _Subdivision:
    """Vertices of the recursive midpoint subdivision, each edge midpoint made once: ``normalize((x_a + x_b) / 2)``."""

    def __init__(self, vertices: np.ndarray) -> None:
        self.points = [tuple(point) for point in vertices.tolist()]
        self.midpoints: dict[tuple[int, int], int] = {}

    def midpoint(self, a: int, b: int) -> int:
        key = (min(a, b), max(a, b))
        if key not in self.midpoints:
            point = [p + q for p, q in zip(self.points[a], self.points[b])]
            norm = math.sqrt(sum(v * v for v in point))
            self.points.append(tuple(v / norm for v in point))
            self.midpoints[key] = len(self.points) - 1
        return self.midpoints[key]

    def split(self, face: tuple[int, int, int]) -> list[tuple[int, int, int]]:
        """One face into four (orientation kept)."""
        a, b, c = face
        ab, bc, ca = self.midpoint(a, b), self.midpoint(b, c), self.midpoint(c, a)
        return [(a, ab, ca), (ab, b, bc), (ca, bc, c), (ab, bc, ca)]

    def patch(self, face: tuple[int, int, int], depth: int) -> dict[tuple[int, int, int], int]:
        """Vertex ids of ``face`` subdivided ``depth`` times, keyed by integer barycentric ``(a, b, c)``
        (sum ``2^depth``)."""
        n = 2**depth
        grid: dict[tuple[int, int, int], int] = {}

        def visit(ids: tuple[int, int, int], coords: tuple[tuple[int, int, int], ...], level: int) -> None:
            if level == 0:
                grid.update(zip(coords, ids))
                return
            (i, j, k), (p, q, r) = ids, coords
            mid = lambda x, y: tuple((u + v) // 2 for u, v in zip(x, y))  # noqa: E731
            ij, jk, ki = self.midpoint(i, j), self.midpoint(j, k), self.midpoint(k, i)
            pq, qr, rp = mid(p, q), mid(q, r), mid(r, p)
            for child_ids, child_coords in (
                ((i, ij, ki), (p, pq, rp)),
                ((ij, j, jk), (pq, q, qr)),
                ((ki, jk, k), (rp, qr, r)),
                ((ij, jk, ki), (pq, qr, rp)),
            ):
                visit(child_ids, child_coords, level - 1)

        visit(face, ((n, 0, 0), (0, n, 0), (0, 0, n)), depth)
        return grid


def barycentric_slots(n: int) -> list[tuple[int, int, int]]:
    """The kernel slots of a triangular patch of side ``n``: ``(a, b, c)``, ``a + b + c = n``, in a fixed order."""
    return [(a, b, n - a - b) for a in range(n, -1, -1) for b in range(n - a, -1, -1)]


@cache
def _rotated(slot: tuple[int, int, int], shift: int) -> tuple[int, int, int]:
    """The barycentric slot ``(a, b, c)`` read in the orientation that starts ``shift`` corners later."""
    return slot[(0 - shift) % 3], slot[(1 - shift) % 3], slot[(2 - shift) % 3]


def icosphere_patches(level: int, patch_level: int) -> tuple[Tensor, Tensor, Tensor]:
    """The icosphere of ``level`` and its lifted patches of ``patch_level``.

    Returns ``vertices (V, 3)`` (float64, unit), ``index (3M, S)`` (the vertex read by kernel slot ``j`` of token
    ``t = 3m + o``: patch ``m`` in orientation ``o``, corners cyclically shifted by ``o``) and ``corners (3M, 3)``
    (the vertex ids of each token's corners in its orientation's order).  ``V = 10 * 4^level + 2``.  The mesh is
    built once per level (:func:`_patch_arrays`); each call returns new tensors of it.
    """
    if not 0 <= patch_level <= level:
        raise ValueError(f"need 0 <= patch_level <= icosphere_level, got {patch_level} and {level}")
    return tuple(torch.tensor(array) for array in _patch_arrays(level, patch_level))  # type: ignore[return-value]


@cache
def _patch_arrays(level: int, patch_level: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`icosphere_patches` as NumPy arrays, built in Python (no tensor op, so ``torch.export`` can trace a
    model that reads them)."""
    vertices, faces = _icosahedron_arrays()
    mesh = _Subdivision(vertices)
    levels = [[tuple(face) for face in faces.tolist()]]
    for _ in range(level):  # level by level, so the vertex order does not depend on patch_level
        levels.append([child for face in levels[-1] for child in mesh.split(face)])
    depth = level - patch_level
    slots = barycentric_slots(2**depth)
    index, corners = [], []
    for face in levels[patch_level]:
        grid = mesh.patch(face, depth)
        for shift in range(3):  # orientation o reads weights (a, b, c) on the corners (face[o], face[o+1], face[o+2])
            index.append([grid[_rotated((a, b, c), shift)] for a, b, c in slots])
            corners.append([face[(shift + i) % 3] for i in range(3)])
    points = np.array(mesh.points, dtype=np.float64)
    assert points.shape[0] == 10 * 4**level + 2, "icosphere vertex count"
    return points, np.array(index, dtype=np.int64), np.array(corners, dtype=np.int64)


def patch_index(level: int, patch_level: int) -> Tensor:
    """The ``index (3M, S)`` of :func:`icosphere_patches` without a copy: a view of the cached table, for the
    gathers and scatters of every forward pass (read it, never write it)."""
    return torch.from_numpy(_patch_arrays(level, patch_level)[1])


def icosphere(level: int) -> Tensor:
    """Unit vertices ``(10 * 4^level + 2, 3)`` (float64) of the icosphere of ``level``, in the model's order."""
    return icosphere_patches(level, 0)[0]


def frame_from_points(first: Tensor, centre: Tensor) -> Tensor:
    """Rotation ``(..., 3, 3)`` with columns ``e1 = normalize(first - (first . c) c)``, ``e2 = c x e1``, ``c``."""
    centre = centre / centre.norm(dim=-1, keepdim=True)
    e1 = first - (first * centre).sum(-1, keepdim=True) * centre
    e1 = e1 / e1.norm(dim=-1, keepdim=True)
    return torch.stack([e1, torch.linalg.cross(centre, e1), centre], dim=-1)


def token_poses(level: int, patch_level: int) -> Tensor:
    """SO(3) pose ``R_t (3M, 3, 3)`` (float64) of every token: the patch frame of its orientation (see module doc)."""
    return torch.tensor(_token_pose_array(level, patch_level))


@cache
def _token_pose_array(level: int, patch_level: int) -> np.ndarray:
    """:func:`token_poses` as a NumPy array, computed once (where torch traces a program it fails rather than keep
    a traced value)."""
    vertices, _, corners = icosphere_patches(level, patch_level)
    points = vertices[corners]  # (3M, 3 corners, 3)
    return frame_from_points(points[:, 0], points.sum(1)).numpy()


def euler_zyz(rotation: Tensor) -> Tensor:
    """Euler angles ``(alpha, beta, gamma)`` of ``R = R_z(alpha) R_y(beta) R_z(gamma)`` (the seed's convention)."""
    beta = torch.atan2(torch.hypot(rotation[..., 0, 2], rotation[..., 1, 2]), rotation[..., 2, 2])
    alpha = torch.atan2(rotation[..., 1, 2], rotation[..., 0, 2])
    gamma = torch.atan2(rotation[..., 2, 1], -rotation[..., 2, 0])
    return torch.stack([alpha, beta, gamma], dim=-1)


def matrix_zyz(angles: Tensor) -> Tensor:
    """``R_z(alpha) R_y(beta) R_z(gamma)`` of angles ``(..., 3)``."""

    def axis(angle: Tensor, i: int, j: int) -> Tensor:
        matrix = torch.zeros(*angle.shape, 3, 3, dtype=angle.dtype, device=angle.device)
        matrix[..., 3 - i - j, 3 - i - j] = 1
        matrix[..., i, i] = matrix[..., j, j] = angle.cos()
        matrix[..., i, j], matrix[..., j, i] = -angle.sin(), angle.sin()
        return matrix

    alpha, beta, gamma = angles.unbind(-1)
    return axis(alpha, 0, 1) @ axis(beta, 2, 0) @ axis(gamma, 0, 1)


@cache
def icosahedral_rotations() -> Tensor:
    """The 60 rotations ``(60, 3, 3)`` (float64) of the icosahedral group: each maps the oriented edge from vertex 0
    to its first neighbour onto one of the 60 oriented edges of the icosahedron."""
    vertices, faces = icosahedron()
    edges = {(int(a), int(b)) for face in faces.tolist() for a, b in zip(face, face[1:] + face[:1])}
    edges |= {(b, a) for a, b in edges}
    source = min(b for a, b in edges if a == 0)

    def frame(a: int, b: int) -> Tensor:
        return frame_from_points(vertices[b], vertices[a])

    reference = frame(0, source)
    return torch.stack([frame(a, b) @ reference.T for a, b in sorted(edges)])


def random_rotations(count: int, seed: int = 0) -> Tensor:
    """``count`` Haar-random rotations ``(count, 3, 3)`` (float64): QR of Gaussian matrices, signs fixed, det +1."""
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(count, 3, 3, dtype=torch.float64, generator=generator))
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    q[torch.det(q) < 0, :, 0] *= -1
    return q


def vertex_permutation(rotation: Tensor, vertices: Tensor, atol: float = 1e-9) -> Tensor:
    """``perm`` with ``rotation @ vertices[i] = vertices[perm[i]]``; raises if ``rotation`` does not permute them."""
    distance, perm = torch.cdist(vertices @ rotation.T, vertices, compute_mode="donot_use_mm_for_euclid_dist").min(-1)
    if float(distance.max()) > atol or perm.unique().numel() != vertices.shape[0]:
        raise ValueError("the rotation does not map the icosphere onto itself")
    return perm


def rotate_signal(signal: Tensor, rotation: Tensor, level: int) -> Tensor:
    """``[G f](x) = f(G^{-1} x)`` for an icosahedral ``G`` and a signal ``(..., V)`` on the icosphere of ``level``."""
    perm = vertex_permutation(rotation, icosphere(level))
    rotated = torch.empty_like(signal)
    rotated[..., perm] = signal
    return rotated


def wigner_degree(head_dim: int) -> int:
    """Largest ``L`` with ``(L+1)^2 <= head_dim``: the Wigner blocks ``D^0 ... D^L`` that fit in a head."""
    return math.isqrt(head_dim) - 1


def _e3nn_o3() -> Any:
    try:
        from e3nn import o3
    except ImportError as error:  # only spherical models need it
        raise ImportError(
            "relative_position='so3' needs e3nn: pip install e3nn (or polar-vit-hf[spherical])"
        ) from error
    return o3


def so3_representation(rotations: Tensor, head_dim: int) -> Tensor:
    r"""SO(3)-RoPE's ``pi(R) = diag(D^0(R), ..., D^L(R))`` (Eq. 6) of ``rotations (..., 3, 3)``: ``(..., m, m)``,
    ``m = (L+1)^2 <= head_dim`` (e3nn's real Wigner-D matrices; computed in float64, returned in the input dtype).

    ``pi`` is orthogonal and a homomorphism, ``pi(U) pi(V) = pi(UV)`` (Def. 6).
    """
    o3 = _e3nn_o3()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # e3nn builds its generators in the default dtype
    try:
        angles = o3.matrix_to_angles(rotations.detach().to(torch.float64).cpu())
        blocks = [o3.wigner_D(degree, *angles) for degree in range(wigner_degree(head_dim) + 1)]
    finally:
        torch.set_default_dtype(previous)
    return _block_diagonal(blocks).to(device=rotations.device, dtype=rotations.dtype)


def _block_diagonal(blocks: list[Tensor]) -> Tensor:
    """Batched block-diagonal matrix of blocks ``(..., d_i, d_i)``."""
    size = sum(block.shape[-1] for block in blocks)
    out = blocks[0].new_zeros(*blocks[0].shape[:-2], size, size)
    start = 0
    for block in blocks:
        end = start + block.shape[-1]
        out[..., start:end, start:end] = block
        start = end
    return out


def token_rope(level: int, patch_level: int, head_dim: int) -> Tensor:
    """``pi(R_t)`` ``(3M, m, m)`` (float64, CPU) of every token of the icosphere tokenisation."""
    return torch.tensor(_token_rope_array(level, patch_level, head_dim))


@lru_cache(maxsize=16)
def _token_rope_array(level: int, patch_level: int, head_dim: int) -> np.ndarray:
    """:func:`token_rope` as a NumPy array, computed once."""
    return so3_representation(token_poses(level, patch_level), head_dim).numpy()


def apply_so3_rope(x: Tensor, rope: Tensor) -> Tensor:
    """``x (..., N, H, d)`` with its first ``m`` axes multiplied by ``rope (N, m, m)``; the rest unchanged (Eq. 2)."""
    m = rope.shape[-1]
    rotated = torch.einsum("nij,...nhj->...nhi", rope.to(x.dtype), x[..., :m])
    return torch.cat([rotated, x[..., m:]], dim=-1)


def legendre_features(cos_theta: Tensor, degree: int) -> Tensor:
    """``[P_1(x), ..., P_K(x)]`` ``(..., K)`` by Bonnet's recursion ``(l+1) P_{l+1} = (2l+1) x P_l - l P_{l-1}``
    (the seed's longitude encoding, ``x = cos(beta)``)."""
    values = [torch.ones_like(cos_theta), cos_theta]
    for l in range(1, degree):  # noqa: E741
        values.append(((2 * l + 1) * cos_theta * values[-1] - l * values[-2]) / (l + 1))
    return torch.stack(values[1 : degree + 1], dim=-1)


def lift_patches(signal: Tensor, level: int, patch_level: int, longitude_encoding: int = 0) -> Tensor:
    """The lifting of Def. 4 before its kernel: signal ``(B, C, V)`` -> patch vectors ``(B, 3M, (C + K) S)``, token
    ``t`` reading its patch's vertices in its orientation's kernel order, with ``K = longitude_encoding`` Legendre
    channels of the vertices' ``cos(beta) = z`` appended (0: none)."""
    index = patch_index(level, patch_level)
    if longitude_encoding:
        z = torch.from_numpy(_patch_arrays(level, patch_level)[0][:, 2])
        legendre = legendre_features(z, longitude_encoding).T.to(signal)
        signal = torch.cat([signal, legendre.expand(signal.shape[0], -1, -1)], dim=1)
    patches = signal[:, :, index.to(signal.device)]  # (B, C + K, 3M, S)
    return patches.transpose(1, 2).flatten(2)


def patch_features(num_channels: int, level: int, patch_level: int, longitude_encoding: int = 0) -> int:
    """Length ``(C + K) S`` of a lifted patch vector, ``S = (n+1)(n+2)/2``, ``n = 2^(level - patch_level)``."""
    side = 2 ** (level - patch_level)
    return (num_channels + longitude_encoding) * (side + 1) * (side + 2) // 2


def equirectangular_to_icosphere(image: Tensor, vertices: Tensor) -> Tensor:
    """Bilinear samples ``(..., C, V)`` of an equirectangular image ``(..., C, H, W)`` at unit ``vertices (V, 3)``.

    Row ``i`` holds colatitude ``(i + 1/2) pi / H`` (north pole at the top), column ``j`` longitude
    ``(j + 1/2) 2 pi / W - pi``; longitude wraps around, colatitude is clamped at the poles.
    """
    height, width = image.shape[-2:]
    x, y, z = vertices.to(torch.float64).unbind(-1)
    row = torch.arccos(z.clamp(-1, 1)) / math.pi * height - 0.5
    col = (torch.atan2(y, x) + math.pi) / (2 * math.pi) * width - 0.5
    row = row.clamp(0, height - 1)
    r0, c0 = row.floor(), col.floor()
    fr, fc = (row - r0).to(image.dtype), (col - c0).to(image.dtype)
    r0, c0 = r0.long(), c0.long()
    r1, c1 = (r0 + 1).clamp(max=height - 1), c0 + 1
    c0, c1 = c0 % width, c1 % width

    def at(r: Tensor, c: Tensor) -> Tensor:
        return image[..., r, c]

    return (1 - fr) * ((1 - fc) * at(r0, c0) + fc * at(r0, c1)) + fr * ((1 - fc) * at(r1, c0) + fc * at(r1, c1))


def vertex_multiplicity(level: int, patch_level: int) -> Tensor:
    """How many kernel slots of the lifted patches read each vertex ``(V,)`` (float64): 3 inside a patch, 6 on a
    patch edge, three per patch that meets at a patch corner (every patch is read in three orientations)."""
    return torch.from_numpy(_multiplicity_array(level, patch_level)).clone()


@cache
def _multiplicity_array(level: int, patch_level: int) -> np.ndarray:
    vertices, index, _ = _patch_arrays(level, patch_level)
    return np.bincount(index.ravel(), minlength=vertices.shape[0]).astype(np.float64)


def project_patches(patches: Tensor, level: int, patch_level: int) -> Tensor:
    r"""The projection convolution of Def. 5 after its kernel: patch vectors ``(B, 3M, C S)`` -> ``(B, C, V)``.

    Token ``t`` puts its ``C S`` values on its patch's vertices in its orientation's kernel order (the slots that
    :func:`lift_patches` reads) and every vertex averages the values that land on it:
    ``project(g) = D^{-1} L^T g``, with ``L`` the lifting's gather and ``D`` = :func:`vertex_multiplicity`.  It is
    the lifting's adjoint in the multiplicity-weighted inner product, ``<L f, g> = <f, project(g)>_D``, it inverts
    the lifting (``project(L f) = f``), and an icosahedral rotation of the tokens rotates its output.
    """
    index, multiplicity = patch_index(level, patch_level), torch.from_numpy(_multiplicity_array(level, patch_level))
    batch, tokens, features = patches.shape
    slots = index.shape[1]
    values = patches.reshape(batch, tokens, features // slots, slots).transpose(1, 2).flatten(2)  # (B, C, 3M S)
    target = index.flatten().to(patches.device).expand(*values.shape)
    summed = values.new_zeros(*values.shape[:2], multiplicity.shape[0]).scatter_add(-1, target, values)
    return summed / multiplicity.to(summed)


def vertex_areas(level: int) -> Tensor:
    """Quadrature weights ``w (V,)`` (float64, summing to 1): a third of each flat triangle's area of the icosphere
    of ``level`` at each of its corners, over the total; ``sum_v w_v f(v)`` approximates the mean of ``f``."""
    return torch.tensor(_vertex_area_array(level))


@cache
def _vertex_area_array(level: int) -> np.ndarray:
    vertices, _, corners = _patch_arrays(level, level)
    faces = corners[0::3]  # the first orientation of every face
    a, b, c = (vertices[faces[:, i]] for i in range(3))
    third = np.linalg.norm(np.cross(b - a, c - a), axis=-1) / 6
    areas = np.bincount(faces.ravel(), weights=np.repeat(third, 3), minlength=vertices.shape[0])
    return areas / areas.sum()


def sphere_errors(prediction: Tensor, target: Tensor, level: int) -> tuple[Tensor, Tensor]:
    r"""The l1 and l2 errors of fields ``(B, C, V)`` (Bonev et al.'s metrics, on the icosphere's quadrature):
    ``l1 = mean_{b,c} sum_v w_v |p - t|`` and ``l2 = mean_{b,c} (sum_v w_v (p - t)^2)^{1/2}``, ``w`` =
    :func:`vertex_areas`."""
    weights = vertex_areas(level).to(prediction)
    difference = prediction - target
    l1 = (difference.abs() * weights).sum(-1).mean()
    l2 = (difference.square() * weights).sum(-1).sqrt().mean()
    return l1, l2


def field_loss(prediction: Tensor, target: Tensor, level: int) -> Tensor:
    r"""The training loss of dense prediction: the squared l2 error ``mean_{b,c} sum_v w_v (p - t)^2`` of the
    (normalised) fields, torch-harmonics' ``l2loss_sphere`` on the icosphere's quadrature :func:`vertex_areas`."""
    if target.shape != prediction.shape:
        raise ValueError(
            f"labels must be target fields (batch, {prediction.shape[1]}, {prediction.shape[2]}), "
            f"got {tuple(target.shape)}"
        )
    weights = vertex_areas(level).to(prediction)
    return ((prediction - target.to(prediction)).square() * weights).sum(-1).mean()


__all__ = [
    "apply_so3_rope",
    "equirectangular_to_icosphere",
    "euler_zyz",
    "field_loss",
    "icosahedral_rotations",
    "icosahedron",
    "icosphere",
    "icosphere_patches",
    "legendre_features",
    "lift_patches",
    "patch_features",
    "patch_index",
    "project_patches",
    "random_rotations",
    "matrix_zyz",
    "rotate_signal",
    "so3_representation",
    "sphere_errors",
    "token_poses",
    "token_rope",
    "vertex_areas",
    "vertex_multiplicity",
    "vertex_permutation",
    "wigner_degree",
]
