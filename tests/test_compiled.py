"""A compiled model through the real flow (issue 44, item 1): its cold compile takes longer than
``heartbeat.stall_s`` and is not called a hang; a SIGKILL during the compile leaves nothing that
breaks the retry, which compiles and trains; two kills after it end bitwise equal to an
uninterrupted compiled run; its checkpoints carry the plain model's names and load into the plain
class."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from flow_util import config, in_thread, params

from tests.engine_util import final_digest, logged_losses, run_worker
from training.checkpointing.store import CheckpointStore
from training.events import Phase, read_events
from training.heartbeat import read_heartbeat
from training.rundir import open_run

TOTAL = 40
TASK = {"task": "tests.compile_tasks:build"}


def _settings(tmp_path: Path, data_dir: Path, name: str) -> dict[str, Any]:
    p = params(
        tmp_path,
        data_dir,
        name,
        train={"total_steps": TOTAL, "chunk_steps": TOTAL},
        heartbeat={"stall_s": 4, "compile_timeout_s": 600},
        orchestration={"retries": 4},
    )
    return {**p, **TASK}


def _kill_at(run_dir: Path, step: int, not_pid: int, timeout: float = 600) -> int:
    """SIGKILL the worker once a beat of a worker other than ``not_pid`` (the one killed before,
    whose last beat stays in the file) trains at ``step`` or later; returns its pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beat = read_heartbeat(run_dir, 0)
        if beat is not None and beat.pid != not_pid and beat.phase == Phase.TRAIN and beat.step >= step:
            os.kill(beat.pid, signal.SIGKILL)
            return beat.pid
        time.sleep(0.02)
    raise AssertionError(f"no new worker trained to step {step}")


def _wait_for_phase(run_dir: Path, phase: str, timeout: float = 240) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beat = read_heartbeat(run_dir, 0)
        if beat is not None and beat.phase == phase:
            return beat.pid
        time.sleep(0.05)
    raise AssertionError(f"the worker never entered phase {phase}")


@pytest.mark.slow
def test_a_compiled_model_is_no_hang_survives_kills_in_and_after_its_compile(
    prefect_api: str, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.train import run_training
    from training.examples.char_gpt import CharGPT, CharGPTArgs

    reference = config(_settings(tmp_path, data_dir, "reference"))
    code, out = run_worker(open_run(reference), TOTAL)
    assert code == 0, out
    monkeypatch.setenv("CONVOY_FAULTS", "step_delay=0.05")  # steps slow enough to be killed at
    cfg = config(_settings(tmp_path, data_dir, "compiled"))
    run_dir = cfg.run_dir.resolve()
    kills: list[str] = []

    def killer() -> None:
        pid = _wait_for_phase(run_dir, Phase.COMPILE)
        time.sleep(3.0)  # inside the cold compile (tens of seconds here)
        os.kill(pid, signal.SIGKILL)
        kills.append("compiling")
        for step in (12, 27):
            pid = _kill_at(run_dir, step, not_pid=pid)
            kills.append(f"step {step}+")

    t = in_thread(killer)
    summary = run_training(cfg)
    t.join(timeout=10)
    assert not t.errors, t.errors
    assert summary["final_step"] == TOTAL and len(kills) == 3, (summary, kills)
    failures = [e["failure"] for e in read_events(run_dir, "failure")]
    assert "hang" not in failures and len(failures) == 3, failures  # compiling is never a hang
    assert final_digest(run_dir) == final_digest(reference.run_dir)
    assert logged_losses(run_dir) == logged_losses(reference.run_dir)
    loaded = CheckpointStore(run_dir).load_latest()
    assert loaded is not None
    weights = loaded[1]["state"]["model"]
    assert not [k for k in weights if "_orig_mod" in k]
    model = CharGPT(CharGPTArgs(**cfg.task_args), cfg.data.seq_len)
    model.load_state_dict(weights)  # strict: the plain class
    assert torch.equal(model.head.weight, weights["head.weight"])
    print(f"\nkilled {kills}; failures {failures}")


def test_the_vector_isa_probe_runs_once_per_run_and_machine(tmp_path: Path) -> None:
    """Rule 4 of training/compiling.py: the first worker runs inductor's probe and records it beside
    the cache; a later worker (a new interpreter) reads the verdict instead of probing, and tells
    inductor only what the probe found."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys; from pathlib import Path\n"
        "from training.compiling import settle_vec_isa\n"
        "from torch._inductor import cpu_vec_isa, config\n"
        "told = settle_vec_isa(Path(sys.argv[1]))\n"
        "print(json.dumps([told, cpu_vec_isa.valid_vec_isa_list.cache_info().currsize, config.cpp.vec_isa_ok]))\n"
    )
    path = tmp_path / "vec-isa.json"

    def worker() -> list[Any]:
        done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True)
        return json.loads(done.stdout.splitlines()[-1])

    first = worker()
    recorded = json.loads(path.read_text())
    all_passed = recorded["probed"] == recorded["plain"]
    assert first == [all_passed, 1, True if all_passed else None]  # probed (inductor's list computed)
    second = worker()
    assert second == ([True, 0, True] if all_passed else [False, 0, None]), (second, recorded)  # not probed
