"""Example task: an image classifier with augmentation and BatchNorm, on torch alone.

The vision recipe that works with the pinned torch (2.13.0 on CPU), for which PyPI's torchvision
does not import: images are generated from the sample's index (coloured bars at one of
``classes`` angles, with noise), augmented the way torchvision's ``RandomResizedCrop``-like
pipelines do it — a random crop, a horizontal flip, a brightness jitter — with draws from torch's
generator only (convoy seeds it per sample: the same sample gets the same augmentation on every
resume, in any loader worker), and classified by a small CNN whose BatchNorm running statistics
are part of the saved state.  Nothing is downloaded, nothing read from disk.

``task_args`` (all optional): classes (4), size (32: the crop's side; images are generated at
size + 8), width (16: the first conv's channels), samples (4096).  A real dataset drops in where
``Bars`` is: a map-style ``Dataset`` that reads image ``i`` and augments it with ``torch.rand*``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from training.config import ConfigError, RunConfig, format_validation_error
from training.examples.char_gpt import warmup_cosine
from training.task import TaskParts


class VisionArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    classes: int = Field(4, ge=2, le=32)
    size: int = Field(32, ge=8, le=256)
    width: int = Field(16, ge=4, le=256)
    samples: int = Field(4096, ge=16)


class Bars(torch.utils.data.Dataset):
    """Image ``i``: bars at angle ``(i % classes) * pi / classes``, phase and colour from ``i``
    (a function of the index, so no state), then a random crop, flip and brightness jitter drawn
    from torch's generator (seeded per sample by convoy)."""

    def __init__(self, args: VisionArgs, offset: int = 0, augment: bool = True) -> None:
        self.args, self.offset, self.augment = args, offset, augment
        full = args.size + 8
        # On the CPU whatever device the factory is built under (convoy validate builds on meta).
        ys, xs = torch.meshgrid(torch.arange(full, device="cpu"), torch.arange(full, device="cpu"), indexing="ij")
        self.grid = (ys.float(), xs.float())

    def __len__(self) -> int:
        return self.args.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        n = i + self.offset
        label = n % self.args.classes
        angle = label * math.pi / self.args.classes
        ys, xs = self.grid
        phase = (n * 0.618) % 1.0 * 2 * math.pi
        bars = torch.sin((xs * math.cos(angle) + ys * math.sin(angle)) * 0.6 + phase)
        colour = torch.tensor([(n * k % 7) / 7 + 0.3 for k in (1, 3, 5)]).view(3, 1, 1)
        image = colour * bars.unsqueeze(0)
        return self._augmented(image) if self.augment else self._centre(image), label

    def _augmented(self, image: torch.Tensor) -> torch.Tensor:
        size = self.args.size
        top, left = (int(v) for v in torch.randint(0, image.shape[-1] - size + 1, (2,)))
        crop = image[:, top : top + size, left : left + size]
        if torch.rand(()) < 0.5:
            crop = crop.flip(-1)
        return crop * (0.8 + 0.4 * torch.rand(())) + 0.1 * torch.randn_like(crop)

    def _centre(self, image: torch.Tensor) -> torch.Tensor:
        start = (image.shape[-1] - self.args.size) // 2
        return image[:, start : start + self.args.size, start : start + self.args.size]


def cnn(args: VisionArgs) -> nn.Module:
    w = args.width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1),
        nn.BatchNorm2d(w),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(2 * w, args.classes),
    )


def build(config: RunConfig, device: torch.device) -> TaskParts:
    try:
        args = VisionArgs(**config.task_args)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "task_args")) from None
    model = cnn(args).to(device)
    tc = config.train
    optimizer = torch.optim.SGD(model.parameters(), lr=tc.lr, momentum=0.9, weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(tc.warmup_steps, tc.total_steps))

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(m(images), labels)

    return TaskParts(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_data=Bars(args),
        val_data=Bars(args, offset=args.samples, augment=False),
        loss_fn=loss_fn,
        sample_rngs=("torch",),  # the augmentation draws from torch's generator only
    )
