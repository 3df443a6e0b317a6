"""The training loop's side of the memory tier: snapshots taken, committed, and what they cost.

Why a class of its own: a snapshot is taken after a step and, copied beside the loop (memory tier
rule 7, ``checkpoint.memory_beside``), committed inside the next step just before its optimizer
step; both stall the loop, and both count as the snapshot's stall (goodput's
``checkpoint_save``), not as the step's.  A tier that fails (``/dev/shm`` full) is dropped with
one line at either point: training never depends on it.
"""

from __future__ import annotations

from collections.abc import Callable

from training.checkpointing.memory.memory_tier import MemoryTier
from training.checkpointing.schedule import MemorySchedule
from training.state import TrainState


class MemorySnapshots:
    """Takes and commits one worker's snapshots; the worker drops the tier when told to."""

    def __init__(self, log: Callable[[str], None], drop: Callable[[], None]) -> None:
        self.log, self.drop = log, drop
        #: The loop's stall in snapshots since the last journal row.
        self.stall_s = 0.0
        #: Of it, the wait for a commit inside the step being trained (not that step's time).
        self.settled_s = 0.0

    def take(self, tier: MemoryTier, state: TrainState, schedule: MemorySchedule) -> None:
        """Snapshot ``state`` (its metrics were flushed: a snapshot is never ahead of them)."""
        try:
            tier.snapshot(state, schedule)
        except OSError as exc:
            self.failed(exc)
            return
        self.stall_s += tier.last_stall_s

    def settle(self, tier: MemoryTier | None) -> None:
        """Before the optimizer step: the snapshot copied beside the loop committed."""
        self.settled_s = 0.0
        if tier is None:
            return
        beside = tier.beside
        try:
            self.settled_s = tier.settle()
        except OSError as exc:
            self.failed(exc)
            return
        self.stall_s += self.settled_s
        if beside and not tier.beside:
            self.log(
                "memory tier: a parameter changed in place between a snapshot and the next optimizer step; "
                "that snapshot was not committed, the next ones are copied on the loop's thread"
            )

    def hooks(self, tier: Callable[[], MemoryTier | None]) -> tuple[Callable[[], None], Callable[[], None]]:
        """``train_step``'s ``before_update`` and ``before_backward`` for the tier ``tier()``
        returns (None once dropped): settle before the optimizer step, and start the snapshot
        copied beside the loop when the backward begins (memory tier rule 7)."""

        def begin() -> None:
            if (now := tier()) is not None:
                now.backward_begins()

        return lambda: self.settle(tier()), begin

    def pop_stall(self) -> float:
        """The stall since the last call (for the journal row of the step just trained)."""
        stall, self.stall_s = self.stall_s, 0.0
        return stall

    def failed(self, exc: OSError) -> None:
        """The tier failed (``/dev/shm`` full): one line, and the worker trains without it."""
        self.log(f"memory tier off: {exc}")
        self.drop()
