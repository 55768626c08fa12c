"""Every config switch through both exporters: ``torch.export`` (saved, loaded) and ONNX run by ONNX Runtime.

Run:  python benchmarks/export_switches.py [--preset demo] [--switches 'residual=space' ...] [--out DIR]

For the default config and each ablation switch of the paper (``tests/helpers.py``'s list, or ``--switches
key=value ...``): export a seeded model (:func:`polar_vit_hf.deploy.export_program`, dynamic batch), save and load
the program, export it to ONNX (:func:`polar_vit_hf.deploy.save_onnx`), and compare both with the eager model's
logits on seeded pixels at three scales (patch radii about 0.01, 1 and 3) at batch 9, which the export did not
trace; beside them, the eager float32 logits against the float64 model's (how well conditioned the config is).
Prints the table (export seconds, the largest difference relative to the largest logit), writes
``export_switches.csv`` and ``export_switches.png``; a switch that fails to export is a row with its error.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import tempfile
import time
from pathlib import Path

SWITCHES = (
    "relative_position=boost",
    "relative_position=rotation",
    "relative_position=none",
    "residual=space",
    "residual=lorentz_midpoint",
    "linear=lorentz",
    "readout=cls",
    "head=poincare_mlr",
    "head=tangent_linear",
    "position_embedding=sincos",
    "position_embedding=none",
    "position_embedding=hypformer",
    "head_merge=beta_concat",
    "k=0.5",
)


def parse_switch(text: str) -> dict:
    """``key=value`` (the value a Python literal, else a string) as a config override."""
    key, _, value = text.partition("=")
    try:
        return {key: ast.literal_eval(value)}
    except (ValueError, SyntaxError):
        return {key: value}


def measure(preset: str, overrides: dict) -> dict:
    """Export times and relative logit differences of one config (an ``error`` entry where an export fails)."""
    import torch

    import polar_vit_hf as P
    from polar_vit_hf.deploy import example_pixels, export_program, onnx_logits, save_onnx

    config = P.PolarViTConfig.from_preset(preset, **overrides)
    torch.manual_seed(0)
    model = P.PolarViTForImageClassification(config).eval()
    pixels = torch.cat([example_pixels(config, 3, seed) * scale for seed, scale in enumerate((0.01, 1.0, 3.0))])
    with torch.no_grad():
        eager = model(pixel_values=pixels).logits
        exact = model.double()(pixel_values=pixels.double()).logits
    model.float()
    relative = lambda logits: float((torch.as_tensor(logits) - eager).abs().max() / eager.abs().max())  # noqa: E731
    row: dict = {"eager_error": float((eager.double() - exact).abs().max() / exact.abs().max())}
    try:
        start = time.perf_counter()
        program = export_program(model)
        row["export_s"] = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as folder:
            torch.export.save(program, f"{folder}/model.pt2")
            with torch.no_grad():
                row["pt2_error"] = relative(torch.export.load(f"{folder}/model.pt2").module()(pixels))
            start = time.perf_counter()
            save_onnx(program, f"{folder}/model.onnx")
            row["onnx_s"] = time.perf_counter() - start
            row["onnx_error"] = relative(onnx_logits(f"{folder}/model.onnx", pixels))
    except Exception as error:  # noqa: BLE001 - a switch that does not export is a row of the table
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    names = [row["switch"] for row in rows]
    bars = (
        ("pt2_error", "torch.export vs eager"),
        ("onnx_error", "ONNX Runtime vs eager"),
        ("eager_error", "eager vs f64"),
    )
    for offset, (key, label) in zip((-0.27, 0.0, 0.27), bars):
        values = [row.get(key) or 0.0 for row in rows]
        ax.bar([i + offset for i in range(len(rows))], values, width=0.27, label=label)
    ax.axhline(1e-5, color="k", linestyle="--", linewidth=1, label="1e-5")
    ax.set_yscale("log")
    ax.set_ylabel("max |logits - eager| / max |logit|")
    ax.set_xticks(range(len(rows)), names, rotation=35, ha="right", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--switches", nargs="+", default=list(SWITCHES), help="key=value config overrides")
    parser.add_argument("--out", default="outputs/export_switches")
    args = parser.parse_args(argv)
    from tqdm.auto import tqdm

    rows = []
    for switch in tqdm(["default", *args.switches], desc="configs", unit="config"):
        row = {"switch": switch, **measure(args.preset, {} if switch == "default" else parse_switch(switch))}
        tqdm.write(json.dumps(row))
        rows.append(row)
    print(f"\n{args.preset}: exports and their logits against eager (batch 9, relative to the largest logit)")
    print(f"{'switch':<30} {'export':>8} {'.pt2 error':>11} {'ONNX':>8} {'ONNX error':>11} {'eager vs f64':>13}")
    for row in rows:
        if "error" in row:
            print(f"{row['switch']:<30} fails: {row['error']}")
            continue
        print(
            f"{row['switch']:<30} {row['export_s']:>7.1f}s {row['pt2_error']:>11.1e} {row['onnx_s']:>7.1f}s "
            f"{row['onnx_error']:>11.1e} {row['eager_error']:>13.1e}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = ("switch", "export_s", "pt2_error", "onnx_s", "onnx_error", "eager_error", "error")
    with open(out / "export_switches.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out / "export_switches.png")
    print(f"wrote {out / 'export_switches.csv'} and {out / 'export_switches.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
