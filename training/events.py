"""Append-only audit log ``runs/<name>/events.jsonl`` (failures, detections, resumes, skips).

One JSON object per line, appended with O_APPEND in a single write so concurrent writers
(worker, supervisor, hooks) never interleave inside a line.

The vocabulary the worker and the processes watching it share is named here, once: the event
kinds (:class:`Event`), the heartbeat phases (:class:`Phase`), the failure kinds a ``failure``
event carries (:class:`FailureKind`) and the openings of the worker's output lines that others
read (:class:`WorkerSays`) — and the worker's exit codes that mean more than "failed"
(:data:`EXIT_CONFIG`, :data:`EXIT_PREEMPTED`), and the variables a forked worker is given.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from training.paths import EVENTS_FILE, RunPaths  # noqa: F401 - EVENTS_FILE re-exported


@dataclass(frozen=True)
class StandbyOrder:
    """The one line a warm standby worker waits for on its stdin (tasks/supervision/standby.py
    writes it, ``training.worker`` reads it): train to ``until_step``, pipelined or not."""

    until_step: int
    pipelined: bool = False

    def as_line(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def from_line(cls, line: str) -> StandbyOrder:
        d = json.loads(line)
        return cls(int(d["until_step"]), bool(d.get("pipelined", False)))


#: Exit code of a training process for a configuration or data error (EX_CONFIG, not retryable).
EXIT_CONFIG = 78
#: Exit code of a worker that was preempted (SIGTERM) and saved an emergency checkpoint.
EXIT_PREEMPTED = 75
#: Set in a worker forked by the run's zygote (:mod:`training.zygote`) to the zygote's pid; the
#: worker records where it came from in its ``started``/``resumed`` event (``origin``).
FORKED_BY_ENV = "CONVOY_FORKED_BY"
#: The fd of a forked worker's lifeline (:mod:`training.loop.lifeline`): the read end of a pipe only the
#: flow process can write to, so its hang-up says the flow is gone.
LIFELINE_FD_ENV = "CONVOY_LIFELINE_FD"


class Event(StrEnum):
    """Every kind of audit event, named once (a StrEnum: equal to its string, written as it)."""

    ATTEMPT_STARTED = "attempt_started"
    #: The MLflow run of an attempt whose ``attempt_started`` was written before its task existed
    #: (a worker killed while parked was replaced at once: tasks/supervision/replacement.py).
    ATTEMPT_RECORDED = "attempt_recorded"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_FETCHED = "checkpoint_fetched"
    CHECKPOINT_INVALID = "checkpoint_invalid"
    CHECKPOINT_PUBLISHED = "checkpoint_published"
    CHECKPOINT_REPLACED = "checkpoint_replaced"
    CHECKPOINT_RETIRED = "checkpoint_retired"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    CHECKPOINT_VERSIONED = "checkpoint_versioned"
    CHECKPOINTS_PULLED = "checkpoints_pulled"
    CHUNK_DONE = "chunk_done"
    #: The chunk task failed for good (its Prefect failure hook, tasks/hooks.py).
    CHUNK_FAILED = "chunk_failed"
    CHUNK_FLOW_RUN_FAILED = "chunk_flow_run_failed"
    CONFIG_CHANGED = "config_changed"
    CONFIG_ERROR = "config_error"
    #: The run's own loss turned non-finite: stopped, not retried (training.loop.nonfinite rule 4).
    DIVERGED = "diverged"
    FAILURE = "failure"
    FIRST_STEP = "first_step"
    #: The flow run crashed with its hook running (tasks/hooks.py): it ended, no takeover needed.
    FLOW_CRASHED = "flow_crashed"
    FLOW_DONE = "flow_done"
    #: The flow run failed with its hook running (tasks/hooks.py).
    FLOW_FAILED = "flow_failed"
    #: Prefect set this live flow run final (Crashed by the liveness automation): trained on.
    FLOW_MARKED_WHILE_ALIVE = "flow_marked_while_alive"
    FLOW_STARTED = "flow_started"
    FLOW_TAKEN_OVER = "flow_taken_over"
    FOREIGN_THREADS = "foreign_threads"
    FORKED = "forked"
    #: A worker found the node short of host memory before a copy of the state and gave its
    #: copies up: tier off, saves synchronous (training.loop.memory_watch rule 5).
    HOST_MEMORY_SHORT = "host_memory_short"
    INTERVAL_CHOSEN = "interval_chosen"
    MEMORY_SNAPSHOT_REFUSED = "memory_snapshot_refused"
    NONDETERMINISTIC_RESUME = "nondeterministic_resume"
    PREEMPTED = "preempted"
    #: A run that committed checkpoints found none that restores: refused, never a fresh start.
    NO_RESTORABLE_CHECKPOINT = "no_restorable_checkpoint"
    REAP_FAILED = "reap_failed"
    #: A run written by an earlier release reopened: only the release's reading of its settings
    #: differs, and it trains as it was trained (training.compat).
    RELEASE_UPGRADED = "release_upgraded"
    REMOTE_CHECKPOINT_REFUSED = "remote_checkpoint_refused"
    REPEATED_FAILURE = "repeated_failure"
    REPLAY_AFTER_RESIZE = "replay_after_resize"
    #: Replayed metric values differed from the first pass (training.tracking.metrics).
    REPLAY_MISMATCH = "replay_mismatch"
    REPLAY_VERIFIED = "replay_verified"
    RESUBMITTED = "resubmitted"
    RESUMED = "resumed"
    #: Slurm's time limit was near (SIGUSR1): the run stopped with an emergency checkpoint and
    #: its job went back to Slurm's queue (flows/slurm_job.py).
    SLURM_REQUEUED = "slurm_requeued"
    STALE_WORKER_STOPPED = "stale_worker_stopped"
    STANDBY_CALLED = "standby_called"
    STANDBY_TOOK_OVER = "standby_took_over"
    STARTED = "started"
    WORKER_DONE = "worker_done"
    WORLD_SIZE_CHANGED = "world_size_changed"
    ZYGOTE_REPLACED = "zygote_replaced"


class Phase(StrEnum):
    """What a worker is doing, as its heartbeat says (``phase`` in ``heartbeat-rank<r>.json``);
    each phase has its own liveness limit in the supervisor."""

    INIT = "init"
    LOAD = "load"
    TRAIN = "train"
    #: A compiled model's first step in a worker, where it compiles (``heartbeat.compile_timeout_s``).
    COMPILE = "compile"
    EVAL = "eval"
    SAVE = "save"
    DONE = "done"


class FailureKind(StrEnum):
    """How an attempt failed: the ``failure`` field of a ``failure`` event and ``ChunkFailed.kind``
    (the rules that assign them: ``tasks/supervision/failure_kinds.py``)."""

    CONFIG = "config"
    CRASH = "crash"
    DEAD = "dead"
    DISKFULL = "diskfull"
    HANG = "hang"
    KILLED = "killed"
    OOM = "oom"
    #: The flow run supervising the attempt died (found when the next flow took the run over).
    ORPHANED = "orphaned"
    PREEMPTED = "preempted"
    REPEATED = "repeated"
    TIMEOUT = "timeout"


class WorkerSays(StrEnum):
    """How the worker's output lines that others read begin (after ``[worker rank r]``, except the
    ``config error`` line, which goes bare to stderr): the chunk task echoes them to Prefect's log,
    the supervisor takes a config error's message from them, and tests and benches wait for them."""

    ALREADY_AT = "already at step"
    CONFIG_ERROR = "config error"
    DONE_AT = "done at step"
    NO_CHECKPOINT = "no valid checkpoint"
    RESUMED_FROM = "resumed from"
    SIGTERM = "SIGTERM"
    STANDBY_READY = "standby ready"


def append_event(run_dir: str | Path, kind: str, **fields: Any) -> dict[str, Any]:
    record = {"time": round(time.time(), 3), "kind": kind, **fields}
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    path = RunPaths(run_dir).events
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return record


def read_events(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    path = RunPaths(run_dir).events
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line after a crash; the rest of the log stays readable
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out


def carry_events(run_dir: str | Path, records: list[dict[str, Any]]) -> int:
    """Append events written elsewhere (a pool node's, brought back with its chunk's outcome) as
    they are, skipping any this log already holds (a node on shared storage wrote into it
    directly); one write, so no reader sees half of them.  Returns how many were added."""
    have = {json.dumps(e, sort_keys=True, default=str) for e in read_events(run_dir)}
    lines = []
    for rec in records:
        line = json.dumps(rec, sort_keys=True, default=str)
        if line not in have:
            have.add(line)
            lines.append(line + "\n")
    if lines:
        path = RunPaths(run_dir).events
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, "".join(lines).encode())
        finally:
            os.close(fd)
    return len(lines)
