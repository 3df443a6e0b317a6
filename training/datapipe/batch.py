"""Batches of any structure: a tree map that moves every tensor of a batch to the device.

Why its own module: the worker, the in-loop validation and the examples all need the same rule
for "what a batch is".  A batch is whatever the DataLoader yields (after the task's
``collate_fn``): a tensor, a tuple or list of them, a dict (the Hugging Face convention
``{"input_ids", "attention_mask", "labels"}``), any nesting of those, with non-tensor leaves
(strings, numbers, None) passed through untouched.  The loss function receives the same
structure, on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def tree_map(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Apply ``fn`` to every tensor leaf, keeping the containers' types (dict subclasses such as
    HF ``BatchEncoding`` become plain dicts only if they cannot be rebuilt from a dict)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: tree_map(fn, v) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(tree_map(fn, v) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(tree_map(fn, v) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """The batch with every tensor on ``device`` (no copy for tensors already there)."""
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), batch)


def leaves(batch: Any) -> list[torch.Tensor]:
    """Every tensor of the batch, depth first in container order."""
    out: list[torch.Tensor] = []
    tree_map(lambda t: out.append(t), batch)
    return out


def batch_len(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (0 if it has none)."""
    found = leaves(batch)
    return int(found[0].shape[0]) if found and found[0].dim() > 0 else 0
