"""Deterministic, resumable data order with an O(1) cursor.

* The order of epoch *e* is a pure function of ``(seed, e)`` (a seeded ``randperm``).
* The cursor is the position of the next *global* batch: ``(epoch, offset)`` in samples.
  Restoring it costs one permutation of indices; no sample before it is read, no batch replayed.
* Rank *r* of *W* takes the slice ``[r·B/W, (r+1)·B/W)`` of each fixed global batch of ``B``
  samples, so changing the world size keeps the global sample sequence.
* With gradient accumulation (``accum`` = A) one optimizer step reads A consecutive global
  micro-batches of B samples, i.e. the same A·B samples, in the same order, as one batch of A·B
  would be; the cursor and the epoch's dropped tail count whole optimizer batches of A·B, so
  ``accum 4 x B`` and ``accum 1 x 4B`` see exactly the same samples at every step.
* Every sample is fetched with the host generators seeded from ``sample_seed(seed, epoch,
  position)``, its position in the epoch's global order (:mod:`training.datapipe.sample_rng`): augmentation
  drawn in ``__getitem__`` is the same whichever process, loader worker or rank fetches it, and
  after any resume.  The DataLoader gets a generator of its own, so its start-up never consumes
  the trainer's global RNG (it would, once per process, and a resumed run would drift).
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from training.datapipe.sample_rng import HOST_RNGS, SEED_MASK, SampleKey, SeededBatch, SeededSamples

_GOLDEN = 0x9E3779B97F4A7C15
#: Salts keep the sample streams apart from every other use of ``mix_seed`` (epoch orders, ranks).
TRAIN_SALT = 0x7E5A_3B1D
VAL_SALT = 0x5EED_0A11


def mix_seed(*values: int) -> int:
    """Deterministic 63-bit seed from integers (no Python ``hash``: it is salted per process)."""
    x = 0x243F6A8885A308D3
    for v in values:
        x = ((x ^ (v & 0xFFFFFFFFFFFFFFFF)) * _GOLDEN + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & 0x7FFFFFFFFFFFFFFF


def epoch_seed_base(run_seed: int, epoch: int, salt: int = TRAIN_SALT) -> int:
    """The mixed part of every sample seed of one epoch (computed once an epoch, not per sample)."""
    return mix_seed(run_seed, salt, epoch)


def sample_seed(run_seed: int, epoch: int, position: int, salt: int = TRAIN_SALT) -> int:
    """Seed of the sample at ``position`` of epoch ``epoch``'s global order (all ranks and
    micro-batches of a step together), so it does not depend on who fetches the sample.  Base +
    position, as DataLoader seeds its workers: each generator's own seeding scrambles the value."""
    return (epoch_seed_base(run_seed, epoch, salt) + position) & SEED_MASK


def validation_keys(run_seed: int, indices: list[int]) -> list[SampleKey]:
    """Keys of validation samples: seeded by their index, so each looks the same at every eval."""
    base = epoch_seed_base(run_seed, 0, VAL_SALT)
    return [SampleKey(i, (base + i) & SEED_MASK) for i in indices]


@dataclass(frozen=True)
class Cursor:
    """Position of the next global batch."""

    epoch: int = 0
    offset: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> Cursor:
        return cls(int(d["epoch"]), int(d["offset"]))

    def advance(self, batch_size: int, num_samples: int | None) -> Cursor:
        """Next cursor; the partial batch at an epoch's end is dropped (fixed global batch).
        ``num_samples`` None: a stream, whose cursor counts samples without epochs."""
        offset = self.offset + batch_size
        if num_samples is not None and offset + batch_size > num_samples:
            return Cursor(self.epoch + 1, 0)
        return Cursor(self.epoch, offset)

    def samples_consumed(self, batch_size: int, num_samples: int | None) -> int:
        """Global samples trained on before this cursor, with the same ``batch_size`` (one
        optimizer step) as :meth:`advance`: each finished epoch counts the whole batches it
        yielded.  What ``convoy status`` and MLflow (``data/samples``) show, streams included."""
        if num_samples is None:
            return self.offset
        return self.epoch * (num_samples // batch_size) * batch_size + self.offset


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return torch.randperm(num_samples, generator=g)


@dataclass(frozen=True)
class LoaderSpec:
    """Which samples a rank's loader yields: the global batch, the seed of the epoch orders, the
    cursor to start at, this rank's slice and the micro-batches per optimizer step.  One object,
    so the sampler and the loader cannot be built from different values."""

    batch_size: int
    seed: int
    start: Cursor = Cursor()
    rank: int = 0
    world_size: int = 1
    accum: int = 1


class ResumableBatchSampler(Sampler[list[int]]):
    """Infinite stream of this rank's slice of each global batch, starting at ``spec.start``."""

    def __init__(self, num_samples: int, spec: LoaderSpec) -> None:
        batch_size, world_size, accum = spec.batch_size, spec.world_size, spec.accum
        if batch_size % world_size:
            raise ValueError(f"global batch {batch_size} is not divisible by world size {world_size}")
        if batch_size * accum > num_samples:
            raise ValueError(
                f"global batch {batch_size} x {accum} accumulation steps is larger than the dataset "
                f"({num_samples} samples)"
            )
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, spec.seed
        self.start, self.rank, self.world_size, self.accum = spec.start, spec.rank, world_size, accum
        self.per_rank = batch_size // world_size

    def __iter__(self) -> Iterator[list[int]]:
        for _epoch, _at, indices in self.slices():
            yield indices

    def keyed(self) -> Iterator[SeededBatch]:
        """The same batches with their seeds: each sample's seed from its global position (the
        positions of a micro-batch are consecutive, so are its seeds: the first one is sent)."""
        base_epoch, base = -1, 0
        for epoch, at, indices in self.slices():
            if epoch != base_epoch:
                base_epoch, base = epoch, epoch_seed_base(self.seed, epoch)
            yield SeededBatch(indices, (base + at) & SEED_MASK)

    def slices(self) -> Iterator[tuple[int, int, list[int]]]:
        """``(epoch, position of the first sample in the epoch's order, indices)`` of each of this
        rank's micro-batches."""
        cursor = self.start
        order = epoch_order(self.num_samples, self.seed, cursor.epoch)
        lo = self.rank * self.per_rank
        while True:
            for k in range(self.accum):  # the micro-batches of one optimizer step
                at = cursor.offset + k * self.batch_size + lo
                yield cursor.epoch, at, order[at : at + self.per_rank].tolist()
            nxt = cursor.advance(self.batch_size * self.accum, self.num_samples)
            if nxt.epoch != cursor.epoch:
                order = epoch_order(self.num_samples, self.seed, nxt.epoch)
            cursor = nxt

    def __len__(self) -> int:  # infinite; DataLoader only needs it for len(loader)
        return 2**62


class KeyedBatches(Sampler[SeededBatch]):
    """The batch sampler the loader uses: :class:`ResumableBatchSampler`'s batches with seeds."""

    def __init__(self, sampler: ResumableBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[SeededBatch]:
        return self.sampler.keyed()

    def __len__(self) -> int:
        return len(self.sampler)


def worker_init(worker_id: int) -> None:
    """Loader worker start-up.  Each sample is seeded on its own (:mod:`training.datapipe.sample_rng`);
    seeding the worker's streams too keeps a draw outside any sample (a stream's own start-up)
    reproducible.  SIGTERM is ignored here: preemption is handled by the main process (emergency
    checkpoint), and a worker dying first would abort that step."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_loader(
    dataset: Dataset,
    spec: LoaderSpec,
    *,
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    sample_rngs: tuple[str, ...] = HOST_RNGS,
) -> DataLoader:
    """The resumable loader; yields ``spec.accum`` micro-batches per optimizer step, each collated
    by ``collate_fn`` (the task's, or PyTorch's default, which already handles dicts and tuples).
    Every sample is fetched seeded by its global position (module docstring)."""
    sampler = ResumableBatchSampler(len(dataset), spec)  # type: ignore[arg-type]
    return DataLoader(
        SeededSamples(dataset, sample_rngs),
        batch_sampler=KeyedBatches(sampler),
        num_workers=num_workers,
        generator=loader_generator(spec.seed, spec.rank),
        collate_fn=collate_fn,
        worker_init_fn=worker_init if num_workers else None,
        prefetch_factor=2 if num_workers else None,
    )


def loader_generator(seed: int, rank: int) -> torch.Generator:
    """The DataLoader's own generator: its start-up draws a base seed from it instead of from the
    trainer's global RNG."""
    return torch.Generator().manual_seed(mix_seed(seed, rank))


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens → (input, target) pairs."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.reads = 0  # how many samples were materialised (tests count this)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        start = i * self.seq_len
        chunk = self.tokens[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]
