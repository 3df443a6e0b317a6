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

from dataclasses import dataclass, replace
from pathlib import Path

from training.event_records import AttemptRecorded, AttemptStarted, ChunkDone, EventLog, append_record
from training.tracking.failure_record import RecordedFailure

#: The records that name a chunk attempt (``chunk`` and ``attempt`` fields).
_NUMBERED = (AttemptStarted, RecordedFailure, ChunkDone)


def next_attempt(log: EventLog, chunk: int) -> int:
    """The number the chunk's next worker attempt gets: one more than any it used before."""
    numbered = (e for e in log.of(*_NUMBERED) if e.chunk == chunk)
    return max((int(e.attempt) for e in numbered if e.attempt), default=0) + 1


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
    run_dir: str | Path,
    attempt: AttemptId,
    mlflow_run_id: str | None,
    metrics_offset: int,
    parked: bool | None = None,
    replaces: int | None = None,
) -> None:
    """The attempt's ``attempt_started`` event: written by its chunk task, or, for a worker killed
    while parked, by the parking ahead of the task (``tasks/supervision/replacement.py``:
    ``parked``, or ``replaces``: the attempt it replaces).  ``metrics_offset``: where its steps
    begin in ``metrics.jsonl``."""
    started = AttemptStarted(
        chunk=attempt.chunk,
        attempt=attempt.attempt,
        flow_run_id=attempt.flow_run_id,
        task_run_id=attempt.task_run_id,
        mlflow_run_id=mlflow_run_id,
        resumes_from=attempt.resumes_from,
        metrics_offset=metrics_offset,
        parked=parked,
        replaces=replaces,
    )
    append_record(run_dir, started)


@dataclass(frozen=True)
class ChunkHistory:
    """What a chunk went through in every flow run so far: its attempts (the highest number
    used) and the kinds of its failures, oldest first."""

    attempts: int
    failure_kinds: tuple[str, ...]


def chunk_history(log: EventLog, chunk: int) -> ChunkHistory:
    """The chunk's :class:`ChunkHistory`, read from the run's events."""
    kinds = [str(f.kind) for f in log.of(RecordedFailure) if f.chunk == chunk]
    return ChunkHistory(next_attempt(log, chunk) - 1, tuple(kinds))


def recorded_digest(log: EventLog, chunk: int) -> str | None:
    """The digest the chunk's commit recorded (its newest ``chunk_done``), for a chunk whose
    boundary checkpoint retention has since removed; None if it never committed."""
    done = [e for e in log.of(ChunkDone) if e.chunk == chunk and e.digest]
    return str(done[-1].digest) if done else None


def failures_without_progress(log: EventLog, chunk: int) -> int:
    """How many of the chunk's newest attempts, in a row, failed without training a step past the
    one they resumed from: a crash loop, which the retry backoff slows down.  A worker that
    trained and then died (a kill, a lost node) is not one: its successor starts at once."""
    mine = [e for e in log.of(*_NUMBERED) if e.chunk == chunk]
    resumed = {e.attempt: e.resumes_from for e in mine if isinstance(e, AttemptStarted)}
    streak = 0
    for e in mine:
        if isinstance(e, ChunkDone):
            streak = 0
        elif isinstance(e, RecordedFailure):
            start, reached = resumed.get(e.attempt), e.details.trained_to
            progressed = start is not None and reached is not None and int(reached) > int(start)
            streak = 0 if progressed else streak + 1
    return streak


def open_attempts(log: EventLog) -> list[AttemptStarted]:
    """``attempt_started`` events whose attempt never ended (no ``failure`` and no ``chunk_done``
    names it): under the run's lock, attempts of a flow that died.  An ``attempt_recorded`` adds
    the MLflow run and task run an attempt started ahead of its task got later."""
    ended = {(e.chunk, e.attempt) for e in log.of(RecordedFailure, ChunkDone)}
    later = {(e.chunk, e.attempt): e for e in log.of(AttemptRecorded)}
    out = []
    for e in log.of(AttemptStarted):
        key = (e.chunk, e.attempt)
        if key in ended:
            continue
        got = later.get(key)
        out.append(replace(e, task_run_id=got.task_run_id, mlflow_run_id=got.mlflow_run_id) if got else e)
    return out


def latest_attempts(log: EventLog) -> dict[int, int]:
    """``{chunk: number of its newest attempt}`` (what the live line shows as "attempt")."""
    return {int(e.chunk or 0): int(e.attempt or 0) for e in log.of(AttemptStarted)}


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
