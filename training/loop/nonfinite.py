"""A loss that is not finite: a bad checkpoint (valid bytes, bad state) or a run that diverged.

A checkpoint's hashes prove its bytes are the ones written, not that the state in them is sound:
NaN weights written before hashing verify.  Resumed, such a state trains into a non-finite loss
at once, and a retry from the same checkpoint would do so forever; training on (a loss of NaN for
days) is the worst outcome of all.  So the worker watches the loss of every optimizer step.

Rules (``train.on_nonfinite: stop``, the default; ``continue`` turns the watch off):

1. ``train.nonfinite_steps`` steps in a row with a non-finite loss trip the watch; a finite loss
   resets it (a float16 GradScaler's skipped step is not a divergence).
2. While a streak is open no checkpoint or snapshot is written, and its metric rows wait in the
   logger: none holds a state that trained into a non-finite loss.
3. Tripped within ``nonfinite_steps`` steps of a resume, the state resumed from is refused: a disk
   checkpoint is moved aside (``checkpoint_invalid``, never deleted), a memory snapshot's header
   dropped, with the streak's held rows; the worker then fails as a crash, and the retry
   resumes from the one before.  Bounded: each refusal removes a candidate, and with none left the
   run fails loudly
   (:func:`training.loop.restore.refuse_fresh_start`), never at step 0.
4. Tripped later, the run diverged by itself: it stops in one line (exit 78, not retried: the
   same steps would diverge the same way), recorded as ``diverged``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from training.checkpointing.store import Checkpoint
from training.config import ConfigError, RunConfig
from training.events import Event, append_event
from training.loop.restore import Restored
from training.loop.runtime import Runtime
from training.run_memory import discard_snapshot
from training.state import TrainState
from training.tracking.metrics import StepMetricLogger


class Diverged(ConfigError):
    """The run's own loss turned non-finite (rule 4): not retried."""


class BadStateResumed(RuntimeError):
    """The state resumed from trained into a non-finite loss at once (rule 3): retried."""


@dataclass
class NonFiniteWatch:
    """One worker's watch over its losses (the module docstring's rules)."""

    patience: int
    enabled: bool
    #: The step this worker resumed at (0: from scratch) and what from.
    resumed_step: int
    checkpoint: Checkpoint | None
    from_memory: bool
    #: First step of the open streak of non-finite losses (None: the last loss was finite).
    streak_from: int | None = None
    last_loss: float = 0.0

    @classmethod
    def after(cls, config: RunConfig, restored: Restored) -> NonFiniteWatch:
        """The watch of a worker that restored ``restored`` (a fresh start: no checkpoint)."""
        train, checkpoint = config.train, restored.checkpoint
        step = checkpoint.step if checkpoint is not None else 0
        return cls(train.nonfinite_steps, train.on_nonfinite == "stop", step, checkpoint, restored.from_memory)

    def observe(self, loss: float, state: TrainState) -> float:
        """Note the loss of the step ``state`` just trained (rule 1); returns it."""
        step = state.step
        finite = math.isfinite(loss)
        self.streak_from = None if finite or not self.enabled else (self.streak_from or step)
        self.last_loss = loss
        return loss

    @property
    def clean(self) -> bool:
        """No streak open: a save may be written (rule 2)."""
        return self.streak_from is None

    def tripped(self, step: int) -> bool:
        return self.streak_from is not None and step - self.streak_from + 1 >= self.patience

    def act(self, runtime: Runtime, step: int, log: Callable[[str], None], metrics: StepMetricLogger) -> None:
        """The watch tripped at ``step`` (every rank agreed): refuse the state or stop; raises."""
        # Another rank may have tripped the agreed watch while this one saw finite losses.
        first, run_dir = self.streak_from or step, runtime.store.run_dir
        losses = f"the loss is {self.last_loss} at steps {first}-{step}"
        if self.checkpoint is not None and first <= self.resumed_step + self.patience:
            name = self.checkpoint.path.name
            reason = f"its state trained into a non-finite loss at once ({losses}): valid bytes, bad state"
            if self.from_memory:
                if runtime.memory is not None:
                    discard_snapshot(runtime.memory, self.checkpoint.step)
                append_event(run_dir, Event.MEMORY_SNAPSHOT_REFUSED, rank=runtime.rank, checkpoint=name, reason=reason)
            elif runtime.rank == 0:
                runtime.store.quarantine(self.checkpoint.path, reason)
            metrics.drop_held()  # rows of a refused state: the retry trains and logs these steps
            log(f"refusing {'the memory snapshot' if self.from_memory else 'checkpoint'} {name}: {reason}")
            raise BadStateResumed(f"{name}: {reason}; the retry resumes from the one before it")
        if runtime.rank == 0:
            append_event(run_dir, Event.DIVERGED, first_step=first, step=step, loss=str(self.last_loss))
        raise Diverged(
            f"the run diverged: {losses}, {step - (first or step) + 1} in a row (train.nonfinite_steps = "
            f"{self.patience}); its checkpoints end before step {first}: lower train.lr or raise "
            f"train.warmup_steps / set train.grad_clip and go on with `convoy train --allow-config-change`, "
            f"or set train.on_nonfinite: continue to train on"
        )
