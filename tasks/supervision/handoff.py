"""Hand a running worker from one chunk task to the next (``orchestration.pipeline``).

Why: restarting the worker at every chunk boundary costs a Python start, ``import torch``, the
model build and a verified restore — measured ~5 s per chunk on the bench model, 9% of a 60 s
chunk.  With pipelining, the worker is started once with ``--until-step`` = the run's end and
commits a checkpoint at every chunk boundary; chunk k's task succeeds as soon as that boundary
is committed and leaves the worker running here; chunk k+1's task adopts it.  Training never
pauses for Prefect's bookkeeping.

Failures are unchanged: the task watching the worker stops its whole group and raises, and the
retry starts a fresh worker from the newest verified checkpoint.  A worker that died between two
tasks is adopted dead and reported as the next chunk's failure (that is where its steps were).
Between the two tasks (the flow versions the boundary, refreshes the audit, Prefect starts the
next task: about a second) no task watches the worker, so the registry does: a thread waits on
its pidfd and notes the moment it died, which the adopting task reports as the detection.
The registry lives in the flow process (tasks are threads there); pool mode never uses it.
The protocol around the boundary (what the worker waits for, what the flow acknowledges, what
retention keeps): :mod:`training.chunk_boundary`.
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tasks.supervision.worker_handle import WorkerHandle

#: How often the parked worker's watcher checks whether a task adopted it (a death wakes it at once).
_ADOPTED_POLL_S = 0.05


@dataclass
class Parked:
    """A worker between two chunk tasks, with the command it runs and the thread watching it."""

    worker: WorkerHandle
    cmd: list[str]
    adopted: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        """Until a task adopts it: wait for its death (noted in ``worker.died_at``)."""
        while not self.adopted.is_set():
            if self.worker.wait_exit(_ADOPTED_POLL_S):
                return

    def hand_over(self) -> WorkerHandle:
        """Stop watching; the adopting task watches from now on."""
        self.adopted.set()
        self.watcher.join()
        return self.worker


_LIVE: dict[str, Parked] = {}
_LOCK = threading.Lock()


def _key(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve())


def park(run_dir: str | Path, worker: WorkerHandle, cmd: list[str]) -> None:
    """Keep a running worker for the next chunk task of this run, watched until it is adopted."""
    parked = Parked(worker, list(cmd))
    with _LOCK:
        old = _LIVE.pop(_key(run_dir), None)
        _LIVE[_key(run_dir)] = parked
    if old is not None and old.worker is not worker:
        old.hand_over().stop(5.0)


def adopt(run_dir: str | Path, cmd: list[str]) -> WorkerHandle | None:
    """The parked worker of this run if it runs ``cmd`` (else it is stopped and None returned)."""
    with _LOCK:
        parked = _LIVE.pop(_key(run_dir), None)
    if parked is None:
        return None
    worker = parked.hand_over()
    if parked.cmd != list(cmd):
        worker.stop(5.0)
        return None
    return worker


def parked_pid(run_dir: str | Path) -> int | None:
    with _LOCK:
        parked = _LIVE.get(_key(run_dir))
    return parked.worker.pid if parked is not None and parked.worker.poll() is None else None


def release(run_dir: str | Path, grace_s: float = 10.0) -> bool:
    """Stop the parked worker of this run, if any (the flow ends or fails).  True if one was."""
    with _LOCK:
        parked = _LIVE.pop(_key(run_dir), None)
    if parked is None:
        return False
    parked.hand_over().stop(grace_s)
    return True


@atexit.register
def _release_all() -> None:
    with _LOCK:
        parked = list(_LIVE.values())
        _LIVE.clear()
    for p in parked:
        p.hand_over().stop(5.0)
