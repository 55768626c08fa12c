"""The read-outs of Polar-ViT: the classification heads (hyperbolic MLR of Bdeir et al. 2024, HNN++'s Poincare
MLR, a tangent-space linear layer) and the poolers (centroid, class token).

Each head sets its initial values in ``init_parameters`` (called at construction and by ``_init_weights``) and
computes through a :class:`manifold_ops.ManifoldOps` strategy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import initialization as init

from .manifold_ops import ManifoldOps


class HyperplaneHead(nn.Module):
    r"""Hyperbolic multinomial logistic regression, one hyperplane per class (base of the two MLR heads).

    Both margins have the form ``c1 sinh(a) (u . z_hat) - c2 cosh(a)`` (:meth:`ManifoldOps.hyperplane_margin`:
    in polar form ``cosh(a) [c1 (u . z_hat) - c2] - c1 (u . z_hat) e^{-a}``, so the large terms never cancel).
    """

    def __init__(self, hidden_size: int, num_labels: int, k: float, std: float) -> None:
        super().__init__()
        self.sqrt_k, self.std = math.sqrt(k), float(std)
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))  # z_c
        self.bias = nn.Parameter(torch.empty(num_labels))  # a_c or r_c
        self.init_parameters()

    def init_parameters(self) -> None:
        init.normal_(self.weight, std=self.std)
        init.zeros_(self.bias)

    def unit_normal(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(||z_c||, z_c / ||z_c||)``."""
        weight = self.weight.to(dtype)
        z_norm = torch.linalg.vector_norm(weight, dim=-1).clamp_min(1e-12)
        return z_norm, weight / z_norm.unsqueeze(-1)


class LorentzMLRHead(HyperplaneHead):
    r"""Bdeir et al. 2024: ``v_c = sqrt(k) ||z_c|| arsinh(alpha_c / (sqrt(k) ||z_c||))`` with
    ``alpha_c = cosh(A) <z_c, x_s> - sinh(A) x_0``, ``A = a_c / sqrt(k)``."""

    def forward(self, p: Tensor, ops: ManifoldOps) -> Tensor:
        z_norm, z_hat = self.unit_normal(p.dtype)
        big_a = self.bias.to(p.dtype) / self.sqrt_k
        margin = ops.hyperplane_margin(p, z_hat, z_norm * torch.cosh(big_a), torch.sinh(big_a))
        return self.sqrt_k * z_norm * torch.asinh(margin / z_norm)


class PoincareMLRHead(HyperplaneHead):
    r"""HNN++ unidirectional MLR on the Poincare image ``x_s / (1 + x_0 / sqrt(k))``:
    ``v_c = 2 sqrt(k) ||z_c|| arsinh(lambda_x <x, z_hat> cosh(2 r_c/sqrt(k)) - (lambda_x - 1) sinh(2 r_c/sqrt(k)))``,
    in polar form ``sinh(a) (u . z_hat) cosh(A) - cosh(a) sinh(A)``."""

    def forward(self, p: Tensor, ops: ManifoldOps) -> Tensor:
        z_norm, z_hat = self.unit_normal(p.dtype)
        big_a = 2.0 * self.bias.to(p.dtype) / self.sqrt_k
        margin = ops.hyperplane_margin(p, z_hat, torch.cosh(big_a), torch.sinh(big_a))
        return 2.0 * self.sqrt_k * z_norm * torch.asinh(margin)


class TangentLinearHead(nn.Module):
    """Hybrid head: a Euclidean linear layer on ``log_o(x) = r u``."""

    def __init__(self, hidden_size: int, num_labels: int, k: float, std: float) -> None:
        super().__init__()
        self.std = float(std)
        self.linear = nn.Linear(hidden_size, num_labels)
        self.init_parameters()

    def init_parameters(self) -> None:
        init.trunc_normal_(self.linear.weight, std=self.std)
        init.zeros_(self.linear.bias)

    def forward(self, p: Tensor, ops: ManifoldOps) -> Tensor:
        r, u = ops.polar(p)
        return F.linear(r.unsqueeze(-1) * u, self.linear.weight.to(r.dtype), self.linear.bias.to(r.dtype))


HEAD_CLASSES = {"lorentz_mlr": LorentzMLRHead, "poincare_mlr": PoincareMLRHead, "tangent_linear": TangentLinearHead}


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


__all__ = [
    "HEAD_CLASSES",
    "POOLER_CLASSES",
    "HyperplaneHead",
    "LorentzMLRHead",
    "PoincareMLRHead",
    "PolarViTCentroidPooler",
    "PolarViTClassTokenPooler",
    "TangentLinearHead",
]
