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

import pytest

from tests.engine_util import SMALL
from training.config import load_config

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
