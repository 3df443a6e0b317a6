"""A task that compiles its own model (``torch.compile`` in the factory), as users write it."""

from __future__ import annotations

import torch

from training.config import RunConfig
from training.examples.char_gpt import build as build_char_gpt
from training.task import TaskParts


def build(config: RunConfig, device: torch.device) -> TaskParts:
    parts = build_char_gpt(config, device)
    parts.model = torch.compile(parts.model)  # the wrapper whose state names carry `_orig_mod.`
    return parts
