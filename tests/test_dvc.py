"""DVC: checkpoint versioning (dvc add + push, concurrent with training), restore on a "fresh
machine" (local checkpoints and cache deleted, pulled back) and resume to the same final digest;
the pipeline in dvc.yaml (a real ``dvc repro`` in a temporary clone, when the CLI exists).

Real git + DVC repositories and a local directory remote in a tmp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.dvc_util import GITIGNORE, ROOT, dvc_repo, git
from tests.engine_util import final_digest, kill_group, make_run, run_worker, start_worker
from training.checkpointing.store import CheckpointStore
from training.evaluate import export_final_model, load_model_file, write_loss_plot
from training.events import read_events


@pytest.mark.slow
def test_version_pull_resume_same_digest(tmp_path: Path) -> None:
    from tasks.remote.dvc_pull import checkpoint_dvcfiles, pull_run
    from tasks.remote.dvc_version import version_checkpoint, version_checkpoint_async
    from training import run_memory

    repo = dvc_repo(tmp_path / "repo")
    remote = tmp_path / "remote"
    run_dir = make_run(repo, "run")  # keep_last=2: the next chunk retires step 30
    code, out = run_worker(run_dir, 30)
    assert code == 0, out
    ck30 = run_dir / "checkpoints" / "step-000000030"

    # Version step 30 while the next chunk trains (a background thread, as the flow does), and
    # retire step 30 (as retention does) while DVC is still working on it.
    p = start_worker(run_dir, 60)
    future = version_checkpoint_async(repo, ck30, str(remote))
    stage = run_dir / "checkpoints" / ".stage-step-000000030"
    while not stage.exists() and not future.future.done():
        time.sleep(0.005)
    assert stage.exists(), "versioning finished before the retire could race it"
    shutil.rmtree(ck30)
    result = future.future.result(timeout=120)
    p_out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, p_out
    digest_b = final_digest(run_dir)
    assert result.step == 30 and result.files_pushed >= 1 and result.dvc_md5.endswith(".dir")
    assert (run_dir / "checkpoints" / "step-000000030.dvc").exists()
    assert any(remote.rglob("*")), "nothing arrived in the DVC remote"
    assert "step-000000030.dvc" in git(repo, "status", "--porcelain", "-uall")  # not git-ignored: committable
    assert (run_dir / "checkpoints" / ".gitignore").read_text() == "/step-000000030\n"
    assert not stage.exists() and not list((run_dir / "checkpoints").glob(".stage-*"))
    # Content-addressed: versioning an unchanged checkpoint again sends nothing.
    ck60 = run_dir / "checkpoints" / "step-000000060"
    first60 = version_checkpoint(repo, ck60, str(remote))
    again = version_checkpoint(repo, ck60, str(remote))
    assert first60.files_pushed >= 1 and again.files_pushed == 0 and again.dvc_md5 == first60.dvc_md5
    assert [e["checkpoint"] for e in read_events(run_dir, "checkpoint_versioned")] == [
        "step-000000030",
        "step-000000060",
        "step-000000060",
    ]
    (run_dir / "checkpoints" / "step-000000060.dvc").unlink()  # "the other machine" pulls step 30 only

    # "Another machine": no local checkpoints, no DVC cache.  Pull, verify, resume.
    for path in (run_dir / "checkpoints").iterdir():
        if path.is_dir():
            shutil.rmtree(path)
    (run_dir / "checkpoints" / "LATEST").unlink(missing_ok=True)
    shutil.rmtree(repo / ".dvc" / "cache")
    run_memory.remove(run_dir)  # another machine's RAM holds nothing of this run either
    assert CheckpointStore(run_dir).latest_valid(record=False) is None
    assert [p.name for p in checkpoint_dvcfiles(run_dir)] == ["step-000000030.dvc"]
    pulled = pull_run(repo, run_dir, remote=str(remote))
    assert [(c.checkpoint, c.digest) for c in pulled.checkpoints] == [("step-000000030", result.digest)]
    code, out = run_worker(run_dir, 60)
    assert code == 0, out
    assert "resumed from step 30" in out
    assert final_digest(run_dir) == digest_b

    # The exported model is the newest checkpoint's model, deterministic bytes.
    m1, m2 = tmp_path / "m1.safetensors", tmp_path / "m2.safetensors"
    info = export_final_model(run_dir, m1)
    export_final_model(run_dir, m2)
    assert info["step"] == 60 and info["digest"] == digest_b
    assert m1.read_bytes() == m2.read_bytes()
    tensors, meta = load_model_file(m1)
    assert meta["digest"] == digest_b and "tok.weight" in tensors and "head.weight" in tensors
    assert write_loss_plot(run_dir, tmp_path / "loss.csv") == 60


def test_version_refuses_invalid_and_unknown_remote(tmp_path: Path) -> None:
    from tasks.remote.dvc_pull import pull_run
    from tasks.remote.dvc_version import VersioningError, version_checkpoint

    repo = dvc_repo(tmp_path / "repo")
    run_dir = repo / "runs" / "r"
    bad = run_dir / "checkpoints" / "step-000000010"
    bad.mkdir(parents=True)
    (bad / "state.safetensors").write_bytes(b"garbage")
    with pytest.raises(VersioningError, match="does not verify"):
        version_checkpoint(repo, bad, str(tmp_path / "remote"))
    with pytest.raises(VersioningError, match="not a checkpoint directory"):
        version_checkpoint(repo, run_dir, str(tmp_path / "remote"))
    with pytest.raises(VersioningError, match="nothing was versioned"):
        pull_run(repo, run_dir)


def test_dvc_yaml_stages_read_params() -> None:
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    stages = spec["stages"]
    assert list(stages) == ["prepare", "train", "evaluate"]
    assert "convoy train" in stages["train"]["cmd"] and "convoy prepare" in stages["prepare"]["cmd"]
    train_outs = [o if isinstance(o, str) else next(iter(o)) for o in stages["train"]["outs"]]
    assert train_outs == ["models/model.safetensors", "reports/train-info.json"]
    assert not any(str(o).startswith("runs") for o in train_outs), "runs/ must stay outside outs (resume)"
    assert "train" in stages["train"]["params"] and "data" in stages["prepare"]["params"]
    assert [next(iter(m)) for m in stages["train"]["metrics"]] == ["metrics/train.json"]
    assert [next(iter(m)) for m in stages["train"]["plots"]] == ["plots/loss.csv", "plots/timeline.png"]
    assert [next(iter(p)) for p in spec["plots"]] == ["train_vs_val", "learning rate", "gradient norm"]
    assert "models/model.safetensors" in stages["evaluate"]["deps"]


SMALL_PARAMS = {
    "task_args": {"n_layer": 1, "n_head": 2, "d_model": 32, "dropout": 0.1},
    "data": {"synthetic_chars": 60000, "seq_len": 32},
    "train": {"total_steps": 60, "chunk_steps": 30, "batch_size": 8, "warmup_steps": 5},
    "checkpoint": {"every_steps": 10},
    "heartbeat": {"interval_s": 0.2},
}


@pytest.mark.slow
def test_dvc_repro_in_a_clone(tmp_path: Path, prefect_api: str) -> None:
    """Fresh clone: an interrupted `dvc repro` resumes rather than restarts when repeated (the run
    dir is not an output); it produces model, metrics, plots; then `dvc repro` has nothing to do."""
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(ROOT), str(clone))
    for name in ("dvc.yaml", "params.yaml"):  # the working tree's versions (may be uncommitted)
        shutil.copy(ROOT / name, clone / name)
    if not (clone / ".dvc").is_dir():
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=clone, check=True)
    params = yaml.safe_load((clone / "params.yaml").read_text())
    for section, values in SMALL_PARAMS.items():
        params.setdefault(section, {}).update(values)
    remote = tmp_path / "remote"
    params.setdefault("tracking", {}).update(
        mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", dvc=True, dvc_remote=str(remote)
    )
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # Git must not ignore checkpoints/step-N.dvc (DVC refuses to write an ignored .dvc file).
    ignore = [ln for ln in (clone / ".gitignore").read_text().splitlines() if ln.strip() not in ("runs/", "runs")]
    (clone / ".gitignore").write_text("\n".join([*ignore, *GITIGNORE.splitlines()[:4]]) + "\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def repro() -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "dvc", "repro"], cwd=clone, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        return proc.stdout

    # Interrupt the first `dvc repro` once chunk 1 is committed and versioned (kill its process group).
    run_dir = clone / params.get("runs_dir", "runs") / params.get("run_name", "demo")
    first = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro"],
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not (run_dir / "checkpoints" / "step-000000030.dvc").exists():
            assert first.poll() is None, first.communicate()[0][-4000:]
            assert time.time() < deadline, "chunk 1 never committed and versioned"
            time.sleep(0.2)
    finally:
        kill_group(first)
        first.wait()
    _clear_torn_rwlock(clone)
    out = repro()  # resumes: chunk 1 is not trained again
    assert "Running stage 'train'" in out and "Running stage 'evaluate'" in out
    events = read_events(run_dir)
    assert len([e for e in events if e["kind"] == "started"]) == 1, "training restarted from step 0"
    flows = [e for e in events if e["kind"] == "flow_started"]
    assert len(flows) == 2 and flows[1]["committed_step"] >= 30
    metrics = json.loads((clone / "metrics" / "train.json").read_text())
    assert metrics["final_step"] == 60 and metrics["logged_steps"] == 60
    assert all(isinstance(v, int | float) for v in metrics.values()), metrics  # numbers only
    assert json.loads((clone / "reports" / "train-info.json").read_text())["digest"] == final_digest(run_dir)
    assert (clone / "models" / "model.safetensors").exists()
    assert json.loads((clone / "metrics" / "eval.json").read_text())["val_loss"] > 0
    assert (clone / "plots" / "loss.csv").read_text().count("\n") == 61
    assert (clone / "plots" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "Data and pipelines are up to date" in repro()

    # Another machine: no checkpoints, no DVC cache; `convoy pull` brings back what the .dvc files
    # name (chunk 2's is dropped), and `convoy train` still ends on the final state: the remote's
    # index names step 60, which it fetches by itself (invariant 10).
    from tasks.remote.dvc_pull import checkpoint_dvcfiles

    assert {"step-000000030.dvc", "step-000000060.dvc"} <= {p.name for p in checkpoint_dvcfiles(run_dir)}
    digest = final_digest(run_dir)
    for path in (run_dir / "checkpoints").iterdir():
        if path.is_dir():
            shutil.rmtree(path)
    (run_dir / "checkpoints" / "LATEST").unlink(missing_ok=True)
    (run_dir / "checkpoints" / "step-000000060.dvc").unlink()
    shutil.rmtree(clone / ".dvc" / "cache")
    for cmd in (["convoy", "pull", str(run_dir)], ["convoy", "train"]):
        proc = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert read_events(run_dir, "checkpoint_fetched")[-1]["step"] == 60
    assert final_digest(run_dir) == digest


def _clear_torn_rwlock(clone: Path) -> None:
    """What docs/dvc.md tells a user to do when the kill landed in DVC's in-place rewrite of its
    lock file (an empty ``.dvc/tmp/rwlock``: the next ``dvc repro`` refuses to read it)."""
    lock = clone / ".dvc" / "tmp" / "rwlock"
    try:
        json.loads(lock.read_text())
    except FileNotFoundError:
        return
    except ValueError:
        print(f"\nthe kill tore {lock} ({lock.stat().st_size} bytes): removed, as docs/dvc.md says")
        lock.unlink()
