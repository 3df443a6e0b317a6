"""Durable file-system primitives shared by the checkpoint store, heartbeat and run directory.

A rename is only durable once the parent directory is fsynced; these helpers make that the
default so no caller forgets it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def file_size(path: Path) -> int:
    """Its size in bytes; 0 when it does not exist (yet)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary_sibling(path: Path) -> Path:
    """A temporary name no other writer uses: per process *and* per thread, since two threads
    of one process (the worker's main thread and its heartbeat thread) may write one file at
    once, and a shared name lets one thread rename the other's half-written file away."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_native_id()}.tmp")


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Write via a temporary sibling + rename, so readers see the old or the new file, never half."""
    tmp = _temporary_sibling(path)
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_replace(path: Path, durable: bool = True) -> Iterator[Path]:
    """For writers that need a path (a plot, a safetensors file, a symbolic link): yield a
    temporary sibling to create, which replaces ``path`` when the block ends without an error
    (removed otherwise), so readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(path)
    tmp.unlink(missing_ok=True)
    try:
        yield tmp
        if durable and tmp.is_file() and not tmp.is_symlink():
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any, durable: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), durable)


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
