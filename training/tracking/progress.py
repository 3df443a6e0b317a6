"""Where a run stands right now, read from its run directory alone (no Prefect, no MLflow).

Why from files: ``convoy status``, the live line of ``convoy train`` and a person on another
terminal must agree, and they must work while a worker trains (the heartbeat and ``metrics.jsonl``
move every step, a checkpoint only every N steps), after a kill with no flow left, and on a
pulled clone.  State:

``running``        a fresh heartbeat (younger than ``heartbeat.timeout_s``) whose pid is alive
                   on this host (a beat of another host: fresh is enough), or a live flow holding
                   the run's lock (between two workers, or waiting to retry one).
``finished``       the newest verified checkpoint is at ``train.total_steps``.
``failed``         not running, and the flow gave up (a ``chunk_failed`` / ``flow_failed`` /
                   ``flow_crashed`` event after the last start).
``dead``           not running and not finished, and the last beat was not a clean end: a stale
                   beat or a pid gone (a kill with no flow left).
``stopped``        not running and not finished, but nothing died: the last worker ended its
                   chunk cleanly (phase ``done``), or no worker ever beat here (a pulled clone).
``never started``  no beat, no event of a worker, no checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import psutil

from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.store import CheckpointStore
from training.config import RunConfig
from training.datapipe.corpus import entropy_floor
from training.event_records import (
    CheckpointFetched,
    CheckpointPublished,
    ChunkTaskFailed,
    EventLog,
    FlowCrashed,
    FlowFailed,
    FlowStarted,
    Resumed,
    Started,
)
from training.heartbeat import HOST, Beat, read_heartbeat
from training.paths import RunPaths, owner_note
from training.tracking.attempts import latest_attempts
from training.tracking.failure_record import RecordedFailure
from training.tracking.goodput import Goodput, StepJournal, compute, journal_steps
from training.tracking.metrics import read_metric_lines
from training.tracking.resume_audit import analyse

#: Step times averaged for the ETA: long enough to smooth noise, short enough to follow a change.
ETA_WINDOW = 50
_GAVE_UP = (ChunkTaskFailed, FlowFailed, FlowCrashed)
_STARTS = (FlowStarted, Started, Resumed)


@dataclass(frozen=True)
class RunStatus:
    """Where a run stands now (the module's states): what ``convoy status``, its ``--json``, the
    live line of ``convoy train`` and the report read, named once.  Every field has a default, so
    a status written by an older release (``--json``) reads back."""

    run_name: str = ""
    run_dir: str = ""
    state: str = "never started"
    #: The worker's step: its beat's while it runs, else the furthest its files show.
    step: int = 0
    total_steps: int = 0
    phase: str | None = None
    heartbeat_age_s: float | None = None
    pid: int | None = None
    host: str | None = None
    worker_alive: bool = False
    flow_pid: int | None = None
    loss: float | None = None
    loss_step: int | None = None
    entropy_floor: float | None = None
    val_loss: float | None = None
    val_loss_step: int | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    data_epoch: float | None = None
    data_samples: float | None = None
    steps_per_s: float | None = None
    eta_s: float | None = None
    checkpoint_step: int | None = None
    checkpoint: str | None = None
    checkpoint_digest: str | None = None
    checkpoint_verified: bool = True
    steps_since_checkpoint: int = 0
    uploaded_step: int | None = None
    upload_lag_steps: int | None = None
    upload_lag_s: float | None = None
    failures: int = 0
    resumes: int = 0
    steps_lost: int = 0
    failure_kinds: list[str] = field(default_factory=list)
    failure_chunks: list[int | None] = field(default_factory=list)
    #: ``{chunk: number of its newest attempt}``, numbered across flow runs.
    chunk_attempts: dict[int, int] = field(default_factory=dict)
    goodput: float | None = None
    wall_s: float | None = None
    productive_s: float | None = None
    #: None: goodput was not asked for (its four fields are then left out of :meth:`as_dict`).
    badput_s: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON-able mapping (``convoy status --json``), in the fields' order."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.badput_s is None:
            out = {k: v for k, v in out.items() if k not in _GOODPUT_FIELDS}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunStatus:
        """Read :meth:`as_dict`'s mapping back (JSON's string chunk keys made numbers again); keys
        this version does not know are left out."""
        known = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        if "chunk_attempts" in known:
            known["chunk_attempts"] = {int(k): v for k, v in (known["chunk_attempts"] or {}).items()}
        return cls(**known)

    def measured_goodput(self) -> Goodput | None:
        """The goodput so far, when it was asked for and could be measured."""
        if self.goodput is None or self.wall_s is None or self.productive_s is None:
            return None
        return Goodput(self.goodput, self.wall_s, self.productive_s, dict(self.badput_s or {}))


_GOODPUT_FIELDS = ("goodput", "wall_s", "productive_s", "badput_s")


def pid_alive(pid: int) -> bool:
    """A live, non-zombie process (a SIGKILLed worker not yet reaped is a zombie: dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def flow_holder(run_dir: Path) -> int | None:
    """Pid of the live flow on this host holding ``.lock`` (its ``.lock.owner`` says
    ``pid N on HOST``); None when there is none or it is gone."""
    try:
        words = owner_note(RunPaths(run_dir).flow_lock).read_text().split()
    except OSError:
        return None
    if len(words) < 4 or words[0] != "pid" or words[3] != HOST or not words[1].isdigit():
        return None
    pid = int(words[1])
    return pid if pid_alive(pid) else None


def beat_alive(beat: Beat | None, timeout_s: float, now: float) -> bool:
    """Whether a heartbeat shows a worker that is training or finishing right now."""
    if beat is None or beat.done or now - beat.time > timeout_s:
        return False
    return not beat.is_local or pid_alive(beat.pid)


def metrics_tail(run_dir: Path, rows: int = ETA_WINDOW, max_bytes: int = 256 * 1024) -> list[dict[str, Any]]:
    """The last ``rows`` rows (0: all read) of ``metrics.jsonl``, read from its end (it grows every
    step) by the one reader of the file, :func:`training.tracking.metrics.read_metric_lines`."""
    found: list[dict[str, Any]] = []
    try:
        for step, metrics in read_metric_lines(RunPaths(run_dir).metrics, tail_bytes=max_bytes):
            found.append({"step": step, "metrics": metrics})
    except OSError:
        return []
    except ValueError:  # a damaged line: status shows what precedes it (the export reports the damage)
        pass
    return found[-rows:] if rows else found


def last_logged(run_dir: Path, key: str) -> tuple[int, float] | None:
    """The newest (step, value) of a metric logged only now and then (``val_loss``), searched in
    the file's last 256 KiB (some thousands of steps)."""
    for row in reversed(metrics_tail(run_dir, rows=0)):
        if key in row.get("metrics", {}):
            return int(row["step"]), float(row["metrics"][key])
    return None


#: (checkpoint path, manifest mtime) → digest of a checkpoint already verified by this process, so
#: ``status --follow`` hashes each checkpoint once, not at every refresh.
def newest_checkpoint(store: CheckpointStore, verify: bool = True) -> tuple[int, str, str] | None:
    """(step, name, digest) of the newest checkpoint that verifies (``verify``: the store's resume
    point, each unchanged checkpoint hashed once per store) or, without ``verify``, whose manifest
    reads — cheap enough for a live line refreshed every few seconds while checkpoints are
    gigabytes.  A caller that asks again and again (``--follow``, the live line) keeps one store."""
    if verify:
        ck = store.resume_point().checkpoint
        return (ck.step, ck.path.name, ck.digest) if ck is not None else None
    for step, path in store.step_dirs():
        try:
            return step, path.name, store.read_manifest(path)["digest"]
        except (CheckpointRejected, OSError):  # unreadable, or retired meanwhile
            continue
    return None


def _state(running: bool, finished: bool, log: EventLog, started: bool, clean_end: bool = False) -> str:
    if running:
        return "running"
    if finished:
        return "finished"
    marks = log.of(*_STARTS, *_GAVE_UP)
    last_start = max((i for i, e in enumerate(marks) if isinstance(e, _STARTS)), default=-1)
    if marks[last_start + 1 :]:  # the flow gave up after the last start
        return "failed"
    if not started:
        return "never started"
    return "stopped" if clean_end else "dead"


def _eta(rows: list[dict[str, Any]], step: int, total: int) -> tuple[float | None, float | None]:
    """(steps per second, seconds to go) from the measured step times of the last rows."""
    times = [float(r["metrics"]["step_time_s"]) for r in rows if "step_time_s" in r.get("metrics", {})]
    if not times or sum(times) <= 0:
        return None, None
    rate = len(times) / sum(times)
    return rate, max(0, total - step) / rate


def _audit_fields(log: EventLog) -> dict[str, Any]:
    """The recovery counts of the run so far, from its events."""
    audit = analyse(log)
    return {
        "failures": audit.failures,
        "resumes": audit.resumes,
        "steps_lost": audit.steps_lost,
        "failure_kinds": [r["kind"] for r in audit.rows],
        "failure_chunks": [f.chunk for f in log.of(RecordedFailure)],
        "chunk_attempts": latest_attempts(log),  # the attempt number each chunk is at
    }


def _upload_fields(config: RunConfig, log: EventLog, ck_step: int | None) -> dict[str, Any]:
    """With ``tracking.dvc``: the newest checkpoint in the remote index (as this machine's
    ``checkpoint_published``/``checkpoint_fetched`` events say) and how far the newest verified
    checkpoint here is ahead of it (the upload lag); all None without versioning."""
    if not config.tracking.dvc:
        return {"uploaded_step": None, "upload_lag_steps": None, "upload_lag_s": None}
    published = log.of(CheckpointPublished, CheckpointFetched)
    steps = [int(e.step) for e in published if e.step is not None]
    uploaded = max(steps) if steps else None
    last = [e.upload_lag_s for e in published if isinstance(e, CheckpointPublished)]
    return {
        "uploaded_step": uploaded,
        "upload_lag_steps": max(0, (ck_step or 0) - (uploaded or 0)) if ck_step is not None else None,
        "upload_lag_s": last[-1] if last else None,
    }


def describe_upload(st: RunStatus) -> str | None:
    """``step 40, 5 steps behind (last upload 1.2 s after its commit)``; None without versioning."""
    if st.upload_lag_steps is None:
        return None
    up = f"step {st.uploaded_step}" if st.uploaded_step is not None else "nothing yet"
    after = f" (last upload {st.upload_lag_s:.1f} s after its commit)" if st.upload_lag_s is not None else ""
    return f"{up}, {st.upload_lag_steps} steps behind{after}"


def _goodput_fields(run_dir: Path, log: EventLog, until: float | None, journal: StepJournal | None) -> dict[str, Any]:
    """Goodput so far (:mod:`training.tracking.goodput`) up to ``until`` (None: the run's last
    event or row, for a run nobody is running); all None when it cannot be measured."""
    try:
        measured = compute(log, journal_steps(run_dir, journal), until)
    except (OSError, ValueError):  # a damaged journal: status shows the rest
        measured = None
    if measured is None:
        return {"goodput": None, "wall_s": None, "productive_s": None, "badput_s": {}}
    return {k: getattr(measured, k) for k in _GOODPUT_FIELDS}


def _beat_fields(beat: Beat | None, now: float) -> dict[str, Any]:
    """What the newest heartbeat says of the worker (all None without one)."""
    return {
        "phase": str(beat.phase) if beat else None,
        "heartbeat_age_s": round(now - beat.time, 3) if beat else None,
        "pid": beat.pid if beat else None,
        "host": beat.host if beat else None,
    }


def _checkpoint_fields(newest: tuple[int, str, str] | None, verify: bool, step: int) -> dict[str, Any]:
    """The newest checkpoint and how far the worker's step is past it."""
    ck_step = newest[0] if newest is not None else None
    return {
        "checkpoint_step": ck_step,
        "checkpoint": newest[1] if newest is not None else None,
        "checkpoint_digest": newest[2] if newest is not None else None,
        "checkpoint_verified": verify,
        "steps_since_checkpoint": max(0, step - (ck_step or 0)),
    }


def run_status(
    config: RunConfig,
    run_dir: str | Path,
    now: float | None = None,
    verify: bool = True,
    goodput: bool = True,
    store: CheckpointStore | None = None,
) -> dict[str, Any]:
    """:func:`read_status` as one JSON-able dict (``convoy status --json``)."""
    return read_status(config, run_dir, now, verify, goodput, store).as_dict()


def read_status(
    config: RunConfig,
    run_dir: str | Path,
    now: float | None = None,
    verify: bool = True,
    goodput: bool = True,
    store: CheckpointStore | None = None,
    journal: StepJournal | None = None,
) -> RunStatus:
    """Everything ``convoy status`` shows; ``verify=False``: the newest checkpoint by its manifest only;
    ``goodput=False``: no goodput fields (they read the journal: the live line of ``convoy train``);
    ``store``, ``journal``: the run's, kept by a caller that asks again (verdicts kept, journal read on)."""
    run_dir = Path(run_dir)
    store = store if store is not None else CheckpointStore(run_dir)
    now = time.time() if now is None else now
    total = config.train.total_steps
    beat = read_heartbeat(run_dir, 0)
    log = EventLog.read(run_dir)
    newest = newest_checkpoint(store, verify)
    ck_step = newest[0] if newest is not None else None
    rows = metrics_tail(run_dir)
    metric_step = int(rows[-1]["step"]) if rows else None
    worker_alive = beat_alive(beat, config.heartbeat.timeout_s, now)
    flow_pid = flow_holder(run_dir)
    finished = ck_step is not None and ck_step >= total
    # The worker's step: its beat while it runs; otherwise the furthest any source got.
    known = [s for s in (beat.step if beat else None, metric_step, ck_step) if s is not None]
    step = beat.step if worker_alive and beat else (max(known) if known else 0)
    started = bool(known) or bool(log.of(Started, Resumed))
    rate, eta = _eta(rows, step, total)
    last = rows[-1]["metrics"] if rows else {}
    val = last_logged(run_dir, "val_loss")
    clean_end = beat is None or beat.done
    running = worker_alive or flow_pid is not None
    facts = {
        "run_name": config.run_name,
        "run_dir": str(run_dir),
        "state": _state(running, finished, log, started, clean_end=clean_end),
        "step": step,
        "total_steps": total,
        **_beat_fields(beat, now),
        "worker_alive": worker_alive,
        "flow_pid": flow_pid,
        "loss": last.get("loss"),
        "loss_step": metric_step,
        "entropy_floor": entropy_floor(config.data, config.task),
        "val_loss": val[1] if val else None,
        "val_loss_step": val[0] if val else None,
        "tokens_per_s": last.get("tokens_per_s"),
        "samples_per_s": last.get("samples_per_s"),
        "data_epoch": last.get("data/epoch"),
        "data_samples": last.get("data/samples"),
        "steps_per_s": round(rate, 3) if rate else None,
        "eta_s": round(eta, 1) if eta is not None and not finished else None,
        **_checkpoint_fields(newest, verify, step),
        **_upload_fields(config, log, ck_step),
        **_audit_fields(log),
        **(_goodput_fields(run_dir, log, now if running else None, journal) if goodput else {}),
    }
    return RunStatus(**facts)
