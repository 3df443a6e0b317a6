#!/usr/bin/env python
"""Peak host memory of FSDP2 over 2 CPU ranks, convoy's defaults against the bare loop, and
whether the memory watch (training/loop/memory_watch.py, rule 5) gave the copies up.

Run from the repository root::

    .venv/bin/python bench/fsdp_memory.py --sizes 1,4

Per size (``tests/memory_tasks.py``'s linear stack, as bench/sharded.py): the bare FSDP2 loop
(``bench/sharded.py --bare``: no checkpoint) and ``torchrun ... training.worker`` with the
defaults (the memory tier every 3 steps, asynchronous saves every 10, staged in the tier's slot),
each sampled every 20 ms: ``Pss_Anon`` of every process of the run summed, plus the tier's pages in
``/dev/shm``.  Prints the peaks, their difference against the state, the ``host_memory_short``
events (the step and what the worker read), the exit code, and the machine's memory.  Why: the
start-up budget projects a rank's share, not the CPU allocator's retained FSDP2 buffers (2.7 GiB
a rank for a 0.67 GiB share), and the 4 GiB row of bench/sharded.py was OOM-killed before rule 5.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import scale  # bench/scale.py (puts the repository and tests/ on the path)
import sharded  # bench/sharded.py: the settings and the bare loop

GB = 1e9


def bare_peak(size_gib: float) -> int:
    """The bare FSDP2 loop's peak (every rank's ``Pss_Anon``, summed)."""
    from test_one_copy import Sampler

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={sharded.RANKS}"]
    p = subprocess.Popen(
        [*cmd, str(Path(sharded.__file__)), "--bare", str(size_gib)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    sampler = Sampler(p.pid, Path("/nonexistent"), tree=True)
    p.wait()
    rows = sampler.stop()
    if p.returncode != 0:
        raise RuntimeError(f"the bare loop failed: exit {p.returncode}")
    return max(a + s for a, s in rows)


def convoy_peak(size_gib: float, tmp: Path) -> dict[str, Any]:
    """convoy's ranks with the defaults: peak, exit code, the watch's events."""
    from engine_util import make_run
    from test_one_copy import Sampler

    from training import run_memory
    from training.events import read_events

    run = make_run(tmp / f"convoy-{size_gib}", extra=sharded.settings(size_gib))
    tier = run_memory.tier_root(run)
    p = scale._start(run, scale.STEPS, {}, sharded.RANKS)
    sampler = Sampler(p.pid, tier or Path("/nonexistent"), tree=True)
    out, _ = p.communicate()
    rows = sampler.stop()
    run_memory.remove(run)
    short = read_events(run, "host_memory_short")
    said = [line for line in out.splitlines() if "host memory while training" in line]
    return {
        "peak": max(a + s for a, s in rows),
        "exit": p.returncode,
        "short": short,
        "said": said[:1],
        "tail": out[-1500:] if p.returncode else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4", help="GiB of state, comma-separated")
    args = ap.parse_args()
    from training.memory_budget import mem_available

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"machine: {total / GB:.1f} GB, MemAvailable {mem_available() / GB:.1f} GB", flush=True)
    (scale.ROOT / ".bench-tmp").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scale.ROOT / ".bench-tmp") as tmp:
        for size in (float(s) for s in args.sizes.split(",")):
            state = size * (1 << 30)
            bare = bare_peak(size)
            print(f"{size} GiB: bare loop peak {bare / GB:.2f} GB", flush=True)
            got = convoy_peak(size, Path(tmp))
            over = (got["peak"] - bare) / state
            print(
                f"{size} GiB: convoy peak {got['peak'] / GB:.2f} GB (exit {got['exit']}), "
                f"over the bare loop {over:+.2f}x the state; watch: {got['said'] or 'nothing given up'}",
                flush=True,
            )
            print(json.dumps({"size_gib": size, "bare_peak": bare, **got}, default=str), flush=True)


if __name__ == "__main__":
    main()
