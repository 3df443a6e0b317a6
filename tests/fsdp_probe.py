"""What a sharded run's newest checkpoint restores to, at any world size (``torchrun
--nproc-per-node N -m tests.fsdp_probe RUN_DIR OUT.json``): the runtime built as a worker builds
it (FSDP2 over N ranks), the newest checkpoint restored through DCP (re-sharded when N differs
from the saving world size), then the whole model and optimizer state gathered to rank 0 and
compared, tensor by tensor, with the checkpoint's shards read in one process without a process
group (:func:`training.checkpointing.sharded.full_model` and the same for the optimizer).  Rank 0
writes what it found to OUT.json: the step, how many tensors, and every one that differs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def offline_state(path: Path, skeleton: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's shards by DCP key, read whole in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    from training.checkpointing.codec import tensor_refs

    meta = HuggingFaceStorageReader(str(path / "dcp")).read_metadata().state_dict_metadata
    whole = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in sorted(tensor_refs(skeleton))}
    dcp.load(whole, storage_reader=HuggingFaceStorageReader(str(path / "dcp")), no_dist=True)
    return whole


def main(run_dir: Path, out: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from training.checkpointing.codec import split_tree
    from training.loop.restore import restore_newest
    from training.loop.runtime import build_runtime, start_device
    from training.rundir import load_run_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    config = load_run_config(run_dir)
    device = start_device(config, world)
    runtime = build_runtime(config, device, rank, world, run_dir=run_dir)
    restored = restore_newest(runtime, run_dir, lambda m: None)
    assert restored.checkpoint is not None, "nothing restored"
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(runtime.parts.model, runtime.parts.optimizer, options=options)
    if rank != 0:
        return
    _, live = split_tree({"model": model_sd, "optimizer": optim_sd})
    skeleton = json.loads((restored.checkpoint.path / "dcp.json").read_text())
    saved = offline_state(restored.checkpoint.path, skeleton)
    differ = [k for k, t in saved.items() if k not in live or not torch.equal(live[k], t)]
    report = {"step": restored.checkpoint.step, "world": world, "tensors": len(saved), "differ": differ}
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
