"""Where the run's MLflow tracking store is, and one client per store per process.

* :func:`resolve_tracking_uri` — ``tracking.mlflow_uri`` from params, else ``$MLFLOW_TRACKING_URI``,
  else the URI already recorded in the run's ``run.json``, else ``sqlite:///<abs cwd>/mlflow.db``.
  Relative SQLite paths are made absolute, so a chunk task started in another directory writes to
  the same store as the flow that created the run.
* :func:`client_for` — creating a SQLite store runs schema checks (~0.5 s): one client per URI.

Only the orchestration talks to MLflow (the flow, the chunk tasks and their metric shipper,
``tasks/records/metric_shipping.py``); the worker never imports it (docs/architecture.md, invariant 12).
Imports MLflow (~3 s): callers import this module lazily.  The client settings of these
processes (timeouts, retries, telemetry) are set when the ``tasks`` package is imported
(``tasks.MLFLOW_DEFAULTS``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from mlflow.tracking import MlflowClient

from training.config import RunConfig
from training.run_identity import RunInfo
from training.rundir import run_info

TAG_PREFIX = "convoy."


def _absolute_sqlite(uri: str) -> str:
    """``sqlite:///rel.db`` → ``sqlite:////abs/rel.db`` (``sqlite:////abs`` and others unchanged)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/") and ":memory:" not in uri:
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri


def default_tracking_uri() -> str:
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def resolve_tracking_uri(config: RunConfig | None = None, run_dir: str | Path | None = None) -> str:
    """params ``tracking.mlflow_uri`` > ``$MLFLOW_TRACKING_URI`` > run.json > ``sqlite:///<cwd>/mlflow.db``."""
    if config is not None and config.tracking.mlflow_uri:
        return _absolute_sqlite(config.tracking.mlflow_uri)
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return _absolute_sqlite(env)
    if run_dir is None and config is not None:
        run_dir = config.run_dir
    if run_dir is not None:
        stored = (run_info(run_dir) or RunInfo()).mlflow_tracking_uri
        if stored:
            return stored
    return default_tracking_uri()


class _Clients:
    """The process's clients by URI (a lock: the flow, its chunk tasks and shippers are threads)."""

    def __init__(self) -> None:
        self._by_uri: dict[str, MlflowClient] = {}
        self._lock = threading.Lock()

    def get(self, uri: str) -> MlflowClient:
        with self._lock:
            if uri not in self._by_uri:
                self._by_uri[uri] = MlflowClient(tracking_uri=uri)
            return self._by_uri[uri]


_CLIENTS = _Clients()


def client_for(uri: str) -> MlflowClient:
    """One client per URI per process: a cache of connections, not a registry of run state."""
    return _CLIENTS.get(uri)
