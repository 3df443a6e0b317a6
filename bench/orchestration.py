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
from typing import Any

from training.config import load_config
from training.datapipe.corpus import prepare
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
    bare = run_bare_worker(common, total)
    (root / "none.yaml").write_text("{}\n")
    chunk_s = bare["steps"] / args.chunks
    print(f"chunk length ≈ {chunk_s:.0f} s of training steps")
    variants = [("pipelined", "true")] + ([("restart per chunk", "false")] if args.unpipelined else [])
    for label, pipe in variants:
        flow, summary, flow_cpu = run_flow(root, common, f"flow-{pipe}", pipe)
        api = "PREFECT_API_URL" if os.environ.get("PREFECT_API_URL") else "ephemeral API (start-up included)"
        print(
            f"\nflow, {label} ({args.chunks} chunks of {args.chunk_steps}, {api}): {flow['wall']:.1f} s, "
            f"steps {flow['steps']:.1f} s (final step {summary['final_step']})"
        )
        print_overhead(flow, bare, args.chunks, flow_cpu)


def run_bare_worker(common: list[str], total: int) -> dict[str, float]:
    """``python -m training.worker`` straight to ``total`` steps: the baseline's :func:`breakdown`.
    It gets no chunk boundaries (chunk_steps = total): boundary saves count as overhead."""
    cfg = load_config(None, [*common, "run_name=bare", f"train.chunk_steps={total}"])
    prepare(cfg.data, cfg.train.seed)
    run_dir = open_run(cfg)
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(total)],
        check=True,
        capture_output=True,
    )
    bare = breakdown(run_dir, t0, time.time())
    print(
        f"bare worker: {total} steps in {bare['wall']:.1f} s (steps {bare['steps']:.1f} s, start-up "
        f"{bare['one_off']:.1f} s)",
        flush=True,
    )
    return bare


def run_flow(root: Path, common: list[str], name: str, pipe: str) -> tuple[dict[str, float], dict[str, Any], float]:
    """``convoy train`` of run ``name`` (``orchestration.pipeline={pipe}``): its :func:`breakdown`,
    its JSON summary and the CPU seconds of the flow process."""
    cmd = [sys.executable, "-m", "flows.cli.main", "train", str(root / "none.yaml"), "--json"]  # the summary to parse
    for o in [*common, f"run_name={name}", f"orchestration.pipeline={pipe}"]:
        cmd += ["-S", o]
    t0 = time.time()
    # CPU of the flow process itself: Prefect, its embedded API, the supervisor (not the worker).
    rc, out, err, flow_cpu = run_sampled(cmd, {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"})
    if rc != 0:
        sys.exit(f"flow failed: {err[-2000:]}")
    flow = breakdown(root / "runs" / name, t0, time.time())
    return flow, json.loads(out[out.index("{") :]), flow_cpu


def print_overhead(flow: dict[str, float], bare: dict[str, float], chunks: int, flow_cpu: float) -> None:
    """The flow's overhead against the bare worker: whole run, per chunk, once per flow run."""
    chunk_s = bare["steps"] / chunks
    # Step time is the work; everything else is overhead.  Compared with the bare worker's:
    # inside the worker span (first step .. last step) the extra is what recurs per chunk
    # (boundary checkpoints, task hand-over, worker restarts); outside it, process + Prefect
    # API start-up and the flow's wrap-up happen once per flow run.
    per_chunk = (flow["inside"] - bare["inside"]) / chunks
    one_off = flow["one_off"] - bare["one_off"]
    total_overhead = (flow["wall"] - flow["steps"]) - (bare["wall"] - bare["steps"])
    print(
        f"  overhead vs bare worker, whole run: {total_overhead:+.1f} s = "
        f"{total_overhead / bare['steps']:+.2%} of the training time"
    )
    print(
        f"  recurring, per chunk: {per_chunk:+.2f} s = {per_chunk / chunk_s:+.2%} of a {chunk_s:.0f} s chunk "
        "(goal <= 3%)"
    )
    print(f"  one-off per flow run (start-up + wrap-up beyond the bare worker's): {one_off:+.1f} s")
    print(f"  projected for a 24 h run of {chunk_s:.0f} s chunks: {per_chunk / chunk_s + one_off / 86400:+.2%}")
    print(
        f"  step time vs bare worker: {flow['steps'] / bare['steps'] - 1:+.2%}; the flow process used "
        f"{flow_cpu:.1f} CPU s ({flow_cpu / flow['wall']:.1%} of one core) beside the worker"
    )


def run_sampled(cmd: list[str], env: dict[str, str]) -> tuple[int, str, str, float]:
    """Run ``cmd``; return its exit code, output, errors and the CPU seconds (user + system) of
    that process itself, sampled until it exits.  Reader threads keep its pipes drained."""
    import threading

    import psutil

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    box: dict[str, str] = {}
    readers = [
        threading.Thread(target=lambda k=k, f=f: box.__setitem__(k, f.read()), daemon=True)
        for k, f in (("out", p.stdout), ("err", p.stderr))
    ]
    for t in readers:
        t.start()
    proc, cpu = psutil.Process(p.pid), 0.0
    while p.poll() is None:
        try:
            times = proc.cpu_times()
            cpu = times.user + times.system
        except psutil.Error:
            break
        time.sleep(0.5)
    for t in readers:
        t.join()
    return p.wait(), box.get("out", ""), box.get("err", ""), cpu


def breakdown(run_dir: Path, t_start: float, t_end: float) -> dict[str, float]:
    """Wall time, time in training steps (Σ ``step_time_s``), non-step time between the first
    worker's start of training and the last step's worker exit (``inside``), and outside it."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    first = next(e["time"] for e in events if e["kind"] in ("started", "resumed"))
    done = [e["time"] for e in events if e["kind"] == "worker_done"][-1]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sum(r["metrics"]["step_time_s"] for r in rows)
    return {
        "wall": t_end - t_start,
        "steps": steps,
        "inside": (done - first) - steps,
        "one_off": (first - t_start) + (t_end - done),
    }


if __name__ == "__main__":
    main()
