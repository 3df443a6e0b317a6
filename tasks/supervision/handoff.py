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

A worker killed while parked is **replaced at once** (issue 30, item 2): the watcher calls the
parking chunk's ``on_death`` (:mod:`tasks.supervision.replacement`), which reports the death as
the next chunk's attempt and starts the next attempt's worker there and then, so training goes
on while Prefect starts the next task; that task finds a :class:`Replacement` and records both
attempts (:meth:`Parking.take_replacement`).  Without it the replacement would wait for the next
task, its failure report and Prefect's retry: 1-2.4 s of bookkeeping before the fork.
The :class:`Parking` lives in the flow process (tasks are threads there), one per run, held by
the run's resources; pool mode never uses it.
The protocol around the boundary (what the worker waits for, what the flow acknowledges, what
retention keeps): :mod:`training.chunk_boundary`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tasks.supervision.worker_handle import WorkerHandle
from training.tracking.attempts import AttemptId
from training.tracking.failure_record import FailureDetails

log = logging.getLogger("convoy.handoff")

#: How often the parked worker's watcher checks whether a task adopted it (a death wakes it at once).
_ADOPTED_POLL_S = 0.05


@dataclass(frozen=True)
class Replacement:
    """A parked worker that died before a task adopted it, and the worker started in its place.

    ``dead``/``failure``: the next chunk's attempt the dead worker was (its ``failure`` event is
    written); ``worker``/``attempt``: the attempt started in its place (its ``attempt_started``
    is written), training already; ``source``: where that worker came from (forked, standby...)."""

    dead: WorkerHandle
    dead_attempt: AttemptId
    kind: str
    message: str
    failure: FailureDetails
    worker: WorkerHandle
    attempt: AttemptId
    source: str


#: What the parking chunk does when its parked worker dies unadopted: a replacement, or None
#: (the next chunk's task then adopts the dead worker and reports it, as before).
OnDeath = Callable[[WorkerHandle], Replacement | None]


@dataclass
class Parked:
    """A worker between two chunk tasks, with the command it runs and the thread watching it."""

    worker: WorkerHandle
    cmd: list[str]
    on_death: OnDeath | None = None
    #: Where ``on_death`` runs: the parking's long-lived thread (a worker spawned there gets its
    #: parent-death signal when *that thread* ends, not when this watcher does).
    runner: ThreadPoolExecutor | None = None
    adopted: threading.Event = field(default_factory=threading.Event)
    #: Set by the watcher when it replaced the dead worker (read after the watcher has ended).
    replacement: Replacement | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        #: Whether the watcher took ``on_death`` (a replacement is being made, or was).
        self.replacing = False
        self.watcher = threading.Thread(target=self._watch, daemon=True, name="convoy-parking")
        self.watcher.start()

    def _watch(self) -> None:
        """Until a task adopts it: wait for its death (noted in ``worker.died_at``), then replace it."""
        try:
            while not self.adopted.is_set():
                if self.worker.wait_exit(_ADOPTED_POLL_S):
                    self._replace()
                    return
        except Exception:  # noqa: BLE001 - a dead watcher thread would say nothing; the task adopts as before
            log.exception("watching the parked worker pid %d failed", self.worker.pid)

    def _replace(self) -> None:
        """It died unadopted: ``on_death`` unless a task disarmed it first (:meth:`disarm`)."""
        with self._lock:
            on_death, self.replacing = self.on_death, self.on_death is not None
        if on_death is None:
            log.info("parked worker pid %d died; a task came first (or no successor): it reports it", self.worker.pid)
            return
        try:
            dead = self.worker
            self.replacement = self.runner.submit(on_death, dead).result() if self.runner else on_death(dead)
        except Exception:  # noqa: BLE001 - the next task adopts the dead worker: recovery as before
            log.exception("replacing the parked worker pid %d failed", self.worker.pid)

    def disarm(self) -> bool:
        """No replacement from now on (the next task is here: a later death is its to report).
        True when the watcher has begun one already (then it is, or will be, :attr:`replacement`)."""
        with self._lock:
            self.on_death = None
            return self.replacing

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
        #: The one thread replacements are started from, alive as long as the run (see :class:`Parked`).
        self._runner: ThreadPoolExecutor | None = None

    def _take(self) -> Parked | None:
        with self._lock:
            parked, self._parked = self._parked, None
        return parked

    def park(self, worker: WorkerHandle, cmd: list[str], on_death: OnDeath | None = None) -> None:
        """Keep a running worker for the next chunk task, watched until it is adopted; a death
        before then is passed to ``on_death`` (which may start its replacement at once)."""
        with self._lock:
            if on_death is not None and self._runner is None:
                self._runner = ThreadPoolExecutor(1, thread_name_prefix="convoy-replacer")
        parked = Parked(worker, list(cmd), on_death, self._runner)
        with self._lock:
            old, self._parked = self._parked, parked
        if old is not None and old.worker is not worker:
            old.hand_over().stop(5.0)

    def take_replacement(self) -> Replacement | None:
        """The replacement of a parked worker that died unadopted, if its watcher made one: it
        takes the dead worker's place in the parking (adopted by the next :meth:`adopt`, watched
        until then, never replaced again), and the record is returned for the chunk task to
        account for both attempts.  None otherwise, and the parked worker is disarmed: the task
        calling this adopts it next, and a death in between is that task's to report (two
        accounts of one death would number its attempts twice)."""
        with self._lock:
            parked = self._parked
        if parked is None or not parked.disarm():  # alive (or no successor): the task adopts it as it is
            return None
        parked.watcher.join()  # it died and the watcher is replacing it, or has
        replacement = parked.replacement
        if replacement is None:
            return None
        successor = Parked(replacement.worker, parked.cmd)
        with self._lock:
            if self._parked is not parked:  # released meanwhile (the flow ends)
                successor.hand_over().stop(5.0)
                return None
            self._parked = successor
        return replacement

    def adopt(self, cmd: list[str]) -> WorkerHandle | None:
        """The parked worker if it runs ``cmd`` (else it is stopped and None returned)."""
        parked = self._take()
        if parked is None:
            return None
        worker = parked.hand_over()
        if parked.replacement is not None:  # not taken (:meth:`take_replacement`): nobody accounts for it
            parked.replacement.worker.stop(5.0)
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

    def close(self) -> None:
        """The run is over: the replacer thread ends (a worker it spawned was stopped by
        :meth:`release` first; it would get its parent-death signal now)."""
        with self._lock:
            runner, self._runner = self._runner, None
        if runner is not None:
            runner.shutdown(wait=True)

    def release(self, grace_s: float = 10.0) -> bool:
        """Stop the parked worker, if any (the flow ends or fails), and a replacement its watcher
        started.  True if there was one."""
        parked = self._take()
        if parked is None:
            return False
        parked.hand_over().stop(grace_s)
        if parked.replacement is not None:
            parked.replacement.worker.stop(grace_s)
        return True
