"""The tracking seam: :class:`Tracker`, what the flow and its chunk tasks ask of a tracking backend.

Why: every record of a run (its run and attempt runs, step metrics, the resume audit, the model)
used to be written by MLflow code called from the orchestration by name, so a second backend
(W&B, TensorBoard) touched every caller.  Now the callers go through
:mod:`tasks.records.run_records`, which picks the run's tracker with :func:`tracker_for` and
applies the one policy of every record but the run's creation (best effort: a warning, never a
failed chunk); a tracker only says how its backend does each thing.  MLflow's is
:class:`tasks.records.mlflow_tracker.MlflowTracker`.

Adding a backend ``<name>``: one module ``tasks/records/<name>_tracker.py`` with a function
``tracker(config: RunConfig) -> Tracker`` (a class with the methods below; it may raise, the
dispatcher catches), and the config value ``tracking.backend: <name>``.  Nothing else names a
backend: :func:`tracker_for` imports the module by that name.  Import the backend's client
inside the methods, not at the module's top: :func:`tracker_for` runs in every flow and chunk.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from training.config import RunConfig
from training.tracking.attempts import AttemptId, outcome_label
from training.tracking.failure_record import FailureDetails, RecordedFailure

if TYPE_CHECKING:
    from tasks.records.metric_shipping import ShipReport
    from training.tracking.goodput import StepJournal


@dataclass(frozen=True)
class AttemptOutcome:
    """How one chunk attempt ended, as :meth:`Tracker.end_attempt` records it.

    ``status``: FINISHED, FAILED or KILLED; ``failure_kind``: the supervisor's name for the failure
    (``killed``, ``hang``...); ``steps``: steps the attempt committed; ``seconds``: its duration;
    ``failure``: the supervisor's details of a failed attempt; ``end_step``: the step a successful
    attempt committed.
    """

    status: str
    failure_kind: str | None = None
    steps: int = 0
    seconds: float = 0.0
    failure: FailureDetails | None = None
    end_step: int | None = None

    def label(self) -> str:
        """The outcome in the attempt's name: ``killed 290→200``, ``done→400``."""
        if self.failure is None and self.failure_kind is None:
            return outcome_label(None, resumed_from=self.end_step)
        failure = self.failure or FailureDetails()
        return outcome_label(self.failure_kind or "failed", failure.failed_at_step, failure.last_committed_step or 0)


class MetricFollower(Protocol):
    """What follows the worker's ``metrics.jsonl`` into the backend from outside the worker
    (invariant 12): one per run, held by the run's resources from the first chunk to the last."""

    #: Where it reports an outage and its end: the current chunk's log (set by each chunk).
    say: Callable[[str], None]

    def mirror(self, run_id: str, first_step: int, last_step: int) -> None:
        """Send the points of steps ``first_step``..``last_step`` to the attempt run ``run_id``
        (as :meth:`Tracker.start_attempt` returned it) as well, those already read included."""

    def stop(self, drain_s: float) -> ShipReport:
        """Send what is left for at most ``drain_s`` seconds; what is unsent stays in the journal."""


@runtime_checkable
class Tracker(Protocol):
    """A tracking backend, as the orchestration uses it (see the module docstring).

    Made by :func:`tracker_for`.  The run's resources hold the one every chunk task of the run
    opens and ends its attempt runs with (``RunResources.tracker``), so it may hold what it opened
    (an attempt run's address, say) between its own calls, never in a module; the other records
    are asked of a tracker made for the call, so making one must cost nothing.  Every ``run_dir``
    is the run's directory; the backend's run ids it returns are recorded in the run's events
    (``attempt_started``), so they must be strings.  Params are logged where a run is opened:
    the run's settings by :meth:`begin_run`, an attempt's by :meth:`end_attempt`.
    """

    #: The backend's name in warnings ("MLflow: could not end attempt run ...").
    name: str

    def begin_run(self, run_dir: Path) -> str | None:
        """Create the training run's run in the backend, or find the one ``run.json`` names, and
        record its id there; idempotent.  Raising stops the flow before it trains: a run whose
        records cannot be opened is reported at once, not after a day of training."""

    def start_attempt(self, run_dir: Path, attempt: AttemptId) -> str | None:
        """Open the run of one chunk attempt under the training run (running, with its Prefect
        flow and task runs); returns its id, which :meth:`end_attempt` and
        :meth:`MetricFollower.mirror` take."""

    def end_attempt(
        self, run_dir: Path, attempt_run: str, outcome: AttemptOutcome, attempt: AttemptId | None = None
    ) -> None:
        """Close the attempt run ``attempt_run`` with ``outcome``: its status, steps, seconds
        and, for a failure, why it failed and where the next attempt resumes.  With ``attempt``:
        named after its outcome, its params logged."""

    def close_orphaned_attempts(self, run_dir: Path, orphans: Sequence[RecordedFailure]) -> list[str]:
        """Close KILLED every attempt run a dead flow left running (none is alive: the caller holds
        the run's lock), each described from its ``orphaned`` failure in ``orphans``; their ids."""

    def link_flow_run(self, run_dir: Path, tags: dict[str, str]) -> None:
        """Tag the training run with its Prefect flow runs (``tags``) and describe how each ended."""

    def follow_metrics(self, run_dir: Path, say: Callable[[str], None]) -> MetricFollower | None:
        """Start following the worker's ``metrics.jsonl`` into the training run, each (metric,
        step) once whatever fails; None when the run has no run in the backend."""

    def log_metrics(self, run_dir: Path, step: int, metrics: dict[str, float]) -> None:
        """Log ``metrics`` at ``step`` in the training run now (one point per step: the caller
        calls once per step)."""

    def log_goodput(self, run_dir: Path, journal: StepJournal | None = None) -> list[int]:
        """Log the goodput point of every chunk end the backend lacks (computed from the run's
        files: the same values whoever computes them); returns the steps logged.  ``journal``: the
        run's reader of its step journal, which reads on from where it stopped (a pass at each
        chunk end would otherwise parse the whole journal again: 0.7 s at 100,000 steps); None:
        read it whole."""

    def start_system_metrics(self, run_dir: Path) -> Callable[[], None]:
        """Start sampling this machine's CPU, memory, disk, network and GPU into the training run;
        returns what stops it."""

    def refresh_audit(self, run_dir: Path) -> dict[str, Any]:
        """Recompute the resume audit from the run's files, write it under ``audit/`` and publish
        it (counts, table, timeline picture); idempotent, so it converges after a crash.  Returns
        the audit's summary; a failure to publish is said, not raised."""

    def log_model(self, run_dir: Path) -> dict[str, Any] | None:
        """Log the finished run's final model (and register it); None when it is logged already."""

    def finish_run(self, run_dir: Path, ok: bool) -> None:
        """Mark the training run finished (``ok``) or failed: the flow's last record."""


def tracker_for(config: RunConfig) -> Tracker | None:
    """The run's tracker: ``tracking.backend``'s module ``tasks.records.<backend>_tracker`` makes
    it; None when ``tracking.mlflow`` is false (then nothing is tracked, as before there was a
    second backend to choose).  Imported by name, so no module lists the backends."""
    if not config.tracking.mlflow:
        return None
    module = importlib.import_module(f"tasks.records.{config.tracking.backend}_tracker")
    tracker: Tracker = module.tracker(config)
    return tracker
