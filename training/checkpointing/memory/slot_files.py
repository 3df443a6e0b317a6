"""One rank's memory-tier slot files, mapped, and the three steps that write a slot.

Why a module of its own: :mod:`training.checkpointing.memory.memory_tier` decides *when* a slot is
written and which snapshot a resume takes; this writes the bytes, on the loop's thread or on the
tier's writer thread (:mod:`training.checkpointing.memory.beside`, memory tier rule 7), in three steps:

1. :meth:`SlotFiles.open` and :func:`place_skeleton`: the slot's header
   length zeroed (uncommitted from here on), its data mapped at the state's size, the alignment
   gaps zeroed and the JSON skeletons written after the tensors' bytes;
2. :func:`copy_and_hash`: the tensors copied into the mapping and the whole slot hashed — a few C
   calls that release the interpreter lock;
3. :meth:`SlotFiles.commit`: the header's body (:meth:`SlotFiles.prepare`, which the writer
   thread may run), then its length and checksum, written last, on the loop's thread
   (:meth:`SlotFiles.write_commit`, :func:`~training.checkpointing.memory.slot_format.encode_header`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from training import faults
from training.checkpointing.memory.slot_format import FORMAT, HEAD, encode_header, slot_hash
from training.checkpointing.memory.slot_layout import Group, copy_into
from training.checkpointing.memory.snapshot_plan import SlotContent, skeleton_bytes

if TYPE_CHECKING:
    from training.checkpointing.memory.slot_layout import Layout

SLOTS = (0, 1)


def header_path(root: Path, rank: int, slot: int) -> Path:
    return root / f"rank-{rank}.slot-{slot}.head"


def data_path(root: Path, rank: int, slot: int) -> Path:
    return root / f"rank-{rank}.slot-{slot}.bin"


class SlotFiles:
    """Rank ``rank``'s slots (one or two) under ``root``: each slot's header and data file, mapped once and
    grown when the state grows (a snapshot every step pays for no open, unlink or rename)."""

    def __init__(self, root: Path, rank: int, slots: int = len(SLOTS)) -> None:
        self.heads = [header_path(root, rank, k) for k in SLOTS[:slots]]
        self.datas = [data_path(root, rank, k) for k in SLOTS[:slots]]
        self._head_maps: dict[int, mmap.mmap] = {}
        self._data_maps: dict[int, mmap.mmap] = {}

    def open(self, slot: int, data_size: int) -> mmap.mmap:
        """``slot`` uncommitted (a kill from here on leaves it without a header) and its data
        mapped for ``data_size`` bytes.  ``/dev/shm`` full raises OSError here, on the caller's
        thread."""
        head = _mapped(self._head_maps, self.heads[slot], HEAD, slot)
        head[:8] = bytes(8)
        faults.slot_stall()  # a test's kill lands here: the slot uncommitted
        return _mapped(self._data_maps, self.datas[slot], data_size, slot)

    def open_for(self, slot: int, content: SlotContent) -> tuple[mmap.mmap, int]:
        """Step 1 for ``content``: :meth:`open` at its size, then :func:`place_skeleton`;
        returns (the mapping, the slot's size)."""
        skeleton = skeleton_bytes(content.skeletons)
        buf = self.open(slot, content.layout.end + len(skeleton))
        return buf, place_skeleton(buf, content.layout, skeleton)

    def commit(self, slot: int, body: bytes) -> None:
        """``body`` (the header's JSON) into ``slot``'s header, its length and checksum last."""
        self.write_commit(slot, self.prepare(slot, body))

    def prepare(self, slot: int, body: bytes) -> bytes:
        """``body`` into ``slot``'s header, not committed: returns the commit
        (:meth:`write_commit` writes it; the writer thread prepares, the loop commits)."""
        commit, body = encode_header(body)
        head = _mapped(self._head_maps, self.heads[slot], HEAD + len(body), slot)
        head[HEAD : HEAD + len(body)] = body
        return commit

    def write_commit(self, slot: int, commit: bytes) -> None:
        """The header's length and checksum, written last: the slot is committed."""
        self._head_maps[slot][:HEAD] = commit  # no fsync: the tier does not outlive the machine

    def close(self) -> None:
        """Unmap (a mapping still exported to a tensor stays until that tensor goes)."""
        for m in (*self._data_maps.values(), *self._head_maps.values()):
            try:
                m.close()
            except BufferError:
                pass
        self._data_maps.clear()
        self._head_maps.clear()


def place_skeleton(buf: mmap.mmap, layout: Layout, skeleton: bytes) -> int:
    """Step 1's rest: the layout's alignment gaps zeroed (a slot's bytes are its content's alone,
    not what an older layout left there), ``skeleton`` after the tensors.  Returns the slot's size."""
    for start, end in layout.gaps:
        buf[start:end] = bytes(end - start)
    size = layout.end + len(skeleton)
    buf[layout.end : size] = skeleton
    return size


def copy_and_hash(buf: mmap.mmap, groups: list[Group], size: int, on_cpu: bool = False) -> str:
    """Step 2: the tensors into the slot, and the hash of its ``size`` bytes."""
    copy_into(buf, groups, on_cpu=on_cpu)
    return slot_hash(memoryview(buf)[:size])


def header_body(
    step: int, fingerprint: str, world_size: int, rank: int, layout: Layout, size: int, digest: str
) -> bytes:
    """Step 3's body: the header of a slot (:class:`~training.checkpointing.memory.slot_format.Header`'s
    fields, in its order)."""
    return orjson.dumps(
        {
            "format": FORMAT,
            "step": step,
            "fingerprint": fingerprint,
            "world_size": world_size,
            "rank": rank,
            "tensors": layout.places_json,  # serialised once per layout: the same at every snapshot
            "skeletons": [layout.end, size],
            "size": size,
            "digest": digest,
        }
    )


def _mapped(maps: dict[int, mmap.mmap], path: Path, size: int, slot: int) -> mmap.mmap:
    """``path`` (one of ``slot``'s files) mapped, at least ``size`` bytes."""
    current = maps.get(slot)
    if current is not None and len(current) >= size:
        return current
    if current is not None:
        with contextlib.suppress(BufferError):  # still exported to a staged save's views: it stays
            current.close()
    with open(path, "a+b") as f:
        # Allocated now, not on first touch: a full tmpfs is an OSError here, where a write into
        # a mapped hole would be a SIGBUS that kills the worker.
        os.posix_fallocate(f.fileno(), 0, max(size, 1))
        maps[slot] = mmap.mmap(f.fileno(), max(size, 1))
    return maps[slot]
