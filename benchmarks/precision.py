"""Reproduce the paper's Table 7 side by side: ambient vs polar arithmetic in float32.

Run:  python benchmarks/precision.py [--radii 2 4 6 8 10 12 14 16] [--out outputs/precision]

Prints the table (median errors against a 60-digit mpmath reference on the same stored inputs,
clusters of 64 points with geodesic spread 1), the manifold weight-decay step and the bfloat16
radius limits, and writes ``precision.png`` and ``precision.csv`` to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
from pathlib import Path

from tqdm.auto import tqdm

from polar_vit_hf.benchmarks.mpmath_reference import bf16_radius_limit, precision_row, weight_decay_row


def fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf"
    return f"{v:.1e}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--radii", type=float, nargs="+", default=[2, 4, 6, 8, 10, 12, 14, 16])
    parser.add_argument("--out", default="outputs/precision")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rows = [precision_row(r, seed=args.seed) for r in tqdm(args.radii, desc="precision table", unit="radius")]
    decay = [weight_decay_row(r) for r in tqdm(args.radii, desc="weight-decay step", unit="radius")]
    limits = bf16_radius_limit()

    header = (
        "r",
        "sqdist ambient",
        "sqdist polar",
        "centroid ambient",
        "centroid polar",
        "centring ambient",
        "centring polar",
        "resolution limit",
        "ambient centroid radius",
    )
    print("\nTable 7 (float32 vs 60-digit reference, clusters of 64 points, spread 1, k = 1)")
    print("squared distance: median relative error; centroid / gyro-norm centring: median geodesic error")
    print(" | ".join(f"{h:>16}" for h in header))
    for row in rows:
        vals = (
            f"{row.radius:g}",
            fmt(row.sq_distance_ambient),
            fmt(row.sq_distance_polar),
            fmt(row.centroid_ambient),
            fmt(row.centroid_polar),
            fmt(row.centring_ambient),
            fmt(row.centring_polar),
            fmt(row.resolution_limit),
            f"{row.centroid_radius_ambient:.2f}",
        )
        print(" | ".join(f"{v:>16}" for v in vals))

    print("\nManifold weight decay: centroid of {x, o} with weights (1 - 1e-5, 1e-5), float32")
    headers = ("r", "exact r'", "polar r'", "ambient r'", "polar err/step", "ambient err/step")
    print(" | ".join(f"{h:>16}" for h in headers))
    for wd in decay:
        vals = (
            f"{wd.radius:g}",
            f"{wd.reference_radius:.6f}",
            f"{wd.polar_radius:.6f}",
            f"{wd.ambient_radius:.6f}",
            fmt(wd.polar_error_of_step),
            fmt(wd.ambient_error_of_step),
        )
        print(" | ".join(f"{v:>16}" for v in vals))

    print(
        f"\nbfloat16 storage resolves unit distances up to r = {limits['ambient']:g} (ambient) "
        f"and r = {limits['polar']:g} (polar); theory 2.8 and 6.2"
    )

    with open(out / "precision.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        for row in rows:
            writer.writerow(
                [
                    row.radius,
                    row.sq_distance_ambient,
                    row.sq_distance_polar,
                    row.centroid_ambient,
                    row.centroid_polar,
                    row.centring_ambient,
                    row.centring_polar,
                    row.resolution_limit,
                    row.centroid_radius_ambient,
                ]
            )
    plot(rows, decay, out / "precision.png")
    print(f"\nwrote {out / 'precision.csv'} and {out / 'precision.png'}")
    return 0


def plot(rows, decay, path: Path) -> None:
    import matplotlib

    matplotlib.use(os.environ.get("MPLBACKEND", "Agg"))
    import matplotlib.pyplot as plt

    radii = [row.radius for row in rows]
    cap = 1e3  # NaN / inf drawn at the top of the axis

    def clean(values):
        return [cap if not math.isfinite(v) else max(v, 1e-9) for v in values]

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    panels = [
        ("squared distance (median rel. error)", "sq_distance"),
        ("weighted centroid (geodesic error)", "centroid"),
        ("gyro-norm centring (geodesic error)", "centring"),
    ]
    for ax, (title, key) in zip(axes, panels):
        for kind, marker, color in (("ambient", "o-", "tab:red"), ("polar", "s-", "tab:blue")):
            ax.semilogy(
                radii, clean([getattr(r, f"{key}_{kind}") for r in rows]), marker, color=color, label=f"{kind} fp32"
            )
        if key != "sq_distance":
            ax.semilogy(radii, [r.resolution_limit for r in rows], "k--", lw=1, label="resolution limit (Prop. 2)")
        ax.axvline(8.3, color="gray", lw=0.8, ls=":")
        ax.set_title(title)
        ax.set_xlabel("radius r")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[3]
    ax.plot([d.radius for d in decay], [d.reference_radius for d in decay], "k-", label="exact")
    ax.plot([d.radius for d in decay], [d.polar_radius for d in decay], "s", color="tab:blue", label="polar fp32")
    ax.plot([d.radius for d in decay], [d.ambient_radius for d in decay], "o", color="tab:red", label="ambient fp32")
    ax.plot([d.radius for d in decay], [d.radius for d in decay], ":", color="gray", label="no decay")
    ax.set_title("weight-decay step r -> r' (w = 1e-5)")
    ax.set_xlabel("radius r")
    ax.set_ylabel("r'")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle("Polar vs ambient Lorentz arithmetic in float32 (Polar-ViT paper, Table 7)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
