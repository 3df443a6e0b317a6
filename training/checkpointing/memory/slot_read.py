"""Reading a slot back, verified: the whole of it (the rank's own, or every rank's of a replicated
state), or all but the parts a rank does not need (another rank's pieces of a sharded state).

Why apart from :mod:`training.checkpointing.memory.memory_tier`: the tier decides which snapshot a
resume takes; this reads the bytes and checks them against the header's hash (memory tier rule 4),
the one place a slot's file is read.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from training.checkpointing.codec import join_tree
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.memory.slot_format import Header, slot_hash, tensor_views

#: Where the tensors kept from another rank's slot start in their buffer (a dtype view needs it).
ALIGN = 64


def read_whole(path: Path, header: Header) -> np.ndarray:
    """The slot's bytes as a private (copy-on-write) mapping of its RAM file, verified.

    No copy: the restored tensors view the mapping, whose pages are the slot's own in ``/dev/shm``
    (counted by the tier, not again by the worker); the restore copies what it keeps into the
    live state (``load_state_dict``, the optimizer's state cloned), and the mapping goes with the
    last view.  A copy into an anonymous buffer (until this change) held a second whole state
    beside the live one: at a 7.8 GiB state the resumed worker peaked at 15.8 GB and was
    OOM-killed (bench/scale.py's largest row).  Private: a write through a view stays in this
    process.  Nothing else writes the slot while it is read: the run's lease holds every other
    worker of the run off, and this worker snapshots only after its restore."""
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise CheckpointRejected(f"memory slot of rank {header.rank}: unreadable ({exc})") from exc
    if len(m) < header.size:
        raise CheckpointRejected(f"memory slot of rank {header.rank}: {len(m)} of {header.size} bytes (cut short)")
    data = np.frombuffer(m, dtype=np.uint8, count=header.size)  # keeps the mapping alive
    _check(header, slot_hash(memoryview(data)))
    return data


def read_parts_but(path: Path, header: Header, drop: Collection[str]) -> dict[str, Any]:
    """The parts of the slot except those named in ``drop``, verified: the whole slot is hashed
    where it lies (a read-only mapping of the RAM file: no copy), then only the kept tensors are
    copied out.  Another rank's slot of a sharded state: its pieces stay where they are, so a
    resume holds one rank's share, not every rank's."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if len(m) < header.size:
                raise CheckpointRejected(
                    f"memory slot of rank {header.rank}: {len(m)} of {header.size} bytes (cut short)"
                )
            with memoryview(m) as whole:
                _check(header, slot_hash(whole[: header.size]))
            start, end = header.skeletons
            skeletons = {p: s for p, s in json.loads(m[start:end]).items() if p not in drop}
            data, places = _copied(m, [p for p in header.tensors if p[0] not in drop])
    except CheckpointRejected:
        raise
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped, JSON torn
        raise CheckpointRejected(f"memory slot of rank {header.rank}: unreadable ({exc})") from exc
    tensors: dict[str, dict[str, Any]] = {part: {} for part in skeletons}
    tensors.update(tensor_views(data, places))
    return {part: join_tree(skel, tensors[part]) for part, skel in skeletons.items()}


def _copied(m: mmap.mmap, places: list[Any]) -> tuple[bytearray, list[Any]]:
    """The bytes of ``places`` copied out of ``m`` into one buffer, and their places in it."""
    moved, at = [], 0
    for part, key, dtype, shape, offset, nbytes in places:
        moved.append((part, key, dtype, shape, at, nbytes, offset))
        at += -(-nbytes // ALIGN) * ALIGN
    data = bytearray(max(at, 1))
    for *_, new, nbytes, old in moved:
        data[new : new + nbytes] = m[old : old + nbytes]
    return data, [place[:6] for place in moved]


def _check(header: Header, digest: str) -> None:
    if digest != header.digest:
        said = f"content hash {digest[:12]}… != header {header.digest[:12]}…"
        raise CheckpointRejected(f"memory slot of rank {header.rank}: {said} (corrupt)")
