"""Orchestration overhead: the Prefect flow with K chunks vs one bare worker for the same steps.

Both train the same run configuration from scratch: (a) ``python -m training.worker`` straight to
N steps, (b) ``convoy train`` with ``chunk_steps = N / K`` (Prefect API: ``$PREFECT_API_URL`` if
set, else the embedded ephemeral one, whose start-up is then part of the flow's wall time and
reported separately).  The overhead is split into what recurs with every chunk (boundary
checkpoint, task run bookkeeping, and without pipelining a new worker process per chunk:
imports, model build, verified restore) and the one-off cost of a flow run (process and Prefect
API start-up, wrap-up), which a long run amortises.  Goal: ≤ 3% at 60-second chunks.

    .venv/bin/python bench/orchestration.py --chunks 3 --chunk-steps 1700 --unpipelined
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
    ap.add_argument("--unpipelined", action="store_true", help="also run with orchestration.pipeline=false")
    args = ap.parse_args()
    total = args.chunks * args.chunk_steps
    root = Path(tempfile.mkdtemp(prefix="convoy-orch-"))
    common = MODEL + [
        f"runs_dir={root / 'runs'}",
        f"data.prepared_dir={root / 'data'}",
        f"train.total_steps={total}",
        f"train.chunk_steps={args.chunk_steps}",
    ]
    # The bare worker gets no chunk boundaries (chunk_steps = total): boundary saves count as overhead.
    cfg = load_config(None, [*common, "run_name=bare", f"train.chunk_steps={total}"])
    prepare(cfg.data, cfg.train.seed)
    run_dir = open_run(cfg)
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(total)],
        check=True,
        capture_output=True,
    )
    bare = time.time() - t0
    bare_events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    bare_startup = next(e["time"] for e in bare_events if e["kind"] == "started") - t0
    print(f"bare worker: {total} steps in {bare:.1f} s (start-up {bare_startup:.1f} s)", flush=True)
    (root / "none.yaml").write_text("{}\n")
    chunk_s = bare / args.chunks
    print(f"chunk length ≈ {chunk_s:.0f} s of training")
    variants = [("pipelined", "true")] + ([("restart per chunk", "false")] if args.unpipelined else [])
    for label, pipe in variants:
        name = f"flow-{pipe}"
        cmd = [sys.executable, "-m", "flows.cli", "train", str(root / "none.yaml")]
        for o in [*common, f"run_name={name}", f"orchestration.pipeline={pipe}"]:
            cmd += ["-S", o]
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True,
                           env={**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"})
        flow = time.time() - t0
        if p.returncode != 0:
            sys.exit(f"flow failed: {p.stderr[-2000:]}")
        summary = json.loads(p.stdout[p.stdout.index("{") :])
        events = [json.loads(line) for line in (root / "runs" / name / "events.jsonl").read_text().splitlines()]
        first = next(e["time"] for e in events if e["kind"] in ("started", "resumed"))
        done = next(e["time"] for e in events if e["kind"] == "worker_done")
        # One-off: process + Prefect API start until the first worker runs, flow wrap-up after the last
        # step.  Everything else beyond the bare worker's training time recurs with every chunk.
        one_off = (first - t0) + (t0 + flow - done)
        trained = done - first
        bare_trained = bare - bare_startup
        per_chunk = (trained - bare_trained) / args.chunks
        api = "PREFECT_API_URL" if os.environ.get("PREFECT_API_URL") else "ephemeral API (start-up included)"
        print(f"\nflow, {label} ({args.chunks} chunks of {args.chunk_steps}, {api}): {flow:.1f} s "
              f"(final step {summary['final_step']})")
        print(f"  overhead total vs bare worker: {flow / bare - 1:+.1%}")
        print(f"  recurring, per chunk: {per_chunk:.2f} s = {per_chunk / chunk_s:+.2%} of a {chunk_s:.0f} s chunk "
              f"(goal <= 3%)")
        print(f"  one-off (start-up + wrap-up): {one_off:.1f} s vs bare worker start-up {bare_startup:.1f} s "
              f"-> {one_off - bare_startup:+.1f} s per run")
        day = 86400
        print(f"  projected for a 24 h run of {chunk_s:.0f} s chunks: "
              f"{per_chunk / chunk_s + (one_off - bare_startup) / day:+.2%}")


if __name__ == "__main__":
    main()
