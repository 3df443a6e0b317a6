"""Goodput under periodic kills: ``checkpoint.every_steps: auto`` vs fixed intervals.

For each interval policy, a real worker trains the example task for ``--minutes`` of wall time
and is SIGKILLed every ``--kill-every`` seconds, then restarted (this script plays the
supervisor and records each kill as a ``failure`` event, which is what ``auto`` reads its MTBF
from; nothing is configured ahead, as in a user's run).  Goodput = committed steps × median
fault-free step time / wall time.  The policies: ``auto``; fixed at 10× and 0.1× the interval
auto settled on; and a sweep of fixed intervals to find the best one (by default 0.5× and 2×
auto's choice besides 0.1× and 10×).
Ratios are printed against the best fixed interval of the same run.  Each policy's run is also
measured by ``training/tracking/goodput.py`` (the script writes the events a flow would:
``flow_started``, ``attempt_started`` before each worker, a ``failure`` with its time and resume
step per kill): each kept step's own time over the wall-clock, and the badput by bucket.

    .venv/bin/python bench/goodput.py --minutes 10 --kill-every 60
    .venv/bin/python bench/goodput.py --minutes 3 --kill-every 60 --only-auto   # the breakdown only
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tasks.supervision.worker_zygote import WorkerZygote
from training import run_memory
from training.checkpointing.store import CheckpointStore
from training.config import load_config
from training.datapipe.corpus import prepare
from training.events import append_event, read_events
from training.rundir import open_run
from training.tracking.goodput import Goodput, run_goodput

MODEL = [
    "task_args.d_model=128",
    "task_args.n_layer=2",
    "task_args.n_head=4",
    "data.seq_len=64",
    "train.batch_size=16",
    "data.synthetic_chars=400000",
    "tracking.mlflow=false",
    "checkpoint.keep_last=2",
    "train.total_steps=1000000",
    "train.chunk_steps=1000000",
]


def run_policy(root: Path, name: str, every: str, minutes: float, kill_every: float, fork: bool = True) -> dict:
    """One policy's run; ``fork``: every worker forked by a zygote, as a flow does (else a new
    interpreter per worker, the way before issue 30)."""
    cfg = load_config(
        None,
        MODEL
        + [
            f"runs_dir={root / 'runs'}",
            f"data.prepared_dir={root / 'data'}",
            f"run_name={name}",
            f"checkpoint.every_steps={every}",
            # No MTBF prior: each tier's auto learns the kill rate from the failures, as a
            # user's run does (with the memory tier on, the disk tier keeps the default 24 h,
            # the machine's: a killed worker resumes from RAM).
        ],
    )
    prepare(cfg.data, cfg.train.seed)
    run_dir = open_run(cfg)
    t0 = time.time()
    zygote = WorkerZygote(run_dir) if fork else None
    try:
        train_with_kills(run_dir, zygote, t0 + minutes * 60, kill_every)
    finally:
        if zygote is not None:
            zygote.close()
    return policy_result(run_dir, name, every, time.time() - t0)


def train_with_kills(run_dir: Path, zygote: WorkerZygote | None, end: float, kill_every: float) -> None:
    """Workers one after the other until ``end``, each SIGKILLed ``kill_every`` s after its start;
    the events a flow would write (the script plays the flow: goodput's clock)."""
    cmd = [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", "1000000"]
    append_event(run_dir, "flow_started", flow_run_id=None)
    attempt = 0
    while time.time() < end:
        attempt += 1
        append_event(run_dir, "attempt_started", chunk=1, attempt=attempt)  # a worker's start-up begins
        p = start_worker(zygote, cmd, run_dir / "logs" / f"worker-{attempt}.log")
        try:
            p.wait(timeout=min(kill_every, end - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            killed_at = time.time()
            p.wait()
            resumes = CheckpointStore(run_dir).latest_valid(record=False)
            append_event(
                run_dir,
                "failure",
                failure="killed",
                chunk=1,
                attempt=attempt,
                detected_at=round(killed_at, 3),
                detected_after_s=0,
                last_committed_step=run_memory.resume_step(run_dir, resumes.step if resumes else 0),
            )


def policy_result(run_dir: Path, name: str, every: str, wall: float) -> dict:
    newest = CheckpointStore(run_dir).latest_valid(record=False)
    committed = newest.step if newest else 0
    mpath = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in mpath.read_text().splitlines()] if mpath.exists() else []
    step_s = statistics.median(r["metrics"]["step_time_s"] for r in rows) if rows else float("nan")
    picks = read_events(run_dir, "interval_chosen")
    interval = picks[-1]["interval_steps"] if picks else every
    measured = run_goodput(run_dir)
    return {
        "policy": name,
        "every": every,
        "interval_steps": interval,
        "committed_steps": committed,
        "wall_s": round(wall, 1),
        "median_step_s": step_s,
        "goodput": committed * step_s / wall,
        # training/tracking/goodput.py: each kept step's own time over the wall-clock, and the rest by bucket
        "measured": measured.as_dict() if measured else None,
    }


def start_worker(zygote: WorkerZygote | None, cmd: list[str], log: Path) -> Any:
    """A worker forked by ``zygote`` (a ``ForkedProcess``), else a new process."""
    handle = zygote.fork(cmd, log, "bench", cwd=os.getcwd(), env=dict(os.environ)) if zygote else None
    if handle is not None:
        return handle.proc
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--kill-every", type=float, default=60)
    ap.add_argument("--sweep", default="", help="extra fixed intervals in steps, e.g. 5,20,80,320")
    ap.add_argument("--sweep-factors", default="0.5,2", help="extra fixed intervals as multiples of auto's choice")
    ap.add_argument("--only-auto", action="store_true", help="measure the auto policy only (no fixed intervals)")
    ap.add_argument("--spawn", action="store_true", help="a new interpreter per worker (before the zygote)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="convoy-goodput-", dir=Path(__file__).resolve().parent.parent))
    print(f"workspace {root}; {args.minutes} min per policy, kill every {args.kill_every} s", flush=True)
    results = [run_policy(root, "auto", "auto", args.minutes, args.kill_every, not args.spawn)]
    auto = int(results[0]["interval_steps"])
    print(json.dumps(results[-1]), flush=True)
    factors = [0.1, 10, *(float(x) for x in args.sweep_factors.split(",") if x)]
    fixed = sorted({max(1, round(auto * f)) for f in factors} | {int(x) for x in args.sweep.split(",") if x})
    fixed = [] if args.only_auto else fixed
    for n in fixed:
        results.append(run_policy(root, f"fixed-{n}", str(n), args.minutes, args.kill_every, not args.spawn))
        print(json.dumps(results[-1]), flush=True)
    fixed_runs = [r for r in results if r["policy"] != "auto"] or results
    best = max(fixed_runs, key=lambda r: r["goodput"])
    print(f"\n{'policy':>12} {'interval':>9} {'committed':>10} {'goodput':>8} {'vs best fixed':>14} {'measured':>9}")
    for r in results:
        m = Goodput.from_dict(r["measured"]) if r["measured"] else None
        print(
            f"{r['policy']:>12} {r['interval_steps']!s:>9} {r['committed_steps']:>10} {r['goodput']:>8.3f} "
            f"{r['goodput'] / best['goodput']:>13.3f}x {m.describe(n=4) if m else '-':>9}"
        )
    print(f"\nauto / best fixed ({best['policy']}) = {results[0]['goodput'] / best['goodput']:.3f} (goal >= 0.98)")


if __name__ == "__main__":
    main()
