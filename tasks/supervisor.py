"""Chunk supervisor: run one worker process group, watch it, classify and clean up failures.

Why a separate process we watch instead of Prefect's own runners: a SIGKILLed task process in
Prefect's process pool breaks the whole flow (``BrokenProcessPool``, no retry) and a task timeout
leaves the child running.  So the Prefect task stays alive and *owns* the worker: it spawns it in
its own session (process group), polls it every ``poll_s`` and, on any failure, stops the whole
group itself (SIGTERM → grace → SIGKILL), reaps every descendant, writes the audit event and
raises :class:`ChunkFailed`.  Prefect then retries only that chunk.

This module never imports Prefect, so it is unit-tested with stand-in scripts.

Failure kinds and the rules that assign them: :mod:`tasks.classify`.  Process-group
lifecycle (die with the supervisor, stop, reap): :mod:`tasks.procs`.
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
from tasks.classify import (
    FAILURE_KINDS,
    NOT_RETRYABLE,
    classify_exit,
    config_message,
    diskfull_message,
    launcher_exit,
    oom_kills,
    signame,
)
from tasks.multinode import failed_node, launcher_command
from tasks.procs import child_setup, pid_gone, reap_stale_worker, stop_group
from training.audit import steps_lost, trained_high_water
from training.config import EXIT_CONFIG
from training.events import append_event
from training.heartbeat import beat_is_local, heartbeat_path, read_heartbeat
from training.paths import RunPaths

#: Re-exported: callers only need this module.
__all__ = [
    "FAILURE_KINDS",
    "NOT_RETRYABLE",
    "ChunkFailed",
    "Limits",
    "Outcome",
    "classify_exit",
    "last_committed_step",
    "reap_stale_worker",
    "stop_group",
    "supervise",
    "worker_command",
]


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
        facts = [f"at step {d['trained_to']}" if d.get("trained_to") is not None else "",
                 f"detected after {d['detected_after_s']} s" if d.get("detected_after_s") is not None else "",
                 f"resumes from step {d.get('last_committed_step') or 0}" if "last_committed_step" in d else "",
                 f"{d['steps_lost']} step(s) lost" if d.get("steps_lost") is not None else "",
                 f"log {d['log']}" if d.get("log") else ""]
        shown = "; ".join(f for f in facts if f)
        return f"{self.message} ({shown})" if shown else self.message


@dataclass(frozen=True)
class Limits:
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
    def from_config(cls, config: Any) -> Limits:
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


def worker_command(
    run_dir: Path, until_step: int, ranks: int = 1, pipelined: bool = False,
    hosts: Sequence[str] = (), node_launch: str = "",
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


def _follow(
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


def _check(
    w: _Watch, beats: list[dict[str, Any]], ranks: int, lim: Limits, now: float
) -> tuple[str, str, float] | None:
    """Return (kind, reason, detected_after_s) if the running worker has failed, else None."""
    if lim.deadline_s and now - w.started > lim.deadline_s:
        return "timeout", f"chunk deadline of {lim.deadline_s:g} s exceeded", now - w.started - lim.deadline_s
    if not beats:
        if now - w.started > lim.init_timeout_s:
            return "dead", f"no heartbeat within {lim.init_timeout_s:g} s of start", now - w.started
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
        w.phase, w.phase_since = phase, min(now, max(oldest, w.started))
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
        return "hang", f"no step progress for {now - w.progress:.1f} s at step {step}", now - w.progress
    if phases != {"done"} and now - oldest > lim.timeout_s:  # a finished rank stops beating by design
        return "dead", f"no heartbeat for {now - oldest:.1f} s (phase {phase})", now - oldest
    if len(beats) < ranks and now - w.started > lim.init_timeout_s:
        return (
            "dead",
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
            "hang",
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
            return "crash", f"rank {rank} (pid {b.get('pid')}) is gone; the other ranks are blocked", now - since
    return None


def _spawn(
    cmd: Sequence[str], log_path: Path, chunk: int | None, attempt: int | None, started: float,
    cwd: str | Path | None, env: dict[str, str], stdin: int = subprocess.DEVNULL,
) -> tuple[subprocess.Popen, int]:
    """Start the worker in its own session, output appended to ``log_path``; returns it and the
    log offset its output starts at.  ``stdin=PIPE`` for a standby (its order comes that way)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"# convoy chunk={chunk} attempt={attempt} started={started:.3f} cmd={' '.join(cmd)}\n".encode())
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


def last_committed_step(run_dir: Path) -> int | None:
    """Step of the newest *verified* checkpoint (imported lazily: it pulls in torch)."""
    from training.checkpoint import CheckpointStore

    ck = CheckpointStore(run_dir).latest_valid(record=False)
    return ck.step if ck is not None else None


def supervise(
    cmd: Sequence[str],
    run_dir: str | Path,
    limits: Limits,
    log_path: str | Path,
    *,
    ranks: int = 1,
    chunk: int | None = None,
    attempt: int | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    on_line: Callable[[str], None] | None = None,
    tail_lines: int = 80,
    done_at_step: int | None = None,
    pipeline: bool = False,
    standby_order: dict[str, Any] | None = None,
) -> Outcome:
    """Run ``cmd`` to completion under watch; return on exit 0, raise :class:`ChunkFailed` otherwise.

    Exit 0 only means the worker *says* it finished; the caller checks the committed checkpoint.
    Whatever happens (including KeyboardInterrupt or a Prefect cancellation in this thread), no
    process of the worker's group outlives this call — except with ``pipeline``: a worker parked
    by the previous chunk (same ``cmd``) is adopted instead of spawned, and once the checkpoint of
    ``done_at_step`` is committed the call returns with the worker still training, parked for the
    next chunk (:mod:`tasks.handoff`).  With ``standby_order`` (``until_step``, ``pipelined``) a
    warm standby of the run is given that order instead of spawning ``cmd``, and once the worker
    trains a new standby is kept ready behind it (:mod:`tasks.standby`).
    """
    run_dir = Path(run_dir)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    live = handoff.adopt(run_dir, list(cmd)) if pipeline else None
    oom_before = oom_kills()
    metrics_offset = _size(run_dir / "metrics.jsonl")  # this attempt's rows start here (steps lost)
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    started = time.time()
    if live is not None:  # its beats are current; the log is the one it was started with
        # Read on from where the previous chunk stopped: what it said in between (a traceback if it
        # died between the tasks, a launcher naming the failed node) is this chunk's to report.
        proc, log_path, offset = live.proc, live.log_path, live.offset
    else:
        for r in range(ranks):  # stale beats of an earlier attempt must not count as liveness
            with contextlib.suppress(FileNotFoundError):
                heartbeat_path(run_dir, r).unlink()
        ready = standby.take(run_dir, **standby_order) if standby_order is not None else None
        if ready is not None:
            proc, log_path, offset = ready.proc, ready.log_path, ready.offset
            with open(log_path, "ab") as log:
                log.write(f"# convoy chunk={chunk} attempt={attempt} took over standby pid {proc.pid} at "
                          f"{started:.3f}\n".encode())
            append_event(run_dir, "standby_called", chunk=chunk, attempt=attempt, pid=proc.pid,
                         ready_s=round(started - ready.started, 3))
        else:
            proc, offset = _spawn(cmd, log_path, chunk, attempt, started, cwd, {**os.environ, **(env or {})})

    def start_standby(standby_cmd: list[str], standby_log: Path) -> tuple[subprocess.Popen, int]:
        return _spawn(standby_cmd, standby_log, None, None, time.time(), cwd, {**os.environ, **(env or {})},
                      stdin=subprocess.PIPE)
    committed_marker = RunPaths(run_dir).checkpoint(done_at_step) / "manifest.json" \
        if done_at_step is not None else None
    handed_off = False
    stop_follow = threading.Event()
    position = [offset]
    follower = threading.Thread(target=_follow, args=(log_path, offset, stop_follow, tail, on_line, position),
                                daemon=True)
    follower.start()
    watch = _Watch(started=started, phase_since=started, progress=started)
    failure: tuple[str, str, float] | None = None
    last_seen_running = exit_seen = started
    standby_checked = False
    if live is not None:  # what the adopted worker last said, so a death in the hand-off is measured
        beats = [b for b in (read_heartbeat(run_dir, r) for r in range(ranks)) if b]
        if beats:
            watch.last_step = min(int(b.get("step", 0)) for b in beats)
            if proc.poll() is not None:  # it died between the tasks: it was last alive at its last beat
                last_seen_running = max(float(b.get("time", started)) for b in beats)
    try:
        while proc.poll() is None:
            last_seen_running = time.time()
            # The boundary first: whatever happens after it is committed is the next chunk's.
            if pipeline and committed_marker is not None and committed_marker.exists():
                break
            failure = _check(watch, _beats(run_dir, ranks, started), ranks, limits, last_seen_running)
            if failure is not None:
                break
            if standby_order is not None and not standby_checked and watch.phase == "train":
                standby_checked = True  # once per attempt: a standby that cannot start is not retried
                standby.ensure(run_dir, start_standby)  # once the worker trains: not during its start
            time.sleep(limits.poll_s)
        if pipeline and failure is None and committed_marker is not None and committed_marker.exists():
            # Running, or died just after the commit (between two polls): either way this chunk is
            # done and the worker, alive or not, is the next chunk's to adopt and judge.
            parked = handoff.LiveWorker(proc, list(cmd), log_path)
            handoff.park(run_dir, parked)
            handed_off = True
        # Wall time of the detection (exit seen or limit crossed), before the stop takes its grace.
        exit_seen = time.time()
    finally:
        if handed_off:
            leftover = []
        elif proc.poll() is None:
            leftover = stop_group(proc, limits.grace_s)
        else:
            leftover = stop_group(proc, min(limits.grace_s, 2.0))  # the group may outlive its leader
        stop_follow.set()
        follower.join(timeout=5)
        if handed_off:
            parked.offset = position[0]  # before the next chunk's task exists: same thread
    seconds = time.time() - started
    rc = proc.returncode
    if not handed_off:
        with open(log_path, "ab") as log:
            log.write(f"# convoy exit={rc} after {seconds:.2f} s\n".encode())
    if leftover:
        append_event(run_dir, "reap_failed", chunk=chunk, attempt=attempt, pids=leftover)
    if handed_off:
        with open(log_path, "ab") as log:
            log.write(f"# convoy chunk={chunk} committed step {done_at_step} after {seconds:.2f} s; worker "
                      "continues into the next chunk\n".encode())
        return Outcome(0, seconds, watch.last_step, log_path, list(tail))
    if failure is None and rc == 0:
        return Outcome(rc, seconds, watch.last_step, log_path, list(tail))
    if failure is not None:
        kind, reason, detected_after = failure
        if kind == "crash" and ranks > 1 and launcher_exit(run_dir, 1, list(tail), started) == EXIT_CONFIG:
            kind, reason = "config", config_message(tail)  # a rank's config error: never retried
    else:
        code = rc if ranks <= 1 else launcher_exit(run_dir, rc, list(tail), started)
        kind = classify_exit(code, list(tail), oom_before, oom_kills())
        reason = {
            "config": config_message(tail),
            "preempted": "preempted (exit 75) after saving an emergency checkpoint",
            "diskfull": diskfull_message(tail),
        }.get(kind, signame(code) + ("" if code == rc else f" in a rank (launcher {signame(rc)})"))
        if kind not in ("config", "preempted", "diskfull") and (node := failed_node(tail)):
            reason += f"; first to fail: {node}"
        detected_after = exit_seen - last_seen_running  # upper bound: the exit happened in between
    committed = last_committed_step(run_dir)
    trained_to = trained_high_water(run_dir, watch.last_step, metrics_offset)
    lost = steps_lost(trained_to, committed)  # the next attempt resumes from `committed` (0 if none)
    append_event(
        run_dir,
        "failure",
        failure=kind,
        reason=reason,
        chunk=chunk,
        attempt=attempt,
        returncode=rc,
        detected_after_s=round(detected_after, 3),
        detected_at=round(exit_seen, 3),
        last_beat_step=watch.last_step,
        trained_to=trained_to,
        last_committed_step=committed,
        steps_lost=lost,
        log=str(log_path),
        leftover_pids=leftover,
    )
    details = {
        "detected_after_s": round(detected_after, 3),
        "last_beat_step": watch.last_step,
        "trained_to": trained_to,
        "last_committed_step": committed,
        "steps_lost": lost,
        "returncode": rc,
        "reason": reason,
        "log": str(log_path),
        "tail": list(tail)[-10:],
        "seconds": round(seconds, 3),
    }
    where = f"chunk {chunk}" if chunk is not None else "worker"
    message = f"{where} {kind}: {reason}"
    if kind not in ("config", "preempted", "diskfull") and tail:
        message += f" | last output: {tail[-1][:300]}"
    raise ChunkFailed(kind, message, details)
