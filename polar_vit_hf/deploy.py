"""Deployment: a classifier as a ``torch.export`` program and as an ONNX model, both with a dynamic batch.

* :func:`export_program` - ``torch.export.export`` of ``model(pixel_values).logits`` with a batch of
  ``1 .. max_batch`` and, where the config allows it, any image size (a multiple of the patch size, with
  ``interpolate_pos_encoding``); the program round-trips through ``torch.export.save`` / ``torch.export.load``.
* :func:`export_onnx` - that program translated by ``torch.onnx.export(..., dynamo=True)`` into ``model.onnx``
  (ONNX's own operators; no custom domain, so ONNX Runtime runs it as it is).
* :func:`onnx_logits` - the logits of an ONNX file by ONNX Runtime on the CPU.

An exported graph is the model's eager formulas traced once (no compiled CPU kernels, no Triton kernels, no
per-call input scans): the input check at the edge stays in the program as an assertion (``torch.export``);
ONNX has no assertions, so an ONNX model returns NaN where the PyTorch model would refuse the input.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from .modeling import PolarViTConfig

__all__ = [
    "ExportSpec",
    "LogitsOnly",
    "example_pixels",
    "export_onnx",
    "export_program",
    "onnx_logits",
    "precise_translations",
    "save_onnx",
]

ONNX_FILE = "model.onnx"
ONNX_INPUT = "pixel_values"
ONNX_OUTPUT = "logits"


class LogitsOnly(nn.Module):
    """``model(pixel_values).logits``: the tensor-in, tensor-out function a runtime serves (a ``ModelOutput`` is a
    dictionary; exporters and servers want the tensor)."""

    def __init__(self, model: nn.Module, interpolate_pos_encoding: bool = False) -> None:
        super().__init__()
        self.model = model
        self.interpolate_pos_encoding = interpolate_pos_encoding

    def forward(self, pixel_values: Tensor) -> Tensor:  # noqa: D102
        kwargs = {"interpolate_pos_encoding": True} if self.interpolate_pos_encoding else {}
        return self.model(pixel_values=pixel_values, **kwargs).logits


@dataclass(frozen=True)
class ExportSpec:
    """What an exported program accepts: batches of ``1 .. max_batch``; ``dynamic_image_size``: square or
    rectangular images of ``patch_size * (2 .. max_patches)`` pixels a side (planar models whose position
    embedding interpolates; ``interpolate_pos_encoding`` is then always on)."""

    max_batch: int = 512
    dynamic_image_size: bool = False
    max_patches: int = 64


def example_pixels(config: PolarViTConfig, batch: int = 2, seed: int = 0) -> Tensor:
    """Seeded normalised-looking pixels ``(batch, C, H, W)`` (planar) or ``(batch, C, V)`` (spherical)."""
    generator = torch.Generator().manual_seed(seed)
    sample = (config.num_vertices,) if config.is_spherical else (config.image_size, config.image_size)
    return torch.randn(batch, config.num_channels, *sample, generator=generator)


def _dynamic_shapes(config: PolarViTConfig, spec: ExportSpec) -> dict:
    """``torch.export`` dimensions: the batch, and the image sides as multiples of the patch size."""
    if spec.max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {spec.max_batch}")
    axes = {0: torch.export.Dim("batch", min=1, max=spec.max_batch)}
    if spec.dynamic_image_size:
        if config.is_spherical:
            raise ValueError("dynamic_image_size: a spherical model's input is its icosphere grid, of one size")
        if config.position_embedding == "hypformer":
            raise ValueError("dynamic_image_size: the 'hypformer' position encoding has one table size")
        patch = config.patch_size
        axes[2] = patch * torch.export.Dim("patches_high", min=2, max=spec.max_patches)
        axes[3] = patch * torch.export.Dim("patches_wide", min=2, max=spec.max_patches)
    return {"pixel_values": axes}


def export_program(model: PreTrainedModel, spec: ExportSpec = ExportSpec()) -> torch.export.ExportedProgram:
    """``torch.export.export`` of the model's logits (a classifier's, or the fields of a dense spherical model) with
    the dynamic axes of ``spec`` (eval mode, float32 or float64 weights as they are), after one eager pass."""
    model.eval()
    config = model.config
    dynamic_shapes = _dynamic_shapes(config, spec)  # (checks the spec first)
    wrapper = LogitsOnly(model, interpolate_pos_encoding=spec.dynamic_image_size).eval()
    pixels = example_pixels(config).to(next(model.parameters()))
    with torch.no_grad():
        wrapper(pixels)  # builds the constant tables a model makes on first use (the icosphere's, SO(3)-RoPE's)
        if spec.dynamic_image_size:  # traced off the config's size, so that the interpolation is part of the graph
            pixels = F.pad(pixels, (0, config.patch_size, 0, config.patch_size))
        return torch.export.export(wrapper, (pixels,), dynamic_shapes=dynamic_shapes)


def export_onnx(model: PreTrainedModel, path: str | Path, spec: ExportSpec = ExportSpec()) -> Path:
    """Write ``model``'s logits as an ONNX file with a dynamic batch axis (:func:`export_program`, then
    :func:`save_onnx`)."""
    return save_onnx(export_program(model, spec), path)


def save_onnx(program: torch.export.ExportedProgram, path: str | Path) -> Path:
    """Translate ``program`` by ``torch.onnx.export(..., dynamo=True)`` with :func:`precise_translations` and write
    it to ``path`` unoptimised (ONNX Runtime optimises it when a session loads it; the exporter's own optimiser
    takes minutes on thousands of elementwise nodes)."""
    path = Path(path)
    onnx_program = torch.onnx.export(
        program,
        dynamo=True,
        optimize=False,
        input_names=[ONNX_INPUT],
        output_names=[ONNX_OUTPUT],
        custom_translation_table=precise_translations(),
        verbose=False,
    )
    if onnx_program is None:  # (only the TorchScript exporter returns nothing)
        raise RuntimeError("torch.onnx.export returned no program")
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx_program.save(str(path))
    return path


def precise_translations() -> dict:
    """ONNX translations of the operators that the exporter's library decomposes with a cancellation:
    ``expm1(x)`` as ``exp(x) - 1`` and ``log1p(x)`` as ``log(1 + x)`` lose every digit of a small ``x`` (the
    stable forms of the model rest on both).  ONNX has neither operator, so they are built by Kahan's
    reformulations, exact to a few ulp wherever ``exp`` and ``log`` are:

    ``expm1(x) = (u - 1) x / log(u)`` with ``u = e^x`` (``x`` where ``u = 1``, ``-1`` where ``u - 1 = -1``, ``u``
    where it is infinite), ``log1p(x) = log(u) x / (u - 1)`` with ``u = 1 + x`` (``x`` where ``u = 1``, ``u`` where
    it is infinite)."""
    from onnxscript import opset18 as op

    def expm1(x):  # noqa: ANN001, ANN202 - onnxscript values
        u = op.Exp(x)
        one = op.CastLike(op.Constant(value_float=1.0), x)
        u_minus_one = op.Sub(u, one)
        result = op.Div(op.Mul(u_minus_one, x), op.Log(u))
        result = op.Where(op.Equal(u, one), x, result)
        result = op.Where(op.Equal(u_minus_one, op.Neg(one)), op.Neg(one), result)
        return op.Where(op.IsInf(u), u, result)

    def log1p(x):  # noqa: ANN001, ANN202 - onnxscript values
        one = op.CastLike(op.Constant(value_float=1.0), x)
        u = op.Add(one, x)
        result = op.Div(op.Mul(op.Log(u), x), op.Sub(u, one))
        result = op.Where(op.Equal(u, one), x, result)
        return op.Where(op.IsInf(u), u, result)

    return {torch.ops.aten.expm1.default: expm1, torch.ops.aten.log1p.default: log1p}


def onnx_logits(path: str | Path, pixel_values: Tensor | np.ndarray, threads: int | None = None) -> np.ndarray:
    """The logits of the ONNX model at ``path`` for ``pixel_values``, by ONNX Runtime on the CPU."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only (constant folding notes on every shape computation otherwise)
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    values = pixel_values.numpy() if isinstance(pixel_values, Tensor) else pixel_values
    return session.run([ONNX_OUTPUT], {ONNX_INPUT: np.ascontiguousarray(values, dtype=np.float32)})[0]
