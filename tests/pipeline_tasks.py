"""Tasks written as a user would, for the data-pipeline tests (tests/test_data_pipelines.py).

* ``build_cnn``: a CNN with BatchNorm and dropout on tiny images, with random flip and random crop
  drawn from torch's global RNG in ``__getitem__`` (what torchvision transforms do), a brightness
  jitter from numpy's and an inversion from python's global RNG.
* ``build_counter``: an endless ``IterableDataset`` of sample ids, sharded by rank and loader
  worker, with ``state_dict``/``load_state_dict`` and noise drawn from torch's global RNG.
* ``build_hf_logged``: the HF ``datasets`` stream example with its sample ids logged.

The stream tasks append each step's sample ids to ``<run dir>/ids.jsonl`` (the tests check that
every sample was trained exactly once, in order).  ``build_stateless`` is a stream convoy must
refuse; ``build_raises_at_step_7`` a task whose ``loss_fn`` raises at step 7 every time.
"""

from __future__ import annotations

import fcntl
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from training.config import RunConfig
from training.datapipe.streams import rank_and_world
from training.task import TaskParts

IMAGES, SIDE, CLASSES = 96, 10, 4


class AugmentedImages(Dataset):
    """Fixed tiny images; every fetch draws a flip, a crop offset, a brightness and an inversion."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = (torch.rand(IMAGES, 3, SIDE, SIDE, generator=g) * 255).to(torch.uint8)

    def __len__(self) -> int:
        return IMAGES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = self.images[i].float() / 255
        if torch.rand(1).item() < 0.5:
            img = img.flip(-1)
        top, left = torch.randint(0, 5, (2,)).tolist()
        img = F.pad(img, (2, 2, 2, 2))[:, top : top + SIDE, left : left + SIDE]
        img = img * float(1 + 0.2 * np.random.uniform(-1, 1))
        if random.random() < 0.2:
            img = 1 - img
        return img, i % CLASSES


def _constant_schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def build_cnn(config: RunConfig, device: torch.device) -> TaskParts:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(32, CLASSES),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.train.lr, momentum=0.9)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(m(x), y)

    return TaskParts(
        model=model,
        optimizer=optimizer,
        scheduler=_constant_schedule(optimizer),
        train_data=AugmentedImages(),
        val_data=None,
        loss_fn=loss_fn,
    )


class ShardedCounter(IterableDataset):
    """Endless stream of sample ids: shard ``rank * workers + worker`` of ``world * workers`` yields
    ``shard, shard + shards, ...``; each sample carries noise drawn from torch's global RNG."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.k = self.start = 0

    def __iter__(self):  # noqa: ANN204 - a generator
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        shards, shard = self.world * workers, self.rank * workers + wid
        self.k = self.start
        while True:
            i = shard + self.k * shards
            self.k += 1
            x = torch.full((8,), float(i % 13) / 13) + 0.1 * torch.randn(8)
            yield {"id": i, "x": x, "y": i % CLASSES}

    def state_dict(self) -> dict[str, int]:
        return {"k": self.k}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = int(state["k"])


def id_logger(config: RunConfig, scheduler: Any) -> Any:
    """``log(ids)``: append the step's sample ids to the run's ``ids.jsonl``."""
    path = Path(config.runs_dir) / config.run_name / "ids.jsonl"

    def log(ids: torch.Tensor) -> None:
        with open(path, "a") as fh:
            fh.write(json.dumps({"step": scheduler.last_epoch + 1, "ids": ids.tolist()}) + "\n")

    return log


def _counter_model(config: RunConfig, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """The counter task's model, its SGD optimizer, constant schedule and id logger."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, CLASSES)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.train.lr)
    scheduler = _constant_schedule(optimizer)
    return model, optimizer, scheduler, id_logger(config, scheduler)


def build_counter(config: RunConfig, device: torch.device) -> TaskParts:
    model, optimizer, scheduler, log = _counter_model(config, device)

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        log(batch["id"])
        return F.cross_entropy(m(batch["x"]), batch["y"])

    rank, world = rank_and_world()
    return TaskParts(model, optimizer, scheduler, ShardedCounter(rank, world), loss_fn)


def build_hf_logged(config: RunConfig, device: torch.device) -> TaskParts:
    from training.examples import hf_stream

    parts = hf_stream.build(config, device)
    log, inner = id_logger(config, parts.scheduler), parts.loss_fn

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        log(batch["id"])
        return inner(m, batch)

    parts.loss_fn = loss_fn
    return parts


class Stateless(IterableDataset):
    def __iter__(self):  # noqa: ANN204 - a generator
        while True:
            yield torch.zeros(8)


def build_stateless(config: RunConfig, device: torch.device) -> TaskParts:
    model = nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return TaskParts(model, optimizer, None, Stateless(), lambda m, b: m(b).mean())


def _raising_in(parts: TaskParts, step: int, error: Exception, rank: int | None = None) -> TaskParts:
    """``parts`` whose loss_fn raises ``error`` in ``step`` (on ``rank`` only, or on every rank)."""
    inner, scheduler = parts.loss_fn, parts.scheduler

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        if scheduler.last_epoch + 1 == step and (rank is None or rank == torch.distributed.get_rank()):
            raise error
        return inner(m, batch)

    parts.loss_fn = loss_fn
    return parts


def build_raises_at_step_7(config: RunConfig, device: torch.device) -> TaskParts:
    """The CNN task with a bug: its loss_fn raises on step 7, every time."""
    return _raising_in(build_cnn(config, device), 7, RuntimeError("loss exploded: NaN in batch statistics at step 7"))


def build_char_gpt_raises_on_rank_1(config: RunConfig, device: torch.device) -> TaskParts:
    """The example model with a bug on one rank only: rank 1's loss_fn raises in step 3."""
    from training.examples.char_gpt import build

    return _raising_in(build(config, device), 3, ValueError("rank 1 saw a batch of the wrong shape in step 3"), rank=1)


def build_char_gpt_bad_units(config: RunConfig, device: torch.device) -> TaskParts:
    """The example model naming shard units it does not have (a GRU)."""
    from training.examples.char_gpt import build

    parts = build(config, device)
    parts.shard_units = (nn.GRU,)
    return parts


def build_char_gpt_sharding_itself(config: RunConfig, device: torch.device) -> TaskParts:
    """The example model sharded by its own factory, as a user who applies FSDP2 herself writes
    it: each block and the root over convoy's data-parallel mesh, then the optimizer and schedule
    built on the sharded parameters; the plain model where no process group runs."""
    from torch.distributed.fsdp import fully_shard

    from training.examples.char_gpt import Block, build, warmup_cosine
    from training.sharding import data_parallel_mesh

    parts = build(config, device)
    if not torch.distributed.is_initialized():
        return parts
    mesh = data_parallel_mesh(device)
    for block in [m for m in parts.model.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh)
    fully_shard(parts.model, mesh=mesh)
    tc = config.train
    parts.optimizer = torch.optim.AdamW(
        parts.model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95)
    )
    parts.scheduler = torch.optim.lr_scheduler.LambdaLR(parts.optimizer, warmup_cosine(tc.warmup_steps, tc.total_steps))
    parts.shard_units = None
    return parts


def build_bad_collate(config: RunConfig, device: torch.device) -> TaskParts:
    """The CNN task with a collate function that cannot handle its samples (tuples)."""
    parts = build_cnn(config, device)
    parts.collate_fn = lambda samples: torch.stack(samples)
    return parts


# ---------------------------------------------------------------- third-party streams (adapters)
#: Samples in each third-party dataset the adapter tests write: more than a 24-step run of batch 8
#: reads (192), so a run stays inside one epoch on every loader worker.
STREAM_SAMPLES = 400


def stream_sample(i: int) -> dict[str, Any]:
    """Sample ``i`` of the third-party datasets: its id and 8 features."""
    return {"id": i, "x": np.full(8, (i % 13) / 13, dtype=np.float32)}


def write_litdata(out: str) -> None:
    """``litdata.optimize`` the samples into ``out`` (run it in a subprocess: optimize switches the
    process's multiprocessing start method to spawn)."""
    import litdata

    litdata.optimize(fn=stream_sample, inputs=list(range(STREAM_SAMPLES)), output_dir=out, chunk_size=16, num_workers=1)


def write_mds(out: str) -> None:
    """Write the samples into ``out`` with MosaicML's ``MDSWriter`` (several small shards)."""
    from training.datapipe.stream_adapters.mosaic import streaming_base

    columns = {"id": "int", "x": "ndarray:float32:8"}
    with streaming_base().MDSWriter(out=out, columns=columns, size_limit=1 << 11) as writer:
        for i in range(STREAM_SAMPLES):
            writer.write(stream_sample(i))


def add_noise(sample: dict[str, Any]) -> dict[str, Any]:
    """Augmentation as a user writes it: noise from torch's global generator (in a loader worker)."""
    return {"id": int(sample["id"]), "x": torch.tensor(np.array(sample["x"])) + 0.1 * torch.randn(8)}


def _id_task(config: RunConfig, device: torch.device, data: IterableDataset) -> TaskParts:
    """The counter task's model on ``data`` (samples ``{"id", "x"}``), logging each step's ids."""
    model, optimizer, scheduler, log = _counter_model(config, device)

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        log(batch["id"])
        return F.cross_entropy(m(batch["x"].float()), batch["id"] % CLASSES)

    return TaskParts(model, optimizer, scheduler, data, loss_fn)


def build_litdata(config: RunConfig, device: torch.device) -> TaskParts:
    """A shuffled ``litdata.StreamingDataset`` over ``task_args.dir``, augmented by its transform."""
    import litdata

    from training.datapipe.stream_adapters.litdata import LitDataStream

    ds = litdata.StreamingDataset(config.task_args["dir"], shuffle=True, seed=7, transform=add_noise)
    return _id_task(config, device, LitDataStream(ds))


def build_mosaic(config: RunConfig, device: torch.device) -> TaskParts:
    """A shuffled MosaicML ``StreamingDataset`` over ``task_args.dir``; its ``__getitem__``
    augments (a subclass, as MosaicML's examples do).  ``task_args.batch``: build it for another
    batch size than the run's (convoy refuses it)."""
    from training.datapipe.stream_adapters.mosaic import MosaicStream, streaming_base

    class Augmented(streaming_base().StreamingDataset):
        def __getitem__(self, i: int) -> dict[str, Any]:
            return add_noise(super().__getitem__(i))

    batch = config.task_args.get("batch", config.train.batch_size // rank_and_world()[1])  # per-rank micro-batch
    # MosaicML registers each dataset in shared memory under the first free prefix: two processes
    # building one at the same moment can take the same prefix (the tests run side by side).
    with open(Path(config.task_args["dir"]) / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ds = Augmented(local=config.task_args["dir"], batch_size=batch, shuffle=True, shuffle_seed=7)
    return _id_task(config, device, MosaicStream(ds))


def build_hf_map(config: RunConfig, device: torch.device) -> TaskParts:
    """An HF ``datasets`` stream of the samples (4 shards, endless) augmented by ``.map``."""
    import datasets

    from training.datapipe.stream_adapters.hf_datasets import HFStream

    rows = [stream_sample(i) for i in range(STREAM_SAMPLES)]
    table = datasets.Dataset.from_dict({"id": [r["id"] for r in rows], "x": [r["x"].tolist() for r in rows]})

    def augment(example: dict[str, Any]) -> dict[str, Any]:
        return {"x": (torch.tensor(example["x"]) + 0.1 * torch.randn(8)).tolist()}

    ds = table.to_iterable_dataset(num_shards=4).map(augment).repeat(None)
    parts = _id_task(config, device, HFStream(ds, config.data.num_workers))
    parts.collate_fn = lambda samples: {
        "id": torch.tensor([s["id"] for s in samples]),
        "x": torch.tensor([s["x"] for s in samples]),
    }
    return parts
