"""No snapshot outlives its run: the memory tiers on this machine judged, and the orphaned freed.

Why: the tier is RAM of the machine's (``/dev/shm``), not of a process (memory tier rule 5).  A
run killed with its flow and never resumed, or whose run directory was deleted, left its slots
there until a reboot: after a day of test runs here, 22 folders; at a 4 GiB state, 8 GB of RAM
each.  So every flow's start (``convoy train``, a deployment's run) frees the tiers whose run is
gone, and ``convoy snapshots`` lists them all and frees the same on request.

Rules (numbered; cited in code):

1. **A live or resumable run's tier is never freed.**  Kept: the tier of the run being started,
   of a run whose flow holds its lock on this host, and of a run whose directory is as the tier
   was made for (same creation time) and that was active (a slot written, a worker's beat)
   within ``checkpoint.memory_keep_hours``.
2. **Freed: a tier whose run is gone.**  Its run directory no longer exists, or was made again
   (another creation time: another run, memory tier rule 3).
3. **Freed: a tier not resumed within the set time.**  No write and no beat for longer than
   ``checkpoint.memory_keep_hours``: the run may still resume, from its disk checkpoints (the
   tier is never the last verified checkpoint, memory tier rule 1).
4. **A tier that names no owner** (written by a convoy before owners were recorded) is judged by
   its age alone (rule 3).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from training.checkpointing.memory.memory_tier import tier_base
from training.checkpointing.memory.tier_folders import TierFolder, list_tier_folders
from training.heartbeat import read_heartbeat
from training.rundir import run_info
from training.tracking.progress import flow_holder

HOUR_S = 3600.0


@dataclass(frozen=True)
class TierVerdict:
    """One tier folder judged: freed (``orphaned``) or kept, and why, in words a person reads."""

    folder: TierFolder
    orphaned: bool
    why: str

    @property
    def run_dir(self) -> str:
        return self.folder.owner.run_dir if self.folder.owner is not None else "(not recorded)"


def judge(folder: TierFolder, keep_hours: float, now: float, current: Path | None = None) -> TierVerdict:
    """Whether ``folder`` is orphaned (rules 1-4); ``current``: the run being started (rule 1)."""
    owner = folder.owner
    if owner is None:  # rule 4
        return _by_age(folder, folder.last_write, keep_hours, now, "no owner recorded (an older convoy's)")
    run_dir = Path(owner.run_dir)
    if current is not None and run_dir == current.resolve():
        return TierVerdict(folder, False, "the run being started")
    info = run_info(run_dir) if run_dir.is_dir() else None
    if info is None:  # rule 2
        return TierVerdict(folder, True, f"its run directory {run_dir} is gone")
    if info.created_text != owner.created:
        return TierVerdict(folder, True, f"its run directory {run_dir} was made again (another run)")
    if (pid := flow_holder(run_dir)) is not None:  # rule 1
        return TierVerdict(folder, False, f"its run's flow is alive (pid {pid})")
    beat = read_heartbeat(run_dir, 0)
    last = max(folder.last_write, beat.time if beat is not None else 0.0)
    return _by_age(folder, last, keep_hours, now, "resumable")


def _by_age(folder: TierFolder, last: float, keep_hours: float, now: float, what: str) -> TierVerdict:
    """Rule 3: kept while active within ``keep_hours``."""
    idle_h = max(0.0, now - last) / HOUR_S
    if idle_h > keep_hours:
        said = f"{what}; not resumed for {idle_h:.1f} h (checkpoint.memory_keep_hours = {keep_hours:g})"
        return TierVerdict(folder, True, said)
    newest = f" from step {folder.steps[0]}" if folder.steps else ""
    return TierVerdict(folder, False, f"{what}{newest}; idle {idle_h:.1f} h of {keep_hours:g}")


def survey(keep_hours: float, current: Path | None = None, base: Path | None = None) -> list[TierVerdict]:
    """Every tier on this machine (for this user), judged; oldest write first."""
    now = time.time()
    return [judge(f, keep_hours, now, current) for f in list_tier_folders(base or tier_base())]


def free(verdicts: Iterable[TierVerdict]) -> list[TierVerdict]:
    """Remove the orphaned tiers among ``verdicts`` (never another: rule 1); those removed."""
    freed = []
    for v in verdicts:
        if v.orphaned:
            shutil.rmtree(v.folder.path, ignore_errors=True)  # a sweep beside this one may be faster
            freed.append(v)
    return freed


def free_orphans(keep_hours: float, current: Path | None = None) -> list[TierVerdict]:
    """What a flow's start does: the orphaned tiers on this machine freed (rules 2-4)."""
    return free(survey(keep_hours, current))


def freed_line(freed: list[TierVerdict]) -> str | None:
    """One line for a log: how many tiers were freed, how much RAM, and whose."""
    if not freed:
        return None
    gb = sum(v.folder.size_bytes for v in freed) / 1e9
    whose = "; ".join(f"{v.folder.path.name}: {v.why}" for v in freed)
    return f"memory tier: freed {len(freed)} snapshot folder(s) of runs that are gone ({gb:.2f} GB of RAM): {whose}"
