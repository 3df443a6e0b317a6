"""A task whose state is large against the example's: a stack of square linear layers trained
with AdamW on a fixed random regression, sized by ``task_args`` (``width``, ``layers``).  The
memory tests train it to measure what convoy holds beside the live state."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import Dataset

from training.config import RunConfig
from training.task import TaskParts


class Regression(Dataset):
    """``n`` fixed input/target pairs of ``width`` features, generated from a seed (no files)."""

    def __init__(self, width: int, n: int = 256, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randn(n, width, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def build_linear_stack(config: RunConfig, device: torch.device) -> TaskParts:
    args: dict[str, Any] = dict(config.task_args)
    width, layers = int(args.get("width", 1024)), int(args.get("layers", 4))
    linears = [torch.nn.Linear(width, width) for _ in range(layers)]
    # Weights N(0, 1/width), biases 0, tanh between layers: each layer keeps the activations'
    # scale and none can blow up.  PyTorch's default init shrinks it ~3x a layer, so a deep stack's
    # gradients underflowed into denormals, which the CPU computes ~10x slower (a 4 GiB state
    # stepped in 24 s, its loss NaN).  tanh holds no state: the checkpoint is the linears'.
    with torch.no_grad():
        for layer in linears:
            layer.weight.normal_(0.0, width**-0.5)
            layer.bias.zero_()
    blocks: list[torch.nn.Module] = []
    for layer in linears:
        blocks += [layer, torch.nn.Tanh()]
    model = torch.nn.Sequential(*blocks[:-1]).to(device)
    # One parameter at a time (no foreach): its transients stay the size of one layer, so what a
    # test measures beside the live state is not hidden in them.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay, foreach=False
    )

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(m(x), y)

    parts = TaskParts(model=model, optimizer=optimizer, scheduler=None, train_data=Regression(width), loss_fn=loss_fn)
    return replace(parts, shard_units=(torch.nn.Linear,))  # train.parallel: fsdp shards each layer
