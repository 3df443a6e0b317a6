"""Host memory while a run trains: the budget's rule 5, checked by every worker before each copy
of the state (a memory-tier snapshot or an asynchronous save's staging).

Why: the budget before the run (:mod:`training.memory_budget`, rules 1-4) projects what convoy
holds from the state's size, but not what training itself holds beside it — activations, and on
the CPU the allocator's retained buffers.  Measured (issue 43): a bare FSDP2 loop over 2 CPU ranks
held 2.7-2.8 GiB a rank for a 0.67 GiB share, growing over its first 4 steps and then flat; the
budget let the 4 GiB row of bench/sharded.py start, and its ranks were OOM-killed once the tier's
copies came on top.  Only the running process knows what it holds, so the worker checks.

Rules (numbered; cited in code):

5. **Before each copy, and at every step while a copy is held, enough left for the next
   step.**  What the node has available now (the cgroup's room or ``MemAvailable``; with
   ``checkpoint.host_memory_gb``, that less what this node's ranks hold: each rank's anonymous
   memory, as this one's, and the tier's pages), less what the ranks will claim again in their
   next step (their peak over their resident memory, as this rank's) and less the copy still to
   be allocated (none once the tier's slot or the save's staging holds pages), must stay above
   the reserve the budget keeps: ``1 - checkpoint.host_memory_share`` of the machine's memory (or
   of ``host_memory_gb``).  Below it, every rank gives up its copies for the rest of the worker
   (agreed in the step's one collective: saves stay collective): the memory tier's slots are
   freed and saves become synchronous, as the budget's rule 3 would have done at the start, in
   one line and one event (``host_memory_short``).  The next worker checks again from the start.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from training.checkpointing.memory.slot_files import SLOTS, data_path, header_path
from training.config import RunConfig
from training.events import Event, append_event
from training.loop.runtime import Runtime
from training.memory_budget import (
    CONVOY_PROCESSES,
    GB,
    StateSize,
    cgroup_room,
    mem_available,
    no_copy,
    project,
    size_text,
)


def _status_bytes(*keys: str) -> dict[str, int]:
    """This process's ``/proc/self/status`` fields (kB) in bytes."""
    found: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                found[key] = int(value.split()[0]) * 1024
    return found


def _total_bytes() -> int:
    """The machine's memory, or the cgroup's limit where one is lower."""
    limit = None
    for name in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text != "max" and int(text) < 2**60:
            limit = int(text)
        break
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(total, limit) if limit is not None else total


def _allocated(root: Path | None) -> int:
    """Bytes of RAM the memory tier's files hold under ``root`` (every rank's, all slots)."""
    if root is None or not root.is_dir():
        return 0
    return sum(p.stat().st_blocks * 512 for p in root.iterdir() if p.is_file())


@dataclass(frozen=True)
class Reading:
    """One look at the node (rule 5), in bytes."""

    available: int
    claim_again: int
    new_copy: int
    reserve: int

    @property
    def short(self) -> bool:
        return self.available - self.claim_again - self.new_copy < self.reserve

    def line(self) -> str:
        return (
            f"host memory while training: {size_text(self.available)} available, the ranks' next steps claim "
            f"{size_text(self.claim_again)} again and a copy of the state needs {size_text(self.new_copy)} more: "
            f"below the {size_text(self.reserve)} kept free (1 - checkpoint.host_memory_share)"
        )


class MemoryWatch:
    """Rule 5 for one worker of ``config`` (a state of ``size``; ``tier_root``: the run's memory
    tier directory, whose files hold RAM)."""

    def __init__(self, config: RunConfig, size: StateSize, on_cpu: bool, tier_root: Path | None) -> None:
        c = config.checkpoint
        self.config, self.size, self.tier_root = config, size, tier_root
        self.stand_in = int(c.host_memory_gb * GB) if c.host_memory_gb is not None else None
        self.reserve = int((1 - c.host_memory_share) * (self.stand_in or _total_bytes()))
        projection = project(config, size, on_cpu)
        self.ranks, self.copies = config.train.ranks, projection.tier + projection.staging
        #: Whether this worker made a copy already (its pages are held from then on).
        self.copied = False

    def gave_up(self, reading: Reading) -> str:
        """The one line said when the copies go: why, and what that costs."""
        return f"{reading.line()}: {no_copy(self.config, self.size)[1]}"

    def reading(self) -> Reading:
        mine = _status_bytes("VmHWM", "VmRSS", "RssAnon")
        held = _allocated(self.tier_root)
        if self.stand_in is not None:  # the stand-in machine holds what this node's ranks hold
            available = self.stand_in - self.ranks * mine["RssAnon"] - held - CONVOY_PROCESSES
        else:
            room = cgroup_room()
            available = min(room, mem_available()) if room is not None else mem_available()
        claim = self.ranks * max(0, mine["VmHWM"] - mine["VmRSS"])
        new = 0 if self.copied else max(0, self.copies - held)
        return Reading(available, claim, new, self.reserve)

    def short(self, copying: bool) -> Reading | None:
        """This rank's verdict before a copy (``copying``), and after every step once its copies
        hold pages (what the ranks hold can grow for steps: the CPU allocator's retained buffers
        under FSDP2 grew over the first 4): the reading when the node is short."""
        if not self.copies or not (copying or self.copied):
            return None
        now = self.reading()
        return now if now.short else None


def free_tier_slots(root: Path, rank: int) -> None:
    """This rank's slot files removed: their pages go back to the machine (a snapshot in them is
    lost; the disk checkpoints are untouched)."""
    for slot in SLOTS:
        for path in (header_path(root, rank, slot), data_path(root, rank, slot)):
            path.unlink(missing_ok=True)


def give_up_copies(
    runtime: Runtime, watch: MemoryWatch, reading: Reading | None, log: Callable[[str], None]
) -> Runtime:
    """Rule 5's verdict carried out on this rank (every rank, agreed): saves synchronous, the
    memory tier's slots freed; one line and one event from each rank that found the node short
    (``reading``).  Returns the runtime without its tier."""
    store = runtime.store
    store.wait()  # a save persisting from the tier's slot reads it until here (memory tier rule 8)
    store.policy = store.policy.model_copy(update={"async_save": False})
    if runtime.memory is not None:
        runtime.memory.release_when_done(runtime.state.step, runtime.config.train.total_steps)
        free_tier_slots(runtime.memory.root, runtime.rank)
    watch.copies = 0
    if reading is not None:
        log(watch.gave_up(reading))
        append_event(
            store.run_dir,
            Event.HOST_MEMORY_SHORT,
            rank=runtime.rank,
            step=runtime.state.step,
            available=reading.available,
            claim_again=reading.claim_again,
            new_copy=reading.new_copy,
            reserve=reading.reserve,
        )
    return replace(runtime, memory=None)
