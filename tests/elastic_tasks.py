"""Tasks for the elastic-stream tests (tests/test_elastic_streams.py), written as a user would.

* ``build_global``: an endless stream in one canonical global order (sample ``g`` has id ``g``)
  that implements convoy's global-order protocol (``iter_global``, training/datapipe/stream_position.py);
  each sample carries noise drawn from torch's global RNG (convoy seeds it per global index).
* ``build_sharded``: the sharded stateful counter of tests/pipeline_tasks.py (positions per rank
  and loader worker), which convoy must refuse to resume on another layout.

Both log each micro-batch's sample ids to ``<run dir>/ids-rank<r>.jsonl`` (step, rank, ids): the
tests check that every id is trained exactly once, in the uninterrupted run's global order.  No
dropout: after a world-size change only the floating-point order of the gradient sum differs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

from tests.pipeline_tasks import CLASSES, ShardedCounter
from training.config import RunConfig
from training.datapipe.streams import rank_and_world
from training.task import TaskParts


def sample(i: int) -> dict[str, Any]:
    """Sample ``i``: its id, features that depend on it plus noise from torch's global RNG, a label."""
    x = torch.full((8,), float(i % 13) / 13) + 0.1 * torch.randn(8)
    return {"id": i, "x": x, "y": i % CLASSES}


class GlobalCounter(IterableDataset):
    """Sample ``g`` of the canonical order is :func:`sample` ``(g)``; read sequentially, skipping
    what this reader is not asked for (a real stream would seek to the shard holding ``g``)."""

    def iter_global(self, indices: Iterator[int]) -> Iterator[dict[str, Any]]:
        for g in indices:
            yield sample(g)

    def __iter__(self) -> Iterator[dict[str, Any]]:  # outside convoy: the whole order
        g = 0
        while True:
            yield sample(g)
            g += 1


def _parts(config: RunConfig, device: torch.device, data: IterableDataset) -> TaskParts:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, CLASSES)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.train.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    rank, _world = rank_and_world()
    path = Path(config.runs_dir) / config.run_name / f"ids-rank{rank}.jsonl"

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with open(path, "a") as fh:
            fh.write(json.dumps({"step": scheduler.last_epoch + 1, "rank": rank, "ids": batch["id"].tolist()}) + "\n")
        return F.cross_entropy(m(batch["x"]), batch["y"])

    return TaskParts(model, optimizer, scheduler, data, loss_fn)


def build_global(config: RunConfig, device: torch.device) -> TaskParts:
    return _parts(config, device, GlobalCounter())


def build_sharded(config: RunConfig, device: torch.device) -> TaskParts:
    return _parts(config, device, ShardedCounter(*rank_and_world()))
