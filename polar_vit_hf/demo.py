"""A tiny, seeded training loop for the CPU demo and the tests (the full trainer is ``training/``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .data import DigitsSplit


def fit_classifier(
    model: nn.Module,
    train: DigitsSplit,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    weight_decay: float = 0.05,
    warmup: int = 10,
    seed: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    progress: bool = False,
) -> list[float]:
    """Train ``model`` (a transformers image classifier) for ``steps`` seeded AdamW steps.

    Linear warm-up then cosine decay; returns the loss of every step.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * min(s, steps) / steps))
    )
    losses = []
    model.train()
    iterator = range(steps)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc=type(model).__name__, unit="step")
    for _ in iterator:
        index = torch.randint(0, len(train.labels), (batch_size,), generator=generator)
        loss = model(pixel_values=train.pixel_values[index], labels=train.labels[index]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.detach().item())
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, split: DigitsSplit, batch_size: int = 256) -> float:
    """Top-1 accuracy of ``model`` on ``split``."""
    model.eval()
    correct = 0
    for start in range(0, len(split.labels), batch_size):
        logits = model(pixel_values=split.pixel_values[start : start + batch_size]).logits
        correct += int((logits.argmax(-1) == split.labels[start : start + batch_size]).sum())
    return correct / len(split.labels)
