"""Fetch before promising: ``convoy validate`` (and ``convoy train``, before any run directory
exists) reads and collates the first training batch and one validation batch on the CPU.

Why: a dataset that raises in ``__getitem__``, a collate function that cannot stack what the
dataset returns, or a stream that cannot start would otherwise surface only in the first worker,
after a run directory, an MLflow run and a Prefect flow exist, and as a crash that is retried.
Here it is one line and exit 2.  The fetch goes through the same loader code the worker uses
(per-sample seeding included), in this process (no loader workers).

The same holds for a stream resumed on another layout (:func:`check_stream_resume`): its saved
positions are per rank and loader worker, so another world size or ``data.num_workers`` would
train other samples; it is refused here, before the flow, the run directory or MLflow is touched,
not by every worker of a retried chunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.data import default_collate

from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.verify import load_checkpoint, parse_step
from training.config import ConfigError, RunConfig
from training.datapipe.data import Cursor, LoaderSpec, validation_keys
from training.datapipe.sample_rng import SeededSamples
from training.datapipe.stream_position import SavedLayout, check_resume, is_global
from training.datapipe.streams import is_main_positioned, is_stream, train_batches
from training.paths import RunPaths


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".rstrip(": ")


def fetch_first_batches(config: RunConfig, parts: Any, resume_dir: Path | None = None) -> None:
    """Fetch rank 0's first micro-batch and the first validation batch; a ConfigError names
    which data failed and how; a stream first checks that its saved position in ``resume_dir``
    (the directory that trains ``config``, given by the caller) fits this layout."""
    if resume_dir is not None:
        check_stream_resume(resume_dir, config, parts.train_data)
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


def newest_stream_layout(run_dir: Path) -> SavedLayout | None:
    """How the stream of the newest checkpoint that verifies was read (the one a resume takes);
    None without checkpoints or for map-style data.  Reads only; records nothing."""
    root = RunPaths(run_dir).checkpoints
    if not root.is_dir():
        return None
    found = ((parse_step(p.name), p) for p in root.iterdir() if p.is_dir())
    for step, path in sorted(((s, p) for s, p in found if s is not None), reverse=True):
        try:
            checkpoint, parts = load_checkpoint(path, None, None)
        except CheckpointRejected:
            continue  # the resume passes it over too
        stream = (parts.get("rank-0") or {}).get("stream")
        world = int(checkpoint.manifest.get("world_size", 1))
        return SavedLayout.of(step, world, stream) if isinstance(stream, dict) else None
    return None


def check_stream_resume(run_dir: Path, config: RunConfig, train_data: Any) -> None:
    """Refuse (one line) resuming the run ``config`` trains when its stream was saved by another
    world size or ``data.num_workers`` (:func:`training.datapipe.stream_position.check_resume`)."""
    if not is_stream(train_data):
        return
    layout = newest_stream_layout(run_dir)
    if layout is not None:
        restripes = is_main_positioned(train_data) and bool(train_data.restripes)
        check_resume(layout, config.train.world_size, config.data.num_workers, is_global(train_data), restripes)
