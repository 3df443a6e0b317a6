"""Streams positioned by a global sample index: resumable after any change of world size or workers.

Why: a stream that keeps its own position (``state_dict()``/``load_state_dict()``,
:mod:`training.datapipe.streams`) keeps one position per rank and loader worker, each the position *in its
shard*.  Another world size or ``data.num_workers`` cuts the stream into other shards, and no
shard position says where the new shards are; convoy refuses such a resume (one line, up front:
:func:`check_resume`) rather than train other samples than the uninterrupted run.

The global-order protocol removes the shards from the position.  A stream that implements

    ``iter_global(indices: Iterator[int]) -> Iterator[sample]``

is a fixed, endless, canonical order of samples, sample ``g`` for ``g = 0, 1, 2, ...`` (whatever
the world size: MosaicML's canonical-nodes idea).  convoy asks each reader (rank ``r`` of ``w``,
loader worker ``k`` of ``K``) for exactly the ascending global indices it must train
(:class:`ReaderPlan`), and the stream yields those samples, one per index, in that order.  It
must draw the indices lazily (the iterator is endless) and may skip what it is not asked for
(seek to a shard, read on).  It needs no state of its own: the saved position is the number of
global samples trained (the run's data cursor, ``{"global_sample": g}`` in each rank's part),
which means the same thing at any world size.  A resume with other ranks or workers re-stripes
the rest of the one global order, so every sample is trained exactly once, in the uninterrupted
run's order:

* global micro-batch ``n`` holds samples ``[n*B, (n+1)*B)`` (``B`` = ``train.batch_size``);
  rank ``r`` trains its slice ``[n*B + r*b, n*B + (r+1)*b)`` (``b = B / w``), as map-style data;
* the DataLoader hands out batches round-robin over its workers, so worker ``k`` reads the
  micro-batches ``n0 + k, n0 + k + K, ...`` (``n0`` = the micro-batch the run resumes at);
* each sample is fetched with the host generators seeded from (run seed, ``g``) alone
  (:mod:`training.datapipe.sample_rng`), so augmentation in the stream replays at any world size too.

What stays approximate after a world-size change is floating-point: the same samples form each
global batch, but the gradient is summed over another number of ranks (all-reduce), so losses
differ in the last bits (~1e-7 measured) — as for map-style data.  Sample ids are exact.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from training.config import ConfigError
from training.datapipe.data import loader_generator, mix_seed, worker_init
from training.datapipe.sample_rng import HOST_RNGS, check_rngs, preserved_host_rngs, seed_host_rngs

GLOBAL_SALT = 0x6C0B_A15A
#: The key of a global position in a rank's checkpoint part (``{"global_sample": g}``).
GLOBAL_KEY = "global_sample"


@runtime_checkable
class GlobalOrderStream(Protocol):
    """A stream in one canonical global order that yields the samples at the indices asked for."""

    def iter_global(self, indices: Iterator[int]) -> Iterator[Any]:
        """The samples at ``indices`` (ascending, endless, drawn lazily), one per index, in order."""
        ...


def is_global(data: Any) -> bool:
    """Whether ``data`` is a stream positioned by global sample index (implements ``iter_global``)."""
    return isinstance(data, IterableDataset) and callable(getattr(data, "iter_global", None))


@dataclass(frozen=True)
class ReaderPlan:
    """Which global samples one reader trains: rank ``rank`` of ``world_size``, loader worker
    ``worker`` of ``num_workers`` (0: the training process reads), from global sample ``start``
    (a multiple of ``global_batch``: checkpoints fall on optimizer steps)."""

    start: int
    global_batch: int
    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 0

    def micro_batches(self) -> Iterator[int]:
        """The global micro-batches this reader reads, in order (round-robin over the workers)."""
        return itertools.count(self.start // self.global_batch + self.worker, max(self.num_workers, 1))

    def indices(self) -> Iterator[int]:
        """The ascending global sample indices this reader's stream must yield."""
        per_rank = self.global_batch // self.world_size
        for n in self.micro_batches():
            lo = n * self.global_batch + self.rank * per_rank
            yield from range(lo, lo + per_rank)


class GlobalStreamEnded(RuntimeError):
    """``iter_global`` stopped before the indices did (convoy needs an endless order)."""


class GlobalSeededStream(IterableDataset):
    """The task's global-order stream as one reader sees it (a copy runs in each loader worker):
    the plan's indices, each sample fetched with the host generators seeded from its index."""

    def __init__(self, inner: Any, seed: int, plan: ReaderPlan, rngs: tuple[str, ...] = HOST_RNGS) -> None:
        self.inner, self.seed, self.plan, self.rngs = inner, seed, plan, check_rngs(rngs)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        plan = replace(self.plan, worker=info.id, num_workers=info.num_workers) if info is not None else self.plan
        it = iter(self.inner.iter_global(plan.indices()))
        for g in plan.indices():  # a second copy of the same plan: the seed of each sample asked for
            seed_host_rngs(mix_seed(self.seed, GLOBAL_SALT, g), self.rngs)
            try:
                sample = next(it)
            except StopIteration:
                raise GlobalStreamEnded(
                    f"train_data: iter_global() ended before global sample {g}; convoy needs an endless global order"
                ) from None
            yield sample


class GlobalBatches:
    """This rank's micro-batches of a global-order stream, and the position of what was handed to
    training (:meth:`state_dict`): the global samples trained, the same number on every rank.
    Batches prefetched but not trained are in no saved state; a resume reads them again."""

    def __init__(self, loader: DataLoader, plan: ReaderPlan) -> None:
        self.plan, self.num_workers = plan, plan.num_workers
        self.next_sample = plan.start
        self.it: Any = iter(loader)

    def __iter__(self) -> GlobalBatches:
        return self

    def __next__(self) -> Any:
        try:
            if self.num_workers:
                batch = next(self.it)
            else:  # fetched in the training process: the trainer's generators are put back
                with preserved_host_rngs():
                    batch = next(self.it)
        except GlobalStreamEnded as exc:  # from a worker: its message is the last line
            self.close()
            raise ConfigError(str(exc).splitlines()[-1].split("GlobalStreamEnded: ", 1)[-1]) from None
        self.next_sample += self.plan.global_batch
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {GLOBAL_KEY: self.next_sample}

    def close(self) -> None:
        """Stop the loader's worker processes now (see ``StreamBatches.close``)."""
        it, self.it = self.it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def make_global_loader(
    stream: Any,
    *,
    seed: int,
    plan: ReaderPlan,
    collate_fn: Callable[[list[Any]], Any] | None,
    sample_rngs: tuple[str, ...] = HOST_RNGS,
) -> GlobalBatches:
    """This rank's loader of a global-order stream from ``plan.start`` (any world, any workers)."""
    if plan.start % plan.global_batch:
        raise ValueError(f"global sample {plan.start} is not at a micro-batch of {plan.global_batch}")
    workers = plan.num_workers
    loader = DataLoader(
        GlobalSeededStream(stream, seed, plan, sample_rngs),
        batch_size=plan.global_batch // plan.world_size,
        num_workers=workers,
        collate_fn=collate_fn or default_collate,
        generator=loader_generator(seed, plan.rank),
        worker_init_fn=worker_init if workers else None,
        prefetch_factor=2 if workers else None,
    )
    return GlobalBatches(loader, plan)


# ---------------------------------------------------------------- resuming: exact, or refused


@dataclass(frozen=True)
class SavedLayout:
    """How the stream of a checkpoint was read: world size, loader workers, and whether its
    position is global (world-independent) or per rank and worker."""

    step: int
    world_size: int
    num_workers: int | None
    is_global: bool

    @classmethod
    def of(cls, step: int, world_size: int, rank0_stream: dict[str, Any]) -> SavedLayout:
        workers = rank0_stream.get("num_workers")
        return cls(step, world_size, None if workers is None else int(workers), GLOBAL_KEY in rank0_stream)


def check_resume(
    saved: SavedLayout, world_size: int, num_workers: int, stream_is_global: bool, restripes: bool = False
) -> None:
    """Refuse, in one line, a resume that would train other samples than the uninterrupted run:
    a per-shard stream position read by another world size or ``data.num_workers``, or a
    position whose kind does not fit the task's stream.  A global position fits any layout; a
    stream whose library deals the rest of its order out again to the loader workers after a
    resume (``restripes``: MosaicML, :class:`training.datapipe.streams.MainPositioned`) fits any
    ``num_workers``."""
    if saved.is_global != stream_is_global:
        kind = "a global sample index" if saved.is_global else "per-rank shard positions"
        raise ConfigError(
            f"the checkpoint of step {saved.step} holds the train_data stream's position as {kind}, but the "
            f"task's stream {'does not implement' if saved.is_global else 'implements'} iter_global() "
            "(training/datapipe/stream_position.py); resume with the stream that saved it, or start a new run"
        )
    if saved.is_global:
        return
    same_world = saved.world_size == world_size
    same_workers = restripes or saved.num_workers is None or saved.num_workers == num_workers
    if same_world and same_workers:
        return
    raise ConfigError(
        f"train_data is a stream saved at step {saved.step} by world size {saved.world_size} with "
        f"data.num_workers={saved.num_workers}, this resume has world size {world_size} with "
        f"data.num_workers={num_workers}: its saved positions are per rank and loader worker shard, so "
        f"another layout would train other samples; resume with the saved values "
        f"(train.ranks x train.nnodes = {saved.world_size}, -S data.num_workers={saved.num_workers}), "
        "start a new run (-S run_name=<new name>), or give the stream iter_global() "
        "(training/datapipe/stream_position.py) to resume on any layout"
    )
