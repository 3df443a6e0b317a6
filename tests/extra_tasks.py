"""A task with state of its own (``TaskParts.extra_state``): the example char GPT plus a
"curriculum" that its loss reads and updates, so a resume that lost it would change the losses."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from training.config import RunConfig
from training.examples.char_gpt import build as build_char_gpt
from training.task import TaskParts


class Curriculum:
    """A running mean of the training loss that weights the next loss: state the trajectory
    depends on, kept by the task and restored by convoy."""

    def __init__(self) -> None:
        self.mean = torch.zeros(())
        self.steps = 0

    def observe(self, loss: torch.Tensor) -> torch.Tensor:
        weighted = loss * (1.0 + 0.1 * torch.tanh(self.mean))
        self.mean.mul_(0.9).add_(loss.detach(), alpha=0.1)
        self.steps += 1
        return weighted

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean.copy_(state["mean"])
        self.steps = int(state["steps"])


def build(config: RunConfig, device: torch.device) -> TaskParts:
    parts = build_char_gpt(config, device)
    curriculum = Curriculum()
    inner = parts.loss_fn

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = inner(m, batch)
        return curriculum.observe(loss) if m.training else loss  # validation leaves it alone

    return replace(parts, loss_fn=loss_fn, extra_state={"curriculum": curriculum})
