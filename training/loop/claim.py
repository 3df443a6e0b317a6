"""Taking a run: what a worker must hold before it changes anything of the run's state.

In this order, each for a reason: the lease first (``.worker.lock``, invariant 8: a second worker
on the run fails here and changes nothing), then the predecessor's last beat (read before ours
replaces it: how far a worker that vanished unseen got, the audit's steps lost), then our own
beat, then the SIGTERM handler (from here on a stop is a preemption with an emergency save).
A standby worker builds everything else first and claims only when it is ordered to train.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from training.config import RunConfig
from training.fsutil import atomic_write_json
from training.heartbeat import Heartbeat, read_heartbeat
from training.paths import RunPaths
from training.rundir import take_worker_lease


class Preempt:
    """SIGTERM, or a stop request (``RunPaths.stop_request``) written after this worker claimed
    the run, sets the flag; the loop saves at the next step boundary (never mid-update).  The
    file reaches ranks no signal reaches whole: under ``srun``, a SIGTERM to the launcher's step
    becomes SIGKILL of its tasks.  A request older than the claim is an earlier attempt's: ignored."""

    def __init__(self, stop_file: Path | None = None) -> None:
        self._requested = False
        self._stop_file, self._since = stop_file, time.time()
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self._requested = True

    @property
    def requested(self) -> bool:
        """Read at every step boundary: one ``stat`` until the request comes, then latched."""
        if not self._requested and self._stop_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self._requested = os.stat(self._stop_file).st_mtime >= self._since
        return self._requested


@dataclass(frozen=True)
class Claim:
    """What taking the run gave this worker."""

    #: ``.worker.lock``, held by rank 0 (None on other ranks).
    lease: FileLock | None
    #: The step of the predecessor's last beat (None: no beat); see training/tracking/resume_audit.py.
    previous_beat_step: int | None
    heartbeat: Heartbeat
    preempt: Preempt


def request_stop(run_dir: Path) -> None:
    """Ask every rank that claimed the run to save and exit 75 (:class:`Preempt`)."""
    path = RunPaths(run_dir).stop_request
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"time": time.time(), "pid": os.getpid()}, durable=False)


def claim_run(run_dir: Path, rank: int, config: RunConfig) -> Claim:
    """Take the run (see the module docstring for the order)."""
    lease = take_worker_lease(run_dir) if rank == 0 else None
    beat = read_heartbeat(run_dir, rank)
    previous = beat.step if beat else None
    heartbeat = Heartbeat(run_dir, rank, config.heartbeat.interval_s).start()
    return Claim(lease, previous, heartbeat, Preempt(RunPaths(run_dir).stop_request))
