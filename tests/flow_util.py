"""Helpers for the end-to-end flow and deployment tests (tiny real runs, process checks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from training.heartbeat import Beat, read_heartbeat

REPO = Path(__file__).resolve().parents[1]
TOTAL, CHUNK = 60, 20


def params(tmp: Path, data_dir: Path, name: str, **sections: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {
        "run_name": name,
        "runs_dir": str(tmp / "runs"),
        "task_args": {"n_layer": 1, "n_head": 2, "d_model": 32, "dropout": 0.1},
        "data": {"prepared_dir": str(data_dir), "synthetic_chars": 20000, "seq_len": 32},
        "train": {"total_steps": TOTAL, "chunk_steps": CHUNK, "batch_size": 8, "warmup_steps": 5},
        "checkpoint": {"every_steps": 5, "async_save": True, "keep_last": 3},
        "heartbeat": {
            "interval_s": 0.2,
            "stall_s": 5,
            "timeout_s": 5,
            "init_timeout_s": 90,
            "save_timeout_s": 30,
            "grace_s": 3,
        },
        "orchestration": {"retries": 2, "retry_delay_seconds": 0.5, "backoff": 2, "jitter": 0.1},
        "tracking": {"mlflow": False},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values} if isinstance(values, dict) else values
    return base


def config(p: dict[str, Any]) -> Any:
    from training.config import config_from_dict

    return config_from_dict(p)


def leftovers(marker: Path) -> list[str]:
    out = []
    for p in psutil.process_iter(["cmdline", "status", "pid"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(marker) in cmd and p.pid != os.getpid():
                out.append(f"{p.pid} {cmd}")
        except psutil.Error:
            continue
    return out


def assert_no_leftovers(marker: Path, wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(marker), leftovers(marker)


def wait_for_step(run_dir: Path, step: int, timeout: float = 240, rank: int = 0) -> Beat:
    """The first heartbeat of ``rank`` in phase train at ``step`` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beat = read_heartbeat(run_dir, rank)
        if beat and beat.phase == "train" and beat.step >= step:
            return beat
        time.sleep(0.05)
    raise AssertionError(f"worker never reached step {step}")


def stop_group(p: subprocess.Popen, check: bool = True) -> None:
    """SIGTERM a process group, SIGKILL what is left after 10 s, reap; with ``check`` assert that
    no process of the group survived."""
    procs = []
    with contextlib.suppress(psutil.Error):
        procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(procs, timeout=10)
    for q in alive:
        with contextlib.suppress(psutil.Error):
            q.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    if check:
        psutil.wait_procs(procs, timeout=5)
        assert not [q.pid for q in procs if q.is_running() and q.status() != psutil.STATUS_ZOMBIE]


def in_thread(fn: Any) -> threading.Thread:
    """Run ``fn`` (a fault injector) beside the flow; what it raised is in ``.errors``."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.errors = errors  # type: ignore[attr-defined]
    t.start()
    return t


def uninterrupted_digest(tmp: Path, data_dir: Path, name: str, **sections: dict[str, Any]) -> str:
    """Digest after TOTAL steps trained by one uninterrupted worker (no Prefect, no chunks) for
    ``params(tmp, data_dir, name, **sections)``: what any chunking and any failures must reach."""
    from training.checkpointing.store import CheckpointStore
    from training.rundir import open_run

    run_dir = open_run(config(params(tmp, data_dir, name, **sections))).resolve()
    cmd = [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(TOTAL)]
    rc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rc.returncode == 0, rc.stderr[-2000:]
    ck = CheckpointStore(run_dir).latest_valid(record=False)
    assert ck is not None and ck.step == TOTAL
    return ck.digest


def two_node_reference(p: dict[str, Any], until: int) -> str:
    """Digest of run ``p`` trained to ``until`` uninterrupted on two nodes of this machine
    (``127.0.0.1`` and ``localhost``: the multi-node launcher alone, no Prefect, no scheduler)."""
    from tasks.supervision.multinode import launcher_command
    from tasks.supervision.supervisor import worker_command
    from training.checkpointing.store import CheckpointStore
    from training.rundir import open_run

    ref = open_run(config(p)).resolve()
    cmd = launcher_command(["127.0.0.1", "localhost"], 1, "", worker_command(ref, until)[1:])
    env = {**os.environ, "CONVOY_FAULTS": "step_delay=0.03"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return CheckpointStore(ref).latest_valid().digest


def flow_run_processes(worker_pid: int, training_pid: int) -> list[int]:
    """What a flow run started by the Prefect worker ``worker_pid`` is made of (for a test or a
    bench that kills the whole job): the process Prefect's worker started for it (under ``convoy
    prefect-worker`` the ``flows.flow_exec`` client standing in for the fork, else the engine) and
    the process running the flow (the flow server's fork that is not the run's worker zygote, or
    the training worker's parent or its zygote's parent)."""
    top = psutil.Process(worker_pid)
    family = top.children(recursive=True)
    started = [p for p in family if any(m in " ".join(p.cmdline()) for m in ("flows.flow_exec", "prefect.engine"))]
    parent = psutil.Process(training_pid).parent()
    zygote = parent if parent is not None and "training.zygote" in " ".join(parent.cmdline()) else None
    servers = [p for p in family if "flows.flow_server" in " ".join(p.cmdline()) and p.parent() == top]
    if servers:
        flows = [p for p in servers[0].children() if zygote is None or p.pid != zygote.pid]
    else:
        flows = [zygote.parent() if zygote is not None else parent]
    return sorted({p.pid for p in [*started, *flows] if p is not None and p.pid != top.pid})
