"""Adaptive checkpoint interval (``checkpoint.every_steps: auto``), after CheckFreq (FAST'21).

The cost of one checkpoint is what training loses to it: the snapshot stall plus the extra
step time while the background persist competes for cores.  Both are *measured* (moving
averages).  The interval is the Young/Daly optimum √(2·cost·MTBF), raised where needed so that
cost/interval never exceeds ``max_overhead``, converted to steps with the measured step time.
MTBF is configured, or estimated from failures recorded in ``events.jsonl`` across attempts
(the configured one only while the memory tier is on: :meth:`SaveSchedule.for_run`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from training.checkpointing.reliability import young_daly_h
from training.events import Event, FailureKind, read_events

WARMUP_STEPS = 10  # first save early, to measure the stall


class AdaptiveInterval:
    def __init__(self, mtbf_s: float, max_overhead: float, alpha: float = 0.3) -> None:
        self.mtbf_s = mtbf_s
        self.max_overhead = max_overhead
        self.alpha = alpha
        self.step_s: float | None = None  # steps without a persist in flight
        self.cost_s: float | None = None  # stall + overlap slowdown per checkpoint
        self._overlap_s = 0.0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_step(self, seconds: float, persist_in_flight: bool) -> None:
        if persist_in_flight and self.step_s is not None:
            self._overlap_s += max(0.0, seconds - self.step_s)
        elif not persist_in_flight:
            self.step_s = self._ema(self.step_s, seconds)

    def observe_save(self, stall_s: float) -> None:
        """Called at each save with its stall; the overlap of the *previous* persist is added."""
        self.cost_s = self._ema(self.cost_s, stall_s + self._overlap_s)
        self._overlap_s = 0.0

    def interval_seconds(self) -> float | None:
        if self.cost_s is None:
            return None
        optimum = young_daly_h(self.cost_s, self.mtbf_s)  # units cancel: seconds in, seconds out
        return max(optimum, self.cost_s / self.max_overhead)

    def interval_steps(self) -> int:
        seconds = self.interval_seconds()
        if seconds is None or not self.step_s:
            return WARMUP_STEPS
        return max(1, math.ceil(seconds / self.step_s))


def estimate_mtbf_s(run_dir: str | Path, configured_s: float) -> float:
    """Wall time since the run's first event divided by failures seen; configured if none."""
    events = read_events(run_dir)
    failures = [e for e in events if e.get("kind") == Event.FAILURE and e.get("failure") != FailureKind.CONFIG]
    if not failures or not events:
        return configured_s
    elapsed = time.time() - events[0]["time"]
    return max(elapsed / len(failures), 1.0)
