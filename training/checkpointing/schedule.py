"""When the training loop saves: every chunk boundary, then the run's checkpoint policy.

A chunk boundary is always saved (a pipelined worker's chunk task waits for that commit).
Between boundaries the policy decides: a fixed step interval (``checkpoint.every_steps``), the
adaptive one (``every_steps: auto``, :mod:`training.checkpointing.adaptive`), and/or a wall-clock
interval (``checkpoint.every_seconds``).  Every rank asks; the loop agrees on the answer.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from training.checkpointing.adaptive import AdaptiveInterval, estimate_mtbf_s
from training.config import CheckpointConfig


class SaveSchedule:
    """The save decisions of one worker, from the step it restored on."""

    def __init__(self, policy: CheckpointConfig, chunk_steps: int, adaptive: AdaptiveInterval | None) -> None:
        self.policy, self.chunk_steps, self.adaptive = policy, chunk_steps, adaptive
        self.last_step = 0
        self.last_time = time.time()

    @classmethod
    def for_run(cls, policy: CheckpointConfig, chunk_steps: int, run_dir: Path) -> SaveSchedule:
        """With ``every_steps: auto``, the adaptive interval starts from the MTBF the run's own
        failures suggest (the configured one until it has failed)."""
        adaptive = None
        if policy.every_steps == "auto":
            adaptive = AdaptiveInterval(estimate_mtbf_s(run_dir, policy.mtbf_hours * 3600), policy.max_overhead)
        return cls(policy, chunk_steps, adaptive)

    def start(self, step: int) -> None:
        """The loop starts at ``step`` (what was restored): intervals count from here."""
        self.saved(step)

    def due(self, step: int) -> bool:
        """Whether ``step`` (just trained) is saved."""
        if step % self.chunk_steps == 0:
            return True
        if self.adaptive is not None:
            if step - self.last_step >= self.adaptive.interval_steps():
                return True
        elif self.policy.every_steps and step % self.policy.every_steps == 0:
            return True
        return bool(self.policy.every_seconds and time.time() - self.last_time >= self.policy.every_seconds)

    def saved(self, step: int) -> None:
        self.last_step, self.last_time = step, time.time()

    def observe_step(self, seconds: float, persist_in_flight: bool) -> None:
        if self.adaptive is not None:
            self.adaptive.observe_step(seconds, persist_in_flight)

    def observe_save(self, stall_s: float) -> dict[str, Any] | None:
        """Feed a save's stall to the adaptive interval; when that changes the interval, what
        the worker records of the new choice (the ``interval_chosen`` event's fields)."""
        if self.adaptive is None:
            return None
        old = self.adaptive.interval_steps()
        self.adaptive.observe_save(stall_s)
        new = self.adaptive.interval_steps()
        if new == old:
            return None
        return {
            "interval_steps": new,
            "interval_s": self.adaptive.interval_seconds(),
            "cost_s": self.adaptive.cost_s,
            "step_s": self.adaptive.step_s,
            "mtbf_s": self.adaptive.mtbf_s,
        }


class MemorySchedule:
    """When the loop snapshots into the memory tier (``checkpoint.memory_every_steps``).

    A fixed N, or ``auto``: as often as the snapshots' measured cost stays within
    ``memory_max_overhead`` of the step time.  Not Young/Daly, as the disk interval is: there the
    expected loss to failures is traded against a costly save, but a memory snapshot costs next to
    nothing, so the interval is set by what the loop can afford, and a kill loses at most the steps
    of one interval (every step on the demo).  Cost = the snapshot's time on the loop's thread,
    where all of it runs; step time and cost as moving averages."""

    def __init__(self, every: int | str | None, max_overhead: float, alpha: float = 0.3) -> None:
        self.fixed = every if isinstance(every, int) else None
        self.auto = every == "auto"
        self.max_overhead, self.alpha = max_overhead, alpha
        self.step_s: float | None = None
        self.cost_s: float | None = None
        self.last_step = 0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def start(self, step: int) -> None:
        self.last_step = step

    def interval_steps(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.cost_s is None or not self.step_s:
            return 1  # measure first
        return max(1, math.ceil(self.cost_s / (self.max_overhead * self.step_s)))

    def due(self, step: int) -> bool:
        return (self.fixed is not None or self.auto) and step - self.last_step >= self.interval_steps()

    def observe_step(self, seconds: float) -> None:
        self.step_s = self._ema(self.step_s, seconds)

    def saved(self, step: int, cost_s: float) -> None:
        self.last_step = step
        self.cost_s = self._ema(self.cost_s, cost_s)
