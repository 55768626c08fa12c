"""Polar-ViT next to the public Lorentz Vision Transformers, at the same shape: step time, memory, and the
float32 distance error the speed of ambient arithmetic costs.

Run:  python benchmarks/peers.py [--hypercore DIR] [--hexformer DIR] [--batches 32 64 128] [--repeats 5]
          [--threads 2] [--radii 0 1 2 4 8 12 16] [--out outputs/peers]

Step time: ``benchmarks/step_time.py``'s interleaved rounds (each model in its own fresh process, one step of
each in turn, ratios the medians of the per-round ratios) for transformers' ViT, Polar-ViT in polar and in
ambient arithmetic and, given their checkouts, HyperCore's ``LViT`` (``hypercore/models/LViT.py``: ambient
Lorentz ViT, Lorentz linear layers and multi-head attention, LResNet residuals) and HexFormer's
``classification_vit`` (its Lorentz encoder and Lorentz MLR decoder), each built at the tiny-cifar shape
(32×32 images, patch 4, 9 layers, width 192, 12 heads, MLP 384, 100 classes) and trained by cross-entropy on
its logits.  Get the checkouts with::

    git clone https://github.com/Graph-and-Geometric-Learning/HyperCore   # needs: pip install geoopt
    git clone https://github.com/HayaAlyoussef/HexFormer                  # ships its own geoopt

HyperCore's package ``__init__`` imports graph libraries a ViT does not use (torch_geometric, networkx), so
its ``manifolds``, ``nn`` and ``models.LViT`` modules are loaded on their own (:func:`hypercore_modules`).

Distance error: two points at radius ``r`` whose directions are ``--angle`` radians apart (``--pairs`` random
pairs in 16 dimensions, one head's width), the median relative error of their float32 geodesic distance
against a 60-digit mpmath reference on the same stored inputs: Polar-ViT's polar form (``geometry.distance``),
its ambient arithmetic, and each peer's own manifold ``dist`` on the float32 rounding of the exact ambient
coordinates (the best an ambient model can store).  Writes ``peers.csv``, ``distance_error.csv`` and
``peers.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import math
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers.modeling_outputs import ImageClassifierOutput

PEERS = ("hypercore", "hexformer")
STEP_MODELS = ("euclidean", "polar", "ambient")


class PeerClassifier(nn.Module):
    """A peer's image classifier (pixels -> logits) with the ``(pixel_values, labels) -> .loss`` call of the
    transformers models, so one training step times every model alike."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = network

    def forward(self, pixel_values: Tensor, labels: Tensor | None = None) -> ImageClassifierOutput:
        logits = self.network(pixel_values)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return ImageClassifierOutput(loss=loss, logits=logits)


def _package(name: str, path: Path) -> types.ModuleType:
    """An empty package ``name`` whose submodules are found in ``path`` (its ``__init__`` not run)."""
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    sys.modules[name] = module
    return module


def _export(into: types.ModuleType, module: types.ModuleType) -> None:
    into.__dict__.update({key: value for key, value in vars(module).items() if not key.startswith("_")})


def hypercore_modules(checkout: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """HyperCore's ``(models.LViT, manifolds)`` modules, loaded without the package's graph-learning imports:
    ``hypercore.utils`` gets only its ``math_utils`` (what the manifolds import), ``hypercore.nn`` its
    ``linear``, ``conv`` and ``attention`` subpackages."""
    root = Path(checkout) / "hypercore"
    if not (root / "models" / "LViT.py").is_file():
        raise FileNotFoundError(f"{checkout} is not a HyperCore checkout (no hypercore/models/LViT.py)")
    _package("hypercore", root)
    _export(_package("hypercore.utils", root / "utils"), importlib.import_module("hypercore.utils.math_utils"))
    manifolds = importlib.import_module("hypercore.manifolds")
    layers = _package("hypercore.nn", root / "nn")
    for sub in ("linear", "conv", "attention"):  # attention imports names from hypercore.nn itself
        _export(layers, importlib.import_module(f"hypercore.nn.{sub}"))
    _package("hypercore.models", root / "models")
    return importlib.import_module("hypercore.models.LViT"), manifolds


def hexformer_modules(checkout: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """HexFormer's ``(classification_vit/models/classifier.py, lib.lorentz.manifold)`` modules, its ``lib``
    package imported as its ``train.py`` does (the bundled geoopt first: the two import each other)."""
    root = Path(checkout)
    if not (root / "classification_vit" / "models" / "classifier.py").is_file():
        raise FileNotFoundError(f"{checkout} is not a HexFormer checkout (no classification_vit/models/classifier.py)")
    _package("lib", root / "lib")  # its __init__ is empty
    importlib.import_module("lib.geoopt")
    _package("hexformer_vit", root / "classification_vit")
    _package("hexformer_vit.models", root / "classification_vit" / "models")
    return importlib.import_module("hexformer_vit.models.classifier"), importlib.import_module("lib.lorentz.manifold")


def peer_classifier(name: str, checkout: Path, config: object) -> PeerClassifier:
    """The peer ``name`` ("hypercore" or "hexformer") built at ``config``'s shape (a ``PolarViTConfig``: image
    and patch size, depth, width, heads, MLP width; 100 classes)."""
    heads, width = config.num_attention_heads, config.hidden_size
    if name == "hypercore":
        lvit, manifolds = hypercore_modules(checkout)
        lorentz = manifolds.Lorentz
        network = lvit.LViT(
            lorentz(1.0),
            lorentz(1.0),
            lorentz(1.0),
            image_size=config.image_size,
            patch_size=config.patch_size,
            num_layers=config.num_hidden_layers,
            in_channel=config.num_channels,
            hidden_channel=width // heads,  # per head, time coordinate included: the heads concatenate to width
            out_channel=100,
            mlp_hidden_size=config.intermediate_size + 1,
            num_heads=heads,
            dropout=0.0,
        )
    elif name == "hexformer":
        classifier, _ = hexformer_modules(checkout)
        encoder = dict(
            num_layers=config.num_hidden_layers,
            img_dim=[config.num_channels, config.image_size, config.image_size],
            num_classes=100,
            patch_size=config.patch_size,
            heads=heads,
            hidden_dim=width,
            mlp_dim=config.intermediate_size,
            learn_k=False,
            k=1.0,
        )
        decoder = dict(embed_dim=width, num_classes=100, k=1.0, learn_k=False, type="mlr", clip_r=1.0)
        network = classifier.ViTClassifier("lorentz", "lorentz", encoder, decoder)
    else:
        raise ValueError(f"unknown peer {name!r}; expected one of {PEERS}")
    return PeerClassifier(network)


def peer_distance(name: str, checkout: Path) -> Callable[[Tensor, Tensor], Tensor]:
    """The peer's own geodesic distance ``dist(x, y)`` on ambient points (its Lorentz manifold, k = 1)."""
    if name == "hypercore":
        return hypercore_modules(checkout)[1].Lorentz(1.0).dist
    if name == "hexformer":
        return hexformer_modules(checkout)[1].CustomLorentz(k=1.0).dist
    raise ValueError(f"unknown peer {name!r}; expected one of {PEERS}")


class DistanceRow(NamedTuple):
    """Median relative float32 error of the distance between two points at ``radius``, per arithmetic."""

    radius: float
    errors: dict[str, float]


def distance_rows(
    radii: list[float],
    distances: dict[str, Callable[[Tensor, Tensor], Tensor]],
    angle: float = 1e-3,
    pairs: int = 32,
    dim: int = 16,
    seed: int = 0,
) -> list[DistanceRow]:
    """For each radius, ``pairs`` point pairs ``(r, u), (r, v)`` with ``angle(u, v) = angle`` stored in float32:
    the median relative error against mpmath of Polar-ViT's polar distance (Eq. 3 via the chord), its ambient
    distance, and each ambient ``distances[name](x, y)`` on the rounded exact ambient coordinates."""
    from polar_vit_hf.benchmarks.mpmath_reference import mp_distance, mp_point, mp_point_from_space
    from polar_vit_hf.modeling import ambient, geometry

    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(pairs, dim, generator=gen, dtype=torch.float64), dim=-1)
    w = torch.randn(pairs, dim, generator=gen, dtype=torch.float64)
    w = torch.nn.functional.normalize(w - (w * u).sum(-1, keepdim=True) * u, dim=-1)  # orthogonal to u
    v = math.cos(angle) * u + math.sin(angle) * w
    functions = {"Polar-ViT ambient": lambda x, y: ambient.distance(x, y), **distances}
    rows = []
    for radius in radii:
        r = torch.full((pairs, 1), float(radius))
        u32, v32 = u.float(), v.float()
        polar = geometry.distance(r, u32, r, v32).reshape(-1)
        exact_x = [mp_point(float(radius), row.tolist()) for row in u32]
        exact_y = [mp_point(float(radius), row.tolist()) for row in v32]
        reference = [mp_distance(x, y) for x, y in zip(exact_x, exact_y)]
        errors = {"Polar-ViT polar": _median_relative(polar, reference)}
        x = torch.tensor([[float(c) for c in p] for p in exact_x], dtype=torch.float32)
        y = torch.tensor([[float(c) for c in p] for p in exact_y], dtype=torch.float32)
        stored = [
            mp_distance(mp_point_from_space(a[1:].tolist()), mp_point_from_space(b[1:].tolist()))
            for a, b in zip(x.double(), y.double())
        ]
        for name, function in functions.items():
            with torch.no_grad():
                errors[name] = _median_relative(function(x, y).reshape(-1), stored)
        rows.append(DistanceRow(float(radius), errors))
    return rows


def _median_relative(values: Tensor, reference: list) -> float:
    errors = sorted(
        float(abs(value - ref) / ref) if math.isfinite(value) and ref > 0 else math.inf
        for value, ref in zip(values.tolist(), reference)
    )
    return errors[len(errors) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hypercore", help="a checkout of github.com/Graph-and-Geometric-Learning/HyperCore")
    parser.add_argument("--hexformer", help="a checkout of github.com/HayaAlyoussef/HexFormer")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per model (default: all)")
    parser.add_argument("--radii", type=float, nargs="+", default=[0.5, 1, 2, 4, 8, 12, 16])
    parser.add_argument("--angle", type=float, default=1e-3, help="radians between the two points' directions")
    parser.add_argument("--skip_steps", action="store_true", help="only the distance-error table")
    parser.add_argument("--out", default="outputs/peers")
    args = parser.parse_args(argv)
    from polar_vit_hf.benchmarks import step_time

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peers = {name: Path(getattr(args, name)) for name in PEERS if getattr(args, name)}
    models = [*STEP_MODELS, *peers]
    tables: dict[int, dict] = {}
    for batch in [] if args.skip_steps else args.batches:
        line = ["--models", *models, "--batch", str(batch), "--repeats", str(args.repeats), "--interleave"]
        line += ["--out", str(out / f"batch{batch}")] + (["--threads", str(args.threads)] if args.threads else [])
        line += [f"--{name}={path}" for name, path in peers.items()]
        step_args = step_time.parser().parse_args(line)
        step_args.batch = batch
        results = step_time.measure(step_args)
        if results is None:
            return 1
        step_time.report(results, step_args)
        tables[batch] = results
    if tables:
        print_step_table(tables, models, step_time)
    rows = distance_rows(
        args.radii, {step_time.LABELS[name]: peer_distance(name, path) for name, path in peers.items()}, args.angle
    )
    print_distance_table(rows, args.angle)
    write_csv(out, tables, models, rows, step_time)
    plot(out / "peers.png", tables, models, rows, step_time.LABELS)
    print(f"wrote {out / 'peers.csv'}, {out / 'distance_error.csv'} and {out / 'peers.png'}")
    return 0


def print_step_table(tables: dict[int, dict], models: list[str], step_time: types.ModuleType) -> None:
    """ms / step, × ViT (and × HyperCore when measured) per batch size; at the largest batch, peak memory × ViT (the
    resident set's growth over the first step, then the most tensor bytes alive at once in a later step) and the
    first step."""
    print(f"\ntraining step (forward + backward, CPU capability {torch.backends.cpu.get_cpu_capability()})")
    reference = "hypercore" if "hypercore" in models else None
    header = f"{'model':<36}" + "".join(
        f" | b{batch}: ms, x ViT" + (", x HyperCore" if reference else "") for batch in tables
    )
    print(header + " | peak memory x ViT: RSS, tensors | first step")
    for name in models:
        cells = []
        for results in tables.values():
            cell = (
                f"{results[name]['median_s'] * 1e3:.0f}, {step_time.time_ratio(results, name, 'euclidean', True):.2f}"
            )
            if reference:
                cell += f", {step_time.time_ratio(results, name, reference, True):.2f}"
            cells.append(cell)
        last = tables[max(tables)]
        memory = (last[name][key] / last["euclidean"][key] for key in ("peak_growth_mib", "peak_tensor_mib"))
        print(
            f"{step_time.LABELS[name]:<36} | "
            + " | ".join(cells)
            + f" | {', '.join(f'{ratio:.2f}' for ratio in memory)} | {last[name]['first_step_s']:.1f} s"
        )


def print_distance_table(rows: list[DistanceRow], angle: float) -> None:
    print(f"\nfloat32 distance between two points {angle:g} rad apart, median relative error against mpmath")
    names = list(rows[0].errors)
    print(f"{'r':>5} | " + " | ".join(f"{name:>32}" for name in names))
    for row in rows:
        print(f"{row.radius:>5g} | " + " | ".join(f"{row.errors[name]:>32.1e}" for name in names))


def write_csv(
    out: Path, tables: dict[int, dict], models: list[str], rows: list[DistanceRow], step_time: types.ModuleType
) -> None:
    with open(out / "peers.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        fields = ("median_s", "vs_vit", "peak_growth_mib", "peak_tensor_mib", "first_step_s")
        writer.writerow(["batch", "model", *fields])
        for batch, results in tables.items():
            for name in models:
                row = {**results[name], "vs_vit": step_time.time_ratio(results, name, "euclidean", True)}
                writer.writerow([batch, name, *(row[key] for key in fields)])
    with open(out / "distance_error.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        names = list(rows[0].errors)
        writer.writerow(["radius", *names])
        for row in rows:
            writer.writerow([row.radius, *(row.errors[name] for name in names)])


def plot(path: Path, tables: dict[int, dict], models: list[str], rows: list[DistanceRow], labels: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(19, 4.8))
    batches = list(tables)
    for name in models if tables else []:
        axes[0].plot(batches, [tables[b][name]["median_s"] * 1e3 for b in batches], marker="o", label=labels[name])
    axes[0].set(xlabel="batch", ylabel="ms / training step (CPU)", xscale="log", yscale="log", title="step time")
    axes[0].set_xticks(batches, [str(b) for b in batches])
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    if tables:
        last, width = tables[max(tables)], 0.4
        for offset, (key, kind) in zip(
            (-width / 2, width / 2), (("peak_growth_mib", "RSS"), ("peak_tensor_mib", "tensors"))
        ):
            ratios = [last[name][key] / last["euclidean"][key] for name in models]
            axes[1].bar([i + offset for i in range(len(models))], ratios, width, label=kind)
        axes[1].axhline(2.0, color="gray", linestyle="--", linewidth=1)
        axes[1].set_xticks(range(len(models)), [labels[name] for name in models], rotation=20, ha="right", fontsize=8)
        axes[1].set(ylabel="peak memory x ViT", title=f"peak memory, batch {max(tables)}")
    radii = [row.radius for row in rows]
    for name in rows[0].errors:
        axes[2].plot(radii, [max(row.errors[name], 1e-10) for row in rows], marker="o", label=name)
    axes[2].set(xlabel="radius r", ylabel="median relative error", yscale="log", title="float32 distance error")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
