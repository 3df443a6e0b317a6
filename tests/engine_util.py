"""Helpers for engine tests: build a small run directory and drive real worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from training.checkpoint import CheckpointStore
from training.config import load_config
from training.corpus import prepare
from training.heartbeat import read_heartbeat
from training.rundir import open_run

SMALL = [
    "train.total_steps=120", "train.chunk_steps=60", "train.batch_size=8", "train.warmup_steps=5",
    "data.synthetic_chars=60000", "data.seq_len=32", "task_args.d_model=32", "task_args.n_head=2",
    "checkpoint.every_steps=10", "checkpoint.keep_last=2", "tracking.mlflow=false",
    "heartbeat.interval_s=0.1",
]


def make_run(tmp: Path, name: str = "run", extra: list[str] | None = None) -> Path:
    cfg = load_config(None, SMALL + [f"runs_dir={tmp / 'runs'}", f"data.prepared_dir={tmp / 'data'}",
                                     f"run_name={name}"] + (extra or []))
    prepare(cfg.data, cfg.train.seed)
    return open_run(cfg)


def worker_cmd(run_dir: Path, until: int) -> list[str]:
    return [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(until)]


def start_worker(run_dir: Path, until: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(worker_cmd(run_dir, until), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def run_worker(run_dir: Path, until: int, env: dict[str, str] | None = None, timeout: float = 300) -> tuple[int, str]:
    p = start_worker(run_dir, until, env)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def kill_group(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def wait_for_step(run_dir: Path, p: subprocess.Popen, step: int, timeout: float = 120) -> int | None:
    """Poll the heartbeat until it reports ``step`` or more; None if the worker exited first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if p.poll() is not None:
            return None
        hb = read_heartbeat(run_dir, 0)
        if hb and hb["phase"] in ("train", "save") and hb["step"] >= step:
            return hb["step"]
        time.sleep(0.01)
    raise TimeoutError(f"worker did not reach step {step}")


def final_digest(run_dir: Path) -> str:
    ck = CheckpointStore(run_dir).latest_valid(record=False)
    assert ck is not None
    return ck.digest
