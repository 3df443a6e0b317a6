"""What the memory tier needs of a training state: a protocol, so the tier does not import the
state (:class:`training.state.TrainState` meets it) and any state that meets it can be
snapshotted, a test's as well as the worker's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from training.parts import TaskParts


class SnapshotSource(Protocol):
    """A rank's state at its step: the parts whose model and optimizer a plan finds once
    (:mod:`~training.checkpointing.memory.snapshot_plan`), and the checkpoint parts it would
    write (what a snapshot holds, byte for byte)."""

    step: int
    parts: TaskParts

    def checkpoint_parts(
        self, rank: int = 0, include_replicated: bool = True, sharded: bool = False
    ) -> dict[str, Any]: ...
