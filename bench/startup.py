"""Start-up: ``convoy train`` of a small run vs a bare loop, and the answer for a finished run.

The bare loop imports torch, builds the same task (``training.task.build_task``) and trains the
same steps with a DataLoader; ``convoy train`` trains a fresh run of those settings with MLflow off
and Prefect's temporary API (no ``$PREFECT_API_URL``: what a user's first command gets); then
``convoy train`` again on the finished run.  Alternated, median of ``--repeats``.  Where the
seconds of ``convoy train`` go is read from the run's own events: to ``flow_started`` (the CLI,
the config's check, Prefect's temporary API and the flow engine), to the chunk's first step (the
worker's start: imports, build, restore), the steps, and the wrap-up after ``worker_done``.

    .venv/bin/python bench/startup.py --steps 20 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BARE = """
import sys, time, torch
from torch.utils.data import DataLoader
from training.config import load_config
from training.task import build_task
cfg = load_config(sys.argv[1], [])
torch.manual_seed(cfg.train.seed)
parts = build_task(cfg, torch.device("cpu"))
loader = iter(DataLoader(parts.train_data, batch_size=cfg.train.batch_size, shuffle=True))
for _ in range(cfg.train.total_steps):
    parts.optimizer.zero_grad()
    parts.loss_fn(parts.model, next(loader)).backward()
    parts.optimizer.step()
"""


def params(work: Path, name: str, steps: int) -> Path:
    path = work / f"{name}.yaml"
    path.write_text(
        json.dumps(
            {
                "run_name": name,
                "runs_dir": str(work / "runs"),
                "data": {"prepared_dir": str(work / "data")},
                "train": {"total_steps": steps, "chunk_steps": steps, "batch_size": 16},
                "tracking": {"mlflow": False},
            }
        )
    )
    return path


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds of ``cmd`` and when it started (epoch)."""
    t0, start = time.perf_counter(), time.time()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0, start


def phases(run_dir: Path, started: float, wall: float) -> dict[str, float]:
    """Where ``convoy train``'s seconds went, from the run's events."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    at = {e["kind"]: e["time"] for e in reversed(events)}  # the first of each kind
    return {
        "to flow_started (CLI, check, Prefect API, flow engine)": at["flow_started"] - started,
        "to the first step (chunk task, worker start)": at["first_step"] - at["flow_started"],
        "steps": at["worker_done"] - at["first_step"],
        "wrap-up (after worker_done)": started + wall - at["worker_done"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PYTHONPATH"] = str(REPO)
    convoy = [sys.executable, "-m", "flows.cli.main"]
    with tempfile.TemporaryDirectory(prefix="convoy-startup-") as tmp:
        work = Path(tmp)
        subprocess.run([*convoy, "prepare", str(params(work, "prep", args.steps))], cwd=REPO, env=env, check=True)
        bare, train, again, split = [], [], [], []
        for i in range(args.repeats):
            bare.append(timed([sys.executable, "-c", BARE, str(params(work, "bare", args.steps))], env)[0])
            p = params(work, f"run{i}", args.steps)
            wall, started = timed([*convoy, "train", str(p)], env)
            train.append(wall)
            split.append(phases(work / "runs" / f"run{i}", started, wall))
            again.append(timed([*convoy, "train", str(p)], env)[0])
    med = statistics.median
    print(f"{args.steps} steps, median of {args.repeats} (alternated):")
    print(f"  bare loop (import torch, build the task, train): {med(bare):.2f} s")
    print(f"  convoy train (fresh run, temporary Prefect API):  {med(train):.2f} s  ({med(train) - med(bare):+.2f} s)")
    print(f"  convoy train of the finished run:                {med(again):.2f} s")
    print("  where convoy train's seconds go (median):")
    for key in split[0]:
        print(f"    {key}: {med(s[key] for s in split):.2f} s")


if __name__ == "__main__":
    main()
