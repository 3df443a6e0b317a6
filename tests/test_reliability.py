"""Planner formulas (the seeds' worked examples) and the adaptive checkpoint interval."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from training.checkpointing.adaptive import WARMUP_STEPS, AdaptiveInterval
from training.checkpointing.reliability import PlanInput, overhead, plan, reliability, young_daly_h


def test_worked_examples() -> None:
    assert overhead(5, 0.5, 100) == pytest.approx(0.125)
    assert reliability(1000, 0.001 / 24, 7 * 24) == pytest.approx(0.000912, abs=5e-7)
    out = plan(PlanInput(gpus=1000, failure_rate_per_day=0.001, job_hours=168, save_hours=0.5))
    assert out["reliability_over_job"] == pytest.approx(0.000912, abs=5e-7)
    assert out["cluster_mtbf_hours"] == pytest.approx(24.0)


def test_young_daly_is_the_numerical_minimum() -> None:
    save, mtbf = 0.5, 100.0
    grid = np.linspace(0.5, 40, 20000)
    best = grid[np.argmin([overhead(t, save, mtbf) for t in grid])]
    assert best == pytest.approx(young_daly_h(save, mtbf), rel=1e-3)
    assert young_daly_h(save, mtbf) == pytest.approx(10.0)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--gpus", "0", "--save-hours", "1"], "gpus = 0"),
        (["--failure-rate-per-day", "-0.5", "--save-hours", "1"], "failure-rate-per-day = -0.5"),
        (["--gpus", "4"], "give --save-hours"),
    ],
)
def test_plan_rejects_impossible_inputs_with_one_line(args: list[str], needle: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli.main", "plan", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def _simulate(cost_s: float, step_s: float = 0.01, steps: int = 100_000) -> tuple[list[int], float]:
    """Feed an AdaptiveInterval with a constant save cost; return intervals and save overhead.

    The first save (after WARMUP_STEPS) is the measurement; the budget applies from then on."""
    ad = AdaptiveInterval(mtbf_s=3600, max_overhead=0.02)
    intervals, since, stalls, wall = [], 0, 0.0, 0.0
    for _ in range(steps):
        ad.observe_step(step_s, persist_in_flight=False)
        wall += step_s
        since += 1
        if since >= ad.interval_steps():
            ad.observe_save(cost_s)
            if intervals:
                stalls += cost_s
                wall += cost_s
            else:
                wall = 0.0
            intervals.append(ad.interval_steps())
            since = 0
    return intervals, stalls / wall


def test_slow_save_grows_interval_fast_save_shrinks_it_and_budget_holds() -> None:
    slow, slow_overhead = _simulate(cost_s=2.0)
    fast, fast_overhead = _simulate(cost_s=0.001)
    assert slow[-1] > fast[-1] > 0
    assert slow_overhead <= 0.02 + 1e-9 and fast_overhead <= 0.02 + 1e-9
    assert fast[-1] != WARMUP_STEPS


def test_adaptive_interval_reacts_to_measured_saves_in_a_real_worker(tmp_path: Path) -> None:
    from tests.engine_util import make_run, run_worker
    from training.events import read_events

    chosen = {}
    for name, faults, blocking in (("fast", "", "true"), ("slow", "persist_delay=0.5", "false")):
        run_dir = make_run(
            tmp_path,
            name,
            ["checkpoint.every_steps=auto", "checkpoint.mtbf_hours=0.05", f"checkpoint.async_save={blocking}"],
        )
        code, out = run_worker(run_dir, 120, env={"CONVOY_FAULTS": faults})
        assert code == 0, out
        picks = read_events(run_dir, "interval_chosen")
        assert picks, "no interval recorded"
        chosen[name] = picks[-1]
        saves = read_events(run_dir, "checkpoint_saved")
        wall = read_events(run_dir, "worker_done")[0]["time"] - read_events(run_dir, "started")[0]["time"]
        print(name, picks[-1]["interval_steps"], "overhead", sum(s["stall_s"] for s in saves[:-1]) / wall)
    # With a synchronous 0.5 s save, the stall is large: the interval must be longer.
    assert chosen["slow"]["interval_s"] > chosen["fast"]["interval_s"]
    assert chosen["slow"]["cost_s"] > chosen["fast"]["cost_s"]


def test_plan_prints_each_figure_with_its_unit() -> None:
    def plan(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "flows.cli.main", "plan", *args], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    out = plan("--save-hours", "0.01")
    assert "None" not in out and "- (give --params)" in out, out  # sizes are estimated from --params only
    assert "7.746 h" in out and "0.2582%" in out and "yes" in out, out  # interval, overhead, resume beats rerun
    sized = plan("--params", "7e9", "--gpus", "64")
    assert "84 GB" in sized  # 7e9 parameters x (weights + 2 Adam moments) x 4 bytes
    # convoy's one copy per node: rank 0's whole state replicated, 8 of 64 shares sharded
    assert "replicated │     84 GB" in sized and "sharded    │   10.5 GB" in sized, sized


def _memory_schedule(mtbf_s: float, cost_s: float = 0.003, step_s: float = 0.037) -> Any:
    """A memory-tier schedule at the defaults' band (0.5-3 %) that has measured its costs."""
    from training.checkpointing.schedule import MemorySchedule

    schedule = MemorySchedule("auto", max_overhead=0.03, min_overhead=0.005, mtbf_s=mtbf_s)
    schedule.observe_step(step_s)
    schedule.saved(0, cost_s)
    return schedule


def test_memory_tier_auto_is_young_daly_held_between_two_shares_of_the_step() -> None:
    """bench/goodput.py's model (3 ms snapshots, 37 ms steps): Young/Daly inside the band, the band's
    edges outside it.  The cap was the whole policy before, and spent 3 % at any failure rate."""
    cost, step = 0.003, 0.037
    steps_costing = {share: math.ceil(cost / (share * step)) for share in (0.03, 0.005)}  # 3 and 17 steps
    between = _memory_schedule(mtbf_s=15.0)  # one kill every 15 s: Young/Daly is 0.3 s, 9 steps
    assert between.interval_steps() == math.ceil(young_daly_h(cost, 15.0) / step) == 9
    assert steps_costing[0.03] < 9 < steps_costing[0.005]
    assert _memory_schedule(mtbf_s=0.5).interval_steps() == steps_costing[0.03]  # failing all the time: the cap
    assert _memory_schedule(mtbf_s=86400).interval_steps() == steps_costing[0.005]  # a failure a day: the floor
    assert _memory_schedule(mtbf_s=math.inf).interval_steps() == steps_costing[0.005]
    assert _memory_schedule(mtbf_s=15.0, cost_s=1e-9).interval_steps() == 1  # free snapshots: every step


def test_memory_tier_learns_the_runs_mtbf_and_the_disk_tier_keeps_the_machines(tmp_path: Path) -> None:
    """Worker deaths resume from RAM: they set the memory tier's interval, not the disk tier's."""
    from training.checkpointing.schedule import MemorySchedule, SaveSchedule
    from training.config import CheckpointConfig
    from training.events import append_event

    policy = CheckpointConfig(every_steps="auto", mtbf_hours=24.0)
    append_event(tmp_path, "flow_started")
    for _ in range(4):
        append_event(tmp_path, "failure", failure="killed")
    assert MemorySchedule.for_run(policy, tmp_path).mtbf_s < 60  # 4 failures within a second or so
    save = SaveSchedule.for_run(policy, 50, tmp_path, memory_tier=True).adaptive
    assert save is not None and save.mtbf_s == 24 * 3600
    save = SaveSchedule.for_run(policy, 50, tmp_path, memory_tier=False).adaptive
    assert save is not None and save.mtbf_s < 60
    assert MemorySchedule.for_run(CheckpointConfig(memory_every_steps=4), tmp_path).interval_steps() == 4


def test_memory_overhead_band_must_be_a_band() -> None:
    from pydantic import ValidationError

    from training.config import CheckpointConfig

    with pytest.raises(ValidationError, match="memory_min_overhead = 0.05 is above memory_max_overhead = 0.03"):
        CheckpointConfig(memory_min_overhead=0.05)
