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
from pathlib import Path
from typing import Any

import psutil

from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.store import CheckpointStore
from training.config import RunConfig
from training.corpus import entropy_floor
from training.events import Event, read_events
from training.heartbeat import HOST, Beat, read_heartbeat
from training.paths import RunPaths, owner_note
from training.tracking.attempts import latest_attempts
from training.tracking.goodput import compute, journal_steps
from training.tracking.metrics import read_metric_lines
from training.tracking.resume_audit import analyse_events

#: Step times averaged for the ETA: long enough to smooth noise, short enough to follow a change.
ETA_WINDOW = 50
_GAVE_UP = ("chunk_failed", "flow_failed", "flow_crashed")
_STARTS = (Event.FLOW_STARTED, Event.STARTED, Event.RESUMED)


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


def _state(running: bool, finished: bool, events: list[dict[str, Any]], started: bool, clean_end: bool = False) -> str:
    if running:
        return "running"
    if finished:
        return "finished"
    last_start = max((i for i, e in enumerate(events) if e["kind"] in _STARTS), default=-1)
    if any(e["kind"] in _GAVE_UP for e in events[last_start + 1 :]):
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


def _audit_fields(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The recovery counts of the run so far, from its events."""
    audit = analyse_events(events)
    return {
        "failures": audit["failures"],
        "resumes": audit["resumes"],
        "steps_lost": audit["steps_lost"],
        "failure_kinds": [r["kind"] for r in audit["rows"]],
        "failure_chunks": [e.get("chunk") for e in events if e["kind"] == Event.FAILURE],
        "chunk_attempts": latest_attempts(events),  # the attempt number each chunk is at
    }


def _upload_fields(config: RunConfig, events: list[dict[str, Any]], ck_step: int | None) -> dict[str, Any]:
    """With ``tracking.dvc``: the newest checkpoint in the remote index (as this machine's
    ``checkpoint_published``/``checkpoint_fetched`` events say) and how far the newest verified
    checkpoint here is ahead of it (the upload lag); all None without versioning."""
    if not config.tracking.dvc:
        return {"uploaded_step": None, "upload_lag_steps": None, "upload_lag_s": None}
    published = [e for e in events if e["kind"] in (Event.CHECKPOINT_PUBLISHED, Event.CHECKPOINT_FETCHED)]
    steps = [int(e["step"]) for e in published if e.get("step") is not None]
    uploaded = max(steps) if steps else None
    last = [e.get("upload_lag_s") for e in published if e["kind"] == Event.CHECKPOINT_PUBLISHED]
    return {
        "uploaded_step": uploaded,
        "upload_lag_steps": max(0, (ck_step or 0) - (uploaded or 0)) if ck_step is not None else None,
        "upload_lag_s": last[-1] if last else None,
    }


def describe_upload(st: dict[str, Any]) -> str | None:
    """``step 40, 5 steps behind (last upload 1.2 s after its commit)``; None without versioning."""
    if st.get("upload_lag_steps") is None:
        return None
    up = f"step {st['uploaded_step']}" if st["uploaded_step"] is not None else "nothing yet"
    after = f" (last upload {st['upload_lag_s']:.1f} s after its commit)" if st.get("upload_lag_s") is not None else ""
    return f"{up}, {st['upload_lag_steps']} steps behind{after}"


def _goodput_fields(run_dir: Path, events: list[dict[str, Any]], until: float | None) -> dict[str, Any]:
    """Goodput so far (:mod:`training.tracking.goodput`) up to ``until`` (None: the run's last
    event or row, for a run nobody is running); all None when it cannot be measured."""
    try:
        measured = compute(events, journal_steps(run_dir), until)
    except (OSError, ValueError):  # a damaged journal: status shows the rest
        measured = None
    if measured is None:
        return {"goodput": None, "wall_s": None, "productive_s": None, "badput_s": {}}
    return {k: getattr(measured, k) for k in ("goodput", "wall_s", "productive_s", "badput_s")}


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
    """Everything ``convoy status`` shows, as one JSON-able dict; ``verify=False``: the newest
    checkpoint by its manifest only, and ``goodput=False``: without the goodput fields, which read
    the whole journal (the live line of ``convoy train``); ``store``: the run's store, kept by a
    caller that asks again (its verdicts are remembered)."""
    run_dir = Path(run_dir)
    store = store if store is not None else CheckpointStore(run_dir)
    now = time.time() if now is None else now
    total = config.train.total_steps
    beat = read_heartbeat(run_dir, 0)
    events = read_events(run_dir)
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
    started = bool(known) or any(e["kind"] in (Event.STARTED, Event.RESUMED) for e in events)
    rate, eta = _eta(rows, step, total)
    last = rows[-1]["metrics"] if rows else {}
    val = last_logged(run_dir, "val_loss")
    clean_end = beat is None or beat.done
    running = worker_alive or flow_pid is not None
    return {
        "run_name": config.run_name,
        "run_dir": str(run_dir),
        "state": _state(running, finished, events, started, clean_end=clean_end),
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
        **_upload_fields(config, events, ck_step),
        **_audit_fields(events),
        **(_goodput_fields(run_dir, events, now if running else None) if goodput else {}),
    }
