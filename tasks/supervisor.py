"""Chunk supervisor: run one worker process group, watch it, classify and clean up failures.

Why a separate process we watch instead of Prefect's own runners: a SIGKILLed task process in
Prefect's process pool breaks the whole flow (``BrokenProcessPool``, no retry) and a task timeout
leaves the child running.  So the Prefect task stays alive and *owns* the worker: it spawns it in
its own session (process group), polls it every ``poll_s`` and, on any failure, stops the whole
group itself (SIGTERM → grace → SIGKILL), reaps every descendant, writes the audit event and
raises :class:`ChunkFailed`.  Prefect then retries only that chunk.

This module never imports Prefect, so it is unit-tested with stand-in scripts.

Failure kinds (DESIGN "Worker ⇄ supervisor contract"):

``config``     exit 78 — configuration/data error, never retried.
``preempted``  exit 75 — SIGTERM from outside; the worker saved an emergency checkpoint.
``oom``        best effort: killed by SIGKILL (or exit 137) *and* the cgroup ``oom_kill`` counter
               rose during the attempt, or the output tail says "out of memory"/``MemoryError``.
``killed``     ended by a signal it did not raise itself (SIGKILL, SIGTERM, SIGINT, ...).
``crash``      any other non-zero exit, a fatal signal of its own (SIGSEGV/SIGABRT/SIGBUS/SIGFPE/
               SIGILL), or exit 0 without a committed checkpoint at the chunk's end step.
``hang``       alive and beating but no step progress for ``stall_s`` in phase ``train``, or stuck
               in a phase longer than its own limit (init/load: ``init_timeout_s``; save/eval and
               the exit after ``done``: ``save_timeout_s``).
``dead``       no heartbeat for ``timeout_s`` (a frozen or wedged process), or none at all within
               ``init_timeout_s`` of the start.
``timeout``    the attempt ran past the chunk deadline.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from training.config import EXIT_CONFIG, EXIT_PREEMPTED
from training.events import append_event, read_events
from training.heartbeat import heartbeat_path, read_heartbeat

FAILURE_KINDS = ("crash", "killed", "oom", "hang", "dead", "preempted", "timeout", "config")
#: Kinds Prefect must never retry: the same input fails the same way.
NOT_RETRYABLE = frozenset({"config"})
#: Signals a process raises on itself when it crashes (as opposed to being killed from outside).
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
_OOM_MARKERS = ("out of memory", "memoryerror", "cannot allocate memory")
_PR_SET_PDEATHSIG = 1
try:  # resolved in the parent: dlopen inside a forked child of a threaded process can deadlock
    _PRCTL: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


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


@dataclass(frozen=True)
class Limits:
    """Detection limits in seconds; mirrors ``heartbeat.*`` plus the chunk deadline."""

    stall_s: float = 20.0
    timeout_s: float = 10.0
    init_timeout_s: float = 120.0
    save_timeout_s: float = 120.0
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


def worker_command(run_dir: Path, until_step: int, ranks: int = 1) -> list[str]:
    """The worker's command line; more than one rank goes through torchrun (elastic launcher)."""
    tail = ["-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(until_step)]
    if ranks <= 1:
        return [sys.executable, *tail]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *tail]


def _oom_kills() -> int | None:
    """cgroup v2 ``oom_kill`` counter (None where unavailable, e.g. cgroup v1 or no access)."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory.events.local"):
        try:
            for line in Path(path).read_text().splitlines():
                key, _, val = line.partition(" ")
                if key == "oom_kill":
                    return int(val)
        except (OSError, ValueError):
            continue
    return None


def _child_setup(parent_pid: int) -> Callable[[], None]:
    """preexec: ask the kernel to SIGTERM the worker if the supervising thread dies.

    Without this a SIGKILLed flow process leaves its worker training on, unsupervised, writing
    checkpoints while a re-run starts a second one.  SIGTERM lets it save an emergency checkpoint.
    """

    def setup() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(EXIT_PREEMPTED)

    return setup


def _follow(
    path: Path,
    offset: int,
    stop: threading.Event,
    tail: collections.deque[str],
    on_line: Callable[[str, str], None] | None,
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
                tail.append(line)
                if on_line is not None:
                    with contextlib.suppress(Exception):
                        on_line("out", line)
            elif stop.is_set():
                if buf:
                    tail.append(buf.decode(errors="replace"))
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
        w.phase, w.phase_since = phase, now
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
        "eval": lim.save_timeout_s,
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


def _pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _lost_rank(w: _Watch, beats: list[dict[str, Any]], ranks: int, now: float) -> tuple[str, str, float] | None:
    """A rank whose process is gone (not finished) while the launcher runs: a crash of that rank.

    Detected by pid within one poll instead of after ``stall_s``; the launcher first gets
    :data:`RANK_GONE_GRACE_S` to exit by itself, so its exit code and the ranks' audit events
    (config error, emergency checkpoint) classify the failure when they can.
    """
    if ranks <= 1:
        return None  # the worker is our own child: its exit is seen directly
    for b in beats:
        rank = int(b.get("rank", 0))
        if b.get("phase") == "done" or not _pid_gone(int(b.get("pid", 0))):
            continue
        first = w.rank_gone.setdefault(rank, now)
        if now - first >= RANK_GONE_GRACE_S:
            since = float(b["time"])
            return "crash", f"rank {rank} (pid {b.get('pid')}) is gone; the other ranks are blocked", now - since
    return None


def classify_exit(returncode: int, tail: Sequence[str], oom_before: int | None, oom_after: int | None) -> str:
    """Failure kind of a worker that exited by itself with ``returncode`` (non-zero)."""
    if returncode == EXIT_CONFIG:
        return "config"
    if returncode == EXIT_PREEMPTED:
        return "preempted"
    oom_counter = oom_before is not None and oom_after is not None and oom_after > oom_before
    text = "\n".join(tail[-20:]).lower()
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) and oom_counter:
        return "oom"
    if any(m in text for m in _OOM_MARKERS):
        return "oom"
    if returncode < 0:
        return "crash" if -returncode in _CRASH_SIGNALS else "killed"
    if returncode > 128 and returncode - 128 in {int(s) for s in signal.Signals}:
        # A shell or launcher reporting its child's signal as 128+n.
        return "crash" if returncode - 128 in _CRASH_SIGNALS else "killed"
    return "crash"


def _launcher_exit(run_dir: Path, returncode: int, tail: Sequence[str], since: float) -> int:
    """The exit that matters when torchrun stands between us and the ranks.

    torchrun exits 1 whatever its ranks did, so the ranks' own audit events decide first (a
    config error, an emergency checkpoint), then the "Root Cause" exit code in its failure report.
    """
    if returncode in (0, EXIT_CONFIG, EXIT_PREEMPTED):
        return returncode
    recent = [e for e in read_events(run_dir) if e.get("time", 0) >= since]
    if any(e["kind"] == "config_error" for e in recent):
        return EXIT_CONFIG
    if any(e["kind"] == "preempted" for e in recent):
        return EXIT_PREEMPTED
    text = "\n".join(tail)
    root = text[text.find("Root Cause") :] if "Root Cause" in text else text
    m = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    return int(m.group(1)) if m else returncode


def _config_message(tail: Sequence[str]) -> str:
    """The worker's one-line config message (it prints ``config error: ...`` last, on stderr)."""
    for line in reversed(tail):
        if line.startswith("config error"):
            return line
    return next((line for line in reversed(tail) if line.strip()), "configuration error (exit 78)")


def _signame(returncode: int) -> str:
    try:
        return f"signal {signal.Signals(-returncode).name}" if returncode < 0 else f"exit code {returncode}"
    except ValueError:
        return f"signal {-returncode}"


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> list[int]:
    """SIGTERM the worker's group, wait ``grace_s``, SIGKILL, reap. Returns pids still alive (bug).

    Descendants are collected *before* anything is signalled: once the worker dies its children
    are re-parented and can no longer be found from it.  Any that left the process group
    (``setsid``) are signalled one by one.
    """
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    pgid = proc.pid  # start_new_session=True: the group id is the worker's pid

    def signal_all(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    signal_all(signal.SIGTERM)
    # A stopped (SIGSTOPped) process only acts on SIGTERM once continued; this lets it save.
    signal_all(signal.SIGCONT)
    _wait_gone(proc, procs, grace_s)
    if _alive(procs) or proc.poll() is None:
        signal_all(signal.SIGKILL)
        _wait_gone(proc, procs, 10.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    return [p.pid for p in procs if _is_live(p)]


def _is_live(p: psutil.Process) -> bool:
    """Running and not a zombie.  A zombie whose parent is not us is its parent's to reap."""
    try:
        if p.status() == psutil.STATUS_ZOMBIE:
            if p.ppid() == os.getpid():
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(p.pid, os.WNOHANG)
            return False
        return p.is_running()
    except psutil.Error:
        return False


def _alive(procs: list[psutil.Process]) -> bool:
    return any(_is_live(p) for p in procs)


def _wait_gone(proc: subprocess.Popen[bytes], procs: list[psutil.Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.poll()  # reap the direct child as soon as it exits
        if proc.returncode is not None and not _alive(procs):
            return
        time.sleep(0.05)


def reap_stale_worker(run_dir: Path, ranks: int = 1, grace_s: float = 5.0) -> list[int]:
    """Stop a worker of this run left over from a supervisor that died (caller holds the run lock).

    Identified by the heartbeat's pid *and* a command line naming the run directory, so a recycled
    pid is never touched.  Returns the pids that were stopped.
    """
    stopped = []
    for r in range(ranks):
        beat = read_heartbeat(run_dir, r)
        if not beat:
            continue
        try:
            p = psutil.Process(int(beat["pid"]))
            if str(run_dir) not in " ".join(p.cmdline()) or p.status() == psutil.STATUS_ZOMBIE:
                continue
            group = [p, *p.children(recursive=True)]
            for q in group:
                with contextlib.suppress(psutil.Error):
                    q.terminate()
            _gone, alive = psutil.wait_procs(group, timeout=grace_s)
            for q in alive:
                with contextlib.suppress(psutil.Error):
                    q.kill()
            psutil.wait_procs(alive, timeout=5)
            stopped.append(p.pid)
        except (psutil.Error, KeyError, ValueError):
            continue
    if stopped:
        append_event(run_dir, "stale_worker_stopped", pids=stopped)
    return stopped


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
    on_line: Callable[[str, str], None] | None = None,
    tail_lines: int = 80,
) -> Outcome:
    """Run ``cmd`` to completion under watch; return on exit 0, raise :class:`ChunkFailed` otherwise.

    Exit 0 only means the worker *says* it finished; the caller checks the committed checkpoint.
    Whatever happens (including KeyboardInterrupt or a Prefect cancellation in this thread), no
    process of the worker's group outlives this call.
    """
    run_dir = Path(run_dir)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):  # stale beats of an earlier attempt must not count as liveness
        with contextlib.suppress(FileNotFoundError):
            heartbeat_path(run_dir, r).unlink()
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    oom_before = _oom_kills()
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    started = time.time()
    with open(log_path, "ab") as log:
        log.write(f"# convoy chunk={chunk} attempt={attempt} started={started:.3f} cmd={' '.join(cmd)}\n".encode())
        log.flush()
        offset = log.tell()
        proc = subprocess.Popen(
            list(cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=full_env,
            start_new_session=True,
            preexec_fn=_child_setup(os.getpid()),
        )
    stop_follow = threading.Event()
    follower = threading.Thread(target=_follow, args=(log_path, offset, stop_follow, tail, on_line), daemon=True)
    follower.start()
    watch = _Watch(started=started, phase_since=started, progress=started)
    failure: tuple[str, str, float] | None = None
    last_seen_running = exit_seen = started
    try:
        while proc.poll() is None:
            last_seen_running = time.time()
            failure = _check(watch, _beats(run_dir, ranks, started), ranks, limits, last_seen_running)
            if failure is not None:
                break
            time.sleep(limits.poll_s)
        # Wall time of the detection (exit seen or limit crossed), before the stop takes its grace.
        exit_seen = time.time()
    finally:
        if proc.poll() is None:
            leftover = stop_group(proc, limits.grace_s)
        else:
            leftover = stop_group(proc, min(limits.grace_s, 2.0))  # the group may outlive its leader
        stop_follow.set()
        follower.join(timeout=5)
    seconds = time.time() - started
    rc = proc.returncode
    with open(log_path, "ab") as log:
        log.write(f"# convoy exit={rc} after {seconds:.2f} s\n".encode())
    if leftover:
        append_event(run_dir, "reap_failed", chunk=chunk, attempt=attempt, pids=leftover)
    if failure is None and rc == 0:
        return Outcome(rc, seconds, watch.last_step, log_path, list(tail))
    if failure is not None:
        kind, reason, detected_after = failure
        if kind == "crash" and ranks > 1 and _launcher_exit(run_dir, 1, list(tail), started) == EXIT_CONFIG:
            kind, reason = "config", _config_message(tail)  # a rank's config error: never retried
    else:
        code = rc if ranks <= 1 else _launcher_exit(run_dir, rc, list(tail), started)
        kind = classify_exit(code, list(tail), oom_before, _oom_kills())
        reason = {
            "config": _config_message(tail),
            "preempted": "preempted (exit 75) after saving an emergency checkpoint",
        }.get(kind, _signame(code) + ("" if code == rc else f" in a rank (launcher {_signame(rc)})"))
        detected_after = exit_seen - last_seen_running  # upper bound: the exit happened in between
    committed = last_committed_step(run_dir)
    lost = (watch.last_step - committed) if (watch.last_step is not None and committed is not None) else None
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
        last_committed_step=committed,
        steps_lost=lost,
        log=str(log_path),
        leftover_pids=leftover,
    )
    details = {
        "detected_after_s": round(detected_after, 3),
        "last_beat_step": watch.last_step,
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
    if kind not in ("config", "preempted") and tail:
        message += f" | last output: {tail[-1][:300]}"
    raise ChunkFailed(kind, message, details)
