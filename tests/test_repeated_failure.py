"""A failure that repeats is not retried blindly (tasks/supervision/repeated.py): a loss_fn that raises at
step 7 every time fails its chunk after exactly two crash attempts with the ``repeated`` kind,
while SIGKILLs at different steps before it are retried as always."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tasks.supervision.repeated import same_failure
from tests.flow_util import assert_no_leftovers, config, in_thread, params, wait_for_step
from training.events import read_events
from training.tracking.failure_record import RecordedFailure


def failure(kind: str, step: int, error: str = "RuntimeError: boom", committed: int = 4) -> RecordedFailure:
    event = {"kind": "failure", "failure": kind, "chunk": 1, "attempt": 1, "trained_to": step, "error": error,
             "last_committed_step": committed}  # fmt: skip
    return RecordedFailure.from_event(event)


def test_only_the_same_crash_at_the_same_step_repeats() -> None:
    assert same_failure(failure("crash", 6), failure("crash", 6, committed=6))  # an async save landed or not
    assert not same_failure(failure("crash", 6), failure("crash", 8))  # it got further: progress
    assert not same_failure(failure("crash", 6), failure("crash", 6, "ValueError: other"))
    for kind in ("killed", "hang", "dead", "oom", "preempted", "timeout", "diskfull"):
        assert not same_failure(failure(kind, 6), failure(kind, 6)), kind  # faults from outside
    assert not same_failure(failure("crash", 6, ""), failure("crash", 6, ""))  # no error seen: unknown


@pytest.mark.slow
def test_loss_fn_raising_at_step_7_stops_after_two_attempts(prefect_api: str, data_dir: Path, tmp_path: Path) -> None:
    from flows.train import run_training
    from tasks.supervision.supervisor import ChunkFailed

    cfg = config(
        params(
            tmp_path,
            data_dir,
            "repeats",
            task="tests.pipeline_tasks:build_raises_at_step_7",
            task_args={},
            train={"total_steps": 10, "chunk_steps": 10, "lr": 0.05},
            checkpoint={"every_steps": 2},
            orchestration={"retries": 4, "retry_delay_seconds": 0.1, "backoff": 1, "jitter": 0},
        )
    )
    os.environ["CONVOY_FAULTS"] = "step_delay=0.15"  # so the kills below land on their steps
    run_dir = cfg.run_dir.resolve()
    killed: list[int] = []

    def killer() -> None:  # SIGKILL at step 2, then (another worker) at step 4
        pid = None
        for step in (2, 4):
            deadline = time.monotonic() + 120
            beat = wait_for_step(run_dir, step)
            while beat.pid == pid and time.monotonic() < deadline:
                time.sleep(0.05)
                beat = wait_for_step(run_dir, step)
            pid = beat.pid
            os.kill(pid, signal.SIGKILL)
            killed.append(beat.step)

    t = in_thread(killer)
    try:
        with pytest.raises(ChunkFailed) as info:
            run_training(cfg)
    finally:
        del os.environ["CONVOY_FAULTS"]
    t.join(timeout=5)
    assert not t.errors and len(killed) == 2, (t.errors, killed)  # type: ignore[attr-defined]
    assert info.value.kind == "repeated" and not info.value.retryable
    message = str(info.value)
    assert "attempts 3 and 4 both crashed in step 7" in message and "RuntimeError: loss exploded" in message
    assert "chunk-1-attempt-4.log" in message
    kinds = [e["failure"] for e in read_events(run_dir, "failure")]
    assert kinds == ["killed", "killed", "crash", "crash"]  # every kill retried; the bug twice, not five times
    (rep,) = read_events(run_dir, "repeated_failure")
    assert rep["attempts"] == [3, 4] and rep["step"] == 6 and rep["error"].startswith("RuntimeError: loss exploded")
    failed = [e for e in read_events(run_dir, "chunk_failed")]
    assert len(failed) == 1 and failed[0]["failure"] == "repeated"
    assert_no_leftovers(run_dir)
