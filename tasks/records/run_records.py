"""Glue from the orchestration to MLflow (training/tracking/resume_audit.py) and DVC (tasks/remote/dvc_version.py).

Why a separate module: the flow and the chunk task call these at fixed points (run start, every
attempt, every committed chunk, run end) and each call must be *best effort* where the tracking
side is an audit (a dead MLflow server must not fail a chunk that trained fine), while a failure
to create the run's MLflow run at the start is reported before any training happens.  MLflow and
DVC are imported lazily (~3 s each) and only when enabled in ``tracking``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tasks.records.mlflow_audit import AttemptOutcome
from training.config import RunConfig
from training.tracking.attempts import AttemptId
from training.tracking.failure_record import FailureDetails, RecordedFailure

log = logging.getLogger("convoy.tracking")


def begin_run(config: RunConfig, run_dir: Path) -> str | None:
    """Create (or find) the run's MLflow run so workers log into it; None without MLflow."""
    if not config.tracking.mlflow:
        return None
    from tasks.records.mlflow_runs import ensure_mlflow_run

    return ensure_mlflow_run(config, run_dir)


def start_attempt(config: RunConfig, run_dir: Path, attempt: AttemptId) -> str | None:
    """Nested MLflow run of one chunk attempt, tagged with its Prefect flow and task run (best
    effort)."""
    if not config.tracking.mlflow:
        return None
    try:
        from tasks.records.mlflow_audit import start_attempt as _start

        return _start(config, run_dir, attempt)
    except Exception as exc:  # noqa: BLE001 - audit only
        log.warning("MLflow: could not start the attempt run of chunk %d: %s", attempt.chunk, exc)
        return None


def attempt_outcome(
    ok: bool,
    kind: str | None = None,
    steps: int = 0,
    seconds: float = 0.0,
    failure: FailureDetails | None = None,
    end_step: int | None = None,
) -> AttemptOutcome:
    """The outcome of a chunk attempt as the chunk task knows it (ok or not, and the supervisor's
    failure kind and details, or the step it committed), in the form
    :func:`tasks.records.mlflow_audit.end_attempt` records."""
    return AttemptOutcome("FINISHED" if ok else "FAILED", kind, steps, seconds, failure, end_step)


def end_attempt(
    config: RunConfig, run_dir: Path, child: str | None, outcome: AttemptOutcome, attempt: AttemptId | None = None
) -> None:
    """End the attempt's MLflow run, named after its outcome when ``attempt`` is given (best
    effort); ``outcome``: see :func:`attempt_outcome`."""
    if child is None:
        return
    try:
        from tasks.records.mlflow_audit import end_attempt as _end

        _end(child, outcome, config=config, run_dir=run_dir, attempt=attempt)
    except Exception as exc:  # noqa: BLE001
        log.warning("MLflow: could not end attempt run %s: %s", child, exc)


def close_orphaned_attempts(config: RunConfig, run_dir: Path, orphans: Sequence[RecordedFailure]) -> list[str]:
    """End the MLflow runs of attempts whose flow died KILLED, named and described from their
    ``orphaned`` failure events (best effort); returns their ids."""
    if not config.tracking.mlflow:
        return []
    try:
        from tasks.records.mlflow_audit import close_running_attempts

        return close_running_attempts(config, run_dir, orphans)
    except Exception as exc:  # noqa: BLE001 - audit only
        log.warning("MLflow: could not close the attempt runs of a dead flow: %s", exc)
        return []


def link_flow_run(config: RunConfig, run_dir: Path, tags: dict[str, str]) -> None:
    """Tag the run's MLflow run with its Prefect flow runs, and say how each ended in its
    description (best effort)."""
    if not config.tracking.mlflow or not tags:
        return
    try:
        from tasks.records.mlflow_audit import run_description
        from tasks.records.mlflow_runs import set_run_tags

        set_run_tags(config, run_dir, {**tags, "mlflow.note.content": run_description(run_dir)})
    except Exception as exc:  # noqa: BLE001
        log.warning("MLflow: could not link the Prefect flow run: %s", exc)


def log_model(config: RunConfig, run_dir: Path) -> dict[str, Any] | None:
    """Log the finished run's model to MLflow and register it (:mod:`tasks.records.mlflow_model`; best
    effort: the checkpoint and the DVC export hold it anyway)."""
    if not config.tracking.mlflow or not config.tracking.log_model:
        return None
    try:
        from tasks.records.mlflow_audit import client_and_parent
        from tasks.records.mlflow_model import log_final_model

        client, run_id, _ = client_and_parent(config, run_dir)
        return log_final_model(config, run_dir, client, run_id)
    except Exception as exc:  # noqa: BLE001
        log.warning("MLflow: could not log the final model: %s", exc)
        return None


def finish_run(config: RunConfig, run_dir: Path, ok: bool) -> dict[str, Any] | None:
    """Recompute the resume audit (files under ``audit/``, MLflow if enabled) and end the run."""
    summary = None
    try:
        from tasks.records.mlflow_audit import finish_run as _finish
        from tasks.records.mlflow_audit import refresh_audit

        summary = refresh_audit(config, run_dir)
        _finish(config, run_dir, "FINISHED" if ok else "FAILED")
    except Exception as exc:  # noqa: BLE001
        log.warning("audit: could not finish the run's audit: %s", exc)
    return summary


@contextlib.contextmanager
def system_metrics(config: RunConfig, run_dir: Path) -> Iterator[None]:
    """MLflow's own system metrics (``system/cpu_utilization_percentage``, memory, disk, network,
    GPU where there is one) logged into the run's MLflow run while the flow trains, sampled on
    the machine whose workers train (the local flow; in pool mode each chunk's flow).  Every
    ``tracking.system_metrics_s`` seconds (``$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` wins);
    0 turns it off.  Their step is MLflow's sample counter, continued across flow runs.  Best
    effort: monitoring never fails a run."""
    monitor = None
    if config.tracking.mlflow and config.tracking.system_metrics_s > 0:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            from tasks.records.mlflow_client import resolve_tracking_uri
            from tasks.records.mlflow_runs import ensure_mlflow_run

            run_id = ensure_mlflow_run(config, run_dir)
            uri = resolve_tracking_uri(config, run_dir)
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no start/stop chatter
            monitor = SystemMetricsMonitor(
                run_id, sampling_interval=config.tracking.system_metrics_s, resume_logging=True, tracking_uri=uri
            )
            monitor.start()
        except Exception as exc:  # noqa: BLE001 - monitoring must never fail a chunk
            log.warning("MLflow: could not start the system metrics: %s", exc)
            monitor = None
    try:
        yield
    finally:
        if monitor is not None:
            with contextlib.suppress(Exception):
                monitor.finish()


def refresh(config: RunConfig, run_dir: Path) -> None:
    """Refresh the resume audit (tags, table, timeline picture) at a chunk's end; best effort."""
    if not config.tracking.mlflow:
        return
    try:
        from tasks.records.mlflow_audit import refresh_audit

        refresh_audit(config, run_dir)
    except Exception as exc:  # noqa: BLE001
        log.warning("audit: could not refresh: %s", exc)


def warm_up() -> None:
    """Import what the first audit refresh needs (matplotlib for the timeline picture, ~1 s), when
    the run opens: otherwise the first chunk end pays it on the refresh thread, whose interpreter
    lock then slows a recovery that happens at that moment (bench/mttr.py's first kill: 2.3 s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def log_upload_lag(run_dir: Path, step: int, lag: dict[str, float]) -> None:
    """Record a published checkpoint's upload lag (``upload_lag_steps``, ``upload_lag_s``) in the
    run's MLflow run at the checkpoint's step; once per published step, so one point per step.
    Best effort: the checkpoint is in the remote either way."""
    from training.rundir import load_run_config, run_info

    try:
        config = load_run_config(run_dir)
        run_id = (run_info(run_dir) or {}).get("mlflow_run_id")
        if not config.tracking.mlflow or not run_id:
            return
        from mlflow.entities import Metric

        from tasks.records.mlflow_client import client_for, resolve_tracking_uri

        ts = int(time.time() * 1000)
        metrics = [Metric(key, float(value), ts, int(step)) for key, value in sorted(lag.items())]
        client_for(resolve_tracking_uri(config, run_dir)).log_batch(run_id, metrics=metrics, synchronous=True)
    except Exception as exc:  # noqa: BLE001 - audit only
        log.warning("MLflow: could not record the upload lag of step %d: %s", step, exc)
