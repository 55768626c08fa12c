"""PyTorch Polar-ViT: a fully hyperbolic Vision Transformer in polar form (paper Section 4).

Tokens are points of the Lorentz model ``L^n_k``.  Between layers a token is one tensor of shape
``(..., n+1)``: ``[r, u]`` (radius, unit direction) with ``arithmetic="polar"`` or ambient
coordinates ``[x_0, x_s]`` with ``arithmetic="ambient"`` (see :mod:`manifold_ops`); the parameters
are the same either way.

Outputs: ``last_hidden_state`` and ``pooler_output`` hold **ambient coordinates**
``x = (sqrt(k) cosh a, sqrt(k) sinh a u)`` of shape ``(..., n+1)``, the natural Lorentz tensor;
``last_hidden_polar`` / ``pooler_polar`` hold the exact polar view ``[r, u]`` (use these beyond
``r ~ 8`` in float32, where the ambient view loses precision).

Every module declares the roles of its parameters (``parameter_roles``, read by
:func:`parameter_roles` and ``optim.param_groups``): manifold points (bias points of the gyro layer
norms, the class token; stored as plain tensors of space coordinates, because a ``Parameter``
subclass would not survive ``from_pretrained`` in transformers 5), scales that are never
weight-decayed, and Polar-FC radius parameters decayed towards their anchor (Appendix D.3).  Every
module sets its initial values in one place, ``init_parameters`` (called at construction and by
``_init_weights``).  Ablation variants are classes chosen from mappings (``RESIDUAL_CLASSES``,
``RELATIVE_POSITION_CLASSES``, ``HEAD_CLASSES``, ``POOLER_CLASSES``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel, initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

from .attention import select_implementation
from .configuration_polar_vit import POSITION_AXES, PolarViTConfig, PolarViTSphericalConfig
from .fused import fused_boost_residual, fused_gyro_layer_norm, fused_polar_fc, fused_reserved_axes_encoding
from .geometry import asinh_exp, cosh_sinhc_sq, input_checks, perp, safe_normalize
from .manifold_ops import ManifoldOps, PolarOps, make_ops
from .spherical import apply_so3_rope, icosphere_patches, lift_patches, patch_features, token_rope

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


@dataclass
class PolarViTModelOutput(BaseModelOutputWithPooling):
    r"""Output of :class:`PolarViTModel`.

    Args:
        last_hidden_state (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size + 1)`):
            Ambient Lorentz coordinates ``(x_0, x_s)`` of the output tokens (after the final gyro norm).
        pooler_output (`torch.FloatTensor` of shape `(batch_size, hidden_size + 1)`):
            Ambient coordinates of the readout point (polar centroid of the tokens or class token).
        hidden_states (`tuple(torch.FloatTensor)`, *optional*):
            Ambient coordinates after the embeddings and after every layer.
        attentions (`tuple(torch.FloatTensor)`, *optional*):
            Attention probabilities ``(batch_size, num_heads, seq, seq)`` of every layer.
        last_hidden_polar (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size + 1)`):
            The same tokens in polar form ``[r, u]``: exact at any radius.
        pooler_polar (`torch.FloatTensor` of shape `(batch_size, hidden_size + 1)`):
            The readout point in polar form ``[r, u]``.
    """

    last_hidden_polar: Tensor | None = None
    pooler_polar: Tensor | None = None


# ------------------------------------------------------------------------------------------------
# layers
# ------------------------------------------------------------------------------------------------
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
    ):
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
        heads = self.num_heads or 1
        if ops.fused:
            out = fused_polar_fc(p, self.weight, self.rule_parameters(), self.sqrt_k, heads, self.activation)
            return out if self.num_heads else out.squeeze(-2)
        h = F.linear(ops.unit_coords(p), self.weight).unflatten(-1, (heads, self.out_features))
        if self.activation is not None:
            h = self.activation(h)
        norm = torch.linalg.vector_norm(h, dim=-1)  # (..., H)
        log_norm = torch.log(norm.clamp_min(1e-30))
        if self.radius_rule:
            a = (ops.radius(p) / self.sqrt_k).unsqueeze(-1)
            log_radius = (
                self.norm_power * log_norm + self.radius_weight * a
                + ops.klein(p) @ self.klein_weight.t() + self.radius_bias
            )
        else:
            log_radius = log_norm
        out = ops.make(self.sqrt_k * asinh_exp(log_radius), safe_normalize(h))
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

    def __init__(self, num_heads: int, rate_init: tuple[float, float]):
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

    def move(self, p: Tensor, t: Tensor, axes: tuple[int, int], ops: ManifoldOps) -> Tensor:
        """Move the points ``p`` by ``t`` on the axis pair ``axes``."""
        raise NotImplementedError

    def forward(self, p: Tensor, grid: tuple[int, int], num_prefix: int, ops: ManifoldOps) -> Tensor:
        """``p (B, N, H, d+1)`` -> same shape."""
        t_rows, t_cols = self.offsets(grid, num_prefix, p.dtype)
        if ops.fused:
            return fused_reserved_axes_encoding(p, t_rows, t_cols, self.kind, ops.sqrt_k)
        for t, axes in zip((t_rows, t_cols), POSITION_AXES):
            p = self.move(p, t, axes, ops)
        return p


class HoroshiftEncoding(RelativePositionEncoding):
    """Horoshift (Eq. 10, App. C): axis ``first`` is the ideal axis, ``second`` the shift axis; the squared
    distance of Eq. 9 then depends only on the offset along each grid axis."""

    kind = "horoshift"

    def move(self, p: Tensor, t: Tensor, axes: tuple[int, int], ops: ManifoldOps) -> Tensor:
        return ops.horoshift(p, t, *axes)


class BoostEncoding(RelativePositionEncoding):
    """HoPE: a Lorentz boost along the first axis of each pair with rapidity ``t``."""

    kind = "boost"

    def move(self, p: Tensor, t: Tensor, axes: tuple[int, int], ops: ManifoldOps) -> Tensor:
        return ops.boost(p, t, axes[0])


class RotationEncoding(RelativePositionEncoding):
    """HOPE, HELM: a rotation of the plane of each axis pair by angle ``t``."""

    kind = "rotation"

    def move(self, p: Tensor, t: Tensor, axes: tuple[int, int], ops: ManifoldOps) -> Tensor:
        return ops.rotate(p, t, *axes)


class SO3RotaryEncoding(nn.Module):
    r"""SO(3)-RoPE (Libner et al., Eq. 2 and 6) on spherical tokens: the direction ``u`` of every query and key head
    is multiplied by ``pi(R_t) = diag(D^0, ..., D^L)`` of its token's pose, the radius is untouched.

    ``pi(R_t)`` is orthogonal, so this is an isometry of ``L^d`` fixing the origin and the squared distance of
    Eq. 9 becomes ``d^2(q, pi(R_s^{-1} R_t) k)``: it depends on the relative pose only.  In ambient
    coordinates the same matrix acts on the space coordinates.  No parameters; prefix (class) tokens are not moved.
    """

    kind = "so3"

    def forward(self, p: Tensor, rope: Tensor, num_prefix: int, ops: ManifoldOps) -> Tensor:
        """``p (B, N, H, d+1)``, ``rope (N - num_prefix, m, m)`` -> same shape."""
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
    return RELATIVE_POSITION_CLASSES[config.relative_position](config.num_attention_heads, config.horoshift_rate_init)


def _has_forward_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` would run forward (pre-)hooks, its own or global ones."""
    from torch.nn.modules import module as torch_module

    return bool(module._forward_hooks or module._forward_pre_hooks or torch_module._global_forward_hooks
                or torch_module._global_forward_pre_hooks)


class PolarSelfAttention(nn.Module):
    r"""Split-head polar attention, Eq. 9.

    Queries, keys and values are per-head Polar-FCs ``L^n -> L^{n/H}`` (orthogonal init, D.2); the
    relative positional encoding moves queries and keys; the score is ``-(gamma / tau_h) d^2`` with
    ``gamma = (n/H)^{-1/2}`` and a learned temperature per head; the values are aggregated by the
    polar centroid (Eq. 22); heads are merged by Lorentz direct concatenation, then a Polar-FC.
    With ``head_merge="beta_concat"`` (HNN++ multi-head attention) each projection is one Polar-FC
    ``L^n -> L^n`` followed by a beta-split into the heads, and the heads are merged by
    beta-concatenation (:func:`geometry.beta_split`, :func:`geometry.beta_concat`).
    """

    def __init__(self, config: PolarViTConfig):
        super().__init__()
        n, heads, d = config.hidden_size, config.num_attention_heads, config.head_dim
        rule = config.linear == "polar"
        self.num_heads, self.head_dim, self.k = heads, d, float(config.k)
        self.config = config  # read at call time: ``model.config.polar_attn_implementation = ...`` switches

        def projection(out_features: int, num_heads: int | None) -> PolarFC:
            return PolarFC(n, out_features, config.k, num_heads, radius_rule=rule, init_scheme="orthogonal")

        self.beta_heads = config.head_merge == "beta_concat"
        split = (n, None) if self.beta_heads else (d, heads)
        self.q_proj, self.k_proj, self.v_proj = (projection(*split) for _ in range(3))
        self.o_proj = projection(n, None)
        self.temperature_init = float(config.attention_temperature_init)
        self.log_temperature = nn.Parameter(torch.empty(heads))
        self.position = relative_position_encoding(config)
        self.init_parameters()

    parameter_roles = {"log_temperature": NO_DECAY}

    def init_parameters(self) -> None:
        """Every head starts at the temperature ``attention_temperature_init``."""
        init.constant_(self.log_temperature, math.log(self.temperature_init))

    def scale(self) -> Tensor:
        """``gamma / tau_h`` per head."""
        return self.head_dim**-0.5 * torch.exp(-self.log_temperature)

    def project(self, p: Tensor, ops: ManifoldOps) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values.  Fused, the three Polar-FCs (one input) run as one with stacked weights,
        unless a forward hook watches one of them (``calibration``, feature extraction): then each runs as itself."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if not ops.fused or any(_has_forward_hooks(projection) for projection in projections):
            return tuple(projection(p, ops) for projection in projections)
        rules = [projection.rule_parameters() for projection in projections]
        rule = None if rules[0] is None else tuple(torch.cat(parts) for parts in zip(*rules))
        heads = self.q_proj.num_heads or 1
        out = fused_polar_fc(p, torch.cat([projection.weight for projection in projections]), rule,
                             self.q_proj.sqrt_k, 3 * heads)  # (B, N, 3 heads, d+1)
        return tuple(t if self.q_proj.num_heads else t.squeeze(-2) for t in out.chunk(3, dim=-2))

    def forward(
        self, p: Tensor, positions: tuple[int, int] | Tensor | None, num_prefix: int, ops: ManifoldOps,
        output_attentions: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``positions``: the patch grid ``(rows, cols)`` of a planar input or the SO(3)-RoPE matrices ``(N, m, m)``
        of a spherical one (:class:`PolarViTSphericalEmbeddings`)."""
        q, k, v = self.project(p, ops)
        if self.beta_heads:  # (B, N, n+1) -> (B, N, H, d+1)
            q, k, v = (ops.beta_split_heads(t, self.num_heads) for t in (q, k, v))
        if self.position is not None:  # queries and keys move alike: one call on both
            q, k = self.position(torch.cat([q, k]), positions, num_prefix, ops).chunk(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, N, d+1)
        implementation = select_implementation(self.config.polar_attn_implementation, output_attentions, p.device,
                                               p.shape[1], self.config.fused_ops)
        heads, probs = ops.attention(q, k, v, self.scale().to(p.dtype), implementation, output_attentions)
        heads = heads.transpose(1, 2)
        merged = ops.beta_concat_heads(heads) if self.beta_heads else ops.concat_heads(heads)  # (B, N, n+1)
        return self.o_proj(merged, ops), probs


class GyroLayerNorm(nn.Module):
    r"""Gyro layer normalisation over the tokens of each sample (Sec. 4.4).

    ``x_hat = beta (+) (gamma / sqrt(sigma^2 + eps) (x) ((-)xbar (+) x))`` with ``xbar`` the polar
    centroid of the sample's tokens and ``sigma^2`` their mean squared distance to it.  The gain
    ``gamma = exp(log_gain)`` starts at ``sqrt(k) arsinh sqrt(n/k)``; the bias point ``beta``
    (space coordinates ``bias_point``) starts at the origin.  No running state.
    """

    def __init__(self, hidden_size: int, k: float, eps: float):
        super().__init__()
        self.hidden_size, self.k, self.eps = hidden_size, float(k), float(eps)
        self.log_gain = nn.Parameter(torch.empty(()))
        self.bias_point = nn.Parameter(torch.empty(hidden_size))
        self.init_parameters()

    parameter_roles = {"log_gain": NO_DECAY, "bias_point": MANIFOLD}

    def init_parameters(self) -> None:
        """``gamma = sqrt(k) arsinh sqrt(n/k)``, the bias point at the origin."""
        init.constant_(self.log_gain, math.log(math.sqrt(self.k) * math.asinh(math.sqrt(self.hidden_size / self.k))))
        init.zeros_(self.bias_point)

    def forward(self, p: Tensor, ops: ManifoldOps) -> Tensor:
        if ops.fused:
            return fused_gyro_layer_norm(p, self.log_gain, self.bias_point.to(p.dtype), self.k, self.eps)
        batch, tokens = p.shape[0], p.shape[-2]
        uniform = p.new_full((batch, 1, tokens), 1.0 / tokens)
        mean = ops.centroid(p, uniform)  # (B, 1, n+1)
        variance = ops.sq_distance(p, mean).mean(-1, keepdim=True)  # (B, 1)
        centred = ops.gyrocenter(mean, p)
        scaled = ops.scale(centred, torch.exp(self.log_gain) / torch.sqrt(variance + self.eps))
        return ops.gyroadd_space(self.bias_point.to(p.dtype), scaled)


class PolarResidual(nn.Module):
    r"""Residual connection ``x -> x "+" f(x)`` with stochastic depth (base class of the variants below)."""

    def __init__(self, config: PolarViTConfig, drop_path: float):
        super().__init__()
        self.drop_path, self.sqrt_k = float(drop_path), math.sqrt(config.k)

    def init_parameters(self) -> None:
        """No parameters in the base class."""

    def _strength(self, p: Tensor) -> Tensor | None:
        """Per-sample stochastic-depth factor ``(B, 1)``: 0 (dropped) or ``1 / keep`` (kept)."""
        if not self.training or self.drop_path == 0.0:
            return None
        keep = 1.0 - self.drop_path
        mask = torch.empty(p.shape[0], 1, dtype=p.dtype, device=p.device).bernoulli_(keep)
        return mask / keep

    def combine(self, x: Tensor, f: Tensor, ops: ManifoldOps, strength: Tensor | None) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor, f: Tensor, ops: ManifoldOps) -> Tensor:
        return self.combine(x, f, ops, self._strength(x))


class BoostResidual(PolarResidual):
    r"""Eq. 12: ``a' = a + alpha (b_par - mean(b_par))`` (radial step centred over the sample's tokens) and
    ``u' = normalize(tanh(a) u + sinh(alpha b_perp) v_perp_hat)``, learned ``alpha`` (``residual_alpha_init``)."""

    parameter_roles = {"alpha": NO_DECAY}

    def __init__(self, config: PolarViTConfig, drop_path: float):
        super().__init__(config, drop_path)
        self.alpha_init = float(config.residual_alpha_init)
        self.alpha = nn.Parameter(torch.empty(()))
        self.init_parameters()

    def init_parameters(self) -> None:
        init.constant_(self.alpha, self.alpha_init)

    def combine(self, x: Tensor, f: Tensor, ops: ManifoldOps, strength: Tensor | None) -> Tensor:
        if ops.fused:
            return fused_boost_residual(x, f, self.alpha, strength, self.sqrt_k)
        r, u = ops.polar(x)
        r_f, v = ops.polar(f)
        a, b = r / self.sqrt_k, r_f / self.sqrt_k
        if strength is not None:
            b = b * strength
        v_perp, _, _ = perp(v, u)
        b_par = b * (u * v).sum(-1)
        perp_step = (self.alpha * b).unsqueeze(-1) * v_perp  # alpha b_perp v_perp_hat
        a_new = a + self.alpha * (b_par - b_par.mean(-1, keepdim=True))
        _, sinhc = cosh_sinhc_sq(perp_step.square().sum(-1))
        direction = safe_normalize(torch.tanh(a).unsqueeze(-1) * u + sinhc.unsqueeze(-1) * perp_step)
        flip = torch.where(a_new < 0, -1.0, 1.0).to(direction.dtype).unsqueeze(-1)
        return ops.make(self.sqrt_k * a_new.abs(), flip * direction)


class SpaceResidual(PolarResidual):
    """Chen et al. 2022: add the space coordinates, recompute the time coordinate."""

    def combine(self, x: Tensor, f: Tensor, ops: ManifoldOps, strength: Tensor | None) -> Tensor:
        step = ops.space(f) if strength is None else ops.space(f) * strength.unsqueeze(-1)
        return ops.from_space(ops.space(x) + step)


class LorentzMidpointResidual(PolarResidual):
    """LResNet: the weighted Lorentzian midpoint of ``{x, f(x)}`` with weights ``(1, softplus(w))``, ``w`` starting
    where the weight is 1."""

    parameter_roles = {"midpoint_weight": NO_DECAY}

    def __init__(self, config: PolarViTConfig, drop_path: float):
        super().__init__(config, drop_path)
        self.midpoint_weight = nn.Parameter(torch.empty(()))
        self.init_parameters()

    def init_parameters(self) -> None:
        init.constant_(self.midpoint_weight, math.log(math.e - 1.0))  # softplus -> 1

    def combine(self, x: Tensor, f: Tensor, ops: ManifoldOps, strength: Tensor | None) -> Tensor:
        w = F.softplus(self.midpoint_weight).expand(x.shape[:-1])
        if strength is not None:
            w = w * strength
        weights = torch.stack([torch.ones_like(w), w], dim=-1).unsqueeze(-2)  # (B, N, 1, 2)
        return ops.centroid(torch.stack([x, f], dim=-2), weights).squeeze(-2)


RESIDUAL_CLASSES = {"boost": BoostResidual, "space": SpaceResidual, "lorentz_midpoint": LorentzMidpointResidual}


class PolarMLP(nn.Module):
    """Two Polar-FCs ``L^n -> L^m -> L^n`` with the activation in the first (Eq. 8, Xavier init)."""

    def __init__(self, config: PolarViTConfig):
        super().__init__()
        rule = config.linear == "polar"
        self.fc1 = PolarFC(config.hidden_size, config.intermediate_size, config.k,
                           activation=config.hidden_act, radius_rule=rule)
        self.fc2 = PolarFC(config.intermediate_size, config.hidden_size, config.k, radius_rule=rule)

    def forward(self, p: Tensor, ops: ManifoldOps) -> Tensor:
        return self.fc2(self.fc1(p, ops), ops)


class PolarViTLayer(GradientCheckpointingLayer):
    """Pre-norm block: gyro norm, polar attention, residual; gyro norm, polar MLP, residual."""

    def __init__(self, config: PolarViTConfig, drop_path: float = 0.0):
        super().__init__()
        self.attention_norm = GyroLayerNorm(config.hidden_size, config.k, config.layer_norm_eps)
        self.attention = PolarSelfAttention(config)
        self.attention_residual = RESIDUAL_CLASSES[config.residual](config, drop_path)
        self.mlp_norm = GyroLayerNorm(config.hidden_size, config.k, config.layer_norm_eps)
        self.mlp = PolarMLP(config)
        self.mlp_residual = RESIDUAL_CLASSES[config.residual](config, drop_path)

    def forward(
        self, hidden: Tensor, positions: tuple[int, int] | Tensor | None, num_prefix: int, ops: ManifoldOps,
        output_attentions: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        attended, probs = self.attention(self.attention_norm(hidden, ops), positions, num_prefix, ops,
                                         output_attentions)
        hidden = self.attention_residual(hidden, attended, ops)
        hidden = self.mlp_residual(hidden, self.mlp(self.mlp_norm(hidden, ops), ops), ops)
        return hidden, probs


def sincos_positions(hidden_size: int, grid: tuple[int, int]) -> Tensor:
    """2-D sine-cosine positions ``(rows * cols, n)`` (MAE style), scaled to unit norm per token."""
    if hidden_size % 4:
        raise ValueError(f"sine-cosine positions need hidden_size divisible by 4, got {hidden_size}")
    quarter = hidden_size // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(grid[0], dtype=torch.float64),
                                torch.arange(grid[1], dtype=torch.float64), indexing="ij")
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

    def __init__(self, config: PolarViTConfig):
        super().__init__()
        self.epsilon = float(config.hypformer_epsilon)
        self.htc_linear = PolarFC(config.hidden_size, config.hidden_size, config.k, radius_rule=False,
                                  init_scheme="uniform")

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

    def __init__(self, config: PolarViTConfig):
        super().__init__()
        self.config = config
        self.patch_size = config.patch_size
        self.grid = (config.image_size // config.patch_size,) * 2
        self.patch_projection = PolarFC(self.patch_features(config), config.hidden_size, config.k,
                                        radius_rule=config.linear == "polar")
        self.position_embeddings = None
        if config.position_embedding == "learned":
            self.position_embeddings = nn.Parameter(torch.empty(1, config.num_patches, config.hidden_size))
        self.position_encoding = (
            HypformerPositionalEncoding(config) if config.position_embedding == "hypformer" else None)
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

    def positions(self, grid: tuple[int, int], dtype: torch.dtype) -> Tensor | None:
        """Position table for ``grid``; learned tables are bicubically interpolated when asked to."""
        kind = self.config.position_embedding
        if kind in ("none", "hypformer"):
            return None
        if kind == "sincos":  # computed on the fly: cheap, and never a stale buffer after meta-device loading
            device = self.patch_projection.weight.device
            return sincos_positions(self.config.hidden_size, grid)[None].to(device=device, dtype=dtype)
        table = self.position_embeddings
        if grid != self.grid:
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

    def forward(self, pixel_values: Tensor, ops: ManifoldOps, interpolate_pos_encoding: bool = False
                ) -> tuple[Tensor, tuple[int, int], int]:
        """``(tokens, patch grid (rows, cols), number of prefix tokens)``."""
        batch, channels, height, width = pixel_values.shape
        size = self.patch_size
        grid = (height // size, width // size)
        if grid != self.grid and not interpolate_pos_encoding and self.config.position_embedding == "learned":
            raise ValueError(
                f"Input image size ({height}*{width}) doesn't match model ({self.config.image_size}*"
                f"{self.config.image_size}); resize the image or pass interpolate_pos_encoding=True"
            )
        patches = pixel_values.reshape(batch, channels, grid[0], size, grid[1], size)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(batch, grid[0] * grid[1], -1)
        tokens, num_prefix = self.embed(patches, self.positions(grid, patches.dtype), ops)
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
        return patch_features(config.num_channels, config.icosphere_level, config.patch_level,
                                        config.longitude_encoding)

    def rope(self, dtype: torch.dtype) -> Tensor | None:
        """``pi(R_t)`` of every token, or ``None`` without SO(3)-RoPE."""
        if self.config.relative_position != "so3":
            return None
        config = self.config
        rope = token_rope(config.icosphere_level, config.patch_level, config.head_dim)
        return rope.to(device=self.patch_projection.weight.device, dtype=dtype)

    def forward(self, pixel_values: Tensor, ops: ManifoldOps, interpolate_pos_encoding: bool = False
                ) -> tuple[Tensor, Tensor | None, int]:
        """``(tokens, SO(3)-RoPE matrices or None, number of prefix tokens)``."""
        config = self.config
        patches = lift_patches(pixel_values, config.icosphere_level, config.patch_level,
                                         config.longitude_encoding)  # (B, N, (C + K) S)
        table = None if self.position_embeddings is None else self.position_embeddings.to(patches.dtype)
        tokens, num_prefix = self.embed(patches, table, ops)
        return tokens, self.rope(patches.dtype), num_prefix


class HyperplaneHead(nn.Module):
    r"""Hyperbolic multinomial logistic regression, one hyperplane per class (base of the two MLR heads).

    Both margins have the form ``c1 sinh(a) (u . z_hat) - c2 cosh(a)`` (:meth:`ManifoldOps.hyperplane_margin`:
    in polar form ``cosh(a) [c1 (u . z_hat) - c2] - c1 (u . z_hat) e^{-a}``, so the large terms never cancel).
    """

    def __init__(self, hidden_size: int, num_labels: int, k: float, std: float):
        super().__init__()
        self.sqrt_k, self.std = math.sqrt(k), float(std)
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))  # z_c
        self.bias = nn.Parameter(torch.empty(num_labels))  # a_c or r_c
        self.init_parameters()

    def init_parameters(self) -> None:
        init.normal_(self.weight, std=self.std)
        init.zeros_(self.bias)

    def unit_normal(self) -> tuple[Tensor, Tensor]:
        """``(||z_c||, z_c / ||z_c||)``."""
        z_norm = torch.linalg.vector_norm(self.weight, dim=-1).clamp_min(1e-12)
        return z_norm, self.weight / z_norm.unsqueeze(-1)


class LorentzMLRHead(HyperplaneHead):
    r"""Bdeir et al. 2024: ``v_c = sqrt(k) ||z_c|| arsinh(alpha_c / (sqrt(k) ||z_c||))`` with
    ``alpha_c = cosh(A) <z_c, x_s> - sinh(A) x_0``, ``A = a_c / sqrt(k)``."""

    def forward(self, p: Tensor, ops: ManifoldOps) -> Tensor:
        z_norm, z_hat = self.unit_normal()
        big_a = self.bias / self.sqrt_k
        margin = ops.hyperplane_margin(p, z_hat, z_norm * torch.cosh(big_a), torch.sinh(big_a))
        return self.sqrt_k * z_norm * torch.asinh(margin / z_norm)


class PoincareMLRHead(HyperplaneHead):
    r"""HNN++ unidirectional MLR on the Poincare image ``x_s / (1 + x_0 / sqrt(k))``:
    ``v_c = 2 sqrt(k) ||z_c|| arsinh(lambda_x <x, z_hat> cosh(2 r_c/sqrt(k)) - (lambda_x - 1) sinh(2 r_c/sqrt(k)))``,
    in polar form ``sinh(a) (u . z_hat) cosh(A) - cosh(a) sinh(A)``."""

    def forward(self, p: Tensor, ops: ManifoldOps) -> Tensor:
        z_norm, z_hat = self.unit_normal()
        big_a = 2.0 * self.bias / self.sqrt_k
        margin = ops.hyperplane_margin(p, z_hat, torch.cosh(big_a), torch.sinh(big_a))
        return 2.0 * self.sqrt_k * z_norm * torch.asinh(margin)


class TangentLinearHead(nn.Module):
    """Hybrid head: a Euclidean linear layer on ``log_o(x) = r u``."""

    def __init__(self, hidden_size: int, num_labels: int, k: float, std: float):
        super().__init__()
        self.std = float(std)
        self.linear = nn.Linear(hidden_size, num_labels)
        self.init_parameters()

    def init_parameters(self) -> None:
        init.trunc_normal_(self.linear.weight, std=self.std)
        init.zeros_(self.linear.bias)

    def forward(self, p: Tensor, ops: ManifoldOps) -> Tensor:
        r, u = ops.polar(p)
        return self.linear(r.unsqueeze(-1) * u)


HEAD_CLASSES = {"lorentz_mlr": LorentzMLRHead, "poincare_mlr": PoincareMLRHead, "tangent_linear": TangentLinearHead}


class PolarViTEncoder(nn.ModuleList):
    """The ``L`` polar blocks (a ``ModuleList``, so checkpoints keep the keys ``layers.{i}``), drop-path rates
    rising linearly to ``drop_path_rate``."""

    def __init__(self, config: PolarViTConfig):
        depth = config.num_hidden_layers
        rates = [config.drop_path_rate * i / max(1, depth - 1) for i in range(depth)]
        super().__init__([PolarViTLayer(config, rate) for rate in rates])

    def forward(
        self, hidden: Tensor, positions: tuple[int, int] | Tensor | None, num_prefix: int, ops: ManifoldOps,
        output_attentions: bool = False, output_hidden_states: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, ...] | None, tuple[Tensor, ...] | None]:
        """``(hidden, all hidden states in ambient coordinates or None, attentions or None)``."""
        all_hidden = [ops.to_ambient(hidden)] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        for layer in self:
            hidden, probs = layer(hidden, positions, num_prefix, ops, output_attentions)
            if all_hidden is not None:
                all_hidden.append(ops.to_ambient(hidden))
            if all_attentions is not None:
                all_attentions.append(probs)
        return (hidden, tuple(all_hidden) if all_hidden is not None else None,
                tuple(all_attentions) if all_attentions is not None else None)


class PolarViTCentroidPooler(nn.Module):
    """Readout: the polar centroid (Eq. 22) of the output tokens with uniform weights."""

    def forward(self, hidden: Tensor, ops: ManifoldOps) -> Tensor:
        uniform = hidden.new_full((hidden.shape[0], 1, hidden.shape[1]), 1.0 / hidden.shape[1])
        return ops.centroid(hidden, uniform).squeeze(1)


class PolarViTClassTokenPooler(nn.Module):
    """Readout: the class token (the first token)."""

    def forward(self, hidden: Tensor, ops: ManifoldOps) -> Tensor:
        return hidden[:, 0]


POOLER_CLASSES = {"centroid": PolarViTCentroidPooler, "cls": PolarViTClassTokenPooler}


# ------------------------------------------------------------------------------------------------
# transformers classes
# ------------------------------------------------------------------------------------------------
class PolarViTPreTrainedModel(PreTrainedModel):
    """Weights initialisation (Appendix D.2) and the transformers plumbing shared by Polar-ViT models."""

    config_class = PolarViTConfig
    config: PolarViTConfig
    base_model_prefix = "polar_vit"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    supports_gradient_checkpointing = True
    _no_split_modules = ["PolarViTEmbeddings", "PolarViTLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        """Every Polar-ViT module sets its own initial values (``init_parameters``, Appendix D.2); plain
        ``nn.Linear`` layers inside them (the tangent-linear head) get the truncated normal of
        ``initializer_range`` and a zero bias.  transformers calls this for every module whose parameters were not
        loaded (a new head after ``ignore_mismatched_sizes``, a base model loaded as a classifier)."""
        if hasattr(module, "init_parameters"):
            module.init_parameters()
        elif isinstance(module, nn.Linear):
            init.trunc_normal_(module.weight, std=self.config.initializer_range)
            if module.bias is not None:
                init.zeros_(module.bias)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` plus the complete ``auto_map`` for remote code.

        transformers records only the saved class in ``config.json``'s ``auto_map``; Polar-ViT folders
        list ``AutoConfig``, ``AutoModel`` and ``AutoModelForImageClassification`` so any of them
        loads with ``trust_remote_code=True`` where ``polar_vit_hf`` is not installed.
        """
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            complete_auto_map(save_directory, SPHERICAL_AUTO_MAP if self.config.is_spherical else AUTO_MAP)
        return result

    def manifold_parameter_names(self) -> list[str]:
        """Names of the parameters that are points of the manifold (stored as space coordinates)."""
        return [name for name, role in parameter_roles(self).items() if role == MANIFOLD]


AUTO_MAP = {
    "AutoConfig": "configuration_polar_vit.PolarViTConfig",
    "AutoModel": "modeling_polar_vit.PolarViTModel",
    "AutoModelForImageClassification": "modeling_polar_vit.PolarViTForImageClassification",
}


SPHERICAL_AUTO_MAP = {
    "AutoConfig": "configuration_polar_vit.PolarViTSphericalConfig",
    "AutoModel": "modeling_polar_vit.PolarViTSphericalModel",
    "AutoModelForImageClassification": "modeling_polar_vit.PolarViTSphericalForImageClassification",
}


def complete_auto_map(save_directory, entries: dict[str, str]) -> None:
    """Write every Polar-ViT Auto class into ``config.json``'s ``auto_map`` (keeps other entries)."""
    import json
    import os

    path = os.path.join(save_directory, "config.json")
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["auto_map"] = {**config.get("auto_map", {}), **entries}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")


# Largest patch radius (RMS pixel value of a patch) the model accepts: deeper layers grow radii by a few units and
# the polar arithmetic holds to r ~ 88 in float32 (measured: fused tiny-cifar finite at RMS 30, not at 40).
PATCH_RADIUS_LIMIT = 32.0


def _check_pixel_values(pixel_values: Tensor | None, config: PolarViTConfig) -> None:
    """Validate the model input once, at the edge: layout, channels, finiteness and the pixel scale (patch RMS)."""
    if pixel_values is None:
        raise ValueError("You have to specify pixel_values")
    spherical_input = config.is_spherical
    layout = "(batch, channels, vertices)" if spherical_input else "(batch, channels, height, width)"
    if pixel_values.dim() != (3 if spherical_input else 4):
        raise ValueError(f"pixel_values must have shape {layout}, got {tuple(pixel_values.shape)}"
                         + ("; resample images with PolarViTSphericalImageProcessor" if spherical_input else ""))
    if pixel_values.shape[1] != config.num_channels:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[1]} channels but the model expects "
            f"num_channels={config.num_channels}; check the image mode (e.g. convert to RGB)"
        )
    if spherical_input and pixel_values.shape[2] != config.num_vertices:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[2]} values per channel but icosphere_level="
            f"{config.icosphere_level} has {config.num_vertices} vertices; resample with "
            f"PolarViTSphericalImageProcessor(icosphere_level={config.icosphere_level})"
        )
    if not spherical_input:
        height, width = pixel_values.shape[-2:]
        if height % config.patch_size or width % config.patch_size:
            raise ValueError(f"image size {height}x{width} is not a multiple of patch_size={config.patch_size}")
    if torch.compiler.is_compiling():
        return
    if not torch.isfinite(pixel_values).all():
        raise ValueError("pixel_values contains NaN or Inf values")
    # the radius of a patch token is the RMS of its values (PolarViTEmbeddings): keep it where float32 holds
    power = pixel_values.detach().float().square().mean(1)
    if spherical_input:
        _, index, _ = icosphere_patches(config.icosphere_level, config.patch_level)
        patch_rms = power[:, index.to(power.device)].mean(-1).sqrt()
        patch = "patch"
    else:
        patch_rms = F.avg_pool2d(power.unsqueeze(1), config.patch_size).sqrt()
        patch = f"{config.patch_size}x{config.patch_size} patch"
    largest = float(patch_rms.max())
    if largest > PATCH_RADIUS_LIMIT:
        processor = "PolarViTSphericalImageProcessor" if spherical_input else "PolarViTImageProcessor"
        raise ValueError(
            f"pixel_values look unnormalised: a {patch} has RMS {largest:.1f}, and that RMS is the radius of its "
            f"token on the hyperboloid (Polar-ViT supports patch radii up to {PATCH_RADIUS_LIMIT:g}; float32 "
            f"overflows near 88). Rescale and normalise the images first, e.g. with {processor} "
            f"(do_rescale=True, do_normalize=True), so pixel values are of order 1"
        )


class PolarViTModel(PolarViTPreTrainedModel):
    """The bare Polar-ViT encoder: embeddings, ``L`` polar blocks, final gyro norm and readout point."""

    def __init__(self, config: PolarViTConfig):
        super().__init__(config)
        self.embeddings = (PolarViTSphericalEmbeddings if config.is_spherical else PolarViTEmbeddings)(config)
        self.layers = PolarViTEncoder(config)
        self.norm = GyroLayerNorm(config.hidden_size, config.k, config.layer_norm_eps)
        self.pooler = POOLER_CLASSES[config.readout]()
        self.gradient_checkpointing = False
        self.post_init()

    def set_arithmetic(self, arithmetic: str) -> None:
        """Switch between polar and ambient arithmetic in place (same parameters)."""
        self.config.arithmetic = arithmetic
        self.config.validate_polar_vit()

    @property
    def encoder(self) -> PolarViTEncoder:
        """The polar blocks (stored as ``layers``)."""
        return self.layers

    @property
    def ops(self) -> ManifoldOps:
        """The arithmetic of ``config.arithmetic`` / ``config.fused_ops``, read at call time (both switch in place)."""
        return make_ops(self.config.arithmetic, self.config.k, self.config.fused_ops)

    def forward(
        self,
        pixel_values: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        interpolate_pos_encoding: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> PolarViTModelOutput | tuple:
        config = self.config
        output_attentions = output_attentions if output_attentions is not None else config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else config.return_dict
        _check_pixel_values(pixel_values, config)
        ops = self.ops
        dtype = self.embeddings.patch_projection.weight.dtype
        # the polar arithmetic always runs in (at least) float32, also under bf16 autocast
        compute_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        # inputs were checked once above; the geometry functions inside run without their per-call checks
        with torch.autocast(device_type=pixel_values.device.type, enabled=False), input_checks(False):
            hidden, positions, num_prefix = self.embeddings(
                pixel_values.to(compute_dtype), ops, bool(interpolate_pos_encoding)
            )
            hidden, all_hidden, all_attentions = self.encoder(
                hidden, positions, num_prefix, ops, bool(output_attentions), bool(output_hidden_states)
            )
            hidden = self.norm(hidden, ops)
            pooled = self.pooler(hidden, ops)
        polar_view = PolarOps.make(*ops.polar(hidden))
        pooled_polar = PolarOps.make(*ops.polar(pooled))
        output = PolarViTModelOutput(
            last_hidden_state=ops.to_ambient(hidden),
            pooler_output=ops.to_ambient(pooled),
            hidden_states=all_hidden,
            attentions=all_attentions,
            last_hidden_polar=polar_view,
            pooler_polar=pooled_polar,
        )
        return output if return_dict else output.to_tuple()


class PolarViTForImageClassification(PolarViTPreTrainedModel):
    """Polar-ViT with a hyperbolic classification head on the readout point (Sec. 4)."""

    def __init__(self, config: PolarViTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.polar_vit = PolarViTModel(config)
        self.classifier = HEAD_CLASSES[config.head](config.hidden_size, config.num_labels, config.k,
                                                    config.initializer_range)
        self.post_init()

    def set_arithmetic(self, arithmetic: str) -> None:
        """Switch between polar and ambient arithmetic in place (same parameters)."""
        self.polar_vit.set_arithmetic(arithmetic)

    def reset_classifier(self, id2label: dict[int, str]) -> None:
        """A new, freshly initialised head for the labels ``id2label`` (fine-tuning on another label set; the
        config's ``id2label`` / ``label2id`` / ``num_labels`` follow)."""
        config = self.config
        config.id2label = {int(k): v for k, v in id2label.items()}
        config.label2id = {v: k for k, v in config.id2label.items()}
        self.num_labels = config.num_labels
        weight = next(self.polar_vit.parameters())
        self.classifier = HEAD_CLASSES[config.head](config.hidden_size, config.num_labels, config.k,
                                                    config.initializer_range).to(device=weight.device,
                                                                                 dtype=weight.dtype)

    def forward(
        self,
        pixel_values: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        interpolate_pos_encoding: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ImageClassifierOutput | tuple:
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.polar_vit(
            pixel_values,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            interpolate_pos_encoding=interpolate_pos_encoding,
            return_dict=True,
        )
        ops = self.polar_vit.ops
        pooled = ops.readout(outputs)
        with torch.autocast(device_type=pooled.device.type, enabled=False):
            logits = self.classifier(pooled, ops)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels, logits, self.config, **kwargs)
        output = ImageClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


class PolarViTSphericalModel(PolarViTModel):
    """The bare Polar-ViT encoder on icosphere signals (``PolarViTSphericalConfig``): lifting embedding, SO(3)-RoPE."""

    config_class = PolarViTSphericalConfig
    config: PolarViTSphericalConfig


class PolarViTSphericalForImageClassification(PolarViTForImageClassification):
    """Polar-ViT classifying icosphere signals (``PolarViTSphericalConfig``); with ``relative_position="so3"``, no
    absolute positions and the centroid readout, its logits are invariant under the 60 icosahedral rotations."""

    config_class = PolarViTSphericalConfig
    config: PolarViTSphericalConfig


__all__ = [
    "AUTO_MAP",
    "SPHERICAL_AUTO_MAP",
    "HEAD_CLASSES",
    "MANIFOLD",
    "NO_DECAY",
    "POOLER_CLASSES",
    "RADIUS_RULE_ANCHOR",
    "RELATIVE_POSITION_CLASSES",
    "RESIDUAL_CLASSES",
    "PolarViTEncoder",
    "PolarViTForImageClassification",
    "PolarViTModel",
    "PolarViTModelOutput",
    "PolarViTPreTrainedModel",
    "PolarViTSphericalForImageClassification",
    "PolarViTSphericalModel",
    "parameter_roles",
]
