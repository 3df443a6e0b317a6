"""Chunk supervisor: run one worker process group, watch it, classify and clean up failures.

Why a separate process we watch instead of Prefect's own runners: a SIGKILLed task process in
Prefect's process pool breaks the whole flow (``BrokenProcessPool``, no retry) and a task timeout
leaves the child running.  So the Prefect task stays alive and *owns* the worker: it gets it from
:mod:`tasks.supervision.worker_source` (spawned in its own session, adopted from the previous chunk, or the
warm standby), watches it (its death wakes the watch at once; its beats are read every
``poll_s``) and, on any failure, stops the whole group itself (SIGTERM → grace → SIGKILL), reaps
every descendant, writes the audit event and raises :class:`ChunkFailed`.  Prefect then retries
only that chunk.

This module never imports Prefect, so it is unit-tested with stand-in scripts.

The liveness rules: :mod:`tasks.supervision.worker_liveness`.  Failure kinds and the rules that name an exit:
:mod:`tasks.supervision.failure_kinds`.  What a failure report carries: :mod:`training.tracking.failure_record`.
Process-group lifecycle (die with the supervisor, stop, reap): :mod:`tasks.supervision.process_group`.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tasks.supervision.attempt import AttemptSpec
from tasks.supervision.failure_kinds import (
    NOT_RETRYABLE,
    Verdict,
    classify_exit,
    config_message,
    diskfull_message,
    error_line,
    launcher_exit,
    oom_kills,
    signame,
)
from tasks.supervision.multinode import failed_node, launcher_command
from tasks.supervision.worker_liveness import Watch, failure_verdict, fresh_beats
from tasks.supervision.worker_log import LogFollower
from tasks.supervision.worker_source import Acquired, Source, WorkerSource, clock
from training import chunk_boundary, run_memory
from training.events import EXIT_CONFIG, Event, FailureKind, Phase, append_event
from training.fsutil import file_size
from training.heartbeat import read_heartbeat
from training.loop.claim import request_stop
from training.paths import RunPaths
from training.tracking.failure_record import FailureDetails
from training.tracking.resume_audit import steps_lost, trained_high_water

#: Failure kinds whose reason says it all (no "first to fail" node appended).
_SAYS_WHY = (FailureKind.CONFIG, FailureKind.PREEMPTED, FailureKind.DISKFULL)


class ChunkFailed(Exception):
    """One chunk attempt failed; ``kind`` is a :class:`training.events.FailureKind`, ``details``
    what is known about it (a mapping, e.g. read back from a pool node's artifact, is read as
    :class:`FailureDetails`).

    ``args`` carries every field so the exception pickles (Prefect may persist failed states).
    """

    def __init__(self, kind: str, message: str, details: FailureDetails | Mapping[str, Any] | None = None) -> None:
        if not isinstance(details, FailureDetails):
            details = FailureDetails.from_dict(details or {})
        super().__init__(kind, message, details)
        self.kind = kind
        self.message = message
        self.details: FailureDetails = details

    @property
    def retryable(self) -> bool:
        return self.kind not in NOT_RETRYABLE

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        """What Prefect's log shows ("Task run failed with exception: …"): words, not a dict."""
        d = self.details
        facts = [
            f"at step {d.trained_to}" if d.trained_to is not None else "",
            f"detected after {d.detected_after_s} s" if d.detected_after_s is not None else "",
            f"resumes from step {d.resume_step}" if d.resume_step is not None else "",
            f"{d.steps_lost} step(s) lost" if d.steps_lost is not None else "",
            f"log {d.log}" if d.log else "",
        ]
        shown = "; ".join(f for f in facts if f)  # after a semicolon: the message may end in brackets
        return f"{self.message}; {shown}" if shown else self.message


@dataclass
class Outcome:
    """A successful attempt."""

    returncode: int
    seconds: float
    last_beat_step: int | None
    log_path: Path
    tail: list[str] = field(default_factory=list)


def worker_command(
    run_dir: Path,
    until_step: int,
    ranks: int = 1,
    pipelined: bool = False,
    hosts: Sequence[str] = (),
    node_launch: str = "",
) -> list[str]:
    """The worker's command line; more than one rank goes through torchrun (elastic launcher),
    more than one host through :mod:`tasks.supervision.multinode` (one torchrun per node, one rendezvous).
    ``pipelined``: the worker waits at each chunk boundary for the previous one's acknowledgement."""
    tail = ["-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(until_step)]
    if pipelined:
        tail.append("--pipelined")
    if len(hosts) > 1:
        return launcher_command(hosts, ranks, node_launch, tail)
    if ranks <= 1:
        return [sys.executable, *tail]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *tail]


def supervise(spec: AttemptSpec) -> Outcome:
    """Run one attempt to completion under watch; return on exit 0 (or a parked hand-off), raise
    :class:`ChunkFailed` otherwise.  See :class:`WorkerAttempt`."""
    return WorkerAttempt(spec).run()


def own_log_name(worker_log: Path, attempt_log: Path, source: str) -> Path:
    """An adopted (pipelined) worker writes on into the log it was started with, named after the
    chunk and attempt it started in, and a standby into ``standby-<n>.log``; this attempt's name
    is made a second name of that same file (a hard link: what the worker writes shows under
    both), so ``chunk-2-attempt-1.log`` exists for ``c2·a1``.  A line marks where this attempt
    begins.  Where a link cannot be made, the worker's own name stays."""
    if worker_log == attempt_log:
        return worker_log
    try:
        if not attempt_log.exists():
            os.link(worker_log, attempt_log)
        with open(attempt_log, "ab") as log:
            log.write(f"# convoy {source} as {attempt_log.stem} (this file is also {worker_log.name})\n".encode())
    except OSError:
        return worker_log
    return attempt_log


class WorkerAttempt:
    """One worker attempt: acquire → watch → stop or park → outcome or failure report.

    Exit 0 only means the worker *says* it finished; the caller checks the committed checkpoint.
    Whatever happens (including KeyboardInterrupt or a Prefect cancellation in this thread), no
    process of the worker's group outlives :meth:`run`, except a worker parked for the next chunk.
    """

    def __init__(self, spec: AttemptSpec) -> None:
        self.spec = spec
        self.run_dir = spec.run_dir
        self.log_path = spec.log_path
        self.tail: collections.deque[str] = collections.deque(maxlen=spec.tail_lines)
        self.failure: Verdict | None = None
        self.handed_off = False
        self.leftover: list[int] = []
        self.source = WorkerSource(spec)

    def run(self) -> Outcome:
        self.start()
        try:
            self.watch()
        finally:
            self.stop()
        return self.report()

    # ------------------------------------------------------------------ start
    def start(self, acquired: Acquired | None = None) -> None:
        """Get the worker from its source (:mod:`tasks.supervision.worker_source`), then follow its
        log; ``acquired``: a worker got already (a dead parked one, for its post-mortem)."""
        self.oom_before = oom_kills()
        self.metrics_offset = file_size(RunPaths(self.run_dir).metrics)  # this attempt's rows start here (steps lost)
        self.started = time.time()
        acquired = acquired or self.source.acquire(self.started)
        self.worker, adopted = acquired.worker, acquired.source == Source.ADOPTED
        self.log_path = own_log_name(self.worker.log_path, self.spec.log_path, acquired.source)
        # An adopted worker's last words so far (read by the chunk that parked it) are not echoed
        # again; what it said since (a traceback if it died between the tasks) is this chunk's.
        self.tail.extend(self.worker.said)
        self.follower = LogFollower(self.log_path, self.worker.offset, self.tail, self.spec.on_line)
        # Beats count from this attempt's start, so stale beats of an earlier worker are no sign of
        # life; an adopted worker's beats are its own however old, so one stopped or wedged before
        # this task adopted it is judged by its last beat (hang/dead), not as one that never beat.
        self.watched = Watch(
            started=self.started,
            phase_since=self.started,
            progress=self.started,
            beats_since=0.0 if adopted else self.started,
        )
        self.last_seen_running = self.exit_seen = self.started
        if adopted:
            self.recall_adopted()

    def recall_adopted(self) -> None:
        """What the adopted worker last said, so a death in the hand-off is measured."""
        beats = [b for b in (read_heartbeat(self.run_dir, r) for r in range(self.spec.ranks)) if b]
        if beats:
            self.watched.last_step = min(b.step for b in beats)
        if self.worker.poll() is None:
            return
        # It died between the tasks: last known alive at its last beat; detected when the registry's
        # watcher saw it go (at once, on its pidfd), which the failure reports as its detection.
        died_at = self.worker.died_at
        if beats:
            self.last_seen_running = max(b.time for b in beats)
        if died_at is not None:
            self.last_seen_running = min(self.last_seen_running, died_at)
            self.note(f"worker pid {self.worker.pid} ended at {clock(died_at)}, while parked")

    # ------------------------------------------------------------------ watch
    def boundary_committed(self) -> bool:
        step = self.spec.boundary_step
        return step is not None and chunk_boundary.boundary_committed(self.run_dir, step)

    def watch(self) -> None:
        """Until the worker exits, a limit is crossed, or (pipelined) the boundary is committed:
        judge its beats every ``poll_s`` and, in between, wait for its death."""
        spec = self.spec
        while self.worker.poll() is None:
            self.last_seen_running = time.time()
            # The boundary first: whatever happens after it is committed is the next chunk's.
            if self.boundary_committed():
                break
            beats = fresh_beats(self.run_dir, spec.ranks, self.watched.clock_floor)
            self.failure = failure_verdict(self.watched, beats, spec.ranks, spec.limits, self.last_seen_running)
            if self.failure is not None:
                break
            if self.watched.phase == Phase.TRAIN:
                self.source.worker_trains()
            if self.worker.wait_exit(spec.limits.poll_s):  # it died: the wait woke as it did
                self.last_seen_running = self.worker.died_at or self.last_seen_running
        if self.failure is None and self.worker.poll() is not None:
            # Its last beats may postdate our last look: they still say how far it got.
            final = fresh_beats(self.run_dir, spec.ranks, self.watched.clock_floor)
            if final:
                self.watched.last_step = min(b.step for b in final)
        # Running, or died just after the commit (between two looks): either way this chunk is
        # done and the worker, alive or not, is the next chunk's to adopt and judge.
        self.handed_off = self.failure is None and self.boundary_committed()
        # Wall time of the detection (exit seen or limit crossed), before the stop takes its grace.
        died_at = self.worker.died_at if self.failure is None else None
        self.exit_seen = died_at if died_at is not None else time.time()

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop and reap the worker's group, or park it for the next chunk; then the log follower."""
        grace = self.spec.limits.grace_s
        if self.handed_off:
            self.leftover = []
        elif self.worker.poll() is None:
            if self.failure is None:  # stopped from outside (the flow ending): it saves first
                request_stop(self.run_dir)
                self.worker.wait_exit(grace)
            self.leftover = self.worker.stop(grace)
        else:
            self.leftover = self.worker.stop(min(grace, 2.0))  # the group may outlive its leader
        position = self.follower.stop()
        if self.handed_off:  # the next chunk reads on from here, knowing what was read
            self.worker.offset, self.worker.said = position, list(self.tail)
            self.source.park(self.worker)

    # ------------------------------------------------------------------ report
    def note(self, text: str) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"# convoy {text}\n".encode())

    def report(self) -> Outcome:
        """The outcome of a finished or parked attempt; :class:`ChunkFailed` for any other."""
        seconds = time.time() - self.started
        rc = self.worker.proc.returncode
        if not self.handed_off:
            self.note(f"exit={rc} after {seconds:.2f} s")
        if self.leftover:
            append_event(
                self.run_dir, Event.REAP_FAILED, chunk=self.spec.chunk, attempt=self.spec.attempt, pids=self.leftover
            )
        if self.handed_off:
            self.note(
                f"chunk={self.spec.chunk} committed step {self.spec.boundary_step} after {seconds:.2f} s; "
                "worker continues into the next chunk"
            )
            return Outcome(0, seconds, self.watched.last_step, self.log_path, list(self.tail))
        if self.failure is None and rc == 0:
            return Outcome(rc, seconds, self.watched.last_step, self.log_path, list(self.tail))
        raise self.failure_report(rc, seconds)

    def classify(self, rc: int) -> Verdict:
        """The verdict on a failed attempt: the watch's, or the exit's."""
        tail, ranks = list(self.tail), self.spec.ranks
        if self.failure is not None:
            verdict = self.failure
            if (
                verdict.kind == FailureKind.CRASH
                and ranks > 1
                and launcher_exit(self.run_dir, 1, tail, self.started) == EXIT_CONFIG
            ):  # a rank's config error: never retried
                return replace(verdict, kind=FailureKind.CONFIG, reason=config_message(self.tail))
            if verdict.kind == FailureKind.CRASH and (why := error_line(tail)):  # a lost rank's exception
                return replace(verdict, reason=f"{verdict.reason}: {why}")
            return verdict
        code = rc if ranks <= 1 else launcher_exit(self.run_dir, rc, tail, self.started)
        kind = classify_exit(code, tail, self.oom_before, oom_kills())
        reason = {
            FailureKind.CONFIG: config_message(self.tail),
            FailureKind.PREEMPTED: "preempted (exit 75) after saving an emergency checkpoint",
            FailureKind.DISKFULL: diskfull_message(self.tail),
        }.get(kind, signame(code) + ("" if code == rc else f" in a rank (launcher {signame(rc)})"))
        if kind not in _SAYS_WHY and (node := failed_node(tail)):
            reason += f"; first to fail: {node}"
        if kind == FailureKind.CRASH and (why := error_line(tail)):  # the exception, never a banner
            reason += f": {why}"
        # The exit happened between the last moment it was seen running and its detection: a few
        # milliseconds while waiting on its death, at most a verdict's computation otherwise.
        return Verdict(kind, reason, self.exit_seen - self.last_seen_running)

    def failure_report(self, rc: int, seconds: float) -> ChunkFailed:
        """Audit the failure (one ``failure`` event, steps lost by their one definition) and say it."""
        verdict = self.classify(rc)
        point = self.spec.store().resume_point()
        committed, passed_over = run_memory.resume_step(self.run_dir, point.step), point.passed_over_dicts()
        trained_to = trained_high_water(self.run_dir, self.watched.last_step, self.metrics_offset)
        details = FailureDetails(
            detected_after_s=round(verdict.detected_after_s, 3),
            last_beat_step=self.watched.last_step,
            trained_to=trained_to,
            last_committed_step=committed,
            steps_lost=steps_lost(trained_to, committed),  # the next attempt resumes from `committed`
            passed_over=passed_over,  # newer checkpoints that do not verify: why it resumes further back
            returncode=rc,
            reason=verdict.reason,
            error=error_line(self.tail),  # tasks/supervision/repeated.py compares it between attempts
            log=str(self.log_path),
        )
        append_event(
            self.run_dir,
            Event.FAILURE,
            failure=verdict.kind,
            chunk=self.spec.chunk,
            attempt=self.spec.attempt,
            detected_at=round(self.exit_seen, 3),
            leftover_pids=self.leftover,
            **details.as_dict(),
        )
        where = f"chunk {self.spec.chunk}" if self.spec.chunk is not None else "worker"
        message = f"{where} {verdict.kind}: {verdict.reason}"
        said = error_line(self.tail) if verdict.kind in (FailureKind.CRASH, FailureKind.OOM) else None
        if said:  # a process that ended itself said why; a killed or stalled one did not
            message += f" | last output: {said[:300]}"
        told = replace(details, tail=list(self.tail)[-10:], seconds=round(seconds, 3))
        return ChunkFailed(verdict.kind, message, told)
