"""Nothing ``convoy train`` started outlives it (issue 44, item 6).

A user's ``convoy train`` on the embedded defaults (no ``PREFECT_API_URL``: Prefect's temporary
API server is started for the command) is killed with SIGKILL, then, resumed, with SIGTERM —
only the command's own process, as ``kill`` or an OOM killer does it, not its process group.
Within 10 s every process it had started (the temporary API server, the run's zygote, the worker,
convoy's reaper) must be gone; and a command refused by the task's check (while the temporary API
started beside it) leaves nothing either.  One test: one fresh ``PREFECT_HOME`` migrated once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from flow_util import REPO, config, params, wait_for_step


def _started(pid: int) -> list[psutil.Process]:
    """Every process descending from ``pid`` (the zygote and the reaper run in sessions of their
    own: followed by parent, not by group)."""
    return psutil.Process(pid).children(recursive=True)


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
    return out


def _kill_and_check(cmd: list[str], env: dict[str, str], run_dir: Path, step: int, sig: signal.Signals) -> None:
    flow = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_for_step(run_dir, step, timeout=300)
        started = _started(flow.pid)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert "create_app" in names and "flows.reaper" in names, names  # the temporary API, tied
        flow.send_signal(sig)  # the command's process only, as `kill` does
        flow.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(started), f"left running 10 s after {sig.name}: {_alive(started)}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(flow.pid, signal.SIGKILL)
        for p in _started(flow.pid) if flow.poll() is None else []:
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.mark.slow
def test_sigkill_and_sigterm_of_convoy_train_leave_nothing_running(data_dir: Path, tmp_path: Path) -> None:
    p = params(tmp_path, data_dir, "left", train={"total_steps": 400, "chunk_steps": 400})
    (tmp_path / "left.yaml").write_text(yaml.safe_dump(p))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # Prefect's temporary API
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), CONVOY_FAULTS="step_delay=0.05")
    cmd = [sys.executable, "-m", "flows.cli.main", "train", str(tmp_path / "left.yaml")]
    run_dir = config(p).run_dir.resolve()
    _kill_and_check(cmd, env, run_dir, 3, signal.SIGKILL)
    _kill_and_check(cmd, env, run_dir, 10, signal.SIGTERM)
    # A task that fails its check: the temporary API was starting beside the check (flows/cli/main.py
    # starts it early); the one-line error, exit 2, and nothing of this PREFECT_HOME left running.
    bad = subprocess.run([*cmd, "-S", "task_args.n_head=3"], cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error:"), bad.stderr[-2000:]
    deadline = time.monotonic() + 10
    while (left := _with_home(env["PREFECT_HOME"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left running after a config error: {left}"


def _with_home(home: str) -> list[str]:
    """Live processes whose environment names ``home`` as PREFECT_HOME."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("PREFECT_HOME") == home and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
    return out
