"""The building blocks of Polar-ViT's embeddings: the Polar-FC (Eq. 8), the parameter roles, the relative position
encodings (horoshift Eq. 10, HoPE boost, HOPE rotation, SO(3)-RoPE), the absolute positions (learned, sine-cosine,
Hypformer's), the planar / spherical patch embeddings and the spherical projection of dense prediction.

Every module declares the roles of its parameters (``parameter_roles``, read by :func:`parameter_roles` and
``optim.param_groups``) and sets its initial values in one place, ``init_parameters`` (called at construction and
by ``_init_weights``).  Layers compute through a :class:`manifold_ops.ManifoldOps` strategy and never test a flag.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import initialization as init
from transformers.activations import ACT2FN

from .configuration_polar_vit import PolarViTConfig
from .manifold_ops import ManifoldOps
from .spherical import apply_so3_rope, lift_patches, patch_features, project_patches, token_rope
from .stable_math import safe_normalize

# Parameter roles (Appendix D.3), declared by each module in ``parameter_roles``:
MANIFOLD = "manifold"  # a point of the manifold stored as space coordinates: Riemannian updates, manifold decay
NO_DECAY = "no_decay"  # a scale (gain, temperature, residual step, rate): never weight-decayed
# Anchored initial values of the Polar-FC radius rule (Eq. 8): the Lorentz FC of Chen et al. 2022.  They are
# the initial values and the weight-decay targets of these parameters (role ``("decay_to", value)``).
RADIUS_RULE_ANCHOR = {"norm_power": 1.0, "radius_weight": 0.0, "klein_weight": 0.0, "radius_bias": 0.0}


def parameter_roles(model: nn.Module) -> dict[str, object]:
    """``{parameter name: role}`` for every parameter whose module declares one (``MANIFOLD``, ``NO_DECAY`` or
    ``("decay_to", value)``); parameters of modules without ``parameter_roles`` are plain weights."""
    roles = {}
    for prefix, module in model.named_modules():
        for name, role in getattr(module, "parameter_roles", {}).items():
            if getattr(module, name, None) is not None:
                roles[f"{prefix}.{name}" if prefix else name] = role
    return roles


class PolarFC(nn.Module):
    r"""Polar fully connected layer, Eq. 8.

    ``h = phi(W x / sqrt(k))`` (``W`` acts on all ``n+1`` ambient coordinates, its time column
    plays the role of a bias), output direction ``h / ||h||`` and log-radius

        ``l = beta ln||h|| + lambda a + varphi^T chi + varphi_0``,   ``a' = arsinh(e^l)``

    with the Klein vector ``chi = tanh(a) u``.  Anchored initialisation ``beta = 1``,
    ``lambda = varphi_0 = 0``, ``varphi = 0`` makes it the general Lorentz FC of Chen et al. 2022
    (``sinh a' = ||h||``) in curvature-normalised coordinates.  ``n'(n+1) + n + 3`` parameters per
    head.  With ``radius_rule=False`` it *is* that Lorentz FC (``linear="lorentz"``).  With
    ``num_heads = H`` the layer is ``H`` independent Polar-FCs ``L^n -> L^d`` (split-head attention
    projections) and returns ``(..., H, d+1)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        k: float = 1.0,
        num_heads: int | None = None,
        activation: str | None = None,
        radius_rule: bool = True,
        init_scheme: str = "xavier",
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.num_heads = in_features, out_features, num_heads
        self.sqrt_k = math.sqrt(k)
        self.init_scheme = init_scheme
        heads = num_heads or 1
        self.weight = nn.Parameter(torch.empty(heads * out_features, in_features + 1))
        self.activation = ACT2FN[activation] if activation else None
        self.radius_rule = radius_rule
        if radius_rule:
            self.norm_power = nn.Parameter(torch.empty(heads))  # beta
            self.radius_weight = nn.Parameter(torch.empty(heads))  # lambda
            self.klein_weight = nn.Parameter(torch.empty(heads, in_features))  # varphi
            self.radius_bias = nn.Parameter(torch.empty(heads))  # varphi_0
        self.init_parameters()

    @property
    def parameter_roles(self) -> dict[str, object]:
        return {name: ("decay_to", value) for name, value in RADIUS_RULE_ANCHOR.items()} if self.radius_rule else {}

    uniform_bound = 0.02  # init_scheme="uniform": Hypformer's HTCLinear initialisation

    def init_parameters(self) -> None:
        """Orthogonal (attention projections), Xavier (D.2) or small uniform weights; the radius rule at its anchor."""
        if self.init_scheme == "uniform":
            init.uniform_(self.weight, -self.uniform_bound, self.uniform_bound)
        else:
            (init.orthogonal_ if self.init_scheme == "orthogonal" else init.xavier_uniform_)(self.weight)
        if self.radius_rule:
            for name, value in RADIUS_RULE_ANCHOR.items():
                init.constant_(getattr(self, name), value)

    def rule_parameters(self) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """``(beta, lambda, varphi, varphi_0)`` of the radius rule, or ``None`` for the Lorentz FC."""
        if not self.radius_rule:
            return None
        return self.norm_power, self.radius_weight, self.klein_weight, self.radius_bias

    def forward(self, p: Tensor, ops: ManifoldOps) -> Tensor:
        out = ops.polar_fc(p, self.weight, self.rule_parameters(), self.num_heads or 1, self.activation)
        return out if self.num_heads else out.squeeze(-2)


class RelativePositionEncoding(nn.Module):
    r"""Relative positional encoding on the patch grid, per head, on two reserved axis pairs (base class).

    The token at grid position ``(m_y, m_x)`` is moved by ``t = m rho_h / M`` along each grid axis,
    rows on the axis pair ``(0, 1)``, columns on ``(2, 3)``; the variants say how
    (:class:`HoroshiftEncoding`, :class:`BoostEncoding`, :class:`RotationEncoding`).  Learned rates
    ``rho`` ``(H, 2)``: ``2H`` parameters per layer, excluded from weight decay.  Prefix (class)
    tokens are not moved.
    """

    kind: str
    parameter_roles = {"rates": NO_DECAY}

    def __init__(self, num_heads: int, rate_init: tuple[float, float]) -> None:
        super().__init__()
        self.rate_init = tuple(float(v) for v in rate_init)
        self.rates = nn.Parameter(torch.empty(num_heads, 2))
        self.init_parameters()

    def init_parameters(self) -> None:
        """Rates log-spaced over ``horoshift_rate_init`` across heads, so heads differ in locality."""
        low, high = self.rate_init
        heads = self.rates.shape[0]
        values = torch.logspace(math.log10(low), math.log10(high), heads) if heads > 1 else torch.tensor([low])
        init.copy_(self.rates, values.unsqueeze(-1).expand(heads, 2).clone())

    def offsets(self, grid: tuple[int, int], num_prefix: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Per-token, per-head ``(t_rows, t_cols)`` of shape ``(N, H)``."""
        rows, cols = grid
        index = torch.arange(rows * cols, device=self.rates.device)
        rates = self.rates.to(dtype)
        t_rows = (index // cols).to(dtype).unsqueeze(-1) * rates[:, 0] / rows
        t_cols = (index % cols).to(dtype).unsqueeze(-1) * rates[:, 1] / cols
        if num_prefix:
            pad = t_rows.new_zeros(num_prefix, t_rows.shape[1])
            t_rows, t_cols = torch.cat([pad, t_rows]), torch.cat([pad, t_cols])
        return t_rows, t_cols

    def forward(self, p: Tensor, grid: tuple[int, int], num_prefix: int, ops: ManifoldOps) -> Tensor:
        """``p (B, N, m H, d+1)`` -> same shape (:meth:`ManifoldOps.relative_position`): ``m`` groups of the ``H``
        heads side by side (queries and keys) move alike."""
        t_rows, t_cols = self.offsets(grid, num_prefix, p.dtype)
        groups = p.shape[-2] // t_rows.shape[-1]
        if groups > 1:
            t_rows, t_cols = t_rows.repeat(1, groups), t_cols.repeat(1, groups)
        return ops.relative_position(self.kind, p, t_rows, t_cols)


class HoroshiftEncoding(RelativePositionEncoding):
    """Horoshift (Eq. 10, App. C): axis ``first`` is the ideal axis, ``second`` the shift axis; the squared
    distance of Eq. 9 then depends only on the offset along each grid axis."""

    kind = "horoshift"


class BoostEncoding(RelativePositionEncoding):
    """HoPE: a Lorentz boost along the first axis of each pair with rapidity ``t``."""

    kind = "boost"


class RotationEncoding(RelativePositionEncoding):
    """HOPE, HELM: a rotation of the plane of each axis pair by angle ``t``."""

    kind = "rotation"


class SO3RotaryEncoding(nn.Module):
    r"""SO(3)-RoPE (Libner et al., Eq. 2 and 6) on spherical tokens: the direction ``u`` of every query and key head
    is multiplied by ``pi(R_t) = diag(D^0, ..., D^L)`` of its token's pose, the radius is untouched.

    ``pi(R_t)`` is orthogonal, so this is an isometry of ``L^d`` fixing the origin and the squared distance of
    Eq. 9 becomes ``d^2(q, pi(R_s^{-1} R_t) k)``: it depends on the relative pose only.  In ambient
    coordinates the same matrix acts on the space coordinates.  No parameters; prefix (class) tokens are not moved.
    """

    kind = "so3"

    def forward(self, p: Tensor, rope: Tensor, num_prefix: int, ops: ManifoldOps) -> Tensor:
        """``p (B, N, H', d+1)`` (any number of heads side by side), ``rope (N - num_prefix, m, m)`` -> same
        shape."""
        tokens = p[:, num_prefix:]
        moved = torch.cat([tokens[..., :1], apply_so3_rope(tokens[..., 1:], rope)], dim=-1)
        return torch.cat([p[:, :num_prefix], moved], dim=1) if num_prefix else moved


RELATIVE_POSITION_CLASSES = {"horoshift": HoroshiftEncoding, "boost": BoostEncoding, "rotation": RotationEncoding}


def relative_position_encoding(config: PolarViTConfig) -> nn.Module | None:
    """The module of ``config.relative_position`` (``None`` for ``"none"``)."""
    if config.relative_position == "none":
        return None
    if config.relative_position == "so3":
        return SO3RotaryEncoding()
    low, high = config.horoshift_rate_init
    return RELATIVE_POSITION_CLASSES[config.relative_position](config.num_attention_heads, (low, high))


def sincos_positions(hidden_size: int, grid: tuple[int, int]) -> Tensor:
    """2-D sine-cosine positions ``(rows * cols, n)`` (MAE style), scaled to unit norm per token."""
    if hidden_size % 4:
        raise ValueError(f"sine-cosine positions need hidden_size divisible by 4, got {hidden_size}")
    quarter = hidden_size // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(
        torch.arange(grid[0], dtype=torch.float64), torch.arange(grid[1], dtype=torch.float64), indexing="ij"
    )
    parts = []
    for coord in (rows.flatten(), cols.flatten()):
        angles = coord[:, None] * omega[None]
        parts += [torch.sin(angles), torch.cos(angles)]
    return (torch.cat(parts, dim=-1) / math.sqrt(hidden_size / 2)).float()


class HypformerPositionalEncoding(nn.Module):
    r"""Hypformer's learnable positional encoding (``position_embedding="hypformer"``).

    ``p = HTCLinear(x)``, a Lorentz FC ``L^n -> L^n`` (Hypformer's linear map with the output's time
    coordinate from the constraint: :class:`PolarFC` with ``radius_rule=False``, weights uniform in
    ``[-0.02, 0.02]`` as in the reference, ``init_scheme="uniform"``), then the LResNet residual
    ``lorentz_residual(x, p, w_y=epsilon)``: the Lorentzian midpoint of ``{x, p}`` with weights
    ``(1, epsilon)`` (the polar centroid, Eq. 22).
    ``epsilon`` (``hypformer_epsilon``) is a fixed number ``>= 0``, not a parameter: a learned weight
    below ``-1`` would leave the upper sheet.  As in Hypformer the encoding is computed from each
    token, so the grid position itself reaches the model through the relative encoding.
    """

    def __init__(self, config: PolarViTConfig) -> None:
        super().__init__()
        self.epsilon = float(config.hypformer_epsilon)
        self.htc_linear = PolarFC(
            config.hidden_size, config.hidden_size, config.k, radius_rule=False, init_scheme="uniform"
        )

    def forward(self, x: Tensor, ops: ManifoldOps) -> Tensor:
        p = self.htc_linear(x, ops)
        weights = x.new_tensor([1.0, self.epsilon]).expand(*x.shape[:-1], 1, 2)  # (B, N, 1, 2)
        return ops.centroid(torch.stack([x, p], dim=-2), weights).squeeze(-2)


class PolarViTEmbeddings(nn.Module):
    r"""Patch embedding: patches onto the manifold, a Polar-FC, absolute positions, class token.

    A patch vector ``e`` (``C P^2`` values) is mapped by ``exp_o`` of ``e / sqrt(C P^2)`` (radius =
    RMS pixel value, direction ``e / ||e||``), then by a Polar-FC to ``L^n`` (Xavier, D.2).
    Positions (learned table, or fixed sine-cosine of unit norm) are added to the space
    coordinates (Sec. 4).  With ``readout="cls"`` a class token (a point, space coordinates
    ``cls_token``) is prepended.
    """

    def __init__(self, config: PolarViTConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_size = config.patch_size
        self.grid = (config.image_size // config.patch_size,) * 2
        self.patch_projection = PolarFC(
            self.patch_features(config), config.hidden_size, config.k, radius_rule=config.linear == "polar"
        )
        self.position_embeddings = None
        if config.position_embedding == "learned":
            self.position_embeddings = nn.Parameter(torch.empty(1, config.num_patches, config.hidden_size))
        self.position_encoding = (
            HypformerPositionalEncoding(config) if config.position_embedding == "hypformer" else None
        )
        self.cls_token = nn.Parameter(torch.empty(config.hidden_size)) if config.readout == "cls" else None
        self.init_parameters()

    parameter_roles = {"cls_token": MANIFOLD}

    @staticmethod
    def patch_features(config: PolarViTConfig) -> int:
        """Values per patch: ``C P^2``."""
        return config.num_channels * config.patch_size**2

    def init_parameters(self) -> None:
        """Truncated-normal position table and class token (``initializer_range``)."""
        for table in (self.position_embeddings, self.cls_token):
            if table is not None:
                init.trunc_normal_(table, std=self.config.initializer_range)

    def positions(self, grid: tuple[int, int], dtype: torch.dtype, traced_sizes: bool = False) -> Tensor | None:
        """Position table for ``grid``; learned tables are bicubically interpolated when asked to (``traced_sizes``:
        always, as an exported graph of any image size must; at the table's own size that is the identity)."""
        kind = self.config.position_embedding
        if kind in ("none", "hypformer"):
            return None
        if kind == "sincos":  # computed on the fly: cheap, and never a stale buffer after meta-device loading
            device = self.patch_projection.weight.device
            return sincos_positions(self.config.hidden_size, grid)[None].to(device=device, dtype=dtype)
        table: Tensor | None = self.position_embeddings
        assert table is not None  # position_embedding="learned"
        if traced_sizes or grid != self.grid:
            n = table.shape[-1]
            image = table.reshape(1, *self.grid, n).permute(0, 3, 1, 2)
            image = F.interpolate(image, size=grid, mode="bicubic", align_corners=False)
            table = image.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], n)
        return table.to(dtype)

    def embed(self, patches: Tensor, positions: Tensor | None, ops: ManifoldOps) -> tuple[Tensor, int]:
        """Patch vectors ``(B, N, F)`` -> tokens ``(B, N (+1), n+1)`` and the number of prefix tokens."""
        radius = torch.linalg.vector_norm(patches, dim=-1) / math.sqrt(patches.shape[-1])
        tokens = self.patch_projection(ops.make(radius, safe_normalize(patches)), ops)
        if positions is not None:
            tokens = ops.from_space(ops.space(tokens) + positions)
        if self.position_encoding is not None:
            tokens = self.position_encoding(tokens, ops)
        if self.cls_token is None:
            return tokens, 0
        cls = ops.from_space(self.cls_token.to(tokens.dtype)).expand(tokens.shape[0], 1, -1)
        return torch.cat([cls, tokens], dim=1), 1

    def forward(
        self, pixel_values: Tensor, ops: ManifoldOps, interpolate_pos_encoding: bool = False
    ) -> tuple[Tensor, tuple[int, int] | Tensor | None, int]:
        """``(tokens, patch grid (rows, cols), number of prefix tokens)``."""
        batch, channels, height, width = pixel_values.shape
        size = self.patch_size
        grid = (height // size, width // size)
        if not interpolate_pos_encoding and self.config.position_embedding == "learned" and grid != self.grid:
            raise ValueError(
                f"Input image size ({height}*{width}) doesn't match model ({self.config.image_size}*"
                f"{self.config.image_size}); resize the image or pass interpolate_pos_encoding=True"
            )
        patches = pixel_values.reshape(batch, channels, grid[0], size, grid[1], size)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(batch, grid[0] * grid[1], -1)
        traced_sizes = interpolate_pos_encoding and torch.compiler.is_exporting()
        tokens, num_prefix = self.embed(patches, self.positions(grid, patches.dtype, traced_sizes), ops)
        return tokens, grid, num_prefix


class PolarViTSphericalEmbeddings(PolarViTEmbeddings):
    r"""Lifting patch embedding of icosphere signals (SO(3)-RoPE Sec. 3, Def. 4).

    Token ``t`` (patch ``m`` in orientation ``o``) reads the ``S = (n+1)(n+2)/2`` vertices of its patch in its
    kernel order (:func:`spherical.icosphere_patches`), optionally with ``longitude_encoding`` Legendre channels
    appended; the patch vector then goes onto the manifold exactly as a planar patch does.  The positions passed
    to the blocks are the SO(3)-RoPE matrices ``pi(R_t)`` ``(N, m, m)`` (``relative_position="so3"``).
    """

    @staticmethod
    def patch_features(config: PolarViTConfig) -> int:
        """Values per patch: ``(C + K) S``."""
        return patch_features(
            config.num_channels, config.icosphere_level, config.patch_level, config.longitude_encoding
        )

    def rope(self, dtype: torch.dtype) -> Tensor | None:
        """``pi(R_t)`` of every token, or ``None`` without SO(3)-RoPE."""
        if self.config.relative_position != "so3":
            return None
        config = self.config
        rope = token_rope(config.icosphere_level, config.patch_level, config.head_dim)
        return rope.to(device=self.patch_projection.weight.device, dtype=dtype)

    def forward(
        self, pixel_values: Tensor, ops: ManifoldOps, interpolate_pos_encoding: bool = False
    ) -> tuple[Tensor, Tensor | None, int]:
        """``(tokens, SO(3)-RoPE matrices or None, number of prefix tokens)``."""
        config = self.config
        patches = lift_patches(
            pixel_values, config.icosphere_level, config.patch_level, config.longitude_encoding
        )  # (B, N, (C + K) S)
        table = None if self.position_embeddings is None else self.position_embeddings.to(patches.dtype)
        tokens, num_prefix = self.embed(patches, table, ops)
        return tokens, self.rope(patches.dtype), num_prefix


class PolarViTSphericalProjection(nn.Module):
    r"""Projection convolution of icosphere fields (SO(3)-RoPE Sec. 3 "Unpatchification", Def. 5), the inverse of
    the lifting embedding.

    Every token leaves the hyperboloid by the logarithmic map at the origin, ``log_o(x) = r u`` (a Euclidean
    vector of width ``n`` whose norm is the token's distance to the origin, exact in polar form at any radius);
    a linear kernel gives it ``C_out S`` values, which :func:`spherical.project_patches` puts on its patch's
    vertices in its orientation's kernel order and averages per vertex.  Output ``(B, C_out, V)``.
    """

    def __init__(self, config: PolarViTConfig) -> None:
        super().__init__()
        self.level, self.patch_level = config.icosphere_level, config.patch_level
        slots = patch_features(1, config.icosphere_level, config.patch_level)
        self.kernel = nn.Linear(config.hidden_size, config.output_channels * slots)
        self.std = config.initializer_range
        self.init_parameters()

    def init_parameters(self) -> None:
        init.trunc_normal_(self.kernel.weight, std=self.std)
        init.zeros_(self.kernel.bias)

    def forward(self, radius: Tensor, direction: Tensor) -> Tensor:
        """Patch tokens in polar form, ``r (B, N)`` and ``u (B, N, n)`` -> fields ``(B, C_out, V)``."""
        tangent = radius.unsqueeze(-1) * direction  # log_o(x)
        values = F.linear(tangent, self.kernel.weight.to(tangent.dtype), self.kernel.bias.to(tangent.dtype))
        return project_patches(values, self.level, self.patch_level)
