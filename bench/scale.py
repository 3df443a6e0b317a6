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
* **T_fetch**: the state fetched from a local-directory DVC remote by another repository (read
  the index, copy, verify, install; bench/remote_fetch.py's measurement) against a raw copy of
  the same object files.
* **resume**: a worker killed after step 12 and started again: its restore (``load_s`` of the
  ``resumed`` event: read, verify, ``load_state_dict``; from the memory tier where it holds a newer
  step than disk, else from disk) against the raw read of that size, and the time from the kill to
  the new worker's first step (a new process: interpreter, imports, task, restore, one step; a
  flow's zygote forks instead, and detection adds a fixed ~0.1-0.3 s: bench/mttr.py).
* **2 ranks** (``--rank-sizes``): the peak over the bare loop, every rank's process summed, for
  the replicated and the sharded format, beside what the budget projects for the copies.

``--largest`` adds a row at the largest state the budget lets convoy train here (workers only).

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
#: From this state size on, glibc's own thresholds: with the fixed 1 MiB threshold every
#: temporary of AdamW's per-parameter update is a fresh mapping faulted in and unmapped each step,
#: and a 4 GiB state stepped in 20-30 s instead of ~2 s; what the fixed thresholds hide (50-90 MB
#: of freed temporaries kept in the heap) is under 2 % of such a state.
BIG_GIB = 2.0


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


def _linear_stack(size_gib: float) -> list[str]:
    """The run's settings: a linear stack of ``size_gib`` of state, 24 steps, one chunk."""
    width = 2048 if size_gib >= 0.5 else 1024
    layers = max(1, round(size_gib * GIB / 12 / (width * width + width)))
    return [
        "task=tests.memory_tasks:build_linear_stack",
        f'task_args={{"width": {width}, "layers": {layers}}}',
        f"train.total_steps={STEPS}",
        f"train.chunk_steps={STEPS}",
        "train.warmup_steps=0",
        "checkpoint.every_steps=10",
        "checkpoint.memory_every_steps=3",
        "checkpoint.memory_beside=false",
    ]


def _start(run_dir: Path, until: int, env: dict[str, str], ranks: int) -> subprocess.Popen:
    """A worker (one rank) or torchrun's ranks training ``run_dir`` to ``until``."""
    from engine_util import start_worker, worker_cmd

    if ranks == 1:
        return start_worker(run_dir, until, env)
    cmd = worker_cmd(run_dir, until)
    cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "training.worker"]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
        start_new_session=True,
    )


def _worker_peak(run_dir: Path, tier: Path | None, ranks: int, size_gib: float) -> int:
    """Train ``run_dir`` to the end, sampled: peak Pss_Anon of every process + the tier's bytes."""
    from test_one_copy import Sampler

    p = _start(run_dir, STEPS, FIXED_MALLOC if size_gib < BIG_GIB else {}, ranks)
    sampler = Sampler(p.pid, tier or Path("/nonexistent"), tree=ranks > 1)
    out, _ = p.communicate()
    rows = sampler.stop()
    if p.returncode != 0:
        raise RuntimeError(f"worker of {run_dir} failed:\n{out[-3000:]}")
    return max((a + s for a, s in rows), default=0)


def memory_figures(size_gib: float, tmp: Path, ranks: int = 1, fmt: str = "replicated") -> dict[str, float]:
    """Peak host memory of the defaults over the same loop holding no copy, and the budget's
    projection of that difference (``training.memory_budget.project``)."""
    from engine_util import make_run

    from training import run_memory
    from training.memory_budget import StateSize, project
    from training.rundir import load_run_config

    base = [*_linear_stack(size_gib), f"train.ranks={ranks}", f"checkpoint.format={fmt}"]
    tag = f"{size_gib}-{ranks}-{fmt}"
    bare = make_run(
        tmp / f"bare-{tag}", extra=[*base, "checkpoint.memory_every_steps=null", "checkpoint.async_save=false"]
    )
    live = _worker_peak(bare, None, ranks, size_gib)
    run = make_run(tmp / f"convoy-{tag}", extra=base)
    peak = _worker_peak(run, run_memory.tier_root(run), ranks, size_gib)
    state = sum(f.stat().st_size for f in (run / "checkpoints").glob(f"step-{STEPS:09d}/**/*.safetensors"))
    projected = project(load_run_config(run), StateSize(int(state), 0, 0), on_cpu=True)  # the copies only
    return {"state": state, "bare_peak": live, "peak": peak, "projected_copies": projected.tier + projected.staging}


def resume_figures(size_gib: float, tmp: Path) -> dict[str, float]:
    """A worker killed in step 14 (the memory tier's slot holds 12) and a new one started at once: its restore
    (the ``resumed`` event's ``load_s``; from the tier where it is newer than disk) and the time
    from the kill to its first step done (a new process: interpreter, imports, task, restore)."""
    from engine_util import make_run, wait_for_step

    from training import run_memory
    from training.events import Event, read_events

    # No disk save before the kill: a save persisting from the one slot holds it (memory tier rule
    # 8), so at a small state (fast steps) the snapshot of 12 could be skipped for the save of 10.
    killed = make_run(tmp / f"killed-{size_gib}", extra=[*_linear_stack(size_gib), "checkpoint.every_steps=20"])
    # Step 14 stalls: the heartbeat says 13 while it does, the snapshot of 12 was taken by then.
    p = _start(killed, STEPS, {"CONVOY_FAULTS": "slow_step=14:600"}, 1)
    wait_for_step(killed, p, 13, timeout=1800)
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGKILL)
    t_kill = time.time()
    p.wait()
    p = _start(killed, 15, {}, 1)
    p.wait()
    # The killed run never reaches its end, so its tier stays in /dev/shm: freed here, or the next
    # row trains beside it (the largest state was OOM-killed beside the 4 GiB row's left-over tier).
    run_memory.remove(killed)
    resumed = read_events(killed, Event.RESUMED)[-1]
    first = read_events(killed, Event.FIRST_STEP)[-1]
    return {"load_s": resumed["load_s"], "tier": resumed["tier"], "mttr_s": first["time"] - t_kill}


def fetch_figures(size_gib: float, tmp: Path, repeats: int) -> dict[str, float]:
    """T_fetch of the state from a local-directory DVC remote against a raw copy of its objects
    (bench/remote_fetch.py's measurement at this size)."""
    import remote_fetch

    out = remote_fetch.fetch_bench(tmp / f"fetch-{size_gib}", size_gib * GIB / 12, repeats)
    shutil.rmtree(tmp / f"fetch-{size_gib}", ignore_errors=True)
    return {"fetch": statistics.median(out["fetch_s"]), "raw_copy": statistics.median(out["copy_s"])}


def largest_state() -> float:
    """The largest state (bytes) the host-memory budget lets convoy train on this machine, CPU,
    one rank, the defaults: live (weights, gradients, moments: 4/3 of the state) + one copy."""
    host = HostMemory.of_machine(_defaults(), Path("/dev/shm"))
    budget = _defaults().checkpoint.host_memory_share * host.available - CONVOY_PROCESSES
    return budget / (4 / 3 + 1)


def _defaults():
    from training.config import load_config

    return load_config(None, [])


def _ratio(r: dict[str, float], num: str, den: str, fmt: str = ".3f") -> str:
    """``num s / den s = **ratio**``, or "-" where the row did not measure them."""
    if num not in r or den not in r:
        return "-"
    return f"{r[num]:{fmt}} s / {r[den]:{fmt}} s = **{r[num] / r[den]:.2f}**"


def table(rows: list[dict[str, float]]) -> str:
    """One row a state size, one rank: every cost beside its baseline."""
    head = (
        "| state | save stall / copy | persist / raw write+fsync | restore (load) / raw read | T_fetch / raw copy "
        "| peak over bare loop | resume load / raw read | kill -> first step (new process) |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        over = r["peak"] - r["bare_peak"]
        resume = f"{r['load_s']:.3f} s ({r['tier']})" + (
            f" / {r['read']:.3f} s = **{r['load_s'] / r['read']:.2f}**" if "read" in r else ""
        )
        lines.append(
            f"| {r['state'] / GB:.2f} GB | {_ratio(r, 'stall', 'copy')} | {_ratio(r, 'persist', 'write', '.2f')} "
            f"| {_ratio(r, 'load', 'read')} | {_ratio(r, 'fetch', 'raw_copy', '.2f')} "
            f"| +{over / GB:.2f} GB = **+{over / r['state']:.2f}x** the state | {resume} | {r['mttr_s']:.2f} s |"
        )
    return head + "\n".join(lines)


def ranks_table(rows: list[dict[str, float]]) -> str:
    """One row a multi-rank run: measured copies over the bare loop against the budget's projection."""
    head = (
        "| state | ranks | format | bare loop peak | convoy peak | over bare | projected copies |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['state'] / GB:.2f} GB | {r['ranks']} | {r['format']} "
        f"| {r['bare_peak'] / GB:.2f} GB | {r['peak'] / GB:.2f} GB "
        f"| +{(r['peak'] - r['bare_peak']) / GB:.2f} GB = **+{(r['peak'] - r['bare_peak']) / r['state']:.2f}x** "
        f"| {r['projected_copies'] / GB:.2f} GB = {r['projected_copies'] / r['state']:.2f}x |"
        for r in rows
    ]
    return head + "\n".join(lines)


def size_row(size: float, tmp: Path, repeats: int, io: bool) -> dict[str, float]:
    """Every figure at one size; ``io`` False (the largest state): only the workers', since the
    bench's own baselines would hold three more copies of the state."""
    row: dict[str, float] = {}
    if io:
        print(f"state {size:.2f} GiB: I/O ...", flush=True)
        row.update(io_figures(size, tmp, repeats))
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # the I/O state's pages back before the workers run
        print(f"state {size:.2f} GiB: T_fetch ...", flush=True)
        row.update(fetch_figures(size, tmp, repeats))
    print(f"state {size:.2f} GiB: workers ...", flush=True)
    row.update(memory_figures(size, tmp))
    row.update(resume_figures(size, tmp))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.25,1,4", help="states in GiB, comma-separated")
    ap.add_argument("--largest", action="store_true", help="add the largest state the budget allows (workers only)")
    ap.add_argument("--rank-sizes", default="0.25,1", help="states in GiB of the 2-rank rows ('' for none)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the I/O figures (median)")
    ap.add_argument("--tmp", default=str(ROOT / ".bench-tmp"), help="scratch dir on the same disk as the repo")
    ap.add_argument("--json", help="write the raw figures here")
    args = ap.parse_args()
    tmp = Path(args.tmp) / "scale"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CONVOY_MEMORY_DIR", tempfile.mkdtemp(prefix="convoy-scale-", dir="/dev/shm"))
    rows, ranked = [], []
    try:
        for size in (float(s) for s in args.sizes.split(",") if s):
            rows.append(size_row(size, tmp, args.repeats, True))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        if args.largest:  # measured now: what the rows before left in memory is gone
            largest = largest_state() / GIB
            print(f"largest state the budget lets convoy train here (CPU, one rank): {largest * GIB / GB:.1f} GB")
            rows.append(size_row(largest * 0.97, tmp, args.repeats, False))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        for size in (float(s) for s in args.rank_sizes.split(",") if s):
            for fmt in ("replicated", "sharded"):
                print(f"state {size} GiB, 2 ranks, {fmt}: workers ...", flush=True)
                ranked.append({"ranks": 2, "format": fmt, **memory_figures(size, tmp, 2, fmt)})
                print(ranks_table(ranked[-1:]).splitlines()[-1], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(os.environ["CONVOY_MEMORY_DIR"], ignore_errors=True)
    print(table(rows))
    print(ranks_table(ranked))
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes": rows, "ranks": ranked}, indent=1, default=str))


if __name__ == "__main__":
    main()
