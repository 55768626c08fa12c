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
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel, initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.utils import ModelOutput

from .configuration_polar_vit import (
    AUTO_MAP,
    SPHERICAL_AUTO_MAP,
    PolarViTConfig,
    PolarViTSphericalConfig,
    complete_auto_map,
)
from .heads_polar_vit import (  # the read-outs, re-exported with the model classes
    HEAD_CLASSES,
    POOLER_CLASSES,
    HyperplaneHead,
    LorentzMLRHead,
    PoincareMLRHead,
    PolarViTCentroidPooler,
    PolarViTClassTokenPooler,
    TangentLinearHead,
)
from .layers_polar_vit import (  # the embeddings' building blocks, re-exported with the model classes
    MANIFOLD,
    NO_DECAY,
    RADIUS_RULE_ANCHOR,
    RELATIVE_POSITION_CLASSES,
    BoostEncoding,
    HoroshiftEncoding,
    HypformerPositionalEncoding,
    PolarFC,
    PolarViTEmbeddings,
    PolarViTSphericalEmbeddings,
    PolarViTSphericalProjection,
    RelativePositionEncoding,
    RotationEncoding,
    SO3RotaryEncoding,
    parameter_roles,
    relative_position_encoding,
    sincos_positions,
)
from .manifold_ops import ManifoldOps, PolarOps, make_ops, product_dtype
from .runtime import runtime_options, use_runtime_options
from .spherical import field_loss
from .torch_internals import functorch_transforms_active
from .validation import check_pixel_values


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
def _has_forward_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` would run forward (pre-)hooks, its own or global ones."""
    from torch.nn.modules import module as torch_module

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
    )


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

    def __init__(self, config: PolarViTConfig) -> None:
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

    def scale(self, dtype: torch.dtype | None = None) -> Tensor:
        """``gamma / tau_h`` per head."""
        log_temperature = self.log_temperature if dtype is None else self.log_temperature.to(dtype)
        return self.head_dim**-0.5 * torch.exp(-log_temperature)

    def project(self, p: Tensor, ops: ManifoldOps) -> tuple[Tensor, Tensor]:
        """``(queries and keys side by side along the heads, values)``: the three Polar-FCs (one input) run as one
        with stacked weights (one product, one epilogue), and the queries and keys are a view of its output, which
        the values keep for backward anyway (the position encoding then saves no copy).  Where a forward hook
        watches one projection (``calibration``, feature extraction) each runs as itself."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        heads_dim = -2 if self.q_proj.num_heads else -1
        if any(_has_forward_hooks(projection) for projection in projections):
            return torch.cat([self.q_proj(p, ops), self.k_proj(p, ops)], dim=heads_dim), self.v_proj(p, ops)
        rules = [projection.rule_parameters() for projection in projections]
        rule = None
        if rules[0] is not None:
            beta, lam, varphi, varphi_0 = (torch.cat(parts) for parts in zip(*rules))
            rule = (beta, lam, varphi, varphi_0)
        heads = self.q_proj.num_heads or 1
        out = ops.polar_fc(
            p, torch.cat([projection.weight for projection in projections]), rule, 3 * heads
        )  # (B, N, 3 heads, d+1)
        qk, v = out.split([2 * heads, heads], dim=-2)
        return (qk, v) if self.q_proj.num_heads else (qk.flatten(-2), v.squeeze(-2))

    def forward(
        self,
        p: Tensor,
        positions: tuple[int, int] | Tensor | None,
        num_prefix: int,
        ops: ManifoldOps,
        output_attentions: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``positions``: the patch grid ``(rows, cols)`` of a planar input or the SO(3)-RoPE matrices ``(N, m, m)``
        of a spherical one (:class:`PolarViTSphericalEmbeddings`)."""
        qk, v = self.project(p, ops)
        if self.beta_heads:  # (B, N, 2 (n+1)) -> (B, N, 2H, d+1)
            q, k = qk.chunk(2, dim=-1)
            qk = torch.cat([ops.beta_split_heads(t, self.num_heads) for t in (q, k)], dim=-2)
            v = ops.beta_split_heads(v, self.num_heads)
        if self.position is not None:  # queries and keys move alike: one call on both, side by side
            qk = self.position(qk, positions, num_prefix, ops)
        heads, probs = ops.attention_heads(  # (B, N, H, d+1)
            qk, v, self.scale(p.dtype), self.config.polar_attn_implementation, output_attentions
        )
        merged = ops.beta_concat_heads(heads) if self.beta_heads else ops.concat_heads(heads)  # (B, N, n+1)
        return self.o_proj(merged, ops), probs


class GyroLayerNorm(nn.Module):
    r"""Gyro layer normalisation over the tokens of each sample (Sec. 4.4).

    ``x_hat = beta (+) (gamma / sqrt(sigma^2 + eps) (x) ((-)xbar (+) x))`` with ``xbar`` the polar
    centroid of the sample's tokens and ``sigma^2`` their mean squared distance to it.  The gain
    ``gamma = exp(log_gain)`` starts at ``sqrt(k) arsinh sqrt(n/k)``; the bias point ``beta``
    (space coordinates ``bias_point``) starts at the origin.  No running state.
    """

    def __init__(self, hidden_size: int, k: float, eps: float) -> None:
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
        return ops.gyro_layer_norm(p, self.log_gain.to(p.dtype), self.bias_point.to(p.dtype), self.eps)


class PolarResidual(nn.Module):
    r"""Residual connection ``x -> x "+" f(x)`` with stochastic depth (base class of the variants below)."""

    def __init__(self, config: PolarViTConfig, drop_path: float) -> None:
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

    def __init__(self, config: PolarViTConfig, drop_path: float) -> None:
        super().__init__(config, drop_path)
        self.alpha_init = float(config.residual_alpha_init)
        self.alpha = nn.Parameter(torch.empty(()))
        self.init_parameters()

    def init_parameters(self) -> None:
        init.constant_(self.alpha, self.alpha_init)

    def combine(self, x: Tensor, f: Tensor, ops: ManifoldOps, strength: Tensor | None) -> Tensor:
        return ops.boost_residual(x, f, self.alpha.to(x.dtype), strength)


class SpaceResidual(PolarResidual):
    """Chen et al. 2022: add the space coordinates, recompute the time coordinate."""

    def combine(self, x: Tensor, f: Tensor, ops: ManifoldOps, strength: Tensor | None) -> Tensor:
        step = ops.space(f) if strength is None else ops.space(f) * strength.unsqueeze(-1)
        return ops.from_space(ops.space(x) + step)


class LorentzMidpointResidual(PolarResidual):
    """LResNet: the weighted Lorentzian midpoint of ``{x, f(x)}`` with weights ``(1, softplus(w))``, ``w`` starting
    where the weight is 1."""

    parameter_roles = {"midpoint_weight": NO_DECAY}

    def __init__(self, config: PolarViTConfig, drop_path: float) -> None:
        super().__init__(config, drop_path)
        self.midpoint_weight = nn.Parameter(torch.empty(()))
        self.init_parameters()

    def init_parameters(self) -> None:
        init.constant_(self.midpoint_weight, math.log(math.e - 1.0))  # softplus -> 1

    def combine(self, x: Tensor, f: Tensor, ops: ManifoldOps, strength: Tensor | None) -> Tensor:
        w = F.softplus(self.midpoint_weight.to(x.dtype)).expand(x.shape[:-1])
        if strength is not None:
            w = w * strength
        weights = torch.stack([torch.ones_like(w), w], dim=-1).unsqueeze(-2)  # (B, N, 1, 2)
        return ops.centroid(torch.stack([x, f], dim=-2), weights).squeeze(-2)


RESIDUAL_CLASSES = {"boost": BoostResidual, "space": SpaceResidual, "lorentz_midpoint": LorentzMidpointResidual}


class PolarMLP(nn.Module):
    """Two Polar-FCs ``L^n -> L^m -> L^n`` with the activation in the first (Eq. 8, Xavier init)."""

    def __init__(self, config: PolarViTConfig) -> None:
        super().__init__()
        rule = config.linear == "polar"
        self.fc1 = PolarFC(
            config.hidden_size, config.intermediate_size, config.k, activation=config.hidden_act, radius_rule=rule
        )
        self.fc2 = PolarFC(config.intermediate_size, config.hidden_size, config.k, radius_rule=rule)

    def forward(self, p: Tensor, ops: ManifoldOps) -> Tensor:
        return self.fc2(self.fc1(p, ops), ops)


class PolarViTLayer(GradientCheckpointingLayer):
    """Pre-norm block: gyro norm, polar attention, residual; gyro norm, polar MLP, residual."""

    def __init__(self, config: PolarViTConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        self.attention_norm = GyroLayerNorm(config.hidden_size, config.k, config.layer_norm_eps)
        self.attention = PolarSelfAttention(config)
        self.attention_residual = RESIDUAL_CLASSES[config.residual](config, drop_path)
        self.mlp_norm = GyroLayerNorm(config.hidden_size, config.k, config.layer_norm_eps)
        self.mlp = PolarMLP(config)
        self.mlp_residual = RESIDUAL_CLASSES[config.residual](config, drop_path)

    def forward(
        self,
        hidden: Tensor,
        positions: tuple[int, int] | Tensor | None,
        num_prefix: int,
        ops: ManifoldOps,
        output_attentions: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        # inputs are checked at the model's edge; the layer runs (and a checkpointed layer is recomputed) without
        # the geometry's per-operation scans, whatever context the recomputation runs in
        with use_runtime_options(input_checks=False):
            attended, probs = self.attention(
                self.attention_norm(hidden, ops), positions, num_prefix, ops, output_attentions
            )
            hidden = self.attention_residual(hidden, attended, ops)
            hidden = self.mlp_residual(hidden, self.mlp(self.mlp_norm(hidden, ops), ops), ops)
        return hidden, probs


class PolarViTEncoder(nn.ModuleList):
    """The ``L`` polar blocks (a ``ModuleList``, so checkpoints keep the keys ``layers.{i}``), drop-path rates
    rising linearly to ``drop_path_rate``."""

    def __init__(self, config: PolarViTConfig) -> None:
        depth = config.num_hidden_layers
        rates = [config.drop_path_rate * i / max(1, depth - 1) for i in range(depth)]
        super().__init__([PolarViTLayer(config, rate) for rate in rates])

    def forward(
        self,
        hidden: Tensor,
        positions: tuple[int, int] | Tensor | None,
        num_prefix: int,
        ops: ManifoldOps,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, ...] | None, tuple[Tensor | None, ...] | None]:
        """``(hidden, all hidden states in ambient coordinates or None, attentions or None)``."""
        all_hidden = [ops.to_ambient(hidden)] if output_hidden_states else None
        all_attentions: list[Tensor | None] | None = [] if output_attentions else None
        for layer in self:
            hidden, probs = layer(hidden, positions, num_prefix, ops, output_attentions)
            if all_hidden is not None:
                all_hidden.append(ops.to_ambient(hidden))
            if all_attentions is not None:
                all_attentions.append(probs)
        return (
            hidden,
            tuple(all_hidden) if all_hidden is not None else None,
            tuple(all_attentions) if all_attentions is not None else None,
        )


# ------------------------------------------------------------------------------------------------
# transformers classes
# ------------------------------------------------------------------------------------------------
class PolarViTPreTrainedModel(PreTrainedModel):
    """Weights initialisation (Appendix D.2) and the transformers plumbing shared by Polar-ViT models."""

    config_class = PolarViTConfig
    config: PolarViTConfig
    base_model_prefix = "polar_vit"
    main_input_name = "pixel_values"
    input_modalities = ("image",)  # type: ignore[assignment]  # as transformers' ViT
    supports_gradient_checkpointing = True
    _no_split_modules = ["PolarViTEmbeddings", "PolarViTLayer"]
    kernels_for_inference = False  # set by compile_cpu_kernels(): gradient-free passes run the kernels at any size

    def _init_weights(self, module: nn.Module) -> None:
        """Every Polar-ViT module sets its own initial values (``init_parameters``, Appendix D.2); plain
        ``nn.Linear`` layers inside them (the tangent-linear head) get the truncated normal of
        ``initializer_range`` and a zero bias.  transformers calls this for every module whose parameters were not
        loaded (a new head after ``ignore_mismatched_sizes``, a base model loaded as a classifier)."""
        initialise = getattr(module, "init_parameters", None)
        if callable(initialise):
            initialise()
        elif isinstance(module, nn.Linear):
            init.trunc_normal_(module.weight, std=self.config.initializer_range)
            if module.bias is not None:
                init.zeros_(module.bias)

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
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

    def compile_cpu_kernels(self, batch_sizes: tuple[int, ...] = (1, 2), inference_mode: bool = False) -> int:
        """Compile (or load) the compiled CPU kernels of gradient-free passes at ``batch_sizes`` (``no_grad``, as
        pipelines and ``Trainer.evaluate`` run; also ``inference_mode`` when asked) and run this model's
        gradient-free passes through them from now on; returns the variants compiled.

        Below ``kernel_min_elements`` (a single image) a pass runs eagerly, whatever the kernel cache holds, so
        that an input's output never depends on the cache's state.  After this call this model's gradient-free
        passes run the variants at hand at every size (``runtime.RuntimeOptions.kernels_at_hand``): those of a
        single image and of batches (sizes 1 and 2 and up compile variants of their own), compiled once per
        machine, torch, source and thread count (the process's: about half a minute for tiny-cifar on 2 cores) and
        loaded by every later process's call.  A no-op off float32 CPU models or with the kernels off."""
        from .cpu_kernels import compiled_variants

        if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
            raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes!r}")
        config = self.config
        weight = next(self.parameters())
        sample = (config.num_vertices,) if config.is_spherical else (config.image_size, config.image_size)
        generator = torch.Generator().manual_seed(0)
        before, training = compiled_variants(), self.training
        self.eval()
        try:
            with use_runtime_options(kernel_min_elements=0):  # every call compiles (or loads) its variant
                for batch in batch_sizes:
                    pixels = torch.randn(batch, config.num_channels, *sample, generator=generator)
                    pixels = pixels.to(device=weight.device, dtype=weight.dtype)
                    with torch.no_grad():
                        self(pixel_values=pixels)
                    if inference_mode:
                        with torch.inference_mode():
                            self(pixel_values=pixels)
        finally:
            self.train(training)
        for module in self.modules():  # from now on: the variants at hand, never a compile (a server's requests)
            if isinstance(module, PolarViTPreTrainedModel):
                module.kernels_for_inference = True
        return compiled_variants() - before


class PolarViTModel(PolarViTPreTrainedModel):
    """The bare Polar-ViT encoder: embeddings, ``L`` polar blocks, final gyro norm and readout point."""

    def __init__(self, config: PolarViTConfig) -> None:
        config.validate_polar_vit()  # fields may have been assigned one by one since the config was built
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

    def get_input_embeddings(self) -> nn.Module:
        """The patch embedding (as transformers' ViT): the Polar-FC that lifts each patch onto the hyperboloid, or
        the spherical model's lifting layer."""
        return self.embeddings.patch_projection

    @property
    def encoder(self) -> PolarViTEncoder:
        """The polar blocks (stored as ``layers``)."""
        return self.layers

    @property
    def ops(self) -> ManifoldOps:
        """The arithmetic of ``config.arithmetic`` / ``config.fused_ops``, read at call time (both switch in place),
        with the matrix products of this call's precision policy (:func:`manifold_ops.product_dtype`).  Under
        ``torch.func`` transforms (per-sample gradients, ensembles) the reference layers run: their operations are
        all transformable, the fused layers' hand-derived backward passes are not."""
        weight = self.embeddings.patch_projection.weight
        return make_ops(
            self.config.arithmetic,
            self.config.k,
            self.config.fused_ops and not functorch_transforms_active(),
            product_dtype(weight.device.type, weight.dtype),
        )

    def forward(
        self,
        pixel_values: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        interpolate_pos_encoding: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> PolarViTModelOutput | tuple:
        config = self.config
        output_attentions = output_attentions if output_attentions is not None else config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else config.return_dict
        check_pixel_values(pixel_values, config)
        assert pixel_values is not None  # (checked above)
        ops = self.ops  # the precision policy is read here, under the caller's autocast
        dtype = self.embeddings.patch_projection.weight.dtype
        # the precision policy: products in half precision (ops), the geometry in float32 or float64, so autocast is
        # off inside; inputs were checked once above, the geometry functions run without their per-call checks
        compute_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        unautocast = torch.autocast(device_type=pixel_values.device.type, enabled=False)
        # after compile_cpu_kernels() (a server's warm-up) a gradient-free pass (evaluation, pipelines, a request)
        # runs the variants at hand at every size and never compiles one; otherwise what runs never depends on what
        # the kernel cache holds
        options = runtime_options()
        serving = self.kernels_for_inference and not torch.is_grad_enabled()
        at_hand, compiles = options.kernels_at_hand or serving, options.kernel_compiles and not serving
        with unautocast, use_runtime_options(input_checks=False, kernels_at_hand=at_hand, kernel_compiles=compiles):
            hidden, positions, num_prefix = self.embeddings(
                pixel_values.to(compute_dtype), ops, bool(interpolate_pos_encoding)
            )
            hidden, all_hidden, all_attentions = self.encoder(
                hidden, positions, num_prefix, ops, bool(output_attentions), bool(output_hidden_states)
            )
            hidden = self.norm(hidden, ops)
            pooled = self.pooler(hidden, ops)
            output = PolarViTModelOutput(
                last_hidden_state=ops.to_ambient(hidden),
                pooler_output=ops.to_ambient(pooled),
                hidden_states=all_hidden,
                attentions=all_attentions,
                last_hidden_polar=PolarOps.make(*ops.polar(hidden)),
                pooler_polar=PolarOps.make(*ops.polar(pooled)),
            )
        return output if return_dict else output.to_tuple()


class PolarViTForImageClassification(PolarViTPreTrainedModel):
    """Polar-ViT with a hyperbolic classification head on the readout point (Sec. 4)."""

    def __init__(self, config: PolarViTConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.polar_vit = PolarViTModel(config)
        self.classifier = HEAD_CLASSES[config.head](
            config.hidden_size, cast(int, config.num_labels), config.k, config.initializer_range
        )
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
        self.classifier = HEAD_CLASSES[config.head](
            config.hidden_size, cast(int, config.num_labels), config.k, config.initializer_range
        ).to(device=weight.device, dtype=weight.dtype)

    def forward(
        self,
        pixel_values: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        interpolate_pos_encoding: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
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


@dataclass
class SphericalFieldsOutput(ModelOutput):
    r"""Output of :class:`PolarViTSphericalForDensePrediction` (and of its Euclidean twin).

    Args:
        loss (`torch.FloatTensor` of shape `()`, *optional*):
            The quadrature-weighted squared l2 error of the fields (:func:`spherical.field_loss`).
        logits (`torch.FloatTensor` of shape `(batch_size, num_output_channels, num_vertices)`):
            The predicted fields at every icosphere vertex.
        hidden_states, attentions: as in :class:`PolarViTModelOutput`.
    """

    loss: Tensor | None = None
    logits: Tensor | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


class PolarViTSphericalForDensePrediction(PolarViTPreTrainedModel):
    """Polar-ViT predicting fields on the icosphere (``PolarViTSphericalConfig``): the spherical encoder, then the
    projection convolution (SO(3)-RoPE Def. 5) of its patch tokens, ``C_out = config.output_channels`` values per
    vertex.  With ``relative_position="so3"``, no absolute positions and no longitude encoding, the fields rotate
    with the input under the 60 icosahedral rotations."""

    config_class = PolarViTSphericalConfig
    config: PolarViTSphericalConfig

    def __init__(self, config: PolarViTSphericalConfig) -> None:
        super().__init__(config)
        self.polar_vit = PolarViTSphericalModel(config)
        self.projection = PolarViTSphericalProjection(config)
        self.post_init()

    def set_arithmetic(self, arithmetic: str) -> None:
        """Switch between polar and ambient arithmetic in place (same parameters)."""
        self.polar_vit.set_arithmetic(arithmetic)

    def forward(
        self,
        pixel_values: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> SphericalFieldsOutput | tuple:
        """``labels``: the target fields ``(batch, C_out, V)``."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.polar_vit(
            pixel_values,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        tokens = outputs.last_hidden_polar[:, -self.config.num_patches :]  # [r, u] of the patch tokens
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            fields = self.projection(tokens[..., 0], tokens[..., 1:])
        loss = None if labels is None else field_loss(fields, labels, self.config.icosphere_level)
        output = SphericalFieldsOutput(
            loss=loss, logits=fields, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


__all__ = [
    "AUTO_MAP",
    "HEAD_CLASSES",
    "MANIFOLD",
    "NO_DECAY",
    "POOLER_CLASSES",
    "RADIUS_RULE_ANCHOR",
    "RELATIVE_POSITION_CLASSES",
    "RESIDUAL_CLASSES",
    "SPHERICAL_AUTO_MAP",
    "BoostEncoding",
    "BoostResidual",
    "GyroLayerNorm",
    "HoroshiftEncoding",
    "HyperplaneHead",
    "HypformerPositionalEncoding",
    "LorentzMLRHead",
    "LorentzMidpointResidual",
    "PoincareMLRHead",
    "PolarFC",
    "PolarSelfAttention",
    "PolarViTCentroidPooler",
    "PolarViTClassTokenPooler",
    "PolarViTEmbeddings",
    "PolarViTEncoder",
    "PolarViTForImageClassification",
    "PolarViTLayer",
    "PolarViTModel",
    "PolarViTModelOutput",
    "PolarViTPreTrainedModel",
    "PolarViTSphericalEmbeddings",
    "PolarViTSphericalForDensePrediction",
    "PolarViTSphericalForImageClassification",
    "PolarViTSphericalModel",
    "PolarViTSphericalProjection",
    "RelativePositionEncoding",
    "RotationEncoding",
    "SO3RotaryEncoding",
    "SphericalFieldsOutput",
    "SpaceResidual",
    "TangentLinearHead",
    "complete_auto_map",
    "parameter_roles",
    "relative_position_encoding",
    "sincos_positions",
]
