"""Goodput in the run's MLflow run: step-aligned metrics at each chunk end, exactly once.

At each chunk's end step the run's MLflow run (the parent run, ``run.json``'s ``mlflow_run_id``)
gets ``goodput`` (cumulative: the run as it stood at that chunk's end), ``goodput_interval`` (the
goodput of the wall-clock since the previous chunk end) and ``badput/<bucket>`` (cumulative
seconds), computed by :mod:`training.tracking.goodput` from the run's files cut at the chunk's
``chunk_done``: the same values whichever process computes them, and when.

Exactly once per (metric, step), across resumes and flow runs: before logging, the ``goodput``
history of the MLflow run says which chunk end steps have their point, and only the others are
logged, each point's metrics in one ``log_batch`` stamped with the chunk end's time.  A chunk end
whose flow died before logging it is logged by the next flow at its next chunk end (or its
summary).  Off the path between two chunk tasks: the run's resources ask the run's tracker
(:func:`tasks.records.run_records.log_goodput`, MLflow's calling :func:`log_points`) on a thread
of their own (``RunResources.goodput``, :class:`tasks.records.background.OneAtATime`), and the
flow joins it and logs what is left before its summary.  Both pass the run's
:class:`~training.tracking.goodput.StepJournal` (``RunResources.journal``), which reads the
step journal on from where it stopped: read whole, it is most of a pass (0.7 s at 100,000
steps).  Best effort: a tracking failure is a warning, never a failed run;
``tracking.mlflow: false`` logs nothing.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from training.config import RunConfig
from training.event_records import EventLog
from training.run_identity import RunInfo
from training.rundir import run_info
from training.tracking.goodput import StepJournal, chunk_ends, chunk_points, journal_steps

log = logging.getLogger("convoy.tracking")

#: The metric whose history says which chunk ends are logged.
GOODPUT = "goodput"
#: One logging pass at a time in this process (the flow's thread and its summary).
_passing = threading.Lock()


def log_points(config: RunConfig, run_dir: Path, journal: StepJournal | None = None) -> list[int]:
    """Log the point of each chunk end the MLflow run does not have yet; returns their steps.
    ``journal``: the run's reader of ``metrics.jsonl`` (reads on); None: the journal read whole."""
    if not config.tracking.mlflow:
        return []
    with _passing:
        try:
            run_id = (run_info(run_dir) or RunInfo()).mlflow_run_id
            return _log_missing(config, run_dir, run_id, journal) if run_id else []
        except Exception as exc:  # noqa: BLE001 - audit only
            log.warning("MLflow: could not log the goodput of run %s: %s", config.run_name, exc)
            return []


def _log_missing(config: RunConfig, run_dir: Path, run_id: str, journal: StepJournal | None) -> list[int]:
    from mlflow.entities import Metric

    from tasks.records.mlflow_client import client_for, resolve_tracking_uri

    log = EventLog.read(run_dir)
    ends = [step for step, _ in chunk_ends(log)]
    if not ends:
        return []
    client = client_for(resolve_tracking_uri(config, run_dir))
    have = {m.step for m in client.get_metric_history(run_id, GOODPUT)}
    missing = [step for step in ends if step not in have]
    logged = []
    for point in chunk_points(log, journal_steps(run_dir, journal), only=missing) if missing else []:
        stamp = int(point.time * 1000)
        metrics = [Metric(k, float(v), stamp, point.step) for k, v in sorted(point.metrics().items())]
        client.log_batch(run_id, metrics=metrics, synchronous=True)  # the point whole, or not at all
        logged.append(point.step)
    return logged
