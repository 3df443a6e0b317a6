"""The plug-in interface: how a user trains *their* model under convoy.

``params.yaml`` names ``task: package.module:factory``.  The factory is called as
``factory(config, device)`` and returns :class:`TaskParts`.  Everything in it must be built
deterministically from ``config`` (convoy seeds every RNG before calling it), because a resumed
worker rebuilds the parts and then overwrites their state from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from training.config import ConfigError, RunConfig, resolve_task_factory


@dataclass
class TaskParts:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: Stepped once per optimizer step; its position is the global step.
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    train_data: Dataset
    #: ``loss_fn(model, batch) -> scalar loss`` (batch as the DataLoader yields it, on device).
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    val_data: Dataset | None = None
    #: Tokens per sample, for the tokens-seen counter and tokens/s.
    tokens_per_sample: int = 1


def build_task(config: RunConfig, device: torch.device) -> TaskParts:
    """Call the configured factory; a bad argument or missing data becomes a ConfigError."""
    try:
        factory = resolve_task_factory(config.task)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    parts = factory(config, device)
    if not isinstance(parts, TaskParts):
        raise ConfigError(f"task = {config.task!r}: factory returned {type(parts).__name__}, not TaskParts")
    return parts
