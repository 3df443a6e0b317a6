"""The run directory's one-writer locks (invariant 8): the flow's ``.lock``, the worker's lease.

Both are OS file locks (``filelock``): the OS drops one when its holder dies, however it dies, so
a crash never leaves a stale lock that someone must remove by hand.  Beside each lock its holder
writes an owner note, ``pid N on HOST since TIME``, so that the refusal of a second writer names
the first one and ``convoy status`` can tell whether the flow holding a run is still alive
(``training.tracking.progress.flow_holder`` reads the note's first four words).

What is refused, and in which words, is the caller's: each lock raises its own ``ConfigError``
(one line, exit non-zero, never retried) from the holder's note.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from training.fsutil import atomic_write_bytes
from training.paths import owner_note

#: What a refusal names when the holder left no note (killed between locking and writing it).
UNKNOWN_HOLDER = "a process that did not say who it is"


def holder(lock_path: Path) -> str:
    """The owner note of ``lock_path``'s holder, or :data:`UNKNOWN_HOLDER`."""
    try:
        return owner_note(lock_path).read_text().strip() or UNKNOWN_HOLDER
    except OSError:
        return UNKNOWN_HOLDER


def take_lock(lock_path: Path, wait_s: float, refuse: Callable[[str], Exception]) -> FileLock:
    """Hold ``lock_path`` (waiting at most ``wait_s``; 0 = refuse at once) and write the owner
    note; a lock held past the wait raises ``refuse(holder)``.  The caller keeps the returned lock
    for as long as it writes (dropping it releases the lock)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path), timeout=wait_s)
    try:
        lock.acquire()
    except Timeout:
        raise refuse(holder(lock_path)) from None
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    note = f"pid {os.getpid()} on {os.uname().nodename} since {since}\n"
    atomic_write_bytes(owner_note(lock_path), note.encode(), durable=False)  # never read half-written
    return lock


@contextlib.contextmanager
def holding(lock_path: Path, refuse: Callable[[str], Exception]) -> Iterator[FileLock]:
    """:func:`take_lock` without waiting, for a ``with`` block: on leaving it the owner note is
    removed (no note outlives its holder on a clean exit) and the lock released."""
    lock = take_lock(lock_path, 0, refuse)
    try:
        yield lock
    finally:
        with contextlib.suppress(OSError):
            owner_note(lock_path).unlink()
        lock.release()
