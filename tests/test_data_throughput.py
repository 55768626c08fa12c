"""benchmarks/data_throughput.py: the ImageNet training pipeline's images per second and the GPU demand."""

from __future__ import annotations

import csv

from polar_vit_hf.benchmarks.data_throughput import PAPER_STEP_MS, gpu_images_per_second, macs_per_image, main


def test_the_gpu_demand_is_table_8_scaled_by_multiply_adds():
    # ViT-S/16 at 224: 4.6 G multiply-adds per image (the well-known figure), ViT-Tiny at CIFAR shape ~0.19 G
    assert abs(macs_per_image("small") / 1e9 - 4.57) < 0.05
    assert abs(macs_per_image("tiny-cifar") / 1e9 - 0.185) < 0.01
    assert abs(gpu_images_per_second("polar", "tiny-cifar") - 128 / PAPER_STEP_MS["polar"] * 1000) < 1e-6
    assert gpu_images_per_second("polar", "small") < gpu_images_per_second("euclidean", "small")


def test_the_benchmark_measures_the_recipe_pipeline(tmp_path, capsys):
    assert main(["--images", "12", "--workers", "0", "--batch", "4", "--epochs", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "images/s" in printed and "workers per GPU" in printed
    with open(tmp_path / "data_throughput.csv") as handle:
        (row,) = list(csv.DictReader(handle))
    assert float(row["images_per_second"]) > 0 and (tmp_path / "data_throughput.png").exists()
