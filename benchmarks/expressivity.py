"""Single-layer expressivity test (paper Appendix E.3, Figure 1; protocol of van der Klis et al. 2026).

Run:  python benchmarks/expressivity.py [--radii 1 2 ... 18] [--seeds 3] [--max-iters 10000] [--lr 1e-3]
          [--layers polar lorentz chen]

One fully connected layer maps a fixed input point (radius 1) to a target point at distance
``R`` from the origin; SGD runs until the geodesic distance to the target falls below 0.1 (or the
iteration limit).  Layers: the Polar-FC (Eq. 8) and the general Lorentz FC (the Polar-FC with its
radius rule frozen at the anchor), both trained with the polar distance of Eq. 5 and lr 1e-3; and
the Lorentz FC of Chen et al. 2022 (sigmoid-bounded time coordinate, learnable scale) with its
original squared Lorentzian distance loss in ambient coordinates and lr 0.1.  All problems of one
layer and precision are trained at once with ``torch.func.vmap`` over stacked copies of the real
module.  Prints the mean iteration counts and writes ``expressivity.png`` (like Figure 1).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from polar_vit_hf import geometry as G
from polar_vit_hf.geometry import ambient as A
from polar_vit_hf.modeling.manifold_ops import PolarOps
from polar_vit_hf.modeling.modeling_polar_vit import PolarFC

DIM = 16
THRESHOLD = 0.1


class ChenLorentzLinear(nn.Module):
    """Lorentz linear layer of Chen et al. 2022 as used in practice (k = 1).

    ``y_0 = sigmoid(v^T x + b) e^s + 1.1`` and the space part ``W x`` rescaled so that
    ``y_0^2 - ||y_s||^2 = 1``; the scale ``e^s`` starts at 10.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features + 1))
        self.time_weight = nn.Parameter(torch.empty(in_features + 1))
        self.time_bias = nn.Parameter(torch.zeros(()))
        self.log_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        nn.init.xavier_uniform_(self.weight)
        nn.init.normal_(self.time_weight, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time = torch.sigmoid(x @ self.time_weight + self.time_bias) * self.log_scale.exp() + 1.1
        space = x @ self.weight.t()
        space = space * (torch.sqrt(time.square() - 1.0) / space.norm(dim=-1)).unsqueeze(-1)
        return torch.cat([time.unsqueeze(-1), space], dim=-1)


def make_layer(kind: str, dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "chen":
        return ChenLorentzLinear(DIM, DIM).to(dtype)
    layer = PolarFC(DIM, DIM, radius_rule=(kind == "polar"))
    nn.init.xavier_uniform_(layer.weight)
    return layer.to(dtype)


def problem(radius: float, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed input (radius 1) and target (radius ``radius``) in polar form, packed ``[r, u]``."""
    gen = torch.Generator().manual_seed(1000 + seed)
    u_in = torch.nn.functional.normalize(torch.randn(DIM, generator=gen, dtype=torch.float64), dim=0)
    u_t = torch.nn.functional.normalize(torch.randn(DIM, generator=gen, dtype=torch.float64), dim=0)
    x_in = PolarOps.make(torch.tensor(1.0, dtype=torch.float64), u_in)
    target = PolarOps.make(torch.tensor(float(radius), dtype=torch.float64), u_t)
    return x_in.to(dtype), target.to(dtype)


def run(
    kind: str, radii: list[float], seeds: int, dtype: torch.dtype, max_iters: int, lr: float = 1e-3
) -> dict[float, float]:
    """Mean iterations to reach the target, per radius (``max_iters`` when not reached); ``lr`` is
    the SGD step of the polar-distance layers (Chen et al.'s layer always uses 0.1)."""
    polar = PolarOps()
    cases = [(r, s) for r in radii for s in range(seeds)]
    layers = [make_layer(kind, dtype, s) for _, s in cases]
    params, buffers = stack_module_state(layers)
    base = make_layer(kind, dtype, 0).to("meta")
    inputs, targets = zip(*(problem(r, s, dtype) for r, s in cases))
    inputs, targets = torch.stack(inputs), torch.stack(targets)
    lr = 0.1 if kind == "chen" else lr

    def output_polar(p, b, x_in):
        if kind == "chen":
            out = functional_call(base, (p, b), (polar.to_ambient(x_in),))
            return polar.make(*G.from_ambient(out))
        return functional_call(base, (p, b), (x_in, polar))

    def loss(p, b, x_in, target):
        if kind == "chen":  # original loss: squared Lorentzian distance -2 - 2 <x, y>_L, ambient
            out = functional_call(base, (p, b), (polar.to_ambient(x_in),))
            return -2.0 - 2.0 * A.inner(out, polar.to_ambient(target))
        out = output_polar(p, b, x_in)
        return G.sq_distance(out[0], out[1:], target[0], target[1:])

    step_grad = vmap(grad(loss), in_dims=(0, 0, 0, 0))
    forward = vmap(output_polar, in_dims=(0, 0, 0))
    reached = torch.full((len(cases),), float(max_iters))
    with G.input_checks(False):
        for iteration in range(max_iters + 1):
            out = forward(params, buffers, inputs).double()
            dist = G.distance(out[:, 0], out[:, 1:], targets[:, 0].double(), targets[:, 1:].double())
            newly = (dist < THRESHOLD) & (reached == max_iters)
            reached[newly] = float(iteration)
            if bool((reached < max_iters).all()) or iteration == max_iters:
                break
            grads = step_grad(params, buffers, inputs, targets)
            for name in params:
                g = torch.nan_to_num(grads[name], nan=0.0, posinf=0.0, neginf=0.0)
                params[name] = params[name] - lr * g
    result = {}
    for index, (radius, _) in enumerate(cases):
        result.setdefault(radius, []).append(float(reached[index]))
    return {radius: sum(v) / len(v) for radius, v in result.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--radii", type=float, nargs="+", default=[float(r) for r in range(1, 19)])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-iters", type=int, default=10_000)
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD step of the polar-distance layers")
    parser.add_argument(
        "--layers", nargs="+", choices=("polar", "lorentz", "chen"), default=["polar", "lorentz", "chen"]
    )
    parser.add_argument("--out", default="outputs/expressivity")
    args = parser.parse_args(argv)
    from tqdm.auto import tqdm

    labels = {
        "polar": "Polar-FC (Eq. 8)",
        "lorentz": "Lorentz FC, general form",
        "chen": "Lorentz FC (Chen et al. 2022)",
    }
    labels = {kind: name for kind, name in labels.items() if kind in args.layers}
    runs = [(kind, dtype) for kind in labels for dtype in (torch.float32, torch.float64)]
    results = {}
    for kind, dtype in tqdm(runs, desc="layers x precisions", unit="run"):
        results[(kind, dtype)] = run(kind, args.radii, args.seeds, dtype, args.max_iters, args.lr)

    names = [f"{labels[k]} {str(d).split('.')[-1]}" for k, d in runs]
    print(
        f"\nIterations to reach the target (distance < {THRESHOLD}); mean of {args.seeds} seeds; "
        f"{args.max_iters} = not reached; lr {args.lr:g} (Chen et al.: 0.1)"
    )
    print(f"{'R':>4} " + " ".join(f"{n[:26]:>27}" for n in names))
    for radius in args.radii:
        print(f"{radius:>4g} " + " ".join(f"{results[key][radius]:>27.0f}" for key in runs))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "expressivity.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["radius", *names])
        for radius in args.radii:
            writer.writerow([radius, *(results[key][radius] for key in runs)])
    plot(results, runs, labels, args, out / "expressivity.png")
    print(f"wrote {out / 'expressivity.csv'} and {out / 'expressivity.png'}")
    return 0


def plot(results, runs, labels, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"polar": "tab:blue", "lorentz": "tab:orange", "chen": "tab:red"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind, dtype in runs:
        style = "-o" if dtype == torch.float32 else "--s"
        values = [results[(kind, dtype)][r] for r in args.radii]
        ax.plot(
            args.radii, values, style, color=colors[kind], ms=4, label=f"{labels[kind]}, {str(dtype).split('.')[-1]}"
        )
    ax.set_yscale("log")
    ax.axhline(args.max_iters, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("distance of the target from the origin")
    ax.set_ylabel("iterations to reach the target")
    ax.set_title("Single-layer expressivity (Appendix E.3)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
