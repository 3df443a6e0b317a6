"""The vision example (issue 44, item 5): an image classifier with torch-only augmentation in two
loader workers and BatchNorm buffers, killed twice, ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_util import killed_run_matches, logged_losses, make_run, run_worker

TOTAL = 60
VISION = [
    "task=training.examples.vision_cnn:build",
    "task_args={}",
    "train.lr=0.05",
    "train.batch_size=32",
    "data.num_workers=2",
    "train.eval_every=20",
    "train.eval_samples=64",
]


@pytest.mark.slow
def test_the_vision_example_learns_and_resumes_bitwise_after_two_kills(tmp_path: Path) -> None:
    ref = make_run(tmp_path, "reference", VISION)
    code, out = run_worker(ref, TOTAL)
    assert code == 0, out
    losses = dict(logged_losses(ref))
    assert losses[TOTAL] < losses[1], losses  # it learns the bars' angle
    killed_run_matches(tmp_path, VISION, ref, TOTAL, [19, 42], seed=4405)
