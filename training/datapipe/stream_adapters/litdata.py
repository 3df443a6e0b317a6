"""Lightning ``litdata.StreamingDataset`` (0.2.76) as a convoy stream, resumed exactly.

litdata's position is ``state_dict(num_samples_yielded, num_workers, batch_size)``, computed in
the training process from the samples the DataLoader yielded (it raises inside a loader worker);
``load_state_dict(state)`` is given back in the training process before the DataLoader starts,
and each loader worker then continues its own chunks (``_replay_sampling``: batches dealt
round-robin from worker 0).  convoy's :class:`training.datapipe.streams.StreamBatches` counts the batches
it handed to training, so the state describes exactly what was trained (batches prefetched but not
trained are read again after a resume), and it hands the workers' batches out in the saved
round-robin order.

The adapter also tells the dataset the DataLoader's batch size and worker count (what litdata's
own ``StreamingDataLoader`` does): without them litdata sees another "topology" on resume and
re-stripes the rest of the epoch over the workers, in another order than the uninterrupted run.

One epoch: a litdata stream ends with its epoch, and convoy refuses a stream that ends (one
line).  A resume with another ``data.num_workers`` or world size is refused by convoy: each
loader worker's samples are seeded by their number in its shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from training.config import ConfigError


class LitDataStream(IterableDataset):
    """``dataset`` (a ``litdata.StreamingDataset``) positioned in the training process
    (:class:`training.datapipe.streams.MainPositioned`)."""

    restripes = False  # each loader worker continues its own chunks after a resume

    def __init__(self, dataset: Any) -> None:
        try:
            from litdata import StreamingDataset
        except ImportError:
            raise ConfigError("LitDataStream needs litdata: make install (the streams extra)") from None
        if not isinstance(dataset, StreamingDataset):
            raise ConfigError(
                f"LitDataStream wraps a litdata.StreamingDataset, not a {type(dataset).__qualname__}; "
                "combined or parallel litdata datasets are not supported: train on one StreamingDataset"
            )
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)  # litdata reads the loader worker from get_worker_info() itself

    def start_at(self, state: dict[str, Any] | None, num_workers: int, batch_size: int) -> None:
        """Tell litdata the DataLoader's shape and give it its saved state (training process)."""
        self.dataset.set_batch_size(batch_size)
        self.dataset.set_num_workers(max(num_workers, 1))  # litdata counts the training process as one worker
        if state is not None:
            self.dataset.load_state_dict(_from_json(state))

    def main_state_dict(self, samples: int, num_workers: int, batch_size: int) -> dict[str, Any]:
        """litdata's state after this rank's DataLoader yielded ``samples`` samples."""
        return dict(self.dataset.state_dict(samples, max(num_workers, 1), batch_size))


def _from_json(state: dict[str, Any]) -> dict[str, Any]:
    """The state as litdata wrote it: JSON turned its ``region_of_interest`` tuples into lists."""
    out = dict(state)
    if out.get("region_of_interest") is not None:
        out["region_of_interest"] = [tuple(r) for r in out["region_of_interest"]]
    return out
