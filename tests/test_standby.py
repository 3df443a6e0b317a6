"""Warm standby (``orchestration.standby``): a built, waiting worker takes over a killed one.

Real flow, real Prefect API, real SIGKILLs: two kills in a row, each handled by the standby that
was ready at the time (the second by the standby started behind the first), end bitwise equal to
an uninterrupted run (MLflow on, so the tracking clients the standby connected early are part of
the proof); the standby dies with a killed flow.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.flow_run_util import start_flow
from tests.flow_util import CHUNK, TOTAL, assert_no_leftovers, config, in_thread, params, wait_for_step
from training.events import WorkerSays, read_events

pytestmark = pytest.mark.slow


def wait_for_ready_standby(run_dir: Path, n: int, timeout: float = 120) -> int:
    """Pid of standby number ``n`` once it says it is ready (built, tracking connected)."""
    log = run_dir / "logs" / f"standby-{n}.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if WorkerSays.STANDBY_READY in text:
            return _pid_of(log)
        time.sleep(0.05)
    raise AssertionError(f"standby {n} never got ready: {log}")


def _pid_of(log: Path) -> int:
    """The pid the standby says it has (forked by the run's zygote, its command line is the zygote's)."""
    found = re.findall(rf"{WorkerSays.STANDBY_READY} \(pid (\d+)\)", log.read_text(errors="replace"))
    assert found, f"no standby pid in {log}"
    pid = int(found[-1])
    assert psutil.pid_exists(pid), "no standby process"
    return pid


def test_two_kills_in_a_row_are_taken_over_by_standbys_bitwise(
    prefect_api: str, data_dir: Path, tmp_path: Path, reference_digest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.train import run_training

    # 50 ms a step, and the first worker stalls 10 s early in chunk 2 (once: the replacements
    # resume past that step), so the first standby is ready before the first kill lands where it
    # is aimed, in chunk 2, however slowly a loaded machine starts it.  After the kill the flag
    # stalls the next step long enough for the second standby to get ready, and the second kill
    # lands in that stall (below the raised hang limit).
    flag = tmp_path / "stall-after-first-kill"
    monkeypatch.setenv("CONVOY_FAULTS", f"step_delay=0.05,slow_step={CHUNK + 2}:10,slow_flag={flag}:60")
    # The URI in the params, not in $MLFLOW_TRACKING_URI: nothing of this run may reach an MLflow
    # database in the checkout (a full suite once left mlflow.db and mlartifacts/ there).
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config(
        params(
            tmp_path,
            data_dir,
            "standby",
            orchestration={"standby": True},
            tracking={"mlflow": True, "mlflow_uri": uri},
            heartbeat={"stall_s": 90},
        )
    )
    run_dir = cfg.run_dir.resolve()
    kills: list[dict[str, Any]] = []

    def killer() -> None:
        wait_for_ready_standby(run_dir, 1)
        beat = wait_for_step(run_dir, CHUNK + 7)
        flag.touch()
        kills.append({"pid": beat.pid, "step": beat.step})
        os.kill(beat.pid, signal.SIGKILL)
        wait_for_ready_standby(run_dir, 2)  # started behind the standby that took over
        beat = wait_for_step(run_dir, 0)
        assert beat.pid != kills[0]["pid"]
        kills.append({"pid": beat.pid, "step": beat.step})
        os.kill(beat.pid, signal.SIGKILL)

    t = in_thread(killer)
    summary = run_training(cfg)
    t.join(timeout=5)
    assert not t.errors, t.errors  # type: ignore[attr-defined]
    assert len(kills) == 2, kills
    assert summary["final_step"] == TOTAL
    assert summary["digest"] == reference_digest, "a standby's resume diverged from the uninterrupted run"
    fail = read_events(run_dir, "failure")
    assert [e["failure"] for e in fail] == ["killed", "killed"]
    took_over = read_events(run_dir, "standby_took_over")
    assert len(took_over) == 2, "each kill must be handled by a standby, not a fresh worker"
    # The first standby took over the first kill and was the second kill's victim; the second
    # standby (started behind it) finished the run.
    assert took_over[0]["pid"] == kills[1]["pid"] and took_over[1]["pid"] not in {k["pid"] for k in kills}
    resumed = read_events(run_dir, "resumed")
    assert [e["step"] for e in resumed[-2:]] == [f["last_committed_step"] for f in fail]
    called = read_events(run_dir, "standby_called")
    assert [e["chunk"] for e in called] == [2, 2]
    print(
        "\nstandby hand-over after each kill: "
        + ", ".join(
            f"kill at step {k['step']} -> resumed at {r['step']} ({r['time'] - f['time']:.2f} s after the failure "
            f"was recorded)"
            for k, r, f in zip(kills, resumed[-2:], fail, strict=True)
        )
    )
    assert_no_leftovers(run_dir)


def test_standby_dies_with_a_killed_flow(prefect_api: str, data_dir: Path, tmp_path: Path) -> None:
    p = params(tmp_path, data_dir, "standbyflow", orchestration={"standby": True})
    env = {**os.environ, "CONVOY_FAULTS": "step_delay=0.05"}
    run_dir, flow = start_flow(tmp_path, p, env)
    try:
        standby_pid = wait_for_ready_standby(run_dir, 1)
        assert flow.poll() is None
        os.kill(flow.pid, signal.SIGKILL)  # the flow's machine "dies": nothing of the run may live on
        flow.wait(timeout=10)
        assert_no_leftovers(run_dir, wait_s=40)
        assert not psutil.pid_exists(standby_pid) or psutil.Process(standby_pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, signal.SIGKILL)
            flow.wait()
