"""Per-sample RNG: what a sample looks like is a function of its place in the run (invariant 9).

Why: augmentation drawn in ``Dataset.__getitem__`` from the global RNG (what torchvision's
transforms do) otherwise depends on which process fetched the sample and what that process drew
before: a loader worker's stream restarts from a new seed after a resume, another ``num_workers``
deals samples to other workers, and in the training process the fetch consumes the trainer's own
stream (dropout).  So each sample is fetched with the host generators (torch's CPU generator,
numpy's global ``RandomState``, python's ``random``) seeded from a key derived from the run seed
and the sample's position; in the training process the trainer's generators are saved before a
batch and put back after it.

Seeding costs ~1.5 us (torch), ~2.5 us (numpy) and ~4-5 us (python) a sample, on a ~70-150 us
CNN-style fetch; most tasks draw from one or two of the three.  So a map-style dataset's torch
generator is seeded before every sample, and numpy's and python's are seeded *when the sample
draws from them*: before a batch each is parked in a known state, after each sample one draw from
it is compared with what the parked stream gives at that point (0.25 us numpy, 0.04 us python); a
mismatch means the sample drew from it unseeded, so the sample is fetched again with it seeded,
and from then on (in that process) it is seeded before every sample.  Every sample therefore gets
exactly what seeding all three before every fetch gives it, whatever it draws and whichever
process fetches it; nothing is detected once and trusted, nothing is recorded.  A dataset whose
fetch has side effects sees one extra fetch per process for each of numpy and python it draws
from.  Streams (:mod:`training.streams`) cannot fetch an item twice: they seed eagerly.

What a task author may rely on: draw from torch's (or numpy's, or python's) global RNG in
``__getitem__``; the draws are the same for every ``num_workers``, world size and resume.  A task
whose samples draw from fewer generators may say so (``TaskParts.sample_rngs``, e.g. ``("torch",)``
for torchvision-style transforms): a generator left out is then neither seeded nor checked (seeded
once per loader worker, not per sample), so drawing from it breaks the guarantee.  What
breaks it: a dataset that keeps a generator of its own (``torch.Generator``,
``np.random.default_rng``) created once and drawn from across samples, or one that draws on a
CUDA generator (only the CPU generator is seeded: the trainer's CUDA stream is left alone).
"""

from __future__ import annotations

import _random
import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

_NP = np.random.mtrand._rand  # the RandomState behind np.random.*
_PY = random._inst  # type: ignore[attr-defined] # the Random behind random.*

#: Sample seeds are 63-bit (``training.data.sample_seed``).
SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


class SampleKey(NamedTuple):
    """What the dataset is fetched with: the sample's index and its seed."""

    index: int
    seed: int


class SeededBatch(NamedTuple):
    """A training micro-batch as the loader hands it to a worker: the indices and the first
    sample's seed.  A micro-batch's samples are consecutive positions of the epoch's order, so
    their seeds are consecutive: one int crosses the process boundary instead of a key per
    sample (pickling 64 ``SampleKey``s and back costs ~2 us a sample)."""

    indices: list[int]
    first_seed: int

    def seeds(self) -> list[int]:
        return [(self.first_seed + j) & SEED_MASK for j in range(len(self.indices))]

    def keys(self) -> list[SampleKey]:
        return [SampleKey(i, s) for i, s in zip(self.indices, self.seeds(), strict=True)]


#: The host generators a sample may draw from (the default ``TaskParts.sample_rngs``).
HOST_RNGS: tuple[str, ...] = ("torch", "numpy", "python")


def _seed_torch(seed: int) -> None:
    # Only the CPU generator: ``torch.manual_seed`` would re-seed every CUDA device too (the
    # trainer's dropout stream) and costs ~100x more.
    torch.default_generator.manual_seed(seed)


def _numpy_seed(seed: int) -> int:
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def _seed_numpy(seed: int) -> None:
    _NP.seed(_numpy_seed(seed))  # clears the cached gaussian, as np.random.seed does


def _seed_python(seed: int) -> None:
    _random.Random.seed(_PY, seed)
    _PY.gauss_next = None  # what random.seed clears besides the C state


_SEEDERS = {"torch": _seed_torch, "numpy": _seed_numpy, "python": _seed_python}

#: What a lazily seeded generator is parked at before a batch (any constant: a sample that draws
#: from it unseeded is fetched again, so the parked stream never reaches a sample).
_PARK_SEED = 0x0C0F_FEE5


def _draw_numpy() -> float:
    return _NP.random_sample()


def _reference_numpy(n: int) -> list[float]:
    return np.random.RandomState(_numpy_seed(_PARK_SEED)).random_sample(n).tolist()


def _draw_python() -> float:
    return _PY.random()


def _reference_python(n: int) -> list[float]:
    parked = random.Random(_PARK_SEED)
    return [parked.random() for _ in range(n)]


class _Check(NamedTuple):
    """How to tell whether a fetch drew from a parked generator: one draw from the global
    generator, and the first ``n`` draws a private generator seeded as the parked one gives."""

    draw: Callable[[], float]
    reference: Callable[[int], list[float]]


#: The generators seeded only when a sample draws from them (torch's is seeded before every
#: sample: checking it would cost what seeding it does).
_CHECKS = {"numpy": _Check(_draw_numpy, _reference_numpy), "python": _Check(_draw_python, _reference_python)}


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
    """A map-style dataset fetched as ``SeededBatch``es (or ``[SampleKey, ...]``), each sample
    with the generators it draws from seeded by its seed (module docstring).

    In the training process (``num_workers`` 0, validation) the trainer's generators are saved
    before the batch and restored after it; a loader worker draws nothing else, so there they are
    simply overwritten.  ``eager``: the generators seeded before every sample; ``lazy``: those
    parked and checked, moved to ``eager`` (in this process) by the first sample that draws from
    one."""

    def __init__(self, dataset: Any, rngs: tuple[str, ...] = HOST_RNGS) -> None:
        names = check_rngs(rngs)
        self.dataset = dataset
        self.eager = tuple(n for n in names if n not in _CHECKS)
        self.lazy = tuple(n for n in names if n in _CHECKS)
        self._references: dict[str, list[float]] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def _park(self, samples: int) -> list[tuple[Callable[[], float], list[float]]]:
        """Seed the lazy generators with the park seed; per lazy generator its draw and the
        reference draws for the next ``samples`` checks."""
        checks = []
        for name in self.lazy:
            if len(self._references.get(name, ())) < samples:
                self._references[name] = _CHECKS[name].reference(max(samples, 256))
            _SEEDERS[name](_PARK_SEED)
            checks.append((_CHECKS[name].draw, self._references[name]))
        return checks

    def _fetch(self, indices: Sequence[int], seeds: Sequence[int]) -> list[Any]:
        """The samples, each under its seed.  Hot loop (~1 us a sample of Python around the
        seeding): the eager seeders and the checks are local, the rare refetch is a call."""
        dataset, out = self.dataset, []
        seeders = [_SEEDERS[name] for name in self.eager]
        checks = self._park(len(indices))
        at = 0  # checks since the park
        for index, seed in zip(indices, seeds, strict=True):
            for seed_one in seeders:
                seed_one(seed)
            sample = dataset[index]
            if checks:
                drawn = [i for i, (draw, reference) in enumerate(checks) if draw() != reference[at]]
                at += 1
                if drawn:
                    sample = self._promote(drawn, index, seed)
                    seeders = [_SEEDERS[name] for name in self.eager]
                    checks, at = self._park(len(indices)), 0
            out.append(sample)
        return out

    def _promote(self, drawn: list[int], index: int, seed: int) -> Any:
        """The lazy generators at ``drawn`` were drawn from unseeded: seed them eagerly from now
        on, and fetch the sample again with them seeded (and check it again: a sample may draw
        from python only after numpy gave it some value)."""
        names = [self.lazy[i] for i in drawn]
        self.eager += tuple(names)
        self.lazy = tuple(n for n in self.lazy if n not in names)
        return self._fetch([index], [seed])[0]

    def __getitems__(self, batch: SeededBatch | list[SampleKey]) -> list[Any]:
        if isinstance(batch, SeededBatch):
            indices, seeds = batch.indices, batch.seeds()
        else:
            indices, seeds = [k.index for k in batch], [k.seed for k in batch]
        if get_worker_info() is not None:
            return self._fetch(indices, seeds)
        with preserved_host_rngs():
            return self._fetch(indices, seeds)

    def __getitem__(self, key: SampleKey) -> Any:
        return self.__getitems__([key])[0]
