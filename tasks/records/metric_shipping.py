"""Ship the worker's metric journal (``metrics.jsonl``) to the run's MLflow run, from outside the
worker (docs/architecture.md, invariant 12).

Why not from the worker: an HTTP client's retry loop runs beside training and draws its backoff
jitter from Python's process-wide ``random`` (urllib3's ``Retry``), the generator convoy saves as
training state.  With a tracking server down for a few seconds, a run logged from inside the
worker ended with every loss right and the checkpoint's ``rng.python.state`` wrong.  So the worker
only appends rows to ``metrics.jsonl`` (a local file it writes anyway, synchronously, before each
checkpoint commit) and the process that supervises it — the chunk task — follows that file and
sends what MLflow lacks.  What the shipper's own retries draw from ``random`` moves nothing.

Exactly one point per (metric, step), whatever fails:

* The journal holds each step once: a resumed worker compares its replayed steps with it instead
  of writing them again (:class:`training.tracking.metrics.StepMetricLogger`).
* Each row carries the time the worker logged it and every shipper stamps the MLflow point with
  it, so a row sent twice — a retry after a lost reply, a second shipper after a chunk task died,
  a request that reached a frozen server and is answered once it thaws — is the *same* point,
  which MLflow's SQL store keeps once (its key is metric, timestamp, step and value).
* A shipper starts by asking MLflow which steps each metric already has (the first time it meets
  the metric) and sends only the others: a new chunk task re-reads the whole journal but sends
  only what no earlier one delivered.

Each chunk attempt's MLflow run gets the points of its own steps too (:meth:`MetricShipper.mirror`):
its charts show the window it trained, live, so a failed attempt's loss is on its own page.  The
same rule holds there: each point once, stamped with the worker's time.

The shipper never gives up while the worker trains: MLflow unreachable only means rows wait in
the journal (said once per outage, and once when it is back).  At a chunk's end :meth:`stop`
waits a bounded time for the rest; what is still unsent then is sent by the next chunk's shipper.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config import RunConfig
from training.paths import RunPaths
from training.run_identity import RunInfo
from training.rundir import run_info
from training.tracking.metrics import JournalRow, read_journal

#: MLflow's per-request limit on metric values in one ``log_batch``.
MAX_BATCH_METRICS = 1000


#: Rows kept after they were read, so an attempt mirrored a little late (a pipelined worker that
#: trained past its boundary before the next chunk's task adopted it) still gets its first steps.
RECENT_ROWS = 20_000


@dataclass(frozen=True)
class Mirror:
    """An attempt's MLflow run that also gets the points of steps ``first``..``last``."""

    run_id: str
    first: int
    last: int

    def wants(self, step: int) -> bool:
        return self.first <= step <= self.last


@dataclass(frozen=True)
class ShipReport:
    """What a shipper did: values delivered, values still waiting (in the journal), and the last
    error if MLflow could not be reached at the end."""

    shipped: int
    waiting: int
    error: str | None


def split_batches(metrics: list[Any], limit: int = MAX_BATCH_METRICS) -> list[list[Any]]:
    """Cut a step-ordered metric list into ≤ ``limit`` chunks without splitting a step.

    Each ``log_batch`` is one transaction, so a crash between calls never leaves a step half
    logged (a step's keys are all in MLflow or none are)."""
    batches: list[list[Any]] = []
    cur: list[Any] = []
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


class MetricShipper:
    """Follows one run's ``metrics.jsonl`` on a thread (``convoy-ship``) and sends its rows to one
    MLflow run; owned by the chunk task that supervises the worker (:meth:`for_run`)."""

    def __init__(
        self,
        client: Callable[[], Any],
        run_id: str,
        journal: Path,
        *,
        poll_s: float = 0.5,
        say: Callable[[str], None] = print,
    ) -> None:
        self._client_factory = client
        self.run_id = run_id
        self.journal = Path(journal)
        self.poll_s = poll_s
        self.say = say
        self.shipped = 0
        self._offset = 0
        self._known: dict[str, set[int]] = {}  # per metric: the steps MLflow held when first asked
        self._pending: list[Any] = []
        self._mirrors: list[Mirror] = []
        self._mirror_pending: dict[str, list[Any]] = {}  # attempt run id → its points not sent yet
        self._recent: deque[JournalRow] = deque(maxlen=RECENT_ROWS)
        self._lock = threading.Lock()  # mirrors are added by the chunk task's thread
        self._error: str | None = None
        self._deadline: float | None = None  # set by stop(): the last moment to keep trying
        self._stop = threading.Event()
        self._jitter = random.Random()  # its own generator: the process-wide one is not drawn from
        self._thread = threading.Thread(target=self._follow, name="convoy-ship", daemon=True)

    @classmethod
    def for_run(cls, config: RunConfig, run_dir: Path, say: Callable[[str], None] = print) -> MetricShipper | None:
        """The shipper of a run, started; None when MLflow is off or the run has no MLflow run."""
        run_id = (run_info(run_dir) or RunInfo()).mlflow_run_id if config.tracking.mlflow else None
        if not run_id:
            return None
        from tasks.records.mlflow_client import client_for, resolve_tracking_uri  # imports MLflow: slow

        uri = resolve_tracking_uri(config, run_dir)
        return cls(lambda: client_for(uri), run_id, RunPaths(run_dir).metrics, say=say).start()

    def mirror(self, run_id: str, first_step: int, last_step: int) -> None:
        """Send the points of steps ``first_step``..``last_step`` to the attempt run ``run_id``
        as well, those read already included (from the recent rows)."""
        mirror = Mirror(run_id, first_step, last_step)
        with self._lock:
            self._mirrors = [m for m in self._mirrors if m.run_id != run_id] + [mirror]
            self._queue_mirrored(list(self._recent), [mirror])

    def _queue_mirrored(self, rows: list[JournalRow], mirrors: list[Mirror]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for m in mirrors:
            points = [
                Metric(key, value, row.time_ms or now, row.step)
                for row in rows
                if m.wants(row.step)
                for key, value in sorted(row.metrics.items())
            ]
            if points:
                self._mirror_pending.setdefault(m.run_id, []).extend(points)

    def start(self) -> MetricShipper:
        self._thread.start()
        return self

    def stop(self, drain_s: float) -> ShipReport:
        """Send what is left, trying for at most ``drain_s`` seconds; what is still unsent stays in
        the journal for the next shipper.  Returns what was done."""
        self._deadline = time.monotonic() + drain_s
        self._stop.set()
        # A request to a frozen server can outlast the deadline: the thread is then left to finish
        # it (a daemon; a late delivery is the same point as the next shipper's, see above).
        self._thread.join(timeout=drain_s + 1.0)
        waiting = len(self._pending) + self._unread_values()
        if waiting:
            self.say(
                f"MLflow: {waiting} metric value(s) not delivered yet ({self._error or 'still sending'}); "
                "they stay in metrics.jsonl and the next chunk sends them"
            )
        return ShipReport(self.shipped, waiting, self._error)

    # ------------------------------------------------------------------ the thread
    def _follow(self) -> None:
        client = None
        delay = self.poll_s
        while True:
            stopping = self._stop.is_set()
            try:
                client = client or self._client_factory()
                self._read_new(client)
                self._send(client)
                if self._error is not None:
                    self.say(f"MLflow reachable again: metric shipping resumed ({self.shipped} value(s) sent so far)")
                    self._error = None
                delay = self.poll_s
            except Exception as exc:  # noqa: BLE001 - MLflow down: rows wait in the journal
                if self._error is None:
                    self.say(
                        f"MLflow unreachable ({type(exc).__name__}: {str(exc)[:200]}); metrics wait in "
                        "metrics.jsonl and are sent when it is back"
                    )
                self._error = f"{type(exc).__name__}: {str(exc)[:200]}"
                delay = min(5.0, delay * 2) * (0.5 + self._jitter.random())
            if stopping and (not self._pending and self._error is None or self._past_deadline()):
                return
            if stopping:
                time.sleep(min(delay, max(0.0, (self._deadline or 0) - time.monotonic())))
            else:
                self._stop.wait(delay)

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _read_new(self, client: Any) -> None:
        """Queue the journal's new rows, less the (metric, step) points MLflow already holds.  The
        read position moves only once they are queued: MLflow failing while it is asked for a
        metric's history leaves them to be read again."""
        from mlflow.entities import Metric

        rows, offset = read_journal(self.journal, self._offset)
        for key in sorted({k for row in rows for k in row.metrics}):
            self._history(client, key)
        now = int(time.time() * 1000)
        for row in rows:
            for key, value in sorted(row.metrics.items()):
                if row.step not in self._known[key]:
                    self._pending.append(Metric(key, value, row.time_ms or now, row.step))
        self._offset = offset
        with self._lock:
            self._recent.extend(rows)
            if rows:
                newest = rows[-1].step
                self._mirrors = [m for m in self._mirrors if m.last >= newest - RECENT_ROWS]
            self._queue_mirrored(rows, self._mirrors)

    def _history(self, client: Any, key: str) -> set[int]:
        if key not in self._known:
            self._known[key] = {int(m.step) for m in client.get_metric_history(self.run_id, key)}
        return self._known[key]

    def _send(self, client: Any) -> None:
        """Send the queued points, a batch at a time; a failure keeps the rest queued."""
        for batch in split_batches(self._pending):
            client.log_batch(self.run_id, metrics=batch, synchronous=True)
            del self._pending[: len(batch)]
            self.shipped += len(batch)
        with self._lock:
            mirrored = {run_id: list(points) for run_id, points in self._mirror_pending.items()}
        for run_id, points in mirrored.items():
            for batch in split_batches(points):
                if not self._send_mirrored(client, run_id, batch):
                    break
            with self._lock:
                if not self._mirror_pending.get(run_id):
                    self._mirror_pending.pop(run_id, None)

    def _send_mirrored(self, client: Any, run_id: str, batch: list[Any]) -> bool:
        """One batch to an attempt run; False when the store refused the run (deleted, say): its
        points are dropped, since the training run's own points are what must arrive.  An
        unreachable store raises, as for those."""
        from mlflow.exceptions import MlflowException

        try:
            client.log_batch(run_id, metrics=batch, synchronous=True)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "INVALID_STATE"):
                with self._lock:
                    self._mirror_pending.pop(run_id, None)
                    self._mirrors = [m for m in self._mirrors if m.run_id != run_id]
                return False
            raise
        with self._lock:
            del self._mirror_pending[run_id][: len(batch)]
        return True

    def _unread_values(self) -> int:
        rows: list[JournalRow]
        try:
            rows, _ = read_journal(self.journal, self._offset)
        except (OSError, ValueError):
            return 0
        return sum(len(r.metrics) for r in rows)
