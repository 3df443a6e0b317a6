"""Creating the MLflow run of a training run (the flow does it once; chunk tasks ship into it).

:func:`ensure_mlflow_run` creates the run once (name = run_name, ``convoy.*`` tags, params logged
once) and stores its id and URI in ``run.json``; later calls, from any process or attempt, reuse
it (or the id a checkpoint manifest carries, after a pull).  Kept out of the engine: a worker
never talks to MLflow; its ``metrics.jsonl`` is shipped into the run named in ``run.json``
(:class:`tasks.records.metric_shipping.MetricShipper`).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks.records.mlflow_client import TAG_PREFIX, client_for, resolve_tracking_uri
from training.config import RunConfig
from training.paths import RunPaths
from training.run_identity import RunInfo
from training.rundir import run_info, update_run_info

MAX_BATCH_PARAMS = 100


def default_artifact_location(uri: str, experiment: str) -> str | None:
    """Artifacts of a SQLite store go next to the database (``<db dir>/mlartifacts/<experiment>``).

    MLflow's own default is ``./mlruns`` of whatever directory the *creating* process ran in;
    tying it to the database keeps a run's artifacts with its metrics.  Servers decide themselves.
    """
    prefix = "sqlite:///"
    if uri.startswith(prefix) and ":memory:" not in uri:
        db = Path(uri[len(prefix) :])
        return (db.parent / "mlartifacts" / experiment).resolve().as_uri()
    return None


#: The experiment's description (MLflow shows ``mlflow.note.content`` on the experiment's page):
#: what a reader finds in it, since convoy's runs have a shape of their own.
EXPERIMENT_NOTE = (
    "Training runs by convoy (fault-tolerant, exactly resumable training). Each top-level run is one "
    "training run: its loss, the resume audit (tags `convoy.resumes`, `convoy.failures`, "
    "`convoy.steps_lost`; artifacts `convoy/timeline.png`, `convoy/resume_events.json`), its goodput and "
    "its model. Its child runs are the attempts of its chunks, named by outcome first: `killed 151→125 "
    "c2·a2` failed at step 151 and the next attempt resumed from step 125; `done→200 c2·a3` committed "
    "the chunk. Each description links the Prefect flow run and task run."
)


def ensure_experiment(client: MlflowClient, name: str, uri: str = "") -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        if "mlflow.note.content" not in exp.tags:  # made by an older convoy or by hand: described once
            client.set_experiment_tag(exp.experiment_id, "mlflow.note.content", EXPERIMENT_NOTE)
        return exp.experiment_id
    try:
        return client.create_experiment(
            name,
            artifact_location=default_artifact_location(uri, name),
            tags={"mlflow.note.content": EXPERIMENT_NOTE, "convoy.kind": "training runs"},
        )
    except MlflowException:  # created concurrently by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def flatten_params(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested config dict → ``{"train.lr": "0.003", ...}`` (MLflow params are flat strings);
    unset (None) values are left out: "None" is no setting anyone compares."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(flatten_params(v, key))
            elif v is not None:
                out[key] = str(v)[:6000]
    elif data is not None:
        out[prefix or "value"] = str(data)[:6000]
    return out


def run_params(config: RunConfig) -> dict[str, str]:
    """The params of the MLflow run: what defines the run, i.e. its trajectory settings (what the
    fingerprint hashes: task, task_args, data, optimisation).  Chunking, limits, tracking and
    launch settings are how it is run, not what it is, and may change between flow runs."""
    return flatten_params(config.trajectory())


def created_by() -> dict[str, str]:
    """``mlflow.user``, which MLflow's "Created by" shows (the fluent ``start_run`` sets it; a
    client's ``create_run`` does not): the user the flow runs as."""
    import getpass

    try:
        return {"mlflow.user": getpass.getuser()}
    except (KeyError, OSError):  # no user name for this uid (a container): leave it unset
        return {}


@functools.cache
def git_tags(cwd: Path | None = None) -> dict[str, str]:
    """MLflow's source tags for the code in ``cwd`` (the project the run is trained from):
    commit, branch, origin URL; ``convoy.git_dirty`` when tracked files had changes.  Outside a
    git work tree only the source's type and name (what MLflow's Source column shows)."""
    import subprocess

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    source = {"mlflow.source.type": "LOCAL", "mlflow.source.name": "convoy train"}  # MLflow's Source column
    commit = git("rev-parse", "HEAD")
    if not commit:
        return source
    tags = {
        "mlflow.source.git.commit": commit,
        "mlflow.source.git.branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "mlflow.source.git.repoURL": git("config", "--get", "remote.origin.url"),
        "mlflow.source.type": "LOCAL",
        "mlflow.source.name": "convoy train",
        "convoy.git_dirty": "true" if git("status", "--porcelain", "--untracked-files=no") else None,
    }
    return {k: v for k, v in tags.items() if v}


def corpus_dataset(config: RunConfig) -> Any | None:
    """The prepared corpus as an MLflow ``Dataset``: its path, a digest of its bytes and a profile
    (bytes, validation fraction, sequence length, entropy floor); None when it is not on this
    machine.  Named after the corpus, not the run (``corpus-synthetic``, ``corpus-<file stem>``):
    MLflow keys a dataset by name and digest, so every run on one corpus shares one dataset."""
    import hashlib

    from mlflow.entities import Dataset

    from training.datapipe.corpus import CORPUS_FILE, entropy_floor

    path = Path(config.data.prepared_dir) / CORPUS_FILE
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    profile = {
        "bytes": len(raw),
        "source": config.data.source,
        "val_fraction": config.data.val_fraction,
        "seq_len": config.data.seq_len,
        "entropy_floor_nats_per_char": entropy_floor(config.data, config.task),
    }
    named = Path(config.data.path).stem if config.data.source == "file" and config.data.path else config.data.source
    return Dataset(
        name=f"corpus-{named}",
        digest=hashlib.sha256(raw).hexdigest()[:16],
        source_type="local",
        source=json.dumps({"uri": path.resolve().as_uri()}),
        profile=json.dumps(profile),
    )


def log_corpus_input(client: MlflowClient, run_id: str, config: RunConfig) -> bool:
    """The prepared corpus (:func:`corpus_dataset`) as the run's training dataset input
    (``mlflow.log_input``'s record).  False when the corpus is not on this machine."""
    from mlflow.entities import DatasetInput, InputTag

    dataset = corpus_dataset(config)
    if dataset is None:
        return False
    client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "training")])])
    return True


def set_run_tags(config: RunConfig, run_dir: str | Path, tags: dict[str, str]) -> None:
    """Set tags on the training run's MLflow run."""
    from mlflow.entities import RunTag

    uri = resolve_tracking_uri(config, run_dir)
    run_id = ensure_mlflow_run(config, run_dir)
    client_for(uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()], synchronous=True)


def _run_exists(client: MlflowClient, run_id: str) -> bool:
    """Whether the store knows ``run_id``.  Only the store's "no such run" says no: a store that
    cannot be reached raises.  (Taking an outage for "not there" created a second MLflow run for
    one training run when the server came back between the two calls: tests/test_hermetic.py.)"""
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    if run.info.lifecycle_stage == "deleted":
        client.restore_run(run_id)
    return True


def run_id_from_checkpoints(run_dir: str | Path) -> str | None:
    """The MLflow run id recorded in the newest checkpoint manifest that has one (``mlflow_run_id``).

    On another machine the checkpoints arrive (``convoy pull``) without ``run.json``; the id in the
    manifest keeps every resume logging into the same MLflow run."""
    root = RunPaths(run_dir).checkpoints
    if not root.is_dir():
        return None
    for path in sorted(root.glob("step-*/manifest.json"), reverse=True):
        try:
            run_id = json.loads(path.read_text()).get("mlflow_run_id")
        except (OSError, ValueError):
            continue
        if run_id:
            return str(run_id)
    return None


def lineage_tags(parent: dict[str, Any] | None) -> dict[str, str]:
    """``convoy.parent_*`` tags of a run forked from another (``--from``): the parent's run,
    step, digest, MLflow run id (the link to it) and DVC hash."""
    if not parent:
        return {}
    keys = {
        "run_name": "parent_run",
        "step": "parent_step",
        "digest": "parent_digest",
        "mlflow_run_id": "parent_mlflow_run_id",
        "dvc_md5": "parent_dvc_md5",
    }
    return {f"{TAG_PREFIX}{tag}": str(parent[key]) for key, tag in keys.items() if parent.get(key) is not None}


def ensure_mlflow_run(config: RunConfig, run_dir: str | Path | None = None) -> str:
    """The MLflow run id of this training run, creating the run (and recording it) if needed.

    Idempotent: the id stored in ``run.json`` is reused when it exists in the tracking store.  A
    stored id the store does not know (another tracking URI, a deleted database) gets a fresh
    run and a warning — the training run itself is unaffected.
    """
    run_dir = Path(run_dir) if run_dir is not None else config.run_dir
    uri = resolve_tracking_uri(config, run_dir)
    client = client_for(uri)
    info = run_info(run_dir) or RunInfo()
    run_id = info.mlflow_run_id or run_id_from_checkpoints(run_dir)
    ui = config.tracking.mlflow_ui_url or None
    if run_id and (info.mlflow_tracking_uri or uri) == uri and _run_exists(client, run_id):
        if (info.mlflow_run_id, info.mlflow_tracking_uri, info.mlflow_ui) != (run_id, uri, ui):
            update_run_info(run_dir, mlflow_run_id=run_id, mlflow_tracking_uri=uri, mlflow_ui=ui)
        return run_id
    if run_id:
        print(
            f"WARNING: MLflow run {run_id} of {run_dir} is not in {uri}; creating a new MLflow run",
            file=sys.stderr,
            flush=True,
        )
    exp_id = ensure_experiment(client, config.tracking.experiment, uri)
    tags = {
        "mlflow.runName": config.run_name,
        f"{TAG_PREFIX}run_name": config.run_name,
        f"{TAG_PREFIX}fingerprint": config.fingerprint(),
        f"{TAG_PREFIX}run_dir": str(run_dir.resolve()),
        f"{TAG_PREFIX}task": config.task,
        f"{TAG_PREFIX}total_steps": str(config.train.total_steps),
        f"{TAG_PREFIX}resumes": "0",
        f"{TAG_PREFIX}failures": "0",
        f"{TAG_PREFIX}steps_lost": "0",
        **lineage_tags(info.parent.to_json() if info.parent else None),
        **git_tags(),
        **created_by(),
    }
    run = client.create_run(exp_id, run_name=config.run_name, tags=tags)
    run_id = run.info.run_id
    params = [Param(k, v) for k, v in sorted(run_params(config).items())]
    for i in range(0, len(params), MAX_BATCH_PARAMS):
        client.log_batch(run_id, params=params[i : i + MAX_BATCH_PARAMS], synchronous=True)
    try:
        log_corpus_input(client, run_id, config)
    except MlflowException as exc:  # the input is a record, not a reason to stop
        print(f"WARNING: could not log the corpus as the run's dataset input: {exc}", file=sys.stderr, flush=True)
    update_run_info(run_dir, mlflow_run_id=run_id, mlflow_tracking_uri=uri, mlflow_experiment_id=exp_id, mlflow_ui=ui)
    return run_id
