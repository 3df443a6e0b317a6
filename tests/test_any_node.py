"""Any node, no shared disk (invariant 10), end to end through real Prefect, DVC and MLflow.

"Machines" are directories on this box that share only the git origin, the DVC remote (a local
directory, or an S3 bucket on moto's standalone S3-API server: the stand-in for AWS S3 / MinIO),
the Prefect API and an MLflow tracking server started by the session.  Each has its own clone,
its own ``runs/``, ``data/`` and DVC cache.  Slow: every scenario starts real processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dvc_util import git
from tests.engine_util import final_digest, run_worker
from tests.flow_util import assert_no_leftovers, params, stop_group
from tests.project_util import clone_project, commit_all, run, summary_json
from training.events import read_events
from training.heartbeat import read_heartbeat

pytestmark = pytest.mark.slow


def _index(remote: Path) -> list[int]:
    """Steps named by the (only) run index under a local directory remote."""
    found = list(remote.glob("convoy/runs/*/*/index.json"))
    return [e["step"] for e in json.loads(found[0].read_text())["checkpoints"]] if found else []


def _uninterrupted(tmp_path: Path, params_file: Path, data: Path, total: int) -> str:
    """Digest of one worker training the params' run from step 0 to ``total`` in another directory."""
    from training.config import load_config
    from training.rundir import open_run

    cfg = load_config(params_file, [f"runs_dir={tmp_path / 'reference'}", f"data.prepared_dir={data}"])
    run_dir = open_run(cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"dvc": False})}))
    code, out = run_worker(run_dir.resolve(), total)
    assert code == 0, out
    return final_digest(run_dir)


def test_fresh_clone_train_continues_from_the_remote(tmp_path: Path, prefect_api: str) -> None:
    """Machine A trains with versioning on and is SIGKILLed mid-way (flow and worker); a fresh clone
    of the repository as committed *before* training (no runs/, no DVC cache, no .dvc file of any
    checkpoint) runs only `convoy train`: it fetches the remote's newest uploaded checkpoint by
    itself and ends bitwise equal to an uninterrupted run."""
    remote = tmp_path / "remote"
    origin, env = clone_project(tmp_path, dvc=True, dvc_remote=str(remote))
    p = yaml.safe_load((origin / "params.yaml").read_text())
    p["train"].update(total_steps=30)
    p["checkpoint"].update(every_steps=5, keep_last=3)
    (origin / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    commit_all(origin)
    run(origin, env, "convoy", "prepare")
    a = subprocess.Popen(
        ["convoy", "train", "--json"],
        cwd=origin,
        env={**env, "CONVOY_FAULTS": "step_delay=0.15"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not any(10 < s < 30 for s in _index(remote)):
            assert a.poll() is None and time.monotonic() < deadline, "machine A never uploaded a checkpoint past 10"
            time.sleep(0.1)
    finally:
        os.killpg(a.pid, signal.SIGKILL)  # the flow; its worker dies with it (parent-death signal)
        a.wait()
    newest = max(_index(remote))
    assert newest < 30
    assert_no_leftovers(origin / "runs")

    b = tmp_path / "machine-b"
    git(tmp_path, "clone", "-q", str(origin), str(b))
    assert not (b / "runs").exists() and not (b / ".dvc" / "cache").exists()
    run(b, env, "convoy", "prepare")
    out = summary_json(run(b, env, "convoy", "train", "--json"))
    assert out["fetched"]["step"] == newest and out["fetched"]["refused"] == [], out["fetched"]
    assert out["final_step"] == 30 and out["trained_chunks"] >= 1
    assert out["digest"] == _uninterrupted(tmp_path, b / "params.yaml", b / "data", 30)
    run_dir = Path(out["run_dir"])
    assert read_events(run_dir, "resumed")[0]["step"] == newest  # never trained from step 0
    assert json.loads(run(b, env, "convoy", "status", str(run_dir), "--json"))["upload_lag_steps"] == 0


# ---------------------------------------------------------------------------------- pool mode
PREFECT = str(Path(sys.executable).parent / "prefect")


@pytest.fixture(scope="module")
def pool_machines(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Iterator[dict[str, Any]]:
    """The parent's clone (deploys ``train-chunk/gpu`` from ``prefect.yaml``) and two node clones,
    each with its own prepared data; nothing shared but git, the remote and the servers."""
    tmp = tmp_path_factory.mktemp("pool")
    origin, env = clone_project(tmp)
    base = params(tmp, tmp, "pooled")
    base.update(runs_dir="runs", data={**base["data"], "prepared_dir": "data"})
    (origin / "params.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    commit_all(origin)
    env = {**env, "PREFECT_API_URL": prefect_api, "PREFECT_WORKER_QUERY_SECONDS": "1"}
    env["PREFECT_WORKER_PREFETCH_SECONDS"] = "1"
    nodes = {}
    for name in ("node-a", "node-b"):
        nodes[name] = tmp / name
        git(tmp, "clone", "-q", str(origin), str(nodes[name]))
    for d in (origin, *nodes.values()):
        run(d, env, "convoy", "prepare")
    deploy_env = {**env, "PWD": str(origin)}  # prefect.yaml's default node directory: the parent's
    run(origin, deploy_env, PREFECT, "work-pool", "create", "gpu", "--type", "process", "--overwrite")
    run(origin, deploy_env, PREFECT, "--no-prompt", "deploy", "--name", "gpu")
    yield {"origin": origin, "nodes": nodes, "env": env, "base": base}


def _start_node(machines: dict[str, Any], name: str, extra_env: dict[str, str]) -> subprocess.Popen[bytes]:
    node = machines["nodes"][name]
    env = {**machines["env"], **extra_env, "CONVOY_NODE": name, "CONVOY_NODE_DIR": str(node)}
    log = open(node / "worker.log", "ab")  # noqa: SIM115 - the worker's lifetime
    return subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "gpu", "--name", f"{name}-{time.time_ns()}"],
        cwd=node,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _kill_mid_chunk(run_a: Path, stop_a: Any, start_b: Any, seen: dict[str, Any]) -> None:
    """Once node A uploaded a checkpoint inside chunk 2 and trains past it: A leaves the pool
    (its Prefect worker is stopped; the chunk flow run under it still reports), A's training
    worker is SIGKILLed, and B joins."""
    deadline = time.monotonic() + 400
    while True:
        assert time.monotonic() < deadline, "node A never uploaded a checkpoint inside chunk 2"
        mid = [e["step"] for e in read_events(run_a, "checkpoint_published") if 20 < e["step"] < 40]
        beat = read_heartbeat(run_a, 0)
        if mid and beat and beat.phase == "train" and mid[0] < beat.step < 40:
            break
        time.sleep(0.05)
    stop_a()
    os.kill(beat.pid, signal.SIGKILL)
    # Read the step after the kill: between the poll above and the signal the worker may have
    # trained (and saved) further, and the fetch must fall inside what it really reached.
    # A beat is written every interval, so a checkpoint committed after the last one counts too.
    after = read_heartbeat(run_a, 0) or beat
    committed = [e["step"] for e in read_events(run_a, "checkpoint_committed")]
    seen.update(uploaded=mid[0], killed_at=max(beat.step, after.step, *committed))
    start_b()


def test_two_machines_pool_mode_resume_on_the_other_node(
    pool_machines: dict[str, Any], mlflow_server: str, reference_digest: str, s3_endpoint: dict[str, Any]
) -> None:
    """Pool mode, versioning on to the S3 endpoint: chunk 2 runs on node A and is SIGKILLed after a
    mid-chunk upload; the re-dispatched chunk runs on node B, which fetches the newest uploaded
    checkpoint by itself; the run ends on the uninterrupted digest, MLflow has exactly one point
    per step, and the parent's summary shows the node change and the fetch.  (A local-directory
    remote ran this same scenario too, ~100 s more of the suite for no code of its own: nothing in
    pool mode depends on the remote's kind, and that remote's fetch and fallbacks are the fresh
    clone's test above and tests/test_remote_checkpoints.py.)"""
    m, name = pool_machines, "pooled-s3"
    origin, env = m["origin"], {**m["env"], **s3_endpoint["env"]}
    remote = f"s3://{s3_endpoint['bucket']}/pool"
    p = {**m["base"], "run_name": name}
    p["orchestration"] = {**p["orchestration"], "mode": "pool", "pool": "gpu", "retries": 2}
    p["tracking"] = {"mlflow": True, "mlflow_uri": mlflow_server, "dvc": True, "dvc_remote": remote}
    pfile = origin / "params-s3.yaml"
    pfile.write_text(yaml.safe_dump(p, sort_keys=False))
    slow = {**env, "CONVOY_FAULTS": "step_delay=0.3"}
    # Node A holds its chunk-2 worker at step 38 for up to 60 s, so a mid-chunk upload (25, 30 or
    # 35) is published while it still trains, however slow the remote: CI once saw the upload of
    # an S3 remote come after the worker had finished chunk 2, and nothing was ever killed.
    held = {**slow, "CONVOY_FAULTS": "step_delay=0.3,slow_step=39:60"}
    workers = [_start_node({**m, "env": held}, "node-a", {})]
    seen: dict[str, Any] = {}
    killer = threading.Thread(
        target=_kill_mid_chunk,
        args=(
            m["nodes"]["node-a"] / "runs" / name,
            lambda: os.kill(workers[0].pid, signal.SIGSTOP),
            lambda: workers.append(_start_node({**m, "env": slow}, "node-b", {})),
            seen,
        ),
        daemon=True,
    )
    killer.start()
    try:
        out = summary_json(run(origin, env, "convoy", "train", str(pfile), "--json"))
    finally:
        killer.join(timeout=5)
        for w in workers:
            os.kill(w.pid, signal.SIGCONT)
            stop_group(w)
    assert seen, "node A's worker was never killed"
    assert out["digest"] == reference_digest and out["final_step"] == 60
    chunk2 = out["chunks"][1]
    assert chunk2["nodes"] == ["node-a", "node-b"] and chunk2["failure_kinds"] == ["killed"], chunk2
    fetch = [f for f in chunk2["fetched"] if f["attempt"] == 2]
    assert fetch and fetch[0]["node"] == "node-b" and fetch[0]["from_node"] == "node-a", chunk2["fetched"]
    assert seen["uploaded"] <= fetch[0]["step"] <= seen["killed_at"], (seen, fetch)
    assert out["chunks"][2]["nodes"] == ["node-b"]
    assert out["audit"]["resumes"] == 1 and out["audit"]["failures"] == 1

    parent_dir = Path(out["run_dir"])
    assert not list((parent_dir / "checkpoints").glob("step-*")), "the parent machine holds no checkpoint"
    resumed = [e["step"] for e in read_events(parent_dir, "resumed")]  # the nodes' events, carried back
    assert fetch[0]["step"] in resumed and read_events(parent_dir, "checkpoint_fetched"), resumed
    from tasks.records.mlflow_audit import refresh_audit
    from training.rundir import load_run_config, run_info

    audit = refresh_audit(load_run_config(parent_dir), parent_dir)
    assert audit["rows"][0]["fetch_s"] == fetch[0]["fetch_s"]

    from mlflow.tracking import MlflowClient

    client, run_id = MlflowClient(mlflow_server), run_info(parent_dir).mlflow_run_id
    history = client.get_metric_history(run_id, "loss")
    assert sorted(int(h.step) for h in history) == list(range(1, 61)), "not exactly one loss point per step"
    lag = [int(h.step) for h in client.get_metric_history(run_id, "upload_lag_steps")]
    assert 60 in lag and len(lag) == len(set(lag)), lag  # recorded by both nodes, once per uploaded step
    for node in m["nodes"].values():
        assert_no_leftovers(node / "runs")


def test_a_logged_model_links_its_registered_version_once_over_a_server(mlflow_server: str) -> None:
    """An MLflow server links a logged model to the version created from it (an int version);
    convoy's own link (for SQLite stores, which do not) finds it and adds no second one."""
    from mlflow.tracking import MlflowClient

    from tasks.records.mlflow_model import link_version

    client = MlflowClient(mlflow_server)
    experiment = client.create_experiment("model-link")
    run = client.create_run(experiment)
    model = client.create_logged_model(experiment, name="linked", source_run_id=run.info.run_id)
    client.create_registered_model("linked")
    version = client.create_model_version(
        "linked", source=f"models:/{model.model_id}", run_id=run.info.run_id, model_id=model.model_id
    )
    link_version(client, model.model_id, "linked", str(version.version))
    links = json.loads(client.get_logged_model(model.model_id).tags["mlflow.modelVersions"])
    assert [(link["name"], str(link["version"])) for link in links] == [("linked", "1")], links
