"""Prefect tasks at the top: the supervised chunk (``chunk``), failure hooks (``hooks``),
Prefect artifacts (``artifacts``) and the take-over of a dead flow's run (``takeover``).

The rest is grouped by concern in sub-packages, each of which says what it may import:
``supervision`` (one worker attempt, Prefect-free), ``remote`` (checkpoints that travel: DVC,
the remote index, the fetch) and ``records`` (MLflow runs, attempt runs, audit, model).
Imports go flows -> tasks -> training; inside ``tasks``: top -> {supervision, remote, records},
remote -> records.

Importing the package sets the MLflow client defaults of the orchestration's processes
(:data:`MLFLOW_DEFAULTS`) before any of its modules imports MLflow or starts a thread: set once,
here, because ``os.environ`` is not safe to change while another thread reads it.
"""

import os

#: The orchestration's MLflow client settings; a value the user set in the environment wins.
#: * A call to a frozen server: MLflow's defaults (a 120 s timeout, 7 retries with backoff) would
#:   hold a chunk task for many minutes; the calls made here are an audit and the metrics wait
#:   in ``metrics.jsonl`` (tasks/records/metric_shipping.py), so give up sooner.
#: * Telemetry off: MLflow's telemetry client sets and unsets an environment variable on a thread
#:   of its own when its endpoint cannot be reached, and a request iterating ``os.environ`` on
#:   another thread then failed with ``KeyError: '_MLFLOW_TELEMETRY_SESSION_ID'`` (seen creating
#:   a run in bench/conformance.py).
MLFLOW_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}
for _name, _value in MLFLOW_DEFAULTS.items():
    os.environ.setdefault(_name, _value)
