"""Ablation switches of Polar-ViT on scikit-learn's digits: the paper's defaults against one change each.

Run:  python benchmarks/ablation.py [--steps 200] [--seeds 0 1 2] [--rows default hypformer beta_concat ...]

Every row is the ``demo`` preset trained by the loop behind ``make demo`` (``training/pretrain.py``,
``digits-demo`` recipe, the same steps, batch, learning rate and seeds), changed by the ``--set``
overrides of that row:

- ``default``: learned absolute positions, horoshift relative encoding, direct concatenation of heads;
- ``no_relative``: ``relative_position=none`` (the paper's horoshift-vs-none ablation row);
- ``no_absolute``: ``position_embedding=none`` (no absolute positions: what ``hypformer`` replaces the table by);
- ``hypformer``: ``position_embedding=hypformer`` (Hypformer's learnable encoding instead of the table);
- ``beta_concat``: ``head_merge=beta_concat`` (HNN++ beta-split projections and beta-concatenation);
- ``hypformer+beta_concat``: both.

Prints held-out accuracy (mean +- std over seeds), parameters and train time; writes
``ablation.png`` (loss curves) to ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polar_vit_hf as P
from polar_vit_hf.benchmarks.digits_demo import plot, print_table, train_runs

ROWS = {
    "default": {},
    "no_relative": {"relative_position": "none"},
    "no_absolute": {"position_embedding": "none"},
    "hypformer": {"position_embedding": "hypformer"},
    "beta_concat": {"head_merge": "beta_concat"},
    "hypformer+beta_concat": {"position_embedding": "hypformer", "head_merge": "beta_concat"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--out", default="outputs/ablation")
    args = parser.parse_args(argv)
    runs = {
        name: ("polar", [arg for key, value in ROWS[name].items() for arg in ("--set", f"model.{key}={value}")])
        for name in args.rows
    }
    results = train_runs(runs, args.seeds, args.steps)
    params = {}
    for name in args.rows:
        config = P.PolarViTConfig.from_preset("demo", num_labels=10, **ROWS[name])
        params[name] = sum(p.numel() for p in P.PolarViTForImageClassification(config).parameters())
    print(f"\nPolar-ViT demo ablations on the digits, {args.steps} steps, seeds {args.seeds}")
    print_table(results, params)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "ablation.png", "digits: Polar-ViT ablation switches")
    print(f"wrote {out / 'ablation.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
