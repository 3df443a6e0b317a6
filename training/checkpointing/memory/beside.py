"""The memory tier's copy beside the loop (memory tier rule 7): what its writer thread does with
a snapshot, when it starts, and what the loop is handed back to commit.

Why it waits for the loop's backward: the loop's thread runs Python between the torch calls of
its step, and so does the writer thread for part of its job (the walked rest laid out, the
skeletons serialised, the header built).  Two threads that both want the interpreter lock hand it
back and forth at every torch call: measured with the demo at one torch thread
(``bench/snapshot_cost.py``), each millisecond of Python on the writer thread during the next
step's fetch and forward slowed that step by about three.  The backward holds no lock (autograd
runs in C++), so a job that starts there runs beside it for free: the loop tells the writer with
:meth:`BesideCopy.backward_begins` (``training.loop.step.accumulate`` calls it before the first
backward; until then the writer thread sleeps, woken by nothing), and :meth:`BesideCopy.take`
hands over a job no backward did (a task's own ``train_step``, which has no such call: its
snapshots are copied while the loop waits).  A backward shorter than the job (a model far smaller
than its optimizer's state) leaves the rest to the settle's wait, which counts as the snapshot's
stall, so ``memory_every_steps: auto`` sees it.

What the writer reads must not change before it does (memory tier rule 7): the parameters and the
optimizer's state change only in the optimizer step, after the commit; the buffers are copied on
the loop's thread (:meth:`~training.checkpointing.memory.snapshot_plan.SnapshotPlan.frozen_templates`);
the walked rest is the capture's own objects (fresh RNG states, new dicts of plain values) —
except a stream's position, which the next batch's fetch may move: a snapshot holding one is laid
out on the loop's thread, and the writer gets that content (:meth:`BesideCopy.submit`'s
``content``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from training.checkpointing.memory.slot_files import SlotFiles, copy_and_hash
from training.checkpointing.memory.snapshot_plan import PLAN_ERRORS, SlotContent, SnapshotPlan
from training.checkpointing.writer_thread import WriterThread

if TYPE_CHECKING:
    from training.checkpointing.memory.slot_layout import Layout

#: (step, layout, slot size, digest) -> the header's body.
HeaderBody = Callable[[int, "Layout", int, str], bytes]


@dataclass
class Job:
    """A snapshot for the writer thread: handed to it when the loop's backward begins."""

    args: tuple[Any, ...]  # what :meth:`BesideCopy._write` writes
    plan: SnapshotPlan  # whose parameters' versions...
    versions: tuple[int, ...]  # ...were these when it was taken
    slot: int
    #: Once handed over: the header's commit once the slot and the header's body are written;
    #: None there: the plan no longer lays the state out (a tensor appeared in the walked rest),
    #: not committed.
    done: Future[bytes | None] | None = None


class BesideCopy:
    """One rank's writer thread and its job in flight (one at a time)."""

    def __init__(self, files: SlotFiles, header: HeaderBody) -> None:
        self._files, self._header = files, header
        #: Started at its first job, in the worker, never in a process that forks workers.
        self._thread = WriterThread()
        #: Whether the loop says when its backward begins (it did once): jobs wait for it.
        self.gated = False
        self._job: Job | None = None

    def submit(
        self, plan: SnapshotPlan, slot: int, step: int, light: dict[str, Any] | None = None, content: Any = None
    ) -> None:
        """Write ``step``'s snapshot into ``slot`` on the writer thread: laid out there from
        ``light`` (the plan's walked rest), or ``content`` laid out already.  Handed over when
        the loop's backward begins (at once while the loop has never said so): until then the
        writer thread sleeps, and wakes nothing."""
        templates = plan.frozen_templates() if content is None else None
        self._job = Job((plan, slot, step, light, templates, content), plan, plan.versions(), slot)
        if not self.gated:
            self._hand_over(self._job)

    def backward_begins(self) -> None:
        """The loop's backward begins: the job waiting for it goes to the writer thread."""
        self.gated = True
        if self._job is not None and self._job.done is None:
            self._hand_over(self._job)

    def take(self) -> Job | None:
        """The job in flight, handed over if it still waits (the caller waits for ``done``)."""
        job, self._job = self._job, None
        if job is not None and job.done is None:
            self._hand_over(job)
        return job

    def shutdown(self) -> None:
        """Finish the job in flight (one never handed over is dropped: not committed), then stop."""
        self._job = None
        self._thread.shutdown()

    def _hand_over(self, job: Job) -> None:
        job.done = self._thread.submit(self._write, *job.args)

    def _write(
        self,
        plan: SnapshotPlan,
        slot: int,
        step: int,
        light: dict[str, Any] | None,
        templates: list[list[Any]] | None,
        content: SlotContent | None,
    ) -> bytes | None:
        if content is None:
            try:
                content = plan.lay_out(light or {}, templates)
            except PLAN_ERRORS:
                content = None
            if content is None:
                return None
        buf, size = self._files.open_for(slot, content)
        digest = copy_and_hash(buf, content.groups, size, on_cpu=True)
        return self._files.prepare(slot, self._header(step, content.layout, size, digest))
