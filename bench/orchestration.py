"""Orchestration overhead: the Prefect flow with K chunks vs one bare worker for the same steps.

Both train the same run configuration from scratch: (a) ``python -m training.worker`` straight to
N steps, (b) ``convoy train`` with ``chunk_steps = N / K`` (Prefect API: ``$PREFECT_API_URL`` if
set, else the embedded ephemeral one, whose start-up is then part of the flow's wall time and
reported separately).  The overhead is split into the per-chunk cost (a new worker process per
chunk: imports, model build, verified restore) and the flow's own cost (API, task runs, lock,
artifacts).  Goal: ≤ 3% at 60-second chunks.

    .venv/bin/python bench/orchestration.py --chunks 3 --chunk-steps 1500
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training.config import load_config
from training.corpus import prepare
from training.rundir import open_run

MODEL = [
    "data.synthetic_chars=200000",
    "tracking.mlflow=false",
    "checkpoint.every_steps=250",
    "heartbeat.interval_s=0.5",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--chunk-steps", type=int, default=1500)
    args = ap.parse_args()
    total = args.chunks * args.chunk_steps
    root = Path(tempfile.mkdtemp(prefix="convoy-orch-"))
    common = MODEL + [
        f"runs_dir={root / 'runs'}",
        f"data.prepared_dir={root / 'data'}",
        f"train.total_steps={total}",
        f"train.chunk_steps={args.chunk_steps}",
    ]
    cfg = load_config(None, [*common, "run_name=bare"])
    prepare(cfg.data, cfg.train.seed)
    run_dir = open_run(cfg)
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(total)],
        check=True,
        capture_output=True,
    )
    bare = time.time() - t0
    print(f"bare worker: {total} steps in {bare:.1f} s", flush=True)
    cmd = [sys.executable, "-m", "flows.cli", "train", str(root / "none.yaml")]
    (root / "none.yaml").write_text("{}\n")
    for o in [*common, "run_name=flow"]:
        cmd += ["-S", o]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"})
    flow = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"flow failed: {p.stderr[-2000:]}")
    summary = json.loads(p.stdout[p.stdout.index("{") :])
    in_chunks = sum(c["seconds"] for c in summary["chunks"])
    api = "PREFECT_API_URL" if os.environ.get("PREFECT_API_URL") else "ephemeral API (start-up included)"
    print(
        f"flow ({args.chunks} chunks of {args.chunk_steps}, {api}): {flow:.1f} s; inside chunk tasks {in_chunks:.1f} s"
    )
    print(f"chunk length ≈ {bare / args.chunks:.0f} s of training")
    print(f"overhead total: {flow / bare - 1:+.1%}  (goal <= +3%)")
    print(
        f"  per-chunk worker restarts: {(in_chunks - bare) / bare:+.1%} "
        f"({(in_chunks - bare) / args.chunks:.1f} s/chunk)"
    )
    print(f"  flow/API outside chunks:   {(flow - in_chunks) / bare:+.1%} ({flow - in_chunks:.1f} s)")


if __name__ == "__main__":
    main()
