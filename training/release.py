"""Which convoy wrote a file: the package version and, from a git checkout, its commit.

Recorded in every checkpoint's manifest (``versions.convoy``) so a run that outlived releases
says which release wrote each of its checkpoints (docs/compatibility.md).  Computed once per
process: one ``git`` call of at most a few milliseconds, never at a save's hot path twice.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


@functools.cache
def convoy_release() -> str:
    """``0.1.0+g1a2b3c4d5e6f`` from a git checkout (``-dirty`` with uncommitted changes),
    ``0.1.0`` from an installed copy; ``unknown`` when neither says."""
    try:
        version = importlib.metadata.version("convoy")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    commit = _commit()
    return f"{version}+g{commit}" if commit else version


def _commit() -> str | None:
    if not (_CHECKOUT / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(_CHECKOUT), "describe", "--always", "--abbrev=12", "--dirty", "--exclude=*"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
            # --dirty refreshes the index and would take .git/index.lock when it can: a `git commit`
            # of the run's DVC versioning in the same checkout must never find it held.
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head or None
