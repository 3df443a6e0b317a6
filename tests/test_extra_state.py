"""State of the task's own and convoy's EMA of the weights (issue 44, item 3): saved, hashed,
restored bitwise after kills, evaluated in the loop, and registrable in MLflow as the model."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from tests.engine_util import killed_run_matches, make_run, run_worker
from training.checkpointing.store import CheckpointStore
from training.rundir import load_run_config

TOTAL = 60
EXTRA = [
    "task=tests.extra_tasks:build",
    "train.ema_decay=0.9",
    "train.ema_registered=ema",
    "train.eval_every=20",
    "train.eval_samples=32",
]

pytestmark = pytest.mark.slow


def _extra(run_dir: Path) -> dict:
    loaded = CheckpointStore(run_dir).load_latest()
    assert loaded is not None
    return loaded[1]["state"]


def _metric(run_dir: Path, name: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["metrics"][name] for r in rows if name in r["metrics"]}


def test_ema_and_a_task_state_resume_bitwise_after_two_kills_and_the_ema_is_registered(tmp_path: Path) -> None:
    ref = make_run(tmp_path, "reference", EXTRA)
    code, out = run_worker(ref, TOTAL)
    assert code == 0, out
    run = killed_run_matches(tmp_path, EXTRA, ref, TOTAL, [17, 38], seed=4403)
    assert sorted(_metric(run, "val_loss_ema")) == [20, 40, 60]
    assert _metric(run, "val_loss_ema") == _metric(ref, "val_loss_ema") != _metric(ref, "val_loss")
    mine, theirs = _extra(run), _extra(ref)
    assert mine["extra"]["curriculum"]["steps"] == TOTAL and torch.equal(
        mine["extra"]["curriculum"]["mean"], theirs["extra"]["curriculum"]["mean"]
    )
    ema = mine["extra"]["ema"]
    assert ema["updates"] == TOTAL and ema["weights"].keys() == mine["model"].keys()
    assert all(torch.equal(ema["weights"][k], theirs["extra"]["ema"]["weights"][k]) for k in ema["weights"])
    assert not torch.equal(ema["weights"]["head.weight"], mine["model"]["head.weight"])
    _registered_model_is_the_ema(tmp_path, run, ema["weights"])


def _registered_model_is_the_ema(tmp_path: Path, run: Path, weights: dict[str, torch.Tensor]) -> None:
    """Real MLflow (a SQLite store): the run's final model logged and registered; its file loads
    strictly into the plain model class and holds the EMA's weights."""
    import mlflow
    from mlflow import MlflowClient

    from tasks.records.mlflow_model import global_tracking_uri, log_final_model
    from training.evaluate import load_model_file
    from training.examples.char_gpt import CharGPT, CharGPTArgs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("ema", artifact_location=(tmp_path / "mlartifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    cfg = load_run_config(run)
    with contextlib.chdir(tmp_path):  # whatever MLflow writes by default lands here, not in the checkout
        out = log_final_model(cfg, run, client, run_id)
        assert out is not None and out["registered"] == "killed version 1", out
        # A models:/ URI is resolved through MLflow's *global* tracking URI (its tracking_uri
        # argument is not used there): set it to this store meanwhile, as convoy does.
        with global_tracking_uri(uri):
            where = mlflow.artifacts.download_artifacts(f"models:/{out['model_id']}", dst_path=str(tmp_path / "dl"))
    tensors, meta = load_model_file(Path(where) / "model.safetensors")
    assert meta["weights"] == "ema"
    model = CharGPT(CharGPTArgs(**cfg.task_args), cfg.data.seq_len)
    model.load_state_dict(tensors)  # strict: the plain class's every name and shape
    assert all(torch.equal(tensors[k], weights[k]) for k in weights)
