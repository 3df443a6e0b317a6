"""MosaicML ``streaming.StreamingDataset`` (mosaicml-streaming 0.13.0) as a convoy stream.

MosaicML's position is ``state_dict(num_samples, from_beginning)``: the number of samples the
whole world trained in the epoch, computed in the training process (its ``StreamingDataLoader``
counts batches there); ``load_state_dict(state)`` is given back in the training process before
the DataLoader starts (it goes to shared memory, where the loader workers read it).  After a
resume MosaicML drops the samples trained from its one global order and deals the rest out
again from loader worker 0 — so the adapter says ``restripes``: convoy starts the round-robin at
worker 0 and seeds each sample by its number in the rank's stream, not in a worker's shard.
That also makes a resume with another ``data.num_workers`` exact (the global order and the seeds
do not depend on it).

What it needs: the dataset's ``batch_size`` is the per-rank micro-batch (MosaicML partitions its
order by it; another value is refused in one line), and the run fits in one epoch (a MosaicML
stream ends with its epoch and convoy refuses a stream that ends; ``epoch_size`` makes an epoch as
long as needed).  Killed processes leave MosaicML's shared memory behind (/dev/shm): a new process
takes the next free prefix, so a stale resume state is never read, but the files stay until
``streaming.base.util.clean_stale_shared_memory()`` runs with no other MosaicML process alive.

``import streaming`` imports ``streaming.vision``, which needs torchvision; with CPU-only torch
and no matching torchvision build, :func:`streaming_base` imports ``streaming.base`` (the dataset
and the writers) without the vision, text and multimodal subpackages.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from torch.utils.data import IterableDataset

from training.config import ConfigError


def streaming_base() -> ModuleType:
    """MosaicML's ``streaming.base`` (``StreamingDataset``, ``MDSWriter``, ...), importable
    without torchvision (module docstring)."""
    if "streaming" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        spec = importlib.util.find_spec("streaming")
        if spec is None or spec.submodule_search_locations is None:
            raise ConfigError("the MosaicML adapter needs mosaicml-streaming: make install (the streams extra)")
        package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("streaming", None, is_package=True))
        package.__path__ = list(spec.submodule_search_locations)  # its __init__ (vision) is not run
        sys.modules["streaming"] = package
    try:
        return importlib.import_module("streaming.base")
    except ImportError as exc:
        raise ConfigError(
            f"the MosaicML adapter needs mosaicml-streaming: make install (the streams extra) ({exc})"
        ) from None


class MosaicStream(IterableDataset):
    """``dataset`` (a MosaicML ``StreamingDataset``) positioned in the training process
    (:class:`training.datapipe.streams.MainPositioned`)."""

    restripes = True  # the rest of the global order is dealt out again from loader worker 0
    #: Threads MosaicML runs in the process that iterates it (the training process with
    #: num_workers 0): its shard download/prepare pool.  Audited for invariant 12: they shuffle
    #: with their own ``np.random.default_rng(seed)``, never the global generators.
    convoy_threads = ("ThreadPoolExecutor-",)

    def __init__(self, dataset: Any) -> None:
        if not isinstance(dataset, streaming_base().StreamingDataset):
            raise ConfigError(f"MosaicStream wraps a MosaicML StreamingDataset, not a {type(dataset).__qualname__}")
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)  # MosaicML reads the rank and loader worker itself

    def start_at(self, state: dict[str, Any] | None, num_workers: int, batch_size: int) -> None:
        """Check the partition's batch size and give MosaicML its saved state (training process)."""
        if self.dataset.batch_size != batch_size:
            raise ConfigError(
                f"the MosaicML StreamingDataset has batch_size={self.dataset.batch_size}, but each rank's "
                f"micro-batch is {batch_size} samples: MosaicML partitions its order by it; build it with "
                f"batch_size={batch_size} (train.batch_size / ranks / accumulation)"
            )
        if state is not None:
            self.dataset.load_state_dict(state)

    def main_state_dict(self, samples: int, num_workers: int, batch_size: int) -> dict[str, Any]:
        """MosaicML's state after this rank trained ``samples`` samples (the world trained
        ``samples * world size``: every rank trains as many), counted from the epoch's start."""
        from training.datapipe.streams import rank_and_world

        return dict(self.dataset.state_dict(samples * rank_and_world()[1], True))
