"""Exact resume under real signals: SIGKILL at random moments and SIGTERM preemption.

The final state (every tensor incl. optimizer moments, RNG, cursor) must be bitwise equal to an
uninterrupted run's; the whole-state digest covers all of it.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from tests.engine_util import (
    final_digest,
    kill_at_random_steps,
    logged_losses,
    make_run,
    reference_digest,
    run_worker,
    start_worker,
    wait_for_step,
)
from training.checkpointing.store import CheckpointStore
from training.events import Event, read_events

pytestmark = pytest.mark.slow
TOTAL = 120


@pytest.fixture(autouse=True)
def several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers at two intra-op threads (the suite's default is one, see conftest.py): resumes must
    be bitwise where a GEMM is split across threads too."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sigkill_at_random_moments_ends_bitwise_equal(tmp_path: Path, num_workers: int) -> None:
    extra = [f"data.num_workers={num_workers}"]
    ref = reference_digest(tmp_path, extra)
    run_dir = make_run(tmp_path, "killed", extra)
    rng = random.Random(20261129 + num_workers)
    targets = sorted(rng.sample(range(3, TOTAL - 5), 5))
    kills = kill_at_random_steps(run_dir, TOTAL, targets, rng)
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
    runs = (tmp_path / "runs" / "reference", run_dir)
    starts = [e for r in runs for e in read_events(r) if e["kind"] in (Event.STARTED, Event.RESUMED)]
    assert len({e["intraop_threads"] for e in starts}) == 1, starts  # one summation order
    # Per step first: a divergence names its step (before or after the resume), not just a digest.
    assert logged_losses(run_dir) == logged_losses(tmp_path / "runs" / "reference")
    assert final_digest(run_dir) == ref
