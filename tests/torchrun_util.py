"""Helpers for the multi-rank tests (torchrun, gloo on CPU): start a worker on some ranks, wait for
it, read its losses and checkpoint cursor, reopen a run with another world size."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.engine_util import SMALL, kill_group, make_run, wait_for_step
from training.checkpointing.store import CheckpointStore
from training.config import load_config
from training.rundir import open_run

#: Steps of the multi-rank runs (tests/test_distributed.py, test_sharded.py, test_fsdp.py).
TOTAL = 60
#: Documented tolerance for losses after a world-size change (dropout masks are drawn per rank and
#: the all-reduce sums in another order, so values differ slightly; the sample sequence does not).
RESIZE_LOSS_TOLERANCE = 0.25


def torchrun_cmd(run_dir: Path, until: int, ranks: int) -> list[str]:
    """The worker command on ``ranks`` ranks: torchrun for several, the plain worker for one."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return [
        *(launch if ranks > 1 else [sys.executable]),
        "-m",
        "training.worker",
        "--run-dir",
        str(run_dir),
        "--until-step",
        str(until),
    ]


def torchrun(run_dir: Path, until: int, ranks: int) -> subprocess.Popen:
    return subprocess.Popen(
        torchrun_cmd(run_dir, until, ranks),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(p: subprocess.Popen) -> str:
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    return out


def set_ranks(tmp: Path, name: str, ranks: int, batch: int = 8) -> None:
    cfg = load_config(
        None,
        SMALL
        + [
            f"runs_dir={tmp / 'runs'}",
            f"data.prepared_dir={tmp / 'data'}",
            f"run_name={name}",
            f"train.total_steps={TOTAL}",
            f"train.ranks={ranks}",
            f"train.batch_size={batch}",
        ],
    )
    open_run(cfg)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["metrics"]["loss"] for r in rows}


def cursor_at_end(run_dir: Path) -> dict:
    ck = CheckpointStore(run_dir).latest_valid(record=False)
    return json.loads((ck.path / "state.json").read_text())["cursor"]


def ref_and_killed_on_two_ranks(tmp: Path, extra: list[str]) -> tuple[Path, Path, str]:
    """An uninterrupted 2-rank run, and one SIGKILLed (launcher and both ranks) at step 25 and
    resumed to the end; returns both run dirs and the resumed run's output."""
    ref = make_run(tmp, "ref2", extra)
    finish(torchrun(ref, TOTAL, 2))
    run = make_run(tmp, "killed2", extra)
    p = torchrun(run, TOTAL, 2)
    wait_for_step(run, p, 25)
    time.sleep(0.05)
    kill_group(p)
    p.wait()
    return ref, run, finish(torchrun(run, TOTAL, 2))
