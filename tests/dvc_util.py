"""Helpers for the tests on real git + DVC repositories: this checkout's root, git, a fresh DVC
repository whose .gitignore lets checkpoints' .dvc files be committed."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GITIGNORE = "runs/**\n!runs/**/\n!runs/*/checkpoints/*.dvc\n!runs/*/checkpoints/.gitignore\ndata/\n"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def dvc_repo(path: Path) -> Path:
    from dvc.repo import Repo

    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q")
    (path / ".gitignore").write_text(GITIGNORE)
    Repo.init(str(path)).close()
    return path
