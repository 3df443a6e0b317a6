"""Put a staged directory in place as a run's newest checkpoint: the one way it is done.

A checkpoint is committed by three writers — the store's save, a fork from a parent run
(``convoy train --from``) and a fetch from the DVC remote on another machine — and each must
survive a power cut at any instant with either the old or the new checkpoint named by
``LATEST``, never a name whose directory, or whose files, are not on disk yet.  The order
(invariant 1 of docs/architecture.md):

1. every file of the stage durable (skipped when the writer already fsynced each file it wrote:
   the store's own writes, the fork's hard links and rewritten manifest),
2. the stage directory durable (its entries),
3. ``rename(stage, step-N)`` and the checkpoints directory durable (the rename),
4. only then ``LATEST`` rewritten atomically and durably.

What to do with a directory already at ``step-N`` is the writer's decision (the store keeps an
equal one or moves it aside, a fetch moves an invalid one aside, a fork keeps its own earlier
copy), taken before calling :func:`install`.
"""

from __future__ import annotations

import os
from pathlib import Path

from training.fsutil import atomic_write_bytes, fsync_dir
from training.paths import LATEST_FILE


def fsync_files(stage: Path) -> None:
    """Every regular file under ``stage`` durable (a download through a library that never
    fsyncs), then every directory below it."""
    for root, dirs, files in os.walk(stage):
        for name in files:
            fd = os.open(Path(root) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for name in dirs:
            fsync_dir(Path(root) / name)


def point_latest(final: Path) -> None:
    """``LATEST`` names ``final`` (a committed checkpoint directory), atomically and durably."""
    atomic_write_bytes(final.parent / LATEST_FILE, (final.name + "\n").encode())


def install(stage: Path, final: Path, *, files_synced: bool) -> None:
    """Rename ``stage`` to ``final`` (which must not exist) durably, then point ``LATEST`` at it
    (the order in the module docstring)."""
    if not files_synced:
        fsync_files(stage)
    fsync_dir(stage)
    os.rename(stage, final)
    fsync_dir(final.parent)
    point_latest(final)
