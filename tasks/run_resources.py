"""What lives across the chunk tasks of one run, in one object the flow holds and passes on.

A flow run trains its chunks as Prefect tasks in its own process (threads), and nine things
outlive a single chunk task: the run's tracker, which opens and ends each attempt's run in the
tracking backend (:func:`tasks.records.tracker.tracker_for`), the follower that sends the
worker's step metrics there (:class:`tasks.records.tracker.MetricFollower`), the run's checkpoint
store with its verdicts (each unchanged checkpoint hashed once,
:mod:`training.checkpointing.verified`), the pipelined worker parked at a chunk boundary for the
next task (:class:`tasks.supervision.handoff.Parking`), the warm standby
(:class:`tasks.supervision.standby.StandbySlot`), the worker zygote that forks every worker
(:class:`tasks.supervision.worker_zygote.WorkerZygote`), the thread that uploads committed
checkpoints (:class:`tasks.remote.remote_checkpoints.Uploader`), the boundary versioning still in
flight (:class:`tasks.remote.dvc_version.Versioning`) and the reader of the run's step journal
that goodput reads on (:class:`training.tracking.goodput.StepJournal`).

:class:`RunResources` is created when the flow opens the run, handed to every chunk task as a
parameter (a plain object: Prefect passes it through, the task's cache policy is ``NO_CACHE`` so
it is never hashed), and released once by :meth:`RunResources.close` on the flow's one exit path,
whatever happened.  A pool node's chunk flow makes its own for the one chunk it trains
(:func:`flows.pool.train_chunk`), and a chunk task called on its own (a test) makes its own and
closes it when it ends.  Every record goes through :mod:`tasks.records.run_records`, so no
backend is named here.  Nothing is looked up by run directory in a module registry, so a
signature says what a piece depends on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from tasks.artifacts import FailureNotes
from tasks.execution_plan import ExecutionPlan
from tasks.records import run_records
from tasks.records.background import OneAtATime
from tasks.records.tracker import MetricFollower
from tasks.remote.dvc_version import NotVersioned, Versioned, Versioning
from tasks.remote.remote_checkpoints import Uploader
from tasks.supervision.attempt import WorkerSlots
from tasks.supervision.handoff import Parking
from tasks.supervision.standby import StandbySlot
from tasks.supervision.worker_zygote import WorkerZygote
from training.checkpointing.store import CheckpointStore
from training.config import RunConfig
from training.tracking.goodput import StepJournal

log = logging.getLogger("convoy.run")


def zygote_for(plan: ExecutionPlan, run_dir: Path) -> WorkerZygote | None:
    """The run's worker zygote, started now so its imports overlap the flow's start-up; None where
    workers are not forked (``orchestration.zygote`` off, pool mode, more than one rank)."""
    return WorkerZygote(run_dir) if plan.zygote else None


class RunResources:
    """One run's long-lived helpers in the flow process (see the module docstring)."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        self.config, self.run_dir = config, Path(run_dir).resolve()
        #: The run's tracker (None: tracking off), one for all its chunk tasks, which open and end
        #: their attempt runs with it (:func:`tasks.records.tracker.tracker_for`).
        self.tracker = run_records.tracker_for(config)
        #: How the run's chunks execute, decided once (:mod:`tasks.execution_plan`).
        self.plan = ExecutionPlan.of(config)
        self.slots = WorkerSlots(Parking(), StandbySlot(self.run_dir), zygote_for(self.plan, self.run_dir))
        #: The run's checkpoints as this process sees them: one store, so each unchanged checkpoint
        #: is verified once however many callers ask for the resume point.
        self.checkpoints = CheckpointStore(self.run_dir)
        self.versioning = Versioning(config, self.run_dir)
        #: The run's step journal as goodput reads it: each read parses only the rows since the last.
        self.journal = StepJournal(self.run_dir)
        #: The resume audit and the goodput points in the tracking backend, written at each chunk
        #: end on threads of their own: off the path between two chunk tasks
        #: (:mod:`tasks.records.background`); goodput reads the journal on through ``journal``.
        self.audit = OneAtATime(lambda: run_records.refresh(config, self.run_dir), "convoy-audit-refresh")
        self.goodput = OneAtATime(
            lambda: run_records.log_goodput(config, self.run_dir, journal=self.journal), "convoy-goodput"
        )
        if config.tracking.mlflow:  # the refresh's imports, now, while the run's first worker starts
            OneAtATime(run_records.warm_up, "convoy-records-warm-up").request()
        #: Failure notes (Prefect artifacts), published off the path from a failure to its retry.
        self.notes = FailureNotes()
        self._uploader: Uploader | None = None
        self._follower: MetricFollower | None = None
        self._lock = threading.Lock()
        self.closed = False

    def __repr__(self) -> str:  # what Prefect shows for the task parameter
        return f"RunResources({self.run_dir.name})"

    def follow_uploads(self) -> Uploader | None:
        """The run's uploader, started on first use; None when versioning is off."""
        if not self.config.tracking.dvc:
            return None
        with self._lock:
            if self._uploader is None:
                self._uploader = Uploader(self.config, self.run_dir)
            return self._uploader

    def follow_metrics(self, say: Callable[[str], None]) -> MetricFollower | None:
        """The run's metric follower, the backend's (:func:`tasks.records.run_records.follow_metrics`;
        MLflow's: :class:`tasks.records.metric_shipping.MetricShipper`), started by the first chunk
        task and kept for the run: a shipper per chunk made each chunk's end wait up to 2 s for it
        and each chunk's start read the MLflow history again, between two chunk tasks, where a
        worker that dies waits to be replaced.  ``say``: the current chunk's log."""
        with self._lock:
            if self._follower is None:
                self._follower = run_records.follow_metrics(self.config, self.run_dir, say=say)
            else:
                self._follower.say = say
            return self._follower

    def close(self, grace_s: float = 10.0) -> tuple[bool, list[Versioned | NotVersioned], Versioned | None]:
        """Release everything, in the order that loses nothing: stop the parked worker (only one a
        failure left: the last chunk's worker exits by itself) and the standby, wait for the
        boundary versioning, then upload the newest committed checkpoint and stop the uploader.
        Returns (a worker was stopped, the versioning results, the final upload).  Idempotent."""
        if self.closed:
            return False, [], None
        self.closed = True
        stopped = self.slots.release(grace_s)
        with self._lock:
            follower, self._follower = self._follower, None
        if follower is not None:  # what the last worker logged, before the run's final records
            follower.stop(self.config.tracking.ship_drain_s)
        self.audit.join()
        self.goodput.join()
        self.notes.close()
        versioned = self.versioning.collect()
        with self._lock:
            uploader, self._uploader = self._uploader, None
        final = uploader.close(drain=True) if uploader is not None else None
        return stopped, versioned, final
