"""Reading and verifying one checkpoint directory; never unpickles, never writes.

What a checkpoint is on disk (``checkpoints/step-000001200/``): for each *part* (``state`` — the
replicated train state written by rank 0 — and ``rank-<r>`` — that rank's RNG) a
``<part>.safetensors`` with the tensors and a ``<part>.json`` with the JSON skeleton, plus
``manifest.json`` (step, per-file size + xxh3-128, whole-state digest, fingerprint, world size,
versions).  A directory without a valid manifest is not a checkpoint.

Every way a directory can fail to be a good checkpoint raises
:class:`~training.checkpointing.errors.CheckpointRejected` with a one-line reason naming the
file (an unreadable file too: the ``OSError`` becomes the rejection's cause).  Anything else
raised here is a bug and propagates as itself.  The store (:mod:`training.checkpointing.store`)
walks directories and records what it passes over; this module judges one directory.
"""

from __future__ import annotations

import json
import platform
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.checkpointing import safetensors_io as safetensors
from training.checkpointing import sharded
from training.checkpointing.codec import join_tree, tensor_refs
from training.checkpointing.errors import CheckpointRejected
from training.fsutil import read_json
from training.release import convoy_release

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def writer_versions() -> dict[str, str]:
    """What wrote a checkpoint (its manifest's ``versions``); called at a save, where tensors
    exist, so torch is imported already and verifying never imports it."""
    return {
        "torch": sys.modules["torch"].__version__,
        "python": platform.python_version(),
        "format": str(FORMAT_VERSION),
        "convoy": convoy_release(),
    }


#: What a manifest may name: a plain file of the checkpoint directory, or one in its ``dcp/``
#: sub-directory.  No leading dot, so no ``..``, no hidden temp files, no absolute paths.
_MEMBER_NAME = re.compile(rf"(?:{sharded.SHARD_DIR}/)?[A-Za-z0-9_][A-Za-z0-9_.-]*")
#: Parts convoy writes: ``state`` (replicated train state) and ``rank-<r>`` (that rank's RNG).
_PART_NAME = re.compile(r"state|rank-\d+")

#: ``validator(manifest, parts)`` raises CheckpointRejected when loaded parts do not make a train
#: state that fits (see :func:`training.checkpointing.state_check.checkpoint_validator`).
Validator = Callable[[dict[str, Any], dict[str, Any]], None]


@dataclass
class Checkpoint:
    step: int
    path: Path
    manifest: dict[str, Any]

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def bytes(self) -> int:
        return sum(f["size"] for f in self.manifest["files"].values())


def parse_step(name: str) -> int | None:
    if not name.startswith("step-"):
        return None
    digits = name[5:]
    return int(digits) if digits.isdigit() else None


def state_digest(files: dict[str, dict[str, Any]]) -> str:
    """Whole-state digest: a hash over every file's content hash, in name order.

    convoy's files are deterministic functions of the state (sorted headers, no timestamps); for
    shard files written by DCP the entry's ``content`` hash (canonical header + data) is used.  So
    two runs that reach the same state at the same step have the same digest.
    """
    h = safetensors.new_hasher()
    for name in sorted(files):
        h.update(f"{name}:{files[name].get('content', files[name]['xxh3_128'])}\n".encode())
    return h.hexdigest()


def member_path(checkpoint_dir: Path, name: Any) -> Path:
    """The path of a file the manifest names, confined to ``checkpoint_dir``.

    Manifest names are data read from disk: a doctored manifest could name ``../../x`` or
    ``/etc/passwd`` with a matching hash.  Anything but a plain relative name, or a symbolic link,
    is refused before it is opened."""
    if not isinstance(name, str) or not _MEMBER_NAME.fullmatch(name):
        raise CheckpointRejected(
            f"manifest names {name!r}: not a plain file name inside the checkpoint (refused, not opened)"
        )
    path = checkpoint_dir / name
    for p in (path, path.parent):
        if p.is_symlink():
            raise CheckpointRejected(f"{name}: a symbolic link (refused, not opened)")
    return path


def read_manifest(path: Path, step: int | None = None) -> dict[str, Any]:
    """``path``'s manifest, checked against its file list and the step in the directory name
    (or ``step``, for a copy under another name, e.g. a DVC stage)."""
    mpath = path / MANIFEST
    try:
        if not mpath.exists():
            raise CheckpointRejected("no manifest.json (incomplete checkpoint)")
        manifest = read_json(mpath)
    except (ValueError, UnicodeDecodeError) as exc:  # read_json: not JSON
        raise CheckpointRejected(f"manifest.json unreadable ({exc})") from None
    except OSError as exc:
        raise CheckpointRejected(f"manifest.json unreadable ({exc})") from exc
    if not isinstance(manifest, dict):
        raise CheckpointRejected("manifest.json is not a JSON object")
    for key in ("step", "files", "digest"):
        if key not in manifest:
            raise CheckpointRejected(f"manifest.json lacks {key!r}")
    written = manifest.get("format", FORMAT_VERSION)
    if not isinstance(written, int) or written > FORMAT_VERSION:
        raise CheckpointRejected(f"manifest.json: format {written!r}; this convoy reads {FORMAT_VERSION} and older")
    if manifest["step"] != (parse_step(path.name) if step is None else step):
        raise CheckpointRejected(f"manifest step {manifest['step']} does not match directory {path.name}")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(isinstance(info, dict) for info in files.values()):
        raise CheckpointRejected("manifest.json: 'files' is not a mapping of file entries")
    for info in files.values():
        info_hash(info)
    if state_digest(files) != manifest["digest"]:
        raise CheckpointRejected("manifest digest does not match its file list")
    return manifest


def load_checkpoint(
    path: Path, step: int | None, validator: Validator | None, tensors: bool = True
) -> tuple[Checkpoint, dict[str, Any]]:
    """Verify and load every part, reading each file exactly once.  ``tensors=False`` puts each
    tensor's header entry (:class:`~training.checkpointing.safetensors_io.TensorMeta`) where the
    tensor would be: every check below still runs, on the bytes and the headers, without torch.

    Checks, in order, each failure a CheckpointRejected naming the file and what is wrong: the
    manifest; every name it lists confined to ``path`` (before anything is opened); only files
    convoy writes (``<part>.safetensors`` + ``<part>.json`` pairs, sharded ``dcp/`` files); sizes
    and hashes; safetensors headers; skeletons that name exactly the tensors their file holds;
    then ``validator`` (the train state's structure and, where the model is known, its shapes
    and dtypes).  A file that cannot be read is a rejection too (the OSError is its cause)."""
    try:
        if path.is_symlink():
            raise CheckpointRejected(f"{path.name}: the checkpoint directory is a symbolic link (refused, not opened)")
        manifest = read_manifest(path, step)
        files = manifest["files"]
        for name in files:
            member_path(path, name)
        layout_sharded = manifest.get("layout") == sharded.LAYOUT
        part_names = _part_names(files, layout_sharded)
        parts: dict[str, Any] = {}
        if layout_sharded:
            parts[sharded.LAYOUT] = sharded.verify_shards(path, manifest)  # the skeleton; tensors load later
        for part in part_names:
            parts[part] = _load_part(path, files, part, tensors)
    except OSError as exc:
        raise CheckpointRejected(f"{path.name}: unreadable ({exc})") from exc
    if validator is not None:
        validator(manifest, parts)
    return Checkpoint(manifest["step"], path, manifest), parts


def _load_part(path: Path, files: dict[str, Any], part: str, tensors: bool) -> Any:
    name, skel_name = f"{part}.safetensors", f"{part}.json"
    info, skel_info = files[name], files[skel_name]
    skel_buf = safetensors.read_verified(path / skel_name, info_size(skel_info), info_hash(skel_info))
    buf = safetensors.read_verified(path / name, info_size(info), info_hash(info))
    try:
        loaded, _ = safetensors.parse(buf) if tensors else safetensors.parse_meta(buf)
    except safetensors.SafetensorsFormatError as exc:
        raise CheckpointRejected(f"{name}: {exc}") from None
    try:
        skeleton = json.loads(bytes(skel_buf))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointRejected(f"{skel_name}: not JSON") from None
    try:
        named = tensor_refs(skeleton)
    except ValueError as exc:  # codec: a tensor reference that is not a name
        raise CheckpointRejected(f"{skel_name}: {exc}") from None
    if named != set(loaded):
        missing, unused = sorted(named - set(loaded))[:3], sorted(set(loaded) - named)[:3]
        raise CheckpointRejected(
            f"{skel_name} does not match {name}: names tensors it lacks {missing}, leaves tensors unnamed {unused}"
        )
    try:
        return join_tree(skeleton, loaded)
    except (TypeError, ValueError, KeyError) as exc:  # hashes matched: the skeleton was written wrong
        raise CheckpointRejected(f"{skel_name}: malformed skeleton ({type(exc).__name__}: {exc})") from None


def info_size(info: Any) -> int:
    if not isinstance(info, dict) or not isinstance(info.get("size"), int):
        raise CheckpointRejected(f"manifest file entry {info!r}: no integer size")
    return info["size"]


def info_hash(info: Any) -> str:
    if not isinstance(info, dict) or not isinstance(info.get("xxh3_128"), str):
        raise CheckpointRejected(f"manifest file entry {info!r}: no xxh3_128 hash")
    return info["xxh3_128"]


def _part_names(files: dict[str, Any], layout_sharded: bool) -> list[str]:
    """The parts a manifest lists; any file convoy does not write is refused (e.g. a torch-saved
    ``model.pt``: convoy would never load it, and its presence means the directory was altered)."""
    parts: set[str] = set()
    for name in files:
        if layout_sharded and (name == sharded.SKELETON or name.startswith(f"{sharded.SHARD_DIR}/")):
            continue
        stem, _, ext = name.rpartition(".")
        if ext not in ("safetensors", "json") or not _PART_NAME.fullmatch(stem):
            raise CheckpointRejected(f"{name}: not a file convoy writes (refused, not opened)")
        parts.add(stem)
    for part in sorted(parts):
        for ext in ("safetensors", "json"):
            if f"{part}.{ext}" not in files:
                raise CheckpointRejected(f"{part}.{ext}: not in manifest (part {part!r} is incomplete)")
    return sorted(parts)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
