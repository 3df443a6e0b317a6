"""Hugging Face ``datasets.IterableDataset`` (``.map`` augmentation included) as a convoy stream.

``datasets`` keeps the position itself, per loader worker: each worker iterates its own shards
(from ``get_worker_info()``) and its ``state_dict()``/``load_state_dict()`` are called in that
worker (:mod:`training.datapipe.streams` does it for every batch).  A ``.map`` function runs lazily as
each example is drawn, so augmentation drawn from the host generators in it is seeded per sample
and replays exactly after a resume.

Refused in one line: ``.shuffle(buffer_size=...)`` (the buffer's contents are not in the state,
so a resume would train other samples), and fewer shards than loader workers (a worker without
shards would end at once; convoy needs an endless stream: ``.repeat(None)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from training.config import ConfigError
from training.datapipe.streams import check_stream


class HFStream(IterableDataset):
    """``dataset`` (a ``datasets.IterableDataset``) with its own state protocol, in each worker."""

    def __init__(self, dataset: Any, num_workers: int | None = None) -> None:
        try:
            import datasets
        except ImportError:
            raise ConfigError("HFStream needs datasets: make install (the hf extra)") from None
        if not isinstance(dataset, datasets.IterableDataset):
            raise ConfigError(
                f"HFStream wraps a datasets.IterableDataset, not a {type(dataset).__qualname__}; "
                "make a Dataset a stream with .to_iterable_dataset(num_shards=...)"
            )
        check_stream(dataset, "train_data")  # the shuffle buffer
        if num_workers and dataset.num_shards < num_workers:
            raise ConfigError(
                f"train_data has {dataset.num_shards} shards for {num_workers} loader workers: a worker "
                f"without shards ends at once; use .to_iterable_dataset(num_shards={num_workers}) or more"
            )
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
