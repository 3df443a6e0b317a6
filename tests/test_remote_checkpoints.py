"""Checkpoints that travel by themselves (invariant 10): background upload, the remote index, the
fetch on another machine, an upload killed half-way, a corrupt remote object.

Each "machine" is its own git + DVC repository with its own run directory and DVC cache; they
share only the DVC remote (a local directory).  Real workers, real DVC, real SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.remote.dvc_version import version_checkpoint
from tasks.remote.remote_checkpoints import fetch_newest, open_remote
from tasks.run_resources import RunResources
from tests.dvc_util import dvc_repo
from tests.engine_util import final_digest, make_run, run_worker
from training.checkpointing.store import CheckpointStore
from training.events import read_events
from training.rundir import load_run_config
from training.tracking.metrics import metric_rows
from training.tracking.progress import run_status

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def remote(tmp_path: Path) -> str:
    """The DVC remote every machine of the test shares: a local directory (the S3 endpoint is
    exercised end to end by tests/test_any_node.py; the index code is the same but for its PUT)."""
    return str(tmp_path / "remote")


def machine(tmp_path: Path, name: str, remote: str) -> Path:
    """A machine's run directory of the same run (same params, its own repository and data)."""
    extra = [
        "train.total_steps=30",
        "train.chunk_steps=10",
        "checkpoint.every_steps=5",
        "checkpoint.keep_last=5",
        "tracking.dvc=true",
        f"tracking.dvc_remote={remote}",
    ]
    return make_run(dvc_repo(tmp_path / name), "run", extra)


def flip_remote_byte(run_dir: Path, step: int, member: str) -> None:
    """Corrupt one object of an uploaded checkpoint in the remote (through DVC's own file system)."""
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.tree import Tree

    remote = open_remote(load_run_config(run_dir), run_dir)
    entry = next(e for e in remote.read_index().checkpoints if e.step == step)
    tree = Tree.load(remote.odb, HashInfo("md5", entry.dvc_md5))
    oid = next(hi.value for key, _, hi in tree if key == (member,))
    path = remote.odb.oid_to_path(oid)
    data = bytearray(remote.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    remote.fs.rm(path)  # a local remote's objects are read-only files
    remote.fs.pipe_file(path, bytes(data))


def kill_mid_upload(run_dir: Path, step: int, remote: str, flag: Path) -> None:
    """Upload ``step`` in a process of its own, SIGKILLed once every object is in the remote but
    before the index names it (the ``upload_stall`` fault holds it there)."""
    code = "import sys; from tasks.remote.dvc_version import version_checkpoint as v; v(None, sys.argv[1], sys.argv[2])"
    ckpt = run_dir / "checkpoints" / f"step-{step:09d}"
    env = {**os.environ, "CONVOY_FAULTS": f"upload_stall={step}:300:{flag}"}
    p = subprocess.Popen([sys.executable, "-c", code, str(ckpt), remote], cwd=REPO, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the upload never reached its index"
            time.sleep(0.05)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def uploaded_steps(run_dir: Path) -> list[int]:
    return [e.step for e in open_remote(load_run_config(run_dir), run_dir).read_index().checkpoints]


@pytest.mark.slow
def test_upload_fetch_kill_mid_upload_and_corrupt_fallback(tmp_path: Path, remote: str) -> None:
    a = machine(tmp_path, "a", remote)
    cfg = load_run_config(a)
    assert run_worker(a, 30)[0] == 0
    digest = final_digest(a)
    for step in (10, 20):  # uploaded while the worker went on to 30
        version_checkpoint(None, a / "checkpoints" / f"step-{step:09d}", remote)
    assert uploaded_steps(a) == [10, 20]
    lag = read_events(a, "checkpoint_published")[-1]
    assert (lag["step"], lag["upload_lag_steps"]) == (20, 10) and lag["upload_lag_s"] > 0
    st = run_status(cfg, a)
    assert (st["uploaded_step"], st["upload_lag_steps"]) == (20, 10)

    # Step 30 is killed half-way through its upload: its objects are in the remote, the index does not name it.
    kill_mid_upload(a, 30, remote, tmp_path / "stalled")
    assert uploaded_steps(a) == [10, 20]
    half = next((a / "checkpoints").glob(".stage-step-000000030.dvc"))
    md5 = yaml.safe_load(half.read_text())["outs"][0]["md5"]
    r = open_remote(cfg, a)
    assert r.fs.exists(r.odb.oid_to_path(md5)), "the killed upload had not pushed the data yet"

    # Machine B has the repository and the remote only: it fetches 20 (never the half-uploaded 30).
    b = machine(tmp_path, "b", remote)
    got = fetch_newest(load_run_config(b), b)
    assert got is not None and got["step"] == 20 and got["refused"] == [] and got["fetch_s"] > 0
    assert [s for s, _ in metric_rows(b)] == list(range(1, 21))  # the metric history came with it
    code, out = run_worker(b, 30)
    assert code == 0 and "resumed from step 20" in out, out
    assert final_digest(b) == digest

    # A corrupt object of step 20 in the remote: machine C refuses it, naming the step, and falls back to 10.
    flip_remote_byte(a, 20, "state.safetensors")
    c = machine(tmp_path, "c", remote)
    said: list[str] = []
    got = fetch_newest(load_run_config(c), c, said.append)
    assert got is not None and got["step"] == 10 and [r["step"] for r in got["refused"]] == [20]
    refused = read_events(c, "remote_checkpoint_refused")
    assert refused[0]["step"] == 20 and "state.safetensors" in refused[0]["reason"], refused
    assert any("step 20 refused" in line for line in said), said
    assert not list((c / "checkpoints").glob("step-000000020*")), "the corrupt copy was installed"
    assert final_digest(c) == got["digest"] == CheckpointStore(a).verify(a / "checkpoints" / "step-000000010").digest


def test_uploader_follows_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    """The background uploader takes the newest committed checkpoint whenever it is free, skips
    what the index already has, and a drain leaves the newest one in the remote."""
    remote = str(tmp_path / "remote")
    a = machine(tmp_path, "a", remote)
    cfg = load_run_config(a)
    resources = RunResources(cfg, a)
    uploader = resources.follow_uploads()
    assert uploader is not None and resources.follow_uploads() is uploader  # one per run
    code, out = run_worker(a, 20, env={"CONVOY_FAULTS": "step_delay=0.1"})
    assert code == 0, out
    resources.close()  # drains: the newest committed checkpoint is uploaded
    steps = uploaded_steps(a)
    assert steps[-1] == 20 and len(steps) >= 2, steps  # at least one mid-way upload while training
    assert all(e["upload_lag_steps"] <= 10 for e in read_events(a, "checkpoint_published"))
    again = RunResources(cfg, a)
    assert again.follow_uploads().upload_newest() is None  # 20 is in the index: nothing to do
    again.close()


def test_index_is_written_last_and_read_back(tmp_path: Path) -> None:
    """The index's own contract, without DVC objects: entries only added, a step re-published with
    the same digest is not written again, metric rows travel in segments up to the entry's step."""
    from tasks.remote.remote_index import IndexEntry, RemoteRun, metric_rows_through, publish

    class LocalRemote:
        from dvc_objects.fs.local import LocalFileSystem

        fs = LocalFileSystem()
        path = str(tmp_path / "remote")
        odb: Any = None

    run = RemoteRun.of(LocalRemote(), "test remote", "demo@1a2b3c4d", "f" * 16)
    rows = [(s, {"loss": 1.0 / s}) for s in range(1, 13)]
    entry = IndexEntry(step=5, digest="d5", dvc_md5="x.dir", uploaded=1.0)
    assert publish(run, entry, rows) is True
    assert publish(run, replace(entry), rows) is False  # same step, same digest: nothing written
    assert publish(run, replace(entry, step=10, digest="d10"), rows) is True
    index = run.read_index()
    assert [e.step for e in index.checkpoints] == [5, 10]
    assert [(m.first, m.through) for m in index.metrics] == [(1, 5), (6, 10)]
    on_disk = json.loads((Path(run.root) / "index.json").read_text())  # the keys as before
    assert [(m["from"], m["through"]) for m in on_disk["metrics"]] == [(1, 5), (6, 10)]
    assert on_disk["checkpoints"][0] == {**entry.to_json()} and on_disk["updated"] == 1.0
    assert metric_rows_through(run, index, 7) == rows[:7]
    assert not list(Path(run.root).glob(".*tmp*")), "a temporary file was left next to the index"
    (Path(run.root) / "index.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a convoy index"):
        run.read_index()
