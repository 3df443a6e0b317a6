"""No snapshot outlives its run (training/memory_sweep.py, issue 42 item 5).

Real run directories and real tier folders in a private tier base: a tier whose run directory is
gone or was made again, or that was not resumed within ``checkpoint.memory_keep_hours``, is
freed; a live, resumable or starting run's tier never is.  End to end: a ``convoy train`` SIGKILLed
with its flow and its run directory deleted leaves its tier in RAM, and the next ``convoy train`` of
another run frees it (and says so), while a resumable run's tier stays.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from engine_util import make_run
from flow_util import REPO, assert_no_leftovers, config, params
from typer.testing import CliRunner

from flows.cli.main import app
from training import memory_sweep, run_memory
from training.checkpointing.memory import memory_tier
from training.checkpointing.memory.tier_folders import OWNER_FILE, list_tier_folders
from training.rundir import load_run_config

HOUR = 3600.0


def _tier(run_dir: Path) -> Path:
    """The run's tier as its worker opens it (its owner recorded), with one file of RAM in it."""
    tier = run_memory.open_tier(run_dir, load_run_config(run_dir))
    assert tier is not None
    (tier.root / "rank-0.slot-0.bin").write_bytes(b"\0" * 65536)
    return tier.root


def _verdicts(base: Path, keep_hours: float, now: float, current: Path | None = None) -> dict[str, str]:
    """Folder name -> "freed: why" / "kept: why"."""
    out = {}
    for f in list_tier_folders(base):
        v = memory_sweep.judge(f, keep_hours, now, current)
        out[f.path.name] = ("freed: " if v.orphaned else "kept: ") + v.why
    return out


def test_only_tiers_whose_run_is_gone_or_idle_too_long_are_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "tiers"
    monkeypatch.setenv(memory_tier.DIR_ENV, str(base))
    live = make_run(tmp_path / "live")
    gone = make_run(tmp_path / "gone")
    again = make_run(tmp_path / "again")
    tiers = {name: _tier(run) for name, run in (("live", live), ("gone", gone), ("again", again))}
    assert json.loads((tiers["live"] / OWNER_FILE).read_text())["run_dir"] == str(live.resolve())
    shutil.rmtree(gone)
    shutil.rmtree(again)
    assert make_run(tmp_path / "again") == again  # the same path, made again: another run
    legacy = base / "old-run-0123456789abcdef"  # written before owners were recorded
    legacy.mkdir()
    (legacy / "rank-0.slot-0.bin").write_bytes(b"\0" * 4096)

    now = time.time()
    said = _verdicts(base, 24, now)
    assert said[tiers["live"].name].startswith("kept: resumable"), said
    assert said[tiers["gone"].name] == f"freed: its run directory {gone.resolve()} is gone", said
    assert (
        said[tiers["again"].name].startswith("freed: its run directory") and "made again" in said[tiers["again"].name]
    )
    assert said[legacy.name].startswith("kept: no owner recorded"), said

    # Two days later, nothing written: the idle tiers go too, but never the run being started.
    later = _verdicts(base, 24, now + 48 * HOUR, current=live)
    assert later[tiers["live"].name] == "kept: the run being started"
    assert "not resumed for 48.0 h (checkpoint.memory_keep_hours = 24)" in later[legacy.name]
    assert later[legacy.name].startswith("freed: ")
    assert _verdicts(base, 24, now + 48 * HOUR)[tiers["live"].name].startswith("freed: resumable; not resumed")

    freed = memory_sweep.free_orphans(24)
    assert sorted(v.folder.path.name for v in freed) == sorted([tiers["gone"].name, tiers["again"].name])
    assert tiers["live"].is_dir() and legacy.is_dir() and not tiers["gone"].exists() and not tiers["again"].exists()
    line = memory_sweep.freed_line(freed)
    assert line is not None and line.startswith("memory tier: freed 2 snapshot folder(s) of runs that are gone")

    # The command lists what is left; --free frees nothing kept.
    runner = CliRunner()
    (tmp_path / "params.yaml").write_text("checkpoint:\n  memory_keep_hours: 24\n")
    listed = runner.invoke(app, ["snapshots", str(tmp_path / "params.yaml"), "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {Path(r["folder"]).name: r for r in json.loads(listed.output)["tiers"]}
    assert set(rows) == {tiers["live"].name, legacy.name} and not any(r["orphaned"] for r in rows.values())
    assert rows[tiers["live"].name]["bytes"] >= 65536
    freeing = runner.invoke(
        app, ["snapshots", str(tmp_path / "params.yaml"), "--free", "-S", "checkpoint.memory_keep_hours=24"]
    )
    assert freeing.exit_code == 0 and "2 tier(s)" in freeing.output, freeing.output
    assert tiers["live"].is_dir() and legacy.is_dir()


@pytest.mark.slow
def test_the_next_train_frees_the_tier_of_a_killed_run_whose_directory_was_deleted(
    prefect_api: str, data_dir: Path, tmp_path: Path
) -> None:
    """The issue's case, as a user meets it: a run SIGKILLed with its flow, its run directory
    deleted by hand; the next ``convoy train`` (of another run) frees that tier and says so in one
    line, and the tier of a resumable run (its directory kept) stays."""
    base = tmp_path / "tiers"
    env = {**os.environ, memory_tier.DIR_ENV: str(base), "PREFECT_API_URL": prefect_api, "COLUMNS": "250"}
    killed = params(
        tmp_path,
        data_dir,
        "killed",
        train={"total_steps": 400, "chunk_steps": 400},
        checkpoint={"every_steps": 100, "memory_every_steps": 1},
    )
    (tmp_path / "killed.yaml").write_text(yaml.safe_dump(killed))
    cmd = [sys.executable, "-m", "flows.cli.main", "train"]
    flow = subprocess.Popen(
        [*cmd, str(tmp_path / "killed.yaml")],
        cwd=REPO,
        env={**env, "CONVOY_FAULTS": "step_delay=0.05"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    run_dir = config(killed).run_dir.resolve()
    try:
        deadline = time.monotonic() + 240
        while not [f for f in list_tier_folders(base) if f.steps and f.steps[0] >= 5]:
            assert time.monotonic() < deadline and flow.poll() is None, "the killed run never snapshotted"
            time.sleep(0.2)
    finally:
        os.killpg(flow.pid, signal.SIGKILL)  # the flow's machine "dies", with what it started
        flow.wait(timeout=10)
    assert_no_leftovers(run_dir, wait_s=40)
    (orphan,) = list_tier_folders(base)
    shutil.rmtree(run_dir)  # the user deletes the run by hand; its tier is still in RAM
    resumable = make_run(tmp_path / "resumable")
    kept = _tier(resumable)

    other = params(tmp_path, data_dir, "other", train={"total_steps": 10, "chunk_steps": 10})
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    done = subprocess.run(
        [*cmd, str(tmp_path / "other.yaml")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not orphan.path.exists(), "the tier of a deleted run outlived it"
    assert kept.is_dir(), "the tier of a resumable run was freed"
    said = done.stdout + done.stderr
    assert "memory tier: freed 1 snapshot folder(s) of runs that are gone" in said, said[-3000:]
    assert f"its run directory {run_dir} is gone" in said
    assert_no_leftovers(tmp_path)
