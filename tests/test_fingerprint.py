"""The config fingerprint: pinned values, and which settings it covers.

Why pinned: a run is keyed by its fingerprint: its directory under ``on_config_change: new_run``
(``runs/<name>@<fingerprint[:8]>``), the fingerprint each checkpoint's manifest names, and the
run's index in the DVC remote (``convoy/runs/<name>/<fingerprint>/``).  A fingerprint that changes
for the same params forks every existing run into a new, empty one (``new_run``), or refuses to
resume it (``refuse``), and a clone no longer finds its uploaded checkpoints.  These hex strings
were computed from the code as it was before the fingerprint became opt-in; they must never change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from tests.engine_util import SMALL
from training import config
from training.config import RunConfig, TrainConfig, load_config
from training.trajectory import Trajectory, marker

REPO = Path(__file__).resolve().parents[1]

GOLDEN = {
    # `convoy train` without a params.yaml: the built-in defaults.
    "defaults": ([], "4f9558eef94a86d3"),
    "amp on": (["train.amp=true"], "14a406c4ff3722bc"),
    "amp float16 on cuda": (["train.device=cuda", "train.amp=true", "train.amp_dtype=float16"], "92744585707caabc"),
    "amp off, dtype set": (["train.amp=false", "train.amp_dtype=float16"], "4f9558eef94a86d3"),
    "grad accumulation": (["train.grad_accum_steps=4"], "776a037b19b5df02"),
    "child run": (
        ["init_from.run=runs/demo@3be1596c", "init_from.step=600", "init_from.digest=abc123"],
        "1b762f773b66f360",
    ),
    "engine tests' small run": (SMALL, "809fab0cfa4bd14e"),
}


@pytest.mark.parametrize("name", list(GOLDEN))
def test_golden_fingerprint(name: str) -> None:
    overrides, expected = GOLDEN[name]
    assert load_config(None, overrides).fingerprint() == expected


@pytest.mark.parametrize(
    ("params", "expected"), [("params.yaml", "e5b7ddb683f20a4e"), ("params-hf.yaml", "c6fc36236eafbc63")]
)
def test_golden_fingerprint_of_the_project_params(params: str, expected: str) -> None:
    assert load_config(REPO / params, []).fingerprint() == expected


def test_golden_fingerprint_of_a_file_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # data.path is hashed as written: relative, so the same anywhere
    (tmp_path / "corpus.txt").write_text("hello world corpus text\n")
    cfg = load_config(None, ["data.source=file", "data.path=corpus.txt"])
    assert cfg.fingerprint() == "4728f0751671fa09"


class LoggedTrain(TrainConfig):
    """``train`` with one more setting, not marked: how a logging-only setting is added."""

    log_every: int = 10


class LoggedRun(RunConfig):
    train: Annotated[LoggedTrain, Trajectory()] = Field(default_factory=LoggedTrain)


class HashedTrain(TrainConfig):
    """The same setting marked: the control that shows the test above can fail."""

    log_every: Annotated[int, Trajectory()] = 10


class HashedRun(RunConfig):
    train: Annotated[HashedTrain, Trajectory()] = Field(default_factory=HashedTrain)


def test_an_unmarked_setting_is_never_hashed() -> None:
    defaults = GOLDEN["defaults"][1]
    assert LoggedRun().fingerprint() == defaults
    assert LoggedRun(train=LoggedTrain(log_every=1)).fingerprint() == defaults
    assert HashedRun().fingerprint() != defaults
    assert HashedRun(train=HashedTrain(log_every=1)).fingerprint() != HashedRun().fingerprint()


#: A config in which every marked setting is hashed (AMP on, a parent run, a data path).
EVERYTHING = [
    "train.amp=true",
    "init_from.run=runs/demo@3be1596c",
    "init_from.step=600",
    "init_from.digest=abc123",
    f"data.path={REPO / 'params.yaml'}",
]

#: One change of each marked setting; the test below fails when a marked setting has none here.
MARKED_CHANGES = {
    "task": "task=training.examples.hf_causal_lm:build",
    "task_args": "task_args.d_model=32",
    "init_from.run": "init_from.run=runs/other",
    "init_from.step": "init_from.step=5",
    "init_from.digest": "init_from.digest=def456",
    "data.source": "data.source=file",
    "data.path": f"data.path={REPO / 'params-hf.yaml'}",
    "data.synthetic_chars": "data.synthetic_chars=50000",
    "data.val_fraction": "data.val_fraction=0.1",
    "data.seq_len": "data.seq_len=32",
    "train.total_steps": "train.total_steps=700",
    "train.batch_size": "train.batch_size=32",
    "train.lr": "train.lr=1e-4",
    "train.parallel": "train.parallel=fsdp",
    "train.weight_decay": "train.weight_decay=0.1",
    "train.warmup_steps": "train.warmup_steps=5",
    "train.grad_clip": "train.grad_clip=0.5",
    "train.seed": "train.seed=1",
    "train.device": "train.device=cuda",
    "train.amp": "train.amp=false",
    "train.amp_dtype": "train.amp_dtype=bfloat16",
    "train.deterministic": "train.deterministic=false",
    "train.grad_accum_steps": "train.grad_accum_steps=2",
    "train.ema_decay": "train.ema_decay=0.99",
    "train.compile": "train.compile=model",
}


def _marked_settings(section: BaseModel, prefix: str = "") -> set[str]:
    """Dotted names of the marked leaf settings of ``section`` (marked sections walked into)."""
    names: set[str] = set()
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if marker(field) is None:
            continue
        if isinstance(value, BaseModel):
            names |= _marked_settings(value, f"{prefix}{name}.")
        else:
            names.add(f"{prefix}{name}")
    return names


def test_every_marked_setting_changes_the_fingerprint() -> None:
    base = load_config(None, EVERYTHING)
    assert _marked_settings(base) == set(MARKED_CHANGES)
    for key, change in MARKED_CHANGES.items():
        assert load_config(None, [*EVERYTHING, change]).fingerprint() != base.fingerprint(), key


def test_the_synthetic_generator_version_changes_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    before = load_config(None, []).fingerprint()
    monkeypatch.setattr(config, "SYNTHETIC_GENERATOR", config.SYNTHETIC_GENERATOR + 1)
    assert load_config(None, []).fingerprint() != before


UNMARKED_CHANGES = [
    "run_name=other",
    "runs_dir=elsewhere",
    "on_config_change=new_run",
    "data.prepared_dir=elsewhere",
    "data.num_workers=2",
    "train.chunk_steps=100",
    "train.ranks=2",
    "train.nnodes=2",
    "train.hosts=[a, b]",
    "train.eval_every=10",
    "train.eval_samples=64",
    "checkpoint.every_steps=7",
    "heartbeat.stall_s=5",
    "orchestration.retries=1",
    "tracking.mlflow=false",
]


def test_settings_that_leave_the_trajectory_alone_are_not_hashed() -> None:
    base = load_config(None, EVERYTHING)
    changed = load_config(None, [*EVERYTHING, *UNMARKED_CHANGES])
    assert changed.fingerprint() == base.fingerprint()
    assert changed.model_dump() != base.model_dump()  # the changes did apply
