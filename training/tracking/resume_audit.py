"""What happened to a run, read from its own files: recoveries, failures, steps lost, a picture.

Pure reading of ``events.jsonl`` and ``metrics.jsonl``, no MLflow and no Prefect, so every tool
that reports on a run agrees: the supervisor's failure report, ``convoy status``, the export's
DVC plots and the flow's MLflow audit (:mod:`tasks.records.mlflow_audit`) all count from here.

* :func:`steps_lost` — the one definition of steps lost; :func:`trained_high_water` — how far a
  failed attempt got.
* :func:`analyse` — the audit summary (:class:`ResumeAudit`) and one row per recovery.
* :func:`render_timeline` — loss vs step with a marker at each failure and resume.

A *recovery* is a worker start (``started``/``resumed``) that follows a failure: a supervisor
``failure`` event, a ``preempted`` event, or a previous worker that never reported
``worker_done`` (killed without anyone noticing).  A worker starting the next chunk after a clean
``worker_done`` is a continuation, not a resume.  A ``checkpoint_fetched`` event before the start
(the checkpoint came from the remote, another machine's upload) gives the row its ``fetch_s``.
"""

from __future__ import annotations

import datetime as _dt
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from training.event_records import (
    CheckpointFetched,
    CheckpointSkipped,
    EventLog,
    NondeterministicResume,
    Preempted,
    ReplayMismatch,
    ReplayVerified,
    Resumed,
    Started,
    WorkerDone,
    WorkerStart,
)
from training.fsutil import atomic_replace
from training.paths import RunPaths
from training.tracking.failure_record import FailureDetails, RecordedFailure
from training.tracking.metrics import read_metric_lines


# ---------------------------------------------------------------------------------- steps lost
def steps_lost(trained_to: int | None, resumed_from: int | None) -> int | None:
    """THE definition of steps lost, used by every tool (status, chaos, MLflow, Prefect, DVC):
    the steps trained beyond the checkpoint the next worker resumes from.  No checkpoint yet means
    a resume from step 0, so a kill before the first save loses every step trained so far.
    ``trained_to`` is the high-water step of the failed attempt (:func:`trained_high_water`);
    None when nothing says how far it got."""
    if trained_to is None:
        return None
    return max(0, int(trained_to) - int(resumed_from or 0))


def trained_high_water(run_dir: str | Path, beat_step: int | None, metrics_offset: int = 0) -> int | None:
    """How far an attempt trained: the larger of its last heartbeat step and the last step it
    wrote to ``metrics.jsonl`` after byte ``metrics_offset`` (where the attempt started).  The
    metrics row is written every step, while the beat may be an interval old at a kill."""
    steps = [beat_step] if beat_step is not None else []
    try:
        for step, _ in read_metric_lines(RunPaths(run_dir).metrics, from_byte=metrics_offset):
            steps.append(step)
    except (OSError, ValueError):  # a damaged row: count the rows before it (the export reports it)
        pass
    return max(steps) if steps else None


# ---------------------------------------------------------------------------------- events → rows
#: The kinds the audit reads, in the log's order.
_READS = (CheckpointFetched, RecordedFailure, Preempted, Started, Resumed, WorkerDone, CheckpointSkipped)
_READS += (ReplayVerified, ReplayMismatch, NondeterministicResume)


def _utc(t: float | None) -> str | None:
    """``12-03 16:04:41``, UTC: a resume table's time column is narrow in MLflow's table view, and
    a full ISO time was cut before its seconds."""
    if t is None:
        return None
    return _dt.datetime.fromtimestamp(t, _dt.UTC).strftime("%m-%d %H:%M:%S")


@dataclass
class _Pending:
    """The failure no worker start has followed yet: a supervisor's ``failure``, a ``preempted``
    worker, or a worker that vanished without a report; the checkpoints its resume passed over."""

    failure: RecordedFailure | None = None
    preempted: Preempted | None = None
    unreported: bool = False
    skipped: list[CheckpointSkipped] = field(default_factory=list)


@dataclass(frozen=True)
class ResumeAudit:
    """The audit summary: recoveries, failures, steps lost, the replay check, and one row per
    recovery (the MLflow resume table's rows, by column name).  What the flow's summary, the MLflow
    run, ``convoy status``, the chaos drill and the DVC metrics count from."""

    resumes: int = 0
    failures: int = 0
    steps_lost: int = 0
    #: Whether every recovery (and a failure not resumed yet) said how many steps it lost.
    steps_lost_known: bool = True
    nondeterministic: bool = False
    nondeterministic_first_step: int | None = None
    #: Resumes whose replayed steps matched the first pass bit for bit.
    replay_verified: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The JSON-able summary (the flow's ``audit``, ``refresh_audit``'s answer)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResumeAudit:
        """Read :meth:`as_dict`'s mapping back (or the flow summary's part of it: the counts)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def analyse_events(log: EventLog) -> dict[str, Any]:
    """:func:`analyse` as its JSON-able mapping."""
    return analyse(log).as_dict()


def analyse(log: EventLog) -> ResumeAudit:
    """Pure function: the audit summary and the resume rows from the event log (in file order)."""
    rows: list[dict[str, Any]] = []
    pending: _Pending | None = None  # the failure not yet followed by a worker start
    session_open = False  # a worker started and has not reported worker_done
    current: dict[str, Any] | None = None  # the row of the running (resumed) worker session
    failures = 0
    nondet: list[NondeterministicResume] = []
    fetch: CheckpointFetched | None = None  # a download from the remote just before the next start
    for ev in log.of(*_READS):
        if isinstance(ev, CheckpointFetched):
            fetch = ev
        elif isinstance(ev, RecordedFailure):
            if pending is None or pending.failure is not None:
                failures += 1
                pending = _Pending()
            pending.failure = ev
            session_open, current = False, None
        elif isinstance(ev, Preempted) and ev.on_rank0:
            if pending is None:
                failures += 1
                pending = _Pending()
            pending.preempted = ev
            session_open, current = False, None
        elif isinstance(ev, WorkerStart) and ev.on_rank0:
            if pending is None and session_open:
                failures += 1  # the previous worker vanished without a report (e.g. SIGKILL)
                pending = _Pending(unreported=True)
            current = _row(ev, pending, fetch) if pending is not None else None
            rows += [current] if current is not None else []
            pending, session_open, fetch = None, True, None
        elif isinstance(ev, WorkerDone) and ev.on_rank0:
            session_open, current = False, None
        elif isinstance(ev, CheckpointSkipped) and pending is not None:  # the resume passing one over
            pending.skipped.append(ev)
        elif isinstance(ev, ReplayVerified | ReplayMismatch) and current is not None:
            current["values_compared"] = ev.values_compared
            current["mismatches"] = ev.mismatches
            current["replay_verified"] = isinstance(ev, ReplayVerified) and not ev.mismatches
        elif isinstance(ev, NondeterministicResume):
            nondet.append(ev)
            if current is not None:
                current["replay_verified"] = False
    return _summary(rows, failures, pending, nondet)


def _summary(
    rows: list[dict[str, Any]], failures: int, pending: _Pending | None, nondet: list[NondeterministicResume]
) -> ResumeAudit:
    """The audit summary over the resume rows.  ``pending`` is a failure no worker start has
    followed yet: its steps lost count too (the run failed and has not resumed), and without
    its own count the total is not known."""
    lost = [r["lost_steps"] for r in rows if r["lost_steps"] is not None]
    if pending and pending.failure and pending.failure.details.steps_lost is not None:
        lost.append(int(pending.failure.details.steps_lost))  # failed, not resumed (yet)
    return ResumeAudit(
        resumes=len(rows),
        failures=failures,
        steps_lost=sum(lost),
        steps_lost_known=len(lost) == len(rows) + (1 if pending else 0),
        nondeterministic=bool(nondet),
        nondeterministic_first_step=nondet[0].step if nondet else None,
        replay_verified=sum(1 for r in rows if r["replay_verified"] is True),
        rows=rows,
    )


def _failed_at(start: WorkerStart, pending: _Pending) -> int | None:
    """How far the failed worker got: its failure's high-water mark (else last beat), the
    preemption's step, or, for one that vanished, its successor's record of its last beat."""
    fail, pre = pending.failure, pending.preempted
    failed_at = fail.details.failed_at_step if fail is not None else None
    if failed_at is None and pre is not None:
        failed_at = pre.step
    if failed_at is None and pending.unreported:
        failed_at = start.previous_beat_step  # the vanished worker's last beat
    return failed_at


def _row(start: WorkerStart, pending: _Pending, fetch: CheckpointFetched | None) -> dict[str, Any]:
    fail, pre = pending.failure, pending.preempted
    details = fail.details if fail is not None else FailureDetails()
    resumed = start if isinstance(start, Resumed) else Resumed()  # "started" = from scratch
    resumed_from = start.resumed_from
    failed_at = _failed_at(start, pending)
    # an emergency checkpoint was saved at the preemption step
    lost = 0 if pre is not None and fail is None else steps_lost(failed_at, resumed_from)
    # An orphaned attempt's failure is recorded when the next flow finds it: it failed at its last sign of life.
    failed_time = (fail.last_seen or fail.time or None) if fail is not None else (pre.time if pre else None)
    skipped = [{"step": _step_of(e.checkpoint), "reason": e.reason} for e in pending.skipped]
    return {
        "time": _utc(start.time or None),
        "kind": (fail.kind if fail is not None else None) or ("preempted" if pre else "unreported"),
        "detected_after_s": details.detected_after_s,
        "failed_at_step": failed_at,
        "resumed_from_step": resumed_from,
        "lost_steps": lost,
        "recovery_s": round(start.time - failed_time, 3) if failed_time and start.time else None,
        "load_s": resumed.load_s,
        "fetch_s": fetch.fetch_s if fetch else None,  # T_fetch: the download from the remote before this start
        "checkpoint": resumed.checkpoint,
        "checkpoint_digest": resumed.digest,
        "replay_verified": None,  # filled by the session's replay_verified / mismatch events
        "values_compared": None,
        "mismatches": None,
        "passed_over": describe_passed_over(skipped or details.passed_over or []),
        "chunk": fail.chunk if fail is not None else None,
        "attempt": fail.attempt if fail is not None else None,
        "failure_time": failed_time,  # not a table column: lets `convoy chaos` match its faults
    }


def _step_of(name: Any) -> int | str | None:
    """``step-000000250`` → 250 (a name of another form is shown as it is)."""
    digits = str(name or "").removeprefix("step-")
    return int(digits) if digits.isdigit() else name


def describe_passed_over(passed: list[dict[str, Any]], limit: int = 200) -> str:
    """``step 250 (reason); step 240 (reason)``: the checkpoints a resume passed over and why
    (empty when it took the newest).  Each reason is cut at ``limit`` characters."""
    return "; ".join(f"step {p.get('step')} ({str(p.get('reason') or 'no reason recorded')[:limit]})" for p in passed)


# ---------------------------------------------------------------------------------- timeline
def read_loss(run_dir: str | Path) -> tuple[list[int], list[float]]:
    from training.tracking.metrics import metric_rows

    rows = [(step, m["loss"]) for step, m in metric_rows(run_dir) if "loss" in m]
    return [s for s, _ in rows], [float(v) for _, v in rows]


def _readable_y_range(ax: Any, loss: list[float]) -> None:
    """Keep the trained region readable: a log scale for losses spanning decades, else a y range
    from the loss after the first 5 % of steps, so a high initial loss cannot flatten the rest."""
    if not loss:
        return
    if min(loss) > 0 and max(loss) / min(loss) > 20:
        ax.set_yscale("log")
        return
    trained = loss[len(loss) // 20 :] or loss
    low, high = min(trained), max(trained)
    if max(loss) > high + (high - low):  # the first steps would take over half of the axis
        pad = 0.1 * (high - low or 1.0)
        ax.set_ylim(low - pad, high + pad)


#: Heights (axes fraction, text hanging down from there) of the failure labels: a label close to
#: another on the step axis goes one level down, so rotated labels never overlap.
LABEL_LEVELS = (0.97, 0.64, 0.31)
#: Width of one rotated label on the step axis, in pixels (a 7-point line and some air).
LABEL_WIDTH_PX = 12.0
#: Labels are drawn above the event lines and the loss (matplotlib draws lines at zorder 2).
LABEL_ZORDER = 5


def _failure_labels(rows: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """``[(step, "killed, corrupt @ 250")]``: one label per failed step, kinds joined."""
    kinds: dict[int, list[str]] = {}
    for row in rows:
        if row["failed_at_step"] is not None:
            kinds.setdefault(int(row["failed_at_step"]), []).append(str(row["kind"]))
    return [(step, f"{', '.join(dict.fromkeys(k))} @ {step}") for step, k in sorted(kinds.items())]


def place_labels(labels: list[tuple[int, str]], min_gap: float) -> list[tuple[int, str, int]]:
    """``(step, text, level)`` for each label: the first level whose previous label is at least
    ``min_gap`` steps away.  When all levels are taken nearby, the label joins the nearest one
    placed (``killed @ 250, hang @ 252``), so no two ever overlap."""
    placed: list[list[Any]] = []
    last_at: dict[int, int] = {}  # level -> index in placed
    for step, text in labels:
        free = [lv for lv in range(len(LABEL_LEVELS)) if lv not in last_at or step - placed[last_at[lv]][0] >= min_gap]
        if free:
            last_at[free[0]] = len(placed)
            placed.append([step, text, free[0]])
        else:
            placed[-1][1] += f", {text}"
    return [(int(p[0]), str(p[1]), int(p[2])) for p in placed]


def _mark_attempts(ax: Any, rows: list[dict[str, Any]]) -> list[Any]:
    """A red line at each failure, labelled with its kind and step, and a dotted green one at each
    resume; each legend entry once, however many recoveries there were.  Returns the labels."""
    failed = sorted({int(r["failed_at_step"]) for r in rows if r["failed_at_step"] is not None})
    for i, step in enumerate(failed):
        ax.axvline(step, color="tab:red", ls="-", lw=1.2, alpha=0.8, label="failure" if i == 0 else None)
    for i, step in enumerate(sorted({int(r["resumed_from_step"]) for r in rows})):
        ax.axvline(step, color="tab:green", ls=":", lw=1.5, label="resumed from" if i == 0 else None)
    x0, x1 = ax.get_xlim()
    min_gap = (x1 - x0) * LABEL_WIDTH_PX / max(ax.bbox.width, 1.0)
    return [
        ax.annotate(  # beside its line, inside the axes (never clipped at the top)
            text,
            (step, LABEL_LEVELS[level]),
            xycoords=("data", "axes fraction"),
            xytext=(3, 0),
            textcoords="offset points",
            rotation=90,
            va="top",
            ha="left",
            fontsize=7,
            color="tab:red",
            # Over every line, on white: the line of an event a few steps away (and the loss
            # curve) would otherwise cross the label's letters.
            bbox={"boxstyle": "square,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.9},
            zorder=LABEL_ZORDER,
        )
        for step, text, level in place_labels(_failure_labels(rows), min_gap)
    ]


def _label_axes(ax: Any, summary: ResumeAudit, loss: list[float], title: str) -> None:
    """Axis names, a readable y range and the run's recovery counts in the title."""
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    _readable_y_range(ax, loss)
    ax.set_title(
        f"{title}  resumes={summary.resumes} failures={summary.failures} steps_lost={summary.steps_lost}".strip(),
        fontsize=9,
    )
    ax.grid(alpha=0.3)


def _save_png_atomically(fig: Any, out_path: str | Path) -> Path:
    """Write through a temporary file and rename, so a reader never sees half a picture."""
    out = Path(out_path)
    with atomic_replace(out, durable=False) as tmp:
        fig.savefig(tmp, format="png")
    return out


def import_plotting_beside() -> threading.Thread:
    """Import the plotting library on a thread while the run trains: the timeline is drawn at the
    run's end, where importing matplotlib cost 0.9 s of a 20-step run's 3.6 s wrap-up (profiled);
    the flow's process only waits on its workers meanwhile.  Imports are safe across threads (the
    import lock): :func:`render_timeline` finds it imported, or waits for the import to finish."""

    def load() -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401

    thread = threading.Thread(target=load, name="convoy-import-plotting", daemon=True)
    thread.start()
    return thread


def render_timeline(run_dir: str | Path, summary: ResumeAudit, out_path: str | Path, title: str = "") -> Path:
    """The loss against the step with a marker at each failure and resume: one look shows where a
    run was interrupted and where it picked up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, loss = read_loss(run_dir)
    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    try:
        ax.plot(steps, loss, lw=1.0, color="tab:blue", label="loss")
        _mark_attempts(ax, summary.rows)
        _label_axes(ax, summary, loss, title)
        if steps:
            ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        return _save_png_atomically(fig, out_path)
    finally:
        plt.close(fig)
