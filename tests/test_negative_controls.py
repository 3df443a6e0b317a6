"""Negative controls: the bitwise comparison sees every component of the train state (issue 45).

The suite's exactness tests end on "the resumed run's digest and every step's loss equal the
uninterrupted run's".  That is only as strong as what it can see: here each component of the
state is withheld from one resume (``CONVOY_FAULTS=withhold=<component>``: left as the freshly
built task has it) and the same comparison must then **fail**, from a disk checkpoint and from
the memory tier's snapshot alike.  A control that passed would be a hole in the state or in the
comparison.  The same resume withholding nothing must pass (the harness itself is sound).

The per-sample seeding of python, numpy and torch while a sample is fetched (in the loop or in a
loader worker) keeps no state of its own: it is derived from the seed and the sample's place in
the run, which the ``cursor`` control covers (and, for a stream, its loader workers' position, the
``stream`` control).

Not run here, for want of what they steer: the AMP scaler and the CUDA generator (a CUDA device;
``rng.cuda`` is restored by the same code path per device, tests/test_cuda.py covers it there).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tasks.supervision.worker_zygote import WorkerZygote
from tests.engine_util import (
    final_digest,
    logged_losses,
    make_run,
    wait_for_step,
    worker_cmd,
)
from training.checkpointing.memory.memory_tier import DIR_ENV
from training.events import Event, read_events
from training.run_memory import tier_root
from training.state import COMPONENTS

pytestmark = pytest.mark.slow

TOTAL, HALF, KILLED_AT = 24, 8, 13
CONTROL = [
    "task=tests.control_tasks:build",
    "task_args={}",
    f"train.total_steps={TOTAL}",
    f"train.chunk_steps={TOTAL}",
    "train.lr=0.01",
    "train.warmup_steps=0",
    "train.ema_decay=0.9",
    f"checkpoint.every_steps={HALF}",
]
STREAM = [
    "task=tests.pipeline_tasks:build_counter",
    "task_args={}",
    f"train.total_steps={TOTAL}",
    f"train.chunk_steps={TOTAL}",
    "train.lr=0.05",
    "data.num_workers=2",
    f"checkpoint.every_steps={HALF}",
]
#: A snapshot every step, two slots: one stays free while a disk save persists from the other.
MEMORY_TIER = ["checkpoint.memory_every_steps=1", "checkpoint.memory_slots=2"]
#: Components only a CUDA run has (see the module docstring).
CUDA_ONLY = {"scaler", "rng.cuda"}
#: The control task's optimizer buffers (AdamW) and extra state (the EMA of train.ema_decay).
BUFFERS = ("optimizer.exp_avg", "optimizer.exp_avg_sq", "optimizer.step")
EXTRA = ("extra.ema",)
#: Components whose absence a check refuses before a step is trained (what it says).
GUARDED = {"stream": "holds no stream position"}
MAP_CONTROLS = tuple(c for c in COMPONENTS if c not in CUDA_ONLY | {"stream"}) + BUFFERS + EXTRA


def same_as(run_dir: Path, reference: Path) -> bool:
    """The suite's comparison: the final digest and every step's loss."""
    return final_digest(run_dir) == final_digest(reference) and logged_losses(run_dir) == logged_losses(reference)


@dataclass
class Controls:
    """The module's runs, its tiers' folder and a worker zygote per task (imports done once, the
    recovery path of a real run): every worker of the module is forked from one."""

    tmp: Path
    zygotes: dict[str, WorkerZygote] = field(default_factory=dict)
    runs: dict[str, Path] = field(default_factory=dict)

    def start(self, task: str, run_dir: Path, until: int, faults: str = "") -> tuple[Any, Path]:
        """A worker forked for ``run_dir``, and the log it writes."""
        env = {**os.environ, DIR_ENV: str(self.tmp / "tiers"), "CONVOY_FAULTS": faults}
        log = run_dir / "logs" / f"worker-{time.time_ns()}.log"
        handle = self.zygotes[task].fork(worker_cmd(run_dir, until), log, "control", cwd=os.getcwd(), env=env)
        assert handle is not None, "the zygote did not fork"
        return handle.proc, log

    def train(self, task: str, run_dir: Path, until: int, faults: str = "") -> tuple[int, str]:
        proc, log = self.start(task, run_dir, until, faults)
        return proc.wait(300), log.read_text()

    def resume_withholding(self, task: str, tier: str, name: str, withheld: str) -> tuple[Path, int, str]:
        """A copy of the task's ``tier`` source (and of its memory tier) resumed to ``TOTAL`` with
        ``withheld`` left out of the restore: the copy, the worker's exit code and its output."""
        source = self.runs[f"{task}-{tier}"]
        copy = source.parent / name
        shutil.copytree(source, copy)
        mine = tier_root(source)
        if mine is not None and mine.is_dir():
            shutil.copytree(mine, tier_root(copy))
        return (copy, *self.train(task, copy, TOTAL, f"withhold={withheld}"))


@pytest.fixture(scope="module")
def controls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controls]:
    """Per task, the uninterrupted reference and two resumable sources: stopped at ``HALF`` (a
    disk checkpoint, no snapshot newer) and killed at ``KILLED_AT`` (the memory tier's snapshot
    newer than the disk's).  The tiers live in the test's folder (``DIR_ENV``, here and in every
    worker), where a copy of a run gets a copy of its tier."""
    made = Controls(tmp_path_factory.mktemp("controls"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DIR_ENV, str(made.tmp / "tiers"))
        try:
            for task, extra in (("map", CONTROL), ("stream", STREAM)):
                _sources(made, task, extra)
            yield made
        finally:
            for zygote in made.zygotes.values():
                zygote.close()


def _sources(made: Controls, task: str, extra: list[str]) -> None:
    runs = made.runs
    runs[f"{task}-reference"] = make_run(made.tmp, f"{task}-reference", extra)
    made.zygotes[task] = WorkerZygote(runs[f"{task}-reference"])
    assert made.train(task, runs[f"{task}-reference"], TOTAL)[0] == 0
    runs[f"{task}-disk"] = make_run(made.tmp, f"{task}-disk", [*extra, "checkpoint.memory_every_steps=null"])
    assert made.train(task, runs[f"{task}-disk"], HALF)[0] == 0
    runs[f"{task}-memory"] = make_run(made.tmp, f"{task}-memory", [*extra, *MEMORY_TIER])
    p, _ = made.start(task, runs[f"{task}-memory"], TOTAL, f"slow_step={KILLED_AT + 1}:60")
    assert wait_for_step(runs[f"{task}-memory"], p, KILLED_AT) == KILLED_AT
    time.sleep(0.5)  # the beat comes before the step's snapshot; step KILLED_AT + 1 waits 60 s
    os.killpg(p.pid, signal.SIGKILL)  # the forked worker leads its own process group
    p.wait(60)


@pytest.mark.parametrize("tier", ["disk", "memory"])
def test_a_resume_that_withholds_nothing_passes(controls: Controls, tier: str) -> None:
    for task in ("map", "stream"):
        copy, code, out = controls.resume_withholding(task, tier, f"{task}-{tier}-nothing", "")
        assert code == 0, out
        (resumed,) = read_events(copy, Event.RESUMED)
        assert resumed["tier"] == tier and (resumed["step"] > HALF) == (tier == "memory"), resumed
        assert same_as(copy, controls.runs[f"{task}-reference"])


@pytest.mark.parametrize("tier", ["disk", "memory"])
@pytest.mark.parametrize("component", [*MAP_CONTROLS, "stream"])
def test_a_resume_that_withholds_one_component_fails_the_comparison(
    controls: Controls, tier: str, component: str
) -> None:
    """Each control ends differently from the reference, or, where a check guards the component
    (:data:`GUARDED`), is refused by that check before it trains: never the reference's result."""
    task = "stream" if component == "stream" else "map"
    copy, code, out = controls.resume_withholding(task, tier, f"{task}-{tier}-{component}", component)
    assert f"withholds {component}" in out  # the control announced itself
    assert "resumed from step" in out and (("memory snapshot" in out) == (tier == "memory")), out
    if component in GUARDED:
        assert code != 0 and GUARDED[component] in out, out
        return
    assert code == 0, out
    assert not same_as(copy, controls.runs[f"{task}-reference"]), f"withholding {component} went unseen: a hole"


def test_every_component_has_a_control() -> None:
    """A component added to the state without a control here fails this test."""
    assert set(COMPONENTS) == set(MAP_CONTROLS) - set(BUFFERS) - set(EXTRA) | CUDA_ONLY | {"stream"}
