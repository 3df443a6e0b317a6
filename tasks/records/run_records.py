"""The orchestration's one door to the run's records: tracking (MLflow today) and the resume audit.

Why a separate module: the flow and the chunk task call these at fixed points (run start, every
attempt, every committed chunk, run end) and each call must be *best effort* where the tracking
side is an audit (a dead MLflow server must not fail a chunk that trained fine), while a failure
to create the run's MLflow run at the start is reported before any training happens.  That policy
is here, once; what each record is in the backend is the run's tracker's
(:class:`tasks.records.tracker.Tracker`, chosen by ``tracking.backend``: :func:`tracker_for`), so
no caller names a backend.  Every function but :func:`start_attempt` and :func:`end_attempt`
takes the config and makes the tracker itself; those two take the tracker, which the run's
resources make once (``RunResources.tracker``) for every chunk task of the run: the tracker that
opened an attempt run ends it (it may hold where it opened it).  A tracker's backend (~3 s to
import MLflow) and DVC are imported only when enabled in ``tracking``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.records.tracker import AttemptOutcome, MetricFollower, Tracker, tracker_for
from training.config import RunConfig
from training.tracking.attempts import AttemptId
from training.tracking.failure_record import FailureDetails, RecordedFailure

if TYPE_CHECKING:
    from training.tracking.goodput import StepJournal

log = logging.getLogger("convoy.tracking")


def _name(tracker: Tracker | None) -> str:
    """The backend's name in a warning ("MLflow: ..."), or "tracking" before there is a tracker."""
    return tracker.name if tracker is not None else "tracking"


def begin_run(config: RunConfig, run_dir: Path) -> str | None:
    """Create (or find) the run's run in the backend so chunks log into it; None without tracking.
    Not caught: a run whose records cannot be opened stops before it trains."""
    tracker = tracker_for(config)
    return tracker.begin_run(run_dir) if tracker is not None else None


def start_attempt(tracker: Tracker | None, run_dir: Path, attempt: AttemptId) -> str | None:
    """The run of one chunk attempt, nested in the training run and tagged with its Prefect flow
    and task run (best effort); ``tracker``: the chunk task's, which :func:`end_attempt` gets too."""
    if tracker is None:
        return None
    try:
        return tracker.start_attempt(run_dir, attempt)
    except Exception as exc:  # noqa: BLE001 - audit only
        log.warning("%s: could not start the attempt run of chunk %d: %s", tracker.name, attempt.chunk, exc)
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
    :meth:`tasks.records.tracker.Tracker.end_attempt` records."""
    return AttemptOutcome("FINISHED" if ok else "FAILED", kind, steps, seconds, failure, end_step)


def end_attempt(
    tracker: Tracker | None,
    run_dir: Path,
    child: str | None,
    outcome: AttemptOutcome,
    attempt: AttemptId | None = None,
) -> None:
    """End the attempt's run, named after its outcome when ``attempt`` is given (best effort);
    ``tracker``: the one whose :func:`start_attempt` opened ``child``; ``outcome``: see
    :func:`attempt_outcome`."""
    if tracker is None or child is None:
        return
    try:
        tracker.end_attempt(run_dir, child, outcome, attempt)
    except Exception as exc:  # noqa: BLE001
        log.warning("%s: could not end attempt run %s: %s", tracker.name, child, exc)


def close_orphaned_attempts(config: RunConfig, run_dir: Path, orphans: Sequence[RecordedFailure]) -> list[str]:
    """End the runs of attempts whose flow died KILLED, named and described from their
    ``orphaned`` failure events (best effort); returns their ids."""
    tracker = None
    try:
        tracker = tracker_for(config)
        return tracker.close_orphaned_attempts(run_dir, orphans) if tracker is not None else []
    except Exception as exc:  # noqa: BLE001 - audit only
        log.warning("%s: could not close the attempt runs of a dead flow: %s", _name(tracker), exc)
        return []


def link_flow_run(config: RunConfig, run_dir: Path, tags: dict[str, str]) -> None:
    """Tag the training run with its Prefect flow runs, and say how each ended in its
    description (best effort)."""
    if not tags:
        return
    tracker = None
    try:
        tracker = tracker_for(config)
        if tracker is not None:
            tracker.link_flow_run(run_dir, tags)
    except Exception as exc:  # noqa: BLE001
        log.warning("%s: could not link the Prefect flow run: %s", _name(tracker), exc)


def follow_metrics(config: RunConfig, run_dir: Path, say: Callable[[str], None]) -> MetricFollower | None:
    """The run's metric follower (MLflow's: :class:`tasks.records.metric_shipping.MetricShipper`),
    started; None without tracking or without the run's run.  Not caught, as before the seam."""
    tracker = tracker_for(config)
    return tracker.follow_metrics(run_dir, say) if tracker is not None else None


def log_goodput(config: RunConfig, run_dir: Path, journal: StepJournal | None = None) -> list[int]:
    """Log the goodput point of each chunk end the backend lacks (best effort); their steps.
    ``journal``: the run's reader of its step journal (``RunResources.journal``), so each pass
    reads only the steps since the last; None reads the journal whole."""
    tracker = None
    try:
        tracker = tracker_for(config)
        return tracker.log_goodput(run_dir, journal=journal) if tracker is not None else []
    except Exception as exc:  # noqa: BLE001 - audit only
        log.warning("%s: could not log the goodput of run %s: %s", _name(tracker), config.run_name, exc)
        return []


def log_model(config: RunConfig, run_dir: Path) -> dict[str, Any] | None:
    """Log the finished run's model and register it (MLflow: :mod:`tasks.records.mlflow_model`;
    best effort: the checkpoint and the DVC export hold it anyway)."""
    if not config.tracking.log_model:
        return None
    tracker = None
    try:
        tracker = tracker_for(config)
        return tracker.log_model(run_dir) if tracker is not None else None
    except Exception as exc:  # noqa: BLE001
        log.warning("%s: could not log the final model: %s", _name(tracker), exc)
        return None


def finish_run(config: RunConfig, run_dir: Path, ok: bool) -> dict[str, Any] | None:
    """Recompute the resume audit (files under ``audit/``, the backend if tracking) and end the run."""
    summary = None
    try:
        tracker = tracker_for(config)
        if tracker is None:  # the files alone
            from tasks.records.mlflow_audit import write_audit_files

            summary = write_audit_files(config, run_dir)[0].as_dict()
        else:
            summary = tracker.refresh_audit(run_dir)
            tracker.finish_run(run_dir, ok)
    except Exception as exc:  # noqa: BLE001
        log.warning("audit: could not finish the run's audit: %s", exc)
    return summary


@contextlib.contextmanager
def system_metrics(config: RunConfig, run_dir: Path) -> Iterator[None]:
    """The backend's system metrics (MLflow's: ``system/cpu_utilization_percentage``, memory,
    disk, network, GPU where there is one) logged into the training run while the flow trains,
    sampled on the machine whose workers train (the local flow; in pool mode each chunk's flow).
    Every ``tracking.system_metrics_s`` seconds; 0 turns it off.  Best effort: monitoring never
    fails a run."""
    stop: Callable[[], None] | None = None
    if config.tracking.system_metrics_s > 0:
        tracker = None
        try:
            tracker = tracker_for(config)
            stop = tracker.start_system_metrics(run_dir) if tracker is not None else None
        except Exception as exc:  # noqa: BLE001 - monitoring must never fail a chunk
            log.warning("%s: could not start the system metrics: %s", _name(tracker), exc)
            stop = None
    try:
        yield
    finally:
        if stop is not None:
            with contextlib.suppress(Exception):
                stop()


def refresh(config: RunConfig, run_dir: Path) -> None:
    """Refresh the resume audit (tags, table, timeline picture) at a chunk's end; best effort."""
    try:
        tracker = tracker_for(config)
        if tracker is not None:
            tracker.refresh_audit(run_dir)
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
    training run at the checkpoint's step; once per published step, so one point per step.
    Best effort: the checkpoint is in the remote either way."""
    from training.rundir import load_run_config

    tracker = None
    try:
        tracker = tracker_for(load_run_config(run_dir))
        if tracker is not None:
            tracker.log_metrics(run_dir, step, lag)
    except Exception as exc:  # noqa: BLE001 - audit only
        log.warning("%s: could not record the upload lag of step %d: %s", _name(tracker), step, exc)
