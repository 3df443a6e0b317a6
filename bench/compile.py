"""A compiled model's cold start against its replacement's warm start (issue 44, item 1).

For the example char GPT (``params.yaml``'s model, ``train.compile: model``), one worker per
phase, each a real ``python -m training.worker`` process on a fresh run directory:

* **eager**: the uncompiled model's first step (the baseline of a step);
* **cold**: the compiled model's first step in a run with no compile cache (it compiles: dynamo,
  AOTAutograd, inductor's C++ build);
* **warm**: the run's worker killed (SIGKILL, its process group) a few steps later and a new one
  started: its first step after the restore, with the cache the first worker published
  (``runs/<run>/compile-cache``, :mod:`training.compiling`).

The first step's time is its ``step_time_s`` in ``metrics.jsonl`` (the step alone, restore and
start-up excluded); each phase's process time to that step (start -> first step) is shown beside it.
Goal: warm first step <= 10 % of the cold one.

    .venv/bin/python bench/compile.py [--repeats 2] [-S task_args.n_layer=2 ...]
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.config import load_config  # noqa: E402
from training.datapipe.corpus import prepare  # noqa: E402
from training.rundir import open_run  # noqa: E402

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
STEPS = 12


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def worker(run_dir: Path, until: int, stop_at: int | None = None) -> tuple[float, float]:
    """Run a worker (killed once its journal shows ``stop_at``); returns (its first step's
    ``step_time_s``, seconds from its start to that step's row)."""
    before = len(rows(run_dir))
    cmd = [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(until)]
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first: tuple[float, float] | None = None
    try:
        while p.poll() is None or first is None:
            mine = rows(run_dir)[before:]
            if mine and first is None:
                first = (mine[0]["metrics"]["step_time_s"], mine[0]["time_ms"] / 1000 - t0)
            if stop_at is not None and mine and mine[-1]["step"] >= stop_at:
                break
            if p.poll() is not None and first is None:
                raise RuntimeError(f"worker exited {p.returncode} before its first step")
            time.sleep(0.01)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert first is not None
    return first


def one_repeat(tmp: Path, settings: list[str], k: int) -> dict[str, float]:
    base = [f"runs_dir={tmp / 'runs'}", f"data.prepared_dir={tmp / 'data'}", f"train.total_steps={STEPS}"]
    base += [f"train.chunk_steps={STEPS}", "checkpoint.every_steps=2", "tracking.mlflow=false", *settings]
    eager = open_run(load_config(PARAMS, [*base, f"run_name=eager-{k}"]))
    compiled = open_run(load_config(PARAMS, [*base, f"run_name=compiled-{k}", "train.compile=model"]))
    out: dict[str, float] = {}
    out["eager"], out["eager_start"] = worker(eager, 3, stop_at=3)
    out["cold"], out["cold_start"] = worker(compiled, STEPS, stop_at=5)
    out["warm"], out["warm_start"] = worker(compiled, STEPS)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-S", dest="settings", action="append", default=[], help="extra section.key=value")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="convoy-compile-"))
    try:
        prepare(load_config(PARAMS, [f"data.prepared_dir={tmp / 'data'}"]).data, 1234)
        results = []
        for k in range(args.repeats):
            r = one_repeat(tmp, args.settings, k)
            print(json.dumps({key: round(v, 3) for key, v in r.items()}), flush=True)
            results.append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {key: statistics.median(r[key] for r in results) for key in results[0]}
    print(f"\nmedian of {len(results)} (seconds): first step / worker start -> first step")
    for name in ("eager", "cold", "warm"):
        print(f"  {name:5s} {med[name]:8.3f} / {med[name + '_start']:8.3f}")
    ratio = med["warm"] / med["cold"]
    print(f"warm / cold first step = {ratio:.3f} (goal <= 0.10: {'met' if ratio <= 0.10 else 'NOT met'})")


if __name__ == "__main__":
    main()
