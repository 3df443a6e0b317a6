"""Helpers for the tests on a git clone of this project (a real ``dvc repro`` / ``convoy`` in it):
the clone with a tiny params.yaml, a command run in it, its JSON summary, a commit of everything."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.dvc_util import GITIGNORE, ROOT, git

TINY = {
    "on_config_change": "new_run",
    "task_args": {"n_layer": 1, "n_head": 2, "d_model": 32, "dropout": 0.1},
    "data": {"synthetic_chars": 20000, "seq_len": 16},
    "train": {"total_steps": 20, "chunk_steps": 10, "batch_size": 4, "warmup_steps": 2, "lr": 0.003},
    "checkpoint": {"every_steps": 10},
    "heartbeat": {"interval_s": 0.2},
}


def clone_project(tmp_path: Path, **tracking: Any) -> tuple[Path, dict[str, str]]:
    """A git clone of this repository with the working tree's dvc.yaml and a tiny params.yaml;
    returns it and the environment the ``convoy``/``dvc`` commands run in."""
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(ROOT), str(clone))
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, clone / name)
    for package in ("training", "tasks", "flows"):  # workers import from their cwd: the working tree's code
        shutil.rmtree(clone / package)
        shutil.copytree(ROOT / package, clone / package, ignore=shutil.ignore_patterns("__pycache__"))
    if not (clone / ".dvc").is_dir():
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=clone, check=True)
    params = yaml.safe_load((clone / "params.yaml").read_text())
    for section, values in TINY.items():
        if isinstance(values, dict):
            params.setdefault(section, {}).update(values)
        else:
            params[section] = values
    params.setdefault("tracking", {}).update(mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", **tracking)
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    ignore = [ln for ln in (clone / ".gitignore").read_text().splitlines() if ln.strip() not in ("runs/", "runs")]
    (clone / ".gitignore").write_text("\n".join([*ignore, *GITIGNORE.splitlines()[:4]]) + "\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return clone, env


def run(cwd: Path, env: dict[str, str], *cmd: str) -> str:
    proc = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout


def summary_json(out: str) -> dict[str, Any]:
    """The JSON document a convoy command prints last (DVC prints hints to stdout before it)."""
    start = 0 if out.startswith("{") else out.index("\n{") + 1
    return json.loads(out[start:])


def commit_all(repo: Path) -> None:
    git(repo, "add", "-A")
    git(repo, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-q", "-m", "trained")
