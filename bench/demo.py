"""The demo's learning and wall time: params.yaml against the previous demo config, same run.

    python bench/demo.py [--repeats 2] [--threads 1]

Trains ``make demo``'s config (params.yaml: 600 steps) and the config it replaced (dropout 0.1,
lr 0.003, batch 16, the rest equal) with one ``python -m training.worker`` each, tracking off,
alternately (machine-load drifts hit both sides alike), both on the synthetic corpus of this
code: a step costs the same whatever characters the corpus holds, so the wall-time ratio is the
configs' own.  Prints per run the wall time (worker start to exit) and the final and last-50
mean loss against the corpus's entropy floor, then the medians and the ratio new / previous
(goal: <= 1.0, "same or shorter wall time") and the gap to the floor (goal: <= 0.25 nats).
Both sides run with the same torch thread count (``--threads``; on a shared 2-core machine two
threads per process oversubscribe the cores).  A figure, not an assertion.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: What the demo trained with before it was changed to learn (task_args and train overrides).
PREVIOUS = ["task_args.dropout=0.1", "train.lr=0.003", "train.batch_size=16"]


def train_once(tmp: Path, name: str, overrides: list[str], threads: int) -> dict[str, float]:
    """One worker from step 0 to the end on params.yaml with ``overrides``: wall time and losses."""
    from training.config import load_config
    from training.datapipe.corpus import entropy_floor, prepare
    from training.rundir import open_run
    from training.tracking.metrics import metric_rows

    cfg = load_config(
        ROOT / "params.yaml",
        [f"runs_dir={tmp / 'runs'}", f"data.prepared_dir={tmp / 'data'}", f"run_name={name}", "tracking.mlflow=false"]
        + overrides,
    )
    prepare(cfg.data, cfg.train.seed)
    run_dir = open_run(cfg)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # the worker pins torch to it
    until = str(cfg.train.total_steps)
    cmd = [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", until]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: worker exited {proc.returncode}: {proc.stdout[-2000:]}")
    losses = [m["loss"] for _, m in metric_rows(run_dir)]
    floor = entropy_floor(cfg.data) or float("nan")
    return {"wall_s": wall, "final": losses[-1], "last50": statistics.mean(losses[-50:]), "floor": floor}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {"demo": [], "previous": []}
    with tempfile.TemporaryDirectory(prefix="convoy-demo-bench-") as tmp:
        for i in range(args.repeats):
            for side, overrides in (("previous", PREVIOUS), ("demo", [])):
                r = train_once(Path(tmp), f"{side}-{i}", overrides, args.threads)
                results[side].append(r)
                print(
                    f"{side:>8} #{i}: wall {r['wall_s']:6.1f} s  final loss {r['final']:.4f}  last-50 mean "
                    f"{r['last50']:.4f}  floor {r['floor']:.4f}  gap {r['final'] - r['floor']:+.4f}",
                    flush=True,
                )
    med = {side: statistics.median(r["wall_s"] for r in rs) for side, rs in results.items()}
    ratio = med["demo"] / med["previous"]
    gap = max(r["final"] - r["floor"] for r in results["demo"])
    print(f"\nmedian wall: demo {med['demo']:.1f} s, previous {med['previous']:.1f} s, ratio {ratio:.2f} (goal <= 1.0)")
    print(f"demo final loss above the floor: at most {gap:+.4f} nats (goal <= 0.25)")


if __name__ == "__main__":
    main()
