"""Links a user can click between the MLflow and Prefect UIs, written as markdown into MLflow run
descriptions (MLflow renders ``mlflow.note.content`` as markdown; a tag value is text to copy).

Why a module: the parent run's description lists every flow run of the training run, an attempt's
description links its flow run, its task run and the training run, and an orphaned attempt names
the flow run that found it; all read the same facts.  The Prefect UI's address is recorded in
``run.json`` (``prefect_ui``) by the flow, which knows Prefect's settings: this room never imports
Prefect.  With an embedded (ephemeral) Prefect API there is no UI to link: names stay text.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from training.event_records import EventLog, FlowCrashed, FlowDone, FlowFailed, FlowStarted, FlowTakenOver
from training.run_identity import RunInfo
from training.rundir import run_info


def prefect_ui(run_dir: str | Path) -> str | None:
    """The Prefect UI's base address the flow recorded, or None (no server)."""
    ui = (run_info(run_dir) or RunInfo()).prefect_ui
    return str(ui).rstrip("/") if ui else None


def link(label: str, url: str | None) -> str:
    """``[label](url)``, or the label alone when there is nothing to link to."""
    return f"[{label}]({url})" if url else label


def flow_run_link(ui: str | None, flow_run_id: str | None, name: str | None = None) -> str:
    """A Prefect flow run by its name (its id's first 8 characters without one), linked."""
    label = name or (flow_run_id or "?")[:8]
    return link(label, f"{ui}/runs/flow-run/{flow_run_id}" if ui and flow_run_id else None)


def task_run_link(ui: str | None, task_run_id: str | None, label: str) -> str:
    return link(label, f"{ui}/runs/task-run/{task_run_id}" if ui and task_run_id else None)


def mlflow_run_link(experiment_id: str | None, run_id: str | None, label: str) -> str:
    """A link inside the MLflow UI (its router is the page's ``#`` part, so it works under any
    host the UI is opened on)."""
    return link(label, f"#/experiments/{experiment_id}/runs/{run_id}" if experiment_id and run_id else None)


def flow_run_names(log: EventLog) -> dict[str, str]:
    """``{flow run id: its name}`` from the run's ``flow_started`` events."""
    return {str(e.flow_run_id): str(e.flow_run_name or "") for e in log.of(FlowStarted) if e.flow_run_id}


def flow_run_endings(log: EventLog, current: str | None = None) -> dict[str, str]:
    """``{flow run id: how it ended}``, oldest first: ``crashed`` when another took it over,
    ``finished``, ``failed``, ``running`` for ``current`` (default: the newest one), else
    ``ended``."""
    taken = {p for e in log.of(FlowTakenOver) for p in e.previous}
    done = {e.flow_run_id for e in log.of(FlowDone)}
    failed = {e.flow_run_id for e in log.of(FlowFailed, FlowCrashed)}

    def ended(i: str) -> str:
        if i in taken:
            return "crashed"
        if i in done:
            return "finished"
        if i in failed:
            return "failed"
        return "running" if i == current else "ended"

    ids = list(flow_run_names(log))
    current = current or (ids[-1] if ids else None)
    return {i: ended(i) for i in ids}


def flow_runs_markdown(run_dir: str | Path, log: EventLog, current: str | None = None) -> str:
    """``Prefect flow runs: [crimson-owl](…) (crashed) → [brave-fox](…) (finished)``; empty
    without flow runs."""
    ui = prefect_ui(run_dir)
    names = flow_run_names(log)
    runs = [f"{flow_run_link(ui, i, names.get(i))} ({how})" for i, how in flow_run_endings(log, current).items()]
    return "Prefect flow runs: " + " → ".join(runs) if runs else ""


def attempt_links(run_dir: str | Path, log: EventLog, prefect: tuple[str | None, str | None]) -> str:
    """An attempt's way back: its Prefect flow run and task run, and the training run's MLflow
    run; ``prefect``: (flow run id, task run id)."""
    flow_run_id, task_run_id = prefect
    info = run_info(run_dir) or RunInfo()
    ui = prefect_ui(run_dir)
    parts = []
    if flow_run_id:
        parts.append(f"flow run {flow_run_link(ui, flow_run_id, flow_run_names(log).get(flow_run_id))}")
    if task_run_id:
        parts.append(task_run_link(ui, task_run_id, "task run"))
    prefect_part = "Prefect: " + " · ".join(parts) if parts else ""
    parent = mlflow_run_link(info.mlflow_experiment_id, info.mlflow_run_id, "the training run")
    return " · ".join(p for p in (prefect_part, f"part of {parent}") if p)


def attempts_oldest_first(run_dir: str | Path) -> str:
    """A link to the runs list showing only this training run's attempts, oldest first (MLflow
    lists a parent's children newest first, and a run's story reads from its start); empty
    before the run has an MLflow run."""
    info = run_info(run_dir) or RunInfo()
    experiment, run_id = info.mlflow_experiment_id, info.mlflow_run_id
    if not experiment or not run_id:
        return ""
    query = quote(f"tags.mlflow.parentRunId = '{run_id}'")
    url = f"#/experiments/{experiment}/runs?searchFilter={query}&orderByKey=attributes.start_time&orderByAsc=true"
    return link("Its chunk attempts, oldest first", url) + " (child runs)."
