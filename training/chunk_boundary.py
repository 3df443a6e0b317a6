"""The chunk-boundary hand-off protocol of a pipelined run, in one place.

Why it exists: restarting the worker at every chunk boundary costs a Python start, ``import
torch``, the model build and a verified restore (~5 s per chunk on the bench model).  With
``orchestration.pipeline`` (local mode) one worker trains through every boundary while the flow
still treats each chunk as its own Prefect task, with its own verified artifact and its own
retries.  Four parties follow this protocol; each calls only the function named for it here.

Boundary ``b`` is a step with ``b % chunk_steps == 0`` and ``0 < b < total_steps``: chunk ``k``
ends there and chunk ``k + 1`` starts.

1. **Worker** (``training.worker``, ``--pipelined``).  Trains to the run's last step, committing a
   checkpoint at every boundary.  Before it commits boundary ``b`` (or its final step) it calls
   :func:`wait_for_previous_boundary`: it blocks until the flow has acknowledged the previous
   boundary ``b - chunk_steps``.  So it is never more than one chunk ahead of the flow.  A worker
   that resumed at or after that boundary did not produce it and does not wait.
2. **Chunk task** (``tasks.supervision.supervisor.WorkerAttempt`` with ``AttemptSpec.boundary_step``).  Chunk
   ``k``'s attempt ends as soon as :func:`boundary_committed` says boundary ``b`` is committed;
   the worker keeps training and is *parked* in the flow process (``tasks.supervision.handoff``) for chunk
   ``k + 1``'s task to adopt.  The task then verifies checkpoint ``b``: it is the chunk's artifact.
   :func:`boundary_step` says which step that is (none for the last chunk, which ends with the
   worker's exit, and none without pipelining).
3. **Flow** (``flows.train``).  After chunk ``k``'s task returns, it versions checkpoint ``b``
   (DVC hard-links it into its stage) and then calls :func:`acknowledge` once, which waits until
   the checkpoint is staged before writing the acknowledgement (``chunk-ack.json``).
4. **Retention** (``CheckpointStore.apply_retention``).  While the newest verified checkpoint is
   not itself a boundary, :func:`boundary_to_keep` keeps the newest boundary checkpoint.  With at
   most one unacknowledged boundary (rule 1) that is exactly the one the flow may still be
   verifying and staging, so retention never deletes a checkpoint the flow has yet to version.

Failures are unchanged by all this: the task watching the worker stops its group and raises, and
the retry starts a fresh (unpipelined-looking) worker from the newest verified checkpoint.  In
normal runs the worker's wait is zero; with DVC on, a push slower than a chunk throttles training
to it instead of losing a chunk's version.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from training.fsutil import atomic_write_json, read_json
from training.paths import RunPaths

__all__ = [
    "acknowledge",
    "acknowledged_step",
    "boundary_committed",
    "boundary_step",
    "boundary_to_keep",
    "previous_boundary",
    "wait_for_previous_boundary",
]


# ---------------------------------------------------------------------------- 1. worker
def previous_boundary(step: int, chunk_steps: int) -> int:
    """The boundary before the one a save at ``step`` commits or passes (0: the run's start)."""
    return (step - 1) // chunk_steps * chunk_steps


def wait_for_previous_boundary(
    run_dir: str | Path,
    step: int,
    chunk_steps: int,
    resumed_step: int,
    stop: Callable[[], bool],
    poll_s: float = 0.01,
) -> float:
    """Block until the flow acknowledged the boundary before ``step`` (rule 1).

    No wait when this worker did not produce that boundary (it resumed at or after it), or when
    ``stop()`` turns true (SIGTERM: the emergency save must not wait for the flow).  Returns the
    seconds waited."""
    boundary = previous_boundary(step, chunk_steps)
    if boundary <= resumed_step:
        return 0.0
    t0 = time.monotonic()
    while acknowledged_step(run_dir) < boundary and not stop():
        time.sleep(poll_s)
    return time.monotonic() - t0


# ---------------------------------------------------------------------------- 2. chunk task
def boundary_step(end_step: int, total_steps: int, pipelined: bool) -> int | None:
    """Where a chunk attempt ending at ``end_step`` hands its worker over (rule 2), or None: the
    attempt ends with the worker's exit (no pipelining, or the run's last chunk)."""
    return end_step if pipelined and end_step < total_steps else None


def boundary_committed(run_dir: str | Path, step: int) -> bool:
    """True once the checkpoint of boundary ``step`` is committed (its manifest is the commit)."""
    return (RunPaths(run_dir).checkpoint(step) / "manifest.json").exists()


# ---------------------------------------------------------------------------- 3. flow
def acknowledge(run_dir: str | Path, step: int, staged: threading.Event | None = None, timeout_s: float = 0) -> None:
    """The flow is done with boundary ``step`` (rule 3): once ``staged`` is set (its DVC version
    holds the checkpoint; None when versioning is off), let the worker commit the next one."""
    if staged is not None:
        staged.wait(timeout=timeout_s)
    atomic_write_json(RunPaths(run_dir).ack, {"step": step, "time": time.time()}, durable=False)


def acknowledged_step(run_dir: str | Path) -> int:
    """The newest acknowledged boundary, -1 when none."""
    try:
        return int(read_json(RunPaths(run_dir).ack)["step"])
    except (FileNotFoundError, ValueError, KeyError):
        return -1


# ---------------------------------------------------------------------------- 4. retention
def boundary_to_keep(newest_step: int, older_steps: Iterable[int], chunk_steps: int) -> int | None:
    """The boundary checkpoint retention must keep besides the newest verified one (rule 4):
    the newest boundary among ``older_steps`` while ``newest_step`` is not a boundary itself;
    None when nothing extra is kept (no pipelining: ``chunk_steps`` 0)."""
    if not chunk_steps or newest_step % chunk_steps == 0:
        return None
    return max((s for s in older_steps if s % chunk_steps == 0), default=None)
