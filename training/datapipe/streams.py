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
  worker's stream yielded), like map-style samples (:mod:`training.datapipe.sample_rng`), so augmentation
  in the stream replays exactly too.

How a stream learns its shard: convoy sets nothing on it.  The rank and world size are torchrun's
``RANK``/``WORLD_SIZE`` (also for one rank: 0 and 1; :func:`rank_and_world`), read by the task
factory (``datasets.distributed.split_dataset_by_node``); the loader worker is
``torch.utils.data.get_worker_info()``, read by the stream in ``__iter__`` (HF datasets does
that itself).  So ``data.num_workers`` and the world size are part of a stream's position: a
resume with other values is refused (one line, up front: ``training.datapipe.preflight``), not guessed.
A stream in one canonical global order (``iter_global``, :mod:`training.datapipe.stream_position`) has
no such shards in its position and resumes exactly on any layout.

Streams positioned in the training process (:class:`MainPositioned`: litdata's and MosaicML's,
through :mod:`training.datapipe.stream_adapters`): their libraries compute the position from the number
of samples trained, in the training process (litdata refuses ``state_dict`` in a loader worker).
:class:`StreamBatches` counts the batches it handed to training and saves the library's state for
that count (``"main"``); a resume gives it back to the stream before the DataLoader starts.  A
library that re-stripes the rest of one order from loader worker 0 after a resume (MosaicML:
``restripes``) has each sample seeded by its number in this rank's stream, not in a worker's.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from training.config import ConfigError
from training.datapipe.data import LoaderSpec, loader_generator, make_loader, mix_seed, worker_init
from training.datapipe.sample_rng import HOST_RNGS, check_rngs, preserved_host_rngs, seed_host_rngs
from training.datapipe.stream_position import GLOBAL_KEY, ReaderPlan, is_global, make_global_loader

STREAM_SALT = 0x57AE_A3ED
#: HF ``datasets`` iterables whose state does not hold what they need to resume exactly.
_UNRESUMABLE = {"BufferShuffledExamplesIterable": "its shuffle buffer's contents are not in its state_dict()"}


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size as torchrun sets them (0 and 1 without torchrun)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def is_stream(data: Any) -> bool:
    return isinstance(data, IterableDataset)


@runtime_checkable
class MainPositioned(Protocol):
    """A stream whose position its library computes in the training process from the samples
    trained (why: litdata raises if asked in a loader worker; MosaicML counts samples globally)."""

    #: True: after a resume the library deals the rest of one order out again from loader worker 0
    #: (MosaicML); False: each loader worker continues its own shard (litdata).
    restripes: bool

    def main_state_dict(self, samples: int, num_workers: int, batch_size: int) -> Any:
        """The library's state after this rank trained ``samples`` samples (JSON values)."""
        ...

    def start_at(self, state: Any | None, num_workers: int, batch_size: int) -> None:
        """Position the stream (``state`` None: its start) before the DataLoader iterates it."""
        ...


def is_main_positioned(data: Any) -> bool:
    return is_stream(data) and isinstance(data, MainPositioned)


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_stream(data: Any, name: str = "train_data") -> None:
    """Refuse a stream convoy cannot position exactly (one line: what, its type, what to do).
    A stream in a global order (:mod:`training.datapipe.stream_position`) needs no state of its own; one
    positioned in the training process (:class:`MainPositioned`) keeps its library's."""
    if not is_stream(data) or is_global(data) or is_main_positioned(data):
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

    A copy runs in each loader worker; ``states[w]`` is worker ``w``'s saved state (None: start).
    ``restripe`` (``(rank samples at the resume, batch size)``): a re-striping stream's samples are
    seeded by their number in the rank's stream (:class:`MainPositioned`)."""

    def __init__(
        self,
        inner: IterableDataset,
        seed: int,
        rank: int,
        states: list[Any] | None,
        rngs: tuple[str, ...] = HOST_RNGS,
        restripe: tuple[int, int] | None = None,
    ) -> None:
        self.inner, self.seed, self.rank, self.states, self.rngs = inner, seed, rank, states, check_rngs(rngs)
        self.restripe = restripe
        self.samples = 0

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        saved = self.states[wid] if self.states and self.restripe is None else None
        if saved is not None and not is_main_positioned(self.inner):  # else positioned before the loader
            self.inner.load_state_dict(saved["stream"])  # type: ignore[attr-defined]
        self.samples = saved["samples"] if saved is not None else 0
        it = iter(self.inner)
        base = mix_seed(self.seed, STREAM_SALT, self.rank, wid if self.restripe is None else 0)
        while True:  # in the training process StreamBatches keeps the trainer's generators aside
            sample = self._next(it, (base + self._key(wid, workers)) & 0x7FFFFFFFFFFFFFFF, wid)
            self.samples += 1
            yield sample

    def _key(self, wid: int, workers: int) -> int:
        """The next sample's seed key: its number in this worker's shard, or, re-striped, in the
        rank's stream (worker ``wid``'s ``j``-th batch since the resume is the rank's batch
        ``start/B + j*workers + wid``: the DataLoader deals batches round-robin)."""
        if self.restripe is None:
            return self.samples
        start, batch = self.restripe
        return start + ((self.samples // batch) * workers + wid) * batch + self.samples % batch

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
        if is_main_positioned(self.inner):  # its state is the training process's to compute
            return {"samples": self.samples}
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
    what was handed out (:meth:`state_dict`, saved in the rank's checkpoint part).  ``main``: the
    stream's :meth:`MainPositioned.main_state_dict` for a count of samples, and the batch size."""

    def __init__(
        self,
        loader: DataLoader,
        num_workers: int,
        saved: dict[str, Any] | None,
        main: MainPosition | None = None,
    ) -> None:
        self.slots = max(num_workers, 1)
        self.num_workers = num_workers
        self.main = main
        self.batches = int(saved.get("batches", 0)) if saved else 0
        if main is not None and main.restripes:  # re-striped from loader worker 0: no worker position
            saved = None
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
        self.batches += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        out = {"num_workers": self.num_workers, "next_worker": self.next_worker, "workers": list(self.workers)}
        if self.main is not None:
            out.update(batches=self.batches, main=json_state(self.main.state(self.batches * self.main.batch)))
            if self.main.restripes:  # a resume starts at worker 0 with no worker position: the same
                out.update(next_worker=0, workers=[None] * self.slots)  # state whenever it resumed
        return out

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
    restripes = is_main_positioned(stream) and bool(stream.restripes)  # type: ignore[attr-defined]
    if saved is not None and int(saved["num_workers"]) != num_workers and not restripes:
        raise ConfigError(
            f"data.num_workers = {num_workers}, but the checkpoint's train_data stream was read by "
            f"{saved['num_workers']} loader workers (each holds its own shard position); resume with "
            f"-S data.num_workers={saved['num_workers']}"
        )
    main = _main_position(stream, num_workers, per_rank_batch, saved)
    restripe = (int(saved.get("batches", 0)) * per_rank_batch if saved else 0, per_rank_batch) if restripes else None
    wrapped = SeededStream(stream, seed, rank, saved["workers"] if saved else None, sample_rngs, restripe)
    loader = DataLoader(
        wrapped,
        batch_size=per_rank_batch,
        num_workers=num_workers,
        collate_fn=StampedCollate(collate_fn, wrapped),
        generator=loader_generator(seed, rank),
        worker_init_fn=worker_init if num_workers else None,
        prefetch_factor=2 if num_workers else None,
    )
    return StreamBatches(loader, num_workers, saved, main)


class MainPosition(NamedTuple):
    """How :class:`StreamBatches` saves a :class:`MainPositioned` stream's state."""

    state: Callable[[int], Any]  # samples trained -> the library's state
    batch: int  # samples per batch handed out
    restripes: bool


def _main_position(
    stream: IterableDataset, num_workers: int, batch: int, saved: dict[str, Any] | None
) -> MainPosition | None:
    """For a :class:`MainPositioned` stream: position it here, in the training process, before the
    DataLoader copies it into its workers; what :class:`StreamBatches` needs to save its state."""
    if not is_main_positioned(stream):
        return None
    stream.start_at(saved["main"] if saved else None, num_workers, batch)  # type: ignore[attr-defined]

    def position(samples: int) -> Any:
        return stream.main_state_dict(samples, num_workers, batch)  # type: ignore[attr-defined]

    return MainPosition(position, batch, bool(stream.restripes))  # type: ignore[attr-defined]


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
