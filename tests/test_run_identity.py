"""Run identity: a run is its name *and* its trajectory (``on_config_change: new_run``).

A param change under a real ``dvc repro`` (in a git clone of this repository, real MLflow on
SQLite) trains a new run in its own directory, never refused and never mixed with the old one;
the old run's checkpoints stay bitwise as they were; ``dvc repro`` again does nothing; changing
the param back reuses the old run instead of training again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dvc_util import git
from tests.engine_util import SMALL, final_digest, kill_group, make_run, run_worker, start_worker, wait_for_step
from tests.project_util import clone_project, commit_all, run, summary_json
from training.checkpointing.store import CheckpointStore
from training.config import load_config
from training.evaluate import load_model_file
from training.events import read_events
from training.rundir import keyed_config, link_current
from training.tracking.metrics import metric_rows


def set_lr(clone: Path, lr: float) -> None:
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["train"]["lr"] = lr
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def checkpoint_digests(run_dir: Path) -> dict[str, str]:
    """Every file of every checkpoint, hashed: "untouched" means bitwise."""
    import hashlib

    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((run_dir / "checkpoints").rglob("*"))
        if p.is_file()
    }


def test_keyed_config_and_link(tmp_path: Path) -> None:
    base = [f"runs_dir={tmp_path}", "on_config_change=new_run"]
    a, b = load_config(None, base), load_config(None, [*base, "train.lr=0.002"])
    ka, kb = keyed_config(a), keyed_config(b)
    assert ka.run_name == f"demo@{a.fingerprint()[:8]}" and kb.run_name == f"demo@{b.fingerprint()[:8]}"
    assert keyed_config(ka) is ka and keyed_config(load_config(None, [f"runs_dir={tmp_path}"])).run_name == "demo"
    ka.run_dir.mkdir()
    kb.run_dir.mkdir()
    assert link_current(ka) == tmp_path / "demo" and (tmp_path / "demo").resolve() == ka.run_dir.resolve()
    link_current(kb)
    assert (tmp_path / "demo").resolve() == kb.run_dir.resolve()


def test_one_writer_locks_refuse_a_second_holder_by_name(tmp_path: Path) -> None:
    """The flow's ``.lock`` and the worker's lease (invariant 8): one helper, two refusals; the
    holder's note names it while it holds the lock, and a cleanly left flow lock leaves no note."""
    from flows.train import RunLocked, run_lock
    from training.paths import RunPaths, owner_note
    from training.rundir import RunBusy, take_worker_lease
    from training.tracking.progress import flow_holder

    run_dir = tmp_path / "runs" / "demo"  # the flow lock creates the directory
    paths = RunPaths(run_dir)
    with run_lock(run_dir, "demo"):
        assert paths.flow_lock == run_dir / ".lock" and flow_holder(run_dir) == os.getpid()
        refused = rf"already being trained by another flow \(lock .* held by pid {os.getpid()} on"
        with pytest.raises(RunLocked, match=refused), run_lock(run_dir, "demo"):
            pass
        lease = take_worker_lease(run_dir, wait_s=0.1)  # the worker's lease is another lock
        assert owner_note(paths.worker_lease).read_text().startswith(f"pid {os.getpid()} on ")
        with pytest.raises(RunBusy, match=rf"being trained by another worker \(pid {os.getpid()} on .* since "):
            take_worker_lease(run_dir, wait_s=0.1)
        lease.release()
    assert not owner_note(paths.flow_lock).exists() and flow_holder(run_dir) is None
    with run_lock(run_dir, "demo"):  # free again
        pass


@pytest.mark.slow
def test_param_change_under_dvc_repro_and_exp_run_train_their_own_runs(tmp_path: Path, prefect_api: str) -> None:
    """One clone for both DVC entry points (a clone and its first run cost as much as the checks):
    `dvc repro` after a param change, then `dvc exp run` twice."""
    clone, env = clone_project(tmp_path)
    _param_change_under_dvc_repro_trains_a_new_run(tmp_path, clone, env)
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params.update(on_config_change="new_run")
    params["train"]["lr"] = 0.003
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    _dvc_exp_run_twice_gives_two_experiments_with_their_own_runs(clone, env)


def _param_change_under_dvc_repro_trains_a_new_run(tmp_path: Path, clone: Path, env: dict[str, str]) -> None:
    run(clone, env, sys.executable, "-m", "dvc", "repro")
    first = keyed_config(load_config(clone / "params.yaml")).run_name
    old_dir = clone / "runs" / first
    old = checkpoint_digests(old_dir)
    model_a = (clone / "models" / "model.safetensors").read_bytes()

    set_lr(clone, 0.002)
    out = run(clone, env, sys.executable, "-m", "dvc", "repro")
    assert "Running stage 'train'" in out
    cfg = load_config(clone / "params.yaml")
    new_dir = clone / "runs" / keyed_config(cfg).run_name
    assert new_dir != old_dir and (clone / "runs" / "demo").resolve() == new_dir.resolve()
    _, meta = load_model_file(clone / "models" / "model.safetensors")
    assert meta["fingerprint"] == cfg.fingerprint() and int(meta["step"]) == 20
    assert json.loads((new_dir / "config.json").read_text())["train"]["lr"] == 0.002
    assert checkpoint_digests(old_dir) == old, "the old run's checkpoints changed"
    assert CheckpointStore(new_dir).latest_valid(record=False).manifest["fingerprint"] == cfg.fingerprint()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("convoy")
    names = {r.info.run_name for r in client.search_runs([exp.experiment_id], "tags.`convoy.run_name` LIKE 'demo@%'")}
    assert names == {first, new_dir.name}

    assert "Data and pipelines are up to date" in run(clone, env, sys.executable, "-m", "dvc", "repro")

    set_lr(clone, 0.003)  # back: the old run has these params, nothing is trained again
    run(clone, env, sys.executable, "-m", "dvc", "repro")
    assert (clone / "models" / "model.safetensors").read_bytes() == model_a
    assert len(read_events(old_dir, "started")) == 1 and not read_events(old_dir, "resumed")
    assert checkpoint_digests(old_dir) == old

    # A refused stage (on_config_change: refuse, another lr) fails, names the key, and leaves the
    # model in the workspace (persist: DVC does not delete it before the stage runs).
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params.update(on_config_change="refuse")
    params["train"]["lr"] = 0.005
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", "repro"], cwd=clone, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode != 0 and "train.lr 0.003 → 0.005" in proc.stderr, proc.stderr[-3000:]
    assert (clone / "models" / "model.safetensors").read_bytes() == model_a


@pytest.mark.slow
def test_pull_in_a_fresh_clone_resumes_to_the_same_digest(tmp_path: Path, prefect_api: str) -> None:
    """Versioning on, remote from params.yaml; two of three chunks reach git (the third .dvc file is
    dropped: the first machine "stopped" there).  A fresh clone (no runs/, empty DVC cache) pulls
    `runs/demo` and resumes to the uninterrupted run's digest; another pulls with the remote only
    as the repository's committed default remote; a wrong remote is named in the error."""
    remote = tmp_path / "remote"
    origin, env = clone_project(tmp_path, dvc=True, dvc_remote=str(remote))
    params = yaml.safe_load((origin / "params.yaml").read_text())
    params["train"].update(total_steps=30)
    (origin / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(origin, env, "convoy", "prepare")
    summary = summary_json(run(origin, env, "convoy", "train", "--json"))
    digest = summary["digest"]
    run_dir = Path(summary["run_dir"])
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("step-*.dvc"))][-1] == "step-000000030.dvc"
    (run_dir / "checkpoints" / "step-000000030.dvc").unlink()
    commit_all(origin)

    def fresh_clone(name: str) -> Path:
        clone = tmp_path / name
        git(tmp_path, "clone", "-q", str(origin), str(clone))
        assert not (clone / "runs" / "demo").exists() and not (clone / ".dvc" / "cache").exists()
        run(clone, env, "convoy", "prepare")
        return clone

    def pull_and_train(clone: Path) -> None:
        pulled = summary_json(run(clone, env, "convoy", "pull", "runs/demo"))
        assert [c["checkpoint"] for c in pulled["checkpoints"]] == ["step-000000010", "step-000000020"]
        # The README's next commands work on runs/demo: pull linked it to what it pulled.
        link = clone / "runs" / "demo"
        assert link.is_symlink() and link.resolve() == (clone / "runs" / run_dir.name).resolve()
        assert "step-000000020" in run(clone, env, "convoy", "inspect", "runs/demo")
        pulled_status = json.loads(run(clone, env, "convoy", "status", "runs/demo", "--json"))
        assert (pulled_status["state"], pulled_status["checkpoint_step"]) == ("stopped", 20), pulled_status
        out = summary_json(run(clone, env, "convoy", "train", "--json"))
        # The remote's index names step 30 (uploaded, though its .dvc file never reached git): fetched.
        assert out["digest"] == digest and out["trained_chunks"] == 0 and out["fetched"]["step"] == 30
        assert json.loads(run(clone, env, "convoy", "status", "runs/demo", "--json"))["checkpoint_step"] == 30

    a = fresh_clone("machine-a")
    pull_and_train(a)
    assert summary_json(run(a, env, "convoy", "pull", "runs/demo", "--latest-only"))["remote"].startswith(
        "remote 'convoy'"
    )

    b = fresh_clone("machine-b")  # the remote only as the repository's default remote
    params["tracking"]["dvc_remote"] = ""
    (b / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    empty = tmp_path / "empty-remote"
    empty.mkdir()
    proc = subprocess.run(
        ["convoy", "pull", "runs/demo", "--remote", str(empty)],
        cwd=b,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and str(empty) in proc.stderr and "step-000000020" in proc.stderr, proc.stderr
    run(b, env, sys.executable, "-m", "dvc", "remote", "remove", "convoy", "--local")
    run(b, env, sys.executable, "-m", "dvc", "remote", "add", "-d", "store", str(remote))
    pulled = summary_json(run(b, env, "convoy", "pull", "runs/demo"))  # machine a showed the rest
    assert [c["checkpoint"] for c in pulled["checkpoints"]] == ["step-000000010", "step-000000020"]
    assert pulled["remote"].startswith("remote 'store'"), pulled["remote"]


def test_from_a_finished_run_trains_longer_with_lineage_and_resumes_bitwise(tmp_path: Path) -> None:
    """`--from` a finished run with total_steps doubled: the child starts at the parent's step
    with its state, records the lineage (run.json, the forked checkpoint, MLflow tags), and a
    child killed mid-way and resumed ends bitwise equal to an uninterrupted child."""
    from tasks.records.mlflow_client import client_for
    from tasks.records.mlflow_runs import ensure_mlflow_run
    from training.rundir import open_run, resolve_parent, run_info

    parent = make_run(tmp_path, "parent", ["train.total_steps=20", "train.chunk_steps=20"])
    assert run_worker(parent, 20)[0] == 0
    parent_files = checkpoint_digests(parent)
    assert resolve_parent(f"{parent}@10").step == 10

    def child(name: str) -> tuple[Any, Path]:
        cfg = load_config(
            None,
            SMALL
            + [
                f"runs_dir={tmp_path / 'runs'}",
                f"data.prepared_dir={tmp_path / 'data'}",
                f"run_name={name}",
                "train.total_steps=40",
                "train.chunk_steps=20",
                "train.lr=0.001",
            ],
        )
        cfg = cfg.model_copy(update={"init_from": resolve_parent(str(parent))})
        return cfg, open_run(cfg)

    cfg, a = child("child-a")
    code, out = run_worker(a, 40)
    assert code == 0 and "resumed from step 20" in out and "forked from" in out, out
    lineage = run_info(a).parent
    assert lineage.step == 20 and lineage.digest == final_digest(parent) and lineage.run_name == "parent"
    rows = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][0] == 21 and rows[-1]["step"] == 40
    from training.examples.char_gpt import warmup_cosine

    assert rows[0]["metrics"]["lr"] == 0.001 * warmup_cosine(5, 40)(20)  # the child's lr and schedule at step 20

    _, b = child("child-b")
    p = start_worker(b, 40, {"CONVOY_FAULTS": "step_delay=0.1"})  # ~2 s to 40: the kill lands mid-way
    assert wait_for_step(b, p, 25) is not None
    kill_group(p)
    p.wait()
    code, out = run_worker(b, 40)
    assert code == 0 and "resumed from step" in out, out
    assert final_digest(b) == final_digest(a) != final_digest(parent)
    assert checkpoint_digests(parent) == parent_files, "the parent's checkpoints changed"

    # `--from` the child itself (runs/<name> links to it once it trained) with the same params
    # resumes that child instead of forking a grandchild.
    from training.rundir import child_config

    assert child_config(cfg.model_copy(update={"init_from": None}), str(a)).init_from == cfg.init_from

    # The CLI refuses a parent checkpoint already at total_steps (the child would train nothing).
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(json.loads((parent / "config.json").read_text())))
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli.main", "train", str(params), "--from", str(parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "already at train.total_steps = 20" in proc.stderr, proc.stderr

    tracked = cfg.model_copy(
        update={"tracking": cfg.tracking.model_copy(update={"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})}
    )
    tags = client_for(tracked.tracking.mlflow_uri).get_run(ensure_mlflow_run(tracked, a)).data.tags
    assert tags["convoy.parent_run"] == "parent" and tags["convoy.parent_step"] == "20"
    assert tags["convoy.parent_digest"] == lineage.digest


def _dvc_exp_run_twice_gives_two_experiments_with_their_own_runs(clone: Path, env: dict[str, str]) -> None:
    """lr 0.002 is a run `dvc repro` trained above (reused, not trained again); 0.001 is new."""
    for lr in ("0.002", "0.001"):
        run(clone, env, sys.executable, "-m", "dvc", "exp", "run", "-S", f"train.lr={lr}")
    shown = json.loads(run(clone, env, sys.executable, "-m", "dvc", "exp", "show", "--json"))
    exps = [e for rev in shown for e in (rev.get("experiments") or [])]
    losses = {}  # the digest is identity, not a metric: it is in reports/train-info.json
    for exp in exps:
        data = exp["revs"][0]["data"]
        lr = data["params"]["params.yaml"]["data"]["train"]["lr"]
        losses[lr] = data["metrics"]["metrics/train.json"]["data"]["final_loss"]
    assert set(losses) == {0.002, 0.001} and len(set(losses.values())) == 2
    for lr, loss in losses.items():
        cfg = load_config(clone / "params.yaml", [f"train.lr={lr}"])
        run_dir = clone / "runs" / keyed_config(cfg).run_name
        assert CheckpointStore(run_dir).latest_valid(record=False).step == cfg.train.total_steps
        assert metric_rows(run_dir)[-1][1]["loss"] == loss  # each experiment's metrics from its own run
        assert json.loads((run_dir / "config.json").read_text())["train"]["lr"] == lr
