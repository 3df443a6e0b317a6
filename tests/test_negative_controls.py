"""Negative controls: the bitwise comparison sees every component of the train state (issue 45).

The suite's exactness tests end on "the resumed run's digest and every step's loss equal the
uninterrupted run's".  That is only as strong as what it can see: here each component of the
state is withheld from one resume (``CONVOY_FAULTS=withhold=<component>``: left as the freshly
built task has it) and the same comparison must then **fail**, from a disk checkpoint and from
the memory tier's snapshot alike.  A control that passed would be a hole in the state or in the
comparison.  The same resume withholding nothing must pass (the harness itself is sound).

Not run here, for want of what they steer: the AMP scaler and the CUDA generator (a CUDA device;
``rng.cuda`` is restored by the same code path per device, tests/test_cuda.py covers it there).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine_util import (
    final_digest,
    kill_group,
    logged_losses,
    make_run,
    run_worker,
    start_worker,
    wait_for_step,
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


def resume_withholding(source: Path, name: str, withheld: str, tiers: Path) -> tuple[Path, int, str]:
    """A copy of ``source`` (and of its memory tier, where it has one) resumed to ``TOTAL`` with
    ``withheld`` left out of the restore: the copy, the worker's exit code and its output."""
    copy = source.parent / name
    shutil.copytree(source, copy)
    mine = tier_root(source)
    if mine is not None and mine.is_dir():
        shutil.copytree(mine, tier_root(copy))
    code, out = run_worker(copy, TOTAL, {DIR_ENV: str(tiers), "CONVOY_FAULTS": f"withhold={withheld}"})
    return copy, code, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The uninterrupted references and the two resumable sources of each task: stopped at
    ``HALF`` (a disk checkpoint, no snapshot newer) and killed at ``KILLED_AT`` (the memory
    tier's snapshot newer than the disk's).  The tiers live in the test's folder (``DIR_ENV``,
    here and in every worker), where a copy of a run gets a copy of its tier."""
    tmp = tmp_path_factory.mktemp("controls")
    tiers = tmp / "tiers"
    env = {DIR_ENV: str(tiers)}
    out: dict[str, Path] = {"tiers": tiers}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DIR_ENV, str(tiers))
        yield _sources(tmp, env, out)


def _sources(tmp: Path, env: dict[str, str], out: dict[str, Path]) -> dict[str, Path]:
    for task, extra in (("map", CONTROL), ("stream", STREAM)):
        out[f"{task}-reference"] = make_run(tmp, f"{task}-reference", extra)
        assert run_worker(out[f"{task}-reference"], TOTAL, env)[0] == 0
        out[f"{task}-disk"] = make_run(tmp, f"{task}-disk", [*extra, "checkpoint.memory_every_steps=null"])
        assert run_worker(out[f"{task}-disk"], HALF, env)[0] == 0
        out[f"{task}-memory"] = make_run(tmp, f"{task}-memory", [*extra, *MEMORY_TIER])
        p = start_worker(out[f"{task}-memory"], TOTAL, {**env, "CONVOY_FAULTS": f"slow_step={KILLED_AT + 1}:60"})
        assert wait_for_step(out[f"{task}-memory"], p, KILLED_AT) == KILLED_AT
        time.sleep(0.5)  # the beat comes before the step's snapshot; step KILLED_AT + 1 waits 60 s
        kill_group(p)
        p.wait()
    return out


@pytest.mark.parametrize("tier", ["disk", "memory"])
def test_a_resume_that_withholds_nothing_passes(runs: dict[str, Path], tier: str) -> None:
    for task in ("map", "stream"):
        copy, code, out = resume_withholding(runs[f"{task}-{tier}"], f"{task}-{tier}-nothing", "", runs["tiers"])
        assert code == 0, out
        (resumed,) = read_events(copy, Event.RESUMED)
        assert resumed["tier"] == tier and (resumed["step"] > HALF) == (tier == "memory"), resumed
        assert same_as(copy, runs[f"{task}-reference"])


@pytest.mark.parametrize("tier", ["disk", "memory"])
@pytest.mark.parametrize("component", [*MAP_CONTROLS, "stream"])
def test_a_resume_that_withholds_one_component_fails_the_comparison(
    runs: dict[str, Path], tier: str, component: str
) -> None:
    """Each control ends differently from the reference, or, where a check guards the component
    (:data:`GUARDED`), is refused by that check before it trains: never the reference's result."""
    task = "stream" if component == "stream" else "map"
    copy, code, out = resume_withholding(runs[f"{task}-{tier}"], f"{task}-{tier}-{component}", component, runs["tiers"])
    assert f"withholds {component}" in out  # the control announced itself
    assert "resumed from step" in out and (("memory snapshot" in out) == (tier == "memory")), out
    if component in GUARDED:
        assert code != 0 and GUARDED[component] in out, out
        return
    assert code == 0, out
    assert not same_as(copy, runs[f"{task}-reference"]), f"withholding {component} went unseen: a hole"


def test_every_component_has_a_control() -> None:
    """A component added to the state without a control here fails this test."""
    assert set(COMPONENTS) == set(MAP_CONTROLS) - set(BUFFERS) - set(EXTRA) | CUDA_ONLY | {"stream"}
