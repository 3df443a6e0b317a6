"""What a committed chunk reports to its flow: :class:`ChunkRecord`.

A record crosses three boundaries as a plain mapping (the ``chunk_done`` event, the Prefect task's
Completed state, a pool node's outcome artifact), and is read by the parent flow; the type names
the facts once, so no reader depends on string keys that a writer may spell differently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from training.event_records import ChunkDone, optional


@dataclass(frozen=True)
class ChunkRecord(ChunkDone):
    """One chunk's steps [start_step, end_step), committed by attempt ``attempt`` with ``digest``:
    the ``chunk_done`` event's record (:class:`training.event_records.ChunkDone`, whose fields it
    has), and what the pool's dispatcher adds to it."""

    #: Pool mode only (the parent's dispatcher adds them): each chunk flow run's id, failure kind,
    #: node and downloads, since no event of another machine names them.
    flow_runs: list[str] | None = optional()
    failure_kinds: list[str] | None = optional()
    nodes: list[str | None] | None = optional()
    fetched: list[dict[str, Any]] | None = optional()

    def as_dict(self) -> dict[str, Any]:
        """The mapping that is written (event, task state, artifact): the pool-only fields only when set."""
        return {k: getattr(self, k) for k in _FIELDS if getattr(self, k) is not None or k in _ALWAYS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChunkRecord:
        """Read a record back; keys this version does not know (a newer node's) are ignored."""
        return cls(**{k: v for k, v in data.items() if k in _FIELDS})


_FIELDS = ChunkRecord.own_fields()
_ALWAYS = set(ChunkDone.own_fields())


@dataclass
class ChunkRow:
    """The flow's row for one chunk of this flow run: the chunks table artifact, the summary's
    ``chunks`` and the end-of-run table.  Filled in as the chunk is skipped, trained or fails;
    ``attempts`` and ``failure_kinds`` count every flow run of the training run
    (:func:`training.tracking.attempts.chunk_history`), so a restarted flow does not say "1 attempt,
    no failures" of a chunk a dead flow tried three times."""

    chunk: int
    start_step: int
    end_step: int
    status: str = "pending"
    attempts: int = 0
    failure_kinds: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    digest: str | None = None
    loss: float | None = None
    #: Pool mode only: per attempt, its chunk flow run, node and download.
    flow_runs: list[str] | None = None
    nodes: list[str | None] | None = None
    fetched: list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The written form (artifact, summary JSON): the pool-only fields only when set."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k in _ROW_ALWAYS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChunkRow:
        return cls(**{k: v for k, v in data.items() if k in _ROW_FIELDS})

    def record_history(self, attempts: int, failure_kinds: list[str]) -> None:
        self.attempts, self.failure_kinds = attempts, list(failure_kinds)


_ROW_FIELDS = {f.name for f in dataclasses.fields(ChunkRow)}
_ROW_ALWAYS = {f.name for f in dataclasses.fields(ChunkRow) if f.name not in ("flow_runs", "nodes", "fetched")}
