"""Step-aligned, exactly-once metric logging with replay verification (docs/architecture.md, invariant 5).

A resumed worker recomputes the steps between its checkpoint and the failure.  Those steps were
(partly) logged before the failure, so instead of logging them again — a second point per step
is what makes tracker charts zig-zag — :class:`StepMetricLogger` compares the recomputed
deterministic values with what was logged and reports any difference as non-determinism.
Steps past the high-water mark are buffered and written in batches (one call per
``flush_every`` steps), which is what keeps logging cheap.

Backends implement :class:`MetricBackend`; the worker's one is :class:`JsonlBackend`
(``metrics.jsonl`` in the run directory, the run's metric journal).  MLflow gets the journal's
rows from the supervising process (``tasks/records/metric_shipping.py``), never from the worker.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from training.events import Event, append_event
from training.paths import RunPaths

#: Metrics that are a pure function of the state, so a replay must reproduce them bit for bit.
DETERMINISTIC_KEYS = ("loss", "lr", "grad_norm", "val_loss")


def same_value(a: float, b: float) -> bool:
    """Equal, NaN included: an AMP float16 step the GradScaler skips logs a NaN or inf grad norm,
    and its bitwise-equal replay must not be called non-deterministic."""
    return a == b or (math.isnan(a) and math.isnan(b))


def _text_lines(path: Path, tail_bytes: int | None, from_byte: int = 0) -> tuple[list[str], str]:
    """The file's lines from byte ``from_byte`` on, or only those wholly inside its last
    ``tail_bytes``; a line cut at the window's start is dropped (it is not torn, just partly
    outside the window).  Also how to name a line in an error (``path:N``, or ``line N of path
    after byte B``)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - tail_bytes) if tail_bytes is not None else min(max(0, from_byte), size)
        if start:
            f.seek(start - 1)
            cut = f.read(1) != b"\n"  # the window starts inside a line
        else:
            f.seek(0)
            cut = False
        lines = f.read().decode(errors="replace").splitlines()[1 if cut else 0 :]
    where = f"{path}: line {{}} after byte {start}" if start else f"{path}:{{}}"
    return lines, where


def read_metric_lines(
    path: str | Path, *, tail_bytes: int | None = None, from_byte: int = 0
) -> Iterator[tuple[int, dict[str, float]]]:
    """Every ``(step, metrics)`` row of a ``metrics.jsonl`` in file order (a replayed step may
    appear more than once; callers keep the first).  The one rule for a torn line: only the last
    line may be cut short (a kill during the append) and it is skipped; a bad line anywhere else
    means the file was damaged and is an error naming the line.  ``tail_bytes``: read only the
    file's end (live status of a long run: the file grows every step); ``from_byte``: read from
    there (one attempt's rows: where the file ended when it started)."""
    path = Path(path)
    if not path.exists():
        return
    lines, where = _text_lines(path, tail_bytes, from_byte)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            yield int(rec["step"]), {k: float(v) for k, v in rec.get("metrics", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if number == len(lines):
                return  # torn by a kill mid-append; JsonlBackend cuts it off when it next opens
            raise ValueError(
                f"{where.format(number)}: not a metrics row ({exc}); the file was edited or damaged"
            ) from None


@dataclass(frozen=True)
class JournalRow:
    """One row of ``metrics.jsonl`` as a shipper reads it: the step, its values and the wall-clock
    time the worker logged it (ms since the epoch; None in rows written before it was recorded)."""

    step: int
    metrics: dict[str, float]
    time_ms: int | None


def read_journal(path: str | Path, from_byte: int = 0) -> tuple[list[JournalRow], int]:
    """The complete rows of ``metrics.jsonl`` from byte ``from_byte`` on, and the byte after the
    last of them: where the next read starts.  A line still being appended (no newline yet) is
    left for the next read, so a shipper following a live file never sees half a row; a complete
    line that does not parse means the file was damaged and is an error naming it."""
    path = Path(path)
    if not path.exists():
        return [], from_byte
    with open(path, "rb") as f:
        f.seek(from_byte)
        data = f.read()
    end = data.rfind(b"\n") + 1
    rows: list[JournalRow] = []
    for number, line in enumerate(data[:end].decode(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            metrics = {k: float(v) for k, v in rec.get("metrics", {}).items()}
            stamp = rec.get("time_ms")
            rows.append(JournalRow(int(rec["step"]), metrics, int(stamp) if stamp is not None else None))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{path}: line {number} after byte {from_byte}: not a metrics row ({exc}); "
                "the file was edited or damaged"
            ) from None
    return rows, from_byte + end


def metric_rows(run_dir: str | Path) -> list[tuple[int, dict[str, float]]]:
    """``metrics.jsonl`` as (step, metrics) sorted by step; the first value of a step wins."""
    by_step: dict[int, dict[str, float]] = {}
    for step, metrics in read_metric_lines(RunPaths(run_dir).metrics):
        by_step.setdefault(step, metrics)
    return sorted(by_step.items())


class MetricBackend(Protocol):
    def history(self, keys: tuple[str, ...]) -> dict[str, dict[int, float]]: ...
    def write(self, rows: list[tuple[int, dict[str, float]]]) -> None: ...
    def close(self) -> None: ...


class JsonlBackend:
    """Append-only ``metrics.jsonl``; a torn last line (kill during a write) is cut off."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()

    def _repair(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            with open(self.path, "r+b") as f:
                f.truncate(cut)

    def history(self, keys: tuple[str, ...]) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {k: {} for k in keys}
        for step, metrics in read_metric_lines(self.path):
            for k in keys:
                if k in metrics:
                    out[k][step] = metrics[k]
        return out

    def write(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        # The time each row was logged travels with it: the shipper stamps the MLflow point with
        # it, so a row sent twice (a retry, a second shipper after a crash) is the same point and
        # the store keeps one (its key is metric, timestamp, step, value).
        now = int(time.time() * 1000)
        blob = "".join(
            json.dumps({"step": s, "metrics": m, "time_ms": now}, sort_keys=True) + "\n" for s, m in rows
        ).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, blob)
        finally:
            os.close(fd)

    def close(self) -> None:
        pass


class StepMetricLogger:
    """Fan-out to backends; each (metric, step) is written at most once per backend.

    The worker's only backend is ``metrics.jsonl`` (invariant 12: no network client runs in the
    training process); what reaches MLflow is shipped from that file by the supervising process
    (``tasks/records/metric_shipping.py``)."""

    def __init__(
        self,
        backends: list[MetricBackend],
        run_dir: str | Path,
        flush_every: int = 50,
        exact: bool = True,
        hold: int = 0,
    ) -> None:
        #: Rows whose loss is not finite wait, up to this many in a row (``training.loop.nonfinite``
        #: rule 2): a streak that trips the watch after a resume is dropped with its state.
        self.hold = hold
        self._held: list[tuple[int, dict[str, float]]] = []
        #: False after a world-size change: replayed values are expected to differ slightly, so
        #: the largest difference is recorded instead of a non-determinism warning.
        self.exact = exact
        self.max_abs_diff = 0.0
        self.backends = backends
        self.run_dir = Path(run_dir)
        self.flush_every = flush_every
        self._buffer: list[tuple[int, dict[str, float]]] = []
        self._logged: list[dict[str, dict[int, float]]] = [b.history(DETERMINISTIC_KEYS) for b in backends]
        self._high: list[int] = [max((max(h, default=0) for h in hist.values()), default=0) for hist in self._logged]
        self.replayed = 0
        self.mismatches: list[dict[str, object]] = []
        self._start_high = max(self._high, default=0)
        self._verdict_sent = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._held.append((step, metrics))
        if self.hold and not math.isfinite(metrics.get("loss", 0.0)) and len(self._held) <= self.hold:
            return
        held, self._held = self._held, []
        for row in held:
            self._log_now(*row)

    def drop_held(self) -> list[int]:
        """Forget the rows held (their state was refused: ``training.loop.nonfinite`` rule 3); their steps."""
        steps, self._held = [s for s, _ in self._held], []
        return steps

    def _log_now(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self._start_high:
            self._verify_replay(step, metrics)
        elif self.replayed:
            self.report_verdict()  # replay is over: record it now, a second kill must not lose it
        self._buffer.append((step, metrics))
        if len(self._buffer) >= self.flush_every:
            self.flush()

    def log_extra(self, step: int, metrics: dict[str, float]) -> None:
        """Add values to a step already logged in this process (e.g. the chosen interval)."""
        if self._held and self._held[-1][0] == step:
            self._held[-1][1].update(metrics)
        elif self._buffer and self._buffer[-1][0] == step:
            self._buffer[-1][1].update(metrics)
        else:
            self._buffer.append((step, dict(metrics)))

    def _verify_replay(self, step: int, metrics: dict[str, float]) -> None:
        for hist in self._logged:
            for key in DETERMINISTIC_KEYS:
                before = hist.get(key, {}).get(step)
                if before is None or key not in metrics:
                    continue
                self.replayed += 1
                if not self.exact:
                    self.max_abs_diff = max(self.max_abs_diff, abs(before - metrics[key]))
                elif not same_value(before, metrics[key]):
                    rec = {"step": step, "metric": key, "logged": before, "replayed": metrics[key]}
                    self.mismatches.append(rec)
                    if len(self.mismatches) == 1:
                        # The MLflow tags follow from this event (the chunk's audit refresh).
                        append_event(self.run_dir, Event.NONDETERMINISTIC_RESUME, **rec)
                        print(
                            f"WARNING: non-deterministic resume at step {step}: {key} was {before!r}, "
                            f"replay gave {metrics[key]!r}",
                            flush=True,
                        )

    def flush(self) -> None:
        if not self._buffer:
            return
        rows, self._buffer = self._buffer, []
        for i, backend in enumerate(self.backends):
            fresh = [(s, m) for s, m in rows if s > self._high[i]]
            if fresh:
                backend.write(fresh)
                self._high[i] = fresh[-1][0]

    def report_verdict(self) -> None:
        """One event per resume saying whether the replayed steps matched what was logged."""
        if self._verdict_sent or not self.replayed:
            return
        self._verdict_sent = True
        if not self.exact:
            append_event(
                self.run_dir, Event.REPLAY_AFTER_RESIZE, values_compared=self.replayed, max_abs_diff=self.max_abs_diff
            )
        else:
            append_event(
                self.run_dir,
                Event.REPLAY_VERIFIED if not self.mismatches else Event.REPLAY_MISMATCH,
                values_compared=self.replayed,
                mismatches=len(self.mismatches),
            )

    def close(self) -> None:
        held, self._held = self._held, []  # a run ending inside a streak: its rows are what happened
        for row in held:
            self._log_now(*row)
        self.report_verdict()
        self.flush()
        for b in self.backends:
            b.close()
