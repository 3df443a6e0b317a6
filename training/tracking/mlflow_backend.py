"""MLflow as a :class:`training.tracking.metrics.MetricBackend`: one MLflow run per training run.

* :func:`resolve_tracking_uri` — ``tracking.mlflow_uri`` from params, else ``$MLFLOW_TRACKING_URI``,
  else the URI already recorded in the run's ``run.json``, else ``sqlite:///<abs cwd>/mlflow.db``.
  Relative SQLite paths are made absolute, so a worker started in another directory writes to
  the same store as the flow that created the run.
* The run itself is created by the flow (:func:`tasks.mlflow_runs.ensure_mlflow_run`); a worker
  only logs into the one named in ``run.json``.
* :class:`MlflowBackend` — ``write`` only enqueues; a background thread sends the rows with
  ``MlflowClient.log_batch`` at most every ``batch_interval_s`` (or per 1000 values; split at step
  boundaries), so the logger may hand over every single step.  A call that
  fails is retried with the *same* Metric objects: the store's primary key (key, timestamp,
  step, value) makes a retried insert a no-op, so a retry never adds a second point.  Rows still
  queued when the process is SIGKILLed are lost, which is safe: the MLflow high-water mark is
  then lower and the resumed worker's :class:`~training.tracking.metrics.StepMetricLogger` writes those
  steps again (compared with ``metrics.jsonl`` first).

Imports MLflow (~3 s), so the worker imports this module lazily; it never imports Prefect or DVC.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from training.config import RunConfig
from training.paths import RunPaths
from training.rundir import run_info
from training.tracking.metrics import read_metric_lines

#: MLflow's per-request limit on metric values in one ``log_batch``.
MAX_BATCH_METRICS = 1000
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
        stored = (run_info(run_dir) or {}).get("mlflow_tracking_uri")
        if stored:
            return stored
    return default_tracking_uri()


_clients: dict[str, MlflowClient] = {}
_clients_lock = threading.Lock()


def client_for(uri: str) -> MlflowClient:
    """One client per URI per process (creating a SQLite store runs schema checks: ~0.5 s)."""
    with _clients_lock:
        if uri not in _clients:
            _clients[uri] = MlflowClient(tracking_uri=uri)
        return _clients[uri]


def split_batches(metrics: list[Metric], limit: int = MAX_BATCH_METRICS) -> list[list[Metric]]:
    """Cut a step-ordered metric list into ≤ ``limit`` chunks without splitting a step.

    Each ``log_batch`` is one transaction, so a crash between calls never leaves a step half
    logged (a step's keys are all in MLflow or none are)."""
    batches: list[list[Metric]] = []
    cur: list[Metric] = []
    i = 0
    while i < len(metrics):
        j = i
        while j < len(metrics) and metrics[j].step == metrics[i].step:
            j += 1
        group = metrics[i:j]
        if cur and len(cur) + len(group) > limit:
            batches.append(cur)
            cur = []
        cur.extend(group)
        i = j
    if cur:
        batches.append(cur)
    return batches


@dataclass(frozen=True)
class MlflowDelivery:
    """How :class:`MlflowBackend` sends: on a background thread (``asynchronous``; else
    ``log_batch`` runs in the training loop), batched every ``batch_interval_s``, each batch retried
    ``max_retries`` times before the backend gives up (the local ``metrics.jsonl`` still has it)."""

    asynchronous: bool = True
    max_retries: int = 5
    batch_interval_s: float = 5.0


class MlflowBackend:
    """MetricBackend writing ``(step, {key: value})`` rows to one MLflow run, off the training thread."""

    def __init__(
        self,
        config: RunConfig | None,
        run_id: str,
        *,
        tracking_uri: str | None = None,
        run_dir: str | Path | None = None,
        delivery: MlflowDelivery = MlflowDelivery(),
    ) -> None:
        self.run_id = run_id
        self.uri = tracking_uri or resolve_tracking_uri(config, run_dir)
        self.client = client_for(self.uri)
        self.run_dir = self._find_run_dir(config, run_dir)
        self.backfilled = 0
        self._reconciled = False
        self.max_retries = delivery.max_retries
        self.asynchronous = delivery.asynchronous
        self.write_s = 0.0  # time spent in log_batch (on the background thread when asynchronous)
        self.calls = 0
        self.values = 0
        self.error: BaseException | None = None
        self.batch_interval_s = delivery.batch_interval_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        if self.asynchronous:
            self._thread = threading.Thread(target=self._drain, name="convoy-mlflow", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ MetricBackend
    def history(self, keys: tuple[str, ...]) -> dict[str, dict[int, float]]:
        if not self._reconciled:
            self._reconciled = True
            self.reconcile()
        return self._history(keys)

    def _history(self, keys: Any) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for key in keys:
            points: dict[int, float] = {}
            for m in self.client.get_metric_history(self.run_id, key):
                points.setdefault(int(m.step), float(m.value))  # first logged value wins
            out[key] = points
        return out

    def reconcile(self) -> int:
        """Copy into MLflow the ``metrics.jsonl`` points it lacks; returns how many.

        ``metrics.jsonl`` is written synchronously before every checkpoint commit; MLflow is written
        from a queue.  A worker killed right after a commit can leave MLflow behind the checkpoint,
        and steps at or below a checkpoint are never replayed — so at start-up (the only writer of
        the run is this worker) MLflow is brought level with the local log first.  The copied
        values are the ones logged before the failure, i.e. what MLflow would have received."""
        if self.run_dir is None:
            return 0
        rows: dict[int, dict[str, float]] = {}
        for step, metrics in read_metric_lines(RunPaths(self.run_dir).metrics):
            for key, value in metrics.items():
                rows.setdefault(step, {}).setdefault(key, value)
        if not rows:
            return 0
        have = self._history(sorted({k for m in rows.values() for k in m}))
        missing = []
        for step, m in sorted(rows.items()):
            lacking = {k: v for k, v in m.items() if step not in have.get(k, {})}
            if lacking:
                missing.append((step, lacking))
        if missing:
            ts = int(time.time() * 1000)
            self._send([Metric(k, v, ts, step) for step, m in missing for k, v in sorted(m.items())])
            self.backfilled = sum(len(m) for _, m in missing)
            print(
                f"MLflow run {self.run_id}: copied {self.backfilled} value(s) of {len(missing)} step(s) from "
                f"metrics.jsonl that the tracking store lacked (a worker died before sending them)",
                flush=True,
            )
        return self.backfilled

    def _find_run_dir(self, config: RunConfig | None, run_dir: str | Path | None) -> Path | None:
        """The run directory whose ``run.json`` names this MLflow run (None: no reconciliation)."""
        candidates = [Path(run_dir)] if run_dir is not None else []
        if config is not None:
            candidates.append(config.run_dir)
        for cand in candidates:
            if (run_info(cand) or {}).get("mlflow_run_id") == self.run_id:
                return cand
        return None

    def write(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        ts = int(time.time() * 1000)
        metrics = [
            Metric(key, float(value), ts, int(step))
            for step, values in sorted(rows, key=lambda r: r[0])
            for key, value in sorted(values.items())
        ]
        if not metrics:
            return
        if self.asynchronous:
            self._queue.put(metrics)
        else:
            self._send(metrics)

    def sync(self) -> None:
        """Block until every row written so far is in MLflow (call before committing a checkpoint:
        rows of steps <= the checkpoint's step are never replayed, so they must not be lost)."""
        if self._thread is not None:
            event = threading.Event()
            self._queue.put(("sync", event))
            event.wait()

    def close(self) -> None:
        """Send everything still queued (blocks until done); the backend stays usable for history."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self.error is not None:
            print(f"WARNING: MLflow logging to {self.uri} failed: {self.error}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ extras
    def set_tags(self, tags: dict[str, Any]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()], synchronous=True)

    def tag_nondeterminism(self, rec: dict[str, Any]) -> None:
        """For the worker to call on the first replay mismatch (tag right away, not at chunk end)."""
        self.set_tags(
            {
                f"{TAG_PREFIX}nondeterministic": "true",
                f"{TAG_PREFIX}nondeterministic_first_step": rec.get("step"),
                f"{TAG_PREFIX}nondeterministic_metric": rec.get("metric"),
            }
        )

    # ------------------------------------------------------------------ internals
    def _drain(self) -> None:
        """Background sender: batches by time (``batch_interval_s``) and size (``MAX_BATCH_METRICS``),
        so a logger that hands over every step (cheap: one enqueue) still costs few ``log_batch``
        calls.  ``("sync", event)`` sends everything pending and sets the event; ``None`` ends."""
        pending: list[Metric] = []
        last = time.monotonic()
        while True:
            timeout = max(0.0, self.batch_interval_s - (time.monotonic() - last)) if pending else None
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = "tick"
            done = item is None
            if isinstance(item, list):
                pending.extend(item)
            due = done or item == "tick" or isinstance(item, tuple) or len(pending) >= MAX_BATCH_METRICS
            if due and pending:
                self._send(pending)
                pending = []
                last = time.monotonic()
            if isinstance(item, tuple):
                item[1].set()
            if done:
                return

    def _send(self, metrics: list[Metric]) -> None:
        if self.error is not None:
            return  # after a permanent failure send nothing more: MLflow keeps a gap-free prefix
        for batch in split_batches(metrics):
            delay = 0.2
            for attempt in range(self.max_retries + 1):
                t0 = time.perf_counter()
                try:
                    self.client.log_batch(self.run_id, metrics=batch, synchronous=True)
                    self.calls += 1
                    self.values += len(batch)
                    break
                except Exception as exc:  # noqa: BLE001 - logging must never kill training
                    if attempt == self.max_retries:
                        self.error = exc
                        print(
                            f"WARNING: MLflow log_batch of {len(batch)} values failed after {attempt + 1} tries: {exc}",
                            file=sys.stderr,
                            flush=True,
                        )
                        return
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
                finally:
                    self.write_s += time.perf_counter() - t0
