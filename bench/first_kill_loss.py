"""Steps a run's first kill -9 loses, on the demo as shipped (``params.yaml``: memory tier ``auto``).

For each of ``--runs`` fresh runs: a worker trains, is SIGKILLed (with its process group) after a
random step between ``--after`` and ``--before``, and the loss is the last step its journal shows
minus the step the next worker would resume from (:func:`training.checkpointing.memory.run_memory.resume_step`:
the memory snapshot when it is newer than the newest verified disk checkpoint).  A first kill is
the worst case of ``auto``: before any failure the run's MTBF is ``checkpoint.mtbf_hours`` and
the memory tier snapshots as rarely as ``memory_min_overhead`` allows.

    .venv/bin/python bench/first_kill_loss.py --runs 8 [-S checkpoint.memory_every_steps=1 -S checkpoint.memory_slots=2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training import run_memory  # noqa: E402
from training.checkpointing.store import CheckpointStore  # noqa: E402
from training.config import load_config  # noqa: E402
from training.datapipe.corpus import prepare  # noqa: E402
from training.rundir import open_run  # noqa: E402

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"


def last_row_step(journal: Path) -> int:
    """The step of the journal's last complete row (0 before the first)."""
    rows = [line for line in journal.read_text().splitlines() if line.endswith("}")] if journal.exists() else []
    return json.loads(rows[-1])["step"] if rows else 0


def one_kill(run_dir: Path, target: int) -> tuple[int, int]:
    """Train until the journal shows ``target``, SIGKILL; returns (last step shown, resume step)."""
    cmd = [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(target + 100)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    journal = run_dir / "metrics.jsonl"
    try:
        while last_row_step(journal) < target and p.poll() is None:
            time.sleep(0.005)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    disk = CheckpointStore(run_dir).latest_valid(record=False)
    resume = run_memory.resume_step(run_dir, disk.step if disk else 0) or 0
    return last_row_step(journal), resume


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--after", type=int, default=80)
    ap.add_argument("--before", type=int, default=150)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], help="a params override")
    args = ap.parse_args()
    root, rng, lost = Path(tempfile.mkdtemp(prefix="convoy-first-kill-")), random.Random(args.seed), []
    for i in range(args.runs):
        where = [f"runs_dir={root / 'runs'}", f"data.prepared_dir={root / 'data'}", f"run_name=kill{i}"]
        cfg = load_config(PARAMS, [*where, "tracking.mlflow=false", *args.overrides])
        prepare(cfg.data, cfg.train.seed)
        run_dir = open_run(cfg)
        last, resume = one_kill(run_dir, rng.randint(args.after, args.before))
        lost.append(last - resume)
        print(f"run {i}: killed after step {last}, resumes at {resume}: {last - resume} step(s) lost", flush=True)
        run_memory.remove(run_dir)
    shutil.rmtree(root, ignore_errors=True)
    print(f"steps lost per first kill: mean {statistics.mean(lost):.1f}, max {max(lost)} ({args.runs} runs)")


if __name__ == "__main__":
    main()
