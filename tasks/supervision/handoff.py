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
next task: about a second) no task watches the worker, so the parking does: a thread waits on
its pidfd and notes the moment it died, which the adopting task reports as the detection.
The :class:`Parking` lives in the flow process (tasks are threads there), one per run, held by
the run's resources; pool mode never uses it.
The protocol around the boundary (what the worker waits for, what the flow acknowledges, what
retention keeps): :mod:`training.chunk_boundary`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

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


class Parking:
    """The one place a run's worker waits between two chunk tasks (at most one worker at a time).

    One per run, held by the flow's :class:`tasks.run_resources.RunResources` and handed to each
    chunk attempt explicitly: the parking chunk and the adopting one share this object, not a
    process-wide registry.  Thread-safe: chunk tasks are threads of the flow process."""

    def __init__(self) -> None:
        self._parked: Parked | None = None
        self._lock = threading.Lock()

    def _take(self) -> Parked | None:
        with self._lock:
            parked, self._parked = self._parked, None
        return parked

    def park(self, worker: WorkerHandle, cmd: list[str]) -> None:
        """Keep a running worker for the next chunk task, watched until it is adopted."""
        parked = Parked(worker, list(cmd))
        with self._lock:
            old, self._parked = self._parked, parked
        if old is not None and old.worker is not worker:
            old.hand_over().stop(5.0)

    def adopt(self, cmd: list[str]) -> WorkerHandle | None:
        """The parked worker if it runs ``cmd`` (else it is stopped and None returned)."""
        parked = self._take()
        if parked is None:
            return None
        worker = parked.hand_over()
        if parked.cmd != list(cmd):
            worker.stop(5.0)
            return None
        return worker

    def holds_worker(self) -> bool:
        """Whether a worker is parked, alive or not (one that finished the run before the next
        chunk task came is still that task's to adopt)."""
        with self._lock:
            return self._parked is not None

    def parked_pid(self) -> int | None:
        with self._lock:
            parked = self._parked
        return parked.worker.pid if parked is not None and parked.worker.poll() is None else None

    def release(self, grace_s: float = 10.0) -> bool:
        """Stop the parked worker, if any (the flow ends or fails).  True if there was one."""
        parked = self._take()
        if parked is None:
            return False
        parked.hand_over().stop(grace_s)
        return True
