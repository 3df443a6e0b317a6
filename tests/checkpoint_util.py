"""Helpers for the checkpoint-store tests: a small real model and optimizer state to save."""

from __future__ import annotations

import torch

from training.checkpointing.store import CheckpointStore


def small_parts(step: int) -> dict:
    torch.manual_seed(step)
    m = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {
        "state": {"model": m.state_dict(), "optimizer": opt.state_dict(), "step": step},
        "rank-0": {"rng": torch.get_rng_state(), "step": step},
    }


def fill(store: CheckpointStore, steps: list[int]) -> None:
    for s in steps:
        store.save(s, small_parts(s), blocking=True)
