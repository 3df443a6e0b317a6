"""The task every release fixture is trained with: a user's own small model on torch alone.

A 2-layer MLP with dropout (draws from torch's CPU generator every step), SGD with momentum (a
buffer per parameter), StepLR (a position), over samples generated from a fixed seed.  It uses
only what ``TaskParts`` has offered since the first release with fixtures (2026-11-29), so every
release trains it as it is; nothing of the synthetic corpus is read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

from training.task import TaskParts

FEATURES, CLASSES, SAMPLES = 12, 4, 256


def _data(seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)  # its own generator: building draws nothing global
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    w = torch.randn(FEATURES, CLASSES, generator=gen)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def build(config: Any, device: torch.device) -> TaskParts:
    torch.manual_seed(config.train.seed)  # the weights: the same on every release
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, CLASSES)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.train.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)
    return TaskParts(
        model=model, optimizer=optimizer, scheduler=scheduler, train_data=_data(7), loss_fn=_loss, val_data=None
    )
