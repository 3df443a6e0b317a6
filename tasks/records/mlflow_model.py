"""The finished run's model in MLflow: a logged model and a version of the registered model.

What is logged (``tracking.log_model``): the model tensors of the final verified checkpoint as
``model.safetensors`` (the DVC stage's export, :func:`training.evaluate.export_final_model`:
step, digest and fingerprint in its metadata), the run's resolved ``config.json`` and
``convoy-model.json`` (format, task, how to load it).  No MLflow flavour: ``mlflow.pytorch``
pickles the module, and loading a pickle runs code from the file, which convoy never does
(invariant 7).  safetensors loads without executing anything: build the task from
``config.json`` and ``load_state_dict`` the tensors (:func:`training.evaluate.load_model_file`).

The registered model (``tracking.register_model``) is named after the run without its
fingerprint (``demo`` for ``demo@3be1596c``): each trajectory trained under one name is a
version of it, tagged with its fingerprint and digest.

Idempotent: a run whose MLflow run already holds a model of the final digest logs nothing (a
finished run trained again trains nothing and logs nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from training.config import RunConfig

#: Tags on the training run's MLflow run naming its logged model.
MODEL_ID_TAG, MODEL_DIGEST_TAG = "convoy.model_id", "convoy.digest"


@contextlib.contextmanager
def global_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow 3.17's SQL model registry looks a ``models:/<id>`` source up through the *global*
    tracking URI, not the client's (a TODO in its ``create_model_version``): set it meanwhile."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    # Restore exactly what was there: ``set_tracking_uri`` also writes $MLFLOW_TRACKING_URI, and
    # putting back ``get_tracking_uri()`` (the resolved default, ``<cwd>/mlflow.db``, when none was
    # set) would leave that in the environment of the flow process for every later run.
    saved_global, saved_env = getattr(utils, "_tracking_uri", None), os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved_global)
        if saved_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved_env


def registered_name(config: RunConfig) -> str:
    """``demo@3be1596c`` → ``demo``: one registered model per run name."""
    return config.run_name.partition("@")[0]


def _write_model_dir(config: RunConfig, run_dir: Path, out: Path) -> dict[str, Any]:
    from training.evaluate import export_final_model

    ema = config.train.ema_decay is not None and config.train.ema_registered == "ema"
    export = export_final_model(run_dir, out / "model.safetensors", weights="ema" if ema else "model")
    (out / "config.json").write_text(json.dumps(config.model_dump(mode="json"), indent=1, sort_keys=True))
    how = {
        "format": "convoy-model-1 (safetensors, nothing pickled)",
        "task": config.task,
        "step": export["step"],
        "digest": export["digest"],
        "fingerprint": export["fingerprint"],
        "weights": "the EMA of the trained weights (train.ema_decay)" if ema else "the trained weights",
        "load": "parts = training.task.build_task(config_from_dict(config.json), device); "
        "parts.model.load_state_dict(training.evaluate.load_model_file('model.safetensors')[0])",
    }
    (out / "convoy-model.json").write_text(json.dumps(how, indent=1))
    return export


def log_final_model(config: RunConfig, run_dir: Path, client: Any, run_id: str) -> dict[str, Any] | None:
    """Log the final checkpoint's model as a logged model of ``run_id`` and register it; None
    when it is already logged or switched off."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.exceptions import MlflowException

    if not config.tracking.log_model:
        return None
    run = client.get_run(run_id)
    with tempfile.TemporaryDirectory() as tmp:
        export = _write_model_dir(config, run_dir, Path(tmp))
        if run.data.tags.get(MODEL_DIGEST_TAG) == export["digest"]:
            return None
        params = {"step": str(export["step"]), "parameters": str(export["parameters"])}
        tags = {"convoy.digest": export["digest"], "convoy.fingerprint": export["fingerprint"]}
        tags["convoy.weights"] = export["weights"]  # "ema": the average of the trained weights
        model = client.create_logged_model(
            run.info.experiment_id,
            name=registered_name(config),
            source_run_id=run_id,
            params=params,
            tags=tags,
            model_type="convoy-safetensors",
        )
        client.log_model_artifacts(model.model_id, tmp)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, export["step"])])
    log_model_metrics(client, run_id, model.model_id, config, run_dir)
    client.set_tag(run_id, MODEL_ID_TAG, model.model_id)
    client.set_tag(run_id, MODEL_DIGEST_TAG, export["digest"])
    out = {"model_id": model.model_id, "digest": export["digest"], "step": export["step"]}
    if config.tracking.register_model:
        name = registered_name(config)
        try:
            client.create_registered_model(name, description=f"convoy run {name}: one version per trained config")
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        with global_tracking_uri(client.tracking_uri):
            version = client.create_model_version(
                name, source=f"models:/{model.model_id}", run_id=run_id, tags=tags, model_id=model.model_id
            )
        link_version(client, model.model_id, name, str(version.version))
        out["registered"] = f"{name} version {version.version}"
    return out


#: The run's metrics a model page shows: the last value of each, at its step.
MODEL_METRICS = ("loss", "val_loss", "val_loss_ema")


def log_model_metrics(client: Any, run_id: str, model_id: str, config: RunConfig, run_dir: Path) -> None:
    """The model's own metrics (its page listed "Metrics (0)"): the last ``loss`` and
    ``val_loss`` the run logged, linked to the model and to the corpus dataset it was trained
    and evaluated on (MLflow 3 keys a model's metrics by dataset), at their steps.  Each carries
    the time the worker logged it, as the shipper's point does: in the run's history it is that
    same point, not a second one at the step."""
    from mlflow.entities import Metric

    from tasks.records.mlflow_runs import corpus_dataset
    from training.paths import RunPaths
    from training.tracking.metrics import read_journal

    last: dict[str, tuple[int, float, int]] = {}
    rows, _ = read_journal(RunPaths(run_dir).metrics)
    for row in rows:
        for key in MODEL_METRICS:
            if key in row.metrics and row.time_ms is not None:
                last[key] = (row.step, float(row.metrics[key]), row.time_ms)
    dataset = corpus_dataset(config)
    name, digest = (dataset.name, dataset.digest) if dataset is not None else (None, None)
    metrics = [
        Metric(key, value, at, step, model_id=model_id, dataset_name=name, dataset_digest=digest)
        for key, (step, value, at) in sorted(last.items())
    ]
    if metrics:
        client.log_batch(run_id, metrics=metrics, synchronous=True)


def link_version(client: Any, model_id: str, name: str, version: str) -> None:
    """Tag the logged model with its registered version (``mlflow.modelVersions``), which the
    MLflow UI reads to show "Registered" on the model's page and the experiment's Models list.
    An MLflow server adds it when it creates the version; a client over a SQLite file does not
    (only ``mlflow.register_model`` does it, client-side), so every store gets it here, once."""
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    links = json.loads(client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS) or "[]")
    if any(link.get("name") == name and str(link.get("version")) == version for link in links):
        return  # a server wrote it (its version an int, the client's a string: the same link)
    links.append({"name": name, "version": version})
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(links)})
