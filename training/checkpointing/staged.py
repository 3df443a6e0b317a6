"""A durable save staged by another holder of the state's copy: the store persists what the memory
tier copied into its slot instead of copying the state a second time.

Why: the async save's own staging copy and the memory tier's slots made three copies of the state
beside the live one (measured at a 4 GiB state: 18.3 GB peak against a bare loop's 6.2 GB).  With
the save persisting from the slot, one copy serves both tiers (memory tier rule 8).  The store
imports nothing of the memory tier: the holder hands it this record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Staged:
    """A state already copied out of the live tensors: what the store writes, and the holder's two
    hooks around the write."""

    #: The parts' JSON skeletons (``codec.split_tree``), by part.
    skeletons: dict[str, Any]
    #: The parts' tensors, by part and key: views of the holder's copy, stable until released.
    tensors: dict[str, dict[str, torch.Tensor]]
    #: Runs on the persist thread before any file is written (the slot's hash and commit).
    before_write: Callable[[], None]
    #: Runs once the persist ended, however it ended: the holder may overwrite its copy from then.
    release: Callable[[], None]
