"""Every path inside a run directory, named once.

Why: the run-directory layout (docs/architecture.md, "Run directory") is a contract between the
worker, the supervisor, the flow, versioning and the CLI, which run in different processes and
sometimes on different machines.  Spelled as string literals at each call site, a rename in one
place silently splits the run in two; here each path has one name and one definition, and the
modules that own an artifact (checkpoint store, heartbeat, events, metrics) build theirs from it.

This module imports nothing from convoy so that every other module may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RUN_FILE = "run.json"
CONFIG_FILE = "config.json"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "LATEST"
HEARTBEAT_DIR = "heartbeat"
EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
LOGS_DIR = "logs"
ACK_FILE = "chunk-ack.json"
#: Held by the flow training the run for its whole life (invariant 8; ``training/locks.py``).
FLOW_LOCK = ".lock"
#: Held by the training process of a run (rank 0) for its whole life (invariant 8).
WORKER_LEASE = ".worker.lock"
#: Beside a lock, its holder's note (``pid N on HOST since TIME``): ``.lock.owner``.
OWNER_SUFFIX = ".owner"


def checkpoint_name(step: int) -> str:
    """``step-000001200``: zero-padded so that names sort in step order."""
    return f"step-{step:09d}"


def owner_note(lock: Path) -> Path:
    """The owner note beside the lock file ``lock``."""
    return lock.with_name(lock.name + OWNER_SUFFIX)


@dataclass(frozen=True)
class RunPaths:
    """The paths of one run directory (``RunPaths(run_dir).metrics`` and so on)."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def run_file(self) -> Path:
        return self.root / RUN_FILE

    @property
    def config_file(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def task_shapes(self) -> Path:
        """The task's model/optimizer shapes, written by rank 0's worker for ``convoy verify``."""
        return self.root / "task_shapes.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / checkpoint_name(step)

    @property
    def latest(self) -> Path:
        return self.checkpoints / LATEST_FILE

    @property
    def heartbeats(self) -> Path:
        return self.root / HEARTBEAT_DIR

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / f"rank-{rank}.json"

    @property
    def events(self) -> Path:
        return self.root / EVENTS_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    def chunk_log(self, chunk: int, attempt: int | str) -> Path:
        return self.logs / f"chunk-{chunk}-attempt-{attempt}.log"

    def standby_log(self, n: int) -> Path:
        return self.logs / f"standby-{n}.log"

    def zygote_log(self, n: int) -> Path:
        return self.logs / f"zygote-{n}.log"

    def exit_status(self, token: int) -> Path:
        """Where a worker forked by the zygote leaves its exit code (read, then removed, by the
        flow when the zygote that would report it is gone; :mod:`tasks.supervision.worker_zygote`)."""
        return self.heartbeats / f"exit-{token}.json"

    @property
    def ack(self) -> Path:
        return self.root / ACK_FILE

    @property
    def stop_request(self) -> Path:
        """Written by the supervisor stopping an attempt from outside (the flow ending): every rank
        that claimed the run before its time saves an emergency checkpoint and exits 75, as on
        SIGTERM (:class:`training.loop.claim.Preempt`), also a rank no signal reaches whole (``srun``
        turns a SIGTERM into a SIGKILL of its tasks)."""
        return self.heartbeats / "stop-request"

    @property
    def worker_lease(self) -> Path:
        return self.root / WORKER_LEASE

    @property
    def flow_lock(self) -> Path:
        return self.root / FLOW_LOCK
