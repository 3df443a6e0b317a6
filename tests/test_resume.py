"""Exact resume under real signals: SIGKILL at random moments and SIGTERM preemption.

The final state (every tensor incl. optimizer moments, RNG, cursor) must be bitwise equal to an
uninterrupted run's; the whole-state digest covers all of it.
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest

from tests.engine_util import final_digest, kill_group, make_run, run_worker, start_worker, wait_for_step
from training.checkpoint import CheckpointStore
from training.events import read_events

pytestmark = pytest.mark.slow
TOTAL = 120


def reference_digest(tmp_path: Path, extra: list[str]) -> str:
    run_dir = make_run(tmp_path, "reference", extra)
    code, out = run_worker(run_dir, TOTAL)
    assert code == 0, out
    return final_digest(run_dir)


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["metrics"]["loss"]) for r in rows]


def wait_for_persist(run_dir: Path, p, timeout: float = 60) -> bool:
    """Wait until a background persist is in flight (its temporary dir exists)."""
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        if any((run_dir / "checkpoints").glob(".tmp-*")):
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sigkill_at_random_moments_ends_bitwise_equal(tmp_path: Path, num_workers: int) -> None:
    extra = [f"data.num_workers={num_workers}"]
    ref = reference_digest(tmp_path, extra)
    run_dir = make_run(tmp_path, "killed", extra)
    rng = random.Random(20261129 + num_workers)
    targets = sorted(rng.sample(range(3, TOTAL - 5), 5))
    # Slow the background persist so that one kill provably lands inside it.
    faults = {"CONVOY_FAULTS": "persist_delay=0.4"}
    kills = []
    p = start_worker(run_dir, TOTAL, faults)
    assert wait_for_persist(run_dir, p), "never saw an async persist in flight"
    kill_group(p)
    p.wait()
    kills.append("during persist")
    for target in targets:
        p = start_worker(run_dir, TOTAL)
        reached = wait_for_step(run_dir, p, target)
        if reached is None:  # finished before the target: nothing to kill
            break
        time.sleep(rng.random() * 0.03)  # land somewhere inside a step, not at its boundary
        kill_group(p)
        p.wait()
        kills.append(reached)
    code, out = run_worker(run_dir, TOTAL)
    assert code == 0, out
    assert len(kills) >= 6, kills
    print(f"killed at {kills}; resumes: {len(read_events(run_dir, 'resumed'))}")
    assert final_digest(run_dir) == ref
    # Step-aligned metrics: one point per step, equal to the uninterrupted run's values.
    logged = logged_losses(run_dir)
    assert [s for s, _ in logged] == list(range(1, TOTAL + 1))
    assert logged == logged_losses(tmp_path / "runs" / "reference")
    assert CheckpointStore(run_dir).latest_valid().step == TOTAL


def test_sigterm_saves_emergency_checkpoint_exits_75_and_resumes_exactly(tmp_path: Path) -> None:
    ref = reference_digest(tmp_path, [])
    run_dir = make_run(tmp_path, "preempted", ["checkpoint.every_steps=1000"])
    p = start_worker(run_dir, TOTAL)
    wait_for_step(run_dir, p, 37)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 75, out
    pre = read_events(run_dir, "preempted")
    assert len(pre) == 1
    ck = CheckpointStore(run_dir).latest_valid()
    assert ck.step == pre[0]["step"] >= 37  # the step reached, not an older periodic one
    code, out = run_worker(run_dir, TOTAL)
    assert code == 0 and f"resumed from step {ck.step}" in out
    assert final_digest(run_dir) == ref
