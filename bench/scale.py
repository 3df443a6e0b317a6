#!/usr/bin/env python
"""Costs by the size of the state: each of convoy's costs against a raw baseline measured in the
same run, at several state sizes, so how each grows with the state shows in one table.

Run from the repository root::

    .venv/bin/python bench/scale.py                      # states of 0.25, 1 and 4 GiB
    .venv/bin/python bench/scale.py --sizes 0.05,0.25    # quick

The state is a stack of fp32 ``nn.Linear`` layers and AdamW's two moments (12 bytes a parameter),
as ``tests/memory_tasks.py`` builds it.  Per size:

* **save stall**: what the worker's loop waits for at an asynchronous save with the defaults
  (the state copied into the memory tier's slot, the store's persist started from it; memory tier
  rule 8) against ``copy_`` of the same tensors into preallocated, reused buffers.
* **persist**: the store's background persist from the slot (slot hash, files written, hashed
  and fsynced, manifest, rename) against one raw ``write`` + ``fsync`` of the same bytes.
* **restore**: ``CheckpointStore.load`` by a store that verified nothing yet (read, xxh3-128
  verify, tensors; every tensor then summed, as a restore's copy reads it) against a raw
  ``readinto`` of the same files into a preallocated buffer (page cache warm).
* **peak host memory**: real worker processes training the state 24 steps with the defaults,
  against the same loop holding no copy (memory tier off, synchronous saves): peak ``Pss_Anon``
  plus the tier's pages in ``/dev/shm``, sampled every 20 ms; the difference in states.
* **resume**: a worker killed after step 12 and started again: its restore (``load_s`` of the
  ``resumed`` event: read, verify, ``load_state_dict``; from the memory tier where it holds a newer
  step than disk, else from disk) against the raw read of that size.

Figures of one run only mean something against each other: the ratios are the result.  The
largest state this machine's host memory would let convoy train (``training.memory_budget``) is
printed too.  Scratch files go to ``--tmp`` (default ``<repo>/.bench-tmp``), removed at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import checkpoint as ck  # noqa: E402  bench/checkpoint.py: the raw baselines and the state
import torch  # noqa: E402

from training.checkpointing.memory.memory_tier import MemoryTier  # noqa: E402
from training.checkpointing.store import CheckpointStore  # noqa: E402
from training.config import CheckpointConfig  # noqa: E402
from training.memory_budget import CONVOY_PROCESSES, GB, HostMemory  # noqa: E402

GIB = 1 << 30
STEPS = 24
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}


def io_figures(size_gib: float, tmp: Path, repeats: int) -> dict[str, float]:
    """Save stall, persist and restore at ``size_gib``, each beside its raw baseline."""
    model, opt, _ = ck.build_state(size_gib * GIB / 12)
    parts = ck.make_parts(model, opt, 1)
    src = ck.flat_tensors(parts)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    bufs = [torch.empty_like(t) for t in src]
    ck.copy_all(bufs, src)  # first touch outside the timing: reused buffers, as the store's
    run_dir = tmp / f"io-{size_gib}"
    store = CheckpointStore(run_dir, CheckpointConfig(keep_last=2), "bench")
    tier = MemoryTier(Path(tempfile.mkdtemp(dir="/dev/shm")), "bench", slots=1)
    out: dict[str, list[float]] = {k: [] for k in ("copy", "stall", "persist", "write", "load", "read")}
    raw = tmp / "raw.bin"
    view = memoryview(bytearray(nbytes + (1 << 20)))  # touched once here: the raw read reuses it
    for step in range(2, 2 + repeats + 1):  # the first round maps the slot: not counted
        out["copy"].append(ck.timed(ck.copy_all, bufs, src)[0])
        t0 = time.perf_counter()
        store.save(step, parts, staged=tier.stage(step, parts))
        stall = time.perf_counter() - t0
        t1 = time.perf_counter()
        store.wait()
        out["stall"].append(stall)
        out["persist"].append(time.perf_counter() - t1 + stall)  # the persist began in save()
        out["write"].append(ck.timed(ck.raw_write, raw, ck.raw_views(bufs))[0])
        path = run_dir / "checkpoints" / f"step-{step:09d}"
        fresh = CheckpointStore(run_dir, CheckpointConfig(keep_last=2), "bench")  # nothing verified yet
        out["load"].append(ck.timed(_restored, fresh, path)[0])
        out["read"].append(
            sum(ck.timed(ck.raw_readinto, f, view[: f.stat().st_size])[0] for f in path.glob("*.safetensors"))
        )
    tier.release_when_done(0, 1)
    shutil.rmtree(tier.root, ignore_errors=True)
    med = {k: statistics.median(v[1:]) for k, v in out.items()}
    return {"bytes": nbytes, **med}


def _restored(store: CheckpointStore, path: Path) -> None:
    """``load`` (read, verify) and every tensor's bytes touched, as a restore's copy touches them."""
    _checkpoint, parts = store.load(path)
    for t in ck.flat_tensors(parts):
        t.sum()


def _worker_peak(run_dir: Path, tier: Path | None, until: int, env: dict[str, str]) -> tuple[int, subprocess.Popen]:
    """Train ``run_dir`` in a worker to ``until``, sampled: (peak Pss_Anon + tier bytes, process)."""
    from engine_util import start_worker
    from test_one_copy import Sampler

    p = start_worker(run_dir, until, {**env, **FIXED_MALLOC})
    sampler = Sampler(p.pid, tier or Path("/nonexistent"))
    p.wait()
    rows = sampler.stop()
    return max((a + s for a, s in rows), default=0), p


def memory_and_resume(size_gib: float, tmp: Path) -> dict[str, float]:
    """Peak host memory of the defaults over the bare loop's, and a resume from the tier."""
    from engine_util import make_run

    from training import run_memory
    from training.events import Event, read_events

    width = 2048 if size_gib >= 0.5 else 1024
    layers = max(1, round(size_gib * GIB / 12 / (width * width + width)))
    base = [
        "task=tests.memory_tasks:build_linear_stack",
        f'task_args={{"width": {width}, "layers": {layers}}}',
        f"train.total_steps={STEPS}",
        f"train.chunk_steps={STEPS}",
        "train.warmup_steps=0",
        "checkpoint.every_steps=10",
        "checkpoint.memory_every_steps=3",
        "checkpoint.memory_beside=false",
    ]
    bare = make_run(
        tmp / f"bare-{size_gib}", extra=[*base, "checkpoint.memory_every_steps=null", "checkpoint.async_save=false"]
    )
    live, _ = _worker_peak(bare, None, STEPS, {})
    run = make_run(tmp / f"convoy-{size_gib}", extra=base)
    peak, _ = _worker_peak(run, run_memory.tier_root(run), STEPS, {})
    state = sum(f.stat().st_size for f in (run / "checkpoints").glob(f"step-{STEPS:09d}/*.safetensors"))
    # A kill after step 12 (the slot holds 12), then a new worker: its restore from the tier.
    killed = make_run(tmp / f"killed-{size_gib}", extra=base)
    from engine_util import start_worker, wait_for_step

    p = start_worker(killed, STEPS, {"CONVOY_FAULTS": "slow_step=13:30"})
    wait_for_step(killed, p, 13, timeout=1800)
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    t0 = time.perf_counter()
    p = start_worker(killed, 14, {})
    p.wait()
    restart = time.perf_counter() - t0
    resumed = read_events(killed, Event.RESUMED)[-1]
    return {
        "state": state,
        "bare_peak": live,
        "peak": peak,
        "load_s": resumed["load_s"],
        "tier": resumed["tier"],
        "restart_s": restart,
    }


def largest_state() -> float:
    """The largest state (bytes) the host-memory budget lets convoy train on this machine, CPU,
    one rank, the defaults: live (weights, gradients, moments: 4/3 of the state) + one copy."""
    host = HostMemory.of_machine(_defaults(), Path("/dev/shm"))
    budget = _defaults().checkpoint.host_memory_share * host.available - CONVOY_PROCESSES
    return budget / (4 / 3 + 1)


def _defaults():
    from training.config import load_config

    return load_config(None, [])


def table(rows: list[dict[str, float]]) -> str:
    head = (
        "| state | save stall / copy | persist / raw write+fsync | restore (load) / raw read | "
        "peak over bare loop | resume load / raw read |\n|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        lines.append(
            f"| {r['bytes'] / GB:.2f} GB | {r['stall']:.3f} s / {r['copy']:.3f} s = **{r['stall'] / r['copy']:.2f}** "
            f"| {r['persist']:.2f} s / {r['write']:.2f} s = **{r['persist'] / r['write']:.2f}** "
            f"| {r['load']:.3f} s / {r['read']:.3f} s = **{r['load'] / r['read']:.2f}** "
            f"| +{(r['peak'] - r['bare_peak']) / GB:.2f} GB = "
            f"**+{(r['peak'] - r['bare_peak']) / r['state']:.2f}x** the state "
            f"| {r['load_s']:.3f} s ({r['tier']}) / {r['read']:.3f} s = **{r['load_s'] / r['read']:.2f}** |"
        )
    return head + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.25,1,4", help="states in GiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the I/O figures (median)")
    ap.add_argument("--tmp", default=str(ROOT / ".bench-tmp"), help="scratch dir on the same disk as the repo")
    ap.add_argument("--json", help="write the raw figures here")
    args = ap.parse_args()
    tmp = Path(args.tmp) / "scale"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CONVOY_MEMORY_DIR", tempfile.mkdtemp(prefix="convoy-scale-", dir="/dev/shm"))
    rows = []
    try:
        for size in (float(s) for s in args.sizes.split(",")):
            print(f"state {size} GiB: I/O ...", flush=True)
            row = io_figures(size, tmp, args.repeats)
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # the I/O state's pages back before the workers run
            print(f"state {size} GiB: workers ...", flush=True)
            row.update(memory_and_resume(size, tmp))
            rows.append(row)
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(os.environ["CONVOY_MEMORY_DIR"], ignore_errors=True)
    print(table(rows))
    print(f"largest state the budget lets convoy train here (CPU, one rank, defaults): {largest_state() / GB:.1f} GB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
