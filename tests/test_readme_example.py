"""README's "Train your own model", run literally in a fresh clone (issue 44, item 5): its
``mytask.py`` and ``waves.yaml`` written as the README shows them, its shell block run as it
stands (the clone's ``.venv`` is this checkout's, as ``make install`` would have made it)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from flow_util import REPO


def _blocks(readme: str) -> dict[str, str]:
    """The section's fenced blocks: ``mytask.py`` and ``waves.yaml`` by their first-line comment,
    ``shell`` the bash block."""
    section = readme.split("## Train your own model", 1)[1].split("\n## ", 1)[0]
    out = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
        first = body.splitlines()[0]
        name = "shell" if lang == "bash" else first.lstrip("# ").split(":")[0].strip()
        out[name] = body
    return out


@pytest.mark.slow
def test_the_readme_example_runs_as_written_in_a_fresh_clone(prefect_api: str, tmp_path: Path) -> None:
    blocks = _blocks((REPO / "README.md").read_text())
    assert set(blocks) == {"mytask.py", "waves.yaml", "shell"}, sorted(blocks)
    clone = tmp_path / "convoy"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    (clone / ".venv").symlink_to(REPO / ".venv")
    (clone / "mytask.py").write_text(blocks["mytask.py"])
    (clone / "waves.yaml").write_text(blocks["waves.yaml"])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MLFLOW_TRACKING_URI")}
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if ".venv" not in p)  # `convoy` only via activate
    done = subprocess.run(
        ["bash", "-e", "-c", blocks["shell"]], cwd=clone, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ok: waves.yaml is valid" in done.stdout, done.stdout[-2000:]
    assert "400" in done.stdout and (clone / "runs" / "waves").exists(), done.stdout[-2000:]
