"""Per-sample RNG: what a sample looks like is a function of its place in the run (invariant 9).

Why: augmentation drawn in ``Dataset.__getitem__`` from the global RNG (what torchvision's
transforms do) otherwise depends on which process fetched the sample and what that process drew
before: a loader worker's stream restarts from a new seed after a resume, a different
``num_workers`` deals samples to other workers, and in the training process the fetch consumes
the trainer's own stream (dropout).  So before each sample is fetched, the RNG streams the task
names in ``TaskParts.sample_rng`` (torch's CPU generator, numpy's global ``RandomState``, python's
``random``) are seeded from a key derived from the run seed and the sample's position; in the
training process the trainer's streams are saved before a batch and put back after it.

What a task author may rely on: draw from torch's (or numpy's, or python's) global RNG in
``__getitem__``; the draws are the same for every ``num_workers``, every world size and every
resume.  What breaks it: a dataset that keeps a generator of its own (``torch.Generator``,
``np.random.default_rng``) created once and drawn from across samples, or that draws on a
CUDA generator (only the CPU generator is seeded: the trainer's CUDA stream is left alone).

Cost (``bench/loader_overhead.py``): seeding is ~1.2 us (torch), ~2 us (numpy), ~4 us (python)
per sample; a task that draws only from torch says ``sample_rng=("torch",)`` and pays only that.
"""

from __future__ import annotations

import _random
import random
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

#: The streams a sample may draw from, seeded per sample (TaskParts.sample_rng).
STREAMS = ("torch", "numpy", "python")
_MASK64 = 0xFFFFFFFFFFFFFFFF
#: Keeps sample keys apart from every other use of the run seed (the epoch orders).
_TRAIN_TAG, _VAL_TAG, _STREAM_TAG = 0x5A4D504C, 0x56414C44, 0x53545245


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 wraps silently in arrays)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_keys(seed: int, tag: int, head: Sequence[int], positions: np.ndarray) -> list[int]:
    """One 63-bit key per position: a pure function of (seed, tag, head..., position).

    Vectorised so a batch of keys costs a few microseconds, not one Python hash per sample."""
    base = np.array([seed & _MASK64], dtype=np.uint64)
    for v in (tag, *head):
        base = _splitmix(base ^ np.uint64(v & _MASK64))
    keys = _splitmix(base + positions.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    return (keys & np.uint64(0x7FFFFFFFFFFFFFFF)).tolist()


def train_keys(seed: int, epoch: int, first: int, count: int) -> list[int]:
    """Keys of epoch ``epoch``'s positions ``first .. first+count-1`` (positions in the epoch's
    order: the same for every rank, worker count and accumulation split)."""
    return sample_keys(seed, _TRAIN_TAG, (epoch,), np.arange(first, first + count, dtype=np.uint64))


def val_keys(seed: int, indices: Sequence[int]) -> list[int]:
    """Keys of validation samples: by index, so every rank draws the same for a sample."""
    return sample_keys(seed, _VAL_TAG, (), np.asarray(indices, dtype=np.uint64))


def stream_key(seed: int, rank: int, worker: int, count: int) -> int:
    """Key of the ``count``-th sample a stream's loader worker yields on ``rank``."""
    return sample_keys(seed, _STREAM_TAG, (rank, worker), np.array([count], dtype=np.uint64))[0]


def check_streams(streams: Iterable[str]) -> tuple[str, ...]:
    """``TaskParts.sample_rng`` validated: a ValueError names a stream convoy does not know."""
    out = tuple(streams)
    unknown = [s for s in out if s not in STREAMS]
    if unknown:
        raise ValueError(f"sample_rng {unknown} unknown; choose from {list(STREAMS)}")
    return out


class Seeder:
    """Seeds the chosen global streams from a sample key (the fastest calls that are exact).

    torch: only the CPU default generator (``torch.manual_seed`` would re-seed every CUDA device
    too, and costs ~100x more).  numpy: the legacy global ``RandomState`` (what ``np.random.*``
    draws from) with its cached gaussian cleared.  python: ``random``'s module instance."""

    def __init__(self, streams: Sequence[str]) -> None:
        self.torch, self.numpy, self.python = (s in streams for s in STREAMS)
        self._np = np.random.mtrand._rand  # the RandomState behind np.random.*
        self._py = random._inst  # type: ignore[attr-defined] # the Random behind random.*

    def seed(self, key: int) -> None:
        if self.torch:
            torch.default_generator.manual_seed(key)
        if self.numpy:
            self._np.seed((key ^ (key >> 32)) & 0xFFFFFFFF)
        if self.python:
            _random.Random.seed(self._py, key)  # the C seed: random.seed's checks cost 1 us more
            self._py.gauss_next = None

    def capture(self) -> tuple[Any, Any, Any]:
        """The streams this seeder touches, to put back after a fetch in the training process."""
        return (
            torch.default_generator.get_state() if self.torch else None,
            self._np.get_state(legacy=False) if self.numpy else None,
            self._py.getstate() if self.python else None,
        )

    def restore(self, saved: tuple[Any, Any, Any]) -> None:
        t, n, p = saved
        if t is not None:
            torch.default_generator.set_state(t)
        if n is not None:
            self._np.set_state(n)
        if p is not None:
            self._py.setstate(p)


def in_loader_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


class SeededSamples(torch.utils.data.Dataset):
    """A map-style dataset fetched as ``[(index, key), ...]`` batches, each sample under its key.

    In the training process (``num_workers`` 0, validation) the trainer's streams are saved
    before the batch and restored after it, so fetching consumes none of its randomness; a
    loader worker draws nothing else, so there they are simply overwritten."""

    def __init__(self, dataset: Any, streams: Sequence[str]) -> None:
        self.dataset = dataset
        self.seeder = Seeder(streams)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, batch: list[tuple[int, int]]) -> list[Any]:
        saved = None if in_loader_worker() else self.seeder.capture()
        try:
            out = []
            for index, key in batch:
                self.seeder.seed(key)
                out.append(self.dataset[index])
            return out
        finally:
            if saved is not None:
                self.seeder.restore(saved)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        return self.__getitems__([item])[0]
