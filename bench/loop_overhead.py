"""Step time of convoy's training loop vs a bare PyTorch loop of the same model, same process.

    python bench/loop_overhead.py [--steps 200] [--block 25] [--eval-every 10] [--threads 1] [-S k=v ...]

Two pairs, in interleaved blocks (machine-load drifts hit both sides alike):

* ``no eval``   — the real :class:`training.worker.Worker` (heartbeat thread, metrics.jsonl every
  step, cursor, preemption and save checks, fault hooks, batch tree map, accumulation loop) with
  no checkpoint inside the block (``checkpoint.every_steps: null``; the block's closing save is
  outside the timed steps), MLflow off (``bench/logging_overhead.py`` measures it), against a
  hand-written loop over the same model, data order and update;
* ``eval``      — both with validation every ``--eval-every`` steps over the same
  ``train.eval_samples`` samples: convoy's in-loop eval (phase change, RNG saved and restored,
  model.eval()/no_grad) against a bare ``no_grad`` loop over the same batches.

Each convoy block is one ``Worker.run`` resuming the previous block's checkpoint; its step times
are the gaps between successive steps as the loop reports them to the heartbeat (everything the
loop does per step), the first two after the restore left out.  Printed: mean and median step
time per side and the ratio convoy / bare (goal <= 1.03 without saves), then ``step only``:
``Worker.train_step`` against the bare step alternated one by one (the sharpest of the three
when the machine is loaded).  A figure, not an assertion.
Both sides run with the same torch thread count (``--threads``, 1 by default: on a shared 2-core
machine two threads per process oversubscribe the cores and step times swing by tens of %).
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


def bare_setup(cfg: Any) -> tuple[Any, Any, Any]:
    """The same model, optimizer, scheduler and data order as the worker builds, without convoy."""
    import torch

    from training.data import Cursor, LoaderSpec, make_loader
    from training.state import configure_determinism, seed_everything
    from training.task import build_task

    device = torch.device("cpu")
    configure_determinism(cfg.train.deterministic, device)
    seed_everything(cfg.train.seed)
    parts = build_task(cfg, device)
    batches = iter(make_loader(parts.train_data, LoaderSpec(cfg.train.batch_size, cfg.train.seed, Cursor())))
    return parts, batches, device


def bare_steps(cfg: Any, parts: Any, batches: Any, n: int, start: int, eval_every: int) -> list[float]:
    """``n`` plain steps (zero_grad, forward, backward, clip, step, schedule, loss to float);
    with ``eval_every``, a no_grad pass over the validation samples at those steps."""
    import torch

    out, t_prev = [], time.perf_counter()
    for step in range(start + 1, start + n + 1):
        x = next(batches)
        parts.model.train()
        parts.optimizer.zero_grad(set_to_none=True)
        loss = parts.loss_fn(parts.model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parts.model.parameters(), cfg.train.grad_clip)
        parts.optimizer.step()
        parts.scheduler.step()
        float(loss.detach())
        if eval_every and step % eval_every == 0:
            parts.model.eval()
            n_val = min(cfg.train.eval_samples, len(parts.val_data))
            total = 0.0
            with torch.no_grad():
                for lo in range(0, n_val, cfg.train.batch_size):
                    idx = range(lo, min(lo + cfg.train.batch_size, n_val))
                    batch = torch.utils.data.default_collate([parts.val_data[i] for i in idx])
                    total += float(parts.loss_fn(parts.model, batch)) * len(idx)
        now = time.perf_counter()
        out.append(now - t_prev)
        t_prev = now
    return out


def convoy_steps(run_dir: Path, until: int) -> list[float]:
    """One worker block to ``until``: the gaps between the steps it reports, restore excluded."""
    from training.worker import Worker

    worker = Worker(run_dir, until)
    stamps: list[float] = []
    original = worker.hb.set

    def set_and_stamp(phase: str | None = None, step: int | None = None) -> None:
        if step is not None and phase is None:  # the loop's per-step report
            stamps.append(time.perf_counter())
        original(phase=phase, step=step)

    worker.hb.set = set_and_stamp  # type: ignore[method-assign]
    code = worker.run()
    if worker.lease is not None:
        worker.lease.release()
    assert code == 0, f"worker block to {until} exited {code}"
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return gaps[1:]  # the first gap still carries the restore's warm-up


def alternating_steps(cfg: Any, run_dir: Path, n: int) -> tuple[list[float], list[float]]:
    """Single steps of ``Worker.train_step`` and of the bare step on identical models, alternated
    one by one (who goes first flips each round), so load drifts cancel: the per-step work
    convoy adds to the update itself (tree map, autocast/scaler no-ops, accumulation loop, LRs)."""
    from training.data import LoaderSpec, make_loader
    from training.worker import Worker

    worker = Worker(run_dir, cfg.train.total_steps)
    worker.setup()
    worker.restore()
    convoy_batches = iter(
        make_loader(worker.parts.train_data, LoaderSpec(cfg.train.batch_size, cfg.train.seed, worker.state.cursor))
    )
    parts, batches, _ = bare_setup(cfg)
    sides = {
        "bare": lambda: bare_steps(cfg, parts, batches, 1, 0, 0),
        "convoy": lambda: worker.train_step([next(convoy_batches)]),
    }
    times: dict[str, list[float]] = {"bare": [], "convoy": []}
    for _ in range(5):
        for run in sides.values():
            run()
    for i in range(n):
        for name in ("bare", "convoy") if i % 2 else ("convoy", "bare"):
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
    worker.hb.stop()
    if worker.lease is not None:
        worker.lease.release()
    return times["bare"], times["convoy"]


def summary(times: list[float]) -> tuple[float, float]:
    return statistics.fmean(times), statistics.median(times)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="timed steps per side and variant")
    ap.add_argument("--block", type=int, default=25, help="steps per interleaved block")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both sides (0 = torch's default); on a small shared "
        "machine more than one thread per process makes step times swing by tens of %%",
    )
    ap.add_argument("--memory-every", default="auto", help="the memory tier's interval for its pair (steps or auto)")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[])
    return ap.parse_args()


def measure_blocks(args: argparse.Namespace, base: list[str], blocks: int) -> dict[str, dict[str, list[float]]]:
    """Per variant (no eval, eval): bare and convoy step times over ``blocks`` interleaved blocks."""
    from training.config import load_config
    from training.corpus import prepare
    from training.rundir import open_run

    variants = {"no eval": 0, "eval": args.eval_every}
    results: dict[str, dict[str, list[float]]] = {}
    for name, every in variants.items():
        cfg = load_config(None, [*base, f"run_name=loop-{every}", f"train.eval_every={every}"])
        prepare(cfg.data, cfg.train.seed)
        run_dir = open_run(cfg)
        parts, batches, _ = bare_setup(cfg)
        bare_steps(cfg, parts, batches, 5, 0, 0)  # warm-up: the first Adam step imports dynamo
        bare: list[float] = []
        convoy: list[float] = []
        for b in range(blocks):
            bare += bare_steps(cfg, parts, batches, args.block, b * args.block, every)[2:]
            convoy += convoy_steps(run_dir, (b + 1) * args.block)
        results[name] = {"bare": bare, "convoy": convoy}
    return results


def measure_memory_tier(args: argparse.Namespace, base: list[str], blocks: int) -> dict[str, list[float]]:
    """convoy's loop with the memory tier (``--memory-every``, ``auto`` by default) against the
    same loop without it, in interleaved blocks: what the snapshots cost the loop (goal <= 3 %)."""
    from training.config import load_config
    from training.corpus import prepare
    from training.rundir import open_run

    runs = {}
    for side, every in (("off", "null"), ("on", args.memory_every)):
        cfg = load_config(None, [*base, f"run_name=memory-{side}", f"checkpoint.memory_every_steps={every}"])
        prepare(cfg.data, cfg.train.seed)
        runs[side] = open_run(cfg)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for b in range(blocks):
        for side in ("off", "on") if b % 2 else ("on", "off"):
            times[side] += convoy_steps(runs[side], (b + 1) * args.block)
    return times


def print_row(name: str, bare: list[float], convoy: list[float], note: str = "") -> None:
    (bm, bmed), (cm, cmed) = summary(bare), summary(convoy)
    print(
        f"{name:8} {bm * 1e3:13.2f} {cm * 1e3:15.2f} {cm / bm:13.3f} {bmed * 1e3:15.2f} {cmed * 1e3:17.2f} "
        f"{cmed / bmed:15.3f}{note}"
    )


def main() -> int:
    args = parse_args()

    import torch

    from training.config import load_config
    from training.rundir import open_run

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="convoy-bench-loop-"))
    blocks = -(-args.steps // args.block)
    total = blocks * args.block
    base = [
        f"runs_dir={tmp / 'runs'}",
        f"data.prepared_dir={tmp / 'data'}",
        f"train.total_steps={total}",
        f"train.chunk_steps={total}",
        "checkpoint.every_steps=null",
        "checkpoint.memory_every_steps=null",
        "tracking.mlflow=false",
        "checkpoint.async_save=false",
        *args.overrides,
    ]
    results = measure_blocks(args, base, blocks)

    cfg = load_config(None, base)
    print(
        f"convoy loop overhead — {args.steps} steps per side, blocks of {args.block}, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}; example task d_model {cfg.task_args.get('d_model', 64)}, "
        f"batch {cfg.train.batch_size}, seq {cfg.data.seq_len}; eval every {args.eval_every} steps over "
        f"{cfg.train.eval_samples} samples"
    )
    print(
        f"{'variant':8} {'bare mean ms':>13} {'convoy mean ms':>15} {'ratio (mean)':>13} "
        f"{'bare median ms':>15} {'convoy median ms':>17} {'ratio (median)':>15}"
    )
    for name, r in results.items():
        print_row(name, r["bare"], r["convoy"])
    cfg = load_config(None, [*base, "run_name=alternating"])
    bare, convoy = alternating_steps(cfg, open_run(cfg), args.steps)
    print_row("step only", bare, convoy, "   (train_step vs bare step, alternated one by one)")
    ratio = statistics.fmean(results["no eval"]["convoy"]) / statistics.fmean(results["no eval"]["bare"])
    print(
        f"VERDICT loop overhead without saves: {100 * (ratio - 1):+.1f} % (goal <= 3 %): "
        f"{'ok' if ratio <= 1.03 else 'over'}"
    )
    memory = measure_memory_tier(args, base, blocks)
    print_row("memory", memory["off"], memory["on"], f"   (tier every {args.memory_every} vs off; columns: off, on)")
    ratio = statistics.median(memory["on"]) / statistics.median(memory["off"])
    print(
        f"VERDICT memory tier slowdown: {100 * (ratio - 1):+.1f} % (median; goal <= 3 %): "
        f"{'ok' if ratio <= 1.03 else 'over'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
