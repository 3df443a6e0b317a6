"""Taking a run: what a worker must hold before it changes anything of the run's state.

In this order, each for a reason: the lease first (``.worker.lock``, invariant 8: a second worker
on the run fails here and changes nothing), then the predecessor's last beat (read before ours
replaces it: how far a worker that vanished unseen got, the audit's steps lost), then our own
beat, then the SIGTERM handler (from here on a stop is a preemption with an emergency save).
A standby worker builds everything else first and claims only when it is ordered to train.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from training.config import RunConfig
from training.heartbeat import Heartbeat, read_heartbeat
from training.rundir import take_worker_lease


class Preempt:
    """SIGTERM sets a flag; the loop saves at the next step boundary (never mid-update)."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True


@dataclass(frozen=True)
class Claim:
    """What taking the run gave this worker."""

    #: ``.worker.lock``, held by rank 0 (None on other ranks).
    lease: FileLock | None
    #: The step of the predecessor's last beat (None: no beat); see training/tracking/resume_audit.py.
    previous_beat_step: int | None
    heartbeat: Heartbeat
    preempt: Preempt


def claim_run(run_dir: Path, rank: int, config: RunConfig) -> Claim:
    """Take the run (see the module docstring for the order)."""
    lease = take_worker_lease(run_dir) if rank == 0 else None
    beat = read_heartbeat(run_dir, rank)
    previous = beat.step if beat else None
    heartbeat = Heartbeat(run_dir, rank, config.heartbeat.interval_s).start()
    return Claim(lease, previous, heartbeat, Preempt())
