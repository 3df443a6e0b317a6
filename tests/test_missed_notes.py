"""A failure note a dead flow run never sent is sent by the flow that takes over, once.

Why a test of its own: the chaos run's flowkill lands a few steps after a full disk; once in a
full run here the diskfull's note was still on the notes thread when the flow process was killed,
and the failures artifact listed 8 of the run's 9 failures.  Real Prefect server (the session's).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from tasks.artifacts import artifact_key, note_title, publish_failure_note
from tasks.missed_notes import publish_missed_notes, published_titles
from training.event_records import EventLog
from training.events import Event, append_event


def _attempt(run_dir: Path, chunk: int, attempt: int, flow_run: str, failure: str) -> None:
    append_event(run_dir, Event.ATTEMPT_STARTED, chunk=chunk, attempt=attempt, flow_run_id=flow_run)
    append_event(
        run_dir,
        Event.FAILURE,
        chunk=chunk,
        attempt=attempt,
        failure=failure,
        reason=f"{failure} in the test",
        detected_after_s=0.2,
        last_beat_step=9,
        last_committed_step=5,
        steps_lost=4,
    )


def test_a_note_the_dead_flow_never_sent_is_sent_once_by_the_next(prefect_api: str, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    name, run_dir = f"notes-{uuid.uuid4().hex[:8]}", tmp_path / "run"
    _attempt(run_dir, 1, 1, "dead", "killed")  # its note was sent before the flow died
    _attempt(run_dir, 1, 2, "dead", "diskfull")  # its note was on the notes thread: lost
    _attempt(run_dir, 1, 3, "dead", "orphaned")  # the takeover notes orphans itself
    _attempt(run_dir, 2, 1, "alive", "killed")  # another flow run's: not this takeover's business
    publish_failure_note(name, note_title(1, 1, "killed"), ["sent in time"])
    events = EventLog.read(run_dir)

    assert publish_missed_notes(name, events, ["dead"], "next-flow") == 1
    assert published_titles(name) == {note_title(1, 1, "killed"), note_title(1, 2, "diskfull")}
    assert publish_missed_notes(name, events, ["dead"], "next-flow") == 0  # once
    assert publish_missed_notes(name, events, [], "next-flow") == 0

    wanted = ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(name, "failures")]))
    with get_client(sync_client=True) as client:
        notes = {a.description: a.data for a in client.read_artifacts(artifact_filter=wanted)}
    late = notes[f"convoy run {name}: {note_title(1, 2, 'diskfull')}"]
    assert "diskfull in the test" in late and "resumes from step 5 (steps lost: 4)" in late, late
    assert "sent late by flow run next-flow" in late, late
