"""The built-in example task: its first logged loss is what an untrained byte-level model gives."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.engine_util import logged_losses, make_run, run_worker
from tests.flow_util import REPO
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


def test_entropy_floor_is_the_chains_entropy_rate() -> None:
    """The floor ``convoy prepare`` records is exact: the text's mean negative log-likelihood under
    the generating chain itself (the best any model can do) agrees with it to sampling noise."""
    import numpy as np

    from training.datapipe.corpus import ALPHABET, chain, synthetic_text

    text, floor = synthetic_text(200_000, 7)
    probs, k = chain(7), len(ALPHABET)
    ids = np.array([ALPHABET.index(c) for c in text])
    nll = -np.log(probs[ids[:-2] * k + ids[1:-1], ids[2:]]).mean()
    assert abs(nll - floor) < 0.01, (nll, floor)
    assert floor < math.log(len(ALPHABET)) - 1.0  # far below the unigram: there is something to learn


@pytest.mark.slow
def test_the_demo_learns_to_near_the_entropy_floor(tmp_path: Path) -> None:
    """``make demo``'s config (params.yaml: 600 steps), trained by one worker: the final loss is
    within 0.25 nats of the corpus's entropy floor, and the loss keeps falling over the run (each
    100-step window's mean below the one before, from step 100 on)."""
    from statistics import mean

    from training.config import load_config
    from training.datapipe.corpus import entropy_floor, prepare
    from training.rundir import open_run
    from training.tracking.progress import run_status

    cfg = load_config(
        REPO / "params.yaml",
        [f"runs_dir={tmp_path / 'runs'}", f"data.prepared_dir={tmp_path / 'data'}", "tracking.mlflow=false"],
    )
    prepare(cfg.data, cfg.train.seed)
    run_dir = open_run(cfg)
    code, out = run_worker(run_dir, cfg.train.total_steps, timeout=900)
    assert code == 0, out
    losses = logged_losses(run_dir)
    floor = entropy_floor(cfg.data, cfg.task)
    assert floor is not None and len(losses) == cfg.train.total_steps == 600
    final = losses[-1][1]
    print(
        f"\nfloor {floor:.4f}, final loss {final:.4f} (+{final - floor:.4f}), last-50 mean "
        f"{mean(v for _, v in losses[-50:]):.4f}"
    )
    assert final <= floor + 0.25
    windows = [mean(v for s, v in losses if lo < s <= lo + 100) for lo in range(100, 600, 100)]
    assert all(b < a for a, b in zip(windows, windows[1:], strict=False)), windows
    st = run_status(cfg, run_dir)  # what `convoy status` prints next to the loss
    assert st["entropy_floor"] == floor and st["loss"] == final
