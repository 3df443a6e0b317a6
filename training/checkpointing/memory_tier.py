"""The memory tier: the newest training state kept in RAM, in front of the durable checkpoints.

Why: a worker killed ``every_steps`` after its last durable checkpoint loses up to that many
steps (50 on the demo), because disk and the remote are the only tiers.  Gemini (SOSP'23), NVRx's
local checkpointing and multi-tier checkpointing put a fast tier in front of them.  Here the
worker snapshots its state every ``checkpoint.memory_every_steps`` into a checkpoint directory on
a RAM file system (``/dev/shm``), in the same format, with the same hashes and manifest, written
by the same code as a disk checkpoint (:class:`MemoryStore` is a
:class:`~training.checkpointing.store.CheckpointStore` with another root).  It survives the
worker's death — tmpfs belongs to the machine, not to a process — and a resume restores from it
when it is newer than every disk checkpoint that verifies: at most the step in flight is lost.

Rules (numbered; cited in code):

1. **Never the last verified checkpoint.**  Retention and "the newest verified checkpoint" of the
   run (``convoy verify``, the chunk's artifact, DVC, the remote) are the disk tier's; the memory
   tier keeps only its own newest snapshot and is never counted as durable.
2. **Only when newer.**  A disk checkpoint at the same or a later step wins; the memory snapshot is
   a candidate only ahead of the first disk checkpoint older than it (:func:`merged`).
3. **Only this run, this trajectory.**  The directory is keyed by the run directory *and* its
   creation time (``run.json``: a run directory deleted and created again is another run), and a
   snapshot whose manifest holds another fingerprint is ignored, never an error.
4. **Verified like any checkpoint.**  A snapshot that does not verify (bit flips, a half-written
   one) is passed over, said in the log and recorded (``memory_snapshot_refused``), and the disk
   tier decides.
5. **The machine is the limit.**  When the machine goes (reboot, a node lost), so does the tier;
   the disk and remote tiers decide, as without it.  Multi-node runs do not use it (every node has
   its own RAM), nor do machines without ``/dev/shm``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.store import Candidate, CheckpointStore, WriterGroup
from training.config import CheckpointConfig, RunConfig
from training.rundir import run_info

if TYPE_CHECKING:  # the loop's types: the tier is built before them
    from training.checkpointing.schedule import MemorySchedule
    from training.state import TrainState

#: Where the tier lives: a RAM file system on Linux.
SHM = Path("/dev/shm")
#: Another place for it (a tmpfs of your own; the tests keep theirs in a temporary directory).
DIR_ENV = "CONVOY_MEMORY_DIR"


def tier_root(run_dir: str | Path) -> Path | None:
    """The run's memory tier directory (rule 3), or None where there is no RAM file system."""
    base = Path(os.environ[DIR_ENV]) if os.environ.get(DIR_ENV) else SHM / f"convoy-{os.getuid()}"
    if not base.parent.is_dir() or not os.access(base.parent, os.W_OK):
        return None
    run_dir = Path(run_dir).resolve()
    created = (run_info(run_dir) or {}).get("created", "")
    key = hashlib.blake2b(f"{run_dir}\0{created}".encode(), digest_size=8).hexdigest()
    return base / f"{run_dir.name}-{key}"


def enabled(config: RunConfig) -> bool:
    """Whether this run keeps a memory tier (``checkpoint.memory_every_steps`` set, one node)."""
    return bool(config.checkpoint.memory_every_steps) and config.train.nnodes == 1


class MemoryStore(CheckpointStore):
    """The memory tier's store: a checkpoint store on ``tier_root``, keeping its newest snapshot
    only and writing nothing to the run's audit (a snapshot a step would flood ``events.jsonl``)."""

    def __init__(self, run_dir: str | Path, root: Path, fingerprint: str, writers: WriterGroup | None = None) -> None:
        policy = CheckpointConfig(every_steps=None, keep_last=1, async_save=True)
        super().__init__(run_dir, policy, fingerprint, writers=writers, root=root)

    def _keep_existing(self, final: Path, new_digest: str) -> bool:
        """A snapshot of this step is there already (a resumed worker re-reached it): replace it."""
        shutil.rmtree(final, ignore_errors=True)
        return False

    def _delete(self, path: Path, reason: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def snapshot(self, state: TrainState, schedule: MemorySchedule) -> None:
        """Snapshot ``state`` (this rank's parts, as a replicated disk checkpoint holds them) and
        persist it in the background; the schedule learns what it cost.  Raises a previous
        snapshot's write error (the caller drops the tier)."""
        self.check()
        previous_persist = self.last_persist_s
        parts = state.checkpoint_parts(self.rank, include_replicated=self.rank == 0, sharded=False)
        stall = self.save(state.step, parts, blocking=False)
        schedule.saved(state.step, stall, previous_persist)

    def release_when_done(self, rank: int, step: int, total_steps: int) -> None:
        """At a worker's end: once the run's last step is trained (on disk), free the tier's RAM."""
        self.wait()
        if rank == 0 and step >= total_steps:
            remove(self.run_dir)

    def newest(self) -> Candidate | None:
        """The newest snapshot, loaded and verified (rule 4: ``reason`` says why not); None if
        there is none or it belongs to another trajectory (rule 3)."""
        dirs = self.step_dirs()
        if not dirs:
            return None
        step, path = dirs[0]
        try:
            if self.read_manifest(path).get("fingerprint") != self.fingerprint:
                return None
            return Candidate(step, path, "", self.load(path))
        except CheckpointRejected as exc:
            return Candidate(step, path, str(exc), None)


def open_tier(run_dir: str | Path, config: RunConfig, writers: WriterGroup | None = None) -> MemoryStore | None:
    """The run's memory store for a worker, or None when the run keeps no memory tier here."""
    root = tier_root(run_dir)
    if root is None or not enabled(config):
        return None
    return MemoryStore(run_dir, root, config.fingerprint(), writers)


def merged(memory: Candidate | None, disk: CheckpointStore) -> Iterator[tuple[Candidate, bool]]:
    """The resume's candidates newest first, each with whether it is the memory snapshot: the
    memory one goes just before the first disk checkpoint older than it (rule 2).  A disk
    checkpoint is loaded only when it is reached, so one older than the snapshot costs nothing."""
    pending = memory
    for step, path in disk.step_dirs():
        if pending is not None and pending.step > step:
            yield pending, True
            pending = None
        yield disk.candidate(step, path), False
    if pending is not None:
        yield pending, True


def newest_step(run_dir: str | Path, fingerprint: str) -> int | None:
    """Step of the tier's newest snapshot by its manifest alone (no hashing): what the flow reports
    a worker will resume from; the worker verifies it before it restores."""
    root = tier_root(run_dir)
    if root is None or not root.is_dir():
        return None
    store = MemoryStore(run_dir, root, fingerprint)
    for step, path in store.step_dirs():
        try:
            if store.read_manifest(path).get("fingerprint") == fingerprint:
                return step
        except CheckpointRejected:
            continue
    return None


def resume_step(run_dir: str | Path, disk_step: int | None) -> int | None:
    """The step the next worker of the run resumes from, as the flow reports it: the memory
    snapshot's when the run keeps the tier and it is newer than ``disk_step`` (rule 2), else
    ``disk_step``.  The worker's own restore, which verifies, has the last word."""
    from training.rundir import load_run_config

    try:
        config = load_run_config(run_dir)
    except (OSError, ValueError):
        return disk_step
    if not enabled(config):
        return disk_step
    memory = newest_step(run_dir, config.fingerprint())
    return memory if memory is not None and memory > (disk_step or 0) else disk_step


def remove(run_dir: str | Path) -> bool:
    """Drop the run's memory tier (the run finished: nothing will resume from it)."""
    root = tier_root(run_dir)
    if root is None or not root.exists():
        return False
    shutil.rmtree(root, ignore_errors=True)
    return True


def describe(candidate: Candidate) -> dict[str, Any]:
    return {"step": candidate.step, "path": str(candidate.path), "reason": candidate.reason}
