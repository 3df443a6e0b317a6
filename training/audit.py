"""Resume audit in MLflow: chunk attempts as nested runs, resume/failure tags, table, timeline.

Called by the flow (never by the worker):

* :func:`start_attempt` / :func:`end_attempt` — each chunk attempt is a child run of the training
  run's MLflow run (tag ``mlflow.parentRunId``), ended FINISHED or FAILED with the failure kind,
  the steps trained and the seconds spent.
* :func:`refresh_audit` — reads ``events.jsonl`` and ``metrics.jsonl``; sets the parent's
  ``convoy.resumes`` / ``convoy.failures`` / ``convoy.steps_lost`` (and ``convoy.nondeterministic``
  when a replay did not reproduce the logged values); replaces the table artifact
  ``convoy/resume_events.json`` (MLflow table format, one row per recovery) and the picture
  ``convoy/timeline.png`` (loss vs step, a marker at each failure and resume).  The same files are
  written to ``<run_dir>/audit/`` so they exist without MLflow too.
* :func:`finish_run` — marks the parent run FINISHED/FAILED at the end of the flow.

A *recovery* is a worker start (``started``/``resumed``) that follows a failure: a supervisor
``failure`` event, a ``preempted`` event, or a previous worker that never reported
``worker_done`` (killed without anyone noticing).  A worker starting the next chunk after a clean
``worker_done`` is a continuation, not a resume.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config import RunConfig
from training.events import read_events

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
    "checkpoint",
    "checkpoint_digest",
    "replay_verified",
    "values_compared",
    "mismatches",
    "chunk",
    "attempt",
]

#: child run id → tracking URI, so that :func:`end_attempt` needs only the id (same process).
_child_uris: dict[str, str] = {}


# ---------------------------------------------------------------------------------- steps lost
def steps_lost(trained_to: int | None, resumed_from: int | None) -> int | None:
    """THE definition of steps lost, used by every tool (status, chaos, MLflow, Prefect, DVC):
    the steps trained beyond the checkpoint the next worker resumes from.  No checkpoint yet means
    a resume from step 0, so a kill before the first save loses every step trained so far.
    ``trained_to`` is the high-water step of the failed attempt (:func:`trained_high_water`);
    None when nothing says how far it got."""
    if trained_to is None:
        return None
    return max(0, int(trained_to) - int(resumed_from or 0))


def trained_high_water(run_dir: str | Path, beat_step: int | None, metrics_offset: int = 0) -> int | None:
    """How far an attempt trained: the larger of its last heartbeat step and the last step it
    wrote to ``metrics.jsonl`` after byte ``metrics_offset`` (where the attempt started).  The
    metrics row is written every step, while the beat may be an interval old at a kill."""
    steps = [beat_step] if beat_step is not None else []
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(metrics_offset)
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line after a kill
    return max(steps) if steps else None


# ---------------------------------------------------------------------------------- events → rows
def _rank0(ev: dict[str, Any]) -> bool:
    return int(ev.get("rank", 0) or 0) == 0


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return _dt.datetime.fromtimestamp(t, _dt.UTC).isoformat(timespec="seconds")


def analyse_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Pure function: the audit summary and the resume rows from the event log (in file order)."""
    rows: list[dict[str, Any]] = []
    pending: dict[str, Any] | None = None  # the failure not yet followed by a worker start
    session_open = False  # a worker started and has not reported worker_done
    current: dict[str, Any] | None = None  # the row of the running (resumed) worker session
    failures = 0
    nondet: list[dict[str, Any]] = []
    for ev in events:
        kind = ev.get("kind")
        if kind == "failure":
            if pending is None or "failure" in pending:
                failures += 1
                pending = {}
            pending["failure"] = ev
            session_open, current = False, None
        elif kind == "preempted" and _rank0(ev):
            if pending is None:
                failures += 1
                pending = {}
            pending["preempted"] = ev
            session_open, current = False, None
        elif kind in ("started", "resumed") and _rank0(ev):
            if pending is None and session_open:
                failures += 1  # the previous worker vanished without a report (e.g. SIGKILL)
                pending = {"unreported": True}
            if pending is not None:
                current = _row(ev, pending)
                rows.append(current)
            else:
                current = None
            pending, session_open = None, True
        elif kind == "worker_done" and _rank0(ev):
            session_open, current = False, None
        elif kind in ("replay_verified", "replay_mismatch") and current is not None:
            current["values_compared"] = ev.get("values_compared")
            current["mismatches"] = ev.get("mismatches")
            current["replay_verified"] = kind == "replay_verified" and not ev.get("mismatches")
        elif kind == "nondeterministic_resume":
            nondet.append(ev)
            if current is not None:
                current["replay_verified"] = False
    lost = [r["lost_steps"] for r in rows if r["lost_steps"] is not None]
    if pending and "failure" in pending and pending["failure"].get("steps_lost") is not None:
        lost.append(int(pending["failure"]["steps_lost"]))  # failed, not resumed (yet)
    return {
        "resumes": len(rows),
        "failures": failures,
        "steps_lost": sum(lost),
        "steps_lost_known": len(lost) == len(rows) + (1 if pending else 0),
        "nondeterministic": bool(nondet),
        "nondeterministic_first_step": nondet[0].get("step") if nondet else None,
        "replay_verified": sum(1 for r in rows if r["replay_verified"] is True),
        "rows": rows,
    }


def _row(start: dict[str, Any], pending: dict[str, Any]) -> dict[str, Any]:
    fail = pending.get("failure") or {}
    pre = pending.get("preempted") or {}
    resumed_from = int(start.get("step", 0) or 0)  # "started" = from scratch
    failed_at = fail.get("trained_to", fail.get("last_beat_step", pre.get("step")))
    if failed_at is None and pending.get("unreported"):
        failed_at = start.get("previous_beat_step")  # the vanished worker's last beat
    if pre and not fail:
        lost: int | None = 0  # an emergency checkpoint was saved at the preemption step
    else:
        lost = steps_lost(failed_at, resumed_from)
    failed_time = fail.get("time", pre.get("time"))
    return {
        "time": _iso(start.get("time")),
        "kind": fail.get("failure") or ("preempted" if pre else "unreported"),
        "detected_after_s": fail.get("detected_after_s"),
        "failed_at_step": failed_at,
        "resumed_from_step": resumed_from,
        "lost_steps": lost,
        "recovery_s": round(start["time"] - failed_time, 3) if failed_time and start.get("time") else None,
        "load_s": start.get("load_s"),
        "checkpoint": start.get("checkpoint"),
        "checkpoint_digest": start.get("digest"),
        "replay_verified": None,  # filled by the session's replay_verified / mismatch events
        "values_compared": None,
        "mismatches": None,
        "chunk": fail.get("chunk"),
        "attempt": fail.get("attempt"),
        "failure_time": failed_time,  # not a table column: lets `convoy chaos` match its faults
    }


# ---------------------------------------------------------------------------------- timeline
def read_loss(run_dir: str | Path) -> tuple[list[int], list[float]]:
    from training.metrics import metric_rows

    rows = [(step, m["loss"]) for step, m in metric_rows(run_dir) if "loss" in m]
    return [s for s, _ in rows], [float(v) for _, v in rows]


def _readable_y_range(ax: Any, loss: list[float]) -> None:
    """Keep the trained region readable: a log scale for losses spanning decades, else a y range
    from the loss after the first 5 % of steps, so a high initial loss cannot flatten the rest."""
    if not loss:
        return
    if min(loss) > 0 and max(loss) / min(loss) > 20:
        ax.set_yscale("log")
        return
    trained = loss[len(loss) // 20 :] or loss
    low, high = min(trained), max(trained)
    if max(loss) > high + (high - low):  # the first steps would take over half of the axis
        pad = 0.1 * (high - low or 1.0)
        ax.set_ylim(low - pad, high + pad)


def _mark_attempts(ax: Any, rows: list[dict[str, Any]]) -> None:
    """A red line (labelled with its kind) at each failure and a dotted green one at each resume;
    each legend entry once, however many recoveries there were."""
    first_fail = first_resume = True
    for row in rows:
        if row["failed_at_step"] is not None:
            ax.axvline(
                row["failed_at_step"],
                color="tab:red",
                ls="-",
                lw=1.2,
                alpha=0.8,
                label="failure" if first_fail else None,
            )
            first_fail = False
            # The kind beside the failure line, inside the axes (never clipped at the top).
            ax.annotate(
                f"{row['kind']} @ {row['failed_at_step']}",
                (row["failed_at_step"], 0.97),
                xycoords=("data", "axes fraction"),
                xytext=(3, 0),
                textcoords="offset points",
                rotation=90,
                va="top",
                ha="left",
                fontsize=7,
                color="tab:red",
            )
        ax.axvline(
            row["resumed_from_step"],
            color="tab:green",
            ls=":",
            lw=1.5,
            label="resumed from" if first_resume else None,
        )
        first_resume = False


def _label_axes(ax: Any, summary: dict[str, Any], loss: list[float], title: str) -> None:
    """Axis names, a readable y range and the run's recovery counts in the title."""
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    _readable_y_range(ax, loss)
    ax.set_title(
        f"{title}  resumes={summary['resumes']} failures={summary['failures']} "
        f"steps_lost={summary['steps_lost']}".strip(),
        fontsize=9,
    )
    ax.grid(alpha=0.3)


def _save_png_atomically(fig: Any, out_path: str | Path) -> Path:
    """Write through a temporary file and rename, so a reader never sees half a picture."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


def render_timeline(run_dir: str | Path, summary: dict[str, Any], out_path: str | Path, title: str = "") -> Path:
    """The loss against the step with a marker at each failure and resume: one look shows where a
    run was interrupted and where it picked up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, loss = read_loss(run_dir)
    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    try:
        ax.plot(steps, loss, lw=1.0, color="tab:blue", label="loss")
        _mark_attempts(ax, summary["rows"])
        _label_axes(ax, summary, loss, title)
        if steps:
            ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        return _save_png_atomically(fig, out_path)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------- MLflow side
def _client_and_parent(config: RunConfig, run_dir: Path) -> tuple[Any, str, str]:
    from training.mlflow_backend import client_for, ensure_mlflow_run, resolve_tracking_uri

    run_id = ensure_mlflow_run(config, run_dir)
    uri = resolve_tracking_uri(config, run_dir)
    return client_for(uri), run_id, uri


def start_attempt(
    config: RunConfig, run_dir: str | Path, chunk: int, attempt: int, start_step: int, end_step: int
) -> str | None:
    """Create the nested child run of one chunk attempt; returns its id (None without MLflow)."""
    if not config.tracking.mlflow:
        return None
    run_dir = Path(run_dir)
    client, parent_id, uri = _client_and_parent(config, run_dir)
    parent = client.get_run(parent_id)
    if parent.info.status != "RUNNING":
        client.update_run(parent_id, status="RUNNING")  # resumed after a FAILED/KILLED flow
    tags = {
        "mlflow.parentRunId": parent_id,
        "convoy.role": "attempt",
        "convoy.chunk": str(chunk),
        "convoy.attempt": str(attempt),
        "convoy.start_step": str(start_step),
        "convoy.end_step": str(end_step),
        "convoy.fingerprint": config.fingerprint(),
    }
    child = client.create_run(parent.info.experiment_id, run_name=f"chunk-{chunk:03d}-attempt-{attempt}", tags=tags)
    _child_uris[child.info.run_id] = uri
    return child.info.run_id


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


def failure_tags(failure: dict[str, Any]) -> dict[str, str]:
    """The facts of a failed attempt as MLflow tags (static facts are tags, not metric charts)."""
    resumed_from = failure.get("last_committed_step") or 0
    facts = {
        "failed_at_step": failure.get("trained_to", failure.get("last_beat_step")),
        "resumed_from_step": resumed_from,
        "steps_lost": failure.get("steps_lost"),
        "detected_after_s": failure.get("detected_after_s"),
        "failure_reason": str(failure.get("reason") or "")[:500],
        "log": failure.get("log"),
    }
    return {f"convoy.{k}": str(v) for k, v in facts.items() if v is not None}


@dataclass(frozen=True)
class AttemptOutcome:
    """How one chunk attempt ended, as :func:`end_attempt` records it on the attempt's MLflow run.

    ``status``: FINISHED, FAILED or KILLED; ``failure_kind``: the supervisor's name for the failure
    (``killed``, ``hang``...); ``steps``: steps the attempt committed; ``seconds``: its duration;
    ``failure``: the supervisor's details of a failed attempt (see :func:`failure_tags`).
    """

    status: str
    failure_kind: str | None = None
    steps: int = 0
    seconds: float = 0.0
    failure: dict[str, Any] | None = None


def _outcome_tags(outcome: AttemptOutcome) -> dict[str, str]:
    """The tags of an ended attempt, with a one-line description of a failure for the MLflow UI."""
    tags = {
        "convoy.status": outcome.status,
        "convoy.steps_committed": str(outcome.steps),
        "convoy.seconds": f"{outcome.seconds:.1f}",
    }
    if outcome.failure_kind:
        tags["convoy.failure_kind"] = outcome.failure_kind
    if outcome.failure:
        tags.update(failure_tags(outcome.failure))
        tags["mlflow.note.content"] = (
            f"{outcome.failure_kind or 'failure'} at step {tags.get('convoy.failed_at_step', '?')}: "
            f"{tags.get('convoy.failure_reason', '')}; detected after {tags.get('convoy.detected_after_s', '?')} s; "
            f"the next attempt resumes from step {tags['convoy.resumed_from_step']} "
            f"({tags.get('convoy.steps_lost', '?')} steps lost)"
        )
    return tags


def end_attempt(
    child_run_id: str | None,
    outcome: AttemptOutcome,
    *,
    config: RunConfig | None = None,
    run_dir: str | Path | None = None,
) -> None:
    """End a child run FINISHED or FAILED.  Tags: status, steps committed by the attempt, seconds,
    and for a failure (``outcome.failure`` = the supervisor's details) its kind, reason, failed-at
    and resumed-from steps, steps lost and log path, with the log's tail as an artifact and a
    one-line description, so a failed attempt explains itself in the MLflow UI."""
    if not child_run_id:
        return
    if outcome.status not in ("FINISHED", "FAILED", "KILLED"):
        raise ValueError(f"status = {outcome.status!r}: expected FINISHED, FAILED or KILLED")
    from mlflow.entities import RunTag

    from training.mlflow_backend import client_for, resolve_tracking_uri

    uri = _child_uris.get(child_run_id) or resolve_tracking_uri(config, run_dir)
    client = client_for(uri)
    tags = _outcome_tags(outcome)
    client.log_batch(child_run_id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
    tail = log_tail((outcome.failure or {}).get("log"))
    if tail:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(LOG_TAIL_ARTIFACT).name
            path.write_text("\n".join(tail) + "\n")
            client.log_artifact(child_run_id, str(path), artifact_path=str(Path(LOG_TAIL_ARTIFACT).parent))
    client.set_terminated(child_run_id, status=outcome.status)
    _child_uris.pop(child_run_id, None)


def finish_run(config: RunConfig, run_dir: str | Path, status: str = "FINISHED") -> None:
    """Mark the training run's MLflow run terminated (the flow calls it at the very end)."""
    if not config.tracking.mlflow:
        return
    client, parent_id, _ = _client_and_parent(config, Path(run_dir))
    client.set_terminated(parent_id, status=status)


def _table_payload(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON layout of ``MlflowClient.log_table`` (pandas ``orient="split"``)."""
    return {"columns": TABLE_COLUMNS, "data": [[r.get(c) for c in TABLE_COLUMNS] for r in rows]}


def refresh_audit(config: RunConfig, run_dir: str | Path) -> dict[str, Any]:
    """Recompute the audit from the event log and publish it (files always, MLflow if enabled).

    Idempotent: the table and picture are replaced, not appended, so calling it at every chunk
    end (and again after a crash) converges on the same artifacts."""
    run_dir = Path(run_dir)
    summary = analyse_events(read_events(run_dir))
    out_dir = run_dir / AUDIT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    table = _table_payload(summary["rows"])
    tmp = out_dir / ".resume_events.json.tmp"
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, out_dir / "resume_events.json")
    png = render_timeline(run_dir, summary, out_dir / "timeline.png", title=config.run_name)
    if not config.tracking.mlflow:
        return summary
    try:
        _publish(config, run_dir, summary, table, png)
    except Exception as exc:  # noqa: BLE001 - the audit must never fail a training run
        print(f"WARNING: could not publish the resume audit to MLflow: {exc}", file=sys.stderr, flush=True)
        summary["mlflow_error"] = str(exc)
    return summary


def describe_audit(summary: dict[str, Any]) -> str:
    """The audit in a sentence or two: the training run's description in MLflow."""
    if not summary["failures"]:
        return "No failures: trained without interruption."
    kinds: dict[str, int] = {}
    for row in summary["rows"]:
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
    shown = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "not resumed yet"
    text = (
        f"{summary['failures']} failure(s) ({shown}), {summary['resumes']} resume(s) from verified checkpoints, "
        f"{summary['steps_lost']} step(s) lost and retrained."
    )
    if summary["resumes"]:
        text += f" Replays verified bit for bit after {summary['replay_verified']} of {summary['resumes']} resume(s)."
    if summary["nondeterministic"]:
        text += f" NON-DETERMINISM detected from step {summary['nondeterministic_first_step']}."
    return text + " See convoy/resume_events.json and convoy/timeline.png."


def _publish(config: RunConfig, run_dir: Path, summary: dict[str, Any], table: dict[str, Any], png: Path) -> None:
    from mlflow.entities import RunTag
    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

    client, run_id, _ = _client_and_parent(config, run_dir)
    tags = {
        "convoy.resumes": summary["resumes"],
        "convoy.failures": summary["failures"],
        "convoy.steps_lost": summary["steps_lost"],
        "convoy.replay_verified": summary["replay_verified"],
    }
    tags["mlflow.note.content"] = describe_audit(summary)
    if summary["nondeterministic"]:
        tags["convoy.nondeterministic"] = "true"
        tags["convoy.nondeterministic_first_step"] = summary["nondeterministic_first_step"]
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
