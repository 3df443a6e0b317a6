"""Chunk supervisor: run one worker process group, watch it, classify and clean up failures.

Why a separate process we watch instead of Prefect's own runners: a SIGKILLed task process in
Prefect's process pool breaks the whole flow (``BrokenProcessPool``, no retry) and a task timeout
leaves the child running.  So the Prefect task stays alive and *owns* the worker: it spawns it in
its own session (process group), polls it every ``poll_s`` and, on any failure, stops the whole
group itself (SIGTERM → grace → SIGKILL), reaps every descendant, writes the audit event and
raises :class:`ChunkFailed`.  Prefect then retries only that chunk.

This module never imports Prefect, so it is unit-tested with stand-in scripts.

Failure kinds and the rules that assign them: :mod:`tasks.failure_kinds`.  Process-group
lifecycle (die with the supervisor, stop, reap): :mod:`tasks.process_group`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks import handoff, standby
from tasks.failure_kinds import (
    FAILURE_KINDS,
    NOT_RETRYABLE,
    classify_exit,
    config_message,
    diskfull_message,
    error_line,
    launcher_exit,
    oom_kills,
    signame,
)
from tasks.multinode import failed_node, launcher_command
from tasks.process_group import child_setup, pid_gone, reap_stale_worker, stop_group
from training import chunk_boundary
from training.config import EXIT_CONFIG
from training.events import Event, FailureKind, append_event
from training.heartbeat import beat_is_local, heartbeat_path, read_heartbeat
from training.paths import RunPaths
from training.tracking.resume_audit import resume_point, steps_lost, trained_high_water

#: Re-exported: callers only need this module.
__all__ = [
    "FAILURE_KINDS",
    "NOT_RETRYABLE",
    "ChunkFailed",
    "DetectionLimits",
    "AttemptSpec",
    "Outcome",
    "classify_exit",
    "resume_point",
    "reap_stale_worker",
    "stop_group",
    "WorkerAttempt",
    "supervise",
    "worker_command",
]


#: Failure kinds whose reason says it all (no "first to fail" node appended).
_SAYS_WHY = (FailureKind.CONFIG, FailureKind.PREEMPTED, FailureKind.DISKFULL)


class ChunkFailed(Exception):
    """One chunk attempt failed; ``kind`` is one of :data:`FAILURE_KINDS`.

    ``args`` carries every field so the exception pickles (Prefect may persist failed states).
    """

    def __init__(self, kind: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(kind, message, details or {})
        self.kind = kind
        self.message = message
        self.details = details or {}

    @property
    def retryable(self) -> bool:
        return self.kind not in NOT_RETRYABLE

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        """What Prefect's log shows ("Task run failed with exception: …"): words, not a dict."""
        d = self.details
        facts = [
            f"at step {d['trained_to']}" if d.get("trained_to") is not None else "",
            f"detected after {d['detected_after_s']} s" if d.get("detected_after_s") is not None else "",
            f"resumes from step {d.get('last_committed_step') or 0}" if "last_committed_step" in d else "",
            f"{d['steps_lost']} step(s) lost" if d.get("steps_lost") is not None else "",
            f"log {d['log']}" if d.get("log") else "",
        ]
        shown = "; ".join(f for f in facts if f)
        return f"{self.message} ({shown})" if shown else self.message


@dataclass(frozen=True)
class DetectionLimits:
    """Detection limits in seconds; mirrors ``heartbeat.*`` plus the chunk deadline."""

    stall_s: float = 20.0
    timeout_s: float = 10.0
    init_timeout_s: float = 120.0
    save_timeout_s: float = 120.0
    eval_timeout_s: float = 300.0
    grace_s: float = 10.0
    deadline_s: float = 0.0  # 0 = none
    poll_s: float = 0.2

    @classmethod
    def from_config(cls, config: Any) -> DetectionLimits:
        hb, orch = config.heartbeat, config.orchestration
        return cls(
            stall_s=hb.stall_s,
            timeout_s=hb.timeout_s,
            init_timeout_s=hb.init_timeout_s,
            save_timeout_s=hb.save_timeout_s,
            eval_timeout_s=hb.eval_timeout_s,
            grace_s=hb.grace_s,
            deadline_s=orch.chunk_deadline_s,
            poll_s=min(0.2, hb.interval_s),
        )


@dataclass
class Outcome:
    """A successful attempt."""

    returncode: int
    seconds: float
    last_beat_step: int | None
    log_path: Path
    tail: list[str] = field(default_factory=list)


@dataclass
class _Watch:
    """What the supervisor has observed so far (one per attempt)."""

    started: float
    phase: str | None = None
    phase_since: float = 0.0
    last_step: int | None = None
    last_beat: float | None = None
    progress: float = 0.0
    #: rank → when we first saw its process gone while the launcher still ran (multi-rank only)
    rank_gone: dict[int, float] = field(default_factory=dict)
    #: Beats from this time on are the watched worker's: the attempt's start, or 0 for an adopted
    #: worker (every beat is its own, also those from before this task adopted it).
    beats_since: float | None = None

    @property
    def clock_floor(self) -> float:
        return self.started if self.beats_since is None else self.beats_since


def worker_command(
    run_dir: Path,
    until_step: int,
    ranks: int = 1,
    pipelined: bool = False,
    hosts: Sequence[str] = (),
    node_launch: str = "",
) -> list[str]:
    """The worker's command line; more than one rank goes through torchrun (elastic launcher),
    more than one host through :mod:`tasks.multinode` (one torchrun per node, one rendezvous).
    ``pipelined``: the worker waits at each chunk boundary for the previous one's acknowledgement."""
    tail = ["-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(until_step)]
    if pipelined:
        tail.append("--pipelined")
    if len(hosts) > 1:
        return launcher_command(hosts, ranks, node_launch, tail)
    if ranks <= 1:
        return [sys.executable, *tail]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *tail]


def _tail_log(
    path: Path,
    offset: int,
    stop: threading.Event,
    tail: collections.deque[str],
    on_line: Callable[[str], None] | None,
    position: list[int] | None = None,
) -> None:
    """Tail the worker's log file: keep the last lines, hand each one to ``on_line``.

    The worker writes to the file itself (not to a pipe of ours), so its output, and its
    emergency save, survive the supervisor's death: a print into a widowed pipe would raise.
    """
    with open(path, "rb") as f:
        f.seek(offset)
        buf = b""
        while True:
            chunk = f.readline()
            if chunk:
                buf += chunk
                if not buf.endswith(b"\n"):
                    continue
                line = buf.decode(errors="replace").rstrip("\n")
                buf = b""
                if line.startswith("# convoy "):  # our own annotations, not the worker's output
                    continue
                tail.append(line)
                if on_line is not None:
                    with contextlib.suppress(Exception):
                        on_line(line)
            elif stop.is_set():
                if buf:
                    tail.append(buf.decode(errors="replace"))
                if position is not None:  # where the next reader (the adopting chunk) starts
                    position[0] = f.tell()
                return
            else:
                time.sleep(0.05)


def _beats(run_dir: Path, ranks: int, since: float) -> list[dict[str, Any]]:
    """Fresh beats (written by this attempt) of every rank that has beaten yet."""
    out = []
    for r in range(ranks):
        beat = read_heartbeat(run_dir, r)
        if beat is not None and float(beat.get("time", 0)) >= since:
            out.append(beat)
    return out


def _failure_verdict(
    w: _Watch, beats: list[dict[str, Any]], ranks: int, lim: DetectionLimits, now: float
) -> tuple[str, str, float] | None:
    """Return (kind, reason, detected_after_s) if the running worker has failed, else None."""
    if lim.deadline_s and now - w.started > lim.deadline_s:
        return FailureKind.TIMEOUT, f"chunk deadline of {lim.deadline_s:g} s exceeded", now - w.started - lim.deadline_s
    if not beats:
        if now - w.started > lim.init_timeout_s:
            return FailureKind.DEAD, f"no heartbeat within {lim.init_timeout_s:g} s of start", now - w.started
        return None
    # The slowest rank decides: one stalled rank stalls a collective for everybody.
    oldest = min(float(b["time"]) for b in beats)
    step = min(int(b.get("step", 0)) for b in beats)
    phases = {b.get("phase") for b in beats}
    phase = "train" if "train" in phases else sorted(p or "" for p in phases)[0]
    progress = min(float(b.get("progress_time", b["time"])) for b in beats)
    if phase != w.phase:
        # The phase began no later than the beat that first reports it.  Taking our own clock
        # instead (up to a poll and a beat later) let a worker stopped just after a phase change
        # (e.g. adopted at a chunk boundary) look dead before it looked hung when stall_s equals
        # timeout_s: the stall clock must never start after the last beat.
        w.phase, w.phase_since = phase, min(now, max(oldest, w.clock_floor))
    if step != w.last_step:
        w.last_step = step
    w.last_beat = oldest
    # Progress in the current phase counts from when we first saw the phase: a long save must not
    # look like a stalled step once training resumes.
    w.progress = max(progress, w.phase_since)
    lost = _lost_rank(w, beats, ranks, now)
    if lost is not None:
        return lost
    if phase == "train" and now - w.progress > lim.stall_s:
        return FailureKind.HANG, f"no step progress for {now - w.progress:.1f} s at step {step}", now - w.progress
    if phases != {"done"} and now - oldest > lim.timeout_s:  # a finished rank stops beating by design
        return FailureKind.DEAD, f"no heartbeat for {now - oldest:.1f} s (phase {phase})", now - oldest
    if len(beats) < ranks and now - w.started > lim.init_timeout_s:
        return (
            FailureKind.DEAD,
            f"only {len(beats)}/{ranks} ranks beat within {lim.init_timeout_s:g} s",
            now - w.started,
        )
    limit = {
        "init": lim.init_timeout_s,
        "load": lim.init_timeout_s,
        "save": lim.save_timeout_s,
        "eval": lim.eval_timeout_s,
        "done": lim.save_timeout_s,
    }.get(phase)
    if limit is not None and now - w.phase_since > limit:
        return (
            FailureKind.HANG,
            f"stuck in phase {phase} for {now - w.phase_since:.1f} s (limit {limit:g} s)",
            now - w.phase_since - limit,
        )
    return None


#: How long a launcher (torchrun) gets to end the job itself after one of its ranks vanished; past
#: it, the survivors are blocked in a collective and torchrun waits out its own 30 s grace.
RANK_GONE_GRACE_S = 2.0


def _lost_rank(w: _Watch, beats: list[dict[str, Any]], ranks: int, now: float) -> tuple[str, str, float] | None:
    """A rank whose process is gone (not finished) while the launcher runs: a crash of that rank.

    Detected by pid within one poll instead of after ``stall_s``, for ranks on this machine only
    (a remote node's ranks are judged by their beats: ``timeout_s``, ``stall_s``); the launcher first gets
    :data:`RANK_GONE_GRACE_S` to exit by itself, so its exit code and the ranks' audit events
    (config error, emergency checkpoint) classify the failure when they can.
    """
    if ranks <= 1:
        return None  # the worker is our own child: its exit is seen directly
    for b in beats:
        rank = int(b.get("rank", 0))
        if b.get("phase") == "done" or not beat_is_local(b) or not pid_gone(int(b.get("pid", 0))):
            continue
        first = w.rank_gone.setdefault(rank, now)
        if now - first >= RANK_GONE_GRACE_S:
            since = float(b["time"])
            return (
                FailureKind.CRASH,
                f"rank {rank} (pid {b.get('pid')}) is gone; the other ranks are blocked",
                now - since,
            )
    return None


def _spawn(
    cmd: Sequence[str],
    log_path: Path,
    header: str,
    *,
    cwd: str | Path | None,
    env: dict[str, str],
    stdin: int = subprocess.DEVNULL,
) -> tuple[subprocess.Popen, int]:
    """Start the worker in its own session, output appended to ``log_path`` after a ``# convoy``
    ``header`` line; returns it and the log offset its output starts at.  ``stdin=PIPE`` for a
    standby (its order comes that way)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"# convoy {header} cmd={' '.join(cmd)}\n".encode())
        log.flush()
        offset = log.tell()
        proc = subprocess.Popen(
            list(cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            cwd=cwd,
            env={**env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=child_setup(os.getpid()),
        )
    return proc, offset


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _clock(t: float) -> str:
    """A log header's time, as a person reads it (UTC)."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


@dataclass(frozen=True)
class AttemptSpec:
    """What one worker attempt runs and how it is watched: the input of :class:`WorkerAttempt`.

    A worker parked by the previous chunk (same ``cmd``) is adopted instead of spawned;
    ``boundary_step`` (pipelined, every chunk but the last): once that step's checkpoint is
    committed the attempt ends with the worker still training, parked for the next chunk (rule 2
    of :mod:`training.chunk_boundary`; the registry is :mod:`tasks.handoff`).
    ``standby_order`` (``until_step``, ``pipelined``): a warm standby of the run is given that
    order instead of spawning ``cmd``, and once the worker trains a new standby is kept ready
    behind it (:mod:`tasks.standby`)."""

    cmd: Sequence[str]
    run_dir: Path
    limits: DetectionLimits
    log_path: Path
    ranks: int = 1
    chunk: int | None = None
    attempt: int | None = None
    env: dict[str, str] | None = None
    cwd: str | Path | None = None
    on_line: Callable[[str], None] | None = None
    tail_lines: int = 80
    boundary_step: int | None = None
    standby_order: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        object.__setattr__(self, "log_path", Path(self.log_path))


def supervise(spec: AttemptSpec) -> Outcome:
    """Run one attempt to completion under watch; return on exit 0 (or a parked hand-off), raise
    :class:`ChunkFailed` otherwise.  See :class:`WorkerAttempt`."""
    return WorkerAttempt(spec).run()


class WorkerAttempt:
    """One worker attempt: start or adopt → watch → stop or park → outcome or failure report.

    Exit 0 only means the worker *says* it finished; the caller checks the committed checkpoint.
    Whatever happens (including KeyboardInterrupt or a Prefect cancellation in this thread), no
    process of the worker's group outlives :meth:`run`, except a worker parked for the next chunk.
    """

    def __init__(self, spec: AttemptSpec) -> None:
        self.spec = spec
        self.run_dir = spec.run_dir
        self.log_path = spec.log_path
        self.tail: collections.deque[str] = collections.deque(maxlen=spec.tail_lines)
        self.failure: tuple[str, str, float] | None = None
        self.handed_off = False
        self.leftover: list[int] = []

    def run(self) -> Outcome:
        self.start()
        try:
            self.watch()
        finally:
            self.stop()
        return self.report()

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Adopt the parked worker, take the standby, or spawn; then follow its log."""
        spec = self.spec
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        live = handoff.adopt(self.run_dir, list(spec.cmd))  # None unless the previous chunk parked it
        self.oom_before = oom_kills()
        self.metrics_offset = _size(RunPaths(self.run_dir).metrics)  # this attempt's rows start here (steps lost)
        self.started = time.time()
        # Beats count from this attempt's start, so stale beats of an earlier worker are no sign of
        # life; an adopted worker's beats are its own however old, so one stopped or wedged before
        # this task adopted it is judged by its last beat (hang/dead), not as one that never beat.
        beats_since = 0.0 if live is not None else self.started
        if live is not None:  # its beats are current; the log is the one it was started with
            # Read on from where the previous chunk stopped: what it said in between (a traceback if it
            # died between the tasks, a launcher naming the failed node) is this chunk's to report.
            self.proc, self.log_path, offset = live.proc, live.log_path, live.offset
            self.tail.extend(live.tail)  # its last words so far, not echoed again
        else:
            for r in range(spec.ranks):  # stale beats of an earlier attempt must not count as liveness
                with contextlib.suppress(FileNotFoundError):
                    heartbeat_path(self.run_dir, r).unlink()
            self.proc, offset = self.take_standby() or _spawn(
                spec.cmd,
                self.log_path,
                f"chunk={spec.chunk} attempt={spec.attempt} started {_clock(self.started)}",
                cwd=spec.cwd,
                env=self.environment(),
            )
        self.position = [offset]
        self.stop_follow = threading.Event()
        self.follower = threading.Thread(
            target=_tail_log,
            args=(self.log_path, offset, self.stop_follow, self.tail, spec.on_line, self.position),
            daemon=True,
        )
        self.follower.start()
        self.watched = _Watch(
            started=self.started, phase_since=self.started, progress=self.started, beats_since=beats_since
        )
        self.last_seen_running = self.exit_seen = self.started
        if live is not None:
            self.recall_adopted()

    def environment(self) -> dict[str, str]:
        return {**os.environ, **(self.spec.env or {})}

    def take_standby(self) -> tuple[subprocess.Popen, int] | None:
        """Give the run's warm standby its order (``standby_order``); None when there is none."""
        spec = self.spec
        ready = standby.take(self.run_dir, **spec.standby_order) if spec.standby_order is not None else None
        if ready is None:
            return None
        self.log_path = ready.log_path
        with open(ready.log_path, "ab") as log:
            log.write(
                f"# convoy chunk={spec.chunk} attempt={spec.attempt} took over standby pid {ready.proc.pid} "
                f"at {_clock(self.started)}\n".encode()
            )
        append_event(
            self.run_dir,
            Event.STANDBY_CALLED,
            chunk=spec.chunk,
            attempt=spec.attempt,
            pid=ready.proc.pid,
            ready_s=round(self.started - ready.started, 3),
        )
        return ready.proc, ready.offset

    def start_standby(self, standby_cmd: list[str], standby_log: Path) -> tuple[subprocess.Popen, int]:
        header = f"standby started {_clock(time.time())}"
        return _spawn(
            standby_cmd, standby_log, header, cwd=self.spec.cwd, env=self.environment(), stdin=subprocess.PIPE
        )

    def recall_adopted(self) -> None:
        """What the adopted worker last said, so a death in the hand-off is measured."""
        beats = [b for b in (read_heartbeat(self.run_dir, r) for r in range(self.spec.ranks)) if b]
        if beats:
            self.watched.last_step = min(int(b.get("step", 0)) for b in beats)
            if self.proc.poll() is not None:  # it died between the tasks: it was last alive at its last beat
                self.last_seen_running = max(float(b.get("time", self.started)) for b in beats)

    # ------------------------------------------------------------------ watch
    def boundary_committed(self) -> bool:
        step = self.spec.boundary_step
        return step is not None and chunk_boundary.boundary_committed(self.run_dir, step)

    def watch(self) -> None:
        """Poll until the worker exits, a limit is crossed, or (pipelined) the boundary is committed."""
        spec = self.spec
        standby_checked = False
        while self.proc.poll() is None:
            self.last_seen_running = time.time()
            # The boundary first: whatever happens after it is committed is the next chunk's.
            if self.boundary_committed():
                break
            self.failure = _failure_verdict(
                self.watched,
                _beats(self.run_dir, spec.ranks, self.watched.clock_floor),
                spec.ranks,
                spec.limits,
                self.last_seen_running,
            )
            if self.failure is not None:
                break
            if spec.standby_order is not None and not standby_checked and self.watched.phase == "train":
                standby_checked = True  # once per attempt: a standby that cannot start is not retried
                standby.ensure(self.run_dir, self.start_standby)  # once the worker trains: not during its start
            time.sleep(spec.limits.poll_s)
        if self.failure is None and self.boundary_committed():
            # Running, or died just after the commit (between two polls): either way this chunk is
            # done and the worker, alive or not, is the next chunk's to adopt and judge.
            self.parked = handoff.LiveWorker(self.proc, list(spec.cmd), self.log_path)
            handoff.park(self.run_dir, self.parked)
            self.handed_off = True
        # Wall time of the detection (exit seen or limit crossed), before the stop takes its grace.
        self.exit_seen = time.time()

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop and reap the worker's group (unless parked), then the log follower."""
        grace = self.spec.limits.grace_s
        if self.handed_off:
            self.leftover = []
        elif self.proc.poll() is None:
            self.leftover = stop_group(self.proc, grace)
        else:
            self.leftover = stop_group(self.proc, min(grace, 2.0))  # the group may outlive its leader
        self.stop_follow.set()
        self.follower.join(timeout=5)
        if self.handed_off:  # before the next chunk's task exists: same thread
            self.parked.offset, self.parked.tail = self.position[0], list(self.tail)

    # ------------------------------------------------------------------ report
    def note(self, text: str) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"# convoy {text}\n".encode())

    def report(self) -> Outcome:
        """The outcome of a finished or parked attempt; :class:`ChunkFailed` for any other."""
        seconds = time.time() - self.started
        rc = self.proc.returncode
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
        if self.handed_off or (self.failure is None and rc == 0):
            return Outcome(
                0 if self.handed_off else rc, seconds, self.watched.last_step, self.log_path, list(self.tail)
            )
        raise self.failure_report(rc, seconds)

    def classify(self, rc: int) -> tuple[str, str, float]:
        """(kind, reason, detected_after_s) of a failed attempt: the watch's verdict, or the exit's."""
        tail, ranks = list(self.tail), self.spec.ranks
        if self.failure is not None:
            kind, reason, detected_after = self.failure
            if (
                kind == FailureKind.CRASH
                and ranks > 1
                and launcher_exit(self.run_dir, 1, tail, self.started) == EXIT_CONFIG
            ):
                kind, reason = FailureKind.CONFIG, config_message(self.tail)  # a rank's config error: never retried
            return kind, reason, detected_after
        code = rc if ranks <= 1 else launcher_exit(self.run_dir, rc, tail, self.started)
        kind = classify_exit(code, tail, self.oom_before, oom_kills())
        reason = {
            FailureKind.CONFIG: config_message(self.tail),
            FailureKind.PREEMPTED: "preempted (exit 75) after saving an emergency checkpoint",
            FailureKind.DISKFULL: diskfull_message(self.tail),
        }.get(kind, signame(code) + ("" if code == rc else f" in a rank (launcher {signame(rc)})"))
        if kind not in _SAYS_WHY and (node := failed_node(tail)):
            reason += f"; first to fail: {node}"
        return kind, reason, self.exit_seen - self.last_seen_running  # upper bound: the exit happened in between

    def failure_report(self, rc: int, seconds: float) -> ChunkFailed:
        """Audit the failure (one ``failure`` event, steps lost by their one definition) and say it."""
        kind, reason, detected_after = self.classify(rc)
        committed, passed_over = resume_point(self.run_dir)
        trained_to = trained_high_water(self.run_dir, self.watched.last_step, self.metrics_offset)
        details = {
            "detected_after_s": round(detected_after, 3),
            "last_beat_step": self.watched.last_step,
            "trained_to": trained_to,
            "last_committed_step": committed,
            "steps_lost": steps_lost(trained_to, committed),  # the next attempt resumes from `committed`
            "passed_over": passed_over,  # newer checkpoints that do not verify: why it resumes further back
            "returncode": rc,
            "reason": reason,
            "error": error_line(self.tail),  # tasks/repeated.py compares it between attempts
            "log": str(self.log_path),
        }
        append_event(
            self.run_dir,
            Event.FAILURE,
            failure=kind,
            chunk=self.spec.chunk,
            attempt=self.spec.attempt,
            detected_at=round(self.exit_seen, 3),
            leftover_pids=self.leftover,
            **details,
        )
        details.update(tail=list(self.tail)[-10:], seconds=round(seconds, 3))
        where = f"chunk {self.spec.chunk}" if self.spec.chunk is not None else "worker"
        message = f"{where} {kind}: {reason}"
        said = error_line(self.tail) if kind in (FailureKind.CRASH, FailureKind.OOM) else None
        if said:  # a process that ended itself said why; a killed or stalled one did not
            message += f" | last output: {said[:300]}"
        return ChunkFailed(kind, message, details)
