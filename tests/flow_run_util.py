"""Helpers that drive the training flow end to end under faults (tests/test_flow.py, test_cuda.py,
test_standby.py): ``convoy train`` as a process of its own, a flow run whose worker is SIGKILLed
inside chunk 3."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests.flow_util import CHUNK, REPO, config, in_thread, wait_for_step


def start_flow(tmp_path: Path, p: dict[str, Any], env: dict[str, str] | None = None) -> tuple[Path, subprocess.Popen]:
    """``python -m flows.cli.main train`` on the params ``p`` (written to ``tmp_path/params.yaml``)
    in a session of its own, its output discarded; returns the run's directory and the process."""
    pfile = tmp_path / "params.yaml"
    pfile.write_text(yaml.safe_dump(p))
    run_dir = config(p).run_dir.resolve()
    flow = subprocess.Popen(
        [sys.executable, "-m", "flows.cli.main", "train", str(pfile)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    return run_dir, flow


def train_killed_in_chunk_3(run_training: Callable[[Any], dict[str, Any]], cfg: Any) -> tuple[dict[str, Any], dict]:
    """``run_training(cfg)`` while a thread SIGKILLs the worker once its heartbeat says step
    ``2 * CHUNK + 8`` (chunk 3 = steps [40, 60)); returns the flow's summary and the kill (pid,
    step, time), after checking that the kill happened and the thread raised nothing."""
    run_dir = cfg.run_dir.resolve()
    killed: dict[str, Any] = {}

    def killer() -> None:
        beat = wait_for_step(run_dir, 2 * CHUNK + 8)  # chunk 3 = steps [40, 60)
        killed.update(pid=beat.pid, step=beat.step, time=time.time())
        os.kill(beat.pid, signal.SIGKILL)

    t = in_thread(killer)
    summary = run_training(cfg)
    t.join(timeout=5)
    assert not t.errors, t.errors  # type: ignore[attr-defined]
    assert killed, "the killer never fired"
    return summary, killed
