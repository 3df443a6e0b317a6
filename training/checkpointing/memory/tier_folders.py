"""The memory tiers on this machine, each a folder under the tier's base (``/dev/shm/convoy-<uid>``):
whose each is, how much RAM it holds and when it was last written.

Why: a tier lives in RAM that belongs to the machine, not to a process (memory tier rule 5), so
the tier of a run killed and never resumed, or whose run directory was deleted, stays until the
machine reboots (at a 4 GiB state, two slots: 8 GB each).  Its folder's name is a hash of the run
directory and its creation time (rule 3), which cannot be read back; so the worker that makes a
tier writes its owner beside the slots (``owner.json``: the run directory and its creation time),
and whoever judges a folder (``training.memory_sweep``) reads it.  Folders written by a convoy
before this file existed have no owner: only their age speaks for them.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from training.checkpointing.memory.slot_files import SLOTS, header_path
from training.checkpointing.memory.slot_format import Header
from training.fsutil import atomic_write_json, read_json

#: Beside the slots: whose tier this is.
OWNER_FILE = "owner.json"


@dataclass(frozen=True)
class TierOwner:
    """The run a tier belongs to: its run directory (resolved) and that directory's creation time
    (``run.json``'s ``created``: a directory deleted and made again is another run)."""

    run_dir: str
    created: str

    def write(self, root: Path) -> None:
        atomic_write_json(root / OWNER_FILE, {"run_dir": self.run_dir, "created": self.created})

    @classmethod
    def read(cls, root: Path) -> TierOwner | None:
        try:
            data = read_json(root / OWNER_FILE)
            return cls(str(data["run_dir"]), str(data["created"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class TierFolder:
    """One tier on this machine, as its files show it."""

    path: Path
    owner: TierOwner | None
    #: RAM its files hold (tmpfs pages: what freeing it gives back).
    size_bytes: int
    #: When a slot or the owner was last written (seconds since the epoch).
    last_write: float
    #: The steps its committed slots hold (any rank), newest first.
    steps: tuple[int, ...]


def list_tier_folders(base: Path) -> list[TierFolder]:
    """Every tier folder under ``base`` (none when it does not exist), oldest write first."""
    if not base.is_dir():
        return []
    found = [_folder(p) for p in base.iterdir() if p.is_dir() and not p.is_symlink()]
    return sorted((f for f in found if f is not None), key=lambda f: f.last_write)


def _folder(path: Path) -> TierFolder | None:
    size, last = 0, 0.0
    try:
        for entry in os.scandir(path):
            st = entry.stat(follow_symlinks=False)
            size += st.st_blocks * 512  # the pages it holds, not its mapped length
            last = max(last, st.st_mtime)
        last = last or path.stat().st_mtime
    except OSError:  # removed meanwhile (another sweep, the run's own end)
        return None
    steps = {h.step for rank in _ranks(path) for k in SLOTS if (h := Header.read(header_path(path, rank, k)))}
    return TierFolder(path, TierOwner.read(path), size, last, tuple(sorted(steps, reverse=True)))


def _ranks(path: Path) -> set[int]:
    ranks = set()
    for p in path.glob("rank-*.slot-*.head"):
        with contextlib.suppress(ValueError):
            ranks.add(int(p.name.split(".")[0].removeprefix("rank-")))
    return ranks
