"""A run's memory tier, seen from its run directory: where it lives, whether the run keeps one,
the step the next worker resumes from, and freeing it.

Why apart from :mod:`training.checkpointing.memory`: these read what the run directory says (its
creation time in ``run.json``, its config), which the tier's room does not import (the room
stands below the run; ``tests/test_import_rooms.py``).  The tier's rules are in
:mod:`training.checkpointing.memory.memory_tier`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from training.checkpointing.memory.memory_tier import (
    MemoryTier,
    committed_boundaries,
    enabled,
    missing_boundary,
    spare_cpu,
    tier_dir,
)
from training.checkpointing.memory.slot_files import header_path
from training.checkpointing.memory.tier_folders import TierOwner
from training.checkpointing.verify import parse_step
from training.config import RunConfig
from training.paths import RunPaths
from training.run_identity import RunInfo
from training.rundir import load_run_config, run_info


def owner(run_dir: str | Path) -> TierOwner:
    """Whose a tier is: the run directory (resolved) and its creation time (``run.json``)."""
    return TierOwner(str(Path(run_dir).resolve()), (run_info(run_dir) or RunInfo()).created_text)


def tier_root(run_dir: str | Path) -> Path | None:
    """The run's memory tier directory (rule 3: keyed by the run directory and its creation
    time), or None where there is no RAM file system."""
    whose = owner(run_dir)
    return tier_dir(whose.run_dir, whose.created)


def open_tier(run_dir: str | Path, config: RunConfig, rank: int = 0, world_size: int = 1) -> MemoryTier | None:
    """The run's memory tier for one rank of a worker, or None when the run keeps none here."""
    whose = owner(run_dir)
    root = tier_dir(whose.run_dir, whose.created)
    if root is None or not enabled(config):
        return None
    beside = config.checkpoint.memory_beside and spare_cpu(world_size)  # one node: every rank is here
    c = config.checkpoint
    sharded = c.format == "sharded"
    tier = MemoryTier(
        root, config.fingerprint(), rank, world_size, overlap=beside, slots=c.memory_slots, sharded=sharded
    )
    if rank == 0:  # whose it is, for the sweep of tiers whose run is gone (training.memory_sweep)
        whose.write(root)
    return tier


def newest_step(run_dir: str | Path, fingerprint: str, world_size: int = 1) -> int | None:
    """Step of the tier's newest snapshot by its headers alone (no hashing): what the flow reports
    a worker will resume from; the worker verifies it before it restores."""
    root = tier_root(run_dir)
    if root is None or not root.is_dir():
        return None
    return MemoryTier(root, fingerprint, 0, world_size).newest_step()


def resume_step(run_dir: str | Path, disk_step: int | None) -> int | None:
    """The step the next worker of the run resumes from, as the flow reports it: the memory
    snapshot's when the run keeps the tier and it is newer than ``disk_step`` (rule 2), else
    ``disk_step``.  The worker's own restore, which verifies, has the last word."""
    try:
        config = load_run_config(run_dir)
    except (OSError, ValueError):
        return disk_step
    if not enabled(config):
        return disk_step
    memory = newest_step(run_dir, config.fingerprint(), config.train.world_size)
    if memory is None or memory <= (disk_step or 0):
        return disk_step
    on_disk = {step for step in (parse_step(p.name) for p in RunPaths(run_dir).checkpoints.glob("step-*")) if step}
    on_disk |= committed_boundaries(run_dir)
    return disk_step if missing_boundary(memory, config.train.chunk_steps, on_disk) is not None else memory


def remove(run_dir: str | Path) -> bool:
    """Drop the run's memory tier (the run finished: nothing will resume from it)."""
    root = tier_root(run_dir)
    if root is None or not root.exists():
        return False
    shutil.rmtree(root, ignore_errors=True)
    return True


def discard_snapshot(tier: MemoryTier, step: int) -> None:
    """Drop this rank's snapshot of ``step`` by its header (a slot without one is no candidate,
    memory tier rule 4): a snapshot whose bytes verified but whose state trained into a
    non-finite loss (:mod:`training.loop.nonfinite`)."""
    mine = tier.headers().get(step, {}).get(tier.rank)
    if mine is not None:
        header_path(tier.root, tier.rank, mine[0]).unlink(missing_ok=True)
