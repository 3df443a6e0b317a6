"""Bad configurations: one-line error, non-zero exit, nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.config import ConfigError, load_config

BAD = {
    "negative steps": ({"train": {"total_steps": -5}}, "train.total_steps"),
    "unknown key": ({"train": {"lr": 0.1, "learning_rate": 0.1}}, "unknown key 'train.learning_rate'"),
    "wrong type": ({"train": {"batch_size": "sixteen"}}, "train.batch_size"),
    "chunk larger than total": ({"train": {"total_steps": 100, "chunk_steps": 500}}, "chunk_steps"),
    "missing data file": ({"data": {"source": "file", "path": "no/such/corpus.txt"}}, "no/such/corpus.txt"),
    "bad task import path": ({"task": "nosuchpkg.model:build"}, "nosuchpkg"),
    "task without factory": ({"task": "training.examples.char_gpt:nothing_here"}, "nothing_here"),
    "batch not divisible by ranks": ({"train": {"batch_size": 10, "ranks": 4}}, "ranks"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_config_one_line_error_and_nothing_written(tmp_path: Path, name: str) -> None:
    data, needle = BAD[name]
    data = {"runs_dir": str(tmp_path / "runs"), **data}
    data.setdefault("data", {})["prepared_dir"] = str(tmp_path / "data")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(data))
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli.main", "prepare", str(params)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and lines[0].startswith("error:")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # wrote nothing


def test_overrides_are_typed_and_nested() -> None:
    cfg = load_config(None, ["train.lr=3e-4", "checkpoint.every_seconds=null", "task_args.dropout=0.2"])
    assert cfg.train.lr == 3e-4 and cfg.checkpoint.every_seconds is None and cfg.task_args["dropout"] == 0.2
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["train.lr"])


def test_fingerprint_ignores_cadence_but_not_trajectory() -> None:
    base = load_config(None, [])
    assert base.fingerprint() == load_config(None, ["checkpoint.every_steps=7", "train.chunk_steps=100"]).fingerprint()
    assert base.fingerprint() != load_config(None, ["train.lr=1e-4"]).fingerprint()


def test_worker_exits_78_on_missing_prepared_data(tmp_path: Path) -> None:
    from tests.engine_util import make_run, run_worker

    run_dir = make_run(tmp_path)
    (tmp_path / "data" / "corpus.txt").unlink()
    code, out = run_worker(run_dir, 10)
    assert code == 78, out
    assert "run `convoy prepare` first" in out
    assert not any((run_dir / "checkpoints").iterdir())


def test_trajectory_change_refused_unless_explicitly_allowed(tmp_path: Path) -> None:
    from tests.engine_util import SMALL, make_run, run_worker
    from training.rundir import open_run

    run_dir = make_run(tmp_path)
    assert run_worker(run_dir, 20)[0] == 0
    changed = load_config(
        None,
        SMALL
        + [f"runs_dir={tmp_path / 'runs'}", f"data.prepared_dir={tmp_path / 'data'}", "run_name=run", "train.lr=0.01"],
    )
    with pytest.raises(ConfigError, match="--allow-config-change") as refused:
        open_run(changed)
    assert "train.lr 0.003 → 0.01" in str(refused.value) and "run_name=<new name>" in str(refused.value)
    open_run(changed, allow_config_change=True)
    code, out = run_worker(run_dir, 30)
    assert code == 0 and "resumed from step 20" in out, out


def test_mismatch_refusals_name_the_changed_keys(tmp_path: Path) -> None:
    """CLI and worker refusals name `train.lr` old → new; `--allow-config-change` on a finished
    run refuses (exit 2) instead of training nothing and exiting 0."""
    import json

    from tests.engine_util import make_run, run_worker

    run_dir = make_run(tmp_path, extra=["train.total_steps=20", "train.chunk_steps=20"])
    assert run_worker(run_dir, 20)[0] == 0
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(json.loads((run_dir / "config.json").read_text())))

    def convoy(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "flows.cli.main", "train", str(params), *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
        )

    proc = convoy("-S", "train.lr=0.002")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "train.lr 0.003 → 0.002" in lines[0] and "convoy train -S run_name=" in lines[0]
    proc = convoy("-S", "train.lr=0.002", "--allow-config-change")
    assert proc.returncode == 2 and "already at step 20" in proc.stderr and "train.lr" in proc.stderr, proc.stderr
    assert json.loads((run_dir / "config.json").read_text())["train"]["lr"] == 0.003  # nothing changed

    # The worker's own check (config.json edited behind the run's back): exit 78, keys named.
    edited = json.loads((run_dir / "config.json").read_text())
    edited["train"]["lr"], edited["train"]["total_steps"] = 0.002, 30
    (run_dir / "config.json").write_text(json.dumps(edited))
    code, out = run_worker(run_dir, 30)
    assert code == 78 and "train.lr 0.003 → 0.002" in out and "train.total_steps 20 → 30" in out, out
