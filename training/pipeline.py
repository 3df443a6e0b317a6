"""Flow control between a pipelined worker and the chunk tasks that watch it.

A pipelined worker (``--pipelined``) trains through chunk boundaries; chunk k's task ends when
boundary k is committed and verified, and the flow then *acknowledges* it here (after DVC has
hard-linked it to its stage, when versioning is on).  Before the worker commits boundary k+1 it
waits for that acknowledgement, so it never runs more than one chunk ahead of the flow.  That
bound is what makes retention safe: the newest boundary checkpoint is kept
(``CheckpointStore.boundary_every``), and with at most one unacknowledged boundary that is the
one the flow has yet to verify and stage.  In normal runs (chunks of minutes, a flow that
answers in well under a second) the wait is zero; with DVC on, a push slower than a chunk
throttles training to it rather than losing a chunk's version.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from training.fsutil import atomic_write_json, read_json
from training.paths import ACK_FILE, RunPaths  # noqa: F401 - ACK_FILE re-exported


def acknowledge_chunk(run_dir: str | Path, step: int) -> None:
    """The flow verified the boundary checkpoint at ``step``."""
    atomic_write_json(RunPaths(run_dir).ack, {"step": step, "time": time.time()}, durable=False)


def acknowledged_step(run_dir: str | Path) -> int:
    try:
        return int(read_json(RunPaths(run_dir).ack)["step"])
    except (FileNotFoundError, ValueError, KeyError):
        return -1


def wait_for_ack(
    run_dir: str | Path, previous_boundary: int, resumed_step: int, stop: Callable[[], bool], poll_s: float = 0.01
) -> float:
    """Block until ``previous_boundary`` is acknowledged (no wait if this worker did not produce
    it: it resumed at or after it).  ``stop()`` true (e.g. SIGTERM) ends the wait.  Returns the
    seconds waited."""
    if previous_boundary <= resumed_step:
        return 0.0
    t0 = time.monotonic()
    while acknowledged_step(run_dir) < previous_boundary and not stop():
        time.sleep(poll_s)
    return time.monotonic() - t0
