"""Fetch before promising: ``convoy validate`` (and ``convoy train``, before any run directory
exists) reads and collates the first training batch and one validation batch on the CPU.

Why: a dataset that raises in ``__getitem__``, a collate function that cannot stack what the
dataset returns, or a stream that cannot start would otherwise surface only in the first worker,
after a run directory, an MLflow run and a Prefect flow exist, and as a crash that is retried.
Here it is one line and exit 2.  The fetch goes through the same loader code the worker uses
(per-sample seeding included), in this process (no loader workers).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import default_collate

from training.config import ConfigError, RunConfig
from training.data import Cursor, LoaderSpec, validation_keys
from training.sample_rng import SeededSamples
from training.streams import is_stream, train_batches


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".rstrip(": ")


def fetch_first_batches(config: RunConfig, parts: Any) -> None:
    """Fetch rank 0's first micro-batch and the first validation batch; a ConfigError names
    which data failed and how."""
    tc = config.train
    spec = LoaderSpec(tc.batch_size, tc.seed, Cursor(), 0, tc.world_size, tc.grad_accum_steps)
    try:
        next(
            train_batches(
                parts.train_data,
                spec,
                num_workers=0,
                collate_fn=parts.collate_fn,
                saved_stream=None,
                resumed=False,
                sample_rngs=parts.sample_rngs,
            )
        )
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the task's data raises is reported as one line
        raise ConfigError(f"train_data: fetching the first batch failed: {_line(exc)}") from None
    val = parts.val_data
    if val is None or is_stream(val) or len(val) == 0:
        return
    n = min(tc.batch_size // tc.world_size, len(val))
    keys = validation_keys(tc.seed, list(range(n)))
    try:
        (parts.collate_fn or default_collate)(SeededSamples(val, parts.sample_rngs).__getitems__(keys))
    except Exception as exc:  # noqa: BLE001 - as above
        raise ConfigError(f"val_data: fetching the first batch failed: {_line(exc)}") from None
