"""MLflow as a :class:`training.metrics.MetricBackend`: one MLflow run per training run.

* :func:`resolve_tracking_uri` — ``tracking.mlflow_uri`` from params, else ``$MLFLOW_TRACKING_URI``,
  else the URI already recorded in the run's ``run.json``, else ``sqlite:///<abs cwd>/mlflow.db``.
  Relative SQLite paths are made absolute, so a worker started in another directory writes to
  the same store as the flow that created the run.
* :func:`ensure_mlflow_run` — creates the MLflow run of a training run once (name = run_name,
  ``convoy.*`` tags, params logged once) and stores its id and URI in ``run.json``; later calls,
  from any process or attempt, reuse it (or the id a checkpoint manifest carries, after a pull).
* :class:`MlflowBackend` — ``write`` only enqueues; a background thread sends the rows with
  ``MlflowClient.log_batch`` at most every ``batch_interval_s`` (or per 1000 values; split at step
  boundaries), so the logger may hand over every single step.  A call that
  fails is retried with the *same* Metric objects: the store's primary key (key, timestamp,
  step, value) makes a retried insert a no-op, so a retry never adds a second point.  Rows still
  queued when the process is SIGKILLed are lost, which is safe: the MLflow high-water mark is
  then lower and the resumed worker's :class:`~training.metrics.StepMetricLogger` writes those
  steps again (compared with ``metrics.jsonl`` first).

Imports MLflow (~3 s), so the worker imports this module lazily; it never imports Prefect or DVC.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from training.config import RunConfig
from training.metrics import read_metric_lines
from training.paths import RunPaths
from training.rundir import run_info, update_run_info

#: MLflow's per-request limit on metric values in one ``log_batch``.
MAX_BATCH_METRICS = 1000
MAX_BATCH_PARAMS = 100
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


def default_artifact_location(uri: str, experiment: str) -> str | None:
    """Artifacts of a SQLite store go next to the database (``<db dir>/mlartifacts/<experiment>``).

    MLflow's own default is ``./mlruns`` of whatever directory the *creating* process ran in;
    tying it to the database keeps a run's artifacts with its metrics.  Servers decide themselves.
    """
    prefix = "sqlite:///"
    if uri.startswith(prefix) and ":memory:" not in uri:
        db = Path(uri[len(prefix) :])
        return (db.parent / "mlartifacts" / experiment).resolve().as_uri()
    return None


def ensure_experiment(client: MlflowClient, name: str, uri: str = "") -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=default_artifact_location(uri, name))
    except MlflowException:  # created concurrently by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def flatten_params(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested config dict → ``{"train.lr": "0.003", ...}`` (MLflow params are flat strings)."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(flatten_params(v, key))
            else:
                out[key] = str(v)[:6000]
    else:
        out[prefix or "value"] = str(data)[:6000]
    return out


def _run_exists(client: MlflowClient, run_id: str) -> bool:
    try:
        run = client.get_run(run_id)
    except MlflowException:
        return False
    if run.info.lifecycle_stage == "deleted":
        client.restore_run(run_id)
    return True


def run_id_from_checkpoints(run_dir: str | Path) -> str | None:
    """The MLflow run id recorded in the newest checkpoint manifest that has one (``mlflow_run_id``).

    On another machine the checkpoints arrive (``convoy pull``) without ``run.json``; the id in the
    manifest keeps every resume logging into the same MLflow run."""
    root = RunPaths(run_dir).checkpoints
    if not root.is_dir():
        return None
    for path in sorted(root.glob("step-*/manifest.json"), reverse=True):
        try:
            run_id = json.loads(path.read_text()).get("mlflow_run_id")
        except (OSError, ValueError):
            continue
        if run_id:
            return str(run_id)
    return None


def lineage_tags(parent: dict[str, Any] | None) -> dict[str, str]:
    """``convoy.parent_*`` tags of a run forked from another (``--from``): the parent's run,
    step, digest, MLflow run id (the link to it) and DVC hash."""
    if not parent:
        return {}
    keys = {
        "run_name": "parent_run",
        "step": "parent_step",
        "digest": "parent_digest",
        "mlflow_run_id": "parent_mlflow_run_id",
        "dvc_md5": "parent_dvc_md5",
    }
    return {f"{TAG_PREFIX}{tag}": str(parent[key]) for key, tag in keys.items() if parent.get(key) is not None}


def ensure_mlflow_run(config: RunConfig, run_dir: str | Path | None = None) -> str:
    """The MLflow run id of this training run, creating the run (and recording it) if needed.

    Idempotent: the id stored in ``run.json`` is reused when it exists in the tracking store.  A
    stored id the store does not know (another tracking URI, a deleted database) gets a fresh
    run and a warning — the training run itself is unaffected.
    """
    run_dir = Path(run_dir) if run_dir is not None else config.run_dir
    uri = resolve_tracking_uri(config, run_dir)
    client = client_for(uri)
    info = run_info(run_dir) or {}
    run_id = info.get("mlflow_run_id") or run_id_from_checkpoints(run_dir)
    if run_id and info.get("mlflow_tracking_uri", uri) == uri and _run_exists(client, run_id):
        if info.get("mlflow_run_id") != run_id or info.get("mlflow_tracking_uri") != uri:
            update_run_info(run_dir, mlflow_run_id=run_id, mlflow_tracking_uri=uri)
        return run_id
    if run_id:
        print(
            f"WARNING: MLflow run {run_id} of {run_dir} is not in {uri}; creating a new MLflow run",
            file=sys.stderr,
            flush=True,
        )
    exp_id = ensure_experiment(client, config.tracking.experiment, uri)
    tags = {
        "mlflow.runName": config.run_name,
        f"{TAG_PREFIX}run_name": config.run_name,
        f"{TAG_PREFIX}fingerprint": config.fingerprint(),
        f"{TAG_PREFIX}run_dir": str(run_dir.resolve()),
        f"{TAG_PREFIX}task": config.task,
        f"{TAG_PREFIX}total_steps": str(config.train.total_steps),
        f"{TAG_PREFIX}resumes": "0",
        f"{TAG_PREFIX}failures": "0",
        f"{TAG_PREFIX}steps_lost": "0",
        **lineage_tags(info.get("parent")),
    }
    run = client.create_run(exp_id, run_name=config.run_name, tags=tags)
    run_id = run.info.run_id
    params = [Param(k, v) for k, v in sorted(flatten_params(config.model_dump(mode="json")).items())]
    for i in range(0, len(params), MAX_BATCH_PARAMS):
        client.log_batch(run_id, params=params[i : i + MAX_BATCH_PARAMS], synchronous=True)
    update_run_info(run_dir, mlflow_run_id=run_id, mlflow_tracking_uri=uri, mlflow_experiment_id=exp_id)
    return run_id


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
