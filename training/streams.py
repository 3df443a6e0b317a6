"""Streaming train data (``torch.utils.data.IterableDataset``) resumed exactly.

A stream is positioned by its own state: ``train_data`` must implement ``state_dict()`` and
``load_state_dict(state)`` (the Stateful protocol of torchdata nodes, HF ``datasets.IterableDataset``
and MosaicML's ``StreamingDataset``), with JSON-able states.  Anything else is refused before a run
exists (:func:`check_stream`): convoy never resumes a stream approximately.

How the checkpointed position stays consistent with what was trained (invariant 9):

* Each loader worker runs its own copy of the stream (one shard of it).  The worker collates each
  batch and attaches ``(worker id, the stream's state right after that batch)``
  (:class:`StampedCollate`), so the state travels with the batch it describes.
* The DataLoader hands out batches round-robin over its workers.  :class:`StreamBatches` (in the
  training process) keeps, per worker, the state of the last batch it *handed to training*, and
  which worker's batch comes next.  Batches prefetched but not trained on are in no saved state:
  after a resume they are read again, once.
* On resume each worker loads its own saved state; the new DataLoader starts at worker 0 again,
  so :class:`StreamBatches` holds back batches of workers whose turn has not come (at most
  ``num_workers - 1`` batches) and hands them out in the saved round-robin order.
* Every sample is drawn with the host generators seeded from (run seed, rank, worker, samples that
  worker's stream yielded), like map-style samples (:mod:`training.sample_rng`), so augmentation
  in the stream replays exactly too.

How a stream learns its shard: convoy sets nothing on it.  The rank and world size are torchrun's
``RANK``/``WORLD_SIZE`` (also for one rank: 0 and 1; :func:`rank_and_world`), read by the task
factory (``datasets.distributed.split_dataset_by_node``); the loader worker is
``torch.utils.data.get_worker_info()``, read by the stream in ``__iter__`` (HF datasets does
that itself).  So ``data.num_workers`` and the world size are part of a stream's position: a
resume with other values is refused (one line, up front: ``training.preflight``), not guessed.
A stream in one canonical global order (``iter_global``, :mod:`training.stream_position`) has
no such shards in its position and resumes exactly on any layout.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from training.config import ConfigError
from training.data import LoaderSpec, loader_generator, make_loader, mix_seed, worker_init
from training.sample_rng import HOST_RNGS, check_rngs, preserved_host_rngs, seed_host_rngs
from training.stream_position import GLOBAL_KEY, ReaderPlan, is_global, make_global_loader

STREAM_SALT = 0x57AE_A3ED
#: HF ``datasets`` iterables whose state does not hold what they need to resume exactly.
_UNRESUMABLE = {"BufferShuffledExamplesIterable": "its shuffle buffer's contents are not in its state_dict()"}


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size as torchrun sets them (0 and 1 without torchrun)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def is_stream(data: Any) -> bool:
    return isinstance(data, IterableDataset)


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_stream(data: Any, name: str = "train_data") -> None:
    """Refuse a stream convoy cannot position exactly (one line: what, its type, what to do).
    A stream in a global order (:mod:`training.stream_position`) needs no state of its own."""
    if not is_stream(data) or is_global(data):
        return
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(data, m, None))]
    if missing:
        raise ConfigError(
            f"{name} is a {_type_name(data)}, an IterableDataset without {' or '.join(m + '()' for m in missing)}: "
            "convoy cannot resume it exactly; implement state_dict() and load_state_dict(state) (a JSON-able "
            "position), or make it a map-style Dataset"
        )
    node = getattr(data, "_ex_iterable", None)  # HF datasets: the chain of example iterables
    while node is not None:
        why = _UNRESUMABLE.get(type(node).__name__)
        if why:
            raise ConfigError(
                f"{name} is a {_type_name(data)} with .shuffle(buffer_size=...): {why}, so a resume would "
                "train other samples than the uninterrupted run; shuffle the map-style Dataset before "
                ".to_iterable_dataset(), or shuffle shards only"
            )
        node = getattr(node, "ex_iterable", None)


def json_state(state: Any, name: str = "train_data") -> Any:
    """``state`` as plain JSON values (checkpoints hold no pickle); one line if it is not JSON."""
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{name}.state_dict() returned a value that is not JSON ({exc}); return plain values"
        ) from None


class StreamEnded(RuntimeError):
    """A stream ran out: convoy needs an endless stream (a finite one would change epochs)."""


class SeededStream(IterableDataset):
    """The task's stream, positioned from a saved state and seeded per sample (module docstring).

    A copy runs in each loader worker; ``states[w]`` is worker ``w``'s saved state (None: start)."""

    def __init__(
        self,
        inner: IterableDataset,
        seed: int,
        rank: int,
        states: list[Any] | None,
        rngs: tuple[str, ...] = HOST_RNGS,
    ) -> None:
        self.inner, self.seed, self.rank, self.states, self.rngs = inner, seed, rank, states, check_rngs(rngs)
        self.samples = 0

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        wid = info.id if info is not None else 0
        saved = self.states[wid] if self.states else None
        if saved is not None:
            self.inner.load_state_dict(saved["stream"])  # type: ignore[attr-defined]
        self.samples = saved["samples"] if saved is not None else 0
        it = iter(self.inner)
        base = mix_seed(self.seed, STREAM_SALT, self.rank, wid)
        while True:  # in the training process StreamBatches keeps the trainer's generators aside
            sample = self._next(it, (base + self.samples) & 0x7FFFFFFFFFFFFFFF, wid)
            self.samples += 1
            yield sample

    def _next(self, it: Iterator[Any], seed: int, wid: int) -> Any:
        seed_host_rngs(seed, self.rngs)
        try:
            return next(it)
        except StopIteration:
            raise StreamEnded(
                f"train_data: the stream of rank {self.rank}, loader worker {wid} ended after {self.samples} "
                "samples; convoy needs an endless stream (e.g. datasets' .repeat(None)) with at least "
                "data.num_workers shards per rank"
            ) from None

    def state_dict(self) -> dict[str, Any]:
        return {"stream": json_state(self.inner.state_dict()), "samples": self.samples}  # type: ignore[attr-defined]


class StampedCollate:
    """Collate in the worker and attach ``(worker id, stream state after this batch)``."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None, stream: SeededStream) -> None:
        self.collate, self.stream = collate or default_collate, stream

    def __call__(self, samples: list[Any]) -> tuple[Any, int, dict[str, Any]]:
        info = get_worker_info()
        stream = info.dataset if info is not None else self.stream
        return self.collate(samples), (info.id if info is not None else 0), stream.state_dict()  # type: ignore[union-attr]


class StreamBatches:
    """This rank's micro-batches of a stream in the saved round-robin order, and the position of
    what was handed out (:meth:`state_dict`, saved in the rank's checkpoint part)."""

    def __init__(self, loader: DataLoader, num_workers: int, saved: dict[str, Any] | None) -> None:
        self.slots = max(num_workers, 1)
        self.num_workers = num_workers
        self.workers: list[Any] = list(saved["workers"]) if saved else [None] * self.slots
        self.next_worker = int(saved["next_worker"]) if saved else 0
        self.held: dict[int, collections.deque[tuple[Any, Any]]] = collections.defaultdict(collections.deque)
        self.it = iter(loader)

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> Any:
        want = self.next_worker
        while not self.held[want]:
            try:
                if self.num_workers:
                    batch, wid, state = next(self.it)
                else:  # fetched in the training process: the trainer's generators are put back
                    with preserved_host_rngs():
                        batch, wid, state = next(self.it)
            except StreamEnded as exc:  # from a worker: "Caught StreamEnded ... StreamEnded: <line>"
                self.close()
                raise ConfigError(str(exc).splitlines()[-1].split("StreamEnded: ", 1)[-1]) from None
            self.held[wid].append((batch, state))
        batch, state = self.held[want].popleft()
        self.workers[want] = state
        self.next_worker = (want + 1) % self.slots
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "next_worker": self.next_worker, "workers": list(self.workers)}

    def close(self) -> None:
        """Stop the loader's worker processes now.  Why explicitly: an iterator still referenced
        from an exception's traceback keeps its workers until interpreter exit, where joining
        them can wait forever (seen: a stream that ended left the process hanging at exit)."""
        it, self.it = self.it, None
        shutdown = getattr(it, "_shutdown_workers", None)  # torch's multi-process iterator only
        if shutdown is not None:
            shutdown()


def make_stream_loader(
    stream: IterableDataset,
    *,
    seed: int,
    rank: int,
    per_rank_batch: int,
    num_workers: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    saved: dict[str, Any] | None,
    sample_rngs: tuple[str, ...] = HOST_RNGS,
) -> StreamBatches:
    """This rank's resumable stream loader; ``saved`` is the rank's stream state from the checkpoint."""
    if saved is not None and int(saved["num_workers"]) != num_workers:
        raise ConfigError(
            f"data.num_workers = {num_workers}, but the checkpoint's train_data stream was read by "
            f"{saved['num_workers']} loader workers (each holds its own shard position); resume with "
            f"-S data.num_workers={saved['num_workers']}"
        )
    wrapped = SeededStream(stream, seed, rank, saved["workers"] if saved else None, sample_rngs)
    loader = DataLoader(
        wrapped,
        batch_size=per_rank_batch,
        num_workers=num_workers,
        collate_fn=StampedCollate(collate_fn, wrapped),
        generator=loader_generator(seed, rank),
        worker_init_fn=worker_init if num_workers else None,
        prefetch_factor=2 if num_workers else None,
    )
    return StreamBatches(loader, num_workers, saved)


def train_batches(
    data: Any,
    spec: LoaderSpec,
    *,
    num_workers: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    saved_stream: dict[str, Any] | None,
    resumed: bool,
    sample_rngs: tuple[str, ...] = HOST_RNGS,
) -> Iterator[Any]:
    """This rank's training micro-batches: the map-style loader from ``spec.start``, or the stream
    loader from the rank's saved stream state (``resumed`` without one: refused, the stream's
    position was not saved for this rank, e.g. after a change of world size)."""
    if not is_stream(data):
        return iter(make_loader(data, spec, num_workers=num_workers, collate_fn=collate_fn, sample_rngs=sample_rngs))
    if is_global(data):
        return global_batches(data, spec, num_workers, collate_fn, saved_stream, sample_rngs)
    if resumed and saved_stream is None:
        raise ConfigError(
            f"train_data is a stream and the checkpoint holds no stream position for rank {spec.rank} of "
            f"{spec.world_size}; a stream resumes only with the world size it was saved with "
            "(train.ranks x train.nnodes)"
        )
    return make_stream_loader(
        data,
        seed=spec.seed,
        rank=spec.rank,
        per_rank_batch=spec.batch_size // spec.world_size,
        num_workers=num_workers,
        collate_fn=collate_fn,
        saved=saved_stream,
        sample_rngs=sample_rngs,
    )


def global_batches(
    data: Any,
    spec: LoaderSpec,
    num_workers: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    saved_stream: dict[str, Any] | None,
    sample_rngs: tuple[str, ...],
) -> Iterator[Any]:
    """A global-order stream's loader for this rank from the run's data cursor (for a stream it
    counts global samples), which the saved ``global_sample`` must equal (both say where the run is)."""
    start = spec.start.offset
    if saved_stream is not None and int(saved_stream[GLOBAL_KEY]) != start:
        raise ValueError(f"stream position {saved_stream[GLOBAL_KEY]} != data cursor {start}")
    plan = ReaderPlan(start, spec.batch_size, spec.rank, spec.world_size, num_workers=num_workers)
    return make_global_loader(data, seed=spec.seed, plan=plan, collate_fn=collate_fn, sample_rngs=sample_rngs)
