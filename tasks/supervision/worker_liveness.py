"""Is the watched worker still alive and training?  The liveness judgement of one attempt.

Why its own module: these rules (deadline, no beat, no progress, a phase past its limit, a rank
gone) are the heartbeat half of docs/architecture.md "Worker ⇄ supervisor contract" and are
unit-tested on beat records without running anything.  The exit half (exit codes, output) is
:mod:`tasks.supervision.failure_kinds`; the supervisor (:mod:`tasks.supervision.supervisor`) polls both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tasks.supervision.failure_kinds import Verdict
from tasks.supervision.process_group import pid_gone
from training.config import RunConfig
from training.events import FailureKind, Phase
from training.heartbeat import Beat, read_heartbeat

#: How long a launcher (torchrun) gets to end the job itself after one of its ranks vanished; past
#: it, the survivors are blocked in a collective and torchrun waits out its own 30 s grace.
RANK_GONE_GRACE_S = 2.0
#: The longest pause between two looks at a worker: a death wakes the watch at once (a pidfd),
#: but a stalled or silent worker is only seen by looking.
MAX_POLL_S = 0.2


@dataclass(frozen=True)
class DetectionLimits:
    """Detection limits in seconds: ``heartbeat.*``, the chunk deadline (0 = none) and how often
    the beats are read.  Built from the run's config only (:meth:`from_config`), so the limits
    have one owner: :class:`training.config.HeartbeatConfig`."""

    stall_s: float
    timeout_s: float
    init_timeout_s: float
    save_timeout_s: float
    eval_timeout_s: float
    compile_timeout_s: float
    grace_s: float
    deadline_s: float
    poll_s: float

    @classmethod
    def from_config(cls, config: RunConfig) -> DetectionLimits:
        hb, orch = config.heartbeat, config.orchestration
        return cls(
            stall_s=hb.stall_s,
            timeout_s=hb.timeout_s,
            init_timeout_s=hb.init_timeout_s,
            save_timeout_s=hb.save_timeout_s,
            eval_timeout_s=hb.eval_timeout_s,
            compile_timeout_s=hb.compile_timeout_s,
            grace_s=hb.grace_s,
            deadline_s=orch.chunk_deadline_s,
            poll_s=min(MAX_POLL_S, hb.interval_s),
        )

    def phase_limit(self, phase: str) -> float | None:
        """How long a worker may stay in ``phase`` (None: judged by progress, ``stall_s``)."""
        return {
            Phase.INIT: self.init_timeout_s,
            Phase.LOAD: self.init_timeout_s,
            Phase.SAVE: self.save_timeout_s,
            Phase.EVAL: self.eval_timeout_s,
            Phase.COMPILE: self.compile_timeout_s,
            Phase.DONE: self.save_timeout_s,
        }.get(phase)


@dataclass
class Watch:
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


def fresh_beats(run_dir: Path, ranks: int, since: float) -> list[Beat]:
    """Fresh beats (written by this attempt) of every rank that has beaten yet."""
    out = []
    for r in range(ranks):
        beat = read_heartbeat(run_dir, r)
        if beat is not None and beat.time >= since:
            out.append(beat)
    return out


def _observe(w: Watch, beats: list[Beat], now: float) -> tuple[str, int, float]:
    """Fold the beats into ``w``; returns (the slowest rank's phase, step, oldest beat time)."""
    # The slowest rank decides: one stalled rank stalls a collective for everybody.
    oldest = min(b.time for b in beats)
    step = min(b.step for b in beats)
    phases = {b.phase for b in beats}
    # A rank still compiling its first step holds the others in its first collective: compile wins.
    phase = next((p for p in (Phase.COMPILE, Phase.TRAIN) if p in phases), sorted(phases)[0])
    progress = min(b.progress_time for b in beats)
    if phase != w.phase:
        # The phase began no later than the beat that first reports it.  Taking our own clock
        # instead (up to a poll and a beat later) would let a worker stopped just after a phase
        # change (e.g. adopted at a chunk boundary) look dead before it looked hung when stall_s
        # equals timeout_s: the stall clock must never start after the last beat.
        w.phase, w.phase_since = phase, min(now, max(oldest, w.clock_floor))
    w.last_step = step
    w.last_beat = oldest
    # Progress in the current phase counts from when we first saw the phase: a long save must not
    # look like a stalled step once training resumes.
    w.progress = max(progress, w.phase_since)
    return phase, step, oldest


def failure_verdict(w: Watch, beats: list[Beat], ranks: int, lim: DetectionLimits, now: float) -> Verdict | None:
    """The verdict on a running worker if it has failed (a limit crossed, a rank gone), else None."""
    if lim.deadline_s and now - w.started > lim.deadline_s:
        overdue = now - w.started - lim.deadline_s
        return Verdict(FailureKind.TIMEOUT, f"chunk deadline of {lim.deadline_s:g} s exceeded", overdue)
    if not beats:
        if now - w.started > lim.init_timeout_s:
            reason = f"no heartbeat within {lim.init_timeout_s:g} s of start"
            return Verdict(FailureKind.DEAD, reason, now - w.started)
        return None
    phase, step, oldest = _observe(w, beats, now)
    lost = lost_rank(w, beats, ranks, now)
    if lost is not None:
        return lost
    if phase == Phase.TRAIN and now - w.progress > lim.stall_s:
        reason = f"no step progress for {now - w.progress:.1f} s at step {step}"
        return Verdict(FailureKind.HANG, reason, now - w.progress)
    finished = all(b.done for b in beats)  # a finished rank stops beating by design
    if not finished and now - oldest > lim.timeout_s:
        silent = f"no heartbeat for {now - oldest:.1f} s in phase {phase}"
        state = silent_state(beats)
        if state is not None:  # alive but silent: a hang, whatever the order of the limits
            return Verdict(FailureKind.HANG, f"{silent}; {state}", now - oldest)
        return Verdict(FailureKind.DEAD, f"{silent}; the process is gone", now - oldest)
    if len(beats) < ranks and now - w.started > lim.init_timeout_s:
        reason = f"only {len(beats)}/{ranks} ranks beat within {lim.init_timeout_s:g} s"
        return Verdict(FailureKind.DEAD, reason, now - w.started)
    limit = lim.phase_limit(phase)
    if limit is not None and now - w.phase_since > limit:
        reason = f"stuck in phase {phase} for {now - w.phase_since:.1f} s (limit {limit:g} s)"
        return Verdict(FailureKind.HANG, reason, now - w.phase_since - limit)
    return None


#: What a process's state says about a worker that stopped beating (psutil's status names).
_SILENT = {
    "stopped": "its process is alive but stopped (SIGSTOP or a debugger)",
    "tracing-stop": "its process is alive but stopped by a tracer",
    "disk-sleep": "its process is alive but stuck in the kernel (uninterruptible I/O)",
}


def silent_state(beats: list[Beat]) -> str | None:
    """Why a worker whose beats stopped is not dead: what its process is doing, when every beating
    process is on this machine and still there; None when one is gone or cannot be checked (a
    remote node's rank: judged by its beats alone, so dead)."""
    states = []
    for b in beats:
        if not b.is_local:
            return None
        try:
            status = psutil.Process(b.pid).status()
        except psutil.Error:
            return None
        if status == psutil.STATUS_ZOMBIE:
            return None
        states.append(_SILENT.get(status, "its process is alive but silent (every thread blocked or frozen)"))
    return states[0] if states else None


def lost_rank(w: Watch, beats: list[Beat], ranks: int, now: float) -> Verdict | None:
    """A rank whose process is gone (not finished) while the launcher runs: a crash of that rank.

    Detected by pid within one poll instead of after ``stall_s``, for ranks on this machine only
    (a remote node's ranks are judged by their beats: ``timeout_s``, ``stall_s``); the launcher first gets
    :data:`RANK_GONE_GRACE_S` to exit by itself, so its exit code and the ranks' audit events
    (config error, emergency checkpoint) classify the failure when they can.
    """
    if ranks <= 1:
        return None  # the worker itself is watched: its exit is seen directly
    for b in beats:
        if b.done or not b.is_local or not pid_gone(b.pid):
            continue
        first = w.rank_gone.setdefault(b.rank, now)
        if now - first >= RANK_GONE_GRACE_S:
            reason = f"rank {b.rank} (pid {b.pid}) is gone; the other ranks are blocked"
            return Verdict(FailureKind.CRASH, reason, now - b.time)
    return None
