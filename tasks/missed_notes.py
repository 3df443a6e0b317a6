"""Failure notes a dead flow run said but never sent, published by the flow that takes over.

Why: a chunk task's failure note is published on a thread of its own
(:class:`tasks.artifacts.FailureNotes`), off the path from a failure to its retry.  A flow
process killed a moment after a failure takes the note it had not sent yet with it (the chaos
run's ``flowkill`` lands a few steps after its full disk), and so does a Prefect that was down
when the note was due: the run's failures artifact then lists fewer failures than its events.
The events are the record.  The flow that takes the run over (:func:`tasks.takeover.take_over`)
compares the failures of the dead flow runs' attempts with the notes Prefect holds, by title
(:func:`tasks.artifacts.note_title`, the one wording every note uses), and publishes each one missing from its
``failure`` event, saying who sent it late and why.  The orphans the takeover records itself
are left to it.  Best effort, like every note: a Prefect that cannot be read sends nothing.
"""

from __future__ import annotations

import logging

from tasks.artifacts import artifact_key, note_description, note_title, publish_failure_note
from training.event_records import AttemptStarted, EventLog
from training.events import FailureKind
from training.tracking.failure_record import RecordedFailure

log = logging.getLogger("convoy.takeover")

#: Artifacts read per request (Prefect's API pages its answers).
_PAGE = 200


def published_titles(run_name: str) -> set[str]:
    """The titles of the run's failure notes that Prefect holds (every version of the key)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    wanted = ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(run_name, "failures")]))
    prefix = note_description(run_name)
    titles: set[str] = set()
    with get_client(sync_client=True) as client:
        offset = 0
        while page := client.read_artifacts(artifact_filter=wanted, limit=_PAGE, offset=offset):
            titles |= {a.description.removeprefix(prefix) for a in page if a.description}
            offset += len(page)
    return titles


def dead_failures(log: EventLog, dead_flow_runs: list[str]) -> list[RecordedFailure]:
    """The ``failure`` events of attempts that ran in ``dead_flow_runs``, oldest first, without
    the orphans (the takeover notes those itself)."""
    dead = set(dead_flow_runs)
    ran_there = {(e.chunk, e.attempt) for e in log.of(AttemptStarted) if e.flow_run_id in dead}
    return [f for f in log.of(RecordedFailure) if f.kind != FailureKind.ORPHANED and (f.chunk, f.attempt) in ran_there]


def publish_missed_notes(run_name: str, log: EventLog, dead_flow_runs: list[str], by: str) -> int:
    """Publish the note of each failure of ``dead_flow_runs`` that Prefect has none of; ``by``:
    this flow run's name.  Returns how many were published."""
    failures = dead_failures(log, dead_flow_runs)
    if not failures:
        return 0
    try:
        have = published_titles(run_name)
    except Exception as exc:  # noqa: BLE001 - a note must never stop the flow that trains
        log.warning("could not read the run's failure notes from Prefect: %s", exc)
        return 0
    sent = 0
    for f in failures:
        title = note_title(f.chunk, f.attempt, f.kind or "failure")
        if title in have:
            continue
        publish_failure_note(run_name, title, _lines(f, by))
        have.add(title)
        sent += 1
    return sent


def _lines(failure: RecordedFailure, by: str) -> list[str]:
    """A note's lines from its ``failure`` event (what the dead flow's note would have said,
    less the retry it announced)."""
    d = failure.details
    return [
        str(d.reason or failure.kind),
        f"detected after {d.detected_after_s} s; last beat step {d.last_beat_step}",
        f"resumes from step {d.last_committed_step or 0} (steps lost: {d.steps_lost})",
        f"sent late by flow run {by}: the flow run that saw this failure died before its note was sent",
    ]
