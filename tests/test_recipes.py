"""The shipped recipes, field by field, against tables written from their sources: big_vision's
configs/vit_s16_i1k.py + big_vision/optax.py (Beyer et al. 2022) for ImageNet-1k, the paper's D.4 (H-CAST) for
the fine-tuning recipes, the paper's D.3 with HexFormer's code for CIFAR-100; and the transforms they build."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from polar_vit_hf.training.data import build_transforms, randaugment_magnitude

RECIPES = Path(__file__).resolve().parents[1] / "training" / "recipes"

# big_vision configs/vit_s16_i1k.py (BV) and big_vision/optax.py (OX)
IMAGENET = {
    "model": {"preset": "small"},  # S/16: 12 layers, width 384, MLP 1536, 6 heads, patch 16
    "data": {"dataset": "imagenet-1k", "image_size": 224, "train_split": "train", "eval_split": "validation"},
    "augment": {
        "random_resized_crop": True,
        "crop_min_scale": 0.05,  # decode_jpeg_and_inception_crop(224), area_min=5
        "horizontal_flip": True,  # flip_lr
        "auto_augment": "randaugment",
        "randaugment_ops": 2,
        "randaugment_magnitude": 10,  # randaug(2,10)
        "random_erasing": 0.0,
        "mixup": 0.2,
        "cutmix": 0.0,
        "mix_prob": 1.0,  # mixup p=0.2, every batch
        "label_smoothing": 0.0,  # loss softmax_xent
        "eval_resize": 256,  # resize_small(256)|central_crop(224)
    },
    "optim": {
        "lr": 1e-3,
        "weight_decay": 1e-4,
        "decoupled_wd": True,  # lr, wd; OX add_decayed_weights before schedule
        "max_grad_norm": 1.0,  # grad_clip_norm
        "betas": [0.9, 0.999],  # scale_by_adam defaults
        "batch_size": 1024,
        "grad_accum": 1,
        "warmup_steps": 10000,
        "epochs": 90,
        "eval_steps": 2500,
        "save_steps": 1000,  # evals log_steps, checkpoint_steps
    },
    "mixed_precision": "bf16",  # the project's precision policy (documented as not from BV)
}

# the paper, Appendix D.4 (the H-CAST recipe) and its Datasets paragraph
FINETUNE = {
    "epochs": 100,
    "warmup_epochs": 5,
    "per_device_batch_size": 32,
    "effective_batch": 256,
    "base_lr": 5e-4,
    "weight_decay": 0.05,
    "label_smoothing": 0.1,
    "mixup": 0.8,
    "cutmix": 1.0,
    "rand_augment": "rand-m9-mstd0.5-inc1",
    "random_erasing": 0.25,
    "drop_path": 0.1,
    "max_grad_norm": 0.0,
    "image_size": 224,
    "eval_split": "test",
}
CUB = {**FINETUNE, "dataset": "cub", "train_split": "train"}
AIRCRAFT = {
    **FINETUNE,
    "dataset": "aircraft",
    "train_split": "trainval",
    "annotation": "variant",
    "keep_banner": False,
}

# the paper, Appendix D.3 (P), and HexFormer's classification_vit (HX)
CIFAR100 = {
    "model": {"preset": "tiny-cifar"},
    "data": {"dataset": "cifar100", "image_size": 32, "train_split": "train", "eval_split": "test"},
    "augment": {
        "random_resized_crop": False,
        "random_crop_padding": 4,  # HX RandomCrop(32, padding=4)
        "horizontal_flip": True,
        "auto_augment": "autoaugment",
        "autoaugment_policy": "cifar10",  # CIFAR10Policy
        "random_erasing": 0.25,
        "random_erasing_max_area": 0.4,  # RandomErasing(0.25, sh=0.4, r1=0.3)
        "mixup": 1.0,
        "cutmix": 1.0,
        "mix_prob": 0.5,  # mixup_data(alpha=1), cutmix_data(beta=1), p = 0.5
        "label_smoothing": 0.1,  # LabelSmoothingCrossEntropy(0.1)
    },
    "optim": {
        "lr": 3e-3,
        "weight_decay": 0.05,
        "betas": [0.9, 0.999],
        "batch_size": 128,
        "grad_accum": 1,
        "warmup_epochs": 10,
        "epochs": 100,
        "eval_steps": 2000,
        "save_steps": 2000,
    },
    "mixed_precision": "no",
}


@pytest.mark.parametrize(
    "name, source", [("imagenet1k", IMAGENET), ("cub", CUB), ("aircraft", AIRCRAFT), ("cifar100", CIFAR100)]
)
def test_every_recipe_field_is_the_sources_value(name, source):
    recipe = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    assert recipe == source  # every field, no field more or less


def test_every_recipe_field_names_its_source_in_a_comment():
    for path in RECIPES.glob("*.yaml"):
        if path.stem in ("imagenet1k", "cub", "aircraft", "cifar100"):
            fields = [
                line
                for line in path.read_text().splitlines()
                if ":" in line and not line.startswith("#") and not line.rstrip().endswith(":")
            ]
            assert all("#" in line for line in fields), (path.name, [f for f in fields if "#" not in f])


def test_the_imagenet_transforms_are_big_visions():
    from torchvision.transforms import v2

    augment = IMAGENET["augment"]
    train = build_transforms(224, augment, train=True).transforms
    crop = next(t for t in train if isinstance(t, v2.RandomResizedCrop))
    assert crop.scale == (0.05, 1.0) and crop.size == (224, 224)
    randaugment = next(t for t in train if isinstance(t, v2.RandAugment))
    assert (randaugment.num_ops, randaugment.magnitude, randaugment.num_magnitude_bins) == (2, 30, 31)
    assert randaugment_magnitude(10) == 30 and randaugment_magnitude(5) == 15  # the 0..10 scale onto 0..30
    evaluation = build_transforms(224, augment, train=False).transforms
    assert isinstance(evaluation[0], v2.Resize) and evaluation[0].size == [256]  # the short side
    assert isinstance(evaluation[1], v2.CenterCrop) and evaluation[1].size == (224, 224)


def test_the_cifar_transforms_are_hexformers():
    from torchvision.transforms import v2

    train = build_transforms(32, CIFAR100["augment"], train=True).transforms
    crop = next(t for t in train if isinstance(t, v2.RandomCrop))
    assert crop.padding == [4, 4, 4, 4] and not any(isinstance(t, v2.RandomResizedCrop) for t in train)
    assert next(t for t in train if isinstance(t, v2.AutoAugment)).policy == v2.AutoAugmentPolicy.CIFAR10
    erasing = next(t for t in train if isinstance(t, v2.RandomErasing))
    assert erasing.p == 0.25 and erasing.scale == (0.02, 0.4)
