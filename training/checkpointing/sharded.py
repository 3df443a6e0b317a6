"""Sharded model/optimizer state (``checkpoint.format: sharded``) in DCP's layout.

Why DCP's layout: FSDP-style state (DTensor shards) has to be written by every rank and
re-sharded when the world size changes; DCP's load planner re-shards.  Why its HuggingFace
storage: DCP's default ``FileSystemWriter`` stores the metadata with ``pickle``, and convoy
never loads a file that can execute code; in the HuggingFace layout each rank's
``dcp/shard-<r+1>-model-00001-of-00001.safetensors`` carries its pieces' offsets in its JSON header,
and the reader rebuilds DCP's metadata from those headers (``safetensors.safe_open``).
Non-tensor leaves (optimizer hyper-parameters) and tied-tensor aliases stay in convoy's JSON
skeleton ``dcp.json``, written by rank 0.

Why not DCP's writer: its plan is agreed by collectives, which must run on the training thread
(the loop's own collectives use the same process group), so every save held the loop for the
whole write.  Each rank's pieces are known without asking the others (the local shard of each
DTensor, its offset from the placement; a tensor every rank holds is written by one of them), so
:func:`local_shard` takes them on the training thread, the store copies them into reused buffers
like any part, and :func:`write_shard` writes them on the persist thread: an asynchronous sharded
save.  The files are those DCP's writer made (same names, same header metadata); checkpoints it
wrote load the same way.

Everything else of the train state (scheduler, scaler, cursor, step, per-rank RNG) keeps the
regular per-part files; the checkpoint store's manifest lists and hashes the shard files like any
other, so the commit protocol and the verify-before-load rule are unchanged.
"""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.checkpointing import safetensors_io as safetensors
from training.checkpointing.codec import join_tree, split_tree, tensor_refs
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.staged import Staged
from training.fsutil import atomic_write_bytes, fsync_dir

SHARD_DIR = "dcp"
SKELETON = "dcp.json"
LAYOUT = "sharded"

if TYPE_CHECKING:  # torch is imported where shards are taken, written or read
    import torch


def _trees(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """FQN-keyed model and optimizer state (DDP prefix stripped; DTensors kept sharded).  For an
    optimizer that has not stepped yet, DCP initialises its state, giving the load its targets."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def _alias_id(t: torch.Tensor) -> tuple | None:
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: its local shard
    ptr = local.untyped_storage().data_ptr()
    if ptr == 0:
        return None
    return (ptr, local.storage_offset(), tuple(local.shape), tuple(local.stride()), local.dtype)


def _flatten(trees: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """``split_tree`` with tied tensors (e.g. an embedding shared with the output head) stored once:
    safetensors refuses aliased tensors, and one copy is what the model holds anyway.  The
    skeleton points every alias at the first key, so loading fills the shared tensor once."""
    skeleton, flat = split_tree(trees)
    first: dict[tuple, str] = {}
    alias: dict[str, str] = {}
    for key, t in flat.items():
        ident = _alias_id(t)
        if ident is None:
            continue
        if ident in first:
            alias[key] = first[ident]
        else:
            first[ident] = key
    for key in alias:
        del flat[key]

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if "__t__" in node:
                return {"__t__": alias.get(node["__t__"], node["__t__"])}
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(skeleton), flat


@dataclass(frozen=True)
class LocalShard:
    """This rank's pieces of the model and optimizer state, laid out as DCP's HuggingFace storage
    lays them out (so DCP's reader re-shards them on load), taken on the training thread without
    any collective: the store copies the pieces like any part and writes them on its persist
    thread (an asynchronous sharded save; the ranks meet through files, as for every save)."""

    #: ``dcp/shard-<r+1>-model-00001-of-00001.safetensors``: the file this rank writes.
    name: str
    #: DCP key -> this rank's piece (a view of the live state until the store copies it).
    tensors: dict[str, torch.Tensor]
    #: DCP key -> where the piece starts in the whole tensor (DCP's ``saved_offsets``).
    offsets: dict[str, list[int]]
    #: The whole tree's skeleton (non-tensor leaves, aliases); rank 0's only, written as ``dcp.json``.
    skeleton: Any | None

    def metadata(self) -> dict[str, str]:
        """The safetensors header metadata DCP's ``HuggingFaceStorageReader`` reads offsets from."""
        info = {key: {"saved_offsets": self.offsets[key]} for key in sorted(self.tensors)}
        return {"DCP_SHARDING_INFO": json.dumps(info, sort_keys=True), "DCP_VERSION": "1.0", "format": "pt"}


def flattened(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, dict[str, torch.Tensor]]:
    """(skeleton, DCP key -> tensor with DTensors kept) of the live model and optimizer: what a
    save and a snapshot of the same step both take their pieces from, walked once."""
    return _flatten(_trees(model, optimizer))


def local_shard(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world_size: int,
    walked: tuple[Any, dict[str, torch.Tensor]] | None = None,
) -> LocalShard:
    """This rank's pieces: of each DTensor the local shard (once per replicated mesh dimension);
    of each plain tensor, which every rank holds (DDP, optimizer step counters), the whole tensor
    on one rank, spread over the ranks by key order so that each writes its share.  ``walked``:
    :func:`flattened` of this step, when the caller has it."""
    skeleton, flat = walked or flattened(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    offsets: dict[str, list[int]] = {}
    plain = 0
    for key in sorted(flat):
        t = flat[key]
        if hasattr(t, "device_mesh"):
            piece = _dtensor_piece(t)
        else:
            piece = (t, [0] * t.dim()) if plain % world_size == rank else None
            plain += 1
        if piece is not None:
            tensors[key], offsets[key] = piece
    name = f"{SHARD_DIR}/shard-{rank + 1:05d}-model-00001-of-00001.safetensors"
    return LocalShard(name, tensors, offsets, skeleton if rank == 0 else None)


def _dtensor_piece(t: Any) -> tuple[torch.Tensor, list[int]] | None:
    """A DTensor's local piece and its offset, None where another rank writes it (a replicated
    mesh dimension is written by its first coordinate) or it is empty (uneven sharding)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    if any(isinstance(p, Replicate) and c != 0 for p, c in zip(t.placements, coordinate, strict=True)):
        return None
    local = t.to_local()
    if local.numel() == 0:
        return None
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return local, [int(o) for o in offset]


def held_pieces(walked: tuple[Any, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """DCP key -> every piece this rank holds of :func:`flattened`'s tensors: of each DTensor its
    local shard (empty ones too), of each plain tensor the whole.  What the memory tier snapshots
    per rank: a resume from it runs on the same world size and mesh (memory tier rule 3), so each
    piece goes back into the same rank's local tensor (:func:`load_pieces`) without DCP's
    re-sharding or offsets."""
    return {key: t.to_local() if hasattr(t, "device_mesh") else t for key, t in walked[1].items()}


#: A sharded state in the memory tier: this rank's pieces (:func:`held_pieces`) under this part,
#: the skeleton as JSON text under :data:`LAYOUT` (a text leaf: its tensor references are the
#: pieces', not the slot's).
PIECES = "shard"


def snapshot_parts(walked: tuple[Any, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """What a rank's memory-tier slot holds of a sharded model and optimizer (:func:`flattened`),
    beside its other parts."""
    return {PIECES: held_pieces(walked), LAYOUT: json.dumps(walked[0], sort_keys=True)}


def pieces_misfit(pieces: dict[str, torch.Tensor], skeleton: Any, flat: dict[str, torch.Tensor]) -> str | None:
    """Why a snapshot's pieces do not fit :func:`flattened`'s tensors (another model, another
    sharding), or None: each key there, each piece of its local tensor's shape and dtype."""
    if set(pieces) != set(flat) or tensor_refs(skeleton) != set(flat):
        missing, extra = sorted(set(pieces) - set(flat))[:5], sorted(set(flat) - set(pieces))[:5]
        return f"sharded snapshot does not match the model/optimizer: only in it {missing}, only in model {extra}"
    for key, live in flat.items():
        local, piece = (live.to_local() if hasattr(live, "device_mesh") else live), pieces[key]
        if local.shape != piece.shape or local.dtype != piece.dtype:
            return (
                f"sharded snapshot: {key} is {piece.dtype} {tuple(piece.shape)} in it, {local.dtype} "
                f"{tuple(local.shape)} in the model (another sharding)"
            )
    return None


def snapshot_misfit(parts: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """:func:`pieces_misfit` of a memory snapshot's parts (None for any other candidate): asked on
    every rank before the snapshot is taken, so that all refuse it alike (memory tier rule 9)."""
    if PIECES not in parts:
        return None
    return pieces_misfit(parts[PIECES], parts[LAYOUT], flattened(model, optimizer)[1])


def staged_shard(staged: Staged, shard: LocalShard) -> tuple[Staged, LocalShard]:
    """A save staged in the memory tier's slot with :func:`snapshot_parts` (memory tier rule 8):
    the regular parts for the store, and ``shard`` whose pieces are the slot's copies (the store
    copies them no more)."""
    views = staged.tensors[PIECES]
    rest = {part: tree for part, tree in staged.skeletons.items() if part not in (PIECES, LAYOUT)}
    tensors = {part: staged.tensors.get(part, {}) for part in rest}
    pieces = {key: views[key] for key in shard.tensors}
    return replace(staged, skeletons=rest, tensors=tensors), replace(shard, tensors=pieces)


def load_pieces(
    pieces: dict[str, torch.Tensor], skeleton: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """:func:`held_pieces` of a snapshot back into the live model and optimizer, on this rank
    alone (no collective): each piece copied into the local tensor it was taken from.  A key or a
    shape that differs is a snapshot that does not fit (CheckpointRejected)."""
    import torch
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _, flat = _flatten(_trees(model, optimizer))
    misfit = pieces_misfit(pieces, skeleton, flat)
    if misfit is not None:  # checked before any is written: a refusal changes nothing
        raise CheckpointRejected(misfit)
    locals_ = {key: live.to_local() if hasattr(live, "device_mesh") else live for key, live in flat.items()}
    with torch.no_grad():
        for key, local in locals_.items():
            local.copy_(pieces[key])
    tree = join_tree(skeleton, flat)
    set_state_dict(model, optimizer, model_state_dict=tree["model"], optim_state_dict=tree["optimizer"])


def write_shard(shard: LocalShard, tmp: Path) -> dict[str, Any]:
    """Write this rank's pieces (copied by the store) into ``tmp``, fsynced; rank 0 writes the
    skeleton too.  Returns the manifest entries."""
    path = tmp / shard.name
    path.parent.mkdir(parents=True, exist_ok=True)
    size, digest = safetensors.write_file(path, shard.tensors, shard.metadata())
    files: dict[str, Any] = {shard.name: {"size": size, "xxh3_128": digest}}
    fsync_dir(path.parent)
    if shard.skeleton is not None:
        blob = (json.dumps(shard.skeleton, sort_keys=True, indent=1) + "\n").encode()
        atomic_write_bytes(tmp / SKELETON, blob, durable=True)
        files[SKELETON] = {"size": len(blob), "xxh3_128": safetensors.hash_bytes(blob)}
    return files


def verify_shards(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Check every ``dcp/`` file against the manifest (size + xxh3-128) and return the skeleton.
    Raises CheckpointRejected, like the rest of the store's verification."""
    files = manifest["files"]
    if SKELETON not in files:
        raise CheckpointRejected(f"{SKELETON}: not in manifest (sharded checkpoint without its skeleton)")
    on_disk = {f"{SHARD_DIR}/{p.name}" for p in (path / SHARD_DIR).glob("*.safetensors")}
    listed = {n for n in files if n.startswith(f"{SHARD_DIR}/")}
    if on_disk != listed:
        raise CheckpointRejected(f"{SHARD_DIR}/: files {sorted(on_disk ^ listed)} differ from the manifest")
    for name in sorted(listed):
        try:  # the header is parsed too: a file that hashes right but is no safetensors is refused
            size, digest, _content = safetensors.hash_file_and_content(path / name)
        except (ValueError, struct.error) as exc:  # the header parse of a file that is no safetensors
            raise CheckpointRejected(f"{name}: not a safetensors file ({exc})") from None
        if size != files[name]["size"] or digest != files[name]["xxh3_128"]:
            raise CheckpointRejected(f"{name}: size or content hash does not match the manifest (corrupt)")
    info = files[SKELETON]
    blob = safetensors.read_verified(path / SKELETON, info["size"], info["xxh3_128"])
    try:
        return json.loads(bytes(blob))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointRejected(f"{SKELETON}: not JSON") from None


def load_shards(path: Path, skeleton: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: read the shards this rank needs (re-sharding to the current world size) into the
    live model and optimizer.  The tensor keys must match exactly; a mismatch is a checkpoint that
    does not fit the task (CheckpointRejected: only here are the shard keys compared with the model's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _, flat = _flatten(_trees(model, optimizer))
    saved = tensor_refs(skeleton)
    if saved != set(flat):
        missing, extra = sorted(saved - set(flat))[:5], sorted(set(flat) - saved)[:5]
        raise CheckpointRejected(
            f"sharded checkpoint does not match the model/optimizer: only in checkpoint {missing}, "
            f"only in model {extra}"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(path / SHARD_DIR)))
    tree = join_tree(skeleton, flat)
    set_state_dict(model, optimizer, model_state_dict=tree["model"], optim_state_dict=tree["optimizer"])


def full_model(path: Path, skeleton: Any) -> dict[str, torch.Tensor]:
    """The model's whole tensors, by parameter name, from a sharded checkpoint already verified
    (:func:`verify_shards` gave ``skeleton``): read in this one process, no process group (DCP
    then reads every rank's shard into each whole tensor), to export or register the finished
    model, which loads into the unsharded model class.  Tied tensors come back under each name."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    refs = {
        name: node["__t__"] for name, node in skeleton["model"].items() if isinstance(node, dict) and "__t__" in node
    }
    shapes = HuggingFaceStorageReader(str(path / SHARD_DIR)).read_metadata().state_dict_metadata
    whole = {}
    for key in sorted(set(refs.values())):
        meta = shapes[key]
        whole[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(whole, storage_reader=HuggingFaceStorageReader(str(path / SHARD_DIR)), no_dist=True)
    return {name: whole[key] for name, key in refs.items()}
