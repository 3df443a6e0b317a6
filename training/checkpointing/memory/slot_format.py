"""What a memory-tier slot's files hold: the header (its format, its commit), the slot's hash,
and the checkpoint parts and manifest a verified slot stands for.

Kept apart from :mod:`training.checkpointing.memory.memory_tier` (which writes and picks the slots) so the
format is read in one place: the header file is the body's length (8 bytes, 0 = none), the body's
xxh64 (8), then the body (JSON); a slot's bytes are hashed with the checkpoints' xxh3-128.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.checkpointing.codec import join_tree

FORMAT = 2  # 2: headers written in place (.head); 1 was renamed in (.json)


def slot_hash(*buffers: Any) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for b in buffers:
        h.update(b)
    return h.hexdigest()


@dataclass(frozen=True)
class Header:
    """A slot's header (``rank-<r>.slot-<k>.head``): what the slot holds and its hash."""

    step: int
    fingerprint: str
    world_size: int
    rank: int
    #: (part, key, dtype name, shape, offset, bytes) of each tensor, in the slot's order.
    tensors: Any  # a list of those; written as the layout's serialised places (an orjson Fragment)
    #: Where in the slot the JSON skeletons of the parts are (:mod:`training.checkpointing.codec`):
    #: [start, end), after the tensors' bytes.
    skeletons: list[int]
    size: int
    digest: str

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.__dict__}

    @classmethod
    def read(cls, path: Path) -> Header | None:
        """The header committed in ``path``, or None: none committed, being written, torn or of
        another format (see :func:`encode_header`)."""
        try:
            d = json.loads(decode_header(path.read_bytes()) or b"null")
            fields = {k: d[k] for k in cls.__dataclass_fields__}
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return cls(**fields) if d.get("format") == FORMAT else None


#: A header file: the body's length (8 bytes, 0 = no header), the body's xxh64 (8), the body (JSON).
HEAD = 16


def encode_header(body: bytes) -> tuple[bytes, bytes]:
    """(length and checksum, body) as a header file holds them; the first part is written last:
    the commit."""
    import xxhash

    return len(body).to_bytes(8, "little") + xxhash.xxh64_digest(body), body


def decode_header(data: bytes) -> bytes | None:
    """The committed body of a header file, or None where there is none or it does not check out
    (a kill in the middle of its write)."""
    import xxhash

    n = int.from_bytes(data[:8], "little")
    body = data[HEAD : HEAD + n]
    if not n or len(body) != n or xxhash.xxh64_digest(body) != data[8:HEAD]:
        return None
    return body


def slot_parts(header: Header, data: Any) -> dict[str, Any]:
    """The state parts a verified slot holds (tensors over a private copy of its bytes)."""
    start, end = header.skeletons
    skeletons = json.loads(bytes(data[start:end]))
    tensors: dict[str, dict[str, Any]] = {part: {} for part in skeletons}
    tensors.update(tensor_views(data, header.tensors))
    return {part: join_tree(skel, tensors[part]) for part, skel in skeletons.items()}


def tensor_views(data: Any, places: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Each place's tensor (``(part, key, dtype, shape, offset, bytes)``, as a header lists them)
    as a view of ``data``, a slot's bytes, by part and key: no copy."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for part, key, dtype, shape, offset, nbytes in places:
        dt = getattr(torch, dtype)
        flat = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else None
        out.setdefault(part, {})[key] = (
            flat.view(dt).reshape(shape) if flat is not None else torch.empty(shape, dtype=dt)
        )
    return out


def slot_manifest(step: int, headers: dict[int, Header]) -> dict[str, Any]:
    """What a restore reads of a checkpoint's manifest, for a snapshot."""
    h0 = headers[0]
    return {
        "step": step,
        "fingerprint": h0.fingerprint,
        "world_size": h0.world_size,
        "digest": slot_hash(*(h.digest.encode() for _, h in sorted(headers.items()))),
        "files": {f"rank-{r}.slot": {"size": h.size} for r, h in headers.items()},
        "tier": "memory",
    }
