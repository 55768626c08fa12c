"""Riemannian AdamW in polar form (Bdeir et al. 2025, paper Appendix B, D.3).

Manifold-valued parameters are stored as space coordinates ``x_s`` (the modules declare them in
``parameter_roles``; see ``modeling_polar_vit.parameter_roles``); their polar view is
``(r, u) = geometry.from_space(x_s)``.  For those, one step is

1. manifold weight decay: ``x <- centroid({x, o}, weights (1 - c, c))`` in polar form (B.7), with the decay
   coefficient ``c = lr wd`` (PyTorch's AdamW convention) or, with ``decoupled_wd=True``, ``c = wd s(t)``;
2. Riemannian gradient in the polar frame from the Euclidean gradient of ``x_s`` (Eq. 15, with
   ``g_0 = 0`` because polar layers read only space coordinates): ``(xi_r, xi_perp)``;
3. Adam moments: ``m`` a tangent vector, ``v`` the running mean of ``<xi, xi>_L`` (Eq. 14);
4. update by the exponential map of ``-lr m_hat / (sqrt(v_hat) + eps)`` (Eq. 16-18) and parallel
   transport of ``m`` to the new point (B.5).

Euclidean parameters get AdamW (``p <- p - c p``); Polar-FC radius parameters can be decayed towards
their initial values (``decay_to``: ``p <- p - c (p - p_0)``) instead of towards zero.
``param_groups(model, weight_decay)`` builds the groups with the paper's rules.

Two weight-decay conventions (group option ``decoupled_wd``):

* ``False`` (default, PyTorch's ``AdamW``): ``c = lr(t) wd`` - the decay follows the learning rate;
* ``True`` (big_vision's ``optax.add_decayed_weights`` after the base learning rate, before the schedule, as
  in Beyer et al. 2022): ``c = wd s(t)`` with ``s(t) = lr(t) / lr_0`` the schedule multiplier (``lr_0`` the
  group's ``initial_lr``, set by every ``torch.optim.lr_scheduler``; ``s = 1`` without a scheduler).  The
  same decay with PyTorch's convention needs ``weight_decay = wd / lr_0`` (0.1 for ``wd = 1e-4``,
  ``lr_0 = 1e-3``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .modeling.geometry import centroid, expmap, from_space, project_grad, space, tangent_inner, transport
from .modeling.modeling_polar_vit import MANIFOLD, NO_DECAY, parameter_roles

__all__ = ["RiemannianAdamW", "decay_coefficient", "euclidean_param_groups", "param_groups"]

# Euclidean ViT parameters that are not weight matrices although they have two or more dimensions (transformers' ViT
# names; timm's ``no_weight_decay``): never decayed, as big_vision decays kernels only
EUCLIDEAN_NO_DECAY = ("position_embeddings", "cls_token", "mask_token")


def decay_coefficient(group: dict) -> float:
    """The fraction ``c`` by which a step decays the group's weights (see the module docstring)."""
    wd = float(group["weight_decay"])
    if not group.get("decoupled_wd"):
        return float(group["lr"]) * wd
    initial = float(group.get("initial_lr", group["lr"]))
    return wd * (float(group["lr"]) / initial if initial > 0 else 0.0)


def euclidean_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups for a Euclidean ViT: weight matrices (``.weight`` of two or more dimensions) decayed, biases,
    norms, position tables and class tokens not (big_vision's ``kernel``-only decay, timm's rule)."""
    decay: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matrix = param.dim() > 1 and name.endswith("weight") and not any(key in name for key in EUCLIDEAN_NO_DECAY)
        (decay if matrix else rest).append(param)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=rest, weight_decay=0.0)]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Parameter groups with the paper's decay rules (Appendix D.3), from the roles the modules declare.

    * manifold points (gyro-norm bias points, class token): ``manifold=True``, manifold weight decay;
    * Polar-FC radius parameters (``norm_power``, ``radius_weight``, ``klein_weight``,
      ``radius_bias``): decayed towards their anchored initial values;
    * scale parameters (gains, temperatures, residual steps, horoshift rates) and other 0-/1-D
      parameters (biases): never decayed;
    * everything else (weight matrices, position tables, head hyperplanes): AdamW decay.
    """
    k = float(getattr(getattr(model, "config", None), "k", 1.0))
    groups: dict[str, dict[str, Any]] = {
        "decay": dict(params=[], names=[], weight_decay=weight_decay),
        "no_decay": dict(params=[], names=[], weight_decay=0.0),
        "radius": dict(params=[], names=[], weight_decay=weight_decay, decay_to=[]),
        "manifold": dict(params=[], names=[], weight_decay=weight_decay, manifold=True, k=k),
    }
    roles = parameter_roles(model)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        role = roles.get(name)
        if role == MANIFOLD:
            key = "manifold"
        elif isinstance(role, tuple) and role[0] == "decay_to":
            key = "radius"
            groups[key]["decay_to"].append(float(role[1]))
        elif role == NO_DECAY or param.dim() <= 1:
            key = "no_decay"
        else:
            key = "decay"
        groups[key]["params"].append(param)
        groups[key]["names"].append(name)
    return [group for group in groups.values() if group["params"]]


class RiemannianAdamW(torch.optim.Optimizer):
    """AdamW with Riemannian updates for manifold groups (``manifold=True``) in polar form.

    Group options: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``decoupled_wd`` (the decay convention, module
    docstring); ``manifold`` (bool) and ``k``
    (curvature parameter) for manifold points stored as space coordinates ``(..., n)``;
    ``decay_to`` (one float per parameter) to decay Euclidean parameters towards a value instead
    of zero.  Other keys (such as ``names``) are kept and ignored.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_wd: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(
                f"invalid RiemannianAdamW hyper-parameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}"
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            decoupled_wd=bool(decoupled_wd),
            manifold=False,
            k=1.0,
            decay_to=None,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # noqa: D102
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            targets = group.get("decay_to") or [None] * len(group["params"])
            for param, target in zip(group["params"], targets):
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("RiemannianAdamW does not support sparse gradients")
                if group["manifold"]:
                    self._manifold_step(param, group)
                else:
                    self._euclidean_step(param, group, target)
        return loss

    def _euclidean_step(self, param: Tensor, group: dict, target: float | None) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float64)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        state["step"] += 1
        step = float(state["step"])
        decay = decay_coefficient(group)
        if decay:
            if target is None:
                param.mul_(1.0 - decay)
            else:  # decoupled decay towards the anchored initial value
                param.sub_(decay * (param - target))
        grad = param.grad
        state["exp_avg"].lerp_(grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (state["exp_avg_sq"] / (1.0 - beta2**step)).sqrt_().add_(eps)
        param.addcdiv_(state["exp_avg"], denom, value=-lr / (1.0 - beta1**step))

    def _manifold_step(self, param: Tensor, group: dict) -> None:
        k = float(group["k"])
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float64)
            state["exp_avg_r"] = torch.zeros(param.shape[:-1], dtype=param.dtype, device=param.device)
            state["exp_avg_perp"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros(param.shape[:-1], dtype=param.dtype, device=param.device)
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        state["step"] += 1
        step = float(state["step"])
        r, u = from_space(param, k)
        decay = decay_coefficient(group)
        if decay:  # manifold weight decay: polar centroid of {x, o} with weights (1 - c, c)
            points_r = torch.stack([r, torch.zeros_like(r)], dim=-1)
            points_u = torch.stack([u, u], dim=-2)
            weights = torch.tensor([1.0 - decay, decay], dtype=r.dtype, device=r.device)
            r_dec, u_dec = centroid(points_r, points_u, weights.expand(*r.shape, 1, 2), k)
            r, u = r_dec.squeeze(-1), u_dec.squeeze(-2)
        xi_r, xi_perp = project_grad(r, u, torch.zeros_like(r), param.grad, k)  # Eq. 15 with g_0 = 0
        m_r = state["exp_avg_r"].mul_(beta1).add_(xi_r, alpha=1.0 - beta1)
        m_perp = state["exp_avg_perp"].mul_(beta1).add_(xi_perp, alpha=1.0 - beta1)
        v = state["exp_avg_sq"].mul_(beta2).add_(tangent_inner(xi_r, xi_perp, xi_r, xi_perp), alpha=1.0 - beta2)
        scale = -(lr / (1.0 - beta1**step)) / ((v / (1.0 - beta2**step)).sqrt() + eps)
        r_new, u_new = expmap(r, u, scale * m_r, scale.unsqueeze(-1) * m_perp, k)
        m_r_new, m_perp_new = transport(r, u, r_new, u_new, m_r, m_perp, k)
        state["exp_avg_r"].copy_(m_r_new)
        state["exp_avg_perp"].copy_(m_perp_new)
        param.copy_(space(r_new, u_new, k))
