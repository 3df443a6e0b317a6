"""Slurm's time limit on a real one-node cluster, with Slurm's own defaults: from the warning
signal to the requeued job's first training step, and the steps lost.

Baseline, measured in the same run on the same cluster: a batch job that does nothing but
``scontrol requeue`` itself on the same signal and write a timestamp when it starts again (what
any requeue costs on this Slurm: its hold of ``cred_expire`` + 1 s, 121 s by default, plus the
scheduler's pass).  Then ``convoy slurm script --submit`` of a small run whose chunk 2 waits at
step 25 for the signal (``hold_flag``); the figures are read from the run's own events.

    .venv/bin/python bench/slurm_requeue.py            # ~6 min (two requeues at Slurm's 121 s hold)
    .venv/bin/python bench/slurm_requeue.py --cred-expire 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.slurm_cluster import SlurmCluster, installed_or_reason  # noqa: E402
from training.events import read_events  # noqa: E402

BASELINE = """#!/bin/bash
#SBATCH --time=2
#SBATCH --signal=B:USR1@20
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={out}
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then echo "started $(date +%s.%N)"; exit 0; fi
trap 'echo "signal $(date +%s.%N)"; scontrol requeue $SLURM_JOB_ID; sleep 60' USR1
sleep 300 & wait
"""


def wait_until(ready, timeout: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.5)


def baseline(cluster: SlurmCluster, tmp: Path) -> float:
    """Seconds from the signal to the restarted job's first line, for a job that does nothing."""
    out = tmp / "baseline.out"
    script = tmp / "baseline.sh"
    script.write_text(BASELINE.format(out=out))
    job = cluster.run("sbatch", "--parsable", str(script)).strip()
    wait_until(lambda: out.exists() and "started" in out.read_text(), 600)
    words = [line.split() for line in out.read_text().splitlines()]
    times = {w[0]: w[1] for w in words if len(w) == 2 and w[0] in ("signal", "started")}
    wait_until(lambda: cluster.job_state(job) == "GONE", 60)
    return float(times["started"]) - float(times["signal"])


def convoy_run(cluster: SlurmCluster, tmp: Path) -> dict[str, float]:
    """A run held at step 25 until Slurm's warning; its events give the figures."""
    hold = tmp / "hold"
    hold.touch()
    p = {
        "run_name": "slurm-bench",
        "runs_dir": str(tmp / "runs"),
        "task_args": {"n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"prepared_dir": str(tmp / "data"), "synthetic_chars": 20000, "seq_len": 32},
        "train": {"total_steps": 60, "chunk_steps": 20, "batch_size": 8},
        "checkpoint": {"every_steps": 10},
        "heartbeat": {"stall_s": 120},
        "tracking": {"mlflow": False},
    }
    pfile = tmp / "params.yaml"
    pfile.write_text(yaml.safe_dump(p))
    convoy = [sys.executable, "-m", "flows.cli.main"]
    subprocess.run([*convoy, "prepare", str(pfile)], cwd=REPO, check=True, capture_output=True)
    env = {**cluster.env, "CONVOY_FAULTS": f"step_delay=0.2,hold_flag={hold}:25"}
    cmd = [*convoy, "slurm", "script", str(pfile), "--time=2", "--signal-lead=20", "--submit"]
    job = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout.split()[-1]
    run_dir = tmp / "runs" / "slurm-bench"
    wait_until(lambda: read_events(run_dir, "slurm_requeued"), 300)
    hold.unlink()
    wait_until(lambda: cluster.job_state(job) == "GONE", 600)
    requeued = read_events(run_dir, "slurm_requeued")[0]
    first = next(e for e in read_events(run_dir, "first_step") if e["time"] > requeued["time"])
    saves = read_events(run_dir, "checkpoint_saved")
    trained = max(e["step"] for e in saves if e["time"] <= requeued["warned_at"])
    return {
        "stop_s": requeued["stop_s"],
        "signal_to_first_step_s": first["time"] - requeued["warned_at"],
        "saved_step": requeued["saved_step"],
        "steps_lost": first["step"] - 1 - requeued["saved_step"] if first["step"] > requeued["saved_step"] else 0,
        "newest_periodic_checkpoint": trained,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cred-expire", type=int, default=120, help="Slurm's AuthInfo cred_expire (its default: 120)")
    args = ap.parse_args()
    if reason := installed_or_reason():
        sys.exit(reason)
    with tempfile.TemporaryDirectory(prefix="convoy-slurm-bench-") as d:
        tmp = Path(d)
        cluster = SlurmCluster(tmp / "slurm", cred_expire_s=args.cred_expire)
        try:
            cluster.start()
            base = baseline(cluster, tmp)
            got = convoy_run(cluster, tmp)
        finally:
            cluster.stop()
    print(f"slurm requeue (cred_expire {args.cred_expire} s): a bare job back {base:.1f} s after the signal")
    print(
        f"convoy: stopped with step {got['saved_step']} saved in {got['stop_s']:.1f} s; first step of the requeued "
        f"job {got['signal_to_first_step_s']:.1f} s after the signal ({got['signal_to_first_step_s'] / base:.2f}x the "
        f"bare job's return, +{got['signal_to_first_step_s'] - base:.1f} s); steps lost {got['steps_lost']} (the "
        f"newest periodic checkpoint was step {got['newest_periodic_checkpoint']})"
    )
    print(json.dumps({"cred_expire_s": args.cred_expire, "bare_requeue_s": round(base, 2), **got}))


if __name__ == "__main__":
    main()
