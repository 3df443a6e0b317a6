"""The built-in example task: its first logged loss is what an untrained byte-level model gives."""

from __future__ import annotations

import math
from pathlib import Path

from tests.engine_util import logged_losses, make_run, run_worker
from training.examples.char_gpt import VOCAB


def test_first_logged_loss_is_near_ln_vocab(tmp_path: Path) -> None:
    """A uniform guess over 256 bytes costs ln 256 ≈ 5.55 nats; the first logged loss must be
    within 1.0 of it (with N(0, 1) tied embeddings it was ~38, flattening every loss chart)."""
    run_dir = make_run(tmp_path, "init")
    code, out = run_worker(run_dir, 2)
    assert code == 0, out
    first_step, first_loss = logged_losses(run_dir)[0]
    assert first_step == 1
    assert abs(first_loss - math.log(VOCAB)) < 1.0, first_loss
