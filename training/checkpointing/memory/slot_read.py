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
    """The slot's bytes, in one private copy that the restored tensors view, verified.

    One copy, into the buffer the restored tensors view (read_bytes, a slice and a bytearray made
    three: a resume from the tier read 270 MB 5x slower than a raw read, bench/scale.py).  Each
    page touched once before the read: a read into pages never touched faults them in one by one
    inside the kernel's copy (1.6-2.3 s for 1 GB here); bytearray(n) zeroes them all first (1.1 s +
    a 0.7 s read); a write per page, then the read: 0.15 + 0.6 s."""
    import torch

    data = torch.empty(header.size, dtype=torch.uint8).numpy()
    data[:: mmap.PAGESIZE] = 0
    try:
        with open(path, "rb", buffering=0) as f:
            got, view = 0, memoryview(data)
            while got < header.size and (n := f.readinto(view[got:])):
                got += n
    except OSError as exc:
        raise CheckpointRejected(f"memory slot of rank {header.rank}: unreadable ({exc})") from exc
    if got != header.size:
        raise CheckpointRejected(f"memory slot of rank {header.rank}: {got} of {header.size} bytes (cut short)")
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
