"""The worker's remote metric backends (MLflow), built off the recovery's critical path.

Importing MLflow and reading back what the run logged so far is slow.  The history is stable
once a worker holds the run's lease (the previous writer is gone), so it is read on a thread
while the checkpoint loads and the first steps train; the metric logger keeps those steps' rows
and hands them over when the backends are ready (:meth:`StepMetricLogger.attach`).
``metrics.jsonl`` is never deferred: the replay check reads it from the first step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from training.config import RunConfig
from training.rundir import run_info
from training.tracking.metrics import DETERMINISTIC_KEYS, MetricBackend, StepMetricLogger

#: What a backend's history read gives: per backend, metric -> step -> value.
History = list[dict[str, dict[int, float]]]


def tracking_backends(config: RunConfig, run_dir: Path) -> list[MetricBackend]:
    """The remote metric backends (MLflow) of the run, connected; none when tracking is off or
    the run has no MLflow run yet."""
    backends: list[MetricBackend] = []
    if config.tracking.mlflow:
        from training.tracking.mlflow_backend import MlflowBackend  # imported lazily: slow

        run_id = (run_info(run_dir) or {}).get("mlflow_run_id")
        if run_id:
            backends.append(MlflowBackend(config, run_id, run_dir=run_dir))
    return backends


class TrackingWarmup:
    """Backends built and their history read on a thread; :meth:`result` joins it."""

    def __init__(self, backends: Callable[[], list[MetricBackend]]) -> None:
        self._result: tuple[list[MetricBackend], History] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(backends,), name="convoy-tracking", daemon=True)
        self._thread.start()

    def _run(self, backends: Callable[[], list[MetricBackend]]) -> None:
        try:
            built = backends()
            self._result = built, [b.history(DETERMINISTIC_KEYS) for b in built]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread by result()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> tuple[list[MetricBackend], History]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class DeferredTracking:
    """Rank 0's remote backends, from "not started" through "warming up" to "attached".

    Started at once when a standby built the backends while it waited (ready now); otherwise
    after the first step (:meth:`start`): the MLflow import holds the GIL long enough to double
    a restart's first step if it ran during it."""

    def __init__(self, factory: Callable[[], list[MetricBackend]], start_now: bool) -> None:
        self._factory: Callable[[], list[MetricBackend]] | None = factory
        self._warmup: TrackingWarmup | None = None
        if start_now:
            self.start()

    def start(self) -> None:
        """Build the backends on their thread (once)."""
        if self._factory is not None:
            self._warmup = TrackingWarmup(self._factory)
            self._factory = None

    def attach(self, metrics: StepMetricLogger, wait: bool) -> None:
        """Hand the backends to the logger once they are ready (``wait``: start and block for
        them, so a run that ends before its first step still logs)."""
        if wait:
            self.start()
        if self._warmup is not None and (wait or self._warmup.done()):
            metrics.attach(*self._warmup.result())
            self._warmup = None
