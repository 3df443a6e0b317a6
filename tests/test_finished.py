"""A finished run has nothing to do (issue 44, item 7): ``training.finished`` decides it from the
run's own record, and anything short of finished goes through the flow."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.engine_util import final_digest, make_run, run_worker
from training.events import Event, append_event
from training.finished import finished_run
from training.rundir import load_run_config

TOTAL = 20


def _finished(tmp: Path) -> Path:
    run_dir = make_run(tmp, "done", [f"train.total_steps={TOTAL}", f"train.chunk_steps={TOTAL}"])
    append_event(run_dir, Event.FLOW_STARTED, flow_run_id="f-1")
    assert run_worker(run_dir, TOTAL)[0] == 0
    append_event(run_dir, Event.FLOW_DONE, final_step=TOTAL, digest=final_digest(run_dir), flow_run_id="f-1")
    return run_dir


def test_finished_only_when_the_last_flow_ended_on_the_verified_final_checkpoint(tmp_path: Path) -> None:
    run_dir = _finished(tmp_path)
    config = load_run_config(run_dir)
    done = finished_run(config)
    assert done is not None and (done.step, done.digest, done.flow_run_id) == (TOTAL, final_digest(run_dir), "f-1")
    longer = config.model_copy(update={"train": config.train.model_copy(update={"total_steps": TOTAL + 10})})
    assert finished_run(longer) is None  # other settings: the flow checks and names them
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "state.safetensors"
    data = bytearray(newest.read_bytes())
    data[-3] ^= 1
    newest.write_bytes(bytes(data))
    assert finished_run(config) is None  # the final checkpoint does not verify: the flow repairs it
    newest.write_bytes(bytes(data[:-3]) + bytes([data[-3] ^ 1]) + bytes(data[-2:]))
    assert finished_run(config) is not None
    append_event(run_dir, Event.FLOW_STARTED, flow_run_id="f-2")  # a flow that died after it
    assert finished_run(config) is None


def test_convoy_train_of_a_finished_run_answers_without_a_flow(tmp_path: Path) -> None:
    run_dir = _finished(tmp_path)
    params = tmp_path / "params.yaml"
    params.write_text((run_dir / "config.json").read_text())  # JSON is YAML
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli.main", "train", str(params)], capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert f"run done is finished: step {TOTAL}" in out.stdout and "nothing to do" in out.stdout, out.stdout
    assert "Flow run" not in out.stderr + out.stdout
    print(f"\nconvoy train of a finished run: {took:.2f} s")
