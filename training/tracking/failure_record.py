"""A failed chunk attempt's facts: what a ``ChunkFailed`` carries, and the ``failure`` event read back.

Why a type: the supervisor, the chunk task, the failure hooks, the pool flow and the report all
read the same facts (when it was detected, how far it trained, where a retry resumes, its log).
Named fields say which facts exist; :meth:`FailureDetails.as_dict` is the one place they become
the mapping that the ``failure`` audit event, a pool node's Prefect artifact and the MLflow
attempt run record, and :meth:`FailureDetails.from_dict` reads such a mapping back (a pool node's
artifact, written by another process).  It lives in ``training/tracking`` because every room that
reads a ``failure`` event (supervision, the run records, the resume audit) may import from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Self

from training.event_records import EventRecord, event_time
from training.events import Event

#: Fields the supervisor always fills (None where it could not tell), in the order the ``failure``
#: event has always listed them; the others appear in :meth:`FailureDetails.as_dict` only when set.
_ALWAYS = (
    "detected_after_s",
    "last_beat_step",
    "trained_to",
    "last_committed_step",
    "steps_lost",
    "passed_over",
    "returncode",
    "reason",
    "error",
    "log",
)


@dataclass(frozen=True)
class FailureDetails:
    """The facts of one failed attempt; every field is None where it is not known."""

    #: Seconds from the failure (exit, last beat, last progress, limit) to its detection.
    detected_after_s: float | None = None
    #: The step of the worker's last heartbeat the supervisor read.
    last_beat_step: int | None = None
    #: How far the attempt trained (``training.tracking.resume_audit.trained_high_water``).
    trained_to: int | None = None
    #: The newest verified checkpoint: where a retry resumes (None: none yet).
    last_committed_step: int | None = None
    #: Steps trained beyond ``last_committed_step`` (``resume_audit.steps_lost``).
    steps_lost: int | None = None
    #: Newer checkpoints that do not verify: why the resume goes further back.
    passed_over: list[dict[str, Any]] | None = None
    #: The worker's (or launcher's) exit status; None when the supervisor saw no exit.
    returncode: int | None = None
    #: The failure in words, without the "chunk k kind:" prefix of the message.
    reason: str | None = None
    #: The line of the worker's last output that says why it ended (:mod:`tasks.supervision.repeated` compares it).
    error: str | None = None
    #: The worker log the supervisor followed.
    log: str | None = None
    #: The last lines the supervisor read (not in the ``failure`` event: the log holds them).
    tail: list[str] | None = None
    #: Wall seconds of the attempt.
    seconds: float | None = None
    #: A ``repeated`` failure: the attempt it repeats.
    repeats_attempt: int | None = None
    #: Pool mode: the chunk flow runs that tried the chunk.
    flow_runs: list[Any] | None = None

    @property
    def resume_step(self) -> int | None:
        """The step a retry resumes from (0 without a checkpoint); None when nobody looked it up
        (the failure did not come from a watched attempt)."""
        if self.last_committed_step is None and self.returncode is None:
            return None
        return self.last_committed_step or 0

    @property
    def failed_at_step(self) -> int | None:
        """How far the attempt got: the trained high-water mark, else its last beat's step."""
        return self.trained_to if self.trained_to is not None else self.last_beat_step

    def as_dict(self) -> dict[str, Any]:
        """The mapping the ``failure`` event, a Prefect artifact and MLflow record: the fields the
        supervisor always fills (None included), then every other field that is set."""
        out = {name: getattr(self, name) for name in _ALWAYS}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in out and value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FailureDetails:
        """Read :meth:`as_dict`'s mapping back; keys this version does not know are left out."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class RecordedFailure(EventRecord):
    """A ``failure`` event read back: how which attempt of which chunk failed, with its details.

    Why a type: the failure event is written by the supervisor and the takeover and read by
    :mod:`tasks.supervision.repeated`, the audit, goodput and the report; its keys are the event's
    (``failure``, ``chunk``, ``attempt``, then :meth:`FailureDetails.as_dict`'s, then when the
    failure was seen).  It is the ``failure`` kind's :class:`~training.event_records.EventRecord`:
    keys it does not name (``flow_run_id``, ``leftover_pids``...) stay in ``extra``."""

    KIND = Event.FAILURE

    kind: str | None
    chunk: int | None
    attempt: int | None
    details: FailureDetails
    #: When the supervisor saw the exit (or its verdict): ``detected_at - detected_after_s`` is the death.
    detected_at: float | None = field(default=None, kw_only=True)
    #: An ``orphaned`` attempt's last heartbeat: when it was last seen alive.
    last_seen: float | None = field(default=None, kw_only=True)

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> RecordedFailure:
        return cls.from_json(event)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """Read a ``failure`` line back; missing keys are None, unknown ones go to ``extra``."""
        named = {"failure", "chunk", "attempt", "detected_at", "last_seen", *_DETAIL_KEYS}
        return cls(
            data.get("failure"),
            data.get("chunk"),
            data.get("attempt"),
            FailureDetails.from_dict(data),
            detected_at=data.get("detected_at"),
            last_seen=data.get("last_seen"),
            time=event_time(data),
            extra={k: v for k, v in data.items() if k not in named and k not in ("kind", "time")},
        )

    def as_event_fields(self) -> dict[str, Any]:
        """The event's fields (what :func:`training.events.append_event` is given)."""
        return {"failure": self.kind, "chunk": self.chunk, "attempt": self.attempt, **self.details.as_dict()}

    def as_fields(self) -> dict[str, Any]:
        seen = {k: v for k, v in (("detected_at", self.detected_at), ("last_seen", self.last_seen)) if v is not None}
        return {**self.as_event_fields(), **seen, **self.extra}

    @property
    def death(self) -> float:
        """When the failed worker stopped making progress (goodput rule 7): its exit or last beat
        before the detection latency, an orphan's last beat, else when the failure was written."""
        if self.detected_at is not None:
            return float(self.detected_at) - float(self.details.detected_after_s or 0.0)
        if self.last_seen is not None:
            return float(self.last_seen)
        return self.time


_DETAIL_KEYS = tuple(f.name for f in fields(FailureDetails))
