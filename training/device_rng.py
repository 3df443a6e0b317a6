"""Which saved CUDA generator state a rank restores: the choice, pure (no CUDA, no checkpoint).

Why a module of its own, at training's bottom: the state restores the chosen stream
(:func:`training.state.restore_rng`) and the checkpoint check judges a checkpoint's device
streams by the same reading (:mod:`training.checkpointing.state_check`).  Here, both use it
without the state importing the checkpoint rooms or the reverse.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def _is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # a real tensor exists only where torch was imported
    return torch is not None and isinstance(x, torch.Tensor)


def select_cuda_rng(
    saved: list[Any], device_index: int, is_tensor: Callable[[Any], bool] = _is_torch_tensor
) -> tuple[Any, str]:
    """Pick the saved CUDA generator state that belongs to this rank's device (pure: no CUDA).

    Returns ``(state, how)``; ``state`` None means none applies (``how`` says why) and the
    caller seeds a fresh stream (:func:`training.state.fallback_cuda_seed`).  ``is_tensor`` tells
    a device state in the old format: a tensor, or what stands in for one where the state is
    checked from a checkpoint's header (:mod:`training.checkpointing.state_check`).  Formats:

    * current: ``[{"device": i, "state": t}]``, this rank's own stream.  It is taken whatever
      ``i`` is: the stream belongs to the rank, and a resume may put the rank on another device
      index (other visible devices, another node shape); ``i`` is kept for diagnostics.
    * old (before per-rank device RNG): a list of plain tensors, one per device visible to the
      rank when saved, by index.  The entry for ``device_index`` is taken when present; when the
      checkpoint has fewer entries (resumed with more visible devices), there is none.
    * ``[]`` (saved on CPU): none.
    """
    if not saved:
        return None, "checkpoint has no CUDA RNG state (saved on CPU)"
    if all(isinstance(e, dict) and "state" in e for e in saved):
        if len(saved) != 1:
            raise ValueError(f"rank RNG holds {len(saved)} per-rank CUDA states; expected one")
        entry = saved[0]
        return entry["state"], f"rank stream (saved on cuda:{entry.get('device')})"
    if not all(is_tensor(e) for e in saved):
        raise ValueError("rank RNG 'cuda' entry is neither per-rank nor a list of device states")
    if device_index < len(saved):
        return saved[device_index], f"old all-devices format, entry {device_index} of {len(saved)}"
    return None, f"old all-devices format holds {len(saved)} device(s), none for cuda:{device_index}"
