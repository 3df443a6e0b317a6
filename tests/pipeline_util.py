"""Helpers for the data-pipeline tests (tests/test_data_pipelines.py, test_stream_adapters.py):
the runs' settings, the CLI in-process, scenarios of real workers killed twice at random steps and
resumed (run side by side), each step's logged sample ids."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from typer.testing import CliRunner

from flows.cli.main import app
from tests.engine_util import final_digest, kill_group, make_run, run_worker, start_worker, wait_for_step

TOTAL = 24
SLOW = {"CONVOY_FAULTS": "step_delay=0.05"}  # kills driven by heartbeats land inside the run
BASE = [
    f"train.total_steps={TOTAL}",
    f"train.chunk_steps={TOTAL}",
    "train.batch_size=8",
    "train.lr=0.05",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=2",
    "data.seq_len=16",
    "task_args={}",
]


def cli(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, [ln for ln in result.output.splitlines() if ln.strip()]


def kill_twice(run_dir: Path, rng: random.Random) -> list[int]:
    """SIGKILL the worker's process group (loader workers included) at a random moment of a
    random step, twice (the second target beyond the first kill's step, so a stale beat of the
    killed worker cannot trigger it); the caller runs the last worker to the end."""
    kills = []
    for target in (rng.randrange(5, 10), rng.randrange(14, 19)):
        p = start_worker(run_dir, TOTAL, SLOW)
        reached = wait_for_step(run_dir, p, target)
        assert reached is not None, p.communicate()[0]
        time.sleep(rng.random() * 0.05)
        kill_group(p)
        p.wait()
        kills.append(reached)
    return kills


_OPENING = threading.Lock()  # make_run (re)writes the shared corpus file: one at a time


def opened(tmp: Path, name: str, extra: list[str]) -> Path:
    with _OPENING:
        return make_run(tmp, name, extra)


def scenario(tmp: Path, name: str, extra: list[str], kills: int | None = None, then: list[str] | None = None) -> dict:
    """One run: uninterrupted (``kills`` None) or killed twice with seed ``kills`` and resumed,
    after re-opening it with ``then`` (e.g. another num_workers) if given."""
    run_dir = opened(tmp, name, extra)
    landed = kill_twice(run_dir, random.Random(kills)) if kills is not None else []
    if then is not None:
        run_dir = opened(tmp, name, then)
    code, out = run_worker(run_dir, TOTAL)
    assert code == 0, out
    return {"digest": final_digest(run_dir), "kills": landed, "dir": run_dir}


def side_by_side(tmp: Path, runs: dict[str, tuple]) -> dict[str, dict]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(scenario, tmp, name, *args) for name, args in runs.items()}
        return {name: f.result() for name, f in futures.items()}


def step_ids(run_dir: Path) -> list[list[int]]:
    """Each step's sample ids; a step trained twice (lost to a kill, replayed) must have had the
    same ids both times."""
    seen: dict[int, list[int]] = {}
    for line in (run_dir / "ids.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert seen.setdefault(row["step"], row["ids"]) == row["ids"], row
    assert sorted(seen) == list(range(1, TOTAL + 1))
    return [seen[s] for s in range(1, TOTAL + 1)]
