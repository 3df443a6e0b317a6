"""Streaming safetensors writer/reader with the content hash computed in the same pass.

The files are standard safetensors (readable by ``safetensors.safe_open``), but writing them
ourselves lets us (a) hash while writing instead of re-reading, (b) write straight from reused
snapshot buffers with no intermediate ``bytes``, and (c) on restore read each file exactly once,
hash it and build tensors over that buffer (``torch.frombuffer``): no pickle, no second read.
The header is deterministic (sorted keys, no timestamps), so equal state gives equal bytes.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from training.checkpointing.errors import CheckpointRejected

if TYPE_CHECKING:  # torch is imported where tensors are made: hashing a file needs none
    import torch

#: safetensors' dtype names, in torch's terms.
_DTYPE_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


@cache
def _dtypes() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors name; built on first use, so that verifying a checkpoint (a
    read-only command, the flow's resume point) does not pay ``import torch``."""
    import torch

    return {getattr(torch, name): code for name, code in _DTYPE_NAMES.items()}


@cache
def _from_name() -> dict[str, torch.dtype]:
    return {v: k for k, v in _dtypes().items()}


_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFormatError(ValueError):
    """The file is not a well-formed safetensors file (e.g. a pickle posing as one)."""


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    import torch

    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


def hash_bytes(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def _hash_all(hasher: Any, views: list[Any]) -> None:
    for view in views:
        hasher.update(view)


def write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write ``tensors`` (CPU) to ``path``, fsync it; return (size, xxh3-128 hex of the bytes)."""
    header: dict[str, object] = {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        if t.dtype not in _dtypes():
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be checkpointed")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _dtypes()[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section like the reference writer
    prefix = struct.pack("<Q", len(blob)) + blob
    views = [_raw_bytes(tensors[name]) for name in names]
    # The hash runs on a helper thread while this one writes and fsyncs: xxhash releases the GIL,
    # and so do write() and fsync(), so hashing (~14 GB/s) hides behind the disk instead of adding
    # to it (bench/checkpoint.py, "sync save").  Both read the same immutable views.
    hasher = new_hasher()
    hash_thread = threading.Thread(target=_hash_all, args=(hasher, [prefix, *views]), name="convoy-hash")
    hash_thread.start()
    try:
        with open(path, "wb", buffering=0) as f:
            f.write(prefix)
            for view in views:
                written = 0
                while written < len(view):
                    written += f.write(view[written:])
            os.fsync(f.fileno())
    finally:
        hash_thread.join()
    return len(prefix) + offset, hasher.hexdigest()


def read_verified(path: Path, expected_size: int, expected_hash: str) -> mmap.mmap | bytes:
    """Map the file privately (copy-on-write), check size and hash; CheckpointRejected on any
    mismatch (the file is a checkpoint's: it is the store's verification).

    A private mapping is read straight from the page cache with no first-touch of fresh memory
    (which runs at ~1 GB/s here), and tensors built over it may be written (optimizer moments
    are updated in place) without touching the file.
    """
    size = path.stat().st_size
    if size != expected_size:
        raise CheckpointRejected(f"{path.name}: size {size} != manifest {expected_size} (truncated or replaced)")
    if size == 0:
        buf: mmap.mmap | bytes = b""
    else:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    digest = xxhash.xxh3_128(buf).hexdigest()
    if digest != expected_hash:
        raise CheckpointRejected(
            f"{path.name}: content hash {digest[:12]}… != manifest {expected_hash[:12]}… (corrupt)"
        )
    return buf


def hash_file(path: Path) -> tuple[int, str]:
    """Size and xxh3-128 of a file, hashed over a short-lived read-only mapping (no copies)."""
    size = path.stat().st_size
    if size == 0:
        return 0, xxhash.xxh3_128(b"").hexdigest()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
        return size, xxhash.xxh3_128(mm).hexdigest()


def hash_file_and_content(path: Path) -> tuple[int, str, str]:
    """Size, xxh3-128 of the bytes, and xxh3-128 of the *content*: the header as sorted JSON plus
    the data section.  For files written by another serializer (DCP's safetensors writer emits
    the header keys in hash-map order, which changes from process to process) the content hash
    is what identifies the state; the byte hash still guards integrity."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
        (hlen,) = struct.unpack("<Q", mm[:8])
        if hlen > min(_MAX_HEADER, size - 8):
            raise SafetensorsFormatError(f"{path.name}: header length out of range: not a safetensors file")
        header = json.loads(mm[8 : 8 + hlen])
        content = xxhash.xxh3_128(json.dumps(header, sort_keys=True).encode())
        content.update(memoryview(mm)[8 + hlen :])
        return size, xxhash.xxh3_128(mm).hexdigest(), content.hexdigest()


#: Bytes per element of each safetensors dtype name (checked without torch).
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


@dataclass(frozen=True)
class TensorMeta:
    """A tensor's dtype and shape as its file's header states them: what a read-only command
    (``convoy verify``/``inspect``) checks in place of the tensor, so it never imports torch.

    ``dtype`` is spelled as ``str(torch_tensor.dtype)`` (``"torch.float32"``) so the same
    shape/dtype comparisons hold for both."""

    dtype: str
    shape: tuple[int, ...]
    #: Loaded as a numpy array (``__nd__`` in the skeleton), where a resume gets ``tensor.numpy()``.
    array: bool = False

    def numpy(self) -> TensorMeta:
        """What ``join_tree`` calls for a saved numpy array, as on a tensor."""
        return replace(self, array=True)


@dataclass(frozen=True)
class _Entry:
    meta: TensorMeta
    code: str  # the safetensors dtype name
    start: int
    end: int


def _read_header(buf: mmap.mmap | bytes | bytearray) -> tuple[dict[str, _Entry], dict[str, str], int]:
    """The header's entries (offsets checked against the file and against dtype x shape), its
    metadata and where the data section starts.  Pure parsing: no torch, nothing executed."""
    if len(buf) < 8:
        raise SafetensorsFormatError("file too short for a safetensors header")
    (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
    if hlen > min(_MAX_HEADER, len(buf) - 8):
        raise SafetensorsFormatError("header length out of range: not a safetensors file")
    try:
        header = json.loads(bytes(buf[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SafetensorsFormatError("header is not JSON: not a safetensors file") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("header is not a mapping")
    metadata = header.pop("__metadata__", {}) or {}
    base = 8 + hlen
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        try:
            code = info["dtype"]
            itemsize = _ITEMSIZE[code]
            start, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(s) for s in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsFormatError(f"bad header entry for {name!r}") from None
        if not 0 <= start <= end <= len(buf) - base:
            raise SafetensorsFormatError(f"{name!r}: data offsets outside the file")
        if min(shape, default=0) < 0 or math.prod(shape) * itemsize != end - start:
            raise SafetensorsFormatError(f"{name!r}: {end - start} bytes do not hold a {list(shape)} {code} tensor")
        entries[name] = _Entry(TensorMeta(f"torch.{_TORCH_NAMES[code]}", shape), code, start, end)
    return entries, metadata, base


#: safetensors' dtype names -> torch's attribute names (the inverse of ``_DTYPE_NAMES``).
_TORCH_NAMES = {code: name for name, code in _DTYPE_NAMES.items()}


def parse_meta(buf: mmap.mmap | bytes | bytearray) -> tuple[dict[str, TensorMeta], dict[str, str]]:
    """The header's tensors as :class:`TensorMeta` (for verifying without ``import torch``)."""
    entries, metadata, _ = _read_header(buf)
    return {name: e.meta for name, e in entries.items()}, metadata


def parse(buf: mmap.mmap | bytes | bytearray) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Build tensors over ``buf`` (no copy); never executes anything from the file."""
    import torch

    entries, metadata, base = _read_header(buf)
    tensors: dict[str, torch.Tensor] = {}
    for name, e in entries.items():
        dtype = _from_name()[e.code]
        if e.end == e.start:
            tensors[name] = torch.empty(e.meta.shape, dtype=dtype)
        else:
            count = math.prod(e.meta.shape)
            tensors[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + e.start).reshape(e.meta.shape)
    return tensors, metadata
