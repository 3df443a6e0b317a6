"""Write a release fixture: a run trained to half-way by one release of convoy, kept in the repo.

Usage, from the repository root (today's checkout is the release by default)::

    .venv/bin/python tests/releases/make_fixture.py              # today's, as the next fixture
    git worktree add /tmp/rel-e96280b e96280b --detach           # an earlier landed release
    .venv/bin/python tests/releases/make_fixture.py --code /tmp/rel-e96280b

It trains ``upgrade_task`` (this folder) with the release's own code to ``HALF`` of
``TOTAL`` steps in a temporary folder, then copies the run directory, without its transient
files, to ``tests/releases/<commit date>-<commit>/run`` beside a ``release.json`` that says what
wrote it.  tests/test_release_gate.py resumes every fixture with HEAD and requires the losses of
every step and the final digest of HEAD's own uninterrupted run.  Only the APIs every fixture's
release has are used (``config_from_dict``, ``open_run``, ``python -m training.worker``), so the
script runs against any of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The run every fixture holds: settings of the tiny task, as each release's config accepts them.
PARAMS = {
    "run_name": "upgrade",
    "runs_dir": "runs",
    "task": "upgrade_task:build",
    "data": {"prepared_dir": "data", "synthetic_chars": 2000, "seq_len": 8},
    "train": {"total_steps": 40, "chunk_steps": 40, "batch_size": 8, "lr": 0.05, "warmup_steps": 0, "seed": 5},
    "checkpoint": {"every_steps": 10, "keep_last": 2},
    "tracking": {"mlflow": False},
}
TOTAL, HALF = 40, 20
#: What a run directory holds that only a live run needs: never kept in a fixture.
TRANSIENT = ("heartbeat", "logs", ".worker.lock", ".worker.lock.owner")

_OPEN = (
    "import json, sys\n"
    "from training.config import config_from_dict\n"
    "from training.rundir import open_run\n"
    "print(open_run(config_from_dict(json.loads(sys.argv[1]))))\n"
)


def release_env(code: Path) -> dict[str, str]:
    """The environment that runs ``code``'s convoy with this folder's task importable."""
    return {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{HERE}", "CONVOY_FAULTS": ""}


def train(code: Path, work: Path, until: int) -> Path:
    """Open the run with ``code``'s convoy in ``work`` and train it to ``until``; its run dir."""
    env = release_env(code)
    subprocess.run([sys.executable, "-c", _OPEN, json.dumps(PARAMS)], cwd=work, env=env, check=True)
    run_dir = work / PARAMS["runs_dir"] / PARAMS["run_name"]
    cmd = [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(until)]
    subprocess.run(cmd, cwd=work, env=env, check=True, timeout=600)
    return run_dir


def describe(code: Path) -> dict[str, str]:
    """The release: its commit and the date it landed, as ``git`` of its checkout says."""
    out = subprocess.run(
        ["git", "-C", str(code), "log", "-1", "--format=%h %cs"], capture_output=True, text=True, check=True
    ).stdout.split()
    import torch

    return {"commit": out[0], "date": out[1], "torch": torch.__version__, "python": sys.version.split()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, default=HERE.parent.parent, help="checkout of the release")
    parser.add_argument("--out", type=Path, default=HERE, help="folder of the fixtures")
    args = parser.parse_args()
    release = describe(args.code.resolve())
    target = args.out / f"{release['date']}-{release['commit']}"
    if target.exists():
        print(f"{target} exists already: remove it first to write it again", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="convoy-fixture-") as work:
        run_dir = train(args.code.resolve(), Path(work), HALF)
        for name in TRANSIENT:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        shutil.copytree(run_dir, target / "run")
    (target / "release.json").write_text(json.dumps({**release, "steps": HALF}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {target} ({sum(f.stat().st_size for f in target.rglob('*') if f.is_file())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
