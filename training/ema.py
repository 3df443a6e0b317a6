"""An exponential moving average of the model's weights, kept by convoy (``train.ema_decay``).

Why convoy keeps it rather than the task: an EMA is state that must be saved, hashed, restored
bitwise and registered with the run, and one hidden inside the model (the recipe before this)
forced a ``train_step`` of the task's own.  Held in ``TaskParts.extra_state["ema"]``, it goes
through the same path as any extra state of a task (:mod:`training.parts`).

Rules:
1. Updated after every optimizer step (``ema = decay * ema + (1 - decay) * weight``, one
   ``lerp_`` per tensor, in the weight's dtype): deterministic, so a resumed run's EMA is bit for
   bit the uninterrupted run's.
2. Starts as a copy of the weights the run starts from (after an ``init_from``), so step 0's EMA
   is the model.
3. Covers every floating tensor of the model's ``state_dict`` (parameters and buffers, e.g. a
   BatchNorm's running stats); integer buffers are copied as they are.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

#: The name of convoy's EMA in ``TaskParts.extra_state``.
EMA = "ema"


class WeightEMA:
    """The EMA of ``model``'s state (rule 3), updated by :meth:`update` after each optimizer step."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema_decay = {decay}: must be between 0 and 1 (e.g. 0.999)")
        self.model = model
        self.decay = decay
        self.updates = 0
        self.weights: dict[str, torch.Tensor] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._copy: torch.nn.Module | None = None

    def module(self) -> torch.nn.Module:
        """A copy of the model holding the averaged weights (built once, refreshed at each call):
        in-loop validation evaluates it while the live model stays untouched."""
        if self._copy is None:
            self._copy = copy.deepcopy(self.model)
            for p in self._copy.parameters():
                p.grad = None
                p.requires_grad_(False)
        self._copy.load_state_dict(self.weights)
        return self._copy

    def reset(self) -> None:
        """Rule 2: the EMA of a run that starts now is the model as it starts."""
        self.updates = 0
        for key, value in self.model.state_dict().items():
            self.weights[key].copy_(value)

    @torch.no_grad()
    def update(self) -> None:
        """Rule 1: one step of the average, after an optimizer step."""
        for key, value in self.model.state_dict().items():
            ema = self.weights[key]
            if ema.is_floating_point():
                ema.lerp_(value.detach(), 1.0 - self.decay)
            else:
                ema.copy_(value)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["weights"]) != set(self.weights):
            raise ValueError("the saved EMA covers other tensors than the model's")
        for key, value in state["weights"].items():
            self.weights[key].copy_(value)
        self.updates = int(state["updates"])
