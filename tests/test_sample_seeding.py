"""Lazy per-sample seeding (training/datapipe/sample_rng.py): numpy's and python's generators are seeded only
for the samples that draw from them, and each sample still gets exactly what seeding all three
generators before its fetch gives it, with any ``num_workers`` and whatever it draws.

The reference in every test is the definition of invariant 9 written out: ``seed_host_rngs(seed)``
(all three generators) and then ``dataset[index]``, for each sample's key.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from training.datapipe.data import Cursor, LoaderSpec, ResumableBatchSampler, make_loader, sample_seed
from training.datapipe.sample_rng import HOST_RNGS, SEED_MASK, SampleKey, SeededBatch, SeededSamples, seed_host_rngs

SPEC = LoaderSpec(8, 3, Cursor(1, 8))
BATCHES = 6


class Chained(Dataset):
    """Draws that depend on each other: numpy only when torch's draw is small, python only when
    numpy's is large (so a sample may draw from python only once numpy is seeded), a cached
    gaussian from each, a shuffle; ``fetches`` counts every fetch of this copy."""

    def __init__(self, numpy_below: float = 0.3) -> None:
        self.numpy_below = numpy_below
        self.fetches = 0

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fetches += 1
        row = [float(i), torch.rand(1).item(), 0.0, 0.0, 0.0, 0.0]
        if row[1] < self.numpy_below:
            row[2] = float(np.random.normal())  # normal(): numpy caches the second gaussian
            if row[2] > 0.5:
                row[3] = random.gauss(0, 1)  # python caches one too
                order = list(range(5))
                random.shuffle(order)
                row[4] = float(order[0])
        if i % 11 == 4:
            row[5] = float(np.random.randint(1000)) + random.random()
        return torch.tensor(row, dtype=torch.float64)


class TorchOnly(Dataset):
    """A torchvision-style sample: draws from torch alone."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(1).item()], dtype=torch.float64)


def eager_reference(dataset: Dataset, spec: LoaderSpec, batches: int) -> torch.Tensor:
    """Every sample fetched after seeding all three generators with its seed (the definition)."""
    sampler = ResumableBatchSampler(len(dataset), spec)  # type: ignore[arg-type]
    rows = []
    for batch in itertools.islice(sampler.keyed(), batches):
        for key in batch.keys():
            seed_host_rngs(key.seed, HOST_RNGS)
            rows.append(dataset[key.index])
    return torch.stack(rows)


def loader_rows(dataset: Dataset, spec: LoaderSpec, batches: int, workers: int) -> torch.Tensor:
    loader = make_loader(dataset, spec, num_workers=workers)
    return torch.cat(list(itertools.islice(iter(loader), batches)))


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_draws_what_seeding_all_three_gives_it(workers: int) -> None:
    """Samples that draw from numpy or python only now and then (chained on other draws, through
    numpy's and python's gaussian caches) get the eager seeding's values exactly."""
    reference = eager_reference(Chained(), SPEC, BATCHES)
    assert (reference[:, 2] != 0).any() and (reference[:, 3] != 0).any()  # the draws do happen
    assert (reference[:, 1] >= 0.3).any()  # and some samples skip them
    assert torch.equal(reference, loader_rows(Chained(), SPEC, BATCHES, workers))


def test_a_generator_is_seeded_per_sample_once_a_sample_drew_from_it() -> None:
    """A torch-only dataset leaves numpy and python parked (lazy); the first sample drawing from
    one of them promotes it, and the sample that revealed it is fetched once more, not every one
    after it."""
    samples = SeededSamples(TorchOnly())
    keys = [SampleKey(i, sample_seed(3, 0, i)) for i in range(16)]
    samples.__getitems__(keys)
    assert samples.eager == ("torch",) and samples.lazy == ("numpy", "python")

    chained = Chained(numpy_below=1.0)  # every sample draws from numpy; some from python
    samples = SeededSamples(chained)
    got = torch.stack(samples.__getitems__(keys))
    assert set(samples.eager) == set(HOST_RNGS) and samples.lazy == ()
    assert chained.fetches == len(keys) + 2  # one extra fetch for numpy, one for python
    reference = []
    for key in keys:
        seed_host_rngs(key.seed)
        reference.append(Chained(numpy_below=1.0)[key.index])
    assert torch.equal(torch.stack(reference), got)


def test_the_training_process_keeps_its_generators_while_generators_are_promoted() -> None:
    """``num_workers`` 0: parking, checking and refetching happen between the trainer's saved and
    restored generators; the trainer's streams continue as if nothing was fetched."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    loader_rows(Chained(), SPEC, BATCHES, workers=0)
    assert torch.equal(expected[0], torch.rand(3))
    assert (expected[1] == np.random.rand(3)).all() and expected[2] == [random.random() for _ in range(3)]


def test_a_batch_carries_its_first_seed_and_its_seeds_are_the_positions_seeds() -> None:
    """What crosses to a loader worker is the indices and one seed; the seeds it expands to are
    ``sample_seed`` of the consecutive positions, wrapping at 63 bits like ``sample_seed``."""
    sampler = ResumableBatchSampler(48, LoaderSpec(8, 3, Cursor(0, 16), rank=1, world_size=2))
    batch = next(sampler.keyed())
    assert isinstance(batch, SeededBatch) and len(batch.indices) == 4
    assert batch.seeds() == [sample_seed(3, 0, 16 + 4 + j) for j in range(4)]
    assert SeededBatch([5, 6, 7], SEED_MASK).seeds() == [SEED_MASK, 0, 1]


def test_numpy_is_read_in_place_and_any_draw_or_reseed_unparks_it() -> None:
    """The in-place view of numpy's state is the state ``MT19937.state`` reports; parked, it says
    so until anything draws (a uniform, a gaussian, one integer) or re-seeds numpy."""
    from training.datapipe.sample_rng import _PARK_SEED, _numpy_parked, _numpy_state, _seed_numpy

    view = _numpy_state()
    assert view is not None
    state = np.random.mtrand._rand._bit_generator.state["state"]
    assert list(view[:624]) == state["key"].tolist() and view[624] == state["pos"]
    for disturb in (np.random.rand, np.random.normal, lambda: np.random.randint(3), lambda: np.random.seed(7)):
        _seed_numpy(_PARK_SEED)
        assert _numpy_parked(view)
        disturb()
        assert not _numpy_parked(view)


def test_a_replaced_numpy_bit_generator_is_read_afresh_or_seeded_eagerly() -> None:
    """``np.random.set_bit_generator`` swaps the generator behind ``np.random.*``: the view follows
    it (an MT19937) or numpy is seeded before every sample (another kind: no view)."""
    from training.datapipe.sample_rng import _numpy_state

    original = np.random.get_bit_generator()
    try:
        np.random.set_bit_generator(np.random.MT19937(5))
        assert _numpy_state() is not None and _numpy_state()[624] == np.random.get_bit_generator().state["state"]["pos"]
        np.random.set_bit_generator(np.random.PCG64(5))
        assert _numpy_state() is None
    finally:
        np.random.set_bit_generator(original)
    assert _numpy_state() is not None
