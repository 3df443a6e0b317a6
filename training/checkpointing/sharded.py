"""Sharded model/optimizer state (``checkpoint.format: sharded``) via torch.distributed.checkpoint.

Why DCP: FSDP-style state (DTensor shards) has to be written by every rank and re-sharded when
the world size changes; DCP's planners do both (replicated DDP tensors are de-duplicated, each
written by one rank).  Why not DCP's default ``FileSystemWriter``: it stores the checkpoint
metadata with ``pickle``, and convoy never loads a file that can execute code.  So the tensors
go through DCP's HuggingFace storage: each rank writes ``dcp/shard-<r+1>-model-….safetensors``
whose JSON header carries the shard offsets, and the reader rebuilds DCP's metadata from those
headers (``safetensors.safe_open``: no code execution).  Non-tensor leaves (optimizer
hyper-parameters) stay in convoy's JSON skeleton ``dcp.json``, written by rank 0.

Everything else of the train state (scheduler, scaler, cursor, step, per-rank RNG) keeps the
regular per-part files; the checkpoint store's manifest lists and hashes the shard files like any
other, so the commit protocol and the verify-before-load rule are unchanged.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.checkpointing import safetensors_io as safetensors
from training.checkpointing.codec import join_tree, split_tree, tensor_refs
from training.checkpointing.errors import CheckpointRejected
from training.fsutil import atomic_write_bytes, fsync_dir

SHARD_DIR = "dcp"
SKELETON = "dcp.json"
LAYOUT = "sharded"

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported where shards are written or read
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


def save_shards(tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    """Collective: every rank calls it with the same ``tmp``.  Returns this rank's manifest entries
    (``dcp/…`` shard files it wrote, plus ``dcp.json`` on rank 0), each fsynced and hashed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    skeleton, flat = _flatten(_trees(model, optimizer))
    # DCP gives a tensor every rank holds (replicated state) to one writer, choosing in the order
    # the state dict lists its items; an optimizer restored from a checkpoint lists its state in
    # another order than one that trained from the start, so the same state went into other
    # shards and the checkpoint's digest differed (tests/test_sharded.py, a real 2-rank kill).
    # Sorted keys make the plan, hence the files, a function of the state alone.
    flat = dict(sorted(flat.items()))
    out = tmp / SHARD_DIR
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # one process without a process group is a supported case
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(out), save_distributed=True))
    files: dict[str, Any] = {}
    for path in sorted(out.glob(f"shard-{rank + 1:05d}-*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        size, digest, content = safetensors.hash_file_and_content(path)
        files[f"{SHARD_DIR}/{path.name}"] = {"size": size, "xxh3_128": digest, "content": content}
    fsync_dir(out)
    if rank == 0:
        blob = (json.dumps(skeleton, sort_keys=True, indent=1) + "\n").encode()
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
