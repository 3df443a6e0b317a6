"""What a memory-tier snapshot after every step costs the loop, in one process, on one model.

    .venv/bin/python bench/snapshot_cost.py [--blocks 40] [--block 25] [--threads 1] [-S k=v ...]

Why a bench of its own: ``bench/loop_overhead.py``'s memory pair runs a new worker per block for
each side, so each side trains its own allocation of the model; on this VM two allocations of the
same model step a few % apart (up to ±3 ms of a ~33 ms step between processes), as much as the
snapshot costs.  Here one runtime (the demo's model, optimizer, data and memory tier as
``params.yaml`` builds them) trains on; blocks of ``--block`` steps alternate between three sides:

* ``off``   — the training step alone;
* ``plan``  — the step, then a snapshot through the tier's plan (what a worker does);
* ``walk``  — the step, then a snapshot by the full walk of model and optimizer (a tier without
  plans, what every snapshot did before ``training/checkpointing/snapshot_plan.py``);
* ``beside`` — the worker's tier: the plan's snapshot takes what the next step's forward may
  change (buffers, RNG states, the rest of the walk) and returns; the copy of parameters and
  optimizer state and the hash run on the tier's writer thread during the next step's fetch,
  forward and backward, and the ``settle`` before its optimizer step commits (memory tier rule
  7).  Its stall is what the snapshot took on the loop's thread plus that settle's wait.

Printed per side: the step's median (the batch's fetch and the step, less a settle's wait: a copy
beside them may slow them) and how far it is from ``off``'s (a snapshot slows the next step too:
its copy and hash push the model's working set out of the caches), the snapshot's median stall
and its share of ``off``'s step, and both together: the verdict (goal <= 3 % at a snapshot every
step, issue 30 item 3).  ``--sides off,plan,off,beside`` measures the baseline twice as often.
The tier's beside copy is used here whatever the CPUs (the worker uses it only with a CPU its
torch threads leave free).  A figure, not an assertion.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIDES = ("off", "plan", "walk", "beside")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=40, help="blocks in all (a multiple of 4 keeps the sides even)")
    ap.add_argument("--block", type=int, default=25, help="steps per block")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--sides", type=lambda v: v.split(","), default=list(SIDES), help="of " + ",".join(SIDES))
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[])
    return ap.parse_args()


def setup(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """The demo's runtime (as a worker builds it), its config, and a planning and a walking tier."""
    root = Path(tempfile.mkdtemp(prefix="convoy-snapshot-cost-"))
    os.environ.setdefault("CONVOY_MEMORY_DIR", str(root / "shm"))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from training.checkpointing.memory_tier import MemoryTier, tier_root
    from training.config import load_config
    from training.corpus import prepare
    from training.rundir import open_run
    from training.runtime import build_runtime
    from training.state import configure_determinism

    params = Path(__file__).resolve().parents[1] / "params.yaml"
    cfg = load_config(
        params, [f"runs_dir={root}/runs", f"data.prepared_dir={root}/data", "tracking.mlflow=false", *args.overrides]
    )
    prepare(cfg.data, cfg.train.seed)
    device = torch.device("cpu")
    configure_determinism(cfg.train.deterministic, device)
    run_dir = open_run(cfg)
    runtime = build_runtime(cfg, device, 0, 1, run_dir=run_dir)
    where = tier_root(run_dir)
    assert where is not None
    tiers = {
        "plan": MemoryTier(where / "plan", "bench"),
        "walk": MemoryTier(where / "walk", "bench", plans=False),
        "beside": MemoryTier(where / "beside", "bench", overlap=True),
    }
    return runtime, cfg, tiers


def main() -> None:
    args = parse_args()
    runtime, cfg, tiers = setup(args)
    from training.checkpointing.schedule import MemorySchedule
    from training.data import Cursor, LoaderSpec, make_loader
    from training.step import train_step

    state, schedule = runtime.state, MemorySchedule("auto", 0.03)

    def batches():  # the run's data, epoch after epoch
        while True:
            yield from make_loader(state.parts.train_data, LoaderSpec(cfg.train.batch_size, cfg.train.seed, Cursor()))

    source = batches()
    for _ in range(10):  # warm-up: the first Adam step imports dynamo; the first snapshots map the slots
        train_step(runtime, [next(source)])
        state.step += 1
        for tier in tiers.values():
            tier.snapshot(state, schedule)
            tier.settle()
    sides = args.sides
    steps: dict[str, list[float]] = {s: [] for s in sides}
    stalls: dict[str, list[float]] = {s: [] for s in sides}
    print(f"{args.blocks} blocks of {args.block} steps, sides {', '.join(sides)} in turn", flush=True)
    for block in range(args.blocks):
        side = sides[block % len(sides)]
        tier = tiers.get(side)
        waited = [0.0]

        def settle(tier: Any = tier, waited: list[float] = waited) -> None:
            waited[0] = tier.settle() if tier is not None else 0.0

        for i in range(args.block):
            t0 = time.perf_counter()
            train_step(runtime, [next(source)], before_update=settle)  # as the worker calls it
            state.step += 1
            t1 = time.perf_counter()
            if tier is not None:
                tier.snapshot(state, schedule)
            t2 = time.perf_counter()
            if i >= 3:  # the first steps after a switch carry the previous side's caches
                stalls[side][-1] += waited[0]  # the previous snapshot's wait for its commit
            if i >= 2:
                steps[side].append(t1 - t0 - waited[0])
                stalls[side].append(t2 - t1)
        if tier is not None:
            stalls[side][-1] += tier.settle()
    report(steps, stalls)
    print(f"plan in use at the end: {tiers['plan']._plan is not None}")


def report(steps: dict[str, list[float]], stalls: dict[str, list[float]]) -> None:
    base = statistics.median(steps["off"])
    print(f"{'side':6} {'step ms':>9} {'step vs off':>12} {'snapshot ms':>12} {'snapshot/step':>14} {'slowdown':>9}")
    for side in steps:
        step, stall = statistics.median(steps[side]), statistics.median(stalls[side])
        print(
            f"{side:6} {step * 1e3:9.2f} {step / base - 1:+12.1%} {stall * 1e3:12.3f} {stall / base:14.1%} "
            f"{(step + stall) / base - 1:+9.1%}"
        )
    for side in [s for s in ("plan", "beside") if s in steps]:
        share = statistics.median(stalls[side]) / base
        slowdown = (statistics.median(steps[side]) + statistics.median(stalls[side])) / base - 1
        verdict = "met" if slowdown <= 0.03 else "over"
        print(
            f"VERDICT snapshot every step ({side}): the loop {slowdown:+.1%} (stall {share:.1%} of the step, "
            f"the step itself {statistics.median(steps[side]) / base - 1:+.1%}; goal <= 3 %): {verdict}"
        )


if __name__ == "__main__":
    main()
