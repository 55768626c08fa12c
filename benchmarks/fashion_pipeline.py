"""``pipeline("image-classification")`` of an exported model on real Fashion-MNIST test images.

Run:  python benchmarks/fashion_pipeline.py MODEL_DIR [--data_dir DIR] [--count 1000] [--out DIR]

Feeds the first ``--count`` official test images (PIL, 28 x 28 greyscale, exactly as stored) through transformers'
image-classification pipeline of ``MODEL_DIR`` (its saved processor, its labels), prints the first predictions
next to the truth and the accuracy over all ``--count``, and writes ``pipeline_predictions.png`` (a grid of test
images titled with prediction and truth).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm.auto import tqdm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--data_dir", help="the four IDX files (default: Debian's location or the package cache)")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--out", default="outputs/fashion_pipeline")
    args = parser.parse_args(argv)
    from transformers import pipeline

    import polar_vit_hf  # noqa: F401  (the Auto classes)
    from polar_vit_hf.training.fashion_mnist import CLASS_NAMES, load_fashion_mnist

    test = load_fashion_mnist(args.data_dir)["test"].select(range(args.count))
    classify = pipeline("image-classification", model=args.model_dir, trust_remote_code=False)  # local classes
    predictions = [
        result[0]["label"]
        for result in tqdm(classify(list(test["image"]), batch_size=100), total=args.count, desc="pipeline")
    ]
    truth = [CLASS_NAMES[label] for label in test["label"]]
    correct = sum(p == t for p, t in zip(predictions, truth))
    print(f"{'test image':>10}  {'prediction':<12} {'truth':<12}")
    for index in range(12):
        mark = "" if predictions[index] == truth[index] else "  x"
        print(f"{index:>10}  {predictions[index]:<12} {truth[index]:<12}{mark}")
    print(
        f"pipeline accuracy on the first {args.count} test images: {correct}/{args.count} = "
        f"{100 * correct / args.count:.2f} %"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(test["image"][:24], predictions[:24], truth[:24], out / "pipeline_predictions.png")
    print(f"wrote {out / 'pipeline_predictions.png'}")
    return 0


def plot(images, predictions: list[str], truth: list[str], path: Path) -> None:
    """A 3 x 8 grid of test images titled ``prediction / truth`` (red where wrong)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 8, figsize=(13, 5.6))
    for ax, image, guess, label in zip(axes.flat, images, predictions, truth):
        ax.imshow(image, cmap="gray_r")
        ax.set_title(f"{guess}\n({label})", fontsize=7, color="black" if guess == label else "red")
        ax.axis("off")
    fig.suptitle("pipeline('image-classification') on Fashion-MNIST test images: prediction (truth)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
