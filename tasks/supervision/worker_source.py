"""Where a chunk attempt's worker comes from: the one seam between the supervisor and its sources.

Four sources, tried in this order, each giving the supervisor the same
:class:`tasks.supervision.worker_handle.WorkerHandle` (pid, a death it can wait for, a stop, its log):

1. **adopted** — the worker the previous chunk parked at its boundary (``orchestration.pipeline``,
   :mod:`tasks.supervision.handoff`), if it runs this attempt's command.  Its beats are its own however old and
   its log is read on from where the previous chunk stopped.
2. **standby** — the run's warm standby (``orchestration.standby``, :mod:`tasks.supervision.standby`), given
   this attempt's order.
3. **forked** — by the run's worker zygote (:mod:`tasks.supervision.worker_zygote`): a ready interpreter
   with torch imported forks it in milliseconds (after removing stale beats of an earlier attempt);
4. **spawned** — a fresh process, when there is no zygote ready (or the command is not a local
   one-rank worker).

Every source is watched equally well: the handle waits on the process's pidfd, so the death of
a worker this task did not start is seen as fast as that of one it did.  The supervisor
(:mod:`tasks.supervision.supervisor`) holds one :class:`WorkerSource` per attempt and only asks it for the
worker (:meth:`~WorkerSource.acquire`), tells it once the worker trains (then a new standby is
started behind it) and, at a committed boundary, leaves the worker to the next chunk
(:meth:`~WorkerSource.park`).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from tasks.supervision.attempt import AttemptSpec, ParkedSince
from tasks.supervision.failure_kinds import oom_kills
from tasks.supervision.handoff import Replacement
from tasks.supervision.worker_handle import WorkerHandle, spawn
from training.events import Event, append_event
from training.fsutil import file_size
from training.heartbeat import heartbeat_path
from training.paths import RunPaths


class Source(StrEnum):
    """Where the watched worker came from."""

    ADOPTED = "adopted"
    STANDBY = "standby"
    #: By the run's zygote (:mod:`tasks.supervision.worker_zygote`): no interpreter start.
    FORKED = "forked"
    SPAWNED = "spawned"


@dataclass(frozen=True)
class Acquired:
    worker: WorkerHandle
    source: Source


def clock(t: float) -> str:
    """A log header's time, as a person reads it (UTC)."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


class WorkerSource:
    """Where one attempt's worker comes from and goes to (see the module docstring)."""

    def __init__(self, spec: AttemptSpec) -> None:
        self.launch = spec
        self.slots = spec.slots
        self.standby_checked = False

    def acquire(self, started: float) -> Acquired:
        """This attempt's worker: the parked one, else the standby, else a fresh spawn."""
        launch = self.launch
        parked = self.slots.parking.adopt(list(launch.cmd))  # None unless the previous chunk parked it
        if parked is not None:
            return Acquired(parked, Source.ADOPTED)
        return self.fresh(started)

    def fresh(self, started: float) -> Acquired:
        """A worker that restores for this attempt: the standby, else forked, else spawned (also
        what replaces a worker killed while parked, :mod:`tasks.supervision.replacement`)."""
        launch = self.launch
        for r in range(launch.ranks):  # stale beats of an earlier attempt must not count as liveness
            with contextlib.suppress(FileNotFoundError):
                heartbeat_path(launch.run_dir, r).unlink()
        called = self._call_standby(started)
        if called is not None:
            return Acquired(called, Source.STANDBY)
        header = f"chunk={launch.chunk} attempt={launch.attempt} started {clock(started)}"
        forked = self._fork(launch.cmd, launch.log_path, header)
        if forked is not None:
            return Acquired(forked, Source.FORKED)
        fresh = spawn(launch.cmd, launch.log_path, header, cwd=launch.cwd, env=launch.environment())
        return Acquired(fresh, Source.SPAWNED)

    def _fork(self, cmd: Sequence[str], log_path: Path, header: str, stdin: bool = False) -> WorkerHandle | None:
        """A worker forked by the run's zygote; None when there is none ready (then it is spawned)."""
        zygote = self.slots.zygote
        if zygote is None:
            return None
        launch = self.launch
        return zygote.fork(cmd, log_path, header, cwd=launch.cwd, env=launch.environment(), stdin=stdin)

    def _call_standby(self, started: float) -> WorkerHandle | None:
        """Give the run's warm standby this attempt's order; None when there is none."""
        launch = self.launch
        if launch.standby_order is None:
            return None
        ready = self.slots.standby.take(launch.standby_order)
        if ready is None:
            return None
        with open(ready.log_path, "ab") as log:
            log.write(
                f"# convoy chunk={launch.chunk} attempt={launch.attempt} took over standby pid {ready.pid} "
                f"at {clock(started)}\n".encode()
            )
        append_event(
            launch.run_dir,
            Event.STANDBY_CALLED,
            chunk=launch.chunk,
            attempt=launch.attempt,
            pid=ready.pid,
            ready_s=round(started - ready.started, 3),
        )
        return ready

    def worker_trains(self) -> None:
        """The worker is past its start-up: keep the run's standby ready behind it (once per
        attempt: a standby that cannot start is not retried)."""
        if self.standby_checked or self.launch.standby_order is None:
            return
        self.standby_checked = True
        launch = self.launch

        def start(cmd: list[str], log_path: Path) -> WorkerHandle:
            header = f"standby started {clock(time.time())}"
            forked = self._fork(cmd, log_path, header, stdin=True)
            if forked is not None:
                return forked
            return spawn(cmd, log_path, header, cwd=launch.cwd, env=launch.environment(), stdin=subprocess.PIPE)

        self.slots.standby.ensure(start)

    def park(self, worker: WorkerHandle) -> None:
        """Leave the worker, alive or not, to the next chunk's attempt (which judges it); a death
        before that attempt adopts it goes to the attempt's ``successor`` (replaced at once)."""
        successor = self.launch.successor
        on_death = None
        if successor is not None:
            since = ParkedSince(file_size(RunPaths(self.launch.run_dir).metrics), oom_kills())

            def on_death(dead: WorkerHandle) -> Replacement | None:
                return successor(dead, since)

        self.slots.parking.park(worker, list(self.launch.cmd), on_death)
