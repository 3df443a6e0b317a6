"""Goodput: the share of a run's wall-clock time spent on training steps it kept; badput: the rest, by cause.

Read from the run's own files (``events.jsonl`` and the step journal ``metrics.jsonl``), no MLflow
and no Prefect, so the summary of ``convoy train``, ``convoy status``, the chaos verdict and the
MLflow metrics (``tasks/records/goodput_metrics.py``) show one number.  The bucket names are those
of Google's ``ml-goodput-measurement`` where they fit.  Definitions, cited in code as "rule n":

1. **Wall-clock** (``wall_s``): from the run's first ``flow_started`` (its first event or journal
   row when no flow ran it: a bare worker, a bench) to ``until``: the moment asked about (a
   chunk's end, now for a run in progress), by default the run's last event or row.  A flow run
   that ended by itself (``flow_done``, ``flow_failed``, ``flow_crashed``) stops the clock until
   the next ``flow_started``: nobody was running the run (finished, given up, paused by a person).
   A flow run that *died* (no end event: killed with its machine) does not stop it: the gap to
   the next flow run is ``infrastructure_recovery`` (rule 7).  What a flow process does before its
   ``flow_started`` (Prefect's start-up, creating the MLflow run) is not counted.
2. A **worker life** is one rank-0 ``started``/``resumed`` event.  It resumed at step r (0 for
   ``started``) and trained to h, the furthest step shown by its journal rows, checkpoints,
   ``first_step``, its ``failure`` (``trained_to``), ``worker_done``/``preempted`` event or its
   successor's ``previous_beat_step``.  A step's time is its first journal row's ``step_time_s``
   (a replay repeats the same computation); a step without a row takes the mean.  ``eval_time_s``
   is timed apart: ``step_time_s`` does not include it.
3. **productive** (``productive_s``): the ``step_time_s`` of steps 1..H, H the last life's h:
   every step the run trained and kept, once however often it was trained.
   ``goodput = productive_s / wall_s``.
4. ``evaluation``: the ``eval_time_s`` of those kept steps (in-loop validation).
5. ``wasted_progress``: steps trained and then rolled back.  Life i trained (r_i, h_i]; when a
   later life resumes from m < h_i (m the lowest later resume step), (max(r_i, m), h_i] is lost:
   its ``step_time_s`` + ``eval_time_s``.  The step in flight at a kill has no row (rule 11).
6. ``program_startup``: a life from its start until it begins restoring (its event's time minus
   ``load_s``).  Its start is the latest ``attempt_started`` before that (the chunk task's
   attempt: the remote check, the resume point, the spawn or fork, import and build), never
   before the previous life's end nor its flow run's start.  The run's first start is one; a
   warm standby's own start-up, off the critical path, is not; a parked worker that the next
   chunk adopts is the same life, with no start-up.
7. ``infrastructure_recovery``: from a life's failure to the next life's start (rule 6): detection,
   reaping, the retry's wait and any attempt that failed before restoring.  The failure's time is
   its death, ``detected_at - detected_after_s`` of its first ``failure`` event (the exit, the last
   beat or the last progress, so detection latency is included), the ``last_seen`` beat of an
   ``orphaned`` one, a ``preempted`` event, or, for a worker that vanished unseen, its last row or
   event.  Also the gap after a flow run that died, from its last sign to the next ``flow_started``.
8. ``checkpoint_save``: the loop's stall in disk saves (``stall_s`` of ``checkpoint_saved``; the
   persist runs beside training) and in memory-tier snapshots (``memory_snapshot_s``, on the
   journal row of the step after each: with ``memory_every_steps: auto`` they cost between
   ``memory_min_overhead`` and ``memory_max_overhead`` of the step time, as Young/Daly sets it).
9. ``checkpoint_restore``: ``load_s`` of each rank-0 ``resumed`` (disk or memory tier, verified).
10. ``data_loading`` is not a bucket: the worker times ``next(batches)`` inside ``step_time_s`` and
   nothing it records tells the wait for a batch from the step, so that wait counts as productive
   rather than being guessed.
11. ``other``: ``wall_s`` minus productive and every bucket above: orchestration between chunk
   tasks (Prefect's task runs; the boundary versioning and acknowledgement a pipelined worker
   waits for), the flow's start before its first attempt, a clean worker exit to the next start
   (``pipeline: false``), the loop's own work between steps (journal, heartbeat: not recorded
   per step), a memory snapshot just before a kill (its row never came), the step in flight at
   a kill, and replayed steps that no row or checkpoint shows done yet (a run in progress).  It
   is never below 0 (clamped: event times are rounded to the millisecond).

Rules 6, 7 and 9 are time intervals, clipped to the wall-clock and made disjoint (restore, then
start-up, then recovery); rules 3, 4, 5 and 8 are durations the worker measured.  So productive +
every bucket = ``wall_s``.  Chunk-end points (:func:`chunk_points`) cut the files at the chunk's
``chunk_done`` time, so a point is the same whichever process computes it, and when.
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from training import event_records as ev
from training.events import Event, FailureKind
from training.paths import RunPaths
from training.tracking.failure_record import RecordedFailure
from training.tracking.metrics import read_journal

#: The badput buckets, in the order they are shown (rules 4-9, 11).
BUCKETS = (
    "program_startup",
    "checkpoint_save",
    "checkpoint_restore",
    "wasted_progress",
    "infrastructure_recovery",
    "evaluation",
    "other",
)
_FLOW_END = (ev.FlowDone, ev.FlowFailed, ev.FlowCrashed)
#: The kinds goodput reads; every other line counts by its time alone (a sign of life, rule 1).
_READS = (*_FLOW_END, ev.FlowStarted, ev.AttemptStarted, ev.Started, ev.Resumed, ev.FirstStep, ev.CheckpointSaved)
_READS += (ev.WorkerDone, ev.Preempted, RecordedFailure, ev.ChunkDone)
#: Events a new flow process writes before its ``flow_started`` (reaping, take-over, fetch): not
#: a sign of the dead flow before it (rule 1).
_PREAMBLE = {
    Event.FLOW_TAKEN_OVER,
    Event.STALE_WORKER_STOPPED,
    Event.CHECKPOINT_FETCHED,
    Event.REMOTE_CHECKPOINT_REFUSED,
    Event.CHECKPOINT_SKIPPED,
}
Span = tuple[float, float]


class StepRow(NamedTuple):
    """What goodput needs of one journal row: step, when it was logged (s; None in old rows), times."""

    step: int
    time: float | None
    step_s: float
    eval_s: float
    #: The memory-tier snapshot taken just before this row's step (rule 8).
    snapshot_s: float = 0.0


@dataclass(frozen=True)
class Goodput:
    """A run's goodput up to ``until``: ``goodput`` = ``productive_s`` / ``wall_s``, and the rest by
    bucket (:data:`BUCKETS`); ``step``: the step it has trained and kept."""

    goodput: float
    wall_s: float
    productive_s: float
    badput_s: dict[str, float] = field(default_factory=dict)
    step: int = 0
    until: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Goodput:
        return cls(
            goodput=float(data["goodput"]),
            wall_s=float(data["wall_s"]),
            productive_s=float(data["productive_s"]),
            badput_s={str(k): float(v) for k, v in (data.get("badput_s") or {}).items()},
            step=int(data.get("step") or 0),
            until=data.get("until"),
        )

    def largest(self, n: int = 3) -> list[tuple[str, float]]:
        """The ``n`` largest badput buckets that are not zero, largest first."""
        ranked = sorted(self.badput_s.items(), key=lambda kv: -kv[1])
        return [(k, v) for k, v in ranked[:n] if v > 0]

    def describe(self, n: int = 3) -> str:
        """``0.912 of 46.2 s; badput: infrastructure_recovery 19.1 s, program_startup 4.1 s``."""
        text = f"{self.goodput:.3f} of {self.wall_s:.1f} s"
        worst = ", ".join(f"{k} {v:.1f} s" if v >= 0.1 else f"{k} {v * 1000:.0f} ms" for k, v in self.largest(n))
        return text + (f"; badput: {worst}" if worst else "")


# ---------------------------------------------------------------------------------- the journal
class StepJournal:
    """One run's journal (``metrics.jsonl``) as :class:`StepRow`, read on from where this reader
    stopped (a new file, or a shorter one, is read again).  Held and passed down by whoever reads
    goodput again (the flow's run resources, ``convoy status --follow``), so the rows live as long
    as their reader, not the process: parsing is most of a goodput pass (0.69 s of 0.78 s for
    100,000 steps; reading on, 1 ms).  Thread-safe: a flow's threads may share one."""

    KEPT = ("step_time_s", "eval_time_s", "memory_snapshot_s")  # the metrics a StepRow keeps, in its order

    def __init__(self, run_dir: str | Path) -> None:
        self.path, self._lock = RunPaths(run_dir).metrics, threading.Lock()
        self._ino, self._offset, self._rows = -1, 0, list[StepRow]()  # -1: no file read yet

    def rows(self) -> list[StepRow]:
        """Every row of the journal so far (a copy: the caller may keep it)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        with self._lock:
            if self._ino != st.st_ino or st.st_size < self._offset:
                self._ino, self._offset, self._rows = st.st_ino, 0, []
            new, self._offset = read_journal(self.path, from_byte=self._offset)
            for r in new:
                stamp = r.time_ms / 1000 if r.time_ms is not None else None
                self._rows.append(StepRow(r.step, stamp, *(float(r.metrics.get(k, 0.0)) for k in self.KEPT)))
            return list(self._rows)


def journal_steps(run_dir: str | Path, journal: StepJournal | None = None) -> list[StepRow]:
    """The journal's rows: read on by ``journal`` (the caller's reader of this run), else read whole."""
    return (journal if journal is not None else StepJournal(run_dir)).rows()


# ---------------------------------------------------------------------------------- intervals
def _union(spans: Iterable[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersect(spans: list[Span], within: list[Span]) -> list[Span]:
    return _union((max(a, c), min(b, d)) for a, b in spans for c, d in within if min(b, d) > max(a, c))


def _subtract(spans: list[Span], minus: list[Span]) -> list[Span]:
    out = []
    for a, b in spans:
        pieces = [(a, b)]
        for c, d in minus:
            pieces = [p for x, y in pieces for p in ((x, min(y, c)), (max(x, d), y)) if p[1] > p[0]]
        out.extend(pieces)
    return _union(out)


def _length(spans: list[Span]) -> float:
    return sum(b - a for a, b in spans)


# ---------------------------------------------------------------------------------- rule 1
def _last_sign(events: Sequence[ev.EventRecord], rows: Sequence[StepRow], after: float, before: float) -> float:
    """The last event or row of a flow run that died, in (after, before): not what the next flow
    process wrote before its ``flow_started`` (rule 1)."""
    times = [after]
    for e in events:
        orphan = isinstance(e, RecordedFailure) and e.kind == FailureKind.ORPHANED
        if after < e.time < before and e.event_kind not in _PREAMBLE and not orphan:
            times.append(e.time)
    times += [r.time for r in rows if r.time is not None and after < r.time < before]
    return max(times)


def wall_spans(
    events: Sequence[ev.EventRecord], rows: Sequence[StepRow], until: float
) -> tuple[list[Span], list[Span]]:
    """(the wall-clock spans, the gaps after a flow run that died) up to ``until`` (rule 1)."""
    # A flow's clock starts when it did (``started_at``, before its MLflow run), not at its event.
    starts = [e.clock_start for e in events if isinstance(e, ev.FlowStarted)]
    first = [e.time for e in events[:1]] + [r.time for r in rows[:1] if r.time is not None]
    if not starts:
        return ([(min(first), until)] if first else []), []
    spans: list[Span] = []
    gaps: list[Span] = []
    begin = starts[0]
    for nxt in [*starts[1:], None]:
        stop = until if nxt is None else nxt
        ended = [e.time for e in events if isinstance(e, _FLOW_END) and begin <= e.time <= stop]
        if ended:
            spans.append((begin, min(max(ended), until)))
        elif nxt is not None:
            gaps.append((_last_sign(events, rows, begin, nxt), nxt))
            continue  # the clock runs on through the gap
        else:
            spans.append((begin, until))
        if nxt is not None:
            begin = nxt
    return _union(spans + gaps), gaps


# ---------------------------------------------------------------------------------- rules 2, 6, 7
@dataclass
class _Life:
    """One worker life (rule 2): restore [begin, restored], resumed at ``step``, trained to ``high``."""

    begin: float
    restored: float
    step: int
    high: int
    start: float = 0.0
    #: when it ended, by a clean exit or its death (None: it runs on, as far as anyone knows)
    end: float | None = None
    #: when its failure happened (rule 7): a death, a preemption, or the last sign of a worker that
    #: vanished; also a failed attempt after a clean exit (it failed before restoring)
    failed_at: float | None = None
    #: where its failure event says the next life resumes (``last_committed_step``)
    rolled_back_to: int | None = None


def _follow_life(life: _Life, events: Sequence[ev.EventRecord], row_steps: Sequence[StepRow], last: bool) -> None:
    """How far ``life`` trained and how it ended, from the events and rows of its span (rule 2)."""
    signs = [life.restored] + [r.time for r in row_steps[-1:] if r.time is not None]
    life.high = max([life.high] + [r.step for r in row_steps])
    exited = None
    for e in events:
        if isinstance(e, ev.CheckpointSaved | ev.FirstStep) or (isinstance(e, ev.WorkerDone) and e.on_rank0):
            life.high = max(life.high, int(e.step or 0))
            signs.append(e.time)
            if isinstance(e, ev.WorkerDone) and exited is None:
                exited = e.time
        elif isinstance(e, RecordedFailure) and life.failed_at is None:
            d = e.details
            life.high = max(life.high, int(d.trained_to or d.last_beat_step or 0))
            life.failed_at = max(life.restored, e.death)
            if d.last_committed_step is not None:
                life.rolled_back_to = int(d.last_committed_step)
        elif isinstance(e, ev.Preempted) and e.on_rank0 and life.failed_at is None:
            life.high = max(life.high, int(e.step or 0))
            life.failed_at = e.time
    if life.failed_at is None and exited is None and not last:  # a successor restored: it vanished unseen
        life.failed_at = max(signs)
    ends = [t for t in (exited, life.failed_at) if t is not None]
    life.end = min(ends) if ends else None


def _starts(lives: list[_Life], events: Sequence[ev.EventRecord]) -> None:
    """Each life's start (rule 6)."""
    marks = [e.time for e in events if isinstance(e, ev.AttemptStarted | ev.FlowStarted)]
    previous_end: float | None = None
    for life in lives:
        before = [t for t in marks if t <= life.begin]
        if previous_end is not None and previous_end <= life.begin:
            before.append(previous_end)
        life.start = min(life.begin, max(before)) if before else life.begin
        previous_end = life.end


def worker_lives(events: Sequence[ev.EventRecord], rows: Sequence[StepRow]) -> list[_Life]:
    """The run's worker lives (rule 2), each with its start, how far it trained and how it ended;
    ``events`` sorted by time."""
    starts = [e for e in events if isinstance(e, ev.WorkerStart) and e.on_rank0]
    lives = []
    for e in starts:
        step = e.resumed_from
        lives.append(_Life(begin=e.time - e.restore_s, restored=e.time, step=step, high=step))
    event_times = [e.time for e in events]
    timed = sorted((r for r in rows if r.time is not None), key=lambda r: r.time or 0.0)
    row_times = [r.time or 0.0 for r in timed]
    for i, life in enumerate(lives):
        stop = lives[i + 1].begin if i + 1 < len(lives) else float("inf")
        span = events[bisect_left(event_times, life.restored) : bisect_left(event_times, stop)]
        own = timed[bisect_left(row_times, life.restored) : bisect_left(row_times, stop)]
        _follow_life(life, span, own, last=i + 1 == len(lives))
    for life, nxt in zip(lives, starts[1:], strict=False):
        if nxt.previous_beat_step is not None:
            life.high = max(life.high, int(nxt.previous_beat_step))
    _starts(lives, events)
    return lives


# ---------------------------------------------------------------------------------- rules 3-5
class _StepTimes:
    """Each step's ``step_time_s`` and ``eval_time_s``: its first row's, the mean step time for a
    step without a row (rule 2)."""

    def __init__(self, rows: Sequence[StepRow]) -> None:
        self.by_step: dict[int, tuple[float, float]] = {}
        for r in rows:
            self.by_step.setdefault(r.step, (r.step_s, r.eval_s))
        n = len(self.by_step)
        self.mean = sum(v[0] for v in self.by_step.values()) / n if n else 0.0

    def over(self, lo: int, hi: int) -> tuple[float, float]:
        """(step time, eval time) of the steps lo+1..hi."""
        steps = evals = 0.0
        for s in range(lo + 1, hi + 1):
            d, e = self.by_step.get(s, (self.mean, 0.0))
            steps += d
            evals += e
        return steps, evals


def _kept(lives: list[_Life]) -> int:
    """H (rule 3): how far the last life trained, less what its failure will roll back."""
    if not lives:
        return 0
    last = lives[-1]
    return min(last.high, last.rolled_back_to) if last.rolled_back_to is not None else last.high


def _wasted(lives: list[_Life], times: _StepTimes) -> float:
    """Rule 5: each life's steps above the lowest later resume (for the last life: the resume its
    failure event names)."""
    total, lowest_later = 0.0, float("inf")
    for life in reversed(lives):
        floor = lowest_later if lowest_later < float("inf") else life.rolled_back_to
        if floor is not None and floor < life.high:
            d, e = times.over(max(life.step, int(floor)), life.high)
            total += d + e
        lowest_later = min(lowest_later, life.step)
    return total


# ---------------------------------------------------------------------------------- the figures
def _intervals(lives: list[_Life], gaps: list[Span], until: float) -> dict[str, list[Span]]:
    """Rules 6, 7, 9 as disjoint intervals: restore, then start-up, then recovery."""
    restore = _union((life.begin, life.restored) for life in lives)
    startup = _subtract(_union((life.start, life.begin) for life in lives), restore)
    recovery = [(a.failed_at, b.start) for a, b in zip(lives, lives[1:], strict=False) if a.failed_at is not None]
    if lives and lives[-1].failed_at is not None:  # no successor (yet): recovering
        recovery.append((lives[-1].failed_at, until))
    recovery = _subtract(_subtract(_union(recovery + gaps), restore), startup)
    return {"checkpoint_restore": restore, "program_startup": startup, "infrastructure_recovery": recovery}


def _last_time(events: Sequence[ev.EventRecord], rows: Sequence[StepRow]) -> float | None:
    times = [e.time for e in events] + [r.time for r in rows[-1:] if r.time is not None]
    return max(times) if times else None


def compute(log: ev.EventLog, rows: Sequence[StepRow], until: float | None = None) -> Goodput | None:
    """The run's :class:`Goodput` from its events and journal rows as they were at ``until`` (None:
    the last event or row); None for a run with no wall-clock time yet, or whose journal is not
    on this machine (pool mode without shared storage: the nodes hold it)."""
    return _compute(_timeline(log), rows, until)


def _timeline(log: ev.EventLog) -> list[ev.EventRecord]:
    """Every line of the log, the kinds goodput reads typed, sorted by time."""
    return sorted(log.all(*_READS), key=lambda e: e.time)


def _compute(events: Sequence[ev.EventRecord], rows: Sequence[StepRow], until: float | None) -> Goodput | None:
    """:func:`compute` over the log's :func:`_timeline`."""
    until = _last_time(events, rows) if until is None else until
    if until is None:
        return None
    events = [e for e in events if e.time <= until]
    rows = [r for r in rows if r.time is None or r.time <= until]
    spans, gaps = wall_spans(events, rows, until)
    wall = _length(spans)
    if wall <= 0:
        return None
    lives = worker_lives(events, rows)
    times = _StepTimes(rows)
    kept = _kept(lives)
    if kept and not times.by_step:  # steps trained, no journal here (pool mode without shared storage)
        return None
    productive, evaluation = times.over(0, kept)
    badput = {name: _length(_intersect(iv, spans)) for name, iv in _intervals(lives, gaps, until).items()}
    badput["checkpoint_save"] = sum(
        float(e.stall_s or 0.0)
        for e in events
        if isinstance(e, ev.CheckpointSaved) and any(a <= e.time <= b for a, b in spans)
    ) + sum(r.snapshot_s for r in rows if r.snapshot_s and (r.time is None or any(a <= r.time <= b for a, b in spans)))
    badput["wasted_progress"] = _wasted(lives, times)
    badput["evaluation"] = evaluation
    badput["other"] = max(0.0, wall - productive - sum(badput.values()))
    return Goodput(
        goodput=round(productive / wall, 4),
        wall_s=round(wall, 3),
        productive_s=round(productive, 3),
        badput_s={name: round(badput[name], 3) for name in BUCKETS},
        step=kept,
        until=round(until, 3),
    )


def run_goodput(run_dir: str | Path, until: float | None = None, journal: StepJournal | None = None) -> Goodput | None:
    """:func:`compute` over the run's ``events.jsonl`` and ``metrics.jsonl`` (read on by ``journal`` if given)."""
    return compute(ev.EventLog.read(run_dir), journal_steps(run_dir, journal), until)


# ---------------------------------------------------------------------------------- chunk ends
@dataclass(frozen=True)
class Point:
    """Goodput at a chunk's end step: cumulative, and ``interval``: the goodput of the wall-clock
    since the previous chunk end (the productive time gained over the wall time passed)."""

    step: int
    time: float
    cumulative: Goodput
    interval: float

    def metrics(self) -> dict[str, float]:
        """The MLflow metrics of this point: ``goodput``, ``goodput_interval``, ``badput/<bucket>``."""
        out = {"goodput": self.cumulative.goodput, "goodput_interval": self.interval}
        return out | {f"badput/{k}": v for k, v in self.cumulative.badput_s.items()}


def chunk_ends(log: ev.EventLog) -> list[tuple[int, float]]:
    """(end step, time) of each chunk's first ``chunk_done``, by step."""
    done: dict[int, float] = {}
    for e in sorted(log.of(ev.ChunkDone), key=lambda e: e.time):
        if e.end_step is not None:
            done.setdefault(int(e.end_step), e.time)
    return sorted(done.items())


def chunk_points(log: ev.EventLog, rows: Sequence[StepRow], only: Iterable[int] | None = None) -> list[Point]:
    """The :class:`Point` of each chunk end (of the end steps in ``only``), the files cut at the
    chunk's ``chunk_done``: the same values whichever process computes them, and when."""
    ends = chunk_ends(log)
    timeline = _timeline(log)
    wanted = set(only) if only is not None else {s for s, _ in ends}
    memo: dict[int, Goodput | None] = {}

    def at(i: int) -> Goodput | None:
        if i not in memo:
            memo[i] = _compute(timeline, rows, until=ends[i][1])
        return memo[i]

    out = []
    for i, (step, t) in enumerate(ends):
        g = at(i) if step in wanted else None
        if g is None:
            continue
        prev = at(i - 1) if i > 0 else None
        dw = g.wall_s - prev.wall_s if prev is not None else 0.0
        interval = (g.productive_s - prev.productive_s) / dw if prev is not None and dw > 0 else g.goodput
        out.append(Point(step, t, g, round(min(1.0, max(0.0, interval)), 4)))
    return out
