"""Per-sample RNG: what a sample looks like is a function of its place in the run (invariant 9).

Why: augmentation drawn in ``Dataset.__getitem__`` from the global RNG (what torchvision's
transforms do) otherwise depends on which process fetched the sample and what that process drew
before: a loader worker's stream restarts from a new seed after a resume, another ``num_workers``
deals samples to other workers, and in the training process the fetch consumes the trainer's own
stream (dropout).  So each sample is fetched with the host generators (torch's CPU generator,
numpy's global ``RandomState``, python's ``random``) seeded from a key derived from the run seed
and the sample's position; in the training process the trainer's generators are saved before a
batch and put back after it.

What a task author may rely on: draw from torch's (or numpy's, or python's) global RNG in
``__getitem__``; the draws are the same for every ``num_workers``, world size and resume.  A task
whose samples draw from fewer generators may say so (``TaskParts.sample_rngs``, e.g. ``("torch",)``
for torchvision-style transforms) to skip the others' seeding; a generator left out is then seeded
once per loader worker, not per sample, so drawing from it breaks the guarantee.  What
breaks it: a dataset that keeps a generator of its own (``torch.Generator``,
``np.random.default_rng``) created once and drawn from across samples, or one that draws on a
CUDA generator (only the CPU generator is seeded: the trainer's CUDA stream is left alone).
"""

from __future__ import annotations

import _random
import contextlib
import random
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

_NP = np.random.mtrand._rand  # the RandomState behind np.random.*
_PY = random._inst  # type: ignore[attr-defined] # the Random behind random.*


class SampleKey(NamedTuple):
    """What the batch sampler hands the dataset: the sample's index and its seed."""

    index: int
    seed: int


#: The host generators a sample may draw from, each seeded per sample unless a task names fewer
#: (``TaskParts.sample_rngs``): seeding costs ~1.2 us (torch), ~1.9 us (numpy), ~3.7 us (python).
HOST_RNGS: tuple[str, ...] = ("torch", "numpy", "python")


def _seed_torch(seed: int) -> None:
    # Only the CPU generator: ``torch.manual_seed`` would re-seed every CUDA device too (the
    # trainer's dropout stream) and costs ~100x more.
    torch.default_generator.manual_seed(seed)


def _seed_numpy(seed: int) -> None:
    _NP.seed((seed ^ (seed >> 32)) & 0xFFFFFFFF)  # clears the cached gaussian, as np.random.seed does


def _seed_python(seed: int) -> None:
    _random.Random.seed(_PY, seed)
    _PY.gauss_next = None  # what random.seed clears besides the C state


_SEEDERS = {"torch": _seed_torch, "numpy": _seed_numpy, "python": _seed_python}


def check_rngs(rngs: Any) -> tuple[str, ...]:
    """``rngs`` as a tuple of known generator names; ValueError (one line) otherwise."""
    names = tuple(rngs)
    unknown = [r for r in names if r not in _SEEDERS]
    if unknown or not names:
        raise ValueError(f"sample_rngs = {list(names)!r}: name one or more of {list(HOST_RNGS)}")
    return names


def seed_host_rngs(seed: int, rngs: tuple[str, ...] = HOST_RNGS) -> None:
    """Seed the named host generators (all three by default) for one sample."""
    for name in rngs:
        _SEEDERS[name](seed)


@contextlib.contextmanager
def preserved_host_rngs() -> Iterator[None]:
    """Put the host generators back as they were (the training process's own streams)."""
    saved = (torch.default_generator.get_state(), _NP.get_state(legacy=False), _PY.getstate())
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        _NP.set_state(saved[1])
        _PY.setstate(saved[2])


class SeededSamples(Dataset):
    """A map-style dataset fetched as ``[SampleKey, ...]`` batches, each sample under its seed.

    In the training process (``num_workers`` 0, validation) the trainer's generators are saved
    before the batch and restored after it; a loader worker draws nothing else, so there they are
    simply overwritten."""

    def __init__(self, dataset: Any, rngs: tuple[str, ...] = HOST_RNGS) -> None:
        self.dataset = dataset
        self.seeders = tuple(_SEEDERS[name] for name in check_rngs(rngs))  # module functions: picklable

    def __len__(self) -> int:
        return len(self.dataset)

    def _fetch(self, keys: list[SampleKey]) -> list[Any]:
        out = []
        for index, seed in keys:
            for seed_one in self.seeders:
                seed_one(seed)
            out.append(self.dataset[index])
        return out

    def __getitems__(self, keys: list[SampleKey]) -> list[Any]:
        if get_worker_info() is not None:
            return self._fetch(keys)
        with preserved_host_rngs():
            return self._fetch(keys)

    def __getitem__(self, key: SampleKey) -> Any:
        return self.__getitems__([key])[0]
