"""The task of the negative controls: one that every component of the train state steers.

An MLP with dropout (torch's CPU generator) trained by AdamW (buffers ``exp_avg``,
``exp_avg_sq`` and ``step``) under a StepLR schedule, on map-style data (the cursor), whose loss
is scaled by draws from python's and numpy's global generators (as a user's stochastic
regulariser would draw them), so each of those streams changes the weights.  With
``train.ema_decay`` the run keeps an EMA (extra state ``ema``).  A control that withholds a
component this task never reads would pass and prove nothing: the test lists which it uses.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from training.config import RunConfig
from training.parts import TaskParts

FEATURES, CLASSES, SAMPLES = 10, 3, 512


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    jitter = 1.0 + 0.05 * random.random() + 0.05 * float(np.random.rand())
    return torch.nn.functional.cross_entropy(model(x), y) * jitter


def build(config: RunConfig, device: torch.device) -> TaskParts:
    torch.manual_seed(config.train.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 24), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(24, CLASSES)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    y = (x[:, :CLASSES] * torch.randn(CLASSES, generator=gen)).argmax(dim=1)
    return TaskParts(
        model=model, optimizer=optimizer, scheduler=scheduler, train_data=TensorDataset(x, y), loss_fn=_loss
    )
