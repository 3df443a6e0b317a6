"""MLflow as the run's tracking backend (``tracking.backend: mlflow``): :class:`MlflowTracker`.

Why a class over the MLflow modules: the orchestration no longer calls them by name, it asks the
run's :class:`tasks.records.tracker.Tracker` (through :mod:`tasks.records.run_records`, which
catches and warns), so a second backend is a module beside this one.  Each method hands over to
the module that does the work: the training run (:mod:`tasks.records.mlflow_runs`), attempt runs
and the resume audit (:mod:`tasks.records.mlflow_audit`), the model
(:mod:`tasks.records.mlflow_model`), step metrics (:mod:`tasks.records.metric_shipping`), goodput
(:mod:`tasks.records.goodput_metrics`).  They are imported inside the methods: MLflow takes ~3 s
to import, and making a tracker must not cost that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.records.tracker import AttemptOutcome, MetricFollower
from training.config import RunConfig
from training.run_identity import RunInfo
from training.rundir import run_info
from training.tracking.attempts import AttemptId
from training.tracking.failure_record import RecordedFailure

if TYPE_CHECKING:
    from training.tracking.goodput import StepJournal


class MlflowTracker:
    """The :class:`tasks.records.tracker.Tracker` of MLflow, for one run's ``config``."""

    name = "MLflow"

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        #: Attempt run id → the tracking URI it was opened in, so :meth:`end_attempt` ends it in
        #: that store; held by whoever holds this tracker (the run's resources), not by a module.
        self._attempt_uris: dict[str, str] = {}

    def begin_run(self, run_dir: Path) -> str | None:
        from tasks.records.mlflow_runs import ensure_mlflow_run

        return ensure_mlflow_run(self.config, run_dir)

    def start_attempt(self, run_dir: Path, attempt: AttemptId) -> str | None:
        from tasks.records.mlflow_audit import start_attempt
        from tasks.records.mlflow_client import resolve_tracking_uri

        run_id = start_attempt(self.config, run_dir, attempt)
        if run_id:
            self._attempt_uris[run_id] = resolve_tracking_uri(self.config, run_dir)
        return run_id

    def end_attempt(
        self, run_dir: Path, attempt_run: str, outcome: AttemptOutcome, attempt: AttemptId | None = None
    ) -> None:
        from tasks.records.mlflow_audit import end_attempt

        uri = self._attempt_uris.get(attempt_run)
        end_attempt(attempt_run, outcome, config=self.config, run_dir=run_dir, attempt=attempt, uri=uri)
        self._attempt_uris.pop(attempt_run, None)

    def close_orphaned_attempts(self, run_dir: Path, orphans: Sequence[RecordedFailure]) -> list[str]:
        from tasks.records.mlflow_audit import close_running_attempts

        return close_running_attempts(self.config, run_dir, orphans)

    def link_flow_run(self, run_dir: Path, tags: dict[str, str]) -> None:
        from tasks.records.mlflow_audit import run_description
        from tasks.records.mlflow_runs import set_run_tags

        set_run_tags(self.config, run_dir, {**tags, "mlflow.note.content": run_description(run_dir)})

    def follow_metrics(self, run_dir: Path, say: Callable[[str], None]) -> MetricFollower | None:
        from tasks.records.metric_shipping import MetricShipper

        return MetricShipper.for_run(self.config, run_dir, say=say)

    def log_metrics(self, run_dir: Path, step: int, metrics: dict[str, float]) -> None:
        """Into the MLflow run ``run.json`` names; nothing when it names none."""
        run_id = (run_info(run_dir) or RunInfo()).mlflow_run_id
        if not run_id:
            return
        from mlflow.entities import Metric

        from tasks.records.mlflow_client import client_for, resolve_tracking_uri

        ts = int(time.time() * 1000)
        points = [Metric(key, float(value), ts, int(step)) for key, value in sorted(metrics.items())]
        client_for(resolve_tracking_uri(self.config, run_dir)).log_batch(run_id, metrics=points, synchronous=True)

    def log_goodput(self, run_dir: Path, journal: StepJournal | None = None) -> list[int]:
        from tasks.records import goodput_metrics

        return goodput_metrics.log_points(self.config, run_dir, journal)

    def start_system_metrics(self, run_dir: Path) -> Callable[[], None]:
        """MLflow's own monitor (``system/cpu_utilization_percentage``, ...), every
        ``tracking.system_metrics_s`` seconds (``$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` wins);
        its step is MLflow's sample counter, continued across flow runs."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        from tasks.records.mlflow_client import resolve_tracking_uri
        from tasks.records.mlflow_runs import ensure_mlflow_run

        run_id = ensure_mlflow_run(self.config, run_dir)
        uri = resolve_tracking_uri(self.config, run_dir)
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no start/stop chatter
        monitor = SystemMetricsMonitor(
            run_id, sampling_interval=self.config.tracking.system_metrics_s, resume_logging=True, tracking_uri=uri
        )
        monitor.start()
        return monitor.finish

    def refresh_audit(self, run_dir: Path) -> dict[str, Any]:
        from tasks.records.mlflow_audit import refresh_audit

        return refresh_audit(self.config, run_dir)

    def log_model(self, run_dir: Path) -> dict[str, Any] | None:
        from tasks.records.mlflow_audit import client_and_parent
        from tasks.records.mlflow_model import log_final_model

        client, run_id, _ = client_and_parent(self.config, run_dir)
        return log_final_model(self.config, run_dir, client, run_id)

    def finish_run(self, run_dir: Path, ok: bool) -> None:
        from tasks.records.mlflow_audit import finish_run

        finish_run(self.config, run_dir, "FINISHED" if ok else "FAILED")


def tracker(config: RunConfig) -> MlflowTracker:
    """What :func:`tasks.records.tracker.tracker_for` calls for ``tracking.backend: mlflow``."""
    return MlflowTracker(config)
