"""Per-sample RNG: what a sample looks like is a function of its place in the run (invariant 9).

Why: augmentation drawn in ``Dataset.__getitem__`` from the global RNG (what torchvision's
transforms do) otherwise depends on which process fetched the sample and what that process drew
before: a loader worker's stream restarts from a new seed after a resume, another ``num_workers``
deals samples to other workers, and in the training process the fetch consumes the trainer's own
stream (dropout).  So each sample is fetched with the host generators (torch's CPU generator,
numpy's global ``RandomState``, python's ``random``) seeded from a key derived from the run seed
and the sample's position; in the training process the trainer's generators are saved before a
batch and put back after it.

Seeding costs ~2-3 us a generator a sample in a loader worker (python's more), on a ~60-150 us
CNN-style fetch, and most tasks draw from one or two of the three.  So torch's generator is seeded
before every sample, and numpy's and python's *when the sample draws from them*: before a batch
each is parked (seeded with a constant); after each sample numpy's state is read in place (parked
means: its position still says "regenerate before the next draw" and its first word is still the
park seed: any draw overwrites both) and one ``random()`` from python's is compared with what the
parked stream gives at that point.  A sample that drew from a parked generator is fetched again
with it seeded, and from then on (in that process) that generator is seeded before every sample.
Every sample therefore gets exactly what seeding all three before every fetch gives it, whatever
it draws and whichever process fetches it: nothing is detected once and trusted, nothing needs
recording in a checkpoint.  A dataset whose fetch has side effects sees one extra fetch per
process for each of numpy and python it draws from.  What the checks cannot see: a fetch that
draws from numpy or python and then puts that generator's state back (``set_state`` /
``setstate`` to what it found) drew from the parked stream unnoticed.  Streams
(:mod:`training.datapipe.streams`) cannot fetch an item twice: they seed eagerly.

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
import ctypes
import functools
import random
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

_NP = np.random.mtrand._rand  # the RandomState behind np.random.*
_PY = random._inst  # type: ignore[attr-defined] # the Random behind random.*

#: Sample seeds are 63-bit (``training.datapipe.data.sample_seed``).
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

#: What a lazily seeded generator is parked at before a batch (any constant below 2**32: a sample
#: that draws from it unseeded is fetched again, so the parked stream never reaches a sample).
_PARK_SEED = 0x0C0F_FEE5
_MT_N = 624  # words of MT19937 state; ``pos == _MT_N``: the next draw regenerates them all


def _numpy_state() -> Any:
    """The MT19937 state of numpy's global generator as 625 uint32 (``key[624]``, ``pos``), read in
    place, or None where that is not its layout: numpy is then seeded before every sample."""
    return _state_view(_NP._bit_generator)  # looked up each batch: np.random.set_bit_generator


@functools.cache
def _state_view(bit_generator: Any) -> Any:
    """``bit_generator``'s state in place (``BitGenerator.ctypes``), checked once against
    ``MT19937.state``.  Per process (a cache, not pickled: a spawned loader worker maps its own);
    the cache keeps the generator alive, so a view never outlives what it reads."""
    if type(bit_generator).__name__ != "MT19937":
        return None
    view = (ctypes.c_uint32 * (_MT_N + 1)).from_address(bit_generator.ctypes.state_address)
    state = bit_generator.state["state"]
    same = list(view[:_MT_N]) == state["key"].tolist() and view[_MT_N] == state["pos"]
    return view if same else None


def _numpy_parked(view: Any) -> bool:
    """numpy's generator is as parking left it: any draw regenerates the state (``pos`` was
    ``_MT_N``), overwriting ``key[0]`` (the park seed); ``np.random.seed`` by the sample changes
    ``key[0]`` too."""
    return view[0] == _PARK_SEED and view[_MT_N] == _MT_N


def _python_reference(n: int) -> list[float]:
    """The first ``n`` ``random()`` draws after parking: python's check draws one per sample."""
    parked = random.Random(_PARK_SEED)
    return [parked.random() for _ in range(n)]


#: The generators seeded only when a sample draws from them (torch's is seeded before every
#: sample: telling whether a fetch drew from it would cost what seeding it does).
_LAZY = ("numpy", "python")


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
        self.eager = tuple(n for n in names if n not in _LAZY)
        self.lazy = tuple(n for n in names if n in _LAZY)
        self._python_reference: list[float] = []

    def __len__(self) -> int:
        return len(self.dataset)

    def _park(self, samples: int) -> tuple[Any, list[float] | None]:
        """Park the lazy generators for a batch of ``samples``: numpy's state view (None: not
        lazy) and python's reference draws (None: not lazy)."""
        if "numpy" in self.lazy and _numpy_state() is None:
            self.eager, self.lazy = (*self.eager, "numpy"), tuple(n for n in self.lazy if n != "numpy")
        for name in self.lazy:
            _SEEDERS[name](_PARK_SEED)
        if "python" in self.lazy and len(self._python_reference) < samples:
            self._python_reference = _python_reference(max(samples, 256))
        numpy_view = _numpy_state() if "numpy" in self.lazy else None
        return numpy_view, (self._python_reference if "python" in self.lazy else None)

    def _fetch(self, indices: Sequence[int], seeds: Sequence[int]) -> list[Any]:
        """The samples, each under its seed.  Hot loop (~0.3 us a sample around the seeding, on a
        fetch that evicts everything from the caches): the checks are inline, the refetch a call."""
        dataset, out = self.dataset, []
        seeders = [_SEEDERS[name] for name in self.eager]
        numpy_view, python_reference = self._park(len(indices))
        at = 0  # python's checks since the park
        for index, seed in zip(indices, seeds, strict=True):
            for seed_one in seeders:
                seed_one(seed)
            sample = dataset[index]
            drawn = []
            if numpy_view is not None and not _numpy_parked(numpy_view):
                drawn.append("numpy")
            if python_reference is not None:
                if _PY.random() != python_reference[at]:
                    drawn.append("python")
                at += 1
            if drawn:
                sample = self._promote(drawn, index, seed)
                seeders = [_SEEDERS[name] for name in self.eager]
                (numpy_view, python_reference), at = self._park(len(indices)), 0
            out.append(sample)
        return out

    def _promote(self, drawn: list[str], index: int, seed: int) -> Any:
        """The lazy generators ``drawn`` were drawn from unseeded: seed them before every sample
        from now on, and fetch this sample again with them seeded (and checked again: a sample
        may draw from python only after numpy gave it some value)."""
        self.eager += tuple(drawn)
        self.lazy = tuple(n for n in self.lazy if n not in drawn)
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
