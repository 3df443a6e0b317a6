"""Where a memory-tier slot puts each tensor, and the copy into it.

A slot holds the tensors' bytes grouped by dtype (one concatenation a group, each group aligned to
64 bytes), in the order of their (part, key), then the parts' JSON skeletons.  The layout depends
only on the tensors' names, dtypes and shapes, so it is the same at every snapshot of a run and is
computed once (:class:`Layouts` for the full walk, the snapshot plan for its fast path).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mmap

    import torch

_IS_CUDA = operator.attrgetter("is_cuda")
#: (part, key, tensor), in the slot's order: sorted by part, then by key.
Flat = list[tuple[str, str, "torch.Tensor"]]
#: (dtype, offset, numel, the group's tensors as 1-D views): one copy each.
Group = tuple[Any, int, int, list["torch.Tensor"]]


@dataclass(frozen=True)
class Layout:
    """A slot's layout for one signature (names, dtypes, shapes) of its tensors."""

    #: (dtype, offset, numel, indices into the flat list) of each dtype group.
    order: list[tuple[Any, int, int, list[int]]]
    #: (part, key, dtype name, shape, offset, bytes) of each tensor: what the slot's header lists.
    places: list[tuple[str, str, str, list[int], int, int]]
    #: Where the tensors' bytes end (the skeletons follow).
    end: int
    #: [start, end) of the alignment padding before each group: written as zeros, so a slot's
    #: bytes are its content's alone, not also what an older layout left there.
    gaps: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, signature: tuple[tuple[str, str, Any, Any], ...]) -> Layout:
        by_dtype: dict[Any, list[int]] = {}
        for i, (_part, _key, dtype, _shape) in enumerate(signature):
            by_dtype.setdefault(dtype, []).append(i)
        order, places, offset, gaps = [], [], 0, []
        for dtype in sorted(by_dtype, key=str):
            if offset % 64:
                gaps.append((offset, offset + -offset % 64))
            offset += -offset % 64
            start, size = offset, dtype.itemsize
            for i in by_dtype[dtype]:
                part, key, _dtype, shape = signature[i]
                nbytes = math.prod(shape) * size
                places.append((part, key, str(dtype).removeprefix("torch."), list(shape), offset, nbytes))
                offset += nbytes
            order.append((dtype, start, (offset - start) // size, by_dtype[dtype]))
        return cls(order, places, offset, tuple(gaps))

    @functools.cached_property
    def places_json(self) -> Any:
        """:attr:`places` serialised once: the header of every snapshot repeats them."""
        import orjson

        return orjson.Fragment(orjson.dumps(self.places))

    def groups(self, flat: Flat) -> list[Group]:
        """``flat``'s tensors (of this layout's signature) as the groups :func:`copy_into` copies."""
        return [
            (dtype, offset, numel, [flat[i][2].reshape(-1) for i in idx]) for dtype, offset, numel, idx in self.order
        ]


def signature(flat: Flat) -> tuple[tuple[str, str, Any, Any], ...]:
    return tuple((part, key, t.dtype, t.shape) for part, key, t in flat)


class Layouts:
    """The layout of the newest signature seen: one run's state has one."""

    def __init__(self) -> None:
        self._kept: tuple[Any, Layout] | None = None

    def of(self, flat: Flat) -> Layout:
        sig = signature(flat)
        if self._kept is None or self._kept[0] != sig:
            self._kept = (sig, Layout.of(sig))
        return self._kept[1]


def copy_into(buf: mmap.mmap, groups: list[Group], on_cpu: bool = False) -> None:
    """Each dtype group's tensors into the mapped slot with one concatenation (a CUDA group is
    concatenated on its device, then copied to the host once).  ``on_cpu``: the caller knows every
    tensor is in host memory (the writer thread's copy: no Python loop over the tensors)."""
    import torch

    for dtype, offset, numel, tensors in groups:
        if not numel:
            continue
        dst = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset)
        if not on_cpu and any(map(_IS_CUDA, tensors)):
            # One group can hold both: Adam keeps its step counts on the CPU beside CUDA parameters
            # (unless capturable or fused), numpy's RNG keys share int64 with a BatchNorm's count.
            device = next(t.device for t in tensors if t.is_cuda)
            dst.copy_(torch.cat([t if t.device == device else t.to(device) for t in tensors]))
        else:
            torch.cat(tensors, out=dst)
