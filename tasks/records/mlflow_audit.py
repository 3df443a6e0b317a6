"""Resume audit in MLflow: chunk attempts as nested runs, resume/failure tags, table, timeline.

Called by the flow and its chunk tasks (never by the worker), through :mod:`tasks.records.run_records`
and the MLflow tracker (:class:`tasks.records.mlflow_tracker.MlflowTracker`, which holds what an
attempt run was opened in until it is ended; no state lives in this module):

* :func:`start_attempt` / :func:`end_attempt` — each chunk attempt is a child run of the training
  run's MLflow run (tag ``mlflow.parentRunId``), ended FINISHED or FAILED with the failure kind,
  the steps trained and the seconds spent.
* :func:`refresh_audit` — :func:`write_audit_files` reads ``events.jsonl`` and ``metrics.jsonl``; sets the parent's
  ``convoy.resumes`` / ``convoy.failures`` / ``convoy.steps_lost`` (and ``convoy.nondeterministic``
  when a replay did not reproduce the logged values); replaces the table artifact
  ``convoy/resume_events.json`` (MLflow table format, one row per recovery) and the picture
  ``convoy/timeline.png`` (loss vs step, a marker at each failure and resume).  The same files are
  written to ``<run_dir>/audit/`` so they exist without MLflow too.
* :func:`finish_run` — marks the parent run FINISHED/FAILED at the end of the flow.

What counts as a recovery and as a step lost: :mod:`training.tracking.resume_audit`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tasks.records.run_links import attempt_links, attempts_oldest_first, flow_runs_markdown
from tasks.records.tracker import AttemptOutcome
from training.config import RunConfig
from training.event_records import EventLog
from training.events import FailureKind
from training.fsutil import atomic_write_json
from training.run_identity import RunInfo
from training.rundir import run_info
from training.tracking.attempts import AttemptId, attempt_name
from training.tracking.failure_record import FailureDetails, RecordedFailure
from training.tracking.resume_audit import ResumeAudit, analyse, describe_passed_over, read_loss, render_timeline

AUDIT_DIR = "audit"


TABLE_ARTIFACT = "convoy/resume_events.json"


TIMELINE_ARTIFACT = "convoy/timeline.png"


TABLE_COLUMNS = [
    "time",
    "kind",
    "detected_after_s",
    "failed_at_step",
    "resumed_from_step",
    "lost_steps",
    "recovery_s",
    "load_s",
    "fetch_s",
    "checkpoint",
    "checkpoint_digest",
    "passed_over",
    "replay_verified",
    "values_compared",
    "mismatches",
    "chunk",
    "attempt",
]


# ---------------------------------------------------------------------------------- MLflow side
def client_and_parent(config: RunConfig, run_dir: Path) -> tuple[Any, str, str]:
    """The MLflow client and the training run's MLflow run (imported here: MLflow takes ~3 s, and
    importing this module must not cost that to a flow that tracks nothing)."""
    from tasks.records.mlflow_client import client_for, resolve_tracking_uri
    from tasks.records.mlflow_runs import ensure_mlflow_run

    run_id = ensure_mlflow_run(config, run_dir)
    uri = resolve_tracking_uri(config, run_dir)
    return client_for(uri), run_id, uri


def start_attempt(config: RunConfig, run_dir: str | Path, attempt: AttemptId) -> str | None:
    """Create the nested child run of one chunk attempt (its chunk's steps), named
    ``running c<chunk>·a<attempt>`` until :func:`end_attempt` names its outcome, tagged with the
    flow and task run ids it runs in, its source and its user, described with its links.
    Returns its id (None without MLflow)."""
    if not config.tracking.mlflow:
        return None
    from tasks.records import mlflow_runs

    run_dir = Path(run_dir)
    client, parent_id, _ = client_and_parent(config, run_dir)
    parent = client.get_run(parent_id)
    if parent.info.status != "RUNNING":
        client.update_run(parent_id, status="RUNNING")  # resumed after a FAILED/KILLED flow
    tags = {
        "mlflow.parentRunId": parent_id,
        "convoy.role": "attempt",
        "convoy.chunk": str(attempt.chunk),
        "convoy.attempt": str(attempt.attempt),
        "convoy.start_step": str(attempt.start),
        "convoy.end_step": str(attempt.end),
        "convoy.fingerprint": config.fingerprint(),
        **{k: v for k, v in (("convoy.flow_run", attempt.flow_run_id), ("convoy.task_run", attempt.task_run_id)) if v},
        **mlflow_runs.git_tags(),
        **mlflow_runs.created_by(),
        "mlflow.note.content": attempt_note(run_dir, attempt, "running"),
    }
    child = client.create_run(parent.info.experiment_id, run_name=attempt.name(), tags=tags)
    return child.info.run_id


def attempt_note(run_dir: Path, attempt: AttemptId, what: str) -> str:
    """An attempt run's description: what happened (``what``), then its links (markdown: MLflow
    renders a description, so they are clickable) to its Prefect flow run and task run and to the
    training run."""
    steps = (
        f"Chunk {attempt.chunk}, attempt {attempt.attempt}: steps [{attempt.start}, {attempt.end})"  # as Prefect says
    )
    since = f", resuming from step {attempt.resumes_from}" if attempt.resumes_from is not None else ""
    links = attempt_links(run_dir, EventLog.read(run_dir), (attempt.flow_run_id, attempt.task_run_id))
    return f"{what}\n\n{steps}{since}.\n\n{links}"


def attempt_params(config: RunConfig, attempt: AttemptId) -> dict[str, str]:
    """An attempt run's params: its chunk's steps and resume point, then the training run's
    settings (the same for every attempt, so the runs list can compare attempts of several runs)."""
    own = {"chunk": attempt.chunk, "attempt": attempt.attempt, "start_step": attempt.start, "end_step": attempt.end}
    if attempt.resumes_from is not None:
        own["resumes_from"] = attempt.resumes_from
    from tasks.records.mlflow_runs import run_params

    return {**{k: str(v) for k, v in own.items()}, **run_params(config)}


#: Lines of the worker's log attached to a failed attempt's MLflow run.
LOG_TAIL_LINES = 200
LOG_TAIL_ARTIFACT = "convoy/worker-log-tail.txt"


def log_tail(path: str | Path | None, lines: int = LOG_TAIL_LINES, max_bytes: int = 512 * 1024) -> list[str]:
    """The last ``lines`` lines of a worker log (read from its end: logs of long runs grow)."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            start = max(0, f.seek(0, os.SEEK_END) - max_bytes)
            f.seek(start)
            text = f.read().decode(errors="replace").splitlines()[1 if start else 0 :]
    except OSError:
        return []
    return text[-lines:]


def failure_tags(failure: FailureDetails) -> dict[str, str]:
    """The facts of a failed attempt as MLflow tags (static facts are tags, not metric charts)."""
    facts = {
        "failed_at_step": failure.failed_at_step,
        "resumed_from_step": failure.last_committed_step or 0,
        "steps_lost": failure.steps_lost,
        "detected_after_s": failure.detected_after_s,
        "reason": (failure.reason or "")[:500],
        "skipped": describe_passed_over(failure.passed_over or [], limit=300) or None,
        "log": failure.log,
    }
    return {f"convoy.{k}": str(v) for k, v in facts.items() if v is not None}


def _outcome_tags(outcome: AttemptOutcome) -> dict[str, str]:
    """The tags of an ended attempt, with a one-line account of a failure (the first line of its
    description in the MLflow UI)."""
    tags = {
        "convoy.status": outcome.status,
        "convoy.steps_committed": str(outcome.steps),
        "convoy.seconds": f"{outcome.seconds:.1f}",
    }
    if outcome.failure_kind:
        tags["convoy.failure_kind"] = outcome.failure_kind
    if outcome.failure is not None:
        tags.update(failure_tags(outcome.failure))
        passed = tags.get("convoy.skipped")
        detected = tags.get("convoy.detected_after_s")
        tags["mlflow.note.content"] = (
            f"**{outcome.failure_kind or 'failure'}** at step {tags.get('convoy.failed_at_step', '?')}: "
            f"{tags.get('convoy.reason', '')}"
            + (f"; detected after {detected} s" if detected is not None else "")
            + f"; the next attempt resumes from step {tags['convoy.resumed_from_step']} "
            f"({tags.get('convoy.steps_lost', '?')} steps lost)"
            + (f"; newer checkpoints passed over: {passed}" if passed else "")
        )
    return tags


def end_attempt(
    child_run_id: str | None,
    outcome: AttemptOutcome,
    *,
    config: RunConfig | None = None,
    run_dir: str | Path | None = None,
    attempt: AttemptId | None = None,
    uri: str | None = None,
) -> None:
    """End a child run FINISHED, FAILED or KILLED.  Tags: status, steps committed by the attempt,
    seconds, and for a failure (``outcome.failure`` = the supervisor's details) its kind, reason,
    failed-at and resumed-from steps, steps lost, the checkpoints passed over and the log path,
    with the log's tail as an artifact and a description, so a failed attempt explains itself in
    the MLflow UI.  With ``attempt`` (and ``config``, ``run_dir``): renamed ``killed 290→200
    c2·a3``, its params logged and its description ending in its links.  ``uri``: the store the
    run was opened in, where the caller kept it (the tracker that opened it); else the run's."""
    if not child_run_id:
        return
    if outcome.status not in ("FINISHED", "FAILED", "KILLED"):
        raise ValueError(f"status = {outcome.status!r}: expected FINISHED, FAILED or KILLED")
    from mlflow.entities import Param, RunTag

    from tasks.records.mlflow_client import client_for, resolve_tracking_uri
    from tasks.records.mlflow_runs import MAX_BATCH_PARAMS

    client = client_for(uri or resolve_tracking_uri(config, run_dir))
    tags = _outcome_tags(outcome)
    params: list[Any] = []
    if attempt is not None and config is not None and run_dir is not None:
        done = f"**done**: committed step {outcome.end_step} in {outcome.seconds:.1f} s"
        what = tags.get("mlflow.note.content") or done
        tags["mlflow.note.content"] = attempt_note(Path(run_dir), attempt, what)
        params = [Param(k, v) for k, v in attempt_params(config, attempt).items()]
    first, rest = params[:MAX_BATCH_PARAMS], params[MAX_BATCH_PARAMS:]
    client.log_batch(child_run_id, tags=[RunTag(k, v) for k, v in tags.items()], params=first, synchronous=True)
    for i in range(0, len(rest), MAX_BATCH_PARAMS):
        client.log_batch(child_run_id, params=rest[i : i + MAX_BATCH_PARAMS], synchronous=True)
    if attempt is not None:
        client.update_run(child_run_id, name=attempt_name(attempt.chunk, attempt.attempt, outcome.label()))
    tail = log_tail(outcome.failure.log if outcome.failure else None)
    if tail:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(LOG_TAIL_ARTIFACT).name
            path.write_text("\n".join(tail) + "\n")
            client.log_artifact(child_run_id, str(path), artifact_path=str(Path(LOG_TAIL_ARTIFACT).parent))
    client.set_terminated(child_run_id, status=outcome.status)


def close_running_attempts(config: RunConfig, run_dir: str | Path, orphans: Sequence[RecordedFailure]) -> list[str]:
    """End every RUNNING attempt run of the training run KILLED (the caller holds the run's lock:
    none of them is alive), each named and described from its ``orphaned`` failure event (matched
    by chunk and attempt).  Returns the ids it ended."""
    import time

    client, parent_id, _ = client_and_parent(config, Path(run_dir))
    experiment = client.get_run(parent_id).info.experiment_id
    query = f"tags.mlflow.parentRunId = '{parent_id}' and attributes.status = 'RUNNING'"
    by_attempt = {(str(o.chunk), str(o.attempt)): o for o in orphans}
    unknown = FailureDetails(reason="its flow run died while it ran")
    closed = []
    for child in client.search_runs([experiment], filter_string=query):
        tag = child.data.tags.get
        chunk, attempt = tag("convoy.chunk"), tag("convoy.attempt")
        orphan = by_attempt.get((str(chunk), str(attempt)))
        seconds = time.time() - child.info.start_time / 1000
        kind = (orphan.kind if orphan else None) or FailureKind.ORPHANED
        outcome = AttemptOutcome("KILLED", kind, 0, seconds, orphan.details if orphan else unknown)
        which = None
        if chunk and attempt:
            steps = (int(tag("convoy.start_step") or 0), int(tag("convoy.end_step") or 0))
            prefect = (tag("convoy.flow_run"), tag("convoy.task_run"))
            which = AttemptId(int(chunk), int(attempt), *steps, *prefect)
        end_attempt(child.info.run_id, outcome, config=config, run_dir=run_dir, attempt=which)
        closed.append(child.info.run_id)
    return closed


def finish_run(config: RunConfig, run_dir: str | Path, status: str = "FINISHED") -> None:
    """Mark the training run's MLflow run terminated (the flow calls it at the very end)."""
    if not config.tracking.mlflow:
        return
    client, parent_id, _ = client_and_parent(config, Path(run_dir))
    client.set_terminated(parent_id, status=status)


def _table_payload(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON layout of ``MlflowClient.log_table`` (pandas ``orient="split"``); an unknown
    value is an empty cell (MLflow shows a JSON null as the word "null")."""
    return {
        "columns": TABLE_COLUMNS,
        "data": [["" if r.get(c) is None else r.get(c) for c in TABLE_COLUMNS] for r in rows],
    }


def write_audit_files(config: RunConfig, run_dir: str | Path) -> tuple[ResumeAudit, dict[str, Any], Path]:
    """Recompute the audit from the event log and write it under ``<run_dir>/audit/`` (the table,
    the timeline picture): (the audit, the table, the picture's path).  No MLflow: a run tracked
    nowhere gets these files at its end too (:func:`tasks.records.run_records.finish_run`)."""
    run_dir = Path(run_dir)
    audit = analyse(EventLog.read(run_dir))
    out_dir = run_dir / AUDIT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    table = _table_payload(audit.rows)
    atomic_write_json(out_dir / "resume_events.json", table, durable=False)
    png = render_timeline(run_dir, audit, out_dir / "timeline.png", title=config.run_name)
    return audit, table, png


def refresh_audit(config: RunConfig, run_dir: str | Path) -> dict[str, Any]:
    """Recompute the audit from the event log and publish it (files always, MLflow if enabled).

    Idempotent: the table and picture are replaced, not appended, so calling it at every chunk
    end (and again after a crash) converges on the same artifacts."""
    run_dir = Path(run_dir)
    audit, table, png = write_audit_files(config, run_dir)
    if not config.tracking.mlflow:
        return audit.as_dict()
    try:
        _publish(config, run_dir, audit, table, png)
    except Exception as exc:  # noqa: BLE001 - the audit must never fail a training run
        print(f"WARNING: could not publish the resume audit to MLflow: {exc}", file=sys.stderr, flush=True)
        return {**audit.as_dict(), "mlflow_error": str(exc)}
    return audit.as_dict()


def run_description(run_dir: Path, summary: ResumeAudit | None = None) -> str:
    """The training run's MLflow description: the audit in a sentence or two, then its Prefect
    flow runs as links with how each ended."""
    log = EventLog.read(run_dir)
    parts = [describe_audit(summary or analyse(log)), timeline_picture(run_dir)]
    parts += [flow_runs_markdown(run_dir, log), attempts_oldest_first(run_dir)]
    return "\n\n".join(p for p in parts if p)


def timeline_picture(run_dir: Path) -> str:
    """The timeline picture (the loss with every failure and resume marked) in the description,
    on the run's Overview page, the page a user opens first: MLflow renders the markdown image
    from the run's own artifact (a relative address, so any host and path prefix of the UI
    serves it).  Empty until the picture has been published once."""
    run_id = (run_info(run_dir) or RunInfo()).mlflow_run_id
    if not run_id or not (run_dir / AUDIT_DIR / "timeline.png").exists():
        return ""
    address = f"get-artifact?path={quote(TIMELINE_ARTIFACT, safe='')}&run_uuid={run_id}"
    return f"![loss with every failure and resume]({address})"


def replay_sentence(summary: ResumeAudit) -> str:
    """What the replay check found, counted over the resumes that re-trained steps: one that
    resumed at the step the failure hit (the memory tier) has nothing to compare, and "2 of 7"
    read as five failed checks."""
    rows = summary.rows
    replayed = [r for r in rows if (r.get("lost_steps") or 0) > 0]
    none = len(rows) - len(replayed)
    text = ""
    if replayed:
        text += (
            f" Re-trained steps matched the first pass bit for bit after {summary.replay_verified} of "
            f"{len(replayed)} resume(s) that re-trained steps."
        )
    if none:
        text += f" {none} resume(s) started at the step the failure hit: nothing to re-train or compare."
    return text


def describe_audit(summary: ResumeAudit) -> str:
    """The audit in a sentence or two: the training run's description in MLflow."""
    if not summary.failures:
        return "No failures: trained without interruption."
    kinds = Counter(str(row["kind"]) for row in summary.rows)
    shown = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "not resumed yet"
    text = (
        f"{summary.failures} failure(s) ({shown}), {summary.resumes} resume(s) from verified checkpoints, "
        f"{summary.steps_lost} step(s) lost and retrained."
    )
    text += replay_sentence(summary)
    if summary.nondeterministic:
        text += f" NON-DETERMINISM detected from step {summary.nondeterministic_first_step}."
    return text + " See convoy/resume_events.json and convoy/timeline.png."


#: A metric with a point at each failed step, valued at the number of failures so far: a
#: staircase that reads at a glance on MLflow's own charts (a point per failure valued at the loss
#: there drew a zig-zag between failures, and two failures at one step made one point).
FAILURE_METRIC = "failures"
#: The loss picture with every failure and resume marked, logged as an image *series* so MLflow
#: shows it in the run's charts, next to ``loss``, without configuring anything.
CHART_IMAGE_KEY = "loss_with_failures"


def failure_counts(rows: list[dict[str, Any]]) -> dict[int, int]:
    """``{failed step: failures up to and including it}`` of the audit ``rows``."""
    failed = sorted(int(r["failed_at_step"]) for r in rows if r.get("failed_at_step") is not None)
    return {step: n for n, step in enumerate(failed, start=1)}  # a later failure at a step wins


def _log_failure_counts(client: Any, run_id: str, rows: list[dict[str, Any]]) -> None:
    """Log the points of :func:`failure_counts` MLflow does not hold yet (one per step,
    invariant 5, however often the audit is refreshed; a step's count is the one seen first)."""
    import time

    from mlflow.entities import Metric

    counts = failure_counts(rows)
    if not counts:
        return
    held = {m.step for m in client.get_metric_history(run_id, FAILURE_METRIC)}
    now = int(time.time() * 1000)
    new = [Metric(FAILURE_METRIC, float(n), now, step) for step, n in sorted(counts.items()) if step not in held]
    if new:
        client.log_batch(run_id, metrics=new, synchronous=True)


def _log_chart_image(client: Any, run_id: str, png: Path, step: int) -> None:
    """The timeline picture as the one image of the series :data:`CHART_IMAGE_KEY`, at ``step``.

    One, the newest: MLflow's image chart opens at the series' only step when there is one, and
    at step 0 otherwise (a blank panel when the pictures are at the chunk ends).  So the new
    picture is logged first and the older ones are then deleted (a reader always finds one; a
    store that cannot delete keeps them, and the slider still reaches the newest)."""
    from PIL import Image

    mine = [
        f.path for f in client.list_artifacts(run_id, "images") if Path(f.path).name.startswith(f"{CHART_IMAGE_KEY}+")
    ]
    if any(Path(p).name.startswith(f"{CHART_IMAGE_KEY}+step+{step}+") for p in mine):
        return
    with Image.open(png) as picture:
        client.log_image(run_id, picture.convert("RGB"), key=CHART_IMAGE_KEY, step=step, synchronous=True)
    if mine:
        _delete_artifacts(client, run_id, mine)


def _delete_artifacts(client: Any, run_id: str, paths: list[str]) -> None:
    """Delete a run's artifacts (a local store's files, or through a server's artifact proxy);
    best effort: a store that cannot delete keeps them."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    try:
        repo = get_artifact_repository(client.get_run(run_id).info.artifact_uri, tracking_uri=client.tracking_uri)
        for path in paths:
            repo.delete_artifacts(path)
    except Exception as exc:  # noqa: BLE001 - an extra picture is no reason to fail the audit
        print(f"WARNING: could not remove an older loss picture from MLflow: {exc}", file=sys.stderr, flush=True)


def _publish(config: RunConfig, run_dir: Path, summary: ResumeAudit, table: dict[str, Any], png: Path) -> None:
    from mlflow.entities import RunTag
    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

    client, run_id, _ = client_and_parent(config, run_dir)
    _log_failure_counts(client, run_id, summary.rows)
    tags: dict[str, Any] = {
        "convoy.resumes": summary.resumes,
        "convoy.failures": summary.failures,
        "convoy.steps_lost": summary.steps_lost,
        "convoy.replay_verified": summary.replay_verified,
    }
    tags["mlflow.note.content"] = run_description(run_dir, summary)
    if summary.nondeterministic:
        tags["convoy.nondeterministic"] = "true"
        tags["convoy.nondeterministic_first_step"] = summary.nondeterministic_first_step
    run = client.get_run(run_id)
    logged = json.loads(run.data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
    entry = {"path": TABLE_ARTIFACT, "type": "table"}
    if entry not in logged:
        tags[MLFLOW_LOGGED_ARTIFACTS] = json.dumps([*logged, entry])
    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()], synchronous=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(TABLE_ARTIFACT).name
        path.write_text(json.dumps(table))
        client.log_artifact(run_id, str(path), artifact_path=str(Path(TABLE_ARTIFACT).parent))
    client.log_artifact(run_id, str(png), artifact_path=str(Path(TIMELINE_ARTIFACT).parent))
    steps, _ = read_loss(run_dir)
    if steps and summary.rows:  # a run without failures has its loss chart already
        _log_chart_image(client, run_id, png, steps[-1])
