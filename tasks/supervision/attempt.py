"""The one attempt object: what a worker attempt runs, how it is watched, where its worker may
come from.  The supervisor (:mod:`tasks.supervision.supervisor`) watches it, the worker source
(:mod:`tasks.supervision.worker_source`) starts or finds its worker from it; neither copies it.

:class:`WorkerSlots` is the part that outlives one attempt: the run's parking spot (a pipelined
worker between chunk tasks), its standby slot and its worker zygote.  The flow holds them for the whole run
(:class:`tasks.run_resources.RunResources`) and every attempt of the run gets the same pair, passed
explicitly, so nothing about a run lives in a module-level registry.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.supervision.handoff import Parking, Replacement
from tasks.supervision.standby import StandbySlot
from tasks.supervision.worker_liveness import DetectionLimits
from training.events import StandbyOrder
from training.tracking.attempts import AttemptId

if TYPE_CHECKING:  # the store imports torch; an attempt is described without it
    from tasks.supervision.worker_handle import WorkerHandle
    from tasks.supervision.worker_zygote import WorkerZygote
    from training.checkpointing.store import CheckpointStore


@dataclass(frozen=True)
class ParkedSince:
    """Where a parked worker's record starts: the metric journal's size and the cgroup's OOM-kill
    count when it was parked, so a death while parked is judged like one under watch (how far it
    trained; killed or out of memory)."""

    metrics_offset: int
    oom_kills: int | None


@dataclass(frozen=True)
class WorkerSlots:
    """A run's parking spot, standby slot and worker zygote (see the module docstring)."""

    parking: Parking
    standby: StandbySlot
    #: Forks the run's workers (:mod:`tasks.supervision.worker_zygote`); None: every worker is spawned.
    zygote: WorkerZygote | None = None

    @classmethod
    def empty(cls, run_dir: str | Path = ".") -> WorkerSlots:
        return cls(Parking(), StandbySlot(run_dir))

    def release(self, grace_s: float = 5.0) -> bool:
        """Stop the parked worker, then the standby, then the zygote; True if a worker was parked."""
        stopped = self.parking.release(grace_s)
        self.parking.close()
        self.standby.release()
        if self.zygote is not None:
            self.zygote.close()
        return stopped


@dataclass(frozen=True)
class AttemptSpec:
    """What one worker attempt runs and how it is watched: the input of :class:`WorkerAttempt`.

    Where the worker comes from (spawned from ``cmd``, adopted from the previous chunk, or the
    warm standby given ``standby_order``) is :mod:`tasks.supervision.worker_source`'s business.
    ``boundary_step`` (pipelined, every chunk but the last): once that step's checkpoint is
    committed the attempt ends with the worker still training, parked for the next chunk (rule 2
    of :mod:`training.chunk_boundary`)."""

    cmd: Sequence[str]
    run_dir: Path
    limits: DetectionLimits
    log_path: Path
    ranks: int = 1
    #: Which attempt of which chunk (None: an attempt on its own, as in a bench).
    id: AttemptId | None = None
    env: dict[str, str] | None = None
    cwd: str | Path | None = None
    on_line: Callable[[str], None] | None = None
    #: Lines of the attempt's output kept for the verdict: enough for torchrun's failure report,
    #: which repeats the failed rank's whole traceback after the rank's own and torchrun's.
    tail_lines: int = 240
    boundary_step: int | None = None
    standby_order: StandbyOrder | None = None
    #: Where a worker waits between chunks and the warm standby: the run's, shared by its chunk
    #: attempts; a fresh pair (nothing parked, no standby) for an attempt on its own.
    slots: WorkerSlots = field(default_factory=lambda: WorkerSlots.empty())
    #: The run's checkpoints as the flow process sees them (one store per run, so a checkpoint the
    #: attempt's start verified is not hashed again by its failure report); None: a fresh store.
    checkpoints: CheckpointStore | None = None
    #: Pipelined: what starts the next chunk's worker at once if this one dies while parked
    #: (:func:`tasks.supervision.replacement.replace_parked`); None: the next task finds it dead.
    successor: Callable[[WorkerHandle, ParkedSince], Replacement | None] | None = None

    @property
    def chunk(self) -> int | None:
        return self.id.chunk if self.id else None

    @property
    def attempt(self) -> int | None:
        return self.id.attempt if self.id else None

    def store(self) -> CheckpointStore:
        if self.checkpoints is not None:
            return self.checkpoints
        from training.checkpointing.store import CheckpointStore

        return CheckpointStore(self.run_dir)

    def environment(self) -> dict[str, str]:
        return {**os.environ, **(self.env or {})}

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        object.__setattr__(self, "log_path", Path(self.log_path))
