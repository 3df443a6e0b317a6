"""Failure detection latency and the MTTR split, measured with the real supervisor and worker.

For each failure kind a real worker is supervised by ``tasks.supervision.supervisor.supervise`` and a real
signal is sent once the heartbeat reports a step: SIGKILL (crash), SIGSTOP with the stall limit
below the beat timeout (hang), SIGSTOP with the beat timeout below the stall limit (dead).
Latency = the failure event's detection time − the moment the signal was sent, printed beside the
configured limit.  Then the worker is restarted and the seeds' MTTR split is measured:
T_detect (above), T_rebuild (process start → restore begins: imports, model and optimizer
build), T_load (verified load of the newest checkpoint, from the worker's ``resumed`` event) and
T_verify (hashing that checkpoint alone, measured here).

    .venv/bin/python bench/detection.py [--repeats 3] [--ranks 1|2] [--nnodes 1|2]

``--nnodes 2`` runs two torchrun agents in one rendezvous on this machine (hosts ``127.0.0.1`` and
``localhost``, :mod:`tasks.supervision.multinode`); the signal goes to the last rank, on the last node.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tasks.supervision.attempt import AttemptSpec
from tasks.supervision.supervisor import ChunkFailed, supervise, worker_command
from tasks.supervision.worker_liveness import DetectionLimits
from training.checkpointing.store import CheckpointStore
from training.config import load_config
from training.datapipe.corpus import prepare
from training.events import read_events
from training.heartbeat import read_heartbeat
from training.rundir import open_run
from training.tracking.attempts import AttemptId

SMALL = [
    "train.total_steps=400",
    "train.chunk_steps=400",
    "train.batch_size=8",
    "data.synthetic_chars=60000",
    "data.seq_len=32",
    "task_args.d_model=32",
    "task_args.n_head=2",
    "checkpoint.every_steps=10",
    "tracking.mlflow=false",
    "heartbeat.interval_s=0.2",
]
SCENARIOS = {  # kind: (signal, stall_s, timeout_s)
    "crash": (signal.SIGKILL, 3.0, 3.0),
    "hang": (signal.SIGSTOP, 2.0, 6.0),
    "dead": (signal.SIGSTOP, 6.0, 2.0),
}


def inject_when_training(run_dir: Path, sig: int, at_step: int, rank: int, out: dict) -> None:
    while True:
        hb = read_heartbeat(run_dir, rank)
        if hb and hb.phase == "train" and hb.step >= at_step:
            out["t"] = time.time()
            os.kill(hb.pid, sig)
            return
        time.sleep(0.01)


def one(root: Path, kind: str, i: int, ranks: int, nnodes: int = 1) -> dict:
    sig, stall, timeout = SCENARIOS[kind]
    hosts = ["127.0.0.1", *["localhost"] * (nnodes - 1)] if nnodes > 1 else []
    cfg = load_config(
        None,
        SMALL
        + [
            f"runs_dir={root / 'runs'}",
            f"data.prepared_dir={root / 'data'}",
            f"run_name={kind}-{ranks}x{nnodes}-{i}",
            f"train.ranks={ranks}",
            f"train.nnodes={nnodes}",
            f"train.hosts={hosts}",
            f"heartbeat.stall_s={stall}",
            f"heartbeat.timeout_s={timeout}",
            "heartbeat.grace_s=2",
        ],
    )
    world = cfg.train.world_size
    prepare(cfg.data, cfg.train.seed)
    run_dir = open_run(cfg).resolve()
    limits = DetectionLimits.from_config(cfg)
    shot: dict = {}
    t = threading.Thread(target=inject_when_training, args=(run_dir, sig, 25, world - 1, shot), daemon=True)
    t.start()

    def command(until: int) -> list[str]:
        return worker_command(run_dir, until, ranks, hosts=hosts, node_launch=cfg.orchestration.node_launch)

    try:
        supervise(
            AttemptSpec(command(400), run_dir, limits, run_dir / "logs" / "bench.log", ranks=world, id=AttemptId(1, 1))
        )
        raise RuntimeError("worker finished without the injected failure")
    except ChunkFailed as exc:
        detected_as = exc.kind
    fail = read_events(run_dir, "failure")[-1]
    latency = fail["detected_at"] - shot["t"]
    # MTTR: restart and resume.
    t0 = time.time()
    p = subprocess.run(command(fail["last_committed_step"] + 5), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    resumed = [e for e in read_events(run_dir, "resumed") if e.get("rank", 0) == 0][-1]
    t_load = resumed["load_s"]
    t_rebuild = resumed["time"] - t0 - t_load
    newest = CheckpointStore(run_dir).latest_valid(record=False)
    v0 = time.perf_counter()
    CheckpointStore(run_dir).verify(newest.path)
    t_verify = time.perf_counter() - v0
    limit = {"crash": limits.poll_s, "hang": stall, "dead": timeout}[kind]
    return {
        "kind": kind,
        "detected_as": detected_as,
        "latency_s": latency,
        "limit_s": limit,
        "t_rebuild_s": t_rebuild,
        "t_load_s": t_load,
        "t_verify_s": t_verify,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=1, help="ranks per node")
    ap.add_argument("--nnodes", type=int, default=1, help="torchrun agents (nodes), all on this machine")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="convoy-detect-"))
    rows = []
    for kind in SCENARIOS:
        for i in range(args.repeats):
            r = one(root, kind, i, args.ranks, args.nnodes)
            rows.append(r)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    print(f"\nranks={args.ranks} x nnodes={args.nnodes}, median of {args.repeats} (seconds)")
    print(
        f"{'kind':>6} {'detected as':>12} {'T_detect':>9} {'limit':>6} {'over limit':>10} "
        f"{'T_rebuild':>9} {'T_load':>7} {'T_verify':>8} {'MTTR':>6}"
    )
    for kind in SCENARIOS:
        rs = [r for r in rows if r["kind"] == kind]
        med = {k: statistics.median(r[k] for r in rs) for k in ("latency_s", "t_rebuild_s", "t_load_s", "t_verify_s")}
        mttr = med["latency_s"] + med["t_rebuild_s"] + med["t_load_s"]
        print(
            f"{kind:>6} {rs[0]['detected_as']:>12} {med['latency_s']:>9.2f} {rs[0]['limit_s']:>6.1f} "
            f"{med['latency_s'] - rs[0]['limit_s']:>10.2f} {med['t_rebuild_s']:>9.2f} {med['t_load_s']:>7.3f} "
            f"{med['t_verify_s']:>8.4f} {mttr:>6.2f}"
        )
    print(f"(workspace {root}; {sys.executable})")


if __name__ == "__main__":
    main()
