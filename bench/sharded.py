#!/usr/bin/env python
"""Sharded state by size: FSDP2 over 2 CPU ranks (gloo, ``train.parallel: fsdp``), each of
convoy's costs against a raw baseline measured in the same run.

Run from the repository root::

    .venv/bin/python bench/sharded.py                    # states of 0.5, 2 and 4 GiB over 2 ranks
    .venv/bin/python bench/sharded.py --sizes 0.1        # quick

The state is ``tests/memory_tasks.py``'s stack of fp32 linear layers with AdamW's two moments (12
bytes a parameter), each layer an FSDP2 unit; each rank holds half of it.  Per size:

* **save stall** (rank 0's, the ``checkpoint_saved`` event's ``stall_s``: its pieces copied into
  its memory-tier slot, from which the save persists; memory tier rules 8 and 9) against ``copy_``
  of the same bytes (half of each layer's weight, bias and two moments) into reused buffers, on
  one thread as each rank runs (torchrun sets ``OMP_NUM_THREADS=1``).  The steady stall is the
  second asynchronous save's; the first is shown beside it: it also allocates the slot's pages
  in ``/dev/shm`` when no snapshot did before it (once per worker).
* **restore from disk** (the ``resumed`` event's ``load_s`` of a worker started again on the
  finished run: verify every shard file, DCP's load of this rank's pieces, ``set_state_dict``)
  against a raw ``readinto`` of rank 0's shard file (page cache warm).
* **restore from the tier** (a run killed in step 14, started again: its ``load_s``) against a raw
  read of rank 0's slot file, and the time from the kill to the new ranks' first step.
* **loop**: convoy's defaults (saves every 10 steps, the tier every 3) against a bare FSDP2 loop
  (the same model, units, batch and AdamW, no checkpoint: ``--bare`` below, under torchrun), run
  once before and once after convoy's (this VM's speed drifts by tens of percent between
  minutes; the bare figure is the mean of the two): the median step and the mean step (saves and
  snapshots included), from the steps' timestamps.

Figures of one run only mean something against each other: the ratios are the result.  Scratch
files go to ``--tmp`` (default ``<repo>/.bench-tmp``), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import checkpoint as ck  # bench/checkpoint.py: the raw baselines
import scale  # bench/scale.py (puts the repository and tests/ on the path): the linear stack, torchrun
import torch

ROOT = scale.ROOT

GIB = 1 << 30
RANKS = 2
STEPS = scale.STEPS
BARE_STEPS = 12


def settings(size_gib: float) -> list[str]:
    return [*scale._linear_stack(size_gib), "train.parallel=fsdp", f"train.ranks={RANKS}"]


def step_times(run_dir: Path) -> list[float]:
    """Seconds between consecutive steps' journal rows (rank 0's), the first step left out."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    stamps = [r["time_ms"] / 1000 for r in sorted(rows, key=lambda r: r["step"])]
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def shard_copy_s(size_gib: float, repeats: int = 5) -> tuple[float, int]:
    """``copy_`` of one rank's share of the state (half of every tensor) into reused buffers."""
    from training.config import load_config

    cfg = load_config(None, settings(size_gib))
    width, layers = int(cfg.task_args["width"]), int(cfg.task_args["layers"])
    shapes = [(width // RANKS, width), (width // RANKS,)] * 3 * layers  # weight, bias; param + 2 moments
    src = [torch.randn(s) for s in shapes]
    dst = [torch.empty_like(t) for t in src]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        ck.copy_all(dst, src)
        took = [ck.timed(ck.copy_all, dst, src)[0] for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)
    return statistics.median(took), sum(t.numel() * 4 for t in src)


def raw_read_s(path: Path) -> float:
    view = memoryview(bytearray(path.stat().st_size))
    ck.raw_readinto(path, view)  # warm
    return statistics.median(ck.timed(ck.raw_readinto, path, view)[0] for _ in range(3))


def run_figures(size_gib: float, tmp: Path) -> dict[str, float]:
    """Convoy's run with the defaults: its stalls and steps; then a worker on the finished run:
    its restore from disk."""
    from engine_util import make_run

    from training.events import Event, read_events

    run = make_run(tmp / f"convoy-{size_gib}", extra=settings(size_gib))
    p = scale._start(run, STEPS, {}, RANKS)
    out, _ = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(out[-3000:])
    saves = [e for e in read_events(run, Event.CHECKPOINT_SAVED) if not e.get("blocking")]
    gaps = step_times(run)
    p = scale._start(run, STEPS, {}, RANKS)  # nothing left to train: it restores step 24 from disk
    out, _ = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"the restoring ranks failed:\n{out[-3000:]}")
    resumed = read_events(run, Event.RESUMED)[-1]
    shard = sorted((run / "checkpoints" / f"step-{STEPS:09d}" / "dcp").glob("shard-00001-*.safetensors"))[0]
    bare = bare_restore_figures(size_gib, run / "checkpoints" / f"step-{STEPS:09d}")
    return {
        **bare,
        "stall": saves[-1]["stall_s"],  # the second: its slot's pages in place
        "first_stall": saves[0]["stall_s"],
        "step_median": statistics.median(gaps),
        "step_mean": statistics.mean(gaps),
        "disk_load": resumed["load_s"],
        "disk_tier": resumed["tier"],
        "shard_read": raw_read_s(shard),
        "shard_bytes": shard.stat().st_size,
    }


def kill_figures(size_gib: float, tmp: Path) -> dict[str, float]:
    """Both ranks killed in step 14 (its snapshot of 12 in each rank's slot), started again."""
    from engine_util import kill_group, make_run, wait_for_step

    from training import run_memory
    from training.events import Event, read_events

    run = make_run(tmp / f"killed-{size_gib}", extra=[*settings(size_gib), "checkpoint.every_steps=20"])
    p = scale._start(run, STEPS, {"CONVOY_FAULTS": "slow_step=14:600"}, RANKS)
    if wait_for_step(run, p, 13, timeout=1800) is None or p.poll() is not None:
        raise RuntimeError(f"the ranks to be killed failed:\n{p.communicate()[0][-3000:]}")
    time.sleep(0.5)
    root = run_memory.tier_root(run)
    slots = sorted(root.glob("rank-0.slot-*.bin"), key=lambda f: f.stat().st_mtime) if root else []
    if not slots:
        listed = sorted(root.iterdir()) if root and root.exists() else None
        raise RuntimeError(f"no memory slot of rank 0 at step 13 in {root}: {listed}")
    slot_read = raw_read_s(slots[-1])
    kill_group(p)  # torchrun starts each rank in a session of its own: every one signalled
    t_kill = time.time()
    p.wait()
    p = scale._start(run, 15, {}, RANKS)
    out, _ = p.communicate()
    run_memory.remove(run)
    if p.returncode != 0:
        raise RuntimeError(f"the resumed ranks failed:\n{out[-3000:]}")
    resumed = read_events(run, Event.RESUMED)[-1]
    first = read_events(run, Event.FIRST_STEP)[-1]
    return {
        "tier_load": resumed["load_s"],
        "tier_tier": resumed["tier"],
        "tier_step": resumed["step"],
        "slot_read": slot_read,
        "mttr": first["time"] - t_kill,
    }


def bare_figures(size_gib: float) -> dict[str, float]:
    """The bare FSDP2 loop (``--bare``) under torchrun: its steps' median and mean."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
    done = subprocess.run(
        [*cmd, str(Path(__file__)), "--bare", str(size_gib)], capture_output=True, text=True, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-3000:])
    gaps = json.loads(lines[-1])["gaps"]
    return {"bare_median": statistics.median(gaps), "bare_mean": statistics.mean(gaps)}


def _bare_parts(size_gib: float) -> tuple[Any, Any, torch.optim.Optimizer]:
    """(config, task parts, AdamW) of one rank: the task's model, FSDP2 on each linear layer and
    the root, in a gloo process group."""
    import torch.distributed as dist
    from memory_tasks import build_linear_stack
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from training.config import load_config

    dist.init_process_group("gloo")
    cfg = load_config(None, settings(size_gib))
    torch.manual_seed(cfg.train.seed)
    parts = build_linear_stack(cfg, torch.device("cpu"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in parts.model.modules():
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(parts.model, mesh=mesh)
    t = cfg.train
    opt = torch.optim.AdamW(parts.model.parameters(), lr=t.lr, weight_decay=t.weight_decay, foreach=False)
    return cfg, parts, opt


def bare_restore(size_gib: float, checkpoint: Path) -> None:
    """One rank of DCP's own restore of convoy's checkpoint (no verification, no convoy): the
    optimizer state initialised by DCP (``get_state_dict``: a zero-lr step), ``dcp.load`` from
    the shard files, ``set_state_dict``; prints rank 0's seconds of each phase."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from training.checkpointing import sharded as sh
    from training.checkpointing.codec import join_tree

    _, parts, opt = _bare_parts(size_gib)
    dist.barrier()
    t0 = time.perf_counter()
    skeleton, flat = sh.flattened(parts.model, opt)
    t1 = time.perf_counter()
    dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(checkpoint / sh.SHARD_DIR)))
    t2 = time.perf_counter()
    tree = join_tree(skeleton, flat)
    set_state_dict(parts.model, opt, model_state_dict=tree["model"], optim_state_dict=tree["optimizer"])
    t3 = time.perf_counter()
    if dist.get_rank() == 0:
        print(json.dumps({"init": t1 - t0, "read": t2 - t1, "set": t3 - t2}), flush=True)
    dist.destroy_process_group()


def bare_restore_figures(size_gib: float, checkpoint: Path) -> dict[str, float]:
    """:func:`bare_restore` under torchrun: its phases and total."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
    done = subprocess.run(
        [*cmd, str(Path(__file__)), "--bare-restore", str(size_gib), str(checkpoint)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-3000:])
    phases = json.loads(lines[-1])
    return {"dcp_init": phases["init"], "dcp_restore": sum(phases.values())}


def bare_loop(size_gib: float) -> None:
    """One rank of the bare loop: the task's model, FSDP2 on each linear layer and the root, the
    task's AdamW and loss, this rank's half of each global batch, clipping at ``train.grad_clip``
    (the recipe's, not convoy's); prints the steps' gaps."""
    import torch.distributed as dist

    cfg, parts, opt = _bare_parts(size_gib)
    rank, world, t = dist.get_rank(), dist.get_world_size(), cfg.train
    data, per_rank = parts.train_data, cfg.train.batch_size // world
    stamps = []
    for step in range(BARE_STEPS):
        idx = [(step * cfg.train.batch_size + rank * per_rank + i) % len(data) for i in range(per_rank)]
        x, y = (torch.stack(t) for t in zip(*(data[i] for i in idx), strict=True))
        loss = parts.loss_fn(parts.model, (x, y))
        loss.backward()
        if t.grad_clip > 0:  # the recipe's clipping on the global norm, as convoy's step does it
            norm = torch.nn.utils.clip_grad_norm_(parts.model.parameters(), t.grad_clip)
            float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        float(loss)  # the loss read each step, as any loop that logs it
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    if rank == 0:
        print(json.dumps({"gaps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}), flush=True)
    dist.destroy_process_group()


def row(size_gib: float, tmp: Path) -> dict[str, float]:
    print(f"state {size_gib} GiB over {RANKS} ranks: bare loop ...", flush=True)
    before = bare_figures(size_gib)
    r: dict[str, float] = {"size_gib": size_gib}
    r["copy"], r["share_bytes"] = shard_copy_s(size_gib)
    print(f"state {size_gib} GiB: convoy ...", flush=True)
    r.update(run_figures(size_gib, tmp))
    print(f"state {size_gib} GiB: bare loop again ...", flush=True)
    after = bare_figures(size_gib)
    r.update({k: (before[k] + after[k]) / 2 for k in before}, bare_spread=after["bare_median"] / before["bare_median"])
    print(f"state {size_gib} GiB: kill and resume ...", flush=True)
    r.update(kill_figures(size_gib, tmp))
    print(json.dumps(r), flush=True)
    return r


def table(rows: list[dict[str, float]]) -> str:
    head = (
        "| state (one rank's share) | save stall / shard copy | restore from disk / raw shard read "
        "| restore from disk / DCP's own restore | restore from tier / raw slot read | kill -> first step "
        "| step: convoy / bare (median) "
        "| step: convoy / bare (mean, saves included) |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['share_bytes'] * RANKS / 1e9:.2f} GB ({r['share_bytes'] / 1e9:.2f} GB) "
        f"| {r['stall']:.3f} / {r['copy']:.3f} s = **{r['stall'] / r['copy']:.2f}** (first {r['first_stall']:.3f} s) "
        f"| {r['disk_load']:.3f} / {r['shard_read']:.3f} s = **{r['disk_load'] / r['shard_read']:.2f}** "
        f"| {r['disk_load']:.3f} / {r['dcp_restore']:.3f} s = **{r['disk_load'] / r['dcp_restore']:.2f}** "
        f"(DCP's optimizer init {r['dcp_init']:.3f} s) "
        f"| {r['tier_load']:.3f} ({r['tier_tier']}) / {r['slot_read']:.3f} s "
        f"= **{r['tier_load'] / r['slot_read']:.2f}** "
        f"| {r['mttr']:.2f} s "
        f"| {r['step_median']:.3f} / {r['bare_median']:.3f} s = **{r['step_median'] / r['bare_median']:.3f}** "
        f"| {r['step_mean']:.3f} / {r['bare_mean']:.3f} s = **{r['step_mean'] / r['bare_mean']:.3f}** |"
        for r in rows
    ]
    return head + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.5,2,4", help="whole states in GiB (split over the ranks)")
    ap.add_argument("--tmp", type=Path, default=ROOT / ".bench-tmp")
    ap.add_argument("--bare", type=float, help=argparse.SUPPRESS)  # one rank of the bare loop
    ap.add_argument("--bare-restore", nargs=2, help=argparse.SUPPRESS)  # one rank of DCP's restore
    args = ap.parse_args()
    if args.bare is not None:
        bare_loop(args.bare)
        return
    if args.bare_restore is not None:
        bare_restore(float(args.bare_restore[0]), Path(args.bare_restore[1]))
        return
    tmp = args.tmp / "sharded"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        rows = [row(float(s), tmp) for s in args.sizes.split(",") if s]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(rows))


if __name__ == "__main__":
    main()
