"""A chunk's attempts across Prefect retries, preemptions and flow runs, read from the run's events.

Why from the events: Prefect numbers a task's runs per flow run (``run_count`` starts again at 1
when a new flow takes a run over), and a preempted worker re-spawned inside one task run is no
Prefect retry at all.  Only the run directory sees every attempt.  The chunk task records each
worker attempt as an ``attempt_started`` event; its number is one more than the highest the
chunk has used (in any event), so no two attempts of a chunk share a number, a log file or an
MLflow run name, whichever flow ran them.

Names: :func:`attempt_name` puts the outcome in the first characters (``killed 290→200 c2·a3``),
because MLflow's runs table shows about sixteen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.events import Event, append_event

#: Events that name a chunk attempt (``chunk`` and ``attempt`` fields).
_NUMBERED = (Event.ATTEMPT_STARTED, Event.FAILURE, Event.CHUNK_DONE)


def next_attempt(events: list[dict[str, Any]], chunk: int) -> int:
    """The number the chunk's next worker attempt gets: one more than any it used before."""
    numbered = (e for e in events if e["kind"] in _NUMBERED and e.get("chunk") == chunk)
    return max((int(e["attempt"]) for e in numbered if e.get("attempt")), default=0) + 1


@dataclass(frozen=True)
class AttemptId:
    """Which worker attempt this is: the one attempt record the chunk task builds and the
    supervisor (:class:`tasks.supervision.attempt.AttemptSpec`), the worker source, the events and
    the MLflow records (:mod:`tasks.records.run_records`) all take, instead of each copying the
    chunk, the attempt number, the chunk's steps and the Prefect runs positionally.

    ``start``/``end``: the chunk's steps ``(start, end]``; ``flow_run_id``/``task_run_id``: the
    Prefect runs the attempt runs in (None outside a flow); ``resumes_from``: the step its worker
    restores (None until the chunk task has chosen it)."""

    chunk: int
    attempt: int
    start: int = 0
    end: int = 0
    flow_run_id: str | None = None
    task_run_id: str | None = None
    resumes_from: int | None = None

    def name(self, outcome: str = "running") -> str:
        """Its MLflow run name (:func:`attempt_name`)."""
        return attempt_name(self.chunk, self.attempt, outcome)


def record_start(
    run_dir: str | Path, attempt: AttemptId, mlflow_run_id: str | None, metrics_offset: int, **fields: Any
) -> None:
    """The attempt's ``attempt_started`` event: written by its chunk task, or, for a worker killed
    while parked, by the parking ahead of the task (``tasks/supervision/replacement.py``).
    ``metrics_offset``: where its steps begin in ``metrics.jsonl``."""
    append_event(
        run_dir,
        Event.ATTEMPT_STARTED,
        chunk=attempt.chunk,
        attempt=attempt.attempt,
        flow_run_id=attempt.flow_run_id,
        task_run_id=attempt.task_run_id,
        mlflow_run_id=mlflow_run_id,
        resumes_from=attempt.resumes_from,
        metrics_offset=metrics_offset,
        **fields,
    )


@dataclass(frozen=True)
class ChunkHistory:
    """What a chunk went through in every flow run so far: its attempts (the highest number
    used) and the kinds of its failures, oldest first."""

    attempts: int
    failure_kinds: tuple[str, ...]


def chunk_history(events: list[dict[str, Any]], chunk: int) -> ChunkHistory:
    """The chunk's :class:`ChunkHistory`, read from the run's events."""
    kinds = [str(e["failure"]) for e in events if e["kind"] == Event.FAILURE and e.get("chunk") == chunk]
    return ChunkHistory(next_attempt(events, chunk) - 1, tuple(kinds))


def recorded_digest(events: list[dict[str, Any]], chunk: int) -> str | None:
    """The digest the chunk's commit recorded (its newest ``chunk_done``), for a chunk whose
    boundary checkpoint retention has since removed; None if it never committed."""
    done = [e for e in events if e["kind"] == Event.CHUNK_DONE and e.get("chunk") == chunk and e.get("digest")]
    return str(done[-1]["digest"]) if done else None


def failures_without_progress(events: list[dict[str, Any]], chunk: int) -> int:
    """How many of the chunk's newest attempts, in a row, failed without training a step past the
    one they resumed from: a crash loop, which the retry backoff slows down.  A worker that
    trained and then died (a kill, a lost node) is not one: its successor starts at once."""
    resumed = {
        e.get("attempt"): e.get("resumes_from")
        for e in events
        if e["kind"] == Event.ATTEMPT_STARTED and e.get("chunk") == chunk
    }
    streak = 0
    for e in events:
        if e["kind"] == Event.CHUNK_DONE and e.get("chunk") == chunk:
            streak = 0
        elif e["kind"] == Event.FAILURE and e.get("chunk") == chunk:
            start, reached = resumed.get(e.get("attempt")), e.get("trained_to")
            progressed = start is not None and reached is not None and int(reached) > int(start)
            streak = 0 if progressed else streak + 1
    return streak


def open_attempts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``attempt_started`` events whose attempt never ended (no ``failure`` and no ``chunk_done``
    names it): under the run's lock, attempts of a flow that died.  An ``attempt_recorded`` adds
    the MLflow run and task run an attempt started ahead of its task got later."""
    ended = {(e.get("chunk"), e.get("attempt")) for e in events if e["kind"] in (Event.FAILURE, Event.CHUNK_DONE)}
    later = {(e.get("chunk"), e.get("attempt")): e for e in events if e["kind"] == Event.ATTEMPT_RECORDED}
    out = []
    for e in events:
        key = (e.get("chunk"), e.get("attempt"))
        if e["kind"] == Event.ATTEMPT_STARTED and key not in ended:
            added = {k: v for k, v in later.get(key, {}).items() if k not in ("kind", "time")}
            out.append({**e, **added})
    return out


def latest_attempts(events: list[dict[str, Any]]) -> dict[int, int]:
    """``{chunk: number of its newest attempt}`` (what the live line shows as "attempt")."""
    return {int(e["chunk"]): int(e["attempt"]) for e in events if e["kind"] == Event.ATTEMPT_STARTED}


#: Shorter words for the longest failure kinds in a name (the kind itself is a tag and opens the
#: description): MLflow's runs list shows about 14 characters of a nested run's name, and
#: ``orphaned 195→195`` lost its resumed-from step there.
NAME_WORDS = {"orphaned": "orphan", "preempted": "preempt", "diskfull": "disk"}


def outcome_label(kind: str | None, failed_at: int | None = None, resumed_from: int | None = None) -> str:
    """``killed 290→200``: the failure, the step it hit and the step the next attempt resumes
    from; ``done→400`` for an attempt that committed its chunk's end."""
    if kind is None:
        return f"done→{resumed_from}" if resumed_from is not None else "done"
    kind = NAME_WORDS.get(kind, kind)
    at = f" {failed_at}" if failed_at is not None else ""  # a space: "@" is wide, and ~16 characters show
    to = f"→{resumed_from}" if resumed_from is not None else ""
    return f"{kind}{at}{to}"


def attempt_name(chunk: int, attempt: int, outcome: str = "running") -> str:
    """The MLflow run name of one attempt, outcome first: ``killed 290→200 c2·a3``.  MLflow's
    runs list shows about 16 characters of a name: the outcome and its steps must be in them (the
    chunk and attempt are tags too)."""
    return f"{outcome} c{chunk}·a{attempt}"
