"""Helpers for engine tests: build a small run directory and drive real worker processes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from training.checkpointing.store import CheckpointStore
from training.config import load_config
from training.datapipe.corpus import prepare
from training.heartbeat import read_heartbeat
from training.rundir import open_run

SMALL = [
    "train.total_steps=120",
    "train.chunk_steps=60",
    "train.batch_size=8",
    "train.warmup_steps=5",
    "data.synthetic_chars=60000",
    "data.seq_len=32",
    "task_args.d_model=32",
    "task_args.n_head=2",
    "checkpoint.every_steps=10",
    "checkpoint.keep_last=2",
    "tracking.mlflow=false",
    "heartbeat.interval_s=0.1",
]


def make_run(tmp: Path, name: str = "run", extra: list[str] | None = None) -> Path:
    cfg = load_config(
        None,
        SMALL + [f"runs_dir={tmp / 'runs'}", f"data.prepared_dir={tmp / 'data'}", f"run_name={name}"] + (extra or []),
    )
    prepare(cfg.data, cfg.train.seed)
    return open_run(cfg)


def worker_cmd(run_dir: Path, until: int) -> list[str]:
    return [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(until)]


def start_worker(run_dir: Path, until: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        worker_cmd(run_dir, until),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def run_worker(run_dir: Path, until: int, env: dict[str, str] | None = None, timeout: float = 300) -> tuple[int, str]:
    p = start_worker(run_dir, until, env)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def kill_group(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the process group of ``p`` and every descendant: torchrun starts each rank in a
    session of its own, so the group alone would leave the ranks training."""
    import psutil

    try:
        descendants = psutil.Process(p.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    for child in descendants:
        try:
            child.send_signal(sig)
        except psutil.Error:
            pass


def wait_for_step(run_dir: Path, p: subprocess.Popen, step: int, timeout: float = 120) -> int | None:
    """Poll the heartbeat until it reports ``step`` or more; None if the worker exited first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if p.poll() is not None:
            return None
        hb = read_heartbeat(run_dir, 0)
        if hb and hb.phase in ("train", "save") and hb.step >= step:
            return hb.step
        time.sleep(0.01)
    raise TimeoutError(f"worker did not reach step {step}")


def final_digest(run_dir: Path) -> str:
    ck = CheckpointStore(run_dir).latest_valid(record=False)
    assert ck is not None
    return ck.digest


def reference_digest(
    tmp: Path, extra: list[str], until: int = 120, name: str = "reference", env: dict[str, str] | None = None
) -> str:
    """Digest of one uninterrupted worker run to ``until`` (run ``name`` under ``tmp``)."""
    run_dir = make_run(tmp, name, extra)
    code, out = run_worker(run_dir, until, env)
    assert code == 0, out
    return final_digest(run_dir)


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["metrics"]["loss"]) for r in rows]


def wait_for_persist(run_dir: Path, p: subprocess.Popen, timeout: float = 60) -> bool:
    """Wait until a background persist is in flight (its temporary dir exists)."""
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        if any((run_dir / "checkpoints").glob(".tmp-*")):
            return True
        time.sleep(0.005)
    return False


def kill_at_random_steps(
    run_dir: Path, total: int, targets: list[int], rng: random.Random, env: dict[str, str] | None = None
) -> list[int | str]:
    """SIGKILL a worker once inside a background persist (slowed by a fault so the kill provably
    lands there), then once at each of ``targets`` (somewhere inside the step); returns where
    each kill landed.  The caller runs the last worker to the end."""
    faults = ",".join(f for f in ((env or {}).get("CONVOY_FAULTS", ""), "persist_delay=0.4") if f)
    kills: list[int | str] = []
    p = start_worker(run_dir, total, {**(env or {}), "CONVOY_FAULTS": faults})
    assert wait_for_persist(run_dir, p), "never saw an async persist in flight"
    kill_group(p)
    p.wait()
    kills.append("during persist")
    for target in targets:
        p = start_worker(run_dir, total, env)
        reached = wait_for_step(run_dir, p, target)
        if reached is None:  # finished before the target: nothing to kill
            break
        time.sleep(rng.random() * 0.03)  # land somewhere inside a step, not at its boundary
        kill_group(p)
        p.wait()
        kills.append(reached)
    return kills


def killed_run_matches(tmp: Path, extra: list[str], reference: Path, total: int, targets: list[int], seed: int) -> Path:
    """Run ``killed`` with ``extra``: SIGKILLed in a persist and at each of ``targets``, then
    trained to ``total``; asserts it ends bitwise as ``reference`` (digest and every step's loss)."""
    run_dir = make_run(tmp, "killed", extra)
    kills = kill_at_random_steps(run_dir, total, targets, random.Random(seed))
    assert len(kills) == len(targets) + 1, kills
    code, out = run_worker(run_dir, total)
    assert code == 0, out
    assert final_digest(run_dir) == final_digest(reference)
    assert logged_losses(run_dir) == logged_losses(reference)
    return run_dir
