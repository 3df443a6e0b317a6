"""A warm standby worker per run (``orchestration.standby``): the restart path without a start-up.

Why: after a worker dies, a fresh one pays for a Python start, ``import torch``, the task build
and the tracking clients (measured ~3-5 s on the example) before it restores a few milliseconds of
checkpoint.  A standby has paid all of that while the worker trained: it is
``python -m training.worker --run-dir D --standby``, built and waiting on its stdin.  When the
supervisor needs a worker it takes the standby instead of spawning one, writes the order line
(``{"until_step": N, "pipelined": bool}``) and from then on watches it like any worker it
started; a new standby is started behind it.  The standby takes the run's lease, restores the
newest verified checkpoint and trains exactly as a fresh worker would (same build, same restore),
so resumes stay bitwise exact.

Lifetime: one standby per run in the flow process (chunk tasks are threads there, like
:mod:`tasks.supervision.handoff`), in the run's :class:`StandbySlot`.  Its stdin is a pipe from
this process: if the flow dies the pipe closes and the standby, still waiting, exits (the
parent-death signal covers it too); when the flow ends :meth:`StandbySlot.release` closes it.
Single process runs only: a multi-rank worker is a torchrun group whose rendezvous is part of its
start, so a spare group would have to join the live one's rendezvous; not attempted (``standby``
is ignored for more than one rank, said in the log).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tasks.supervision.worker_handle import WorkerHandle
from training.events import StandbyOrder
from training.paths import RunPaths

#: Starts ``cmd`` with its output appended to ``log_path`` and stdin a pipe; returns the worker
#: (its ``offset``: where its output starts, read from there once it is called).
StartFn = Callable[[list[str], Path], WorkerHandle]


def standby_command(run_dir: str | Path) -> list[str]:
    return [sys.executable, "-m", "training.worker", "--run-dir", str(Path(run_dir).resolve()), "--standby"]


class StandbySlot:
    """The run's one warm standby worker (or none), held by the run's resources and handed to each
    chunk attempt explicitly.  Thread-safe: chunk tasks are threads of the flow process."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self._standby: WorkerHandle | None = None
        self._lock = threading.Lock()

    def _take(self) -> WorkerHandle | None:
        with self._lock:
            standby, self._standby = self._standby, None
        return standby

    def ensure(self, start: StartFn) -> WorkerHandle:
        """The run's standby; started with ``start(cmd, log_path)`` if there is none alive."""
        with self._lock:
            current = self._standby
        if current is not None and current.poll() is None:
            return current
        paths = RunPaths(self.run_dir)
        n = len(list(paths.logs.glob("standby-*.log"))) + 1
        standby = start(standby_command(self.run_dir), paths.standby_log(n))
        with self._lock:
            old, self._standby = self._standby, standby
        if old is not None:
            old.stop(2.0)
        return standby

    def take(self, order: StandbyOrder) -> WorkerHandle | None:
        """Hand the standby its order and give it to the caller to watch; None if there is no
        standby alive (it died, or was never started): the caller spawns a worker as usual."""
        standby = self._take()
        if standby is None:
            return None
        stdin = standby.proc.stdin
        if standby.poll() is not None or stdin is None:
            standby.stop(1.0)
            return None
        try:
            stdin.write(order.as_line().encode())
            stdin.flush()
            stdin.close()
        except OSError:  # it died between the poll and the write
            standby.stop(1.0)
            return None
        return standby

    def release(self, grace_s: float = 2.0) -> bool:
        """Stop the standby (the flow ends).  True if there was one."""
        standby = self._take()
        if standby is None:
            return False
        _stop(standby, grace_s)
        return True

    def pid(self) -> int | None:
        with self._lock:
            standby = self._standby
        return standby.pid if standby is not None and standby.poll() is None else None


def _stop(standby: WorkerHandle, grace_s: float) -> None:
    if standby.proc.stdin is not None:
        with contextlib.suppress(OSError):
            standby.proc.stdin.close()  # end of input: a waiting standby exits by itself
    try:
        standby.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    standby.stop(grace_s)
