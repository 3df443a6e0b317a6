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
from training.checkpointing.reliability import young_daly_h
from training.config import CheckpointConfig


class SaveSchedule:
    """The save decisions of one worker, from the step it restored on."""

    def __init__(self, policy: CheckpointConfig, chunk_steps: int, adaptive: AdaptiveInterval | None) -> None:
        self.policy, self.chunk_steps, self.adaptive = policy, chunk_steps, adaptive
        self.last_step = 0
        self.last_time = time.time()

    @classmethod
    def for_run(
        cls, policy: CheckpointConfig, chunk_steps: int, run_dir: Path, memory_tier: bool = False
    ) -> SaveSchedule:
        """With ``every_steps: auto``, the adaptive interval starts from the MTBF the run's own
        failures suggest (the configured one until it has failed).  With the memory tier on
        (``memory_tier``), from the configured one only: a worker that dies resumes from RAM, so
        the disk tier is there for what RAM does not survive — the machine — and the run's worker
        deaths are the memory tier's to count (:meth:`MemorySchedule.for_run`).  Counting them
        here too had both tiers save every ~12 steps at one kill a minute (bench/RESULTS.md)."""
        adaptive = None
        if policy.every_steps == "auto":
            configured = policy.mtbf_hours * 3600
            mtbf_s = configured if memory_tier else estimate_mtbf_s(run_dir, configured)
            adaptive = AdaptiveInterval(mtbf_s, policy.max_overhead)
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

    A fixed N, or ``auto``: the Young/Daly interval √(2·cost·MTBF), as for the disk tier, held
    between two shares of the step time: the snapshots never cost more than
    ``memory_max_overhead`` (failures so frequent that Young/Daly would snapshot more often than
    that), and never less than ``memory_min_overhead`` (failures so rare that Young/Daly would
    hardly snapshot at all: a kill still loses only the steps that share buys).  Why Young/Daly and
    not "as often as a budget allows": a budget is spent whether or not anything fails — at one
    kill a minute, 3 % of every step on snapshots was the largest badput (bench/RESULTS.md).  MTBF
    is the run's own (its failures, ``checkpoint.mtbf_hours`` until it has failed), as the disk
    tier's; cost = the snapshot's time on the loop's thread, where all of it runs; step time and
    cost as moving averages."""

    def __init__(
        self,
        every: int | str | None,
        max_overhead: float,
        min_overhead: float | None = None,
        mtbf_s: float = math.inf,
        alpha: float = 0.3,
    ) -> None:
        self.fixed = every if isinstance(every, int) else None
        self.auto = every == "auto"
        self.max_overhead, self.alpha, self.mtbf_s = max_overhead, alpha, mtbf_s
        self.min_overhead = max_overhead if min_overhead is None else min(min_overhead, max_overhead)
        self.step_s: float | None = None
        self.cost_s: float | None = None
        self.last_step = 0

    @classmethod
    def for_run(cls, policy: CheckpointConfig, run_dir: Path) -> MemorySchedule:
        """With ``memory_every_steps: auto``, Young/Daly starts from the MTBF the run's own
        failures suggest (the configured one until it has failed)."""
        mtbf_s = math.inf
        if policy.memory_every_steps == "auto":
            mtbf_s = estimate_mtbf_s(run_dir, policy.mtbf_hours * 3600)
        every, lo, hi = policy.memory_every_steps, policy.memory_min_overhead, policy.memory_max_overhead
        return cls(every, hi, lo, mtbf_s)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def start(self, step: int) -> None:
        self.last_step = step

    def interval_steps(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.cost_s is None or not self.step_s:
            return 1  # measure first
        rarest = self._costing(self.min_overhead)
        if not math.isfinite(self.mtbf_s):  # no failures to expect: what the least share buys
            return rarest
        optimum = math.ceil(young_daly_h(self.cost_s, self.mtbf_s) / self.step_s)
        return min(max(optimum, self._costing(self.max_overhead)), rarest)

    def _costing(self, share: float) -> int:
        """The interval (steps) at which the snapshots cost ``share`` of the step time."""
        assert self.cost_s is not None and self.step_s
        return max(1, math.ceil(self.cost_s / (share * self.step_s)))

    def due(self, step: int) -> bool:
        return (self.fixed is not None or self.auto) and step - self.last_step >= self.interval_steps()

    def observe_step(self, seconds: float) -> None:
        self.step_s = self._ema(self.step_s, seconds)

    def saved(self, step: int, cost_s: float) -> None:
        self.last_step = step
        self.cost_s = self._ema(self.cost_s, cost_s)
