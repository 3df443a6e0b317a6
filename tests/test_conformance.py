"""The fast subset of the conformance matrix (bench/conformance.py): its trials are reproducible,
and one real trial through the real services passes — an MLflow server killed right after a
checkpoint commit while a map-style, augmented run trains through the flow, judged against its
uninterrupted reference (digest, every loss, one MLflow point per (metric, step), no committed
step lost).  The full matrix (>= 200 trials) runs outside the suite; see bench/RESULTS.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from conformance import FAULTS, MOMENTS, all_cells, draw_trials  # noqa: E402


def test_trials_are_drawn_from_the_seed_alone_and_cover_the_matrix() -> None:
    assert draw_trials(50, 7, 40) == draw_trials(50, 7, 40)
    assert draw_trials(50, 7, 40) != draw_trials(50, 8, 40)
    many = draw_trials(400, 1, 40)
    assert {t.fault for t in many} == set(FAULTS) and {t.moment for t in many} == set(MOMENTS)
    assert {t.cell for t in many} == set(all_cells()) and len(all_cells()) == 16
    assert all(3 <= t.at_step < 40 * 2 // 3 for t in many)
    only = draw_trials(20, 1, 40, cells=["stream-w2-r1"], faults=["sigstop"])
    assert {(t.cell.name, t.fault) for t in only} == {("stream-w2-r1", "sigstop")}


@pytest.mark.slow
def test_one_real_trial_passes_and_the_report_ends_with_the_count(prefect_api: str) -> None:
    """On the session's Prefect server (the fault is MLflow's, the bench's own server)."""
    cmd = [sys.executable, str(REPO / "bench" / "conformance.py"), "--trials", "1", "--seed", "2", "--steps", "24"]
    cmd += ["--cells", "map-aug-w0-r1", "--faults", "mlflow-kill", "--prefect-api", prefect_api]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=560)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert any(line.startswith("trial    1  map-aug-w0-r1") and line.endswith("pass") for line in lines), lines
    assert lines[-1] == "1 passed, 0 failed"
