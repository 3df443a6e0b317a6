"""A flow that starts on a run whose previous flow died closes what that flow left open.

Why: a SIGKILLed flow process runs no hook, so its Prefect flow run stays "Running" (its chunk
task "Running" or "Retrying") and its MLflow attempt run RUNNING for good, and nothing says
which flow run finished the training.  The next flow on the run holds the run's lock
(invariant 8): nothing else trains it, so whatever the earlier flow runs left open is stale.
:func:`take_over` (called by the flow once it holds the lock and has stopped a left-over
worker) closes it:

* the run's events: each attempt that never ended (``attempt_started`` without ``failure`` or
  ``chunk_done``) gets a ``failure`` of kind ``orphaned`` with how far it trained, where the
  next attempt resumes and which checkpoints that passes over, so the audit, the attempt
  names and the chunks table count it like any failure;
* MLflow: each RUNNING attempt run of the training run ends KILLED, named and described like a
  failed attempt (``orphan 290→250 c2·a4``);
* Prefect: each earlier flow run of the run that never finished and is not in a final state is
  set Crashed, with its task runs that are not final;
* links both ways: the old flow run is tagged ``continued-by:<new>``, the new one
  ``continues:<old>``, each gets a markdown artifact naming the other, and the MLflow run lists
  every flow run of the training run (``convoy.flows``, :func:`mlflow_flow_tags`).

Best effort throughout: cleaning up after a dead flow never stops the new one from training.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.artifacts import FailureNotes, artifact_key, chunk_table, note_title, prefect_ui_url, publish_failure_note
from tasks.missed_notes import publish_missed_notes
from tasks.records import run_records
from tasks.records.run_links import flow_run_endings
from training.checkpointing.store import CheckpointStore
from training.config import RunConfig
from training.event_records import (
    AttemptStarted,
    ChunkDone,
    EventLog,
    FlowCrashed,
    FlowDone,
    FlowFailed,
    FlowStarted,
    FlowTakenOver,
    append_record,
)
from training.events import Event, FailureKind, append_event
from training.heartbeat import read_heartbeat
from training.tracking.attempts import open_attempts
from training.tracking.failure_record import RecordedFailure
from training.tracking.resume_audit import steps_lost, trained_high_water

log = logging.getLogger("convoy.takeover")


def unfinished_flow_runs(log: EventLog, current: str | None) -> list[str]:
    """Ids of the run's earlier flow runs that neither ended in this process (``flow_done``, or
    a ``flow_failed``/``flow_crashed`` hook) nor were taken over already, oldest first."""
    settled = {e.flow_run_id for e in log.of(FlowDone, FlowFailed, FlowCrashed)}
    settled |= {p for e in log.of(FlowTakenOver) for p in e.previous}
    ids = [e.flow_run_id for e in log.of(FlowStarted)]
    return list(dict.fromkeys(i for i in ids if i and i != current and i not in settled))


def record_orphans(
    run_dir: Path, flow_run: tuple[str | None, str | None], checkpoints: CheckpointStore
) -> list[RecordedFailure]:
    """A ``failure`` event (kind ``orphaned``) for each attempt whose flow died under it;
    ``flow_run``: (id, name) of the flow run that found it, named in the reason (a name reads
    where a bare UUID does not; the MLflow description links it)."""
    current, name = flow_run
    orphans = open_attempts(EventLog.read(run_dir))
    if not orphans:
        return []
    point = checkpoints.resume_point()
    resumes, passed = point.step, point.passed_over_dicts()
    beat = read_heartbeat(run_dir, 0)
    beat_step, beat_time = (beat.step, beat.time) if beat else (None, None)
    out = []
    for att in orphans:
        trained_to = trained_high_water(run_dir, beat_step, int(att.metrics_offset or 0))
        event = append_event(
            run_dir,
            Event.FAILURE,
            failure=FailureKind.ORPHANED,
            chunk=att.chunk,
            attempt=att.attempt,
            reason=f"its flow run died while it ran (no hook ran: the flow process was killed); "
            f"found by flow run {name or current}",
            flow_run_id=att.flow_run_id,
            mlflow_run_id=att.mlflow_run_id,
            last_seen=beat_time,
            last_beat_step=beat_step,
            trained_to=trained_to,
            last_committed_step=resumes,
            steps_lost=steps_lost(trained_to, resumes),
            passed_over=passed,
        )
        out.append(RecordedFailure.from_event(event))
    return out


def take_over(
    config: RunConfig,
    run_dir: Path,
    flow_run: tuple[str | None, str | None],
    logger: Any,
    checkpoints: CheckpointStore | None = None,
    notes: FailureNotes | None = None,
) -> dict[str, Any] | None:
    """Close what the run's earlier, dead flow runs left open (see the module docstring);
    ``flow_run``: (id, name) of this flow run; ``checkpoints``: the run's store (else a fresh
    one); ``notes``: the run's notes thread, which sends the failure notes off the path to the
    first step (else they are sent here).  Returns the ``flow_taken_over`` event, or None when
    there was nothing to close."""
    current, name = flow_run
    previous = unfinished_flow_runs(EventLog.read(run_dir), current)
    orphans = record_orphans(run_dir, flow_run, checkpoints or CheckpointStore(run_dir))
    if not previous and not orphans:
        return None
    closed = run_records.close_orphaned_attempts(config, run_dir, orphans)
    resumes = orphans[0].details.last_committed_step if orphans else None
    crashed = _crash_in_prefect(previous, (current, name), resumes, EventLog.read(run_dir)) if previous else []
    event = append_record(
        run_dir,
        FlowTakenOver(
            flow_run_id=current,
            previous=previous,
            previous_names=[c.name for c in crashed],
            orphaned=[{"chunk": o.chunk, "attempt": o.attempt, "trained_to": o.details.trained_to} for o in orphans],
            mlflow_runs_closed=closed,
            crashed_task_runs=[t for c in crashed for t in c.crashed_task_runs],
        ),
    )
    _publish_links(config, run_dir, crashed, (current, name), orphans)
    send = notes.later if notes is not None else _now
    # Older than the orphans' failures: the notes a dead flow run had not sent yet go first.
    send(_send_late_notes, config.run_name, run_dir, previous, name or str(current), logger)
    for o in orphans:
        logger.warning(
            "chunk %s attempt %s was orphaned by a flow run that died (trained to step %s); it resumes from step %s",
            o.chunk,
            o.attempt,
            o.details.trained_to,
            o.details.last_committed_step or 0,
        )
        send(  # one failures artifact per failure, this one too
            publish_failure_note,
            config.run_name,
            note_title(o.chunk, o.attempt, o.kind),
            [
                o.details.reason or "its flow run died while it ran",
                f"trained to step {o.details.trained_to}; resumes from step {o.details.last_committed_step or 0} "
                f"(steps lost: {o.details.steps_lost})",
            ],
        )
    if crashed:
        logger.warning("marked the dead flow run(s) %s Crashed", ", ".join(c.name for c in crashed))
    return event.as_json()


def _now(fn: Callable[..., Any], *args: Any) -> None:
    fn(*args)


def _send_late_notes(run_name: str, run_dir: Path, previous: list[str], by: str, logger: Any) -> None:
    """The failure notes the dead flow runs had not sent (:mod:`tasks.missed_notes`)."""
    if previous and (late := publish_missed_notes(run_name, EventLog.read(run_dir), previous, by)):
        logger.warning("sent %d failure note(s) the dead flow run(s) had not sent", late)


def failures_seen(log: EventLog, flow_run_id: str, chunk: int) -> list[str]:
    """``killed at step 145``: the failures of ``chunk``'s attempts that ran in ``flow_run_id``,
    oldest first, without the ``orphaned`` one the takeover recorded.  A flow process killed a
    moment after a failure loses the log lines Prefect had not sent yet; the events keep them."""
    mine = {e.attempt for e in log.of(AttemptStarted) if e.chunk == chunk and e.flow_run_id == flow_run_id}
    return [
        f"{f.kind} at step {f.details.failed_at_step or '?'}"
        for f in log.of(RecordedFailure)
        if f.chunk == chunk and f.attempt in mine and f.kind != FailureKind.ORPHANED
    ]


@dataclass(frozen=True)
class CrashedRun:
    """A dead flow run the takeover found in Prefect: what it was (``state``) and the task runs
    of it that were set Crashed."""

    id: str
    name: str
    state: str
    crashed_task_runs: list[str]


def _crash_in_prefect(
    ids: list[str],
    current: tuple[str | None, str | None],
    resumes: int | None = None,
    log: EventLog | None = None,
) -> list[CrashedRun]:
    """Set each flow run of ``ids`` that is not final (and its task runs that are not) Crashed,
    and tag it ``continued-by:<current name>``; returns what each was and what was crashed.
    Each task run crashed here gets a last log line saying what happened to it (its own log ended
    at whatever its worker said last, or before a failure whose lines Prefect never got);
    ``resumes``: the step the training resumes from; ``log``: the run's events, for those failures."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Crashed

    new_id, new_name = current
    message = f"the flow process died (no hook ran); flow run {new_name} ({new_id}) took the training run over"
    resumed = f"; training resumes from step {resumes}" if resumes is not None else ""
    out = []
    try:
        with get_client(sync_client=True) as client:
            wanted = FlowRunFilter(id=FlowRunFilterId(any_=[UUID(i) for i in ids]))
            for fr in client.read_flow_runs(flow_run_filter=wanted):
                was = fr.state.name if fr.state is not None else "unknown"
                if fr.state is not None and not fr.state.is_final():
                    client.set_flow_run_state(fr.id, Crashed(message=message), force=True)
                tasks, last_words = [], []
                own = FlowRunFilter(id=FlowRunFilterId(any_=[fr.id]))
                for tr in client.read_task_runs(flow_run_filter=own):
                    if tr.state is not None and not tr.state.is_final():
                        client.set_task_run_state(tr.id, Crashed(message=message), force=True)
                        tasks.append(f"{tr.name} ({tr.state.name})")
                        chunk = int(tr.name.rpartition("-")[2]) if tr.name.rpartition("-")[2].isdigit() else None
                        seen = failures_seen(log or EventLog(), str(fr.id), chunk) if chunk is not None else []
                        before = f" after {', '.join(seen)}" if seen else ""
                        said = (
                            f"{tr.name} crashed{before}: its flow process was killed while it watched its "
                            f"worker (no hook ran); the worker attempt was closed as orphaned and flow run "
                            f"{new_name} took the training run over{resumed}"
                        )
                        last_words.append(_log_line(said, fr.id, tr.id))
                if last_words:
                    client.create_logs(last_words)
                client.update_flow_run(fr.id, tags=sorted({*fr.tags, f"continued-by:{new_name}"}))
                out.append(CrashedRun(str(fr.id), fr.name, was, tasks))
            if new_id and out:
                mine = client.read_flow_run(UUID(new_id))
                links = {f"continues:{c.name}" for c in out}
                client.update_flow_run(mine.id, tags=sorted({*mine.tags, *links}))
    except Exception as exc:  # noqa: BLE001 - best effort (another API, a server gone)
        log.warning("Prefect: could not close the dead flow run(s) %s: %s", ", ".join(ids), exc)
    return out


def _log_line(message: str, flow_run_id: Any, task_run_id: Any) -> Any:
    """A log line in a dead task run's own log (ERROR), dated now: the line it never wrote."""
    import datetime

    from prefect.client.schemas.actions import LogCreate

    now = datetime.datetime.now(datetime.UTC)
    return LogCreate(
        name="convoy.takeover",
        level=40,
        message=message,
        timestamp=now,
        flow_run_id=flow_run_id,
        task_run_id=task_run_id,
    )


def _link(flow_run_id: str | None, name: str | None) -> str:
    url = prefect_ui_url(flow_run_id)
    shown = f"`{name or flow_run_id}`"
    return f"[{name or flow_run_id}]({url})" if url else shown


def _publish_links(
    config: RunConfig,
    run_dir: Path,
    crashed: list[CrashedRun],
    current: tuple[str | None, str | None],
    orphans: list[RecordedFailure],
) -> None:
    """A markdown artifact on the new flow run naming the dead ones, and on each dead flow run
    one naming the run that continued it and the chunks table it died before publishing."""
    from prefect.artifacts import create_markdown_artifact

    run_name = config.run_name
    lines = [
        f"- attempt {o.attempt} of chunk {o.chunk}: orphaned after step {o.details.trained_to}; "
        f"resumes from step {o.details.last_committed_step or 0}"
        for o in orphans
    ]
    took = ", ".join(f"{_link(c.id, c.name)} (was {c.state}, now Crashed)" for c in crashed) or "none found"
    body = f"### Run {run_name} taken over\n\nThis flow run continues the dead flow run(s) {took}.\n\n" + "\n".join(
        lines
    )
    try:
        create_markdown_artifact(
            markdown=body, key=artifact_key(run_name, "flow-runs"), description=f"convoy run {run_name}: taken over"
        )
        _note_on_dead_runs(config, EventLog.read(run_dir), crashed, current)
    except Exception as exc:  # noqa: BLE001
        log.warning("Prefect: could not publish the take-over artifacts: %s", exc)


def _note_on_dead_runs(
    config: RunConfig,
    log: EventLog,
    crashed: list[CrashedRun],
    current: tuple[str | None, str | None],
) -> None:
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate

    run_name = config.run_name
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    body = f"### Continued\n\nThis flow run died; run {run_name} was continued by flow run {_link(*current)} ({stamp})."
    with get_client(sync_client=True) as client:
        for c in crashed:
            flow_run_id = UUID(c.id)
            client.create_artifact(
                ArtifactCreate(
                    type="markdown",
                    key=artifact_key(run_name, "flow-runs"),
                    data=body,
                    description=f"convoy run {run_name}: continued by another flow run",
                    flow_run_id=flow_run_id,
                )
            )
            rows = dead_run_rows(log, c.id, config.train.total_steps, config.train.chunk_steps)
            client.create_artifact(
                ArtifactCreate(
                    type="table",
                    key=artifact_key(run_name, "chunks"),
                    data=json.dumps(chunk_table(rows)),
                    description=f"convoy run {run_name}: chunks of this flow run, until it died",
                    flow_run_id=flow_run_id,
                )
            )


def dead_run_rows(log: EventLog, flow_run_id: str, total_steps: int, chunk_steps: int) -> list[dict[str, Any]]:
    """The chunks a dead flow run worked on, from the run's events (it died before publishing
    its own table): attempts it made, their failures (``orphaned`` for the one it died under),
    and what it committed."""
    mine = [e for e in log.of(AttemptStarted) if e.flow_run_id == flow_run_id]
    rows = []
    for chunk in sorted({int(e.chunk or 0) for e in mine}):
        attempts = {e.attempt for e in mine if e.chunk == chunk}
        ended = [e for e in log.of(RecordedFailure, ChunkDone) if e.chunk == chunk and e.attempt in attempts]
        done = next((e for e in ended if isinstance(e, ChunkDone)), None)
        started = min(e.time for e in mine if e.chunk == chunk)
        rows.append(
            {
                "chunk": chunk,
                "start_step": (chunk - 1) * chunk_steps,
                "end_step": min(chunk * chunk_steps, total_steps),
                "status": "trained" if done else "died with this flow run",
                "attempts": len(attempts),
                "failure_kinds": [str(e.kind) for e in ended if isinstance(e, RecordedFailure)],
                "loss": done.loss if done else None,
                "seconds": max((e.time for e in ended), default=started) - started,
                "digest": done.digest if done else None,
            }
        )
    return rows


def mlflow_flow_tags(run_dir: Path, current: str | None, name: str | None) -> dict[str, str]:
    """Tags linking the MLflow run to its Prefect flow runs: the current one (id, name, UI link
    when a server is used) and every flow run of the training run, oldest first, with how it
    ended (``crashed`` when another took it over)."""
    endings = flow_run_endings(EventLog.read(run_dir), current)
    tags = {
        "convoy.flow_run": current,
        "convoy.flow": name,
        "convoy.flows": " → ".join(f"{i} ({how})" for i, how in endings.items())[:5000],
        "convoy.flow_url": prefect_ui_url(current),
    }
    return {k: v for k, v in tags.items() if v}
